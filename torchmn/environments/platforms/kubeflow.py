"""Kubeflow's PyTorchJob: one pod per node, its place in ``MASTER_ADDR``, ``WORLD_SIZE`` and ``RANK``
(counting pods, not processes), or in torchrun's ``PET_*`` variables."""
from __future__ import annotations

from typing import Mapping

from torchmn.environments.platforms.base import NodePlace, Platform, PlatformError, integer


class KubeflowPlatform(Platform):
    """A PyTorchJob pod (Kubeflow's training operator).

    The operator gives every pod ``MASTER_ADDR`` (``<job>-master-0``), ``MASTER_PORT``,
    ``WORLD_SIZE`` (the pods) and ``RANK`` (this pod's index); with ``nprocPerNode`` or an elastic
    policy also ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR`` and
    ``PET_MASTER_PORT``, which win. Detected by ``PET_NNODES``, or by ``WORLD_SIZE`` and ``RANK``
    inside Kubernetes (``KUBERNETES_SERVICE_HOST``) without torchrun's ``LOCAL_RANK``.

    Example::

        >>> place = KubeflowPlatform.read({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0",
        ...                                "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"})
        >>> place.nnodes, place.node_rank, place.master_addr, place.master_port
        (2, 1, 'job-master-0', 23456)
    """

    name = "Kubeflow PyTorchJob"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether the training operator started this pod; see ``Platform.detect``.

        Args:
            env: the environment.

        Returns:
            True with ``PET_NNODES``, or with ``WORLD_SIZE``, ``RANK`` and ``KUBERNETES_SERVICE_HOST``
            and without ``LOCAL_RANK``.

        Example::

            >>> KubeflowPlatform.detect({"PET_NNODES": "2"}), KubeflowPlatform.detect({"RANK": "0"})
            (True, False)
        """
        return "PET_NNODES" in env or (
            "KUBERNETES_SERVICE_HOST" in env and "WORLD_SIZE" in env and "RANK" in env and "LOCAL_RANK" not in env)

    @classmethod
    def read(cls, env: Mapping[str, str]) -> NodePlace:
        """This pod's place; see ``Platform.read``.

        Args:
            env: the environment.

        Returns:
            The place; ``nproc_per_node`` from a numeric ``PET_NPROC_PER_NODE``.

        Raises:
            PlatformError: a variable is not an integer, or ``PET_NNODES`` is a range
                (``min:max``, an elastic policy), which one launcher per node does not follow.

        Example::

            >>> KubeflowPlatform.read({"PET_NNODES": "1:4", "PET_NODE_RANK": "0"})
            Traceback (most recent call last):
            torchmn.environments.platforms.base.PlatformError: Kubeflow PyTorchJob: PET_NNODES='1:4' is a range of nodes (an elastic policy); torchmn run starts one job of a fixed number of nodes: set minReplicas equal to maxReplicas (or drop the elastic policy)
        """
        names = {}
        if "PET_NNODES" in env:
            text = env["PET_NNODES"]
            low, _, high = text.partition(":")
            if high and low != high:
                raise PlatformError(f"{cls.name}: PET_NNODES={text!r} is a range of nodes (an elastic policy); "
                                    f"torchmn run starts one job of a fixed number of nodes: set minReplicas equal "
                                    f"to maxReplicas (or drop the elastic policy)")
            nnodes = integer({"PET_NNODES": low}, "PET_NNODES", cls.name, 1)
            node_rank = integer(env, "PET_NODE_RANK", cls.name)
            names.update(nnodes="PET_NNODES", node_rank="PET_NODE_RANK")
        else:
            nnodes = integer(env, "WORLD_SIZE", cls.name, 1)
            node_rank = integer(env, "RANK", cls.name)
            names.update(nnodes="WORLD_SIZE", node_rank="RANK")
        addr_name = "PET_MASTER_ADDR" if env.get("PET_MASTER_ADDR") else "MASTER_ADDR"
        port_name = "PET_MASTER_PORT" if env.get("PET_MASTER_PORT") else "MASTER_PORT"
        port = integer(env, port_name, cls.name, 1) if env.get(port_name) else None
        nproc = env.get("PET_NPROC_PER_NODE", "")
        names.update(master_addr=addr_name, master_port=port_name)
        return NodePlace(nnodes, node_rank, env.get(addr_name) or None, port,
                         int(nproc) if nproc.isdigit() else None, cls.name, names)
