"""What one rank records of its own training, at torchmn's own boundaries: when each optimizer step
ends, how long the training thread waited in gradient averaging and collectives within it, and,
while a timeline is recorded, every phase as an event.

The hooks (``torchmn.optimizers``, the communicators' ``watch`` decorator, the Horovod layer) look at
:data:`on` before they read the clock, so a job without ``--monitor`` or ``--timeline`` pays one
attribute read per call. A step is the time from the end of one ``optimizer.step()`` to the end of
the next: everything the rank does per iteration (data, forward, backward, averaging, update).

In synchronous data parallelism every rank's step takes as long as the slowest rank's, because the
others wait for it in the averaging. What tells the ranks apart is the step *without* that waiting,
the time a rank is busy: a straggler is busy longer, its victims wait longer.
"""
from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Callable, Optional

# The last steps the figures are taken over.
WINDOW = 200
# The kinds of phase a timeline shows: compute is the rank's own, the others wait for other ranks
# (average, collective) or follow them (update).
CATEGORIES = ("compute", "average", "update", "collective")

on = False          # anything recorded at all (monitor, doctor's data or timeline)
timeline_on = False  # events kept for a timeline

_lock = threading.Lock()
_main = threading.main_thread().ident
_state = {"last_end": None, "wait": 0.0, "depth": 0, "steps": 0, "backward_end": None}
_window: collections.deque = collections.deque(maxlen=WINDOW)  # (end, step_s, wait_s)
_events: list = []   # (name, category, t0, t1, thread name, args)
_origin = (time.time(), time.perf_counter())


def now() -> float:
    """The clock every hook uses (``time.perf_counter``), in seconds.

    Returns:
        Seconds since an arbitrary origin; :func:`wall_time` turns them into Unix time.

    Example::

        >>> t0 = now()
    """
    return time.perf_counter()


def wall_time(t: float) -> float:
    """Unix time of :func:`now` reading ``t``, for timelines that join several ranks.

    Args:
        t: a reading of :func:`now`.

    Returns:
        Seconds since the epoch.

    Example::

        >>> abs(wall_time(now()) - time.time()) < 1
        True
    """
    return _origin[0] + (t - _origin[1])


def from_wall(t: float) -> float:
    """The :func:`now` reading of Unix time ``t`` (for callers that timed with ``time.time()``).

    Args:
        t: seconds since the epoch.

    Returns:
        The reading of :func:`now` at that moment.

    Example::

        >>> abs(from_wall(time.time()) - now()) < 1
        True
    """
    return _origin[1] + (t - _origin[0])


def start(timeline: bool = False) -> None:
    """Start recording on this rank: step figures always, events too with ``timeline``.

    Args:
        timeline: keep every phase as an event (memory grows with the run: a few events per step).

    Example::

        >>> start(timeline=True)
    """
    global on, timeline_on
    on = True
    timeline_on = timeline_on or timeline


def stop_timeline() -> list:
    """Stop keeping events and hand over those kept.

    Returns:
        The events: ``(name, category, start, end, thread, args)``, times in Unix seconds.

    Example::

        >>> start(timeline=True); events = stop_timeline()
    """
    global timeline_on
    timeline_on = False
    with _lock:
        kept = list(_events)
        _events.clear()
    return [_as_wall(e) for e in kept]


def _as_wall(event: tuple) -> tuple:
    name, category, t0, t1, thread, args = event
    return name, category, wall_time(t0), wall_time(t1), thread, args


def begin() -> float:
    """Open a phase that waits for other ranks (averaging, a collective): until the matching
    :func:`end`, time on the training thread counts as waiting, once, however the phases nest.

    Returns:
        The phase's start, for :func:`end`.

    Example::

        >>> t0 = begin(); comm.barrier(); end("barrier", "collective", t0)
    """
    if threading.get_ident() == _main:
        _state["depth"] += 1
    return time.perf_counter()


