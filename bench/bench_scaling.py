"""ChainerMN's MNIST scaling table (processes x nodes x time), reproduced with torchmn, and its plot.

    python bench/bench_scaling.py                       # needs root: builds 2 "nodes" (below)
    python bench/bench_scaling.py --repeats 1 --epochs 2

The workload of ChainerMN's MNIST example: MLP 784-1000-1000-10, Adam, 20 epochs, batch 100 per
process (the global batch grows with the process count, as in ChainerMN), here on 1000 images of
the bundled subset. Rows: 1, 2 and 4 processes on one node, and 2 "nodes" x 1 and x 2 processes,
the nodes being emulated (``bench/multinode/nodes.py``): network namespaces with their own
addresses, hostnames and sshd, each pinned to cores of its own (on 2 cores, 1 each; on 16, 8 each),
started through ``torchmn run -H`` over ssh, so the inter-node traffic really crosses a network
stack, the hierarchical communicator really has two nodes, and each node's ranks share only their
node's cores (torchmn's thread budget follows them). One-node rows run on the first node alone.
``--link`` shapes the link between the nodes (default: unshaped, the veth's own speed).

Time is the training time the example logs (its last epoch's ``elapsed_time``); median of
``--repeats``. Writes the markdown table to stdout and the plot to ``--plot`` (PNG).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench" / "multinode"))
from nodes import PROFILES, EmulatedNodes, job_env  # noqa: E402

from allocator import ALLOCATOR_ENV  # noqa: E402

SCRIPT = REPO / "examples" / "mnist" / "train_mnist.py"
ROWS = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]  # (processes, nodes)


def command(procs: int, nodes: int, emulated: EmulatedNodes, extra: list[str], log: Path) -> list[str]:
    return emulated.torchmn_run(procs // nodes, [sys.executable, str(SCRIPT), "--log-file", str(log)] + extra,
                                extra=[a for name in ALLOCATOR_ENV for a in ("-x", name)], nodes=nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--n-train", type=int, default=1000)
    parser.add_argument("--plot", default=str(REPO / "bench" / "scaling_mnist.png"))
    parser.add_argument("--link", choices=list(PROFILES), default=None, help="shape the link (default: unshaped)")
    args = parser.parse_args()
    extra = ["--epochs", str(args.epochs), "--n-train", str(args.n_train), "--batch-size", "100"]
    times = {row: [] for row in ROWS}
    accuracy = {row: [] for row in ROWS}
    env = {k: v for k, v in job_env().items() if not k.startswith(("OMP_", "MKL_"))}
    env.update(ALLOCATOR_ENV)
    with EmulatedNodes(2, args.link) as emulated, tempfile.TemporaryDirectory() as tmp:
        cpus = len(emulated.cores[0])
        for r in range(args.repeats):
            for procs, nodes in ROWS:
                log = Path(tmp) / f"log_{procs}_{nodes}_{r}.json"
                # Threads: torchmn's budget, from each node's own cores.
                proc = subprocess.run(command(procs, nodes, emulated, extra, log), cwd=tmp, env=env,
                                      capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    raise RuntimeError(f"{procs} processes on {nodes} node(s) failed:\n{proc.stderr[-3000:]}")
                last = json.loads(log.read_text())[-1]
                times[(procs, nodes)].append(last["elapsed_time"])
                accuracy[(procs, nodes)].append(last["validation/main/accuracy"])
                print(f"# repeat {r + 1}: {procs} processes, {nodes} node(s): "
                      f"{last['elapsed_time']:.2f} s", file=sys.stderr)
    med = {row: statistics.median(v) for row, v in times.items()}
    print(f"# ChainerMN MNIST scaling: {args.n_train} images, {args.epochs} epochs, batch 100 per process, "
          f"{cpus} core(s) a node, link {args.link or 'unshaped'}; median of {args.repeats}")
    print("| processes | nodes | time | runs | vs 1 process | training images/s | val. accuracy |")
    print("|---|---|---|---|---|---|---|")
    base = med[(1, 1)]
    for (procs, nodes), t in med.items():
        runs = ", ".join(f"{x:.2f}" for x in times[(procs, nodes)])
        print(f"| {procs} | {nodes} | {t:.2f} s | {runs} | {t / base:.2f}x | "
              f"{args.epochs * args.n_train / t:.0f} images/s | {statistics.median(accuracy[(procs, nodes)]):.3f} |")
    plot(med, args.plot, cpus)
    print(f"# plot: {args.plot}")


def plot(med: dict, path: str, cpus: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{p} proc\n{n} node{'s' if n > 1 else ''}" for p, n in med]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, list(med.values()), color=["#4c72b0" if n == 1 else "#dd8452" for _, n in med])
    ax.bar_label(bars, fmt="%.1f s")
    ax.set_ylabel("training time (s)")
    ax.set_title(f"torchmn, ChainerMN MNIST workload ({cpus} core(s) a node)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
