"""``hvd.SyncBatchNorm``: batch normalization over every rank's batch, on CPU too."""
from __future__ import annotations

from torchmn.horovod.errors import InvalidCallError
from torchmn.horovod.process_sets import require_comm
from torchmn.nn import MultiNodeBatchNorm


class SyncBatchNorm(MultiNodeBatchNorm):
    """Horovod's ``SyncBatchNorm``: torchmn's :class:`~torchmn.nn.MultiNodeBatchNorm` over the
    job's ranks (any input of two or more dimensions; CPU and GPU).

    As Horovod's, the layer holds no communicator: it uses the one ``hvd.init()`` made when it
    normalizes a batch, so it can be built before ``hvd.init()``, deep-copied (an EMA of the
    model) and pickled with the model (``torch.save(model)``). It is a
    ``torch.nn.modules.batchnorm._BatchNorm``, as Horovod's is.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm1d``.

    Raises:
        InvalidCallError: (forward in training) before ``hvd.init()`` (a ``ValueError``).

    Example::

        >>> bn = hvd.SyncBatchNorm(64)
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, comm=None)

    @property
    def comm(self):
        """The communicator of ``hvd.init()``, looked up at each use.

        Returns:
            The job's communicator.

        Raises:
            InvalidCallError: before ``hvd.init()`` (a ``ValueError``).

        Example::

            >>> hvd.SyncBatchNorm(8).comm.size == hvd.size()
            True
        """
        return require_comm()

    @comm.setter
    def comm(self, value) -> None:
        # MultiNodeBatchNorm's constructor stores the communicator it is given; this layer is given
        # None and always uses hvd.init()'s.
        if value is not None:
            raise InvalidCallError("hvd.SyncBatchNorm uses the communicator of hvd.init(); it takes no other")
