"""Finding a job's processes on this machine: its ranks, each rank's DataLoader workers, and what
each rank's environment says about threads.

A rank is the topmost process of a tree that carries a rank variable (``TORCHMN_RANK``, torchrun's
``RANK``, Open MPI's, MPICH's or Slurm's: the first of these any process of the tree carries, so a
launcher that merely inherited ``SLURM_PROCID`` from its allocation is not taken for a rank); its
descendants are its workers, except torchmn's own
helpers (the watcher and the guardian, started with ``-c`` and a ``torchmn.`` module). A process
tree without any rank variable is one rank (a script run with plain ``python``).
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Iterable, Optional

import psutil

from torchmn import resources
from torchmn.errors import TorchmnError

RANK_VARIABLES = ("TORCHMN_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
# What the doctor shows of each rank's environment: the thread settings every library reads.
# TORCHMN_THREAD_VARIABLES names those torchmn run set (the others are the user's).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCHMN_NUM_THREADS",
                    "SLURM_CPUS_PER_TASK", "TORCHMN_THREAD_VARIABLES")
JOB_VARIABLES = ("TORCHMN_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
# What Slurm allocated, for the CPUs the rank may use (torchmn.resources.cpu_limits reads them).
SLURM_VARIABLES = ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE", "SLURM_STEP_ID")


class ProcessGone(TorchmnError, LookupError):
    """The process asked for has ended (or never was)."""


@dataclasses.dataclass
class RankProcess:
    """One rank of the job, as the doctor sees it.

    Attributes:
        pid: the rank's process.
        rank: its rank, or None where no rank variable is set (a plain script).
        host: the machine (this one).
        settings: its thread variables (:data:`THREAD_VARIABLES`) that are set.
        workers: its descendant processes other than torchmn's helpers (DataLoader workers).
        slurm: its Slurm allocation variables that are set (:data:`SLURM_VARIABLES`).
        environment_read: whether its environment could be read (not another user's process):
            where not, ``settings`` and ``slurm`` are unknown rather than empty.
    """

    pid: int
    rank: Optional[int]
    host: str
    settings: dict
    workers: list
    slurm: dict = dataclasses.field(default_factory=dict)
    environment_read: bool = True


def _environ(proc: psutil.Process) -> Optional[dict]:
    """The process's environment: None where this user may not read it (another user's process),
    empty where the process is gone."""
    try:
        return proc.environ()
    except psutil.AccessDenied:
        return None
    except (psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return {}


def _rank_of(env: dict, names: Iterable[str] = RANK_VARIABLES) -> Optional[int]:
    for name in names:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return None


def _rank_variable(envs: Iterable[dict]) -> Optional[str]:
    """The rank variable that numbers a tree's ranks: the first of :data:`RANK_VARIABLES` any of
    its processes carries. (In a Slurm allocation every process has ``SLURM_PROCID``, the launcher
    too; torchmn run's or torchrun's ranks alone have theirs.)"""
    envs = list(envs)
    return next((name for name in RANK_VARIABLES if any(_rank_of(env, (name,)) is not None for env in envs)), None)


def _is_helper(proc: psutil.Process) -> bool:
    """torchmn's watcher or guardian (not a worker of the script)."""
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return True
    return "-c" in cmdline and any("torchmn." in part for part in cmdline)


def ranks_in_trees(roots: Iterable[psutil.Process]) -> list:
    """The ranks of the process trees under ``roots`` (each root included).

    Args:
        roots: the processes whose trees hold the job.

    Returns:
        The :class:`RankProcess` objects, in rank order; one rank without a number where no process of a
        tree has a rank variable.

    Example::

        >>> [r.rank for r in ranks_in_trees([psutil.Process(launcher_pid)])]
        [0, 1]
    """
    host = socket.gethostname()
    ranks = []
    for root in roots:
        try:
            tree = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        envs = {p.pid: _environ(p) for p in tree}
        hidden = {pid for pid, env in envs.items() if env is None}
        envs = {pid: env or {} for pid, env in envs.items()}
        variable = _rank_variable(envs.values())
        names = (variable,) if variable is not None else ()
        numbered = {p.pid for p in tree if _rank_of(envs[p.pid], names) is not None}
        if not numbered:
            numbered = {root.pid}
        tops = [p for p in tree if p.pid in numbered and not _has_ancestor_in(p, numbered, root.pid)]
        for top in tops:
            try:
                below = top.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            env = envs.get(top.pid, {})
            ranks.append(RankProcess(pid=top.pid, rank=_rank_of(env, names), host=host,
                              settings={k: env[k] for k in THREAD_VARIABLES if k in env},
                              workers=[p.pid for p in below if not _is_helper(p)],
                              slurm={k: env[k] for k in SLURM_VARIABLES if k in env},
                              environment_read=top.pid not in hidden))
    ranks.sort(key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.pid))
    return ranks


