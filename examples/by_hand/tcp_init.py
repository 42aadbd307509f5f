"""A rank started by hand with an explicit rendezvous, rank and size, as in
`init_process_group(init_method="tcp://...", rank=r, world_size=n)`: run one per rank.

    python examples/by_hand/tcp_init.py --init-method tcp://10.0.0.1:29500 --rank 0 --size 2   # on node1
    python examples/by_hand/tcp_init.py --init-method tcp://10.0.0.1:29500 --rank 1 --size 2   # on node2
"""
import argparse

import torch

import torchmn

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
parser.add_argument("--init-method", required=True)
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--size", type=int, required=True)
args = parser.parse_args()

comm = torchmn.create_communicator(init_method=args.init_method, rank=args.rank, size=args.size)
total = comm.allreduce(torch.tensor([float(comm.rank + 1)]), op="sum")
print(f"rank {comm.rank}/{comm.size} (local {comm.intra_rank}/{comm.intra_size}, threads "
      f"{torch.get_num_threads()}): sum {total.item():g}", flush=True)
