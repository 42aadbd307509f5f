"""A parameter's elements in the order its memory holds them, for the optimizers' flat buffers.

The optimizers keep parameters, gradients and state in flat buffers, one run of elements per
parameter. A parameter in another memory format than the default (``channels_last`` for a
convolution) keeps that format when its run holds its elements in the parameter's own memory
order: the views of the run are then shaped with the parameter's strides, so that the model's
parameters, the gradients autograd makes for them and the optimizer's state all keep the layout
the script chose, as in one process (DDP's bucket views do the same).
"""
from __future__ import annotations

import torch


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory, without gaps or overlaps, in some order of
    its dimensions (contiguous, ``channels_last`` and any permutation of them).

    Args:
        t: the tensor.

    Returns:
        True where the strides are those of a contiguous tensor with its dimensions reordered.

    Example::

        >>> is_dense(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
        True
        >>> is_dense(torch.zeros(4, 4)[:, :2])
        False
    """
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) == 1:  # any stride will do
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def own_order(t: torch.Tensor) -> tuple | None:
    """The strides that set ``t``'s memory order where it is not the default one, else None (also
    for a layout with gaps, which the flat buffers store in the default order).

    Args:
        t: a parameter.

    Returns:
        ``t.stride()`` where :func:`shaped` and :func:`elements` follow ``t``'s own order, else None.

    Example::

        >>> own_order(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
        (60, 1, 15, 3)
        >>> own_order(torch.zeros(2, 3)) is None
        True
    """
    return tuple(t.stride()) if not t.is_contiguous() and is_dense(t) else None


def shaped(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A one-dimensional run of ``like.numel()`` elements seen with ``like``'s shape and memory order.

    Args:
        flat: a contiguous one-dimensional tensor of ``like.numel()`` elements.
        like: the parameter whose shape and layout the view takes (a layout with gaps falls back
            to the default one).

    Returns:
        A view of ``flat``.

    Example::

        >>> w = torch.zeros(8, 3, 3, 3).to(memory_format=torch.channels_last)
        >>> shaped(torch.zeros(w.numel()), w).is_contiguous(memory_format=torch.channels_last)
        True
    """
    if own_order(like) is not None:
        return flat.as_strided(like.shape, like.stride())
    return flat.view(like.shape)


def elements(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as one dimension, in the memory order of ``like`` (the order :func:`shaped`
    lays them out in): a view where ``t`` has ``like``'s layout, else a copy.

    Args:
        t: a tensor of ``like``'s shape (a gradient, a state tensor, the parameter itself).
        like: the parameter that sets the order.

    Returns:
        A one-dimensional tensor of ``t.numel()`` elements.

    Example::

        >>> w = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
        >>> torch.equal(shaped(elements(w, w), w), w)
        True
    """
    if own_order(like) is None:
        return t.reshape(-1)
    if t.stride() != like.stride():
        t = torch.empty_like(like, dtype=t.dtype).copy_(t)
    return t.as_strided((t.numel(),), (1,))
