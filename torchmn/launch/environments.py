"""One class per launcher: which variables say that it started us, and what they say.

Every ``read`` follows two rules: ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment win over
anything derived, and a value that is not an integer or does not fit (rank >= size, ...) raises
ValueError naming the variable, its value and what to do.
"""
from __future__ import annotations

import ipaddress
import os
import zlib
from typing import Mapping, Optional, Sequence

from torchmn.launch.base import (
    TORCHMN_LOCAL_RANK,
    TORCHMN_LOCAL_SIZE,
    TORCHMN_NODE_RANK,
    TORCHMN_RANK,
    TORCHMN_SIZE,
    Environment,
    LaunchEnvironment,
)
from torchmn.launch.hostlist import expand_hostlist
from torchmn.resources import slurm_step_id

LOCALHOST = "127.0.0.1"

# torchrun's default port, used when a launcher gives nothing to derive one from.
DEFAULT_PORT = 29500

# Derived ports fall in [PORT_BASE, PORT_BASE + PORT_SPAN) = 20000-31999: above the common service
# ports and below Linux's ephemeral range (32768-60999), where an outgoing connection of any other
# program (gloo opens many) may hold the number and make the rendezvous fail with "address in use".
PORT_BASE = 20000
PORT_SPAN = 12000

def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port for a Slurm step: ``20000 + (job_id * 97 + step_id) % 12000``.

    Every task of a step computes the same number without talking to the others. 97 is prime to
    12000, so steps 0-96 of one job never share a port, and neighbouring job ids land 97 apart.

    Example::

        >>> slurm_port(1234, 0)
        31698
    """
    return PORT_BASE + (job_id * 97 + step_id) % PORT_SPAN


def text_port(job_id: str) -> int:
    """A port derived from an opaque job id string: ``20000 + crc32(job_id) % 12000``.

    crc32 rather than ``hash()``, which Python salts per process, so every rank gets the same port.

    Example::

        >>> text_port("2089418753")
        25854
    """
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def slurm_misuse_error(env: Mapping[str, str]) -> Optional[str]:
    """A message when this process runs inside a multi-task Slurm allocation without srun.

    A batch script (or a shell from salloc) sees ``SLURM_JOB_ID`` and ``SLURM_NTASKS`` but has no
    step id of its own, or a special one; running ``python train.py`` there starts one process, not
    N ranks. Returns None when this does not apply.

    Example::

        >>> slurm_misuse_error({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})[:40]
        'this script runs in a Slurm allocation o'
    """
    if not (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")) or slurm_step_id(env) is not None:
        return None
    ntasks = _allocated_tasks(env)
    if ntasks is None or ntasks <= 1:
        return None
    return (f"this script runs in a Slurm allocation of {ntasks} tasks but was not started by srun; "
            f"launch it with `srun python ...` (one task per rank), or with one `torchmn run` per node: "
            f"`srun --ntasks-per-node 1 torchmn run -np RANKS_PER_NODE python ...`")


def _allocated_tasks(env: Mapping[str, str]) -> Optional[int]:
    """Tasks of the allocation: SLURM_NTASKS, which `sbatch -N 2` without -n leaves unset, else
    the sum of SLURM_TASKS_PER_NODE (one per node by default)."""
    try:
        return int(env.get("SLURM_NTASKS", ""))
    except ValueError:
        pass
    value = env.get("SLURM_TASKS_PER_NODE")
    if not value:
        return None
    try:
        return sum(_expand_tasks_per_node("SLURM_TASKS_PER_NODE", value, ""))
    except ValueError:
        return None


class TorchmnEnvironment(Environment):
    """Started by ``torchmn run``: ``TORCHMN_RANK``, ``TORCHMN_SIZE``, ``TORCHMN_LOCAL_RANK``,
    ``TORCHMN_LOCAL_SIZE``, ``TORCHMN_NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``."""

    source = "torchmn"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return TORCHMN_RANK in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        fix = "these are set by `torchmn run`; do not set them by hand"
        rank = _int(env, TORCHMN_RANK, fix)
        size = _int(env, TORCHMN_SIZE, fix)
        local_rank = _int(env, TORCHMN_LOCAL_RANK, fix)
        local_size = _int(env, TORCHMN_LOCAL_SIZE, fix)
        node_rank = _optional_int(env, TORCHMN_NODE_RANK, fix)
        _check(env, (TORCHMN_RANK, rank), (TORCHMN_SIZE, size), (TORCHMN_LOCAL_RANK, local_rank),
               (TORCHMN_LOCAL_SIZE, local_size), fix)
        addr = _master_addr(env, None, size, local_size, cls.source,
                            "`torchmn run` always sets it; was the variable removed?")
        return LaunchEnvironment(rank, size, local_rank, local_size, node_rank, addr,
                                 _master_port(env, None), cls.source)


class TorchrunEnvironment(Environment):
    """Started by torchrun / torchelastic: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node index), ``MASTER_ADDR``, ``MASTER_PORT``.

    Detected by ``TORCHELASTIC_RUN_ID``, which torchrun gives every worker. The same variables set
    by hand are ``EnvEnvironment``'s, read after Slurm and MPI, whose tasks may inherit them from a
    batch script.
    """

    source = "torchrun"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        fix = "torchrun sets it; was it overridden?"
        rank = _int(env, "RANK", fix)
        size = _int(env, "WORLD_SIZE", fix)
        local_rank = _int(env, "LOCAL_RANK", fix)
        local_size = _int(env, "LOCAL_WORLD_SIZE", fix)
        node_rank = _optional_int(env, "GROUP_RANK", fix)
        _check(env, ("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
               ("LOCAL_WORLD_SIZE", local_size), fix)
        addr = _master_addr(env, None, size, local_size, cls.source, "torchrun sets it; was it unset?")
        return LaunchEnvironment(rank, size, local_rank, local_size, node_rank, addr,
                                 _master_port(env, None), cls.source)


class OpenMPIEnvironment(Environment):
    """Started by Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``,
    ``_LOCAL_SIZE``.

    Checked before Slurm on purpose (SPEC lists Slurm first): a process started by ``mpirun`` inside
    a Slurm allocation inherits the allocation's ``SLURM_*`` variables, which describe the batch
    step, not this rank. Under ``srun --mpi=pmi2``/``pmix`` the ``OMPI_COMM_WORLD_*`` names are
    absent and Slurm is read instead, and the two agree anyway.

    ``node_rank`` is None: ``OMPI_COMM_WORLD_NODE_RANK`` numbers processes within a node (like the
    local rank), it is not an index of nodes. Open MPI does not tell a rank where rank 0 runs, so
    ``master_addr`` is 127.0.0.1 when every rank is on this node and otherwise ``MASTER_ADDR`` must
    be exported (``mpirun -x MASTER_ADDR=<first host>``). The port is ``text_port`` of Open MPI's
    job id (``OMPI_MCA_ess_base_jobid``, else ``OMPI_MCA_orte_ess_jobid``, else
    ``PMIX_NAMESPACE``), which is the same on every rank of one mpirun; else 29500.
    """

    source = "openmpi"
    _job_id_names = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE")

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_RANK" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        fix = "Open MPI's mpirun sets it; check that it was not overridden with -x"
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
        return _read_mpi(env, cls.source, names, fix)


class MPICHEnvironment(Environment):
    """Started by MPICH's or Intel MPI's Hydra ``mpiexec``: ``PMI_RANK``, ``PMI_SIZE``,
    ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.

    Checked before Slurm for the same reason as Open MPI. ``srun --mpi=pmi2`` also sets
    ``PMI_RANK``/``PMI_SIZE`` but not the ``MPI_LOCAL*`` names; that case is left to the Slurm
    class, which knows the node index too.

    ``node_rank`` is None and ``master_addr`` follows the Open MPI rule. Hydra puts no job id in the
    ranks' environment (``PMI_FD`` differs per rank), so the port derives from ``PMI_JOBID`` or
    ``PMIX_NAMESPACE`` where a launcher sets them, else from the ``--control-port`` of the Hydra
    proxy that started this rank: mpiexec's own address, the same for every rank of one mpiexec on
    every node, and different for two mpiexecs running at once (``hydra_job``). Without any of
    these, 29500.
    """

    source = "mpich"
    _job_id_names = ("PMI_JOBID", "PMIX_NAMESPACE")

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        if "PMI_RANK" not in env:
            return False
        return "MPI_LOCALRANKID" in env or not SlurmEnvironment.detect(env)

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        fix = "MPICH / Intel MPI's mpiexec (Hydra) sets it; use Hydra's mpiexec, or srun under Slurm"
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
        return _read_mpi(env, cls.source, names, fix)


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
    """

    source = "slurm"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and slurm_step_id(env) is not None

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        fix = "srun sets it for every task; launch with `srun` rather than setting SLURM_* by hand"
        rank = _int(env, "SLURM_PROCID", fix)
        size_name = _first_present(env, ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"))
        size = _int(env, size_name, fix)
        local_rank = _int(env, "SLURM_LOCALID", fix)
        node_rank = _int(env, "SLURM_NODEID", fix)
        nodelist_name = _first_present(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        hosts = _slurm_hosts(env, nodelist_name)
        local_size, local_size_name = _slurm_local_size(env, _slurm_node_index(env, hosts, node_rank), size, fix)
        _check(env, ("SLURM_PROCID", rank), (size_name, size), ("SLURM_LOCALID", local_rank),
               (local_size_name, local_size), fix)
        addr = _master_addr(env, _slurm_rank0_host(env, hosts), size, local_size, cls.source,
                            "srun normally sets SLURM_STEP_NODELIST")
        return LaunchEnvironment(rank, size, local_rank, local_size, node_rank, addr,
                                 _master_port(env, _slurm_derived_port(env, fix)), cls.source)


class EnvEnvironment(Environment):
    """Started by hand, or by a scheduler, with torch's ``env://`` variables: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and optionally ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE`` (Kubeflow's PyTorchJob sets the first four, one process per pod).

    Checked after every launcher, so that a batch script that exports ``RANK`` for its own use
    changes nothing under srun or mpirun. Without ``LOCAL_*``, ranks whose rendezvous is a loopback
    address all share this host; otherwise each rank is taken to be alone on its host (the
    communicator still groups ranks by hostname). ``node_rank`` is None.
    """

    source = "env"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        fix = ("torch's env:// launch needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on every process "
               "(LOCAL_RANK and LOCAL_WORLD_SIZE when several share a host); or start the job with torchrun "
               "or `torchmn run`")
        rank = _int(env, "RANK", fix)
        size = _int(env, "WORLD_SIZE", fix)
        if "LOCAL_RANK" in env or "LOCAL_WORLD_SIZE" in env:
            local_rank, local_size = _int(env, "LOCAL_RANK", fix), _int(env, "LOCAL_WORLD_SIZE", fix)
        elif _is_loopback(env.get("MASTER_ADDR") or LOCALHOST):
            local_rank, local_size = rank, size
        else:
            local_rank, local_size = 0, 1
        _check(env, ("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
               ("LOCAL_WORLD_SIZE", local_size), fix)
        addr = _master_addr(env, None, size, local_size, cls.source, fix)
        return LaunchEnvironment(rank, size, local_rank, local_size, None, addr, _master_port(env, None),
                                 cls.source)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SingleEnvironment(Environment):
    """No launcher: a world of one process on 127.0.0.1 (``MASTER_ADDR``/``MASTER_PORT`` still win)."""

    source = "single"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        return LaunchEnvironment(0, 1, 0, 1, 0, env.get("MASTER_ADDR") or LOCALHOST,
                                 _master_port(env, None), cls.source)


# ---- helpers ----

def _read_mpi(env: Mapping[str, str], source: str, names: Sequence[str], fix: str) -> LaunchEnvironment:
    rank, size, local_rank, local_size = (_int(env, name, fix) for name in names)
    _check(env, (names[0], rank), (names[1], size), (names[2], local_rank), (names[3], local_size), fix)
    addr = _master_addr(env, None, size, local_size, source,
                        "MPI does not say where rank 0 runs; export it to every rank, e.g. "
                        "`mpirun -x MASTER_ADDR=<first host> ...` (Open MPI) or "
                        "`mpiexec -genv MASTER_ADDR <first host> ...` (MPICH)")
    job_id = _mpi_job_id(env, source)
    derived = text_port(job_id) if job_id is not None else DEFAULT_PORT
    return LaunchEnvironment(rank, size, local_rank, local_size, None, addr,
                             _master_port(env, derived), source)


def _mpi_job_id(env: Mapping[str, str], source: str) -> Optional[str]:
    kind = OpenMPIEnvironment if source == OpenMPIEnvironment.source else MPICHEnvironment
    job = next((env[name] for name in kind._job_id_names if env.get(name)), None)
    if job is None and kind is MPICHEnvironment:
        return hydra_job()
    return job


# Hydra's proxy is hydra_pmi_proxy in MPICH and pmi_proxy in Intel MPI; ranks are its children,
# or its grandchildren behind a wrapper such as `timeout` or `sh -c`.
_HYDRA_PROXIES = ("hydra_pmi_proxy", "pmi_proxy")


def hydra_job(pid: Optional[int] = None, generations: int = 8) -> Optional[str]:
    """The ``--control-port`` (``host:port`` of mpiexec) of the Hydra proxy above process ``pid``
    (default: this one), or None when no Hydra proxy started it. Linux only (/proc).

    Example::

        >>> hydra_job(pid=1) is None
        True
    """
    pid = os.getppid() if pid is None else pid
    for _ in range(generations):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [arg.decode(errors="replace") for arg in f.read().split(b"\0")]
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        except (OSError, ValueError, IndexError):
            return None
        if os.path.basename(argv[0]) in _HYDRA_PROXIES:
            return argv[argv.index("--control-port") + 1] if "--control-port" in argv[:-1] else None
        pid = parent
    return None


def job_label(env: Mapping[str, str], source: str) -> Optional[str]:
    """Words naming this job of launcher ``source`` (the job id its ports derive from), or None
    where the launcher gives none.

    Example::

        >>> job_label({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}, "slurm")
        'Slurm job 42 step 3'
    """
    if source == SlurmEnvironment.source:
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        return f"Slurm job {job} step {slurm_step_id(env) or 0}" if job else None
    mpi = source in (OpenMPIEnvironment.source, MPICHEnvironment.source)
    job = _mpi_job_id(env, source) if mpi else None
    return f"{source} job {job}" if job else None


def _int(env: Mapping[str, str], name: str, fix: str) -> int:
    if name not in env:
        raise ValueError(f"{name} is not set; {fix}")
    value = env[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; {fix}") from None


def _optional_int(env: Mapping[str, str], name: str, fix: str) -> Optional[int]:
    if not env.get(name, "").strip():
        return None
    number = _int(env, name, fix)
    if number < 0:
        raise ValueError(f"{name}={env[name]!r} is negative; {fix}")
    return number


def _check(env: Mapping[str, str], rank: tuple, size: tuple, local_rank: tuple, local_size: tuple,
           fix: str) -> None:
    """Each argument is (variable name, value); raise if they do not fit together."""
    def shown(item: tuple) -> str:
        name, value = item
        return f"{name}={env.get(name, value)!r}"

    if size[1] < 1:
        raise ValueError(f"{shown(size)} must be at least 1; {fix}")
    if local_size[1] < 1:
        raise ValueError(f"{shown(local_size)} must be at least 1; {fix}")
    if not 0 <= rank[1] < size[1]:
        raise ValueError(f"{shown(rank)} is outside 0..{size[1] - 1} given by {shown(size)}; {fix}")
    if not 0 <= local_rank[1] < local_size[1]:
        raise ValueError(f"{shown(local_rank)} is outside 0..{local_size[1] - 1} given by "
                         f"{shown(local_size)}; {fix}")
    if local_size[1] > size[1]:
        raise ValueError(f"{shown(local_size)} is larger than {shown(size)}; {fix}")


def _master_addr(env: Mapping[str, str], derived: Optional[str], size: int, local_size: int,
                 source: str, hint: str) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if derived:
        return derived
    if local_size == size:
        return LOCALHOST
    raise RuntimeError(f"MASTER_ADDR is not set and the {size} ranks ({source}) span several nodes, so "
                       f"torchmn cannot tell where rank 0 runs; {hint}")


def _master_port(env: Mapping[str, str], derived: Optional[int]) -> Optional[int]:
    value = env.get("MASTER_PORT", "").strip()
    if not value:
        return derived
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number (1-65535); "
                         f"unset it or set it to a free TCP port")
    return port


def _first_present(env: Mapping[str, str], names: Sequence[str]) -> str:
    """The first of ``names`` that is set, else the first name (so errors name the main variable)."""
    return next((name for name in names if env.get(name)), names[0])


def _slurm_hosts(env: Mapping[str, str], name: str) -> Optional[list]:
    if name not in env:
        return None
    try:
        return expand_hostlist(env[name])
    except ValueError as error:
        raise ValueError(f"{name}={env[name]!r} cannot be read: {error}; set MASTER_ADDR to the first "
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
        raise RuntimeError("srun --distribution=arbitrary (SLURM_HOSTFILE) places task 0 on a node Slurm's "
                           "variables do not tell; export MASTER_ADDR as the name of the node where task 0 "
                           "runs (the first line of the hostfile)")
    for name in ("SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_JOB_NODELIST_PACK_GROUP_0"):
        if env.get("SLURM_HET_SIZE") and env.get(name):
            return _slurm_hosts(env, name)[0]
    return hosts[0] if hosts else None


def _slurm_local_size(env: Mapping[str, str], node_rank: int, size: int, fix: str) -> tuple:
    """(tasks on this node, variable it came from)."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = _expand_tasks_per_node(name, env[name], fix)
            if node_rank >= len(counts):
                raise ValueError(f"SLURM_NODEID={env['SLURM_NODEID']!r} has no entry in "
                                 f"{name}={env[name]!r} ({len(counts)} nodes); {fix}")
            return counts[node_rank], name
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _int(env, "SLURM_NTASKS_PER_NODE", fix), "SLURM_NTASKS_PER_NODE"
    if size == 1:
        return 1, "SLURM_NTASKS"
    raise ValueError(f"SLURM_TASKS_PER_NODE is not set, so the number of tasks on this node is unknown; {fix}")


def _expand_tasks_per_node(name: str, value: str, fix: str) -> list:
    """Slurm's compact per-node counts: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in value.split(","):
        count_text, _, repeat_text = part.strip().partition("(x")
        try:
            count = int(count_text)
            repeat = int(repeat_text[:-1]) if repeat_text else 1
            if repeat_text and not repeat_text.endswith(")"):
                raise ValueError(part)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a tasks-per-node list like '2(x3),1'; {fix}") from None
        if count < 1 or repeat < 1:
            raise ValueError(f"{name}={value!r} has a count below 1; {fix}")
        counts.extend([count] * repeat)
    return counts


def _slurm_derived_port(env: Mapping[str, str], fix: str) -> int:
    job_name = _first_present(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if not env.get(job_name):
        return DEFAULT_PORT
    job_id = _int(env, job_name, fix)
    step_id = slurm_step_id(env) or 0
    return slurm_port(job_id, step_id)
