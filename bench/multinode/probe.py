"""What a rank of an emulated node sees: its host, cores and thread budget, and one allreduce.

    python bench/multinode/nodes.py --nodes 2 --link 1gbit -- python bench/multinode/probe.py
"""
import os
import socket

import torch

import torchmn

comm = torchmn.create_communicator()
total = comm.allreduce(torch.ones(4)).tolist()
print(f"rank {comm.rank}/{comm.size} on {socket.gethostname()} (node {comm.inter_rank}/{comm.inter_size}): "
      f"cores {sorted(os.sched_getaffinity(0))}, {torch.get_num_threads()} thread(s), allreduce {total}", flush=True)
comm.finalize()
