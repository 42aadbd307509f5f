"""The ChainerMN MNIST workload under torchrun + DistributedDataParallel: the peer in bench_mnist.py.

    torchrun --standalone --nproc-per-node 2 bench/mnist_ddp.py --n-train 1000 --batch-size 50 --log-file ddp.json
    torchrun ... bench/mnist_ddp.py ... --fused          # torch.optim.Adam(fused=True)
    torchrun ... bench/mnist_ddp.py ... --zero [--fused] # DDP + ZeroRedundancyOptimizer(Adam)

The same model, data, batches, optimizer, per-epoch validation and JSON log as
examples/mnist/train_mnist.py, written the way a torchrun + DDP user would. ``--fused`` gives Adam
torch's fused kernel (torchmn's split updates use it; torch's default on the CPU is its for-loop
implementation); ``--zero`` shards Adam's state as torch documents, with
``ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam)``: the peer of
``train_mnist.py --shard-state``.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "mnist"))
from data import add_data_arguments, load_mnist  # noqa: E402
from train_mnist_single import make_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", "--log-file", required=True)
    parser.add_argument("--fused", action="store_true", help="torch.optim.Adam(fused=True)")
    parser.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer around Adam")
    add_data_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    train, val = load_mnist(args.n_train, args.data_dir)
    sampler = torch.utils.data.distributed.DistributedSampler(train, shuffle=True, seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    val_part = torch.utils.data.Subset(val, range(rank, len(val), size))
    val_loader = torch.utils.data.DataLoader(val_part, batch_size=args.batch_size)
    model = DistributedDataParallel(make_model())
    adam = {"fused": True} if args.fused else {}  # else torch's default
    if args.zero:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, **adam)
    else:
        optimizer = torch.optim.Adam(model.parameters(), **adam)
    log = []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        loss_sum = 0.0
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
        sums = torch.zeros(4, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                out = model(x)
                sums += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(),
                                      (out.argmax(1) == y).sum().item(), len(y), 0], dtype=torch.float64)
        sums[3] = loss_sum / len(train_loader)
        dist.all_reduce(sums)
        if rank == 0:
            log.append({"epoch": epoch, "main/loss": sums[3].item() / size,
                        "validation/main/loss": (sums[0] / sums[2]).item(),
                        "validation/main/accuracy": (sums[1] / sums[2]).item(),
                        "elapsed_time": time.perf_counter() - start})
            with open(args.log, "w") as f:
                json.dump(log, f, indent=1)
    # Give gloo's worker threads a moment to drop their last work before teardown: without it a
    # rank sometimes aborts at exit ("terminate called without an active exception"; torch 2.13).
    time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
