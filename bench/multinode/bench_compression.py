"""Gradient compression across emulated nodes: the MNIST example trained with gradients whole,
in fp16, and as PowerSGD's low-rank approximations, on a slow link.

    python bench/multinode/bench_compression.py                        # 2 nodes x 1 rank, 100mbit (root)
    python bench/multinode/bench_compression.py --links 100mbit 1gbit --repeats 3

Each run is ``examples/mnist/train_mnist.py`` (MLP 784-1000-1000-10, 1.8 M parameters, Adam,
batches of 100 a rank, the bundled 5,000 images) under ``torchmn run`` on 2 emulated nodes
(``nodes.py``: network namespaces with cores of their own and a tbf-shaped link). The ways run
interleaved, ``--repeats`` times each; the table gives the median seconds per epoch (the example's
own clock: training and validation, from the second epoch on, so start-up is left out) and the
final validation accuracy (the median over repeats; the same seed everywhere).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nodes import PROFILES, REPO, EmulatedNodes, job_env  # noqa: E402

WAYS = {"none": [], "fp16": ["--compression", "fp16"], "powersgd": ["--compression", "powersgd"]}


def run_once(nodes: EmulatedNodes, way: str, epochs: int, log: str) -> list:
    """One training run; its log, one entry per epoch."""
    argv = nodes.torchmn_run(1, [sys.executable, str(REPO / "examples" / "mnist" / "train_mnist.py"),
                                 "--epochs", str(epochs), "--log", log, *WAYS[way]])
    proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{way}: the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(log) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["100mbit"], choices=list(PROFILES))
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    args = parser.parse_args()
    print("| link | gradients | s per epoch (median) | min-max | vs whole | validation accuracy |")
    print("|---|---|---|---|---|---|")
    for link in args.links:
        per_epoch = {way: [] for way in args.ways}
        accuracy = {way: [] for way in args.ways}
        with EmulatedNodes(2, link) as nodes, tempfile.TemporaryDirectory() as folder:
            for repeat in range(args.repeats):
                for way in args.ways:
                    log = run_once(nodes, way, args.epochs, os.path.join(folder, f"{way}-{repeat}.json"))
                    times = [e["elapsed_time"] for e in log]
                    per_epoch[way].append((times[-1] - times[0]) / (len(times) - 1))
                    accuracy[way].append(log[-1]["validation/main/accuracy"])
        base = statistics.median(per_epoch[args.ways[0]])
        for way in args.ways:
            med = statistics.median(per_epoch[way])
            print(f"| {link} | {way} | {med:.2f} | {min(per_epoch[way]):.2f}-{max(per_epoch[way]):.2f} | "
                  f"{med / base:.2f}x | {statistics.median(accuracy[way]):.3f} |", flush=True)


if __name__ == "__main__":
    main()
