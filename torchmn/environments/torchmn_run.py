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
        """True when ``TORCHMN_RANK`` is set; see ``Environment.detect``."""
        return TORCHMN_RANK in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place, from ``torchmn run``'s variables; see ``Environment.read``."""
        return read_ranks(env, cls.source, (TORCHMN_RANK, TORCHMN_SIZE, TORCHMN_LOCAL_RANK, TORCHMN_LOCAL_SIZE),
                          "these are set by `torchmn run`; do not set them by hand",
                          "`torchmn run` always sets it; was the variable removed?", TORCHMN_NODE_RANK)
