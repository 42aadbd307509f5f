"""Allreduce latency and bandwidth: torchmn vs raw gloo, and vs the memory-copy limit.

Run (2 ranks on one node):

    torchmn run -np 2 python bench/bench_allreduce.py            # the table in BENCHMARKS.md
    torchmn run -np 2 python bench/bench_allreduce.py --quick    # a fast look

For each size, every method runs ``--iters`` times in a row per round, over ``--rounds`` rounds
interleaved (so background noise hits all methods alike); the figure is the median round.
Methods: ``gloo`` = ``torch.distributed.all_reduce`` on the default gloo group (the peer);
``torchmn`` = ``comm.allreduce(x)``, the checked user-facing call; ``torchmn (grad path)`` =
``comm.allreduce_flat``, what the optimizer uses; ``copy`` = one ``Tensor.copy_`` of the same bytes
(the memory-copy floor).

With ``--collective reduce_scatter``, the sharded optimizer's primitive instead: ``gloo`` =
``torch.distributed.reduce_scatter_tensor`` (which gloo runs as an allreduce), ``torchmn`` =
``comm.reduce_scatter_flat`` (through shared memory with the default communicator; with
``--communicator flat``, torch.distributed's all-to-all and a local sum):

    torchmn run -np 2 python bench/bench_allreduce.py --collective reduce_scatter --communicator flat
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import torchmn

SIZES = [4 << 10, 64 << 10, 100_000, 1 << 20, 7_200_000, 16 << 20, 64 << 20]


def fmt_size(n: int) -> str:
    return f"{n / 1e6:g} MB" if n >= 100_000 else f"{n >> 10} KB"


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and iterations")
    parser.add_argument("--communicator", default="auto")
    parser.add_argument("--collective", choices=("allreduce", "reduce_scatter"), default="allreduce")
    args = parser.parse_args()
    if args.collective == "reduce_scatter":
        reduce_scatter(args)
        return
    rounds = 2 if args.quick else args.rounds
    comm = torchmn.create_communicator(args.communicator)
    world = dist.group.WORLD
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4
        x = torch.rand(n)
        iters = max(3, min(200, int(2e8 // max(nbytes, 1)) // (4 if args.quick else 1)))
        methods = {
            "gloo": lambda: dist.all_reduce(x, group=world),
            "torchmn": lambda: comm.allreduce(x),
            "torchmn (grad path)": lambda: comm.allreduce_flat(x).wait(),
            "copy": lambda: y.copy_(x),
        }
        y = torch.empty_like(x)
        samples = {m: [] for m in methods}
        for _ in range(rounds):
            for m, fn in methods.items():
                comm.barrier()
                samples[m].append(timed(fn, iters))
        med = {m: statistics.median(v) for m, v in samples.items()}
        # Every rank's time counts: the slowest rank is what a job waits for.
        med = {m: max(comm.allgather_obj(v)) for m, v in med.items()}
        rows.append((nbytes, med))
    if comm.rank == 0:
        print(f"# allreduce, {comm.size} ranks on {comm.inter_size} node(s), communicator {comm.name!r}, "
              f"median of {rounds} rounds")
        print("| size | gloo | torchmn | torchmn (grad path) | copy | gloo / torchmn | gloo / grad path | "
              "torchmn / copy | GB/s torchmn |")
        print("|---|---|---|---|---|---|---|---|---|")
        for nbytes, med in rows:
            ms = {m: v * 1e3 for m, v in med.items()}
            print(f"| {fmt_size(nbytes)} | {ms['gloo']:.3f} ms | {ms['torchmn']:.3f} ms | "
                  f"{ms['torchmn (grad path)']:.3f} ms | {ms['copy']:.3f} ms | "
                  f"{med['gloo'] / med['torchmn']:.1f}x | {med['gloo'] / med['torchmn (grad path)']:.1f}x | "
                  f"{med['torchmn'] / med['copy']:.1f}x | {nbytes / med['torchmn'] / 1e9:.2f} |")
    comm.finalize()


def reduce_scatter(args) -> None:
    rounds = 2 if args.quick else args.rounds
    comm = torchmn.create_communicator(args.communicator)
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4 // comm.size * comm.size
        x, shard = torch.rand(n), torch.empty(n // comm.size)
        iters = max(3, min(200, int(2e8 // max(nbytes, 1)) // (4 if args.quick else 1)))
        methods = {"gloo": lambda: dist.reduce_scatter_tensor(shard, x),
                   "torchmn": lambda: comm.reduce_scatter_flat(x, shard)}
        samples = {m: [] for m in methods}
        for _ in range(rounds):
            for m, fn in methods.items():
                comm.barrier()
                samples[m].append(timed(fn, iters))
        rows.append((nbytes, {m: max(comm.allgather_obj(statistics.median(v))) for m, v in samples.items()}))
    if comm.rank == 0:
        print(f"# reduce-scatter, {comm.size} ranks on {comm.inter_size} node(s), communicator {comm.name!r}, "
              f"median of {rounds} rounds")
        print("| size | gloo | torchmn | gloo / torchmn |")
        print("|---|---|---|---|")
        for nbytes, med in rows:
            print(f"| {fmt_size(nbytes)} | {med['gloo'] * 1e3:.3f} ms | {med['torchmn'] * 1e3:.3f} ms | "
                  f"{med['gloo'] / med['torchmn']:.1f}x |")
    comm.finalize()


if __name__ == "__main__":
    main()
