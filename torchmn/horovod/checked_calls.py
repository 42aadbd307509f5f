"""What the collectives other than allreduce share: agreeing on the call, naming a mismatch,
the handle of a collective that ran at once, and its timeline entry."""
from __future__ import annotations

import time
from typing import Optional

import torch

from torchmn.communicators import CollectiveMismatchError
from torchmn.horovod import coordination, handles, timeline


def agree_on(comm, kind: str, what: str, fields: tuple, problem: Optional[str]) -> list[tuple]:
    """Exchange every rank's call; raise on every rank alike if one rank's own arguments were bad.

    Args:
        comm: the communicator; ``kind``: the collective; ``what``: the call, for messages.
        fields: what the ranks must agree on (after the kind and host).
        problem: what is wrong with this rank's own arguments, or None.

    Returns:
        Every rank's description, ``(kind, host, *fields, problem)``.

    Raises:
        ValueError: a rank rejected its own arguments.
        CollectiveMismatchError: the ranks called different collectives.
        HorovodInternalError: a rank has joined.
    """
    descriptions = coordination.agree(comm, coordination.describe(kind, *fields, problem), need_descriptions=True)
    coordination.check_same_kind(descriptions, comm.rank)
    for r, d in enumerate(descriptions):
        if d[-1] is not None:
            raise ValueError(f"{what}: rank {r} ({d[1]}) rejected its arguments: {d[-1]}; rank {comm.rank} stops too")
    return descriptions


def mismatch(what: str, field: str, values: list, rank: int, fix: str) -> CollectiveMismatchError:
    """Returns: the error naming each rank's ``field`` (``values``, in rank order) and the ``fix``."""
    listing = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return CollectiveMismatchError(f"{what}: the ranks' {field} differ: {listing}. {fix}; rank {rank} stops")


def completed_handle(kind: str, name: Optional[str], result, nbytes: int, start: float, process_set) -> int:
    """Returns: the handle of a collective that has run already (and recorded itself in the timeline),
    whose ``synchronize`` returns ``result``."""
    return handles.submit(kind, name, None, lambda: result, nbytes, process_set.process_set_id, start, record=False)



def record(kind: str, name: Optional[str], tensor, start: float, process_set) -> None:
    """Add a collective that began at ``start`` and has just ended to the timeline."""
    nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
    timeline.record(kind, name or f"{kind}.noname", nbytes, start, time.time(),
                    getattr(process_set, "process_set_id", 0))
