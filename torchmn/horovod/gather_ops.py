"""``hvd.allgather`` and ``hvd.broadcast``, with their asynchronous, in-place, grouped and
differentiable forms.

These run on the communicator's checked collectives; their ``_async`` forms complete before they
return (the handle is ready at once): only allreduces overlap with the script. Gradients follow
Horovod's conventions: an allgather's is the sum over ranks of the output gradients, sliced; a
broadcast's is that sum on the root and zero elsewhere.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from torchmn.horovod import handles
from torchmn.horovod.allreduce_ops import allreduce, layout
from torchmn.horovod.basics import Sum
from torchmn.horovod.checked_calls import agree_on, completed_handle, mismatch, record
from torchmn.horovod.process_sets import comm_of, global_process_set


# ----------------------------------------------------------------------------- allgather
def _allgather(tensor: torch.Tensor, name: Optional[str], process_set, what: str):
    """The concatenation over ranks of ``tensor`` along dim 0, and every rank's first dimension."""
    start = time.time()
    comm = comm_of(process_set, what)
    handles.check_name("allgather", name)
    problem = None if isinstance(tensor, torch.Tensor) else f"{what} takes a tensor, not {type(tensor).__name__}"
    shape_dtype = layout(tensor) if problem is None else None
    descriptions = agree_on(comm, "allgather", what, (name, shape_dtype), problem)
    shapes = [d[3][0] for d in descriptions]
    dtypes = [d[3][1] for d in descriptions]
    if len(set(dtypes)) > 1:
        raise mismatch(what, "dtypes", dtypes, comm.rank, "Gather tensors of one dtype")
    if len({(len(s), s[1:]) for s in shapes}) > 1:
        raise mismatch(what, "shapes beyond the first dimension", [list(s) for s in shapes], comm.rank,
                        "Only the first dimension may differ between ranks")
    x = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    parts = comm.allgather(x.to(comm.device))
    record("allgather", name, tensor, start, process_set)
    return torch.cat(parts).to(tensor.device), [p.shape[0] for p in parts]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, tensor):
        out, firsts = _allgather(tensor, name, process_set, "hvd.allgather")
        ctx.process_set, ctx.firsts = process_set, firsts
        return out

    @staticmethod
    def backward(ctx, grad):
        summed = allreduce(grad.contiguous(), op=Sum, process_set=ctx.process_set)
        r = comm_of(ctx.process_set, "hvd.allgather (backward)").rank
        offset = sum(ctx.firsts[:r])
        return None, None, summed.narrow(0, offset, ctx.firsts[r])


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension; differentiable.

    Args:
        tensor: one dtype on every rank; shapes may differ in the first dimension only.
        name: the collective's name.
        process_set: the ranks taking part.

    Returns:
        The tensors of all ranks, in rank order, concatenated.

    Raises:
        CollectiveMismatchError: dtypes, or dimensions after the first, differ (on every rank).

    Example::

        >>> hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank()))
    """
    return _Allgather.apply(name, process_set, tensor)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """:func:`allgather`, returning a handle (complete at once).

    Args:
        tensor, name, process_set: as :func:`allgather`.

    Returns:
        A handle whose ``synchronize`` returns the gathered tensor.

    Example::

        >>> hvd.synchronize(hvd.allgather_async(x))
    """
    start = time.time()
    out, _ = _allgather(tensor, name, process_set, "hvd.allgather_async")
    return completed_handle("allgather", name, out, out.numel() * out.element_size(), start, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """:func:`allgather` of each tensor of a list; returns the list of results.

    Args:
        tensors: the tensors; name, process_set: as :func:`allgather`.

    Returns:
        The gathered tensors, in order.

    Example::

        >>> a, b = hvd.grouped_allgather([a, b])
    """
    return [allgather(t, f"{name}.{i}" if name else None, process_set) for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """:func:`grouped_allgather`, returning a handle (complete at once).

    Args:
        tensors, name, process_set: as :func:`grouped_allgather`.

    Returns:
        A handle whose ``synchronize`` returns the list.

    Example::

        >>> a, b = hvd.synchronize(hvd.grouped_allgather_async([a, b]))
    """
    start = time.time()
    outs = [_allgather(t, f"{name}.{i}" if name else None, process_set, "hvd.grouped_allgather_async")[0]
            for i, t in enumerate(tensors)]
    return completed_handle("allgather", name, outs, sum(o.numel() * o.element_size() for o in outs), start, process_set)


# ----------------------------------------------------------------------------- broadcast
def _broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set, what: str) -> torch.Tensor:
    start = time.time()
    comm = comm_of(process_set, what)
    handles.check_name("broadcast", name)
    ranks = (global_process_set if process_set is None else process_set).ranks
    problem = None
    if not isinstance(tensor, torch.Tensor):
        problem = f"{what} takes a tensor, not {type(tensor).__name__}"
    elif root_rank not in ranks:
        problem = f"broadcast received invalid root rank {root_rank} for provided process set"
    descriptions = agree_on(comm, "broadcast", what, (name, root_rank, None if problem else layout(tensor)), problem)
    roots = [d[3] for d in descriptions]
    if len(set(roots)) > 1:
        raise mismatch(what, "root ranks", roots, comm.rank, "Every rank must name the same root_rank")
    layouts = [d[4] for d in descriptions]
    if len(set(layouts)) > 1:
        raise mismatch(what, "tensors' shapes and dtypes", layouts, comm.rank,
                        "Every rank must pass a tensor of the root's shape and dtype")
    out = comm.bcast(tensor.detach().to(comm.device), root=ranks.index(root_rank)).to(tensor.device)
    record("broadcast", name, tensor, start, process_set)
    return out


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, root_rank, name, process_set, tensor):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast(tensor, root_rank, name, process_set, "hvd.broadcast")

    @staticmethod
    def backward(ctx, grad):
        summed = allreduce(grad.contiguous(), op=Sum, process_set=ctx.process_set)
        ranks = (global_process_set if ctx.process_set is None else ctx.process_set).ranks
        if comm_of(ctx.process_set, "hvd.broadcast (backward)").rank != ranks.index(ctx.root_rank):
            summed = summed * 0
        return None, None, None, summed


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return root's ``tensor`` on every rank (``tensor`` is not changed); differentiable.

    Args:
        tensor: root's shape and dtype on every rank.
        root_rank: the rank (``hvd.rank()`` number) whose tensor everyone gets.
        name: the collective's name.
        process_set: the ranks taking part (``root_rank`` among them).

    Returns:
        A new tensor holding root's values.

    Raises:
        ValueError: ``root_rank`` is not in ``process_set``.
        CollectiveMismatchError: ranks name different roots, or their shapes or dtypes differ.

    Example::

        >>> w = hvd.broadcast(w, root_rank=0)
    """
    return _Broadcast.apply(root_rank, name, process_set, tensor)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root's values, in place; returns it.

    Args:
        tensor, root_rank, name, process_set: as :func:`broadcast`.

    Returns:
        ``tensor``, holding root's values.

    Example::

        >>> hvd.broadcast_(p.data, root_rank=0)
    """
    with torch.no_grad():
        return tensor.copy_(_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_"))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """:func:`broadcast`, returning a handle (complete at once).

    Args:
        tensor, root_rank, name, process_set: as :func:`broadcast`.

    Returns:
        A handle whose ``synchronize`` returns root's tensor.

    Example::

        >>> w = hvd.synchronize(hvd.broadcast_async(w, 0))
    """
    start = time.time()
    out = _broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_async")
    return completed_handle("broadcast", name, out, out.numel() * out.element_size(), start, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """:func:`broadcast_`, returning a handle (complete at once).

    Args:
        tensor, root_rank, name, process_set: as :func:`broadcast`.

    Returns:
        A handle whose ``synchronize`` returns ``tensor``.

    Example::

        >>> hvd.synchronize(hvd.broadcast_async_(w, 0))
    """
    start = time.time()
    with torch.no_grad():
        tensor.copy_(_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_async_"))
    return completed_handle("broadcast", name, tensor, tensor.numel() * tensor.element_size(), start, process_set)
