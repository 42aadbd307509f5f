"""The multi-node optimizer: gradients averaged over ranks while backward still runs.

Gradients are packed into buckets in the reverse order of the parameters (the order backward
produces them). A bucket is sent as soon as all its gradients are ready, and buckets are always
sent in the same order on every rank, so a parameter that gets no gradient on one rank cannot make
the ranks disagree: at the end of backward the remaining buckets go out, missing gradients as zeros.
By the time ``loss.backward()`` returns, ``.grad`` holds the averaged gradients, so gradient
clipping and anything else between backward and ``step()`` sees what the update will use.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch.autograd import Variable

from torchmn.communicators import Communicator

FIRST_BUCKET_BYTES = 1024 * 1024  # small, so communication starts early in backward
_COMPRESSION = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Bucket:
    """Gradients of consecutive parameters (one dtype, one device) sent in one message.

    Without compression, ``.grad`` of each parameter becomes a view into the bucket after the
    first step, so later steps average the gradients where backward left them (no copies), unless
    something replaced ``.grad`` in between (``zero_grad()``'s default ``set_to_none``), which
    costs one copy in.
    """

    def __init__(self, params: list[torch.nn.Parameter], wire_dtype: Optional[torch.dtype], as_views: bool):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.wire_dtype = wire_dtype or params[0].dtype
        self.as_views = as_views and self.wire_dtype == params[0].dtype
        self.ready: set[int] = set()
        self.work = None
        self.had_grad: list[bool] = []
        self.buffer: Optional[torch.Tensor] = None
        self.views: list[torch.Tensor] = []

    def pack(self, scale: Optional[float]) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.zeros(self.numel, dtype=self.wire_dtype, device=self.params[0].device)
            offset = 0
            for p in self.params:
                self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        grads = [p.grad for p in self.params]
        self.had_grad = [g is not None for g in grads]
        if scale is None and all(g is not None and not _is_view(g, v) for g, v in zip(grads, self.views)):
            torch.cat([g.reshape(-1) for g in grads], out=self.buffer)  # one call instead of one per tensor
            return self.buffer
        for g, view in zip(grads, self.views):
            if g is None:
                view.zero_()
            elif _is_view(g, view):
                continue  # backward accumulated into the bucket already
            elif scale is None:
                view.copy_(g)
            else:
                view.copy_(g * scale)
        return self.buffer

    def unpack(self, post_scale: Optional[float], zero_fill: bool) -> None:
        if post_scale is not None:
            self.buffer.mul_(post_scale)
        for p, had, view in zip(self.params, self.had_grad, self.views):
            if not (had or zero_fill):
                continue  # zero_fill=False: a rank with no gradient keeps none
            if self.as_views:
                p.grad = view
            elif p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)


def _is_view(g: torch.Tensor, view: torch.Tensor) -> bool:
    return g.data_ptr() == view.data_ptr() and g.shape == view.shape


class MultiNodeOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` so that ``step()`` uses gradients averaged over ranks.

    Build it with :func:`create_multi_node_optimizer`. It behaves like the wrapped optimizer
    (``param_groups``, ``state``, ``state_dict``, LR schedulers) because it shares them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, *, double_buffering: bool,
                 zero_fill: bool, compression: Optional[str], bucket_cap_mb: Optional[float],
                 backward_passes_per_step: int):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"create_multi_node_optimizer wraps a torch.optim.Optimizer, not "
                            f"{type(optimizer).__name__}")
        if compression not in _COMPRESSION:
            raise ValueError(f"compression must be one of None, 'fp16', 'bf16', not {compression!r}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}")
        # Deliberately no Optimizer.__init__: param_groups and state are the wrapped optimizer's own.
        self._optimizer = optimizer
        self.comm = comm
        self.double_buffering = double_buffering
        self.zero_fill = zero_fill
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self._wire_dtype = _COMPRESSION[compression]
        self._no_sync = False
        self._passes = 0            # backward passes since the last synchronisation
        self._in_pass = False
        self._pass_syncs = False
        self._sent = False          # this step's gradients have gone out
        self._first_step = True
        self._hooks = []
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._params = list(dict.fromkeys(params))  # a parameter in two groups counts once
        comm.bcast_tensors([p.data for p in self._params], root=0)
        cap = comm.grad_bucket_cap_bytes if bucket_cap_mb is None else int(bucket_cap_mb * 1024 * 1024)
        self._bucket_sets = [self._make_buckets(cap)]
        if double_buffering:
            self._bucket_sets.append(self._make_buckets(cap))
        self._current = 0           # which bucket set this backward fills
        self._in_flight: list[int] = []  # double buffering: sets sent but not yet used, oldest first
        self._where = {}
        for bi, bucket in enumerate(self._bucket_sets[0]):
            for p in bucket.params:
                self._where[p] = bi
        self._next = 0              # next bucket to send, in order
        # Also in a world of one, so that double buffering means the same there.
        for p in self._params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ----------------------------------------------------------------------------- buckets
    def _make_buckets(self, cap: int) -> list[_Bucket]:
        buckets, run, run_bytes = [], [], 0
        limit = min(cap, FIRST_BUCKET_BYTES) if cap else 0
        # Double buffering keeps gradients out of buckets that may still be in flight.
        as_views = not self.double_buffering
        for p in reversed(self._params):
            n = p.numel() * p.element_size()
            if run and (run[0].dtype != p.dtype or run[0].device != p.device or run_bytes + n > limit):
                buckets.append(_Bucket(run, self._wire_dtype, as_views))
                run, run_bytes, limit = [], 0, cap
            run.append(p)
            run_bytes += n
        if run:
            buckets.append(_Bucket(run, self._wire_dtype, as_views))
        return buckets

    @property
    def _buckets(self) -> list[_Bucket]:
        return self._bucket_sets[self._current]

    def _send(self, bucket: _Bucket) -> None:
        # Compressed gradients are divided before sending so float16 sums cannot overflow.
        pre = 1.0 / self.comm.size if self._wire_dtype is not None else None
        bucket.work = self.comm.allreduce_flat(bucket.pack(pre), async_op=True)

    def _send_ready(self) -> None:
        buckets = self._buckets
        while self._next < len(buckets) and len(buckets[self._next].ready) == len(buckets[self._next].params):
            self._send(buckets[self._next])
            self._next += 1

    def _send_rest(self) -> None:
        for bucket in self._buckets[self._next:]:
            self._send(bucket)
        self._next = len(self._buckets)

    def _finish(self, set_index: int) -> None:
        post = None if self._wire_dtype is not None else 1.0 / self.comm.size
        for bucket in self._bucket_sets[set_index]:
            bucket.work.wait()
            bucket.work = None
            bucket.unpack(post, self.zero_fill)
            bucket.ready.clear()

    # ----------------------------------------------------------------------------- hooks
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._in_pass:
            self._in_pass = True
            self._pass_syncs = not self._no_sync and self._passes + 1 >= self.backward_passes_per_step
            Variable._execution_engine.queue_callback(self._on_backward_end)
        if self._pass_syncs:
            bucket = self._buckets[self._where[p]]
            bucket.ready.add(id(p))
            self._send_ready()

    def _on_backward_end(self) -> None:
        self._in_pass = False
        self._passes += 1
        if not self._pass_syncs:
            return
        self._send_rest()
        self._end_sync()

    def _end_sync(self) -> None:
        self._passes = 0
        self._next = 0
        self._sent = True
        if self.double_buffering:
            self._in_flight.append(self._current)
            self._current = 1 - self._current
        else:
            self._finish(self._current)

    # ----------------------------------------------------------------------------- public
    def synchronize(self) -> None:
        """Average the gradients now, if backward has not already done it (Horovod's name)."""
        if self._sent:
            return
        self._send_rest()
        self._end_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside communicates.

        Example::

            >>> with optimizer.no_sync():
            ...     loss_fn(model(x1)).backward()
            >>> loss_fn(model(x2)).backward()   # averaged over ranks here
            >>> optimizer.step()
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def step(self, closure=None):
        """Average gradients over ranks (if backward has not already), then update."""
        if closure is not None:
            raise ValueError("multi-node optimizers do not support a closure: call backward, then step()")
        self.synchronize()
        self._sent = False
        if not self.double_buffering:
            return self._optimizer.step()
        # Double buffering (ChainerMN): update with the previous step's averages while this
        # step's are in flight; the very first step has nothing to update with.
        if self._first_step:
            self._first_step = False
            return None
        self._finish(self._in_flight.pop(0))
        return self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError("add a parameter group to the wrapped optimizer before wrapping it")

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._optimizer.param_groups = value

    @property
    def state(self):
        return self._optimizer.state

    @state.setter
    def state(self, value):
        self._optimizer.state = value

    @property
    def defaults(self):
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self._optimizer.defaults = value

    def __getstate__(self):
        return {"optimizer": self._optimizer}

    def __repr__(self) -> str:
        return f"MultiNodeOptimizer({self._optimizer!r}, {self.comm!r})"

    def remove_hooks(self) -> None:
        """Detach from the parameters (the wrapped optimizer keeps working on its own)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def create_multi_node_optimizer(optimizer: torch.optim.Optimizer, comm: Communicator, *,
                                double_buffering: bool = False, zero_fill: bool = True,
                                compression: Optional[str] = None, bucket_cap_mb: Optional[float] = None,
                                backward_passes_per_step: int = 1,
                                shard_state: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so every ``step()`` uses gradients averaged over all ranks.

    Parameters are broadcast from rank 0 here, so every rank starts equal. Gradients travel in
    buckets while backward runs (``bucket_cap_mb``, default the communicator's), optionally as
    ``compression="fp16"``/``"bf16"``; ``backward_passes_per_step=k`` and ``optimizer.no_sync()``
    accumulate locally and communicate once; ``double_buffering=True`` updates with the previous
    step's averages while the current ones are in flight (the first ``step()`` only sends).

    Example::

        >>> comm = torchmn.create_communicator()
        >>> optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
        >>> loss_fn(model(x), y).backward()
        >>> optimizer.step()
    """
    if shard_state:
        from torchmn.optimizers.sharded import ShardedMultiNodeOptimizer
        return ShardedMultiNodeOptimizer(optimizer, comm, double_buffering=double_buffering,
                                         zero_fill=zero_fill, compression=compression,
                                         bucket_cap_mb=bucket_cap_mb,
                                         backward_passes_per_step=backward_passes_per_step)
    return MultiNodeOptimizer(optimizer, comm, double_buffering=double_buffering, zero_fill=zero_fill,
                              compression=compression, bucket_cap_mb=bucket_cap_mb,
                              backward_passes_per_step=backward_passes_per_step)
