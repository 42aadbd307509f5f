"""The tensor collectives other than allreduce: ``allgather``, ``broadcast``, ``alltoall`` and
``reducescatter``, with their asynchronous, in-place, grouped and differentiable forms, and
``sparse_allreduce_async``, which gathers every rank's indices and values.

Each runs on the background thread (:mod:`~torchmn.horovod.background`), on the process set's
tensor communicator, and checks on every rank that the ranks' calls agree
(:mod:`~torchmn.horovod.checked_calls`), so that shapes, dtypes, ops or roots that differ between
ranks raise on every rank, naming each rank, its host and its shape (Horovod's coordinator reports a
mismatch without saying which rank sent what). The
``_async`` forms return a handle while the collective is in flight; the others wait for it.

Gradients follow Horovod's conventions (0.28): an allgather's is the average over ranks of the
output gradients, sliced to this rank's rows; a broadcast's is that average on the root and zero
elsewhere; an alltoall's goes back to its senders; a reducescatter's is the gathered gradients,
times the ranks for ``Sum``. The averages are allreduces
(:mod:`~torchmn.horovod.allreduce_collectives`, the module below this one).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from torchmn.horovod import handles
from torchmn.horovod.allreduce_collectives import allreduce
from torchmn.horovod.checked_calls import agree_on, layout, mismatch, nbytes
from torchmn.horovod.compression import Compression
from torchmn.horovod.errors import UnsupportedError
from torchmn.horovod.process_sets import comm_of, global_process_set, tensor_comm_of
from torchmn.horovod.reduction_ops import OP_NAMES, WIDER, Average, Sum, check_op, scale


# ----------------------------------------------------------------------------- allgather
def _start_allgather(tensors: list, name: Optional[str], process_set, what: str, finish, wait: bool = False):
    """Start gathering each tensor on the background thread; the handle's result is ``finish`` of
    the list of ``(gathered, first dimension of each rank)`` pairs."""
    comm = tensor_comm_of(process_set, what)

    def work():
        return finish([_allgather(comm, t, f"{name}.{i}" if name and len(tensors) > 1 else name, what)
                       for i, t in enumerate(tensors)])
    return (handles.run_now if wait else handles.submit)("allgather", name, comm, work, nbytes(tensors),
                                                         process_set.process_set_id)


def _allgather(comm, tensor: torch.Tensor, name: Optional[str], what: str):
    """The concatenation over ranks of ``tensor`` along dim 0, and every rank's first dimension."""
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
    parts = comm.allgather(x)
    return torch.cat(parts).to(tensor.device), [p.shape[0] for p in parts]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, tensor):
        out, firsts = _start_allgather([tensor], name, process_set, "hvd.allgather", lambda parts: parts[0], wait=True)
        ctx.process_set, ctx.firsts = process_set, firsts
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        averaged = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        r = comm_of(ctx.process_set, "hvd.allgather (backward)").rank
        offset = sum(ctx.firsts[:r])
        return None, None, averaged.narrow(0, offset, ctx.firsts[r])


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension; differentiable.

    Args:
        tensor: one dtype on every rank; shapes may differ in the first dimension only.
        name: the collective's name.
        process_set: the ranks taking part.

    Returns:
        The tensors of all ranks, in rank order, concatenated.

    Raises:
        InvalidCallError: before ``hvd.init()``; a name already in flight; a rank outside ``process_set``.
        CollectiveMismatchError: dtypes, or dimensions after the first, differ (on every rank).

    Example::

        >>> hvd.allgather(torch.full((hvd.rank() + 1, 2), hvd.rank()))
    """
    return _Allgather.apply(name, process_set, tensor)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start :func:`allgather`; returns a handle at once.

    Args:
        tensor, name, process_set: as :func:`allgather`.

    Returns:
        A handle whose ``synchronize`` returns the gathered tensor.

    Raises:
        As :func:`allgather`.

    Example::

        >>> hvd.synchronize(hvd.allgather_async(x))
    """
    return _start_allgather([tensor], name, process_set, "hvd.allgather_async", lambda parts: parts[0][0])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """:func:`allgather` of each tensor of a list; returns the list of results.

    Args:
        tensors: the tensors; name, process_set: as :func:`allgather`.

    Returns:
        The gathered tensors, in order.

    Raises:
        As :func:`allgather`.

    Example::

        >>> a, b = hvd.grouped_allgather([a, b])
    """
    return [allgather(t, f"{name}.{i}" if name else None, process_set) for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start :func:`grouped_allgather`; returns a handle at once.

    Args:
        tensors, name, process_set: as :func:`grouped_allgather`.

    Returns:
        A handle whose ``synchronize`` returns the list.

    Raises:
        As :func:`allgather`.

    Example::

        >>> a, b = hvd.synchronize(hvd.grouped_allgather_async([a, b]))
    """
    return _start_allgather(list(tensors), name, process_set, "hvd.grouped_allgather_async",
                            lambda parts: [out for out, _ in parts])


# ----------------------------------------------------------------------------- broadcast
def _start_broadcast(tensor, root_rank: int, name: Optional[str], process_set, what: str, into=None,
                     wait: bool = False):
    """Start broadcasting root's ``tensor`` on the background thread; the handle's result is a new
    tensor, or ``into`` with root's values copied in."""
    comm = tensor_comm_of(process_set, what)
    ranks = (global_process_set if process_set is None else process_set).ranks

    def work():
        out = _broadcast(comm, ranks, tensor, root_rank, name, what)
        if into is None:
            return out
        with torch.no_grad():  # grad mode is the background thread's own
            return into.copy_(out)
    return (handles.run_now if wait else handles.submit)("broadcast", name, comm, work, nbytes([tensor]),
                                                         process_set.process_set_id)


def _broadcast(comm, ranks: list, tensor: torch.Tensor, root_rank: int, name: Optional[str], what: str):
    problem = None
    if not isinstance(tensor, torch.Tensor):
        problem = f"{what} takes a tensor, not {type(tensor).__name__}"
    elif root_rank not in ranks:
        problem = f"broadcast received invalid root rank {root_rank} for provided process set"
    shape_dtype = None if problem else layout(tensor)
    descriptions = agree_on(comm, "broadcast", what, (name, root_rank, shape_dtype), problem)
    roots = [d[3] for d in descriptions]
    if len(set(roots)) > 1:
        raise mismatch(what, "root ranks", roots, comm.rank, "Every rank must name the same root_rank")
    layouts = [d[4] for d in descriptions]
    if len(set(layouts)) > 1:
        raise mismatch(what, "tensors' shapes and dtypes", layouts, comm.rank,
                        "Every rank must pass a tensor of the root's shape and dtype")
    return comm.bcast(tensor.detach(), root=ranks.index(root_rank)).to(tensor.device)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, root_rank, name, process_set, tensor):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _start_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast", wait=True)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        averaged = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        ranks = (global_process_set if ctx.process_set is None else ctx.process_set).ranks
        if comm_of(ctx.process_set, "hvd.broadcast (backward)").rank != ranks.index(ctx.root_rank):
            averaged = averaged * 0
        return None, None, None, averaged


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
        InvalidCallError: ``root_rank`` is not in ``process_set``; before ``hvd.init()``; a name
            already in flight; a rank outside ``process_set``.
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

    Raises:
        As :func:`broadcast`.

    Example::

        >>> hvd.broadcast_(p.data, root_rank=0)
    """
    return _start_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_", into=tensor, wait=True)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start :func:`broadcast`; returns a handle at once.

    Args:
        tensor, root_rank, name, process_set: as :func:`broadcast`.

    Returns:
        A handle whose ``synchronize`` returns root's tensor.

    Raises:
        As :func:`broadcast`.

    Example::

        >>> w = hvd.synchronize(hvd.broadcast_async(w, 0))
    """
    return _start_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_async")


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start :func:`broadcast_`; returns a handle at once.

    Args:
        tensor, root_rank, name, process_set: as :func:`broadcast`.

    Returns:
        A handle whose ``synchronize`` returns ``tensor``.

    Raises:
        As :func:`broadcast`.

    Example::

        >>> hvd.synchronize(hvd.broadcast_async_(w, 0))
    """
    return _start_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_async_", into=tensor)


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
            return None, (f"splits must be a 1-D tensor of int32 or int64, not {splits.dtype} of shape "
                          f"{list(splits.shape)}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != size:
        return None, f"splits has {len(splits)} entries, not one per rank ({size})"
    if min(splits) < 0:
        return None, f"splits must not be negative: {splits}"
    if sum(splits) > rows:  # fewer is fine, as in Horovod: the rows past the splits' sum are not sent
        return None, f"splits sum to {sum(splits)}, more than the tensor's first dimension {rows}"
    return splits, None


def _start_alltoall(tensor, splits, name, process_set, what: str, finish, wait: bool = False):
    """Start an alltoall on the background thread; the handle's result is ``finish((rows, received))``."""
    comm = tensor_comm_of(process_set, what)
    return (handles.run_now if wait else handles.submit)(
        "alltoall", name, comm, lambda: finish(_alltoall(comm, tensor, splits, name, what)), nbytes([tensor]),
        process_set.process_set_id)


