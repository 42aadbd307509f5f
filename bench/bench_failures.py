"""How fast a job ends when one of its ranks dies or raises, under each launcher.

    python bench/bench_failures.py --repeats 10

Every job is 4 ranks of one small script (``create_communicator()``, then allreduces in a loop).

- **kill -9**: once every rank is in the loop, the bench sends SIGKILL to rank 1 and times until
  the launcher exits, under ``torchmn run`` and ``torchrun``.
- **exception**: once every rank is in the loop, rank 1 reads the clock and raises ValueError while
  the other three wait for it in an allreduce; the time is from that clock reading to the
  launcher's exit, under ``torchmn run``, ``srun`` (2 nodes x 2 ranks on the test Slurm cluster of
  ``tests/cluster/slurm.py``, started and stopped by the bench; needs root and Slurm), ``mpirun``
  (Open MPI) and ``torchrun``. "rank 1's traceback shown" counts how often its source line
  appears in the job's output (torchmn run repeats the traceback once in its summary), "tracebacks
  in all" every traceback printed (the other ranks', the launcher's own), each as the values seen
  over the runs; "timeouts" counts the runs that did not end within ``--job-timeout``.

Runs are interleaved (each repeat runs every row once) so that the machine's load falls on all
rows alike; each row gives the median, and the spread as min-max, in seconds. ``--quiet-load``
waits (polling each minute, up to ``--quiet-wait`` seconds) for the 1-minute load average to fall
below it before measuring, and the load is printed before and after.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
NP = 4

RANK_SCRIPT = r"""
import os, sys, time, torch, torchmn
mode, out = sys.argv[1], sys.argv[2]
comm = torchmn.create_communicator()
x = torch.ones(1000)
for _ in range(5):
    comm.allreduce(x)
