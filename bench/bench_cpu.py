"""CPU resources on the MNIST example with 2 ranks: torchmn's thread budget against the classic
oversubscription, against the best settings a ``torchmn tune`` finds, and ``torchmn doctor``'s
verdicts on those runs.

    python bench/bench_cpu.py                         # all parts (about 10 minutes on 2 cores)
    python bench/bench_cpu.py --parts budget --repeats 3
    python bench/bench_cpu.py --parts tune --n-trials 20

Parts:

- ``budget``: ``torchmn run -np 2 python examples/mnist/train_mnist.py --n-train 1000 --batch-size 50``
  with torchmn's default budget, with ``OMP_NUM_THREADS=2`` in every rank (each rank opens one
  thread per core: the classic failure), and with that plus 4 DataLoader workers per rank
  (``TORCHMN_NUM_WORKERS=4``, which the example's ``dataloader_workers_budget`` then returns);
  the training time the example logs, median of ``--repeats``, interleaved;
- ``tune``: ``torchmn tune -np 2 --n-trials N`` of the same command (a fresh study), then its best
  settings and the default run again, interleaved, ``--repeats`` times each, so that the comparison
  is not the best of N noisy runs against a median;
- ``doctor``: ``torchmn doctor -np 2`` on the three ``budget`` configurations (with more epochs, so
  that the job is still training when it is sampled): the verdict and the fix it prints.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from allocator import ALLOCATOR_ENV

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = [str(REPO / "examples" / "mnist" / "train_mnist.py"), "--n-train", "1000", "--batch-size", "50"]
CONFIGS = {
    "torchmn's default budget": {},
    "OMP_NUM_THREADS=2 in each rank": {"OMP_NUM_THREADS": "2"},
    "OMP_NUM_THREADS=2 and 4 DataLoader workers per rank": {"OMP_NUM_THREADS": "2", "TORCHMN_NUM_WORKERS": "4"},
}


def clean_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "OMP_", "MKL_", "OPENBLAS_"))}
    env.update(ALLOCATOR_ENV, **extra)
    return env


def train_time(extra: dict, tmp: str, timeout: float) -> float:
    log = os.path.join(tmp, "log.json")
    argv = [sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable] + EXAMPLE + ["--log-file", log]
    proc = subprocess.run(argv, env=clean_env(extra), capture_output=True, text=True, timeout=timeout, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"{extra} failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(log).read_text())[-1]["elapsed_time"]


def interleaved(configs: dict, repeats: int, timeout: float) -> dict:
    times = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for name, extra in configs.items():
                times[name].append(train_time(extra, tmp, timeout))
                print(f"{i + 1}/{repeats} {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    return times


def table(times: dict, reference: str) -> str:
    med = {n: statistics.median(v) for n, v in times.items()}
    rows = ["| configuration | training time (median) | runs | vs the default |", "|---|---|---|---|"]
    for n, v in times.items():
        rows.append(f"| {n} | {med[n]:.2f} s | {', '.join(f'{t:.2f}' for t in v)} | {med[n] / med[reference]:.2f}x |")
    return "\n".join(rows)


def budget_part(args) -> str:
    times = interleaved(CONFIGS, args.repeats, args.timeout)
    return table(times, "torchmn's default budget") + \
        f"\n\n2 ranks on this machine's {len(os.sched_getaffinity(0))} CPUs; median of {args.repeats} runs, interleaved."


def tune_part(args) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.json")
        argv = [sys.executable, "-m", "torchmn", "tune", "-np", "2", "--n-trials", str(args.n_trials),
                "--storage", f"sqlite:///{tmp}/tune.db", "--log", log, "--",
                sys.executable] + EXAMPLE + ["--log-file", log]
        proc = subprocess.run(argv, env=clean_env({}), capture_output=True, text=True, timeout=args.timeout * 40,
                              cwd=tmp)
        if proc.returncode != 0:
            raise RuntimeError(f"torchmn tune failed:\n{proc.stderr[-3000:]}")
    best_line = next(line for line in proc.stdout.splitlines() if line.startswith("best ("))
    settings = dict(re.findall(r"(TORCHMN_\w+)=(\S+)", best_line))
    times = interleaved({"torchmn's default budget": {}, "the best of the tune": settings}, args.repeats, args.timeout)
    return (f"`torchmn tune -np 2 --n-trials {args.n_trials} --log LOG -- python {' '.join(EXAMPLE[0:1])} ...`:\n\n"
            f"```\n{proc.stdout.strip()}\n```\n\nThe best settings and the default, run again:\n\n"
            + table(times, "torchmn's default budget"))


def doctor_part(args) -> str:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CONFIGS.items():
            argv = [sys.executable, "-m", "torchmn", "doctor", "-np", "2", "--", sys.executable] + EXAMPLE + \
                ["--epochs", "200", "--log-file", os.path.join(tmp, "log.json")]
            proc = subprocess.run(argv, env=clean_env(extra), capture_output=True, text=True, timeout=args.timeout,
                                  cwd=tmp)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("verdict", "fix", "runnable"))]
            out.append(f"{name} (exit status {proc.returncode}):\n```\n" + "\n".join(lines) + "\n```")
    return "\n\n".join(out)


PARTS = {"budget": budget_part, "tune": tune_part, "doctor": doctor_part}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-trials", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    args = parser.parse_args()
    for part in args.parts:
        print(f"\n### {part}\n\n{PARTS[part](args)}", flush=True)


if __name__ == "__main__":
    main()
