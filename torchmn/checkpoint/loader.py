"""``ResumableLoader``: a DataLoader whose position goes into a checkpoint and comes back exactly.

Each epoch's order is a function of the seed and the epoch alone, and a resumed epoch starts
after the batches already taken by cutting the order (no batch is read to be skipped). The
DataLoader draws its workers' seeds from a generator of its own, seeded the same way, so resuming
neither consumes nor depends on the global RNG. torchdata's ``StatefulDataLoader`` does not serve
here: in torchdata 0.11 a resume with ``num_workers=0`` (or with a sampler of the user's) continues
in another order (meta-pytorch/data#1437 and later reports).
"""
from __future__ import annotations

from typing import Any, Iterator, List

import torch

from torchmn.datasets.elastic_part import ElasticDatasetPart
from torchmn.elastic.sampler import split_step
from torchmn.errors import TorchmnValueError

# Mixes the epoch into the seed so that neighbouring seeds do not share orders.
_EPOCH_STRIDE = 1_000_003


class ResumableLoader:
    """Batches of ``dataset`` in a seeded order per epoch, with a position to checkpoint.

    A drop-in for ``torch.utils.data.DataLoader(dataset, batch_size, shuffle=...)`` in a loop
    that :class:`~torchmn.checkpoint.Checkpointer` saves: give it to the Checkpointer, and after
    ``load_latest()`` the next ``for`` loop over it continues the interrupted epoch with the
    next batch, and later epochs follow in the same orders as an uninterrupted run. Each ``for``
    loop over it is one epoch (or the rest of one).

    In an elastic job (``torchmn run --min-np ...``), over the part
    :func:`torchmn.scatter_dataset` returns there (an
    :class:`~torchmn.datasets.ElasticDatasetPart`), it goes on with the rest of an epoch when the
    world changes: give it to the :class:`~torchmn.elastic.State`, and after a reset the samples
    the old world's ranks had not yet taken in the epoch (as of the last commit) are split over the
    new world, each step taking the next ``batch_size`` per rank (the epoch's last step takes
    what is left, ``drop_last`` or not). So within an epoch no sample is taken twice and none is
    skipped, beyond the few samples that neighbouring parts share with ``force_equal_length=True``
    (as without a reset). The next epoch splits the whole dataset over the world of the moment.
    While the world does not change it takes the same batches as in any job.

    Args:
        dataset: a map-style dataset (this rank's part of the data, e.g. from
            :func:`torchmn.scatter_dataset`).
        batch_size: samples per batch.
        shuffle: a new order each epoch (from ``seed`` and the epoch) rather than dataset order.
        seed: the seed of the orders; ranks reading different parts may share it.
        drop_last: leave out the last incomplete batch of an epoch.
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``collate_fn``,
            ``pin_memory``, ...), except ``sampler``, ``batch_sampler``, ``generator`` and
            ``persistent_workers``, which it sets itself.

    Attributes:
        epoch: epochs finished.
        batches: batches taken in the epoch under way.
        world: in an elastic job, the number of ranks the epoch's parts were split for.
        rest: in an elastic job, after the world changed mid-epoch, the epoch's samples (indices
            into the whole dataset) not yet taken then; otherwise None.
        consumed: how many of ``rest`` the steps since have taken.

    Raises:
        ValueError: an argument it sets itself is given, or ``batch_size < 1``.

    Example::

        >>> loader = torchmn.checkpoint.ResumableLoader(train, batch_size=64, shuffle=True, seed=0)
        >>> ckpt = torchmn.checkpoint.Checkpointer("ckpt", comm, model=model, optimizer=opt, loader=loader)
        >>> ckpt.load_latest()
        >>> for x, y in loader:      # continues where the checkpoint was taken
        ...     ...
    """

    def __init__(self, dataset: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, **loader_kwargs: Any):
        taken = sorted({"sampler", "batch_sampler", "generator", "persistent_workers", "shuffle"} & set(loader_kwargs))
        if taken:
            raise TorchmnValueError(f"ResumableLoader sets {', '.join(taken)} itself (its order must come back on a "
                                    f"resume); leave them out")
        if int(batch_size) != batch_size or batch_size < 1:
            raise TorchmnValueError(f"ResumableLoader: batch_size={batch_size!r} must be a positive integer")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.loader_kwargs = loader_kwargs
        self.epoch = 0
        self.batches = 0
        self.world = None
        self.rest = None
        self.consumed = 0

    def __len__(self) -> int:
        """Batches in a whole epoch (not what is left of the epoch under way).

        Returns:
            ``len(dataset) / batch_size``, rounded up, or down with ``drop_last=True``.

        Example::

            >>> len(torchmn.checkpoint.ResumableLoader(list(range(10)), batch_size=4))
            3
        """
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _generator(self) -> torch.Generator:
        # Modulo 2^64, as torch's generator takes a negative seed: any int seed works, and every seed
        # that fitted before keeps its orders.
        return torch.Generator().manual_seed((self.seed * _EPOCH_STRIDE + self.epoch) % 2**64)

    def __iter__(self) -> Iterator[Any]:
        """The epoch under way, from its next batch.

        Each batch taken counts in :attr:`batches`; once the epoch is over, :attr:`epoch` goes
        up by one and :attr:`batches` back to 0. A loop left early (``break``) leaves the
        position after the last batch taken, and the next loop continues from there.

        Yields:
            Batches, as ``DataLoader`` makes them.

        Example::

            >>> for x, y in loader:
            ...     train_one_step(x, y)
        """
        if isinstance(self.dataset, ElasticDatasetPart):
            yield from self._elastic_epoch()
            return
        start = self.batches * self.batch_size
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size,
                                             sampler=self._order(len(self.dataset))[start:],
                                             drop_last=self.drop_last, generator=self._generator(),
                                             **self.loader_kwargs)
        for batch in loader:
            self.batches += 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def _order(self, n: int) -> List[int]:
        """The epoch's order of ``n`` items: a function of the seed and the epoch alone."""
        return torch.randperm(n, generator=self._generator()).tolist() if self.shuffle else list(range(n))

    def _sequence(self, rank: int, size: int) -> List[int]:
        """Rank ``rank``'s order of the epoch, as indices into the whole dataset, where the parts are
        split for ``size`` ranks: the same samples, in the same order, as the plain loop takes."""
        part = self.dataset.part_of(rank, size)
        return [part[i] for i in self._order(len(part))]

    def _elastic_epoch(self) -> Iterator[Any]:
        """The epoch under way over an elastic job's part: the rank's own part while the world is
        the one the epoch started in, else the next steps of the rest of the epoch."""
        comm = self.dataset.comm
        rank, size = comm.rank, comm.size
        if self.world is None:
            self.world = size
        if self.rest is None and size != self.world:
            if self.batches:
                # Every rank of the old world took the same number of batches: the rest of each
                # one's order, which every rank can compute, is what the epoch has left.
                taken = self.batches * self.batch_size
                self.rest = torch.tensor([i for r in range(self.world) for i in self._sequence(r, self.world)[taken:]],
                                         dtype=torch.int64)
                self.consumed = 0
            self.world = size
        whole = self.dataset.whole
        if self.rest is None:
            ends = None
            loader = torch.utils.data.DataLoader(
                whole, batch_size=self.batch_size, sampler=self._sequence(rank, size)[self.batches * self.batch_size:],
                drop_last=self.drop_last, generator=self._generator(), **self.loader_kwargs)
        else:
            rest, steps, ends, at = self.rest.tolist(), [], [], self.consumed
            while at < len(rest):
                positions, at = split_step(len(rest), at, self.batch_size, rank, size)
                steps.append([rest[p] for p in positions])
                ends.append(at)
            loader = torch.utils.data.DataLoader(whole, batch_sampler=steps, generator=self._generator(),
                                                 **self.loader_kwargs)
        for k, batch in enumerate(loader):
            self.batches += 1
            if ends is not None:
                self.consumed = ends[k]
            yield batch
        self.epoch += 1
        self.batches = 0
        self.rest, self.consumed, self.world = None, 0, size

    def _samples(self) -> int:
        """The samples the position is taken over: the whole dataset's for an elastic job's part
        (whose own length changes with the world), else the dataset's."""
        if isinstance(self.dataset, ElasticDatasetPart):
            return len(self.dataset.order)
        return len(self.dataset)

    def state_dict(self) -> dict:
        """The position.

        Returns:
            ``{"epoch": epochs finished, "batches": batches taken in the epoch under way,
            "seed": the seed, "samples": len(dataset), "batch_size", "shuffle"}``; over an elastic job's part, ``samples``
            counts the whole dataset, and ``world``, ``rest`` and ``consumed`` (the attributes)
            come too.

        Example::

            >>> loader.state_dict()
            {'epoch': 2, 'batches': 17, 'seed': 0, 'samples': 50000, 'batch_size': 64, 'shuffle': True}
        """
        state = {"epoch": self.epoch, "batches": self.batches, "seed": self.seed, "samples": self._samples(),
                 "batch_size": self.batch_size, "shuffle": self.shuffle}
        if isinstance(self.dataset, ElasticDatasetPart):
            state.update(world=self.world, rest=self.rest, consumed=self.consumed)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position of :meth:`state_dict`.

        Args:
            state: the position.

        Raises:
            ValueError: it was taken over a dataset of another size, or with another seed, batch
                size or shuffle: the batches taken would not be the ones it skips.

        Example::

            >>> loader.load_state_dict(saved)
            >>> for x, y in loader:      # from the batch after the last one taken before the save
            ...     ...
        """
        if state["samples"] != self._samples() or state["seed"] != self.seed:
            raise TorchmnValueError(
                f"ResumableLoader: the position was taken over {state['samples']} samples with seed "
                f"{state['seed']}; this loader has {self._samples()} samples and seed {self.seed}")
        # Positions saved before these were kept say nothing of them: taken as this loader's.
        other = {k: (state[k], v) for k, v in (("batch_size", self.batch_size), ("shuffle", self.shuffle))
                 if state.get(k, v) != v}
        if other and state["batches"]:
            raise TorchmnValueError(
                "ResumableLoader: the position was taken with " + ", ".join(f"{k}={a}" for k, (a, _) in other.items())
                + "; this loader has " + ", ".join(f"{k}={b}" for k, (_, b) in other.items()) + ", so the batches it "
                f"skips would not be those taken ({state['batches']} in epoch {state['epoch']}). Resume with the same "
                f"values, or at an epoch's start (a checkpoint saved at the end of an epoch)")
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])
        self.world = state.get("world")
        self.rest = state.get("rest")
        self.consumed = int(state.get("consumed", 0))
