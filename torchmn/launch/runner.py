"""``torchmn run``: start N ranks of a command, watch them, and tear the job down cleanly.

The launcher
- hosts the rendezvous store itself (a ``TCPStore`` on a port the OS picks, as torchrun does), so
  there is no race for a free port, and tells every rank to connect to it as a client;
- gives each rank the torchmn and torchrun variables and a CPU thread budget;
- prefixes every output line with the rank, and can also write per-rank log files;
- when one rank fails, stops all others (SIGTERM to each rank's process group, SIGKILL after a
  grace period) and prints which rank failed first, where, how, and its traceback;
- forwards SIGINT/SIGTERM/SIGHUP to the ranks and leaves no process behind.

Ranks are planned as ``Slot`` records over a list of hosts (``-H``/``--hostfile``, see
``torchmn.launch.hosts``). Ranks on this machine are started directly; ranks on other hosts through
one ssh client each, running torchmn's watcher there (``torchmn.launch.remote``). Before any rank
starts, every remote host is checked (reachable over ssh, working directory, interpreter, torchmn
importable); a remote rank that has not started within ``start_timeout`` ends the job.

Inside a Slurm step of several tasks (``srun -N 2 --ntasks-per-node 1 torchmn run -np 2 ...``,
without -H/--hostfile) each task is one node of a single job: task ``t`` starts ranks
``t*np .. t*np+np-1``, task 0 hosts the store on the step's first node, and the launchers check in
with each other through it before any rank starts (same -np everywhere), tell each other when a rank
fails, and task 0 keeps the store up until the other nodes' ranks have ended. See ``slurm_step``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import datetime
import errno
import ipaddress
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Deque, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from torchmn import resources
from torchmn.launch import base, guardian, hosts as hostlib, remote
from torchmn.launch.detect import ENVIRONMENTS
from torchmn.launch.environments import EnvEnvironment, SlurmEnvironment, TorchmnEnvironment
from torchmn.launch.hostlist import expand_hostlist

LOCAL_ADDR = "127.0.0.1"
GRACE_SECONDS = 3.0
START_TIMEOUT = 60.0
TAIL_LINES = 200
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Notifications, not stops: passed on to every running rank, and the job goes on, as under mpirun.
# Slurm's `--signal=USR1@120` warns a job this way before its time limit (a rank can checkpoint).
RELAYED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# Store keys the launchers of one Slurm step share (the ranks' own keys have no such prefix).
SLURM_KEY = "torchmn/launcher/"
# How long task 0 keeps the store up, after its own ranks ended, for the other nodes' ranks to end.
SLURM_DONE_WAIT = 30.0


class RunError(Exception):
    """A job that cannot be started as asked; ``exit_code`` is what ``torchmn run`` exits with."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class Slot:
    """One rank's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    node_count: int
    host: str


def plan_slots(hosts: Sequence[Tuple[str, int]]) -> List[Slot]:
    """Number ranks host by host: the first host's slots get ranks 0..k-1, and so on.

    Example::

        >>> [(s.rank, s.local_rank, s.node_rank) for s in plan_slots([("a", 2), ("b", 1)])]
        [(0, 0, 0), (1, 1, 0), (2, 0, 1)]
    """
    size = sum(count for _, count in hosts)
    slots: List[Slot] = []
    for node_rank, (host, count) in enumerate(hosts):
        for local_rank in range(count):
            slots.append(Slot(len(slots), size, local_rank, count, node_rank, len(hosts), host))
    return slots


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """This launcher's place in a Slurm step that runs one ``torchmn run`` task per node."""

    task: int  # SLURM_PROCID, equal to SLURM_NODEID
    tasks: int  # SLURM_NTASKS, equal to the number of nodes in the step
    hosts: Tuple[str, ...]  # the step's nodes, in SLURM_NODEID order
    master_addr: str
    master_port: int


def _first_launcher(env: Mapping[str, str]):
    """The environment class ``detect_environment`` would read, or None for a world of one."""
    return next((kind for kind in ENVIRONMENTS if kind.detect(env)), None)


def _step_hosts(env: Mapping[str, str]) -> List[str]:
    name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
    if name is None:
        raise RunError("SLURM_STEP_NODELIST is not set, so torchmn run cannot tell the nodes of this "
                       "Slurm step; start it with srun, which sets it.")
    try:
        return expand_hostlist(env[name])
    except ValueError as e:
        raise RunError(f"{name}={env[name]!r} cannot be read: {e}.")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError, UnicodeError):
        return address in ("localhost", "::1")


def _refuse_outer_launcher(env: Mapping[str, str]) -> None:
    """Refuse to be one of several copies that mpirun or torchrun started: each copy would start a
    job of its own, with its own rendezvous, and they would train apart without a word."""
    kind = _first_launcher(env)
    if kind in (None, SlurmEnvironment, TorchmnEnvironment):  # Slurm: see slurm_step
        return
    try:
        size = kind.read(env).size
    except (ValueError, RuntimeError):
        return
    if size > 1 and kind is EnvEnvironment:
        # Hand-set variables may be a batch script's own, or a scheduler's that started a copy of
        # this command on each host (Kubeflow's PyTorchJob): say so, without refusing the first.
        sys.stderr.write(f"torchmn run: warning: RANK={env.get('RANK')} and WORLD_SIZE={env.get('WORLD_SIZE')} are "
                         f"set; if a scheduler started this command on several hosts, each copy runs a job of its "
                         f"own (use one torchmn run with -H/--hostfile, or torchrun). Ignore this if the variables "
                         f"are your script's.\n")
    elif size > 1:
        command = {"openmpi": "mpirun", "mpich": "mpiexec"}.get(kind.source, kind.source)
        raise RunError(f"torchmn run was started as one of {size} {kind.source} processes, so each would start a "
                       f"job of its own. Start the ranks with one launcher: `{command} ... python train.py` "
                       f"alone, or one `torchmn run -np N` (with -H/--hostfile for several hosts).")


