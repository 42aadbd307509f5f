"""Every collective's first step (ranks agree on what they are doing), and ``hvd.join``.

Horovod lets a rank that ran out of data call ``join()`` while the others go on: its tensors count
as zeros in their allreduces until every rank has joined. Here each collective on the job's global
process set starts with a one-number sum in which a joined rank counts 1; while it is 0 (nobody
joined) the collective goes on, and where it also needs every rank's arguments (allreduce checks
shapes) the ranks exchange descriptions of their calls. A joined rank waits inside ``join()``
taking part in those exchanges, and mirrors each allreduce with zeros of the shapes the others
describe (the collectives and the optimizer register how, with :func:`register_mirror`). It
waits on both of the global set's communicators at once: the tensor collectives' one on the
background thread, the main thread's one (``DistributedOptimizer`` steps, barriers) in ``join()``.
"""
from __future__ import annotations

import socket
import time
from typing import Callable, Optional

import torch

from torchmn.communicators import CollectiveMismatchError
from torchmn.horovod import background
from torchmn.horovod.errors import HorovodInternalError, raises_horovods_errors
from torchmn.horovod.process_sets import global_process_set, job, require_comm

# kind -> function(description, comm) that takes part in that collective with zeros
_mirrors: dict[str, Callable] = {}
_after_join: list[Callable] = []
JOINED = "join"


def register_mirror(kind: str, mirror: Callable) -> None:
    """Say how a joined rank takes part in the collectives of one kind.

    Args:
        kind: the kind the collective's description names (its first field).
        mirror: ``mirror(description, comm)``: runs this rank's part of the collective another
            rank described, with zeros for this rank's tensors.

    Example::

        >>> register_mirror("allreduce", mirror_allreduce)
    """
    _mirrors[kind] = mirror


def register_after_join(callback: Callable) -> None:
    """Say what every rank does as ``join()`` ends, once all have joined.

    Args:
        callback: called with no arguments, on every rank, before ``join()`` returns.

    Example::

        >>> register_after_join(restart_step_counts)
    """
    _after_join.append(callback)


def describe_call(kind: str, *fields) -> tuple:
    """A call's description, as the ranks exchange it to check that they make the same call.

    Args:
        kind: the collective (:data:`JOINED` for a rank inside ``join()``).
        fields: what the ranks of this kind must agree on.

    Returns:
        ``(kind, host, *fields)``.

    Example::

        >>> describe_call("allgather", "features", ((4, 3), "float32"), None)
    """
    return (kind, socket.gethostname()) + fields


def agree(comm, description: tuple, need_descriptions: bool) -> Optional[list[tuple]]:
    """The first step of a collective: learn whether a rank has joined, and if needed what each does.

    Args:
        comm: the communicator the collective runs on.
        description: this rank's call, from :func:`describe`.
        need_descriptions: exchange every rank's description even when nobody has joined.

    Returns:
        Every rank's description, or None when nobody joined and they were not needed.

    Raises:
        HorovodInternalError: a rank has joined and this collective cannot run with zeros for it.

    Example::

        >>> descriptions = agree(comm, describe_call("allgather", name, layout, None), need_descriptions=True)
    """
    if comm.size == 1:
        return [description] if need_descriptions else None
    if comm is job.comm or comm is global_process_set.tensor_comm:
        flag = torch.zeros(1, dtype=torch.int64)  # on the CPU: no wait for the GPU
        if description[0] == JOINED:
            flag += 1
        comm.allreduce_flat(flag)
        someone_joined = int(flag.item()) > 0
    else:
        someone_joined = False  # join() covers the global process set only
    if not (someone_joined or need_descriptions):
        return None
    descriptions = comm.allgather_obj(description)
    joined = [r for r, d in enumerate(descriptions) if d[0] == JOINED]
    if joined and description[0] != JOINED:
        kinds = {d[0] for d in descriptions if d[0] != JOINED}
        if not kinds <= set(_mirrors):
            raise HorovodInternalError(
                f"hvd.{description[0]} on rank {comm.rank} ({socket.gethostname()}) while rank(s) {joined} have "
                f"called hvd.join(): a joined rank takes part only in allreduces (its tensors count as zeros) and "
                f"in DistributedOptimizer steps. Call this collective before join(), on every rank")
    return descriptions


