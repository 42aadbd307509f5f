"""The sharded multi-node optimizer (ZeRO stage 1): each rank updates, and keeps state for, 1/size of the model.

Layout. Trainable parameters are packed into buckets in the reverse order of the parameters (the
order backward produces gradients); a bucket never mixes parameter groups, dtypes or devices. Each
bucket owns one flat buffer, padded to a multiple of the rank count, and the real parameters are
re-pointed to be views into it, so the all-gather writes the new values straight into the model.
Rank ``r`` owns the contiguous slice ``[r*k, (r+1)*k)`` of every bucket: that slice is a flat
"shard parameter", and an optimizer of the wrapped optimizer's own class steps it. Optimizer state
(Adam's ``exp_avg``, momentum buffers, ...) therefore exists only for the owned slice.

One step. While backward runs, a bucket whose gradients are all ready is packed and its
reduce-scatter is launched (buckets go out in the same order on every rank; at the end of backward
the rest go out, missing gradients as zeros, so an unused parameter cannot hang the job). In
``step()`` each bucket in turn waits for its reduce-scatter, updates its shard and launches its
all-gather, so the all-gathers of early buckets run while later buckets update; ``step()``
returns once every parameter holds the new values.

On one node (the hierarchical communicator on CPU, the default there) the flat buffers live in
shared memory instead (:class:`torchmn.communicators.shm.NodeArena`): the parameters exist once
per node, so a rank that updates its shard updates every rank's model and no all-gather is needed,
and each rank's gradient buffer is readable by the others, so backward's hooks only copy into it
the parts of the gradients that other ranks' shards need, and ``step()`` sums this rank's shard
from the others' buffers and its own ``.grad``. Two barriers per step (gradients in; shards
updated) keep ranks from reading what another is still writing.

Only elementwise optimizers can be split this way (each element's update depends on that
element's gradient and state alone): see :data:`ELEMENTWISE_OPTIMIZERS`.
"""
from __future__ import annotations

import functools
import inspect
import socket
import warnings
from typing import Optional

import torch

