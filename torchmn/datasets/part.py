"""One rank's part of a dataset: :class:`DatasetPart`, and the rule that splits indices among
ranks, :func:`index_range`."""
from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

from torch.utils.data import Dataset


class DatasetPart(Dataset):
    """One rank's part of a scattered dataset, as :func:`scatter_dataset` returns it.

    ``indices`` are the positions of its items in root's dataset (after shuffling), so
    ``part[i]`` is ``dataset[part.indices[i]]``. Indexing works as for a list: negative integers
    count from the end, and a slice gives a list of items.

    Args:
        base: the dataset the items are read from: root's dataset, or the samples this rank
            received.
        indices: the positions of the part's items in root's dataset.
        positions: where each item is in ``base``; ``None`` means ``indices`` (``base`` is then
            the whole dataset).

    Example::

        >>> part = torchmn.scatter_dataset(data if comm.rank == 0 else None, comm)
        >>> len(part), part.indices[:3]    # rank 0 of 3, 1000 samples
        (334, [0, 1, 2])
    """

    def __init__(self, base: Any, indices: Sequence[int], positions: Optional[Sequence[int]] = None):
        self.base = base
        self.indices = list(indices)
        self.positions = self.indices if positions is None else list(positions)

    def __len__(self) -> int:
        """The number of items in this rank's part.

        Returns:
            ``len(self.indices)``.

        Example::

            >>> len(DatasetPart(range(10, 20), indices=[3, 4, 5]))
            3
        """
        return len(self.indices)

    def __getitem__(self, i: Any) -> Any:
        """The part's item ``i``, or a list of the items in a slice, as for a list.

        Args:
            i: an integer (negative ones count from the end; numpy and 0-d tensor integers too), or
                a slice.

        Returns:
            The item, read from ``base``; for a slice, a list of items.

        Raises:
            TypeError: ``i`` is neither an integer nor a slice.
            IndexError: ``i`` is out of range (which also ends Python's iteration over the part).

        Example::

            >>> part = DatasetPart(range(10, 20), indices=[3, 4, 5])
            >>> part[-1], part[0:2]
            (15, [13, 14])
        """
        n = len(self.indices)
        if isinstance(i, slice):  # as for a list (and ChainerMN's SubDataset): a list of items
            return [self[j] for j in range(*i.indices(n))]
        i = operator.index(i)  # numpy and 0-d tensor integers too, as samplers may yield them
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"index {i} out of range for a dataset part of length {n}")
        return self.base[self.positions[j]]


def index_range(n_total: int, size: int, rank: int, force_equal_length: bool) -> tuple[int, int]:
    """Rank ``rank``'s share of ``range(n_total)`` among ``size`` ranks, by :func:`scatter_index`'s
    rule, computed locally (no communication).

    Args:
        n_total: the number of indices to split.
        size: the number of ranks.
        rank: the rank whose range is wanted.
        force_equal_length: equal-length, possibly overlapping ranges, or disjoint ones.

    Returns:
        ``(begin, end)``: the rank's half-open range of indices.

    Example::

        >>> [index_range(10, 3, r, False) for r in range(3)]
        [(0, 4), (4, 7), (7, 10)]
        >>> [index_range(10, 3, r, True) for r in range(3)]
        [(0, 4), (3, 7), (6, 10)]
    """
    if force_equal_length:
        n_sub = -(-n_total // size)  # ceil
        begin = n_total * rank // size
        return begin, begin + n_sub
    q, r = divmod(n_total, size)
    begin = rank * q + min(rank, r)
    return begin, begin + q + (1 if rank < r else 0)
