"""``ResumableLoader``: a DataLoader whose position goes into a checkpoint and comes back exactly.

Each epoch's order is a function of the seed and the epoch alone, and a resumed epoch starts
after the batches already taken by cutting the order (no batch is read to be skipped). The
DataLoader draws its workers' seeds from a generator of its own, seeded the same way, so resuming
neither consumes nor depends on the global RNG. torchdata's ``StatefulDataLoader`` does not serve
here: in torchdata 0.11 a resume with ``num_workers=0`` (or with a sampler of the user's) continues
in another order (meta-pytorch/data#1437 and later reports).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

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
        return torch.Generator().manual_seed(self.seed * _EPOCH_STRIDE + self.epoch)

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
        n = len(self.dataset)
        order = torch.randperm(n, generator=self._generator()) if self.shuffle else torch.arange(n)
        start = self.batches * self.batch_size
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size, sampler=order[start:].tolist(),
                                             drop_last=self.drop_last, generator=self._generator(),
                                             **self.loader_kwargs)
        for batch in loader:
            self.batches += 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict:
        """The position.

        Returns:
            ``{"epoch": epochs finished, "batches": batches taken in the epoch under way,
            "seed": the seed, "samples": len(dataset)}``.

        Example::

            >>> loader.state_dict()
            {'epoch': 2, 'batches': 17, 'seed': 0, 'samples': 50000}
        """
        return {"epoch": self.epoch, "batches": self.batches, "seed": self.seed, "samples": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position of :meth:`state_dict`.

        Args:
            state: the position.

        Raises:
            ValueError: it was taken over a dataset of another size, or with another seed.

        Example::

            >>> loader.load_state_dict(saved)
            >>> for x, y in loader:      # from the batch after the last one taken before the save
            ...     ...
        """
        if state["samples"] != len(self.dataset) or state["seed"] != self.seed:
            raise TorchmnValueError(
                f"ResumableLoader: the position was taken over {state['samples']} samples with seed "
                f"{state['seed']}; this loader has {len(self.dataset)} samples and seed {self.seed}")
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])
