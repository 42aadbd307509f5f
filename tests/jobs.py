"""Running real multi-process jobs from tests: every job has a hard timeout, so a hang fails fast."""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

# Variables of an outer launcher that would confuse the job's own detection.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHMN_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                   "MASTER_PORT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"}


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class ForkedJob:
    """A job whose ranks ``rank_forks.py`` forked (see there): their PIDs, their output so far,
    and ``wait()`` for the end."""

    def __init__(self, server: subprocess.Popen, argv: list, np, timeout: float):
        self.server, self.argv, self.np, self.timeout = server, argv, np, timeout
        self.out = tempfile.mkdtemp(prefix="torchmn-test-job-")
        self.pids = None
        self.done = False

    def answer(self, wait: float) -> dict:
        ready, _, _ = select.select([self.server.stdout], [], [], wait)
        line = self.server.stdout.readline() if ready else ""
        if not line:
            self.server.kill()  # the server hangs or died: the next job starts another
            self.done = True
            raise subprocess.TimeoutExpired(self.argv, self.timeout)
        return json.loads(line)

    def output(self, kind: str = "out") -> str:
        """The ranks' stdout (``"out"``) or stderr (``"err"``) so far, each line after ``[rank] ``
        (for a world of one without it)."""
        texts = []
        for r in range(len(self.pids)):
            path = Path(self.out, f"{r}.{kind}")
            text = path.read_text() if path.exists() else ""
            texts.append(text if self.np is None else "".join(f"[{r}] {line}" for line in text.splitlines(True)))
        return "".join(texts)

    def wait(self) -> subprocess.CompletedProcess:
        """Wait for every rank to end; the job's exit code is that of the rank that failed first
        (in time: as under torchmn run, the ranks stopped because of it do not count), else 0.
        Each rank's own exit code and output (stdout, then stderr) stay in ``codes`` and
        ``rank_outputs``.

        Raises:
            subprocess.TimeoutExpired: the job outlived its timeout (its ranks are killed).
        """
        # The server stops the job at its timeout; this one only guards against the server hanging.
        answer = self.answer(self.timeout + 30)
        self.done = True
        out, err = self.output("out"), self.output("err")
        self.codes = answer["codes"]
        self.rank_outputs = ["".join(Path(self.out, f"{r}.{kind}").read_text()
                                     for kind in ("out", "err") if Path(self.out, f"{r}.{kind}").exists())
                             for r in range(len(self.pids))]
        shutil.rmtree(self.out, ignore_errors=True)
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(self.argv, self.timeout, out, err)
        first = answer["first_failed"]
        return subprocess.CompletedProcess(self.argv, 0 if first is None else answer["codes"][first], out, err)


class _RankForks:
    """This pytest process's ``rank_forks.py`` process (one per xdist worker), started at its first job; one
    job at a time."""

    def __init__(self):
        self.proc = None
        self.job = None

    def start(self, script, args, np, env, cwd, timeout, stop_on_failure=True) -> ForkedJob:
        if self.job is not None and not self.job.done:
            try:  # a test that failed before waiting for its job: its answer is still due
                self.job.wait()
            except subprocess.TimeoutExpired:
                pass
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "rank_forks.py")], cwd=REPO,
                                         env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            atexit.register(self.proc.kill)
        argv = [str(script), *map(str, args)]
        job = ForkedJob(self.proc, argv, np, timeout)
        self.proc.stdin.write(json.dumps({"script": str(script), "args": argv[1:], "np": np, "env": env,
                                          "cwd": str(cwd), "timeout": timeout, "out": job.out,
                                          "stop_on_failure": stop_on_failure}) + "\n")
        self.proc.stdin.flush()
        job.pids = job.answer(60)["pids"]
        self.job = job
        return job


_rank_forks = _RankForks()


