"""Differentiable collectives: the backward of each is the collective that carries the gradients
back (``allreduce`` <-> ``allreduce``, ``bcast`` <-> sum at the root, ``gather`` <-> ``scatter``,
``allgather`` <-> reduce-scatter, ``alltoall`` <-> ``alltoall``).

Every rank runs the backward collective, so every rank must backpropagate through the output: a
rank whose loss does not use it skips that collective, and the others' backward collective then
meets its next call, which the call check refuses on every rank (a backward pass's collectives are
marked as such: :func:`torchmn.communicators.backward_pass`), or waits until the timeout names it. A
rank with no input of its own (a receiver of ``bcast`` or ``scatter``) still joins the graph.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from torchmn.communicators import CommunicatorBase, backward_pass
from torchmn.errors import TorchmnTypeError
from torchmn.functions._graph_utility import anchor, delegate


def _own(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A collective's result for this rank's own input, as an output of its own (never the input)."""
    return y.clone() if y is x else y.to(x.device)


class _Bcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, root, anchor_, x):
        ctx.comm, ctx.root = comm, root
        if comm.rank == root:
            return _own(comm.bcast(x, root), x)
        return comm.bcast(None, root)  # on root's kind of device: CPU, or this rank's GPU

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, gy):
        parts = ctx.comm.gather(gy.contiguous(), ctx.root)
        if ctx.comm.rank != ctx.root:
            return None, None, None, None
        return None, None, None, torch.stack([p.to(gy.device) for p in parts]).sum(0)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, root, anchor_, x):
        ctx.comm, ctx.root, ctx.device = comm, root, x.device
        ys = comm.gather(x, root)
        if comm.rank != root:
            return (delegate(x.device),)
        return tuple(_own(y, x) if r == comm.rank else y.to(x.device) for r, y in enumerate(ys))

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, *gys):
        if ctx.comm.rank == ctx.root:
            gx = ctx.comm.scatter([g.contiguous() for g in gys], ctx.root)
        else:
            gx = ctx.comm.scatter(None, ctx.root)
        return None, None, None, gx.to(ctx.device)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, root, anchor_, *xs):
        ctx.comm, ctx.root = comm, root
        if comm.rank != root:
            return comm.scatter(None, root)  # on root's kind of device, as bcast
        y = comm.scatter(xs, root)
        return _own(y, xs[root])

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, gy):
        parts = ctx.comm.gather(gy.contiguous(), ctx.root)
        if ctx.comm.rank != ctx.root:
            return None, None, None
        return (None, None, None, *[p.to(gy.device) for p in parts])


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, anchor_, x):
        ctx.comm, ctx.device = comm, x.device
        ys = comm.allgather(x)
        return tuple(_own(y, x) if r == comm.rank else y.to(x.device) for r, y in enumerate(ys))

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, *gys):
        # Rank r's gradient of ys[i] goes to rank i, which sums what it gets: a reduce-scatter.
        parts = ctx.comm.alltoall([g.contiguous() for g in gys])
        return None, None, torch.stack([p.to(ctx.device) for p in parts]).sum(0)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, anchor_, *xs):
        ctx.comm, ctx.devices = comm, [x.device for x in xs]
        ys = comm.alltoall(xs)
        return tuple(_own(y, xs[r]) if r == comm.rank else y.to(xs[r].device) for r, y in enumerate(ys))

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, *gys):
        gxs = ctx.comm.alltoall([g.contiguous() for g in gys])
        return (None, None, *[g.to(d) for g, d in zip(gxs, ctx.devices)])


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, anchor_, x):
        ctx.comm = comm
        return comm.allreduce(x)

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, gy):
        return None, None, ctx.comm.allreduce(gy.contiguous())


