"""A rank's side of an elastic job's membership: waiting for a generation that holds it, taking its
place there, and asking whether a newer one waits (the launcher's side: :mod:`torchmn.run.elastic`;
the keys: :mod:`.protocol`)."""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import weakref
from typing import Iterable, List, Optional

from torchmn.communicators import world
from torchmn.elastic import protocol
from torchmn.elastic.errors import ElasticJobEndedError
from torchmn.errors import TorchmnRuntimeError

POLL_S = 0.02  # how often a waiting rank looks at the store
_told = False  # this rank told the launcher it holds the state
_committed_in: Optional[int] = None  # the generation whose first commit this rank noted
_client = None  # the launcher's store (_store)
_communicators: List["weakref.ref"] = []  # this rank's world communicators, in the order they were made
_followers: List["weakref.ref"] = []  # objects that take part in each new world (follow_world), in order


def remember(comm) -> None:
    """Note a world communicator (``create_communicator`` calls this): the one a
    :class:`~torchmn.elastic.State` syncs over by default, and, in an elastic job, rebuilt for the new
    world at each reset, in the order the script made them.

    Args:
        comm: the communicator (held weakly).

    Example::

        >>> remember(comm)
    """
    _communicators.append(weakref.ref(comm))


def communicators() -> list:
    """This rank's world communicators still in use, in the order they were made.

    Returns:
        The communicators (one per ``create_communicator`` call whose result is still held).

    Example::

        >>> communicators()
        [<FlatCommunicator rank 0/2 ...>]
    """
    alive, seen = [], set()
    for comm in (ref() for ref in _communicators):
        # A communicator made at a reset, and taken over by the script's (Communicator.take_over),
        # shares its attributes: it is the same one.
        if comm is not None and id(comm.__dict__) not in seen:
            seen.add(id(comm.__dict__))
            alive.append(comm)
    _communicators[:] = [weakref.ref(c) for c in alive]
    return alive


def follow(obj) -> None:
    """Note an object that takes part in each new world: its ``follow_world()`` is collective, and
    ``@torchmn.elastic.run`` calls it on every rank at each start, before the state's sync (a rank
    that joined receives there the data the others hold). The scattered dataset and the multi-node
    iterator of an elastic job call this when they are made.

    Args:
        obj: an object with a ``follow_world()`` method (held weakly).

    Example::

        >>> follow(part)
    """
    _followers.append(weakref.ref(obj))


def followers() -> list:
    """The objects noted by :func:`follow` still in use, in the order they were made.

    Returns:
        The objects.

    Example::

        >>> followers()
        [<torchmn.datasets.elastic_part.ElasticDatasetPart object at ...>]
    """
    alive = [obj for obj in (ref() for ref in _followers) if obj is not None]
    _followers[:] = [weakref.ref(obj) for obj in alive]
    return alive


def enabled() -> bool:
    """Whether this process is a rank of an elastic job (``torchmn run --min-np ...``).

    Returns:
        True under ``torchmn run --min-np/--max-np``.

    Example::

        >>> enabled()      # under torchmn run -np 4 --min-np 2
        True
    """
    return protocol.enabled(os.environ)


def worker() -> int:
    """This process's worker number, which the launcher gave it for the job's whole life.

    Returns:
        The number (``TORCHMN_ELASTIC_WORKER``).

    Example::

        >>> worker()
        5
    """
    return int(os.environ[protocol.WORKER_VARIABLE])


def generation() -> Optional[int]:
    """The generation this process's place variables describe.

    Returns:
        Its number; None before the process first joined one.

    Example::

        >>> generation()
        2
    """
    value = os.environ.get(protocol.GENERATION_VARIABLE)
    return None if value is None else int(value)


def _store():
    """The launcher's store, one client for the process's life (every commit asks it)."""
    global _client
    if _client is not None:
        return _client
    store = world.launcher_store(datetime.timedelta(seconds=60))
    if store is None:
        raise TorchmnRuntimeError(f"worker {os.environ.get(protocol.WORKER_VARIABLE)} on {socket.gethostname()}: "
                                  f"cannot reach the launcher's store at {os.environ.get('MASTER_ADDR')}:"
                                  f"{os.environ.get('MASTER_PORT')}; an elastic job's ranks must be started by "
                                  f"torchmn run --min-np/--max-np")
    _client = store
    return store


def newer_generation() -> bool:
    """Whether the launcher has announced a generation newer than this rank's (ranks came or went).

    Returns:
        True when the rank should leave its world at the next commit.

    Example::

        >>> newer_generation()      # after a new worker reached the rendezvous
        True
    """
    current = generation()
    return current is not None and protocol.read_generation(_store()) > current


def note_commit() -> None:
    """Tell the launcher that every rank of this generation got through a commit (called by rank 0
    after the commit's collective; one store write per generation).

    Example::

        >>> note_commit()
    """
    global _committed_in
    current = generation()
    if enabled() and current is not None and _committed_in != current:
        _store().set(protocol.committed_key(current), "")
        _committed_in = current


