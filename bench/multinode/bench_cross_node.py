"""Small allreduces across emulated nodes: gloo's ring against recursive doubling, and what the
default communicator chose at set-up (torchmn/communicators/cross_node.py).

    python bench/multinode/bench_cross_node.py                         # 2 nodes x 1 rank, 1gbit (root)
    python bench/multinode/bench_cross_node.py --nodes 2 4 --links 1gbit 10gbit
    python bench/multinode/bench_cross_node.py --loopback 2 4          # ranks on this machine, no root

Every row runs on emulated nodes (``nodes.py``), one rank each. In one job, rounds interleave at each
size: ``dist.all_reduce`` on the world group (gloo's ring), ``doubling_allreduce`` on the same group,
and ``allreduce_flat`` of the default communicator, which takes one or the other by the size
measured when it was set up. Each figure is the median over ``--rounds`` of the slowest rank's
time per call, in microseconds. ``--loopback N`` runs N ranks on this machine instead, over TCP
loopback (no root, no shaping): the two algorithms only, as the default communicator would take
shared memory there.
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

SIZES_KB = (1, 8, 64, 512)
WAYS = ("gloo ring", "recursive doubling", "torchmn default")


def rank_main(sizes_kb, rounds: int, loopback: bool) -> None:
    import torch
    import torch.distributed as dist

    import torchmn
    from torchmn.communicators.cross_node import doubling_allreduce

    comm = torchmn.create_communicator("flat" if loopback else "auto")
    ranks = list(range(comm.size))
    ways = {WAYS[0]: lambda x: dist.all_reduce(x),
            WAYS[1]: lambda x: doubling_allreduce(x, "sum", dist.group.WORLD, ranks, comm.rank)}
    if not loopback:
        ways[WAYS[2]] = lambda x: comm.allreduce_flat(x)
    cases = [(kb, torch.ones(int(kb * 1024) // 4), max(1, int(2048 // kb))) for kb in sizes_kb]
    slowest = time_rounds(comm, ways, cases, rounds)
    if comm.rank == 0:
        print("FIGURES " + json.dumps(slowest), flush=True)
        if not loopback:
            print("CHOICE " + comm.cross_node.describe(), flush=True)
    comm.finalize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["1gbit"], choices=list(PROFILES))
    parser.add_argument("--nodes", nargs="+", type=int, default=[2], help="emulated node counts")
    parser.add_argument("--sizes", nargs="+", type=float, default=[float(s) for s in SIZES_KB], help="KB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--loopback", nargs="+", type=int, default=None, metavar="N",
                        help="run N ranks on this machine over TCP loopback instead of emulated nodes")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.sizes, args.rounds, args.loopback is not None)
        return
    if args.loopback:
        loopback(args)
        return
    print("| link | nodes | KB | gloo ring us | recursive doubling us | torchmn default us | doubling vs ring |")
    print("|---|---|---|---|---|---|---|")
    choices = []
    for link in args.links:
        for count in args.nodes:
            with EmulatedNodes(count, link) as nodes:
                argv = nodes.torchmn_run(1, [sys.executable, str(Path(__file__)), "--rank", "--rounds",
                                             str(args.rounds), "--sizes", *map(str, args.sizes)])
                proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=3600)
            lines = proc.stdout.splitlines()
            line = next((ln for ln in lines if "FIGURES " in ln), None)
            if proc.returncode != 0 or line is None:
                raise SystemExit(f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            figures = json.loads(line.split("FIGURES ", 1)[1])
            choices.append(f"{link}, {count} nodes: " + next(ln for ln in lines if "CHOICE " in ln).split("CHOICE ", 1)[1])
            for kb in args.sizes:
                med = {way: statistics.median(figures[f"{kb}|{way}"]) for way in WAYS}
                print(f"| {link} | {count} | {kb:g} | {med[WAYS[0]] * 1e6:.0f} | {med[WAYS[1]] * 1e6:.0f} | "
                      f"{med[WAYS[2]] * 1e6:.0f} | {med[WAYS[1]] / med[WAYS[0]]:.2f}x |", flush=True)
    print()
    for choice in choices:
        print(f"- {choice}")


def loopback(args) -> None:
    """The two algorithms among ranks of this machine, over TCP loopback."""
    print("| ranks (one machine) | KB | gloo ring us | recursive doubling us | doubling vs ring |")
    print("|---|---|---|---|---|")
    for np in args.loopback:
        argv = [sys.executable, "-m", "torchmn", "run", "-np", str(np), sys.executable, str(Path(__file__)), "--rank",
                "--rounds", str(args.rounds), "--loopback", str(np), "--sizes", *map(str, args.sizes)]
        proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=3600)
        line = next((ln for ln in proc.stdout.splitlines() if "FIGURES " in ln), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"the job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        figures = json.loads(line.split("FIGURES ", 1)[1])
        for kb in args.sizes:
            ring, doubling = (statistics.median(figures[f"{kb}|{way}"]) for way in WAYS[:2])
            print(f"| {np} | {kb:g} | {ring * 1e6:.0f} | {doubling * 1e6:.0f} | {doubling / ring:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
