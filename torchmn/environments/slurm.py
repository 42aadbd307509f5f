"""Tasks started by Slurm's ``srun``: its ``SLURM_*`` variables, step ids and derived ports.

Standard library only: ``torchmn.resources`` imports ``slurm_step_id`` from here, and the remote
watcher loads ``resources`` without torch.
"""
from __future__ import annotations

from typing import Mapping, Optional

from torchmn.environments.base import Environment, LaunchEnvironment
from torchmn.environments.variables import (
    DEFAULT_PORT,
    PORT_BASE,
    PORT_SPAN,
    check_place,
    first_present,
    master_addr,
    master_port,
    read_int,
)
from torchmn.environments.hostlist import expand_hostlist
from torchmn.errors import TorchmnRuntimeError, TorchmnValueError

# Slurm gives its special steps ids near 2**32: batch 0xfffffffb (0xfffffffe before 20.11), extern
# 0xfffffffc (0xffffffff before), interactive 0xfffffffa. None of these is a task started by srun.
_SLURM_SPECIAL_STEP_MIN = 0xFFFFFFF0


def slurm_step_id(env: Mapping[str, str]) -> Optional[int]:
    """This task's srun step id, or None outside an srun step (batch script, salloc shell, extern).

    Args:
        env: the environment (``SLURM_STEP_ID``, else ``SLURM_STEPID``).

    Returns:
        The step id, or None for no step or one of Slurm's special steps.

    Example::

        >>> slurm_step_id({"SLURM_STEP_ID": "0"}), slurm_step_id({"SLURM_STEP_ID": "4294967291"})
        (0, None)
    """
    value = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if value is None:
        return None
    try:
        step = int(value)
    except ValueError:
        # e.g. "batch" or "extern" as some tools print it: not a task that srun started.
        return None
    if step < 0 or step >= _SLURM_SPECIAL_STEP_MIN:
        return None
    return step


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port for a Slurm step: ``20000 + (job_id * 97 + step_id) % 12000``.

    Every task of a step computes the same number without talking to the others. 97 is prime to
    12000, so steps 0-96 of one job never share a port, and neighbouring job ids land 97 apart.

    Args:
        job_id: ``SLURM_JOB_ID``.
        step_id: the step id (see ``slurm_step_id``).

    Returns:
        A port in 20000-31999.

    Example::

        >>> slurm_port(1234, 0)
        31698
    """
    return PORT_BASE + (job_id * 97 + step_id) % PORT_SPAN


def slurm_misuse_error(env: Mapping[str, str]) -> Optional[str]:
    """A message when this process runs inside a multi-task Slurm allocation without srun.

    A batch script (or a shell from salloc) sees ``SLURM_JOB_ID`` and ``SLURM_NTASKS`` but has no
    step id of its own, or a special one; running ``python train.py`` there starts one process, not
    N ranks.

    Args:
        env: the environment.

    Returns:
        The message, or None when this does not apply.

    Example::

        >>> slurm_misuse_error({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})[:40]
        'this script runs in a Slurm allocation o'
    """
    if not (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")) or slurm_step_id(env) is not None:
        return None
    allocated = _allocated_tasks_or_nodes(env)
    if allocated is None or allocated[0] <= 1:
        return None
    return (f"this script runs in a Slurm allocation of {allocated[0]} {allocated[1]} but was not started by srun; "
            f"launch it with `srun python ...` (one task per rank), or with one `torchmn run` per node: "
            f"`srun --ntasks-per-node 1 torchmn run -np RANKS_PER_NODE python ...`")


def _allocated_tasks_or_nodes(env: Mapping[str, str]) -> Optional[tuple[int, str]]:
    """``(count, "tasks")`` from SLURM_NTASKS; where a job asked for no task count (``sbatch -N 2``
    without -n leaves SLURM_NTASKS unset), ``(count, "nodes")`` from SLURM_TASKS_PER_NODE's entries.
    Not that variable's sum: without -n Slurm fills it with CPUs per node (``sbatch -N 1
    --exclusive`` gives 4 on 4 cores), and one process on one node is a world of one."""
    try:
        return int(env.get("SLURM_NTASKS", "")), "tasks"
    except ValueError:
        pass
    value = env.get("SLURM_TASKS_PER_NODE")
    if not value:
        return None
    try:
        return len(_expand_tasks_per_node("SLURM_TASKS_PER_NODE", value, "")), "nodes"
    except ValueError:
        return None


class SlurmEnvironment(Environment):
    """A task started by ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
    ``SLURM_NODEID``, tasks per node, ``SLURM_STEP_NODELIST``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID``.

    Detected only with ``SLURM_PROCID`` and a real step id (``SLURM_STEP_ID``/``SLURM_STEPID``):
    a batch script also has ``SLURM_PROCID`` but no step of its own (see ``slurm_misuse_error``).
    Checked after MPI: see ``OpenMPIEnvironment``.

    ``local_size`` is this node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (else
    ``SLURM_TASKS_PER_NODE``; srun sets both to the step's layout, e.g. ``2(x2),1``), at this node's
    place in the step's node list (``SLURMD_NODENAME``; else ``SLURM_NODEID``, which in a
    heterogeneous step follows the components instead); else ``SLURM_NTASKS_PER_NODE``.
    ``master_addr`` is the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, else
    ``SLURM_NODELIST``), where task 0 runs with the block and cyclic distributions, or of the first
    component of a heterogeneous step; ``--distribution=arbitrary`` needs ``MASTER_ADDR``. The port is
    ``slurm_port(job id, step id)``.

    Example::

        >>> SlurmEnvironment.read({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
        ...                        "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "0",
        ...                        "SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "n[1-2]"}).master_port
        24074
    """

    source = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether ``srun`` started this process as a task of a step; see ``Environment.detect``.

        Args:
            env: the environment.

        Returns:
            True with ``SLURM_PROCID`` and the step id of a real step (``slurm_step_id`` not None);
            False in a batch script, which has ``SLURM_PROCID`` but no step of its own.

        Example::

            >>> SlurmEnvironment.detect({"SLURM_PROCID": "0", "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"})
            True
            >>> SlurmEnvironment.detect({"SLURM_PROCID": "0", "SLURM_JOB_ID": "42"})
            False
        """
        return "SLURM_PROCID" in env and slurm_step_id(env) is not None

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This task's place, from srun's variables; see ``Environment.read`` and the class's
        description of where each value comes from.

        Args:
            env: the environment.

        Returns:
            The place, with ``source`` ``"slurm"`` and ``node_rank`` ``SLURM_NODEID``; the port is
            ``MASTER_PORT``, else ``slurm_port(job id, step id)``, else 29500 without a job id.

        Raises:
            ValueError: a variable is missing or not an integer, the node list or tasks-per-node
                list does not parse, this node has no entry in the tasks-per-node list, the values
                do not fit together, or ``MASTER_PORT`` is not a port number.
            RuntimeError: ``--distribution=arbitrary`` without ``MASTER_ADDR``, or no node list and
                no ``MASTER_ADDR`` for ranks on several nodes.

        Example::

            >>> SlurmEnvironment.read({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
            ...                        "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_ID": "0",
            ...                        "SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "n[1-2]"}).describe()
            'slurm: rank 2/4, local 0/2, node 1, rendezvous n1:24074'
        """
        fix = "srun sets it for every task; launch with `srun` rather than setting SLURM_* by hand"
        rank = read_int(env, "SLURM_PROCID", fix)
        size_name = first_present(env, ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"))
        size = read_int(env, size_name, fix)
        local_rank = read_int(env, "SLURM_LOCALID", fix)
        node_rank = read_int(env, "SLURM_NODEID", fix)
        nodelist_name = first_present(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        hosts = _slurm_hosts(env, nodelist_name)
        local_size, local_size_name = _slurm_local_size(env, _slurm_node_index(env, hosts, node_rank), size, fix)
        check_place(env, ("SLURM_PROCID", rank), (size_name, size), ("SLURM_LOCALID", local_rank),
                    (local_size_name, local_size), fix)
        addr = master_addr(env, _slurm_rank0_host(env, hosts), size, local_size, cls.source,
                           "srun normally sets SLURM_STEP_NODELIST")
        return LaunchEnvironment(rank, size, local_rank, local_size, node_rank, addr,
                                 master_port(env, _slurm_derived_port(env, fix)), cls.source)

    @classmethod
    def job_label(cls, env: Mapping[str, str]) -> Optional[str]:
        """Words naming this step, for messages.

        Args:
            env: the environment.

        Returns:
            ``Slurm job 42 step 3`` and the like (step 0 where no step id is set), or None without
            a job id.

        Example::

            >>> SlurmEnvironment.job_label({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"})
            'Slurm job 42 step 3'
        """
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        return f"Slurm job {job} step {slurm_step_id(env) or 0}" if job else None


def _slurm_hosts(env: Mapping[str, str], name: str) -> Optional[list]:
    if name not in env:
        return None
    try:
        return expand_hostlist(env[name])
    except ValueError as error:
        raise TorchmnValueError(f"{name}={env[name]!r} cannot be read: {error}; set MASTER_ADDR to the first "
                                f"node's name to bypass it") from error


def _slurm_node_index(env: Mapping[str, str], hosts: Optional[list], node_rank: int) -> int:
    """This node's place in the step's node list, which the tasks-per-node counts follow. That is
    SLURM_NODEID, except in a heterogeneous step, whose node ids follow its components instead."""
    name = env.get("SLURMD_NODENAME")
    if hosts and name in hosts:
        return hosts.index(name)
    return node_rank


def _slurm_rank0_host(env: Mapping[str, str], hosts: Optional[list]) -> Optional[str]:
    """Where task 0 runs: the first node of the step (block and cyclic distributions), or of the
    first component of a heterogeneous step; unknown for ``--distribution=arbitrary``."""
    if env.get("SLURM_DISTRIBUTION", "").startswith("arbitrary") and not env.get("MASTER_ADDR"):
        raise TorchmnRuntimeError("srun --distribution=arbitrary (SLURM_HOSTFILE) places task 0 on a node Slurm's "
                                  "variables do not tell; export MASTER_ADDR as the name of the node where task 0 "
                                  "runs (the first line of the hostfile)")
    for name in ("SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_JOB_NODELIST_PACK_GROUP_0"):
        if env.get("SLURM_HET_SIZE") and env.get(name):
            first = _slurm_hosts(env, name)[0]
            # A step of a later component alone (srun --het-group=1) does not run on component 0.
            if not hosts or first in hosts:
                return first
    return hosts[0] if hosts else None


def _slurm_local_size(env: Mapping[str, str], node_rank: int, size: int, fix: str) -> tuple:
    """(tasks on this node, variable it came from)."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = _expand_tasks_per_node(name, env[name], fix)
            if node_rank >= len(counts):
                where = (f"SLURMD_NODENAME={env['SLURMD_NODENAME']!r}, node {node_rank} of the node list,"
                         if node_rank != int(env["SLURM_NODEID"]) else f"SLURM_NODEID={env['SLURM_NODEID']!r}")
                raise TorchmnValueError(f"{where} has no entry in {name}={env[name]!r} ({len(counts)} nodes); {fix}")
            return counts[node_rank], name
    if env.get("SLURM_NTASKS_PER_NODE"):
        return read_int(env, "SLURM_NTASKS_PER_NODE", fix), "SLURM_NTASKS_PER_NODE"
    if size == 1:
        return 1, "SLURM_NTASKS"
    raise TorchmnValueError(f"SLURM_TASKS_PER_NODE is not set, so the number of tasks on this node is unknown; {fix}")


def _expand_tasks_per_node(name: str, value: str, fix: str) -> list:
    """Slurm's compact per-node counts: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        count_text, _, repeat_text = part.strip().partition("(x")
        try:
            count = int(count_text)
            repeat = int(repeat_text[:-1]) if repeat_text else 1
            if repeat_text and not repeat_text.endswith(")"):
                raise TorchmnValueError(part)
        except ValueError:
            raise TorchmnValueError(f"{name}={value!r} is not a tasks-per-node list like '2(x3),1'; {fix}") from None
        if count < 1 or repeat < 1:
            raise TorchmnValueError(f"{name}={value!r} has a count below 1; {fix}")
        counts.extend([count] * repeat)
    return counts


def _slurm_derived_port(env: Mapping[str, str], fix: str) -> int:
    job_name = first_present(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if not env.get(job_name):
        return DEFAULT_PORT
    job_id = read_int(env, job_name, fix)
    step_id = slurm_step_id(env) or 0
    return slurm_port(job_id, step_id)
