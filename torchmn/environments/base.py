"""What a launcher tells a process about its place in the job, and the interface of a launcher."""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

# Variables `torchmn run` sets for every rank. It also sets torchrun's names (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) so that plain
# torch.distributed scripts work under it with init_method="env://".
TORCHMN_RANK = "TORCHMN_RANK"
TORCHMN_SIZE = "TORCHMN_SIZE"
TORCHMN_LOCAL_RANK = "TORCHMN_LOCAL_RANK"
TORCHMN_LOCAL_SIZE = "TORCHMN_LOCAL_SIZE"
TORCHMN_NODE_RANK = "TORCHMN_NODE_RANK"
TORCHMN_NODE_COUNT = "TORCHMN_NODE_COUNT"
TORCHMN_HOST = "TORCHMN_HOST"


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """A process's place in the job, as its launcher described it.

    ``node_rank`` is the launcher's index of this process's node when the launcher names nodes
    (Slurm's node id, torchrun's group rank, ``torchmn run``'s host index); ``None`` when it does not
    (MPI), in which case the communicator groups ranks by hostname.

    Example::

        >>> from torchmn.environments import detect_environment
        >>> env = detect_environment()
        >>> env.source, env.rank, env.size
        ('single', 0, 1)
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: Optional[int]
    master_addr: str
    master_port: Optional[int]
    source: str

    def describe(self) -> str:
        """One line for logs and error messages.

        Returns:
            ``source: rank R/N, local L/M, node K, rendezvous ADDR:PORT``.

        Example::

            >>> LaunchEnvironment(0, 2, 0, 2, 0, "127.0.0.1", 29500, "torchmn").describe()
            'torchmn: rank 0/2, local 0/2, node 0, rendezvous 127.0.0.1:29500'
        """
        return (f"{self.source}: rank {self.rank}/{self.size}, local {self.local_rank}/{self.local_size}, "
                f"node {self.node_rank}, rendezvous {self.master_addr}:{self.master_port}")


class Environment:
    """One kind of launcher. Subclasses read its variables; ``detect`` says whether it started us."""

    source: str = ""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether this launcher started the process whose environment is ``env``.

        Args:
            env: the environment.

        Returns:
            True when the launcher's variables are there.

        Raises:
            NotImplementedError: on ``Environment`` itself; each launcher's class defines it.

        Example::

            >>> from torchmn.environments import TorchrunEnvironment
            >>> TorchrunEnvironment.detect({"TORCHELASTIC_RUN_ID": "none", "RANK": "0"})
            True
        """
        raise NotImplementedError

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place in the job, from the launcher's variables.

        Args:
            env: the environment.

        Returns:
            The place; ``source`` is the class's ``source``.

        Raises:
            ValueError: a variable is missing, malformed or does not fit the others.
            RuntimeError: the rendezvous address cannot be known.
            NotImplementedError: on ``Environment`` itself; each launcher's class defines it.

        Example::

            >>> from torchmn.environments import TorchmnEnvironment
            >>> TorchmnEnvironment.read({"TORCHMN_RANK": "0", "TORCHMN_SIZE": "4", "TORCHMN_LOCAL_RANK": "0",
            ...                          "TORCHMN_LOCAL_SIZE": "2", "TORCHMN_NODE_RANK": "0",
            ...                          "MASTER_ADDR": "node1", "MASTER_PORT": "29511"}).describe()
            'torchmn: rank 0/4, local 0/2, node 0, rendezvous node1:29511'
        """
        raise NotImplementedError


def environ(env: Optional[Mapping[str, str]] = None) -> Mapping[str, str]:
    """``env``, or ``os.environ`` when it is None.

    Args:
        env: an environment, or None.

    Returns:
        The environment to read: ``env`` itself, or the live ``os.environ`` (not a copy).

    Example::

        >>> environ({"RANK": "1"})
        {'RANK': '1'}
        >>> environ() is os.environ
        True
    """
    return os.environ if env is None else env
