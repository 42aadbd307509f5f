"""What losing a rank costs: torchmn's elastic jobs against torchrun's elastic agent, in one run.

Both train the MNIST MLP (bench/elastic_worker.py: 784-1000-1000-10, Adam, a global batch of 128)
with 4 ranks on this machine and commit (torchmn) or checkpoint (torchrun) every ``--every``
steps; the bench ``kill -9``s one rank at random, ``--kills`` times each, and measures:

- recovery: from the kill to the next completed step (torchmn: the survivors' first step in their
  new world; torchrun: the first step after its agent restarted every rank and they loaded the
  checkpoint);
- steps lost: the steps done again after the kill, beside the steps done since the last commit
  (checkpoint) when the rank was killed: equal when only those are lost;
- join (torchmn only): from the discovery script offering the freed slot again to the new rank's
  first step with the others.

    torchmn run -np 4 --min-np 2 --max-np 4 --host-discovery-script S python bench/elastic_worker.py --mode elastic
    torchrun --standalone --nproc-per-node 4 --max-restarts K --monitor-interval 0.1 bench/elastic_worker.py --mode torchrun

    python bench/bench_elastic.py                 # 5 kills each, a markdown table of medians
    python bench/bench_elastic.py --kills 3 --every 20 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "bench" / "elastic_worker.py")
RANKS = 4
TIMEOUT_S = 240.0


class Job:
    """One job in the background: its progress file, its ranks' pids, and the means to end it."""

    def __init__(self, argv: list, out: Path, env: dict):
        self.out = out
        self.log = open(out / "launcher.log", "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)

    def rows(self) -> list:
        path = self.out / "progress"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
        return rows

    def wait(self, condition, what: str) -> tuple:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            found = condition(self.rows())
            if found:
                return found
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.out / "launcher.log").read_text()[-3000:]
                raise SystemExit(f"bench_elastic: {'the job ended' if self.proc.poll() is not None else 'timed out'} "
                                 f"waiting for {what}; its output ends:\n{tail}")
            time.sleep(0.01)

    def steps_after(self, t: float, size: int, count: int):
        rows = [r for r in self.rows() if r[0] > t and r[2] == size]
        return rows[count - 1] if len(rows) >= count else None

    def kill_one(self) -> tuple:
        """SIGKILL one rank at random: (time of the kill, the last step done before it)."""
        pids = {}
        for path in (self.out / "pids").glob("*"):
            try:
                pid = int(path.read_text())
                os.kill(pid, 0)
                pids[path.name] = pid
            except (OSError, ValueError):
                continue
        victim = random.choice(sorted(pids))
        before = self.rows()[-1][1]
        t = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        return t, before

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def finish(self) -> None:
        (self.out / "stop").write_text("")
        try:
            self.proc.wait(timeout=120)
        finally:
            self.stop()


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHMN_", "TORCHELASTIC_", "SLURM_", "OMPI_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def measure_torchmn(out: Path, kills: int, every: int) -> list:
    slots = out / "slots"
    slots.write_text(str(RANKS))
    script = out / "discover.sh"
    script.write_text(f"#!/bin/sh\necho localhost:$(cat {slots})\n")
    script.chmod(0o755)
    job = Job([sys.executable, "-m", "torchmn", "run", "-np", str(RANKS), "--min-np", "2", "--max-np", str(RANKS),
               "--host-discovery-script", str(script), sys.executable, WORKER, str(out), "--mode", "elastic",
               "--every", str(every)], out, clean_env())
    results = []
    try:
        job.wait(lambda rows: len([r for r in rows if r[2] == RANKS]) >= every + 5, "the first steps")
        for _ in range(kills):
            slots.write_text(str(RANKS - 1))  # no new rank while the survivors recover
            time.sleep(1.5)                    # the launcher has read the script since
            job.wait(lambda rows: rows[-1][1] % every >= every // 2, "a step half-way between commits")
            t_kill, before = job.kill_one()
            first = job.wait(lambda rows: job.steps_after(t_kill, RANKS - 1, 1), "the survivors' first step")
            job.wait(lambda rows: job.steps_after(t_kill, RANKS - 1, 3), "the survivors' steps")
            t_offer = time.time()
            slots.write_text(str(RANKS))
            joined = job.wait(lambda rows: job.steps_after(t_offer, RANKS, 1), "the new rank's first step")
            results.append({"recovery_s": first[0] - t_kill, "steps_lost": before - (first[1] - 1),
                            "since_commit": before % every, "join_s": joined[0] - t_offer})
            job.wait(lambda rows: job.steps_after(joined[0], RANKS, every + 2), "steps with the new rank")
        job.finish()
    finally:
        job.stop()
    return results


def measure_torchrun(out: Path, kills: int, every: int) -> list:
    job = Job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               "--max-restarts", str(kills + 1), "--monitor-interval", "0.1", WORKER, str(out), "--mode", "torchrun",
               "--every", str(every)], out, clean_env())
    results = []
    try:
        job.wait(lambda rows: len(rows) >= every + 5, "the first steps")
        for _ in range(kills):
            job.wait(lambda rows: rows[-1][1] % every >= every // 2, "a step half-way between checkpoints")
            t_kill, before = job.kill_one()
            first = job.wait(lambda rows: job.steps_after(t_kill, RANKS, 1), "the first step after the restart")
            results.append({"recovery_s": first[0] - t_kill, "steps_lost": before - (first[1] - 1),
                            "since_commit": before % every})
            job.wait(lambda rows: job.steps_after(first[0], RANKS, every + 2), "steps after the restart")
        job.finish()
    finally:
        job.stop()
    return results


def summary(results: list, key: str) -> str:
    values = [r[key] for r in results if key in r]
    if not values:
        return "-"
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5, help="ranks killed per launcher (default 5)")
    parser.add_argument("--every", type=int, default=20, help="steps between commits/checkpoints (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every kill's figures here")
    args = parser.parse_args()
    random.seed(args.seed)
    base = Path(tempfile.mkdtemp(prefix="torchmn-bench-elastic-"))
    try:
        figures = {}
        for name, measure in (("torchmn elastic", measure_torchmn), ("torchrun --max-restarts", measure_torchrun)):
            out = base / name.split()[0]
            out.mkdir()
            figures[name] = measure(out, args.kills, args.every)
            print(f"{name}: {figures[name]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{RANKS} ranks on {os.cpu_count()} CPUs, a commit/checkpoint every {args.every} steps, {args.kills} "
          f"kills each; median (min-max)\n")
    print("| launcher | kill to next step (s) | steps lost | steps since the last commit | "
          "slot offered to new rank's first step (s) |")
    print("|---|---|---|---|---|")
    for name, results in figures.items():
        print(f"| {name} | {summary(results, 'recovery_s')} | {summary(results, 'steps_lost')} | "
              f"{summary(results, 'since_commit')} | {summary(results, 'join_s')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"every": args.every, "ranks": RANKS, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
