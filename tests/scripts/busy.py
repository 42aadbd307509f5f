"""Keeps the CPU busy for the doctor's tests: matrix products in the main thread's torch pool, and
optionally DataLoader workers that compute too.

Usage: python busy.py SECONDS [WORKERS] [--steps] [--straggle MS]

With BUSY_FROM (seconds since the epoch) in the environment, it waits until then once torch is
imported: the doctor samples after its warm-up only, and the CPU a spinning warm-up would take
goes to the other tests meanwhile.

--steps: every round of products ends with a step of torchmn's optimizer (a communicator over the
job's ranks, a tiny model), so the job reports steps as a training job does and the doctor samples
as soon as every rank has made two. Without it the job reports none, and the doctor waits for
reports until the job has used its CPU budget for a start-up (seconds of the clock on a loaded
machine) before it samples.

--straggle MS: rank 1 sleeps MS milliseconds before each step (with --steps), so that the others
wait for it in the average.
"""
import argparse
import os
import time

import torch


class Burn(torch.utils.data.Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        x = torch.randn(96, 96)
        for _ in range(20):
            x = torch.tanh(x @ x)
        return x[0]


def stepper():
    """One step of torchmn's optimizer on a tiny model per call; the first one made here, so that
    its start-up cost (building the optimizer imports torch._dynamo) falls in the warm-up."""
    import torchmn

    comm = torchmn.create_communicator()
    model = torch.nn.Linear(8, 1)
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm)
    x = torch.ones(4, 8)

    def step():
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    step()
    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("seconds", type=float)
    parser.add_argument("workers", type=int, nargs="?", default=0)
    parser.add_argument("--steps", action="store_true")
    parser.add_argument("--straggle", type=float, default=0.0)
    args = parser.parse_args()
    end = time.monotonic() + args.seconds
    step = stepper() if args.steps else None
    time.sleep(max(0.0, float(os.environ.get("BUSY_FROM", 0)) - time.time()))
    batches = iter(torch.utils.data.DataLoader(Burn(), batch_size=4, num_workers=args.workers)) if args.workers else None
    a = torch.randn(384, 384)
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
        if batches is not None:
            next(batches)
        if step is not None:
            if args.straggle and os.environ.get("RANK") == "1":
                time.sleep(args.straggle / 1000)
            step()


if __name__ == "__main__":
    main()
