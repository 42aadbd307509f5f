"""Planning a job: ranks onto the hosts' slots, and the variables each rank starts with.

Also the check that ``torchmn run`` is not one of several copies another launcher started.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Dict, List, Mapping, Sequence, Tuple, Union

from torchmn import network, resources
from torchmn.environments import EnvMethodEnvironment, SlurmEnvironment, base
from torchmn.environments.detect import launcher_class
from torchmn.run.config import RunError
from torchmn.run.processes import binding
from torchmn.run.remote.protocol import EXPORTS_ON_STDIN
from torchmn.run.remote.ssh import command_line_env, split_exports

# Set in every local rank's environment, and so in every process it starts: which job they belong to.
JOB_ID = "TORCHMN_JOB_ID"


@dataclasses.dataclass(frozen=True)
class Slot:
    """One rank's place in the job.

    Attributes:
        rank, size: the rank and the number of ranks.
        local_rank, local_size: the same among the ranks of its host.
        node_rank, node_count: its host's index, and the number of hosts.
        host: the host it runs on.
        cross_rank, cross_size: Horovod's: its host's index among the hosts that run a rank of
            its local rank, and their number (``node_rank`` and ``node_count`` where every host
            runs as many ranks).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    node_count: int
    host: str
    cross_rank: int
    cross_size: int


def cross_place(ranks_per_host: Sequence[int], node_rank: int, local_rank: int) -> Tuple[int, int]:
    """Horovod's cross rank and size of local rank ``local_rank`` on host ``node_rank``: hosts hold
    local ranks 0 up, so the hosts with more than ``local_rank`` ranks are those that hold it.

    Args:
        ranks_per_host: how many ranks each host runs, in host order.
        node_rank: the host's index.
        local_rank: the rank's index on its host.

    Returns:
        (the host's index among those hosts, their number).

    Example::

        >>> cross_place([2, 1, 2], 2, 1)    # local rank 1 lives on hosts 0 and 2
        (1, 2)
    """
    holders = [i for i, count in enumerate(ranks_per_host) if count > local_rank]
    return holders.index(node_rank), len(holders)


def plan_slots(hosts: Sequence[Tuple[str, int]]) -> List[Slot]:
    """Number ranks host by host: the first host's slots get ranks 0..k-1, and so on.

    Args:
        hosts: (host, ranks on it) pairs, in order.

    Returns:
        One ``Slot`` per rank, in rank order.

    Example::

        >>> [(s.rank, s.local_rank, s.node_rank) for s in plan_slots([("a", 2), ("b", 1)])]
        [(0, 0, 0), (1, 1, 0), (2, 0, 1)]
    """
    size = sum(count for _, count in hosts)
    counts = [count for _, count in hosts]
    slots: List[Slot] = []
    for node_rank, (host, count) in enumerate(hosts):
        for local_rank in range(count):
            slots.append(Slot(len(slots), size, local_rank, count, node_rank, len(hosts), host,
                              *cross_place(counts, node_rank, local_rank)))
    return slots


