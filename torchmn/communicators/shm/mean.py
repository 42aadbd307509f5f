"""The mean of many tensors over the ranks of one node, through memory they share for good: the
path ``multi_node_mean_grad`` takes on one CPU node, the same the multi-node optimizer takes.

Each rank copies its tensors into its own region of a :class:`NodeArena` (one pass); after a
barrier, each sums its share of every tensor straight from all ranks' regions into the shared
region, divided on the way (one pass over its share); after a second barrier, each copies the
whole mean back into its tensors (one pass). Three passes over the bytes, where packing into a
bucket, a shared-memory allreduce through slots, dividing and unpacking take six.
"""
from __future__ import annotations

from typing import Optional

import torch

from torchmn.communicators.ops import mean_divisors
from torchmn.communicators.shm.arena import NodeArena
from torchmn.communicators.shm.segment import align

# Where the ranks meet in a call (see NodeArena.barrier).
POINTS = ("mean: tensors in", "mean: means ready")


class _Group:
    """The tensors of one dtype in a call: where they lie in every region and in the shared one,
    and the part of them this rank sums."""

    def __init__(self, arena: NodeArena, dtype: torch.dtype, indices: list[int], numels: list[int], offset: int):
        self.indices, self.numels = indices, numels
        n = sum(numels)
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        self.regions = [r[offset:offset + nbytes].view(dtype) for r in arena.regions]
        self.mine = self.regions[arena.local_rank]
        self.shared = arena.shared[offset:offset + nbytes].view(dtype)
        self.results = self.shared.split(numels)
        lo, hi = arena.my_chunk(n, self.shared.element_size())
        self.chunks = [r[lo:hi] for r in self.regions] if hi > lo else None
        self.out = self.shared[lo:hi]
        self.before, self.after = mean_divisors(dtype, arena.local_size)


class NodeMean:
    """Means over the node's ranks of lists of CPU tensors, in an arena kept between calls.

    Build it with :meth:`open` (collective); :meth:`mean_` replaces tensors by their means. Every
    rank must pass tensors of the same layout in the same order (the caller checks).

    Example::

        >>> node_mean = NodeMean.open(comm, NodeMean.nbytes(grads))
        >>> node_mean.mean_(grads)
    """

    def __init__(self, arena: NodeArena, capacity: int):
        """Keep ``arena`` for means of tensors of up to ``capacity`` bytes; :meth:`open` makes both.

        Args:
            arena: an arena opened with this module's ``POINTS``, whose shared region and each
                rank's region hold ``capacity`` bytes.
            capacity: the bytes (:meth:`nbytes`) of the largest list of tensors it takes.

        Example::

            >>> node_mean = NodeMean(comm.open_node_arena(nbytes, nbytes, points=POINTS), nbytes)
        """
        self.arena = arena
        self.capacity = capacity
        self._plan_key = None
        self._plan: list[_Group] = []

    @staticmethod
    def _groups(tensors: list[torch.Tensor]) -> dict:
        groups: dict = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        return groups

    @classmethod
    def nbytes(cls, tensors: list[torch.Tensor]) -> int:
        """The bytes a region needs for ``tensors``: one run per dtype, each cache-line aligned.

        Args:
            tensors: the tensors whose means will be taken.

        Returns:
            The sum over dtypes of their bytes, each rounded up to a multiple of 64.

        Example::

            >>> NodeMean.nbytes([torch.zeros(10), torch.zeros(3, dtype=torch.float64)])
            128
        """
        return sum(align(sum(tensors[i].numel() * tensors[i].element_size() for i in idx))
                   for idx in cls._groups(tensors).values())

    @classmethod
    def open(cls, comm, nbytes: int) -> Optional["NodeMean"]:
        """Map an arena for tensors of up to ``nbytes`` (collective on the node's ranks).

        Args:
            comm: a communicator of one node that can share memory (``open_node_arena``).
            nbytes: the bytes the tensors take, from :meth:`nbytes`.

        Returns:
            The NodeMean, or None on every rank where the arena cannot be had (several nodes,
            GPU, too little /dev/shm).

        Example::

            >>> grads = [p.grad for p in model.parameters()]
            >>> node_mean = NodeMean.open(comm, NodeMean.nbytes(grads))   # comm: hierarchical, one node
        """
        arena = comm.open_node_arena(nbytes, nbytes, points=POINTS)
        return cls(arena, nbytes) if arena is not None else None

    def _plan_for(self, tensors: list[torch.Tensor]) -> list[_Group]:
        key = tuple((t.numel(), t.dtype) for t in tensors)
        if key != self._plan_key:
            plan, offset = [], 0
            for dtype, idx in self._groups(tensors).items():
                numels = [tensors[i].numel() for i in idx]
                plan.append(_Group(self.arena, dtype, idx, numels, offset))
                offset += align(sum(numels) * tensors[idx[0]].element_size())
            self._plan_key, self._plan = key, plan
        return self._plan

    def mean_(self, tensors: list[torch.Tensor]) -> None:
        """Replace each (contiguous CPU) tensor by its mean over the node's ranks.

        Sums go in rank order, so every rank gets the same bits; float16 and bfloat16 values are
        divided before they are summed, so that the sum cannot overflow.

        Args:
            tensors: this rank's tensors, of the layout every rank passes, within the capacity.

        Raises:
            CollectiveMismatchError: a rank reached one of the barriers from another point.
            PeerLostError: a rank of the node exited, or did not come within the timeout.

        Example::

            >>> node_mean.mean_([p.grad for p in model.parameters()])
        """
        arena = self.arena
        plan = self._plan_for(tensors)
        for g in plan:
            parts = [tensors[i].view(-1) for i in g.indices]
            if len(parts) == 1:
                g.mine.copy_(parts[0])
            else:
                torch.cat(parts, out=g.mine)
            if g.before > 1:  # float16/bfloat16: a sum of several ranks' values could overflow
                g.mine.mul_(1.0 / g.before)
        arena.barrier("mean: tensors in")
        for g in plan:
            if g.chunks is None:
                continue
            torch.add(g.chunks[0], g.chunks[1], out=g.out)
            for peer in g.chunks[2:]:
                g.out.add_(peer)
            if g.after > 1:  # exact where it is a power of two, else a true division
                g.out.mul_(1.0 / g.after) if g.after & (g.after - 1) == 0 else g.out.div_(g.after)
        arena.barrier("mean: means ready")
        for g in plan:
            for i, result in zip(g.indices, g.results):
                tensors[i].view(-1).copy_(result)

    def close(self) -> None:
        """Unmap the arena; the NodeMean cannot be used afterwards.

        Example::

            >>> node_mean.close()
        """
        self.arena.close()
