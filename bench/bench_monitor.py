"""What the monitor costs: the MNIST example on 2 ranks under torchmn run, with --monitor and
without, and with --timeline, interleaved repeat after repeat.

    python bench/bench_monitor.py                 # 7 repeats of 5 epochs, the table in BENCHMARKS.md
    python bench/bench_monitor.py --repeats 3 --epochs 2

The figure is the training time the example logs itself (its last epoch's ``elapsed_time``), so
start-up is not counted; the ratio column is each row's median over the plain run's median, taken
in the same run. The workload: MLP 784-1000-1000-10, Adam, 1000 training images of the bundled
MNIST subset, a global batch of 100 (50 per rank), validation every epoch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MNIST = REPO / "examples" / "mnist" / "train_mnist.py"
VARIANTS = {"torchmn run, 2 ranks": [], "with --monitor": ["--monitor"],
            "with --timeline": ["--timeline", "{tmp}/timeline.json"]}


def run_once(flags: list[str], epochs: int, tmp: str) -> float:
    log = Path(tmp) / "log.json"
    argv = ([sys.executable, "-m", "torchmn", "run", "-np", "2"] + [f.format(tmp=tmp) for f in flags] +
            [sys.executable, str(MNIST), "--batch-size", "50", "--epochs", str(epochs), "--log-file", str(log)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "OMP_", "MASTER_"))}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(log.read_text())[-1]["elapsed_time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.repeats):
        for name, flags in VARIANTS.items():
            with tempfile.TemporaryDirectory() as tmp:
                times[name].append(run_once(flags, args.epochs, tmp))
            print(f"repeat {r}: {name}: {times[name][-1]:.3f} s", file=sys.stderr, flush=True)
    base = statistics.median(times["torchmn run, 2 ranks"])
    print(f"| run ({args.epochs} epochs) | median s | min-max s | vs without |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.3f} | {min(ts):.3f}-{max(ts):.3f} | {m / base:.3f}x |")


if __name__ == "__main__":
    main()