comm.barrier()
if comm.rank == 1:
    if mode == "raise":
        time.sleep(0.5)  # the others are in the allreduce below by now
        with open(os.path.join(out, "raised_at"), "w") as f:
            f.write(repr(time.time()))
        raise ValueError("boom from rank 1")
    with open(os.path.join(out, "pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, "pid.tmp"), os.path.join(out, "pid"))
while True:
    comm.allreduce(x)
"""

_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHMN_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                   "MASTER_PORT"}


def job_env(extra: Optional[dict] = None) -> dict:
    """This environment without an outer launcher's variables, importing torchmn from this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra or {})
    return env


def launch_argv(launcher: str, script: Path, mode: str, out: Path) -> list:
    py = sys.executable
    args = [str(script), mode, str(out)]
    if launcher == "torchmn run":
        return [py, "-m", "torchmn", "run", "-np", str(NP), py, *args]
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", "--nproc-per-node", str(NP), "--standalone", *args]
    if launcher == "mpirun":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return ["mpiexec.openmpi", *root, "--oversubscribe", "--bind-to", "none", "-np", str(NP), py, *args]
    if launcher == "srun":
        return ["srun", "-N", "2", "--ntasks-per-node", str(NP // 2), py, *args]
    raise ValueError(launcher)


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def run_once(launcher: str, mode: str, script: Path, env_extra: dict, job_timeout: float) -> dict:
    """One job; returns {"seconds": float or None (it did not run to the end), "tracebacks": rank 1's,
    "all_tracebacks": every one, "note": why there are no seconds}."""
    with tempfile.TemporaryDirectory(prefix="bench-failures-") as tmp:
        out = Path(tmp)
        proc = subprocess.Popen(launch_argv(launcher, script, mode, out), cwd=REPO,
                                env=job_env(env_extra), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        reader = _Reader(proc)
        try:
            if mode == "kill":
                if not wait_for_file(out / "pid", proc, job_timeout):
                    return {"seconds": None, "tracebacks": 0, "note": "rank 1 never started: " + reader.tail()}
                time.sleep(0.5)  # every rank is back in the loop's allreduce
                start = time.time()
                os.kill(int((out / "pid").read_text()), signal.SIGKILL)
            try:
                proc.wait(timeout=job_timeout)
            except subprocess.TimeoutExpired:
                return {"seconds": None, "tracebacks": 0, "note": "timeout"}
            end = time.time()
            if mode == "raise":
                if not (out / "raised_at").exists():
                    return {"seconds": None, "tracebacks": 0, "note": "rank 1 never raised: " + reader.tail()}
                start = float((out / "raised_at").read_text())
            text = reader.text()
            # The raise's own source line appears in rank 1's traceback alone.
            return {"seconds": end - start, "tracebacks": text.count('raise ValueError("boom from rank 1")'),
                    "all_tracebacks": text.count("Traceback (most recent call last)"), "note": ""}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            reader.join()


class _Reader:
    """Reads a job's output in a thread, so a full pipe never stalls it."""

    def __init__(self, proc: subprocess.Popen):
        import threading

        self._chunks: list = []
        self._thread = threading.Thread(target=lambda: self._chunks.extend(proc.stdout), daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join(timeout=10)

    def text(self) -> str:
        self.join()
        return "".join(self._chunks)

    def tail(self) -> str:
        return "".join(self._chunks)[-2000:]


def quiet_machine(limit: float, wait_s: float) -> float:
    """Wait (polling each minute) for the 1-minute load average to fall below ``limit``."""
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load >= limit and time.monotonic() < deadline:
        print(f"# 1-minute load {load:.2f} >= {limit}: waiting", file=sys.stderr, flush=True)
        time.sleep(min(60.0, max(1.0, deadline - time.monotonic())))
        load = os.getloadavg()[0]
    return load


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return (f"{platform.node()}: {model}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def start_slurm() -> tuple:
    """The test Slurm cluster (tests/cluster/slurm.py), or (None, why not)."""
    sys.path.insert(0, str(REPO / "tests"))
    from cluster.slurm import SlurmCluster, missing_programs

    missing = missing_programs()
    if missing:
        return None, f"Slurm programs missing: {', '.join(missing)}"
    if os.geteuid() != 0:
        return None, "the test Slurm cluster needs root"
    cluster = SlurmCluster(tempfile.mkdtemp(prefix="bench-failures-slurm-"))
    cluster.start(timeout=60)
    return cluster, ""


def summarize(rows: list, mode: str) -> str:
    times = [r["seconds"] for r in rows if r["seconds"] is not None]
    timeouts = sum(1 for r in rows if r["note"] == "timeout")
    failed = sum(1 for r in rows if r["seconds"] is None and r["note"] != "timeout")
    ran = [r for r in rows if r["seconds"] is not None and mode == "raise"]
    tracebacks = "/".join(map(str, sorted({r["tracebacks"] for r in ran}))) or "-"
    every = "/".join(map(str, sorted({r["all_tracebacks"] for r in ran}))) or "-"
    median = f"{statistics.median(times):.2f}" if times else "-"
    spread = f"{min(times):.2f}-{max(times):.2f}" if times else "-"
    extra = f" ({failed} failed to run)" if failed else ""
    return f"{median} | {spread} | {len(times)}{extra} | {timeouts} | {tracebacks} | {every}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--launchers", default="torchmn run,srun,mpirun,torchrun",
                        help="comma-separated subset of: torchmn run, srun, mpirun, torchrun")
    parser.add_argument("--job-timeout", type=float, default=90.0, help="seconds a job may take to end")
    parser.add_argument("--quiet-load", type=float, default=None,
                        help="wait for the 1-minute load average to fall below this first")
    parser.add_argument("--quiet-wait", type=float, default=900.0)
    args = parser.parse_args()
    launchers = [name.strip() for name in args.launchers.split(",")]

    cluster, slurm_note = (None, "not asked for")
    if "srun" in launchers:
        cluster, slurm_note = start_slurm()
    if "mpirun" in launchers and shutil.which("mpiexec.openmpi") is None:
        launchers.remove("mpirun")
        print("# mpirun left out: mpiexec.openmpi not found (apt-get install -y openmpi-bin)", file=sys.stderr)
    if "srun" in launchers and cluster is None:
        launchers.remove("srun")
        print(f"# srun left out: {slurm_note}", file=sys.stderr)

    rows: list = [("kill", launcher) for launcher in ("torchmn run", "torchrun") if launcher in launchers]
    rows += [("raise", launcher) for launcher in launchers]
    results: dict = {row: [] for row in rows}
    load_before = quiet_machine(args.quiet_load, args.quiet_wait) if args.quiet_load else os.getloadavg()[0]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-failures-script-") as tmp:
            script = Path(tmp) / "rank.py"
            script.write_text(RANK_SCRIPT)
            for repeat in range(args.repeats):
                for mode, launcher in rows:
                    extra = {"SLURM_CONF": str(cluster.conf)} if launcher == "srun" else {}
                    result = run_once(launcher, mode, script, extra, args.job_timeout)
                    results[(mode, launcher)].append(result)
                    shown = f"{result['seconds']:.2f} s" if result["seconds"] is not None else result["note"]
                    print(f"# repeat {repeat + 1}: {mode} {launcher}: {shown}", file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    load_after = os.getloadavg()[0]

    print(f"# {machine()}")
    print(f"# command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"# 1-minute load average: {load_before:.2f} before, {load_after:.2f} after")
    print(f"# {NP} ranks; srun: 2 nodes x {NP // 2} ranks on the test Slurm cluster (both nodes on this machine)")
    print()
    print("| failure | launcher | median s | min-max s | runs | timeouts | rank 1's traceback shown "
          "| tracebacks in all |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, launcher in rows:
        what = "kill -9 of rank 1 -> launcher exit" if mode == "kill" else "exception in rank 1 -> job end"
        print(f"| {what} | {launcher} | {summarize(results[(mode, launcher)], mode)} |")


if __name__ == "__main__":
    main()
