"""The sharded multi-node optimizer (ZeRO stage 1): each rank updates, and keeps state for, 1/size of the model.

Layout. Trainable parameters are packed into buckets in the reverse order of the parameters (the
order backward produces gradients); a bucket never mixes parameter groups, dtypes or devices. Each
bucket owns one flat buffer holding its parameters one after another, each padded to a multiple of
the rank count, and the real parameters are re-pointed to be views into it. Rank ``r`` owns slice
``r`` of every parameter (``[r*k, (r+1)*k)`` of its flat elements): that slice is a "shard
parameter", and an optimizer of the wrapped optimizer's own class steps the rank's shard
parameters. Optimizer state (Adam's ``exp_avg``, momentum buffers, step counts) therefore exists
only for the owned slices, and per parameter, as in one process: a parameter that no rank has a
gradient for is left alone, and a checkpoint moves between rank counts unchanged.

One step. While backward runs, a bucket whose gradients are all ready is packed, rank-major (rank
``j``'s block holds slice ``j`` of each parameter, then a flag per parameter saying whether this
rank has its gradient), and its reduce-scatter is launched (buckets go out in the same order on
every rank; at the end of backward the rest go out, missing gradients as zeros, so an unused
parameter cannot hang the job). In ``step()`` each bucket in turn waits for its reduce-scatter,
updates its shards and launches its all-gather, so the all-gathers of early buckets run while
later buckets update; ``step()`` copies the gathered slices into the parameters and returns once
every parameter holds the new values.

On one node (the hierarchical communicator on CPU, the default there) the flat buffers live in
shared memory instead (:class:`torchmn.communicators.shm.NodeArena`): the parameters exist once
per node, so a rank that updates its shard updates every rank's model and no all-gather is needed,
and each rank's gradient buffer is readable by the others, so backward's hooks only copy into it
the parts of the gradients that other ranks' slices need (and its flags), and ``step()`` sums this
rank's slices from the others' buffers and its own ``.grad`` (for torch's fused Adam kernel, in
cache-sized pieces, each updated as soon as it is summed: :class:`fused_adam.SumAndStep`). Two
barriers per step (gradients in; shards updated) keep ranks from reading what another is still
writing.

Only elementwise optimizers can be split this way (each element's update depends on that
element's gradient and state alone): see :data:`ELEMENTWISE_OPTIMIZERS`.
"""
from __future__ import annotations

import functools
import inspect
import socket
from typing import Optional

import torch

from torchmn.communicators import Communicator
from torchmn.communicators.communicator import divide_before_sum
from torchmn.communicators.shm import STEP_AFTER_SENDS
from torchmn.optimizers import fused_adam
from torchmn.optimizers.gradient_sync import (GradientSyncOptimizer, arena_layout, copy_scaled, make_buckets,
                                              region_view, sum_scaled)

# Optimizers whose update is elementwise, so a flat slice of the parameters can be stepped alone.
# Others (LBFGS, Adafactor's factored moments, Muon's orthogonalisation, SparseAdam, subclasses
# that may add cross-element math) are refused with a clear error.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.ASGD, torch.optim.Rprop,
)
# State entries of those optimizers that are one value per parameter (a step count, a decay
# factor), not one value per element: copied as they are rather than split or gathered.
SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})


