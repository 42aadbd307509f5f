"""Allreduce across emulated nodes: torchmn's ``flat`` and ``hierarchical`` against raw gloo, beside the
link's floor.

    python bench/multinode/bench_allreduce.py                          # 2 nodes x 1 rank, 1gbit (root)
    python bench/multinode/bench_allreduce.py --links 100mbit 1gbit 10gbit --ranks-per-node 1 2
    python bench/multinode/bench_allreduce.py --collective shard --links 1gbit 10gbit

Every row runs on ``--nodes`` emulated nodes (2 by default; ``nodes.py``: network namespaces, each with its own cores, the
link shaped with tc's token bucket both ways). In one job, rounds interleave the three ways at each
size: ``dist.all_reduce`` on the world group (raw gloo), ``allreduce_flat`` of a ``flat``
communicator (one gloo allreduce over every rank) and of the default ``hierarchical`` one (shared
memory inside a node, the nodes' first ranks across). Each figure is the median over ``--rounds``
of the slowest rank's time per call. The floor is what the link allows for an allreduce among the
nodes: bytes x 2(n-1)/n / rate, n the node count; ``of line rate`` is floor / time of the faster
torchmn way.

``--collective shard`` times the sharded optimizer's pair instead, a reduce-scatter then an
all-gather (the bytes of one allreduce): raw gloo sends each peer its chunk as one message
(``all_to_all_single`` and a local sum, then ``all_gather_into_tensor``), torchmn's
``reduce_scatter_flat`` and ``allgather_flat`` send chunks over 512 KB between nodes in pieces.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nodes import PROFILES, REPO, EmulatedNodes, job_env  # noqa: E402
from rounds import time_rounds  # noqa: E402

SIZES_MB = (0.1, 1, 7.2, 64)
WAYS = {"allreduce": ("gloo all_reduce", "torchmn flat", "torchmn hierarchical"),
        "shard": ("gloo whole messages", "torchmn flat", "torchmn hierarchical")}


def shard_ways(comm, flat) -> dict:
    """The reduce-scatter then all-gather of each way, on the first ``size * k`` elements of ``x``."""
    import torch
    import torch.distributed as dist

    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    buffers: dict = {}

    def buffers_for(x):
        if x.numel() not in buffers:
            k = x.numel() // comm.size
            buffers[x.numel()] = (torch.empty(k), torch.empty(comm.size * k), torch.empty(comm.size * k))
        return buffers[x.numel()]

    def gloo(x):
        shard, out, chunks = buffers_for(x)
        dist.all_to_all_single(chunks, x[:out.numel()])
        torch.sum(chunks.view(comm.size, -1), dim=0, out=shard)
        all_gather_single(out, shard)

    def torchmn_way(c):
        def run(x):
            shard, out, _ = buffers_for(x)
            c.reduce_scatter_flat(x[:out.numel()], shard)
            c.allgather_flat(out, shard)
        return run
    names = WAYS["shard"]
    return {names[0]: gloo, names[1]: torchmn_way(flat), names[2]: torchmn_way(comm)}


def rank_main(collective: str, sizes, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import torchmn
    from torchmn.communicators import make_communicator

    comm = torchmn.create_communicator("hierarchical")
    flat = make_communicator("flat", rank=comm.rank, size=comm.size, group=comm.process_group,
                             obj_group=comm.object_group, backend=comm.backend, node_key=comm.node_key)
    names = WAYS["allreduce"]
    ways = {names[0]: lambda x: dist.all_reduce(x), names[1]: lambda x: flat.allreduce_flat(x),
            names[2]: lambda x: comm.allreduce_flat(x)} if collective == "allreduce" else shard_ways(comm, flat)
    cases = [(float(mb), torch.ones(int(mb * (1 << 20)) // 4), max(1, int(8 / mb)) if mb < 8 else 1) for mb in sizes]
    slowest = time_rounds(comm, ways, cases, rounds)
    if comm.rank == 0:
        print("FIGURES " + json.dumps(slowest), flush=True)
    flat.finalize()
    comm.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collective", choices=list(WAYS), default="allreduce")
    parser.add_argument("--links", nargs="+", default=["1gbit"], choices=list(PROFILES))
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (each needs a core of its own)")
    parser.add_argument("--ranks-per-node", nargs="+", type=int, default=[1])
    parser.add_argument("--sizes", nargs="+", type=float, default=list(SIZES_MB), help="MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write every row's medians (seconds) here, for bench/multinode/model.py --fit")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json and args.collective != "allreduce":
        parser.error("--json writes allreduce rows (what bench/multinode/model.py --fit reads); "
                     "drop it with --collective shard")
    if args.rank:
        rank_main(args.collective, args.sizes, args.rounds)
        return
    ways = WAYS[args.collective]
    print(f"| link | nodes x ranks | MB | {ways[0]} ms | torchmn flat ms | torchmn hierarchical ms | "
          "floor ms | of line rate | flat vs gloo | hierarchical vs gloo |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for link in args.links:
        for per_node in args.ranks_per_node:
            with EmulatedNodes(args.nodes, link) as nodes:
                argv = nodes.torchmn_run(per_node, [sys.executable, str(Path(__file__)), "--rank", "--rounds",
                                                    str(args.rounds), "--collective", args.collective,
                                                    "--sizes", *map(str, args.sizes)])
                proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=3600)
            line = next((ln for ln in proc.stdout.splitlines() if "FIGURES " in ln), None)
            if proc.returncode != 0 or line is None:
                raise SystemExit(f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            figures = json.loads(line.split("FIGURES ", 1)[1])
            for mb in args.sizes:
                med = {way: statistics.median(figures[f"{float(mb)}|{way}"]) for way in ways}
                floor = mb * (1 << 20) * 2 * (args.nodes - 1) / args.nodes / PROFILES[link]
                best = min(med[ways[1]], med[ways[2]])
                rows.append({"link": link, "nodes": args.nodes, "ranks_per_node": per_node, "bytes": mb * (1 << 20),
                             "seconds": med})
                print(f"| {link} | {args.nodes} x {per_node} | {mb:g} | {med[ways[0]] * 1e3:.2f} | "
                      f"{med[ways[1]] * 1e3:.2f} | "
                      f"{med[ways[2]] * 1e3:.2f} | {floor * 1e3:.2f} | {floor / best:.0%} | "
                      f"{med[ways[1]] / med[ways[0]]:.2f}x | {med[ways[2]] / med[ways[0]]:.2f}x |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