def _has_ancestor_in(proc: psutil.Process, pids: set, stop: int) -> bool:
    try:
        for parent in proc.parents():
            if parent.pid in pids:
                return True
            if parent.pid == stop:
                return False
    except psutil.NoSuchProcess:
        pass
    return False


def process_tree(pid: int) -> psutil.Process:
    """The process ``pid``, for :func:`ranks_in_trees`.

    Args:
        pid: the process id of the job's launcher, or of a rank started on its own.

    Returns:
        The ``psutil.Process`` of ``pid``.

    Raises:
        ProcessGone: it has ended (a zombie counts as ended), or never existed.

    Example::

        >>> ranks_in_trees([process_tree(12345)])
    """
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise psutil.NoSuchProcess(pid)
        return proc
    except psutil.NoSuchProcess:
        raise ProcessGone(f"process {pid} has ended (or never existed): nothing to inspect") from None


def job_roots(job_id: str) -> list:
    """The topmost processes on this machine whose environment names job ``job_id``
    (``TORCHMN_JOB_ID``, Slurm's ``SLURM_JOB_ID``, or torchrun's ``TORCHELASTIC_RUN_ID``).

    Only the environments this user may read are looked at (usually their own processes').

    Args:
        job_id: the job's id, as one of those variables holds it.

    Returns:
        The ``psutil.Process`` of each process of the job none of whose ancestors is of the job
        too, for :func:`ranks_in_trees`.

    Raises:
        ProcessGone: no process of this job runs here.

    Example::

        >>> ranks_in_trees(job_roots(os.environ["SLURM_JOB_ID"]))
    """
    found = {}
    for proc in psutil.process_iter():
        env = _environ(proc) or {}
        if any(env.get(name) == job_id for name in JOB_VARIABLES):
            found[proc.pid] = proc
    roots = [p for p in found.values() if not any(a.pid in found for a in _parents(p))]
    if not roots:
        raise ProcessGone(f"no process of job {job_id} runs on this machine (looked for "
                          f"{', '.join(JOB_VARIABLES)}={job_id} in every process's environment)")
    return roots


def _parents(proc: psutil.Process) -> list:
    try:
        return proc.parents()
    except psutil.NoSuchProcess:
        return []


def job_cpu_limits(ranks: list) -> dict:
    """What limits the CPUs the ranks of this machine may use together, each as a CPU count.

    Every rank is read, not the first alone: ranks bound to cores of their own (``torchmn run
    --bind core``, Open MPI's binding) or srun tasks with ``--cpus-per-task`` have CPUs of their
    own, which add up; a cgroup quota is read from each rank's own cgroup, not the doctor's.

    Args:
        ranks: the :class:`RankProcess` objects of this machine.

    Returns:
        ``{"affinity": the CPUs in the union of the ranks' affinities, "cgroup": the quotas of the
        ranks' cgroups, added up (None where one has none), "slurm": the srun tasks' own CPUs added
        up, or the allocation they share (None where Slurm set none)}``, as
        ``torchmn.resources.cpu_limits`` gives for one process.

    Example::

        >>> job_cpu_limits(ranks_in_trees([psutil.Process()]))["affinity"] >= 1
        True
    """
    cpus, quotas, own, shared = set(), {}, 0, None
    for r in ranks:
        try:
            cpus.update(psutil.Process(r.pid).cpu_affinity())
            with open(f"/proc/{r.pid}/cgroup") as f:
                where = f.read()
        except (psutil.Error, AttributeError, OSError):
            continue
        if where not in quotas:
            quotas[where] = resources.cgroup_cpu_limit(proc_cgroup=f"/proc/{r.pid}/cgroup")
        slurm = resources.slurm_cpus(r.slurm)
        if slurm is not None and resources.ranks_sharing_cpus(len(ranks), r.slurm) == 1:
            own += slurm
        elif slurm is not None:
            shared = max(shared or 0, slurm)
    cgroup = None if not quotas or None in quotas.values() else sum(quotas.values())
    return {"affinity": len(cpus) or resources.affinity_cpu_count(), "cgroup": cgroup,
            "slurm": (own + (shared or 0)) or None}
