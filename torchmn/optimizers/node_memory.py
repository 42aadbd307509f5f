"""The optimizers' path through the node's shared memory, where all ranks are on one node (CPU).

Both optimizers put their gradient buffers in a :class:`~torchmn.communicators.shm.arena.NodeArena`
(:func:`open_bucket_arena`): each rank's buffer is readable by the others, so a reduction is each
rank summing its part straight from them, with no copy through a collective. The sharded optimizer
also keeps the parameters there, once per node; :class:`NodeShards` is a shard bucket's part of it.
"""
from __future__ import annotations

from typing import Optional

import torch

from torchmn.communicators import Communicator
from torchmn.communicators.shm import sum_into
from torchmn.optimizers.memory_order import elements, shaped

# The points where the ranks of a node meet in an optimizer's arena (NodeArena.barrier: ranks that
# reach one barrier from different points raise, naming both). The sharded optimizer's first
# barrier of a step says how many backward passes sent gradients since the last step (at most 3),
# so that a rank that skipped a step() is told apart.
STEP_AFTER_SENDS = ("step() after 0 backward passes that sent gradients",
                    "step() after 1 backward pass that sent gradients",
                    "step() after 2 backward passes that sent gradients",
                    "step() after 3 or more backward passes that sent gradients")
ARENA_POINTS = ("set-up", "backward done (gradients in)", "averaged gradients ready",
                "step done (shards updated)", "state loaded") + STEP_AFTER_SENDS


