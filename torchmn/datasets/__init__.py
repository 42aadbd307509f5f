"""Splitting a dataset among ranks: :func:`scatter_dataset`, :func:`scatter_index`,
:func:`create_empty_dataset`, :class:`TransformDataset` (random augmentation after a scatter), and
the :class:`SharedDataset` marker for datasets every rank can
open itself (those are not copied). In an elastic job a scattered part is an
:class:`ElasticDatasetPart`, which follows the world as ranks leave and join.
"""
from torchmn.datasets.elastic_part import ElasticDatasetPart
from torchmn.datasets.empty import create_empty_dataset
from torchmn.datasets.part import DatasetPart, index_range
from torchmn.datasets.scatter import SharedDataset, is_shared, scatter_dataset, scatter_index
from torchmn.datasets.transform import TransformDataset

__all__ = ["DatasetPart", "ElasticDatasetPart", "SharedDataset", "TransformDataset", "create_empty_dataset",
           "index_range", "is_shared", "scatter_dataset", "scatter_index"]
