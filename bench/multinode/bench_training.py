"""Training across emulated nodes: torchmn's optimizers against DistributedDataParallel, step by step.

    python bench/multinode/bench_training.py                            # 2 nodes x 1 rank, 1gbit (root)
    python bench/multinode/bench_training.py --links 100mbit 1gbit --repeats 3
    python bench/multinode/bench_training.py --models mlp --ways DDP torchmn --bucket-sweep 1 4 25 64

Two models on synthetic data (no data loading, so the step is all there is): the MNIST MLP
(784-1000-1000-10, 1.8 M parameters, batches of 100 a rank, communication-heavy) and a small
convolutional network (5 convolutions on 32 x 32 images, 0.6 M parameters, batches of 32 a rank,
compute-heavy), Adam. Every way runs as its own job on 2 emulated nodes (``nodes.py``), started by
``torchmn run -H``; the DDP peers call ``init_process_group("gloo")`` from the variables it sets,
as under torchrun. The ways run interleaved, ``--repeats`` times each. Per job, on its slowest rank:

- step: the median seconds of a training step (forward, backward, averaging, update);
- the gradients' allreduce alone (one ``all_reduce`` of all gradient bytes, raw gloo).

One process with the same batch on one emulated node's core gives the step without averaging
(compute). Hidden is the share of the allreduce a way hides behind backward, 1 - (step - compute)
/ allreduce; the weak-scaling efficiency is compute / step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nodes import PROFILES, REPO, EmulatedNodes, job_env  # noqa: E402

WAYS = ("DDP", "DDP fp16 hook", "torchmn", "torchmn fp16", "torchmn shard_state", "torchmn powersgd")
MODELS = {"mlp": (100, 30, 5), "cnn": (32, 10, 2)}  # batch a rank, timed steps, warm-up steps


def build(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(),
                             nn.Linear(1000, 10)), (1, 28, 28)
    def conv(i, o):
        return [nn.Conv2d(i, o, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*conv(3, 64), *conv(64, 64), nn.MaxPool2d(2), *conv(64, 128), *conv(128, 128),
                         nn.MaxPool2d(2), *conv(128, 256), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(256 * 4 * 4, 10)), (3, 32, 32)


def rank_main(way: str, model_name: str) -> None:
    """One job's rank: time training steps, then the gradients' allreduce alone."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the node's cores, for every way alike
    batch, steps, warmup = MODELS[model_name]
    model, shape = build(model_name)
    optimizer = torch.optim.Adam(model.parameters())
    if way == "one process":
        rank, size = 0, 1
    elif way.startswith("DDP"):
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        if way == "DDP fp16 hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        import torchmn
        comm = torchmn.create_communicator()
        rank, size = comm.rank, comm.size
        if way.endswith(" MB buckets"):  # the bucket sweep: "torchmn 4 MB buckets"
            options = {"bucket_cap_mb": float(way.split()[1])}
        else:
            options = {"torchmn": {}, "torchmn fp16": {"compression": "fp16"},
                       "torchmn shard_state": {"shard_state": True},
                       "torchmn powersgd": {"compression": "powersgd"}}[way]
        optimizer = torchmn.create_multi_node_optimizer(optimizer, comm, **options)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        return time.perf_counter() - t0

    figures = {"step": statistics.median([step() for _ in range(warmup + steps)][warmup:])}
    if size > 1:
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        dist.barrier()
        times = []
        for _ in range(warmup + steps):
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - t0)
        figures["allreduce"] = statistics.median(times[warmup:])
        every = [None] * size
        dist.all_gather_object(every, figures)
        figures = {k: max(f[k] for f in every) for k in figures}
    if rank == 0:
        print("FIGURES " + json.dumps(figures), flush=True)
    if way.startswith("DDP"):
        # DDP with a communication hook can deadlock in gloo's teardown (the reducer's group joins
        # a thread that waits for the GIL it holds; seen with torch 2.13): the figures are out.
        sys.stdout.flush()
        os._exit(0)
    elif way != "one process":
        comm.finalize()


def run(argv: list[str], preexec=None) -> dict:
    proc = subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=1800,
                          preexec_fn=preexec)
    line = next((ln for ln in proc.stdout.splitlines() if "FIGURES " in ln), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"the job failed ({' '.join(argv[-3:])}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line.split("FIGURES ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["1gbit"], choices=list(PROFILES))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-sweep", nargs="*", type=float, default=[], metavar="MB",
                        help="also torchmn's default with these bucket_cap_mb (the first bucket stays at most 1 MB)")
    parser.add_argument("--rank", nargs=2, metavar=("WAY", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(*args.rank)
        return
    me = [sys.executable, str(Path(__file__))]
    ways = [*args.ways, *(f"torchmn {mb:g} MB buckets" for mb in args.bucket_sweep)]
    print("| link | model | way | step ms (median) | min-max | vs DDP | allreduce ms | hidden | weak scaling |")
    print("|---|---|---|---|---|---|---|---|---|")
    for link in args.links:
        with EmulatedNodes(2, link) as nodes:
            first_core = nodes.cores[0]
            for model in args.models:
                rows = {way: [] for way in ("one process", *ways)}
                for _ in range(args.repeats):
                    rows["one process"].append(run(me + ["--rank", "one process", model],
                                                   preexec=lambda: os.sched_setaffinity(0, first_core)))
                    for way in ways:
                        rows[way].append(run(nodes.torchmn_run(1, me + ["--rank", way, model])))
                one = statistics.median(r["step"] for r in rows["one process"])
                ddp = statistics.median(r["step"] for r in rows["DDP"]) if "DDP" in rows else None
                print(f"| {link} | {model} | one process (compute) | {one * 1e3:.1f} | - | - | - | - | - |", flush=True)
                for way in ways:
                    steps = [r["step"] for r in rows[way]]
                    step = statistics.median(steps)
                    allreduce = statistics.median(r["allreduce"] for r in rows[way])
                    hidden = min(1.0, max(0.0, 1 - (step - one) / allreduce))
                    versus = f"{step / ddp:.2f}x" if ddp else "-"
                    print(f"| {link} | {model} | {way} | {step * 1e3:.1f} | {min(steps) * 1e3:.1f}-"
                          f"{max(steps) * 1e3:.1f} | {versus} | {allreduce * 1e3:.1f} | {hidden:.0%} | "
                          f"{one / step:.0%} |", flush=True)


if __name__ == "__main__":
    main()
