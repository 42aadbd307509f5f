"""Why each rank of a node keeps its own copy of the averaged gradient (one process, no ranks).

The default optimizer on one node writes every averaged slice into every rank's buffer, so each
rank's ``.grad`` is a private copy. One node-wide copy viewed by every rank's ``.grad`` would save
those copies, but an edit that every rank makes (clipping, unscaling) would then be applied once
per rank. A copy-on-write view keeps such edits private: each rank maps the node's average with
``MAP_PRIVATE`` (reads see the shared pages; a write copies the page for this rank alone) and drops
its copied pages with ``MADV_DONTNEED`` before each step's average. This script times what each
way costs a rank per step, on a region of ``--mb`` MB in ``/dev/shm``:

- ``copy`` (the peer: what the default does): a copy of the average into a private buffer;
- ``cow read``: the drop, then reading every element (the pages fault back in from the file);
- ``cow edit``: the drop, then an in-place edit of every element (``mul_``, as clipping does),
  which copies every page on a fault;
- ``edit private``: the same edit on private memory (what clipping costs with the copy).

Run:

    python bench/bench_shared_grad.py

Medians of ``--repeats`` timings, milliseconds.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time

import torch


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=8, help="the gradient's size in MB (default 8)")
    parser.add_argument("--repeats", type=int, default=101)
    args = parser.parse_args()
    nbytes = args.mb << 20
    fd, path = tempfile.mkstemp(prefix="torchmn-bench-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        shared = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        private = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE)
        average = torch.frombuffer(shared, dtype=torch.float32)
        view = torch.frombuffer(private, dtype=torch.float32)
        average.fill_(1.0)
        copy, own = torch.empty_like(average), torch.ones_like(average)

        def cow_read():
            private.madvise(mmap.MADV_DONTNEED)
            view.sum()

        def cow_edit():
            private.madvise(mmap.MADV_DONTNEED)
            view.mul_(1.0)

        rows = [("copy (per-rank buffers, the peer)", lambda: copy.copy_(average)),
                ("cow read", cow_read),
                ("cow edit", cow_edit),
                ("edit private", lambda: own.mul_(1.0))]
        results = [(name, median_ms(fn, args.repeats)) for name, fn in rows]
        base = results[0][1]
        print(f"{args.mb} MB float32, medians of {args.repeats}, ms per step and rank")
        print("| way | ms | vs copy |")
        print("|---|---|---|")
        for name, ms in results:
            print(f"| {name} | {ms:.3f} | {ms / base:.2f}x |")
        average = view = None  # the tensors export the maps: close() refuses while they live
        shared.close()
        private.close()
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
