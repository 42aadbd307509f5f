"""A small deterministic training on CPU that checkpoints every N steps and resumes from its newest
checkpoint, for the restart tests (``torchmn run --max-restarts``).

Usage: train_restartable.py --steps 60 --every 10 --checkpoint DIR --out FINAL.pt [--crash-at S]

With ``--crash-at S``, rank ``--crash-rank`` (default 1) raises at the start of step S, but only in
the first start of the job (``TORCHMN_RESTART_COUNT`` 0): the restarted job resumes and finishes.
Every batch is a function of the step and the rank, and dropout draws from torch's generator,
whose state the checkpoint keeps, so a resumed run ends with the weights of an uninterrupted
one, bit for bit. Rank 0 writes the final parameters to ``--out``.
"""
import argparse
import os
import sys

import torch

import torchmn

FEATURES = 8


class Snapshots:
    """Every rank's state at a step, in ``directory/step_<S>.rank<r>.pt`` (written atomically);
    the newest step every rank has is the one resumed from."""

    def __init__(self, directory, comm, **objects):
        self.directory, self.comm, self.objects = directory, comm, objects
        os.makedirs(directory, exist_ok=True)

    def _path(self, step, rank):
        return os.path.join(self.directory, f"step_{step:06d}.rank{rank}.pt")

    def save(self, step):
        state = {name: obj.state_dict() for name, obj in self.objects.items()}
        state["rng"] = torch.get_rng_state()
        path = self._path(step, self.comm.rank)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.comm.barrier()

    def load_latest(self):
        steps = sorted({int(name[5:11]) for name in os.listdir(self.directory) if name.endswith(".pt")})
        complete = [s for s in steps if all(os.path.exists(self._path(s, r)) for r in range(self.comm.size))]
        step = self.comm.bcast_obj(complete[-1] if complete else None)
        if step is None:
            return None
        state = torch.load(self._path(step, self.comm.rank), weights_only=False)
        for name, obj in self.objects.items():
            obj.load_state_dict(state[name])
        torch.set_rng_state(state["rng"])
        return step


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
    snapshots = Snapshots(args.checkpoint, comm, model=model, optimizer=optimizer)
    start = snapshots.load_latest() or 0
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
            snapshots.save(step + 1)
    if comm.rank == 0:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, args.out)
        print(f"done: {args.steps} steps", flush=True)
    comm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
