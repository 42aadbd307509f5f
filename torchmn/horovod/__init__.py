"""Horovod's PyTorch API on torchmn: ``import torchmn.horovod as hvd`` runs a ``horovod.torch``
script unchanged but for that line.

The ranks are torchmn's communicator's; gradients are averaged by torchmn's multi-node optimizer;
the collectives are the communicator's checked ones, so a mismatch raises on every rank, naming
each rank, its host and its shape, and a rank that never calls is named after ``TORCHMN_TIMEOUT``. ``docs/coming-from-horovod.md`` lists every
name with its status.

Example::

    >>> import torchmn.horovod as hvd
    >>> hvd.init()
    >>> optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
"""
import importlib

from torchmn.horovod.allreduce_collectives import (allreduce, allreduce_, allreduce_async, allreduce_async_,
                                                   grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                                                   grouped_allreduce_async_)
from torchmn.horovod.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                    init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                                    mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)
from torchmn.horovod.compression import Compression
from torchmn.horovod.coordination import join
from torchmn.horovod.errors import HorovodInternalError
from torchmn.horovod.exchange_collectives import (allgather, allgather_async, alltoall, alltoall_async, broadcast,
                                                  broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                                                  grouped_allgather_async, grouped_reducescatter,
                                                  grouped_reducescatter_async, reducescatter, reducescatter_async,
                                                  sparse_allreduce_async)
from torchmn.horovod.functions import (allgather_object, barrier, broadcast_object, broadcast_optimizer_state,
                                       broadcast_parameters)
from torchmn.horovod.handles import poll, synchronize
from torchmn.horovod.optimizer import DistributedOptimizer
from torchmn.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from torchmn.horovod.reduction_ops import (Adasum, Average, Max, Min, Product, Sum,
                                           handle_average_backwards_compatibility)
from torchmn.horovod.sync_batch_norm import SyncBatchNorm
from torchmn.horovod.timeline import start_timeline, stop_timeline


def __getattr__(name):
    """Answer for the names this module does not define, as Python asks for them.

    ``hvd.elastic`` is imported where a script first uses it, as Horovod's subpackage is.

    Args:
        name: the attribute asked for.

    Returns:
        The ``torchmn.horovod.elastic`` module for ``"elastic"``.

    Raises:
        AttributeError: any other name.

    Example::

        >>> hvd.elastic.run(train)
    """
    if name == "elastic":
        return importlib.import_module("torchmn.horovod.elastic")
    raise AttributeError(f"module 'torchmn.horovod' has no attribute {name!r}")


__all__ = ["Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
           "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set", "allgather", "allgather_async",
           "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
           "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
           "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "global_process_set",
           "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
           "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
           "grouped_reducescatter_async", "handle_average_backwards_compatibility", "init", "is_homogeneous",
           "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
           "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built",
           "shutdown", "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize"]
