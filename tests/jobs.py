"""Running real multi-process jobs from tests: every job has a hard timeout, so a hang fails fast."""
from __future__ import annotations

import os
import subprocess
import sys
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


def launcher_argv(launcher: str, np: int) -> list[str]:
    if launcher == "torchmn":
        return [sys.executable, "-m", "torchmn", "run", "-np", str(np)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(np),
                "--standalone", "--no-python", sys.executable]
    raise ValueError(launcher)


def run_job(script: str | Path, args: list[str], *, np: int = 2, launcher: str = "torchmn",
            timeout: float = 120, env: dict | None = None, cwd: str | Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``np`` ranks under ``launcher``; fail the test on error or timeout."""
    argv = launcher_argv(launcher, np)
    argv += ([sys.executable] if launcher == "torchmn" else []) + [str(script)] + list(args)
    proc = subprocess.run(argv, cwd=cwd or REPO, env=clean_env(env), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"job failed with exit code {proc.returncode}: {' '.join(argv)}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc
