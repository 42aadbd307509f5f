"""Strong scaling on one node: one process using every core against N ranks with cores/N threads each,
for torchmn's default optimizer and for torchrun + DistributedDataParallel (torch's default Adam and
its fused Adam), with a per-step breakdown.

Two MLPs with Adam, a global batch of 128 split over the ranks, fixed random data:

- ``mlp1000``: 784-1000-1000-10 (1.8 M parameters), 160 steps: the update costs about as much as
  forward and backward, so splitting it is what lets ranks beat one process;
- ``mlp4000``: 784-4000-4000-10 (19 M parameters), 32 steps: memory traffic per step dominates.

Rank counts are 1, 2, 4, ... up to the usable cores (``os.sched_getaffinity``), each rank given
cores/N threads, so every row uses every core. Runs are interleaved (each round runs every row
once) and the table shows medians over the rounds, the time of the training loop alone on the
slowest rank, and its ratios against one process and against DDP with the same ranks and Adam.

The breakdown is the slowest rank's median per step, in milliseconds:

- ``fwd+bwd``: from the end of the last step to the end of backward's compute;
- ``averaging``: torchmn's averaging after backward's compute, including the wait for the other
  ranks' gradients (DDP averages inside backward, overlapped with it: its ``fwd+bwd`` includes
  what of the averaging is not hidden, and the column shows ``-``);
- ``update``: the optimizer's update (torchmn: this rank's slices);
- ``waiting``: after the update, the wait for the other ranks' slices (torchmn only).

torchmn's figures come from its own recorder (``torchmn.monitor.recorder``, as ``--timeline``
uses it), so the breakdown costs each step a few clock readings.

    python bench/bench_node_scaling.py                        # every row that fits, median of 3 rounds
    python bench/bench_node_scaling.py --models mlp1000 --ranks 1 2 --rounds 5
    python bench/bench_node_scaling.py --steps-scale 0.25      # a quick look (a quarter of the steps)
    python bench/bench_node_scaling.py --bind core             # torchmn's ranks on cores of their own

On a machine with fewer cores than the largest rank count asked for, the rows that do not fit are
left out and the script says so; the goals (N ranks no slower than one process up to half the
cores, 2 ranks at most 0.65x one process, torchmn at most 0.25x DDP's time) are printed with the
table, each marked met or not.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from variants import RESULT, run_job

GLOBAL_BATCH = 128
WARM_STEPS = 2  # steps left out of the breakdown (first touch of buffers and state)
# name: (hidden width, steps)
MODELS = {"mlp1000": (1000, 160), "mlp4000": (4000, 32)}
# name: (launcher, what each rank runs, Adam update)
SYSTEMS = {"one process": ("python", "single", "for-loop"),
           "one process, fused Adam": ("python", "single-fused", "fused"),
           "torchmn": ("torchmn", "torchmn", "fused (its default)"),
           "DDP": ("torchrun", "ddp", "for-loop"),
           "DDP, fused Adam": ("torchrun", "ddp-fused", "fused")}


def steps_of(model: str, scale: float) -> int:
    """The steps ``model`` trains for, scaled, with at least one step past the warm-up."""
    return max(WARM_STEPS + 1, round(MODELS[model][1] * scale))


# ----------------------------------------------------------------------------- one rank's work
def worker(args) -> None:
    """Train ``args.model`` for its steps on this rank's part of each global batch; rank 0 prints
    one JSON result line with the slowest rank's loop time and breakdown."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(args.threads)
    mode = args.worker
    width, steps = MODELS[args.model][0], steps_of(args.model, args.steps_scale)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    optimizer = torch.optim.Adam(model.parameters(), **({"fused": True} if mode.endswith("fused") else {}))
    rank, size, comm, recorder = 0, 1, None, None
    gather = (lambda obj: [obj])
    if mode.startswith("ddp"):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = nn.parallel.DistributedDataParallel(model)

        def gather(obj):
            out = [None] * size
            dist.all_gather_object(out, obj)
            return out
        dist.barrier()
    elif mode == "torchmn":
        import torchmn
        from torchmn.monitor import recorder
        comm = torchmn.create_communicator()
        rank, size = comm.rank, comm.size
        optimizer = torchmn.create_multi_node_optimizer(optimizer, comm)
        gather = comm.allgather_obj
        comm.barrier()
    g = torch.Generator().manual_seed(1)
    local = GLOBAL_BATCH // size
    x = torch.rand(GLOBAL_BATCH, 784, generator=g)[rank * local:(rank + 1) * local]
    y = torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)[rank * local:(rank + 1) * local]
    marks = []  # per step: (start, backward returned, step returned)
    if recorder is not None:
        recorder.start(timeline=True)
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        optimizer.step()
        marks.append((t0, t1, time.perf_counter()))
    elapsed = time.perf_counter() - start
    parts = breakdown(marks[WARM_STEPS:], recorder)
    everyone = gather({"seconds": elapsed, "parts": parts})
    if rank == 0:
        slowest = {k: max(e["parts"][k] for e in everyone) if parts[k] is not None else None for k in parts}
        print(RESULT + json.dumps({"seconds": max(e["seconds"] for e in everyone), "parts": slowest}), flush=True)
    if comm is not None:
        comm.finalize()
    elif mode.startswith("ddp"):
        import torch.distributed as dist
        time.sleep(0.05)  # let gloo's threads drop their last work first
        dist.destroy_process_group()


