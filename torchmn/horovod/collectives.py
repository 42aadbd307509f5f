"""Horovod's tensor collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and ``sparse_allreduce_async``, with their asynchronous, in-place, grouped and
differentiable forms, and the reduction ops they take.

Every collective starts by exchanging a description of each rank's call (:mod:`~torchmn.horovod.coordination`),
so that shapes, dtypes, ops or roots that differ between ranks raise on every rank, naming the ranks
and shapes, where Horovod would hang or abort; a rank in ``hvd.join()`` takes part in allreduces
with zeros.

An allreduce starts one communicator ``allreduce_flat`` per dtype of the call (a grouped call is
fused) and is really in flight until its handle completes, when the local part runs (Average's
division, the scale factors, the copy out). The other collectives run on the communicator's
checked collectives and complete before they return: their ``_async`` forms return a handle that
is ready at once.

Gradients follow Horovod's conventions: an allreduce's is the allreduce of the output gradients
with the same op and factors; an allgather's is the sum over ranks of the output gradients,
sliced; a broadcast's is that sum on the root and zero elsewhere; an alltoall's goes back to its
senders; a reducescatter's is the gathered gradients, times the ranks for ``Sum``.
"""
from __future__ import annotations

import time
import warnings
from typing import Optional, Sequence

import torch

from torchmn.communicators import CollectiveMismatchError
from torchmn.horovod import coordination, handles, timeline
from torchmn.horovod.compression import Compression
from torchmn.horovod.errors import InvalidCallError, UnsupportedError
from torchmn.horovod.process_sets import comm_of, global_process_set

# ----------------------------------------------------------------------------- reduction ops
# Horovod's reduction ops, with Horovod's values.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


def handle_average_backwards_compatibility(op: Optional[int], average: Optional[bool]) -> int:
    """The op of a call that may use the deprecated ``average=`` argument, as Horovod decides it.

    Args:
        op: the call's ``op=`` (None: not given).
        average: the call's ``average=`` (None: not given); True means ``Average``, False ``Sum``,
            with a ``DeprecationWarning``.

    Returns:
        The op to reduce with (``Average`` when neither is given).

    Raises:
        InvalidCallError: both were given (a ``ValueError``, with Horovod's message).

    Example::

        >>> hvd.handle_average_backwards_compatibility(None, False) == hvd.Sum
        True
    """
    if op is not None and average is not None:
        raise InvalidCallError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v0.21.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


# The communicator's reduction of each op (Average divides the sum once it is done).
_REDUCE = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
# What a dtype is reduced in: half precision in float32 (no overflow, Horovod's CPU sum does the
# same), int16 in int32 (gloo has no int16 sum; the low bits are the same).
_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int16: torch.int32}


def _check_op(op: int, what: str) -> None:
    """Refuse ops torchmn.horovod does not reduce with.

    Args:
        op: a Horovod op value; ``what``: the call, for the message.

    Raises:
        UnsupportedError: ``hvd.Adasum``, or a value that is not a Horovod op.
    """
    if op == Adasum:
        raise UnsupportedError(f"{what}: op=hvd.Adasum is not implemented in torchmn.horovod; use op=hvd.Average "
                               f"(the default) or hvd.Sum")
    if op not in _REDUCE:
        raise UnsupportedError(f"{what}: op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, "
                               f"hvd.Product")


def _scale(flat: torch.Tensor, factor: float) -> None:
    """Multiply ``flat`` by ``factor`` in place; integers as Horovod's scaling does (the product
    truncated toward zero).

    Args:
        flat: the tensor; ``factor``: the factor.
    """
    if flat.is_floating_point():
        flat.mul_(factor)
    else:
        flat.copy_((flat.to(torch.float64) * factor).trunc())


# ----------------------------------------------------------------------------- what every collective shares
def _layout(t: torch.Tensor) -> tuple:
    """Returns: ``(shape, dtype name)`` of ``t``, as the ranks exchange it to check their calls."""
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