def _alltoall(comm, tensor, splits, name, what: str):
    sizes, problem = _split_sizes(tensor, splits, comm.size)
    trailing = None if problem else (tuple(tensor.shape[1:]), layout(tensor)[1])
    descriptions = agree_on(comm, "alltoall", what, (name, trailing), problem)
    if len({d[3] for d in descriptions}) > 1:
        raise mismatch(what, "dimensions after the first, and dtypes", [d[3] for d in descriptions], comm.rank,
                        "Only the first dimension may differ between ranks")
    got = comm.alltoall(list(tensor.detach()[:sum(sizes)].split(sizes)))
    received = torch.tensor([g.shape[0] for g in got], dtype=torch.int32)
    return torch.cat(got).to(tensor.device), received


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, splits, name, process_set, tensor):
        out, received = _start_alltoall(tensor, splits, name, process_set, "hvd.alltoall", lambda result: result,
                                        wait=True)
        ctx.received, ctx.process_set, ctx.rows = received, process_set, tensor.shape[0]
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _):
        back, _ = _start_alltoall(grad.contiguous(), ctx.received, None, ctx.process_set, "hvd.alltoall (backward)",
                                  lambda result: result, wait=True)
        if back.shape[0] < ctx.rows:  # the rows past the splits' sum were not sent: no gradient flows to them
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return None, None, None, back


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send rows of ``tensor`` to each rank and receive theirs; differentiable.

    Args:
        tensor: the rows to send, in rank order (dimensions after the first equal on every rank).
        splits: how many rows go to each rank (a list or 1-D int tensor; default: equal parts); rows past
            their sum are not sent, as in Horovod.
        name: the collective's name.
        process_set: the ranks taking part.

    Returns:
        The received rows, in rank order; with ``splits`` given, ``(rows, received_splits)`` (an
        int32 tensor of how many rows came from each rank), as Horovod returns them.

    Raises:
        InvalidCallError: ``splits`` do not fit the tensor or the ranks (on every rank); before
            ``hvd.init()``; a name already in flight; a rank outside ``process_set``.
        CollectiveMismatchError: the dimensions after the first, or the dtypes, differ (on every rank).

    Example::

        >>> out, got = hvd.alltoall(torch.arange(3.0), splits=[1, 2])     # on 2 ranks
    """
    out, received = _Alltoall.apply(splits, name, process_set, tensor)
    return (out, received) if splits is not None else out


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start :func:`alltoall`; returns a handle at once.

    ``synchronize`` returns ``(rows, received_splits)``, with ``splits`` or without, as Horovod's
    does (only the blocking :func:`alltoall` drops ``received_splits`` when no ``splits`` are given).

    Args:
        tensor, splits, name, process_set: as :func:`alltoall`.

    Returns:
        A handle.

    Raises:
        As :func:`alltoall`.

    Example::

        >>> out, received_splits = hvd.synchronize(hvd.alltoall_async(x))
    """
    return _start_alltoall(tensor, splits, name, process_set, "hvd.alltoall_async", lambda result: result)


