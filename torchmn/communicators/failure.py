"""An uncaught exception on one rank ends the whole job promptly, with its traceback shown once.

Left alone, the other ranks, waiting for the failed one in a collective, learn of it only once its
process is gone (its connections close, its pid dies), which with torch loaded takes a second or
more of interpreter teardown; each then waits out the grace period meant for slow ranks, prints a
traceback that says nothing about the cause, and passes the news on to the ranks waiting for it
when it exits in turn. Under a launcher that does not stop the job when one task fails (``srun``
without ``--kill-on-bad-exit``, ranks started by hand), that adds up to many seconds.

So :func:`torchmn.create_communicator` installs an exception hook (:func:`install`) that, on the
rank whose exception nobody caught:

1. prints the traceback, through the hook it replaced (torch's, which prefixes ``[rankN]:``);
2. records which rank failed, on which host, with which error, in the job's rendezvous store
   (the first failure wins: a second one only prints its own traceback);
3. *breaks off*: marks its shared-memory flags failed, and closes its gloo connections: it
   finalizes its communicators and drops their process groups (a group's connections close with
   the last reference to it), then destroys every group. The ranks waiting for it raise now, not
   when its process is gone.

A rank whose collective failed that way finds the record (``watch.py`` asks :func:`recorded`) and
raises :class:`RankFailedError` naming the failed rank, without the grace period. Left uncaught,
that error (or any lost-peer error while another rank's failure is recorded: an optimizer's
shared-memory barrier, a plain torch.distributed call) prints one line instead of a traceback and
breaks off in turn: the ranks waiting for this one learn it the same way, in hops of milliseconds.
A rank that reads the record counts itself as informed.
Under torchmn run, torchrun and Open MPI's mpirun it then waits a moment for the failed rank to
exit first: those launchers name the first rank to exit with an error as the job's cause, and stop
the others meanwhile. Where rank 0 hosts the store (Slurm, MPI), it stays until the others have
read the record, for a few seconds at most, also where it caught the error and ends normally.

Only the gloo backend breaks off: destroying an NCCL group with work in flight can hang. The handle
of an asynchronous collective that the script still holds keeps its group's connections open until
the process ends (the ranks waiting for this one then learn it a second or so later, when it exits).
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import os
import socket
import sys
import time
import traceback
import weakref
from typing import Optional

import torch.distributed as dist

from torchmn.communicators import _group_utility
from torchmn.communicators.shm import segment
from torchmn.communicators.errors import PeerLostError, RankFailedError, lost_peer
from torchmn.environments import detect_environment

RECORD_KEY = "torchmn/failure/first"
_COUNT_KEY = "torchmn/failure/count"
_INFORMED_KEY = "torchmn/failure/informed"  # how many other ranks have read the record
# How long a rank stopped by another's failure waits for that rank to exit first: on the same host
# until its process is gone, at most this long (a loaded machine takes seconds to tear down an
# interpreter with torch loaded); from another host, whose processes it cannot see, this long.
SAME_HOST_WAIT_S = 10.0
OTHER_HOST_WAIT_S = 1.0
# How long rank 0, where it hosts the job's store (Slurm, MPI, tcp://), stays for the others to
# read the record once its failure, or the failure it learned of, has been handled.
STORE_HOST_WAIT_S = 5.0
# The launchers (detect_environment().source) that stop the job when a rank fails and name the
# first rank to exit with an error as its cause.
NAME_THE_FIRST_EXIT = ("torchmn", "torchrun", "openmpi")

_previous = None  # the hook this one replaced, which prints tracebacks
_communicators: "weakref.WeakSet" = weakref.WeakSet()  # this process's communicators (track, release_groups)
_store = None  # kept once used: a rank that hosts the store must serve the record after breaking off
_informed_of: Optional[tuple] = None  # (this rank, world size) once this rank has read another's failure
_served = False  # this process has waited for the others to read the record


@dataclasses.dataclass
class Failure:
    """Which rank ended with an uncaught exception: ``rank`` (in the job), ``host``, ``pid`` and
    ``error`` (the exception's last line, as a traceback ends)."""

    rank: int
    host: str
    pid: int
    error: str

    def __str__(self) -> str:
        """The failure in words, as the other ranks' :class:`RankFailedError` messages name it.

        Returns:
            Which rank ended, on which host, with which error, and where its traceback is.

        Example::

            >>> str(Failure(rank=1, host="node1", pid=4242, error="ValueError: boom"))
            "rank 1 (node1) ended with an uncaught ValueError: boom (its traceback is in that rank's output)"
        """
        return self.describe()

    def describe(self, of_the_job: bool = False) -> str:
        """The failure in words; ``of_the_job``: say that the rank is the job's (where the message
        is about a communicator that numbers its ranks otherwise).

        Args:
            of_the_job: name the rank as ``rank N of the job``.

        Returns:
            As ``str()``.

        Example::

            >>> Failure(rank=1, host="node1", pid=4242, error="ValueError: boom").describe(of_the_job=True)[:30]
            'rank 1 of the job (node1) ende'
        """
        return (f"rank {self.rank}{' of the job' if of_the_job else ''} ({self.host}) ended with an uncaught "
                f"{self.error} (its traceback is in that rank's output)")


def install() -> None:
    """Install the hook that ends the job promptly when this rank's exception goes uncaught.

    Called by :func:`torchmn.create_communicator` for a world of more than one rank; installing
    again does nothing. The hook does its part only while a process group is up, for exceptions
    (not KeyboardInterrupt, which every rank gets alike) and outside an interactive session (where
    the interpreter calls it for every error); otherwise it only prints, as the hook it replaced does.

    Example::

        >>> failure.install()            # create_communicator() does this
        >>> raise ValueError("boom")     # the other ranks raise RankFailedError at once
    """
    global _previous
    if _previous is not None:
        return  # also when torch's hook now wraps ours (a world set up again after finalize)
    _previous = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_serve_at_exit)


