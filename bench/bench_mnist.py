"""The ChainerMN MNIST workload: torchmn on 2 ranks vs torchrun + DDP (and + ZeroRedundancyOptimizer)
on 2 ranks vs one process.

    python bench/bench_mnist.py                    # 5 repeats, the table in BENCHMARKS.md
    python bench/bench_mnist.py --repeats 1 --epochs 2

The workload: MLP 784-1000-1000-10, Adam, 1000 training images of the bundled MNIST subset,
20 epochs, a global batch of 100 (100 in one process, 50 per rank on 2 ranks: the same updates),
validation every epoch. Each run is a fresh process tree; the figure is the training time the
script itself logs (its last epoch's ``elapsed_time``), so start-up is not counted for anybody.
Threads: the whole machine for everyone (one process with all CPUs; 2 ranks with half each).
The variants run interleaved, repeat after repeat, so machine noise hits all of them alike.

torchmn's split updates (its default on one node, and ``--shard-state``) step Adam with torch's
fused kernel; torch's default Adam on the CPU is its for-loop implementation. So the DDP peer runs
with both, and so does its ZeRO peer (DDP + ``ZeroRedundancyOptimizer``, the peer of
``--shard-state``): the fused rows are torchmn's like-for-like peers.
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

from allocator import ALLOCATOR_ENV

REPO = Path(__file__).resolve().parent.parent
MNIST = REPO / "examples" / "mnist"


# The DDP peers: (row, mnist_ddp.py's flags).
DDP = "torchrun + DDP, 2 ranks"
DDP_FUSED = "torchrun + DDP fused Adam, 2 ranks"
ZERO = "torchrun + DDP + ZeRO, 2 ranks"
ZERO_FUSED = "torchrun + DDP + ZeRO fused Adam, 2 ranks"
DDP_PEERS = {DDP: [], DDP_FUSED: ["--fused"], ZERO: ["--zero"], ZERO_FUSED: ["--zero", "--fused"]}
# The ratio columns: (reference row, heading); and how each row's Adam update runs.
REFERENCES = [(DDP, "vs DDP"), (DDP_FUSED, "vs DDP fused Adam"), (ZERO, "vs DDP + ZeRO"),
              (ZERO_FUSED, "vs DDP + ZeRO fused Adam")]
ADAM_UPDATE = {DDP: "for-loop", DDP_FUSED: "fused", ZERO: "for-loop", ZERO_FUSED: "fused",
               "torchmn, 2 ranks": "fused", "torchmn shard_state, 2 ranks": "fused"}


def variants(cpus: int, extra: list[str]) -> dict[str, tuple[list[str], dict]]:
    py = sys.executable
    half = str(max(1, cpus // 2))
    ddp = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "bench" / "mnist_ddp.py"), "--batch-size", "50"]
    return {
        f"1 process, {cpus} threads": ([py, str(MNIST / "train_mnist_single.py"), "--batch-size", "100"] + extra,
                                       {"OMP_NUM_THREADS": str(cpus)}),
        **{name: (ddp + flags + extra, {"OMP_NUM_THREADS": half}) for name, flags in DDP_PEERS.items()},
        "torchmn, 2 ranks": ([py, "-m", "torchmn", "run", "-np", "2", py, str(MNIST / "train_mnist.py"),
                              "--batch-size", "50"] + extra, {}),
        "torchmn shard_state, 2 ranks": ([py, "-m", "torchmn", "run", "-np", "2", py, str(MNIST / "train_mnist.py"),
                                          "--batch-size", "50", "--shard-state"] + extra, {}),
    }


def run_once(argv: list[str], env_extra: dict, log: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(ALLOCATOR_ENV, **env_extra)
    proc = subprocess.run(argv + ["--log-file", str(log)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    entries = json.loads(log.read_text())
    return entries[-1]["elapsed_time"], entries[-1]["validation/main/accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--only", nargs="*", help="run only variants whose name contains one of these")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    extra = ["--epochs", str(args.epochs), "--n-train", str(args.n_train)]
    todo = variants(cpus, extra)
    if args.only:
        todo = {k: v for k, v in todo.items() if any(o in k for o in args.only)}
    times = {name: [] for name in todo}
    accuracy = {name: [] for name in todo}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, (argv, env) in todo.items():
                t, acc = run_once(argv, env, Path(tmp) / f"log{r}.json")
                times[name].append(t)
                accuracy[name].append(acc)
                print(f"# repeat {r + 1}: {name}: {t:.2f} s, validation accuracy {acc:.3f}", file=sys.stderr)
    med = {name: statistics.median(v) for name, v in times.items()}
    one = next((k for k in med if k.startswith("1 process")), None)
    references = [(one, "vs 1 process")] + REFERENCES

    def ratio(t, ref):  # "-" where the reference did not run
        return f"{t / med[ref]:.2f}x" if ref in med else "-"

    print(f"# MNIST MLP, {args.n_train} images, {args.epochs} epochs, global batch 100, {cpus} CPUs; "
          f"median of {args.repeats}")
    head = ["variant", "Adam update", "training time (median)", "runs"] + [h for _, h in references] + ["val. accuracy"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, t in med.items():
        runs = ", ".join(f"{x:.2f}" for x in times[name])
        cells = ([name, ADAM_UPDATE.get(name, "for-loop"), f"{t:.2f} s", runs]  # one process: torch's default
                 + [ratio(t, ref) for ref, _ in references] + [f"{statistics.median(accuracy[name]):.3f}"])
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
