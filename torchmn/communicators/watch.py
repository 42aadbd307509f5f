"""Naming the ranks that did not join a collective that timed out.

torch.distributed's own timeout names nobody ("Timed out waiting 600000ms for recv operation").
When a collective of a communicator fails that way, each rank that gave up writes "I was in
collective #N, an allreduce" into the job's rendezvous store, gives the others a moment to do the
same, and raises :class:`CollectiveTimeoutError` naming the ranks that never arrived and, where
the store knows, what they were doing instead. Collectives are numbered per communicator, so #N
is the same call on every rank that runs the same program.

Shared-memory collectives inside a node name their missing peers themselves
(:class:`~torchmn.communicators.errors.PeerLostError`).

Every collective of a communicator is decorated with :func:`collective`, every point-to-point call
with :func:`point_to_point`; an algorithm that overrides one decorates its override alike (a call
made inside another watched call is part of it, and is not numbered again). The same decorators
time each call for the monitor and the timeline (:mod:`torchmn.monitor.recorder`), when recording.

A peer lost because its rank ended with an uncaught exception, which its exception hook recorded
(see :mod:`torchmn.communicators.failure`), is named at once, with its error, as
:class:`~torchmn.communicators.errors.RankFailedError`: there is nobody to wait for.
"""
from __future__ import annotations

import functools
import inspect
import os
import time
from typing import Callable, Optional

import torch.distributed as dist

from torchmn.communicators import failure
from torchmn.communicators.errors import CollectiveTimeoutError, PeerLostError, lost_peer
from torchmn.elastic import protocol
from torchmn.errors import TorchmnRuntimeError
from torchmn.monitor import recorder

GRACE_S = 3.0  # how long a rank that timed out waits for the others to report where they are


class CallLog:
    """What the watcher keeps per communicator: its tag, how many collectives it has made, whether
    one is running (a collective made inside another is part of it, not numbered), the ranks'
    hosts once known, and whether the communicator was finalized.

    Args:
        tag: tells this communicator's calls apart from other communicators' in the store.
    """

    def __init__(self, tag: str):
        self.tag = tag
        self.calls = 0
        self.depth = 0
        self.hosts: Optional[list] = None
        self.closed = False


def _refuse_if_finalized(comm, kind: str) -> None:
    if comm.call_log.closed:
        raise TorchmnRuntimeError(f"rank {comm.rank}: {kind} on a communicator that was finalized (its process "
                                  f"group and shared memory are gone); create a new one with "
                                  f"torchmn.create_communicator() instead")


def point_to_point(peer_arg: str) -> Callable[[Callable], Callable]:
    """Decorate a communicator's point-to-point method: not numbered (only two ranks take part),
    but a lost peer is named in the error, with its host, and a finalized communicator refuses.

    Args:
        peer_arg: the name of the method's argument that is the other rank (``"dest"``, ``"source"``).

    Returns:
        The decorator.

    Example::

        >>> @watch.point_to_point("dest")
        ... def send(self, x, dest, tag=0): ...
    """
    return functools.partial(_watched_p2p, peer_arg)


def collective(fn: Callable) -> Callable:
    """Decorate a communicator's collective: each call gets the next number of its communicator, a
    finalized communicator refuses, and a collective that loses a peer raises an error naming the
    ranks that never joined it (or the rank whose failure stopped it), here or in ``wait()``.

    Args:
        fn: the method; its name is the collective's, in messages.

    Returns:
        The watched method (``.watched`` is True).

    Example::

        >>> @watch.collective
        ... def allreduce(self, x, op="sum"): ...
    """
    return _watched(fn.__name__, fn)


def _watched_p2p(peer_arg: str, fn: Callable) -> Callable:
    kind = fn.__name__
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(comm, *args, **kwargs):
        if comm.call_log.depth:  # part of a collective (gather_obj, scatter_obj), which names the missing
            return fn(comm, *args, **kwargs)
        _refuse_if_finalized(comm, kind)
        t0 = recorder.begin() if recorder.on else None
        try:
            return fn(comm, *args, **kwargs)
        except RuntimeError as e:
            if not lost_peer(e):
                raise
            peer = signature.bind(comm, *args, **kwargs).arguments[peer_arg]
            other = "send" if kind.startswith("recv") else "recv"
            direction = "from" if kind.startswith("recv") else "to"
            failed = failure.recorded()
            if failed is not None:
                raise failure.stopped_by(failed, f"{kind} {direction} rank {peer}", name_rank(comm, comm.rank),
                                         of_the_job=not _numbered_as_the_job(comm)) from e
            raise CollectiveTimeoutError(
                f"{kind} {direction} {name_rank(comm, peer) if isinstance(peer, int) else f'rank {peer}'} "
                f"failed on {name_rank(comm, comm.rank)}: rank {peer} did not make the matching "
                f"{other}{'_obj' if kind.endswith('_obj') else ''} with the same tag within the timeout, or "
                f"exited. (torch.distributed said: {e})") from e
        finally:
            if t0 is not None:
                recorder.end(kind, "collective", t0, {"communicator": comm.call_log.tag})
    call.watched = True
    return call


