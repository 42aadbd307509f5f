"""Process groups and Linux's ``prctl``, for the launcher and the remote watcher.

Signal a process group, end one (SIGTERM, then SIGKILL), ask whether it still runs; the death
signal and the child subreaper. Every rank leads a process group of its own, so a signal to the
group reaches what the rank started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

# The prctl options used here (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group, if it still has members.

    Args:
        pgid: the process group id (a rank's pid: ranks lead groups of their own).
        sig: the signal number.

    Example::

        >>> signal_group(2**22 + 1, 0)   # no such group: nothing happens
    """
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_rank_group(proc, sig: int, name: str, value: str) -> None:
    """Send ``sig`` to the process group that ``proc`` leads (it was started in a session of its
    own), but to none other.

    While ``proc`` has not been reaped, its pid, and so the group's id, belongs to it. Once it has
    been, the id can go to a new process that leads a session of its own (another job's rank, a
    user's shell) as soon as the old group is empty: then only the members whose environment holds
    ``name=value`` (the job's id, which a rank's children inherit) are signalled, one by one.

    Args:
        proc: the ``subprocess.Popen`` that leads the group.
        sig: the signal number.
        name, value: the variable that marks the job's processes.

    Example::

        >>> signal_rank_group(rank.process, signal.SIGTERM, "TORCHMN_JOB_ID", job_id)   # doctest: +SKIP
    """
    if proc.returncode is None:
        signal_group(proc.pid, sig)
        return
    for member in _members(proc.pid):
        try:
            if member.environ().get(name) == value:
                member.send_signal(sig)  # psutil checks the pid still names the process it listed
        except Exception:  # noqa: BLE001 - psutil.Error: gone, or not ours to read or signal
            continue


def rank_group_alive(proc, name: str, value: str) -> bool:
    """Whether the process group that ``proc`` leads still has a running member of the job (see
    ``signal_rank_group`` for why the group's id alone says nothing once ``proc`` is reaped).

    Args:
        proc: the ``subprocess.Popen`` that leads the group.
        name, value: the variable that marks the job's processes.

    Returns:
        The answer.

    Example::

        >>> rank_group_alive(rank.process, "TORCHMN_JOB_ID", job_id)   # doctest: +SKIP
        True
    """
    if proc.returncode is None:
        return group_alive(proc.pid)
    import psutil

    for member in _members(proc.pid):
        try:
            if member.status() != psutil.STATUS_ZOMBIE and member.environ().get(name) == value:
                return True
        except psutil.Error:
            continue
    return False


def _members(pgid: int) -> list:
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                found.append(process)
        except OSError:
            continue
    return found


def stop_group(proc, grace: float = 10.0) -> None:
    """End a process started in a session of its own, and everything it started: SIGTERM to its
    group, then SIGKILL to the group where any of it still runs after ``grace`` seconds (a child
    that ignores SIGTERM outlives a leader that exits on it).

    Args:
        proc: the ``subprocess.Popen`` (started with ``start_new_session=True``).
        grace: seconds it gets to exit after SIGTERM.

    Example::

        >>> proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        >>> stop_group(proc); proc.returncode
        -15
    """
    # The group's id stays the leader's pid while any member lives (Linux reuses no pid still in
    # use as a group's), so signalling it after the leader was reaped reaches only the rest.
    if proc.poll() is None or group_alive(proc.pid):
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None or group_alive(proc.pid):
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a process group still has a member that is not a zombie.

    Orphaned grandchildren become zombies of PID 1, which in containers may take a second or more
    to reap them; waiting for those would only slow teardown down.

    Args:
        pgid: the process group id.

    Returns:
        True while a member of the group runs.

    Example::

        >>> group_alive(os.getpgid(0))
        True
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    import psutil

    for process in _members(pgid):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            continue
    return False


def prctl() -> Optional[Callable[..., int]]:
    """Linux's ``prctl`` from libc, or None elsewhere.

    Returns:
        The C function (called as ``prctl(option, arg2, arg3, arg4, arg5)``), or None.

    Example::

        >>> prctl() is not None or not sys.platform.startswith("linux")
        True
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def become_subreaper() -> bool:
    """Have processes orphaned below this one re-parented to it instead of to init.

    Uses Linux's ``prctl(PR_SET_CHILD_SUBREAPER)``, so that what a rank detached (a new session, a
    double fork) is still found among this process's descendants.

    Returns:
        False where that is not available.

    Example::

        >>> become_subreaper()  # doctest: +SKIP
        True
    """
    call = prctl()
    return call is not None and call(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
