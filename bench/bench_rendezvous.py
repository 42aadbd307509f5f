"""The rendezvous store behind its gate against the store alone: a rank's set-up and the store's
requests under ``torchmn run``.

    git archive <commit before the gate> | tar -x -C /tmp/base
    python bench/bench_rendezvous.py --baseline /tmp/base --np 4 --repeats 5

Each repeat runs ``torchmn run -np N python -c PROBE`` with this checkout and, with ``--baseline``,
with that checkout (the launcher and its ranks import torchmn from it), interleaved so that the
load of the machine falls on both alike. PROBE times, in every rank:

- ``create_communicator()``: the rendezvous and gloo's set-up, whose store requests go through the
  gate (a new client per rank, admitted after the gate looked the process up in /proc);
- ``split(rank % 2)``: a new process group, more store requests (a world of one, ``--np 1``,
  sets up no process group: its first two columns show nothing);
- 1000 ``set`` and 1000 ``get`` requests on a new client of the launcher's store, one after the
  other: the cost of the extra hop per request;

and the launcher's wall time for the whole job. The table shows the median over repeats of the
slowest rank (set-up waits for the slowest one anyway).

With ``--other-host`` (root, for network namespaces) the ranks run on an emulated host of their
own (``tests/cluster/netns.py``) and reach the launcher's store over a bridge, through that host's
relay.
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


def run_once(checkout: Path, np: int, where: list) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "MASTER_"))}
    env["PYTHONPATH"] = str(checkout) + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", str(np), *where, sys.executable, "-c",
                           PROBE], cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({checkout}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [dict((k, float(v)) for k, v in re.findall(r"(\w+)=([\d.]+)", line.split("TIMES", 1)[1]))
            for line in proc.stdout.splitlines() if "TIMES" in line]
    assert len(rows) == np, proc.stdout
    result = {field: max(row[field] for row in rows) for field in FIELDS}
    result["job"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout to compare with (without the gate)")
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--other-host", action="store_true",
                        help="run the ranks on an emulated host of their own (needs root)")
    parser.add_argument("--baseline-name", default="baseline (store alone)", help="the baseline's row")
    args = parser.parse_args()
    checkouts = {"this checkout": REPO}
    if args.baseline:
        checkouts[args.baseline_name] = args.baseline
    results = {name: [] for name in checkouts}
    cluster, where = None, []
    if args.other_host:
        sys.path.insert(0, str(REPO / "tests"))
        from cluster.netns import NetnsCluster

        cluster = NetnsCluster(["h1"])
        cluster.start()
        where = [*cluster.launcher_options(), "-H", f"{cluster.address('h1')}:{args.np}"]
    try:
        for _ in range(args.repeats):
            for name, checkout in checkouts.items():
                results[name].append(run_once(checkout, args.np, where))
    finally:
        if cluster is not None:
            cluster.stop()
    print(f"torchmn run -np {args.np}{' on another host' if cluster else ''}, median of {args.repeats} "
          f"(slowest rank), seconds")
    print(f"{'':24} {'create_communicator':>20} {'split':>8} {'2000 store requests':>20} {'whole job':>10}")
    for name, rows in results.items():
        median = {k: statistics.median(r[k] for r in rows) for k in (*FIELDS, "job")}
        print(f"{name:24} {median['setup']:20.3f} {median['split']:8.3f} {median['store']:20.3f} "
              f"{median['job']:10.2f}")


if __name__ == "__main__":
    main()
