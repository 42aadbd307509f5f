"""The process groups ``Communicator.split`` makes: named alike on every member, and used again
once the communicator that held them is finalized.

Why used again rather than destroyed: torch names a group its members make alone after its
ranks and the number of groups the process holds, and its set-up leaves the members' addresses in
the job's store under that name. Destroying a group lowers the number, so the next group of the
same ranks would take the name and read the dead group's addresses. A finalized communicator's
groups therefore wait here, and a later split whose members all hold an idle group of the same
ranks and backend takes it (its connections are made already) instead of opening new ones: a job
that splits and finalizes in a loop keeps its open files and sockets level."""
from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

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


_idle: dict = {}  # (backend, world ranks) -> {group name: group} of finalized communicators' groups
# The world they belong to: a new world (an elastic job's reset) voids them. Weak, so that a
# world being left closes its connections at once, as the other ranks learn of it by them.
_idle_world: Callable[[], object] = lambda: None


def _current_idle() -> dict:
    global _idle_world
    if _idle_world() is not dist.group.WORLD:
        _idle.clear()
        world_group = dist.group.WORLD
        _idle_world = weakref.ref(world_group) if world_group is not None else (lambda: None)
    return _idle


def release(group) -> None:
    """Keep a finalized communicator's group for a later :func:`group_for` (not a collective).

    Args:
        group: a group :func:`group_for` returned; None, ``NON_GROUP_MEMBER`` and the world's are
            left alone.

    Example::

        >>> release(half.process_group)    # in finalize
    """
    if group in (None, dist.GroupMember.NON_GROUP_MEMBER) or not dist.is_initialized() or group == dist.group.WORLD:
        return
    try:
        key = (str(dist.get_backend(group)), tuple(dist.get_process_group_ranks(group)))
    except (ValueError, RuntimeError):
        return  # a group of a world left before (torch no longer knows it): nothing to use again
    _current_idle().setdefault(key, {})[group.group_name] = group


def drop_idle() -> None:
    """Let go of every idle group, so that their connections close (for a rank ending with an error).

    Example::

        >>> drop_idle()
    """
    _idle.clear()


def idle_groups() -> dict:
    """What this rank holds idle, for ``split``'s exchange.

    Returns:
        ``{(backend, world ranks): [group names]}``.

    Example::

        >>> idle_groups()
        {('gloo', (0, 2)): ['3']}
    """
    return {key: sorted(names) for key, names in _current_idle().items() if names}


def reuse_budget(idle_by_rank: dict) -> dict:
    """The idle groups every one of whose members holds them, from every rank's :func:`idle_groups`.

    Args:
        idle_by_rank: ``{world rank: idle_groups()}`` of the ranks splitting.

    Returns:
        ``{(backend, world ranks): [group names]}``, the same on every rank given the same input;
        :func:`group_for` takes from it.

    Example::

        >>> reuse_budget({0: {("gloo", (0, 1)): ["3"]}, 1: {("gloo", (0, 1)): ["3"]}})
        {('gloo', (0, 1)): ['3']}
    """
    budget = {}
    for key in sorted({key for idle in idle_by_rank.values() for key in idle}):
        if all(r in idle_by_rank for r in key[1]):
            names = set.intersection(*(set(idle_by_rank[r].get(key, ())) for r in key[1]))
            if names:
                budget[key] = sorted(names)
    return budget


def group_for(ranks: Sequence[int], budget: dict, **options):
    """:func:`world.new_group`'s group, or an idle one of these ranks where ``budget`` has one.

    Every rank that would call ``new_group`` calls this instead, in the same order and with the
    same budget, so that all take an idle group (and torch's count of groups stays alike) or all
    make a new one.

    Args:
        ranks: the group's world ranks.
        budget: from :func:`reuse_budget` (taken from as groups are used); ``{}`` makes new ones.
        **options: ``backend``, ``use_local_synchronization``, as ``new_group`` takes them.

    Returns:
        The group (``NON_GROUP_MEMBER`` on a rank outside it).

    Example::

        >>> pair = group_for([0, 1], reuse_budget(every_ranks_idle_groups))
    """
    key = (str(options.get("backend") or dist.get_backend()), tuple(sorted(ranks)))
    if budget.get(key):
        name = budget[key].pop(0)
        if dist.get_rank() not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        return _current_idle()[key].pop(name)
    return world.new_group(list(ranks), **options)
