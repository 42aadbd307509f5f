"""The watcher: the process that runs one remote rank, on the remote host, for ``torchmn run -H``.

The launcher's ssh client starts it there (``python -m torchmn.run.remote.watcher``, see
``torchmn.run.remote.ssh``); it reads the job's token from its stdin, opens this host's relay to
the rendezvous store's gate (which checks that the store is reachable, see
``torchmn.run.store.relay``) and points the rank at it, gives the rank the token, its thread
budget and gloo's interface, runs the rank, passes its output on, and stops everything the rank
started when the rank exits or the launcher goes away. The protocol between
launcher and watcher is in ``protocol.py`` and ``docs/design/launcher.md``. It never imports torch:
nothing it imports does.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from torchmn import network, resources
from torchmn.run.processes import binding
from torchmn.run.processes.groups import become_subreaper, group_alive, signal_group
from torchmn.run.processes.output import join_unless_idle, readable
from torchmn.run.remote.protocol import (EXPORTS_ON_STDIN, RELAY_LINE, SIGNAL_LINE, STARTED_MARKER,
                                         WATCHER_GRACE_SECONDS, read_exports_line)
from torchmn.run.store.auth import TOKEN_ENV, TOKEN_ON_STDIN, ImpostorError, TokenError, read_token_line
from torchmn.run.store.relay import LOCAL_ADDR, Relay


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"torchmn: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _write_line(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
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


def _stop_rank(rank: subprocess.Popen, grace: float, signalled: bool = False) -> None:
    """Stop the rank's process group and every other descendant of this process: SIGTERM, then
    SIGKILL after ``grace`` seconds to whatever is left. As a subreaper this process adopts what the
    rank detached, so descendants cover other sessions too; the group covers the case without a
    subreaper, while the rank is not reaped (after that, its pid and so the group's id may already
    lead another session, which must not be signalled). Descendants are listed again each round,
    since a killed process's children are adopted in turn and get their own SIGTERM. ``signalled``:
    the group has had its signal already (the launcher's, see SIGNAL_LINE): no SIGTERM, only SIGKILL
    after ``grace`` to what is left, as the launcher does with its local ranks. Does not reap (the
    caller does, once the rank is)."""
    import psutil

    pgid = rank.pid

    def ours() -> bool:  # the group's id is still the rank's
        return rank.returncode is None

    group_termed = not signalled and ours()
    if group_termed:
        signal_group(pgid, signal.SIGTERM)
    termed = set()
    deadline = time.monotonic() + grace
    give_up = deadline + 5.0  # SIGKILL sent: only processes stuck in the kernel remain
    while True:
        left = _running_descendants()
        now = time.monotonic()
        if not left and not (ours() and group_alive(pgid)) or now >= give_up:
            return
        if now >= deadline and ours():
            signal_group(pgid, signal.SIGKILL)
        for process in left:
            try:
                if now >= deadline:
                    process.kill()
                elif process.pid not in termed and not signalled:
                    termed.add(process.pid)
                    if not group_termed or os.getpgid(process.pid) != pgid:  # else it had the group's
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


def _copy_output(source: int, target: int, waiting_since: Dict[int, Optional[float]]) -> None:
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


def _prepare_env(env: Dict[str, str], token: Optional[str], rank_pids: List[int],
                 bound: Optional[binding.Binding]) -> Tuple[Optional[str], Optional[Relay]]:
    """Check the store is reachable, choose gloo's interface and add the thread budget (the rank's
    share of the CPUs it is ``bound`` to, where it is bound). With the job's token, the check is
    opening this host's relay (see ``torchmn.run.store.relay``), which the rank is then pointed at
    (``MASTER_ADDR``, ``MASTER_PORT``). Returns an error message or None, and the relay."""
    rank, host = env.get("TORCHMN_RANK", "?"), env.get("TORCHMN_HOST", socket.gethostname())
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    relay = None
    if addr and port:
        seconds = float(env.get("TORCHMN_STORE_CHECK_SECONDS", "10"))
        try:
            if token:
                relay = Relay(addr, int(port), token, seconds, _write_line, likely_pids=lambda: rank_pids)
                local_address = relay.local_address
            else:
                with _reach_store(addr, int(port), seconds) as connection:
                    local_address = connection.getsockname()[0]
        except ImpostorError:
            return (f"rank {rank} on host {host}: the process listening on {addr}:{port} did not prove it "
                    f"knows this job's token, so it is not this job's launcher (another program, perhaps "
                    f"another user's, holds the port) and the rank was not started. Start the job again "
                    f"with another --master-port."), None
        except TokenError:
            return (f"rank {rank} on host {host}: the rendezvous store at {addr}:{port} refused this job's "
                    f"token; another program may have taken the launcher's port. Start the job again."), None
        except OSError as e:
            return (f"rank {rank} on host {host} cannot reach the rendezvous store at {addr}:{port} "
                    f"({e.strerror or e}). The launcher machine must accept connections from every "
                    f"host: pick its address with `torchmn run --network-interface IFACE`, or open "
                    f"the port range in the firewall."), None
        if relay is not None:
            env["MASTER_ADDR"], env["MASTER_PORT"] = LOCAL_ADDR, str(relay.port)
        if "GLOO_SOCKET_IFNAME" not in env:
            interface = network.interface_of(local_address)
            if interface:
                env["GLOO_SOCKET_IFNAME"] = interface
    local_size = int(env.get("TORCHMN_LOCAL_SIZE", "1"))
    env.update(resources.launcher_thread_env(local_size, env,
                                             None if bound is None else (len(bound.cpus), bound.sharing)))
    return None, relay


def _job_token(env: Dict[str, str]) -> Tuple[Optional[str], Optional[str]]:
    """The job's token, which the launcher writes as the first line of stdin (never on the ssh
    command line: every user of both hosts could read it in ``ps``). Returns it (None when the
    launcher sends none) and an error message or None."""
    if not env.pop(TOKEN_ON_STDIN, None):
        return None, None
    token = read_token_line(0)
    if token is None:
        host = env.get("TORCHMN_HOST", socket.gethostname())
        return None, (f"rank {env.get('TORCHMN_RANK', '?')} on host {host}: the launcher's connection ended "
                      f"before it sent the job's token")
    env[TOKEN_ENV] = token
    return token, None


def _exports(env: Dict[str, str]) -> Optional[str]:
    """Add the ``-x`` variables the launcher writes on stdin after the token (never on the ssh
    command line: every user of both hosts could read them in ``ps``). Returns an error message
    or None."""
    if not env.pop(EXPORTS_ON_STDIN, None):
        return None
    values = read_exports_line(0)
    if values is None:
        host = env.get("TORCHMN_HOST", socket.gethostname())
        return (f"rank {env.get('TORCHMN_RANK', '?')} on host {host}: the launcher's connection ended before it "
                f"sent the -x variables")
    env.update(values)
    return None


def watch(command: Sequence[str], grace: float = WATCHER_GRACE_SECONDS) -> int:
    """Run ``command`` as a remote rank until it exits or this process's stdin closes.

    Args:
        command: the rank's program and its arguments.
        grace: seconds between SIGTERM and SIGKILL when the rank is stopped.

    Returns:
        The exit code (128+N when the rank was killed by signal N; 1 when the store cannot be
        reached; 127 or 126 when the command cannot be started).

    Example::

        $ python -m torchmn.run.remote.watcher -- python -c "print('hi')"   # in a terminal: stdin stays open
    """
    env = dict(os.environ)
    token, error = _job_token(env)
    error = error or _exports(env)
    rank_pids: List[int] = []
    bound = None
    try:
        bound = binding.for_rank(env)
    except ValueError as e:  # --bind core with more ranks than this host's cores
        host = env.get("TORCHMN_HOST", socket.gethostname())
        error = error or f"rank {env.get('TORCHMN_RANK', '?')} on host {host}: {e}"
    if error is None:
        error, relay = _prepare_env(env, token, rank_pids, bound)
    if error:
        _say(error)
        return 1
    host = env.get("TORCHMN_HOST", socket.gethostname())
    adopts = become_subreaper()
    try:
        process = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True,
                                   preexec_fn=binding.bind_in_child(bound))
    except OSError as e:
        _say(f"rank {env.get('TORCHMN_RANK', '?')} on host {host} could not start {command[0]!r}: "
             f"{e.strerror}. Check that it is installed there and on the forwarded PATH.")
        return 127 if isinstance(e, FileNotFoundError) else 126
    rank_pids.append(process.pid)
    try:
        sys.stdout.write(STARTED_MARKER + "\n")
        sys.stdout.flush()
    except OSError:
        pass
    # Started after the marker, so that the marker is alone on its line whatever the rank prints.
    waiting_since: Dict[int, Optional[float]] = {}
    copiers = [(pipe.fileno(), threading.Thread(target=_copy_output, args=(pipe.fileno(), fd, waiting_since),
                                                daemon=True))
              for pipe, fd in ((process.stdout, 1), (process.stderr, 2))]
    for _, copier in copiers:
        copier.start()
    stop_lock = threading.Lock()
    torn_down = threading.Event()  # by the launcher (stdin closed), not by the rank's own exit

    def stop(signalled: bool = False) -> None:
        # The stdin thread and the main thread may both get here: one at a time. The main thread's
        # stop, once the rank is reaped, is a last sweep after the stdin thread's (nothing found:
        # one scan of /proc), for an orphan a scan missed while it was being re-parented.
        with stop_lock:
            _stop_rank(process, grace, signalled)

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
    if relay is not None:
        relay.close()
    _reap_children()
    # The pipes reach EOF once nothing holds them any more. The rest of the output goes out however
    # slowly the launcher's console reads it; only a pipe that something we could not stop holds
    # open, silent for 2 s, is given up on.
    for source, copier in copiers:
        join_unless_idle(copier, lambda source=source: waiting_since.get(source), 2.0,
                         lambda source=source: readable(source))
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
    """``python -m torchmn.run.remote.watcher -- COMMAND [ARGS...]``: run COMMAND under the watcher.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``); a leading ``--`` is dropped.

    Without a command it writes its usage to stderr and returns 2.

    Returns:
        The exit code: the rank's (see ``watch``), or 2 without a command.

    Example::

        >>> main(["--"])
        2
        >>> main(["--", "python", "train.py"])  # doctest: +SKIP
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        _say("usage: python -m torchmn.run.remote.watcher -- COMMAND [ARGS...] (started by `torchmn run -H`)")
        return 2
    return watch(args)


if __name__ == "__main__":
    sys.exit(main())
