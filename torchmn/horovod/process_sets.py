"""The ranks a collective runs on: the job's communicator and Horovod's process sets.

``hvd.init`` (in :mod:`torchmn.horovod.basics`) stores the job's communicator in :data:`job` and
makes :data:`global_process_set` hold every rank of it; a process set is a named subset of those
ranks with its own torchmn communicator, made by ``comm.split``, that every collective takes as
``process_set=``. This is the state every other part of torchmn.horovod reads, so it imports none
of them.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torchmn.horovod import background
from torchmn.horovod.errors import InvalidCallError, UnsupportedError

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class _Job:
    """The communicators of the job, once ``hvd.init`` made them (all None before and after)."""

    comm = None        # the ranks the job's global process set holds
    world = None       # every rank of the job (``comm`` is the part ``init(comm=[...])`` chose)
    owns_comm = False  # ``hvd.shutdown`` finalizes ``world``
    solo = None        # a world of one, for the ranks ``init(comm=[...])`` leaves out


job = _Job()


def require_comm():
    """The job's communicator, or Horovod's error before ``hvd.init()``.

    Returns:
        The communicator ``hvd.init`` made (the ranks the job's global process set holds).

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

    Example::

        >>> comm = require_comm()
        >>> comm.rank, comm.size
    """
    if job.comm is None:
        raise InvalidCallError(NOT_INITIALIZED)
    return job.comm


class ProcessSet:
    """A set of ranks collectives can run on, as Horovod's ``ProcessSet``.

    Build it from ranks of the job, then register it on every rank with
    :func:`add_process_set` (or ``hvd.init(process_sets=[...])``).

    Args:
        ranks_or_comm: the job's ranks that belong to the set (an ``mpi4py`` communicator is
            not taken: torchmn does not run on MPI's communicators).

    Raises:
        UnsupportedError: ``ranks_or_comm`` is not a list, tuple or range of ranks.

    Example::

        >>> evens = hvd.add_process_set(hvd.ProcessSet([0, 2]))
        >>> if evens.included():
        ...     hvd.allreduce(x, process_set=evens)
    """

    def __init__(self, ranks_or_comm: Sequence[int]):
        if not isinstance(ranks_or_comm, (list, tuple, range)):
            raise UnsupportedError(f"ProcessSet(<{type(ranks_or_comm).__name__}>): torchmn.horovod takes a list "
                                   f"of ranks, not an mpi4py communicator")
        self.ranks = sorted(int(r) for r in ranks_or_comm)
        self.process_set_id: Optional[int] = None
        self.comm = None         # this rank's communicator of the set, where it belongs to it
        self.tensor_comm = None  # ... and the one its tensor collectives run on (background thread)

    def _registered_here(self) -> bool:
        return self.process_set_id is not None and _registered.get(self.process_set_id) is self

    def size(self) -> Optional[int]:
        """The number of ranks in the set.

        Returns:
            ``len(self.ranks)``; None while the set is not registered (as Horovod's).

        Example::

            >>> hvd.add_process_set([0, 1]).size()      # 2
        """
        return len(self.ranks) if self._registered_here() else None

    def rank(self) -> Optional[int]:
        """This process's rank within the set.

        Returns:
            Its index in ``self.ranks``, or -1 where it does not belong to the set; None while the
            set is not registered (as Horovod's).

        Example::

            >>> pair = hvd.add_process_set([1, 2])
            >>> pair.rank()                 # 0 on rank 1, 1 on rank 2, -1 elsewhere
        """
        if not self._registered_here():
            return None
        return self.comm.rank if self.comm is not None else -1

    def included(self) -> bool:
        """Whether this process belongs to the set, registered or not (as Horovod's).

        Returns:
            True where ``hvd.rank()`` is one of ``self.ranks`` (a rank ``hvd.init(comm=[...])``
            left out belongs to none).

        Raises:
            InvalidCallError: before ``hvd.init()`` (a ``ValueError``).

        Example::

            >>> if pair.included():
            ...     hvd.allreduce(x, process_set=pair)
        """
        comm = require_comm()
        if self._registered_here():
            return self.comm is not None
        return comm is not job.solo and comm.rank in self.ranks

    def __eq__(self, other) -> bool:
        """Whether ``other`` is a process set of the same ranks (registered or not).

        Args:
            other: any object.

        Returns:
            True for a :class:`ProcessSet` with the same ``ranks``.

        Example::

            >>> hvd.ProcessSet([2, 0]) == hvd.ProcessSet([0, 2])
            True
        """
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        """A hash of the ranks, consistent with ``==``.

        Returns:
            ``hash(tuple(self.ranks))``.

        Example::

            >>> len({hvd.ProcessSet([0, 2]), hvd.ProcessSet([2, 0])})
            1
        """
        return hash(tuple(self.ranks))

    def __repr__(self) -> str:
        """The set's id and ranks, as Horovod shows a process set.

        Returns:
            ``ProcessSet(process_set_id=<id>, ranks=<ranks>)``; the id is None until registered.

        Example::

            >>> hvd.ProcessSet([0, 2])
            ProcessSet(process_set_id=None, ranks=[0, 2])
        """
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registered: dict[int, ProcessSet] = {}


def register_global(comm) -> None:
    """Make :data:`global_process_set` every rank of ``comm``, the job's, and the only set registered.

    Args:
        comm: the job's communicator (``hvd.init`` calls this once it has made it).

    Example::

        >>> register_global(job.comm)
    """
    global_process_set.ranks = list(range(comm.size))
    global_process_set.comm = comm
    global_process_set.tensor_comm = _tensor_comm(comm)
    _registered.clear()
    _registered[0] = global_process_set


def _tensor_comm(comm):
    """A communicator of ``comm``'s ranks for the background thread alone (a collective on ``comm``):
    its collectives never meet the main thread's on the wire."""
    return comm.split(color=0, key=comm.rank) if comm.size > 1 else comm


def forget_all() -> None:
    """Unregister every process set and drop their communicators (``hvd.shutdown`` calls this).

    Example::

        >>> forget_all()
        >>> global_process_set.comm is None     # True
    """
    for ps in _registered.values():
        if ps is not global_process_set:
            ps.process_set_id = None
        ps.comm = ps.tensor_comm = None
    _registered.clear()


def add_process_set(process_set) -> ProcessSet:
    """Register a process set on every rank of the job (a collective: every rank calls it, in
    the same order). Ranks are ``hvd.rank()`` numbers.

    Args:
        process_set: a :class:`ProcessSet` or a list of ranks.

    Returns:
        The registered :class:`ProcessSet`.

    Raises:
        InvalidCallError: before ``hvd.init()``; a set of these ranks is registered already; a rank
            is out of range.

    Example::

        >>> pair = hvd.add_process_set([0, 1])
    """
    world = require_comm()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    bad = [r for r in ps.ranks if not 0 <= r < world.size]
    if bad or not ps.ranks:
        raise InvalidCallError(f"add_process_set: ranks {bad or ps.ranks} are not ranks of this job of "
                               f"{world.size}; give ranks 0..{world.size - 1}")
    for existing in _registered.values():
        if existing.ranks == ps.ranks:
            raise InvalidCallError(f"A process set with the same ranks has already been registered: {existing}")
    inside = world.rank in ps.ranks
    sub = world.split(color=0 if inside else 1, key=world.rank)
    if not inside:
        sub.finalize()  # the outsiders' own: unused, and its groups go back for later splits
    ps.comm = sub if inside else None
    ps.tensor_comm = _tensor_comm(sub) if inside else None
    ps.process_set_id = max(_registered) + 1
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (on every rank); the global one stays.

    Args:
        process_set: a set :func:`add_process_set` returned.

    Returns:
        True if it was registered and is removed now, False otherwise.

    Raises:
        InvalidCallError: before ``hvd.init()``.

    Example::

        >>> hvd.remove_process_set(pair)
    """
    require_comm()
    if process_set is global_process_set or process_set.process_set_id not in _registered:
        return False
    del _registered[process_set.process_set_id]
    process_set.process_set_id = None
    if process_set.comm is not None:
        # After the set's collectives still queued, so that a later set of these ranks takes its groups.
        background.retire(process_set.tensor_comm)
        process_set.tensor_comm.finalize()
        process_set.comm.finalize()
    process_set.comm = process_set.tensor_comm = None
    return True


def comm_of(process_set: Optional[ProcessSet], op_name: str):
    """The communicator a collective runs on for ``process_set``, checked as Horovod checks it.

    Args:
        process_set: the call's ``process_set=`` (None: the global one).
        op_name: the call, for the messages.

    Returns:
        This rank's communicator of the set.

    Raises:
        InvalidCallError: before ``hvd.init()``; the set is not registered; this rank is not in it.

    Example::

        >>> comm = comm_of(process_set, "hvd.allgather")
    """
    require_comm()
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet) or _registered.get(ps.process_set_id) is not ps:
        raise InvalidCallError(f"{op_name}: Process set provided does not exist, or has not been registered.")
    if ps.comm is None:
        raise InvalidCallError(f"{op_name}: Rank {job.comm.rank} is not a member of the provided process set.")
    return ps.comm


def tensor_comm_of(process_set: Optional[ProcessSet], op_name: str):
    """The communicator a tensor collective runs on for ``process_set``, on the background thread
    (:mod:`~torchmn.horovod.background`), checked as :func:`comm_of` checks it.

    Args:
        process_set: the call's ``process_set=`` (None: the global one).
        op_name: the call, for the messages.

    Returns:
        This rank's tensor communicator of the set.

    Raises:
        InvalidCallError: before ``hvd.init()``; the set is not registered; this rank is not in it.

    Example::

        >>> comm = tensor_comm_of(process_set, "hvd.allgather")
    """
    comm_of(process_set, op_name)
    return (global_process_set if process_set is None else process_set).tensor_comm
