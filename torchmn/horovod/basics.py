"""The job torchmn.horovod runs in: ``init``, the ranks, what is built, and the reduction ops."""
from __future__ import annotations

import atexit
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from torchmn.errors import TorchmnError

# Horovod's reduction ops, with Horovod's values.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class HorovodInternalError(TorchmnError, RuntimeError):
    """A collective cannot run: a rank that called ``hvd.join()`` cannot take part in it (Horovod's
    error of that name; Horovod also raises it when a peer leaves).

    Example::

        >>> try:
        ...     hvd.allgather(x)            # while another rank has joined
        ... except hvd.HorovodInternalError as e:
        ...     print(e)
    """


class _Job:
    """The communicator of the job, once :func:`init` made it."""

    comm = None
    world = None       # every rank of the job (``comm`` is the part ``init(comm=[...])`` chose)
    owns_comm = False
    solo = None  # a world of one, for the ranks a process set leaves out


job = _Job()


def require_comm():
    """The job's communicator.

    Returns:
        The communicator ``init`` made (the ranks the job's global process set holds).

    Raises:
        ValueError: before :func:`init`, with Horovod's message.
    """
    if job.comm is None:
        raise ValueError(NOT_INITIALIZED)
    return job.comm


def init(comm=None, process_sets=None) -> None:
    """Join the job: ``torchmn.create_communicator()``, and the process sets given.

    Args:
        comm: as Horovod's: None (every rank) or a list of ranks (those ranks form the job's
            global process set). An ``mpi4py`` communicator is not taken: torchmn does not run
            on MPI's communicators (start the job with ``mpirun`` and leave ``comm`` out).
        process_sets: ProcessSets to register now, or ``"dynamic"`` (torchmn always allows
            adding them later).

    Raises:
        NotImplementedError: an ``mpi4py`` communicator as ``comm``.
        ValueError: a duplicate process set.

    Example::

        >>> import torchmn.horovod as hvd
        >>> hvd.init()
        >>> hvd.rank(), hvd.size()
    """
    from torchmn.horovod import process_sets as ps_module, timeline
    import torchmn

    if job.comm is not None:
        return
    if comm is not None and not isinstance(comm, (list, tuple, range)):
        raise NotImplementedError(f"hvd.init(comm=<{type(comm).__name__}>): torchmn.horovod takes a list of ranks "
                                  f"as comm, not an mpi4py communicator (it does not run on MPI's communicators: "
                                  f"start the job with mpirun and leave comm out)")
    world = torchmn.create_communicator()
    job.owns_comm = True
    job.solo = torchmn.communicators.make_communicator("naive", rank=0, size=1, group=None, obj_group=None,
                                                       backend=world.backend, node_key=0)
    if comm is not None and sorted(comm) != list(range(world.size)):
        members = sorted(comm)
        sub = world.split(color=0 if world.rank in members else 1, key=world.rank)
        job.world = world
        job.comm = sub if world.rank in members else job.solo
    else:
        job.world = world
        job.comm = world
    ps_module.register_global(job.comm)
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', not {process_sets!r}")
    elif process_sets:
        for index, ps in enumerate(process_sets):
            if ps in process_sets[:index]:
                raise ValueError(f"Horovod could not be initialized because process_sets entry number {index} is "
                                 f"a duplicate: {ps}")
            ps_module.add_process_set(ps)
    path = os.environ.get("HOROVOD_TIMELINE")
    if path and path.upper() != "DYNAMIC":
        timeline.start_timeline(path)
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the job: write the timeline if one runs, and tear down what :func:`init` set up.

    Example::

        >>> hvd.shutdown()
    """
    from torchmn.horovod import handles, process_sets as ps_module, timeline

    if job.comm is None:
        return
    handles.drain()
    handles.forget()
    if timeline.recording():
        timeline.stop_timeline()
    ps_module.forget_all()
    world = job.world
    job.comm = job.world = None
    if job.owns_comm:
        world.finalize()


def is_initialized() -> bool:
    """Returns: whether :func:`init` has run (and :func:`shutdown` not since).

    Example::

        >>> hvd.is_initialized()
    """
    return job.comm is not None


def rank() -> int:
    """Returns: this process's rank in the job.

    Example::

        >>> hvd.rank()
    """
    return require_comm().rank


def size() -> int:
    """Returns: the number of ranks in the job.

    Example::

        >>> hvd.size()
    """
    return require_comm().size


def local_rank() -> int:
    """Returns: this process's rank among the job's ranks on its node.

    Example::

        >>> torch.cuda.set_device(hvd.local_rank())
    """
    return require_comm().intra_rank


def local_size() -> int:
    """Returns: the number of the job's ranks on this node.

    Example::

        >>> hvd.local_size()
    """
    return require_comm().intra_size


def cross_rank() -> int:
    """Returns: this node's index among the job's nodes.

    Example::

        >>> hvd.cross_rank()
    """
    return require_comm().inter_rank


def cross_size() -> int:
    """Returns: the number of nodes with a rank of this local rank (the nodes, on a homogeneous job).

    Example::

        >>> hvd.cross_size()
    """
    comm = require_comm()
    per_node = comm.allgather_obj(comm.intra_rank) if comm.size > 1 else [0]
    return sum(1 for node in range(comm.inter_size) if comm.intra_rank in
               [per_node[r] for r in range(comm.size) if comm.node_of(r) == node])


def is_homogeneous() -> bool:
    """Returns: whether every node runs as many of the job's ranks.

    Example::

        >>> hvd.is_homogeneous()
    """
    comm = require_comm()
    counts = [sum(1 for r in range(comm.size) if comm.node_of(r) == node) for node in range(comm.inter_size)]
    return len(set(counts)) == 1


def mpi_threads_supported() -> bool:
    """Horovod's question about its MPI controller, which torchmn does not have.

    Returns:
        Never returns.

    Raises:
        ValueError: always, as Horovod does where MPI is not enabled.

    Example::

        >>> hvd.mpi_threads_supported()     # ValueError
    """
    raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and enabled. (torchmn.horovod "
                     "runs on torch.distributed: gloo on CPU, NCCL on GPU.)")


def mpi_enabled() -> bool:
    """Returns: False: torchmn.horovod does not run on MPI (mpirun can still start its ranks).

    Example::

        >>> hvd.mpi_enabled()
    """
    return False


mpi_built = mpi_enabled


def gloo_enabled() -> bool:
    """Returns: True: gloo carries the CPU tensors and the control traffic.

    Example::

        >>> hvd.gloo_enabled()
    """
    return True


gloo_built = gloo_enabled


def nccl_built() -> int:
    """Returns: the version of torch's NCCL, coded as Horovod's (2.28.9 -> 22809; before 2.9 x1000), or 0.

    Example::

        >>> hvd.nccl_built()
    """
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def ddl_built() -> bool:
    """Returns: False (IBM DDL is not supported).

    Example::

        >>> hvd.ddl_built()
    """
    return False


ccl_built = ddl_built


def cuda_built() -> bool:
    """Returns: whether this torch was built with CUDA.

    Example::

        >>> hvd.cuda_built()
    """
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Returns: whether this torch was built with ROCm.

    Example::

        >>> hvd.rocm_built()
    """
    return torch.version.hip is not None


def handle_average_backwards_compatibility(op: Optional[int], average: Optional[bool]) -> int:
    """The op of a call that may use the old ``average=`` argument, as Horovod decides it.

    Raises:
        ValueError: both were given.
    """
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v0.21.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op
