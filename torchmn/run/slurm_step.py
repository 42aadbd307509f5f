"""``torchmn run`` as one task per node of a Slurm step: one job across the step's nodes.

Inside ``srun -N 2 --ntasks-per-node 1 torchmn run -np 2 ...`` (without -H/--hostfile) task ``t``
starts ranks ``t*np .. t*np+np-1``; task 0 hosts the store on the step's first node, and the
launchers talk through it (``SlurmTasks``). The protocol is in ``docs/design/launcher.md``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from torchmn import network
from torchmn.environments import SlurmEnvironment
from torchmn.environments.detect import launcher_class
from torchmn.environments.hostlist import expand_hostlist
from torchmn.run.config import RunError
from torchmn.run.plan import Slot, plan_slots
from torchmn.run.store.auth import ImpostorError, TokenError, step_token
from torchmn.run.store.rendezvous import HostedStore, start_store
from torchmn.run.store.relay import LOCAL_ADDR, Relay

# Store keys the launchers of one Slurm step share (the ranks' own keys have no such prefix).
SLURM_KEY = "torchmn/launcher/"
# How long task 0 keeps the store up, after its own ranks ended, for the other nodes' ranks to end.
SLURM_DONE_WAIT = 30.0


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """This launcher's place in a Slurm step that runs one ``torchmn run`` task per node.

    Attributes:
        task: ``SLURM_PROCID``, equal to ``SLURM_NODEID``.
        tasks: ``SLURM_NTASKS``, equal to the number of nodes in the step.
        hosts: the step's nodes, in ``SLURM_NODEID`` order.
        master_addr, master_port: where task 0 hosts the store.
        job_id, step_id: ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (the step's token derives from them).
    """

    task: int
    tasks: int
    hosts: Tuple[str, ...]
    master_addr: str
    master_port: int
    job_id: str = ""
    step_id: str = ""


def _step_hosts(env: Mapping[str, str]) -> List[str]:
    name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
    if name is None:
        raise RunError("SLURM_STEP_NODELIST is not set, so torchmn run cannot tell the nodes of this "
                       "Slurm step; start it with srun, which sets it.")
    try:
        return expand_hostlist(env[name])
    except ValueError as e:
        raise RunError(f"{name}={env[name]!r} cannot be read: {e}.") from e


def slurm_step(env: Mapping[str, str]) -> Optional[SlurmStep]:
    """The Slurm step this launcher is one task of.

    Requires one task per node (each starts that node's ranks) and task ``t`` on node ``t``. The
    rendezvous is the first node of the step, on ``MASTER_ADDR`` / ``MASTER_PORT`` when set, else
    on ``slurm_port(job id, step id)``.

    Args:
        env: the launcher's environment.

    Returns:
        The step, or None when the launcher runs alone (no srun, or a step of one task), which
        keeps the single-machine behaviour.

    Raises:
        RunError: the step's variables cannot be read, or the tasks are not one per node in order.

    Example::

        >>> step = slurm_step({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
        ...                    "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        ...                    "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "n[1-2]"})
        >>> step.task, step.tasks, step.hosts, step.master_addr, step.master_port
        (1, 2, ('n1', 'n2'), 'n1', 24074)
    """
    if launcher_class(env) is not SlurmEnvironment:
        return None
    try:
        seen = SlurmEnvironment.read(env)
    except (ValueError, RuntimeError) as e:
        raise RunError(f"cannot read this Slurm step's variables: {e}") from e
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
    return SlurmStep(seen.rank, seen.size, tuple(hosts), seen.master_addr, seen.master_port,
                     env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", ""))


def _stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class SlurmTasks:
    """This launcher's dealings with the other tasks' launchers of its step, through the store.

    Args:
        step: this task's place (see ``slurm_step``).
        np: ranks per node (``-np``), which every task must agree on.
        start_timeout: how long to wait for the other tasks (``--start-timeout``).
        env: the launcher's environment (default: ``os.environ``), for the step's token.

    Attributes:
        store: the rendezvous store, once open.
        reported: another node's failure that was reported before this node's own first failure.
        token: the job's token, the same in every task (see ``torchmn.run.store.auth.step_token``).

    Raises:
        RunError: the step's token can be neither read nor made.
    """

    def __init__(self, step: SlurmStep, np: int, start_timeout: float, env: Optional[Mapping[str, str]] = None):
        self.step = step
        self.np = np
        self.start_timeout = start_timeout
        self.store = None
        self.hosted: Optional[HostedStore] = None
        self.relay: Optional[Relay] = None
        self.reported: Optional[str] = None
        try:
            self.token = step_token(os.environ if env is None else env, step.job_id, step.step_id)
        except TokenError as e:
            raise RunError(f"Slurm task {step.task}: {e}") from e

    def plan(self, network_interface: Optional[str]) -> List[Slot]:
        """This node's share of the job's slots: ``np`` ranks on each of the step's nodes.

        Args:
            network_interface: ``--network-interface``, which must not be given.

        Returns:
            The slots of this task's ranks.

        Raises:
            RunError: ``--network-interface`` was given (the rendezvous is the step's first node).

        Example::

            >>> step = SlurmStep(task=1, tasks=2, hosts=("n1", "n2"), master_addr="n1", master_port=24074)
            >>> [slot.rank for slot in SlurmTasks(step, 2, 60.0, {"TORCHMN_JOB_TOKEN": "ab" * 32}).plan(None)]
            [2, 3]
        """
        if network_interface:
            raise RunError("--network-interface does not apply inside a multi-task Slurm step: the "
                           "rendezvous is the step's first node. Set MASTER_ADDR to choose its address.")
        everyone = plan_slots([(host, self.np) for host in self.step.hosts])
        return [slot for slot in everyone if slot.node_rank == self.step.task]

    def open_store(self, master_addr: str, master_port: int, port_origin: str,
                   log: Optional[Callable[[str], None]] = None, likely_pids: Callable[[], Sequence[int]] = tuple,
                   allow_unsigned: bool = False):
        """Task 0 hosts the store, behind its gate on the step's first node; each other task opens
        its node's relay to it (see ``torchmn.run.store.relay``), through which its ranks and this
        launcher reach the store as clients.

        Args:
            master_addr, master_port: where task 0 hosts it.
            port_origin: where the port came from, for the error when it is taken.
            log: where the gate (task 0's, or this node's relay) reports refused connections.
            likely_pids: this node's ranks, looked at first to identify a client.
            allow_unsigned: task 0 starts on a kernel that cannot sign TCP connections (see
                ``torchmn.run.store.rendezvous.start_store``).

        Returns:
            Task 0: the ``HostedStore``; the other tasks: their ``TCPStore`` client, through the
            relay. Either way ``port`` is the port this node's ranks are told (see ``ranks_address``).

        Raises:
            RunError: the store cannot be started, or reached within the start timeout, or task 0
                refused this task's token.

        Example::

            >>> store = tasks.open_store(step.master_addr, step.master_port, "MASTER_PORT")   # doctest: +SKIP
            >>> store.port   # doctest: +SKIP
            24074
        """
        if self.step.task == 0:
            self.hosted = start_store(self._listen_address(master_addr), master_port, port_origin=port_origin,
                                      token=self.token, log=log, likely_pids=likely_pids,
                                      allow_unsigned=allow_unsigned)
            self.store = self.hosted.store
            return self.hosted
        from torch.distributed import TCPStore

        try:
            self.relay = Relay(master_addr, master_port, self.token, self.start_timeout, log or _stderr,
                               likely_pids=likely_pids)
            self.store = TCPStore(LOCAL_ADDR, self.relay.port, is_master=False,
                                  timeout=datetime.timedelta(seconds=self.start_timeout))
        except ImpostorError as e:
            raise RunError(f"Slurm task {self.step.task}: the process listening on {master_addr}:{master_port}, "
                           f"where this step's task 0 hosts its rendezvous store, did not prove it knows the "
                           f"step's token, so this task did not check in and started no rank. Either another "
                           f"program (perhaps another user's) holds the port on {master_addr}: run the step "
                           f"again with another MASTER_PORT exported; or the tasks of this step do not share "
                           f"a token: each derives it from the key in its home directory, so the nodes need "
                           f"the same home, or export TORCHMN_JOB_TOKEN=$(python -c 'import secrets; "
                           f"print(secrets.token_hex(32))') in the batch script, before srun.") from e
        except TokenError as e:
            raise RunError(f"the rendezvous store of Slurm task 0 at {master_addr}:{master_port} refused the "
                           f"token of task {self.step.task}: the tasks of this step do not share one. Each "
                           f"task derives it from the key in its home directory, so the nodes need the same "
                           f"home; or export TORCHMN_JOB_TOKEN=$(python -c 'import secrets; "
                           f"print(secrets.token_hex(32))') in the batch script, before srun.") from e
        except (OSError, RuntimeError) as e:
            raise RunError(f"could not reach the rendezvous store of Slurm task 0 at "
                           f"{master_addr}:{master_port} within {self.start_timeout:g} s "
                           f"({_first_line(e)}). Check that task 0 started and that the port is open "
                           f"between the nodes (set MASTER_PORT to use another), or raise --start-timeout.") from e
        return self.store

    def ranks_address(self, master_addr: str) -> str:
        """Where this node's ranks reach the store (their ``MASTER_ADDR``): task 0's address on its
        node, this node's relay (127.0.0.1) on the others. Call it after ``open_store``.

        Args:
            master_addr: where task 0 hosts the store.

        Returns:
            The address.

        Example::

            >>> tasks.ranks_address(step.master_addr)   # doctest: +SKIP
            '127.0.0.1'
        """
        return LOCAL_ADDR if self.relay is not None else master_addr

    def _listen_address(self, master_addr: str) -> str:
        """Where task 0's gate listens: ``master_addr``, unless that name is a loopback address
        here (Debian's ``127.0.1.1 node1`` line) while the other nodes are elsewhere; then the
        address this node reaches them from."""
        if self.step.tasks > 1 and network.is_loopback(master_addr):
            others = [h for h in self.step.hosts[1:] if not network.is_loopback(h)]
            routed = network.route_address(others[0]) if others else None
            if routed and not network.is_loopback(routed):
                return routed
        return master_addr

    def check_in(self, interrupted: Callable[[], None] = lambda: None) -> None:
        """Publish this task's -np and wait for every other task's; they must all agree.

        Call it after ``open_store``.

        Args:
            interrupted: called again and again while waiting; it raises to stop the wait (the
                launcher's, when a signal came).

        Raises:
            RunError: a task did not check in within the start timeout, the store was lost, or
                the tasks disagree on -np.

        Example::

            >>> tasks.open_store(step.master_addr, step.master_port, "MASTER_PORT")   # doctest: +SKIP
            >>> tasks.check_in()   # doctest: +SKIP
        """
        step = self.step
        keys = [f"{SLURM_KEY}np/{task}" for task in range(step.tasks)]
        try:
            self.store.set(keys[step.task], str(self.np))
            # Polled, not store.wait(): a signal (scancel's SIGTERM) is handled between two looks,
            # while torch's wait would hold it for the whole start timeout.
            deadline = time.monotonic() + self.start_timeout
            while not self.store.check(keys) and time.monotonic() < deadline:
                interrupted()
                time.sleep(0.1)
            missing = self._missing(keys)
            if missing:
                raise RunError(f"Slurm task(s) {', '.join(map(str, missing))} did not start torchmn run "
                               f"within {self.start_timeout:g} s (--start-timeout); every task of the step "
                               f"must run it.")
            counts = [int(self.store.get(key)) for key in keys]
        except RuntimeError as e:
            raise RunError(f"lost the rendezvous store of Slurm task 0 while checking in ({_first_line(e)}).") from e
        if len(set(counts)) > 1:
            told = ", ".join(f"task {t} ({step.hosts[t]}) -np {n}" for t, n in enumerate(counts))
            raise RunError(f"the Slurm tasks disagree on the number of ranks per node: {told}. "
                           f"Every task must run the same `torchmn run -np N`.")

    def _missing(self, keys: Sequence[str]) -> List[int]:
        try:
            return [i for i, key in enumerate(keys) if not self.store.check([key])]
        except RuntimeError:
            return []

    def reported_failure(self) -> Optional[str]:
        """What a task's launcher reported as the job's first failed rank.

        Returns:
            The report (``report_failure``'s description), or None when there is none (or the
            store is gone).

        Example::

            >>> tasks.reported_failure()   # doctest: +SKIP
            'rank 5 (host n2) failed with exit code 1'
        """
        try:
            if self.store.check([SLURM_KEY + "failed"]):
                return self.store.get(SLURM_KEY + "failed").decode()
        except RuntimeError:
            pass  # task 0 ended; how its ranks ended shows in ours
        return None

    def report_failure(self, description: str) -> None:
        """Report this node's first failed rank to the other tasks' launchers, which stop theirs;
        unless another task reported one first, which is then kept in ``reported``.

        A store that is gone is ignored: the other tasks then see their ranks fail on their own.

        Args:
            description: the failed rank, its host and how it ended.

        Example::

            >>> tasks.report_failure("rank 5 (host n2) failed with exit code 1")   # doctest: +SKIP
        """
        self.reported = self.reported_failure()
        if self.reported is None:
            try:
                self.store.set(SLURM_KEY + "failed", description)
            except RuntimeError:
                pass

    def end_task(self, wait_for_others: bool) -> None:
        """Say this task is done. Task 0 keeps the store up until every task is (the other nodes'
        ranks may still use it while they shut down), for at most ``SLURM_DONE_WAIT`` seconds.

        A store that is gone is ignored, and so is a wait that times out.

        Args:
            wait_for_others: task 0 waits (not when the launcher was signalled to stop).

        Example::

            >>> tasks.end_task(wait_for_others=True)   # doctest: +SKIP
        """
        keys = [f"{SLURM_KEY}done/{task}" for task in range(self.step.tasks)]
        try:
            self.store.set(keys[self.step.task], "1")
            if self.step.task == 0 and wait_for_others:
                self.store.wait(keys, datetime.timedelta(seconds=SLURM_DONE_WAIT))
        except RuntimeError:
            pass

    def close(self) -> None:
        """Let go of the store: drop this object's reference to it (the last one shuts task 0's
        server down), close task 0's gate, and close this node's relay on the other tasks.

        Safe to call more than once.

        Example::

            >>> tasks.end_task(wait_for_others=True); tasks.close()   # doctest: +SKIP
        """
        self.store = None
        if self.hosted is not None:
            self.hosted.close()
            self.hosted = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
