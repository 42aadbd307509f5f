"""Process helpers shared by the launcher, the remote watcher and the guardian.

Process groups (signal one, ask whether it still runs), Linux's ``prctl``, joining a pipe reader,
and the ``python -c`` program that starts a helper process without torch. Standard library only
(psutil is imported inside the functions that use it): the watcher and the guardian load this
module on hosts and at moments where torch must not be imported.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

# The prctl options used here (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def bootstrap(module: str) -> str:
    """A ``python -c`` program that runs torchmn's ``module`` as ``__main__`` without running
    ``torchmn/__init__.py``, which imports torch (seconds of start-up and much memory for a process
    that only waits).

    It puts a bare module for the ``torchmn`` package into ``sys.modules``, with the installed
    package's directory as its ``__path__``, so that ``module`` and what it imports (stdlib-only
    torchmn modules) load as usual.

    Args:
        module: the dotted name of the module to run, e.g. ``"torchmn.launch.remote"``.

    Returns:
        The program, for ``[sys.executable, "-c", program, *args]``.

    Example::

        >>> "runpy.run_module('torchmn.launch.guardian'" in bootstrap("torchmn.launch.guardian")
        True
    """
    return ("import importlib.util as u, runpy, sys, types; "
            "package = types.ModuleType('torchmn'); "
            "package.__path__ = list(u.find_spec('torchmn').submodule_search_locations); "
            "sys.modules['torchmn'] = package; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


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


def join_unless_idle(thread: threading.Thread, waiting_since: Callable[[], Optional[float]],
                     idle: float) -> None:
    """Wait for ``thread``, a reader of a pipe, to end, however long it spends passing output on
    (to a slow or paused console), but give up once it has waited ``idle`` seconds on a silent
    pipe: something left behind holds the pipe open.

    Args:
        thread: the reader thread.
        waiting_since: returns when the reader started waiting on its pipe, or None while it is
            writing out what it read.
        idle: seconds of waiting on a silent pipe after which to give up.

    Example::

        >>> t = threading.Thread(target=time.sleep, args=(0.1,)); t.start()
        >>> join_unless_idle(t, lambda: None, 1.0); t.is_alive()
        False
    """
    while thread.is_alive():
        thread.join(0.05)
        since = waiting_since()
        if since is not None and time.monotonic() - since >= idle:
            return
