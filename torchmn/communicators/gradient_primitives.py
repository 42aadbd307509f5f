"""The gradient primitives: what each gradient-averaging algorithm gives the optimizers.

They make no call check (every rank passes the same layout) and return a handle whose ``wait()``
finishes the call (already finished unless ``async_op=True``). Every communicator has them (see
:class:`~torchmn.communicators.communicator_base.CommunicatorBase`).
"""
from __future__ import annotations

import abc

import torch


class GradientPrimitives(abc.ABC):
    """Flat-buffer collectives and shared node memory, for the multi-node optimizers."""

    @property
    @abc.abstractmethod
    def grad_bucket_cap_bytes(self) -> int:
        """Returns: how many bytes of gradients this algorithm fuses into one message (0: one a tensor)."""

    @abc.abstractmethod
    def mean_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor, in place, by its mean over ranks, in this algorithm's way.

        Args:
            tensors: dense tensors, in the same order, shapes and dtypes on every rank.
        """

    @abc.abstractmethod
    def allreduce_flat(self, flat: torch.Tensor, async_op: bool = False, op: str = "sum"):
        """Reduce one contiguous 1-D buffer over all ranks, in place.

        Args:
            flat: a contiguous 1-D tensor, of the same length and dtype on every rank.
            async_op: return at once.
            op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``.

        Returns:
            A handle with ``wait()``.
        """

    @abc.abstractmethod
    def reduce_scatter_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Sum ``flat`` over ranks; rank ``r`` gets elements ``[r*k, (r+1)*k)`` of the sum in ``shard``.

        Args:
            flat: ``size * k`` contiguous elements.
            shard: ``k`` elements, overwritten.
            async_op: return at once.

        Returns:
            A handle with ``wait()``.
        """

    @abc.abstractmethod
    def allgather_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Every rank's ``shard`` (``k`` elements) into ``flat`` (``size * k``, overwritten), in rank order.

        Returns:
            A handle with ``wait()``.
        """

    @abc.abstractmethod
    def open_node_arena(self, shared_bytes: int, region_bytes: int):
        """Memory all ranks share for good (the optimizers keep their buffers there). Collective.

        Args:
            shared_bytes: bytes of the region every rank reads and writes.
            region_bytes: bytes of each rank's own region, readable by the others.

        Returns:
            A :class:`~torchmn.communicators.node_arena.NodeArena`, or None on every rank where
            they cannot share memory (several nodes, GPU, an algorithm without shared memory).
        """

    @abc.abstractmethod
    def may_share_node_memory(self) -> bool:
        """Whether :meth:`open_node_arena` can succeed at all (every rank on one node, an algorithm
        with shared memory); it may still return None where ``/dev/shm`` is too small. No
        communication, the same answer on every rank.

        Returns:
            False where :meth:`open_node_arena` is sure to return None.
        """
