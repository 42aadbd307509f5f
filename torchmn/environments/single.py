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
        """Whether a world of one applies: always, since it is the fallback when no launcher is found.

        See ``Environment.detect``. ``detect_environment`` does not ask it: it reads this class
        only when no launcher in ``ENVIRONMENTS`` says yes.

        Args:
            env: the environment (not looked at).

        Returns:
            True.

        Example::

            >>> SingleEnvironment.detect({})
            True
        """
        return True

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """A world of one process; see ``Environment.read``.

        Args:
            env: the environment; only ``MASTER_ADDR`` and ``MASTER_PORT`` are read.

        Returns:
            Rank 0 of 1, local rank 0 of 1, node 0, with ``source`` ``"single"``; the rendezvous is
            ``MASTER_ADDR`` (else 127.0.0.1) and ``MASTER_PORT`` (else None).

        Raises:
            ValueError: ``MASTER_PORT`` is set but is not a port number.

        Example::

            >>> SingleEnvironment.read({"MASTER_PORT": "29511"}).describe()
            'single: rank 0/1, local 0/1, node 0, rendezvous 127.0.0.1:29511'
        """
        return LaunchEnvironment(0, 1, 0, 1, 0, env.get("MASTER_ADDR") or LOCALHOST,
                                 master_port(env, None), cls.source)
