"""A deterministic training loop that checkpoints with torchmn.checkpoint, for the tests that kill,
crash and restart it and then compare its final parameters with an uninterrupted run's.

Every rank draws dropout from its own seed and reads its own shuffled part of the data, so a resume
is bit for bit only if the model, optimizer, scheduler, data position and every rank's RNG states
all come back. Each checkpoint also records a digest of the parameters, and a resume checks it:
a checkpoint that loaded anything but what was saved fails the run.

    torchmn run -np 2 python checkpoint_train.py --dir CKPT --steps 60 --every 5 --out final.pt
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

import torchmn
from torchmn.checkpoint import Checkpointer, ResumableLoader, atomic_save


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", choices=["default", "replicated", "sharded"], default="default")
    parser.add_argument("--ballast", type=int, default=0, help="extra MB in each rank's file (slower writes)")
    parser.add_argument("--crash-at", type=int, default=0, help="rank 1 exits with 3 at this step on the first start")
    args = parser.parse_args()

    comm = torchmn.create_communicator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(64, 4)).double()
    shard = {"default": None, "replicated": False, "sharded": True}[args.optimizer]
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm,
                                                    shard_state=shard)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.8)
    data = None
    if comm.rank == 0:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(400, 16, generator=g, dtype=torch.float64)
        data = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 0).long())
    train = torchmn.scatter_dataset(data, comm, shuffle=True, seed=2)
    loader = ResumableLoader(train, batch_size=8, shuffle=True, seed=10 + comm.rank)
    torch.manual_seed(100 + comm.rank)  # each rank's own dropout
    ckpt = Checkpointer(args.dir, comm, keep=args.keep, model=model, optimizer=optimizer, scheduler=scheduler,
                        loader=loader)
    step = ckpt.load_latest() or 0
    if ckpt.resumed_from is not None and ckpt.extra["digest"] != digest(model):
        print(f"rank {comm.rank}: step {step} loaded parameters that differ from those saved", file=sys.stderr)
        return 1
    print(f"rank {comm.rank}: starting at step {step}", flush=True)
    first_start = os.environ.get("TORCHMN_RESTART_COUNT", "0") == "0"
    ballast = torch.zeros(args.ballast * 2 ** 17, dtype=torch.float64)
    while step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if args.crash_at and step == args.crash_at and first_start and comm.rank == 1:
                print(f"rank 1: crashing at step {step}", flush=True)
                os._exit(3)
            if step % args.every == 0:
                ckpt.save(step, digest=digest(model), ballast=ballast)
            if step == args.steps:
                break
    if comm.rank == 0:
        atomic_save({n: p.detach().clone() for n, p in model.named_parameters()}, args.out)
    print(f"rank {comm.rank}: done at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
