"""The settings of one ``torchmn run`` job, and the error for a job that cannot be run as asked.

The command line builds one ``LaunchConfig``; it flows ``cli -> run(config) -> Job(config)``.
"""
from __future__ import annotations

import dataclasses
from typing import AbstractSet, Optional, Sequence, Tuple

from torchmn.errors import TorchmnError
from torchmn.run.processes import binding
from torchmn.run.remote.ssh import SshOptions

# Seconds between SIGTERM and SIGKILL when the launcher stops its ranks.
GRACE_SECONDS = 3.0
# Seconds the host checks, and each remote rank's start, may take by default (--start-timeout).
START_TIMEOUT = 60.0
# Seconds between a failed start and the next (--restart-delay). Long enough for a stop that
# reached the ranks before the launcher (scancel, a preemption: SIGTERM to every process) to reach
# the launcher too, so that the stop wins; and for what a failure leaves (memory an OOM kill is
# freeing, a busy file server) to settle. Short next to the seconds a torch job takes to start.
RESTART_DELAY = 3.0
# Seconds an elastic job may stay below --min-np ranks (horovodrun's default).
ELASTIC_TIMEOUT = 600.0
# --max-np with a discovery script and no --max-np: as many as it offers.
NO_LIMIT = 1 << 20


class RunError(TorchmnError):
    """A job that cannot be started as asked; ``exit_code`` is what ``torchmn run`` exits with.

    Args:
        message: what is wrong and what to do about it.
        exit_code: the launcher's exit code (2 by default; 127 for a command not found, ...).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What ``torchmn run`` was asked to do: the command line's options, checked.

    Attributes:
        command: the program each rank runs, with its arguments (a leading ``--`` is dropped).
        np: the number of ranks (in a multi-task Slurm step: ranks per node).
        master_port: the rendezvous port; None lets the OS pick a free one.
        log_dir: a directory for ``rank.<r>.log`` files, or None.
        output_ranks: the ranks whose output the console shows; None for all.
        start_timeout: seconds the host checks, and each remote rank's start, may take
            (None: ``START_TIMEOUT``).
        verbose: print what the launcher does.
        grace: seconds between SIGTERM and SIGKILL when ranks are stopped.
        hosts: (host, slots) pairs as ``torchmn.run.remote.hostfile.parse_hosts`` returns; ranks fill the
            slots in order; None means this machine.
        ssh: how to reach the other hosts (None: ``SshOptions()``).
        exports: ``-x NAME`` / ``-x NAME=VALUE`` options, for every rank.
        network_interface: the interface whose address other hosts use for the rendezvous (else:
            the address the first remote host sees the launcher connect from).
        max_restarts: how many times a failed job is started again (``--max-restarts``).
        restart_on: the exit codes that restart it, a signal N as 128+N (``--restart-on``, see
            ``torchmn.run.restarts.parse_restart_on``); None: any failure of a rank.
        restart_delay: seconds between a failure and the restart (``--restart-delay``).
        allow_unsigned_store: on a kernel that cannot sign TCP connections, start anyway, with the
            rendezvous store's own port open to every program of the machine
            (``--allow-unsigned-store``; see ``torchmn.run.store.rendezvous.start_store``).
        nnodes, node_rank, master_addr: one launcher per node (``--nnodes``, ``--node-rank``,
            ``--master-addr``): this node's place in a job of ``nnodes`` nodes, and where node 0
            hosts the rendezvous (see ``torchmn.run.nodes.per_node_step``).
        monitor: show the live per-rank table and the straggler summary (``--monitor``; see
            ``torchmn.monitor``).
        timeline: write every rank's phases to this Chrome-trace file (``--timeline``), or None.
        min_np, max_np: an elastic job (``--min-np``, ``--max-np``; see ``torchmn.run.elastic``): it
            goes on while at least ``min_np`` ranks live, and grows up to ``max_np``. None for a job
            of a fixed ``np`` ranks; one given makes the other default to ``np`` (``max_np`` to
            no limit with a discovery script).
        host_discovery_script: an elastic job's hosts and slots come from what this program prints
            (``host:slots`` lines), read every second (``--host-discovery-script``).
        elastic_timeout: seconds an elastic job may stay below ``min_np`` ranks (``--elastic-timeout``).
        reset_limit: the most resets an elastic job makes before it ends (``--reset-limit``); None: no limit.
        bind: how each host's ranks are bound to its CPUs (``--bind``: ``"numa"``, ``"core"`` or
            ``"none"``; see ``torchmn.run.processes.binding``).

    Raises:
        RunError: ``np`` below 1, no command, a port outside 1-65535, a start timeout that is
            not positive, a negative restart count or delay, or a ``restart_on`` code outside 1-255.

    Example::

        >>> LaunchConfig(["--", "python", "train.py"], np=2).command
        ('python', 'train.py')
        >>> LaunchConfig([], np=2)
        Traceback (most recent call last):
        torchmn.run.config.RunError: no command given. Usage: torchmn run -np N [options] COMMAND [ARGS...]
    """

    command: Sequence[str]
    np: int
    master_port: Optional[int] = None
    log_dir: Optional[str] = None
    output_ranks: Optional[AbstractSet[int]] = None
    start_timeout: Optional[float] = None
    verbose: bool = False
    grace: float = GRACE_SECONDS
    hosts: Optional[Sequence[Tuple[str, int]]] = None
    ssh: Optional[SshOptions] = None
    exports: Sequence[str] = ()
    network_interface: Optional[str] = None
    max_restarts: int = 0
    restart_on: Optional[AbstractSet[int]] = None
    restart_delay: float = RESTART_DELAY
    allow_unsigned_store: bool = False
    nnodes: Optional[int] = None
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    monitor: bool = False
    timeline: Optional[str] = None
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    host_discovery_script: Optional[str] = None
    elastic_timeout: float = ELASTIC_TIMEOUT
    reset_limit: Optional[int] = None
    bind: str = binding.DEFAULT_MODE

    @property
    def elastic(self) -> bool:
        """Whether ranks may leave and join while the job runs (``--min-np``, ``--max-np`` or a
        ``--host-discovery-script`` given)."""
        return self.min_np is not None
    def __post_init__(self) -> None:
        """Check the options and normalise them in place (the dataclass's constructor calls it).

        Drops a leading ``--`` from ``command``; makes ``command``, ``hosts`` and ``exports``
        tuples and ``output_ranks`` and ``restart_on`` frozensets; fills ``start_timeout`` (with
        ``START_TIMEOUT``) and ``ssh`` (with ``SshOptions()``) where they are None.

        Raises:
            RunError: ``np`` below 1, no command, a port outside 1-65535, a start timeout that is
                not positive, a negative restart count, a negative or NaN restart delay, or a
                ``restart_on`` that is empty or holds a code outside 1-255.

        Example::

            >>> config = LaunchConfig(["--", "python", "train.py"], np=2, output_ranks=[0])
            >>> config.command, config.output_ranks, config.start_timeout
            (('python', 'train.py'), frozenset({0}), 60.0)
        """
        if self.np < 1:
            raise RunError(f"-np must be at least 1, got {self.np}.")
        if self.bind not in binding.MODES:
            raise RunError(f"--bind must be one of {', '.join(binding.MODES)}, got {self.bind!r}.")
        command = tuple(self.command)
        if command and command[0] == "--":
            command = command[1:]
        if not command:
            raise RunError("no command given. Usage: torchmn run -np N [options] COMMAND [ARGS...]")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise RunError(f"--master-port must be between 1 and 65535, got {self.master_port}.")
        if self.start_timeout is not None and not (0 < self.start_timeout < float("inf")):  # also refuses NaN
            raise RunError(f"--start-timeout must be a positive number of seconds, got {self.start_timeout:g}.")
        if self.nnodes is not None and self.nnodes < 1:
            raise RunError(f"--nnodes must be at least 1, got {self.nnodes}.")
        if (self.node_rank is not None or self.master_addr is not None) and self.nnodes is None:
            raise RunError("--node-rank and --master-addr go with --nnodes N (one torchmn run per node).")
        if self.nnodes is not None and self.nnodes > 1 and self.node_rank is None:
            raise RunError(f"--nnodes {self.nnodes} needs --node-rank R (0 to {self.nnodes - 1}), a different R on "
                           f"each node, 0 on the node at --master-addr.")
        if self.max_restarts < 0:
            raise RunError(f"--max-restarts must be 0 or more, got {self.max_restarts}.")
        if not self.restart_delay >= 0:  # also refuses NaN
            raise RunError(f"--restart-delay must be 0 or more seconds, got {self.restart_delay:g}.")
        if self.restart_on is not None and (not self.restart_on or not all(0 < c < 256 for c in self.restart_on)):
            raise RunError(f"--restart-on takes exit codes 1-255 and signal names, got {sorted(self.restart_on)}.")
        elastic = self._check_elastic()
        # Frozen: the normalised values are set once, here.
        normalised = {
            **elastic,
            "command": command,
            "output_ranks": None if self.output_ranks is None else frozenset(self.output_ranks),
            "start_timeout": START_TIMEOUT if self.start_timeout is None else self.start_timeout,
            "hosts": None if self.hosts is None else tuple(self.hosts),
            "ssh": self.ssh or SshOptions(),
            "exports": tuple(self.exports),
            "restart_on": None if self.restart_on is None else frozenset(self.restart_on),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    def _check_elastic(self) -> dict:
        """The elastic settings, checked and completed (empty for a fixed-size job)."""
        if self.min_np is None and self.max_np is None and self.host_discovery_script is None:
            if self.reset_limit is not None:
                raise RunError("--reset-limit bounds an elastic job's resets: give --min-np/--max-np too.")
            return {}
        if self.reset_limit is not None and self.reset_limit < 0:
            raise RunError(f"--reset-limit must be 0 or more, got {self.reset_limit}.")
        min_np = self.np if self.min_np is None else self.min_np
        max_np = self.max_np if self.max_np is not None else NO_LIMIT if self.host_discovery_script else self.np
        if not 1 <= min_np <= self.np <= max_np:
            raise RunError(f"an elastic job needs 1 <= --min-np <= -np <= --max-np; got --min-np {min_np}, "
                           f"-np {self.np}, --max-np {max_np if max_np != NO_LIMIT else 'unlimited'}.")
        if not self.elastic_timeout > 0:
            raise RunError(f"--elastic-timeout must be a positive number of seconds, got {self.elastic_timeout:g}.")
        if self.max_restarts:
            raise RunError("--max-restarts and --min-np/--max-np do not go together: an elastic job keeps its "
                           "survivors running instead of restarting every rank. Drop one of them.")
        if self.monitor or self.timeline:
            raise RunError("--monitor and --timeline do not follow an elastic job's resets (a rank's number and the "
                           "world's size change at each): drop them, or run without --min-np/--max-np to watch the job.")
        return {"min_np": min_np, "max_np": max_np}
