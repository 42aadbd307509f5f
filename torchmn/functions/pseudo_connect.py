"""Tying a delegate variable to the next computation, so that one backward runs every part."""
from __future__ import annotations

from typing import Optional, Union

import torch

from torchmn.errors import TorchmnValueError
from torchmn.functions._graph_utility import differentiable


class _PseudoConnect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, delegate_variable, *xs):
        ctx.delegate = (delegate_variable.shape, delegate_variable.dtype, delegate_variable.device)
        # Detached aliases, not views: torch forbids in-place changes of a custom Function's view
        # outputs, and the next layer may well be a ReLU(inplace=True).
        outs = tuple(x.detach() for x in xs)
        ctx.mark_non_differentiable(*[o for o in outs if not differentiable(o)])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        shape, dtype, device = ctx.delegate
        # The delegate needs no gradient of its own; zeros make its backward (a send's) run.
        return (torch.zeros(shape, dtype=dtype, device=device), *grads)


def pseudo_connect(delegate_variable: Optional[torch.Tensor],
                   *actual_variables: torch.Tensor) -> Union[torch.Tensor, tuple]:
    """``actual_variables`` unchanged, but joined to ``delegate_variable`` in the graph.

    A rank whose model has several unconnected parts (it sends one part's output away, then
    computes on other data) must backpropagate into all of them, in order: the backward through
    the returned values reaches the delegate afterwards, which runs the earlier send's backward.

    Args:
        delegate_variable: the delegate of an earlier :func:`send` (None: nothing to tie).
        *actual_variables: the tensors the next computation uses.

    Returns:
        The tensor, or a tuple of them where several are given.

    Raises:
        ValueError: no actual variable is given.

    Example::

        >>> d = torchmn.functions.send(part0(x), comm, rank=1)
        >>> z = torchmn.functions.pseudo_connect(d, z)     # z: this rank's other data
        >>> loss_fn(part2(z), y).backward()                # also runs part0's backward, via d
    """
    if not actual_variables:
        raise TorchmnValueError("pseudo_connect: pass at least one actual variable after the delegate")
    if delegate_variable is None:
        return actual_variables[0] if len(actual_variables) == 1 else tuple(actual_variables)
    out = _PseudoConnect.apply(delegate_variable, *actual_variables)
    return out[0] if len(actual_variables) == 1 else out