def _agree_on(comm, kind: str, what: str, fields: tuple, problem: Optional[str]) -> list[tuple]:
    """Exchange every rank's call; raise on every rank alike if one rank's own arguments were bad.

    Args:
        comm: the communicator; ``kind``: the collective; ``what``: the call, for messages.
        fields: what the ranks must agree on (after the kind and host).
        problem: what is wrong with this rank's own arguments, or None.

    Returns:
        Every rank's description, ``(kind, host, *fields, problem)``.

    Raises:
        InvalidCallError: a rank rejected its own arguments.
        CollectiveMismatchError: the ranks called different collectives.
        HorovodInternalError: a rank has joined.
    """
    descriptions = coordination.agree(comm, coordination.describe(kind, *fields, problem), need_descriptions=True)
    coordination.check_same_kind(descriptions, comm.rank)
    for r, d in enumerate(descriptions):
        if d[-1] is not None:
            raise InvalidCallError(f"{what}: rank {r} ({d[1]}) rejected its arguments: {d[-1]}; "
                                   f"rank {comm.rank} stops too")
    return descriptions


def _mismatch(what: str, field: str, values: list, rank: int, fix: str) -> CollectiveMismatchError:
    """The error naming each rank's ``field`` (``values``, in rank order) and the ``fix``."""
    listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return CollectiveMismatchError(f"{what}: the ranks' {field} differ: {listing}. {fix}; rank {rank} stops")


def _completed_handle(kind: str, name: Optional[str], result, nbytes: int, start: float, process_set) -> int:
    """The handle of a collective that has run already (and recorded itself in the timeline),
    whose ``synchronize`` returns ``result``."""
    return handles.submit(kind, name, None, lambda: result, nbytes, process_set.process_set_id, start,
                          in_timeline=False)


def _record_finished(kind: str, name: Optional[str], tensor, start: float, process_set) -> None:
    """Add a collective that began at ``start`` and has just ended to the timeline."""
    nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
    timeline.record(kind, name or f"{kind}.noname", nbytes, start, time.time(),
                    getattr(process_set, "process_set_id", 0))


# ----------------------------------------------------------------------------- allreduce
def _local_problem(tensors: Sequence, what: str) -> Optional[str]:
    """What is wrong with this rank's own tensors (sent to the others, so that all raise).

    Args:
        tensors: the call's tensors; ``what``: the call, for the message.

    Returns:
        The problem in words, or None.
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return f"{what} takes tensors, not {type(t).__name__}"
        if t.dtype == torch.bool or t.is_complex() or t.dtype not in (
                torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"{what}: tensors of {t.dtype} cannot be reduced; convert them (t.to(torch.int32), t.float())"
        if t.is_sparse:
            return f"{what} reduces dense tensors; use hvd.sparse_allreduce_async for sparse ones"
    return None


def _check_descriptions(descriptions: list[tuple], what: str, rank: int) -> None:
    """Raise on every rank alike unless every rank that has not joined reduces the same layouts with the same op.

    Args:
        descriptions: every rank's call, from ``coordination.agree``.
        what: the call, for the message; ``rank``: this rank.

    Raises:
        InvalidCallError: a rank rejected its own arguments.
        CollectiveMismatchError: the ranks' ops, factors, shapes or dtypes differ.
    """
    coordination.check_same_kind(descriptions, rank)
    calls = [(r, d) for r, d in enumerate(descriptions) if d[0] != coordination.JOINED]
    for r, d in calls:
        if d[7] is not None:
            raise InvalidCallError(f"{what}: rank {r} ({d[1]}) rejected its arguments: {d[7]}; "
                                   f"rank {rank} stops too")
    for field, index in (("op", 3), ("prescale_factor", 4), ("postscale_factor", 5), ("tensors' shapes and dtypes", 6)):
        if len({repr(d[index]) for _, d in calls}) > 1:
            def show(value):
                return OP_NAMES.get(value, value) if index == 3 else value
            listing = "; ".join(f"rank {r} ({d[1]}): {show(d[index])}" for r, d in calls)
            raise CollectiveMismatchError(
                f"{what}: the ranks' {field} differ: {listing}. Every rank must reduce tensors of the same shape "
                f"and dtype with the same op (Horovod would hang or abort here); rank {rank} stops")


class _Works:
    """The network parts of one call (one per dtype), waited as one."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def network_done(self) -> bool:
        return all(handles.work_done(w) for w in self.works)