def slurm_step(env: Mapping[str, str]) -> Optional[SlurmStep]:
    """The Slurm step this launcher is one task of, or None when it runs alone (no srun, or a step
    of one task), which keeps the single-machine behaviour.

    Requires one task per node (each starts that node's ranks) and task ``t`` on node ``t``;
    raises RunError otherwise. The rendezvous is the first node of the step, on ``MASTER_ADDR`` /
    ``MASTER_PORT`` when set, else on ``slurm_port(job id, step id)``.

    Example::

        >>> step = slurm_step({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
        ...                    "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        ...                    "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "n[1-2]"})
        >>> step.task, step.tasks, step.hosts, step.master_addr, step.master_port
        (1, 2, ('n1', 'n2'), 'n1', 24074)
    """
    if _first_launcher(env) is not SlurmEnvironment:
        return None
    try:
        seen = SlurmEnvironment.read(env)
    except (ValueError, RuntimeError) as e:
        raise RunError(f"cannot read this Slurm step's variables: {e}")
    if seen.size == 1:
        return None
    hosts = _step_hosts(env)
    if seen.size != len(hosts) or seen.local_size != 1:
        raise RunError(
            f"torchmn run was started as {seen.size} Slurm tasks on {len(hosts)} node(s) "
            f"(SLURM_NTASKS={seen.size}, {seen.local_size} on this node); inside srun it must run as "
            f"exactly one task per node, each starting that node's ranks. Use "
            f"`srun --ntasks-per-node 1 torchmn run -np RANKS_PER_NODE ...`, or drop torchmn run and "
            f"start one srun task per rank: `srun -n {seen.size} python train.py`.")
    on = env.get("SLURMD_NODENAME")
    if seen.rank != seen.node_rank or (on in hosts and hosts.index(on) != seen.rank):
        raise RunError(
            f"Slurm task {seen.rank} runs on node {seen.node_rank} of the step (SLURM_PROCID="
            f"{seen.rank}, SLURM_NODEID={seen.node_rank}); torchmn run needs task N on node N, as "
            f"Slurm's default block or cyclic distribution does (task {seen.rank} runs on "
            f"{on or 'an unknown node'}, node {seen.rank} of the step is {hosts[seen.rank]}). Drop "
            f"--distribution/-m, the arbitrary layout or the heterogeneous components.")
    return SlurmStep(seen.rank, seen.size, tuple(hosts), seen.master_addr, seen.master_port)


def rank_env(slot: Slot, master_addr: str, master_port: int) -> Dict[str, str]:
    """The variables that tell one rank its place: torchmn's names and torchrun's.

    Example::

        >>> rank_env(plan_slots([("h", 2)])[1], "127.0.0.1", 29500)["RANK"]
        '1'
    """
    return {
        base.TORCHMN_RANK: str(slot.rank),
        base.TORCHMN_SIZE: str(slot.size),
        base.TORCHMN_LOCAL_RANK: str(slot.local_rank),
        base.TORCHMN_LOCAL_SIZE: str(slot.local_size),
        base.TORCHMN_NODE_RANK: str(slot.node_rank),
        base.TORCHMN_NODE_COUNT: str(slot.node_count),
        base.TORCHMN_HOST: slot.host,
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_size),
        "GROUP_RANK": str(slot.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # The launcher hosts the store; with this, torch's env:// rendezvous makes every rank,
        # rank 0 included, a client of it instead of rank 0 binding MASTER_PORT itself.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def start_store(host: str, port: Optional[int], port_origin: Optional[str] = None):
    """Host the rendezvous TCPStore; port None lets the OS pick a free one. Returns the store.
    ``port_origin`` says where a taken port came from, for the error (default: --master-port).

    Example::

        >>> store = start_store("127.0.0.1", None); store.port > 0
        True
    """
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port or 0, is_master=True, wait_for_workers=False)
    except RuntimeError as e:
        text = str(e)
        if port and ("EADDRINUSE" in text or "in use" in text.lower()):
            if port_origin:
                raise RunError(f"port {port} ({port_origin}) is already in use on this machine. "
                               f"Choose another: set MASTER_PORT, or pass --master-port.")
            raise RunError(f"port {port} is already in use on this machine (--master-port {port}). "
                           f"Pick another port, or leave --master-port out so torchmn picks a free one.")
        raise RunError(f"could not start the rendezvous store on {host}:{port or 0}: {text}")


def _prepare_log_dir(log_dir: str) -> None:
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create --log-dir {log_dir!r}: {e.strerror}. "
                       f"Pass a directory you can write to.")
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise RunError(f"cannot write to --log-dir {log_dir!r}: permission denied. "
                       f"Pass a directory you can write to.")


def extract_traceback(lines: Sequence[str]) -> List[str]:
    """The last Python traceback in ``lines`` (from its "Traceback (most recent call last):" header to
    the end); the last 20 lines when there is none.

    Example::

        >>> extract_traceback(["x", "Traceback (most recent call last):", '  File "a.py"', "E: b"])
        ['Traceback (most recent call last):', '  File "a.py"', 'E: b']
    """
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            return list(lines[i:])
    return list(lines[-20:])


