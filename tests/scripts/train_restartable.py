"""A small deterministic training on CPU that checkpoints every N steps and resumes from its newest
checkpoint, for the restart tests (``torchmn run --max-restarts``).

Usage: train_restartable.py --steps 60 --every 10 --checkpoint DIR --out FINAL.pt [--crash-at S]

With ``--crash-at S``, rank ``--crash-rank`` (default 1) raises at the start of step S, but only in
the first start of the job (``TORCHMN_RESTART_COUNT`` 0): the restarted job resumes and finishes.
Checkpoints are ``torchmn.checkpoint.Checkpointer``'s. Every batch is a function of the step and
the rank, and dropout draws from torch's generator, whose state the checkpoint keeps, so a resumed
run ends with the weights of an uninterrupted one, bit for bit. Rank 0 writes the final
parameters to ``--out``.
"""
import argparse
import os
import sys

import torch

import torchmn
from torchmn.checkpoint import Checkpointer

FEATURES = 8


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, FEATURES, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=1)
    args = parser.parse_args()

    comm = torchmn.create_communicator()
    restart = int(os.environ.get("TORCHMN_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                                    comm)
    torch.manual_seed(comm.rank)  # each rank's own dropout masks
    checkpoints = Checkpointer(args.checkpoint, comm, keep=2, model=model, optimizer=optimizer)
    start = checkpoints.load_latest() or 0  # also puts back each rank's RNG states (dropout)
    if comm.rank == 0:
        print(f"start {restart}: from step {start}", flush=True)
    for step in range(start, args.steps):
        if step == args.crash_at and restart == 0 and comm.rank == args.crash_rank:
            raise RuntimeError(f"injected crash at step {step}")
        x, y = batch(step, comm.rank)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if (step + 1) % args.every == 0:
            checkpoints.save(step + 1)
    if comm.rank == 0:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, args.out)
        print(f"done: {args.steps} steps", flush=True)
    comm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