def _start_reduce(comm, tensors: list[torch.Tensor], op: int, prescale: float, postscale: float,
                  outputs: Optional[list[torch.Tensor]]):
    """Start reducing ``tensors`` over ``comm``.

    Args:
        comm: the communicator; ``tensors``: this rank's tensors; ``op``: a Horovod op.
        prescale, postscale: the factors before and after the reduction.
        outputs: tensors to write the results into (in-place forms), or None for new ones.

    Returns:
        ``(work, finish)``: the network part in flight, and a function that returns the results
        (``outputs`` filled in, or new tensors) once it is done.
    """
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(_WIDER.get(t.dtype, t.dtype), []).append(i)
    buffers, works = {}, []
    for dtype, members in groups.items():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(comm.device, dtype) for i in members]) \
            if len(members) > 1 else tensors[members[0]].detach().reshape(-1).to(comm.device, dtype, copy=True)
        if prescale != 1.0:
            _scale(flat, prescale)
        works.append(comm.allreduce_flat(flat, async_op=True, op=_REDUCE[op]))
        buffers[dtype] = (flat, members)

    def finish():
        results = [None] * len(tensors)
        for flat, members in buffers.values():
            if op == Average:
                if flat.is_floating_point():
                    flat.div_(comm.size)
                else:
                    flat.floor_divide_(comm.size)  # Horovod's integer average
            if postscale != 1.0:
                _scale(flat, postscale)
            offset = 0
            for i in members:
                t = tensors[i]
                part = flat[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()
                if outputs is not None:
                    outputs[i].copy_(part)
                    results[i] = outputs[i]
                else:
                    results[i] = part.to(t.device, t.dtype)
        return results
    return _Works(works), finish


def _mirror_allreduce(description: tuple, comm) -> None:
    """A joined rank's part in an allreduce: zeros of the shapes the others reduce."""
    _, host, _, op, prescale, postscale, layouts, problem = description
    if problem is not None:
        raise InvalidCallError(f"hvd.allreduce: rank {comm.rank} has joined; another rank ({host}) rejected its "
                               f"arguments: {problem}")
    zeros = [torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in layouts]
    work, finish = _start_reduce(comm, zeros, op, prescale, postscale, None)
    work.wait()
    finish()


coordination.register_mirror("allreduce", _mirror_allreduce)


def _start_allreduce(tensors: list[torch.Tensor], outputs: Optional[list[torch.Tensor]], name: Optional[str],
                     op: int, prescale: float, postscale: float, process_set, what: str, grouped: bool = True) -> int:
    """Check, agree and start a (grouped) allreduce: what every allreduce form calls.

    Args:
        tensors, outputs: as :func:`_start_reduce`; ``name``, ``op``, ``prescale``, ``postscale``,
            ``process_set``: the call's arguments; ``what``: the call, for messages.
        grouped: the handle's result is the list of results (else the one result).

    Returns:
        The handle.
    """
    comm = comm_of(process_set, what)
    _check_op(op, what)
    handles.check_name("allreduce", name)
    problem = _local_problem(tensors, what)
    layouts = None if problem else [_layout(t) for t in tensors]
    description = coordination.describe("allreduce", name, op, float(prescale), float(postscale), layouts, problem)
    descriptions = coordination.agree(comm, description, need_descriptions=True)
    _check_descriptions(descriptions, what, comm.rank)
    work, finish_all = _start_reduce(comm, tensors, op, float(prescale), float(postscale), outputs)
    finish = finish_all if grouped else (lambda: finish_all()[0])
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return handles.submit("allreduce", name, work, finish, nbytes, process_set.process_set_id)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing ``tensor`` over the ranks; ``tensor`` is not changed.

    Args:
        tensor: the same shape and dtype on every rank.
        average: deprecated (``op`` instead).
        name: the collective's name (in the timeline; one name is one collective in flight).
        op: ``hvd.Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        prescale_factor: multiply each rank's tensor by this before the reduction.
        postscale_factor: multiply the result by this after it.
        process_set: the ranks taking part (default: all).

    Returns:
        A handle for :func:`~torchmn.horovod.synchronize` / :func:`~torchmn.horovod.poll`.

    Raises:
        InvalidCallError: before ``hvd.init()``; a name already in flight; a rank outside
            ``process_set``; both ``op`` and ``average``.
        UnsupportedError: ``op=hvd.Adasum``.
        CollectiveMismatchError: the ranks' shapes, dtypes or ops differ (on every rank).

    Example::

        >>> h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)
        >>> hvd.synchronize(h)              # tensor([size, size, size])
    """
    op = handle_average_backwards_compatibility(op, average)
    return _start_allreduce([tensor], None, name, op, prescale_factor, postscale_factor, process_set,
                            "hvd.allreduce_async", grouped=False)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """:func:`allreduce_async` whose result is written into ``tensor`` (returned by ``synchronize``).

    Args:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set: as :func:`allreduce_async`.

    Returns:
        A handle.

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> hvd.synchronize(hvd.allreduce_async_(grad))
    """
    op = handle_average_backwards_compatibility(op, average)
    return _start_allreduce([tensor], [tensor], name, op, prescale_factor, postscale_factor, process_set,
                            "hvd.allreduce_async_", grouped=False)


class _Allreduce(torch.autograd.Function):
    """An allreduce whose gradient is the allreduce of the gradients, with the same op and factors."""

    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        handle = _start_allreduce(list(tensors), None, name, op, prescale, postscale, process_set, "hvd.allreduce")
        return tuple(handles.synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        handle = _start_allreduce([g.contiguous() for g in grads], None, None, op, prescale, postscale, process_set,
                                  "hvd.allreduce (backward)")
        return (None,) * 5 + tuple(handles.synchronize(handle))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and return the result; differentiable.

    Args:
        tensor: the same shape and dtype on every rank (not changed).
        compression: ``hvd.Compression.none`` or ``fp16`` (the tensor travels as float16).
        average, name, op, prescale_factor, postscale_factor, process_set: as :func:`allreduce_async`.

    Returns:
        A new tensor: the average (default) or other reduction over ranks.

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> mean_loss = hvd.allreduce(loss.detach(), name="loss")
    """
    op = handle_average_backwards_compatibility(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced, = _Allreduce.apply(name, op, prescale_factor, postscale_factor, process_set, compressed)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks in place.

    Args:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set: as :func:`allreduce_async`.

    Returns:
        ``tensor``, holding the result.

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> hvd.allreduce_(metric, op=hvd.Sum)
    """
    return handles.synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors as one fused collective.

    Args:
        tensors: the tensors; average, name, op, prescale_factor, postscale_factor, process_set:
            as :func:`allreduce_async`.

    Returns:
        A handle whose ``synchronize`` returns the list of results.

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> h = hvd.grouped_allreduce_async([a, b])
        >>> ra, rb = hvd.synchronize(h)
    """
    op = handle_average_backwards_compatibility(op, average)
    return _start_allreduce(list(tensors), None, name, op, prescale_factor, postscale_factor, process_set,
                            "hvd.grouped_allreduce_async")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """:func:`grouped_allreduce_async` writing each result into its tensor.

    Args:
        tensors, average, name, op, prescale_factor, postscale_factor, process_set: as
            :func:`grouped_allreduce_async`.

    Returns:
        A handle whose ``synchronize`` returns the tensors.

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> hvd.synchronize(hvd.grouped_allreduce_async_([a, b]))
    """
    op = handle_average_backwards_compatibility(op, average)
    tensors = list(tensors)
    return _start_allreduce(tensors, tensors, name, op, prescale_factor, postscale_factor, process_set,
                            "hvd.grouped_allreduce_async_")


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> list:
    """Reduce a list of tensors as one fused collective; differentiable.

    Args:
        tensors: the tensors; compression: as :func:`allreduce`; average, name, op,
            prescale_factor, postscale_factor, process_set: as :func:`allreduce_async`.

    Returns:
        The list of results, in order.

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> loss_sum, count = hvd.grouped_allreduce([loss_sum, count], op=hvd.Sum)
    """
    op = handle_average_backwards_compatibility(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _Allreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *[p[0] for p in pairs])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list:
    """Reduce a list of tensors in place, fused.

    Args:
        tensors, average, name, op, prescale_factor, postscale_factor, process_set: as
            :func:`grouped_allreduce_async`.

    Returns:
        The tensors, holding the results.

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> hvd.grouped_allreduce_([a, b], op=hvd.Sum)
    """
    return handles.synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                        postscale_factor, process_set))


