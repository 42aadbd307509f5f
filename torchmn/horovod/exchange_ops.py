"""``hvd.alltoall`` and ``hvd.reducescatter``, with their asynchronous, grouped and
differentiable forms.

As in :mod:`torchmn.horovod.gather_ops`, the ``_async`` forms complete before they return. An
alltoall's gradient goes back to its senders; a reducescatter's is the gathered gradients, times
the ranks for ``Sum`` (Horovod's convention).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from torchmn.horovod import handles
from torchmn.horovod.allreduce_ops import WIDER, check_op, layout, scale
from torchmn.horovod.basics import OP_NAMES, Average, Sum
from torchmn.horovod.checked_calls import agree_on, completed_handle, mismatch, record
from torchmn.horovod.gather_ops import allgather
from torchmn.horovod.process_sets import comm_of, global_process_set


# ----------------------------------------------------------------------------- alltoall
def _split_sizes(tensor, splits, size: int) -> tuple[Optional[list[int]], Optional[str]]:
    """The rows this rank sends to each rank, or what is wrong with ``splits``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        return None, "hvd.alltoall takes a tensor of at least one dimension"
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            return None, (f"the first dimension of the tensor ({rows}) is not divisible by the number of ranks "
                          f"({size}); pass splits=")
        return [rows // size] * size, None
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64) or splits.dim() != 1:
            return None, f"splits must be a 1-D tensor of int32 or int64, not {splits.dtype} of shape {list(splits.shape)}"
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != size:
        return None, f"splits has {len(splits)} entries, not one per rank ({size})"
    if min(splits) < 0:
        return None, f"splits must not be negative: {splits}"
    if sum(splits) != rows:
        return None, f"splits sum to {sum(splits)}, not the tensor's first dimension {rows}"
    return splits, None


def _alltoall(tensor, splits, name, process_set, what: str):
    start = time.time()
    comm = comm_of(process_set, what)
    handles.check_name("alltoall", name)
    sizes, problem = _split_sizes(tensor, splits, comm.size)
    trailing = None if problem else (tuple(tensor.shape[1:]), layout(tensor)[1])
    descriptions = agree_on(comm, "alltoall", what, (name, trailing), problem)
    if len({d[3] for d in descriptions}) > 1:
        raise mismatch(what, "dimensions after the first, and dtypes", [d[3] for d in descriptions], comm.rank,
                        "Only the first dimension may differ between ranks")
    got = comm.alltoall(list(tensor.detach().to(comm.device).split(sizes)))
    received = torch.tensor([g.shape[0] for g in got], dtype=torch.int32)
    record("alltoall", name, tensor, start, process_set)
    return torch.cat(got).to(tensor.device), received


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, splits, name, process_set, tensor):
        out, received = _alltoall(tensor, splits, name, process_set, "hvd.alltoall")
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = _alltoall(grad.contiguous(), ctx.received, None, ctx.process_set, "hvd.alltoall (backward)")
        return None, None, None, back


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send rows of ``tensor`` to each rank and receive theirs; differentiable.

    Args:
        tensor: the rows to send, in rank order (dimensions after the first equal on every rank).
        splits: how many rows go to each rank (a list or 1-D int tensor; default: equal parts).
        name: the collective's name.
        process_set: the ranks taking part.

    Returns:
        The received rows, in rank order; with ``splits`` given, ``(rows, received_splits)`` (an
        int32 tensor of how many rows came from each rank), as Horovod returns them.

    Raises:
        ValueError: ``splits`` do not fit the tensor or the ranks (on every rank).

    Example::

        >>> out, got = hvd.alltoall(torch.arange(3.0), splits=[1, 2])     # on 2 ranks
    """
    out, received = _Alltoall.apply(splits, name, process_set, tensor)
    return (out, received) if splits is not None else out


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """:func:`alltoall`, returning a handle (complete at once; ``synchronize`` returns what it returns).

    Args:
        tensor, splits, name, process_set: as :func:`alltoall`.

    Returns:
        A handle.

    Example::

        >>> out = hvd.synchronize(hvd.alltoall_async(x))
    """
    start = time.time()
    out, received = _alltoall(tensor, splits, name, process_set, "hvd.alltoall_async")
    result = (out, received) if splits is not None else out
    return completed_handle("alltoall", name, result, out.numel() * out.element_size(), start, process_set)


# ----------------------------------------------------------------------------- reducescatter
def _rows_per_rank(rows: int, size: int) -> list[int]:
    """Horovod's split of the first dimension: equal parts, the first ranks one row more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _reducescatter(tensor, op, name, process_set, prescale, postscale, what: str) -> torch.Tensor:
    began = time.time()
    comm = comm_of(process_set, what)
    if op not in (Average, Sum):
        check_op(op, what)
        raise NotImplementedError(f"{what}: op={OP_NAMES.get(op, op)} is not supported; reducescatter takes "
                                  f"hvd.Average (the default) or hvd.Sum")
    handles.check_name("reducescatter", name)
    problem = None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        problem = f"{what} takes a tensor of at least one dimension"
    descriptions = agree_on(comm, "reducescatter", what,
                             (name, op, float(prescale), float(postscale), None if problem else layout(tensor)), problem)
    for field, index in (("ops", 3), ("prescale factors", 4), ("postscale factors", 5),
                         ("tensors' shapes and dtypes", 6)):
        values = [d[index] for d in descriptions]
        if len({repr(v) for v in values}) > 1:
            raise mismatch(what, field, values, comm.rank, "Every rank must pass the same op, factors, shape and dtype")
    counts = _rows_per_rank(tensor.shape[0], comm.size)
    most = max(counts)
    wire = WIDER.get(tensor.dtype, tensor.dtype)
    src = tensor.detach().to(comm.device, wire)
    padded = torch.zeros((comm.size * most,) + tuple(tensor.shape[1:]), dtype=wire, device=comm.device)
    start = 0
    for r, n in enumerate(counts):
        padded[r * most:r * most + n] = src[start:start + n]
        start += n
    if prescale != 1.0:
        scale(padded, prescale)
    shard = torch.empty((most,) + tuple(tensor.shape[1:]), dtype=wire, device=comm.device)
    comm.reduce_scatter_flat(padded.view(-1), shard.view(-1), async_op=True).wait()
    out = shard[:counts[comm.rank]]
    if op == Average:
        out = out.div_(comm.size) if out.is_floating_point() else out.floor_divide_(comm.size)
    if postscale != 1.0:
        scale(out, postscale)
    record("reducescatter", name, tensor, began, process_set)
    return out.to(tensor.device, tensor.dtype)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, process_set, prescale, postscale, tensor):
        ctx.op, ctx.process_set = op, process_set
        return _reducescatter(tensor, op, name, process_set, prescale, postscale, "hvd.reducescatter")

    @staticmethod
    def backward(ctx, grad):
        gathered = allgather(grad.contiguous(), process_set=ctx.process_set)
        if ctx.op == Sum:
            gathered = gathered * comm_of(ctx.process_set, "hvd.reducescatter (backward)").size
        return None, None, None, None, None, gathered