def allreduce(comm: CommunicatorBase, x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``x`` on every rank; in backward, the sum of every rank's gradient.

    The objective being the sum of the ranks' losses, each rank's ``x`` influences every rank's
    result, so its gradient is the sum of theirs (where every rank computes the same loss from the
    result, that is ``size`` times one loss's: the multi-node optimizer's average undoes it).

    Args:
        comm: the communicator.
        x: this rank's tensor; every rank's has the same shape and dtype.

    Returns:
        The sum, part of the graph.

    Raises:
        CollectiveMismatchError: the ranks' shapes or dtypes differ.

    Example::

        >>> stats = torchmn.functions.allreduce(comm, torch.stack([x.sum(0), (x * x).sum(0)]))
    """
    return _AllReduce.apply(comm, anchor(x.device), x)


def bcast(comm: CommunicatorBase, x: Optional[torch.Tensor], root: int = 0) -> torch.Tensor:
    """Root's ``x`` on every rank; in backward, the ranks' gradients are summed at the root.

    Args:
        comm: the communicator.
        x: root's tensor; ignored elsewhere (pass None).
        root: the sending rank.

    Returns:
        Root's tensor, part of the graph on every rank.

    Raises:
        CollectiveMismatchError: the ranks passed different roots or made another call.

    Example::

        >>> w = torchmn.functions.bcast(comm, w0 if comm.rank == 0 else None)
    """
    comm.check_rank(root, "root")
    if comm.rank == root:
        if not isinstance(x, torch.Tensor):
            raise TorchmnTypeError(f"bcast: root rank {root} must pass a tensor, not {type(x).__name__}")
        return _Bcast.apply(comm, root, anchor(x.device), x)
    return _Bcast.apply(comm, root, anchor(torch.device("cpu")), None)


def gather(comm: CommunicatorBase, x: torch.Tensor, root: int = 0):
    """Every rank's ``x`` on ``root``; in backward, root's gradients are scattered back.

    Args:
        comm: the communicator.
        x: this rank's tensor (shapes may differ between ranks).
        root: the receiving rank.

    Returns:
        On root, a tuple of ``size`` tensors; elsewhere a delegate, whose ``backward()`` receives
        this rank's gradient (pass it to :func:`pseudo_connect` if the rank computes on).

    Raises:
        CollectiveMismatchError: the ranks passed different roots or dtypes.

    Example::

        >>> ys = torchmn.functions.gather(comm, h)
        >>> (sum(y.sum() for y in ys) if comm.rank == 0 else ys).backward()
    """
    comm.check_rank(root, "root")
    out = _Gather.apply(comm, root, anchor(x.device), x)
    return out if comm.rank == root else out[0]


def scatter(comm: CommunicatorBase, xs: Optional[Sequence[torch.Tensor]], root: int = 0) -> torch.Tensor:
    """Rank ``i`` gets root's ``xs[i]``; in backward, the gradients are gathered to the root.

    Args:
        comm: the communicator.
        xs: on root, ``size`` tensors; None elsewhere.
        root: the sending rank.

    Returns:
        This rank's tensor, part of the graph.

    Raises:
        ValueError: root did not pass ``size`` tensors.
        CollectiveMismatchError: the ranks passed different roots.

    Example::

        >>> mine = torchmn.functions.scatter(comm, list(x.chunk(comm.size)) if comm.rank == 0 else None)
    """
    comm.check_rank(root, "root")
    if comm.rank != root:
        return _Scatter.apply(comm, root, anchor(torch.device("cpu")))
    if xs is None or len(xs) != comm.size:
        comm.scatter(xs, root)  # which refuses them, on every rank (the others are told instead of waiting)
    return _Scatter.apply(comm, root, anchor(xs[root].device), *xs)


def allgather(comm: CommunicatorBase, x: torch.Tensor) -> tuple:
    """Every rank's ``x`` on every rank; in backward, a reduce-scatter of the output gradients.

    Args:
        comm: the communicator.
        x: this rank's tensor (first dimensions may differ between ranks).

    Returns:
        A tuple of ``size`` tensors, part of the graph.

    Raises:
        CollectiveMismatchError: the ranks' dtypes differ.

    Example::

        >>> hs = torchmn.functions.allgather(comm, h)
        >>> y = torch.cat(hs)                  # each rank's gradient of its h arrives in backward
    """
    return _AllGather.apply(comm, anchor(x.device), x)


def alltoall(comm: CommunicatorBase, xs: Sequence[torch.Tensor]) -> tuple:
    """Rank ``i`` sends ``xs[j]`` to rank ``j``; in backward, the gradients go back the same way.

    Args:
        comm: the communicator.
        xs: ``size`` tensors of one dtype (shapes may differ).

    Returns:
        A tuple of ``size`` tensors: element ``j`` came from rank ``j``.

    Raises:
        ValueError: ``xs`` is not ``size`` tensors.
        CollectiveMismatchError: the tensors' dtypes differ.

    Example::

        >>> ys = torchmn.functions.alltoall(comm, list(x.chunk(comm.size, dim=1)))
    """
    if xs is None or len(xs) != comm.size:
        comm.alltoall(xs)  # which refuses them, on every rank (the others are told instead of waiting)
    return _AllToAll.apply(comm, anchor(xs[0].device), *xs)
