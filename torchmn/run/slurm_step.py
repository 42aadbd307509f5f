"""``torchmn run`` as one task per node of a Slurm step: one job across the step's nodes.

Inside ``srun -N 2 --ntasks-per-node 1 torchmn run -np 2 ...`` (without -H/--hostfile) task ``t``
starts ranks ``t*np .. t*np+np-1``; task 0 hosts the store on the step's first node, and the
launchers talk through it (``torchmn.run.nodes.NodeLaunchers``). This module finds the step.
"""
from __future__ import annotations

from typing import List, Mapping, Optional

from torchmn.environments import SlurmEnvironment
from torchmn.environments.detect import launcher_class
from torchmn.environments.hostlist import expand_hostlist
from torchmn.run.config import RunError
from torchmn.run.nodes import NodeStep

# How the tasks of a step come to share a token, for the error when they do not.
TOKEN_FIX = ("each task derives it from the key in its home directory, so the nodes need the same home; or "
             "export TORCHMN_JOB_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))') in the "
             "batch script, before srun")


def _step_hosts(env: Mapping[str, str]) -> List[str]:
    name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
    if name is None:
        raise RunError("SLURM_STEP_NODELIST is not set, so torchmn run cannot tell the nodes of this "
                       "Slurm step; start it with srun, which sets it.")
    try:
        return expand_hostlist(env[name])
    except ValueError as e:
        raise RunError(f"{name}={env[name]!r} cannot be read: {e}.") from e


def slurm_step(env: Mapping[str, str]) -> Optional[NodeStep]:
    """The Slurm step this launcher is one task of, one per node.

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
    return NodeStep(seen.rank, seen.size, tuple(hosts), seen.master_addr, seen.master_port, kind="Slurm task",
                    token_label=f"slurm step {env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}",
                    token_fix=TOKEN_FIX)