# ----------------------------------------------------------------------------- allgather
def _allgather(tensor: torch.Tensor, name: Optional[str], process_set, what: str):
    """The concatenation over ranks of ``tensor`` along dim 0, and every rank's first dimension."""
    start = time.time()
    comm = comm_of(process_set, what)
    handles.check_name("allgather", name)
    problem = None if isinstance(tensor, torch.Tensor) else f"{what} takes a tensor, not {type(tensor).__name__}"
    shape_dtype = _layout(tensor) if problem is None else None
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
    _record_finished("allgather", name, tensor, start, process_set)
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
        InvalidCallError: before ``hvd.init()``; a name already in flight; a rank outside ``process_set``.
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

    Raises:
        As :func:`allgather`.

    Example::

        >>> hvd.synchronize(hvd.allgather_async(x))
    """
    start = time.time()
    out, _ = _allgather(tensor, name, process_set, "hvd.allgather_async")
    return _completed_handle("allgather", name, out, out.numel() * out.element_size(), start, process_set)


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
    """:func:`grouped_allgather`, returning a handle (complete at once).

    Args:
        tensors, name, process_set: as :func:`grouped_allgather`.

    Returns:
        A handle whose ``synchronize`` returns the list.

    Raises:
        As :func:`allgather`.

    Example::

        >>> a, b = hvd.synchronize(hvd.grouped_allgather_async([a, b]))
    """
    start = time.time()
    outs = [_allgather(t, f"{name}.{i}" if name else None, process_set, "hvd.grouped_allgather_async")[0]
            for i, t in enumerate(tensors)]
    nbytes = sum(o.numel() * o.element_size() for o in outs)
    return _completed_handle("allgather", name, outs, nbytes, start, process_set)


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
    shape_dtype = None if problem else _layout(tensor)
    descriptions = _agree_on(comm, "broadcast", what, (name, root_rank, shape_dtype), problem)
    roots = [d[3] for d in descriptions]
    if len(set(roots)) > 1:
        raise _mismatch(what, "root ranks", roots, comm.rank, "Every rank must name the same root_rank")
    layouts = [d[4] for d in descriptions]
    if len(set(layouts)) > 1:
        raise _mismatch(what, "tensors' shapes and dtypes", layouts, comm.rank,
                        "Every rank must pass a tensor of the root's shape and dtype")
    out = comm.bcast(tensor.detach().to(comm.device), root=ranks.index(root_rank)).to(tensor.device)
    _record_finished("broadcast", name, tensor, start, process_set)
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
    with torch.no_grad():
        return tensor.copy_(_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_"))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """:func:`broadcast`, returning a handle (complete at once).

    Args:
        tensor, root_rank, name, process_set: as :func:`broadcast`.

    Returns:
        A handle whose ``synchronize`` returns root's tensor.

    Raises:
        As :func:`broadcast`.

    Example::

        >>> w = hvd.synchronize(hvd.broadcast_async(w, 0))
    """
    start = time.time()
    out = _broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_async")
    return _completed_handle("broadcast", name, out, out.numel() * out.element_size(), start, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """:func:`broadcast_`, returning a handle (complete at once).

    Args:
        tensor, root_rank, name, process_set: as :func:`broadcast`.

    Returns:
        A handle whose ``synchronize`` returns ``tensor``.

    Raises:
        As :func:`broadcast`.

    Example::

        >>> hvd.synchronize(hvd.broadcast_async_(w, 0))
    """
    start = time.time()
    with torch.no_grad():
        tensor.copy_(_broadcast(tensor, root_rank, name, process_set, "hvd.broadcast_async_"))
    return _completed_handle("broadcast", name, tensor, tensor.numel() * tensor.element_size(), start, process_set)


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
    if sum(splits) != rows:
        return None, f"splits sum to {sum(splits)}, not the tensor's first dimension {rows}"
    return splits, None


def _alltoall(tensor, splits, name, process_set, what: str):
    start = time.time()
    comm = comm_of(process_set, what)
    handles.check_name("alltoall", name)
    sizes, problem = _split_sizes(tensor, splits, comm.size)
    trailing = None if problem else (tuple(tensor.shape[1:]), _layout(tensor)[1])
    descriptions = _agree_on(comm, "alltoall", what, (name, trailing), problem)
    if len({d[3] for d in descriptions}) > 1:
        raise _mismatch(what, "dimensions after the first, and dtypes", [d[3] for d in descriptions], comm.rank,
                        "Only the first dimension may differ between ranks")
    got = comm.alltoall(list(tensor.detach().to(comm.device).split(sizes)))
    received = torch.tensor([g.shape[0] for g in got], dtype=torch.int32)
    _record_finished("alltoall", name, tensor, start, process_set)
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
        InvalidCallError: ``splits`` do not fit the tensor or the ranks (on every rank); before
            ``hvd.init()``; a name already in flight; a rank outside ``process_set``.
        CollectiveMismatchError: the dimensions after the first, or the dtypes, differ (on every rank).

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

    Raises:
        As :func:`alltoall`.

    Example::

        >>> out = hvd.synchronize(hvd.alltoall_async(x))
    """
    start = time.time()
    out, received = _alltoall(tensor, splits, name, process_set, "hvd.alltoall_async")
    result = (out, received) if splits is not None else out
    return _completed_handle("alltoall", name, result, out.numel() * out.element_size(), start, process_set)


