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
    """

    pid: int
    cpu_percent: float = 0.0
    threads: int = 0
    busy_threads: int = 0
    runnable: float = 0.0
    involuntary_per_s: float = 0.0
    alive: bool = True


def _thread_states(pid: int) -> tuple:
    """(threads, runnable threads) of ``pid`` now, from /proc; (0, 0) where it is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0, 0
    running = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The state follows the command name, which is in parentheses and may hold spaces.
        if stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"R":
            running += 1
    return len(tids), running


def _thread_times(proc: psutil.Process) -> dict:
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _counters(proc: psutil.Process):
    try:
        times = proc.cpu_times()
        return times.user + times.system, proc.num_ctx_switches().involuntary
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def sample(pids, seconds: float, interval: float = 0.02, refresh: float = 0.5) -> dict:
    """Watch the job's processes for ``seconds``.

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
    procs, start, counts, most = {}, {}, {}, {}

    def watch(pid):
        try:
            procs[pid] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return
        start[pid] = (_counters(procs[pid]), _thread_times(procs[pid]), time.monotonic())
        counts[pid], most[pid] = [], 0

    t0 = last_refresh = time.monotonic()
    for pid in current():
        watch(pid)
    while time.monotonic() - t0 < seconds:
        if time.monotonic() - last_refresh >= refresh and callable(pids):
            last_refresh = time.monotonic()
            for pid in current():
                if pid not in procs:
                    watch(pid)
        for pid in procs:
            threads, running = _thread_states(pid)
            if threads:
                counts[pid].append(running)
                most[pid] = max(most[pid], threads)
        time.sleep(interval)
    end_time = time.monotonic()
    out = {}
    for pid, proc in procs.items():
        (begin, thread_begin, seen), end = start[pid], _counters(proc)
        wall = max(end_time - seen, 1e-3)
        s = ProcessSample(pid, threads=most[pid])
        if begin is None or end is None:
            s.alive = False
        else:
            s.cpu_percent = 100.0 * (end[0] - begin[0]) / wall
            s.involuntary_per_s = (end[1] - begin[1]) / wall
            thread_end = _thread_times(proc)
            s.busy_threads = sum(1 for tid, t in thread_end.items() if t - thread_begin.get(tid, t) >= 0.5 * wall)
        # Runnable threads averaged over the whole window: a process seen late counts for the time it ran.
        mean = sum(counts[pid]) / len(counts[pid]) if counts[pid] else 0.0
        s.runnable = mean * wall / max(end_time - t0, 1e-3)
        out[pid] = s
    return out
