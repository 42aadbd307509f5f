"""SkyPilot: the task's ``run`` section runs once per node, with ``SKYPILOT_NODE_RANK``,
``SKYPILOT_NODE_IPS`` and ``SKYPILOT_NUM_NODES``."""
from __future__ import annotations

from typing import Mapping

from torchmn.environments.platforms.base import NodePlace, Platform, PlatformError, integer


class SkyPilotPlatform(Platform):
    """A node of a SkyPilot cluster running the task's ``run`` section.

    ``SKYPILOT_NODE_IPS`` holds one address per line, the head node's first; it hosts the
    rendezvous, on ``MASTER_PORT`` when set (else the default port).

    Example::

        >>> SkyPilotPlatform.read({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2",
        ...                        "SKYPILOT_NODE_IPS": "10.0.0.1\\n10.0.0.2\\n"}).master_addr
        '10.0.0.1'
    """

    name = "SkyPilot"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether SkyPilot started this node's command; see ``Platform.detect``.

        Args:
            env: the environment.

        Returns:
            True with ``SKYPILOT_NODE_RANK``.

        Example::

            >>> SkyPilotPlatform.detect({"SKYPILOT_NODE_RANK": "0"})
            True
        """
        return "SKYPILOT_NODE_RANK" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> NodePlace:
        """This node's place; see ``Platform.read``.

        Args:
            env: the environment.

        Returns:
            The place.

        Raises:
            PlatformError: a variable is not an integer, ``SKYPILOT_NODE_IPS`` is empty, or it
                lists fewer addresses than ``SKYPILOT_NUM_NODES``.

        Example::

            >>> SkyPilotPlatform.read({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": ""})
            Traceback (most recent call last):
            torchmn.environments.platforms.base.PlatformError: SkyPilot: SKYPILOT_NODE_IPS is empty; SkyPilot lists the nodes' addresses there, one per line, the head node's first: run torchmn run from the task's run section
        """
        nnodes = integer(env, "SKYPILOT_NUM_NODES", cls.name, 1)
        node_rank = integer(env, "SKYPILOT_NODE_RANK", cls.name)
        ips = [line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
        if not ips:
            raise PlatformError(f"{cls.name}: SKYPILOT_NODE_IPS is empty; SkyPilot lists the nodes' addresses "
                                f"there, one per line, the head node's first: run torchmn run from the task's run "
                                f"section")
        if len(ips) < nnodes:
            raise PlatformError(f"{cls.name}: SKYPILOT_NODE_IPS lists {len(ips)} address(es) for "
                                f"SKYPILOT_NUM_NODES={nnodes} nodes")
        port = integer(env, "MASTER_PORT", cls.name, 1) if env.get("MASTER_PORT") else None
        gpus = env.get("SKYPILOT_NUM_GPUS_PER_NODE", "")
        return NodePlace(nnodes, node_rank, ips[0], port, int(gpus) if gpus.isdigit() and int(gpus) > 0 else None,
                         cls.name, {"nnodes": "SKYPILOT_NUM_NODES", "node_rank": "SKYPILOT_NODE_RANK",
                                    "master_addr": "SKYPILOT_NODE_IPS", "master_port": "MASTER_PORT"},
                         env.get("SKYPILOT_TASK_ID") or None)
