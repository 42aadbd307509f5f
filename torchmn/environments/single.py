"""No launcher: a world of one process."""
from __future__ import annotations

from typing import Mapping

from torchmn.environments.base import Environment, LaunchEnvironment
from torchmn.environments.variables import LOCALHOST, master_port


class SingleEnvironment(Environment):
    """No launcher: a world of one process on 127.0.0.1 (``MASTER_ADDR``/``MASTER_PORT`` still win).

    Example::

        >>> SingleEnvironment.read({}).describe()
        'single: rank 0/1, local 0/1, node 0, rendezvous 127.0.0.1:None'
    """

    source = "single"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Always True; see ``Environment.detect``."""
        return True

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """A world of one; see ``Environment.read``."""
        return LaunchEnvironment(0, 1, 0, 1, 0, env.get("MASTER_ADDR") or LOCALHOST,
                                 master_port(env, None), cls.source)