def track(comm) -> None:
    """Remember a communicator, so that this rank can let go of its process groups when it ends with
    an uncaught exception (:func:`release_groups`). Every communicator calls it as it is made.

    Args:
        comm: the communicator (held weakly: tracking keeps nothing alive).

    Example::

        >>> failure.track(self)     # in Communicator.__init__
    """
    _communicators.add(comm)


def release_groups() -> None:
    """Finalize every communicator of this process and drop its references to its process groups.

    For a rank that is ending with an error: a gloo group's connections close only when the last
    reference to it goes, and a communicator holds its groups for as long as the script holds it,
    so destroying the groups alone would leave the ranks waiting for this one until its process
    is gone.

    Example::

        >>> release_groups()
        >>> comm.allreduce(x)    # RuntimeError: ... a communicator that was finalized
    """
    for comm in list(_communicators):
        comm.drop_process_groups()
    _group_utility.drop_idle()  # finalized communicators' groups, kept for a later split


def recorded() -> Optional[Failure]:
    """The job's first failure recorded by a rank's hook, if any.

    A rank that finds another rank's failure counts itself, once, among those informed of it: rank 0,
    where it hosts the store, stays for them before it exits (also when it caught the error).

    Returns:
        The :class:`Failure`, or None when none is recorded, no process group is up, or the store
        cannot be reached (it may have gone with the rank that hosted it).

    Example::

        >>> failure.recorded()           # after rank 1 raised ValueError("boom") uncaught
        Failure(rank=1, host='node1', pid=4242, error='ValueError: boom')
    """
    try:
        store = _store or dist.distributed_c10d._get_default_store()
        if not store.check([RECORD_KEY]):
            return None
        failed = Failure(**json.loads(store.get(RECORD_KEY).decode()))
    except Exception:  # noqa: BLE001 (no world, a store gone, a foreign value: nothing is known)
        return None
    _store_call(lambda store: _count_informed(store, failed))  # what was read stands if counting fails
    return failed


def stopped_by(failure: Failure, what: str, me: str, of_the_job: bool = False) -> RankFailedError:
    """The error for a rank whose call failed because ``failure``'s rank broke off.

    Args:
        failure: what :func:`recorded` found.
        what: the call, as the message names it ("allreduce (collective #8 of this communicator)").
        me: this rank, as the message names it ("rank 0 (host1)").
        of_the_job: the call's communicator numbers its ranks otherwise than the job: the failed
            rank is named as the job's.

    Returns:
        A :class:`RankFailedError`, to raise from what the call raised (which says only that a peer
        went away).

    Example::

        >>> raise failure.stopped_by(failure.recorded(), "allreduce", "rank 0 (node0)") from error
    """
    return RankFailedError(f"{what} stopped on {me}: {failure.describe(of_the_job)}; nothing went wrong on this "
                           f"rank", failure=failure)


