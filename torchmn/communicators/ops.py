"""The reductions collectives take by name, and how a mean over ranks avoids overflow."""
from __future__ import annotations

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
