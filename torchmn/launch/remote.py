"""Ranks on other hosts, over ssh: checking a host, the command line that starts a rank there, and
the watcher that runs each remote rank.

``torchmn run -H`` starts one ssh client per remote rank. On the remote host the ssh session runs
``cd <launcher's directory> && exec env <forwarded variables> <launcher's python> -c BOOTSTRAP --
COMMAND...``, where BOOTSTRAP runs this file as a script without importing the torchmn package
(which imports torch: seconds of start-up and hundreds of MB for a process that only waits): the
*watcher*. ``python -m torchmn.launch.remote -- COMMAND...`` runs the same. It checks that the rendezvous store is
reachable from that host, tells gloo which interface reaches it, gives the rank its CPU thread
budget for that host, prints a start marker, and runs COMMAND in a new session, relaying its output
through pipes (so that nothing COMMAND leaves behind can hold the ssh session open). When COMMAND
exits, or when the watcher's stdin closes (the launcher killed its ssh client, or the launcher
died), it stops everything COMMAND started, detached processes included (the watcher is their
subreaper): SIGTERM, SIGKILL after a grace period. So killing an ssh client is enough to tear a
remote rank down, without a terminal (``ssh -tt``) on the remote side.

Example (what the launcher runs for rank 2 on host ``node2``)::

    ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o ConnectTimeout=10 node2 \\
        "cd /home/me/proj && exec env PATH=... TORCHMN_RANK=2 ... /usr/bin/python3 \\
         -c 'import importlib.util, ...' -- python train.py"
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

DEFAULT_SSH_COMMAND = "ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o ConnectTimeout=10"

# Printed by the watcher on stdout, alone on its line, once the rank is about to start: the
# launcher drops the line and counts the rank as started (see --start-timeout).
STARTED_MARKER = "@@torchmn-rank-started@@"
_CHECK_MARKER = "@@torchmn-host-ok@@"

# Variables forwarded from the launcher to every remote rank, when set, like ``mpirun -x NAME``.
FORWARDED_NAMES = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CONDA_PREFIX",
                   "CONDA_DEFAULT_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                   "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
FORWARDED_PREFIXES = ("TORCHMN_", "TORCH_", "NCCL_", "GLOO_")

# What the launcher writes to a watcher's stdin to have a signal sent to the rank's process group
# (Ctrl-C reaches remote ranks as SIGINT, as it reaches local ones): "signal 2\n".
SIGNAL_LINE = b"signal "
# ... and to have a notification passed on to the rank, which keeps running (SIGUSR1/SIGUSR2, as a
# batch system sends them before the time limit): "relay 10\n".
RELAY_LINE = b"relay "

_EXIT_NO_CWD = 91
_EXIT_NO_PYTHON = 92
_EXIT_SSH = 255
GRACE_SECONDS = 3.0


class RemoteError(Exception):
    """A host that cannot run ranks, or a ``-x`` that cannot be forwarded."""


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """How to reach other hosts: the ssh client command, and optional port and identity file.

    Example::

        >>> SshOptions(port=2222).argv("node2", "true")[-3:]
        ['2222', 'node2', 'true']
    """

    command: str = DEFAULT_SSH_COMMAND
    port: Optional[int] = None
    identity_file: Optional[str] = None

    def argv(self, host: str, remote_command: str) -> List[str]:
        argv = shlex.split(self.command)
        if not argv:
            raise RemoteError("--ssh-command is empty; give an ssh client command such as 'ssh'")
        if self.identity_file:
            argv += ["-i", self.identity_file]
        if self.port:
            argv += ["-p", str(self.port)]
        return argv + [host, remote_command]

    def hint(self, host: str) -> str:
        """An ssh command the user can try by hand."""
        return " ".join(shlex.quote(a) for a in self.argv(host, "true"))


def parse_exports(items: Sequence[str], env: Mapping[str, str]) -> Dict[str, str]:
    """``-x NAME`` (forward this machine's value) and ``-x NAME=VALUE`` options, as a dict.

    Example::

        >>> parse_exports(["A=1", "HOME"], {"HOME": "/root"})
        {'A': '1', 'HOME': '/root'}
    """
    exports: Dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") \
                or not all(c.isalnum() or c == "_" for c in name):
            raise RemoteError(f"-x {item!r}: expected NAME or NAME=VALUE with NAME a variable name")
        if not sep:
            if name not in env:
                raise RemoteError(f"-x {name}: {name} is not set here, so there is nothing to forward; "
                                  f"export it first or give -x {name}=VALUE")
            value = env[name]
        exports[name] = value
    return exports


def forwarded_env(env: Mapping[str, str], exports: Mapping[str, str]) -> Dict[str, str]:
    """What a remote rank gets from the launcher's environment: ``FORWARDED_NAMES``, names starting
    with ``FORWARDED_PREFIXES``, then the ``-x`` exports.

    Example::

        >>> forwarded_env({"PATH": "/bin", "HOME": "/root", "NCCL_DEBUG": "INFO"}, {"A": "1"})
        {'PATH': '/bin', 'NCCL_DEBUG': 'INFO', 'A': '1'}
    """
    out = {name: value for name, value in env.items()
           if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)}
    out.update(exports)
    return out


def exec_line(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """``exec env NAME=VALUE... ARGV`` for a POSIX shell, every word quoted.

    Example::

        >>> exec_line({"A": "x y"}, ["python", "t.py"])
        "exec env 'A=x y' python t.py"
    """
    words = [f"{k}={v}" for k, v in env.items()] + list(argv)
    return "exec env " + " ".join(shlex.quote(w) for w in words)


def shell_command(cwd: str, env: Mapping[str, str], argv: Sequence[str]) -> str:
    """The POSIX shell line that runs ``argv`` in ``cwd`` with ``env`` added, for ``ssh host LINE``.

    Example::

        >>> shell_command("/w", {"A": "x y"}, ["python", "t.py"])
        "cd /w && exec env 'A=x y' python t.py"
    """
    return f"cd {shlex.quote(cwd)} && {exec_line(env, argv)}"


# Runs this file as the watcher, finding it through torchmn's import path without importing torchmn.
WATCHER_BOOTSTRAP = ("import importlib.util as u, os, runpy, sys; sys.argv[0] = 'torchmn.launch.remote'; "
                     "runpy.run_path(os.path.join(os.path.dirname(u.find_spec('torchmn').origin), "
                     "'launch', 'remote.py'), run_name='__main__')")


def rank_command(cwd: str, python: str, env: Mapping[str, str], command: Sequence[str]) -> str:
    """The remote shell line for one rank: the watcher, running ``command``."""
    return shell_command(cwd, env, [python, "-c", WATCHER_BOOTSTRAP, "--", *command])


def _sibling(name: str):
    """Module ``torchmn/<name>.py`` loaded from its file, without importing the torchmn package
    (only for modules whose top level imports the standard library alone)."""
    import importlib.util

    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(package_dir, *name.split("/")) + ".py"
    spec = importlib.util.spec_from_file_location(f"_torchmn_watcher_{name.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- checking hosts ----------------------------------------------------------------------------

@dataclasses.dataclass
class HostCheck:
    """What checking one host found: ``error`` is None when ranks can start there; ``client_address``
    is this machine's address as the host saw the ssh connection come in."""

    host: str
    error: Optional[str] = None
    client_address: Optional[str] = None


def check_host(host: str, ssh: SshOptions, python: str, cwd: str, env: Mapping[str, str],
               timeout: float, started: Optional[list] = None, preexec_fn=None,
               stop: Optional[threading.Event] = None) -> HostCheck:
    """Log in to ``host`` and check that ``cwd`` exists and ``python`` imports torchmn there.

    Example::

        >>> check_host("node2", SshOptions(), sys.executable, os.getcwd(), {}, 30).error  # doctest: +SKIP
        None
    """
    q_cwd, q_python = shlex.quote(cwd), shlex.quote(python)
    probe = (f"import os, torchmn; print({_CHECK_MARKER!r}, os.environ.get('SSH_CONNECTION', ''))")
    line = (f"cd {q_cwd} 2>/dev/null || exit {_EXIT_NO_CWD}; "
            f"[ -x {q_python} ] || exit {_EXIT_NO_PYTHON}; "
            + exec_line(env, [python, "-c", probe]))
    argv = ssh.argv(host, line)
    if stop is not None and stop.is_set():
        return HostCheck(host, "not checked: the launcher was stopped")
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, preexec_fn=preexec_fn)
    except FileNotFoundError:
        return HostCheck(host, f"the ssh client {argv[0]!r} was not found on this machine; install "
                               f"openssh-client or give --ssh-command")
    if started is not None:
        started.append(proc)  # so that the launcher can stop it (Ctrl-C while checking)
    if stop is not None and stop.is_set():  # stopped while this one started: the launcher may not see it
        proc.kill()
    try:
        out, err_text = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return HostCheck(host, f"did not answer within {timeout:g} s (ssh hung, or the host is slow); "
                               f"try `{ssh.hint(host)}`, or raise --start-timeout")
    err = err_text.strip().splitlines()
    last = err[-1] if err else ""
    if proc.returncode == _EXIT_SSH:
        return HostCheck(host, f"cannot be reached over ssh ({last or 'ssh exit code 255'}). Check the host "
                               f"name, that sshd runs there (--ssh-port) and that key login works "
                               f"without a password: `{ssh.hint(host)}`")
    if proc.returncode == _EXIT_NO_CWD:
        return HostCheck(host, f"has no directory {cwd}; ranks start in the launcher's working "
                               f"directory, so it must exist there too (a shared file system, or the "
                               f"same checkout at the same path)")
    if proc.returncode == _EXIT_NO_PYTHON:
        return HostCheck(host, f"has no Python interpreter at {python} (not found or not executable); "
                               f"remote ranks use the launcher's interpreter path, so install the same "
                               f"environment at the same path on every host")
    for out_line in out.splitlines():
        if out_line.startswith(_CHECK_MARKER):
            parts = out_line[len(_CHECK_MARKER):].split()
            return HostCheck(host, None, parts[0] if parts else None)
    detail = last or f"exit code {proc.returncode}"
    return HostCheck(host, f"cannot import torchmn with {python} ({detail}); install torchmn into that "
                           f"interpreter on every host, or forward PYTHONPATH (-x PYTHONPATH)")


