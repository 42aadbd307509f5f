"""Joining and leaving the job (``init``, ``shutdown``), and what the job and this build are:
the ranks, the node topology, the libraries built in.

``init`` makes the job's communicator, stores it in :data:`torchmn.horovod.process_sets.job`,
registers the process sets and starts the timeline ``HOROVOD_TIMELINE`` names; ``shutdown``
completes the collectives in flight, writes the timeline and tears all of it down.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys

import torch
import torch.distributed as dist

import torchmn
from torchmn.horovod import background, handles, timeline
from torchmn.horovod.errors import InvalidCallError, UnsupportedError
from torchmn.horovod.process_sets import add_process_set, forget_all, job, register_global, require_comm


def init(comm=None, process_sets=None) -> None:
    """Join the job: ``torchmn.create_communicator()``, and the process sets given.

    Args:
        comm: as Horovod's: None (every rank) or a list of ranks (those ranks form the job's
            global process set). An ``mpi4py`` communicator is not taken: torchmn does not run
            on MPI's communicators (start the job with ``mpirun`` and leave ``comm`` out).
        process_sets: ProcessSets to register now, or ``"dynamic"`` (torchmn always allows
            adding them later).

    Raises:
        UnsupportedError: an ``mpi4py`` communicator as ``comm``.
        InvalidCallError: a duplicate process set; ``process_sets`` a string other than ``"dynamic"``.

    Example::

        >>> import torchmn.horovod as hvd
        >>> hvd.init()
        >>> hvd.rank(), hvd.size()
    """
    if job.comm is not None:
        return
    if comm is not None and not isinstance(comm, (list, tuple, range)):
        raise UnsupportedError(f"hvd.init(comm=<{type(comm).__name__}>): torchmn.horovod takes a list of ranks "
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
    register_global(job.comm)
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise InvalidCallError(f"process_sets must be a list of ProcessSet or 'dynamic', not {process_sets!r}")
    elif process_sets:
        for index, ps in enumerate(process_sets):
            if ps in process_sets[:index]:
                raise InvalidCallError(f"Horovod could not be initialized because process_sets entry number "
                                       f"{index} is a duplicate: {ps}")
            add_process_set(ps)
    atexit.register(shutdown)
    path = os.environ.get("HOROVOD_TIMELINE")
    if path and path.upper() != "DYNAMIC":
        try:
            timeline.start_timeline(path)
        except OSError as e:  # seeing the job must never stop it
            sys.stderr.write(f"torchmn.horovod: rank {job.comm.rank} on {socket.gethostname()}: HOROVOD_TIMELINE={path} "
                             f"cannot be written ({e}); no timeline is recorded\n")


def shutdown() -> None:
    """Leave the job: complete the collectives in flight, write the timeline if one runs, and
    tear down what :func:`init` set up (``init`` registers it to run at exit too).

    Example::

        >>> hvd.shutdown()
        >>> hvd.is_initialized()            # False
    """
    if job.comm is None:
        return
    handles.drain()
    handles.forget()
    background.stop()
    if timeline.recording():
        timeline.stop_timeline()
    forget_all()
    world = job.world
    job.comm = job.world = None
    if job.owns_comm:
        world.finalize()


def is_initialized() -> bool:
    """Whether this process is in the job.

    Returns:
        True once :func:`init` has run, until :func:`shutdown`.

    Example::

        >>> if not hvd.is_initialized():
        ...     hvd.init()
    """
    return job.comm is not None


def rank() -> int:
    """This process's rank in the job.

    Returns:
        0 .. ``size() - 1``.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

    Example::

        >>> if hvd.rank() == 0:
        ...     torch.save(model.state_dict(), "model.pt")
    """
    return require_comm().rank


def size() -> int:
    """The number of ranks in the job.

    Returns:
        The ranks the job's global process set holds.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

    Example::

        >>> lr = 0.01 * hvd.size()
    """
    return require_comm().size


def local_rank() -> int:
    """This process's rank among the job's ranks on its node.

    Returns:
        0 .. ``local_size() - 1``.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

    Example::

        >>> torch.cuda.set_device(hvd.local_rank())
    """
    return require_comm().intra_rank


def local_size() -> int:
    """The number of the job's ranks on this node.

    Returns:
        The ranks that share this process's host.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

    Example::

        >>> hvd.local_size()
    """
    return require_comm().intra_size


def cross_rank() -> int:
    """This node's index among the nodes with a rank of this local rank (Horovod's cross
    communicator holds those ranks, one per node).

    Returns:
        0 .. ``cross_size()`` - 1: the node's index, on a homogeneous job.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

    Example::

        >>> hvd.cross_rank()
    """
    return _nodes_holding_this_local_rank().index(require_comm().inter_rank)


def cross_size() -> int:
    """The number of nodes with a rank of this local rank.

    Returns:
        The number of nodes, on a homogeneous job.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

    Example::

        >>> hvd.cross_size()
    """
    return len(_nodes_holding_this_local_rank())


def _nodes_holding_this_local_rank() -> list:
    comm = require_comm()
    # Local ranks count up from 0 on each node, so a node holds local rank i where it has more than i ranks.
    return [node for node, ranks in enumerate(comm.node_ranks) if len(ranks) > comm.intra_rank]


def is_homogeneous() -> bool:
    """Whether every node runs as many of the job's ranks.

    Returns:
        True where each node holds ``local_size()`` ranks.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``, with Horovod's message).

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
        InvalidCallError: always (a ``ValueError``), as Horovod does where MPI is not enabled.

    Example::

        >>> hvd.mpi_threads_supported()     # ValueError
    """
    raise InvalidCallError("Horovod MPI is not enabled; Please make sure it's installed and enabled. (torchmn.horovod "
                           "runs on torch.distributed: gloo on CPU, NCCL on GPU.)")


def mpi_enabled() -> bool:
    """Whether Horovod's MPI controller runs: it does not in torchmn.horovod (``mpirun`` can still
    start its ranks).

    Returns:
        False.

    Example::

        >>> hvd.mpi_enabled()               # False
    """
    return False


mpi_built = mpi_enabled


def gloo_enabled() -> bool:
    """Whether gloo runs: it carries the CPU tensors and the control traffic.

    Returns:
        True.

    Example::

        >>> hvd.gloo_enabled()              # True
    """
    return True


gloo_built = gloo_enabled


def nccl_built() -> int:
    """The version of torch's NCCL, coded as Horovod codes it.

    Returns:
        2.28.9 as 22809 (before 2.9: major x1000), or 0 where NCCL or CUDA is not available.

    Example::

        >>> hvd.nccl_built()
    """
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def ddl_built() -> bool:
    """Whether IBM DDL is built in: it is not supported.

    Returns:
        False.

    Example::

        >>> hvd.ddl_built()                 # False
    """
    return False


ccl_built = ddl_built


def cuda_built() -> bool:
    """Whether this torch was built with CUDA.

    Returns:
        True where ``torch.version.cuda`` is set.

    Example::

        >>> hvd.cuda_built()
    """
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether this torch was built with ROCm.

    Returns:
        True where ``torch.version.hip`` is set.

    Example::

        >>> hvd.rocm_built()
    """
    return torch.version.hip is not None
