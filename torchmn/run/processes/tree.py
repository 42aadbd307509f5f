"""The processes below a process, as the launcher looks for them twice a second.

psutil's ``Process.children()`` reads the stat file of every process on the machine on each call.
Asked once per rank every half second, on a node of many ranks among hundreds of processes, that
cost the launcher a quarter of a core. Linux names each thread's children in
``/proc/PID/task/TID/children`` (since 3.5, where the kernel has ``CONFIG_PROC_CHILDREN``), so a
walk there reads only the job's own processes; where the kernel lacks those files, one read of the
whole process table serves every process asked about in one look.

The kernel's lists can miss a child forked while they are read: callers look again at their next
round, as they would for a child started just after.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List


def _children_files_exist() -> bool:
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _children_from_proc(pid: int) -> List[int]:
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # ended
        return []
    found: List[int] = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:  # the thread or the process ended meanwhile
            continue
    return found


def _children_from_table() -> Callable[[int], List[int]]:
    import psutil

    table: Dict[int, List[int]] = {}
    for process in psutil.process_iter(["ppid"]):
        table.setdefault(process.info["ppid"], []).append(process.pid)
    return lambda pid: table.get(pid, [])


def look() -> Callable[[int], List[int]]:
    """One look at the machine's processes: a function from a pid to its children's pids.

    Returns:
        ``children(pid)``; from the kernel's per-thread lists where they exist (each call reads
        that process's lists), else from one read of the whole process table made now.

    Example::

        >>> children = look()
        >>> children(os.getpid())          # doctest: +SKIP
        [4121, 4122]
    """
    return _children_from_proc if _children_files_exist() else _children_from_table()


def descendants(pid: int, children: Callable[[int], List[int]]) -> List[int]:
    """The pids of every process below ``pid``, children first.

    Args:
        pid: the process whose tree to walk.
        children: what :func:`look` returned (one look for all the processes asked about).

    Returns:
        The pids found, ``pid`` itself left out; empty for a process that has ended.

    Example::

        >>> children = look()
        >>> [descendants(rank_pid, children) for rank_pid in (4120, 4130)]   # doctest: +SKIP
        [[4121, 4125], []]
    """
    found: List[int] = []
    queue = [pid]
    seen = {pid}  # a pid reused while the lists are read must not send the walk round in a loop
    while queue:
        for child in children(queue.pop()):
            if child not in seen:
                seen.add(child)
                found.append(child)
                queue.append(child)
    return found
