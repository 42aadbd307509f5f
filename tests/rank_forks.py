"""A process that imports torch and torchmn once, then forks the ranks of test jobs.

Each rank of a job started from scratch spends some 2.5 CPU-seconds importing torch before it does
anything, and as much again on torch._dynamo when it builds an optimizer; the checks of this suite run well over a hundred such jobs. Forked from this process, a
rank starts in milliseconds and is otherwise what a launcher starts: a process of its own with the
job's environment (torch's ``env://`` variables), its own gloo sockets and shared memory, running
the worker script as ``__main__``. The launchers themselves (``torchmn run``, torchrun, srun,
mpirun) are tested by jobs they really start.

Protocol, one JSON line per job on stdin: ``{"script", "args", "np", "env", "cwd", "timeout",
"out", "stop_on_failure"}``; the answers are JSON lines on stdout: ``{"pids": [pid per rank]}`` once the ranks are
forked, then ``{"codes": [exit code per rank], "timed_out", "first_failed": the rank that failed first, or
null}`` once they have all ended.
Rank ``r`` writes its stdout and stderr to ``{out}/{r}.out`` and ``{out}/{r}.err``. As under
``torchmn run``, a rank that fails stops the others (SIGTERM, then SIGKILL after a grace period),
unless ``stop_on_failure`` is false (ranks started by hand: nobody stops the others).

    python tests/rank_forks.py          (started by tests/jobs.py: one per pytest process, so per xdist worker)
"""
import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch  # noqa: F401  (imported here once, for every rank forked below)
# Building any torch optimizer imports torch._dynamo (some 2.5 CPU-seconds more per rank): once here too.
import torch._dynamo  # noqa: F401

import torchmn  # noqa: F401
import torchmn.communicators  # noqa: F401
import torchmn.optimizers  # noqa: F401
from torchmn.run.config import GRACE_SECONDS  # between SIGTERM and SIGKILL, as under torchmn run

from ports import free_port


def rank_main(job: dict, rank: int) -> None:
    """In the forked child: become rank ``rank`` of ``job`` and run its script; never returns."""
    code = 1
    try:
        atexit._clear()  # the server's exit handlers are not the rank's
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)
        for fd, suffix in ((1, "out"), (2, "err")):
            f = os.open(os.path.join(job["out"], f"{rank}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = open(os.devnull)
        os.environ.clear()
        os.environ.update(job["env"])
        if job["np"] is not None:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["np"]),
                              LOCAL_WORLD_SIZE=str(job["np"]), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(job["port"]))
        os.chdir(job["cwd"])
        script = os.path.abspath(job["script"])
        sys.argv = [script, *job["args"]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 (an uncaught exception: sys.excepthook, as Python calls it)
            sys.excepthook(*sys.exc_info())
            code = 1
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def signal_ranks(pids: list, codes: list, signum: int) -> None:
    """Send ``signum`` to the process group of every rank still running."""
    for r, pid in enumerate(pids):
        if codes[r] is None:
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                pass


def run(job: dict) -> dict:
    """Fork the job's ranks, wait for them (stopping them all when one fails or time runs out)."""
    job["port"] = free_port()
    ranks = job["np"] or 1
    pids = []
    for r in range(ranks):
        pid = os.fork()
        if pid == 0:
            rank_main(job, r)
        try:
            os.setpgid(pid, pid)  # as the child does: whichever runs first, killpg finds the group
        except OSError:
            pass  # the child already exec'd or exited
        pids.append(pid)
    sys.stdout.write(json.dumps({"pids": pids}) + "\n")
    sys.stdout.flush()
    codes = [None] * ranks
    first_failed = None  # the rank that failed first in time (the others may then die of SIGTERM)
    deadline = time.monotonic() + job["timeout"]
    kill_at = None
    timed_out = False
    while None in codes:
        for r, pid in enumerate(pids):
            if codes[r] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[r] = os.waitstatus_to_exitcode(status)
                    if codes[r] != 0 and first_failed is None:
                        first_failed = r
                        if job.get("stop_on_failure", True):
                            kill_at = time.monotonic() + GRACE_SECONDS
                            signal_ranks(pids, codes, signal.SIGTERM)
        if time.monotonic() > deadline:
            timed_out = True
        if timed_out or (kill_at is not None and time.monotonic() > kill_at):
            signal_ranks(pids, codes, signal.SIGKILL)
            for r, pid in enumerate(pids):
                if codes[r] is None:
                    codes[r] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            break
        time.sleep(0.01)
    return {"codes": codes, "timed_out": timed_out, "first_failed": first_failed}


def main() -> None:
    for line in sys.stdin:
        answer = run(json.loads(line))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