def breakdown(marks: list, recorder) -> dict:
    """Median milliseconds per step of each part (see the module's docstring), from torchmn's
    recorder where it ran (None for the peers, whose step splits only into backward and step)."""
    def ms(values):
        return round(1e3 * statistics.median(values), 3) if values else None

    if recorder is None:
        return {"fwd+bwd": ms([t1 - t0 for t0, t1, _ in marks]), "averaging": None,
                "update": ms([t2 - t1 for _, t1, t2 in marks]), "waiting": None}
    # A step's forward+backward phase begins where the step before ended, a little before its mark.
    first = recorder.wall_time(marks[0][0]) - 1e-4
    kept = [e for e in recorder.stop_timeline() if e[2] >= first]

    def durations(name):
        return [t1 - t0 for n, _, t0, t1, _, _ in kept if n == name]
    return {"fwd+bwd": ms(durations("forward+backward")), "averaging": ms(durations("average")),
            "update": ms(durations("update")), "waiting": ms(durations("wait for the node's update"))}


# ----------------------------------------------------------------------------- the driver
def run_once(system: str, ranks: int, threads: int, model: str, args) -> dict:
    launcher, mode, _ = SYSTEMS[system]
    own = [str(Path(__file__).resolve()), "--worker", mode, "--threads", str(threads), "--model", model,
           "--steps-scale", str(args.steps_scale)]
    return run_job(f"{system} x {ranks}", launcher, ranks, threads, own, args.timeout,
                   launcher_args=("--bind", args.bind))


