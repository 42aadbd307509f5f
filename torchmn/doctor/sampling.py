"""Sampling a job's processes for a few seconds: CPU time, threads, runnable threads, context switches.

CPU time and context switches come from psutil, read at the start and the end of the window.
Runnable threads are counted many times during it from ``/proc/<pid>/task/<tid>/stat`` (state
``R``): their average against the CPUs is the direct measure of oversubscription, which no per-
process CPU% shows (four busy threads on two cores each look 50% busy, not 200% demanded).
"""
from __future__ import annotations

import dataclasses
import os
import time

import psutil


@dataclasses.dataclass
class ProcessSample:
    """What one process did during the window.

    Attributes:
        pid: the process.
        cpu_percent: CPU time over wall time, in percent of one CPU.
        threads: its threads at the end of the window (the most seen).
        busy_threads: threads that used at least half a CPU.
        runnable: runnable threads on average.
        involuntary_per_s: involuntary context switches per second (the kernel took a CPU away).
        alive: False where it ended during the window.
        seconds: how long it was watched: from when it was first seen to the window's end, or to
            the last reading before it ended (its figures are over that time).
    """

    pid: int
    cpu_percent: float = 0.0
    threads: int = 0
    busy_threads: int = 0
    runnable: float = 0.0
    involuntary_per_s: float = 0.0
    alive: bool = True
    seconds: float = 0.0


def _thread_states(pid: int) -> tuple:
    """(threads, runnable threads) of ``pid`` now, from /proc; (0, 0) where it is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    threads = running = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The state follows the command name, which is in parentheses and may hold spaces.
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
        if state in (b"Z", b"X"):  # ended (a zombie waits for its parent)
            continue
        threads += 1
        running += state == b"R"
    return threads, running


def _thread_times(proc: psutil.Process) -> dict:
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _counters(proc: psutil.Process):
    """(CPU seconds, involuntary context switches) of ``proc``; None where it has ended (a zombie
    waiting for its parent counts as ended)."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        times = proc.cpu_times()
        return times.user + times.system, proc.num_ctx_switches().involuntary
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def sample(pids, seconds: float, interval: float = 0.02, refresh: float = 0.5) -> dict:
    """Watch the job's processes for ``seconds``, or until every one of them has ended.

    A process that ends during the window is measured over the time it ran (to the last reading,
    at most ``refresh`` seconds before its end), not over the whole window.

    Args:
        pids: the processes (ranks and workers), or a function that returns them now: it is called
            again every ``refresh`` seconds, so that processes started meanwhile (DataLoader workers
            at the first batch) are watched from when they appear.
        seconds: the window.
        interval: seconds between two counts of runnable threads.
        refresh: seconds between two calls of ``pids`` (where it is a function).

    Returns:
        ``{pid: ProcessSample}``.

    Example::

        >>> samples = sample([rank.pid for rank in ranks], 3.0)
    """
    current = pids if callable(pids) else (lambda: pids)
    procs, start, last, counts, most, span = {}, {}, {}, {}, {}, {}  # span: first and last seen running

    def read(pid):
        """The readings of ``pid`` now, or None where it has ended."""
        counters = _counters(procs[pid])
        return None if counters is None else (counters, _thread_times(procs[pid]), time.monotonic())

    def watch(pid):
        try:
            procs[pid] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return
        start[pid] = last[pid] = read(pid)
        counts[pid], most[pid], span[pid] = [], 0, (0.0, 0.0)

    t0 = last_refresh = time.monotonic()
    for pid in current():
        watch(pid)
    while time.monotonic() - t0 < seconds:
        if time.monotonic() - last_refresh >= refresh:
            last_refresh = time.monotonic()
            for pid in current() if callable(pids) else ():
                if pid not in procs:
                    watch(pid)
            alive = False
            for pid in procs:
                now = read(pid)
                if now is not None:
                    last[pid], alive = now, True
            if procs and not alive:
                break  # everything watched has ended, and no new process came
        for pid in procs:
            threads, running = _thread_states(pid)
            if threads:
                counts[pid].append(running)
                most[pid] = max(most[pid], threads)
                span[pid] = (span[pid][0] or time.monotonic(), time.monotonic())
        time.sleep(interval)
    window = max(time.monotonic() - t0, 1e-3)
    out = {}
    for pid in procs:
        s = ProcessSample(pid, threads=most[pid])
        begin, end = start[pid], read(pid)
        if end is None:
            s.alive, end = False, last[pid]
        if begin is not None and end is not None and end[2] > begin[2]:
            (c0, thread_begin, seen), (c1, thread_end, until) = begin, end
            wall = until - seen
            s.seconds = wall
            s.cpu_percent = 100.0 * (c1[0] - c0[0]) / wall
            s.involuntary_per_s = (c1[1] - c0[1]) / wall
            s.busy_threads = sum(1 for tid, t in thread_end.items() if t - thread_begin.get(tid, t) >= 0.5 * wall)
        # Runnable threads averaged over the whole window: a process seen late or ended early counts
        # for the time it ran.
        mean = sum(counts[pid]) / len(counts[pid]) if counts[pid] else 0.0
        s.runnable = mean * min(window, span[pid][1] - span[pid][0] + interval) / window
        out[pid] = s
    return out
