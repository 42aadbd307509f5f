"""The gradient-averaging algorithms by name: what ``create_communicator(name)`` builds (a split
communicator keeps its parent's class)."""
from __future__ import annotations

import os

from torchmn.communicators import shm
from torchmn.communicators.communicator import Communicator
from torchmn.communicators.flat import FlatCommunicator
from torchmn.communicators.hierarchical import HierarchicalCommunicator
from torchmn.communicators.naive import NaiveCommunicator
from torchmn.errors import TorchmnValueError

ALGORITHMS: dict[str, type[Communicator]] = {
    cls.name: cls for cls in (NaiveCommunicator, FlatCommunicator, HierarchicalCommunicator)}
# ChainerMN's names, each taken as the nearest algorithm here (docs/coming-from-chainermn.md says how
# they differ): pure_nccl was one NCCL allreduce over every rank; two_dimensional summed inside each
# node, then across nodes; single_node used the node's own fast path (hierarchical also spans nodes);
# non_cuda_aware staged GPU buffers through the host for MPI, where gloo and shared memory serve here.
CHAINERMN_NAMES = {"pure_nccl": "flat", "two_dimensional": "hierarchical", "single_node": "hierarchical",
                   "non_cuda_aware": "hierarchical"}


def resolve(name: str, backend: str = "gloo", size: int = 1) -> type[Communicator]:
    """The communicator class for algorithm ``name``.

    Args:
        name: ``"naive"``, ``"flat"``, ``"hierarchical"`` or ``"auto"``; or one of ChainerMN's
            names (``CHAINERMN_NAMES``), taken as the nearest of these.
        backend: the tensor backend, which ``"auto"`` decides by.
        size: the number of ranks, which ``"auto"`` decides by.

    Returns:
        The class. ``"auto"`` is ``hierarchical`` with several ranks where shared memory exists
        (gloo's TCP loopback is the bottleneck inside a node; under NCCL it serves CPU tensors, and
        CUDA tensors take its flat way, as NCCL already averages through NVLink/PCIe inside a node
        and the network across nodes), else ``flat``.

    Raises:
        ValueError: an unknown name, or ``"pure_nccl"`` without the NCCL backend.

    Example::

        >>> resolve("auto", "gloo", 4).name
        'hierarchical'
        >>> resolve("two_dimensional", "gloo", 4).name
        'hierarchical'
    """
    if name == "pure_nccl" and backend != "nccl":
        raise TorchmnValueError(
            f"communicator 'pure_nccl' averages through NCCL, which needs a GPU per rank, but this job's backend is "
            f"{backend} (CPU tensors). Use create_communicator() ('auto': shared memory inside a node, then the "
            f"network) or 'hierarchical'; on a machine with GPUs, pass backend='nccl' or let 'auto' choose.")
    name = CHAINERMN_NAMES.get(name, name)
    if name == "auto":
        # Under NCCL too: CUDA tensors take the flat way through NCCL, CPU tensors (a CPU model on
        # a machine with GPUs) the node's shared memory.
        if size > 1 and os.path.isdir(shm.SHM_DIR):
            return HierarchicalCommunicator
        return FlatCommunicator
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise TorchmnValueError(f"unknown communicator {name!r}; choose one of: auto, "
                                f"{', '.join(ALGORITHMS)} (or ChainerMN's {', '.join(CHAINERMN_NAMES)})") from None


def make_communicator(name: str, **kwargs) -> Communicator:
    """Build the communicator class for ``name`` over process groups that already exist.

    What ``split`` does for its sub-communicators; tests use it for a world of one without
    ``torch.distributed``.

    Args:
        name: the algorithm, as for :func:`resolve`.
        **kwargs: the constructor's arguments (``rank``, ``size``, ``group``, ``obj_group``,
            ``backend``, ``node_key``, ...).

    Returns:
        The communicator.

    Example::

        >>> solo = make_communicator("naive", rank=0, size=1, group=None, obj_group=None,
        ...                          backend="gloo", node_key=0)
    """
    return resolve(name, kwargs.get("backend", "gloo"), kwargs.get("size", 1))(**kwargs)
