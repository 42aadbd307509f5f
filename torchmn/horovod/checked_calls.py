"""What the tensor collectives share about a call: the layout the ranks exchange to check it,
agreeing on it (so that a rank's bad arguments raise on every rank), the error naming what the
ranks' calls differ in, and, for a collective that completes before it returns, its timeline entry
and its handle (ready at once).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from torchmn.communicators import CollectiveMismatchError
from torchmn.horovod import coordination, handles, timeline
from torchmn.horovod.errors import InvalidCallError


def layout(t: torch.Tensor) -> tuple:
    """The layout of a tensor, as the ranks exchange it to check their calls.

    Args:
        t: the tensor.

    Returns:
        ``(shape, dtype name)`` of ``t``, e.g. ``((2, 3), "float32")``.

    Example::

        >>> layout(torch.zeros(2, 3))
        ((2, 3), 'float32')
    """
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


def agree_on(comm, kind: str, what: str, fields: tuple, problem: Optional[str]) -> list[tuple]:
    """Exchange every rank's call; raise on every rank alike if one rank's own arguments were bad.

    Args:
        comm: the communicator.
        kind: the collective.
        what: the call, for messages.
        fields: what the ranks must agree on (after the kind and host).
        problem: what is wrong with this rank's own arguments, or None.

    Returns:
        Every rank's description, ``(kind, host, *fields, problem)``.

    Raises:
        InvalidCallError: a rank rejected its own arguments.
        CollectiveMismatchError: the ranks called different collectives.
        HorovodInternalError: a rank has joined.

    Example::

        >>> descriptions = agree_on(comm, "broadcast", "hvd.broadcast", (name, root_rank, layout(tensor)), None)
        >>> roots = [d[3] for d in descriptions]     # every rank's root_rank, in rank order
    """
    descriptions = coordination.agree(comm, coordination.describe_call(kind, *fields, problem), need_descriptions=True)
    coordination.check_same_kind(descriptions, comm.rank)
    for r, d in enumerate(descriptions):
        if d[-1] is not None:
            raise InvalidCallError(f"{what}: rank {r} ({d[1]}) rejected its arguments: {d[-1]}; "
                                   f"rank {comm.rank} stops too")
    return descriptions


def mismatch(what: str, field: str, values: list, rank: int, fix: str) -> CollectiveMismatchError:
    """The error for ranks whose calls differ in one field.

    Args:
        what: the call, for the message.
        field: what differs, in words.
        values: every rank's value of it, in rank order.
        rank: this rank.
        fix: what the ranks must do instead.

    Returns:
        The error (to raise) naming each rank's value and the ``fix``.

    Example::

        >>> print(mismatch("hvd.broadcast", "root ranks", [0, 1], 0, "Name one root_rank"))
        hvd.broadcast: the ranks' root ranks differ: rank 0: 0; rank 1: 1. Name one root_rank; rank 0 stops
    """
    listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return CollectiveMismatchError(f"{what}: the ranks' {field} differ: {listing}. {fix}; rank {rank} stops")


def completed_handle(kind: str, name: Optional[str], result, nbytes: int, start: float, process_set) -> int:
    """The handle of a collective that has run already (and recorded itself in the timeline).

    Args:
        kind: the collective.
        name: its name, or None.
        result: what the handle's ``synchronize`` returns.
        nbytes: the bytes it moved.
        start: when it began (``time.time()``).
        process_set: the ranks it ran on.

    Returns:
        The handle, complete at once.

    Example::

        >>> handle = completed_handle("allgather", name, out, out.numel() * out.element_size(), start, process_set)
        >>> hvd.synchronize(handle) is out
        True
    """
    return handles.submit(kind, name, None, lambda: result, nbytes, process_set.process_set_id, start,
                          in_timeline=False)


def record_finished(kind: str, name: Optional[str], tensor, start: float, process_set) -> None:
    """Add a collective that began at ``start`` and has just ended to the timeline.

    Args:
        kind: the collective.
        name: its name, or None (``<kind>.noname`` in the timeline).
        tensor: its input (for the bytes; anything else counts 0).
        start: when it began (``time.time()``).
        process_set: the ranks it ran on.

    Example::

        >>> start = time.time()
        >>> out = comm.bcast(tensor, root=0)
        >>> record_finished("broadcast", name, tensor, start, process_set)
    """
    nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
    timeline.record(kind, name or f"{kind}.noname", nbytes, start, time.time(),
                    getattr(process_set, "process_set_id", 0))