def wait_until_handled(pid: int, sig: int, timeout: float = 60) -> None:
    """Wait until process ``pid`` has a handler for ``sig`` (Linux's SigCgt mask), so a signal sent
    next tests that handler and not the interpreter's start-up, however loaded the machine is
    (SIGINT has Python's own handler from the start: wait for another the program installs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            raise AssertionError(f"process {pid} ended before handling signal {sig}") from None
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} had no handler for signal {sig} after {timeout} s")


def communicate_all(procs: list, timeout: float) -> list:
    """Each process's ``(exit code, stdout, stderr)`` once it ended, read all at once (one
    thread each, so that one filling its pipe never holds up another); one still running after
    ``timeout`` seconds is killed."""
    results: list = [None] * len(procs)

    def finish(i: int) -> None:
        try:
            out, err = procs[i].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            procs[i].kill()
            out, err = procs[i].communicate()
        results[i] = (procs[i].returncode, out, err)
    threads = [threading.Thread(target=finish, args=(i,)) for i in range(len(procs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def run_two_node_launchers(options: list, command: list, timeout: float = 120) -> list:
    """Two ``torchmn run -np 1 --nnodes 2`` launchers on this machine, node 0 and node 1 of one job
    (as on two nodes sharing a file system), with ``options`` and ``command``; each one's
    ``(exit code, stdout, stderr)`` once both ended."""
    from ports import free_port

    port = str(free_port())
    return communicate_all([subprocess.Popen(
        [sys.executable, "-m", "torchmn", "run", "-np", "1", "--nnodes", "2", "--node-rank", str(node),
         "--master-addr", "127.0.0.1", "--master-port", port, *options, *command],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)],
        timeout)


def launcher_argv(launcher: str, np: int) -> list[str]:
    if launcher == "torchmn":
        return [sys.executable, "-m", "torchmn", "run", "-np", str(np)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np),
                "--standalone", "--no-python", sys.executable]
    raise ValueError(launcher)


def run_job(script: str | Path, args: list[str], *, np: int = 2, launcher: str = "forked",
            timeout: float = 120, env: dict | None = None, cwd: str | Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``np`` ranks; fail the test on error or timeout.

    ``launcher``: ``"forked"`` (ranks forked from the session's process that has torch imported
    already, with torch's ``env://`` variables: see ``rank_forks.py``), ``"torchmn"`` (``torchmn
    run``) or ``"torchrun"``. Each rank's output lines start with ``[rank] `` under ``forked`` and
    ``torchmn``.
    """
    if launcher == "forked":
        proc = start_forked_job(script, args, np=np, env=env, cwd=cwd, timeout=timeout).wait()
        argv = proc.args
    else:
        argv = launcher_argv(launcher, np)
        argv += ([sys.executable] if launcher == "torchmn" else []) + [str(script)] + list(args)
        proc = subprocess.run(argv, cwd=cwd or REPO, env=clean_env(env), capture_output=True, text=True,
                              timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"job failed with exit code {proc.returncode}: {' '.join(argv)}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_one_process(script: str | Path, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python script args`` as a plain process (a world of one, forked as ``run_job``'s ranks
    are), without failing on its exit code."""
    return start_forked_job(script, args, np=None, timeout=timeout).wait()


def start_forked_job(script: str | Path, args: list[str], *, np: int | None = 2, timeout: float = 120,
                     env: dict | None = None, cwd: str | Path | None = None,
                     stop_on_failure: bool = True) -> ForkedJob:
    """Fork ``np`` ranks running ``python script args`` (None: a world of one) and return at once;
    ``run_job(launcher="forked")`` is ``start_forked_job(...).wait()``. One job at a time.
    ``stop_on_failure=False``: a failed rank does not stop the others (ranks started by hand,
    with no launcher watching them)."""
    return _rank_forks.start(script, args, np, clean_env(env), cwd or REPO, timeout, stop_on_failure)


# ----------------------------------------------------------------------------- one test id per check
# Starting ranks costs seconds (each imports torch), so the checks of one configuration share one
# job: the first test of the group runs it with exactly the checks this pytest session selected
# (`pytest -k compression` runs the compression check alone), and every test reads its own check's
# line from that job's output. A test declares its group with @pytest.mark.check_job(FAMILY,
# **fixed_config) and a `check` parameter; its other parameters complete the configuration.
_check_jobs: dict = {}


def job_key(item):
    """The check job a test's check runs in: ``(family, configuration)``, or None for a test that is
    not a check (see above)."""
    mark = item.get_closest_marker("check_job")
    params = getattr(getattr(item, "callspec", None), "params", {})
    if mark is None or "check" not in params:
        return None
    config = dict(mark.kwargs)
    config.update((k, v) for k, v in params.items() if k != "check")
    return mark.args[0], tuple(sorted(config.items(), key=lambda kv: kv[0]))


def check_job_output(request, run) -> subprocess.CompletedProcess:
    """The job that runs this test's check with the others of its group (see above).

    ``run(checks)`` runs the selected checks and returns the CompletedProcess (``check=False``);
    it is called once per group and session. An exception it raises (a timeout) fails every test
    of the group.
    """
    key = job_key(request.node)
    assert key is not None, "a check test needs @pytest.mark.check_job(...) and a `check` parameter"
    if key not in _check_jobs:
        checks = list(dict.fromkeys(item.callspec.params["check"] for item in request.session.items
                                    if job_key(item) == key))
        try:
            _check_jobs[key] = run(checks)
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 (the job's own failure, a timeout
            _check_jobs[key] = e                            # included, reported by each of its tests)
    result = _check_jobs[key]
    if isinstance(result, BaseException):
        raise result
    return result


def assert_check_passed(proc: subprocess.CompletedProcess, check: str) -> None:
    """Fail unless the job printed "PASS <check>" (rank 0's line; "[0] " prefixed under torchmn run;
    mpiexec may splice another rank's output into it, so only the words themselves are looked for)."""
    if re.search(rf"PASS {re.escape(check)}(?=\s|$)", proc.stdout):
        return
    raise AssertionError(
        f"check {check!r} did not pass (the job exited with {proc.returncode}; a failed check stops the "
        f"job, so the checks after it do not run)\n--- stdout ---\n{proc.stdout[-6000:]}\n"
        f"--- stderr ---\n{proc.stderr[-6000:]}")
