"""``torchmn run`` as one launcher per node: one job across the nodes.

Each node's launcher starts that node's ranks; node ``t``'s are ranks ``t*np .. t*np+np-1``.
Node 0's launcher hosts the store on the first node, and the launchers talk through it
(``NodeLaunchers``): they check in, report the first failed rank so that every node stops its
own, and wait for each other at the end. Who the nodes are comes from Slurm (``srun --ntasks-per-node
1 torchmn run``, see ``torchmn.run.slurm_step``) or from ``--nnodes`` / ``--node-rank`` and the
platforms that start one agent per node (see ``per_node_step``). The protocol is in
``docs/design/launcher.md``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import time
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from torchmn import network
from torchmn.environments.platforms import NodePlace, PlatformError, detect_platform
from torchmn.environments import variables
from torchmn.environments.variables import DEFAULT_PORT
from torchmn.run.config import LaunchConfig, RunError
from torchmn.run.plan import Slot, plan_slots
from torchmn.run.store.auth import ImpostorError, TokenError, shared_token
from torchmn.run.store.rendezvous import HostedStore, start_store
from torchmn.run.store.relay import LOCAL_ADDR, Relay

# Store keys the launchers of one job share (the ranks' own keys have no such prefix).
LAUNCHER_KEY = "torchmn/launcher/"
# How long node 0's launcher keeps the store up, after its own ranks ended, for the other nodes' ranks to
# end (torchrun's exit barrier waits as long); it says so after DONE_NOTE seconds.
DONE_WAIT = 300.0
DONE_NOTE = 10.0
# Where the job failed, the other launchers stop their ranks when told (or died with the failure).
FAILED_DONE_WAIT = 30.0


@dataclasses.dataclass(frozen=True)
class NodeStep:
    """This launcher's place among the launchers of one job, one per node.

    Attributes:
        task: this node's index (``SLURM_NODEID``, ``--node-rank``).
        tasks: the number of nodes.
        hosts: the nodes' names, in order (where unknown, placeholders such as ``node1``).
        master_addr, master_port: where node 0's launcher hosts the store.
        kind: what a node's launcher is called in messages: ``Slurm task`` or ``node``.
        token_label: what the job's token is derived from where it is not given (see
            ``torchmn.run.store.auth.shared_token``), the same on every node.
        token_fix: how to give every node the same token, for the error when they differ.
    """

    task: int
    tasks: int
    hosts: Tuple[str, ...]
    master_addr: str
    master_port: int
    kind: str = "node"
    token_label: str = ""
    token_fix: str = ""


TOKEN_FIX = ("set the same TORCHMN_JOB_TOKEN on every node (e.g. from a Kubernetes Secret, or "
             "$(python -c 'import secrets; print(secrets.token_hex(32))') passed to each), or give the nodes the "
             "same home directory, from whose key they derive it with the job's --master-addr as written (the "
             "same spelling on every node, node 0's included), --master-port and --nnodes")


def per_node_step(config: LaunchConfig, env: Mapping[str, str]) -> Optional[NodeStep]:
    """This node's place in a job of one ``torchmn run`` per node: from ``--nnodes``, ``--node-rank``,
    ``--master-addr`` and ``--master-port``, else from the variables of a platform that starts one
    agent per node (Kubeflow, SkyPilot, SageMaker: ``torchmn.environments.platforms``).

    Args:
        config: the launcher's options.
        env: the launcher's environment.

    Returns:
        The place, or None for a job on one node (or with neither the options nor a platform).

    Raises:
        RunError: the node rank is outside the node count, node 0's address is unknown on another
            node, a platform's variables are malformed, or the options come with -H/--hostfile.

    Example::

        >>> config = LaunchConfig(["python", "train.py"], np=2, nnodes=2, node_rank=1, master_addr="n0")
        >>> step = per_node_step(config, {})
        >>> step.task, step.tasks, step.master_addr, step.master_port
        (1, 2, 'n0', 29500)
    """
    if config.nnodes is not None:
        try:
            port = config.master_port or variables.master_port(env, None)
        except ValueError as e:
            raise RunError(str(e)) from e
        place = NodePlace(config.nnodes, config.node_rank or 0, config.master_addr, port,
                          names={"nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
                                 "master_port": "--master-port"})
    else:
        try:
            place = detect_platform(env)
        except PlatformError as e:
            raise RunError(str(e)) from e
        if place is None:
            return None
    if config.hosts is not None:
        raise RunError(f"-H/--hostfile and one launcher per node ({place.source}) do not go together: either one "
                       f"torchmn run starts every host's ranks over ssh, or each node runs its own")
    names = place.names
    if not 0 <= place.node_rank < place.nnodes:
        raise RunError(f"{place.source}: node rank {place.node_rank} ({names.get('node_rank')}) is outside the "
                       f"{place.nnodes} node(s) ({names.get('nnodes')}): it must be 0 to {place.nnodes - 1}")
    if place.nnodes == 1:
        return None
    master_addr = place.master_addr
    if not master_addr:
        if place.node_rank != 0:
            raise RunError(f"{place.source}: node {place.node_rank} does not know where node 0 hosts the "
                           f"rendezvous: pass --master-addr (node 0's address), the same on every node")
        master_addr = socket.getfqdn()
    master_port = config.master_port or place.master_port or DEFAULT_PORT
    hosts = tuple(master_addr if r == 0 else socket.gethostname() if r == place.node_rank else f"node{r}"
                  for r in range(place.nnodes))
    return NodeStep(place.node_rank, place.nnodes, hosts, master_addr, master_port, kind="node",
                    token_label=_token_label(master_addr, master_port, place), token_fix=TOKEN_FIX)


def _token_label(master_addr: str, master_port: int, place: NodePlace) -> str:
    # The platform's run id keeps one run's launchers apart from those of the run before (a node
    # of it still starting, say); without one, runs with the same address, port and node count
    # derive the same token (docs/launching/nodes.md says so).
    label = f"torchmn nodes {master_addr}:{master_port} x{place.nnodes}"
    return f"{label} run {place.run_id}" if place.run_id else label


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class NodeLaunchers:
    """This launcher's dealings with the other nodes' launchers of its job, through the store.

    Args:
        step: this node's place (see ``torchmn.run.slurm_step.slurm_step``, ``per_node_step``).
        np: ranks per node (``-np``), which every task must agree on.
        start_timeout: how long to wait for the other tasks (``--start-timeout``).
        env: the launcher's environment (default: ``os.environ``), for the step's token.

    Attributes:
        store: the rendezvous store, once open.
        reported: another node's failure that was reported before this node's own first failure.
        token: the job's token, the same on every node (see ``torchmn.run.store.auth.shared_token``).

    Raises:
        RunError: the step's token can be neither read nor made.
    """

    def __init__(self, step: NodeStep, np: int, start_timeout: float, env: Optional[Mapping[str, str]] = None):
        self.step = step
        self.np = np
        self.start_timeout = start_timeout
        self.store = None
        self.hosted: Optional[HostedStore] = None
        self.relay: Optional[Relay] = None
        self.reported: Optional[str] = None
        self.store_gone = False  # task 0 ended and took the store with it: no more asking it
        try:
            self.token = shared_token(os.environ if env is None else env, step.token_label)
        except TokenError as e:
            raise RunError(f"{step.kind} {step.task}: {e}") from e

    def plan(self, network_interface: Optional[str]) -> List[Slot]:
        """This node's share of the job's slots: ``np`` ranks on each of the step's nodes.

        Args:
            network_interface: ``--network-interface``, which must not be given.

        Returns:
            The slots of this task's ranks.

        Raises:
            RunError: ``--network-interface`` was given (the rendezvous is the step's first node).

        Example::

            >>> step = NodeStep(task=1, tasks=2, hosts=("n1", "n2"), master_addr="n1", master_port=24074)
            >>> [slot.rank for slot in NodeLaunchers(step, 2, 60.0, {"TORCHMN_JOB_TOKEN": "ab" * 32}).plan(None)]
            [2, 3]
        """
        if network_interface:
            raise RunError("--network-interface does not apply to one launcher per node: the rendezvous "
                           "is the first node. Set MASTER_ADDR (--master-addr) to choose its address.")
        everyone = plan_slots([(host, self.np) for host in self.step.hosts])
        return [slot for slot in everyone if slot.node_rank == self.step.task]

    def open_store(self, master_addr: str, master_port: int, port_origin: str,
                   log: Callable[[str], None], likely_pids: Callable[[], Sequence[int]] = tuple,
                   allow_unsigned: bool = False, interrupt: Callable[[], None] = lambda: None):
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
            interrupt: called while the other tasks wait for task 0's store; what it raises (the
                launcher's Ctrl-C or SIGTERM) ends the wait.

        Returns:
            Task 0: the ``HostedStore``; the other tasks: their ``TCPStore`` client, through the
            relay. Either way ``port`` is the port this node's ranks are told (see ``ranks_address``).

        Raises:
            RunError: the store cannot be started, or reached within the start timeout, or task 0
                refused this task's token.

        Example::

            >>> store = tasks.open_store(step.master_addr, step.master_port, "MASTER_PORT", print)   # doctest: +SKIP
            >>> store.port   # doctest: +SKIP
            24074
        """
        if self.step.task == 0:
            self.hosted = start_store(self._listen_address(master_addr), master_port, port_origin=port_origin,
                                      token=self.token, log=log, likely_pids=likely_pids,
                                      allow_unsigned=allow_unsigned)
            self.store = self.hosted.store
            return self.hosted
        try:
            self.relay = Relay(master_addr, master_port, self.token, self.start_timeout, log,
                               likely_pids=likely_pids, interrupt=interrupt)
            # torch only once task 0 answered: its import takes seconds on a busy machine, during
            # which a Ctrl-C or SIGTERM waits.
            from torch.distributed import TCPStore

            self.store = TCPStore(LOCAL_ADDR, self.relay.port, is_master=False,
                                  timeout=datetime.timedelta(seconds=self.start_timeout))
        except ImpostorError as e:
            kind = self.step.kind
            raise RunError(f"{kind} {self.step.task}: the process listening on {master_addr}:{master_port}, "
                           f"where {kind} 0 hosts the job's rendezvous store, did not prove it knows the "
                           f"job's token, so this {kind} did not check in and started no rank. Either another "
                           f"program (perhaps another user's) holds the port on {master_addr}: start again "
                           f"with another MASTER_PORT; or the {kind}s do not share a token: "
                           f"{self.step.token_fix}.") from e
        except TokenError as e:
            kind = self.step.kind
            raise RunError(f"the rendezvous store of {kind} 0 at {master_addr}:{master_port} refused the "
                           f"token of {kind} {self.step.task}: the {kind}s do not share one: "
                           f"{self.step.token_fix}.") from e
        except (OSError, RuntimeError) as e:
            raise RunError(f"could not reach the rendezvous store of {self.step.kind} 0 at "
                           f"{master_addr}:{master_port} within {self.start_timeout:g} s "
                           f"({_first_line(e)}). Check that {self.step.kind} 0 started and that the port is open "
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
            if not network.is_loopback(master_addr, resolve=False):
                # The other nodes are unknown here (--nnodes): a name written as loopback means one
                # machine, but one that only resolves to it here cannot be reached from elsewhere.
                sys.stderr.write(f"torchmn run: warning: {master_addr!r} is a loopback address on this node "
                                 f"({socket.gethostbyname(master_addr)}, as Debian's /etc/hosts gives a machine's "
                                 f"own name), so the rendezvous listens there and only launchers on this machine "
                                 f"reach it; on several machines pass node 0's IP address as --master-addr on "
                                 f"every node.\n")
        return master_addr

    def check_in(self, interrupted: Callable[[], None] = lambda: None) -> None:
        """Claim this node's rank, publish its -np and wait for every other node's; they must all agree.

        Call it after ``open_store``.

        Args:
            interrupted: called again and again while waiting; it raises to stop the wait (the
                launcher's, when a signal came).

        Raises:
            RunError: another launcher checked in as this node already, a node did not check in
                within the start timeout, the store was lost, or the nodes disagree on -np.

        Example::

            >>> tasks.open_store(step.master_addr, step.master_port, "MASTER_PORT", print)   # doctest: +SKIP
            >>> tasks.check_in()   # doctest: +SKIP
        """
        step = self.step
        keys = [f"{LAUNCHER_KEY}np/{task}" for task in range(step.tasks)]
        failed = LAUNCHER_KEY + "failed"
        try:
            if self.store.add(f"{LAUNCHER_KEY}claimed/{step.task}", 1) > 1:
                raise RunError(f"{step.kind} {step.task} is already taken by another launcher of this job: each "
                               f"node's launcher needs a node rank of its own (--node-rank, or the platform's "
                               f"variable), 0 to {step.tasks - 1}; this one starts no rank.")
            # -np and the node count: a launcher told another --nnodes waits for other nodes.
            self.store.set(keys[step.task], f"{self.np} {step.tasks}")
            # Polled, not store.wait(): a signal (scancel's SIGTERM) is handled between two looks,
            # while torch's wait would hold it for the whole start timeout.
            deadline = time.monotonic() + self.start_timeout
            while not self.store.check(keys) and time.monotonic() < deadline:
                if self.store.check([failed]):  # another launcher found the nodes disagree
                    raise RunError(f"{self.store.get(failed).decode()}; this {step.kind} starts no rank.")
                interrupted()
                time.sleep(0.1)
            missing = self._missing(keys)
            if missing:
                problem = (f"{step.kind}(s) {', '.join(map(str, missing))} did not start torchmn run "
                           f"within {self.start_timeout:g} s (--start-timeout); every {step.kind} of the job "
                           f"must run it")
            else:
                problem = self._disagreement([self.store.get(key).decode().split() for key in keys])
            if problem is not None:
                self.store.set(failed, f"{step.kind} {step.task}'s launcher: {problem}")  # the others stop too
                if step.task == 0:  # its store ends with it: keep it up for the others' next look
                    time.sleep(1.0)
                raise RunError(f"{problem}.")
        except RuntimeError as e:
            raise RunError(f"lost the rendezvous store of {step.kind} 0 while checking in ({_first_line(e)}).") from e

    def _disagreement(self, published: List[List[str]]) -> Optional[str]:
        """What the nodes' launchers disagree on (``[np, nodes]`` each published), or None."""
        kind = self.step.kind
        nodes = [int(p[1]) for p in published]
        if len(set(nodes)) > 1:
            told = ", ".join(f"{kind} {t}: {n}" for t, n in enumerate(nodes))
            return (f"the {kind}s' launchers disagree on the number of {kind}s ({told}); give every {kind} the same "
                    f"--nnodes")
        counts = [int(p[0]) for p in published]
        if len(set(counts)) > 1:
            told = ", ".join(f"{kind} {t} ({self.step.hosts[t]}) -np {n}" for t, n in enumerate(counts))
            return (f"the {kind}s disagree on the number of ranks per node: {told}. Every {kind} must run the "
                    f"same `torchmn run -np N`")
        return None

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
        if self.store_gone:
            return None
        try:
            if self.store.check([LAUNCHER_KEY + "failed"]):
                return self.store.get(LAUNCHER_KEY + "failed").decode()
        except RuntimeError:
            # Task 0 ended; how its ranks ended shows in ours. Asked again, the gone store would
            # make torch print a warning every time.
            self.store_gone = True
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
                self.store.set(LAUNCHER_KEY + "failed", description)
            except RuntimeError:
                pass

    def end_task(self, wait_for_others: bool, log: Callable[[str], None] = lambda line: None,
                 stop: Callable[[], bool] = lambda: False, failed: bool = False) -> None:
        """Say this task is done. Task 0 keeps the store up until every task is (the other nodes'
        ranks may still use it, train on, save, shut down), for at most ``DONE_WAIT`` seconds
        (``FAILED_DONE_WAIT`` where the job failed: the other launchers stop their ranks, or died),
        saying so where that takes more than ``DONE_NOTE``.

        A store that is gone is ignored, and so is a wait that times out.

        Args:
            wait_for_others: task 0 waits (not when the launcher was signalled to stop).
            log: where task 0 says it waits.
            stop: asked while waiting; True ends the wait (a signal came meanwhile).
            failed: the job failed.

        Example::

            >>> tasks.end_task(wait_for_others=True, log=print)   # doctest: +SKIP
        """
        if self.store_gone:
            return
        keys = [f"{LAUNCHER_KEY}done/{task}" for task in range(self.step.tasks)]
        try:
            self.store.set(keys[self.step.task], "1")
            if self.step.task != 0 or not wait_for_others:
                return
            start, told, limit = time.monotonic(), False, FAILED_DONE_WAIT if failed else DONE_WAIT
            while time.monotonic() - start < limit and not stop():
                pending = [task for task, key in enumerate(keys) if not self.store.check([key])]
                if not pending:
                    return
                if not told and time.monotonic() - start >= DONE_NOTE:
                    log(f"torchmn run: this {self.step.kind}'s ranks have ended; {self.step.kind}(s) "
                        f"{', '.join(map(str, pending))} still run theirs, which use the rendezvous store hosted "
                        f"here: waiting for them (at most {limit:g} s; Ctrl-C stops waiting)")
                    told = True
                time.sleep(0.2)
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
