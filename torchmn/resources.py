"""CPU thread budget: how many threads each rank may use, so ranks do not fight over cores.

Every thread pool in a training process (torch's, OpenMP, MKL, OpenBLAS) sizes itself to the whole
machine; the budget is the CPUs this process may use divided by the ranks that share them.
``torchmn run`` puts it in each rank's environment (``launcher_thread_env``); under other launchers
the communicator applies it inside the rank (``apply_thread_budget``). A user's own
``OMP_NUM_THREADS`` always wins, ``TORCHMN_NUM_THREADS`` next. torch is imported only inside a
rank: the remote watcher loads this module without it (see ``docs/design/launcher.md``).
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Callable, Dict, Mapping, Optional, Tuple

from torchmn.environments.mpich import MPICHEnvironment
from torchmn.environments.slurm import slurm_step_id
from torchmn.errors import TorchmnValueError

TORCHMN_NUM_THREADS = "TORCHMN_NUM_THREADS"
# Settings torchmn tune (or a user) can give a job without touching the script.
TORCHMN_INTEROP_THREADS = "TORCHMN_INTEROP_THREADS"     # torch's inter-op pool, applied with the budget
TORCHMN_NUM_WORKERS = "TORCHMN_NUM_WORKERS"             # what dataloader_workers_budget() returns
TORCHMN_BUCKET_CAP_MB = "TORCHMN_BUCKET_CAP_MB"         # create_communicator's default bucket_cap_mb
TORCHMN_SHM_SLOT_MB = "TORCHMN_SHM_SLOT_MB"             # each rank's slot in the node's shared memory
# Which of THREAD_VARIABLES torchmn run set (comma-separated), so that a rank can tell them from the user's.
TORCHMN_THREAD_VARIABLES = "TORCHMN_THREAD_VARIABLES"

# Variables read by the thread pools commonly found in a PyTorch process. OMP_NUM_THREADS comes
# first: when the user set it, we treat the whole thread configuration as theirs.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)

# Variables of launchers that may run inside a Slurm allocation and start their own ranks. MPICH's
# PMI_RANK is not one of them: srun --mpi=pmi2 sets it on its own tasks too (MPICHEnvironment.detect
# tells mpiexec's ranks apart, as detection does).
_OTHER_LAUNCHER_VARIABLES = ("TORCHMN_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK")
# Which thread-count variable each thread pool that threadpoolctl finds reads at load time.
_POOL_VARIABLES = {"openmp": "OMP_NUM_THREADS", "mkl": "MKL_NUM_THREADS", "openblas": "OPENBLAS_NUM_THREADS"}

# threadpool_limits applies its limits when created and keeps them until restore_original_limits();
# holding the object lets torchmn, or a test, undo them later.
_limiter = None
_applied: Optional[int] = None


def _environ(env: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if env is None else env


def _positive_int(value: Optional[str]) -> Optional[int]:
    """Parse a thread-count variable; OpenMP allows a nested list like "4,2": the first level counts."""
    if value is None:
        return None
    try:
        number = int(str(value).split(",")[0].strip())
    except ValueError:
        return None
    return number if number > 0 else None


def affinity_cpu_count() -> int:
    """The CPUs this process may run on (its affinity mask), or all the machine's where there is none.

    Returns:
        A positive count of CPUs.

    Example::

        >>> affinity_cpu_count() <= os.cpu_count()
        True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """CPUs allowed by a cgroup CPU quota (containers, Kubernetes limits), rounded up; None if unlimited.

    Reads cgroup v2 ``cpu.max`` for this process's cgroup and its ancestors (the tightest wins), and
    falls back to cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``.

    Args:
        root: where the cgroup file system is mounted.
        proc_cgroup: the file naming this process's cgroups.

    Returns:
        The quota in whole CPUs (at least 1), or None where no quota applies.

    Example::

        >>> cgroup_cpu_limit(root="/nonexistent") is None
        True
    """
    limits = []
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            limits += _limits_up_from(parts[2], lambda path: _read_cpu_max(os.path.join(root, path, "cpu.max")))
        elif "cpu" in parts[1].split(","):
            # cgroup v1: the cpu controller's hierarchy is mounted as cpu,cpuacct (or cpu, a link to it).
            mounts = [os.path.join(root, name) for name in (parts[1], "cpu", "cpu,cpuacct")]
            mount = next((m for m in mounts if os.path.isdir(m)), mounts[0])
            limits += _limits_up_from(parts[2], lambda path: _read_cfs_quota(os.path.join(mount, path)))
    return min(limits) if limits else None


