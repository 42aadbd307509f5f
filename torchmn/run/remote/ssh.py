"""The launcher's side of ranks on other hosts: ssh command lines and host checks.

How to reach a host (``SshOptions``), which variables a remote rank gets (``forwarded_env``, the
``-x`` exports), the shell line that starts a rank's watcher there (``rank_command``), and the
check that a host can run ranks at all (``check_hosts``), made before any rank starts.

Example (what the launcher runs for rank 2 on host ``node2``)::

    ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new -o ConnectTimeout=10 node2 \\
        "cd /home/me/proj && exec env PATH=... TORCHMN_RANK=2 ... /usr/bin/python3 \\
         -c 'import importlib.util as u, runpy, ...' -- python train.py"
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import shlex
import signal
import subprocess
import threading
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from torchmn.errors import TorchmnError
from torchmn.run.processes.groups import signal_group
from torchmn.run.remote.protocol import WATCHER_MODULE
from torchmn.run.store.auth import TOKEN_ENV, TOKEN_ON_STDIN

DEFAULT_SSH_COMMAND = "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new -o ConnectTimeout=10"

# Variables forwarded from the launcher to every remote rank, when set, like ``mpirun -x NAME``.
FORWARDED_NAMES = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CONDA_PREFIX",
                   "CONDA_DEFAULT_ENV", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                   "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
FORWARDED_PREFIXES = ("TORCHMN_", "TORCH_", "NCCL_", "GLOO_")
# ... except these (see forwarded_env).
NOT_FORWARDED = (TOKEN_ENV, TOKEN_ON_STDIN)
# The -x variables that go on the ssh command line, because the remote shell needs them to start
# the watcher (the interpreter's libraries, torchmn's import path); every other -x value goes
# through the watcher's stdin, where other users of the hosts cannot read it in `ps`.
STARTUP_NAMES = ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD")

# Printed by a host check that got as far as importing torchmn.
_CHECK_MARKER = "@@torchmn-host-ok@@"
# Exit codes of the host check's shell line, and ssh's own.
_EXIT_NO_CWD = 91
_EXIT_NO_PYTHON = 92
_EXIT_SSH = 255


class RemoteError(TorchmnError):
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
        """The ssh client's argument list that runs ``remote_command`` on ``host``.

        Args:
            host: the host to log in to.
            remote_command: the shell line to run there.

        Returns:
            The argument list, for ``subprocess.Popen``.

        The command is split as a POSIX shell would split it; ``-i`` and ``-p`` follow it when an
        identity file or a port is set, then the host and ``remote_command`` as one word.

        Raises:
            RemoteError: the ssh command is empty.

        Example::

            >>> SshOptions(command="ssh -q", port=2222, identity_file="~/.ssh/id_job").argv("node2", "hostname")
            ['ssh', '-q', '-i', '~/.ssh/id_job', '-p', '2222', 'node2', 'hostname']
        """
        argv = shlex.split(self.command)
        if not argv:
            raise RemoteError("--ssh-command is empty; give an ssh client command such as 'ssh'")
        if self.identity_file:
            argv += ["-i", self.identity_file]
        if self.port:
            argv += ["-p", str(self.port)]
        return argv + [host, remote_command]

    def hint(self, host: str) -> str:
        """An ssh command the user can try by hand.

        Args:
            host: the host.

        Returns:
            The command, quoted for a shell.

        Example::

            >>> SshOptions(command="ssh").hint("node2")
            'ssh node2 true'
        """
        return " ".join(shlex.quote(a) for a in self.argv(host, "true"))


def parse_exports(items: Sequence[str], env: Mapping[str, str]) -> Dict[str, str]:
    """``-x NAME`` (forward this machine's value) and ``-x NAME=VALUE`` options, as a dict.

    Args:
        items: the ``-x`` values.
        env: this machine's environment, for ``-x NAME``.

    Returns:
        The variables to set for every rank.

    Raises:
        RemoteError: a malformed item, or ``-x NAME`` for a variable that is not set.

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


def split_exports(exports: Mapping[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """The ``-x`` variables a remote rank's ssh command line carries (``STARTUP_NAMES``), and
    those its watcher reads from its stdin (the rest: never on a command line).

    Args:
        exports: the parsed ``-x`` options (see ``parse_exports``).

    Returns:
        ``(on the command line, through stdin)``.

    Example::

        >>> split_exports({"PYTHONPATH": "/src", "WANDB_API_KEY": "k"})
        ({'PYTHONPATH': '/src'}, {'WANDB_API_KEY': 'k'})
    """
    line = {k: v for k, v in exports.items() if k in STARTUP_NAMES}
    return line, {k: v for k, v in exports.items() if k not in STARTUP_NAMES}


def forwarded_env(env: Mapping[str, str], exports: Mapping[str, str]) -> Dict[str, str]:
    """What a remote rank gets from the launcher's environment: ``FORWARDED_NAMES``, names starting
    with ``FORWARDED_PREFIXES``, then the ``-x`` exports.

    Args:
        env: the launcher's environment.
        exports: the parsed ``-x`` options (see ``parse_exports``).

    Returns:
        The variables to set on the remote host.

    Example::

        >>> forwarded_env({"PATH": "/bin", "HOME": "/root", "NCCL_DEBUG": "INFO"}, {"A": "1"})
        {'PATH': '/bin', 'NCCL_DEBUG': 'INFO', 'A': '1'}
    """
    out = {name: value for name, value in env.items()
           if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)}
    out.update(exports)
    # A job token never goes on a command line, where every user of both hosts could read it in
    # `ps`: the watcher reads the job's own from its stdin.
    for name in NOT_FORWARDED:
        out.pop(name, None)
    return out


def command_line_env(env: Mapping[str, str], exports: Mapping[str, str]) -> Dict[str, str]:
    """What an ssh command line that starts Python on a remote host carries: ``forwarded_env``'s
    variables with the ``-x`` ones Python needs to start (``STARTUP_NAMES``), none of the ``-x``
    variables that go through the watcher's stdin (not even the launcher's own value of one).

    Args:
        env: the launcher's environment.
        exports: the parsed ``-x`` options (see ``parse_exports``).

    Returns:
        The variables to put on the command line.

    Example::

        >>> command_line_env({"PATH": "/bin", "TORCHMN_X": "1"}, {"PYTHONPATH": "/src", "TORCHMN_X": "2"})
        {'PATH': '/bin', 'PYTHONPATH': '/src'}
    """
    on_line, on_stdin = split_exports(exports)
    return {k: v for k, v in forwarded_env(env, on_line).items() if k not in on_stdin}


def exec_line(env: Mapping[str, str], argv: Sequence[str]) -> str:
    """``exec env NAME=VALUE... ARGV`` for a POSIX shell, every word quoted.

    Args:
        env: the variables to set.
        argv: the program and its arguments.

    Returns:
        The shell text.

    Example::

        >>> exec_line({"A": "x y"}, ["python", "t.py"])
        "exec env 'A=x y' python t.py"
    """
    words = [f"{k}={v}" for k, v in env.items()] + list(argv)
    return "exec env " + " ".join(shlex.quote(w) for w in words)


def shell_command(cwd: str, env: Mapping[str, str], argv: Sequence[str]) -> str:
    """The POSIX shell line that runs ``argv`` in ``cwd`` with ``env`` added, for ``ssh host LINE``.

    Args:
        cwd: the directory.
        env: the variables to set.
        argv: the program and its arguments.

    Returns:
        The shell line.

    Example::

        >>> shell_command("/w", {"A": "x y"}, ["python", "t.py"])
        "cd /w && exec env 'A=x y' python t.py"
    """
    return f"cd {shlex.quote(cwd)} && {exec_line(env, argv)}"


def rank_command(cwd: str, python: str, env: Mapping[str, str], command: Sequence[str]) -> str:
    """The remote shell line for one rank: the watcher (``torchmn.run.remote.watcher``), running ``command``.

    Args:
        cwd: the directory to run in (the launcher's).
        python: the interpreter that runs the watcher (the launcher's).
        env: the variables the rank gets on top of the remote login's own.
        command: the rank's program and arguments.

    Returns:
        The shell line, for ``SshOptions.argv``: ``cd CWD && exec env NAME=VALUE... PYTHON -m
        torchmn.run.remote.watcher -- COMMAND...``, every word quoted.

    Example::

        >>> rank_command("/w", "/usr/bin/python3", {"TORCHMN_RANK": "2"}, ["python", "train.py"])
        'cd /w && exec env TORCHMN_RANK=2 /usr/bin/python3 -m torchmn.run.remote.watcher -- python train.py'
    """
    return shell_command(cwd, env, [python, "-m", WATCHER_MODULE, "--", *command])


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

    Args:
        host: the host to check.
        ssh: how to reach it.
        python: the interpreter remote ranks will use.
        cwd: the directory remote ranks will start in.
        env: the variables remote ranks get (``PYTHONPATH`` may be what makes torchmn importable).
        timeout: seconds the whole check may take.
        started: a list the ssh client is appended to as it starts, so the caller can stop it.
        preexec_fn: run in the ssh client before exec.
        stop: once set, the check starts no ssh client (and kills one starting at that moment).

    Returns:
        What was found; a failure is described in ``error``, never raised.

    Raises:
        RemoteError: the ssh command is empty.

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
    """``check_host`` for every host at once.

    Args:
        hosts: the hosts to check.
        ssh, python, cwd, env, timeout, started, preexec_fn, stop: as for ``check_host``.

    Runs up to 32 checks at a time, each on a thread of its own.

    Returns:
        One ``HostCheck`` per host, in the order of ``hosts``; an empty list for no hosts.

    Raises:
        RemoteError: the ssh command is empty.

    Example::

        >>> checks = check_hosts(["node2", "node3"], SshOptions(), sys.executable,  # doctest: +SKIP
        ...                      os.getcwd(), {}, 30)
        >>> [c.error for c in checks]  # doctest: +SKIP
        [None, None]
    """
    if not hosts:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return list(pool.map(lambda h: check_host(h, ssh, python, cwd, env, timeout, started, preexec_fn, stop),
                             hosts))


def check_hosts_or_stop(hosts: Sequence[str], ssh: SshOptions, python: str, cwd: str, env: Mapping[str, str],
                        timeout: float, preexec_fn=None, poll: Callable[[], None] = lambda: None
                        ) -> List[HostCheck]:
    """``check_hosts``, calling ``poll`` every 0.1 s meanwhile; when ``poll`` raises (the launcher
    got Ctrl-C), every ssh client is stopped at once and the exception passes on, rather than
    after the checks (up to ``timeout``).

    Args:
        hosts, ssh, python, cwd, env, timeout, preexec_fn: as for ``check_host``.
        poll: called while the checks run; raises to stop them.

    Returns:
        One ``HostCheck`` per host, in the order of ``hosts``.

    Raises:
        RemoteError: the ssh command is empty.
        BaseException: whatever ``poll`` raises (the launcher's ``RunError`` on Ctrl-C), passed on
            once every ssh client has been killed.

    Example::

        >>> stopped = threading.Event()
        >>> def poll():
        ...     if stopped.is_set():
        ...         raise KeyboardInterrupt
        >>> checks = check_hosts_or_stop(["node2"], SshOptions(), sys.executable, os.getcwd(), {}, 30,  # doctest: +SKIP
        ...                              poll=poll)
    """
    clients: list = []
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        checking = pool.submit(check_hosts, hosts, ssh, python, cwd, env, timeout, clients, preexec_fn, stop)
        while True:
            try:
                return checking.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                pass
            try:
                poll()
            except BaseException:
                stop.set()  # checks not started yet start no ssh client; one starting now stops itself
                for client in list(clients):
                    signal_group(client.pid, signal.SIGKILL)  # each in a session of its own
                raise
