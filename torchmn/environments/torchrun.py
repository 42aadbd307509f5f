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
        """True when ``TORCHELASTIC_RUN_ID`` is set; see ``Environment.detect``."""
        return "TORCHELASTIC_RUN_ID" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place, from torchrun's variables; see ``Environment.read``."""
        return read_ranks(env, cls.source, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
                          "torchrun sets it; was it overridden?", "torchrun sets it; was it unset?",
                          "GROUP_RANK")