class _ShardBucket:
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
        self.step_shard = None               # the optimizer's step (see _step_function)

    def place(self, flat: Optional[torch.Tensor] = None, region: Optional[torch.Tensor] = None,
              peer_regions: Optional[list[torch.Tensor]] = None, own_index: int = 0, fill: bool = True) -> None:
        """Give the bucket its flat parameter buffer (a new one by default) and its gradient buffers.

        ``peer_regions``: every rank's gradient buffer (``region_numel`` elements, shared memory,
        this rank's at ``own_index``, readable here); then the reduce-scatter is a sum read
        straight from them. Otherwise a wire buffer for the collectives is made. ``fill=False``:
        ``flat`` already holds the parameters (another rank of the node wrote them there).
        """
        if flat is None:
            flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.flat = flat
        if fill:
            with torch.no_grad():
                for p, off in zip(self.params, self.offsets):
                    flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        # A view, not a copy: loading weights into the model also updates the shard being stepped.
        self.shard_params = [torch.nn.Parameter(flat[off + self.rank * k:off + (self.rank + 1) * k], requires_grad=True)
                             for off, k in zip(self.offsets, self.ks)]
        if peer_regions is None:
            self._place_wire()
        else:
            self._place_shared(region, peer_regions, own_index)

    @property
    def region_numel(self) -> int:
        """Elements of a rank's shared gradient buffer: the flat layout, then the flags."""
        return self.padded + len(self.params)

    # ----------------------------------------------------------------------------- through collectives
    def _place_wire(self) -> None:
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
        """The wire buffer for this step's reduce-scatter: the gradients rank-major, times ``scale``."""
        self._remember_grads()
        for g, (rows, split, tail, pads) in zip(self.packed, self.wire_plan):
            if g is None:
                rows.zero_()
                if tail is not None:
                    tail.zero_()
            else:
                flat = g.reshape(-1)
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
        """After the reduce-scatter: each shard parameter's gradient, or None where no rank had one."""
        counts = None if all(self.present) else self.grad_shard[self.k:].tolist()
        self._set_grads(self.shard_grads, counts)

    def send_shards(self) -> torch.Tensor:
        """This rank's updated shards, in its block's layout, for the all-gather."""
        torch.cat(self.shard_views, out=self.send[:self.k])
        return self.send

    def take_gathered(self) -> None:
        """Every rank's shards, from the all-gather's buffer into the parameters."""
        rows = self.gathered.view(self.size, self.block)
        with torch.no_grad():
            for off, k, at in zip(self.offsets, self.ks, self.block_offsets):
                self.flat[off:off + self.size * k].view(self.size, k).copy_(rows[:, at:at + k])

    # ----------------------------------------------------------------------------- through shared memory
    def _place_shared(self, region: torch.Tensor, peer_regions: list[torch.Tensor], own_index: int) -> None:
        """Plan the copies and sums once: they run every step, between forward and backward, when
        each line of Python costs several times what it does warm. A slice that is a whole
        parameter is shaped like it, so that its gradient goes in as it is."""
        r = self.rank
        self.flags = region[self.padded:]
        others = [g for j, g in enumerate(peer_regions) if j != own_index]
        self.all_flags = [g[self.padded:] for g in peer_regions]

        def view(buffer, p, at, start, end):
            v = buffer[at + start:at + end]
            return (v.view(p.shape), None, None) if end - start == p.numel() else (v, start, end)

        self.pack_plan, self.sum_plan = [], []
        self.mine_in_own = []  # this rank's slice of each parameter in its own buffer: where its sums go
        for i, (p, off, k, (lo, hi)) in enumerate(zip(self.params, self.offsets, self.ks, self.slices)):
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

    def pack_for_peers(self, scale: float) -> None:
        """Copy, times ``scale``, the parts of the gradients that other ranks own into this rank's
        shared buffer (the part in this rank's own slices stays in ``.grad``), and say which
        gradients this rank has."""
        self._remember_grads()
        packed = self.packed
        for i, view, start, end in self.pack_plan:
            g = packed[i]
            if g is None:
                view.zero_()
            else:
                torch.mul(g if start is None else g.reshape(-1)[start:end], scale, out=view)
        if self.present != self.flags_written:  # they stay in shared memory from one step to the next
            self.flags.copy_(torch.tensor(self.present, dtype=self.flags.dtype))
            self.flags_written = self.present

    def sum_shard_of_peers(self, scale: float) -> None:
        """This rank's slices of the node's gradient sum, as the shard parameters' gradients: the
        other ranks' parts, read from their shared buffers (already times ``scale``), plus this
        rank's own part times ``scale``. A parameter no rank has a gradient for gets None, and
        the optimizer leaves it alone, as in one process.

        The sums go to this rank's own slices of its own buffer, lines that no other rank reads or
        writes: they last until this rank's next sum (``clip_grad_norm_`` before a skipped step
        needs that), and the other ranks' next copies never have to take back lines this rank
        wrote. (Summing in place into the other rank's copy instead, which saves streaming through
        a third buffer, was slower in 17 of 21 interleaved rounds of the MNIST bench, by 0.2-3% in
        the medians of three batches of rounds.)
        """
        packed = self.packed
        for i, lo, hi, others, out in self.sum_plan:
            g = packed[i]
            sum_scaled(out, others, None if g is None else g.reshape(-1)[lo:hi], scale)
        # The flags are read only where this rank lacks a gradient: otherwise every count is >= 1.
        counts = None if all(self.present) else sum(self.all_flags[1:], self.all_flags[0]).tolist()
        self._set_grads(self.mine_in_own, counts)

    # ----------------------------------------------------------------------------- both
    def point_params(self) -> None:
        """Make the model's parameters views into the flat buffer (shared memory on one node, so
        that one rank's update reaches every rank's model)."""
        for p, off in zip(self.params, self.offsets):
            p.data = self.flat[off:off + p.numel()].view_as(p)

    def _set_grads(self, grads: list[torch.Tensor], counts: Optional[list[float]]) -> None:
        """The shard parameters' gradients; None where ``counts`` (ranks that had it) says 0."""
        for i, (sp, g) in enumerate(zip(self.shard_params, grads)):
            if counts is not None and not counts[i]:
                g = None
            if sp.grad is not g:
                sp.grad = g

    def _remember_grads(self) -> None:
        self.packed = [p.grad for p in self.params]
        self.present = [g is not None for g in self.packed]  # which gradients this rank has
        self.versions = None

    def note_versions(self) -> None:
        self.versions = [g._version if g is not None else None for g in self.packed]

    def check_grads_unchanged(self) -> None:
        """Refuse a step whose gradients were edited after backward handed them over.

        Backward's hooks have already sent them (or, on one node, copied the parts other ranks
        need): an edit now would reach only part of the model, silently.
        """
        for p, g, version in zip(self.params, self.packed, self.versions):
            if p.grad is not g or (g is not None and g._version != version):
                raise RuntimeError(
                    f"rank {self.rank} on {socket.gethostname()}: the .grad of a parameter of shape "
                    f"{tuple(p.shape)} was changed between backward and step(). With shard_state=True the "
                    "gradients are averaged as backward leaves them (the other ranks already have theirs), "
                    "so a change made afterwards (clipping, unscaling, scaling) would reach only part of "
                    "the model. Clip with optimizer.clip_grad_norm_(max_norm) instead, and scale the loss "
                    "rather than the gradients.")