from torchmn.communicators import Communicator
from torchmn.communicators.shm import STEP_AFTER_SENDS, sum_into
from torchmn.optimizers.gradient_sync import GradientSyncOptimizer, arena_layout, make_buckets, region_view

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
    """Consecutive parameters of one group, dtype and device, their flat buffers and this rank's shard."""

    def __init__(self, params: list[torch.nn.Parameter], group: int, rank: int, size: int,
                 wire_dtype: Optional[torch.dtype]):
        self.params = params
        self.group = group
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.k = -(-offset // size)          # shard length; the flat buffers hold size * k
        self.padded = self.k * size
        self.rank, self.size = rank, size
        self.dtype, self.device = params[0].dtype, params[0].device
        self.itemsize = params[0].element_size()
        self.wire_dtype = wire_dtype or self.dtype
        self.ready: set[int] = set()
        self.sent = False                    # this step's gradients have left backward's hands
        self.reduce_work = None
        self.gather_work = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.step_shard = None               # the optimizer's step (see _step_function)

    def place(self, flat: Optional[torch.Tensor] = None, grad_flat: Optional[torch.Tensor] = None,
              peer_grads: Optional[list[torch.Tensor]] = None, own_index: int = 0, fill: bool = True) -> None:
        """Give the bucket its flat parameter and gradient buffers (new ones by default).

        ``peer_grads``: every rank's ``grad_flat``, readable here (shared memory), this rank's at
        ``own_index``; then the reduce-scatter is a sum read straight from them. ``fill=False``:
        ``flat`` already holds the parameters (another rank of the node wrote them there).
        """
        if flat is None:
            flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.flat = flat
        if fill:
            with torch.no_grad():
                for p, off in zip(self.params, self.offsets):
                    flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        # Padding must stay 0 in the gradient buffer; pack() writes the parameters' ranges only.
        self.grad_flat = torch.zeros(self.padded, dtype=self.wire_dtype, device=self.device) \
            if grad_flat is None else grad_flat
        lo, hi = self.rank * self.k, (self.rank + 1) * self.k
        mine = flat[lo:hi]
        # A view, not a copy: loading weights into the model also updates the shard being stepped.
        self.shard_param = torch.nn.Parameter(mine, requires_grad=True)
        self.send = torch.empty(self.k, dtype=self.dtype, device=self.device) \
            if self.size > 1 and peer_grads is None else None
        if peer_grads is None:
            self.grad_shard = torch.empty(self.k, dtype=self.wire_dtype, device=self.device)
        else:
            # Where the other ranks leave their parts of this shard (fixed: views, set up once).
            self.others = [g[lo:hi] for j, g in enumerate(peer_grads) if j != own_index]
            # This rank's own part of its shard is never copied (step() reads it from .grad), so
            # that range of its buffer is free for a sum that must outlast a step (see
            # sum_shard_of_peers).
            self.own_range = self.grad_shard = self.grad_flat[lo:hi]
            self._cut_at_shard(lo, hi)
            self._plan_copies()
        self.shard_grad = self.grad_shard if self.wire_dtype == self.dtype else torch.empty_like(mine)

    def _cut_at_shard(self, lo: int, hi: int) -> None:
        """Split every parameter's range into the parts inside this rank's shard and outside it.

        ``outside``: (parameter, start, end) in the parameter's flat elements, copied to the shared
        buffer for the rank that owns them. ``inside``: (parameter, start, end, shard offset), read
        from ``.grad`` at step(). ``padding``: the shard's range past the last parameter.
        """
        self.outside, self.inside = [], []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            n = p.numel()
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                self.inside.append((i, a - off, b - off, a - lo))
                if off < a:
                    self.outside.append((i, 0, a - off))
                if b < off + n:
                    self.outside.append((i, b - off, n))
            else:
                self.outside.append((i, 0, n))
        self.padding = (max(self.numel, lo) - lo, self.k)

    def _plan_copies(self) -> None:
        """The views that backward's copies and step()'s sums write, made once: these run every
        step, between forward and backward, when each line of Python costs several times what it
        does warm. A whole parameter's range is shaped like the parameter, so that its gradient
        goes in as it is (start None), without a flattening view and a slice."""
        def plan(i, start, end, buffer, at):
            p = self.params[i]
            view = buffer[at:at + end - start]
            if end - start == p.numel():
                return view.view(p.shape), None, None
            return view, start, end
        self.pack_plan = [(i,) + plan(i, start, end, self.grad_flat, self.offsets[i] + start)
                          for i, start, end in self.outside]
        self.add_plan = [(i,) + plan(i, start, end, self.others[0], at) for i, start, end, at in self.inside]

    def point_params(self) -> None:
        """Make the model's parameters views into the flat buffer (so a gather needs no copy-back)."""
        for p, off in zip(self.params, self.offsets):
            p.data = self.flat[off:off + p.numel()].view_as(p)

    def pack(self, scale: Optional[float]) -> torch.Tensor:
        self._remember_grads()
        for p, off in zip(self.params, self.offsets):
            view = self.grad_flat[off:off + p.numel()]
            if p.grad is None:
                view.zero_()
            elif scale is None:
                view.copy_(p.grad.reshape(-1))
            elif p.grad.dtype == view.dtype:
                torch.mul(p.grad.reshape(-1), scale, out=view)  # scaled on the way in: no extra pass
            else:
                view.copy_(p.grad.reshape(-1) * scale)
        return self.grad_flat

    def pack_for_peers(self, scale: float) -> None:
        """Copy, times ``scale``, the parts of the gradients that other ranks' shards need into this
        rank's shared buffer (the part in this rank's own shard stays in ``.grad``)."""
        self._remember_grads()
        packed = self.packed
        for i, view, start, end in self.pack_plan:
            g = packed[i]
            if g is None:
                view.zero_()
            else:
                torch.mul(g if start is None else g.reshape(-1)[start:end], scale, out=view)

    def sum_shard_of_peers(self, scale: float, in_place: bool) -> None:
        """This rank's shard of the node's gradient sum, into ``shard_grad``: the other ranks' parts,
        read from their shared buffers (already times ``scale``), plus this rank's own part times
        ``scale``.

        ``in_place``: the sum is made in the first other rank's part of this shard, which nobody
        else reads and its owner rewrites only in the next backward. That saves streaming through
        a third buffer (writing fresh lines reads each of them first: a third less traffic), but
        holds only between step()'s two barriers; a sum that must outlast them
        (``clip_grad_norm_`` before a skipped step) goes to this rank's own range.
        """
        others = self.others
        if in_place:
            out, packed = others[0], self.packed
            for other in others[1:]:
                out.add_(other)
            for i, view, start, end in self.add_plan:
                g = packed[i]
                if g is not None:
                    view.add_(g if start is None else g.reshape(-1)[start:end], alpha=scale)
        elif len(others) == 1:
            # One pass over the shard, each element read twice and written once.
            out, other = self.own_range, others[0]
            for i, start, end, at in self.inside:
                g = self.packed[i]
                if g is None:
                    out[at:at + end - start].copy_(other[at:at + end - start])
                else:
                    torch.add(other[at:at + end - start], g.reshape(-1)[start:end], alpha=scale,
                              out=out[at:at + end - start])
            out[self.padding[0]:self.padding[1]].zero_()
        else:
            out = self.own_range
            sum_into(out, others)
            for i, start, end, at in self.inside:
                if self.packed[i] is not None:
                    out[at:at + end - start].add_(self.packed[i].reshape(-1)[start:end], alpha=scale)
        self.shard_grad = out

    def _remember_grads(self) -> None:
        self.packed = [p.grad for p in self.params]
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


def _build_inner(cls: type, shard_params: list[torch.nn.Parameter], group: dict) -> torch.optim.Optimizer:
    """An optimizer of ``cls`` over some shard parameters of one group, with its hyperparameters
    (the caller decides which shards share one: see the sharded optimizer's constructor).

    A shard is one large flat tensor, which is what torch's fused kernels are for (Adam's update in
    one pass over memory instead of several: 2-3x faster on CPU). So where the user left the kernel
    to torch (``fused`` and ``foreach`` unset) and ``cls`` has a fused kernel for the shard's device
    and dtype, the shard uses it; the arithmetic is the same up to rounding.
    """
    hyper = {k: v for k, v in group.items() if k != "params"}
    accepted = inspect.signature(cls.__init__).parameters
    # Constructor arguments validate (and set flags like fused); the group dict then carries them all.
    ctor = {k: v for k, v in hyper.items() if k in accepted}
    # torch checks a fused kernel's device and dtype only at the first step(), so choose it only
    # where every optimizer that has one supports it: CPU, float32/float64.
    if "fused" in accepted and hyper.get("fused") is None and hyper.get("foreach") is None \
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
    on a 4 MB shard. The shard optimizers are private (no hooks, no closure, one group, every
    shard with a gradient), so they can skip the wrapper torch puts around every step (step hooks,
    a profiler range) and, for fused Adam and AdamW, everything around torch's fused kernel.
    """
    step = type(optimizer).step
    if getattr(step, "hooked", False) and callable(getattr(step, "__wrapped__", None)):
        step = functools.partial(step.__wrapped__, optimizer)
    else:
        step = optimizer.step
    return _fused_adam_step(optimizer, step) or step


# torch's fused Adam and AdamW kernels, with the arguments torch.optim.adam._fused_adam gives them.
_FUSED_ADAM_ARGS = ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "lr", "beta1",
                    "beta2", "weight_decay", "eps", "amsgrad", "maximize", "grad_scale", "found_inf")


def _fused_adam_kernels():
    """(Adam's kernel, AdamW's kernel), or None where this torch's differ from the known ones."""
    try:
        kernels = (torch.ops.aten._fused_adam_.default, torch.ops.aten._fused_adamw_.default)
    except AttributeError:
        return None
    for kernel in kernels:
        if tuple(a.name for a in kernel._schema.arguments) != _FUSED_ADAM_ARGS:
            return None
    return kernels


def _fused_adam_step(optimizer: torch.optim.Optimizer, step):
    """For fused Adam and AdamW: torch's fused kernel called directly; ``step`` where a shard has no
    state yet (the first step creates it), a hyperparameter is a tensor, or this torch's kernels
    are not the known ones.

    What ``Adam.step`` and ``torch.optim.adam.adam`` do around that kernel (collecting lists,
    grouping tensors by device and dtype, checks) is 0.2 ms of cold Python a step, 3% of the MNIST
    bench's time; a shard optimizer has one group of flat CPU shards, all with gradients, so none of
    it is needed. The arithmetic is the kernel's in both cases: the tests compare against one process.
    """
    group = optimizer.param_groups[0]
    kernels = _fused_adam_kernels()
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not group.get("fused") \
            or group.get("capturable") or group.get("differentiable") or "decoupled_weight_decay" not in group \
            or kernels is None:
        return None

    def fused_adam():
        # Looked up every time: load_state_dict replaces the groups and the state.
        group, state = optimizer.param_groups[0], optimizer.state
        params = group["params"]
        states = [state.get(p) for p in params]
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if not all(states) or torch.is_tensor(lr) or torch.is_tensor(beta1) or torch.is_tensor(beta2):
            return step()
        amsgrad = group["amsgrad"]
        steps = [s["step"] for s in states]
        with torch.no_grad():
            torch._foreach_add_(steps, 1)
            kernels[bool(group["decoupled_weight_decay"])](
                params, [p.grad for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
                steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                amsgrad=amsgrad, maximize=group["maximize"])
        return None
    return fused_adam


def _scalar(value):
    return value.item() if torch.is_tensor(value) and value.numel() == 1 else value


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
    this rank's shard state, keyed by flat shard parameters. The model's parameters become views
    into flat buffers: move or convert the model (``.to``, ``.double()``) before wrapping, not after.
    A parameter that no rank has a gradient for in some step is updated with a zero gradient then
    (Adam's momentum and weight decay move it), where one process and the unsharded wrapper leave
    it alone: a shard mixes parameters under one optimizer state and step count. For models with
    parameters left unused in some steps (alternating heads), use ``shard_state=False``.

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
            raise ValueError("shard_state=True needs zero_fill=True: a shard mixes many parameters, so a "
                             "gradient missing on some rank is summed as zeros")
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
        for (group, _), buckets in self._inner.items():
            inner = _build_inner(type(optimizer), [b.shard_param for b in buckets], optimizer.param_groups[group])
            step = _step_function(inner)
            for b in buckets:
                b.optimizer, b.step_shard = inner, step
        self._attach(params, self._buckets)

    def _place_in_shared_memory(self):
        """On one node, put the flat buffers in memory the node's ranks share, or return None.

        The parameters then exist once per node: a rank that updates its shard updates the model
        of every rank, so no all-gather is needed. Each rank's gradient buffer is readable by the
        others, so the reduce-scatter is each rank summing its shard straight from them.
        """
        offsets, total = arena_layout([b.padded * b.itemsize for b in self._buckets])
        arena = self.comm._open_node_arena(shared_bytes=total, region_bytes=total)
        if arena is None:
            return None
        for b, offset in zip(self._buckets, offsets):
            def flat_of(region, b=b, offset=offset):
                return region_view(region, offset, b.padded, b.dtype)
            # Rank 0 writes the (already broadcast) parameters; the others find them there.
            b.place(flat_of(arena.shared), flat_of(arena.regions[arena.local_rank]),
                    [flat_of(region) for region in arena.regions], own_index=arena.local_rank,
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
        # Compressed gradients are divided before sending so float16 sums cannot overflow.
        pre = 1.0 / self.comm.size if self._wire_dtype is not None else None
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
            if not reduced:
                self._sum_shards_in_shared_memory(in_place=True)
            for buckets in self._inner.values():
                buckets[0].step_shard()
            # Every shard is updated in the shared parameters, and nobody reads a gradient buffer
            # any more, so backward may write them again.
            self._arena.barrier("step done (shards updated)")
            self._forget_gradients()
            return None
        for b in self._buckets:
            if not reduced:  # bucket by bucket, so early buckets' all-gathers overlap later updates
                self._finish_reduce_scatter(b)
            b.shard_param.grad = b.shard_grad
            b.step_shard()
            if b.send is not None:
                # The shard is a view into the gathered buffer; a separate send buffer avoids aliasing.
                b.send.copy_(b.shard_param.detach())
                b.gather_work = self.comm.allgather_flat(b.flat, b.send, async_op=True)
        for b in self._buckets:
            if b.gather_work is not None:
                b.gather_work.wait()
                b.gather_work = None
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
        ``foreach`` is accepted for torch's signature; a shard is one tensor per bucket anyway.

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
                # Not in place: the step may be skipped, and then no barrier keeps the other ranks'
                # next backward from rewriting their buffers while these sums are still needed.
                self._sum_shards_in_shared_memory(in_place=False)
            else:
                for b in self._buckets:
                    self._finish_reduce_scatter(b)
            self._reduced = True
        grads = [b.shard_grad for b in self._buckets]
        device = grads[0].device if grads else torch.device("cpu")
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
        return total.to(grads[0].dtype) if grads else total

    def _take_gradients(self) -> None:
        """This step's gradients leave backward's hands: sent if they were not, and not edited since."""
        self.synchronize()
        self._check_gradients()

    def _check_gradients(self) -> None:
        for b in self._buckets:
            b.check_grads_unchanged()

    def _sum_shards_in_shared_memory(self, in_place: bool) -> None:
        # Every rank's gradients are in its buffer. The barrier also tells how many times they were
        # sent since the last step: a rank that skipped a step() meets the others' next one.
        self._arena.barrier(STEP_AFTER_SENDS[min(self._sends, len(STEP_AFTER_SENDS) - 1)])
        for b in self._buckets:
            b.sum_shard_of_peers(1.0 / self.comm.size, in_place)
            b.shard_param.grad = b.shard_grad

    def _finish_reduce_scatter(self, b: _ShardBucket) -> None:
        b.reduce_work.wait()
        b.reduce_work = None
        if self._wire_dtype is None:
            b.grad_shard.mul_(1.0 / self.comm.size)
        elif b.shard_grad is not b.grad_shard:
            b.shard_grad.copy_(b.grad_shard)

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
        local_keys = [list(b.optimizer.state.get(b.shard_param, {})) for b in self._buckets]
        if self.comm.size > 1 and any(k != local_keys for k in self.comm.allgather_obj(local_keys)):
            raise RuntimeError("state_dict: ranks hold different optimizer state layouts; every rank "
                               "must have taken the same steps")
        index = self._indices()
        pending = []
        state = {}
        for b, keys in zip(self._buckets, local_keys):
            if not keys:
                continue
            shard_state = b.optimizer.state[b.shard_param]
            per_param = [{} for _ in b.params]
            for key in keys:
                value = shard_state[key]
                if torch.is_tensor(value) and key not in SCALAR_STATE:
                    full = torch.empty(b.padded, dtype=value.dtype, device=value.device)
                    work = self.comm.allgather_flat(full, value.detach().reshape(-1).contiguous(), async_op=True)
                    pending.append((work, full, b, per_param, key))
                else:
                    for entry in per_param:
                        entry[key] = value.clone() if torch.is_tensor(value) else value
            for p, entry in zip(b.params, per_param):
                state[index[p]] = entry
        for work, full, b, per_param, key in pending:
            work.wait()
            for p, off, entry in zip(b.params, b.offsets, per_param):
                entry[key] = full[off:off + p.numel()].view_as(p).clone()
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
            shard_states = {i: s for i, s in enumerate(self._shard_state(b, saved_state, saved_index) for b in buckets)
                            if s}
            inner_group = {k: v for k, v in groups[group].items() if k != "params"}
            inner_group.update({k: inner.param_groups[0][k] for k in IMPLEMENTATION_FLAGS
                                if k in inner.param_groups[0]})
            inner.state.clear()
            # The inner optimizer's own loader casts dtypes and devices the way torch does.
            inner.load_state_dict({"state": shard_states,
                                   "param_groups": [{**inner_group, "params": list(range(len(buckets)))}]})

    def _shard_state(self, b: _ShardBucket, saved_state: dict, saved_index: dict) -> dict:
        """This rank's shard of bucket ``b``'s state, cut from a whole state_dict's per-parameter state."""
        rank = self.comm.rank
        states = [saved_state.get(saved_index[p]) for p in b.params]
        known = [s for s in states if s]
        if not known:
            return {}
        counts = {_scalar(s[key]) for s in known for key in SCALAR_STATE if key in s}
        if (len(counts) > 1 or len(known) < len(states)) and rank == 0:
            continues = next((_scalar(known[0][k]) for k in SCALAR_STATE if k in known[0]), None)
            warnings.warn(
                f"load_state_dict: the {len(states)} parameters that share a shard (shapes "
                f"{[tuple(p.shape) for p in b.params]}) have different optimizer step counts or no state "
                f"for some ({sorted(map(str, counts))}, {len(states) - len(known)} without state). With "
                f"shard_state=True a shard has one step count and one state, so they all continue from "
                f"{continues}; the "
                f"first updates of those that had fewer steps differ from one process (Adam's bias "
                f"correction). Load into shard_state=False to continue exactly.", RuntimeWarning, stacklevel=3)
        shard_state = {}
        for key, value in known[0].items():
            if torch.is_tensor(value) and key not in SCALAR_STATE:
                full = torch.zeros(b.padded, dtype=value.dtype, device=b.flat.device)
                for p, off, s in zip(b.params, b.offsets, states):
                    if s and key in s:
                        if s[key].numel() != p.numel():
                            raise ValueError(f"loaded state {key!r} has {s[key].numel()} elements for a "
                                             f"parameter of shape {tuple(p.shape)}")
                        full[off:off + p.numel()].copy_(s[key].reshape(-1))
                shard_state[key] = full[rank * b.k:(rank + 1) * b.k].clone()
            else:
                # A copy: Adam counts its step in place, which must not touch the caller's dict.
                shard_state[key] = value.clone() if torch.is_tensor(value) else value
        return shard_state

    @property
    def state(self) -> dict:
        """This rank's shard state, keyed by the flat shard parameters (a fresh dict each time)."""
        return {b.shard_param: b.optimizer.state[b.shard_param]
                for b in self._buckets if b.shard_param in b.optimizer.state}

    @state.setter
    def state(self, value):
        raise AttributeError("the sharded optimizer's state is per shard: use load_state_dict()")

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds (about 1/size of the unsharded optimizer's).

        Example::

            >>> print(f"rank {comm.rank}: {optimizer.state_bytes() / 1e6:.1f} MB of optimizer state")
        """
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                   if torch.is_tensor(v))