def reducescatter(tensor, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and give each rank its rows of the result; differentiable.

    The first dimension is split as Horovod splits it: equal parts, the first ranks one row
    more when it does not divide.

    Args:
        tensor: the same shape and dtype on every rank.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        name: the collective's name.
        process_set: the ranks taking part.
        prescale_factor, postscale_factor: multiply before and after the reduction.

    Returns:
        This rank's rows of the reduction.

    Raises:
        NotImplementedError: another op.
        CollectiveMismatchError: the ranks' shapes, dtypes, ops or factors differ (on every rank).

    Example::

        >>> mine = hvd.reducescatter(torch.ones(4, 3), op=hvd.Sum)    # rows 2r, 2r+1 on 2 ranks
    """
    return _Reducescatter.apply(op, name, process_set, prescale_factor, postscale_factor, tensor)


def reducescatter_async(tensor, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """:func:`reducescatter`, returning a handle (complete at once).

    Args:
        tensor, op, name, process_set, prescale_factor, postscale_factor: as :func:`reducescatter`.

    Returns:
        A handle whose ``synchronize`` returns this rank's rows.

    Example::

        >>> mine = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum))
    """
    start = time.time()
    out = _reducescatter(tensor, op, name, process_set, prescale_factor, postscale_factor, "hvd.reducescatter_async")
    return completed_handle("reducescatter", name, out, tensor.numel() * tensor.element_size(), start, process_set)


def grouped_reducescatter(tensors, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """:func:`reducescatter` of each tensor of a list; returns the list of results.

    Args:
        tensors: the tensors; op, name, process_set, prescale_factor, postscale_factor: as
            :func:`reducescatter`.

    Returns:
        This rank's rows of each reduction, in order.

    Example::

        >>> a, b = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    """
    return [reducescatter(t, op, f"{name}.{i}" if name else None, process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors, op=Average, name=None, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """:func:`grouped_reducescatter`, returning a handle (complete at once).

    Args:
        tensors, op, name, process_set, prescale_factor, postscale_factor: as
            :func:`grouped_reducescatter`.

    Returns:
        A handle whose ``synchronize`` returns the list.

    Example::

        >>> a, b = hvd.synchronize(hvd.grouped_reducescatter_async([a, b]))
    """
    start = time.time()
    outs = [_reducescatter(t, op, f"{name}.{i}" if name else None, process_set, prescale_factor, postscale_factor,
                           "hvd.grouped_reducescatter_async") for i, t in enumerate(tensors)]
    return completed_handle("reducescatter", name, outs, sum(t.numel() * t.element_size() for t in tensors), start, process_set)
