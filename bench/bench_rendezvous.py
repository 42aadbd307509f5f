"""The rendezvous store behind torchmn's gate against torchrun's store: a rank's set-up and the
store's requests.

    python bench/bench_rendezvous.py --np 4 --repeats 5
    python bench/bench_rendezvous.py --np 2 --repeats 7 --other-host     # root: network namespaces

Each repeat runs ``python -c PROBE`` on N ranks under ``torchmn run -np N`` and under ``torchrun
--standalone --nproc-per-node N`` (whose ranks reach its store directly, without a gate),
interleaved so that the load of the machine falls on both alike. PROBE times, in every rank:

- ``create_communicator()``: the rendezvous and gloo's set-up, whose store requests go through
  torchmn's gate (a new client per rank, admitted after the gate looked the process up in /proc);
- ``split(rank % 2)``: a new process group, more store requests (a world of one, ``--np 1``,
  sets up no process group: its first two columns show nothing);
- 1000 ``set`` and 1000 ``get`` requests on a new client of the launcher's store, one after the
  other: the cost of the gate's hop per request;

and the launcher's wall time for the whole job. The table shows the median over repeats of the
slowest rank (set-up waits for the slowest one anyway).

With ``--other-host`` (root, for network namespaces) a third row runs torchmn's ranks on an
emulated host of their own (``tests/cluster/netns.py``), reaching the launcher's store over a
bridge through that host's relay.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = r"""
import datetime, os, time
t0 = time.perf_counter()
import torchmn
import torch.distributed as dist
t1 = time.perf_counter()
comm = torchmn.create_communicator("flat")
t2 = time.perf_counter()
sub = comm.split(comm.rank % 2) if comm.size > 1 else None  # a world of one has no process group
t3 = time.perf_counter()
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=60))
for i in range(1000):
    store.set(f"bench/{comm.rank}/{i}", "x" * 64)
for i in range(1000):
    store.get(f"bench/{comm.rank}/{i}")
t4 = time.perf_counter()
if comm.size > 1:
    comm.barrier()
print(f"TIMES setup={t2 - t1:.4f} split={t3 - t2:.4f} store={t4 - t3:.4f}", flush=True)
"""

FIELDS = ("setup", "split", "store")


def run_once(argv: list, np: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "MASTER_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    proc = subprocess.run([*argv, sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(argv)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    # Ranks share one stdout under torchrun, so one rank's line may run into another's.
    rows = [dict(setup=float(a), split=float(b), store=float(c))
            for a, b, c in re.findall(r"TIMES setup=([\d.]+) split=([\d.]+) store=([\d.]+)", proc.stdout)]
    assert len(rows) == np, proc.stdout
    result = {field: max(row[field] for row in rows) for field in FIELDS}
    result["job"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--other-host", action="store_true",
                        help="also run torchmn's ranks on an emulated host of their own (needs root)")
    args = parser.parse_args()
    np = str(args.np)
    launchers = {"torchmn run": [sys.executable, "-m", "torchmn", "run", "-np", np],
                 "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", np,
                              "--no-python"]}
    cluster = None
    if args.other_host:
        sys.path.insert(0, str(REPO / "tests"))
        from cluster.netns import NetnsCluster

        cluster = NetnsCluster(["h1"])
        cluster.start()
        launchers["torchmn run, ranks on another host"] = [
            sys.executable, "-m", "torchmn", "run", "-np", np, *cluster.launcher_options(),
            "-H", f"{cluster.address('h1')}:{args.np}"]
    results = {name: [] for name in launchers}
    try:
        for _ in range(args.repeats):
            for name, argv in launchers.items():
                results[name].append(run_once(argv, args.np))
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"{args.np} rank(s), median of {args.repeats} (slowest rank), seconds")
    print("| launcher | create_communicator | split | 2000 store requests | whole job |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        median = {k: statistics.median(r[k] for r in rows) for k in (*FIELDS, "job")}
        print(f"| {name} | {median['setup']:.3f} | {median['split']:.3f} | {median['store']:.3f} | "
              f"{median['job']:.2f} |")


if __name__ == "__main__":
    main()
