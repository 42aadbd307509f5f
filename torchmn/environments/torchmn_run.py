"""Ranks started by ``torchmn run``: its ``TORCHMN_*`` variables."""
from __future__ import annotations

from typing import Mapping

from torchmn.environments.base import (
    TORCHMN_LOCAL_RANK,
    TORCHMN_LOCAL_SIZE,
    TORCHMN_NODE_RANK,
    TORCHMN_RANK,
    TORCHMN_SIZE,
    Environment,
    LaunchEnvironment,
)
from torchmn.environments.mpich import MPICHEnvironment
from torchmn.environments.openmpi import OpenMPIEnvironment
from torchmn.environments.torchrun import TorchrunEnvironment
from torchmn.environments.variables import read_ranks


class TorchmnEnvironment(Environment):
    """Started by ``torchmn run``: ``TORCHMN_RANK``, ``TORCHMN_SIZE``, ``TORCHMN_LOCAL_RANK``,
    ``TORCHMN_LOCAL_SIZE``, ``TORCHMN_NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.

    Example::

        >>> TorchmnEnvironment.read({"TORCHMN_RANK": "1", "TORCHMN_SIZE": "2", "TORCHMN_LOCAL_RANK": "1",
        ...                          "TORCHMN_LOCAL_SIZE": "2", "MASTER_PORT": "29511"}).describe()
        'torchmn: rank 1/2, local 1/2, node None, rendezvous 127.0.0.1:29511'
    """

    source = "torchmn"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether ``torchmn run`` started this process; see ``Environment.detect``.

        Args:
            env: the environment.

        Returns:
            True when ``TORCHMN_RANK`` is set, and no launcher a rank of ``torchmn run`` started
            has started this process: torchrun gives ``RANK`` and ``WORLD_SIZE`` values of its
            own, mpirun or mpiexec a world of several (``torchmn run``
            refuses to start as one of several MPI processes). Such a process inherited the rank's
            ``TORCHMN_*`` variables; its own launcher's tell its place.

        Example::

            >>> TorchmnEnvironment.detect({"TORCHMN_RANK": "0"}), TorchmnEnvironment.detect({"RANK": "0"})
            (True, False)
            >>> TorchmnEnvironment.detect({"TORCHMN_RANK": "0", "TORCHMN_SIZE": "1", "TORCHELASTIC_RUN_ID": "x",
            ...                            "RANK": "1", "WORLD_SIZE": "2"})
            False
        """
        if TORCHMN_RANK not in env:
            return False
        if TorchrunEnvironment.detect(env) and any(env.get(name) != env.get(mine) for name, mine in (
                ("RANK", TORCHMN_RANK), ("WORLD_SIZE", TORCHMN_SIZE))):
            return False
        for mpi in (OpenMPIEnvironment, MPICHEnvironment):  # srun --mpi=pmi2's PMI_* are neither
            if mpi.detect(env) and env.get(mpi.names[1], "1").strip() not in ("", "0", "1"):  # its size
                return False
        return True

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place, from ``torchmn run``'s variables; see ``Environment.read``.

        Args:
            env: the environment: ``TORCHMN_RANK``, ``TORCHMN_SIZE``, ``TORCHMN_LOCAL_RANK``,
                ``TORCHMN_LOCAL_SIZE``, and optionally ``TORCHMN_NODE_RANK``, ``MASTER_ADDR``,
                ``MASTER_PORT``.

        Returns:
            The place, with ``source`` ``"torchmn"``; ``node_rank`` is ``TORCHMN_NODE_RANK`` (None
            when unset), the port is ``MASTER_PORT`` (None when unset).

        Raises:
            ValueError: one of the four variables is missing or not an integer,
                ``TORCHMN_NODE_RANK`` is negative, the values do not fit together, or
                ``MASTER_PORT`` is not a port number.
            RuntimeError: ``MASTER_ADDR`` is not set and the ranks span several nodes.

        Example::

            >>> TorchmnEnvironment.read({"TORCHMN_RANK": "0", "TORCHMN_SIZE": "4", "TORCHMN_LOCAL_RANK": "0",
            ...                          "TORCHMN_LOCAL_SIZE": "2", "TORCHMN_NODE_RANK": "0",
            ...                          "MASTER_ADDR": "node1", "MASTER_PORT": "29511"}).describe()
            'torchmn: rank 0/4, local 0/2, node 0, rendezvous node1:29511'
        """
        return read_ranks(env, cls.source, (TORCHMN_RANK, TORCHMN_SIZE, TORCHMN_LOCAL_RANK, TORCHMN_LOCAL_SIZE),
                          "these are set by `torchmn run`; do not set them by hand",
                          "`torchmn run` always sets it; was the variable removed?", TORCHMN_NODE_RANK)
