"""What the parallel layers share: how a dimension is split over ranks, the agreement on a layer's
arguments, and Megatron's four communication operators for tensor parallelism.

Megatron's operators assume that every rank computes the same loss, and give every parameter
slice its exact gradient: ``copy_to_parallel`` (forward: identity; backward: allreduce) feeds a
replicated tensor into split computation, ``reduce_from_parallel`` (forward: allreduce; backward:
identity) sums partial results into a replicated one, ``gather_from_parallel`` (forward: all-gather;
backward: this rank's slice) joins split results into a replicated tensor, and
``scatter_to_parallel`` (forward: this rank's slice; backward: all-gather) splits a replicated one.
"""
from __future__ import annotations

import functools
from typing import Callable, NoReturn, Sequence

import torch
from torch.autograd.function import once_differentiable

from torchmn.communicators import CollectiveMismatchError, CommunicatorBase, backward_pass


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` sizes that differ by at most one, the larger first."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each part starts."""
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


def refuse_with_the_others(comm: CommunicatorBase, error: Exception) -> NoReturn:
    """Raise ``error``, this rank's refusal of its own input, after one call that the communicator
    refuses on every rank (an allreduce without a tensor): the other ranks, already in this layer's
    next collective or on their way to it, fail there naming this rank instead of waiting for it
    until the timeout (or for ever, where this rank catches the error and goes on).

    Args:
        comm: the layer's communicator.
        error: what this rank raises.

    Raises:
        Exception: ``error``, always.

    Example::

        >>> if x.shape[-1] != self.weight.shape[1]:
        ...     refuse_with_the_others(self.comm, TorchmnValueError("an input slice of another width"))
    """
    if comm.size > 1:
        try:
            comm.allreduce(None)
        except TypeError:  # the communicator's own refusal of that call, here; the others get theirs
            pass
    raise error


def agree_on_arguments(layer: torch.nn.Module, comm: CommunicatorBase, arguments: tuple) -> None:
    """Raise on every rank unless every rank built ``layer`` with the same ``arguments`` (collective).

    Raises:
        CollectiveMismatchError: naming each rank's arguments.
    """
    everyone = comm.allgather_obj(arguments) if comm.size > 1 else [arguments]
    if any(e != arguments for e in everyone):
        shown = "; ".join(f"rank {r}: {e}" for r, e in enumerate(everyone))
        raise CollectiveMismatchError(f"{type(layer).__name__}: the ranks built the layer with different arguments "
                                      f"({shown}); build it alike on every rank (raised on rank {comm.rank})")


def accept_dense_state_dicts(layer: torch.nn.Module, dense_weight_shape: Callable[[torch.nn.Module], tuple],
                             slices_of_dense: Callable[[torch.nn.Module, dict], dict]) -> None:
    """Make ``layer.load_state_dict`` take its dense counterpart's ``state_dict`` too: a ``weight``
    of the dense shape (and the ``bias`` beside it) becomes this rank's slices as it loads.

    Args:
        layer: a layer holding slices of a dense layer's parameters.
        dense_weight_shape: ``f(layer)``, the dense layer's weight shape.
        slices_of_dense: ``f(layer, {"weight": ..., "bias": ...})``, this rank's slices of them.

    Example::

        >>> accept_dense_state_dicts(self, type(self)._dense_weight_shape, type(self)._slices_of_dense)
    """
    # Functions of the layer, not bound methods: a deep copy's hook must slice for the copy.
    hook = functools.partial(_slice_dense_entries, dense_weight_shape, slices_of_dense)
    layer._register_load_state_dict_pre_hook(hook, with_module=True)


def _slice_dense_entries(dense_weight_shape, slices_of_dense, layer, state_dict: dict, prefix: str, *_) -> None:
    weight = state_dict.get(prefix + "weight")
    if weight is None or tuple(weight.shape) != dense_weight_shape(layer) or weight.shape == layer.weight.shape:
        return
    dense = {k: state_dict[prefix + k] for k in ("weight", "bias") if prefix + k in state_dict}
    for name, value in slices_of_dense(layer, dense).items():
        state_dict[prefix + name] = value


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, x):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, g):
        return None, ctx.comm.allreduce(g.contiguous())


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, x):
        return comm.allreduce(x)

    @staticmethod
    @once_differentiable  # a second derivative would need the other ranks' first ones: refused, as by the others
    def backward(ctx, g):
        return None, g


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, dim, x):
        parts = comm.allgather(x.contiguous())
        others = [p.shape[:dim] + p.shape[dim + 1:] for p in parts]
        if any(o != others[0] for o in others):
            shown = ", ".join(f"rank {r}: {tuple(p.shape)}" for r, p in enumerate(parts))
            raise CollectiveMismatchError(
                f"the ranks' slices of a split layer's output differ in more than dimension {dim} ({shown}), so "
                f"they do not join into one output: give every rank the same input (a tensor-parallel layer "
                f"computes one output for one batch, split over the ranks) (raised on rank {comm.rank})")
        sizes = [p.shape[dim] for p in parts]
        ctx.dim, ctx.start, ctx.length = dim, offsets(sizes)[comm.rank], x.shape[dim]
        return torch.cat([p.to(x.device) for p in parts], dim=dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return None, None, g.narrow(ctx.dim, ctx.start, ctx.length).contiguous()


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, dim, x):
        sizes = split_sizes(x.shape[dim], comm.size)
        ctx.comm, ctx.dim = comm, dim
        return x.narrow(dim, offsets(sizes)[comm.rank], sizes[comm.rank]).contiguous()

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, g):
        parts = ctx.comm.allgather(g.contiguous())
        return None, None, torch.cat([p.to(g.device) for p in parts], dim=ctx.dim)


def copy_to_parallel(comm: CommunicatorBase, x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged; its gradient is summed over the ranks (Megatron's ``f``)."""
    return _CopyToParallel.apply(comm, x)


def reduce_from_parallel(comm: CommunicatorBase, x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``x``; the gradient passes back unchanged (Megatron's ``g``)."""
    return _ReduceFromParallel.apply(comm, x)


def gather_from_parallel(comm: CommunicatorBase, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's ``x`` joined along ``dim`` (sizes may differ); backward keeps this rank's slice."""
    return _GatherFromParallel.apply(comm, dim % x.dim(), x)


def scatter_to_parallel(comm: CommunicatorBase, x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (see :func:`split_sizes`); backward gathers the slices."""
    return _ScatterToParallel.apply(comm, dim % x.dim(), x)
