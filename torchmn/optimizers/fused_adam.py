"""torch's fused Adam and AdamW kernels called directly on the sharded optimizer's flat shards.

A shard optimizer (see :mod:`torchmn.optimizers.sharded`) is private: one group of flat CPU
shards, no hooks, no closure. What ``Adam.step`` and ``torch.optim.adam.adam`` do around the fused
kernel (collecting lists, grouping tensors by device and dtype, checks) is Python that runs cold
between backward and forward every step, and none of it is needed. The arithmetic is the kernel's
either way: the tests compare against one process.

:func:`direct_step` steps a shard optimizer that way; :class:`SumAndStep` also makes, piece by
piece, the gradient sums the kernel reads (on one node, where they come from shared memory).
"""
from __future__ import annotations

import operator
from typing import Callable, Optional

import torch

from torchmn.errors import TorchmnValueError
from torchmn.optimizers.node_memory import sum_scaled
from torchmn.optimizers.memory_order import elements

# The arguments torch.optim.adam._fused_adam gives the kernels; other torch versions may differ.
_KERNEL_ARGS = ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "lr", "beta1",
                "beta2", "weight_decay", "eps", "amsgrad", "maximize", "grad_scale", "found_inf")

# Bytes of gradient SumAndStep sums ahead of each kernel call: small enough that the sum is still
# in the core's L2 cache (2 MB on the machines measured) when the kernel reads it back, with the
# parameters and moments streaming past it. A multiple of 64 bytes, the kernel's unit of work and
# its widest vector, so that pieces start where its vector loop would.
PIECE_BYTES = 512 * 1024


def kernel_for(optimizer: torch.optim.Optimizer) -> Optional[Callable]:
    """The fused kernel that steps ``optimizer``.

    Args:
        optimizer: a shard optimizer.

    Returns:
        torch's fused Adam or AdamW kernel, or None where calling it directly would not do what
        ``optimizer.step()`` does (not fused Adam or AdamW, capturable, differentiable, or this
        torch's kernels are not the known ones).

    Example::

        >>> kernel_for(torch.optim.Adam(shard_params, fused=True))
        <built-in method _fused_adam_ of type object at 0x7f2dfa2cea40>
        >>> kernel_for(torch.optim.Adam(shard_params)) is None     # not fused
        True
    """
    group = optimizer.param_groups[0]
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not group.get("fused") \
            or group.get("capturable") or group.get("differentiable") or "decoupled_weight_decay" not in group:
        return None
    try:
        kernels = (torch.ops.aten._fused_adam_.default, torch.ops.aten._fused_adamw_.default)
    except AttributeError:
        return None
    if any(tuple(a.name for a in k._schema.arguments) != _KERNEL_ARGS for k in kernels):
        return None
    adamw = bool(group["decoupled_weight_decay"])
    # torch's own binding of the same op (it picks the overload for a float lr): 2 us a call against
    # 5 us through the overload object's keyword handling, and SumAndStep makes 8 calls a step on
    # the MNIST MLP, run cold between backward and forward.
    return getattr(torch, ("_fused_adamw_" if adamw else "_fused_adam_"), None) or kernels[adamw]


