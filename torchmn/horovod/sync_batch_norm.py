"""``hvd.SyncBatchNorm``: batch normalization over every rank's batch, on CPU too."""
from __future__ import annotations

from torchmn.horovod.process_sets import require_comm
from torchmn.nn import MultiNodeBatchNorm


class SyncBatchNorm(MultiNodeBatchNorm):
    """Horovod's ``SyncBatchNorm``: torchmn's :class:`~torchmn.nn.MultiNodeBatchNorm` over the
    job's ranks (any input of two or more dimensions; CPU and GPU).

    Args:
        num_features, eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm1d``.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``).

    Example::

        >>> bn = hvd.SyncBatchNorm(64)
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, comm=require_comm())