def end(name: str, category: str, t0: float, args: Optional[dict] = None) -> None:
    """Close the phase :func:`begin` opened at ``t0``.

    Args:
        name: what it was (``"allreduce"``, ``"average"``), the event's name in a timeline.
        category: one of :data:`CATEGORIES`.
        t0: what :func:`begin` returned.
        args: details for the timeline (bytes, bucket).

    Example::

        >>> t0 = begin(); work.wait(); end("average", "average", t0, {"bucket": 0})
    """
    t1 = time.perf_counter()
    if threading.get_ident() == _main:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            _state["wait"] += t1 - t0
    if timeline_on:
        event(name, category, t0, t1, args)


def event(name: str, category: str, t0: float, t1: float, args: Optional[dict] = None,
          thread: Optional[str] = None) -> None:
    """Keep one finished phase for the timeline (nothing unless a timeline is recorded).

    Args:
        name: the event's name.
        category: one of :data:`CATEGORIES` (or ``"horovod"`` for the Horovod layer's calls).
        t0, t1: its start and end, readings of :func:`now`.
        args: details shown with it.
        thread: the row it goes in (default: the calling thread's); phases that overlap the
            thread's own, such as a bucket's averaging in flight during backward, get a row apart.

    Example::

        >>> t0 = now(); optimizer.step(); event("update", "update", t0, now())
    """
    if timeline_on:
        item = (name, category, t0, t1, thread or threading.current_thread().name, args)
        with _lock:
            _events.append(item)


def backward_ended(t: float) -> None:
    """Mark the end of this step's backward (the optimizer's hook, once all gradients are in).

    Args:
        t: a reading of :func:`now`.

    Example::

        >>> backward_ended(now())
    """
    if timeline_on:
        begun = _state["last_end"] if _state["last_end"] is not None else _state["backward_end"]
        if begun is not None:
            event("forward+backward", "compute", begun, t)
    _state["backward_end"] = t


def update(step: Callable[[], object]) -> object:
    """Run an optimizer's update (``step``), timed as the step's ``update`` phase, and mark the end
    of the step.

    Args:
        step: the wrapped optimizer's ``step``.

    Returns:
        What ``step()`` returned.

    Example::

        >>> return recorder.update(self.wrapped.step)
    """
    if not on:
        return step()
    t0 = time.perf_counter()
    result = step()
    t1 = time.perf_counter()
    event("update", "update", t0, t1)
    step_ended(t1)
    return result


def step_ended(t: float) -> None:
    """Mark the end of an optimizer step: the step since the last one, and its waiting, count.

    Args:
        t: a reading of :func:`now`.

    Example::

        >>> step_ended(now())
    """
    last = _state["last_end"]
    if last is not None:  # the first step's time has no start: it counts, but has no figures
        with _lock:
            _window.append((t, t - last, _state["wait"]))
    _state["steps"] += 1
    _state["last_end"] = t
    _state["wait"] = 0.0


def figures() -> dict:
    """This rank's step figures over the last :data:`WINDOW` steps.

    Returns:
        ``steps`` (counted so far), ``steps_per_s``, ``step_ms`` (median), ``step_p95_ms``,
        ``busy_ms`` (median step time without waiting), ``wait_share`` (of the steps' time spent
        waiting in averaging and collectives); the last five are None before two steps.

    Example::

        >>> figures()["steps"]
        0
    """
    with _lock:
        window = list(_window)
    out = {"steps": _state["steps"], "steps_per_s": None, "step_ms": None, "step_p95_ms": None,
           "busy_ms": None, "wait_share": None}
    if not window:
        return out
    steps = sorted(s for _, s, _ in window)
    total = sum(steps)
    span = window[-1][0] - window[0][0] + window[0][1]
    out.update(steps_per_s=len(window) / span if span > 0 else None,
               step_ms=1e3 * statistics.median(steps),
               step_p95_ms=1e3 * steps[min(len(steps) - 1, int(0.95 * len(steps)))],
               busy_ms=1e3 * statistics.median(s - w for _, s, w in window),
               wait_share=sum(w for _, _, w in window) / total if total > 0 else None)
    return out
