"""Ranks with 7 and 10 batches WITHOUT torchmn.join: rank 0's loop ends first, and the job must
fail with the error it always had (naming the rank that went missing), never hang.

Usage: python uneven_jobs.py COMMUNICATOR KIND AFTER
KIND: replicated, sharded or default (create_multi_node_optimizer's shard_state False, True, None).
AFTER: what rank 0 does once its batches are done: "collective" (an evaluation's comm.allreduce)
or "exit" (its script ends). Each rank prints "NAMED <error>" when the timeout (5 s) hits.
"""
import sys

import torch

import torchmn

name, kind, after = sys.argv[1:4]
comm = torchmn.create_communicator(name, timeout=5)  # seconds
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
shard_state = {"replicated": False, "sharded": True, "default": None}[kind]
opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, shard_state=shard_state)
print(f"OPTIMIZER {type(opt).__name__}", flush=True)
try:
    for _ in range(7 if comm.rank == 0 else 10):
        opt.zero_grad()
        model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
        opt.step()
    if comm.rank == 0 and after == "exit":
        print("LEFT", flush=True)
        sys.exit(0)
    comm.allreduce(torch.ones(1))  # rank 0: an evaluation; rank 1 never gets here
except torchmn.CollectiveTimeoutError as e:
    print(f"NAMED {e}", flush=True)
