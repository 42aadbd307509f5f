"""A real two-node Slurm cluster on this one machine, for tests (recipe: CLUSTER_FACTS.md).

Nodes ``n1`` and ``n2`` are two ``slurmd`` daemons on this host (ports 17001 and 17002, both
reached at 127.0.0.1), managed by one ``slurmctld`` on port 17000. Everything the daemons write
(munge socket and key, configuration, state, spool, logs, pid files) lives under one scratch folder;
the only change outside it is a line in ``/etc/hosts`` so that ``n1`` and ``n2`` resolve, because
ranks rendezvous on the first node's name.

Needs root and Debian's ``slurmd slurmctld slurm-client munge``. Usage::

    cluster = SlurmCluster(tmp_dir)
    cluster.start()                       # waits until both nodes are idle
    cluster.run(["srun", "-n", "2", "hostname"])
    cluster.stop()                        # kills the daemons by the pids in their pid files
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from jobs import clean_env

NODES = ("n1", "n2")
NODE_PORTS = {"n1": 17001, "n2": 17002}
CTLD_PORT = 17000
CPUS_PER_NODE = 4
# How long a requeued job waits before it may start again (Slurm's default is 120 s).
CRED_EXPIRE = 5
HOSTS_LINE = "127.0.0.1 n1 n2  # torchmn tests: two Slurm nodes on this machine"
INSTALL_HINT = ("install them with `apt-get install -y slurmd slurmctld slurm-client munge` "
                "(Debian/Ubuntu); CI's .ci/run does this")
REQUIRED_PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "squeue")


class ClusterError(RuntimeError):
    """The cluster could not be brought up; the message includes the daemons' logs."""


