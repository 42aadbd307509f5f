"""``hvd.allreduce`` and its forms: asynchronous, in place, grouped, differentiable.

Every form runs on the background thread (:mod:`~torchmn.horovod.background`), on the process
set's tensor communicator: it checks, on every rank, that the ranks that have not joined reduce
tensors of the same shapes, dtypes and device types with the same op and factors (the error names
each rank and its shape, which Horovod's "Mismatched allreduce tensor shapes" does not), then runs one communicator ``allreduce_flat`` per
dtype of the call (a grouped call is fused) and the local part (Average's division, the scale
factors, the copy out). The ``_async`` forms return while it is in flight. A rank in ``hvd.join()``
takes part with zeros.

An allreduce's gradient is the allreduce of the output gradients with the same op and factors.
The other collectives, which may use an allreduce for their gradients, are in
:mod:`~torchmn.horovod.exchange_collectives`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from torchmn.communicators import CollectiveMismatchError
from torchmn.horovod import coordination, handles
from torchmn.horovod.checked_calls import layout, nbytes
from torchmn.horovod.compression import Compression
from torchmn.horovod.errors import InvalidCallError
from torchmn.horovod.process_sets import global_process_set, tensor_comm_of
from torchmn.horovod.reduction_ops import (OP_NAMES, REDUCE, WIDER, Average, check_op,
                                           handle_average_backwards_compatibility, scale)

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
        CollectiveMismatchError: the ranks' ops, factors, shapes, dtypes or devices differ.
    """
    coordination.check_same_kind(descriptions, rank)
    calls = [(r, d) for r, d in enumerate(descriptions) if d[0] != coordination.JOINED]
    for r, d in calls:
        if d[7] is not None:
            raise InvalidCallError(f"{what}: rank {r} ({d[1]}) rejected its arguments: {d[7]}; "
                                   f"rank {rank} stops too")
    for field, index in (("op", 3), ("prescale_factor", 4), ("postscale_factor", 5),
                         ("tensors' shapes, dtypes and devices", 6)):
        if len({repr(d[index]) for _, d in calls}) > 1:
            def show(value):
                return OP_NAMES.get(value, value) if index == 3 else value
            listing = "; ".join(f"rank {r} ({d[1]}): {show(d[index])}" for r, d in calls)
            raise CollectiveMismatchError(
                f"{what}: the ranks' {field} differ: {listing}. Every rank must reduce tensors of the same shape, "
                f"dtype and device type with the same op; rank {rank} stops")


def _reduce(comm, tensors: list[torch.Tensor], op: int, prescale: float, postscale: float,
            outputs: Optional[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Reduce ``tensors`` over ``comm``.

    Args:
        comm: the communicator; ``tensors``: this rank's tensors; ``op``: a Horovod op.
        prescale, postscale: the factors before and after the reduction.
        outputs: tensors to write the results into (in-place forms), or None for new ones.

    Returns:
        The results: ``outputs`` filled in, or new tensors.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):  # each tensor goes its device's way: CPU ones on the CPU
        groups.setdefault((WIDER.get(t.dtype, t.dtype), comm.wire_device(t)), []).append(i)
    buffers, works = {}, []
    for (dtype, device), members in groups.items():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(device, dtype) for i in members]) \
            if len(members) > 1 else tensors[members[0]].detach().reshape(-1).to(device, dtype, copy=True)
        if prescale != 1.0:
            scale(flat, prescale)
        works.append(comm.allreduce_flat(flat, async_op=True, op=REDUCE[op]))
        buffers[dtype, device] = (flat, members)

    for w in works:
        w.wait()

    def finish():
        results = [None] * len(tensors)
        for flat, members in buffers.values():
            if op == Average and not flat.is_floating_point():
                # Horovod's core: integers scaled once by postscale / size in float64, truncated
                scale(flat, postscale / comm.size)
            else:
                if op == Average:
                    flat.div_(comm.size)
                if postscale != 1.0:
                    scale(flat, postscale)
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
    with torch.no_grad():  # grad mode is the background thread's own: off for in-place outputs
        return finish()


