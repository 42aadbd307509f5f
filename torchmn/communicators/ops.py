"""The reductions collectives take by name, and how a mean over ranks avoids overflow."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# A mean is a sum divided afterwards: gloo has no AVG.
OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def divide_before_sum(dtype: torch.dtype) -> bool:
    """Whether a mean over ranks divides each rank's values before the sum, not the sum after it.

    In float16 and bfloat16 the sum of a few ranks' large values overflows (65504 is float16's
    largest), so those are divided first; every other dtype is summed first, which rounds less.

    Args:
        dtype: the dtype of the tensors being averaged.

    Returns:
        True for float16 and bfloat16, False otherwise.

    Example::

        >>> divide_before_sum(torch.float16), divide_before_sum(torch.float32)
        (True, False)
    """
    return dtype in (torch.float16, torch.bfloat16)


def mean_divisors(dtype: torch.dtype, ranks: int) -> tuple[int, int]:
    """How a mean over ``ranks`` ranks divides: ``(before, after)``, each rank's values divided by
    ``before`` before the sum and the sum by ``after`` after it; one of them is ``ranks``, the other 1.

    Every mean over ranks (the algorithms' ``mean_tensors``, the optimizers' buckets) decides here,
    by :func:`divide_before_sum`.

    Args:
        dtype: the dtype the values are summed in.
        ranks: how many ranks' values are averaged.

    Returns:
        ``(ranks, 1)`` for float16 and bfloat16, ``(1, ranks)`` otherwise.

    Example::

        >>> mean_divisors(torch.float16, 4), mean_divisors(torch.float32, 4)
        ((4, 1), (1, 4))
    """
    return (ranks, 1) if divide_before_sum(dtype) else (1, ranks)


# The reductions in a tensor's own dtype, by name (a mean is a sum, divided afterwards).
_IN_PLACE = {"sum": torch.add, "mean": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


def reduce_in_order(parts: list[torch.Tensor], op: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out`` = the reduction of ``parts`` in list (rank) order: the first two, then each next one
    into the result, so that whoever computes it gets the same bits.

    Args:
        parts: one tensor per rank, of one shape and dtype.
        op: a name of :data:`OPS` (``"mean"`` sums; the caller divides).
        out: where the result goes (it may be one of ``parts`` only if it is the first); None: a
            new tensor.

    Returns:
        ``out``, or the new tensor.

    Example::

        >>> reduce_in_order([torch.ones(2), torch.full((2,), 2.0)], "max", torch.empty(2))
        tensor([2., 2.])
    """
    if len(parts) == 1:
        return parts[0].clone() if out is None else out.copy_(parts[0])
    reduce = _IN_PLACE[op]
    if out is None:
        out = reduce(parts[0], parts[1])
    else:
        reduce(parts[0], parts[1], out=out)
    for part in parts[2:]:
        reduce(out, part, out=out)
    return out
