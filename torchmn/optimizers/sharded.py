"""The sharded multi-node optimizer (ZeRO stage 1): each rank updates, and keeps state for, 1/size
of the model; the parameters are all-gathered after the update (on one node they live once in
shared memory, so no all-gather is needed).

How a step goes, and why: ``docs/design/sharded-optimizer.md``. The parts: the layout of shards
(:mod:`.shard_layout`), the path through the node's shared memory (:mod:`.node_memory`), the
optimizers that update the shards (:mod:`.inner_optimizers`, :mod:`.fused_adam`) and the whole
``state_dict`` (:mod:`.shard_state`).
"""
from __future__ import annotations

from typing import Optional

import torch

from torchmn.communicators import Communicator
from torchmn.communicators.ops import mean_divisors
from torchmn.errors import TorchmnAttributeError, TorchmnNotImplementedError, TorchmnRuntimeError, TorchmnValueError
from torchmn.monitor import recorder
from torchmn.optimizers import fused_adam, join as joining, shard_state
from torchmn.optimizers.gradient_sync import GradientSyncOptimizer, could_share_memory, make_buckets
from torchmn.optimizers.inner_optimizers import IMPLEMENTATION_FLAGS, build_inner, check_optimizer, step_function
from torchmn.optimizers.node_memory import STEP_AFTER_SENDS, open_bucket_arena, place_buckets
from torchmn.optimizers.shard_layout import ShardBucket


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

    Attributes:
        fused_sum_and_step: per key of ``shard_groups``, the :class:`fused_adam.SumAndStep` that
            sums and updates that group's shards piece by piece; empty unless the ranks share node
            memory and the inner optimizer runs torch's fused Adam/AdamW kernel (a group left out
            is summed whole, then updated).

    Example::

        >>> opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm,
        ...                                           shard_state=True)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()                       # every rank holds the whole updated model again
        >>> state = opt.state_dict()         # on every rank: it gathers the shards
        >>> if comm.rank == 0:
        ...     torch.save(state, "opt.pt")
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, *, zero_fill: bool = True,
                 compression: Optional[str] = None, bucket_cap_mb: Optional[float] = None,
                 backward_passes_per_step: int = 1, double_buffering: bool = False):
        """Wrap ``optimizer``: broadcast the parameters from rank 0, cut them into shards, build
        the shard optimizers and hook the buckets to backward (collective;
        ``create_multi_node_optimizer(..., shard_state=True)`` calls it).

        The model's parameters become views into flat buffers: in memory the node's ranks share
        where every rank is on one node (a communicator that can share memory there), the
        gradients are uncompressed CPU ones and ``/dev/shm`` has room; else this rank's own.

        Args:
            optimizer: an elementwise ``torch.optim.Optimizer`` to wrap (built on every rank).
            comm: the communicator.
            zero_fill: must be True (a gradient missing on some ranks is summed as zeros).
            compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype gradients travel in.
            bucket_cap_mb: MB of gradients per bucket (None: the communicator's).
            backward_passes_per_step: backward passes accumulated locally per averaging.
            double_buffering: must be False (the update needs this step's gradients).

        Raises:
            TypeError: ``optimizer`` is not a torch optimizer, or not an elementwise one.
            ValueError: an unknown ``compression`` (or ``"powersgd"``), ``backward_passes_per_step < 1``,
                ``double_buffering=True``, ``zero_fill=False``, CPU parameters under NCCL, or
                compression of complex parameters.
            CollectiveMismatchError: the ranks' models differ in layout.

        Example::

            >>> optimizer = ShardedMultiNodeOptimizer(torch.optim.Adam(model.parameters()), comm)
        """
        super().__init__(optimizer, comm, compression=compression,
                         backward_passes_per_step=backward_passes_per_step)
        if compression == "powersgd":
            raise TorchmnValueError("shard_state=True with compression='powersgd': each rank updates its slice "
                                    "from reduce-scattered gradients, which PowerSGD's low-rank messages do not "
                                    "give; use the replicated optimizer (shard_state=False)")
        check_optimizer(optimizer)
        if double_buffering:
            raise TorchmnValueError("shard_state=True cannot be combined with double_buffering=True: the shard "
                                    "update needs this step's reduce-scattered gradients")
        if not zero_fill:
            raise TorchmnValueError("shard_state=True needs zero_fill=True: one rank updates each slice of a "
                                    "parameter for all ranks, so a gradient missing on some ranks is summed as zeros "
                                    "(zero_fill=False would leave the ranks' models different)")
        owners = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    owners.setdefault(p, gi)
        params = self.trainable_params()
        cap = comm.grad_bucket_cap_bytes if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)

        def same_bucket(a, b):  # a bucket never mixes parameter groups, dtypes or devices
            return owners[a] == owners[b] and a.dtype == b.dtype and a.device == b.device

        def build(run):
            return ShardBucket(run, owners[run[0]], comm.rank, comm.size, self.wire_dtype)
        self.buckets = make_buckets(params, cap, build, same_bucket)
        self._reduced = False  # clip_grad_norm_ took this step's averaged shards already
        self.arena = self._place_in_shared_memory() if could_share_memory(self.comm, params, self.compression) else None
        if self.arena is None:
            for b in self.buckets:
                b.place()
                b.place_wire()
        # On one node the shards are all updated at once: one inner optimizer per group (and dtype
        # and device, which one fused kernel call needs alike), as each step() costs some 200 us of
        # Python when it runs cold between forward and backward, as much as Adam on a 1 MB shard.
        # Elsewhere each bucket is updated as its reduce-scatter lands, so that its all-gather
        # overlaps the next buckets' updates: one inner optimizer per bucket (one over the group
        # would walk all its shards every time).
        self.shard_groups = {}
        for i, b in enumerate(self.buckets):
            b.point_params()
            kind = (b.dtype, b.device) if self.arena is not None else i
            self.shard_groups.setdefault((b.group, kind), []).append(b)
        self.fused_sum_and_step = {}  # per inner optimizer on one node, where its fused kernel allows
        for key, buckets in self.shard_groups.items():
            inner = build_inner(type(optimizer), [sp for b in buckets for sp in b.shard_params],
                                optimizer.param_groups[key[0]])
            step = step_function(inner)
            for b in buckets:
                b.optimizer, b.step_shard = inner, step
            if self.arena is not None and fused_adam.kernel_for(inner) is not None:
                self.fused_sum_and_step[key] = fused_adam.SumAndStep(inner, buckets, 1.0 / comm.size)
        self.attach_hooks(params, self.buckets)
        if self.wrapped.state:
            # A torch optimizer with state (loaded before wrapping, or handed back by remove_hooks
            # to unfreeze parameters) keeps it, as the replicated optimizer does.
            self.load_whole_state_dict(self.wrapped.state_dict())

    def _place_in_shared_memory(self):
        """On one node, put the flat buffers in memory the node's ranks share, or return None.

        The parameters then exist once per node: a rank that updates its shard updates the model
        of every rank, so no all-gather is needed. Each rank's gradient buffer is readable by the
        others, so the reduce-scatter is each rank summing its shard straight from them.
        """
        opened = open_bucket_arena(self.comm, [b.region_numel * b.itemsize for b in self.buckets])
        if opened is None:
            return None
        arena, offsets = opened
        place_buckets(arena, self.buckets, offsets, offsets, self.comm.rank)
        arena.barrier("set-up")
        return arena

    def _send(self, bucket: ShardBucket) -> None:
        bucket.sent = True
        self._reduced = False  # new gradients: whatever clip_grad_norm_ took is stale
        if self.arena is not None:
            # Into this rank's shared buffer, divided by size on the way (exact for powers of two);
            # step() sums the shards from there. (Inside torchmn.join, by the ranks that have data.)
            bucket.node.pack_for_peers(1.0 / self.contributors)
            bucket.ready.clear()
            return
        if bucket.reduce_work is not None:
            # The last backward's, never taken by a step() (all ranks skipped it): it must be done
            # with the wire buffer before pack() rewrites it.
            bucket.reduce_work.wait()
        # Half-precision gradients (compressed, or the model's own) are divided before the sum, so
        # that it cannot overflow.
        before, _ = mean_divisors(bucket.wire_dtype, self.contributors)
        bucket.reduce_work = self.comm.reduce_scatter_flat(bucket.pack(1.0 / before if before > 1 else None),
                                                           bucket.grad_shard, async_op=True)
        bucket.ready.clear()

    def _all_sent(self) -> None:
        # Backward is done with every gradient now. Their versions are noted here, not as each
        # bucket goes: gradients that are views of one tensor (parameters used through torch.cat)
        # share a version counter, which accumulating into a later bucket's gradient bumps.
        for b in self.buckets:
            b.note_versions()

    def sync_hyperparameters(self) -> None:
        """Copy the wrapped optimizer's hyperparameters (``lr``, ``betas``, ...) into the shard
        optimizers, which read their own copies; ``step()`` does it every time.

        Every entry of each group but ``params``, ``fused`` and ``foreach`` (the shard
        optimizers' choice of kernel stays theirs). No communication.

        Example::

            >>> optimizer.param_groups[0]["lr"] = 0.01      # what an LR scheduler does
            >>> optimizer.sync_hyperparameters()            # the shards use it from now on
        """
        # Schedulers and users change the outer groups; the shard optimizers read their own copies.
        for (group, _), buckets in self.shard_groups.items():
            inner = buckets[0].optimizer.param_groups[0]
            for key, value in self.wrapped.param_groups[group].items():
                if key != "params" and key not in IMPLEMENTATION_FLAGS:
                    inner[key] = value

    # ----------------------------------------------------------------------------- public
    def step(self, closure=None):
        """Update this rank's shard with the averaged gradients, then all-gather the parameters.

        Args:
            closure: not supported (multi-node optimizers need backward before ``step()``).

        Returns:
            None, always (no closure, so no loss to return).

        Raises:
            ValueError: a closure was passed.
            RuntimeError: the last backward raised, a ``.grad`` was edited after backward, or
                parameters were added or unfrozen since wrapping.
            CollectiveMismatchError: (one node) ranks are at different steps (one skipped ``step()``).

        Example::

            >>> loss_fn(model(x), y).backward(); optimizer.step()
        """
        self.check_step(closure, "each rank updates its shards, so a closure's every evaluation would need a "
                                 "gather of the parameters")
        # What an LR scheduler's patch of the wrapped step() would set (see run_as_wrapped_step).
        self.wrapped._opt_called = True
        reduced, self._reduced = self._reduced, False
        if reduced:  # by clip_grad_norm_, which took them; an edit since would still be lost
            self._check_gradients()
        else:
            self._take_gradients()
        self._sent = False
        self.sync_hyperparameters()
        for b in self.buckets:
            b.sent = False
        if self.arena is not None:
            t0 = recorder.now() if recorder.on else None
            if reduced:
                for buckets in self.shard_groups.values():
                    buckets[0].step_shard()
            else:
                self._sum_and_update_in_shared_memory()
            if t0 is not None:
                recorder.event("sum and update", "update", t0, recorder.now(), {"shard": "this rank's"})
            # Every shard is updated in the shared parameters, and nobody reads a gradient buffer
            # any more, so backward may write them again.
            with recorder.waiting("wait for the node's update", "average"):
                self.arena.barrier("step done (shards updated)")
            self._forget_gradients()
            if t0 is not None:
                recorder.step_ended(recorder.now())
            return None
        t0 = recorder.now() if recorder.on else None
        for b in self.buckets:
            if not reduced:  # bucket by bucket, so early buckets' all-gathers overlap later updates
                self._finish_reduce_scatter(b)
            b.step_shard()
            if b.send is not None:
                b.gather_work = self.comm.allgather_flat(b.gathered, b.send_shards(), async_op=True)
        with recorder.waiting("wait for all-gathers", "average"):
            for b in self.buckets:
                if b.gather_work is not None:
                    b.gather_work.wait()
                    b.gather_work = None
                    b.take_gathered()
        self._forget_gradients()
        if t0 is not None:
            t1 = recorder.now()
            recorder.event("update and all-gather", "update", t0, t1)
            recorder.step_ended(t1)
        return None

    def register_step_pre_hook(self, hook):
        """Not supported with ``shard_state=True``: call the hook around ``optimizer.step()``.

        ``register_step_post_hook`` is the same method, and refuses alike.

        Args:
            hook: the hook that would be registered; not used.

        Raises:
            NotImplementedError: always: each rank updates its shards with optimizers of its own,
                so a hook would see neither the model's parameters nor the whole update.

        Example::

            >>> optimizer.register_step_pre_hook(lambda opt, args, kwargs: None)
            Traceback (most recent call last):
            torchmn.errors.TorchmnNotImplementedError: step hooks with shard_state=True: ...
        """
        # Global hooks (torch.optim.optimizer.register_optimizer_step_pre_hook) do not run for the
        # shard optimizers either: they are stepped without torch's hook wrapper (inner_optimizers.step_function).
        raise TorchmnNotImplementedError("step hooks with shard_state=True: each rank updates its shards with "
                                         "optimizers of its own, so a hook would see neither the model's parameters "
                                         "nor the whole update; call it around optimizer.step() instead")

    register_step_post_hook = register_step_pre_hook

    def _forget_gradients(self) -> None:
        self._sends = 0
        for b in self.buckets:
            b.packed = b.versions = None  # so that the next zero_grad frees them

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the averaged gradients by their norm over the whole model; returns that norm.

        What ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does for one process, for
        gradients that exist only as shards: call it between backward and ``step()``, on every
        rank. Each rank takes its shard of the averaged gradients (which ``step()`` then uses),
        the ranks add up their shards' norms, and every shard is scaled by the same factor.

        Args:
            max_norm: the largest total norm the gradients may have.
            norm_type: the norm's order (``2.0``, ``float("inf")``, ...).
            error_if_nonfinite: raise where the total norm is NaN or infinite.
            foreach: accepted for torch's signature.

        Returns:
            The total norm of the averaged gradients, before clipping.

        Raises:
            ValueError: ``norm_type`` is not positive.
            RuntimeError: the norm is not finite and ``error_if_nonfinite`` is set.
            JoinError: called inside ``torchmn.join`` (a rank out of data could not repeat it).

        Example::

            >>> loss_fn(model(x), y).backward()
            >>> norm = optimizer.clip_grad_norm_(1.0)
            >>> optimizer.step()
        """
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise TorchmnValueError(f"clip_grad_norm_: norm_type must be positive (2.0, inf, ...), not {norm_type}")
        joining.refuse_inside(self, "optimizer.clip_grad_norm_ with shard_state=True",
                              "Wrap with shard_state=False, or the default on one node, whose clip_grad_norm_ "
                              "needs no collective")
        if not self._reduced:
            self._take_gradients()
            if self.arena is not None:
                self._sum_shards_in_shared_memory()
            else:
                for b in self.buckets:
                    self._finish_reduce_scatter(b)
            self._reduced = True
        shards = [(sp.grad, hi - lo) for b in self.buckets for sp, (lo, hi) in zip(b.shard_params, b.slices)
                  if sp.grad is not None]
        # The real elements only: a shard's padding must stay 0 (the sums never rewrite it), and a
        # non-finite factor (a skipped bad step) would make it NaN in every later norm.
        grads = [g[:n] for g, n in shards if n]
        device = shards[0][0].device if shards else torch.device("cpu")
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type).to(device, torch.float64) for g in grads]) \
            if grads else torch.zeros(1, dtype=torch.float64)
        if norm_type == float("inf"):
            # gloo's max passes a NaN over or not by the ranks' order: whether any rank has one
            # travels beside the largest of the rest, so every rank sees the NaN, as torch would.
            local = norms.max()
            both = self.comm.allreduce(torch.stack([torch.nan_to_num(local, nan=-1.0), local.isnan().double()]),
                                       op="max")
            total = torch.full_like(local, float("nan")) if both[1] > 0 else both[0]
        else:
            total = self.comm.allreduce(norms.pow(norm_type).sum()).pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise TorchmnRuntimeError(f"rank {self.comm.rank}: the total norm of order {norm_type} of the averaged "
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
        for b in self.buckets:
            b.check_grads_unchanged()

    def _gradients_in(self) -> None:
        # Every rank's gradients are in its buffer. The barrier also tells how many times they were
        # sent since the last step: a rank that skipped a step() meets the others' next one.
        self.arena.barrier(STEP_AFTER_SENDS[min(self._sends, len(STEP_AFTER_SENDS) - 1)])

    def _sum_shards_in_shared_memory(self) -> None:
        # For clip_grad_norm_, which needs every sum before any update.
        self._gradients_in()
        for b in self.buckets:
            b.node.sum_shard_of_peers(1.0 / self.contributors)

    def _sum_and_update_in_shared_memory(self) -> None:
        """Sum each shard from the node's buffers and update it: piece by piece where the fused
        Adam kernel allows (:class:`fused_adam.SumAndStep`), else all sums, then the update."""
        self._gradients_in()
        scale = 1.0 / self.contributors
        for key, buckets in self.shard_groups.items():
            sum_and_step = self.fused_sum_and_step.get(key)
            if sum_and_step is not None:
                sum_and_step.scale = scale  # fewer ranks than size inside torchmn.join
            if sum_and_step is None or not sum_and_step():
                for b in buckets:
                    b.node.sum_shard_of_peers(scale)
                buckets[0].step_shard()

    def _finish_reduce_scatter(self, b: ShardBucket) -> None:
        with recorder.waiting("wait for reduce-scatter", "average"):
            b.reduce_work.wait()
            b.reduce_work = None
        _, after = mean_divisors(b.wire_dtype, self.contributors)
        if after > 1:
            b.grad_shard.mul_(1.0 / after)
        if b.wire_dtype != b.dtype:
            b.shard_grad.copy_(b.grad_shard[:b.k])
        b.take_reduced()

    def remove_hooks(self) -> None:
        """Detach from the parameters' gradient hooks, and hand the whole state to the wrapped
        optimizer, which keeps working alone and keeps its state when wrapped again (to unfreeze
        parameters). Every rank must call it (the state is gathered, as by :meth:`state_dict`).
        Parameters that lived in memory the node's ranks share move into memory of their own,
        keeping their values.

        Example::

            >>> optimizer.remove_hooks()
            >>> backbone.requires_grad_(True)                   # unfreeze
            >>> optimizer = torchmn.create_multi_node_optimizer(optimizer.wrapped, comm)
        """
        whole = self.whole_state_dict()
        # Copies: the node-shared optimizer's state is views into memory that goes with it.
        whole["state"] = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                          for i, entry in whole["state"].items()}
        super().remove_hooks()
        if self.arena is not None:
            # The parameters and gradients are views into memory the node's ranks share: alone,
            # each rank's update would land there once per rank.
            with torch.no_grad():
                for group in self.wrapped.param_groups:
                    for p in group["params"]:
                        p.data = p.data.clone()
                        if p.grad is not None:
                            p.grad = p.grad.clone()
        self.wrapped.load_state_dict(whole)

    def whole_state_dict(self) -> dict:
        """The whole optimizer state, in the wrapped optimizer's format, on every rank
        (``state_dict()`` gives it through the state-dict hooks).

        Every rank must call it (the shards are all-gathered). The result is what the unsharded
        optimizer would hold, so it loads with any rank count or into the plain torch optimizer.

        Returns:
            ``{"state": ..., "param_groups": ...}`` as ``torch.optim.Optimizer.state_dict()``.

        Raises:
            RuntimeError: the ranks hold different state layouts (they took different steps).

        Example::

            >>> sd = optimizer.state_dict()          # all ranks
            >>> if comm.rank == 0: torch.save({"model": model.state_dict(), "opt": sd}, path)
        """
        return shard_state.gather_state_dict(self.comm, self.wrapped.param_groups, self.buckets)

    def load_whole_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from :meth:`state_dict` on any rank count, or a plain torch optimizer;
        ``load_state_dict()`` does, through the state-dict hooks).

        Each rank keeps only its own shard; no communication.

        Args:
            state_dict: a whole state, from any rank count.

        Raises:
            ValueError: it does not fit the parameters (other groups, or entries of other sizes).

        Example::

            >>> optimizer.load_whole_state_dict(torch.load(path)["opt"])   # without the hooks
        """
        shard_state.load_state_dict(state_dict, self.wrapped.param_groups, self.shard_groups)

    def local_state_dict(self) -> dict:
        """This rank's part of the optimizer state, for checkpoints that every rank writes its own
        part of (no communication; ``torchmn.checkpoint`` uses it).

        Returns:
            This rank's slices of the per-element state, with the element range of each parameter
            they hold and the hyperparameters; :meth:`load_local_state_dicts` takes every rank's.

        Example::

            >>> torch.save(optimizer.local_state_dict(), f"opt_rank{comm.rank}.pt")
        """
        return shard_state.local_part(self.comm, self.wrapped.param_groups, self.buckets)

    def load_local_state_dicts(self, parts: list) -> None:
        """Load the state from the parts every rank of a job wrote with :meth:`local_state_dict`,
        on any rank count (each rank keeps its own shard of the whole).

        Args:
            parts: every saving rank's part, in rank order.

        Raises:
            ValueError: the parts are not one job's, or do not fit this optimizer's parameters.

        Example::

            >>> optimizer.load_local_state_dicts([torch.load(f"opt_rank{r}.pt") for r in range(4)])
        """
        self.load_state_dict(shard_state.merge_parts(parts, self.wrapped.param_groups))

    @property
    def state(self) -> dict:
        """This rank's shard state.

        Returns:
            A fresh dict, keyed by the shard parameters (this rank's slice of each parameter).
        """
        return {sp: b.optimizer.state[sp] for b in self.buckets for sp in b.shard_params if sp in b.optimizer.state}

    @state.setter
    def state(self, value):
        raise TorchmnAttributeError("the sharded optimizer's state is per shard: use load_state_dict()")

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank keeps and updates: its shards (which the
        default optimizer on one node keeps in memory the node's ranks share).

        Returns:
            About 1/size of the unsharded optimizer's, plus the padding of each parameter to a
            multiple of size (at most size elements per tensor).

        Example::

            >>> print(f"rank {comm.rank}: {optimizer.state_bytes() / 1e6:.1f} MB of optimizer state")
        """
        # The shard optimizers' own state (each shard parameter has one optimizer).
        return sum(v.numel() * v.element_size() for buckets in self.shard_groups.values()
                   for s in buckets[0].optimizer.state.values() for v in s.values() if torch.is_tensor(v))
