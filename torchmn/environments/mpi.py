"""What MPI launchers share: four variables for the place, a job id for the port."""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Mapping, Optional, Tuple

from torchmn.environments.base import Environment, LaunchEnvironment
from torchmn.environments.variables import DEFAULT_PORT, master_port, read_ranks, text_port

MPI_HINT = ("MPI's launcher does not tell a rank where rank 0 runs. Either install mpi4py, built against "
            "this MPI (`pip install mpi4py`; see docs/launching/mpi.md), and rank 0's address and port travel over MPI itself; or "
            "export them to every rank: `mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...` "
            "(Open MPI) or `mpiexec -genv MASTER_ADDR <first host> -genv MASTER_PORT 29500 ...` (MPICH)")

# ``master_addr`` of ranks on several nodes with neither MASTER_ADDR nor a way to derive it, where
# mpi4py is installed: rank 0 sends its address (and port) over MPI when the communicator is set
# up (torchmn.environments.mpi_rendezvous). Not a host name, so it cannot be taken for one.
MPI_RENDEZVOUS = "<sent by rank 0 over MPI>"


def mpi4py_installed() -> bool:
    """Whether mpi4py can be imported, found without importing it (importing ``mpi4py.MPI``
    would initialise MPI, which reading the environment must not do).

    Returns:
        True when Python finds the ``mpi4py`` package.

    Example::

        >>> isinstance(mpi4py_installed(), bool)
        True
    """
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules or on the path
        return False


class MPIEnvironment(Environment):
    """An MPI launcher: subclasses name its variables of rank, size, local rank and local size
    (``names``) and of its job id (``job_id_names``).

    ``node_rank`` is None: MPI numbers processes, not nodes. MPI's launcher does not tell a rank
    where rank 0 runs, so ``master_addr`` is ``MASTER_ADDR`` when exported, else 127.0.0.1 when
    every rank is on this node. Ranks on several nodes without it get ``MPI_RENDEZVOUS`` where
    mpi4py is installed (rank 0's address and a port travel over MPI at set-up; ``master_port``
    is then ``MASTER_PORT`` or None), and an error naming both fixes where it is not. The port is
    otherwise ``MASTER_PORT``, else ``text_port`` of the job id, which is the same on every rank
    of one job, else 29500.
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

            >>> from torchmn.environments import OpenMPIEnvironment
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

        Example::

            >>> from torchmn.environments import OpenMPIEnvironment
            >>> OpenMPIEnvironment.job_label({"OMPI_MCA_ess_base_jobid": "2089418753"})
            'openmpi job 2089418753'
        """
        job = cls.job_id(env)
        return f"{cls.source} job {job}" if job else None

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place, from the launcher's variables; see ``Environment.read``.

        Args:
            env: the environment: the four variables of ``names``, the job id's variables
                (``job_id_names``), and optionally ``MASTER_ADDR`` and ``MASTER_PORT``.

        Returns:
            The place, with ``node_rank`` None. ``master_addr`` is ``MASTER_ADDR``, else 127.0.0.1
            when every rank is on this node, else ``MPI_RENDEZVOUS`` where mpi4py is installed (its
            port then ``MASTER_PORT`` or None). The port is otherwise ``MASTER_PORT``, else
            ``text_port`` of the job id, else 29500.

        Raises:
            ValueError: one of the four variables is missing or not an integer, the values do not
                fit together, or ``MASTER_PORT`` is not a port number.
            RuntimeError: the ranks span several nodes, ``MASTER_ADDR`` is not set and mpi4py is
                not installed (the message names both fixes).

        Example::

            >>> from torchmn.environments import OpenMPIEnvironment
            >>> OpenMPIEnvironment.read({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            ...                          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            ...                          "OMPI_MCA_ess_base_jobid": "2089418753"}).describe()
            'openmpi: rank 1/2, local 1/2, node None, rendezvous 127.0.0.1:25854'
        """
        job_id = cls.job_id(env)
        derived = text_port(job_id) if job_id is not None else DEFAULT_PORT
        spanning = MPI_RENDEZVOUS if mpi4py_installed() else None
        place = read_ranks(env, cls.source, cls.names, cls.fix, MPI_HINT, derived_port=derived,
                           spanning_addr=spanning)
        if place.master_addr == MPI_RENDEZVOUS:
            # Rank 0 opens its store on a port its system picks, unless one is asked for.
            place = dataclasses.replace(place, master_port=master_port(env, None))
        return place
