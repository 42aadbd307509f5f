"""The multi-node optimizer: gradients averaged over ranks while backward still runs.

Buckets go out from backward hooks (see :mod:`torchmn.optimizers.gradient_sync`). By the time
``loss.backward()`` returns, ``.grad`` holds the averaged gradients, so gradient clipping and
anything else between backward and ``step()`` sees what the update will use.

On one node (the hierarchical communicator on CPU) the buckets live in shared memory: the hooks
only copy gradients into this rank's buffers, and at the end of backward each rank sums its part
of every bucket straight from all ranks' buffers, then copies the whole average back.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from torchmn.communicators import Communicator
from torchmn.communicators.ops import mean_divisors
from torchmn.communicators.errors import CollectiveMismatchError
from torchmn.communicators.shm import sum_into
from torchmn.errors import TorchmnRuntimeError, TorchmnValueError
from torchmn.monitor import recorder
from torchmn.optimizers import join as joining
from torchmn.optimizers.gradient_sync import (GradientSyncOptimizer, copy_scaled, could_share_memory, describe_rank,
                                              make_buckets)
from torchmn.optimizers.node_memory import open_bucket_arena, region_view
from torchmn.optimizers.memory_order import elements, shaped
from torchmn.optimizers.powersgd import LowRankAverager


class _Bucket:
    """Gradients of consecutive parameters (one dtype, one device) sent in one message.

    Without compression, ``.grad`` of each parameter becomes a view into the bucket after the
    first step, so later steps average the gradients where backward left them (no copies), unless
    something replaced ``.grad`` in between (``zero_grad()``'s default ``set_to_none``), which
    costs one copy in.

    After the gradients, the buffer holds one flag per parameter (1 where this rank has a
    gradient), reduced with them: a parameter that no rank has a gradient for keeps ``.grad``
    ``None``, so the optimizer leaves it alone, as in one process. Last come two numbers that tell
    whether every rank has taken as many ``step()`` calls: the parity of this rank's count, and 1
    (both 0 from a rank that is not counted: one sitting out in ``hvd.join()``). Their sums agree
    (or the first is 0) only where the counted ranks' parities are the same, and a rank that
    skipped a ``step()`` the others took has the other parity at the next backward.
    """

    def __init__(self, params: list[torch.nn.Parameter], wire_dtype: Optional[torch.dtype], as_views: bool,
                 comm: Communicator):
        self.params = params
        self.comm = comm  # its size, and the ranks of a zero_fill=False mismatch
        self.data_numel = sum(p.numel() for p in params)
        self.numel = self.data_numel + len(params) + 2  # the gradients, the flags, the step check
        self.wire_dtype = wire_dtype or params[0].dtype
        self.as_views = as_views and self.wire_dtype == params[0].dtype
        self.ready: set[int] = set()
        self.work = None
        self.sent_at = 0.0  # when its message went out (recorder clock), for the timeline
        self.had_grad: list[bool] = []
        self.step_parity: Optional[int] = 0  # of the optimizer's step() count; None: not counted
        self.buffer: Optional[torch.Tensor] = None
        self.views: list[torch.Tensor] = []

    def place(self, buffer: torch.Tensor) -> None:
        """Use ``buffer`` (``numel`` elements of the wire dtype) as this bucket's buffer."""
        self.buffer = buffer
        self.data = buffer[:self.data_numel]
        self.flags = buffer[self.data_numel:self.numel - 2]
        self.step_check = buffer[self.numel - 2:]
        offset = 0
        for p in self.params:
            self.views.append(shaped(buffer[offset:offset + p.numel()], p))
            offset += p.numel()

    def pack(self, scale: Optional[float]) -> torch.Tensor:
        if self.buffer is None:
            self.place(torch.zeros(self.numel, dtype=self.wire_dtype, device=self.params[0].device))
        grads = [p.grad for p in self.params]
        self.had_grad = [g is not None for g in grads]
        unit = 1.0 if scale is None else scale
        if all(self.had_grad):
            self.buffer[self.data_numel:].fill_(unit)
        else:
            self.flags.copy_(torch.tensor(self.had_grad, dtype=self.flags.dtype) * unit)
            self.step_check[1] = unit
        if self.step_parity is None:
            self.step_check.zero_()
        else:
            self.step_check[0] = unit * self.step_parity
        if (scale is None or len(grads) > _MANY) and \
                all(g is not None and not _is_view(g, v) and g.dtype == v.dtype for g, v in zip(grads, self.views)):
            # Many small tensors: one call (and one multiply) instead of one or two per tensor.
            torch.cat([elements(g, p) for g, p in zip(grads, self.params)], out=self.data)
            if scale is not None:
                self.data.mul_(scale)
            return self.buffer
        for g, view in zip(grads, self.views):
            if g is None:
                view.zero_()
            elif _is_view(g, view):  # backward accumulated into the bucket already
                if scale is not None:
                    view.mul_(scale)
            else:
                copy_scaled(view, g, scale)
        return self.buffer

    def unpack(self, post_scale: Optional[float], zero_fill: bool, result: Optional[torch.Tensor] = None) -> None:
        """Averaged gradients into ``.grad``, from the buffer or from ``result`` (already scaled)."""
        if result is not None:
            self.buffer.copy_(result)
        elif post_scale is not None:
            self.buffer.mul_(post_scale)
        # Where this rank had no gradient, whether some other rank had one (read only then). With
        # zero_fill=False every rank must have the same gradients: always read, to check.
        flags = self.flags.real if self.flags.is_complex() else self.flags
        elsewhere = flags.tolist() if not (zero_fill and all(self.had_grad)) else None
        if not zero_fill:
            self._check_same_gradients(elsewhere)
        for i, (p, had, view) in enumerate(zip(self.params, self.had_grad, self.views)):
            if not had and (not zero_fill or elsewhere[i] == 0):
                # No gradient to update with. With double buffering .grad holds this step's own,
                # not yet averaged, gradient: it must not reach the update either.
                if p.grad is not None:
                    p.grad = None
                continue
            if self.as_views:
                if p.grad is not view:
                    p.grad = view
            elif p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)

    def _check_same_gradients(self, flags: list[float]) -> None:
        """zero_fill=False: raise on every rank (the flags are the same everywhere) where some ranks
        had a parameter's gradient and others not; updating it on some ranks only would make the
        ranks' models differ."""
        # Each flag is the fraction of ranks that had the gradient (reduced and scaled with them);
        # half a rank's share of slack covers float16/bfloat16 rounding.
        slack = 0.5 / self.comm.size
        for i, (p, flag) in enumerate(zip(self.params, flags)):
            if slack < flag < 1.0 - slack:
                # Every rank is here alike (the flags are the same everywhere): one more exchange
                # names the ranks.
                had = [r for r, yes in enumerate(self.comm.allgather_obj(self.had_grad[i])) if yes]
                raise CollectiveMismatchError(
                    f"create_multi_node_optimizer(zero_fill=False): a parameter of shape {tuple(p.shape)} has "
                    f"a gradient on rank(s) {had} only, of {self.comm.size}, so only those would update it and the "
                    f"ranks' models would differ. Use zero_fill=True (the default: a missing gradient counts as "
                    f"zeros), or give every rank the same parameters (raised on rank {self.comm.rank})")

    def steps_agree(self) -> bool:
        """After unpack: whether every rank that sent this bucket had taken as many ``step()``
        calls, as far as their parity tells (the same answer on every rank)."""
        check = self.step_check.real if self.step_check.is_complex() else self.step_check
        odd, ranks = check.tolist()
        if ranks == 0:  # none counted
            return True
        # Each number was scaled alike on every rank; half a rank's share of slack covers
        # float16/bfloat16 rounding.
        share, slack = odd / ranks, 0.5 / self.comm.size
        return not slack < share < 1.0 - slack


