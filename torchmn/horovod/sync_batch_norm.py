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
        """The layer over the communicator ``hvd.init()`` made (the job's global process set).

        Args:
            num_features: the number of channels ``C`` of an input ``(N, C, ...)``.
            eps: added to the variance, for numerical stability.
            momentum: the weight of a batch's statistics in the running ones (None: their plain mean).
            affine: learn a scale and a shift per channel.
            track_running_stats: keep running statistics, used in evaluation.

        Raises:
            InvalidCallError: before ``hvd.init()`` (a ``ValueError``).

        Example::

            >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), hvd.SyncBatchNorm(64), torch.nn.ReLU())
        """
        super().__init__(num_features, eps, momentum, affine, track_running_stats, comm=require_comm())
