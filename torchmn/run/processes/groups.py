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


def stop_group(proc, grace: float = 10.0) -> None:
    """End a process started in a session of its own, and everything it started: SIGTERM to its
    group, then SIGKILL where it has not exited after ``grace`` seconds.

    Args:
        proc: the ``subprocess.Popen`` (started with ``start_new_session=True``).
        grace: seconds it gets to exit after SIGTERM.

    Example::

        >>> proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        >>> stop_group(proc); proc.returncode
        -15
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        signal_group(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


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

    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                return True
        except (psutil.Error, OSError):
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
