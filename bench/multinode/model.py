"""An alpha-beta model of gradient averaging across nodes: fitted from the emulated nodes'
measurements, checked against them, then used to predict data-parallel scaling to 1,024 nodes.

    python bench/multinode/bench_allreduce.py --links 100mbit 1gbit 10gbit --ranks-per-node 1 2 \\
        --json allreduce.json                                                # as root
    python bench/multinode/model.py --fit allreduce.json --plot docs/images/scaling_model.png

A message of n bytes costs alpha + n beta (alpha: a message's latency; beta: seconds per byte of a
node's link). For p = N x k ranks, N nodes of k ranks each, numbered node by node:

- ring (gloo's allreduce, torchmn's ``flat``): 2(p-1) steps of n/p bytes; each node has one ring
  edge out across the link, so 2(p-1) alpha + 2(p-1)/p n beta, unless the node's memory is slower:
  its k - 1 edges inside move their n/p bytes through it at once (2 k mu a byte, mu below);
- recursive halving-doubling (Rabenseifner): 2 log2 p steps; in the log2 N steps that cross nodes
  all k ranks of a node share its link: 2 log2 p alpha + 2 k (N-1)/N n beta;
- binomial tree (reduce, then broadcast, whole messages): 2 log2 p (alpha + n beta);
- hierarchical (torchmn's default): the node's ranks sum in shared memory, one rank a node runs the
  ring across the nodes, and every rank copies the result out: 2(N-1) alpha + 2(N-1)/N n beta plus
  3 n k mu (each rank writes, reads and copies n bytes of the node's memory, mu seconds per byte);
- sharded (ZeRO: reduce-scatter in backward, all-gather after the update): the ring's two halves,
  the same total.

``fit`` finds one profile's alpha and beta by least squares on the relative error of the ring's
rows with one rank a node (alpha held at 0 where the best fit would make it negative); mu comes from the hierarchical rows of one profile. ``--fit`` prints the
fitted values and every measured row beside its prediction (2 ranks a node and the other profiles
are predictions, not fits), then predicts the scaling efficiency of three models on 8 ranks a node
at 25 and 100 Gbit/s (see docs/design/scaling.md for the assumptions) and draws it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Link:
    """A node's network: ``alpha`` seconds a message, ``beta`` seconds a byte."""
    alpha: float
    beta: float


def ring(n: float, nodes: int, per_node: int, link: Link, mu: float = 0.0) -> float:
    """Seconds of a ring allreduce of ``n`` bytes over ``nodes`` x ``per_node`` ranks.

    Example::

        >>> round(ring(8e6, 2, 1, Link(1e-4, 8e-9)), 6)     # 2 alpha + n beta
        0.0642
    """
    p = nodes * per_node
    if p == 1:
        return 0.0
    # Each step, the node's edge across the link and its edges inside (k flows, each copied out
    # and in through memory) run at once: the slower sets the step's pace.
    per_byte = max(link.beta if nodes > 1 else 0.0, 2 * per_node * mu if per_node > 1 else 0.0)
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n * per_byte


def halving_doubling(n: float, nodes: int, per_node: int, link: Link, mu: float = 0.0) -> float:
    """Seconds of Rabenseifner's recursive halving-doubling allreduce (``p`` a power of two).

    Example::

        >>> round(halving_doubling(8e6, 4, 1, Link(1e-4, 8e-9)), 6)
        0.0964
    """
    p = nodes * per_node
    if p == 1:
        return 0.0
    return 2 * math.log2(p) * link.alpha + 2 * per_node * (nodes - 1) / nodes * n * link.beta


def tree(n: float, nodes: int, per_node: int, link: Link, mu: float = 0.0) -> float:
    """Seconds of a binomial-tree reduce and broadcast of whole messages.

    Example::

        >>> round(tree(8e6, 4, 1, Link(1e-4, 8e-9)), 6)
        0.2564
    """
    p = nodes * per_node
    return 2 * math.ceil(math.log2(p)) * (link.alpha + n * link.beta) if p > 1 else 0.0


def hierarchical(n: float, nodes: int, per_node: int, link: Link, mu: float = 0.0) -> float:
    """Seconds of torchmn's hierarchical allreduce: shared memory inside a node, a ring of one rank
    a node across (with one rank a node, the ring alone: no shared memory is set up then).

    Example::

        >>> round(hierarchical(8e6, 2, 2, Link(1e-4, 8e-9), mu=1e-10), 6)
        0.069
    """
    intra = 3 * n * per_node * mu if per_node > 1 else 0.0
    return intra + ring(n, nodes, 1, link)


