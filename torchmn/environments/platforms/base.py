"""What a platform says about this node's place: the base class of the platforms and the place."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from torchmn.environments.variables import read_int
from torchmn.errors import TorchmnValueError


class PlatformError(TorchmnValueError):
    """A platform's variables are set but cannot be read."""


@dataclasses.dataclass(frozen=True)
class NodePlace:
    """One node's place in a job of one launcher per node.

    Attributes:
        nnodes: the number of nodes.
        node_rank: this node's index, 0 for the node that hosts the rendezvous.
        master_addr: node 0's address; None where this is node 0 and nothing names it.
        master_port: the rendezvous port; None for the default.
        nproc_per_node: the ranks per node the platform asks for, or None.
        source: the platform's name, for messages.
        names: the variables each value came from (``{"node_rank": "SKYPILOT_NODE_RANK"}``).
        run_id: the platform's name for this run, the same on every node and new for each run,
            where it has one (SkyPilot's task id, SageMaker's training job name); None elsewhere.
    """

    nnodes: int
    node_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    nproc_per_node: Optional[int] = None
    source: str = "--nnodes"
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    run_id: Optional[str] = None


class Platform:
    """A platform that starts one agent per node; subclasses read its variables."""

    name = ""

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether this node's agent was started by the platform.

        Args:
            env: the environment.

        Returns:
            The answer, from variables alone.

        Example::

            >>> Platform.detect({})
            False
        """
        return False

    @classmethod
    def read(cls, env: Mapping[str, str]) -> NodePlace:
        """This node's place, from the platform's variables.

        Args:
            env: the environment.

        Returns:
            The place.

        Raises:
            PlatformError: a variable is malformed.

        Example::

            >>> Platform.read({})  # doctest: +SKIP
        """
        raise NotImplementedError


def integer(env: Mapping[str, str], name: str, platform: str, minimum: int = 0) -> int:
    """``env[name]`` as an integer of at least ``minimum``.

    Args:
        env: the environment.
        name: the variable.
        platform: the platform's name, for the message.
        minimum: the smallest value that makes sense.

    Returns:
        The value.

    Raises:
        PlatformError: it is missing, not an integer (``variables.read_int``), or too small.

    Example::

        >>> integer({"N": "2"}, "N", "SkyPilot", 1)
        2
    """
    try:
        value = read_int(env, name, "the platform sets it for every node, so check the job's definition or the "
                                    "variables passed on to torchmn run")
    except TorchmnValueError as e:
        raise PlatformError(f"{platform}: {e}") from None
    if value < minimum:
        raise PlatformError(f"{platform}: {name}={value} must be at least {minimum}")
    return value
