"""Ranks started by MPICH's or Intel MPI's Hydra ``mpiexec``: ``PMI_*`` and ``MPI_LOCAL*`` variables."""
from __future__ import annotations

import os
from typing import Mapping, Optional

from torchmn.environments.mpi import MPIEnvironment
from torchmn.environments.slurm import SlurmEnvironment

# Hydra's proxy is hydra_pmi_proxy in MPICH and pmi_proxy in Intel MPI; ranks are its children,
# or its grandchildren behind a wrapper such as `timeout` or `sh -c`.
_HYDRA_PROXIES = ("hydra_pmi_proxy", "pmi_proxy")


class MPICHEnvironment(MPIEnvironment):
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

    Example::

        >>> MPICHEnvironment.read({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
        ...                        "MPI_LOCALNRANKS": "2", "PMI_JOBID": "7"}).source
        'mpich'
    """

    source = "mpich"
    names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    fix = "MPICH / Intel MPI's mpiexec (Hydra) sets it; use Hydra's mpiexec, or srun under Slurm"
    job_id_names = ("PMI_JOBID", "PMIX_NAMESPACE")

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether Hydra's ``mpiexec`` started this process; see ``Environment.detect``.

        ``srun --mpi=pmi2`` sets ``PMI_RANK`` too, but not ``MPI_LOCALRANKID``; such a task is left
        to ``SlurmEnvironment``.

        Args:
            env: the environment.

        Returns:
            True with ``PMI_RANK`` and either ``MPI_LOCALRANKID`` or no srun step
            (``SlurmEnvironment.detect`` says no).

        Example::

            >>> MPICHEnvironment.detect({"PMI_RANK": "0", "MPI_LOCALRANKID": "0"})
            True
            >>> MPICHEnvironment.detect({"PMI_RANK": "0", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})
            False
        """
        if "PMI_RANK" not in env:
            return False
        return "MPI_LOCALRANKID" in env or not SlurmEnvironment.detect(env)

    @classmethod
    def job_id(cls, env: Mapping[str, str]) -> Optional[str]:
        """The id of this mpiexec's job.

        Args:
            env: the environment.

        Returns:
            ``PMI_JOBID`` or ``PMIX_NAMESPACE``, else the Hydra proxy's ``--control-port`` (see
            ``hydra_job``), else None.

        Example::

            >>> MPICHEnvironment.job_id({"PMI_JOBID": "7"})
            '7'
        """
        job = super().job_id(env)
        return hydra_job() if job is None else job


def hydra_job(pid: Optional[int] = None, generations: int = 8) -> Optional[str]:
    """The ``--control-port`` of the Hydra proxy above process ``pid``. Linux only (/proc).

    Args:
        pid: the process to start from (default: this one's parent).
        generations: how many parents up to look.

    Returns:
        ``host:port`` of mpiexec, or None when no Hydra proxy started the process.

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
