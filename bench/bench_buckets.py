"""The multi-node optimizer on 300 gradient tensors of 10 KB: bucketed vs one allreduce per tensor.

Run (2 ranks on one node):

    torchmn run -np 2 python bench/bench_buckets.py

Times ``optimizer.step()`` on ready gradients (averaging them, then a plain SGD update) for the
optimizer over the ``naive`` communicator (one gloo allreduce per tensor, the peer), over ``flat``
(gloo, fused buckets) and over ``auto`` (here ``hierarchical``: fused buckets through shared
memory), plus the same SGD update alone (no communication: the floor). Median over ``--rounds``
rounds of ``--steps`` steps each, the methods interleaved.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchmn
from torchmn.communicators import make_communicator

N_TENSORS, TENSOR_BYTES = 300, 10 * 1024


def make_step(comm):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(TENSOR_BYTES // 4)) for _ in range(N_TENSORS)]
    sgd = torch.optim.SGD(params, lr=1e-6, foreach=True)  # one fused update, so communication shows
    opt = torchmn.create_multi_node_optimizer(sgd, comm) if comm is not None else sgd
    for p in params:
        p.grad = torch.randn_like(p)
    return opt.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    base = torchmn.create_communicator("auto")

    def variant(name):
        return make_communicator(name, rank=base.rank, size=base.size, group=base.process_group,
                                 obj_group=base.object_group, backend=base.backend, node_key=base.node_key)
    comms = {"naive": variant("naive"), "flat": variant("flat"), f"auto ({base.name})": base,
             "update only": None}
    steps = {name: make_step(c) for name, c in comms.items()}
    samples = {name: [] for name in steps}
    for name, step in steps.items():
        step()  # warm-up
    for _ in range(args.rounds):
        for name, step in steps.items():
            base.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            samples[name].append((time.perf_counter() - t0) / args.steps)
    med = {name: max(base.allgather_obj(statistics.median(v))) for name, v in samples.items()}
    if base.rank == 0:
        print(f"# optimizer step, {N_TENSORS} tensors x {TENSOR_BYTES >> 10} KB, {base.size} ranks, "
              f"median of {args.rounds} rounds x {args.steps} steps")
        print("| optimizer over | time per step | naive / this |")
        print("|---|---|---|")
        for name, t in med.items():
            print(f"| {name} | {t * 1e3:.2f} ms | {med['naive'] / t:.1f}x |")
    base.finalize()


if __name__ == "__main__":
    main()
