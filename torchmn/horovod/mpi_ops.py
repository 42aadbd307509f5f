"""``horovod.torch.mpi_ops``'s names, for scripts that import them from there
(``from horovod.torch.mpi_ops import synchronize, Sum``): the same objects as ``torchmn.horovod``'s.

Example::

    >>> from torchmn.horovod.mpi_ops import allreduce_async, synchronize, Sum
    >>> total = synchronize(allreduce_async(torch.ones(2), op=Sum))
"""
from torchmn.horovod import (  # the package's own objects: one set of names, two import paths
    Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet, Sum, add_process_set, allgather,
    allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
    broadcast, broadcast_, broadcast_async, broadcast_async_, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
    global_process_set, gloo_built, gloo_enabled, grouped_allgather, grouped_allgather_async, grouped_allreduce,
    grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
    grouped_reducescatter_async, handle_average_backwards_compatibility, init, is_homogeneous, is_initialized, join,
    local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, poll, rank, reducescatter,
    reducescatter_async, remove_process_set, rocm_built, shutdown, size, sparse_allreduce_async, synchronize)

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set",
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "handle_average_backwards_compatibility", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
    "synchronize",
]
