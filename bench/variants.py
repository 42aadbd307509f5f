"""Running one variant of a benchmark as a fresh job: one process, torchrun, or torchmn run, each
rank given the same threads and allocator settings, and the result line its rank 0 prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from allocator import ALLOCATOR_ENV

REPO = Path(__file__).resolve().parent.parent
# What a benchmark's rank 0 prints before its JSON result.
RESULT = "BENCH_RESULT "


def run_job(name: str, launcher: str, ranks: int, threads: int, own: list, timeout: float,
            launcher_args: tuple = ()) -> dict:
    """Start ``own`` (a script and its arguments) as a job and return what its rank 0 printed.

    Args:
        name: the variant, for the error message.
        launcher: ``"python"`` (one process), ``"torchrun"`` or ``"torchmn"``.
        ranks: ranks on this machine (ignored for ``"python"``).
        threads: the thread budget of every rank (``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``).
        own: the script's path and arguments.
        timeout: seconds the job may take.
        launcher_args: more options for ``torchmn run`` (``("--bind", "core")``).

    Returns:
        The JSON object after :data:`RESULT` in the job's last result line.

    Raises:
        RuntimeError: the job failed or printed no result; with its command and the tails of its output.

    Example::

        >>> run_job("ddp", "torchrun", 2, 1, [__file__, "--worker", "ddp"], timeout=600)["seconds"]
        4.2
    """
    if launcher == "python":
        argv = [sys.executable] + own
    elif launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                "--no-python", sys.executable] + own
    else:
        argv = [sys.executable, "-m", "torchmn", "run", "-np", str(ranks), *launcher_args, sys.executable] + own
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "TORCHELASTIC_"))}
    env.update(ALLOCATOR_ENV, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if RESULT in ln]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {' '.join(argv)}\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1].split(RESULT, 1)[1])
