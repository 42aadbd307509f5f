"""The pipeline's bubble and activation memory: GPipe and 1F1B, against the theory.

Run (one stage per rank):

    torchmn run -np 2 python bench/bench_pipeline.py
    torchmn run -np 2 python bench/bench_pipeline.py --micro-batches 1 2 4 8 --steps 5 --width 2048 --batch 512

Every stage is the same MLP block (``--layers`` Linear+ReLU of ``--width``), so the stages cost the
same. For each schedule and micro-batch count m it times ``Pipeline.train_step`` and, in turns with
it (medians of ``--steps`` rounds after a warm-up), on the same ranks at the same time, the
stage's own work with no pipeline: the forward and backward of the same m micro-batches, one
after another, with the gradient of the input on every stage but the first (which the pipeline
sends back) and the loss on the last. The bubble is the share of a step the busiest stage is not
computing: 1 - compute / step, against the theory (p - 1) / (m + p - 1), which counts no
communication. Also the peak bytes of activations each stage held for backward.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchmn
from torchmn.nn import Pipeline


def make_stage(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])


def interleaved_medians(fns, steps: int) -> list:
    """The median time of each of ``fns`` over ``steps`` rounds, after a warm-up round; each round
    calls every one once, so that a change in the machine's speed reaches them all alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(steps):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    comm = torchmn.create_communicator()
    p = comm.size
    x = torch.randn(args.batch, args.width)
    target = torch.randn(args.batch, args.width)
    rows = []
    for schedule in args.schedules:
        for m in args.micro_batches:
            stage = make_stage(args.width, args.layers)
            pipe = Pipeline(stage, comm, micro_batches=m, schedule=schedule, loss_fn=torch.nn.functional.mse_loss)

            def step():
                comm.barrier()
                pipe.train_step(x if pipe.is_first else None, target=target if pipe.is_last else None)

            def alone():
                comm.barrier()  # every stage computes at the same moment, as in the pipeline
                for piece, goal in zip(torch.tensor_split(x, m), torch.tensor_split(target, m)):
                    # A stage's work in the pipeline: every stage but the first also computes the
                    # gradient of its input (to send back), a sixth more work for a 2-layer stage.
                    piece = piece.detach().requires_grad_(not pipe.is_first)
                    out = stage(piece)
                    (torch.nn.functional.mse_loss(out, goal) if pipe.is_last else out.sum()).backward()

            step_s, compute_s = (max(times) for times in zip(*comm.allgather_obj(
                interleaved_medians([step, alone], args.steps))))
            memory = comm.allgather_obj(pipe.peak_activation_bytes)
            rows.append((schedule, m, step_s, compute_s, memory))
    if comm.rank == 0:
        print(f"# {p} stages, each {args.layers} x Linear({args.width}, {args.width}) + ReLU, batch {args.batch}, "
              f"median of {args.steps} steps, {torch.get_num_threads()} thread(s) per rank")
        print("| schedule | micro-batches | step | stage compute | bubble | theory (p-1)/(m+p-1) | "
              + " | ".join(f"peak activations, stage {s}" for s in range(p)) + " |")
        print("|---" * (6 + p) + "|")
        for schedule, m, step_s, compute_s, memory in rows:
            bubble = 1 - compute_s / step_s
            print(f"| {schedule} | {m} | {step_s * 1e3:.1f} ms | {compute_s * 1e3:.1f} ms | {bubble:.2f} | "
                  f"{(p - 1) / (m + p - 1):.2f} | " + " | ".join(f"{b / 1e6:.2f} MB" for b in memory) + " |")
    comm.finalize()


if __name__ == "__main__":
    main()