# ----------------------------------------------------------------------------- reducescatter
def _rows_per_rank(rows: int, size: int) -> list[int]:
    """Horovod's split of the first dimension: equal parts, the first ranks one row more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _reducescatter(tensor, op, name, process_set, prescale, postscale, what: str) -> torch.Tensor:
    began = time.time()
    comm = comm_of(process_set, what)
    if op not in (Average, Sum):
        _check_op(op, what)
        raise UnsupportedError(f"{what}: op={OP_NAMES.get(op, op)} is not supported; reducescatter takes "
                               f"hvd.Average (the default) or hvd.Sum")
    handles.check_name("reducescatter", name)
    problem = None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        problem = f"{what} takes a tensor of at least one dimension"
    shape_dtype = None if problem else _layout(tensor)
    descriptions = _agree_on(comm, "reducescatter", what, (name, op, float(prescale), float(postscale), shape_dtype),
                             problem)
    for field, index in (("ops", 3), ("prescale factors", 4), ("postscale factors", 5),
                         ("tensors' shapes and dtypes", 6)):
        values = [d[index] for d in descriptions]
        if len({repr(v) for v in values}) > 1:
            raise _mismatch(what, field, values, comm.rank,
                            "Every rank must pass the same op, factors, shape and dtype")
    counts = _rows_per_rank(tensor.shape[0], comm.size)
    most = max(counts)
    wire = _WIDER.get(tensor.dtype, tensor.dtype)
    src = tensor.detach().to(comm.device, wire)
    padded = torch.zeros((comm.size * most,) + tuple(tensor.shape[1:]), dtype=wire, device=comm.device)
    start = 0
    for r, n in enumerate(counts):
        padded[r * most:r * most + n] = src[start:start + n]
        start += n
    if prescale != 1.0:
        _scale(padded, prescale)
    shard = torch.empty((most,) + tuple(tensor.shape[1:]), dtype=wire, device=comm.device)
    comm.reduce_scatter_flat(padded.view(-1), shard.view(-1), async_op=True).wait()
    out = shard[:counts[comm.rank]]
    if op == Average:
        out = out.div_(comm.size) if out.is_floating_point() else out.floor_divide_(comm.size)
    if postscale != 1.0:
        _scale(out, postscale)
    _record_finished("reducescatter", name, tensor, began, process_set)
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
        InvalidCallError: before ``hvd.init()``; a name already in flight; a rank outside ``process_set``.
        UnsupportedError: another op.
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

    Raises:
        As :func:`reducescatter`.

    Example::

        >>> mine = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum))
    """
    start = time.time()
    out = _reducescatter(tensor, op, name, process_set, prescale_factor, postscale_factor, "hvd.reducescatter_async")
    return _completed_handle("reducescatter", name, out, tensor.numel() * tensor.element_size(), start, process_set)


def grouped_reducescatter(tensors, op=Average, name=None, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """:func:`reducescatter` of each tensor of a list; returns the list of results.

    Args:
        tensors: the tensors; op, name, process_set, prescale_factor, postscale_factor: as
            :func:`reducescatter`.

    Returns:
        This rank's rows of each reduction, in order.

    Raises:
        As :func:`reducescatter`.

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

    Raises:
        As :func:`reducescatter`.

    Example::

        >>> a, b = hvd.synchronize(hvd.grouped_reducescatter_async([a, b]))
    """
    start = time.time()
    outs = [_reducescatter(t, op, f"{name}.{i}" if name else None, process_set, prescale_factor, postscale_factor,
                           "hvd.grouped_reducescatter_async") for i, t in enumerate(tensors)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return _completed_handle("reducescatter", name, outs, nbytes, start, process_set)


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
    indices = allgather_async(t.indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t.values(), name=f"{name}.values", process_set=process_set)
    size = comm_of(process_set, "hvd.sparse_allreduce_async").size

    def result():
        v = handles.synchronize(values)
        i = handles.synchronize(indices)
        if op == Average:
            v = v / size
        return torch.sparse_coo_tensor(i.transpose(0, 1), v, t.size())
    return result