# ----------------------------------------------------------------------------- reducescatter
def _rows_per_rank(rows: int, size: int) -> list[int]:
    """Horovod's split of the first dimension: equal parts, the first ranks one row more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _start_reducescatter(tensors: list, op, name, process_set, prescale, postscale, what: str, grouped: bool,
                         wait: bool = False):
    """Start reducing and scattering each tensor on the background thread; the handle's result is
    this rank's rows of each (of the one where not ``grouped``)."""
    comm = tensor_comm_of(process_set, what)
    if op not in (Average, Sum):
        check_op(op, what)
        raise UnsupportedError(f"{what}: op={OP_NAMES.get(op, op)} is not supported; reducescatter takes "
                               f"hvd.Average (the default) or hvd.Sum")

    def work():
        outs = [_reducescatter(comm, t, op, f"{name}.{i}" if name and grouped else name, prescale, postscale, what)
                for i, t in enumerate(tensors)]
        return outs if grouped else outs[0]
    return (handles.run_now if wait else handles.submit)("reducescatter", name, comm, work, nbytes(tensors),
                                                         process_set.process_set_id)


def _reducescatter(comm, tensor, op, name, prescale, postscale, what: str) -> torch.Tensor:
    problem = None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        problem = f"{what} takes a tensor of at least one dimension"
    shape_dtype = None if problem else layout(tensor)
    descriptions = agree_on(comm, "reducescatter", what, (name, op, float(prescale), float(postscale), shape_dtype),
                             problem)
    for field, index in (("ops", 3), ("prescale factors", 4), ("postscale factors", 5),
                         ("tensors' shapes and dtypes", 6)):
        values = [d[index] for d in descriptions]
        if len({repr(v) for v in values}) > 1:
            raise mismatch(what, field, values, comm.rank,
                            "Every rank must pass the same op, factors, shape and dtype")
    counts = _rows_per_rank(tensor.shape[0], comm.size)
    most = max(counts)
    wire = WIDER.get(tensor.dtype, tensor.dtype)
    device = comm.wire_device(tensor)
    src = tensor.detach().to(device, wire)
    padded = torch.zeros((comm.size * most,) + tuple(tensor.shape[1:]), dtype=wire, device=device)
    start = 0
    for r, n in enumerate(counts):
        padded[r * most:r * most + n] = src[start:start + n]
        start += n
    if prescale != 1.0:
        scale(padded, prescale)
    shard = torch.empty((most,) + tuple(tensor.shape[1:]), dtype=wire, device=device)
    comm.reduce_scatter_flat(padded.view(-1), shard.view(-1), async_op=True).wait()
    out = shard[:counts[comm.rank]]
    if op == Average and not out.is_floating_point():
        scale(out, postscale / comm.size)  # Horovod's core: once, in float64, truncated
    else:
        if op == Average:
            out.div_(comm.size)
        if postscale != 1.0:
            scale(out, postscale)
    return out.to(tensor.device, tensor.dtype)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, process_set, prescale, postscale, tensor):
        ctx.op, ctx.process_set, ctx.factor = op, process_set, prescale * postscale
        return _start_reducescatter([tensor], op, name, process_set, prescale, postscale, "hvd.reducescatter",
                                    grouped=False, wait=True)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # Horovod's gradient: the rows gathered, times the rank count for Sum and the two factors.
        factor = ctx.factor
        if ctx.op == Sum:
            factor *= comm_of(ctx.process_set, "hvd.reducescatter (backward)").size
        gathered = allgather(grad.contiguous(), process_set=ctx.process_set)
        return None, None, None, None, None, gathered * factor if factor != 1.0 else gathered


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and give each rank its rows of the result; differentiable.

    The first dimension is split as Horovod splits it: equal parts, the first ranks one row
    more when it does not divide. The arguments come in Horovod's order.

    Args:
        tensor: the same shape and dtype on every rank.
        name: the collective's name.
        compression: ``hvd.Compression.none`` or ``fp16`` (the tensor travels as float16).
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        process_set: the ranks taking part.
        prescale_factor, postscale_factor: multiply before and after the reduction.

    Returns:
        This rank's rows of the reduction.

    Raises:
        InvalidCallError: before ``hvd.init()``; a name already in flight; a rank outside ``process_set``.
        UnsupportedError: another op.
        CollectiveMismatchError: the ranks' shapes, dtypes, ops or factors differ (on every rank).

    Example::

        >>> mine = hvd.reducescatter(torch.ones(4, 3), op=hvd.Sum)    # rows 2r, 2r+1 on 2 ranks
    """
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(op, name, process_set, prescale_factor, postscale_factor, compressed)
    return compression.decompress(reduced, ctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start :func:`reducescatter`; returns a handle at once (Horovod's arguments, no compression).

    Args:
        tensor, name, op, process_set, prescale_factor, postscale_factor: as :func:`reducescatter`.

    Returns:
        A handle whose ``synchronize`` returns this rank's rows.

    Raises:
        As :func:`reducescatter`.

    Example::

        >>> mine = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum))
    """
    return _start_reducescatter([tensor], op, name, process_set, prescale_factor, postscale_factor,
                                "hvd.reducescatter_async", grouped=False)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """:func:`reducescatter` of each tensor of a list; returns the list of results.

    Args:
        tensors: the tensors; name, compression, op, process_set, prescale_factor,
            postscale_factor: as :func:`reducescatter`.

    Returns:
        This rank's rows of each reduction, in order.

    Raises:
        As :func:`reducescatter`.

    Example::

        >>> a, b = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    """
    return [reducescatter(t, f"{name}.{i}" if name else None, compression, op, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start :func:`grouped_reducescatter`; returns a handle at once (Horovod's arguments, no
    compression).

    Args:
        tensors, name, op, process_set, prescale_factor, postscale_factor: as
            :func:`grouped_reducescatter`.

    Returns:
        A handle whose ``synchronize`` returns the list.

    Raises:
        As :func:`reducescatter`.

    Example::

        >>> a, b = hvd.synchronize(hvd.grouped_reducescatter_async([a, b]))
    """
    return _start_reducescatter(list(tensors), op, name, process_set, prescale_factor, postscale_factor,
                                "hvd.grouped_reducescatter_async", grouped=True)


# ----------------------------------------------------------------------------- sparse allreduce
def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO tensor: every rank's indices and values are gathered.

    Args:
        tensor: a sparse COO tensor of the same dense shape on every rank.
        name: the collective's name.
        op: ``hvd.Average`` or ``hvd.Sum``.
        process_set: the ranks taking part.

    Returns:
        A callable (pass it to :func:`~torchmn.horovod.synchronize`, or call it) returning the
        reduced sparse tensor (duplicate indices are summed when it is coalesced).

    Raises:
        UnsupportedError: an op other than Average and Sum.

    Example::

        >>> h = hvd.sparse_allreduce_async(emb.weight.grad, name="emb", op=hvd.Average)
        >>> grad = hvd.synchronize(h)
    """
    if op not in (Average, Sum):
        raise UnsupportedError(f"hvd.sparse_allreduce_async: op={OP_NAMES.get(op, op)} is not supported; use "
                               f"hvd.Average or hvd.Sum")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t.indices().transpose(0, 1).contiguous(), name=name and f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t.values(), name=name and f"{name}.values", process_set=process_set)
    size = comm_of(process_set, "hvd.sparse_allreduce_async").size

    def result():
        try:
            i = handles.synchronize(indices)
        finally:
            v = handles.synchronize(values)
        if op == Average:
            v = v / size
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, t.size(), check_invariants=False)
    return result
