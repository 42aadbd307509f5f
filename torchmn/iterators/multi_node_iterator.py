"""One rank reads the data, every rank gets the same batches."""
from __future__ import annotations

import pickle
from typing import Any, Iterable, Iterator, Optional

from torchmn.checkpoint.rng import rng_state, set_rng_state
from torchmn.communicators.pickling import dumps
from torchmn.communicators.errors import RemoteRankError
from torchmn.elastic import membership
from torchmn.errors import TorchmnRuntimeError, TorchmnTypeError, TorchmnValueError

_BATCH, _STOP, _ERROR = 0, 1, 2


class MultiNodeIterator:
    """An iterable whose batches come from ``loader`` on ``rank_master`` (see
    :func:`create_multi_node_iterator`, which makes one).

    Each ``for`` loop over it is one epoch; ``epoch`` counts the epochs finished on this rank.
    ``len()`` is the master's ``len(loader)`` on every rank.

    In an elastic job (``torchmn run --min-np ...``) a reset may lose the master: give the loader
    on every rank that can read it (each one makes the same batches for the same position, e.g. a
    :class:`~torchmn.checkpoint.ResumableLoader`), and the iterator to the
    :class:`~torchmn.elastic.State`. In each new world the master is the lowest rank that has a
    loader, and the epoch goes on after the last committed batch. A rank that joins the running
    job learns the master and the length when its ``@torchmn.elastic.run`` function starts.

    Args:
        loader: the iterable to read on ``rank_master``; other ranks may pass ``None``.
        comm: the communicator whose ranks get the batches.
        rank_master: the rank that reads ``loader``.

    Raises:
        ValueError: ``rank_master`` is not a rank of ``comm``; or, on every rank, the master
            passed ``loader=None`` or ``len()`` of its loader failed.

    Example::

        >>> it = torchmn.iterators.MultiNodeIterator(loader if comm.rank == 0 else None, comm)
        >>> len(it), it.epoch
        (100, 0)
    """

    def __init__(self, loader: Optional[Iterable], comm, rank_master: int = 0):
        comm.check_rank(rank_master, "rank_master")
        self.comm = comm
        self.rank_master = rank_master
        self.loader = loader
        self.epoch = 0
        self.batches = 0          # batches yielded in the epoch under way
        self._skip = 0            # batches the master passes over when the next epoch starts
        self._resuming = False    # the next epoch continues one a checkpoint interrupted
        self._loader_state = None  # the master's loader's position after its last batch, on every rank
        self._length = None
        self._pending = False     # a rank that joined an elastic job, before its run function starts
        if membership.enabled():
            membership.follow(self)
            self._pending = membership.awaiting_state()
            if not self._pending:  # a rank that joined learns the master at its run's start
                self._choose_master(first=True)
            return
        is_master = comm.rank == rank_master
        # Every rank learns the length, and any problem, at the same time: none is left waiting.
        if is_master:
            claim = (_claim(loader, rank_master) if loader is not None else
                     (f"master rank {rank_master} passed loader=None; it must pass the loader to read", None))
        problem, self._length = comm.bcast_obj(claim if is_master else None, root=rank_master)
        if problem:
            raise TorchmnValueError(f"create_multi_node_iterator: {problem} (raised on rank {comm.rank})")

    def follow_world(self) -> None:
        """Choose the master of a new world of an elastic job: the lowest rank that has a loader
        (collective: ``@torchmn.elastic.run`` calls it on every rank before the state's sync).

        Raises:
            RuntimeError: no rank of the new world has a loader (the reading rank was lost, and the
                others passed ``None``).

        Example::

            >>> it.follow_world()
        """
        self._choose_master(first=False)

    def _choose_master(self, first: bool) -> None:
        comm = self.comm
        claims = comm.allgather_obj(None if self.loader is None else _claim(self.loader, comm.rank))
        problems = [c[0] for c in claims if c is not None and c[0]]
        if problems:
            raise TorchmnValueError(f"create_multi_node_iterator: {problems[0]} (raised on rank {comm.rank})")
        readers = [r for r, c in enumerate(claims) if c is not None]
        if first and claims[self.rank_master] is None:
            raise TorchmnValueError(f"create_multi_node_iterator: master rank {self.rank_master} passed loader=None; "
                                    f"it must pass the loader to read (raised on rank {comm.rank})")
        if not readers:
            raise TorchmnRuntimeError(
                f"multi-node iterator: no rank of the new {comm.size}-rank world has a loader (the rank that read "
                f"it was lost); in an elastic job pass the loader on every rank, so that another can read it "
                f"(raised on rank {comm.rank})")
        if not first:
            self.rank_master = readers[0]
        self._length = claims[self.rank_master][1]
        self._pending = False

    def _position(self):
        """The master's loader's position, where it has ``state_dict()``."""
        return self.loader.state_dict() if callable(getattr(self.loader, "state_dict", None)) else None

    def __len__(self) -> int:
        """The number of batches in an epoch: the master's ``len(loader)``. No communication.

        Returns:
            The master's ``len(loader)``, the same on every rank.

        Raises:
            TypeError: the master's loader has no ``len()`` (e.g. over an ``IterableDataset``).
            RuntimeError: this rank joined an elastic job and its run function has not yet started.

        Example::

            >>> len(it)                # on every rank, also where loader was None
            100
        """
        if self._pending:
            raise TorchmnRuntimeError(f"rank {self.comm.rank}: this rank joined a running elastic job and learns the "
                                      f"multi-node iterator's length when its @torchmn.elastic.run function starts; "
                                      f"use the iterator inside that function")
        if self._length is None:
            raise TorchmnTypeError(f"the loader on master rank {self.rank_master} has no len()")
        return self._length

    def state_dict(self) -> dict:
        """The position: finished epochs, batches into the current one, and the master's loader's
        own state where it has one (:class:`~torchmn.checkpoint.ResumableLoader`). No communication.

        Returns:
            ``{"epoch", "batches"}``, plus ``"loader"`` when the master's loader has
            ``state_dict()``: its position after the last batch, which the master sends every rank
            with each batch, so the state is the same on every rank.

        Example::

            >>> it.state_dict()
            {'epoch': 2, 'batches': 17}
        """
        state = {"epoch": self.epoch, "batches": self.batches}
        if self._loader_state is not None:
            state["loader"] = self._loader_state
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position from :meth:`state_dict`, on every rank.

        The next epoch continues after the batches already taken: every rank's loader loads the
        master's position where both have one; otherwise the master reads and drops those batches, which
        repeats the old run exactly when its loader makes the same order for the same epoch (a
        sampler given ``set_epoch(it.epoch)``, or a loader that is not shuffled).

        Args:
            state: from :meth:`state_dict`.

        Example::

            >>> it.load_state_dict({"epoch": 2, "batches": 17})
        """
        self.epoch = int(state["epoch"])
        self.batches = self._skip = int(state["batches"])
        self._resuming = True
        self._loader_state = state.get("loader")
        # Every rank that has a loader takes the position: in an elastic job, any may be the next master.
        if self._loader_state is not None and callable(getattr(self.loader, "load_state_dict", None)):
            self.loader.load_state_dict(self._loader_state)
            self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        """One epoch. Every rank must start it, and consume it, in step with the others.

        Yields:
            The master's batches: on the master as its loader made them, on the other ranks with
            every tensor on CPU.

        Raises:
            RemoteRankError: on every rank but the master, when the master's loader (or pickling
                a batch) failed; the master raises that error itself.
            RuntimeError: on a rank out of step with the master (one of them left an epoch early).

        Example::

            >>> for x, y in it:        # the same batches on every rank
            ...     loss = loss_fn(model(x.to(comm.device)), y.to(comm.device))
        """
        comm, master = self.comm, self.rank_master
        source = None
        skip, self._skip = self._skip, 0
        if not self._resuming:
            self.batches = 0
        self._resuming = False
        while True:
            if comm.rank == master:
                try:
                    if source is None:  # iter() may fail too (a DataLoader whose workers cannot start)
                        # Resuming mid-epoch from a loader without state: read past the batches
                        # taken. The random draws that makes (the loader's seed, a shuffle, an
                        # augmentation) the old run made before its checkpoint, whose random
                        # states were restored: they are undone, not drawn twice.
                        replayed = rng_state() if skip else None
                        source = iter(self.loader)
                        for _ in range(skip):
                            next(source)
                        if replayed is not None:
                            set_rng_state(replayed)
                    batch = next(source)
                    # Pickled here, so that a batch that cannot be pickled is reported like a
                    # failing loader. Tensors go to CPU: a GPU tensor would unpickle onto the
                    # master's GPU index on the receiver.
                    blob = dumps(batch, to_cpu=True) if comm.size > 1 else None
                    self._loader_state = self._position()
                except StopIteration:
                    self._loader_state = self._position()
                    comm.bcast_obj((_STOP, None, self._loader_state, (self.epoch, self.batches)), root=master)
                    self.epoch += 1
                    self.batches = 0
                    return
                except Exception as e:
                    comm.bcast_obj((_ERROR, f"{type(e).__name__}: {e}", None, None), root=master)
                    raise
                comm.bcast_obj((_BATCH, blob, self._loader_state, (self.epoch, self.batches)), root=master)
                self.batches += 1
                yield batch
                continue
            kind, payload, self._loader_state, where = comm.bcast_obj(None, root=master)
            if kind != _ERROR and where != (self.epoch, self.batches):
                raise TorchmnRuntimeError(
                    f"multi-node iterator: rank {comm.rank} is at batch {self.batches} of epoch {self.epoch}, but "
                    f"master rank {master} sent batch {where[1]} of epoch {where[0]}: a rank left a for loop over "
                    f"the iterator early (break) or started one while another was still in the last; every rank "
                    f"must go through each epoch whole, in step with the others")
            if kind == _STOP:
                self.epoch += 1
                self.batches = 0
                return
            if kind == _ERROR:
                raise RemoteRankError(f"multi-node iterator: the loader on master rank {master} failed: "
                                      f"{payload} (raised on rank {comm.rank})")
            self.batches += 1
            yield pickle.loads(payload)


def _claim(loader: Iterable, rank: int) -> tuple:
    """``(problem, length)`` of a rank's loader: its ``len()``, None where it has none."""
    try:
        return None, len(loader)
    except TypeError:
        return None, None  # an IterableDataset's loader may have no length
    except Exception as e:
        return f"len() of the loader on rank {rank} failed: {type(e).__name__}: {e}", None


