"""Naming the process groups that ``Communicator.split`` creates alike on every member."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from torchmn.communicators import world


def torch_group_count() -> Optional[int]:
    """How many process groups this process belongs to (None if torch does not say).

    torch names a group that only its own ranks create (``use_local_synchronization=True``) after
    its ranks and this number, so those ranks must agree on it.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if names is not None else None


def match_group_counts(counts: list[Optional[int]]) -> None:
    """Bring this process's group count up to the highest of ``counts`` (the future members') with
    groups of itself alone, so that torch gives all members the same name for their new group.

    Counts differ where ranks have lived differently: only a node's first rank belongs to the
    group between nodes, only the members of a sub-communicator to the groups of its splits.
    """
    if None in counts:
        return
    target = max(counts)
    while torch_group_count() < target:
        world.new_group([dist.get_rank()], use_local_synchronization=True)
