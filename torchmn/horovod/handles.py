"""Handles of torchmn.horovod's asynchronous collectives: ``synchronize`` and ``poll``.

A collective's network part is in flight from the ``*_async`` call on; what follows it locally (a
division, a copy into the output, a step through the node's shared memory) runs when the handle
completes. Handles complete in the order they were made, on every rank alike: the local part of
an allreduce through shared memory must meet the other ranks of the node in the same order,
whatever order the script synchronizes them in.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

from torchmn.horovod import timeline
from torchmn.horovod.errors import InvalidCallError


class _Pending:
    """One collective in flight: its network work, what finishes it, and what the timeline records."""

    def __init__(self, kind: str, name: str, work, finish: Callable[[], Any], nbytes: int, process_set_id: int,
                 start: Optional[float], in_timeline: bool = True):
        self.kind, self.name, self.work, self.finish, self.in_timeline = kind, name, work, finish, in_timeline
        self.nbytes, self.process_set_id = nbytes, process_set_id
        self.start = time.time() if start is None else start

    def network_done(self) -> bool:
        return work_done(self.work)

    def complete(self) -> Any:
        if self.work is not None:
            self.work.wait()
            self.work = None
        result = self.finish()
        if self.in_timeline:
            timeline.record(self.kind, self.name, self.nbytes, self.start, time.time(), self.process_set_id)
        return result


def work_done(work) -> bool:
    """Whether the network part of a collective has finished, without waiting for it.

    Args:
        work: a communicator's or torch's work handle, an object with ``network_done()``, or None
            (nothing in flight).

    Returns:
        True once ``work.wait()`` would return at once.

    Example::

        >>> work = comm.allreduce_flat(flat, async_op=True)
        >>> work_done(work)
    """
    if work is None:
        return True
    if hasattr(work, "network_done"):
        return work.network_done()
    return work.is_completed() if hasattr(work, "is_completed") else True


_pending: dict[int, _Pending] = {}
_results: dict[int, Any] = {}
_next_handle = [1]


def name_in_flight(name: Optional[str]) -> bool:
    """Whether a collective not yet synchronized was given this name.

    Args:
        name: a collective's ``name=`` (None: never in flight, as unnamed collectives never clash).

    Returns:
        True while a handle of that name is pending.

    Example::

        >>> h = hvd.allreduce_async(x, name="loss")
        >>> name_in_flight("loss")          # True until hvd.synchronize(h)
    """
    return name is not None and any(p.name == name for p in _pending.values())


def check_name(kind: str, name: Optional[str]) -> None:
    """Refuse a collective whose name another collective in flight has, as Horovod does.

    Args:
        kind: the collective, for the message.
        name: its ``name=``.

    Raises:
        InvalidCallError: another collective of this ``name`` is still in flight (Horovod's message).

    Example::

        >>> check_name("allgather", "features")
    """
    if name_in_flight(name):
        raise InvalidCallError(f"Requested to {kind} a tensor with the same name as another tensor that is currently "
                         f"being processed ({name!r}). If you want to request another tensor, use a different "
                         f"tensor name.")


def submit(kind: str, name: Optional[str], work, finish: Callable[[], Any], nbytes: int,
           process_set_id: int = 0, start: Optional[float] = None, in_timeline: bool = True) -> int:
    """Track a collective until it completes, and give it a handle.

    Args:
        kind: the collective (``"allreduce"``, ...).
        name: its ``name=`` (None: named ``<kind>.noname.<handle>`` in the timeline).
        work: its network part in flight, or None where it has run already.
        finish: what completes it locally once ``work`` is done; returns what ``synchronize`` returns.
        nbytes: the bytes it carries, for the timeline.
        process_set_id: the set it runs on, for the timeline.
        start: when it began (default: now).
        in_timeline: add it to the timeline when it completes (False for a collective that ran at
            once and recorded itself).

    Returns:
        The handle, for :func:`synchronize` and :func:`poll`.

    Raises:
        InvalidCallError: another collective of this ``name`` is still in flight (Horovod's message).

    Example::

        >>> work = comm.allreduce_flat(flat, async_op=True)
        >>> handle = submit("allreduce", None, work, lambda: flat, flat.numel() * flat.element_size())
    """
    check_name(kind, name)
    handle = _next_handle[0]
    _next_handle[0] += 1
    _pending[handle] = _Pending(kind, name or f"{kind}.noname.{handle}", work, finish, nbytes,
                                process_set_id, start, in_timeline)
    return handle


def _complete_through(handle: int) -> None:
    """Complete every handle made before ``handle``, then ``handle`` itself, in order."""
    for h in list(_pending):
        if h > handle:
            break
        _results[h] = _pending.pop(h).complete()


def synchronize(handle) -> Any:
    """Wait for an asynchronous collective and return its output.

    Args:
        handle: what an ``*_async`` call returned (or the callable ``sparse_allreduce_async``
            returned).

    Returns:
        The collective's output (for in-place forms, the tensor passed in).

    Raises:
        InvalidCallError: ``handle`` is unknown or was synchronized already.

    Example::

        >>> h = hvd.allreduce_async(x)
        >>> y = hvd.synchronize(h)
    """
    if callable(handle):
        return handle()
    if handle not in _pending and handle not in _results:
        raise InvalidCallError(f"synchronize: handle {handle!r} is not a collective in flight (synchronized already, "
                         f"or not returned by an *_async call)")
    _complete_through(handle)
    return _results.pop(handle)


def poll(handle) -> bool:
    """Whether an asynchronous collective has finished, without waiting for it.

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
    if handle in _results:
        return True
    if handle not in _pending:
        raise InvalidCallError(f"poll: handle {handle!r} is not a collective in flight (synchronized already, or not "
                         f"returned by an *_async call)")
    if all(p.network_done() for h, p in _pending.items() if h <= handle):
        _complete_through(handle)
        return True
    return False


def drain() -> None:
    """Complete every collective in flight, in order (before a blocking collective, ``join`` or
    ``shutdown``, which must not overtake them).

    Example::

        >>> h = hvd.allreduce_async(x)
        >>> drain()
        >>> hvd.poll(h)                     # True
    """
    if _pending:
        _complete_through(max(_pending))


def forget() -> None:
    """Drop every handle and every result not yet fetched (``hvd.shutdown`` calls this after
    :func:`drain`).

    Example::

        >>> drain(); forget()
    """
    _pending.clear()
    _results.clear()