def place_env(slot: Slot) -> Dict[str, str]:
    """The variables that tell one rank its place among the ranks: torchmn's names, torchrun's and
    horovodrun's (``HOROVOD_RANK``..., which Horovod scripts read before ``hvd.init()``, e.g. to
    choose a GPU; ``HOROVOD_CROSS_RANK``/``_SIZE`` as horovodrun sets them, among the hosts that run a
    rank of this local rank). An
    elastic job's ranks take new ones at each reset.

    Args:
        slot: the rank's place.

    Returns:
        The variables.

    Example::

        >>> place_env(plan_slots([("h", 2)])[1])["LOCAL_RANK"]
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
        "HOROVOD_HOSTNAME": slot.host,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


def rank_env(slot: Slot, master_addr: str, master_port: Union[int, str]) -> Dict[str, str]:
    """The variables that tell one rank its place (``place_env``) and where the rendezvous is.

    Args:
        slot: the rank's place.
        master_addr, master_port: where the rendezvous store listens (``torchmn run --dry-run``
            passes placeholders for what only the start tells).

    Returns:
        The variables.

    Example::

        >>> rank_env(plan_slots([("h", 2)])[1], "127.0.0.1", 29500)["RANK"]
        '1'
    """
    return {
        **place_env(slot),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        # The launcher hosts the store; with this, torch's env:// rendezvous makes every rank,
        # rank 0 included, a client of it instead of rank 0 binding MASTER_PORT itself.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def local_env(slot: Slot, base_env: Mapping[str, str], exports: Mapping[str, str], master_addr: str,
              master_port: Union[int, str], job_id: str, several_hosts: bool,
              one_machine: bool = False, bind: str = binding.DEFAULT_MODE) -> Dict[str, str]:
    """The whole environment of a rank on this machine.

    Args:
        slot: the rank's place.
        base_env: the launcher's environment.
        exports: the ``-x`` variables.
        master_addr, master_port: where the rendezvous store listens.
        job_id: the value of ``JOB_ID``, by which teardown finds what the rank started.
        several_hosts: other hosts take part, so gloo is told which interface reaches them.
        one_machine: every rank of the job runs on this machine, so gloo and NCCL's sockets listen
            on loopback only, where nothing on the network reaches them.
        bind: how ranks are bound to CPUs (``--bind``; see ``binding``), in ``TORCHMN_BIND``.

    Returns:
        The environment, for ``subprocess.Popen``: ``base_env`` (less the thread settings a budget
        made in it, ``resources.exported_env``), then the exports, the thread
        budget's variables (``resources.launcher_thread_env``, the rank's share of the CPUs it is
        bound to where it is bound), the rank's place (``rank_env``), ``TORCHMN_BIND``,
        ``PYTHONUNBUFFERED=1`` and ``JOB_ID``, each overriding the ones before; with several
        hosts, also ``GLOO_SOCKET_IFNAME`` (the interface that holds ``master_addr``, where one
        does) unless already set; on one machine, ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``
        the loopback interface unless already set.

    Raises:
        ValueError: ``TORCHMN_NUM_THREADS`` is set but is not a positive integer, or ``--bind core``
            with more ranks than this machine's cores.

    Example::

        >>> env = local_env(plan_slots([("localhost", 2)])[1], {"PATH": "/usr/bin"}, {"NCCL_DEBUG": "INFO"},
        ...                 "127.0.0.1", 29500, "job-1", several_hosts=False)
        >>> env["RANK"], env["LOCAL_WORLD_SIZE"], env["NCCL_DEBUG"], env["TORCHMN_JOB_ID"]
        ('1', '2', 'INFO', 'job-1')
    """
    env = resources.exported_env(base_env, exports)
    bound = binding.for_rank({binding.VARIABLE: bind, "TORCHMN_LOCAL_RANK": str(slot.local_rank),
                              "TORCHMN_LOCAL_SIZE": str(slot.local_size)})
    env.update(resources.launcher_thread_env(slot.local_size, env,
                                             None if bound is None else (len(bound.cpus), bound.sharing)))
    env.update(rank_env(slot, master_addr, master_port))
    env[binding.VARIABLE] = bind
    env["PYTHONUNBUFFERED"] = "1"
    env[JOB_ID] = job_id
    if several_hosts and "GLOO_SOCKET_IFNAME" not in env:
        # gloo would otherwise pick the address of this machine's hostname, often 127.0.1.1.
        interface = network.interface_of(master_addr)
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
    elif one_machine:
        env.update(network.loopback_sockets(env))
    return env


def remote_env(slot: Slot, base_env: Mapping[str, str], exports: Mapping[str, str], master_addr: str,
               master_port: Union[int, str], bind: str = binding.DEFAULT_MODE) -> Dict[str, str]:
    """What a remote rank's ssh command line sets: the forwarded variables and its place. The
    watcher adds the thread budget and gloo's interface on the host itself, and the ``-x``
    variables but ``STARTUP_NAMES``, which the launcher sends on its stdin
    (``EXPORTS_ON_STDIN`` says they follow).

    Args:
        slot: the rank's place.
        base_env: the launcher's environment.
        exports: the ``-x`` variables.
        master_addr, master_port: where the rendezvous store listens.
        bind: how ranks are bound to CPUs there (``--bind``): the watcher binds the rank.

    Returns:
        The variables, for ``torchmn.run.remote.ssh.rank_command``: those ``command_line_env``
        gives, the rank's place (``rank_env``), ``TORCHMN_BIND`` and ``PYTHONUNBUFFERED=1``.

    Example::

        >>> env = remote_env(plan_slots([("node1", 2), ("node2", 2)])[2], {"PATH": "/usr/bin", "HOME": "/root"},
        ...                  {"WANDB_API_KEY": "k"}, "10.0.0.1", 29500)
        >>> env["RANK"], env["GROUP_RANK"], env["MASTER_ADDR"], "HOME" in env, "WANDB_API_KEY" in env
        ('2', '1', '10.0.0.1', False, False)
    """
    # The thread settings a budget made in the launcher's own environment are not forwarded: the
    # watcher there computes the remote ranks' budget.
    env = command_line_env(resources.exported_env(base_env, {}), exports)
    if split_exports(exports)[1]:
        env[EXPORTS_ON_STDIN] = "1"
    env.update(rank_env(slot, master_addr, master_port))
    env[binding.VARIABLE] = bind
    env["PYTHONUNBUFFERED"] = "1"
    return env


def refuse_outer_launcher(env: Mapping[str, str]) -> None:
    """Refuse to be one of several copies that mpirun or torchrun started: each copy would start a
    job of its own, with its own rendezvous, and they would train apart without a word.

    Copies started by srun are handled by ``torchmn.run.slurm_step``; hand-set ``RANK`` and
    ``WORLD_SIZE`` only bring a warning on stderr, since they may be a batch script's own. Variables
    that cannot be read bring nothing: they are left to the job itself.

    Args:
        env: the launcher's environment.

    Raises:
        RunError: torchrun, Open MPI's mpirun, MPICH's mpiexec or another ``torchmn run`` started
            this process as one of more than one.

    Example::

        >>> refuse_outer_launcher({})              # no other launcher
        >>> refuse_outer_launcher({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
        ...                        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
        Traceback (most recent call last):
        torchmn.run.config.RunError: torchmn run was started as one of 2 openmpi processes, ...
    """
    kind = launcher_class(env)
    if kind in (None, SlurmEnvironment):
        return
    try:
        size = kind.read(env).size
    except (ValueError, RuntimeError):
        return
    if size > 1 and kind is EnvMethodEnvironment:
        # Hand-set variables may be a batch script's own, or a scheduler's that started a copy of
        # this command on each host (Kubeflow's PyTorchJob): say so, without refusing the first.
        sys.stderr.write(f"torchmn run: warning: RANK={env.get('RANK')} and WORLD_SIZE={env.get('WORLD_SIZE')} are "
                         f"set; if a scheduler started this command on several hosts, each copy runs a job of its "
                         f"own (use one torchmn run with -H/--hostfile, or torchrun). Ignore this if the variables "
                         f"are your script's.\n")
    elif size > 1:
        command = {"openmpi": "mpirun", "mpich": "mpiexec", "torchmn": "torchmn run"}.get(kind.source, kind.source)
        raise RunError(f"torchmn run was started as one of {size} {kind.source} processes, so each would start a "
                       f"job of its own. Start the ranks with one launcher: `{command} ... python train.py` "
                       f"alone, or one `torchmn run -np N` (with -H/--hostfile for several hosts).")
