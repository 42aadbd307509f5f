"""The guardian: ends a local job's processes when its launcher dies without ending them itself.

The kernel sends each rank SIGTERM when the launcher dies, even by SIGKILL (PR_SET_PDEATHSIG),
but nothing more: a rank that ignores SIGTERM, the children it started, and what it detached
would outlive the launcher. So ``torchmn run`` starts this small process beside the ranks, in a
session of its own (a signal to the launcher's process group or terminal does not reach it),
holding the write end of a pipe. When the launcher ends normally it writes ``done`` first; when
the pipe closes without it, the guardian stops every process that carries the job's
``TORCHMN_JOB_ID`` in its environment (the ranks and all they started): SIGTERM, then SIGKILL
after the grace period.

Like the remote watcher, it runs as a plain script (``GUARDIAN_BOOTSTRAP``), without importing
torch, which would cost seconds and hundreds of MB for a process that only waits.
"""
from __future__ import annotations

import os
import signal
import sys
import time

GUARDIAN_BOOTSTRAP = ("import importlib.util as u, os, runpy, sys; sys.argv[0] = 'torchmn.launch.guardian'; "
                      "runpy.run_path(os.path.join(os.path.dirname(u.find_spec('torchmn').origin), "
                      "'launch', 'guardian.py'), run_name='__main__')")
DONE = b"done\n"


def job_processes(variable: str, job_id: str) -> list:
    """The processes whose environment holds ``variable=job_id`` (psutil objects)."""
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
    """SIGTERM to the job's processes, SIGKILL to those left after ``grace`` seconds."""
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
    """``guardian.py VARIABLE JOB_ID GRACE``: wait for stdin to close, then stop the job unless
    the launcher wrote ``done``."""
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
    # A closing terminal is when it is needed most; Slurm signals every process of a step (its
    # --signal=USR1@120 warning too), and SIGUSR1's default action would end the guardian silently.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(main(sys.argv[1:]))
