"""Small calls inside one node: a barrier, allreduces of 4 KB with and without the call check, and
send/recv of 1 KB and 1 MB, through torchmn's shared memory and through gloo in the same job.

    python bench/bench_small_calls.py            # 2 ranks, the table in BENCHMARKS.md
    python bench/bench_small_calls.py -np 4

Each figure is the median over 7 bursts of 2000 calls (after 300 to warm up; 200 and 30 for 1 MB
messages) of the time per call, on the slowest rank. gloo's rows call torch.distributed directly
on the same process group. A message's figure is half a round trip between ranks 0 and 1
(``comm.send`` then ``comm.recv`` of the echo; gloo: ``dist.send``/``dist.recv`` into buffers made
beforehand); the other ranks wait.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

BURSTS, CALLS, WARM = 7, 2000, 300


def rank_main() -> None:
    import torch
    import torch.distributed as dist

    import torchmn

    comm = torchmn.create_communicator()
    x = torch.ones(1024)  # 4 KB of float32
    flat = x.clone()

    def echo(send, recv):  # half a round trip between ranks 0 and 1
        def call():
            if comm.rank == 0:
                send(1)
                recv(1)
            elif comm.rank == 1:
                recv(0)
                send(0)
        return call

    def messages(nbytes):
        out, back = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        return (echo(lambda peer: comm.send(out, peer), lambda peer: comm.recv(peer)),
                echo(lambda peer: dist.send(out, peer), lambda peer: dist.recv(back, peer)))
    calls = {
        "barrier": (comm.barrier, dist.barrier, 1),
        "allreduce_flat 4 KB (no call check)": (lambda: comm.allreduce_flat(flat), lambda: dist.all_reduce(flat), 1),
        "allreduce 4 KB (checked, new tensor)": (lambda: comm.allreduce(x), lambda: dist.all_reduce(x.clone()), 1),
        "send/recv 1 KB (one way)": (*messages(1 << 10), 2),
        "send/recv 1 MB (one way)": (*messages(1 << 20), 2),
    }
    figures = {}
    for name, (ours, gloo, legs) in calls.items():
        n, warm = (CALLS, WARM) if "MB" not in name else (CALLS // 10, WARM // 10)
        for label, fn in (("torchmn", ours), ("gloo", gloo)):
            per_burst = []
            for _ in range(BURSTS):
                for _ in range(warm):
                    fn()
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                per_burst.append((time.perf_counter() - t0) / n / legs * 1e6)
            figures[(name, label)] = (statistics.median(per_burst), min(per_burst), max(per_burst))
    every = comm.gather_obj(figures)
    if comm.rank == 0:
        slowest = {k: max(f[k] for f in every) for k in figures}
        print(f"| call ({comm.size} ranks, one node) | torchmn us | gloo us | torchmn vs gloo |")
        print("|---|---|---|---|")
        for name in calls:
            ours, theirs = slowest[(name, "torchmn")], slowest[(name, "gloo")]
            print(f"| {name} | {ours[0]:.1f} ({ours[1]:.1f}-{ours[2]:.1f}) | {theirs[0]:.1f} "
                  f"({theirs[1]:.1f}-{theirs[2]:.1f}) | {ours[0] / theirs[0]:.3f}x |")
    comm.finalize()


def main() -> None:
    if os.environ.get("TORCHMN_RANK") is not None:
        rank_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", type=int, default=2)
    args = parser.parse_args()
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", str(args.np), "--output-ranks", "0",
                           sys.executable, __file__], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    print("\n".join(line[4:] for line in proc.stdout.splitlines() if line.startswith("[0] |")))


if __name__ == "__main__":
    main()
