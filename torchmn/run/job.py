"""``torchmn run``: start N ranks of a command, watch them, and tear the job down cleanly.

``run(config)`` runs one job; ``Job`` puts the pieces together: the plan (``plan``), the processes
(``supervisor``), their output (``output``), remote hosts (``ssh``) and the other nodes' launchers
(``nodes``). How the launcher supervises its ranks is in ``docs/design/launcher.md``.
"""
from __future__ import annotations

import collections
import os
import queue
import shlex
import shutil
import signal
import socket
import sys
import time
from typing import Dict, List, Mapping, Optional, Union

from torchmn import monitor, network, resources
from torchmn.errors import TorchmnOSError
from torchmn.run.config import GRACE_SECONDS, START_TIMEOUT, LaunchConfig, RunError
from torchmn.run.plan import Slot, local_env, plan_slots, refuse_outer_launcher, remote_env
from torchmn.run.processes.output import (Console, describe_exit, exit_code_of, failure_summary, made_folder,
                                          prepare_log_dir)
from torchmn.run.processes.supervisor import Rank, Supervisor
from torchmn.run.remote import hostfile
from torchmn.run.remote.protocol import EXPORTS_ON_STDIN, exports_line
from torchmn.run.remote.ssh import (RemoteError, check_hosts_or_stop, command_line_env, parse_exports,
                                    rank_command, split_exports)
from torchmn.run.restarts import TORCHMN_RESTART_COUNT
from torchmn.run.nodes import NodeLaunchers, per_node_step
from torchmn.run.slurm_step import slurm_step
from torchmn.run.store import auth
from torchmn.run.store.rendezvous import address_for_hosts, start_store

__all__ = ["GRACE_SECONDS", "START_TIMEOUT", "Job", "LaunchConfig", "RunError"]

LOCAL_ADDR = "127.0.0.1"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Notifications, not stops: passed on to every running rank, and the job goes on, as under mpirun.
# Slurm's `--signal=USR1@120` warns a job this way before its time limit (a rank can checkpoint).
RELAYED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


