"""Handles of torchmn.horovod's asynchronous collectives: ``synchronize`` and ``poll``.

A collective runs on the background thread (:mod:`~torchmn.horovod.background`) from its
``*_async`` call on, start to end, in the order the script started it; its handle polls False
until it has run, and ``synchronize`` waits for it and returns its output (or raises its error).
A name given to a collective is in flight until that collective has run: another collective of
the same name is refused meanwhile, as Horovod refuses it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from torchmn.horovod import background, timeline
from torchmn.horovod.errors import InvalidCallError, raises_horovods_errors


class _Pending:
    """One collective started: its background job, and what the timeline records of it."""

    def __init__(self, kind: str, name: str, job: background.Job, nbytes: int, process_set_id: int,
                 in_timeline: bool = True):
        self.kind, self.name, self.job, self.in_timeline = kind, name, job, in_timeline
        self.nbytes, self.process_set_id = nbytes, process_set_id
        self.start = time.time()

    def complete(self) -> Any:
        result = self.job.wait()
        if self.in_timeline:
            timeline.record(self.kind, self.name, self.nbytes, self.start, self.job.finished, self.process_set_id)
        return result


_pending: dict[int, _Pending] = {}
_next_handle = [1]


def name_in_flight(name: Optional[str], kind: Optional[str] = None, process_set_id: Optional[int] = None) -> bool:
    """Whether a collective given this name has been started and has not run yet.

    Horovod keys a name by its kind of collective and its process set: an allreduce and an
    allgather may both be named ``"loss"``, as may allreduces on two process sets.

    Args:
        name: a collective's ``name=`` (None: never in flight, as unnamed collectives never clash).
        kind: only collectives of this kind (None: any).
        process_set_id: only collectives on this process set (None: any).

    Returns:
        True while such a collective waits for the other ranks or runs.

    Example::

        >>> h = hvd.allreduce_async(x, name="loss")
        >>> name_in_flight("loss", "allreduce")          # True until it has run
    """
    return name is not None and any(
        p.name == name and kind in (None, p.kind) and process_set_id in (None, p.process_set_id)
        and not p.job.done.is_set() for p in _pending.values())


def check_name(kind: str, name: Optional[str], process_set_id: int = 0) -> None:
    """Refuse a collective whose name another collective of its kind, on its process set, has in
    flight, as Horovod does.

    Args:
        kind: the collective.
        name: its ``name=``.
        process_set_id: the set it runs on.

    Raises:
        InvalidCallError: another such collective of this ``name`` is still in flight (Horovod's message).

    Example::

        >>> check_name("allgather", "features")
    """
    if name_in_flight(name, kind, process_set_id):
        raise InvalidCallError(f"Requested to {kind} a tensor with the same name as another tensor that is currently "
                         f"being processed ({name!r}). If you want to request another tensor, use a different "
                         f"tensor name.")


def _as_started(work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` to run on another thread as if it ran here: in this thread's grad and inference
    modes (thread-local in torch), after the GPU work queued so far on this thread's stream."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    queued = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        queued = torch.cuda.Event()
        queued.record()

    def run():
        if queued is not None:
            queued.wait()
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return work()
    return run


def submit(kind: str, name: Optional[str], comm, work: Callable[[], Any], nbytes: int, process_set_id: int = 0,
           in_timeline: bool = True) -> int:
    """Start a collective on its communicator's background thread and give it a handle.

    Args:
        kind: the collective (``"allreduce"``, ...).
        name: its ``name=`` (None: named ``<kind>.noname.<handle>`` in the timeline).
        comm: the tensor communicator it runs on (one background thread each).
        work: the collective start to end, run on the background thread (in this thread's grad
            and inference modes); returns what ``synchronize`` returns.
        nbytes: the bytes it carries, for the timeline.
        process_set_id: the set it runs on, for the timeline.
        in_timeline: add it to the timeline when it is synchronized (False for one that records
            itself).

    Returns:
        The handle, for :func:`synchronize` and :func:`poll`.

    Raises:
        InvalidCallError: another collective of this ``name`` is still in flight (Horovod's message).

    Example::

        >>> handle = submit("allgather", None, comm, lambda: torch.cat(comm.allgather(x)), x.numel() * x.element_size())
    """
    check_name(kind, name, process_set_id)
    handle = _next_handle[0]
    _next_handle[0] += 1
    _pending[handle] = _Pending(kind, name or f"{kind}.noname.{handle}", background.start(comm, _as_started(work)),
                                nbytes, process_set_id, in_timeline)
    return handle


@raises_horovods_errors
def run_now(kind: str, name: Optional[str], comm, work: Callable[[], Any], nbytes: int,
            process_set_id: int = 0) -> Any:
    """Run a blocking collective and return its output: :func:`submit` then :func:`synchronize`,
    but on the calling thread when no collective of ``comm`` waits before it.

    Args:
        kind, name, comm, work, nbytes, process_set_id: as :func:`submit`.

    Returns:
        What ``work`` returns.

    Raises:
        InvalidCallError: another collective of this ``name`` is still in flight (Horovod's message).
        Exception: the collective's own error.

    Example::

        >>> parts = run_now("allgather", None, comm, lambda: comm.allgather(x), x.numel() * x.element_size())
    """
    check_name(kind, name, process_set_id)
    start = time.time()
    result = background.run_here(comm, _as_started(work))
    timeline.record(kind, name or f"{kind}.noname", nbytes, start, time.time(), process_set_id)
    return result


@raises_horovods_errors
def synchronize(handle) -> Any:
    """Wait for an asynchronous collective and return its output.

    Args:
        handle: what an ``*_async`` call returned (or the callable ``sparse_allreduce_async``
            returned).

    Returns:
        The collective's output (for in-place forms, the tensor passed in); None for a handle
        synchronized already, as Horovod returns.

    Raises:
        InvalidCallError: ``handle`` was never returned by an ``*_async`` call.
        Exception: the collective's own error (mismatched shapes, a timeout naming the ranks that
            never came, ...).

    Example::

        >>> h = hvd.allreduce_async(x)
        >>> y = hvd.synchronize(h)
    """
    if callable(handle):
        return handle()
    if handle in _pending:
        return _pending.pop(handle).complete()
    if isinstance(handle, int) and 0 < handle < _next_handle[0]:
        return None  # synchronized already: Horovod returns None, and scripts rely on it
    raise InvalidCallError(f"synchronize: {handle!r} is not a handle an *_async call returned")


def poll(handle) -> bool:
    """Whether an asynchronous collective has run, without waiting for it.

    Args:
        handle: what an ``*_async`` call returned.

    Returns:
        True once :func:`synchronize` will return at once.

    Raises:
        InvalidCallError: ``handle`` is unknown or was synchronized already.

    Example::

        >>> h = hvd.allreduce_async(x)
        >>> while not hvd.poll(h):
        ...     do_other_work()
    """
    if handle not in _pending:
        raise InvalidCallError(f"poll: handle {handle!r} is not a collective in flight (synchronized already, or not "
                         f"returned by an *_async call)")
    return _pending[handle].job.done.is_set()


def drain() -> None:
    """Wait until every collective started has run (``hvd.shutdown`` calls this); their results
    stay for ``synchronize``.

    Example::

        >>> h = hvd.allreduce_async(x)
        >>> drain()
        >>> hvd.poll(h)                     # True
    """
    for p in list(_pending.values()):
        p.job.done.wait()


def forget() -> None:
    """Drop every handle and every result not yet fetched (``hvd.shutdown`` calls this after
    :func:`drain`).

    Example::

        >>> drain(); forget()
    """
    _pending.clear()