def check_hosts(hosts: Sequence[str], ssh: SshOptions, python: str, cwd: str, env: Mapping[str, str],
                timeout: float, started: Optional[list] = None, preexec_fn=None,
                stop: Optional[threading.Event] = None) -> List[HostCheck]:
    """``check_host`` for every host at once; results in the order of ``hosts``. ``started``
    collects the ssh clients as they start; ``preexec_fn`` runs in each; once ``stop`` is set, no
    more start."""
    if not hosts:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(pool.map(lambda h: check_host(h, ssh, python, cwd, env, timeout, started, preexec_fn, stop),
                             hosts))


# ---- the watcher (runs on the remote host) -----------------------------------------------------

def _say(text: str) -> None:
    try:
        sys.stderr.write(f"torchmn: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _reach_store(addr: str, port: int, seconds: float) -> socket.socket:
    """Connect to the rendezvous store, retrying for ``seconds``; raises OSError on failure."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return socket.create_connection((addr, port), timeout=5)
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def group_alive(pgid: int) -> bool:
    """Whether a process group still has a member that is not a zombie. Orphaned grandchildren
    become zombies of PID 1, which in containers may take a second or more to reap them; waiting for
    those would only slow teardown down. (Shared with the launcher; psutil is imported here, not at
    the top, because the watcher runs this file before torchmn's dependencies are known to load.)"""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    import psutil

    for process in psutil.process_iter(["status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(process.pid) == pgid:
                return True
        except (psutil.Error, OSError):
            continue
    return False


def become_subreaper() -> bool:
    """Have processes orphaned below this one re-parented to it instead of to init (Linux's
    ``prctl(PR_SET_CHILD_SUBREAPER)``), so that what a rank detached (a new session, a double
    fork) is still found among this process's descendants; False where that is not available.
    (Shared with the launcher, like group_alive.)"""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _stop_rank(pgid: int, grace: float, signalled: bool = False) -> None:
    """Stop the rank's process group and every other descendant of this process: SIGTERM, then
    SIGKILL after ``grace`` seconds to whatever is left. As a subreaper this process adopts what the
    rank detached, so descendants cover other sessions too; the group covers the case without a
    subreaper. Descendants are listed again each round, since a killed process's children are
    adopted in turn and get their own SIGTERM. ``signalled``: the group has had its signal already
    (the launcher's, see SIGNAL_LINE): no SIGTERM, only SIGKILL after ``grace`` to what is left, as
    the launcher does with its local ranks. Does not reap (the caller does, once the rank is)."""
    import psutil

    if not signalled:
        signal_group(pgid, signal.SIGTERM)
    termed = set()
    deadline = time.monotonic() + grace
    give_up = deadline + 5.0  # SIGKILL sent: only processes stuck in the kernel remain
    while True:
        left = _running_descendants()
        now = time.monotonic()
        if not left and not group_alive(pgid) or now >= give_up:
            return
        if now >= deadline:
            signal_group(pgid, signal.SIGKILL)
        for process in left:
            try:
                if now >= deadline:
                    process.kill()
                elif process.pid not in termed and not signalled:
                    termed.add(process.pid)
                    if os.getpgid(process.pid) != pgid:  # the group has had its SIGTERM
                        process.terminate()
            except (psutil.Error, OSError):  # gone already, or not ours to signal
                pass
        time.sleep(0.05)


def _running_descendants() -> list:
    """This process's descendants, zombies aside. Each one is checked on its own: one that ends
    meanwhile (the rank, reaped by the main thread) must not hide the others."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    running = []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                running.append(child)
        except psutil.Error:
            continue
    return running


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group, if it still has members (shared with the launcher)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_children() -> None:
    """Collect the exit status of every child that has exited, so that no zombie outlives the
    stop (init may reap them slowly in a container). Only once the rank itself has been waited for:
    ``waitpid(-1)`` could take the rank's status away from ``Popen.wait``."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def join_unless_idle(thread: threading.Thread, waiting_since: Callable[[], Optional[float]],
                     idle: float) -> None:
    """Wait for ``thread``, a reader of a pipe, to end, however long it spends passing output on
    (to a slow or paused console), but give up once ``waiting_since()`` (when it started waiting on
    its pipe, None while it is not) is ``idle`` seconds old: something left behind holds the pipe
    open. (Shared with the launcher.)"""
    while thread.is_alive():
        thread.join(0.05)
        since = waiting_since()
        if since is not None and time.monotonic() - since >= idle:
            return


def _relay(source: int, target: int, waiting_since: Dict[int, Optional[float]]) -> None:
    """Copy the rank's output from the pipe ``source`` to this process's ``target`` (the ssh
    channel), raw bytes as they come. The rank gets a pipe rather than the channel itself so that a
    process it detached cannot keep the channel, and so the ssh session, open after the watcher
    ends. A failed write (the channel is gone) drops the rest of the output but reading goes on, so
    the rank never blocks on a full pipe. ``waiting_since[source]``: since when it has been waiting
    on a silent pipe (None while it writes: a slow or paused console is not idle)."""
    writable = True
    while True:
        waiting_since[source] = time.monotonic()
        try:
            chunk = os.read(source, 65536)
        except OSError:
            break
        finally:
            waiting_since[source] = None
        if not chunk:
            break
        while writable and chunk:
            try:
                chunk = chunk[os.write(target, chunk):]
            except OSError:
                writable = False


def _prepare_env(env: Dict[str, str]) -> Optional[str]:
    """Check the store is reachable, choose gloo's interface and add the thread budget.
    Returns an error message, or None."""
    resources, hosts = _sibling("resources"), _sibling("launch/hosts")
    rank, host = env.get("TORCHMN_RANK", "?"), env.get("TORCHMN_HOST", socket.gethostname())
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        try:
            connection = _reach_store(addr, int(port), float(env.get("TORCHMN_STORE_CHECK_SECONDS", "10")))
        except OSError as e:
            return (f"rank {rank} on host {host} cannot reach the rendezvous store at {addr}:{port} "
                    f"({e.strerror or e}). The launcher machine must accept connections from every "
                    f"host: pick its address with `torchmn run --network-interface IFACE`, or open "
                    f"the port range in the firewall.")
        with connection:
            local_address = connection.getsockname()[0]
        if "GLOO_SOCKET_IFNAME" not in env:
            interface = hosts.interface_of(local_address)
            if interface:
                env["GLOO_SOCKET_IFNAME"] = interface
    local_size = int(env.get("TORCHMN_LOCAL_SIZE", "1"))
    env.update(resources.launcher_thread_env(local_size, env))
    return None


def watch(command: Sequence[str], grace: float = GRACE_SECONDS) -> int:
    """Run ``command`` as a remote rank until it exits or this process's stdin closes; returns the
    exit code (128+N when the rank was killed by signal N).

    Example::

        $ echo | python -m torchmn.launch.remote -- python -c "print('hi')"   # stdin closes at once
    """
    env = dict(os.environ)
    error = _prepare_env(env)
    if error:
        _say(error)
        return 1
    host = env.get("TORCHMN_HOST", socket.gethostname())
    adopts = become_subreaper()
    try:
        process = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        _say(f"rank {env.get('TORCHMN_RANK', '?')} on host {host} could not start {command[0]!r}: "
             f"{e.strerror}. Check that it is installed there and on the forwarded PATH.")
        return 127 if isinstance(e, FileNotFoundError) else 126
    try:
        sys.stdout.write(STARTED_MARKER + "\n")
        sys.stdout.flush()
    except OSError:
        pass
    # Started after the marker, so that the marker is alone on its line whatever the rank prints.
    waiting_since: Dict[int, Optional[float]] = {}
    relays = [(pipe.fileno(), threading.Thread(target=_relay, args=(pipe.fileno(), fd, waiting_since), daemon=True))
              for pipe, fd in ((process.stdout, 1), (process.stderr, 2))]
    for _, relay in relays:
        relay.start()
    stop_lock = threading.Lock()
    torn_down = threading.Event()  # by the launcher (stdin closed), not by the rank's own exit

    def stop(signalled: bool = False) -> None:
        # The stdin thread and the main thread may both get here: one at a time. The main thread's
        # stop, once the rank is reaped, is a last sweep after the stdin thread's (nothing found:
        # one scan of /proc), for an orphan a scan missed while it was being re-parented.
        with stop_lock:
            _stop_rank(process.pid, grace, signalled)

    def read_stdin() -> None:
        pending, signalled = b"", False
        try:
            while True:
                data = os.read(0, 65536)
                if not data:
                    break
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.startswith(SIGNAL_LINE) and line[len(SIGNAL_LINE):].isdigit():
                        signal_group(process.pid, int(line[len(SIGNAL_LINE):]))
                        signalled = True
                    elif line.startswith(RELAY_LINE) and line[len(RELAY_LINE):].isdigit():
                        signal_group(process.pid, int(line[len(RELAY_LINE):]))
        except OSError:
            pass
        # Not process.poll(): only the main thread may reap the rank (see the wait below).
        if process.returncode is None:
            torn_down.set()
        stop(signalled)

    def on_signal(signum, frame) -> None:
        signal_group(process.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    threading.Thread(target=read_stdin, daemon=True).start()
    while adopts:
        # Wait for any child without reaping it: adopted orphans that exit are reaped at once
        # (no zombies piling up over a long job); the rank's own status is left to Popen.wait.
        pid = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT).si_pid
        if pid == process.pid:
            break
        os.waitpid(pid, 0)
    returncode = process.wait()
    # Whatever the rank left running, in its process group or detached, goes with it.
    stop()
    _reap_children()
    # The pipes reach EOF once nothing holds them any more. The rest of the output goes out however
    # slowly the launcher's console reads it; only a pipe that something we could not stop holds
    # open, silent for 2 s, is given up on.
    for source, relay in relays:
        join_unless_idle(relay, lambda source=source: waiting_since.get(source), 2.0)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if not torn_down.is_set():
            _say(f"rank {env.get('TORCHMN_RANK', '?')} on host {host} was killed by {name}")
        return 128 - returncode
    return returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        _say("usage: python -m torchmn.launch.remote -- COMMAND [ARGS...] (started by `torchmn run -H`)")
        return 2
    return watch(args)


if __name__ == "__main__":
    sys.exit(main())