def _watched(kind: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(comm, *args, **kwargs):
        log = comm.call_log
        if log.depth:  # part of another collective of this communicator: not numbered
            return fn(comm, *args, **kwargs)
        _refuse_if_finalized(comm, kind)
        log.calls += 1
        seq = log.calls
        log.depth += 1
        t0 = recorder.begin() if recorder.on else None
        try:
            result = fn(comm, *args, **kwargs)
        except RuntimeError as e:
            named = _naming_the_ranks(comm, seq, kind, e)
            if named is None:
                raise
            raise named from e
        finally:
            log.depth -= 1
            if t0 is not None:
                recorder.end(kind, "collective", t0, {"communicator": log.tag, "call": seq})
        # Async (torch's handle, or torchmn's own around one): the timeout surfaces in wait().
        if isinstance(result, dist.Work) or getattr(type(result), "wraps_torch_work", False):
            return _WatchedWork(result, comm, seq, kind)
        return result
    call.watched = True
    return call


class _WatchedWork:
    """An async collective's handle whose ``wait()`` names the missing ranks on a timeout."""

    def __init__(self, work, comm, seq: int, kind: str):
        self._work, self._comm, self._seq, self._kind = work, comm, seq, kind

    def wait(self, *args) -> bool:
        try:
            return self._work.wait(*args)
        except RuntimeError as e:
            named = _naming_the_ranks(self._comm, self._seq, self._kind, e)
            if named is None:
                raise
            raise named from e

    def __getattr__(self, name):  # is_completed(), get_future(), ... as torch's handle has them
        return getattr(self._work, name)


def timed_out(comm, seq: int, kind: str, error: BaseException) -> CollectiveTimeoutError:
    """The error to raise on this rank instead of torch's: which ranks did not take part.

    Args:
        comm: the communicator whose collective failed.
        seq: the collective's number on this communicator (the same call on every rank).
        kind: the collective's name.
        error: what torch.distributed raised.

    Returns:
        A :class:`CollectiveTimeoutError` naming the missing ranks and, where the job's store knows,
        what they were doing instead.

    Example::

        >>> try:
        ...     dist.all_reduce(flat, group=comm.process_group)
        ... except RuntimeError as e:           # torch's "Timed out waiting ..." names nobody
        ...     raise watch.timed_out(comm, comm.call_log.calls, "allreduce", e) from e
    """
    head = f"{kind} (collective #{seq} of this communicator) failed on {name_rank(comm, comm.rank)}"
    advice = ("Every rank must call the same collectives in the same order; if one legitimately needs "
              "longer, raise the timeout (TORCHMN_TIMEOUT in seconds, create_communicator(timeout=...), or "
              "init_process_group(timeout=...) where the script sets up torch.distributed itself).")
    try:
        store = dist.distributed_c10d._get_default_store()
        found = _ask_the_store(store, comm, seq, kind)
    except Exception as store_error:  # the store itself may be gone with the rank that hosted it
        return CollectiveTimeoutError(f"{head}: {error}. Which rank is missing could not be found out "
                                      f"({store_error}). {advice}")
    if found is None:
        return CollectiveTimeoutError(f"{head}: {error}; every rank reached it, so one of them left it "
                                      f"or failed inside it: see the other ranks' errors. {advice}")
    return CollectiveTimeoutError(f"{head}: {found}. {advice} (torch.distributed said: {error})")


def _naming_the_ranks(comm, seq: int, kind: str, error: BaseException) -> Optional[BaseException]:
    """The error to raise instead of ``error``, which collective ``seq`` raised, naming what the other
    ranks did; None where ``error`` is not about a lost peer (it is raised as it is)."""
    shm_lost = isinstance(error, PeerLostError)
    if not (shm_lost or lost_peer(error)):
        return None
    failed = failure.recorded()
    if failed is not None:  # a rank ended with an uncaught exception: no grace period to wait out
        return failure.stopped_by(failed, f"{kind} (collective #{seq} of this communicator)",
                                  name_rank(comm, comm.rank), of_the_job=not _numbered_as_the_job(comm))
    if protocol.enabled(os.environ):
        # An elastic job: the launcher knows who is gone and the survivors move on at once (see
        # torchmn.elastic); waiting out the grace period to name them would only delay that.
        return error if shm_lost else PeerLostError(
            f"{kind} (collective #{seq} of this communicator) failed on {name_rank(comm, comm.rank)}: a peer was lost ({str(error).splitlines()[0] if str(error) else error!r})")
    return _diagnosed(comm, seq, kind, error) if shm_lost else timed_out(comm, seq, kind, error)


def _diagnosed(comm, seq: int, kind: str, error: BaseException) -> BaseException:
    """A shared-memory collective that lost a peer: this rank's call goes into the store as well, so
    that ranks waiting in a collective over TCP meanwhile name it rightly instead of saying it never
    came, and what the store knows of the others is added to the message."""
    try:
        # The shared-memory error says how long this rank waited, or that the peer exited.
        found = _ask_the_store(dist.distributed_c10d._get_default_store(), comm, seq, kind, within="")
    except Exception:  # no store, or gone with its host: the shared-memory message stands alone
        return error
    if found is None:
        return error
    return type(error)(f"{error}. Collective #{seq} of this communicator ({kind}) on the other ranks: {found}")


def _host(comm, r: int) -> str:
    hosts = comm.call_log.hosts  # unknown if the very first collective timed out
    return hosts[r] if hosts else "host unknown"


def _numbered_as_the_job(comm) -> bool:
    """Whether ``comm``'s rank r is the job's rank r (not so for most communicators ``split`` made)."""
    try:
        return comm.size == (dist.get_world_size() if dist.is_initialized() else 1) and \
            all(comm.world_rank(r) == r for r in range(comm.size))
    except (RuntimeError, ValueError):  # its groups are gone (finalized): its own numbers only
        return True


def name_rank(comm, r: int, node: Optional[int] = None) -> str:
    """Rank ``r`` of ``comm`` as error messages name it: with its host (and ``node``), and, on a
    communicator that numbers its ranks otherwise than the job (one ``split`` made), its rank in the
    job, which the launcher's output prefixes and summaries show.

    Args:
        comm: the communicator.
        r: a rank of it.
        node: its node's index, where the message is about a node.

    Returns:
        ``"rank 1 (host1)"``, ``"rank 1 (node 0, host1)"`` or ``"rank 1 (rank 2 of the job, host1)"``.

    Example::

        >>> name_rank(half, 1)
        'rank 1 (rank 3 of the job, node1)'
    """
    where = ([] if _numbered_as_the_job(comm) else [f"rank {comm.world_rank(r)} of the job"]) + \
        ([] if node is None else [f"node {node}"]) + [_host(comm, r)]
    return f"rank {r} ({', '.join(where)})"


def _ask_the_store(store, comm, seq: int, kind: str, within: str = "within the timeout"):
    prefix = f"torchmn/watch/{comm.call_log.tag}/"
    store.set(f"{prefix}{seq}/{comm.rank}", kind)
    store.set(f"{prefix}last/{comm.rank}", f"{seq} {kind}")
    keys = [f"{prefix}{seq}/{r}" for r in range(comm.size)]
    deadline = time.monotonic() + GRACE_S
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.1)
    arrived = {r: store.get(keys[r]).decode() for r in range(comm.size) if store.check([keys[r]])}
    if len(arrived) == comm.size and all(k == kind for k in arrived.values()):
        return None
    problems = []
    for r in range(comm.size):
        who = name_rank(comm, r)
        if r in arrived:
            if arrived[r] != kind:
                problems.append(f"{who} called {arrived[r]} instead")
            continue
        last = f"{prefix}last/{r}"
        if store.check([last]):
            s, k = store.get(last).decode().split(" ", 1)
            problems.append(f"{who} timed out waiting in collective #{s} ({k}) instead")
        else:
            problems.append(f"{who} never called it{' ' + within if within else ''} (still computing, waiting in "
                            f"another call, or exited)")
    waiting = sorted(r for r, k in arrived.items() if k == kind)
    numbered = _numbered_as_the_job(comm)
    return "; ".join(problems) + ". Waiting for them: rank(s) " + ", ".join(
        str(r) if numbered else f"{r} (rank {comm.world_rank(r)} of the job)" for r in waiting)
