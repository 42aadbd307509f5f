"""What the tensor collectives share about a call: the layout the ranks exchange to check it,
agreeing on it (so that a rank's bad arguments raise on every rank), and the error naming what the
ranks' calls differ in.
"""
from __future__ import annotations

from typing import Optional

import torch

from torchmn.communicators import CollectiveMismatchError
from torchmn.horovod import coordination
from torchmn.horovod.errors import InvalidCallError


def layout(t: torch.Tensor) -> tuple:
    """The layout of a tensor, as the ranks exchange it to check their calls.

    Args:
        t: the tensor.

    Returns:
        ``(shape, dtype name)`` of ``t``, e.g. ``((2, 3), "float32")``.

    Example::

        >>> layout(torch.zeros(2, 3))
        ((2, 3), 'float32')
    """
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


def nbytes(tensors) -> int:
    """The bytes a call's tensors hold, for the timeline (anything but a tensor counts 0).

    Args:
        tensors: the call's tensors.

    Returns:
        The sum of their sizes in bytes.

    Example::

        >>> nbytes([torch.zeros(4), torch.zeros(2, dtype=torch.float64)])
        32
    """
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def agree_on(comm, kind: str, what: str, fields: tuple, problem: Optional[str]) -> list[tuple]:
    """Exchange every rank's call; raise on every rank alike if one rank's own arguments were bad.

    Args:
        comm: the communicator.
        kind: the collective.
        what: the call, for messages.
        fields: what the ranks must agree on (after the kind and host).
        problem: what is wrong with this rank's own arguments, or None.

    Returns:
        Every rank's description, ``(kind, host, *fields, problem)``.

    Raises:
        InvalidCallError: a rank rejected its own arguments.
        CollectiveMismatchError: the ranks called different collectives.
        HorovodInternalError: a rank has joined.

    Example::

        >>> descriptions = agree_on(comm, "broadcast", "hvd.broadcast", (name, root_rank, layout(tensor)), None)
        >>> roots = [d[3] for d in descriptions]     # every rank's root_rank, in rank order
    """
    descriptions = coordination.agree(comm, coordination.describe_call(kind, *fields, problem), need_descriptions=True)
    coordination.check_same_kind(descriptions, comm.rank)
    for r, d in enumerate(descriptions):
        if d[-1] is not None:
            raise InvalidCallError(f"{what}: rank {r} ({d[1]}) rejected its arguments: {d[-1]}; "
                                   f"rank {comm.rank} stops too")
    return descriptions


def mismatch(what: str, field: str, values: list, rank: int, fix: str) -> CollectiveMismatchError:
    """The error for ranks whose calls differ in one field.

    Args:
        what: the call, for the message.
        field: what differs, in words.
        values: every rank's value of it, in rank order.
        rank: this rank.
        fix: what the ranks must do instead.

    Returns:
        The error (to raise) naming each rank's value and the ``fix``.

    Example::

        >>> print(mismatch("hvd.broadcast", "root ranks", [0, 1], 0, "Name one root_rank"))
        hvd.broadcast: the ranks' root ranks differ: rank 0: 0; rank 1: 1. Name one root_rank; rank 0 stops
    """
    listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return CollectiveMismatchError(f"{what}: the ranks' {field} differ: {listing}. {fix}; rank {rank} stops")