class Job:
    """A ``torchmn run`` job. Use ``run()`` unless you need the pieces.

    Args:
        config: what to run, and how.
        env: the launcher's environment, which the ranks inherit (default: ``os.environ``).

    Raises:
        RunError: the job cannot be run as asked (nothing has been started).
    """

    def __init__(self, config: LaunchConfig, env: Optional[Mapping[str, str]] = None):
        self.config = config
        self.base_env = dict(os.environ if env is None else env)
        self.host = socket.gethostname()
        hosts = config.hosts
        try:
            self.exports = parse_exports(config.exports, self.base_env)
            # The ranks record what --monitor and --timeline ask for (see torchmn.monitor).
            if config.monitor:
                self.exports[monitor.MONITOR_VARIABLE] = "1"
            if config.timeline:
                self.exports[monitor.TIMELINE_VARIABLE] = config.timeline
            # The hosts and their slots, this machine's names merged into one (None: this machine).
            self.hosts = hostfile.merge_local_aliases(hosts) if hosts else None
            placement = hostfile.assign_ranks(self.hosts, config.np) if hosts else [(self.host, config.np)]
        except (hostfile.HostsError, RemoteError) as e:
            raise RunError(str(e)) from e
        self.remote_hosts = [h for h, _ in placement if hosts and not network.is_local(h)]
        self.slots: List[Slot] = plan_slots(placement)
        self.master_addr = LOCAL_ADDR
        self.master_port = config.master_port
        # One launcher per node (--nnodes, a platform's variables, or one task per node of a
        # multi-node srun step): this node's share of one job (see torchmn.run.nodes).
        step = per_node_step(config, self.base_env)
        if step is None:
            refuse_outer_launcher(self.base_env)
            step = slurm_step(self.base_env)
            if step is not None and hosts:
                raise RunError(f"-H/--hostfile inside a Slurm step of {step.tasks} tasks: each task would start a "
                               f"job of its own over ssh, and they would train apart. In a Slurm step, one "
                               f"torchmn run per node makes the job of the step's nodes: drop -H/--hostfile "
                               f"(`srun --ntasks-per-node 1 torchmn run -np RANKS_PER_NODE ...`), or start "
                               f"torchmn run -H once, outside srun.")
        self.nodes = None if step is None else NodeLaunchers(step, config.np, config.start_timeout, self.base_env)
        # The job's secret: only processes started with it (or that prove they know it) reach the
        # store; see docs/security.md. The launchers of one job, one per node, share theirs.
        self.token = self.nodes.token if self.nodes is not None else auth.new_token()
        if self.nodes is not None:
            self.slots = self.nodes.plan(config.network_interface)
            self.master_addr = step.master_addr
            if self.master_port is None:
                self.master_port = step.master_port
        self.size = self.slots[0].size
        if config.output_ranks is not None and not config.output_ranks <= set(range(self.size)):
            raise RunError(f"--output-ranks names ranks {sorted(config.output_ranks - set(range(self.size)))}, "
                           f"but the job has ranks 0..{self.size - 1} only.")
        self.console = Console(config.output_ranks)
        self.job_id = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        # Made in this thread, which starts the ranks (see supervisor.die_with_launcher).
        self.procs = Supervisor(self.job_id, config.grace)
        self.events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.first_failure: Optional[Rank] = None
        self.received_signal: Optional[int] = None
        self.start_failure: Optional[str] = None
        self.node_failure: Optional[str] = None
        self.started_at = 0.0
        self.started_wall = 0.0  # time.time() as the ranks start: their timeline parts are newer
        self.store = None
        self.display = None

    @property
    def ranks(self) -> List[Rank]:
        """The ranks started so far."""
        return self.procs.ranks

    # -- starting ---------------------------------------------------------------------------------

    def is_remote(self, slot: Slot) -> bool:
        """Whether ``slot``'s rank runs on another host (started over ssh, through the watcher).

        Args:
            slot: one of the job's slots (``job.slots``).

        Returns:
            True when the slot's host is one of ``remote_hosts``: a host given with ``-H`` or
            ``--hostfile`` that is not a name of this machine.

        Example::

            >>> job = Job(LaunchConfig(["python", "train.py"], np=2))
            >>> job.is_remote(job.slots[0])
            False
        """
        return slot.host in self.remote_hosts

    def check_command(self) -> None:
        """Check that the command can be found where it starts on this machine (with ``-x PATH=...``,
        on that PATH); ranks on other hosts have theirs checked by the watcher there.

        Nothing is checked when every rank runs on another host.

        Raises:
            RunError: the command is not found (exit code 127), or is a file without permission to
                run (exit code 126, as a shell's).

        Example::

            >>> Job(LaunchConfig(["no-such-program"], np=1)).check_command()
            Traceback (most recent call last):
            torchmn.run.config.RunError: command not found: 'no-such-program' was not found on PATH ...
        """
        command = self.config.command
        if all(self.is_remote(slot) for slot in self.slots):
            return  # checked on each host by the watcher
        path = self.exports.get("PATH", self.base_env.get("PATH", os.defpath))  # -x PATH=... is the ranks' PATH
        if shutil.which(command[0], path=path) is None:
            if os.sep in command[0] and os.path.isfile(command[0]):
                raise RunError(f"command not executable: {command[0]!r} is a file without permission to run it "
                               f"(rank 0 on host {self.host} would have run it). Make it executable (chmod +x "
                               f"{command[0]}), or name its interpreter (python {command[0]}).", exit_code=126)
            where = "is not an executable file" if os.sep in command[0] else "was not found on PATH"
            raise RunError(f"command not found: {command[0]!r} {where} (rank 0 on host {self.host} "
                           f"would have run it). Check the spelling, or give its full path.", exit_code=127)

    def check_timeline(self, keep: bool = True) -> None:
        """Make the folder of ``--timeline``'s file on this machine, if ranks start here, and check
        that they can write their parts there: found before training, not after.

        Args:
            keep: False: remove again the folders this call made (``--dry-run``, which checks as the
                real run does and leaves nothing behind).

        Raises:
            RunError: the folder cannot be made or written (exit code 2).

        Example::

            >>> Job(LaunchConfig(["true"], np=1, timeline="/proc/t.json")).check_timeline()
            Traceback (most recent call last):
            torchmn.run.config.RunError: --timeline /proc/t.json: the ranks cannot write their parts ...
        """
        path = self.config.timeline
        if path is None or all(self.is_remote(slot) for slot in self.slots):
            return
        folder = os.path.dirname(os.path.abspath(path))
        try:
            with made_folder(folder, keep):
                problem = None if os.access(folder, os.W_OK | os.X_OK) else "permission denied"
        except OSError as e:
            problem = e.strerror or str(e)
        if problem is not None:
            raise RunError(f"--timeline {path}: the ranks cannot write their parts in {folder} on host {self.host} "
                           f"({problem}); give a path in a folder they can write", exit_code=2)

    def _check_hosts(self) -> None:
        """Check every remote host at once and choose the rendezvous address; raise RunError naming
        every host that cannot run ranks."""
        config = self.config
        known = self.known_master_addr()  # before any ssh: a wrong --network-interface needs none
        if not self.remote_hosts:
            self.master_addr = known
            return
        if config.verbose:
            self.console.message(f"torchmn run: checking hosts {', '.join(self.remote_hosts)} over ssh")
        # The host check starts Python and imports torchmn there: the -x values it needs for that,
        # never the others (its command line is visible in `ps` on both hosts).
        env = command_line_env(self.base_env, self.exports)
        try:
            checks = check_hosts_or_stop(self.remote_hosts, config.ssh, sys.executable, os.getcwd(), env,
                                         config.start_timeout, self.procs.death_signal, self._raise_on_signal)
        except RemoteError as e:
            raise RunError(str(e)) from e
        bad = [c for c in checks if c.error]
        if bad:
            lines = [f"{len(bad)} of {len(checks)} host(s) cannot run ranks:"]
            lines += [f"  host {c.host}: {c.error}" for c in bad]
            raise RunError("\n".join(lines))
        self.master_addr = known or address_for_hosts(checks, self.remote_hosts, config.ssh.port)

    def known_master_addr(self) -> Optional[str]:
        """The rendezvous address as far as it is known before any host is checked.

        Returns:
            Node 0's address with one launcher per node; else the address of
            ``--network-interface`` where given; else ``127.0.0.1`` for a job on this machine alone;
            None where other hosts take part, since the address is then the one the first remote
            host sees the launcher connect from, which only the host checks tell.

        Raises:
            RunError: ``--network-interface`` names no interface with an address.

        Example::

            >>> Job(LaunchConfig(["python", "train.py"], np=2)).known_master_addr()
            '127.0.0.1'
        """
        if self.nodes is not None:
            return self.master_addr
        if self.config.network_interface:
            try:
                return network.interface_address(self.config.network_interface)
            except network.NetworkError as e:
                raise RunError(str(e)) from e
        return None if self.remote_hosts else LOCAL_ADDR

    def _raise_on_signal(self, doing: str = "checking the hosts") -> None:
        """Ctrl-C (or SIGTERM, scancel's) before any rank started: stop the launcher now. SIGUSR1
        and SIGUSR2 (which Slurm's ``--signal`` sends ahead of a time limit) have no rank to go to
        yet: said, and the start goes on, as the ranks would go on."""
        while True:
            try:
                kind, signum = self.events.get_nowait()  # only signals can be queued before ranks start
            except queue.Empty:
                return
            if kind == "relay":
                self.console.message(f"torchmn run: received {signal.Signals(signum).name} while {doing}, before "
                                     f"any rank started: no rank to pass it on to")
                continue
            raise RunError(f"received {signal.Signals(signum).name} while {doing}; stopped", exit_code=128 + signum)

    def rank_environment(self, slot: Slot, port: Union[int, str]) -> Dict[str, str]:
        """The variables torchmn sets for one rank.

        For a rank on this machine, its whole environment: the launcher's, the ``-x`` exports, the
        thread budget, its place, the job's id and its token. For a rank on another host, the
        variables its ssh command line sets (the forwarded ones and its place); the watcher there
        adds the token (read from its stdin), the thread budget and gloo's interface.

        Args:
            slot: the rank's place.
            port: the rendezvous port (``torchmn run --dry-run`` passes a placeholder).

        Returns:
            The variables.

        Example::

            >>> job = Job(LaunchConfig(["python", "train.py"], np=2))
            >>> job.rank_environment(job.slots[1], 29500)["RANK"]
            '1'
        """
        if self.is_remote(slot):
            env = remote_env(slot, self.base_env, self.exports, self.master_addr, port, bind=self.config.bind)
            env[auth.TOKEN_ON_STDIN] = "1"  # the token itself goes through stdin (see start_rank)
            return env
        one_machine = not self.remote_hosts and (self.nodes is None or self.nodes.step.tasks == 1)
        # On a node but the first (one launcher per node), the ranks reach the store through this node's relay.
        address = self.nodes.ranks_address(self.master_addr) if self.nodes is not None else self.master_addr
        try:
            env = local_env(slot, self.base_env, self.exports, address, port, self.job_id,
                            several_hosts=bool(self.remote_hosts), one_machine=one_machine, bind=self.config.bind)
        except ValueError as e:
            raise RunError(str(e)) from e
        env[auth.TOKEN_ENV] = self.token
        return env

    def rank_argv(self, slot: Slot, env: Mapping[str, str]) -> List[str]:
        """What is started for one rank: the command itself on this machine; for a rank on another
        host, the ssh client that runs the watcher there, ``env`` on its command line.

        Args:
            slot: the rank's place.
            env: its variables (see ``rank_environment``).

        Returns:
            The argument list, for ``subprocess.Popen``.

        Raises:
            RunError: ``--ssh-command`` is empty.

        Example::

            >>> job = Job(LaunchConfig(["python", "train.py"], np=1))
            >>> job.rank_argv(job.slots[0], {})
            ['python', 'train.py']
        """
        if not self.is_remote(slot):
            return list(self.config.command)
        line = rank_command(os.getcwd(), sys.executable, env, self.config.command)
        try:
            return self.config.ssh.argv(slot.host, line)
        except RemoteError as e:
            raise RunError(str(e)) from e

    def start_rank(self, slot: Slot, port: int) -> Rank:
        """Start one rank, its output also in ``--log-dir``'s ``rank.<slot.rank>.log`` (``start`` does so
        for every slot; an elastic job also for new workers).

        Args:
            slot: the rank's place.
            port: the rendezvous port.

        Returns:
            The rank started.

        Raises:
            RunError: it could not be started.

        Example::

            >>> rank = job.start_rank(job.slots[0], job.store.port)   # doctest: +SKIP
        """
        remote = self.is_remote(slot)
        env = self.rank_environment(slot, port)
        argv = self.rank_argv(slot, env)
        log_dir = self.config.log_dir
        log_path = os.path.join(log_dir, f"rank.{slot.rank}.log") if log_dir else None
        # A restart adds its ranks' output to the earlier starts' (what made them fail stays).
        start = env.get(TORCHMN_RESTART_COUNT, "0")
        header = f"----- torchmn run: start {start} ({TORCHMN_RESTART_COUNT}={start}) -----" if start != "0" else None
        # A remote rank's ssh client runs with the launcher's environment; its rank's is on the line.
        rank = self.procs.start_rank(slot, argv, self.base_env if remote else env, remote, log_path,
                                     self.console, self._rank_exited, log_header=header)
        if remote:
            auth.send_token(rank.process.stdin, self.token)
            if env.get(EXPORTS_ON_STDIN):
                auth.send_line(rank.process.stdin, exports_line(split_exports(self.exports)[1]))
        return rank

    def start(self) -> None:
        """Check the command and the hosts, open the rendezvous store and start every rank.

        With one launcher per node, node 0 opens the store and the others connect to it; then
        every task checks in. Otherwise the remote hosts are checked over ssh and this machine
        hosts the store. The guardian starts when a rank runs on this machine.

        Raises:
            RunError: the job cannot start; ranks already started are left to ``teardown``.

        Example::

            >>> job = Job(LaunchConfig(["python", "train.py"], np=2))
            >>> job.start()                                    # the ranks run from here on
            >>> code = job.watch(); job.close()
        """
        config = self.config
        self.check_command()
        self.check_timeline()
        self.procs.prepare()
        if config.log_dir is not None:
            prepare_log_dir(config.log_dir)
        if self.nodes is not None:
            origin = ("--master-port" if config.master_port else "MASTER_PORT" if self.base_env.get("MASTER_PORT")
                      else "derived from the Slurm job and step ids" if self.nodes.step.kind == "Slurm task"
                      else "the default port")
            self.store = self.nodes.open_store(
                self.master_addr, self.master_port, origin, self.console.message, self._local_pids,
                allow_unsigned=config.allow_unsigned_store,
                interrupt=lambda: self._raise_on_signal(f"waiting for the rendezvous store of {self.nodes.step.kind} 0"))
            self.nodes.check_in(lambda: self._raise_on_signal(f"waiting for the other {self.nodes.step.kind}s"))
        else:
            self._check_hosts()
            self.store = start_store(self.master_addr, self.master_port, token=self.token, log=self.console.message,
                                     likely_pids=self._local_pids, allow_unsigned=config.allow_unsigned_store)
        port = self.store.port
        if config.verbose:
            self._describe(port)
        self.started_at = time.monotonic()
        self.started_wall = time.time() - 1.0  # allowing for the file system's timestamps
        if any(not self.is_remote(slot) for slot in self.slots):
            self.procs.start_guardian()
        for slot in self.slots:
            self.start_rank(slot, port)
        if self.nodes is None:
            # The store starts while the ranks import torch, not when the first reaches it; ranks on
            # other hosts cannot be watched doing so.
            if any(self.is_remote(slot) for slot in self.slots):
                self.store.open_in_background()
            else:
                self.store.open_when_torch_loads(self._local_pids)
        if config.monitor and (self.nodes is None or self.nodes.step.task == 0):
            self._start_display()

    def _start_display(self) -> None:
        """The monitor's table, from the figures the ranks put in the store (see torchmn.monitor)."""
        from torchmn.monitor import display

        hosted = self.store

        def read():
            try:
                return display.read_store(hosted.store, self.size)
            except RunError:  # the store could not start: the job's own error says why
                return {}
        self.display = display.Display(read, self.size, self.console.message, sys.stderr)
        if self.display.live is not None:  # a terminal: the table is redrawn below the ranks' lines
            self.console.above = self.display.print_above
        self.display.start()

    def finish_display(self) -> None:
        """Show the monitor's last table and summary.

        Example::

            >>> job.finish_display()   # doctest: +SKIP
        """
        if self.display is not None:
            self.console.above = None
            self.display.finish()
            self.display = None

    def join_timeline(self) -> None:
        """Join the timeline's parts found here into the file ``--timeline`` names, where asked:
        after every rank of the job ended (with one launcher per node, on node 0, once the other
        nodes' ranks have ended too).

        Example::

            >>> job.join_timeline()   # doctest: +SKIP
        """
        path = self.config.timeline
        if path is None or (self.nodes is not None and self.nodes.step.task != 0):
            return
        from torchmn.monitor import timeline

        try:
            _, ranks, _, _ = timeline.merge(path, since=self.started_wall, finished=True)
        except TorchmnOSError:
            self.console.message(f"torchmn run: no rank wrote a part of the timeline {path} here (ranks on other "
                                 f"hosts write theirs there: copy them here and run torchmn timeline merge {shlex.quote(path)}; "
                                 f"a rank records only once it calls torchmn.create_communicator())")
            return
        except (OSError, ValueError) as e:
            self.console.message(f"torchmn run: could not join the timeline {path}: {e}")
            return
        missing = sorted(set(range(self.size)) - set(ranks))
        self.console.message(f"torchmn run: timeline of {len(ranks)} rank(s) written to {path}" +
                             (f"; rank(s) {', '.join(map(str, missing))} wrote no part here (on other hosts: copy "
                              f"{path}.rank<r>.json here and run torchmn timeline merge {shlex.quote(path)}; the parts here are "
                              f"kept for it)" if missing else
                              f"; draw it with: torchmn timeline {shlex.quote(path)} --png timeline.png"))

    def _local_pids(self) -> List[int]:
        """The ranks started on this machine: the store's gate looks at them first."""
        return [rank.process.pid for rank in list(self.ranks) if not rank.is_remote]

    def _describe(self, port: int) -> None:
        placed = ", ".join(f"{h}:{n}" for h, n in dict(collections.Counter(s.host for s in self.slots)).items())
        # What a rank here is given: -x exports and --bind's share count, as they do when it starts.
        here = next((slot for slot in self.slots if not self.is_remote(slot)), None)
        env = (self.rank_environment(here, port) if here is not None else
               resources.launcher_thread_env(self.slots[0].local_size,
                                             resources.exported_env(self.base_env, self.exports)))
        # The launcher sets OMP_NUM_THREADS to its budget unless the user set it; a TORCHMN_NUM_THREADS
        # beside another OMP_NUM_THREADS came with the launcher's own environment (a torchmn process's).
        omp, budget = env.get("OMP_NUM_THREADS"), env.get(resources.TORCHMN_NUM_THREADS)
        threads = budget if budget is not None and omp in (None, budget) else f"set by user (OMP_NUM_THREADS={omp})"
        step = self.nodes.step if self.nodes else None
        ranks = (f"ranks {self.slots[0].rank}-{self.slots[-1].rank} of {self.size} "
                 f"({step.kind} {step.task} of {step.tasks})" if step else f"{self.config.np} ranks")
        where = f"{self.master_addr}:{port}"
        if self.nodes is not None and self.nodes.relay is not None:
            where = f"{self.master_addr}:{self.master_port}, through this node's relay on 127.0.0.1:{port}"
        self.console.message(
            f"torchmn run: {ranks} on {placed}, rendezvous {where}, "
            f"threads per rank: {threads}"
            f"{' (on this machine)' if self.remote_hosts else ''}, command: {' '.join(self.config.command)}")

    def _rank_exited(self, rank: Rank, returncode: int) -> None:
        self.events.put(("exit", rank, returncode))

    # -- watching ---------------------------------------------------------------------------------

    def on_signal(self, signum: int, frame) -> None:
        """The launcher's handler of ``FORWARDED_SIGNALS`` and ``RELAYED_SIGNALS``; ``run`` installs it.

        It only queues the signal, which ``watch`` (or ``teardown``) handles: a relayed signal is
        passed on to the running ranks; any other stops the job, and a second one during teardown
        kills what is left at once.

        Args:
            signum: the signal received.
            frame: unused.

        Example::

            >>> signal.signal(signal.SIGTERM, job.on_signal)   # doctest: +SKIP
        """
        # SimpleQueue.put is reentrant, so it is safe even when the signal interrupts a get().
        self.events.put(("relay" if signum in RELAYED_SIGNALS else "signal", signum))

    def ending(self) -> bool:
        """Whether something already ends the job.

        Returns:
            True after a failed rank, a stop signal, a late start or another node's failure.

        Example::

            >>> job.ending()
            False
        """
        return any(x is not None for x in (self.received_signal, self.first_failure, self.start_failure,
                                           self.node_failure))

    def _relay(self, sig: int) -> None:
        if self.ending():
            return
        running = self.procs.relay(sig)
        self.console.message(f"torchmn run: received {signal.Signals(sig).name}; passed it on to "
                             f"{running} running rank(s) (a rank without a handler for it ends, "
                             f"as under mpirun)")

    def teardown(self, first_signal: int) -> None:
        """Stop every rank and everything it started: ``first_signal`` to each process group,
        SIGKILL to whatever is left after the grace period.

        Exits already queued are handled first, as exits that came before the stop. While it
        waits, a signal that comes after the one that stopped the job, or after a rank failed (a
        second Ctrl-C), sends SIGKILL at once rather than waiting out the grace period.

        Args:
            first_signal: the signal the ranks get first (the one the launcher received, else SIGTERM).

        Example::

            >>> job.teardown(signal.SIGTERM)   # doctest: +SKIP
        """
        self.procs.remember_descendants()
        # Exits already queued happened before the stop: those ranks ended on their own.
        while True:
            try:
                self._handle(self.events.get_nowait(), escalate=False)
            except queue.Empty:
                break
        self.procs.stop(first_signal)
        deadline = time.monotonic() + self.procs.grace_after_stop()
        while self.procs.anything_left() and time.monotonic() < deadline:
            self.next_event(min(0.05, max(0.0, deadline - time.monotonic())), escalate=True)
        self.procs.kill_all()

    def next_event(self, timeout: float, escalate: bool = False) -> None:
        """Handle the next rank exit or signal, waiting at most ``timeout`` seconds for one.

        Args:
            timeout: seconds to wait.
            escalate: a second stop signal kills what is left at once (during teardown).

        Example::

            >>> job.next_event(0.5)   # doctest: +SKIP
        """
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(event, escalate)

    def _handle(self, event: tuple, escalate: bool) -> None:
        if event[0] == "exit":
            _, rank, returncode = event
            rank.returncode = returncode
            if returncode != 0 and not rank.stopped_by_launcher and not self.ending():
                self.first_failure = rank
        elif event[0] == "relay":
            self._relay(event[1])
        elif event[0] == "signal":
            if self.received_signal is None and self.first_failure is None:
                self.received_signal = event[1]
            elif escalate:
                # A second Ctrl-C during teardown: do not make the user wait for the grace period.
                self.procs.kill_all()

    def watch(self) -> int:
        """Wait for the job to end, then stop whatever is left and report.

        Call it after ``start``. With one launcher per node it also reports this node's first
        failed rank to the other tasks, and tells them this task has ended.

        Returns:
            The launcher's exit code: 0, the first failed rank's (128+N for a rank killed by signal
            N), 128+N for signal N received by the launcher, 124 for a rank that did not start in
            time, 1 when another node's rank failed.

        Example::

            >>> job = Job(LaunchConfig(["python", "-c", "raise SystemExit(3)"], np=2))
            >>> job.start(); job.watch()   # doctest: +SKIP
            3
        """
        last_scan = 0.0
        while self.procs.running() and not self.ending():
            self.next_event(0.5)
            if time.monotonic() - last_scan > 0.5:
                self.procs.remember_descendants()
                self._check_started()
                self._check_other_nodes()
                last_scan = time.monotonic()
        failed = self.first_failure
        if self.nodes is not None and failed is not None:
            self.nodes.report_failure(f"rank {failed.slot.rank} (host {failed.slot.host}) "
                                      f"{describe_exit(failed.returncode)}")
        # Also when every rank exited 0: stops anything they left running in the background.
        self.teardown(self.received_signal or signal.SIGTERM)
        for rank in self.ranks:
            rank.output.finish(idle=2.0)
        self.finish_display()
        if self.nodes is None:
            self.join_timeline()
        code = self._summarize()
        if self.nodes is not None:
            self.nodes.end_task(wait_for_others=self.received_signal is None, log=self.console.message,
                                stop=self._signalled, failed=code != 0)
            self.join_timeline()  # the other nodes' ranks have ended too: their parts are final
        return code

    def _signalled(self) -> bool:
        """Whether Ctrl-C or SIGTERM came since the ranks ended (the other events are done with)."""
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return False
            if event[0] in ("signal", "relay"):
                return True

    def _check_other_nodes(self) -> None:
        """Stop this node's ranks when another task's launcher reported a failed rank."""
        reason = self.nodes.reported_failure() if self.nodes is not None else None
        if reason is not None:
            self.node_failure = (f"torchmn run: {reason}; stopped the {len(self.procs.running())} "
                                 f"rank(s) on this node.")

    def _check_started(self) -> None:
        """End the job when a remote rank has not started within the start timeout."""
        timeout = self.config.start_timeout
        if self.start_failure is not None or time.monotonic() - self.started_at < timeout:
            return
        late = [r for r in self.ranks if not r.started and r.returncode is None]
        if not late:
            return
        hosts = sorted({r.slot.host for r in late}, key=[s.host for s in self.slots].index)
        self.start_failure = (
            f"torchmn run: rank(s) {', '.join(str(r.slot.rank) for r in late)} on host(s) "
            f"{', '.join(hosts)} did not start within {timeout:g} s (--start-timeout); "
            f"stopped the job. The host passed its check, so ssh or the host itself is slow or hung: "
            f"try `{self.config.ssh.hint(hosts[0])}`, or raise --start-timeout.")

    def _summarize(self) -> int:
        if self.start_failure is not None:
            self.console.message(self.start_failure)
            return 124
        if self.node_failure is not None:
            self.console.message(self.node_failure)
            return 1
        if self.received_signal is not None:
            name = signal.Signals(self.received_signal).name
            self.console.message(f"torchmn run: received {name}; forwarded it to all {self.config.np} ranks "
                                 f"and stopped them.")
            return 128 + self.received_signal
        failed = self.first_failure
        if failed is None:
            return 0
        self.console.message(failure_summary(failed, self.ranks, self.nodes.reported if self.nodes else None))
        return exit_code_of(failed.returncode)

    def run_once(self) -> int:
        """Start the job, watch it to its end and close it: one start, without restarts.

        Returns:
            The exit code (see ``watch``).

        Raises:
            RunError: the job cannot start; any rank already started has been stopped.

        Example::

            >>> Job(LaunchConfig(["python", "-c", "pass"], np=2)).run_once()
            0
        """
        try:
            try:
                self.start()
            except BaseException:
                if self.ranks:
                    self.teardown(signal.SIGTERM)
                raise
            return self.watch()
        finally:
            self.close()

    def close(self) -> None:
        """Close the rendezvous store and let the guardian go; call once the job has ended.

        With one launcher per node it also closes this node's part (see ``NodeLaunchers.close``).
        ``run_once`` calls it.

        Example::

            >>> job = Job(LaunchConfig(["python", "train.py"], np=2))
            >>> try:
            ...     job.start()
            ...     code = job.watch()
            ... finally:
            ...     job.close()
        """
        # Dropping the last reference shuts the store's server down and frees the port.
        self.store = None
        if self.nodes is not None:
            self.nodes.close()
        self.procs.close()
