"""A plain torch.distributed script: gloo all_reduce through init_method="env://"."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
rank, size = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and size == int(os.environ["WORLD_SIZE"])
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
expected = size * (size + 1) / 2
assert x.item() == expected, (x.item(), expected)
print(f"allreduce ok rank={rank} size={size} sum={x.item():g}", flush=True)
dist.destroy_process_group()