def _hyperparameters(group: dict) -> Optional[dict]:
    """The kernel's keyword arguments from ``group`` (looked up every step: schedulers change them),
    or None where a hyperparameter is a tensor (torch's own step handles that)."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    if torch.is_tensor(lr) or torch.is_tensor(beta1) or torch.is_tensor(beta2):
        return None
    return dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                amsgrad=group["amsgrad"], maximize=group["maximize"])


def direct_step(optimizer: torch.optim.Optimizer, step: Callable) -> Optional[Callable]:
    """A function that steps ``optimizer`` (a shard optimizer) through its fused kernel directly.

    Args:
        optimizer: the shard optimizer.
        step: its ordinary step, called where a shard has no state yet (the first step creates
            it) or a hyperparameter is a tensor.

    Returns:
        The function, or None where :func:`kernel_for` finds no kernel.

    Example::

        >>> update = direct_step(inner, inner.step) or inner.step
        >>> update()
    """
    kernel = kernel_for(optimizer)
    if kernel is None:
        return None

    def fused_adam():
        # Looked up every time: load_state_dict replaces the groups and the state.
        group, state = optimizer.param_groups[0], optimizer.state
        params = [p for p in group["params"] if p.grad is not None]  # as torch: no gradient, no update
        if not params:
            return None
        states = [state.get(p) for p in params]
        hyper = _hyperparameters(group)
        if not all(states) or hyper is None:
            return step()
        steps = [s["step"] for s in states]
        with torch.no_grad():
            torch._foreach_add_(steps, 1)
            kernel(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                   [s["exp_avg_sq"] for s in states], [s["max_exp_avg_sq"] for s in states] if hyper["amsgrad"] else [],
                   steps, **hyper)
        return None
    return fused_adam


class SumAndStep:
    """Sum this rank's slices of the node's gradients and update them with the fused kernel, one
    L2-sized piece at a time, for the shards of one shard optimizer on one node.

    Summing every slice first and then running the kernel over them all writes the whole sum to
    memory and reads it back: 2 x 3.6 MB a step per rank on the MNIST MLP, with both ranks doing the
    same at once. Piece by piece, the sum is still in the cache when the kernel reads it. Each
    piece's sum is made by the function that :meth:`node_memory.NodeShards.sum_shard_of_peers` uses
    (:func:`node_memory.sum_scaled`), and the kernel is elementwise and meets each element in the
    same code path (its vector loop or its scalar tail, which round differently) as over the whole
    shard, so the results are the same bits
    (``piecewise_update_is_exact`` in tests/workers/shard_checks.py checks it).

    ``buckets``: the shard buckets the optimizer steps (placed in shared memory). ``__call__``
    returns False, having done nothing, where the piecewise path does not apply this step: a
    gradient this rank lacks (the flags must then be read), or a shard without state yet (the
    first step creates it). The caller then sums and steps the usual way. This path leaves the
    shard parameters' ``.grad`` as they were (the sums exist only piece by piece).

    Example::

        >>> sum_and_step = SumAndStep(inner, buckets, 0.5)
        >>> if not sum_and_step():
        ...     for b in buckets: b.sum_shard_of_peers(0.5)
        ...     inner.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list, scale: float):
        """Keep what to sum and step; the pieces are planned at the first call that applies.

        Args:
            optimizer: the shard optimizer over the buckets' shard parameters; :func:`kernel_for`
                must find its fused kernel.
            buckets: the :class:`~torchmn.optimizers.shard_layout.ShardBucket` objects it steps,
                placed in shared memory (each with its ``node``), of one dtype and device.
            scale: the factor for this rank's own part of each sum (``1 / size``; the other
                ranks' parts are scaled already); the caller may change ``.scale`` between steps.

        Raises:
            ValueError: :func:`kernel_for` finds no fused kernel for ``optimizer``.

        Example::

            >>> sum_and_step = SumAndStep(inner, buckets, 1.0 / comm.size)
        """
        self.kernel = kernel_for(optimizer)
        if self.kernel is None:
            raise TorchmnValueError(f"SumAndStep: {type(optimizer).__name__} is not stepped by a known fused kernel")
        self.optimizer, self.buckets, self.scale = optimizer, buckets, scale
        self.built_for: list = []   # the state tensors that self.calls cut into pieces
        self.calls: list = []

    def _state_tensors(self) -> Optional[list]:
        state, amsgrad = self.optimizer.state, self.optimizer.param_groups[0]["amsgrad"]
        tensors = []
        for b in self.buckets:
            for sp in b.shard_params:
                s = state.get(sp)
                if not s or not torch.is_tensor(s.get("step")):
                    return None
                tensors += (s["step"], s["exp_avg"], s["exp_avg_sq"], s["max_exp_avg_sq"] if amsgrad else None)
        return tensors

    def _plan(self, tensors: list) -> None:
        """Cut every shard into pieces, and group the pieces into kernel calls of at most
        PIECE_BYTES each."""
        # One optimizer's buckets share a dtype and a device (the sharded optimizer groups them so).
        first = self.buckets[0]
        sum_buffer = torch.empty(max(1, PIECE_BYTES // first.itemsize), dtype=first.dtype, device=first.device)
        per_call = sum_buffer.numel()
        self.steps = tensors[0::4]
        self.calls = []
        call, used, n = [], 0, 0
        for b in self.buckets:
            for i, lo, hi, others, _ in b.node.sum_plan:
                step, m, v, vmax = tensors[4 * (n + i):4 * (n + i) + 4]
                p = b.shard_params[i].detach()
                # Pieces start at multiples of the kernel's vector width and the last one runs to the
                # shard's padded end (its padding's gradient: 0), so that the kernel's vector loop and
                # scalar tail meet the same elements as over the whole shard: they round differently.
                for start in range(0, hi - lo, per_call):
                    end = min(p.numel(), start + per_call)
                    if call and used + end - start > per_call:
                        self.calls.append(self._kernel_call(call))
                        call, used = [], 0
                    cut, summed = slice(start, end), min(end, hi - lo) - start
                    grad = sum_buffer[used:used + end - start]
                    call.append((b, i, lo + start, lo + start + summed, [o[start:start + summed] for o in others],
                                 grad[:summed], grad[summed:] if summed < end - start else None,
                                 grad, p[cut], m[cut], v[cut], None if vmax is None else vmax[cut], step))
                    used += end - start
            n += len(b.shard_params)
        if call:
            self.calls.append(self._kernel_call(call))
        self.built_for = tensors

    @staticmethod
    def _kernel_call(pieces: list) -> tuple:
        """One kernel call: the sums to make first (and padding to zero), then the kernel's lists."""
        sums = [piece[:7] for piece in pieces]
        grads, params, moments, squares, maxima, steps = ([piece[k] for piece in pieces] for k in range(7, 13))
        return sums, (params, grads, moments, squares, maxima if maxima[0] is not None else [], steps)

    def __call__(self) -> bool:
        """Sum this rank's slices of the node's gradients and update them, piece by piece, where
        this step allows it.

        Returns:
            True where every shard was summed and updated (its step count advanced); False,
            having done nothing, where this rank lacks a gradient, a shard has no state yet, or a
            hyperparameter is a tensor: the caller then sums and steps the usual way.

        Example::

            >>> if not sum_and_step():
            ...     for b in buckets: b.node.sum_shard_of_peers(sum_and_step.scale)
            ...     buckets[0].step_shard()
        """
        if not all(all(b.present) for b in self.buckets):
            return False
        hyper = _hyperparameters(self.optimizer.param_groups[0])
        tensors = self._state_tensors()
        if hyper is None or tensors is None:
            return False
        if len(tensors) != len(self.built_for) or not all(map(operator.is_, tensors, self.built_for)):
            self._plan(tensors)  # the first time, and after load_state_dict replaced the state
        scale = self.scale
        with torch.no_grad():
            torch._foreach_add_(self.steps, 1)
            for sums, lists in self.calls:
                for b, i, lo, hi, others, out, padding in sums:
                    sum_scaled(out, others, elements(b.packed[i], b.params[i])[lo:hi], scale)
                    if padding is not None:  # the buffer is shared by the calls: another piece wrote here
                        padding.zero_()
                self.kernel(*lists, **hyper)
        return True
