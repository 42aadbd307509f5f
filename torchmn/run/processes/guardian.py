"""The guardian: ends a local job's processes when its launcher dies without ending them itself.

``torchmn run`` starts it beside the ranks (``python -m torchmn.run.processes.guardian``, which does
not import torch), holding the
write end of its stdin; when the pipe closes without ``DONE``, it stops every process that carries
the job's ``TORCHMN_JOB_ID``. Why it is needed is in ``docs/design/launcher.md``.
"""
from __future__ import annotations

import os
import signal
import sys
import time

# What the launcher writes before closing the pipe when the job ended normally.
DONE = b"done\n"
# Signals the guardian ignores. A closing terminal is when it is needed most; Slurm signals every
# process of a step (its --signal=USR1@120 warning too), and SIGUSR1's default action would end the
# guardian silently.
IGNORED = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def job_processes(variable: str, job_id: str) -> list:
    """The processes whose environment holds ``variable=job_id``.

    Reads each process's ``/proc/PID/environ`` (Linux only): the environment it was started with.
    A process whose environment this user may not read, or that ended meanwhile, is skipped.

    Args:
        variable: the variable's name (``TORCHMN_JOB_ID``).
        job_id: the job's value of it.

    Returns:
        psutil ``Process`` objects.

    Example::

        >>> [p.pid for p in job_processes("TORCHMN_JOB_ID", os.environ["TORCHMN_JOB_ID"])]   # doctest: +SKIP
        [4121, 4122, 4130]
    """
    import psutil

    tag = f"{variable}={job_id}".encode()
    found = []
    for process in psutil.process_iter():
        try:
            with open(f"/proc/{process.pid}/environ", "rb") as f:
                if tag in f.read().split(b"\0"):
                    found.append(process)
        except OSError:
            continue
    return found


def stop(variable: str, job_id: str, grace: float) -> None:
    """SIGTERM to the job's processes, SIGKILL to those left after ``grace`` seconds.

    Returns as soon as none of them runs: within ``grace`` seconds of the SIGTERM, else after at
    most ten rounds of SIGKILL, 0.1 s apart, each to the job's processes found then (so that ones
    started meanwhile go too).

    Args:
        variable, job_id: what marks the job's processes (see ``job_processes``).
        grace: seconds between SIGTERM and SIGKILL.

    Example::

        >>> stop("TORCHMN_JOB_ID", "node1-4120-1718000000000000000", grace=3.0)   # doctest: +SKIP
    """
    import psutil

    for process in job_processes(variable, job_id):
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        alive = [p for p in job_processes(variable, job_id) if _running(p)]
        if not alive:
            return
        time.sleep(0.1)
    # New ones may have started since: look again, and again, until none is left.
    for _ in range(10):
        alive = [p for p in job_processes(variable, job_id) if _running(p)]
        if not alive:
            return
        for process in alive:
            try:
                process.kill()
            except psutil.Error:
                continue
        time.sleep(0.1)


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list) -> int:
    """Wait for stdin to close, then stop the job unless the launcher wrote ``DONE``.

    Reads stdin (file descriptor 0) until it closes or fails: the launcher holds its write end,
    so it closes when the launcher writes ``DONE`` and closes it, or when the launcher dies.

    Args:
        argv: ``VARIABLE JOB_ID GRACE`` (see ``stop``).

    Returns:
        0, whether or not it stopped anything.

    Example::

        >>> # as the launcher starts it (see torchmn.run.processes.supervisor.start_guardian):
        >>> main(["TORCHMN_JOB_ID", "node1-4120-1718000000000000000", "3.0"])   # doctest: +SKIP
        0
    """
    variable, job_id, grace = argv[0], argv[1], float(argv[2])
    received = b""
    while True:
        try:
            chunk = os.read(0, 64)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        received += chunk
    if not received.endswith(DONE):
        stop(variable, job_id, grace)
    return 0


if __name__ == "__main__":
    # The launcher started this process with these signals blocked; ignored now, any that came
    # meanwhile are dropped when they are unblocked.
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED)
    sys.exit(main(sys.argv[1:]))