_MANY = 8  # tensors in a bucket from which one fused copy beats a call per tensor


def _is_view(g: torch.Tensor, view: torch.Tensor) -> bool:
    return g.data_ptr() == view.data_ptr() and g.shape == view.shape


def _abandon(buckets) -> None:
    """After a step that raised while it took its averages (a refusal every rank raises alike, which
    a script may catch to go on): wait out the messages still in flight and forget which gradients
    the buckets held, so that the next backward starts from empty buckets, as after a step that
    ended (a bucket left marked ready would be sent before its new gradients)."""
    for bucket in buckets:
        work, bucket.work = bucket.work, None
        if work is not None:
            with contextlib.suppress(Exception):  # the step's own error is the one to raise
                work.wait()
        bucket.ready.clear()


class MultiNodeOptimizer(GradientSyncOptimizer):
    """Wraps a ``torch.optim.Optimizer`` so that ``step()`` uses gradients averaged over ranks.

    Build it with :func:`create_multi_node_optimizer`. It behaves like the wrapped optimizer
    (``param_groups``, ``state``, ``state_dict``, LR schedulers) because it shares them.

    After backward, each ``.grad`` is a view into the wrapper's gradient buffers (no copy out, as
    with DDP's ``gradient_as_bucket_view=True``): a ``.grad`` tensor kept from one step to the
    next is overwritten by the next step's average; ``.clone()`` it to keep it.

    Example::

        >>> optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
        >>> loss_fn(model(x), y).backward()       # .grad holds the average over ranks here
        >>> optimizer.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, *, double_buffering: bool,
                 zero_fill: bool, compression: Optional[str], bucket_cap_mb: Optional[float],
                 backward_passes_per_step: int, powersgd_rank: int = 4):
        """Wrap ``optimizer``: broadcast the parameters from rank 0, build the gradient buckets and
        hook them to backward (collective; :func:`create_multi_node_optimizer` calls it).

        Where every rank is on one node and the communicator can share memory there (the
        hierarchical one, CPU gradients), without double buffering or compression, the buckets
        go in memory the node's ranks share, if ``/dev/shm`` has room; else they are averaged
        with allreduces.

        Args:
            optimizer: the ``torch.optim.Optimizer`` to wrap (built on every rank).
            comm: the communicator.
            double_buffering: update with the previous step's averages (ChainerMN's semantics).
            zero_fill: count a gradient missing on some ranks as zeros (with False, such a
                gradient raises :class:`~torchmn.CollectiveMismatchError`).
            compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype gradients travel in;
                ``"powersgd"``: as low-rank approximations (:mod:`torchmn.optimizers.powersgd`).
            bucket_cap_mb: MB of gradients per message (None: the communicator's).
            backward_passes_per_step: backward passes accumulated locally per averaging.
            powersgd_rank: the approximations' rank under ``compression="powersgd"``.

        Raises:
            TypeError: ``optimizer`` is not a torch optimizer.
            ValueError: an unknown ``compression``, ``backward_passes_per_step < 1``, compression
                of complex parameters; under ``"powersgd"``: half-precision parameters, double
                buffering, or a ``powersgd_rank`` that is not a positive integer.
            CollectiveMismatchError: the ranks' models differ in layout.

        Example::

            >>> optimizer = MultiNodeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
            ...                                double_buffering=False, zero_fill=True, compression=None,
            ...                                bucket_cap_mb=None, backward_passes_per_step=1)
        """
        super().__init__(optimizer, comm, compression=compression,
                         backward_passes_per_step=backward_passes_per_step)
        low_rank = self.compression == "powersgd"
        if low_rank and double_buffering:
            raise TorchmnValueError("compression='powersgd' with double_buffering=True: PowerSGD's error feedback "
                                    "needs each step's average before the next step's gradients go out; use "
                                    "double_buffering=False")
        if low_rank and (not isinstance(powersgd_rank, int) or isinstance(powersgd_rank, bool) or powersgd_rank < 1):
            raise TorchmnValueError(f"powersgd_rank must be a positive integer, not {powersgd_rank!r}")
        self.double_buffering = double_buffering
        self.zero_fill = zero_fill
        # A world of one averages nothing: the gradients stay where backward put them (compression
        # and double buffering, which change what the update sees, keep their way).
        self._alone = comm.size == 1 and self.compression is None and not double_buffering
        self._first_step = True
        self._step_sent = False     # double buffering: this step's gradients have gone out
        # step() calls on this rank, whose parity each message carries (see _Bucket): a rank that
        # skipped one the others took is found at the next averaging instead of drifting apart.
        self._steps_taken = 0
        self._sitting_out = False  # in average_without_gradients: not counted
        params = self.trainable_params()
        cap = comm.grad_bucket_cap_bytes if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)
        # Double buffering keeps gradients out of buckets that may still be in flight.
        as_views = not double_buffering

        def same_bucket(a, b):
            return a.dtype == b.dtype and a.device == b.device

        def build(run):
            return _Bucket(run, self.wire_dtype, as_views, comm)
        self._bucket_sets = [make_buckets(params, cap, build, same_bucket)]
        if double_buffering:
            self._bucket_sets.append(make_buckets(params, cap, build, same_bucket))
        self._current = 0           # which bucket set this backward fills
        self._in_flight: list[int] = []  # double buffering: sets sent but not yet used, oldest first
        self.arena = None
        if not double_buffering and could_share_memory(self.comm, params, self.compression):
            self.arena = self._place_in_shared_memory()
        self._averager = LowRankAverager(powersgd_rank, self.buckets, comm) if low_rank else None
        self.attach_hooks(params, self._bucket_sets[0])

    def _place_in_shared_memory(self):
        """On one node, put each rank's buckets in memory the node's ranks share, or return None.

        Backward's hooks then only copy gradients into this rank's buffers; at the end of backward
        each rank sums its part of every bucket straight from all ranks' buffers into a shared
        result, and copies the whole result back: one barrier-separated pass, no slot copies.
        """
        buckets = self._bucket_sets[0]
        opened = open_bucket_arena(self.comm, [b.numel * b.params[0].element_size() for b in buckets])
        if opened is None:
            return None
        arena, offsets = opened
        self._results, self._peer_buffers = [], []
        for b, offset in zip(buckets, offsets):
            def view(region, b=b, offset=offset):
                return region_view(region, offset, b.numel, b.wire_dtype)
            b.place(view(arena.regions[arena.local_rank]))
            self._peer_buffers.append([view(region) for region in arena.regions])
            self._results.append(view(arena.shared))
        return arena

    def _reduce_in_shared_memory(self) -> None:
        arena = self.arena
        arena.barrier("backward done (gradients in)")  # every rank's gradients are in its buffers
        for i, (b, result, peers) in enumerate(zip(self.buckets, self._results, self._peer_buffers)):
            t0 = recorder.now() if recorder.timeline_on else None
            lo, hi = arena.my_chunk(b.numel, result.element_size())
            if hi > lo:
                sum_into(result[lo:hi], [peer[lo:hi] for peer in peers])
            if t0 is not None:  # this rank's chunk of the bucket, summed from every rank's buffer
                recorder.event(f"bucket {i}", "average", t0, recorder.now(), {"path": "shared memory"},
                               thread="averaging")
        arena.barrier("averaged gradients ready")      # the whole result is there
        try:
            for b, result in zip(self.buckets, self._results):
                b.unpack(None, self.zero_fill, result=result)
                b.ready.clear()
        except BaseException:
            _abandon(self.buckets)
            raise
        self._check_same_steps(self.buckets)
        # No barrier needed after the copy-out: the result is written again only after the next
        # step's first barrier, which every rank reaches after its own copy-out.

    @property
    def buckets(self) -> list[_Bucket]:
        """The gradient buckets this backward fills, in the order they are sent (with double
        buffering, one of the two sets, alternating from step to step)."""
        return self._bucket_sets[self._current]

    def _send(self, bucket: _Bucket) -> None:
        if self._alone:
            return
        bucket.step_parity = None if self._sitting_out else self._steps_taken % 2
        if self.arena is not None:
            # Into this rank's shared buffer, divided by size on the way (exact for powers of two);
            # summed at the end of backward. (Inside torchmn.join, by the ranks that still have data.)
            bucket.pack(1.0 / self.contributors)
            return
        if self.double_buffering and self._step_sent:
            raise TorchmnRuntimeError(
                f"{describe_rank(self.comm)}: a second backward() before step() with double_buffering=True. Each "
                f"backward's gradients go out when it ends and the next step() updates with them, so a "
                f"second one would overwrite gradients still in flight. To accumulate gradients over several "
                f"backward passes, use backward_passes_per_step=k or optimizer.no_sync(). A second backward can "
                f"also come unasked: another loss backpropagating through these parameters (a GAN's generator "
                f"loss through the discriminator: freeze it with requires_grad_(False) meanwhile), or "
                f"checkpoint(..., use_reentrant=True), whose every segment is a backward of its own (use "
                f"use_reentrant=False)")
        bucket.sent_at = recorder.now()
        if self._averager is not None:
            self._averager.start(bucket)  # packs it, once a message a raised backward left is done
            return
        if bucket.work is not None:
            # Sent by a backward that raised (see _check_backward_ended): done with the buffer first.
            bucket.work.wait()
        # Half-precision gradients (compressed, or the model's own) are divided before the sum, so
        # that it cannot overflow.
        before, _ = mean_divisors(bucket.wire_dtype, self.contributors)
        bucket.work = self.comm.allreduce_flat(bucket.pack(1.0 / before if before > 1 else None), async_op=True)

    def _all_sent(self) -> None:
        if self._alone:
            return
        if self.arena is not None:
            self._reduce_in_shared_memory()
        elif self.double_buffering:
            self._step_sent = True
            self._in_flight.append(self._current)
            self._current = 1 - self._current
        else:
            self._finish(self._current)

    def _finish(self, set_index: int) -> None:
        buckets = self._bucket_sets[set_index]
        with recorder.waiting("wait for averages", "average"):
            try:
                if self._averager is not None:  # the averages are in the buffers, already divided
                    self._averager.finish(buckets, self.contributors)
                for i, bucket in enumerate(buckets):
                    if self._averager is None:
                        bucket.work.wait()
                        bucket.work = None
                    if recorder.timeline_on:  # from the send, during backward, to its average's arrival
                        recorder.event(f"bucket {i}", "average", bucket.sent_at, recorder.now(),
                                       {"bytes": bucket.numel * bucket.buffer.element_size()}, thread="averaging")
                    _, after = mean_divisors(bucket.wire_dtype, self.contributors)
                    scale = 1.0 / after if after > 1 and self._averager is None else None
                    bucket.unpack(scale, self.zero_fill)
                    bucket.ready.clear()
            except BaseException:
                _abandon(buckets)
                raise
        self._check_same_steps(buckets)

    def _check_same_steps(self, buckets: list[_Bucket]) -> None:
        """Raise on every rank where the ranks that sent ``buckets`` had taken different numbers of
        ``step()`` calls: a rank that skipped one would update its model less often than the
        others, and the replicas would drift apart without a word. (Every bucket carries the
        check; the last one's is read.)"""
        if not buckets or buckets[-1].steps_agree():
            return
        # Every rank is here alike (the sums are the same everywhere): one more exchange names them.
        counts = self.comm.allgather_obj(self._steps_taken)
        by_count: dict[int, list[int]] = {}
        for rank, count in enumerate(counts):
            by_count.setdefault(count, []).append(rank)
        taken = "; ".join(f"rank(s) {ranks} {count}" for count, ranks in sorted(by_count.items()))
        raise CollectiveMismatchError(
            f"create_multi_node_optimizer: the ranks have taken different numbers of optimizer.step() calls since "
            f"the optimizer was built ({taken}), so a rank skipped a step() the others took and its model would "
            f"fall behind theirs. Decide to skip on values that are the same on every rank (an averaged loss "
            f"or gradient norm, e.g. comm.allreduce(loss, op='mean')), so that the ranks step or skip alike "
            f"(raised on rank {self.comm.rank})")

    def step(self, closure=None):
        """Average gradients over ranks (if backward has not already), then update.

        Args:
            closure: torch's: re-evaluates the loss with a backward (LBFGS); its gradients and the
                loss it returns are averaged over the ranks at each evaluation.

        Returns:
            What the wrapped optimizer's ``step()`` returns (None on double buffering's first step;
            with a closure, the first evaluation's loss averaged over the ranks).

        Raises:
            ValueError: a closure with ``double_buffering`` or ``backward_passes_per_step > 1``.
            RuntimeError: the last backward raised, or parameters were added or unfrozen since wrapping.

        Example::

            >>> loss_fn(model(x), y).backward()
            >>> optimizer.step()
        """
        why = "double_buffering=True updates with the previous step's gradients" if self.double_buffering else \
            "backward_passes_per_step > 1 averages every k-th backward only" if self.backward_passes_per_step > 1 \
            else None
        self.check_step(closure, why)
        if closure is not None:
            return self._step_with_closure(closure)
        self.synchronize()
        self._steps_taken += 1  # after the sends of this step, which synchronize() may make
        joining.share_edited_gradients(self)
        self._sent = False
        self._step_sent = False
        if self.double_buffering:
            # Double buffering (ChainerMN): update with the previous step's averages while this
            # step's are in flight; the very first step has nothing to update with.
            if self._first_step:
                self._first_step = False
                if recorder.on:
                    recorder.step_ended(recorder.now())
                return None
            self._finish(self._in_flight.pop(0))
        return recorder.update(self.wrapped.step)

    def _step_with_closure(self, closure):
        """torch's ``step(closure)`` (LBFGS): each evaluation's backward averages its gradients, and
        its loss is averaged here, so that every rank's line search sees the same numbers and takes
        the same course (as one process on the whole batch would)."""
        def evaluate():
            loss = closure()
            self.synchronize()  # where the closure's backward ran inside no_sync()
            return None if loss is None else self.comm.allreduce(loss.detach(), op="mean")
        try:
            return recorder.update(lambda: self.wrapped.step(evaluate))
        finally:
            self._sent = False
            self._steps_taken += 1

    def average_without_gradients(self) -> None:
        """Take part in the other ranks' gradient averaging with zeros, and update nothing.

        What a rank that has run out of data does while the others still train
        (``torchmn.horovod.join``): the others' averages count it as zeros. Its own gradients
        are None afterwards.

        Raises:
            RuntimeError: with ``double_buffering=True``, or when this step's gradients went out already.

        Example::

            >>> optimizer.average_without_gradients()    # the others run backward() meanwhile
        """
        if self.double_buffering or self._sent:
            raise TorchmnRuntimeError(
                f"{describe_rank(self.comm)}: average_without_gradients() needs double_buffering=False "
                f"and no gradients sent since the last step()")
        self.zero_grad()
        # Not counted in the others' step check: they may step after this averaging or skip it
        # alike (GradScaler), which this rank cannot know (see restart_step_count).
        self._sitting_out = True
        try:
            self.synchronize()
        finally:
            self._sitting_out = False
        self._sent = False
        self.zero_grad()

    def restart_step_count(self) -> None:
        """Count ``step()`` calls from zero again, for the check that every rank takes as many.

        Call it on every rank at the same point of the script, where the ranks have taken different
        numbers of steps on purpose: the end of ``hvd.join()``, after which ranks that sat out the
        others' last steps train with them again.

        Example::

            >>> optimizer.restart_step_count()      # every rank, after hvd.join()
        """
        self._steps_taken = 0

    def whole_state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()``: the same on every rank, no communication
        (``state_dict()`` gives it through the state-dict hooks).

        Returns:
            ``{"state": ..., "param_groups": ...}`` as ``torch.optim.Optimizer.state_dict()``; it
            loads into the plain torch optimizer too.

        Example::

            >>> if comm.rank == 0:
            ...     torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, path)
        """
        return self.wrapped.state_dict()

    def load_whole_state_dict(self, state_dict) -> None:
        """Load a ``state_dict()`` of this or a plain torch optimizer (on every rank;
        ``load_state_dict()`` does, through the state-dict hooks).

        Args:
            state_dict: the state, in torch's optimizer format.

        Example::

            >>> optimizer.load_state_dict(torch.load(path)["opt"])
        """
        self.wrapped.load_state_dict(state_dict)
        if self.double_buffering:
            # The averages in flight belong to the steps before the load: as documented, the first
            # step after loading only sends.
            for set_index in self._in_flight:
                for bucket in self._bucket_sets[set_index]:
                    if bucket.work is not None:  # every rank waits for it alike: the collective ends
                        bucket.work.wait()
                        bucket.work = None
                    bucket.ready.clear()
            self._in_flight.clear()
            self._first_step = True

    @property
    def state(self):
        """The wrapped optimizer's ``state``."""
        return self.wrapped.state

    @state.setter
    def state(self, value):
        self.wrapped.state = value