def sharded(n: float, nodes: int, per_node: int, link: Link, mu: float = 0.0) -> float:
    """Seconds of a ring reduce-scatter and all-gather (ZeRO): the ring allreduce's two halves."""
    return ring(n, nodes, per_node, link, mu)


ALGORITHMS = {"ring": ring, "halving-doubling": halving_doubling, "tree": tree, "hierarchical": hierarchical,
              "sharded": sharded}


def fit(rows: Iterable[tuple[float, int, int, float]]) -> Link:
    """The ``Link`` whose ring best explains measured rows, by least squares on relative error.

    Args:
        rows: ``(bytes, nodes, ranks_per_node, seconds)`` of ring allreduces across nodes.

    Returns:
        The fitted alpha and beta.

    Raises:
        ValueError: fewer than two rows, or rows that cannot tell alpha from beta.

    Example::

        >>> truth = Link(5e-5, 1e-8)
        >>> fitted = fit([(n, 2, 1, ring(n, 2, 1, truth)) for n in (1e5, 1e6, 1e7)])
        >>> round(fitted.alpha, 12), round(fitted.beta, 15)
        (5e-05, 1e-08)
    """
    a, b = [], []
    for n, nodes, per_node, seconds in rows:
        p = nodes * per_node
        coefficients = [2 * (p - 1), 2 * (p - 1) / p * n]  # of alpha and beta in ring()
        a.append([c / seconds for c in coefficients])   # relative error: small messages count too
        b.append(1.0)
    if len(a) < 2 or np.linalg.matrix_rank(np.array(a)) < 2:
        raise ValueError("fitting alpha and beta needs at least two rows of different message sizes")
    a, b = np.array(a), np.array(b)
    (alpha, beta), *_ = np.linalg.lstsq(a, b, rcond=None)
    if alpha < 0:  # latency below what the rows resolve: bandwidth alone
        alpha, beta = 0.0, float(a[:, 1] @ b / (a[:, 1] @ a[:, 1]))
    return Link(float(alpha), float(beta))


def fit_memory(rows: Iterable[tuple[float, int, int, float]], link: Link) -> float:
    """mu (seconds per byte of a node's shared-memory pass) that best explains hierarchical rows
    with several ranks a node, beyond their ring across the nodes.

    Example::

        >>> link = Link(5e-5, 1e-8)
        >>> round(fit_memory([(1e7, 2, 2, hierarchical(1e7, 2, 2, link, mu=2e-10))], link), 15)
        2e-10
    """
    xs, ys = [], []
    for n, nodes, per_node, seconds in rows:
        xs.append(3 * n * per_node / seconds)
        ys.append(1.0 - ring(n, nodes, 1, link) / seconds)
    x, y = np.array(xs), np.array(ys)
    return max(0.0, float(x @ y / (x @ x)))


# --------------------------------------------------------------------------------- predictions
# What a data-parallel step costs at scale: gradient bytes and compute seconds per step on one
# accelerator (assumptions, stated in docs/design/scaling.md), and the share of communication that
# can hide behind backward (about two thirds of a step's compute).
WORKLOADS = {
    "MNIST MLP (1.8 M params, fp32)": (1.8e6 * 4, 0.002),
    "ResNet-50 (25.6 M params, fp32 grads)": (25.6e6 * 4, 0.10),
    "1 B transformer (bf16 grads)": (1e9 * 2, 1.6),
}
HIDDEN = 2 / 3
NODE_COUNTS = [2 ** i for i in range(11)]           # 1 .. 1024
RANKS_PER_NODE = 8
INTRA_NODE_BYTES_PER_S = 100e9                      # the node's own fabric (NVLink / memory)
ALPHA_AT_SCALE = 10e-6                              # one message across a datacenter network


def efficiency(n_bytes: float, compute_s: float, nodes: int, per_node: int, link: Link, mu: float,
               algorithm: str) -> float:
    """Weak-scaling efficiency of one step: compute / (compute + communication left exposed).

    Example::

        >>> round(efficiency(1e8, 0.1, 64, 8, Link(1e-5, 8 / 25e9), 1e-11, "hierarchical"), 2)
        0.82
    """
    if nodes * per_node == 1:
        return 1.0
    averaging = ALGORITHMS[algorithm](n_bytes, nodes, per_node, link, mu)
    return compute_s / (compute_s + max(0.0, averaging - HIDDEN * compute_s))


def predictions(gbits: Sequence[float]) -> dict:
    """Efficiency per workload, link rate, algorithm and node count (8 ranks a node)."""
    mu = 1.0 / INTRA_NODE_BYTES_PER_S
    out = {}
    for name, (n_bytes, compute_s) in WORKLOADS.items():
        for rate in gbits:
            link = Link(ALPHA_AT_SCALE, 8 / (rate * 1e9))
            for algorithm in ("ring", "hierarchical"):
                out[(name, rate, algorithm)] = [efficiency(n_bytes, compute_s, nodes, RANKS_PER_NODE, link, mu,
                                                           algorithm) for nodes in NODE_COUNTS]
    return out