def _mirror_allreduce(description: tuple, comm) -> None:
    """A joined rank's part in an allreduce: zeros of the shapes the others reduce."""
    _, host, _, op, prescale, postscale, layouts, problem = description
    if problem is not None:
        return  # that rank rejected its own arguments: the ranks that called raise, this one goes on waiting
    # On the device the others reduce on: CUDA tensors travel through NCCL, CPU ones through gloo.
    zeros = [torch.zeros(shape, dtype=getattr(torch, dtype), device=comm.device if device == "cuda" else "cpu")
             for shape, dtype, device in layouts]
    _reduce(comm, zeros, op, prescale, postscale, None)


coordination.register_mirror("allreduce", _mirror_allreduce)


def _start_allreduce(tensors: list[torch.Tensor], outputs: Optional[list[torch.Tensor]], name: Optional[str],
                     op: int, prescale: float, postscale: float, process_set, what: str, grouped: bool = True,
                     wait: bool = False):
    """Start a (grouped) allreduce on the background thread: what every allreduce form calls.

    Args:
        tensors, outputs: as :func:`_reduce`; ``name``, ``op``, ``prescale``, ``postscale``,
            ``process_set``: the call's arguments; ``what``: the call, for messages.
        grouped: the handle's result is the list of results (else the one result).
        wait: run it now and return its result instead of a handle (``handles.run_now``).

    Returns:
        The handle.
    """
    comm = tensor_comm_of(process_set, what)
    check_op(op, what)
    problem = _local_problem(tensors, what)
    # The device type too: a joined rank mirrors the call on it, and ranks reducing on different
    # devices (through different backends) are told instead of left waiting for each other.
    layouts = None if problem else [(*layout(t), t.device.type) for t in tensors]
    description = coordination.describe_call("allreduce", name, op, float(prescale), float(postscale), layouts, problem)

    def work():
        descriptions = coordination.agree(comm, description, need_descriptions=True)
        _check_descriptions(descriptions, what, comm.rank)
        results = _reduce(comm, tensors, op, float(prescale), float(postscale), outputs)
        return tuple(results) if grouped else results[0]  # a tuple, as Horovod's grouped calls return
    return (handles.run_now if wait else handles.submit)("allreduce", name, comm, work, nbytes(tensors),
                                                         process_set.process_set_id)


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
        return tuple(_start_allreduce(list(tensors), None, name, op, prescale, postscale, process_set, "hvd.allreduce",
                                      wait=True))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        return (None,) * 5 + tuple(_start_allreduce([g.contiguous() for g in grads], None, None, op, prescale,
                                                    postscale, process_set, "hvd.allreduce (backward)", wait=True))


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
    op = handle_average_backwards_compatibility(op, average)
    return _start_allreduce([tensor], [tensor], name, op, prescale_factor, postscale_factor, process_set,
                            "hvd.allreduce_", grouped=False, wait=True)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors as one fused collective.

    Args:
        tensors: the tensors; average, name, op, prescale_factor, postscale_factor, process_set:
            as :func:`allreduce_async`.

    Returns:
        A handle whose ``synchronize`` returns the tuple of results (as Horovod's).

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
        A handle whose ``synchronize`` returns the tensors, as a tuple (as Horovod's).

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
        The tensors, holding the results, as a tuple (as Horovod's).

    Raises:
        As :func:`allreduce_async`.

    Example::

        >>> hvd.grouped_allreduce_([a, b], op=hvd.Sum)
    """
    op = handle_average_backwards_compatibility(op, average)
    return _start_allreduce(tensors, tensors, name, op, prescale_factor, postscale_factor, process_set,
                            "hvd.grouped_allreduce_", wait=True)
