"""A 3x3 convolution on a 1 x 64 x 256 x 256 image: one process vs channel- vs spatial-parallel;
multi-node BatchNorm vs BatchNorm.

Run (2 ranks on one node):

    torchmn run -np 2 python bench/bench_model_parallel.py            # --steps N (default 5), --size S (256)

Times one forward and backward (median of ``--steps``), in one job:
- ``one process``: the dense ``Conv2d`` on the whole image on rank 0 with every CPU's thread (the
  other rank waits);
- ``channel-parallel``: ``ChannelParallelConv2d`` with the input's channels split (each rank holds
  32) and its output left split, as between two such layers;
- ``spatial-parallel``: ``SpatialParallelConv2d``, each rank holding 128 rows, and, beside it, the
  same rank's convolution alone on its rows and halo (no exchange): their difference is the halo
  exchange;
- ``BatchNorm2d`` and ``MultiNodeBatchNorm2d`` on each rank's rows.
It prints the times, the bytes each rank sends per forward (as many come back in backward) and
the halo exchange's share.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchmn
from torchmn.nn import ChannelParallelConv2d, MultiNodeBatchNorm2d, SpatialParallelConv2d


def timed(comm, fn, steps: int) -> float:
    """Median seconds of ``fn()`` (a forward and backward), the slowest rank's."""
    fn()
    times = []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max(comm.allgather_obj(statistics.median(times)))


def fwd_bwd(layer, x):
    def run():
        layer(x).sum().backward()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--channels", type=int, default=64)
    args = parser.parse_args()
    comm = torchmn.create_communicator()
    p, r, c, n = comm.size, comm.rank, args.channels, args.size
    image = torch.randn(1, c, n, n, generator=torch.Generator().manual_seed(0))
    rows = image.tensor_split(p, dim=2)[r].contiguous().requires_grad_()
    results = {}

    threads = torch.get_num_threads()
    dense = torch.nn.Conv2d(c, c, 3, padding=1)
    if r == 0:
        torch.set_num_threads(threads * p)  # the whole machine, as one process would have it
    whole = image.clone().requires_grad_()
    one = timed(comm, fwd_bwd(dense, whole) if r == 0 else (lambda: None), args.steps)
    torch.set_num_threads(threads)
    results["one process (dense Conv2d)"] = (one, 0)

    channels = image.tensor_split(p, dim=1)[r].contiguous().requires_grad_()
    layer = ChannelParallelConv2d(c, c, 3, padding=1, comm=comm, input_is_parallel=True, gather_output=False)
    sent = image[:, :channels.shape[1]].numel() * 4 * (p - 1)  # its slice to every other rank
    results["channel-parallel"] = (timed(comm, fwd_bwd(layer, channels), args.steps), sent)

    spatial = SpatialParallelConv2d(c, c, 3, padding=1, comm=comm)
    results["spatial-parallel"] = (timed(comm, fwd_bwd(spatial, rows), args.steps), spatial.last_halo_bytes)
    window = torch.nn.functional.pad(rows.detach(), (0, 0, 1, 1)).requires_grad_()
    local = timed(comm, lambda: torch.nn.functional.conv2d(window, spatial.weight, spatial.bias,
                                                            padding=(0, 1)).sum().backward(), args.steps)
    results["  its convolution alone (no exchange)"] = (local, 0)

    bn_s = timed(comm, fwd_bwd(torch.nn.BatchNorm2d(c), rows), args.steps)
    mnbn_s = timed(comm, fwd_bwd(MultiNodeBatchNorm2d(c, comm=comm), rows), args.steps)
    results["BatchNorm2d on a rank's rows"] = (bn_s, 0)
    results["MultiNodeBatchNorm2d on a rank's rows"] = (mnbn_s, (2 * c + 1) * 8)

    if r == 0:
        print(f"# 3x3 convolution, 1 x {c} x {n} x {n} float32, {p} ranks x {threads} thread(s); median of "
              f"{args.steps} forward+backward, slowest rank")
        print("| what | time | vs one process | bytes sent per rank per forward |")
        print("|---|---|---|---|")
        for name, (t, sent) in results.items():
            shown = "-" if not sent else (f"{sent / 1e6:.2f} MB" if sent >= 1e5 else f"{sent / 1e3:.1f} KB")
            print(f"| {name} | {t * 1e3:.1f} ms | {t / one:.2f}x | {shown} |")
        exchange = results["spatial-parallel"][0] - local
        print(f"\nhalo exchange: {exchange * 1e3:.1f} ms, {exchange / local:.2f} of the convolution it feeds; "
              f"MultiNodeBatchNorm2d / BatchNorm2d: {mnbn_s / bn_s:.2f}x")
    comm.finalize()


if __name__ == "__main__":
    main()