def create_multi_node_iterator(loader: Optional[Iterable], comm, rank_master: int = 0) -> MultiNodeIterator:
    """Iterate ``loader`` on ``rank_master`` only and hand every rank the same batches.

    For data that cannot be split, e.g. a model-parallel job where every rank needs the same
    input. Batches may be tensors, tuples, lists or dicts of them, nested, or any picklable
    object. The master yields its batches as the loader made them; the other ranks receive them
    with every tensor on CPU. Other ranks may pass ``None`` as ``loader``. Every rank must
    create the iterator together (the master's ``len(loader)`` is shared then, so ``len()``
    works everywhere) and iterate it in step, each epoch to its end (a rank that breaks out early
    leaves the others waiting); each ``for`` loop over it is one epoch, and it ends on every rank
    after the same batch. If the master's loader raises, the master raises that error and the
    other ranks raise :class:`~torchmn.communicators.errors.RemoteRankError`.

    Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
    processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

    Args:
        loader: the iterable to read (a ``DataLoader``, or any iterable of picklable batches) on
            ``rank_master``; other ranks may pass ``None``.
        comm: the communicator whose ranks get the batches.
        rank_master: the rank that reads ``loader``.

    Returns:
        A :class:`MultiNodeIterator`.

    Raises:
        ValueError: ``rank_master`` is not a rank of ``comm``; or, on every rank, the master
            passed ``loader=None`` or ``len()`` of its loader failed.

    Example::

        >>> loader = DataLoader(data, batch_size=32) if comm.rank == 0 else None
        >>> it = torchmn.create_multi_node_iterator(loader, comm)
        >>> for epoch in range(3):
        ...     for x, y in it:
        ...         ...
    """
    return MultiNodeIterator(loader, comm, rank_master)
