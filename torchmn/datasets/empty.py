"""A placeholder dataset: the right length, nothing inside."""
from __future__ import annotations

import operator
from typing import Any

from torch.utils.data import Dataset

from torchmn.errors import TorchmnTypeError


class EmptyDataset(Dataset):
    """``n`` items, each an empty tuple; :func:`create_empty_dataset` makes one.

    Indexing works as for a list of empty tuples: integers (negative ones count from the end, and
    numpy or 0-d tensor integers are accepted) give ``()``, slices give a list.

    Args:
        n: the number of items.

    Example::

        >>> empty = torchmn.datasets.empty.EmptyDataset(2)
        >>> empty[-1], empty[0:2]
        ((), [(), ()])
    """

    def __init__(self, n: int):
        self._n = int(n)

    def __len__(self) -> int:
        """The number of items.

        Returns:
            ``n``, as given.

        Example::

            >>> len(torchmn.create_empty_dataset(range(3)))
            3
        """
        return self._n

    def __getitem__(self, i: Any) -> Any:
        """The item at ``i``, or a list of the items in a slice, as for a list of empty tuples.

        Args:
            i: an integer (negative ones count from the end; numpy and 0-d tensor integers too), or
                a slice.

        Returns:
            ``()`` for an integer; for a slice, a list of as many ``()`` as it selects.

        Raises:
            TypeError: ``i`` is neither an integer nor a slice.
            IndexError: ``i`` is out of range (which also ends Python's iteration over the dataset).

        Example::

            >>> empty = torchmn.datasets.empty.EmptyDataset(2)
            >>> empty[-1], empty[0:2], empty[torch.tensor(1)]
            ((), [(), ()], ())
        """
        if isinstance(i, slice):  # ChainerMN's empty dataset is a list: slicing gives a list
            return [()] * len(range(*i.indices(self._n)))
        try:
            i = operator.index(i)  # numpy and 0-d tensor integers too, as samplers may yield them
        except TypeError:
            raise TorchmnTypeError(f"EmptyDataset indices must be integers or slices, not {type(i).__name__}") from None
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            # IndexError ends Python's legacy iteration protocol, as for lists.
            raise IndexError(f"index {i} out of range for an EmptyDataset of length {self._n}")
        return ()


def create_empty_dataset(dataset) -> EmptyDataset:
    """A dataset as long as ``dataset`` whose items are empty tuples (ChainerMN's helper).

    Useful for ranks that must step through the same number of iterations as the others without
    reading any data, e.g. the non-input stages of a model-parallel pipeline.

    Args:
        dataset: anything with ``len()``; only its length is used.

    Returns:
        An :class:`EmptyDataset` of ``len(dataset)`` items.

    Example::

        >>> empty = torchmn.create_empty_dataset(range(3))
        >>> len(empty), empty[0]
        (3, ())
    """
    return EmptyDataset(len(dataset))