def left_behind() -> bool:
    """Whether the launcher has moved on from this rank's generation: it announced a newer one, or
    marked this one broken (a member lost, perhaps with no worker yet to take its place). A world
    that failed to set up then failed for that reason: the rank waits for the next generation.

    Returns:
        True when this rank's generation cannot go on.

    Example::

        >>> left_behind()      # after a member died inside the set-up of this rank's world
        True
    """
    current = generation()
    return newer_generation() or (current is not None and _store().check([protocol.broken_key(current)]))


def awaiting_state() -> bool:
    """Whether this process joined a running elastic job and has not yet received the training
    state (it then must not start collectives of its own: the others are in a reset).

    Returns:
        True in a worker the launcher added, until its ``@torchmn.elastic.run`` function starts.

    Example::

        >>> awaiting_state()       # in a new worker, before train(state)
        True
    """
    return enabled() and generation() not in (None, 0) and not _told


def say_it_holds_the_state() -> None:
    """Tell the launcher this rank holds the training state (after its first sync), once.

    Example::

        >>> say_it_holds_the_state()
    """
    global _told
    if enabled() and not _told:
        _store().set(protocol.holds_key(worker()), "")
        _told = True


def _ended(store) -> None:
    reason = protocol.end_reason(store)
    if reason is not None:
        raise ElasticJobEndedError(reason)


def wait_for_place() -> int:
    """Wait until the launcher announces a generation newer than this rank's that holds it, and
    every member of it has arrived; then take its place there (the variables
    ``create_communicator`` reads).

    A generation whose members do not all arrive (one died meanwhile) is passed over for the
    newer one the launcher then announces. A worker the launcher took out of the job (its host
    offers fewer slots now) exits here with status 0.

    Returns:
        The generation joined.

    Raises:
        ElasticJobEndedError: the launcher ended the job (below ``--min-np`` too long).
        RuntimeError: no generation came within the elastic timeout.
        SystemExit: (status 0) the launcher took this worker out of the job.

    Example::

        >>> wait_for_place()        # after the world broke, or in a worker that just started
        3
    """
    store = _store()
    me = worker()
    left = generation()
    if left is None:
        _load_before_arriving()
    left = -1 if left is None else left
    timeout = float(os.environ.get(protocol.TIMEOUT_VARIABLE, "600"))
    deadline = time.monotonic() + timeout
    store.set(protocol.waiting_key(me), str(left))
    tried = left
    while time.monotonic() < deadline:
        _ended(store)
        latest = protocol.read_generation(store)
        if latest > tried:
            tried = latest
            members = dict(protocol.load_members(store.get(protocol.members_key(latest)).decode()))
            if me in members:
                store.set(protocol.arrived_key(latest, me), "")
                if _all_arrived(store, latest, members, deadline):
                    # This rank's place in the new world: what create_communicator reads.
                    os.environ.update(members[me])
                    os.environ[protocol.GENERATION_VARIABLE] = str(latest)
                    return latest
            elif store.check([protocol.removed_key(me)]):
                _leave_the_job(me, latest)
        time.sleep(POLL_S)
    raise TorchmnRuntimeError(f"worker {me} on {socket.gethostname()}: no generation of the elastic job took it within "
                              f"{timeout:g} s (TORCHMN_ELASTIC_TIMEOUT, from --elastic-timeout); the launcher's "
                              f"output says why")


def _leave_the_job(me: int, latest: int) -> None:
    """End this worker, which the launcher took out of the job: a normal exit (status 0, the
    script's code after the training function does not run), which the launcher expects."""
    print(f"torchmn.elastic: worker {me} on {socket.gethostname()} left the job: its host offers fewer slots "
          f"now (--host-discovery-script), and generation {latest} goes on without it", file=sys.stderr, flush=True)
    raise SystemExit(0)


def _load_before_arriving() -> None:
    """Load, in a worker about to join, what the script's first optimizer loads: torch's optimizers
    import ``torch._dynamo`` at their first construction (2-3 s on a small CPU, many times that on a
    loaded one), which the members would otherwise spend waiting in their reset for the newcomer."""
    import torch._dynamo  # noqa: F401


def _all_arrived(store, g: int, members: Iterable[int], deadline: float) -> bool:
    """Whether every member of generation ``g`` arrives before a newer generation is announced.

    Decided once for every member (``protocol.formed_key``): a member that saw a newer generation
    while another had not yet arrived leaves ``g``, and the late one, finding every arrival key set
    afterwards, must not set up a world alone that the others have left (it would wait in its
    process group's rendezvous while they wait for it in the newer generation)."""
    keys = [protocol.arrived_key(g, worker) for worker in members]
    while time.monotonic() < deadline:
        if store.check(keys):
            return _settle(store, g, "formed")
        _ended(store)
        if protocol.read_generation(store) > g:
            return _settle(store, g, "passed")
        time.sleep(POLL_S)
    return False


def _settle(store, g: int, outcome: str) -> bool:
    """Whether generation ``g`` is formed, as the first member to settle it said."""
    return store.compare_set(protocol.formed_key(g), "", outcome) == b"formed"