def arena_layout(nbytes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of buffers packed into one shared-memory region, each on its own cache lines.

    Args:
        nbytes: each buffer's size in bytes.

    Returns:
        The offsets, and the region's size.

    Example::

        >>> arena_layout([10, 100])
        ([0, 64], 192)
    """
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += -(-n // 64) * 64
    return offsets, total


def open_bucket_arena(comm: Communicator, nbytes: list[int]):
    """Shared memory for buffers of ``nbytes`` each, in the shared region and in every rank's own.

    Collective.

    Args:
        comm: the communicator.
        nbytes: each buffer's size in bytes.

    Returns:
        ``(arena, offsets)``, or None where the ranks cannot share memory (several nodes, GPU, a
        small ``/dev/shm``): the caller then takes the path through collectives. ``offsets``
        are the buffers' byte offsets, the same in the shared region and in every rank's
        (:func:`arena_layout`).

    Example::

        >>> opened = open_bucket_arena(comm, [b.numel * b.params[0].element_size() for b in buckets])
        >>> if opened is not None:
        ...     arena, offsets = opened
    """
    offsets, total = arena_layout(nbytes)
    arena = comm.open_node_arena(shared_bytes=total, region_bytes=total, points=ARENA_POINTS)
    return None if arena is None else (arena, offsets)


def region_view(region: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A typed view into a shared-memory region.

    Args:
        region: a uint8 tensor.
        offset: the view's first byte.
        numel: its elements.
        dtype: its dtype.

    Returns:
        ``numel`` elements of ``dtype`` at byte ``offset`` of ``region``: the same memory, so
        writes go to the region, but a storage of its own that spans only those bytes, so that
        ``torch.save`` of a parameter (``model.state_dict()``) writes its buffer, not the whole
        region with every bucket's optimizer state.

    Example::

        >>> region_view(arena.shared, 64, 10, torch.float32).shape      # 10 floats from byte 64
        torch.Size([10])
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    # numpy's view of the slice keeps the region alive, and from_numpy's storage covers the slice only.
    return torch.from_numpy(region[offset:offset + numel * itemsize].numpy()).view(dtype)


def place_buckets(arena, buckets: list, shared_offsets: list, region_offsets: list, rank: int) -> None:
    """Put shard buckets in a node's arena: each one's parameters at its offset in the shared
    region (rank 0 writes the already broadcast values, the others find them there), and its
    gradient buffer at its offset in every rank's region (``bucket.node``, a :class:`NodeShards`).

    Args:
        arena: the :class:`~torchmn.communicators.shm.arena.NodeArena`.
        buckets: the :class:`~torchmn.optimizers.shard_layout.ShardBucket` objects.
        shared_offsets: each bucket's byte offset in the shared region.
        region_offsets: each bucket's byte offset in a rank's region.
        rank: this rank.

    Example::

        >>> arena, offsets = open_bucket_arena(comm, [b.region_numel * b.itemsize for b in buckets])
        >>> place_buckets(arena, buckets, offsets, offsets, comm.rank)
    """
    for b, shared_at, region_at in zip(buckets, shared_offsets, region_offsets):
        b.place(region_view(arena.shared, shared_at, b.padded, b.dtype), fill=rank == 0)
        regions = [region_view(region, region_at, b.region_numel, b.dtype) for region in arena.regions]
        b.node = NodeShards(b, regions[arena.local_rank], regions, arena.local_rank)


def sum_scaled(out: torch.Tensor, others: list[torch.Tensor], mine: Optional[torch.Tensor], scale: float) -> None:
    """``out`` = the other ranks' parts plus this rank's times ``scale``, in one pass where there
    is one other rank.

    Args:
        out: where the sum goes.
        others: the other ranks' parts, added in rank order (as :func:`shm.sum_into` does).
        mine: this rank's part, or None where it has none; it may be ``out`` itself (kept
            gradients, ``zero_grad(set_to_none=False)``, accumulate where the sum goes).
        scale: the factor for ``mine`` (the others' parts are scaled already).

    Example::

        >>> sum_scaled(out, [peer[lo:hi] for peer in others], p.grad.reshape(-1)[lo:hi], 1.0 / comm.size)
    """
    if mine is None:
        sum_into(out, others)
    elif len(others) == 1:
        torch.add(others[0], mine, alpha=scale, out=out)
    elif mine.data_ptr() == out.data_ptr():  # scaled in place first, or the sum would overwrite it
        out.mul_(scale)
        for other in others:
            out.add_(other)
    else:
        sum_into(out, others)
        out.add_(mine, alpha=scale)


class NodeShards:
    """A shard bucket's gradients in the node's shared memory: the reduce-scatter becomes each
    rank summing its own slices straight from every rank's buffer.

    The copies and sums are planned once here: they run every step, between backward and
    forward, when each line of Python costs several times what it does warm. A slice that is a
    whole parameter is shaped like it, so that its gradient goes in as it is.

    Args:
        bucket: the :class:`~torchmn.optimizers.shard_layout.ShardBucket`.
        region: this rank's gradient buffer (``bucket.region_numel`` elements).
        peer_regions: every rank's gradient buffer, this rank's at ``own_index``.
        own_index: this rank's place among them.
    """

    def __init__(self, bucket, region: torch.Tensor, peer_regions: list[torch.Tensor], own_index: int):
        self.bucket = b = bucket
        r = b.rank
        self.flags = region[b.padded:]
        others = [g for j, g in enumerate(peer_regions) if j != own_index]
        self.all_flags = [g[b.padded:] for g in peer_regions]

        def view(buffer, p, at, start, end):
            v = buffer[at + start:at + end]
            return (shaped(v, p), None, None) if end - start == p.numel() else (v, start, end)

        self.pack_plan, self.sum_plan = [], []
        self.mine_in_own = []  # this rank's slice of each parameter in its own buffer: where its sums go
        for i, (p, off, k, (lo, hi)) in enumerate(zip(b.params, b.offsets, b.ks, b.slices)):
            n = p.numel()
            # The parts of the gradient that other ranks own go to this rank's buffer, at their place.
            for start, end in ((0, lo), (hi, n)) if lo < hi else ((0, n),):
                if start < end:
                    self.pack_plan.append((i,) + view(region, p, off, start, end))
            self.mine_in_own.append(region[off + r * k:off + (r + 1) * k])
            # The real elements only: padding is 0 in every buffer (never written), so in the sums too.
            if lo < hi:  # the other ranks' copies of this slice, and where the sum goes
                self.sum_plan.append((i, lo, hi, [g[off + r * k:off + r * k + hi - lo] for g in others],
                                      self.mine_in_own[-1][:hi - lo]))
        self.flags_written = None
        # Each parameter's whole gradient in this rank's buffer: after average_for_all, its average.
        self.averages = [shaped(region[off:off + p.numel()], p) for p, off in zip(b.params, b.offsets)]
        self.counts = None

    def pack_for_peers(self, scale: float) -> None:
        """Copy, times ``scale``, the parts of the gradients that other ranks own into this rank's
        shared buffer (the part in this rank's own slices stays in ``.grad``), and say which
        gradients this rank has.

        Args:
            scale: ``1 / size``, so that the sums are means.

        Example::

            >>> bucket.node.pack_for_peers(1.0 / comm.size)     # as backward hands the bucket over
        """
        b = self.bucket
        b.remember_grads()
        packed = b.packed
        for i, view, start, end in self.pack_plan:
            g = packed[i]
            if g is None:
                view.zero_()
            else:
                torch.mul(g if start is None else elements(g, b.params[i])[start:end], scale, out=view)
        if b.present != self.flags_written:  # they stay in shared memory from one step to the next
            self.flags.copy_(torch.tensor(b.present, dtype=self.flags.dtype))
            self.flags_written = b.present

    def sum_shard_of_peers(self, scale: float) -> None:
        """This rank's slices of the node's gradient sum, as the shard parameters' gradients: the
        other ranks' parts, read from their shared buffers (already times ``scale``), plus this
        rank's own part times ``scale``. A parameter no rank has a gradient for gets None, and
        the optimizer leaves it alone, as in one process.

        The sums go to this rank's own slices of its own buffer, lines that no other rank reads or
        writes: they last until this rank's next sum (``clip_grad_norm_`` before a skipped step
        needs that), and the other ranks' next copies never have to take back lines this rank
        wrote (summing in place into another rank's copy instead measured slower).

        Call it once every rank has packed (after the barrier that says so).

        Args:
            scale: ``1 / size``, for this rank's own part (the others' are scaled already).

        Example::

            >>> arena.barrier(STEP_AFTER_SENDS[1])            # every rank's gradients are in
            >>> for b in buckets: b.node.sum_shard_of_peers(1.0 / comm.size)
        """
        self._sum_slices(scale, share=False)
        self.bucket.set_grads(self.mine_in_own, self._counts())

    def _sum_slices(self, scale: float, share: bool) -> None:
        """Each of this rank's slices: the sum of every rank's part, into this rank's buffer, and
        with ``share`` copied at once (while still in cache) into every other rank's buffer."""
        packed, params = self.bucket.packed, self.bucket.params
        for i, lo, hi, others, out in self.sum_plan:
            g = packed[i]
            sum_scaled(out, others, None if g is None else elements(g, params[i])[lo:hi], scale)
            if share:
                for other in others:
                    other.copy_(out)

    def _counts(self):
        """How many ranks have each gradient, or None where this rank has them all (then every
        count is >= 1, and the flags need not be read)."""
        b = self.bucket
        return None if all(b.present) else sum(self.all_flags[1:], self.all_flags[0]).tolist()

    def average_for_all(self, scale: float) -> None:
        """Sum this rank's slices of the node's gradients and write the averages into every rank's
        buffer, so that each buffer then holds the whole average (:attr:`averages`).

        Call it between two barriers: after every rank packed (:meth:`pack_for_peers`), and before
        any rank reads its averages. Each rank writes only its own slices, in every buffer.

        Args:
            scale: ``1 / size``, for this rank's own part (the others' are scaled already).

        Example::

            >>> arena.barrier("backward done (gradients in)")
            >>> for b in buckets: b.node.average_for_all(1.0 / comm.size)
            >>> arena.barrier("averaged gradients ready")
        """
        self._sum_slices(scale, share=True)
        # Read here, between the barriers: a rank writes its flags again in its next backward.
        self.counts = self._counts()

    def point_grads_at_averages(self) -> None:
        """Make each parameter's ``.grad`` its average in this rank's buffer (None where no rank had
        a gradient, so that the optimizer leaves it alone, as in one process).

        Call it after :meth:`average_for_all` and the barrier that follows it on every rank.

        Example::

            >>> arena.barrier("averaged gradients ready")
            >>> for b in buckets: b.node.point_grads_at_averages()   # .grad holds the averages now
        """
        counts = self.counts
        for i, (p, average) in enumerate(zip(self.bucket.params, self.averages)):
            g = None if counts is not None and not counts[i] else average
            if p.grad is not g:
                p.grad = g

    def take_averages(self) -> None:
        """The shard parameters' gradients: this rank's slice of each ``.grad`` (the averages, or
        what the script put there since: clipped in place, or replaced).

        A ``.grad`` clipped in place is taken where it is; one replaced since backward has its
        slice copied into this rank's buffer; one set to None leaves the shard without a gradient.

        Example::

            >>> for b in buckets: b.node.take_averages()   # in step(), before the shards are updated
        """
        b = self.bucket
        for p, sp, average, mine, (lo, hi) in zip(b.params, b.shard_params, self.averages, self.mine_in_own, b.slices):
            g = p.grad
            if g is None:
                mine = None
            elif g is not average:  # replaced after backward: its slice goes where the average was
                mine[:hi - lo].copy_(elements(g, p)[lo:hi])
            if sp.grad is not mine:
                sp.grad = mine
