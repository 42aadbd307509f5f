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