def describe_exit(returncode: int) -> str:
    """Plain words for a Popen return code.

    Example::

        >>> describe_exit(-9)
        'was killed by signal SIGKILL (exit code 137)'
    """
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by signal {name} (exit code {128 - returncode})"
    return f"failed with exit code {returncode}"


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code: 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _lines(pipe: IO[bytes]) -> Iterator[bytes]:
    """The pipe's output in pieces that end with "\\n", "\\r\\n" or a lone "\\r" (progress bars such as
    tqdm redraw their line with "\\r"), so each piece gets its rank prefix as soon as it is written.
    Each chunk read is searched once, so a line of many MB costs time in proportion to its length."""
    pending: List[bytes] = []   # the start of a line still being written
    while True:
        chunk = pipe.read1(65536)
        if not chunk:
            break
        if pending and pending[-1].endswith(b"\r") and not chunk.startswith(b"\n"):
            yield b"".join(pending)  # that "\r" was a line end of its own
            pending = []
        start = 0
        for end in _LINE_END.finditer(chunk):
            if end.group() == b"\r" and end.end() == len(chunk):
                break  # maybe the first half of "\r\n": wait for the next chunk
            pending.append(chunk[start:end.end()])
            yield b"".join(pending)
            pending = []
            start = end.end()
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)


_LINE_END = re.compile(rb"\r\n|\r|\n")


class _Console:
    """Writes whole lines to the launcher's stdout/stderr under one lock, so lines never interleave."""

    def __init__(self, output_ranks: Optional[Set[int]]):
        self.lock = threading.Lock()
        self.output_ranks = output_ranks
        self.lost: set = set()   # streams that failed: written no more

    def write(self, rank: int, line: bytes, to_stderr: bool) -> None:
        if self.output_ranks is not None and rank not in self.output_ranks:
            return
        stream = sys.stderr if to_stderr else sys.stdout
        # A bare "\r" (a progress bar clearing its line) only moves the cursor: no prefix for it.
        data = line if line == b"\r" else b"[%d] " % rank + line
        with self.lock:
            if stream is None or stream in self.lost:
                return
            try:
                binary = getattr(stream, "buffer", None)
                if binary is not None:
                    stream.flush()
                    binary.write(data)
                    binary.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
            except (OSError, ValueError):
                # The reader went away (`torchmn run ... | head`), the disk is full, the stream was
                # closed: the job goes on, and its log files stay whole, so the rest of this
                # stream goes nowhere. (Stopping to read the rank's pipe would block the rank.)
                self._lose(stream)

    def message(self, text: str) -> None:
        with self.lock:
            for stream, data in ((sys.stdout, None), (sys.stderr, text if text.endswith("\n") else text + "\n")):
                if stream is None or stream in self.lost:
                    continue
                try:
                    if data is not None:
                        stream.write(data)
                    stream.flush()
                except (OSError, ValueError):
                    self._lose(stream)

    def _lose(self, stream) -> None:
        self.lost.add(stream)
        _discard(stream)


