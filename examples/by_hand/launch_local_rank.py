"""A script for `python -m torch.distributed.launch`, which passes `--local-rank` (or
`--local_rank`) to each process it starts, as older PyTorch guides show:

    python -m torch.distributed.launch --nproc-per-node 2 examples/by_hand/launch_local_rank.py
"""
import argparse

import torch

import torchmn

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
parser.add_argument("--local-rank", "--local_rank", type=int, default=0)
args = parser.parse_args()

comm = torchmn.create_communicator()  # reads the launcher's variables; --local-rank agrees with them
assert comm.intra_rank == args.local_rank, (comm.intra_rank, args.local_rank)
total = comm.allreduce(torch.tensor([float(comm.rank + 1)]), op="sum")
print(f"rank {comm.rank}/{comm.size} (--local-rank {args.local_rank}): sum {total.item():g}", flush=True)