def rows_for(cores: int, ranks: list) -> list:
    """The (system, ranks, threads per rank) rows: one process on every core, then each rank count."""
    rows = [("one process", 1, cores), ("one process, fused Adam", 1, cores)]
    for n in ranks:
        if n > 1:
            rows += [(s, n, cores // n) for s in ("torchmn", "DDP", "DDP, fused Adam")]
    return rows


def table(model: str, results: dict, cores: int, args) -> tuple[str, list]:
    """The markdown table of one model, and the goals' verdicts."""
    med = {row: statistics.median(r["seconds"] for r in runs) for row, runs in results.items()}
    one = med[("one process", 1, cores)]
    head = ["system", "ranks x threads", "Adam update", "loop s (median)", "min-max", "vs one process",
            "vs DDP", "vs DDP fused Adam", "fwd+bwd ms", "averaging ms", "update ms", "waiting ms"]
    lines = [f"**{model}** ({MODELS[model][0]} wide, {steps_of(model, args.steps_scale)} steps)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    goals = []
    for row, runs in results.items():
        system, n, threads = row
        secs = [r["seconds"] for r in runs]
        peers = [med.get((p, n, threads)) for p in ("DDP", "DDP, fused Adam")]
        vs = [f"{med[row] / p:.2f}x" if p and system == "torchmn" else "-" for p in peers]
        parts = {k: statistics.median(r["parts"][k] for r in runs) if runs[0]["parts"][k] is not None else None
                 for k in runs[0]["parts"]}
        cells = [system, f"{n} x {threads}", SYSTEMS[system][2], f"{med[row]:.2f}", f"{min(secs):.2f}-{max(secs):.2f}",
                 f"{med[row] / one:.2f}x"] + vs + ["-" if v is None else f"{v:.1f}" for v in parts.values()]
        lines.append("| " + " | ".join(cells) + " |")
        if system == "torchmn":
            ratio = med[row] / one
            if n <= cores // 2:
                goals.append((f"{model}: torchmn {n} ranks <= 1.0x one process", ratio <= 1.0, f"{ratio:.2f}x"))
            if n == 2:
                goals.append((f"{model}: torchmn 2 ranks <= 0.65x one process", ratio <= 0.65, f"{ratio:.2f}x"))
            for peer_name in ("DDP", "DDP, fused Adam"):
                p = med.get((peer_name, n, threads))
                if p:
                    goals.append((f"{model}: torchmn {n} ranks <= 0.25x {peer_name}", med[row] / p <= 0.25,
                                  f"{med[row] / p:.2f}x"))
    return "\n".join(lines), goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, default=None,
                        help="rank counts (default 1, 2, 4, ... up to the usable cores)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale every model's step count")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    # torchmn run's modes spelled out (torchmn.run.processes.binding.MODES): this driver starts the
    # jobs and imports nothing of torchmn, so that it runs where torchmn is not importable.
    parser.add_argument("--bind", choices=("numa", "core", "none"), default="numa",
                        help="torchmn run's --bind for the torchmn rows (default: its default, numa)")
    parser.add_argument("--worker", choices=sorted({v[1] for v in SYSTEMS.values()}), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    # CPU training on every core: on a GPU machine, the GPUs stay out of it (the jobs inherit this).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    cores = len(os.sched_getaffinity(0))
    wanted = args.ranks or [1 << i for i in range(cores.bit_length()) if 1 << i <= cores]
    ranks = [n for n in wanted if n <= cores and cores % n == 0]
    left_out = sorted(set(wanted) - set(ranks))
    print(f"{cores} usable cores: rank counts {ranks}, each with {cores} // N threads; "
          f"torchmn run --bind {args.bind}"
          + (f"; left out (more ranks than cores, or not dividing them): {left_out}" if left_out else "")
          + ("; the full table (8 ranks and more) needs 16 cores" if cores < 16 else ""), flush=True)
    verdicts = []
    for model in args.models:
        rows = rows_for(cores, ranks)
        results = {row: [] for row in rows}
        for i in range(args.rounds):
            for row in rows:
                r = run_once(row[0], row[1], row[2], model, args)
                results[row].append(r)
                print(f"round {i + 1}/{args.rounds} {model} {row[0]} {row[1]} x {row[2]}: {r['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
        text, goals = table(model, results, cores, args)
        print("\n" + text, flush=True)
        verdicts += goals
    print(f"\nGlobal batch {GLOBAL_BATCH}, fixed random data; training loop only, slowest rank; median of "
          f"{args.rounds} interleaved rounds; breakdown: slowest rank's median per step.\n")
    for what, met, value in verdicts:
        print(f"- goal {what}: {value}, {'met' if met else 'not met'}")


if __name__ == "__main__":
    main()
