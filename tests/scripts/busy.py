"""Keeps the CPU busy for the doctor's tests: matrix products in the main thread's torch pool, and
optionally DataLoader workers that compute too.

Usage: python busy.py SECONDS [WORKERS]

With BUSY_FROM (seconds since the epoch) in the environment, it waits until then once torch is
imported: the doctor samples after its warm-up only, and the CPU a spinning warm-up would take
goes to the other tests meanwhile.
"""
import os
import sys
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


def main():
    seconds, workers = float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0
    end = time.monotonic() + seconds
    time.sleep(max(0.0, float(os.environ.get("BUSY_FROM", 0)) - time.time()))
    batches = iter(torch.utils.data.DataLoader(Burn(), batch_size=4, num_workers=workers)) if workers else None
    a = torch.randn(384, 384)
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
        if batches is not None:
            next(batches)


if __name__ == "__main__":
    main()
