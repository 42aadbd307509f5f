"""A transform applied at each read: :class:`TransformDataset`, the place for random augmentation
after :func:`~torchmn.datasets.scatter_dataset` (which copies each sample to its rank once)."""
from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import Dataset


class TransformDataset(Dataset):
    """A dataset whose item ``i`` is ``transform(dataset[i])``, computed at every read, as Chainer's
    ``TransformDataset``: scatter the dataset without its random transform, then wrap each rank's
    part, so that every rank draws a new augmentation in every epoch (a sample copied to a rank
    holds the one draw made when root read it).

    Args:
        dataset: what the items are read from (a rank's part, say).
        transform: a function of one item; it may draw random numbers.

    Example::

        >>> train = torchmn.scatter_dataset(MNIST(path) if comm.rank == 0 else None, comm)
        >>> train = TransformDataset(train, lambda s: (augment(s[0]), s[1]))
    """

    def __init__(self, dataset: Any, transform: Callable[[Any], Any]):
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        """The number of items, ``len(dataset)``.

        Returns:
            The length.

        Example::

            >>> len(TransformDataset([1, 2, 3], str))
            3
        """
        return len(self.dataset)

    def __getitem__(self, i: Any) -> Any:
        """``transform(dataset[i])``; a list of transformed items for a slice.

        Args:
            i: an index, or a slice.

        Returns:
            The transformed item(s).

        Example::

            >>> TransformDataset([1, 2, 3], str)[0], TransformDataset([1, 2, 3], str)[1:]
            ('1', ['2', '3'])
        """
        if isinstance(i, slice):  # item by item: a dataset's own slice may be columns (TensorDataset) or refused
            return [self.transform(self.dataset[k]) for k in range(*i.indices(len(self)))]
        return self.transform(self.dataset[i])