def create_multi_node_optimizer(optimizer: torch.optim.Optimizer, comm: Communicator, *,
                                double_buffering: bool = False, zero_fill: bool = True,
                                compression: Optional[str] = None, bucket_cap_mb: Optional[float] = None,
                                backward_passes_per_step: int = 1,
                                shard_state: Optional[bool] = None, powersgd_rank: int = 4) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so every ``step()`` uses gradients averaged over all ranks.

    Which optimizer you get: where every rank is on one node, the parameters are on the CPU and
    the optimizer is elementwise (Adam, SGD, ... :data:`~torchmn.optimizers.inner_optimizers.
    ELEMENTWISE_OPTIMIZERS`), the default (``shard_state=None``) is a
    :class:`~torchmn.optimizers.node_shared.NodeSharedOptimizer`: the ranks share one copy of the
    parameters and of the optimizer state, and each updates its slice of every parameter, so two
    ranks beat one process instead of each repeating the whole update; ``.grad`` still holds the
    averaged gradient after backward and ``state_dict()`` is whole on any rank, called alone. Its
    parameters live in shared memory (convert the model before wrapping; see the class for what
    that changes). ``shard_state=False`` gives the replicated :class:`MultiNodeOptimizer` (every
    rank updates the whole model) everywhere; ``shard_state=True`` ZeRO stage 1 everywhere.

    Parameters are broadcast from rank 0 here, so every rank starts equal. Gradients travel in
    buckets while backward runs (``bucket_cap_mb``, default the communicator's), optionally as
    ``compression="fp16"``/``"bf16"``, or as low-rank approximations with error feedback for slow
    links (``compression="powersgd"``, rank ``powersgd_rank``; replicated optimizer only, see
    :mod:`torchmn.optimizers.powersgd`); ``backward_passes_per_step=k`` and ``optimizer.no_sync()``
    accumulate locally and communicate once; ``double_buffering=True`` updates with the previous
    step's averages while the current ones are in flight (the first ``step()`` only sends, and so
    does the first after loading a checkpoint: the averages in flight are not part of
    ``state_dict()``, so a resumed run makes one update fewer than an uninterrupted one). A
    backward that raises (a batch the script skips, on every rank) is forgotten at the next
    ``zero_grad()``; ``step()`` right after it refuses. Frozen parameters in the optimizer's
    groups are broadcast too; freezing or unfreezing later needs a new wrapper.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over the model's parameters (built on every rank).
        comm: the communicator.
        double_buffering: update with the previous step's averages (ChainerMN's semantics).
        zero_fill: count a gradient missing on some ranks as zeros (with False, such a gradient
            raises :class:`~torchmn.CollectiveMismatchError`).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype gradients travel in (default:
            the communicator's ``compression``, None unless ``create_communicator`` was given
            ``allreduce_grad_dtype``; ``"none"`` sends them uncompressed regardless);
            ``"powersgd"``: PowerSGD's low-rank approximations.
        bucket_cap_mb: MB of gradients per message (default: the communicator's).
        backward_passes_per_step: backward passes accumulated locally per averaging.
        shard_state: None (default): split the update over the ranks where they share a node
            (see above), else replicate it; True: ZeRO stage 1 (:class:`ShardedMultiNodeOptimizer`),
            each rank updates and keeps state for 1/size of the model, on any number of nodes;
            False: every rank updates the whole model (:class:`MultiNodeOptimizer`).
        powersgd_rank: the rank of PowerSGD's approximations (``compression="powersgd"``): 1
            sends least, higher keeps more of each step's gradient.

    Returns:
        A ``NodeSharedOptimizer``, :class:`MultiNodeOptimizer` or :class:`ShardedMultiNodeOptimizer`.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer, or (sharded) not an elementwise one.
        ValueError: an unknown ``compression``, ``backward_passes_per_step < 1``, or options that
            cannot go together (``shard_state`` with ``double_buffering`` or ``zero_fill=False``).
        CollectiveMismatchError: the ranks' options or models differ.

    Example::

        >>> comm = torchmn.create_communicator()
        >>> optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
        >>> loss_fn(model(x), y).backward()
        >>> optimizer.step()
    """
    options = dict(double_buffering=double_buffering, zero_fill=zero_fill, compression=compression,
                   bucket_cap_mb=bucket_cap_mb, backward_passes_per_step=backward_passes_per_step,
                   shard_state=shard_state, powersgd_rank=powersgd_rank)
    return build_into(None, optimizer, comm, options)


def build_into(target: Optional[GradientSyncOptimizer], optimizer: torch.optim.Optimizer, comm: Communicator,
               options: dict) -> GradientSyncOptimizer:
    """Build the multi-node optimizer :func:`create_multi_node_optimizer` chooses, in ``target`` (an
    existing one, rebuilt in place for an elastic job's new world after
    :meth:`GradientSyncOptimizer.leave_world`) or in a new object. Collective.

    Args:
        target: the object to build in, or None for a new one.
        optimizer: the torch optimizer to wrap.
        comm: the communicator.
        options: ``create_multi_node_optimizer``'s keyword arguments but the first two.

    Returns:
        The optimizer built (``target`` where given); its ``options`` are ``options``.

    Example::

        >>> build_into(optimizer, optimizer.wrapped, comm, optimizer.options)   # at an elastic reset
    """
    def make(cls, **kwargs):
        built = cls.__new__(cls) if target is None else target
        built.__class__ = cls
        built.__dict__.clear()
        built.options = options  # what an elastic reset builds again for a new world
        cls.__init__(built, optimizer, comm, **kwargs)
        return built

    double_buffering, zero_fill = options["double_buffering"], options["zero_fill"]
    compression, bucket_cap_mb = options["compression"], options["bucket_cap_mb"]
    passes = options["backward_passes_per_step"]
    if compression is None:
        compression = getattr(comm, "compression", None)
    _check_same_options(comm, options, compression, optimizer)
    if options["shard_state"] is None and _can_split_on_node(optimizer, comm, double_buffering, zero_fill,
                                                             compression):
        from torchmn.optimizers.node_shared import NoNodeMemory, NodeSharedOptimizer
        try:
            return make(NodeSharedOptimizer, bucket_cap_mb=bucket_cap_mb, backward_passes_per_step=passes)
        except NoNodeMemory:
            pass  # too small a /dev/shm: every rank updates the whole model
    if options["shard_state"]:
        from torchmn.optimizers.sharded import ShardedMultiNodeOptimizer
        return make(ShardedMultiNodeOptimizer, double_buffering=double_buffering, zero_fill=zero_fill,
                    compression=compression, bucket_cap_mb=bucket_cap_mb, backward_passes_per_step=passes)
    return make(MultiNodeOptimizer, double_buffering=double_buffering, zero_fill=zero_fill,
                compression=compression, bucket_cap_mb=bucket_cap_mb, backward_passes_per_step=passes,
                powersgd_rank=options["powersgd_rank"])


def _check_same_options(comm: Communicator, options: dict, compression: Optional[str], optimizer) -> None:
    """Refuse, on every rank, ranks that asked for different optimizers: their gradients would
    travel in different dtypes, buckets or steps, and fail later as a mismatch of unrelated
    collectives (or, between compressions, not at all). The torch optimizers' classes, parameter
    groups and switches too: the shared and sharded updates give each rank's slice of the model to
    that rank's optimizer, so differences there mix updates silently."""
    if comm.size == 1:
        return
    mine = {**options, "compression": None if compression == "none" else compression}
    if mine["compression"] != "powersgd":
        mine.pop("powersgd_rank")
    mine["torch optimizer"] = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    groups = getattr(optimizer, "param_groups", [])
    mine["parameter groups"] = len(groups)
    # The optimizer's own hyperparameters; what else a group holds is another object's (a learning-rate
    # scheduler's initial_lr, which an elastic job's joining rank adds only after this check).
    defaults = getattr(optimizer, "defaults", None)
    for i, group in enumerate(groups):
        mine[f"parameter group {i}'s parameters"] = len(group["params"])
        for key, value in group.items():
            if key != "params" and (not isinstance(defaults, dict) or key in defaults):
                mine[f"parameter group {i}'s {key}"] = _comparable(value)
    every = comm.allgather_obj(mine)
    keys = dict.fromkeys(k for theirs in every for k in theirs)  # in the same order on every rank
    differ = [k for k in keys if len({repr(theirs.get(k)) for theirs in every}) > 1]
    if differ:
        told = "; ".join(f"{k}: " + ", ".join(f"rank {r}: {theirs.get(k)!r}" for r, theirs in enumerate(every))
                         for k in differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise CollectiveMismatchError(f"create_multi_node_optimizer: the ranks' options differ ({told}); pass the "
                                      f"same options, and the same torch optimizer with the same parameter groups "
                                      f"and hyperparameters, on every rank (raised on rank {comm.rank} on {comm.host})")


def _comparable(value: Any) -> Any:
    """A hyperparameter as ranks compare it: switches (``amsgrad``, ``nesterov``, ``maximize``: a
    bool, a string or None) by value, as they change the algorithm and its state; numbers only by
    kind, since schedulers change them (an elastic job's joining rank starts from the script's
    values, the others have the scheduler's until the sync that follows)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float, torch.Tensor)):
        return "a number"
    if isinstance(value, (tuple, list)):
        return tuple(_comparable(v) for v in value)
    return type(value).__name__


def _can_split_on_node(optimizer, comm: Communicator, double_buffering: bool, zero_fill: bool,
                       compression: Optional[str]) -> bool:
    """Whether the default may split the update over the node's ranks (the same answer on every
    rank): ranks on one node with shared memory, CPU parameters, an elementwise optimizer, and no
    option that needs every rank to update the whole model. (Whether /dev/shm is large enough is
    found when the memory is opened.)"""
    from torchmn.optimizers.inner_optimizers import ELEMENTWISE_OPTIMIZERS
    if not isinstance(optimizer, torch.optim.Optimizer):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return (type(optimizer) in ELEMENTWISE_OPTIMIZERS and not double_buffering and zero_fill
            and comm.may_share_node_memory() and could_share_memory(comm, params, compression))
