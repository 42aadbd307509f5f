"""Differentiable send and receive: the backward of a send receives the gradient from the peer,
the backward of a receive sends it back.

A message is a count (``-1`` for a single tensor, else the tuple's length) followed by each
tensor, with the communicator's own headers, so the receiver needs to know neither shapes nor
dtypes. Gradients travel back for the floating-point and complex tensors only, which both sides
tell from the dtypes alike; integer tensors (labels, indices) travel forward only.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch.autograd.function import once_differentiable

from torchmn.communicators import CommunicatorBase
from torchmn.errors import TorchmnTypeError, TorchmnValueError
from torchmn.functions._graph_utility import anchor, delegate, differentiable

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def send_tensors(comm: CommunicatorBase, x: Tensors, rank: int, tag: int = 0) -> None:
    """Send a tensor or a tuple of tensors to ``rank`` (no autograd): :func:`recv_tensors` receives it.

    Args:
        comm: the communicator.
        x: a tensor, or a tuple of tensors.
        rank: the receiving rank.
        tag: tells apart several messages between the same ranks.

    Example::

        >>> send_tensors(comm, (h, mask), rank=1)
    """
    single = isinstance(x, torch.Tensor)
    xs = (x,) if single else tuple(x)
    comm.send(torch.tensor([-1 if single else len(xs)]), rank, tag)
    for t in xs:
        comm.send(t.detach(), rank, tag)


def recv_tensors(comm: CommunicatorBase, rank: int, tag: int = 0) -> Tensors:
    """Receive what :func:`send_tensors` sent (no autograd).

    Args:
        comm: the communicator.
        rank: the sending rank.
        tag: the sender's tag.

    Returns:
        The tensor, or the tuple of tensors, on the communicator's device.

    Example::

        >>> h, mask = recv_tensors(comm, rank=0)
    """
    count = int(comm.recv(rank, tag).item())
    xs = tuple(comm.recv(rank, tag) for _ in range(1 if count == -1 else count))
    return xs[0] if count == -1 else xs


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, rank, tag, single, anchor_, *xs):
        ctx.comm, ctx.rank, ctx.tag = comm, rank, tag
        ctx.inputs = [(differentiable(x), x.device) for x in xs]
        send_tensors(comm, xs[0] if single else xs, rank, tag)
        return delegate(xs[0].device if xs else torch.device("cpu"))

    @staticmethod
    @once_differentiable
    def backward(ctx, _grad_delegate):
        grads = [ctx.comm.recv(ctx.rank, ctx.tag).to(device) if diff else None for diff, device in ctx.inputs]
        return (None, None, None, None, None, *grads)


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, rank, tag, count, anchor_):
        xs = [comm.recv(rank, tag) for _ in range(count)]
        ctx.comm, ctx.rank, ctx.tag = comm, rank, tag
        ctx.differentiable = [differentiable(x) for x in xs]
        ctx.mark_non_differentiable(*[x for x in xs if not differentiable(x)])
        ctx.anchor = (anchor_.shape, anchor_.dtype, anchor_.device)
        return tuple(xs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        for diff, g in zip(ctx.differentiable, grads):
            if diff:
                ctx.comm.send(g, ctx.rank, ctx.tag)
        shape, dtype, device = ctx.anchor
        # Zeros for the delegate or anchor: its own backward (a send's, receiving its gradient) runs next.
        return None, None, None, None, torch.zeros(shape, dtype=dtype, device=device)


def _check_comm(comm, usage: str) -> None:
    if not isinstance(comm, CommunicatorBase):
        raise TorchmnTypeError(f"{usage.split('(')[0]}: comm must be a communicator, not {type(comm).__name__}; "
                               f"the arguments go in ChainerMN's order: {usage}")


def send(x: Tensors, comm: CommunicatorBase, rank: int, tag: int = 0) -> torch.Tensor:
    """Send ``x`` to rank ``rank``, which calls :func:`recv`; its backward receives the gradient.

    Args:
        x: a tensor, or a tuple of tensors (the receiver gets a tuple).
        comm: the communicator.
        rank: the receiving rank.
        tag: tells apart several messages between the same ranks.

    Returns:
        The delegate: a scalar that carries the dependency on ``x``. Pass it to the next
        :func:`recv` or :func:`pseudo_connect` of this rank; where this send is the rank's last
        operation, ``delegate.backward()`` runs the rank's part of the backward (it waits for the
        gradient of ``x`` from ``rank``).

    Raises:
        TypeError: ``comm`` is not a communicator (the arguments in another order).
        ValueError: ``rank`` is not a rank of the communicator, or is this rank.
        CollectiveTimeoutError: the receiver did not receive (or send the gradient back) within
            the timeout.

    Example::

        >>> delegate = torchmn.functions.send(model_part(x), comm, rank=1)
        >>> delegate.backward()
    """
    _check_comm(comm, "send(x, comm, rank)")
    comm.check_rank(rank, "rank")
    if rank == comm.rank:
        raise TorchmnValueError(f"send: rank {rank} is this rank; pass the value on directly instead")
    single = isinstance(x, torch.Tensor)
    xs = (x,) if single else tuple(x)
    if not xs:
        raise TorchmnTypeError("send: x must be a tensor or a tuple of tensors, not an empty tuple")
    other = next((i for i, t in enumerate(xs) if not isinstance(t, torch.Tensor)), None)
    if other is not None:
        nested = " (tuples do not nest: send a flat tuple, e.g. an LSTM's (out, (h, c)) as (out, h, c))" \
            if isinstance(xs[other], (tuple, list)) else ""
        raise TorchmnTypeError(f"send: x must be a tensor or a tuple of tensors; element {other} is a "
                               f"{type(xs[other]).__name__}{nested}")
    device = xs[0].device
    return _Send.apply(comm, rank, tag, single, anchor(device), *xs)


def recv(comm: CommunicatorBase, rank: int, delegate_variable: Optional[torch.Tensor] = None,
         tag: int = 0) -> Tensors:
    """Receive what rank ``rank`` sent with :func:`send`; its backward sends the gradient back.

    Args:
        comm: the communicator.
        rank: the sending rank.
        delegate_variable: the delegate of this rank's previous :func:`send`, if any: the
            backward then runs that send's backward after this receive's, the order in which the
            peers wait for each other. A tensor that does not require grad is not followed.
        tag: the sender's tag.

    Returns:
        The tensor (or tuple of tensors, as sent), on the communicator's device, part of the graph.

    Raises:
        TypeError: ``comm`` is not a communicator (the arguments in another order).
        ValueError: ``rank`` is not a rank of the communicator, or is this rank.
        CollectiveTimeoutError: the sender did not send within the timeout.

    Example::

        >>> h = torchmn.functions.recv(comm, rank=0)
        >>> loss_fn(model_part(h), y).backward()
    """
    _check_comm(comm, "recv(comm, rank)")
    comm.check_rank(rank, "rank")
    if rank == comm.rank:
        raise TorchmnValueError(f"recv: rank {rank} is this rank; pass the value on directly instead")
    count = int(comm.recv(rank, tag).item())
    # The anchor only joins the graph: on the CPU, whichever way the tensors come. A delegate
    # outside the graph (integer labels, a frozen branch) cannot carry the received tensors into
    # it: they would get no backward, and the sender would wait for their gradient in vain.
    if delegate_variable is not None and delegate_variable.requires_grad:
        start = delegate_variable
    else:
        start = anchor(torch.device("cpu"))
    out = _Recv.apply(comm, rank, tag, 1 if count == -1 else count, start)
    return out[0] if count == -1 else out
