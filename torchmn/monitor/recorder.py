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
import math
import os
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
timeline_on = False  # events kept for a timeline: some sink is open

_lock = threading.Lock()
# "started": when recording started, from which a rank held up before its first step is timed.
_state = {"last_end": None, "steps": 0, "backward_end": None, "trainer": None, "started": None}
# Waiting is counted per thread: the training thread's own (the main thread, or the thread Ray
# Train or a user runs the loop in) is the one whose step_ended takes it; a background thread's
# collectives (the Horovod layer's) never reach a step's figures.
_waits = threading.local()
# When each thread's outermost wait began, while it waits: the publisher tells a rank stuck in
# the others' collective from one stuck in its own work.
_open_waits: dict = {}
_window: collections.deque = collections.deque(maxlen=WINDOW)  # (end, step_s, wait_s)
# Every open sink gets every event: the job's timeline (TORCHMN_TIMELINE) and a Horovod
# start_timeline/stop_timeline window record side by side without taking each other's events.
_sinks: list = []   # lists of (name, category, t0, t1, thread name, args)
_origin = (time.time(), time.perf_counter())


def _forget_in_child() -> None:
    """In a process forked from a rank: a lock the fork copied held (by the timeline's writer
    thread, which the child does not have) would hang it, and the sinks belong to the rank."""
    global _lock, timeline_on
    _lock = threading.Lock()
    _sinks.clear()
    timeline_on = False


os.register_at_fork(after_in_child=_forget_in_child)


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


def start() -> None:
    """Start recording this rank's step figures (events, for a timeline, go to the sinks
    :func:`open_events` opens).

    Example::

        >>> start()
    """
    global on
    on = True
    if _state["started"] is None:
        _state["started"] = now()


def open_events() -> list:
    """Start keeping every phase as an event, in a sink of its own, until :func:`close_events`.

    Returns:
        The sink: pass it to :func:`take_events` and :func:`close_events`.

    Example::

        >>> sink = open_events(); comm.barrier(); events = close_events(sink)
    """
    global on, timeline_on
    sink: list = []
    with _lock:
        _sinks.append(sink)
        on = timeline_on = True
    return sink


def take_events(sink: list) -> list:
    """Hand over the events ``sink`` has kept since the last take; it keeps recording.

    Args:
        sink: what :func:`open_events` returned.

    Returns:
        The events: ``(name, category, start, end, thread, args)``, times in Unix seconds.

    Example::

        >>> part.extend(take_events(sink))
    """
    with _lock:
        kept = list(sink)
        sink.clear()
    return [_as_wall(e) for e in kept]


def close_events(sink: list) -> list:
    """Stop keeping events in ``sink`` and hand over those not yet taken.

    Args:
        sink: what :func:`open_events` returned.

    Returns:
        The events, as :func:`take_events` gives them.

    Example::

        >>> sink = open_events(); events = close_events(sink)
    """
    global timeline_on
    with _lock:
        _sinks[:] = [s for s in _sinks if s is not sink]
        timeline_on = bool(_sinks)
    return take_events(sink)


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
    _waits.depth = getattr(_waits, "depth", 0) + 1
    t0 = time.perf_counter()
    if _waits.depth == 1:
        _open_waits[threading.get_ident()] = t0
    return t0


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
    _waits.depth = getattr(_waits, "depth", 1) - 1
    if _waits.depth == 0:
        _waits.wait = getattr(_waits, "wait", 0.0) + (t1 - t0)
        _open_waits.pop(threading.get_ident(), None)
    if timeline_on:
        event(name, category, t0, t1, args)


class waiting:
    """A phase that waits for other ranks, as a ``with`` block: :func:`begin` on entry where the
    recorder is on, and :func:`end` on exit, also where the block raises (a wait left open would
    count every later step as busy, and show the rank as waiting for good).

    Args:
        name: what it was, the event's name in a timeline.
        category: one of :data:`CATEGORIES`.
        args: details for the timeline.

    Example::

        >>> with waiting("wait for averages", "average"):
        ...     work.wait()
    """

    __slots__ = ("name", "category", "args", "t0")

    def __init__(self, name: str, category: str, args: Optional[dict] = None):
        self.name, self.category, self.args, self.t0 = name, category, args, None

    def __enter__(self) -> "waiting":
        self.t0 = begin() if on else None
        return self

    def __exit__(self, *exc_info) -> None:
        if self.t0 is not None:
            end(self.name, self.category, self.t0, self.args)


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
            for sink in _sinks:
                sink.append(item)


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
    """Mark the end of an optimizer step: the step since the last one, and the calling thread's
    waiting in it, count.

    Args:
        t: a reading of :func:`now`.

    Example::

        >>> step_ended(now())
    """
    last = _state["last_end"]
    wait = getattr(_waits, "wait", 0.0)
    if last is not None:  # the first step's time has no start: it counts, but has no figures
        with _lock:
            _window.append((t, t - last, wait))
    _state["steps"] += 1
    _state["last_end"] = t
    _state["trainer"] = threading.get_ident()
    _waits.wait = 0.0


def figures() -> dict:
    """This rank's step figures over the last :data:`WINDOW` steps.

    Returns:
        ``steps`` (counted so far), ``steps_per_s``, ``step_ms`` (median), ``step_p95_ms``,
        ``busy_ms`` (median step time without waiting), ``wait_share`` (of the steps' time spent
        waiting in averaging and collectives), ``max_busy_ms`` (the longest step without its
        waiting: a stall), the last six None before two steps; ``since_step_s`` (since the last
        step ended, or before the first since recording started: a rank held up before its first
        step shows too; None before either) and ``waiting_now_s`` (how long the training thread has been
        waiting for the others, None where it is not).

    Example::

        >>> figures()["steps"]
        0
    """
    with _lock:
        window = list(_window)
    t = time.perf_counter()
    last = _state["last_end"] if _state["last_end"] is not None else _state["started"]
    if _state["trainer"] is not None:
        waiting_since = _open_waits.get(_state["trainer"])
    else:  # before the first step the training thread is not known: any thread waiting is taken for it
        waiting_since = min(_open_waits.values(), default=None)
    out = {"steps": _state["steps"], "steps_per_s": None, "step_ms": None, "step_p95_ms": None,
           "busy_ms": None, "wait_share": None, "max_busy_ms": None,
           "since_step_s": None if last is None else t - last,
           "waiting_now_s": None if waiting_since is None else t - waiting_since}
    if not window:
        return out
    steps = sorted(s for _, s, _ in window)
    total = sum(steps)
    span = window[-1][0] - window[0][0] + window[0][1]
    out.update(steps_per_s=len(window) / span if span > 0 else None,
               step_ms=1e3 * statistics.median(steps),
               step_p95_ms=1e3 * steps[math.ceil(0.95 * len(steps)) - 1],  # nearest rank
               busy_ms=1e3 * statistics.median(s - w for _, s, w in window),
               max_busy_ms=1e3 * max(s - w for _, s, w in window),
               wait_share=sum(w for _, _, w in window) / total if total > 0 else None)
    return out
