"""The batches of an elastic job's epoch, split anew over whichever ranks are there: :class:`ElasticSampler`."""
from __future__ import annotations

import warnings
from typing import Iterator, List, Sized, Tuple

import torch

from torchmn.errors import TorchmnValueError


class ElasticSampler(torch.utils.data.Sampler):
    """A batch sampler whose epoch goes on over a changing world: each step takes the next
    ``batch_size x comm.size`` samples of the epoch's order, ``batch_size`` per rank; after a
    reset the samples not yet consumed are split over the new world's ranks.

    A batch counts as taken when the loader takes it from the sampler: use it with a loader of
    ``num_workers=0`` (a loader with workers takes batches ahead, and a reset would then skip those
    it had taken beyond the commit).

    Within an epoch no sample is seen twice and none is skipped, across any number of resets: its
    position (``state_dict()``) is part of the :class:`~torchmn.elastic.State` it is given to, so a
    reset goes back to the commit with it. Every rank makes the same number of steps and gets at
    least one sample per step: the epoch's last step takes what is left, split as evenly as it goes
    (a tail too short for every rank joins the step before). The one exception: where a reset
    leaves fewer samples in the epoch than the new world has ranks, the ranks without one repeat
    one of them in that last step. Iterated again after its epoch ended, without ``set_epoch()``
    between, it starts the next epoch (with a warning) rather than an empty one.

    Give it to a ``DataLoader`` as ``batch_sampler`` and to the state as a value::

        sampler = torchmn.elastic.ElasticSampler(dataset, comm, batch_size=64, shuffle=True)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        state = torchmn.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

        @torchmn.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                state.sampler.set_epoch(state.epoch)      # back to its start only in a new epoch
                for x, y in loader:
                    ...
                    state.commit()

    Args:
        dataset: the dataset (its length is used), or its length.
        comm: the communicator (its ``rank`` and ``size`` are read at each new iteration, so
            they are the new world's after a reset).
        batch_size: samples per rank and step.
        shuffle: a new order per epoch (``seed + epoch``), the same on every rank.
        seed: the order's seed.

    Raises:
        ValueError: ``batch_size`` below 1.
    """

    def __init__(self, dataset: Sized | int, comm, batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size < 1:
            raise TorchmnValueError(f"ElasticSampler: batch_size must be at least 1, not {batch_size}")
        self.length = dataset if isinstance(dataset, int) else len(dataset)
        self.comm, self.batch_size, self.shuffle, self.seed = comm, batch_size, shuffle, seed
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's order taken by the steps so far, by every rank
        # This sampler's own iteration ran to the epoch's end, and nothing set a position since:
        # iterating again means the next epoch, where a script forgot set_epoch().
        self._ran_out = False

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: its own order, from its first sample. Setting the epoch it is already
        in keeps its position (a reset that goes back into the middle of an epoch).

        Args:
            epoch: the epoch's number.

        Example::

            >>> sampler.set_epoch(state.epoch)
        """
        self._ran_out = False
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def order(self) -> List[int]:
        """This epoch's order of the dataset's indices.

        Returns:
            The indices, the same on every rank.

        Example::

            >>> sampler.order()[:3]
            [712, 48, 1903]
        """
        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def __iter__(self) -> Iterator[List[int]]:
        if self._ran_out and self.consumed >= self.length:
            # Empty epochs would train on nothing without a word; a position a reset went back to
            # (load_state_dict) is left alone, as its epoch's work is done.
            warnings.warn(f"ElasticSampler: iterated again after epoch {self.epoch} ended, without set_epoch(): "
                          f"starting epoch {self.epoch + 1}. Call sampler.set_epoch(epoch) at the start of each "
                          f"epoch, which also keeps the position a reset goes back to", UserWarning, stacklevel=2)
            self.epoch, self.consumed = self.epoch + 1, 0
        self._ran_out = False
        order = self.order()
        while self.consumed < self.length:
            positions, self.consumed = split_step(self.length, self.consumed, self.batch_size, self.comm.rank,
                                                  self.comm.size)
            yield [order[i] for i in positions]
        self._ran_out = True

    def __len__(self) -> int:
        """The steps left in this epoch at the current world size."""
        steps, at = 0, self.consumed
        while at < self.length:
            at, steps = split_step(self.length, at, self.batch_size, 0, self.comm.size)[1], steps + 1
        return steps

    def state_dict(self) -> dict:
        """Where the epoch is (what a commit keeps).

        Returns:
            ``{"epoch": ..., "consumed": ...}``.

        Example::

            >>> sampler.state_dict()
            {'epoch': 2, 'consumed': 1280}
        """
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        """Go back to a position :meth:`state_dict` gave.

        Args:
            state: what :meth:`state_dict` returned.

        Example::

            >>> sampler.load_state_dict({"epoch": 2, "consumed": 1280})
        """
        self.epoch, self.consumed, self._ran_out = state["epoch"], state["consumed"], False


def split_step(length: int, start: int, batch_size: int, rank: int, size: int) -> Tuple[List[int], int]:
    """One step of an epoch shared by a changing world: rank ``rank``'s positions among the next
    ``batch_size x size`` of ``length``, from ``start``, and where the next step starts.

    The epoch's last step takes what is left, split as evenly as it goes (a tail too short to give
    every rank a sample joins the step before); where fewer positions are left than ranks, the
    ranks without one repeat one (an empty batch cannot be collated).

    Args:
        length: the positions of the epoch (``range(length)``).
        start: the first position the step takes.
        batch_size: positions per rank in a full step.
        rank: the rank whose positions are wanted.
        size: the world's size.

    Returns:
        ``(positions, end)``: this rank's positions and the start of the next step.

    Example::

        >>> [split_step(10, 0, 2, r, 3) for r in range(3)]
        [([0, 1], 6), ([2, 3], 6), ([4, 5], 6)]
        >>> [split_step(10, 6, 2, r, 3)[0] for r in range(3)]   # 4 left: the last step
        [[6, 7], [8], [9]]
    """
    end = start + batch_size * size
    if length - end < size:
        end = length
    chunk = list(range(start, end))
    if len(chunk) < size:
        chunk = [chunk[i % len(chunk)] for i in range(size)]
    # As even as it goes: the first len(chunk) % size ranks take one more.
    share, extra = divmod(len(chunk), size)
    first = rank * share + min(rank, extra)
    return chunk[first:first + share + (rank < extra)], end
