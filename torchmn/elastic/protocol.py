"""What the launcher and the ranks of an elastic job say to each other, through the job's store.

Stdlib only: ``torchmn run`` imports it without torch.

The launcher is the one authority on membership. It numbers each membership a *generation* and
writes it once, as the variables of each rank's place (in rank order), under
``members_key(g)``, then ``GENERATION_KEY = g``. A rank (a *worker*, numbered by the launcher for
the job's whole life, ``WORKER_VARIABLE``) that has lost its world, or a new worker, writes
``waiting_key(worker)`` and waits for a generation that holds it; then each member writes
``arrived_key(g, worker)`` and waits for all of them (or for a newer generation, when one of
them died meanwhile; ``formed_key(g)`` settles which came first, alike for every member) before it
sets up the generation's process groups under
``store_prefix(g)``; that set-up gives up when the launcher marks the generation ``broken_key(g)``
(a member lost). A worker the launcher no longer has a slot for (the discovery script offers its
host fewer) finds ``removed_key(worker)`` set and is left out of the next generation: it leaves the
job at that commit. Ranks decide together at each commit whether a newer generation waits
(``State.check_host_updates``), so all of them leave the old world at the same step; the first
commit a generation's ranks all get through is noted (``committed_key(g)``), so that the launcher
tells a generation that broke while making progress from one that cannot make any.
"""
from __future__ import annotations

import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

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
    """The store key of one generation's members (:func:`dump_members`).

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


def formed_key(generation: int) -> str:
    """The key that settles, once for all its members, whether ``generation`` is formed (every member
    arrived) or passed over (a newer one came first): ``"formed"`` or ``"passed"``, written with the
    store's compare-and-set, so that no member sets up a world the others have left.

    Args:
        generation: the generation's number.

    Returns:
        The key.

    Example::

        >>> formed_key(3)
        'torchmn/elastic/formed/3'
    """
    return f"torchmn/elastic/formed/{generation}"


def broken_key(generation: int) -> str:
    """The key the launcher sets when ``generation`` lost a member (one died, or left its world):
    that world cannot be set up or go on. A newer generation announced only because workers came
    leaves the members free to finish setting up theirs (they move at their next commit).

    Args:
        generation: the generation's number.

    Returns:
        The key.

    Example::

        >>> broken_key(3)
        'torchmn/elastic/broken/3'
    """
    return f"torchmn/elastic/broken/{generation}"


def committed_key(generation: int) -> str:
    """The key rank 0 sets at the first commit every rank of ``generation`` got through: a
    generation that broke with every member alive before any commit (a collective timed out on a
    rank that was only slow) made no progress, and the launcher ends a job that keeps doing that.

    Args:
        generation: the generation's number.

    Returns:
        The key.

    Example::

        >>> committed_key(3)
        'torchmn/elastic/committed/3'
    """
    return f"torchmn/elastic/committed/{generation}"


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


def removed_key(worker: int) -> str:
    """The key the launcher sets for a worker it takes out of the job (its host offers fewer slots
    now), before it announces the generation without it: that worker then leaves the job instead
    of waiting for a place.

    Args:
        worker: the worker's number.

    Returns:
        The key.

    Example::

        >>> removed_key(5)
        'torchmn/elastic/removed/5'
    """
    return f"torchmn/elastic/removed/{worker}"


def read_generation(store) -> int:
    """The newest generation the launcher has announced in ``store``.

    Args:
        store: a client of the job's store.

    Returns:
        Its number; 0 before the launcher wrote the first one down.

    Example::

        >>> read_generation(store)
        3
    """
    if not store.check([GENERATION_KEY]):
        return 0
    return int(store.get(GENERATION_KEY).decode())


def end_reason(store) -> Optional[str]:
    """Why the launcher ended the job, if it has.

    Args:
        store: a client of the job's store.

    Returns:
        The launcher's message for every rank; None while the job goes on.

    Example::

        >>> end_reason(store)      # after the job stayed below --min-np too long
        'torchmn run: only 1 worker(s) left, below --min-np 2, ...'
    """
    if not store.check([ENDED_KEY]):
        return None
    return store.get(ENDED_KEY).decode()


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


def dump_members(members: Sequence[Tuple[int, Mapping[str, str]]]) -> str:
    """A generation's members as the store holds them: each worker with the variables of its place
    (``torchmn.run.plan.place_env``, which the rank takes over at the reset).

    Args:
        members: ``(worker, variables)`` pairs, in rank order.

    Returns:
        JSON text.

    Example::

        >>> dump_members([(4, {"RANK": "0"})])
        '[[4, {"RANK": "0"}]]'
    """
    return json.dumps([[worker, dict(variables)] for worker, variables in members])


def load_members(text: str) -> List[Tuple[int, Dict[str, str]]]:
    """The members :func:`dump_members` wrote.

    Args:
        text: what the store holds.

    Returns:
        ``(worker, variables)`` pairs, in rank order.

    Example::

        >>> load_members('[[4, {"RANK": "0"}]]')
        [(4, {'RANK': '0'})]
    """
    return [(worker, variables) for worker, variables in json.loads(text)]
