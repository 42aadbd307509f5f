"""What MPI launchers share: four variables for the place, a job id for the port."""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

from torchmn.launch.base import Environment, LaunchEnvironment
from torchmn.launch.environments.helpers import DEFAULT_PORT, read_ranks, text_port

MPI_HINT = ("MPI does not say where rank 0 runs; export it to every rank, e.g. "
            "`mpirun -x MASTER_ADDR=<first host> ...` (Open MPI) or "
            "`mpiexec -genv MASTER_ADDR <first host> ...` (MPICH)")


class MPIEnvironment(Environment):
    """An MPI launcher: subclasses name its variables of rank, size, local rank and local size
    (``names``) and of its job id (``job_id_names``).

    ``node_rank`` is None: MPI numbers processes, not nodes. MPI does not tell a rank where rank 0
    runs, so ``master_addr`` is 127.0.0.1 when every rank is on this node and otherwise
    ``MASTER_ADDR`` must be exported. The port is ``text_port`` of the job id, which is the same
    on every rank of one job; else 29500.
    """

    names: Tuple[str, str, str, str] = ("", "", "", "")
    fix = ""
    job_id_names: Tuple[str, ...] = ()

    @classmethod
    def job_id(cls, env: Mapping[str, str]) -> Optional[str]:
        """The launcher's id of this job.

        Args:
            env: the environment.

        Returns:
            The first of ``job_id_names`` that is set, or None.

        Example::

            >>> from torchmn.launch.environments import OpenMPIEnvironment
            >>> OpenMPIEnvironment.job_id({"OMPI_MCA_ess_base_jobid": "2089418753"})
            '2089418753'
        """
        return next((env[name] for name in cls.job_id_names if env.get(name)), None)

    @classmethod
    def job_label(cls, env: Mapping[str, str]) -> Optional[str]:
        """Words naming this job, for messages.

        Args:
            env: the environment.

        Returns:
            ``openmpi job 2089418753`` and the like, or None without a job id.
        """
        job = cls.job_id(env)
        return f"{cls.source} job {job}" if job else None

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place, from the launcher's variables; see ``Environment.read``."""
        job_id = cls.job_id(env)
        derived = text_port(job_id) if job_id is not None else DEFAULT_PORT
        return read_ranks(env, cls.source, cls.names, cls.fix, MPI_HINT, derived_port=derived)