def _excepthook(exc_type, exc, tb) -> None:
    if not (issubclass(exc_type, Exception) and dist.is_initialized() and dist.get_world_size() > 1) \
            or hasattr(sys, "ps1") or sys.flags.interactive:
        _previous(exc_type, exc, tb)
        return
    rank, size, raised = dist.get_rank(), dist.get_world_size(), exc
    cause = _another_ranks_failure(exc)
    if cause is None:  # this rank's own failure
        _previous(exc_type, exc, tb)
        sys.stderr.flush()
        _record(exc)
    else:
        # The cause is another rank's, whose traceback is in its own output: one line here.
        if not isinstance(exc, RankFailedError):  # raised where watch.py does not look (an arena barrier)
            what = "a shared-memory wait" if isinstance(exc, PeerLostError) else "a torch.distributed call"
            exc = stopped_by(cause, what, f"rank {rank} ({socket.gethostname()})")
        sys.stderr.write(f"[rank{rank}]: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        _store_call(lambda store: _count_informed(store, cause))
    _break_off(raised)
    if _hosts_the_store(rank):
        _serve_the_record(size)  # the others still read the record
    if cause is not None:
        _let_it_exit_first(cause)


def _another_ranks_failure(exc: BaseException) -> Optional[Failure]:
    """The recorded failure of another rank that ``exc`` (a lost peer) comes from, if any."""
    if isinstance(exc, RankFailedError) and exc.failure is not None:
        return exc.failure
    if not (isinstance(exc, PeerLostError) or lost_peer(exc)):
        return None
    failed = recorded()
    return failed if failed is not None and failed.rank != dist.get_rank() else None


def _record(exc: BaseException) -> None:
    error = traceback.format_exception_only(type(exc), exc)[-1].strip()
    failure = Failure(rank=dist.get_rank(), host=socket.gethostname(), pid=os.getpid(), error=error[:1000])

    def first_failure_wins(store) -> None:
        if store.add(_COUNT_KEY, 1) == 1:
            store.set(RECORD_KEY, json.dumps(dataclasses.asdict(failure)))
    _store_call(first_failure_wins)


def _store_call(call) -> Optional[object]:
    """``call(store)`` on the job's store, kept for after the process group is gone; None when the
    store cannot be reached (the others then name the lost peer as they did without the record)."""
    global _store
    try:
        _store = _store or dist.distributed_c10d._get_default_store()
        return call(_store)
    except Exception:  # noqa: BLE001 (no world, or the store went with the rank that hosted it)
        return None


def _count_informed(store, failed: Failure) -> None:
    """Count this rank, once, among the ranks that have read ``failed`` (not the failed rank itself).
    Called through :func:`_store_call`, which keeps the store for rank 0 to serve the record at exit."""
    global _informed_of
    if _informed_of is not None or failed.rank == dist.get_rank():
        return
    _informed_of = (dist.get_rank(), dist.get_world_size())
    store.add(_INFORMED_KEY, 1)


def _hosts_the_store(rank: int) -> bool:
    """Whether this process hosts the job's store: rank 0, unless a launcher's agent hosts it."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _serve_at_exit() -> None:
    """At a normal exit of rank 0 that caught another rank's failure: serve the record first."""
    if _informed_of is not None and not _served and _hosts_the_store(_informed_of[0]):
        _serve_the_record(_informed_of[1])


def _serve_the_record(size: int) -> None:
    """Keep this process, and the store it hosts, until every other rank has read the record (each
    counts itself as it reads it), at most STORE_HOST_WAIT_S: a rank still computing learns later."""
    global _served
    _served = True
    deadline = time.monotonic() + STORE_HOST_WAIT_S
    while time.monotonic() < deadline:
        informed = _store_call(lambda store: store.add(_INFORMED_KEY, 0))
        if informed is None or informed >= size - 1:
            return
        time.sleep(0.02)


def _break_off(exc: BaseException) -> None:
    """Make the ranks waiting for this one raise now: shared-memory flags, then connections."""
    segment.mark_failed()
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    _store_call(lambda store: None)  # kept: destroying the groups drops their reference to it
    # A gloo group's connections close when the last reference to it (or to one of its collectives'
    # handles) goes: the communicators' and those in the frames the exception went through.
    release_groups()
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    try:
        dist.destroy_process_group()  # every group torch knows of
    except Exception:  # noqa: BLE001 (already failing: the connections close at exit anyway)
        pass
    # Groups, and handles of their collectives (finished ones too), held in reference cycles: a
    # full collection (about 0.1 s: torch's own objects are frozen out of it, see torch_loaded.py).
    # A young one is not enough: a handle in an old cycle keeps its group's connections open, and
    # the peers waiting in it, until this process ends.
    gc.collect()


def leave_world(exc: Optional[BaseException] = None) -> None:
    """Break off from this process's world and go on: what a rank whose exception goes uncaught does
    before it ends, for a rank of an elastic job that moves to a new world (:mod:`torchmn.elastic`).
    The ranks waiting for this one raise now; this process's communicators are finalized and
    ``torch.distributed`` is torn down, ready to be set up again.

    Args:
        exc: the error that broke the world, if any: the frames it went through are cleared, as
            they may hold the old groups' handles (which keep connections open).

    Example::

        >>> leave_world(error)
        >>> dist.is_initialized()
        False
    """
    global _store, _informed_of, _served
    _break_off(exc)
    if dist.is_initialized():  # NCCL, which _break_off leaves alone
        dist.destroy_process_group()
    _store, _informed_of, _served = None, None, False  # the new world has a store of its own


def _let_it_exit_first(failure: Failure) -> None:
    try:
        source = detect_environment().source
    except (ValueError, RuntimeError):
        return
    if source not in NAME_THE_FIRST_EXIT:
        return  # srun, or ranks started by hand: nobody names a culprit by the order of exits
    if failure.host != socket.gethostname():
        time.sleep(OTHER_HOST_WAIT_S)
        return
    deadline = time.monotonic() + SAME_HOST_WAIT_S
    while time.monotonic() < deadline and segment.alive(failure.pid):
        time.sleep(0.02)
