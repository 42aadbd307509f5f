"""Run on 2 emulated nodes (bench/multinode/nodes.py): every algorithm `auto` can choose averages
across them correctly. Prints "NODE <rank> <host> <cores>" per rank and "PASS <algorithm>" on rank 0."""
import os
import socket

import torch

import torchmn
from torchmn.communicators import make_communicator

comm = torchmn.create_communicator()
print(f"NODE {comm.rank} {socket.gethostname()} {sorted(os.sched_getaffinity(0))}", flush=True)
for name in ("auto", "flat", "hierarchical", "naive"):
    c = make_communicator(name, rank=comm.rank, size=comm.size, group=comm.process_group,
                          obj_group=comm.object_group, backend=comm.backend, node_key=comm.node_key)
    assert c.inter_size == 2, (name, c.inter_size)
    x = torch.arange(300_000, dtype=torch.float64) * (comm.rank + 1)
    assert torch.equal(c.allreduce(x), torch.arange(300_000, dtype=torch.float64) * sum(range(1, comm.size + 1)))
    model = torch.nn.Linear(50, 20).double()
    for p in model.parameters():
        p.grad = torch.full_like(p, float(comm.rank))
    c.multi_node_mean_grad(model)
    assert all(torch.equal(p.grad, torch.full_like(p, (comm.size - 1) / 2)) for p in model.parameters()), name
    c.finalize()
    if comm.rank == 0:
        print(f"PASS {name}", flush=True)
comm.finalize()
