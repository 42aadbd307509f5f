"""torchmn with default settings against its peers, measured in one run: the optimizer, the gradient
mean, the checked allreduce, and the MNIST example end to end.

    python bench/bench_default.py                              # all parts, a markdown table each
    python bench/bench_default.py --parts collectives --rounds 3
    python bench/bench_default.py --parts optimizer mnist --repeats 3

The parts (2 ranks on one node, each with torchmn's default thread budget):

- ``optimizer``: the MNIST MLP loop of ``bench_zero.py`` (784-1000-1000-10, Adam, 1000 samples,
  global batch 100, 20 epochs) with ``create_multi_node_optimizer(optimizer, comm)`` and nothing
  else, against one process with 2 threads and torchrun + DDP, the latter with torch's default Adam
  (on the CPU its for-loop implementation) and with ``torch.optim.Adam(fused=True)``, the kernel
  that torchmn's default steps its shards with;
- ``collectives``: ``comm.multi_node_mean_grad(model)`` on that MLP's gradients (7.2 MB) and on a
  0.1 MB model, against a raw gloo ``all_reduce`` of the same bytes; ``comm.allreduce(x)`` (checked,
  a new tensor) and ``comm.allreduce_(x)`` (checked, in place) from 4 KB to 64 MB against gloo's
  in-place ``all_reduce`` of the same tensor. Each figure is the median over rounds of the mean
  time of a burst of calls (the slowest rank's), the peer timed in the same round;
- ``mnist``: ``torchmn run -np 2 python examples/mnist/train_mnist.py`` against
  ``python examples/mnist/train_mnist_single.py``, both with no flags: wall time of the whole
  command and the training time each logs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_zero
from allocator import ALLOCATOR_ENV

REPO = Path(__file__).resolve().parent.parent
RESULT = "BENCH_RESULT "
MB = 1 << 20
ALLREDUCE_BYTES = [4 << 10, 100 << 10, 1 << 20, int(7.2 * MB), 32 << 20, 64 << 20]


# ----------------------------------------------------------------------------- collectives (one rank's work)
def collectives_worker(rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import torchmn

    comm = torchmn.create_communicator()

    def burst(fn, nbytes):
        calls = max(3, min(50, 200 * MB // max(nbytes, 1)))  # about 200 MB a burst
        fn()  # warm: buffers, plans
        comm.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls

    def with_grads(model):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        return model

    mlp = with_grads(bench_zero.make_model())
    small = with_grads(torch.nn.Linear(156, 160))  # 25,120 parameters: 0.1 MB of gradients
    cases = {}
    for name, model in (("multi_node_mean_grad 7.2 MB", mlp), ("multi_node_mean_grad 0.1 MB", small)):
        flat = torch.randn(sum(p.numel() for p in model.parameters()))
        cases[name] = (flat.numel() * 4, lambda m=model: comm.multi_node_mean_grad(m),
                       lambda f=flat: dist.all_reduce(f))
    for nbytes in ALLREDUCE_BYTES:
        x = torch.randn(nbytes // 4)
        label = f"{nbytes / MB:.1f} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
        cases[f"allreduce {label}"] = (nbytes, lambda x=x: comm.allreduce(x), lambda x=x: dist.all_reduce(x))
        cases[f"allreduce_ {label}"] = (nbytes, lambda x=x: comm.allreduce_(x), lambda x=x: dist.all_reduce(x))
    times = {name: ([], []) for name in cases}
    for _ in range(rounds):
        for name, (nbytes, ours, gloo) in cases.items():
            times[name][1].append(burst(gloo, nbytes))
            times[name][0].append(burst(ours, nbytes))
    # The slowest rank's time of each burst.
    every = comm.allgather_obj(times)
    if comm.rank == 0:
        slowest = {name: [[max(r[name][k][i] for r in every) for i in range(rounds)] for k in (0, 1)]
                   for name in cases}
        print(RESULT + json.dumps(slowest), flush=True)
    comm.finalize()


def collectives_table(args) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "OMP_", "MKL_"))}
    env.update(ALLOCATOR_ENV, PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable, str(Path(__file__).resolve()),
            "--worker", "collectives", "--rounds", str(args.rounds)]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if RESULT in ln]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"collectives failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1].split(RESULT, 1)[1])
    rows = ["| call, bytes | torchmn ms (median, min-max) | gloo all_reduce ms (median) | speed vs gloo |",
            "|---|---|---|---|"]
    for name, (ours, gloo) in result.items():
        mine, peer = statistics.median(ours), statistics.median(gloo)
        rows.append(f"| `{name.split()[0]}` {' '.join(name.split()[1:])} | {mine * 1e3:.3f} "
                    f"({min(ours) * 1e3:.3f}-{max(ours) * 1e3:.3f}) | {peer * 1e3:.3f} | {peer / mine:.2f}x |")
    rows.append(f"\n2 ranks on one node; median of {args.rounds} rounds, each the mean of a burst of calls "
                f"(slowest rank), gloo timed in the same round.")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the optimizer
def optimizer_table(args) -> str:
    names = ["single-2t", "ddp", "ddp-fused", "torchmn"]
    zero_args = argparse.Namespace(epochs=20, samples=1000, batch=100, timeout=args.timeout)
    runs = {n: [] for n in names}
    for i in range(args.repeats):
        for n in names:
            runs[n].append(bench_zero.run_once(n, zero_args)["seconds"])
            print(f"optimizer {i + 1}/{args.repeats} {n}: {runs[n][-1]:.2f} s", file=sys.stderr, flush=True)
    med = {n: statistics.median(v) for n, v in runs.items()}
    labels = {"single-2t": "one process, 2 threads", "ddp": "torchrun + DDP, 2 ranks",
              "ddp-fused": "torchrun + DDP fused Adam, 2 ranks", "torchmn": "torchmn default, 2 ranks"}
    rows = [("| variant | Adam update | median s | min-max s | time vs one process | time vs DDP "
             "| time vs DDP fused Adam |"), "|---|---|---|---|---|---|---|"]
    for n in names:
        ratios = " | ".join(f"{med[n] / med[ref]:.2f}x" for ref in ("single-2t", "ddp", "ddp-fused"))
        rows.append(f"| {labels[n]} | {bench_zero.ADAM_UPDATE[n]} | {med[n]:.2f} | "
                    f"{min(runs[n]):.2f}-{max(runs[n]):.2f} | {ratios} |")
    rows.append(f"\nThe training loop of bench_zero.py (slowest rank), median of {args.repeats} runs, interleaved.")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the MNIST example
def mnist_table(args) -> str:
    py, mnist = sys.executable, REPO / "examples" / "mnist"
    commands = {
        "python examples/mnist/train_mnist_single.py": [py, str(mnist / "train_mnist_single.py")],
        "torchmn run -np 2 python examples/mnist/train_mnist.py": [py, "-m", "torchmn", "run", "-np", "2", py,
                                                                  str(mnist / "train_mnist.py")],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "OMP_", "MKL_"))}
    env.update(ALLOCATOR_ENV)
    runs = {c: [] for c in commands}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for label, argv in commands.items():
                log = Path(tmp) / "log.json"
                start = time.perf_counter()
                proc = subprocess.run(argv + ["--log-file", str(log)], cwd=tmp, env=env, capture_output=True,
                                      text=True, timeout=args.timeout)
                wall = time.perf_counter() - start
                if proc.returncode != 0:
                    raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
                last = json.loads(log.read_text())[-1]
                runs[label].append((wall, last["elapsed_time"], last["validation/main/accuracy"]))
                print(f"mnist {i + 1}/{args.repeats} {label}: {wall:.2f} s", file=sys.stderr, flush=True)
    rows = ["| command (no flags) | wall s (median, min-max) | training s (median) | validation accuracy |",
            "|---|---|---|---|"]
    for label, r in runs.items():
        walls = [w for w, _, _ in r]
        rows.append(f"| `{label}` | {statistics.median(walls):.2f} ({min(walls):.2f}-{max(walls):.2f}) | "
                    f"{statistics.median(t for _, t, _ in r):.2f} | {statistics.median(a for _, _, a in r):.3f} |")
    rows.append(f"\nMedian of {args.repeats} runs, interleaved; wall time includes start-up and validation.")
    return "\n".join(rows)


PARTS = {"optimizer": optimizer_table, "collectives": collectives_table, "mnist": mnist_table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant (optimizer, mnist)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of bursts (collectives)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument("--worker", choices=["collectives"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        collectives_worker(args.rounds)
        return
    for part in args.parts:
        print(f"\n### {part}\n\n{PARTS[part](args)}", flush=True)


if __name__ == "__main__":
    main()