def missing_programs() -> list[str]:
    """The Slurm and munge programs not found on PATH (daemons live in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [name for name in REQUIRED_PROGRAMS if shutil.which(name, path=path) is None]


def _which(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    found = shutil.which(name, path=path)
    if found is None:
        raise ClusterError(f"{name} is not installed; {INSTALL_HINT}")
    return found


def ensure_hosts_entry(hosts_file: str = "/etc/hosts") -> None:
    """Make ``n1`` and ``n2`` resolve to 127.0.0.1; adds one line, once, whoever runs this."""
    with open(hosts_file) as f:
        names = {word for line in f for word in line.split("#")[0].split()[1:]}
    if {"n1", "n2"} <= names:
        return
    with open(hosts_file, "a") as f:
        f.write("\n" + HOSTS_LINE + "\n")


class SlurmCluster:
    """Two Slurm nodes, a controller and a munge daemon, all rooted in ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.hostname = socket.gethostname()
        self.started: list[tuple[str, Path]] = []  # (name, pid file) of each daemon we started

    # -- environment ------------------------------------------------------------------------------

    def env(self, extra: Optional[dict] = None) -> dict:
        """The environment for client commands and jobs: no outer launcher's variables, the repo on
        PYTHONPATH, and SLURM_CONF pointing at this cluster."""
        return clean_env({"SLURM_CONF": str(self.conf), **(extra or {})})

    def run(self, argv: Sequence[str], timeout: float = 60, check: bool = True,
            env: Optional[dict] = None, cwd: Optional[str | Path] = None) -> subprocess.CompletedProcess:
        """Run a client command (srun, sbatch, ...) against this cluster; fail loudly on error or
        timeout. After a timeout every job is cancelled, so a hung step cannot hold the nodes (and
        stall the next test) once its srun is killed."""
        try:
            proc = subprocess.run(list(argv), env=self.env(env), cwd=cwd, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as error:
            self._cancel_jobs()
            raise AssertionError(f"{' '.join(map(str, argv))} did not finish within {timeout} s; cancelled "
                                 f"every job\n--- stdout ---\n{_text(error.stdout)[-6000:]}\n"
                                 f"--- stderr ---\n{_text(error.stderr)[-6000:]}") from None
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, argv))} exited with {proc.returncode}\n"
                                 f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
        return proc

    # -- start / stop -----------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        """Write the configuration, start munged, slurmctld and both slurmd, and wait until idle."""
        for name in ("munged", "slurmctld", "slurmd"):
            _which(name)
        ensure_hosts_entry()
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket folder others can write to.
        os.chmod(self.root / "munge", 0o700)
        self.conf.write_text(self._slurm_conf())
        try:
            self._start_munge()
            self._daemon("slurmctld", [_which("slurmctld"), "-f", str(self.conf)], self.root / "slurmctld.pid")
            for node in NODES:
                self._daemon(f"slurmd {node}", [_which("slurmd"), "-f", str(self.conf), "-N", node],
                             self.root / f"slurmd.{node}.pid")
            self._wait_idle(timeout)
        except BaseException:
            self.stop()  # whatever did start must not outlive a failed start
            raise

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        pid_file = self.root / "munge" / "munged.pid"
        # --force: we run as root and in a scratch folder, which munged would otherwise refuse.
        self._daemon("munged", [_which("munged"), "--force", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--pid-file={pid_file}",
                                f"--log-file={self.root / 'log' / 'munged.log'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}"], pid_file)

    def _daemon(self, name: str, argv: list[str], pid_file: Path) -> None:
        """Start a daemon (they fork into the background) and remember its pid file."""
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=self.env())
        self.started.append((name, pid_file))
        if proc.returncode != 0:
            raise ClusterError(f"{name} failed to start (exit code {proc.returncode}): {' '.join(argv)}\n"
                               f"{proc.stdout}{proc.stderr}\n{self.logs()}")
        deadline = time.monotonic() + 10
        while not _read_pid(pid_file):
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} wrote no pid file {pid_file} within 10 s\n{self.logs()}")
            time.sleep(0.05)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
            states = (proc.stdout + proc.stderr).strip()
            rows = dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)
            if proc.returncode == 0 and all(rows.get(node) == "idle" for node in NODES):
                return
            time.sleep(0.25)
        raise ClusterError(f"the Slurm nodes were not idle within {timeout:.0f} s; sinfo says:\n"
                           f"{states}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel leftover jobs, then stop every daemon we started by the pid in its pid file:
        SIGTERM, then SIGKILL after 10 s."""
        if any(name == "slurmctld" for name, _ in self.started):
            self._cancel_jobs()
        pids = [(name, _read_pid(pid_file)) for name, pid_file in reversed(self.started)]
        pids = [(name, pid) for name, pid in pids if pid]
        for _, pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for _, pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for _, pid in pids:
            _signal(pid, signal.SIGKILL)
        self.started = []

    def _cancel_jobs(self, timeout: float = 15) -> None:
        """Cancel every job of this cluster and wait until they are gone, so that no slurmstepd or
        job process outlives the daemons (slurmstepd does not die with slurmd)."""
        def client(argv: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=10)

        try:
            client(["scancel", "--user", "root"])
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                proc = client(["squeue", "-h", "-t", "all", "-o", "%i %T"])
                active = [line for line in proc.stdout.splitlines()
                          if line.split()[1:2] and line.split()[1] in ("RUNNING", "COMPLETING", "PENDING",
                                                                        "CONFIGURING", "REQUEUED",
                                                                        "SUSPENDED")]
                if proc.returncode != 0 or not active:
                    return
                time.sleep(0.2)
        except subprocess.TimeoutExpired:
            pass  # the daemons are stopped regardless

    # -- diagnostics ------------------------------------------------------------------------------

    def logs(self, lines: int = 40) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"----- {path.name} -----\n" + "\n".join(text))
        return "\n".join(parts) or "(no daemon logs yet)"

    def _slurm_conf(self) -> str:
        r = self.root
        nodes = "\n".join(
            f"NodeName={node} NodeHostname={self.hostname} NodeAddr=127.0.0.1 Port={NODE_PORTS[node]} "
            f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for node in NODES)
        return f"""\
# Written by tests/cluster/slurm.py: two nodes, n1 and n2, both on this machine.
ClusterName=torchmn-test
SlurmctldHost={self.hostname}(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SchedulerType=sched/builtin
# Look at pending jobs every second (default 60 s): a requeued job starts as soon as it may.
SchedulerParameters=sched_interval=1
ReturnToService=2
JobRequeue=1
KillWait=3
MinJobAge=600
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _read_pid(pid_file: Path) -> Optional[int]:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A daemon is started by its own fork, so it is not our child: once dead it leaves no zombie
    # we would have to reap, except when PID 1 is slow to; treat a zombie as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