def plot(table: dict, gbits: Sequence[float], path: str) -> None:
    """Efficiency against nodes, one panel per link rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(gbits), figsize=(6 * len(gbits), 4), sharey=True)
    colors = dict(zip(WORKLOADS, ("tab:blue", "tab:orange", "tab:green")))
    for ax, rate in zip(np.atleast_1d(axes), gbits):
        for name in WORKLOADS:
            for algorithm, style in (("hierarchical", "-"), ("ring", "--")):
                ax.plot(NODE_COUNTS, table[(name, rate, algorithm)], style, color=colors[name], marker=".",
                        label=f"{name}, {'hierarchical' if style == '-' else 'flat ring'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"nodes ({RANKS_PER_NODE} ranks each), {rate:g} Gbit/s")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("weak-scaling efficiency")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("torchmn's alpha-beta model: predicted data-parallel scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", required=True, metavar="FILE", help="bench_allreduce.py --json output")
    parser.add_argument("--memory-from", default="1gbit", help="the profile whose hierarchical rows give mu")
    parser.add_argument("--gbits", nargs="+", type=float, default=[25.0, 100.0])
    parser.add_argument("--plot", default=None, metavar="PNG")
    args = parser.parse_args()
    with open(args.fit) as f:
        measured = json.load(f)
    links = {}
    print("| link | alpha us | beta ns/B | rate fitted | rate set |")
    print("|---|---|---|---|---|")
    from nodes import PROFILES
    for profile in dict.fromkeys(r["link"] for r in measured):
        rows = [(r["bytes"], r["nodes"], 1, r["seconds"]["torchmn flat"]) for r in measured
                if r["link"] == profile and r["ranks_per_node"] == 1]
        links[profile] = fit(rows)
        print(f"| {profile} | {links[profile].alpha * 1e6:.0f} | {links[profile].beta * 1e9:.3f} | "
              f"{8 / links[profile].beta / 1e9:.3g} Gbit/s | {PROFILES[profile] * 8 / 1e9:g} Gbit/s |")
    hier = [(r["bytes"], r["nodes"], r["ranks_per_node"], r["seconds"]["torchmn hierarchical"]) for r in measured
            if r["link"] == args.memory_from and r["ranks_per_node"] > 1]
    mu = fit_memory(hier, links[args.memory_from]) if hier else 0.0
    print(f"\nmu (shared memory, from {args.memory_from}'s hierarchical rows): {mu * 1e9:.3f} ns/B "
          f"({1 / mu / 1e9:.2f} GB/s)" if mu else "\nmu: no hierarchical rows with several ranks a node")
    print("\n| link | nodes x ranks | MB | way | measured ms | model ms | model / measured | fitted on |")
    print("|---|---|---|---|---|---|---|---|")
    within, total = 0, 0
    for r in measured:
        for way, algorithm in (("torchmn flat", "ring"), ("torchmn hierarchical", "hierarchical")):
            if way == "torchmn hierarchical" and r["ranks_per_node"] == 1:
                continue  # the same ring as flat
            model = ALGORITHMS[algorithm](r["bytes"], r["nodes"], r["ranks_per_node"], links[r["link"]], mu)
            seconds = r["seconds"][way]
            fitted = ("alpha, beta" if way == "torchmn flat" and r["ranks_per_node"] == 1 else
                      "mu" if way == "torchmn hierarchical" and r["link"] == args.memory_from else "-")
            within += fitted == "-" and abs(model / seconds - 1) <= 0.2
            total += fitted == "-"
            print(f"| {r['link']} | {r['nodes']} x {r['ranks_per_node']} | {r['bytes'] / (1 << 20):g} | {algorithm} | "
                  f"{seconds * 1e3:.2f} | {model * 1e3:.2f} | {model / seconds:.2f} | {fitted} |")
    print(f"\npredicted rows within 20% of the measurement: {within} of {total}")
    table = predictions(args.gbits)
    print("\n| workload | Gbit/s | way | " + " | ".join(f"{n} nodes" for n in NODE_COUNTS[1::3]) + " |")
    print("|---|---|---|" + "---|" * len(NODE_COUNTS[1::3]))
    for (name, rate, algorithm), effs in table.items():
        print(f"| {name} | {rate:g} | {'flat ring' if algorithm == 'ring' else algorithm} | " +
              " | ".join(f"{e:.0%}" for e in effs[1::3]) + " |")
    if args.plot:
        plot(table, args.gbits, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
