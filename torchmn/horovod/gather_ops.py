"""``hvd.allgather``, ``broadcast``, ``alltoall`` and ``reducescatter``, with their asynchronous,
in-place, grouped and differentiable forms.

These run on the communicator's checked collectives; their ``_async`` forms complete before they
return (the handle is ready at once): only allreduces overlap with the script. Gradients follow
Horovod's conventions (an allgather's is the sum over ranks of the output gradients, sliced; a
broadcast's is that sum on the root and zero elsewhere; a reducescatter's is the gathered
gradients, times the ranks for ``Sum``).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from torchmn.communicators import CollectiveMismatchError
from torchmn.horovod import coordination, handles, timeline
from torchmn.horovod.allreduce_ops import WIDER, allreduce, check_op, layout, scale
from torchmn.horovod.basics import OP_NAMES, Average, Sum
from torchmn.horovod.process_sets import comm_of, global_process_set


def _agree_on(comm, kind: str, what: str, fields: tuple, problem: Optional[str]) -> list[tuple]:
    """Exchange every rank's call; raise on every rank alike if one rank's own arguments were bad."""
    descriptions = coordination.agree(comm, coordination.describe(kind, *fields, problem), need_descriptions=True)
    coordination.check_same_kind(descriptions, comm.rank)
    for r, d in enumerate(descriptions):
        if d[-1] is not None:
            raise ValueError(f"{what}: rank {r} ({d[1]}) rejected its arguments: {d[-1]}; rank {comm.rank} stops too")
    return descriptions


def _mismatch(what: str, field: str, values: list, rank: int, fix: str) -> CollectiveMismatchError:
    listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return CollectiveMismatchError(f"{what}: the ranks' {field} differ: {listing}. {fix}; rank {rank} stops")


def _done(kind: str, name: Optional[str], result, nbytes: int, start: float, process_set) -> int:
    """The handle of a collective that has run already (and recorded itself in the timeline)."""
    return handles.submit(kind, name, None, lambda: result, nbytes, process_set.process_set_id, start, record=False)



def _record(kind: str, name: Optional[str], tensor, start: float, process_set) -> None:
    """Add a collective that has just run to the timeline."""
    nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
    timeline.record(kind, name or f"{kind}.noname", nbytes, start, time.time(),
                    getattr(process_set, "process_set_id", 0))


# ----------------------------------------------------------------------------- allgather
def _allgather(tensor: torch.Tensor, name: Optional[str], process_set, what: str):
    """The concatenation over ranks of ``tensor`` along dim 0, and every rank's first dimension."""
    start = time.time()
    comm = comm_of(process_set, what)
    handles.check_name("allgather", name)
    problem = None if isinstance(tensor, torch.Tensor) else f"{what} takes a tensor, not {type(tensor).__name__}"
    shape_dtype = layout(tensor) if problem is None else None
    descriptions = _agree_on(comm, "allgather", what, (name, shape_dtype), problem)
    shapes = [d[3][0] for d in descriptions]
    dtypes = [d[3][1] for d in descriptions]
    if len(set(dtypes)) > 1:
        raise _mismatch(what, "dtypes", dtypes, comm.rank, "Gather tensors of one dtype")
    if len({(len(s), s[1:]) for s in shapes}) > 1:
        raise _mismatch(what, "shapes beyond the first dimension", [list(s) for s in shapes], comm.rank,
                        "Only the first dimension may differ between ranks")
    x = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    parts = comm.allgather(x.to(comm.device))
    _record("allgather", name, tensor, start, process_set)
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
    return _done("allgather", name, out, out.numel() * out.element_size(), start, process_set)


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
    return _done("allgather", name, outs, sum(o.numel() * o.element_size() for o in outs), start, process_set)


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
    descriptions = _agree_on(comm, "broadcast", what, (name, root_rank, None if problem else layout(tensor)), problem)
    roots = [d[3] for d in descriptions]
    if len(set(roots)) > 1:
        raise _mismatch(what, "root ranks", roots, comm.rank, "Every rank must name the same root_rank")
    layouts = [d[4] for d in descriptions]
    if len(set(layouts)) > 1:
        raise _mismatch(what, "tensors' shapes and dtypes", layouts, comm.rank,
                        "Every rank must pass a tensor of the root's shape and dtype")
    out = comm.bcast(tensor.detach().to(comm.device), root=ranks.index(root_rank)).to(tensor.device)
    _record("broadcast", name, tensor, start, process_set)
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
    return _done("broadcast", name, out, out.numel() * out.element_size(), start, process_set)


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
    return _done("broadcast", name, tensor, tensor.numel() * tensor.element_size(), start, process_set)


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
    descriptions = _agree_on(comm, "alltoall", what, (name, trailing), problem)
    if len({d[3] for d in descriptions}) > 1:
        raise _mismatch(what, "dimensions after the first, and dtypes", [d[3] for d in descriptions], comm.rank,
                        "Only the first dimension may differ between ranks")
    got = comm.alltoall(list(tensor.detach().to(comm.device).split(sizes)))
    received = torch.tensor([g.shape[0] for g in got], dtype=torch.int32)
    _record("alltoall", name, tensor, start, process_set)
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
    return _done("alltoall", name, result, out.numel() * out.element_size(), start, process_set)


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
    descriptions = _agree_on(comm, "reducescatter", what,
                             (name, op, float(prescale), float(postscale), None if problem else layout(tensor)), problem)
    for field, index in (("ops", 3), ("prescale factors", 4), ("postscale factors", 5),
                         ("tensors' shapes and dtypes", 6)):
        values = [d[index] for d in descriptions]
        if len({repr(v) for v in values}) > 1:
            raise _mismatch(what, field, values, comm.rank, "Every rank must pass the same op, factors, shape and dtype")
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
    _record("reducescatter", name, tensor, began, process_set)
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
    return _done("reducescatter", name, out, tensor.numel() * tensor.element_size(), start, process_set)


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
    return _done("reducescatter", name, outs, sum(t.numel() * t.element_size() for t in tensors), start, process_set)
