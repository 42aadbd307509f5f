"""What torchmn costs on a GPU: ResNet-50 in a world of one, plain torch against torchmn's optimizer
and DistributedDataParallel, interleaved round after round in one process.

    python bench/bench_gpu.py                      # 7 rounds of 30 steps, the table in BENCHMARKS.md
    python bench/bench_gpu.py --rounds 3 --steps 10 --batch 64

The workload: torchvision's ResNet-50, bf16 autocast, channels_last, batch 128 of random images
(224 x 224) and labels on the GPU, SGD with momentum. Every variant starts from the same weights;
each round times ``--steps`` steps of each variant (after ``--warmup`` steps, CUDA synchronised
before and after), and the table shows images/s: the median over rounds, the spread, and the ratio
to plain torch measured in the same run. A world of one shows the optimizer's own overhead; with
several GPUs, ``torchmn run -np N`` / ``torchrun`` runs of the examples measure the NCCL path.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchmn


def make_model(seed: int) -> torch.nn.Module:
    import torchvision
    torch.manual_seed(seed)
    return torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU (torch sees none)")
    torch.backends.cudnn.benchmark = True
    comm = torchmn.create_communicator()  # a world of one, before DDP's own process group
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)

    variants = {}
    plain = make_model(0)
    variants["plain torch"] = (plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    mn = make_model(0)
    variants["torchmn optimizer"] = (mn, torchmn.create_multi_node_optimizer(
        torch.optim.SGD(mn.parameters(), lr=0.1, momentum=0.9), comm))
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(0), device_ids=[torch.cuda.current_device()])
    variants["DDP, world of one"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, 3, 224, 224, device="cuda", generator=g).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device="cuda", generator=g)

    def steps(model, optimizer, n):
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

    for model, optimizer in variants.values():
        steps(model, optimizer, args.warmup)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, (model, optimizer) in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            steps(model, optimizer, args.steps)
            torch.cuda.synchronize()
            rates[name].append(args.steps * args.batch / (time.perf_counter() - start))
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in rates.items()), file=sys.stderr, flush=True)

    base = statistics.median(rates["plain torch"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, ResNet-50, batch {args.batch}, bf16 "
          f"autocast, channels_last, SGD; {args.rounds} rounds of {args.steps} steps")
    print("| variant | images/s (median) | min-max | vs plain torch |")
    print("|---|---|---|---|")
    for name, vs in rates.items():
        m = statistics.median(vs)
        print(f"| {name} | {m:,.0f} | {min(vs):,.0f}-{max(vs):,.0f} | {m / base:.3f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