def _check_optimizer(optimizer) -> None:
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError("shard_state=True cannot wrap LBFGS: its update needs whole parameters and a "
                        "closure, not a shard; use shard_state=False")
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(f"shard_state=True only wraps elementwise optimizers ({names}), not "
                        f"{type(optimizer).__name__}: its update may need whole tensors; use shard_state=False")


# Not hyperparameters but the choice of kernel; the shard optimizers keep their own (_build_inner).
IMPLEMENTATION_FLAGS = ("fused", "foreach")

# The optimizers whose fused kernel the shards take when the user left the choice to torch. Not
# SGD: its fused kernel cannot step momentum buffers that exist for some parameters and not yet for
# others (a parameter whose first gradient comes late, a checkpoint from such a run), which torch's
# default SGD does; and SGD's update is one pass over memory anyway.
AUTO_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def _build_inner(cls: type, shard_params: list[torch.nn.Parameter], group: dict) -> torch.optim.Optimizer:
    """An optimizer of ``cls`` over some shard parameters of one group, with its hyperparameters
    (the caller decides which shards share one: see the sharded optimizer's constructor).

    A shard parameter is one flat tensor, which is what torch's fused kernels are for (Adam's update
    in one pass over memory instead of several: 2-3x faster on CPU). So where the user left the
    kernel to torch (``fused`` and ``foreach`` unset) and ``cls`` is one of :data:`AUTO_FUSED`, with
    a fused kernel for the shards' device and dtype, the shards use it; the arithmetic is the same
    up to rounding.
    """
    hyper = {k: v for k, v in group.items() if k != "params"}
    accepted = inspect.signature(cls.__init__).parameters
    # Constructor arguments validate (and set flags like fused); the group dict then carries them all.
    ctor = {k: v for k, v in hyper.items() if k in accepted}
    # torch checks a fused kernel's device and dtype only at the first step(), so choose it only
    # where every optimizer that has one supports it: CPU, float32/float64.
    if cls in AUTO_FUSED and hyper.get("fused") is None and hyper.get("foreach") is None \
            and not hyper.get("differentiable") and shard_params[0].device.type == "cpu" \
            and shard_params[0].dtype in (torch.float32, torch.float64):
        try:
            return cls([{**hyper, "fused": True, "params": shard_params}], **{**ctor, "fused": True})
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # an option that rules the fused kernel out (its constructor says so)
    return cls([{**hyper, "params": shard_params}], **ctor)