def _discard(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (as Python's docs advise on SIGPIPE), so that
    later writes, and the flush at exit, neither fail nor block."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class _Rank:
    """One started rank: its process, output readers, stderr tail and log file."""

    def __init__(self, slot: Slot, process: subprocess.Popen, console: _Console, log: Optional[IO[bytes]],
                 is_remote: bool = False):
        self.slot = slot
        self.process = process
        self.is_remote = is_remote
        # A remote rank counts as started when its watcher prints remote.STARTED_MARKER.
        self.started = not is_remote
        self.pgid = process.pid  # start_new_session=True makes the rank the leader of its own group
        self.returncode: Optional[int] = None
        self.stopped_by_launcher = False
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.log = log
        self.waiting_since: Dict[int, Optional[float]] = {}   # per reader thread: see _timed
        self.log_lock = threading.Lock()
        self.console = console
        self.readers = [
            threading.Thread(target=self._read, args=(process.stdout, False), daemon=True),
            threading.Thread(target=self._read, args=(process.stderr, True), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe: IO[bytes], is_stderr: bool) -> None:
        marker = remote.STARTED_MARKER.encode() + b"\n"
        for line in self._timed(_lines(pipe)):
            if not is_stderr and not self.started and line == marker:
                self.started = True
                continue
            if not line.endswith((b"\n", b"\r")):
                line += b"\n"
            if is_stderr and line.endswith(b"\n"):  # progress-bar redraws stay out of the summary
                self.tail.append(line.decode("utf-8", "replace").rstrip("\r\n"))
            if self.log is not None:
                with self.log_lock:
                    self.log.write(line)
                    self.log.flush()
            self.console.write(self.slot.rank, line, is_stderr)
        pipe.close()

    def _timed(self, lines: Iterator[bytes]) -> Iterator[bytes]:
        """``lines``, noting when a reader starts waiting on the pipe (None while it writes out)."""
        while True:
            self.waiting_since[threading.get_ident()] = time.monotonic()
            line = next(lines, None)
            self.waiting_since[threading.get_ident()] = None
            if line is None:
                return
            yield line

    def finish_output(self, idle: float) -> None:
        """Wait for the rest of the rank's output, for as long as it keeps coming (a slow console
        takes what it takes: a reader blocked writing to it is not idle), but no longer than
        ``idle`` seconds of a reader waiting on a silent pipe: a process the rank left behind may
        hold its pipes open."""
        for reader in self.readers:
            remote.join_unless_idle(reader, lambda reader=reader: self.waiting_since.get(reader.ident), idle)
        if self.log is not None and not any(r.is_alive() for r in self.readers):
            self.log.close()


def _prctl() -> Optional[Callable[..., int]]:
    """Linux's ``prctl`` from libc, or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_launcher() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that has the kernel send the rank SIGTERM when the launcher dies, even by
    SIGKILL (which the launcher cannot forward), so that no rank outlives it; None where Linux's
    ``prctl(PR_SET_PDEATHSIG)`` is not there. libc is looked up here, in the launcher: the child
    only makes the one call, as little as possible between fork and exec."""
    prctl = _prctl()
    if prctl is None:
        return None
    launcher = os.getpid()

    def set_death_signal():
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before the call: no signal would come
            os._exit(1)
    return set_death_signal


# Set in every local rank's environment, and so in every process it starts: which job they belong to.
JOB_ID = "TORCHMN_JOB_ID"


def _children() -> Set[int]:
    import psutil

    try:
        return {child.pid for child in psutil.Process().children()}
    except psutil.Error:
        return set()


def _start_guardian(job_id: str, grace: float) -> Optional[subprocess.Popen]:
    """Start the process that ends the job's local processes if this launcher dies without ending
    them (see :mod:`torchmn.launch.guardian`); None where it could not start (the kernel's death
    signal to each rank still applies)."""
    if _prctl() is None:  # not Linux: no /proc to find the job's processes in
        return None
    try:
        return subprocess.Popen([sys.executable, "-c", guardian.GUARDIAN_BOOTSTRAP, JOB_ID, job_id, str(grace)],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    except OSError:
        return None


def _tell_watcher(process: subprocess.Popen, sig: int, line: bytes = remote.SIGNAL_LINE) -> None:
    """Have a remote rank's watcher send ``sig`` to the rank (see remote.SIGNAL_LINE, RELAY_LINE)."""
    if process.stdin is not None:
        try:
            process.stdin.write(line + b"%d\n" % sig)
            process.stdin.flush()
        except (OSError, ValueError):
            pass


def _close_stdin(process: subprocess.Popen) -> None:
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Job:
    """A running ``torchmn run`` job. Use ``run()`` unless you need the pieces."""

    def __init__(self, command: Sequence[str], np: int, *, master_port: Optional[int] = None,
                 log_dir: Optional[str] = None, output_ranks: Optional[Set[int]] = None,
                 start_timeout: Optional[float] = None, verbose: bool = False,
                 grace: float = GRACE_SECONDS, env: Optional[Mapping[str, str]] = None,
                 hosts: Optional[Sequence[Tuple[str, int]]] = None,
                 ssh: Optional[remote.SshOptions] = None, exports: Sequence[str] = (),
                 network_interface: Optional[str] = None):
        if np < 1:
            raise RunError(f"-np must be at least 1, got {np}.")
        command = list(command)
        if command and command[0] == "--":
            command = command[1:]
        if not command:
            raise RunError("no command given. Usage: torchmn run -np N [options] COMMAND [ARGS...]")
        if master_port is not None and not 0 < master_port < 65536:
            raise RunError(f"--master-port must be between 1 and 65535, got {master_port}.")
        if start_timeout is not None and start_timeout <= 0:
            raise RunError(f"--start-timeout must be positive, got {start_timeout:g}.")
        self.command = command
        self.np = np
        self.master_port = master_port
        self.log_dir = log_dir
        # How long host checks may take, and remote ranks may take to start (local ones start at once).
        self.start_timeout = START_TIMEOUT if start_timeout is None else start_timeout
        self.verbose = verbose
        # Ranks are started from this thread, whose end (PR_SET_PDEATHSIG counts threads) is the
        # launcher's.
        self._death_signal = _die_with_launcher()
        self.grace = grace
        self.base_env = dict(os.environ if env is None else env)
        self.host = socket.gethostname()
        self.ssh = ssh or remote.SshOptions()
        self.network_interface = network_interface
        try:
            self.exports = remote.parse_exports(exports, self.base_env)
            placement = hostlib.assign_ranks(hostlib.merge_local_aliases(hosts), np) if hosts else [(self.host, np)]
        except (hostlib.HostsError, remote.RemoteError) as e:
            raise RunError(str(e))
        self.remote_hosts = [h for h, _ in placement if hosts and not hostlib.is_local(h)]
        self.slots = plan_slots(placement)
        self.master_addr = LOCAL_ADDR
        _refuse_outer_launcher(self.base_env)
        # One task of a multi-node srun step: this node's share of one job (see slurm_step).
        self.slurm = None if hosts else slurm_step(self.base_env)
        if self.slurm is not None:
            self._plan_slurm(network_interface)
        self.size = self.slots[0].size
        if output_ranks is not None and not output_ranks <= set(range(self.size)):
            raise RunError(f"--output-ranks names ranks {sorted(output_ranks - set(range(self.size)))}, "
                           f"but the job has ranks 0..{self.size - 1} only.")
        self.node_failure: Optional[str] = None
        # Another node's failure that was reported before this node's own first failure.
        self.reported: Optional[str] = None
        self.start_failure: Optional[str] = None
        self.started_at = 0.0
        self.console = _Console(output_ranks)
        self.ranks: List[_Rank] = []
        self.guardian: Optional[subprocess.Popen] = None
        self.events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.first_failure: Optional[_Rank] = None
        self.received_signal: Optional[int] = None
        self.descendants: Dict[int, object] = {}
        self.job_id = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        self.adopts_orphans = False
        self.store = None

    # -- starting ---------------------------------------------------------------------------------

    def _plan_slurm(self, network_interface: Optional[str]) -> None:
        step = self.slurm
        if network_interface:
            raise RunError("--network-interface does not apply inside a multi-task Slurm step: the "
                           "rendezvous is the step's first node. Set MASTER_ADDR to choose its address.")
        everyone = plan_slots([(host, self.np) for host in step.hosts])
        self.slots = [slot for slot in everyone if slot.node_rank == step.task]
        self.master_addr = step.master_addr
        if self.master_port is None:
            self.master_port = step.master_port

    def _is_remote(self, slot: Slot) -> bool:
        return slot.host in self.remote_hosts

    def _check_command(self) -> None:
        if all(self._is_remote(slot) for slot in self.slots):
            return  # checked on each host by the watcher
        path = self.exports.get("PATH", self.base_env.get("PATH", os.defpath))  # -x PATH=... is the ranks' PATH
        if shutil.which(self.command[0], path=path) is None:
            where = "is not an executable file" if os.sep in self.command[0] else "was not found on PATH"
            raise RunError(f"command not found: {self.command[0]!r} {where} (rank 0 on host {self.host} "
                           f"would have run it). Check the spelling, or give its full path.", exit_code=127)

    def _env_for(self, slot: Slot, port: int) -> Dict[str, str]:
        env = dict(self.base_env)
        env.update(self.exports)
        env.update(resources.launcher_thread_env(slot.local_size, env))
        env.update(rank_env(slot, self.master_addr, port))
        env["PYTHONUNBUFFERED"] = "1"
        env[JOB_ID] = self.job_id  # inherited by whatever the rank starts: see _remember_descendants
        if self.remote_hosts and "GLOO_SOCKET_IFNAME" not in env:
            # gloo would otherwise pick the address of this machine's hostname, often 127.0.1.1.
            interface = hostlib.interface_of(self.master_addr)
            if interface:
                env["GLOO_SOCKET_IFNAME"] = interface
        return env

    def _remote_env_for(self, slot: Slot, port: int) -> Dict[str, str]:
        """What a remote rank's ssh command line sets: the forwarded variables and its place.
        The watcher adds the thread budget and gloo's interface on the host itself."""
        env = remote.forwarded_env(self.base_env, self.exports)
        env.update(rank_env(slot, self.master_addr, port))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _check_hosts(self) -> None:
        """Check every remote host at once and choose the rendezvous address; raise RunError naming
        every host that cannot run ranks."""
        if not self.remote_hosts:
            if self.network_interface:
                self.master_addr = self._interface_address()
            return
        if self.verbose:
            self.console.message(f"torchmn run: checking hosts {', '.join(self.remote_hosts)} over ssh")
        env = remote.forwarded_env(self.base_env, self.exports)
        clients: list = []
        stop = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            checking = pool.submit(remote.check_hosts, self.remote_hosts, self.ssh, sys.executable, os.getcwd(),
                                   env, self.start_timeout, clients, self._death_signal, stop)
            while True:
                try:
                    checks = checking.result(timeout=0.1)
                    break
                except concurrent.futures.TimeoutError:
                    self._stop_checks_on_signal(clients, stop)
                except remote.RemoteError as e:
                    raise RunError(str(e))
        bad = [c for c in checks if c.error]
        if bad:
            lines = [f"{len(bad)} of {len(checks)} host(s) cannot run ranks:"]
            lines += [f"  host {c.host}: {c.error}" for c in bad]
            raise RunError("\n".join(lines))
        if self.network_interface:
            self.master_addr = self._interface_address()
            return
        local = hostlib.local_addresses()
        seen = checks[0].client_address
        if seen and seen in local and not seen.startswith("127."):
            self.master_addr = seen
        else:
            self.master_addr = (hostlib.route_address(self.remote_hosts[0], self.ssh.port or 22)
                                or socket.getfqdn())
        if _is_loopback(self.master_addr):
            # The other hosts would connect to themselves (behind an ssh tunnel or ProxyJump, the
            # address they log in from is this machine's loopback).
            raise RunError(f"cannot tell which address of this machine the hosts {', '.join(self.remote_hosts)} "
                           f"reach it on (found only {self.master_addr}, a loopback address); name the "
                           f"network with --network-interface (e.g. eth0)")

    def _stop_checks_on_signal(self, clients: list, stop: threading.Event) -> None:
        """Ctrl-C (or SIGTERM) while hosts are checked: stop their ssh clients and the launcher now,
        rather than after the checks (up to --start-timeout)."""
        try:
            event = self.events.get_nowait()  # nothing else can be queued before ranks start
        except queue.Empty:
            return
        stop.set()  # checks not started yet start no ssh client; one starting now stops itself
        for client in list(clients):
            remote.signal_group(client.pid, signal.SIGKILL)  # each in a session of its own
        raise RunError(f"received {signal.Signals(event[1]).name} while checking the hosts; stopped",
                       exit_code=128 + event[1])

    def _interface_address(self) -> str:
        try:
            return hostlib.interface_address(self.network_interface)
        except hostlib.HostsError as e:
            raise RunError(str(e))

    def _start_rank(self, slot: Slot, port: int, log_path: Optional[str]) -> _Rank:
        is_remote = self._is_remote(slot)
        if is_remote:
            line = remote.rank_command(os.getcwd(), sys.executable, self._remote_env_for(slot, port),
                                       self.command)
            argv, env = self.ssh.argv(slot.host, line), self.base_env
        else:
            argv, env = self.command, self._env_for(slot, port)
        # Opened first: a log that cannot be written must not leave a started rank behind.
        try:
            log = open(log_path, "wb") if log_path else None
        except OSError as e:
            raise RunError(f"cannot write rank {slot.rank}'s log file {log_path}: {e.strerror}. Choose another "
                           f"--log-dir, or make that path a writable file.") from e
        try:
            # A remote rank's stdin stays open: closing it tells the watcher there to stop the rank.
            process = subprocess.Popen(argv, env=env,
                                       stdin=subprocess.PIPE if is_remote else subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                       preexec_fn=self._death_signal)
        except OSError as e:
            if log is not None:
                log.close()
            code = 127 if e.errno == errno.ENOENT else 126
            raise RunError(f"rank {slot.rank} on host {slot.host} could not start {argv[0]!r}: "
                           f"{e.strerror}. Check the command and its permissions.", exit_code=code)
        return _Rank(slot, process, self.console, log, is_remote=is_remote)

    def start(self) -> None:
        self._check_command()
        # Processes a rank detached (setsid, a daemon) and left behind when it exited come to the
        # launcher instead of init, so that teardown finds them however fast their rank ended.
        self.adopts_orphans = remote.become_subreaper()
        # Children the process calling run() has of its own (and ours, the guardian): never
        # reaped here, so that their Popen objects keep their exit codes.
        self.own_children = _children()
        if self.log_dir is not None:
            _prepare_log_dir(self.log_dir)
        if self.slurm is not None:
            self.store = self._slurm_store()
            self._check_in()
        else:
            self._check_hosts()
            self.store = start_store(self.master_addr, self.master_port)
        port = self.store.port
        if self.verbose:
            placed = ", ".join(f"{h}:{n}" for h, n in dict(collections.Counter(s.host for s in self.slots)).items())
            threads = resources.launcher_thread_env(self.slots[0].local_size, self.base_env).get(
                resources.TORCHMN_NUM_THREADS)
            ranks = (f"ranks {self.slots[0].rank}-{self.slots[-1].rank} of {self.size} "
                     f"(Slurm task {self.slurm.task} of {self.slurm.tasks})" if self.slurm else f"{self.np} ranks")
            self.console.message(
                f"torchmn run: {ranks} on {placed}, rendezvous {self.master_addr}:{port}, "
                f"threads per rank: {threads or 'set by user (OMP_NUM_THREADS)'}"
                f"{' (on this machine)' if self.remote_hosts else ''}, command: {' '.join(self.command)}")
        self.started_at = time.monotonic()
        if any(not self._is_remote(slot) for slot in self.slots):
            self.guardian = _start_guardian(self.job_id, self.grace)
            if self.guardian is not None:
                self.own_children.add(self.guardian.pid)
        for slot in self.slots:
            log_path = os.path.join(self.log_dir, f"rank.{slot.rank}.log") if self.log_dir else None
            rank = self._start_rank(slot, port, log_path)
            self.ranks.append(rank)
            threading.Thread(target=self._wait_for, args=(rank,), daemon=True).start()

    def _slurm_store(self):
        """Task 0 hosts the store (it listens on every interface); the other tasks connect to it."""
        if self.slurm.task == 0:
            return start_store(self.master_addr, self.master_port,
                               port_origin="MASTER_PORT" if self.base_env.get("MASTER_PORT")
                               else "derived from the Slurm job and step ids")
        from torch.distributed import TCPStore

        try:
            return TCPStore(self.master_addr, self.master_port, is_master=False,
                            timeout=datetime.timedelta(seconds=self.start_timeout))
        except RuntimeError as e:
            raise RunError(f"could not reach the rendezvous store of Slurm task 0 at "
                           f"{self.master_addr}:{self.master_port} within {self.start_timeout:g} s "
                           f"({_first_line(e)}). Check that task 0 started and that the port is open "
                           f"between the nodes (set MASTER_PORT to use another), or raise --start-timeout.")

    def _check_in(self) -> None:
        """Every task publishes its -np and waits for all others; they must all agree."""
        step = self.slurm
        keys = [f"{SLURM_KEY}np/{task}" for task in range(step.tasks)]
        try:
            self.store.set(keys[step.task], str(self.np))
            self.store.wait(keys, datetime.timedelta(seconds=self.start_timeout))
            counts = [int(self.store.get(key)) for key in keys]
        except RuntimeError as e:
            missing = self._missing(keys)
            if missing:
                raise RunError(f"Slurm task(s) {', '.join(map(str, missing))} did not start torchmn run "
                               f"within {self.start_timeout:g} s (--start-timeout); every task of the step "
                               f"must run it.")
            raise RunError(f"lost the rendezvous store of Slurm task 0 while checking in ({_first_line(e)}).")
        if len(set(counts)) > 1:
            told = ", ".join(f"task {t} ({step.hosts[t]}) -np {n}" for t, n in enumerate(counts))
            raise RunError(f"the Slurm tasks disagree on the number of ranks per node: {told}. "
                           f"Every task must run the same `torchmn run -np N`.")

    def _missing(self, keys: Sequence[str]) -> List[int]:
        try:
            return [i for i, key in enumerate(keys) if not self.store.check([key])]
        except RuntimeError:
            return []

    def _wait_for(self, rank: _Rank) -> None:
        self.events.put(("exit", rank, rank.process.wait()))

    # -- watching ---------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        # SimpleQueue.put is reentrant, so it is safe even when the signal interrupts a get().
        self.events.put(("relay" if signum in RELAYED_SIGNALS else "signal", signum))

    def _relay(self, sig: int) -> None:
        if any(x is not None for x in (self.received_signal, self.first_failure, self.start_failure,
                                        self.node_failure)):
            return  # the job is ending anyway
        for rank in self._running():
            if not rank.is_remote:
                remote.signal_group(rank.pgid, sig)
            elif rank.started:
                _tell_watcher(rank.process, sig, remote.RELAY_LINE)
        self.console.message(f"torchmn run: received {signal.Signals(sig).name}; passed it on to "
                             f"{len(self._running())} running rank(s) (a rank without a handler for it ends, "
                             f"as under mpirun)")

    def _remember_descendants(self) -> None:
        """Note every process a rank started, so that teardown can find grandchildren that left the
        rank's process group (setsid, daemons). Called every 0.5 s and when teardown starts: such a
        process is found only if it was seen while its rank was still alive."""
        import psutil

        for rank in self.ranks:
            if rank.returncode is not None:
                continue
            try:
                children = psutil.Process(rank.process.pid).children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                self.descendants.setdefault(child.pid, child)
        if self.adopts_orphans:
            ranks = {rank.process.pid for rank in self.ranks}
            try:
                adopted = [c for c in psutil.Process().children() if c.pid not in ranks and c.pid not in self.descendants]
            except psutil.Error:
                adopted = []
            for child in adopted:
                try:  # only this job's: the launcher may run inside a process with children of its own
                    if child.status() == psutil.STATUS_ZOMBIE:
                        if child.pid not in self.own_children:
                            os.waitpid(child.pid, os.WNOHANG)  # an orphan that ended: as init would, reap it
                    elif child.environ().get(JOB_ID) == self.job_id:
                        self.descendants[child.pid] = child
                except (psutil.Error, ChildProcessError):
                    continue

    def _kill_descendants(self) -> None:
        import psutil

        for child in self.descendants.values():
            try:
                child.kill()  # psutil checks the pid still names the same process
            except psutil.Error:
                continue

    def _running(self) -> List[_Rank]:
        return [r for r in self.ranks if r.returncode is None]

    def _anything_left(self) -> bool:
        if self._running():
            return True
        for rank in self.ranks:
            if remote.group_alive(rank.pgid):
                return True
        return any(_alive(child) for child in self.descendants.values())

    def _teardown(self, first_signal: int) -> None:
        """Stop every rank and everything it started: ``first_signal`` to each process group, SIGKILL
        to whatever is left after the grace period."""
        self._remember_descendants()
        # Exits already queued happened before the stop: those ranks ended on their own.
        while True:
            try:
                self._handle(self.events.get_nowait(), escalate=False)
            except queue.Empty:
                break
        for rank in self.ranks:
            # An exit not queued yet may still have come before the stop (two ranks failing at once).
            if rank.returncode is None and rank.process.poll() is None:
                rank.stopped_by_launcher = True
            if rank.is_remote:
                if rank.started:  # the watcher sends the rank our signal, then stops it, then ssh exits
                    _tell_watcher(rank.process, first_signal)
                _close_stdin(rank.process)
                if not rank.started:  # no watcher yet: only the ssh client to stop
                    remote.signal_group(rank.pgid, signal.SIGTERM)
            else:
                remote.signal_group(rank.pgid, first_signal)
        # Remote ranks get the watcher's own grace period on top, plus time for ssh to report back.
        extra = remote.GRACE_SECONDS + 2.0 if any(r.is_remote for r in self.ranks) else 0.0
        deadline = time.monotonic() + self.grace + extra
        while self._anything_left() and time.monotonic() < deadline:
            self._next_event(min(0.05, max(0.0, deadline - time.monotonic())), escalate=True)
        self._kill_all()

    def _kill_all(self) -> None:
        self._remember_descendants()
        for rank in self.ranks:
            remote.signal_group(rank.pgid, signal.SIGKILL)
        self._kill_descendants()
        for rank in self.ranks:
            rank.process.wait()
            rank.returncode = rank.process.returncode
            _close_stdin(rank.process)

    def _next_event(self, timeout: float, escalate: bool = False) -> None:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(event, escalate)

    def _handle(self, event: tuple, escalate: bool) -> None:
        if event[0] == "exit":
            _, rank, returncode = event
            rank.returncode = returncode
            if returncode != 0 and self.first_failure is None and not rank.stopped_by_launcher \
                    and self.received_signal is None and self.start_failure is None \
                    and self.node_failure is None:
                self.first_failure = rank
        elif event[0] == "relay":
            self._relay(event[1])
        elif event[0] == "signal":
            if self.received_signal is None and self.first_failure is None:
                self.received_signal = event[1]
            elif escalate:
                # A second Ctrl-C during teardown: do not make the user wait for the grace period.
                self._kill_all()

    def watch(self) -> int:
        """Wait for the job to end; returns the launcher's exit code."""
        last_scan = 0.0
        while self._running() and self.first_failure is None and self.received_signal is None \
                and self.start_failure is None and self.node_failure is None:
            self._next_event(0.5)
            if time.monotonic() - last_scan > 0.5:
                self._remember_descendants()
                self._check_started()
                self._check_other_nodes()
                last_scan = time.monotonic()
        self._tell_other_nodes()
        # Also when every rank exited 0: stops anything they left running in the background.
        self._teardown(self.received_signal or signal.SIGTERM)
        for rank in self.ranks:
            rank.finish_output(idle=2.0)
        code = self._summarize()
        self._end_slurm_task()
        return code

    # -- several Slurm tasks: the launchers tell each other through the store ----------------------

    def _check_other_nodes(self) -> None:
        """Stop this node's ranks when another task's launcher reported a failed rank."""
        if self.slurm is None:
            return
        reason = self._reported_failure()
        if reason is not None:
            self.node_failure = f"torchmn run: {reason}; stopped the {len(self._running())} rank(s) on this node."

    def _reported_failure(self) -> Optional[str]:
        """What a task's launcher reported as the job's first failed rank, if any."""
        try:
            if self.store.check([SLURM_KEY + "failed"]):
                return self.store.get(SLURM_KEY + "failed").decode()
        except RuntimeError:
            pass  # task 0 ended; how its ranks ended shows in ours
        return None

    def _tell_other_nodes(self) -> None:
        """Report this node's first failed rank to the other tasks' launchers, which stop theirs."""
        failed = self.first_failure
        if self.slurm is None or failed is None:
            return
        self.reported = self._reported_failure()
        if self.reported is None:
            try:
                self.store.set(SLURM_KEY + "failed", f"rank {failed.slot.rank} (host {failed.slot.host}) "
                                                     f"{describe_exit(failed.returncode)}")
            except RuntimeError:
                pass

    def _end_slurm_task(self) -> None:
        """Say this task is done; task 0 keeps the store up until every task is (the other nodes'
        ranks may still use it while they shut down), for at most SLURM_DONE_WAIT seconds."""
        if self.slurm is None:
            return
        keys = [f"{SLURM_KEY}done/{task}" for task in range(self.slurm.tasks)]
        try:
            self.store.set(keys[self.slurm.task], "1")
            if self.slurm.task == 0 and self.received_signal is None:
                self.store.wait(keys, datetime.timedelta(seconds=SLURM_DONE_WAIT))
        except RuntimeError:
            pass

    def _check_started(self) -> None:
        """End the job when a remote rank has not started within the start timeout."""
        if self.start_failure is not None or time.monotonic() - self.started_at < self.start_timeout:
            return
        late = [r for r in self.ranks if not r.started and r.returncode is None]
        if not late:
            return
        hosts = sorted({r.slot.host for r in late}, key=[s.host for s in self.slots].index)
        self.start_failure = (
            f"torchmn run: rank(s) {', '.join(str(r.slot.rank) for r in late)} on host(s) "
            f"{', '.join(hosts)} did not start within {self.start_timeout:g} s (--start-timeout); "
            f"stopped the job. The host passed its check, so ssh or the host itself is slow or hung: "
            f"try `{self.ssh.hint(hosts[0])}`, or raise --start-timeout.")

    def _summarize(self) -> int:
        if self.start_failure is not None:
            self.console.message(self.start_failure)
            return 124
        if self.node_failure is not None:
            self.console.message(self.node_failure)
            return 1
        if self.received_signal is not None:
            name = signal.Signals(self.received_signal).name
            self.console.message(f"torchmn run: received {name}; forwarded it to all {self.np} ranks "
                                 f"and stopped them.")
            return 128 + self.received_signal
        failed = self.first_failure
        if failed is None:
            return 0
        code = failed.returncode
        stopped = sum(1 for r in self.ranks if r.stopped_by_launcher)
        lines = [f"torchmn run: rank {failed.slot.rank} (host {failed.slot.host}) {describe_exit(code)}"
                 + (f"; stopped the other {stopped} running rank(s)." if stopped else ".")]
        also = [r.slot.rank for r in self.ranks
                if r is not failed and not r.stopped_by_launcher and r.returncode != 0]
        if also:
            lines.append(f"torchmn run: rank(s) {', '.join(map(str, also))} also failed on their own, later.")
        if self.reported:
            lines.append(f"torchmn run: before that, on another node, {self.reported}.")
        if failed.is_remote and code == 255:
            lines.append(f"torchmn run: exit code 255 is also ssh's own: unless the rank's output above shows "
                         f"it exiting with 255 itself, the connection to host {failed.slot.host} failed or was lost.")
        if code == -signal.SIGKILL or (failed.is_remote and code == 128 + signal.SIGKILL):
            lines.append("torchmn run: SIGKILL often comes from the out-of-memory killer "
                         "(check `dmesg` or the job's memory limit).")
        tail = extract_traceback(list(failed.tail))
        if tail:
            lines.append(f"----- rank {failed.slot.rank} stderr -----")
            lines.extend(tail)
            lines.append("-" * 30)
        self.console.message("\n".join(lines))
        return exit_code_of(code)

    def close(self) -> None:
        # Dropping the last reference shuts the store's server down and frees the port.
        self.store = None
        if self.guardian is not None:
            try:
                self.guardian.stdin.write(guardian.DONE)  # the ranks are done with: nothing for it to do
                self.guardian.stdin.close()
                self.guardian.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.guardian = None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def run(command: Sequence[str], np: int, *, master_port: Optional[int] = None,
        log_dir: Optional[str] = None, output_ranks: Optional[Set[int]] = None,
        start_timeout: Optional[float] = None, verbose: bool = False,
        grace: float = GRACE_SECONDS, env: Optional[Mapping[str, str]] = None,
        hosts: Optional[Sequence[Tuple[str, int]]] = None, ssh: Optional[remote.SshOptions] = None,
        exports: Sequence[str] = (), network_interface: Optional[str] = None) -> int:
    """Run ``command`` as ``np`` ranks and return the exit code ``torchmn run`` would.

    ``hosts`` is a list of (host, slots) as ``torchmn.launch.hosts.parse_hosts`` returns; ranks fill
    the hosts' slots in order; None means this machine. Ranks on other hosts start over ``ssh``,
    with ``exports`` (``-x NAME`` / ``-x NAME=VALUE``) forwarded. ``start_timeout`` (default 60 s)
    bounds the host checks and how long a remote rank may take to start. ``network_interface``
    picks the rendezvous address (else: the address the first remote host sees us connect from).
    Raises ``RunError`` (before anything is started) for a job that cannot be run as asked.

    Example::

        >>> run(["python", "-c", "import os; print(os.environ['RANK'])"], np=2, output_ranks={0})
        [0] 0
        0
    """
    job = Job(command, np, master_port=master_port, log_dir=log_dir, output_ranks=output_ranks,
              start_timeout=start_timeout, verbose=verbose, grace=grace, env=env, hosts=hosts, ssh=ssh,
              exports=exports, network_interface=network_interface)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main_thread:
        # Installed before the first rank starts, so a Ctrl-C during start-up still tears down.
        for sig in FORWARDED_SIGNALS + RELAYED_SIGNALS:
            previous[sig] = signal.signal(sig, job._on_signal)
    try:
        try:
            job.start()
        except BaseException:
            if job.ranks:
                job._teardown(signal.SIGTERM)
            raise
        return job.watch()
    finally:
        job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
