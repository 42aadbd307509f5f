"""What the launcher and the ranks of an elastic job say to each other, through the job's store.

Stdlib only: ``torchmn run`` imports it without torch.

The launcher is the one authority on membership. It numbers each membership a *generation* and
writes it once, as a list of :class:`Place` (one per rank, in rank order), under
``members_key(g)``, then ``GENERATION_KEY = g``. A rank (a *worker*, numbered by the launcher for
the job's whole life, ``WORKER_VARIABLE``) that has lost its world, or a new worker, writes
``waiting_key(worker)`` and waits for a generation that holds it; then each member writes
``arrived_key(g, worker)`` and waits for all of them (or for a newer generation, when one of
them died meanwhile) before it sets up the generation's process groups under
``store_prefix(g)``. Ranks decide together at each commit whether a newer generation waits
(``State.check_host_updates``), so all of them leave the old world at the same step.
"""
from __future__ import annotations

import dataclasses
import json
from typing import List, Mapping, Sequence

# Set by torchmn run for every rank of an elastic job.
ELASTIC_VARIABLE = "TORCHMN_ELASTIC"              # "1"
WORKER_VARIABLE = "TORCHMN_ELASTIC_WORKER"        # this process's worker number
GENERATION_VARIABLE = "TORCHMN_ELASTIC_GENERATION"  # the generation the rank's place variables describe
TIMEOUT_VARIABLE = "TORCHMN_ELASTIC_TIMEOUT"      # seconds a rank waits for a generation that holds it

GENERATION_KEY = "torchmn/elastic/generation"
ENDED_KEY = "torchmn/elastic/ended"  # the launcher gave up (below --min-np too long): why, for every rank


def enabled(env: Mapping[str, str]) -> bool:
    """Whether this process is a rank of an elastic job (``torchmn run --min-np ...``).

    Args:
        env: the environment (``os.environ``).

    Returns:
        True when ``TORCHMN_ELASTIC`` is ``"1"``.

    Example::

        >>> enabled({"TORCHMN_ELASTIC": "1"}), enabled({})
        (True, False)
    """
    return env.get(ELASTIC_VARIABLE) == "1"


def members_key(generation: int) -> str:
    """The store key of one generation's members (a JSON list of :class:`Place` fields).

    Args:
        generation: the generation's number.

    Returns:
        The key.

    Example::

        >>> members_key(3)
        'torchmn/elastic/members/3'
    """
    return f"torchmn/elastic/members/{generation}"


def waiting_key(worker: int) -> str:
    """The key a worker sets when it waits for a generation (its value: the last one it knew).

    Args:
        worker: the worker's number.

    Returns:
        The key.

    Example::

        >>> waiting_key(5)
        'torchmn/elastic/waiting/5'
    """
    return f"torchmn/elastic/waiting/{worker}"


def arrived_key(generation: int, worker: int) -> str:
    """The key a member sets once it has read its place in ``generation``.

    Args:
        generation, worker: the generation's number, and the worker's.

    Returns:
        The key.

    Example::

        >>> arrived_key(3, 5)
        'torchmn/elastic/arrived/3/5'
    """
    return f"torchmn/elastic/arrived/{generation}/{worker}"


def holds_key(worker: int) -> str:
    """The key a worker sets once it holds the training state (its first ``State.sync()`` is done):
    the launcher adds workers only while one that holds it lives.

    Args:
        worker: the worker's number.

    Returns:
        The key.

    Example::

        >>> holds_key(5)
        'torchmn/elastic/holds/5'
    """
    return f"torchmn/elastic/holds/{worker}"


def store_prefix(generation: int) -> str:
    """Where a generation's process groups keep their keys, apart from every other generation's.

    Args:
        generation: the generation's number.

    Returns:
        The prefix.

    Example::

        >>> store_prefix(3)
        'torchmn/elastic/world3/'
    """
    return f"torchmn/elastic/world{generation}/"


@dataclasses.dataclass(frozen=True)
class Place:
    """One rank of a generation: which worker, on which host, and where among the ranks there.

    Attributes:
        worker: the worker's number (``WORKER_VARIABLE``).
        host: the host it runs on, as the launcher names it.
        local_rank, local_size: its index among the generation's ranks on that host, and their count.
        node_rank, node_count: the host's index among the generation's hosts, and their count.
    """

    worker: int
    host: str
    local_rank: int
    local_size: int
    node_rank: int
    node_count: int


def place_members(workers: Sequence[tuple]) -> List[Place]:
    """The places of a generation whose ranks are ``workers``, in rank order.

    Args:
        workers: ``(worker, host)`` pairs, in rank order.

    Returns:
        One :class:`Place` per worker: local ranks count up per host in rank order, hosts are
        numbered in the order they first appear.

    Example::

        >>> [p.local_rank for p in place_members([(0, "a"), (2, "b"), (3, "a")])]
        [0, 0, 1]
    """
    hosts = list(dict.fromkeys(h for _, h in workers))
    per_host = {h: [w for w, wh in workers if wh == h] for h in hosts}
    return [Place(w, h, per_host[h].index(w), len(per_host[h]), hosts.index(h), len(hosts)) for w, h in workers]


def dump_members(places: Sequence[Place]) -> str:
    """A generation's places as the store holds them.

    Args:
        places: the places, in rank order.

    Returns:
        JSON text.

    Example::

        >>> dump_members(place_members([(0, "a")]))
        '[{"worker": 0, "host": "a", "local_rank": 0, "local_size": 1, "node_rank": 0, "node_count": 1}]'
    """
    return json.dumps([dataclasses.asdict(p) for p in places])


def load_members(text: str) -> List[Place]:
    """The places :func:`dump_members` wrote.

    Args:
        text: what the store holds.

    Returns:
        The places, in rank order.

    Example::

        >>> load_members(dump_members(place_members([(0, "a")])))[0].host
        'a'
    """
    return [Place(**fields) for fields in json.loads(text)]
