"""A rank's part of a dataset scattered in an elastic job, which follows the world as ranks leave
and join: :class:`ElasticDatasetPart`."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from torchmn.datasets.part import DatasetPart, index_range
from torchmn.datasets.transfer import TAG, receive_samples, send_samples
from torchmn.elastic import membership
from torchmn.elastic.errors import StateLostError
from torchmn.errors import TorchmnRuntimeError


class ElasticDatasetPart(DatasetPart):
    """This rank's part of a dataset that :func:`~torchmn.datasets.scatter_dataset` split in an
    elastic job (``torchmn run --min-np ...``): the same split as in any job, but made anew for
    the world of the moment, so that after a reset the ranks left (and those that joined) share the
    whole dataset again.

    For that every rank keeps the whole dataset: the samples, which root sends every rank once,
    or, for a :class:`~torchmn.datasets.SharedDataset`, the dataset object. A rank that joins a
    running job receives them from a rank that has them when its ``@torchmn.elastic.run``
    function starts, with the training state; until then its part has no length.

    :class:`~torchmn.checkpoint.ResumableLoader` over such a part goes on with the rest of an
    epoch after a reset: the samples the ranks had not yet taken are split over the new world.

    Args:
        whole: the whole dataset, indexed by root's indices (None on a rank that joined and has
            not yet received it).
        order: root's (shuffled) order of the indices, the same on every rank.
        comm: the communicator whose rank and size choose the part.
        force_equal_length: the split rule of :func:`~torchmn.datasets.scatter_index`.
        shared: the dataset is a ``SharedDataset`` (ranks hand on the object, not the samples).
        max_buf_len: the most pickled bytes in one chunk when the samples are handed on.

    Attributes:
        whole: the whole dataset on this rank.
        order: root's order of the indices.
        comm: the communicator.

    Example::

        >>> part = torchmn.scatter_dataset(train if comm.rank == 0 else None, comm)   # elastic job
        >>> len(part), comm.size
        (334, 3)
        >>> len(part), comm.size      # after a rank was lost
        (500, 2)
    """

    def __init__(self, whole: Any, order: Optional[Sequence[int]], comm, force_equal_length: bool, shared: bool,
                 max_buf_len: int):
        self.whole = whole
        self.order = None if order is None else list(order)
        self.comm = comm
        self.force_equal_length = force_equal_length
        self.shared = shared
        self.max_buf_len = max_buf_len
        self._cached: tuple = (None, None, [])
        membership.follow(self)

    @property
    def ready(self) -> bool:
        """Whether this rank holds the dataset (False on a rank that joined, until its run function
        starts)."""
        return self.whole is not None

    @property
    def base(self) -> Any:
        """The dataset items are read from: the whole dataset.

        Raises:
            RuntimeError: this rank joined the job and has not yet received it.
        """
        self._check_ready()
        return self.whole

    @property
    def indices(self) -> List[int]:
        """The positions of this rank's items in root's dataset, for the current world.

        Raises:
            RuntimeError: this rank joined the job and has not yet received the dataset.
        """
        self._check_ready()
        rank, size = self.comm.rank, self.comm.size
        if self._cached[:2] != (rank, size):
            self._cached = (rank, size, self.part_of(rank, size))
        return self._cached[2]

    @property
    def positions(self) -> List[int]:
        """Where each item is in :attr:`base`: :attr:`indices`, since ``base`` is the whole dataset."""
        return self.indices

    def part_of(self, rank: int, size: int) -> List[int]:
        """Rank ``rank``'s part of root's order in a world of ``size`` ranks.

        Args:
            rank: the rank.
            size: the world's size.

        Returns:
            The indices into the whole dataset, as ``scatter_dataset`` splits them.

        Example::

            >>> part.part_of(1, 2)[:3]
            [817, 4, 2290]
        """
        self._check_ready()
        return self.order[slice(*index_range(len(self.order), size, rank, self.force_equal_length))]

    def follow_world(self) -> None:
        """Hand the dataset to the ranks of a new world that lack it (collective: every rank calls
        it, at the start of each ``@torchmn.elastic.run`` call, before the state's sync). The first
        rank that holds it sends it to each rank that joined.

        Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
        processes you trust (see ``docs/security.md``).

        Raises:
            StateLostError: no rank of the new world holds the dataset (every rank that did was
                lost while the others waited to join).
            RemoteRankError: the rank handing it on failed to read or pickle a sample.

        Example::

            >>> part.follow_world()
        """
        comm = self.comm
        have = comm.allgather_obj(self.ready) if comm.size > 1 else [self.ready]
        lacking = [r for r, held in enumerate(have) if not held]
        if not lacking:
            return
        if len(lacking) == len(have):
            raise StateLostError(f"rank {comm.rank}/{comm.size}: no rank of this world holds the scattered dataset "
                                 f"(every rank that did was lost while these waited to join); start the job again "
                                 f"from the newest checkpoint")
        giver = have.index(True)
        if comm.rank == giver:
            for r in lacking:
                self._give(r)
        elif comm.rank in lacking:
            self._receive(giver)

    def _give(self, dest: int) -> None:
        comm = self.comm
        if self.shared:
            comm.send_obj(("shared", (self.whole, self.order)), dest, tag=TAG)
            return
        comm.send_obj(("copied", self.order), dest, tag=TAG)
        send_samples(lambda m: comm.send_obj(m, dest, tag=TAG), self.whole, range(len(self.whole)), self.max_buf_len)

    def _receive(self, giver: int) -> None:
        comm = self.comm
        kind, payload = comm.recv_obj(giver, tag=TAG)
        if kind == "shared":
            self.whole, self.order = payload
            return
        _, samples = receive_samples(lambda: comm.recv_obj(giver, tag=TAG), "scatter_dataset", f"rank {giver}",
                                     comm.rank)
        self.whole, self.order = samples, payload

    def _check_ready(self) -> None:
        if self.whole is None:
            raise TorchmnRuntimeError(
                f"rank {self.comm.rank}: this rank joined a running elastic job, and its part of the scattered "
                f"dataset arrives from the other ranks with the training state, when the @torchmn.elastic.run "
                f"function starts; use the part (len(), items, a loader over it) inside that function")
