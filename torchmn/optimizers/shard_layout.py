"""The sharded optimizer's layout: which slice of each parameter a rank owns, the flat buffers the
parameters live in, and the rank-major form the gradients take on the wire.

See ``docs/design/sharded-optimizer.md`` for the whole step.
"""
from __future__ import annotations

import socket
from typing import Optional

import torch

from torchmn.errors import TorchmnRuntimeError
from torchmn.optimizers.gradient_sync import copy_scaled
from torchmn.optimizers.memory_order import elements, shaped


class ShardBucket:
    """Consecutive parameters of one group, dtype and device, their flat buffers and this rank's
    shard of each of them.

    Every parameter is cut into ``size`` equal slices (padded: the last ones may hold padding
    only, 4 elements on 3 ranks are slices of 2, 2 and 0): rank ``r`` owns slice
    ``r`` of every parameter, so each parameter has a shard, an optimizer state and a step count
    on every rank, as it would in one process. The flat parameter buffer holds the parameters one
    after another, each padded to ``size * k`` elements (``k``: its slice length), so that each
    parameter stays a contiguous view and each slice is contiguous. What goes over the wire
    (:meth:`pack`) is the same data rank-major: rank ``j``'s block holds slice ``j`` of every
    parameter, then one "has a gradient" flag per parameter, so that a reduce-scatter hands every
    rank its slices and the number of ranks that had each gradient.
    """

    def __init__(self, params: list[torch.nn.Parameter], group: int, rank: int, size: int,
                 wire_dtype: Optional[torch.dtype]):
        """Lay out the slices of ``params``; no buffer is made yet (:meth:`place` makes them).

        Args:
            params: consecutive parameters of one group, dtype and device.
            group: the index of their group in the wrapped optimizer.
            rank: this rank.
            size: the number of ranks the parameters are sliced over.
            wire_dtype: the dtype gradients travel in (None: the parameters' own).

        Example::

            >>> b = ShardBucket([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))],
            ...                 group=0, rank=1, size=3, wire_dtype=None)
            >>> b.ks, b.slices, b.padded          # slice lengths, rank 1's [lo, hi), flat elements
            ([2, 1], [(2, 4), (1, 2)], 9)
        """
        self.params = params
        self.group = group
        self.rank, self.size = rank, size
        self.numels = [p.numel() for p in params]
        self.ks = [max(1, -(-n // size)) for n in self.numels]   # each parameter's slice length
        self.offsets, self.block_offsets = [], []       # in the flat buffers; in a rank's block
        offset = block_offset = 0
        for k in self.ks:
            self.offsets.append(offset)
            self.block_offsets.append(block_offset)
            offset += k * size
            block_offset += k
        self.padded = offset                 # elements of the flat parameter buffer
        self.k = block_offset                # elements of this rank's shards together
        self.block = self.k + len(params)    # a rank's block on the wire: its shards, then the flags
        self.dtype, self.device = params[0].dtype, params[0].device
        self.itemsize = params[0].element_size()
        self.wire_dtype = wire_dtype or self.dtype
        # This rank's slice of each parameter, [lo, hi) in the parameter's flat elements (empty for
        # a rank whose slice is all padding).
        self.slices = [(min(rank * k, n), min((rank + 1) * k, n)) for k, n in zip(self.ks, self.numels)]
        self.ready: set[int] = set()
        self.sent = False                    # this step's gradients have left backward's hands
        self.reduce_work = None
        self.gather_work = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.step_shard = None               # the optimizer's step (see inner_optimizers.step_function)
        self.node = None                     # on one node: the shared-memory path (node_memory.NodeShards)

    def place(self, flat: Optional[torch.Tensor] = None, fill: bool = True) -> None:
        """Give the bucket its flat parameter buffer (a new one by default) and its shard parameters.

        Then :meth:`place_wire` gives it buffers for the collectives, or the optimizer gives it a
        :class:`~torchmn.optimizers.node_memory.NodeShards` (``self.node``) on one node.

        Args:
            flat: ``padded`` elements, in shared memory on one node.
            fill: copy the parameters in; False where ``flat`` already holds them (another rank of
                the node wrote them there).

        Example::

            >>> bucket.place()                  # a new flat buffer, the parameters copied in
            >>> bucket.place_wire()
        """
        if flat is None:
            flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.flat = flat
        if fill:
            with torch.no_grad():
                for p, off in zip(self.params, self.offsets):
                    flat[off:off + p.numel()].copy_(elements(p.detach(), p))
        # A view, not a copy: loading weights into the model also updates the shard being stepped.
        self.shard_params = [torch.nn.Parameter(flat[off + self.rank * k:off + (self.rank + 1) * k], requires_grad=True)
                             for off, k in zip(self.offsets, self.ks)]

    @property
    def region_numel(self) -> int:
        """The elements of a rank's shared gradient buffer: the flat layout, then one flag per parameter."""
        return self.padded + len(self.params)

    # ----------------------------------------------------------------------------- through collectives
    def place_wire(self) -> None:
        """Buffers for the reduce-scatter and all-gather through the communicator.

        Call it after :meth:`place` (the all-gather's buffers view the shard parameters).

        Example::

            >>> bucket.place(); bucket.place_wire()
        """
        size, block = self.size, self.block
        # Padding must stay 0 on the wire; pack() zeroes what an all-gather may have left there.
        self.wire = torch.zeros(size * block, dtype=self.wire_dtype, device=self.device)
        rows = self.wire.view(size, block)
        self.wire_plan = []
        for k, n, at in zip(self.ks, self.numels, self.block_offsets):
            full, rest = divmod(n, k)
            tail = rows[full, at:at + rest] if rest else None
            pads = [rows[full, at + rest:at + k]] if rest else []
            if full + (1 if rest else 0) < size:
                pads.append(rows[full + (1 if rest else 0):, at:at + k])
            self.wire_plan.append((rows[:full, at:at + k], full * k, tail, pads))
        self.wire_flags = rows[:, self.k:]
        self.flags_made = None, None         # the last pattern of flags, and it as a tensor
        self.grad_shard = torch.empty(block, dtype=self.wire_dtype, device=self.device)
        shard_grad = self.grad_shard if self.wire_dtype == self.dtype else \
            torch.empty(self.k, dtype=self.dtype, device=self.device)
        self.shard_grad = shard_grad[:self.k]
        self.shard_grads = [shard_grad[at:at + k] for at, k in zip(self.block_offsets, self.ks)]
        if self.size > 1:
            self.send = torch.zeros(block, dtype=self.dtype, device=self.device)
            self.shard_views = [sp.detach() for sp in self.shard_params]
            # The all-gather lands in the wire buffer (free until the next backward) when the dtypes
            # allow it, and is copied from there into the parameters.
            self.gathered = self.wire if self.wire_dtype == self.dtype else \
                torch.empty(size * block, dtype=self.dtype, device=self.device)
        else:
            self.send = None

    def pack(self, scale: Optional[float]) -> torch.Tensor:
        """The wire buffer for this step's reduce-scatter.

        Args:
            scale: the factor for the gradients (None: as they are).

        Returns:
            ``size * block`` elements: rank ``j``'s block holds slice ``j`` of every gradient (times
            ``scale``), then one flag per parameter saying whether this rank has its gradient.
            A gradient this rank lacks is zeros; padding is zeros.

        Example::

            >>> work = comm.reduce_scatter_flat(bucket.pack(1.0 / comm.size), bucket.grad_shard, async_op=True)
        """
        self.remember_grads()
        for p, g, (rows, split, tail, pads) in zip(self.params, self.packed, self.wire_plan):
            if g is None:
                rows.zero_()
                if tail is not None:
                    tail.zero_()
            else:
                flat = elements(g, p)
                copy_scaled(rows, flat[:split].view(rows.shape), scale)
                if tail is not None:
                    copy_scaled(tail, flat[split:], scale)
            for pad in pads:
                pad.zero_()
        if self.present != self.flags_made[0]:  # made once per pattern: on a GPU a new tensor would sync
            self.flags_made = self.present, torch.tensor(self.present, dtype=self.wire_dtype, device=self.device)
        self.wire_flags.copy_(self.flags_made[1].expand_as(self.wire_flags))
        return self.wire

    def take_reduced(self) -> None:
        """After the reduce-scatter: each shard parameter's gradient, or None where no rank had one.

        Example::

            >>> work.wait()
            >>> bucket.take_reduced()        # each shard parameter's .grad: this rank's slice of the average
        """
        counts = None if all(self.present) else self.grad_shard[self.k:].tolist()
        self.set_grads(self.shard_grads, counts)

    def send_shards(self) -> torch.Tensor:
        """This rank's updated shards, in its block's layout, for the all-gather.

        Returns:
            A ``block``-element buffer (made by :meth:`place_wire` where ``size > 1``): the shards
            one after another, then zeros where the flags go.

        Example::

            >>> comm.allgather_flat(bucket.gathered, bucket.send_shards())
            >>> bucket.take_gathered()
        """
        torch.cat(self.shard_views, out=self.send[:self.k])
        return self.send

    def take_gathered(self) -> None:
        """Every rank's shards, from the all-gather's buffer into the parameters.

        Example::

            >>> comm.allgather_flat(bucket.gathered, bucket.send_shards())
            >>> bucket.take_gathered()          # the model holds every rank's update now
        """
        rows = self.gathered.view(self.size, self.block)
        with torch.no_grad():
            for off, k, at in zip(self.offsets, self.ks, self.block_offsets):
                self.flat[off:off + self.size * k].view(self.size, k).copy_(rows[:, at:at + k])

    # ----------------------------------------------------------------------------- both
    def point_params(self) -> None:
        """Make the model's parameters views into the flat buffer (shared memory on one node, so
        that one rank's update reaches every rank's model).

        Example::

            >>> bucket.place()
            >>> bucket.point_params()           # p.data is now a view of bucket.flat, for each p
        """
        for p, off in zip(self.params, self.offsets):
            p.data = shaped(self.flat[off:off + p.numel()], p)

    def set_grads(self, grads: list[torch.Tensor], counts: Optional[list[float]]) -> None:
        """Set the shard parameters' gradients.

        Args:
            grads: one tensor per shard parameter.
            counts: how many ranks had each gradient (None: all did); a gradient no rank had
                becomes None, so that the optimizer leaves its parameter alone.

        Example::

            >>> bucket.set_grads(bucket.shard_grads, None)        # every rank had every gradient
        """
        for i, (sp, g) in enumerate(zip(self.shard_params, grads)):
            if counts is not None and not counts[i]:
                g = None
            if sp.grad is not g:
                sp.grad = g

    def remember_grads(self) -> None:
        """Note this step's gradients (``packed``) and which of them this rank has (``present``).

        Forgets the versions :meth:`note_versions` noted.

        Example::

            >>> bucket.remember_grads()
            >>> bucket.present                  # the second parameter got no gradient
            [True, False]
        """
        self.packed = [p.grad for p in self.params]
        self.present = [g is not None for g in self.packed]  # which gradients this rank has
        self.versions = None

    def note_versions(self) -> None:
        """Note the gradients' version counters, to tell an edit made before ``step()``.

        Call it once backward is done with every gradient, after :meth:`remember_grads` (or
        :meth:`pack`, which calls it).

        Example::

            >>> for b in buckets: b.note_versions()     # at the end of backward
        """
        self.versions = [g._version if g is not None else None for g in self.packed]

    def check_grads_unchanged(self) -> None:
        """Refuse a step whose gradients were edited after backward handed them over.

        Backward's hooks have already sent them (or, on one node, copied the parts other ranks
        need): an edit now would reach only part of the model, silently.

        Raises:
            RuntimeError: a ``.grad`` was replaced or changed in place since backward.

        Example::

            >>> bucket.note_versions()
            >>> model.weight.grad.mul_(0.5)
            >>> bucket.check_grads_unchanged()
            Traceback (most recent call last):
            torchmn.errors.TorchmnRuntimeError: rank 0 on node1: the .grad of a parameter of shape (2, 2) was ...
        """
        for p, g, version in zip(self.params, self.packed, self.versions):
            if p.grad is not g or (g is not None and g._version != version):
                raise TorchmnRuntimeError(
                    f"rank {self.rank} on {socket.gethostname()}: the .grad of a parameter of shape "
                    f"{tuple(p.shape)} was changed between backward and step(). With shard_state=True the "
                    "gradients are averaged as backward leaves them (the other ranks already have theirs), "
                    "so a change made afterwards (clipping, unscaling, scaling) would reach only part of "
                    "the model. Clip with optimizer.clip_grad_norm_(max_norm) instead, and scale the loss "
                    "rather than the gradients.")


