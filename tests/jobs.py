"""Running real multi-process jobs from tests: every job has a hard timeout, so a hang fails fast."""
from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import tempfile
from pathlib import Path

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


class _RankForks:
    """The session's ``rank_forks.py`` process (see there), started at its first job."""

    def __init__(self):
        self.proc = None

    def run(self, script, args, np, env, cwd, timeout) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "rank_forks.py")], cwd=REPO,
                                         env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            atexit.register(self.proc.kill)
        with tempfile.TemporaryDirectory(prefix="torchmn-test-job-") as out:
            job = {"script": str(script), "args": [str(a) for a in args], "np": np, "env": env,
                   "cwd": str(cwd), "timeout": timeout, "out": out}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            # The server stops the job at its timeout; this one only guards against the server itself hanging.
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout + 30)
            if not ready:
                self.proc.kill()
                self.proc = None
                raise subprocess.TimeoutExpired(f"{script} {args}", timeout)
            answer = json.loads(self.proc.stdout.readline())
            outputs = {}
            for suffix in ("out", "err"):
                outputs[suffix] = "".join(
                    "".join(f"[{r}] {line}" for line in Path(out, f"{r}.{suffix}").read_text().splitlines(True))
                    if np is not None else Path(out, f"{r}.{suffix}").read_text()
                    for r in range(len(answer["codes"])))
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(f"{script} {args}", timeout, outputs["out"], outputs["err"])
        failed = [c for c in answer["codes"] if c != 0]
        return subprocess.CompletedProcess([str(script), *args], failed[0] if failed else 0, outputs["out"],
                                           outputs["err"])


_rank_forks = _RankForks()


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
        argv = [str(script), *map(str, args)]
        proc = _rank_forks.run(script, args, np, clean_env(env), cwd or REPO, timeout)
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
    return _rank_forks.run(script, args, None, clean_env(), REPO, timeout)


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
        except Exception as e:  # noqa: BLE001 (the job's own failure, reported by each of its tests)
            _check_jobs[key] = e
    result = _check_jobs[key]
    if isinstance(result, Exception):
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
