"""Ranks started by torch.multiprocessing.spawn, as the PyTorch guides do: each process joins the
job with an explicit rendezvous, rank and size.

    python examples/by_hand/spawn.py --nprocs 2
"""
import argparse
import socket

import torch
import torch.multiprocessing as mp

import torchmn


def worker(rank: int, size: int, address: str) -> None:
    comm = torchmn.create_communicator(init_method=address, rank=rank, size=size)
    total = comm.allreduce(torch.tensor([float(rank + 1)]), op="sum")
    print(f"rank {comm.rank}/{comm.size} (local {comm.intra_rank}/{comm.intra_size}): sum {total.item():g}",
          flush=True)
    comm.finalize()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    mp.spawn(worker, args=(args.nprocs, f"tcp://127.0.0.1:{free_port()}"), nprocs=args.nprocs)