def check_same_kind(descriptions: list[tuple], rank: int) -> None:
    """Raise on every rank alike unless the ranks that have not joined make the same kind of call,
    under the same name where every one of them names it.

    Horovod pairs named collectives by name, whatever order the ranks start them in; here each
    rank's collectives run in the order it starts them, so two ranks starting ``"a"`` and ``"b"``
    in opposite orders would reduce ``"a"`` with ``"b"`` (same shapes: wrong numbers, no error).

    Args:
        descriptions: every rank's description, from :func:`agree`; a tensor collective's
            ``(kind, host, name, ...)``.
        rank: this rank, for the message.

    Raises:
        CollectiveMismatchError: two ranks called different collectives, or gave them different names.

    Example::

        >>> check_same_kind(agree(comm, describe_call("broadcast", "w", 0), need_descriptions=True), comm.rank)
    """
    calls = [(r, d) for r, d in enumerate(descriptions) if d[0] != JOINED]
    if len({d[0] for _, d in calls}) > 1:
        listing = ", ".join(f"rank {r} ({d[1]}) hvd.{d[0]}" for r, d in calls)
        raise CollectiveMismatchError(f"the ranks called different collectives at the same point: {listing}; "
                                      f"rank {rank} stops. Every rank must make the same calls in the same order")
    names = [d[2] for _, d in calls]
    if None not in names and len(set(names)) > 1:
        listing = ", ".join(f"rank {r} ({d[1]}) {d[2]!r}" for r, d in calls)
        raise CollectiveMismatchError(
            f"hvd.{calls[0][1][0]}: the ranks started collectives of different names at the same point: {listing}; "
            f"rank {rank} stops. Horovod pairs named collectives by name; torchmn.horovod runs each rank's in the "
            f"order it starts them: start them in the same order on every rank (over sorted(names), say)")


@raises_horovods_errors
def join(device: int = -1) -> int:
    """This rank has no more data: take part in the others' allreduces with zeros until all have joined.

    Blocks until every rank of the job has called ``join()``. Meanwhile the other ranks'
    allreduces (``hvd.allreduce``, ``grouped_allreduce`` and ``DistributedOptimizer`` steps) count
    this rank's tensors as zeros; an ``Average`` still divides by the job's size.

    Args:
        device: accepted for Horovod's signature (the device of the joined rank's zeros is the
            communicator's).

    Returns:
        The rank that joined last.

    Raises:
        InvalidCallError: before ``hvd.init()``.
        HorovodInternalError: another rank stepped a ``DistributedOptimizer`` this rank does not have.

    Example::

        >>> for batch in my_uneven_shard:
        ...     train_step(batch)
        >>> hvd.join()
    """
    comm = require_comm()
    if comm.size == 1:
        return comm.rank
    started = time.monotonic()
    tensor_comm = global_process_set.tensor_comm
    tensor_side = background.start(tensor_comm, lambda: _wait_joined(tensor_comm))
    _wait_joined(comm)
    tensor_side.wait()
    # Every rank leaves the wait at the same moment, so the rank that joined last waited least: each
    # measures its own wait on its own clock (hosts' clocks need not agree).
    waits = comm.allgather_obj(time.monotonic() - started)
    for callback in _after_join:
        callback()
    return min(range(len(waits)), key=lambda r: (waits[r], -r))


def _wait_joined(comm) -> None:
    """Take part, as a joined rank, in the collectives of ``comm`` until every rank has joined."""
    while True:
        descriptions = agree(comm, describe_call(JOINED), need_descriptions=True)
        waiting = [(r, d) for r, d in enumerate(descriptions) if d[0] != JOINED]
        if not waiting:
            return
        kinds = {d[0] for _, d in waiting}
        kind = next(iter(kinds))
        if len(kinds) == 1 and kind in _mirrors:
            _mirrors[kind](waiting[0][1], comm)
        # Otherwise the others raise (agree() saw this rank joined), as under Horovod, and this rank
        # goes on waiting for them: their next call is join() or another collective.
