"""Ranks started by torchrun / torchelastic: its ``RANK``, ``WORLD_SIZE``, ... variables."""
from __future__ import annotations

from typing import Mapping

from torchmn.environments.base import Environment, LaunchEnvironment
from torchmn.environments.variables import read_ranks


class TorchrunEnvironment(Environment):
    """Started by torchrun / torchelastic: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node index), ``MASTER_ADDR``, ``MASTER_PORT``.

    Detected by ``TORCHELASTIC_RUN_ID``, which torchrun gives every worker. The same variables set
    by hand are ``EnvMethodEnvironment``'s, read after Slurm and MPI, whose tasks may inherit them from a
    batch script.

    Example::

        >>> TorchrunEnvironment.read({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
        ...                           "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}).node_rank
        0
    """

    source = "torchrun"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether torchrun started this process; see ``Environment.detect``.

        Args:
            env: the environment.

        Returns:
            True when ``TORCHELASTIC_RUN_ID`` is set (``RANK`` and the rest alone are
            ``EnvMethodEnvironment``'s).

        Example::

            >>> TorchrunEnvironment.detect({"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "1"})
            True
            >>> TorchrunEnvironment.detect({"RANK": "0", "WORLD_SIZE": "1"})
            False
        """
        return "TORCHELASTIC_RUN_ID" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place, from torchrun's variables; see ``Environment.read``.

        Args:
            env: the environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
                and optionally ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.

        Returns:
            The place, with ``source`` ``"torchrun"``; ``node_rank`` is ``GROUP_RANK`` (None when
            unset), the port is ``MASTER_PORT`` (None when unset).

        Raises:
            ValueError: one of the four variables is missing or not an integer, ``GROUP_RANK`` is
                negative, the values do not fit together, or ``MASTER_PORT`` is not a port number.
            RuntimeError: ``MASTER_ADDR`` is not set and the ranks span several nodes.

        Example::

            >>> TorchrunEnvironment.read({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            ...                           "GROUP_RANK": "0", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}).describe()
            'torchrun: rank 1/2, local 1/2, node 0, rendezvous n1:29500'
        """
        return read_ranks(env, cls.source, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                          "torchrun sets it; was it overridden?", "torchrun sets it; was it unset?",
                          "GROUP_RANK")
