"""Horovod's reduction ops (``hvd.Average``, ``Sum``, ``Adasum``, ``Min``, ``Max``, ``Product``), the
deprecated ``average=`` argument, and how torchmn.horovod reduces with them: the communicator's
reduction of each op, the dtype each dtype is reduced in, the ops it refuses, and the scale factors.

The collectives (:mod:`~torchmn.horovod.allreduce_collectives`,
:mod:`~torchmn.horovod.exchange_collectives`) and the optimizer take their ops from here.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from torchmn.horovod.errors import InvalidCallError, UnsupportedError

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
REDUCE = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
# What a dtype is reduced in: half precision in float32, so that an average whose sum overflows
# float16 is still right (Horovod sums float16 in float16, giving inf there); int16 in int32 (gloo has
# no int16 sum; the low bits are the same).
WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int16: torch.int32}


def check_op(op: int, what: str) -> None:
    """Refuse ops torchmn.horovod does not reduce with.

    Args:
        op: a Horovod op value.
        what: the call, for the message.

    Raises:
        UnsupportedError: ``hvd.Adasum``, or a value that is not a Horovod op.

    Example::

        >>> check_op(hvd.Sum, "hvd.allreduce")          # passes
        >>> check_op(hvd.Adasum, "hvd.allreduce")       # UnsupportedError: ... op=hvd.Adasum is not implemented ...
    """
    if op == Adasum:
        raise UnsupportedError(f"{what}: op=hvd.Adasum is not implemented in torchmn.horovod; use op=hvd.Average "
                               f"(the default) or hvd.Sum")
    if op not in REDUCE:
        raise UnsupportedError(f"{what}: op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, "
                               f"hvd.Product")


def scale(flat: torch.Tensor, factor: float) -> None:
    """Multiply ``flat`` by ``factor`` in place; integers as Horovod's scaling does (the product
    truncated toward zero).

    Args:
        flat: the tensor, changed in place.
        factor: the factor.

    Example::

        >>> x = torch.tensor([5, -5])
        >>> scale(x, 0.5)
        >>> x
        tensor([ 2, -2])
    """
    if flat.is_floating_point():
        flat.mul_(factor)
    else:
        flat.copy_((flat.to(torch.float64) * factor).trunc())