def _step_function(optimizer: torch.optim.Optimizer):
    """A function that steps one of the shard optimizers, as cheaply as torch allows.

    Each runs once per training step, between backward and forward, when the interpreter runs
    cold: Python around the update then costs 300-400 us a call, a third of Adam's fused kernel
    on a 4 MB shard. The shard optimizers are private (no hooks, no closure, one group of flat
    shards), so they can skip the wrapper torch puts around every step (step hooks,
    a profiler range) and, for fused Adam and AdamW, everything around torch's fused kernel.
    """
    step = type(optimizer).step
    if getattr(step, "hooked", False) and callable(getattr(step, "__wrapped__", None)):
        step = functools.partial(step.__wrapped__, optimizer)
    else:
        step = optimizer.step
    return fused_adam.direct_step(optimizer, step) or step


class ShardedMultiNodeOptimizer(GradientSyncOptimizer):
    """Wraps an elementwise ``torch.optim.Optimizer``; each rank updates and keeps state for its shard.

    Build it with ``create_multi_node_optimizer(..., shard_state=True)``. It behaves like the wrapped
    optimizer: ``param_groups`` are the wrapped optimizer's (LR schedulers work; hyperparameters reach
    the shards at every ``step()``), ``state_dict()`` is the whole state in the wrapped optimizer's
    format, gathered to every rank, and ``load_state_dict()`` takes that format from any rank count
    (or from a plain torch optimizer) and keeps this rank's shard.

    Differences from the unsharded wrapper: after backward the real parameters' ``.grad`` still hold
    this rank's own gradients (the averaged ones exist only as shards), and they must not be edited
    before ``step()``, which refuses (``GradScaler.unscale_``, ``torch.nn.utils.clip_grad_norm_``:
    they would reach only the part not yet sent; clip with :meth:`clip_grad_norm_`); ``state`` is
    this rank's shard state, keyed by the shard parameters (one flat slice of each parameter). The
    model's parameters become views into flat buffers: move or convert the model (``.to``,
    ``.double()``) before wrapping, not after.
    Each parameter keeps its own optimizer state and step count (each rank holds its slice of them):
    a parameter that no rank has a gradient for in a step is left alone, as in one process; one
    that only some ranks have a gradient for is averaged with zeros from the others, as
    ``zero_fill=True`` says.

    On one node the ranks share one copy of the parameters (in shared memory). Change parameters
    only through the optimizer, or by loading the same values on every rank
    (``model.load_state_dict``): an in-place change that is not idempotent, made on every rank
    (``p.mul_(0.99)``, ``p.add_(noise)``), would be applied once per rank on the shared copy.

    Example::

        >>> opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm,
        ...                                           shard_state=True)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()                       # every rank holds the whole updated model again
        >>> torch.save(opt.state_dict(), "opt.pt") if comm.rank == 0 else None
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, *, zero_fill: bool = True,
                 compression: Optional[str] = None, bucket_cap_mb: Optional[float] = None,
                 backward_passes_per_step: int = 1, double_buffering: bool = False):
        super().__init__(optimizer, comm, compression=compression,
                         backward_passes_per_step=backward_passes_per_step)
        _check_optimizer(optimizer)
        if double_buffering:
            raise ValueError("shard_state=True cannot be combined with double_buffering=True: the shard "
                             "update needs this step's reduce-scattered gradients")
        if not zero_fill:
            raise ValueError("shard_state=True needs zero_fill=True: one rank updates each slice of a "
                             "parameter for all ranks, so a gradient missing on some ranks is summed as zeros "
                             "(zero_fill=False would leave the ranks' models different)")
        owners = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    owners.setdefault(p, gi)
        params = self._trainable()
        cap = comm.grad_bucket_cap_bytes if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)

        def same_bucket(a, b):  # a bucket never mixes parameter groups, dtypes or devices
            return owners[a] == owners[b] and a.dtype == b.dtype and a.device == b.device

        def build(run):
            return _ShardBucket(run, owners[run[0]], comm.rank, comm.size, self._wire_dtype)
        self._buckets = make_buckets(params, cap, build, same_bucket)
        self._reduced = False  # clip_grad_norm_ took this step's averaged shards already
        self._arena = self._place_in_shared_memory() if self._can_share_memory(params) else None
        if self._arena is None:
            for b in self._buckets:
                b.place()
        # On one node the shards are all updated at once: one inner optimizer per group (and dtype
        # and device, which one fused kernel call needs alike), as each step() costs some 200 us of
        # Python when it runs cold between forward and backward, as much as Adam on a 1 MB shard.
        # Elsewhere each bucket is updated as its reduce-scatter lands, so that its all-gather
        # overlaps the next buckets' updates: one inner optimizer per bucket (one over the group
        # would walk all its shards every time).
        self._inner = {}
        for i, b in enumerate(self._buckets):
            b.point_params()
            kind = (b.dtype, b.device) if self._arena is not None else i
            self._inner.setdefault((b.group, kind), []).append(b)
        self._sum_and_step = {}  # per inner optimizer on one node, where its fused kernel allows
        for key, buckets in self._inner.items():
            inner = _build_inner(type(optimizer), [sp for b in buckets for sp in b.shard_params],
                                 optimizer.param_groups[key[0]])
            step = _step_function(inner)
            for b in buckets:
                b.optimizer, b.step_shard = inner, step
            if self._arena is not None and fused_adam.kernel_for(inner) is not None:
                self._sum_and_step[key] = fused_adam.SumAndStep(inner, buckets, 1.0 / comm.size)
        self._attach(params, self._buckets)

    def _place_in_shared_memory(self):
        """On one node, put the flat buffers in memory the node's ranks share, or return None.

        The parameters then exist once per node: a rank that updates its shard updates the model
        of every rank, so no all-gather is needed. Each rank's gradient buffer is readable by the
        others, so the reduce-scatter is each rank summing its shard straight from them.
        """
        offsets, total = arena_layout([b.region_numel * b.itemsize for b in self._buckets])
        arena = self.comm._open_node_arena(shared_bytes=total, region_bytes=total)
        if arena is None:
            return None
        for b, offset in zip(self._buckets, offsets):
            def flat_of(region, numel, b=b, offset=offset):
                return region_view(region, offset, numel, b.dtype)
            # Rank 0 writes the (already broadcast) parameters; the others find them there.
            b.place(flat_of(arena.shared, b.padded), flat_of(arena.regions[arena.local_rank], b.region_numel),
                    [flat_of(region, b.region_numel) for region in arena.regions], own_index=arena.local_rank,
                    fill=self.comm.rank == 0)
        arena.barrier("set-up")
        return arena

    def _send(self, bucket: _ShardBucket) -> None:
        bucket.sent = True
        self._reduced = False  # new gradients: whatever clip_grad_norm_ took is stale
        if self._arena is not None:
            # Into this rank's shared buffer, divided by size on the way (exact for powers of two);
            # step() sums the shards from there.
            bucket.pack_for_peers(1.0 / self.comm.size)
            bucket.ready.clear()
            return
        if bucket.reduce_work is not None:
            # The last backward's, never taken by a step() (all ranks skipped it): it must be done
            # with the wire buffer before pack() rewrites it.
            bucket.reduce_work.wait()
        # Half-precision gradients (compressed, or the model's own) are divided before the sum, so
        # that it cannot overflow.
        pre = 1.0 / self.comm.size if divide_before_sum(bucket.wire_dtype) else None
        bucket.reduce_work = self.comm.reduce_scatter_flat(bucket.pack(pre), bucket.grad_shard, async_op=True)
        bucket.ready.clear()

    def _all_sent(self) -> None:
        # Backward is done with every gradient now. Their versions are noted here, not as each
        # bucket goes: gradients that are views of one tensor (parameters used through torch.cat)
        # share a version counter, which accumulating into a later bucket's gradient bumps.
        for b in self._buckets:
            b.note_versions()

    def _sync_hyperparameters(self) -> None:
        # Schedulers and users change the outer groups; the shard optimizers read their own copies.
        for (group, _), buckets in self._inner.items():
            inner = buckets[0].optimizer.param_groups[0]
            for key, value in self._optimizer.param_groups[group].items():
                if key != "params" and key not in IMPLEMENTATION_FLAGS:
                    inner[key] = value

    # ----------------------------------------------------------------------------- public
    def step(self, closure=None):
        """Update this rank's shard with the averaged gradients, then all-gather the parameters.

        Example::

            >>> loss_fn(model(x), y).backward(); optimizer.step()
        """
        self._check_closure(closure)
        self._refuse_after_failed_backward()
        self._check_parameters_unchanged()
        reduced, self._reduced = self._reduced, False
        if reduced:  # by clip_grad_norm_, which took them; an edit since would still be lost
            self._check_gradients()
        else:
            self._take_gradients()
        self._sent = False
        self._sync_hyperparameters()
        for b in self._buckets:
            b.sent = False
        if self._arena is not None:
            if reduced:
                for buckets in self._inner.values():
                    buckets[0].step_shard()
            else:
                self._sum_and_update_in_shared_memory()
            # Every shard is updated in the shared parameters, and nobody reads a gradient buffer
            # any more, so backward may write them again.
            self._arena.barrier("step done (shards updated)")
            self._forget_gradients()
            return None
        for b in self._buckets:
            if not reduced:  # bucket by bucket, so early buckets' all-gathers overlap later updates
                self._finish_reduce_scatter(b)
            b.step_shard()
            if b.send is not None:
                b.gather_work = self.comm.allgather_flat(b.gathered, b.send_shards(), async_op=True)
        for b in self._buckets:
            if b.gather_work is not None:
                b.gather_work.wait()
                b.gather_work = None
                b.take_gathered()
        self._forget_gradients()
        return None

    def register_step_pre_hook(self, hook):
        # Global hooks (torch.optim.optimizer.register_optimizer_step_pre_hook) do not run for the
        # shard optimizers either: they are stepped without torch's hook wrapper (_step_function).
        raise NotImplementedError("step hooks with shard_state=True: each rank updates its shards with "
                                  "optimizers of its own, so a hook would see neither the model's parameters "
                                  "nor the whole update; call it around optimizer.step() instead")

    register_step_post_hook = register_step_pre_hook

    def _forget_gradients(self) -> None:
        self._sends = 0
        for b in self._buckets:
            b.packed = b.versions = None  # so that the next zero_grad frees them

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the averaged gradients by their norm over the whole model; returns that norm.

        What ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does for one process, for
        gradients that exist only as shards: call it between backward and ``step()``, on every
        rank. Each rank takes its shard of the averaged gradients (which ``step()`` then uses),
        the ranks add up their shards' norms, and every shard is scaled by the same factor.
        ``foreach`` is accepted for torch's signature.

        Example::

            >>> loss_fn(model(x), y).backward()
            >>> norm = optimizer.clip_grad_norm_(1.0)
            >>> optimizer.step()
        """
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"clip_grad_norm_: norm_type must be positive (2.0, inf, ...), not {norm_type}")
        if not self._reduced:
            self._take_gradients()
            if self._arena is not None:
                self._sum_shards_in_shared_memory()
            else:
                for b in self._buckets:
                    self._finish_reduce_scatter(b)
            self._reduced = True
        shards = [(sp.grad, hi - lo) for b in self._buckets for sp, (lo, hi) in zip(b.shard_params, b.slices)
                  if sp.grad is not None]
        # The real elements only: a shard's padding must stay 0 (the sums never rewrite it), and a
        # non-finite factor (a skipped bad step) would make it NaN in every later norm.
        grads = [g[:n] for g, n in shards if n]
        device = shards[0][0].device if shards else torch.device("cpu")
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type).to(device, torch.float64) for g in grads]) \
            if grads else torch.zeros(1, dtype=torch.float64)
        if norm_type == float("inf"):
            total = self.comm.allreduce(norms.max(), op="max")
        else:
            total = self.comm.allreduce(norms.pow(norm_type).sum()).pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"rank {self.comm.rank}: the total norm of order {norm_type} of the averaged "
                               "gradients is not finite, so they cannot be clipped (error_if_nonfinite=True)")
        # torch's own rule: scale by max_norm / (norm + 1e-6), never up.
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor.to(g.device, g.dtype))
        return total.to(shards[0][0].dtype) if shards else total

    def _take_gradients(self) -> None:
        """This step's gradients leave backward's hands: sent if they were not, and not edited since."""
        self.synchronize()
        self._check_gradients()

    def _check_gradients(self) -> None:
        for b in self._buckets:
            b.check_grads_unchanged()

    def _gradients_in(self) -> None:
        # Every rank's gradients are in its buffer. The barrier also tells how many times they were
        # sent since the last step: a rank that skipped a step() meets the others' next one.
        self._arena.barrier(STEP_AFTER_SENDS[min(self._sends, len(STEP_AFTER_SENDS) - 1)])

    def _sum_shards_in_shared_memory(self) -> None:
        # For clip_grad_norm_, which needs every sum before any update.
        self._gradients_in()
        for b in self._buckets:
            b.sum_shard_of_peers(1.0 / self.comm.size)

    def _sum_and_update_in_shared_memory(self) -> None:
        """Sum each shard from the node's buffers and update it: piece by piece where the fused
        Adam kernel allows (:class:`fused_adam.SumAndStep`), else all sums, then the update."""
        self._gradients_in()
        for key, buckets in self._inner.items():
            sum_and_step = self._sum_and_step.get(key)
            if sum_and_step is None or not sum_and_step():
                for b in buckets:
                    b.sum_shard_of_peers(1.0 / self.comm.size)
                buckets[0].step_shard()

    def _finish_reduce_scatter(self, b: _ShardBucket) -> None:
        b.reduce_work.wait()
        b.reduce_work = None
        if not divide_before_sum(b.wire_dtype):
            b.grad_shard.mul_(1.0 / self.comm.size)
        if b.wire_dtype != b.dtype:
            b.shard_grad.copy_(b.grad_shard[:b.k])
        b.take_reduced()

    def _indices(self) -> dict:
        """Each real parameter's index in the state_dict format (torch numbers them across groups)."""
        index, n = {}, 0
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p not in index:
                    index[p] = n
                    n += 1
        return index

    def state_dict(self) -> dict:
        """The whole optimizer state, in the wrapped optimizer's format, on every rank.

        Every rank must call it (the shards are all-gathered). The result is what the unsharded
        optimizer would hold, so it loads with any rank count or into the plain torch optimizer.

        Example::

            >>> sd = optimizer.state_dict()          # all ranks
            >>> if comm.rank == 0: torch.save({"model": model.state_dict(), "opt": sd}, path)
        """
        local_keys = [[list(b.optimizer.state.get(sp, {})) for sp in b.shard_params] for b in self._buckets]
        if self.comm.size > 1 and any(k != local_keys for k in self.comm.allgather_obj(local_keys)):
            raise RuntimeError("state_dict: ranks hold different optimizer state layouts; every rank "
                               "must have taken the same steps")
        index = self._indices()
        pending = []
        state = {}
        for b, keys in zip(self._buckets, local_keys):
            shard_states = [b.optimizer.state.get(sp, {}) for sp in b.shard_params]
            # Each entry's keys in the order the optimizer made them, as torch's own state_dict has
            # them; the gathered tensors fill their places below.
            entries = [dict.fromkeys(param_keys) for param_keys in keys]
            for key in dict.fromkeys(k for param_keys in keys for k in param_keys):
                holders = [i for i, s in enumerate(shard_states) if key in s]
                value = shard_states[holders[0]][key]
                if torch.is_tensor(value) and key not in SCALAR_STATE:
                    # Every rank's slices of this entry, for all the bucket's parameters at once.
                    send = torch.zeros(b.k, dtype=value.dtype, device=value.device)
                    for i in holders:
                        send[b.block_offsets[i]:b.block_offsets[i] + b.ks[i]].copy_(shard_states[i][key].reshape(-1))
                    full = torch.empty(self.comm.size * b.k, dtype=value.dtype, device=value.device)
                    work = self.comm.allgather_flat(full, send, async_op=True)
                    pending.append((work, full, b, entries, key, holders))
                else:
                    for i in holders:
                        value = shard_states[i][key]
                        entries[i][key] = value.clone() if torch.is_tensor(value) else value
            for p, entry in zip(b.params, entries):
                if entry:
                    state[index[p]] = entry
        for work, full, b, entries, key, holders in pending:
            work.wait()
            rows = full.view(self.comm.size, b.k)
            for i in holders:
                at, k, p = b.block_offsets[i], b.ks[i], b.params[i]
                entries[i][key] = rows[:, at:at + k].reshape(-1)[:p.numel()].view_as(p).clone()
        state = dict(sorted(state.items()))
        groups = []
        for group in self._optimizer.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[p] for p in group["params"]]
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from :meth:`state_dict` on any rank count, or a plain torch optimizer).

        Each rank keeps only its own shard; no communication.

        Example::

            >>> optimizer.load_state_dict(torch.load(path)["opt"])
        """
        saved_groups = state_dict["param_groups"]
        groups = self._optimizer.param_groups
        if len(saved_groups) != len(groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
                             f"has {len(groups)}")
        for g, sg in zip(groups, saved_groups):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"loaded state dict has a group of {len(sg['params'])} parameters where "
                                 f"the optimizer has {len(g['params'])}")
        saved_index = {}
        for g, sg in zip(groups, saved_groups):
            for p, i in zip(g["params"], sg["params"]):
                saved_index[p] = i
            for key, value in sg.items():
                if key != "params":
                    g[key] = value
        saved_state = state_dict["state"]
        for (group, _), buckets in self._inner.items():
            inner = buckets[0].optimizer
            shard_states, n = {}, 0
            for b in buckets:
                for i, p in enumerate(b.params):
                    saved = saved_state.get(saved_index[p])
                    if saved:
                        shard_states[n] = self._slice_of_state(b, i, saved)
                    n += 1
            inner_group = {k: v for k, v in groups[group].items() if k != "params"}
            inner_group.update({k: inner.param_groups[0][k] for k in IMPLEMENTATION_FLAGS
                                if k in inner.param_groups[0]})
            inner.state.clear()
            # The inner optimizer's own loader casts dtypes and devices the way torch does.
            inner.load_state_dict({"state": shard_states, "param_groups": [{**inner_group, "params": list(range(n))}]})

    def _slice_of_state(self, b: _ShardBucket, i: int, saved: dict) -> dict:
        """This rank's slice of parameter ``i`` of bucket ``b``'s state, cut from its whole state."""
        p, (lo, hi) = b.params[i], b.slices[i]
        mine = {}
        for key, value in saved.items():
            if torch.is_tensor(value) and key not in SCALAR_STATE:
                if value.numel() != p.numel():
                    raise ValueError(f"loaded state {key!r} has {value.numel()} elements for a parameter of "
                                     f"shape {tuple(p.shape)}")
                mine[key] = torch.zeros(b.ks[i], dtype=value.dtype, device=b.flat.device)  # the padding: 0
                mine[key][:hi - lo].copy_(value.reshape(-1)[lo:hi])
            else:
                # A copy: Adam counts its step in place, which must not touch the caller's dict.
                mine[key] = value.clone() if torch.is_tensor(value) else value
        return mine

    @property
    def state(self) -> dict:
        """This rank's shard state, keyed by its shard parameters (its slice of each parameter; a fresh
        dict each time)."""
        return {sp: b.optimizer.state[sp] for b in self._buckets for sp in b.shard_params if sp in b.optimizer.state}

    @state.setter
    def state(self, value):
        raise AttributeError("the sharded optimizer's state is per shard: use load_state_dict()")

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds: about 1/size of the unsharded optimizer's,
        plus the padding of each parameter to a multiple of size (at most size elements per tensor).

        Example::

            >>> print(f"rank {comm.rank}: {optimizer.state_bytes() / 1e6:.1f} MB of optimizer state")
        """
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                   if torch.is_tensor(v))
