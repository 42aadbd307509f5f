"""Splitting a dataset among ranks: :func:`scatter_dataset`, :func:`scatter_index`,
:func:`create_empty_dataset`, and the :class:`SharedDataset` marker for datasets every rank can
open itself (those are not copied).
"""
from torchmn.datasets.empty import create_empty_dataset
from torchmn.datasets.scatter import DatasetPart, SharedDataset, is_shared, scatter_dataset, scatter_index

__all__ = ["DatasetPart", "SharedDataset", "create_empty_dataset", "is_shared", "scatter_dataset",
           "scatter_index"]
