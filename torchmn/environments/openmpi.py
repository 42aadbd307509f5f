"""Ranks started by Open MPI's ``mpirun``: its ``OMPI_COMM_WORLD_*`` variables."""
from __future__ import annotations

from typing import Mapping

from torchmn.environments.mpi import MPIEnvironment


class OpenMPIEnvironment(MPIEnvironment):
    """Started by Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``,
    ``_LOCAL_SIZE``.

    Checked before Slurm: a process started by ``mpirun`` inside a Slurm allocation inherits the
    allocation's ``SLURM_*`` variables, which describe the batch step, not this rank. Under
    ``srun --mpi=pmi2``/``pmix`` the ``OMPI_COMM_WORLD_*`` names are absent and Slurm is read
    instead, and the two agree anyway.

    ``node_rank`` is None: ``OMPI_COMM_WORLD_NODE_RANK`` numbers processes within a node (like the
    local rank), it is not an index of nodes. Without ``MASTER_ADDR`` the ranks must share this node
    (``mpirun -x MASTER_ADDR=<first host>`` otherwise). The port is ``text_port`` of Open MPI's
    job id (``OMPI_MCA_ess_base_jobid``, else ``OMPI_MCA_orte_ess_jobid``, else
    ``PMIX_NAMESPACE``), which is the same on every rank of one mpirun; else 29500.

    Example::

        >>> OpenMPIEnvironment.read({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
        ...                          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        ...                          "OMPI_MCA_ess_base_jobid": "2089418753"}).master_port
        25854
    """

    source = "openmpi"
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE")
    fix = "Open MPI's mpirun sets it; check that it was not overridden with -x"
    job_id_names = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE")

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether Open MPI's ``mpirun`` started this process; see ``Environment.detect``.

        Args:
            env: the environment.

        Returns:
            True when ``OMPI_COMM_WORLD_RANK`` is set, also inside a Slurm allocation.

        Example::

            >>> OpenMPIEnvironment.detect({"OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0"})
            True
        """
        return "OMPI_COMM_WORLD_RANK" in env