def _limits_up_from(cgroup: str, read: Callable[[str], Optional[int]]) -> list:
    """The quotas of a cgroup and of its ancestors: the tightest of them binds."""
    limits, path = [], cgroup.strip("/")
    # Inside a container the cgroup namespace makes our own cgroup the root; walk up anyway.
    while True:
        limit = read(path)
        if limit is not None:
            limits.append(limit)
        if not path:
            return limits
        path = os.path.dirname(path)


def _read_cpu_max(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def _read_cfs_quota(directory: str) -> Optional[int]:
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def cpu_limits(env: Optional[Mapping[str, str]] = None, affinity: Optional[int] = None) -> Dict[str, Optional[int]]:
    """What limits the CPUs a process may use, each as a CPU count (None where it sets no limit).

    Args:
        env: the process's environment (default: ``os.environ``), for Slurm's allocation.
        affinity: its CPU affinity count (default: this process's).

    Returns:
        ``{"affinity": n, "cgroup": quota or None, "slurm": cpus or None}``.

    Example::

        >>> cpu_limits({"SLURM_CPUS_ON_NODE": "4"}, affinity=8)["slurm"]
        4
    """
    return {"affinity": affinity or affinity_cpu_count(), "cgroup": cgroup_cpu_limit(), "slurm": slurm_cpus(env)}


def slurm_cpus(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The CPUs Slurm allocated to a process: ``--cpus-per-task`` (``SLURM_CPUS_PER_TASK``) for a
    task that srun started, else the job's CPUs on this node (``SLURM_CPUS_ON_NODE``).

    Args:
        env: the process's environment (default: ``os.environ``).

    Returns:
        The CPU count, or None outside Slurm.

    Example::

        >>> slurm_cpus({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "2", "SLURM_CPUS_ON_NODE": "8"})
        2
    """
    env = _environ(env)
    slurm = _positive_int(env.get("SLURM_CPUS_PER_TASK")) if _srun_task(env) else None
    return slurm if slurm is not None else _positive_int(env.get("SLURM_CPUS_ON_NODE"))


def cpu_count_available(env: Optional[Mapping[str, str]] = None) -> int:
    """CPUs this process may use: the tightest of its CPU affinity, a cgroup CPU quota and what
    Slurm allocated: ``--cpus-per-task`` (``SLURM_CPUS_PER_TASK``) for a task that srun started,
    else the job's CPUs on this node (``SLURM_CPUS_ON_NODE``: a batch script, or the ranks that
    ``torchmn run`` or ``mpirun`` start inside it, share them).

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        The CPU count, at least 1.

    Example::

        >>> cpu_count_available({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "1"})
        1
    """
    counts = [n for n in cpu_limits(env).values() if n is not None]
    return max(1, min(counts))


def _srun_task(env: Mapping[str, str]) -> bool:
    """Whether this process is a task that srun itself started (a batch script is not one, nor a
    rank that another launcher started inside the allocation)."""
    return (slurm_step_id(env) is not None and not any(name in env for name in _OTHER_LAUNCHER_VARIABLES)
            and not MPICHEnvironment.detect(env))


def thread_budget(local_size: int, env: Optional[Mapping[str, str]] = None) -> int:
    """Threads for one of ``local_size`` ranks sharing this process's CPUs.

    Args:
        local_size: the ranks that share them.
        env: the environment (default: ``os.environ``).

    Returns:
        ``cpu_count_available() // local_size``, at least 1.

    Raises:
        ValueError: ``local_size`` is below 1.

    Example::

        >>> thread_budget(10**6)
        1
    """
    if local_size < 1:
        raise TorchmnValueError(f"local_size must be at least 1, got {local_size}")
    return max(1, cpu_count_available(env) // local_size)


def requested_threads(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The budget chosen explicitly through ``TORCHMN_NUM_THREADS``.

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        The thread count, or None when the variable is unset or blank.

    Raises:
        ValueError: the value is not a positive integer (rather than silently replacing it by the
            computed budget).

    Example::

        >>> requested_threads({"TORCHMN_NUM_THREADS": "4"}), requested_threads({})
        (4, None)
    """
    env = _environ(env)
    value = env.get(TORCHMN_NUM_THREADS)
    if value is None or not value.strip():
        return None
    threads = _positive_int(value)
    if threads is None or "," in value:
        raise TorchmnValueError(f"{TORCHMN_NUM_THREADS}={value!r} is not a positive integer; set it to the number "
                                f"of threads each rank may use, or unset it to get the CPUs divided among the ranks")
    return threads


# torch's intra-op thread count when torchmn was imported (remember_torch_threads): a different count
# at create_communicator means the script chose its own with torch.set_num_threads.
_torch_threads_at_import: Optional[int] = None
# The count of the last torch.set_num_threads call after import torchmn (see note_torch_threads_set);
# torchmn's own call, when it applies the budget once, notes the budget itself, which changes nothing.
_torch_threads_set: Optional[int] = None


def remember_torch_threads(count: int) -> None:
    """Record torch's thread count as torchmn is imported (``torchmn.torch_loaded`` calls this).

    Args:
        count: ``torch.get_num_threads()`` at import.

    Example::

        >>> remember_torch_threads(4)   # then torch.set_num_threads(2) in the script wins over the budget
    """
    global _torch_threads_at_import
    _torch_threads_at_import = count


def note_torch_threads_set(count: int) -> None:
    """Note a ``torch.set_num_threads(count)`` call (``torchmn.torch_loaded`` wraps torch's
    function with this), so that the script's choice wins over the budget even where it equals
    torch's default.

    Args:
        count: the thread count set.

    Example::

        >>> note_torch_threads_set(2)
    """
    global _torch_threads_set
    _torch_threads_set = count


def _scripts_torch_threads() -> Optional[int]:
    """torch's thread count if the script set it after ``import torchmn``, else None."""
    if _torch_threads_set is not None:
        return _torch_threads_set
    if _torch_threads_at_import is None:
        return None
    import torch

    count = torch.get_num_threads()
    return count if count != _torch_threads_at_import else None


def _set_by_user(env: Mapping[str, str], name: str) -> bool:
    """Whether the user set ``name`` to a thread count; an empty or invalid value (which OpenMP
    ignores, opening one thread per core) counts as unset, and torchmn replaces it."""
    return _positive_int(env.get(name)) is not None


def exported_env(base_env: Mapping[str, str], exports: Mapping[str, str]) -> Dict[str, str]:
    """A launcher's environment for its ranks, before their thread budget: ``base_env`` less the
    thread variables a budget set there (a launcher started inside a torchmn process inherits
    that process's, which were for it, not for these ranks), then the ``-x`` exports, which are
    the user's. Without the first step, an export of ``TORCHMN_NUM_THREADS`` would make the
    inherited ``OMP_NUM_THREADS`` look set by the user.

    Args:
        base_env: the launcher's own environment.
        exports: the variables the user exports to the ranks (``torchmn run -x``).

    Returns:
        The environment to compute the budget from (``launcher_thread_env``) and start the ranks in.

    Example::

        >>> exported_env({"OMP_NUM_THREADS": "2", "TORCHMN_NUM_THREADS": "2",
        ...               "TORCHMN_THREAD_VARIABLES": "OMP_NUM_THREADS,TORCHMN_NUM_THREADS"}, {"TORCHMN_NUM_THREADS": "1"})
        {'TORCHMN_NUM_THREADS': '1'}
    """
    ours = _set_by_torchmn(base_env)
    env = {k: v for k, v in base_env.items() if k not in ours and k != TORCHMN_THREAD_VARIABLES}
    env.update(exports)
    return env


def launcher_thread_env(local_size: int, env: Optional[Mapping[str, str]] = None,
                        bound: Optional[Tuple[int, int]] = None) -> Dict[str, str]:
    """Variables a launcher adds to each of ``local_size`` ranks on a node so that every thread pool
    starts at the rank's budget. Variables the user already set are left out; when the user set
    ``OMP_NUM_THREADS`` nothing is returned (the thread configuration is theirs). A user-set
    ``TORCHMN_NUM_THREADS`` replaces the computed budget.

    Args:
        local_size: the ranks on the node.
        env: the launcher's environment (default: ``os.environ``).
        bound: for a rank bound to CPUs (``torchmn run --bind``), ``(its CPUs, the ranks bound to
            the same ones)``: its budget is its share of those, within its share of a cgroup quota or
            a Slurm allocation smaller than those CPUs.

    Returns:
        The variables to add to each rank's environment.

    Raises:
        ValueError: ``TORCHMN_NUM_THREADS`` is not a positive integer.

    Example::

        >>> launcher_thread_env(2, {"OMP_NUM_THREADS": "3"})
        {}
        >>> launcher_thread_env(2, {"TORCHMN_NUM_THREADS": "4", "MKL_NUM_THREADS": "1"})["OMP_NUM_THREADS"]
        '4'
    """
    env = _environ(env)
    # Values a budget set here earlier (this launcher runs inside a rank, or after a script's
    # create_communicator) were for that process, not for these ranks: they are recomputed.
    ours = _set_by_torchmn(env)
    if _set_by_user(env, "OMP_NUM_THREADS") and "OMP_NUM_THREADS" not in ours:
        return {}
    requested = requested_threads(env) if TORCHMN_NUM_THREADS not in ours else None
    budget = requested or _bound_budget(bound, local_size, env) or thread_budget(local_size, env)
    added = {name: str(budget) for name in THREAD_VARIABLES if name in ours or not _set_by_user(env, name)}
    # TORCHMN_NUM_THREADS is torchmn's where it computed it; a count the user asked for stays theirs.
    added[TORCHMN_THREAD_VARIABLES] = ",".join(list(added) + ([] if requested else [TORCHMN_NUM_THREADS]))
    added[TORCHMN_NUM_THREADS] = str(budget)
    return added


def _set_by_torchmn(env: Mapping[str, str]) -> set:
    """The thread variables a torchmn launcher or budget set in ``env`` and nobody changed since:
    listed in ``TORCHMN_THREAD_VARIABLES`` and still at the budget (``TORCHMN_NUM_THREADS``), so
    that a value the user put in afterwards (``env={**os.environ, "OMP_NUM_THREADS": "3"}``) is theirs."""
    listed = set(filter(None, env.get(TORCHMN_THREAD_VARIABLES, "").split(",")))
    budget = env.get(TORCHMN_NUM_THREADS)
    return {name for name in listed if name == TORCHMN_NUM_THREADS or env.get(name) == budget}


def _bound_budget(bound: Optional[Tuple[int, int]], local_size: int, env: Mapping[str, str]) -> Optional[int]:
    if bound is None:
        return None
    share = max(1, bound[0] // max(1, bound[1]))
    # A quota or an allocation smaller than the launcher's CPUs is shared by all the node's ranks,
    # whichever CPUs each is bound to: a rank gets at most its share of it.
    if cpu_count_available(env) < affinity_cpu_count():
        return min(share, thread_budget(local_size, env))
    return share


def ranks_sharing_cpus(local_size: int, env: Mapping[str, str]) -> int:
    """How many ranks share the CPUs counted by cpu_count_available.

    A task that srun started with ``--cpus-per-task`` has its own CPUs (SLURM_CPUS_PER_TASK is per
    task), so dividing by the ranks on the node again would starve it. Everywhere else (torchmn run,
    torchrun, mpirun, also inside a Slurm batch script) the ranks of a node share one allocation.

    Args:
        local_size: the ranks on this node.
        env: the rank's environment variables.

    Returns:
        1 for an srun task with CPUs of its own, else ``local_size`` (at least 1).

    Example::

        >>> ranks_sharing_cpus(4, {"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "4"})
        1
        >>> ranks_sharing_cpus(4, {})
        4
    """
    if _srun_task(env) and _positive_int(env.get("SLURM_CPUS_PER_TASK")) is not None:
        return 1
    return max(1, local_size)


def _apply(threads: int, user_set: set) -> None:
    global _limiter
    import torch
    from threadpoolctl import ThreadpoolController

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    # A pool whose variable is set read it when it loaded; it is left alone, so that a user's
    # MKL_NUM_THREADS or OPENBLAS_NUM_THREADS keeps its meaning (torchmn run sets them to the budget).
    # Selected by API name: older threadpoolctl (3.1, Debian 12's) silently ignores limits keyed by file path.
    controller = ThreadpoolController()
    apis = sorted({library.internal_api for library in controller.lib_controllers
                   if _POOL_VARIABLES.get(library.internal_api) not in user_set})
    if apis:
        _limiter = controller.select(internal_api=apis).limit(limits=threads)


def apply_thread_budget(local_size: int, env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Apply the thread budget inside a running rank. A ``torch.set_num_threads(n)`` call made after ``import torchmn`` makes ``n`` the budget: torch
    keeps it, and the OpenMP/BLAS pools and child processes get it too.

    ``TORCHMN_NUM_THREADS`` (set by ``torchmn run``, or by the user) is applied as given. Otherwise
    the budget is computed, applied to torch's intra-op pool and to every OpenMP/BLAS pool already
    loaded (threadpoolctl), and written to ``os.environ`` so that child processes such as DataLoader
    workers inherit it. Calling it again returns the first result.

    Args:
        local_size: the ranks on this node.
        env: the environment (default: ``os.environ``, which is then updated).

    Returns:
        The thread count torchmn applied, or None when the user's own ``OMP_NUM_THREADS`` is in
        charge (then nothing is changed).

    Raises:
        ValueError: ``TORCHMN_NUM_THREADS`` is not a positive integer.

    Example::

        >>> n = apply_thread_budget(local_size=2)   # in each of 2 ranks on a 16-CPU node: 8
    """
    global _applied
    if _applied is not None:
        return _applied
    env = _environ(env)
    _apply_interop(env)
    chosen = requested_threads(env)
    omp = _positive_int(env.get("OMP_NUM_THREADS"))
    # torchmn run sets both to the same budget; a user's OMP_NUM_THREADS that differs wins.
    if omp is not None and omp != chosen:
        return None
    chosen = _scripts_torch_threads() or chosen
    threads = chosen or thread_budget(ranks_sharing_cpus(local_size, env), env)
    # What torchmn run set is torchmn's to replace; what the user set stays.
    theirs = _set_by_torchmn(env)
    user_set = {name for name in THREAD_VARIABLES if _set_by_user(env, name) and name not in theirs}
    if env is os.environ:
        written = [name for name in THREAD_VARIABLES if name not in user_set]
        for name in written:
            os.environ[name] = str(threads)  # for child processes: DataLoader workers, subprocesses
        os.environ[TORCHMN_NUM_THREADS] = str(threads)
        # Named as torchmn's, so that a torchmn run started from here budgets its own ranks.
        os.environ[TORCHMN_THREAD_VARIABLES] = ",".join(written + [TORCHMN_NUM_THREADS])
    _apply(threads, user_set)
    _applied = threads
    return threads


def dataloader_workers_budget(local_size: int, env: Optional[Mapping[str, str]] = None) -> int:
    """A default ``num_workers`` for a rank's DataLoader: ``TORCHMN_NUM_WORKERS`` where set, else one
    less than its thread budget (the rank's main thread keeps one CPU), at least 0.

    Args:
        local_size: the ranks on this node.
        env: the environment (default: ``os.environ``).

    Returns:
        The number of DataLoader workers.

    Raises:
        ValueError: ``TORCHMN_NUM_WORKERS`` is not a whole number.

    Example::

        >>> dataloader_workers_budget(10**6)
        0
    """
    env = _environ(env)
    workers = env.get(TORCHMN_NUM_WORKERS, "").strip()
    if workers:
        if not workers.isdigit():
            raise TorchmnValueError(f"{TORCHMN_NUM_WORKERS} must be a whole number >= 0, not {workers!r}")
        return int(workers)
    # The rank's pools in apply_thread_budget's order: the user's OMP_NUM_THREADS first.
    threads = _positive_int(env.get("OMP_NUM_THREADS")) or requested_threads(env) \
        or thread_budget(ranks_sharing_cpus(local_size, env), env)
    return max(0, threads - 1)


def requested_interop_threads(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The inter-op threads asked for through ``TORCHMN_INTEROP_THREADS``.

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        The thread count, or None when the variable is unset or blank (as the other TORCHMN_ variables).

    Raises:
        ValueError: the value is not a positive integer.

    Example::

        >>> requested_interop_threads({"TORCHMN_INTEROP_THREADS": "1"}), requested_interop_threads({})
        (1, None)
    """
    value = _environ(env).get(TORCHMN_INTEROP_THREADS)
    if value is None or not value.strip():
        return None
    threads = _positive_int(value)
    if threads is None:
        raise TorchmnValueError(f"{TORCHMN_INTEROP_THREADS} must be a positive integer, not {value!r}; set it to "
                                f"the inter-op threads you want (e.g. 1), or unset it")
    return threads


def _apply_interop(env: Mapping[str, str]) -> None:
    """``TORCHMN_INTEROP_THREADS``, where set, sizes torch's inter-op pool (before it starts)."""
    threads = requested_interop_threads(env)
    if threads is None:
        return
    import torch

    if torch.get_num_interop_threads() != threads:
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # the pool already ran work: torch cannot resize it any more
            warnings.warn(f"{TORCHMN_INTEROP_THREADS}={threads} was not applied: torch's inter-op pool already "
                          f"ran work with {torch.get_num_interop_threads()} threads, and cannot be resized. Create "
                          f"the communicator before the script's first parallel work", stacklevel=3)


def bucket_cap_mb_requested(env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """``TORCHMN_BUCKET_CAP_MB``, the default gradient bucket size of new communicators, or None.

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        The MB, or None where it is not set.

    Raises:
        ValueError: it is not a number >= 0.

    Example::

        >>> bucket_cap_mb_requested({"TORCHMN_BUCKET_CAP_MB": "4"})
        4.0
    """
    value = _environ(env).get(TORCHMN_BUCKET_CAP_MB)
    if value is None or not value.strip():
        return None
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if not (mb >= 0 and math.isfinite(mb)):
        raise TorchmnValueError(f"{TORCHMN_BUCKET_CAP_MB} must be a number of MB >= 0, not {value!r}")
    return mb


# The smallest slot TORCHMN_SHM_SLOT_MB may ask for (4 KB: tensors go through in pieces of it).
MIN_SHM_SLOT_MB = 0.004


def shm_slot_mb_requested(env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """``TORCHMN_SHM_SLOT_MB``, each rank's slot in the node's shared memory, or None.

    Read here, without torch, so that ``torchmn info`` refuses a malformed value at once.

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        The MB, or None where it is not set.

    Raises:
        ValueError: it is not a number of MB of at least :data:`MIN_SHM_SLOT_MB`.

    Example::

        >>> shm_slot_mb_requested({"TORCHMN_SHM_SLOT_MB": "0.5"}), shm_slot_mb_requested({})
        (0.5, None)
    """
    value = _environ(env).get(TORCHMN_SHM_SLOT_MB)
    if value is None:
        return None
    try:
        mb = float(value)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb >= MIN_SHM_SLOT_MB):
        raise TorchmnValueError(f"{TORCHMN_SHM_SLOT_MB}={value!r} is not a number of MB of at least "
                                f"{MIN_SHM_SLOT_MB:g}; set it to the slot size each rank gets in shared memory "
                                f"(default 16), or unset it")
    return mb
