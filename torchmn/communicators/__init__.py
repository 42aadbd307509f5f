"""Communicators: who the ranks are, how they talk, and how gradients are averaged.

One class per gradient-averaging algorithm (ChainerMN's layout): ``naive`` (an allreduce per
tensor), ``flat`` (fused buckets), ``hierarchical`` (shared memory inside a node, one rank per
node across nodes). :func:`create_communicator` picks and builds one.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from torchmn import monitor, resources
from torchmn.communicators import failure, world
from torchmn.communicators._call_check import backward_pass
from torchmn.communicators.world import adopt_world, default_backend, init_world
from torchmn.communicators.communicator import Communicator
from torchmn.communicators.communicator_base import CommunicatorBase
from torchmn.communicators.errors import (CollectiveMismatchError, CollectiveTimeoutError, PeerLostError,
                                          RankFailedError, RemoteRankError)
from torchmn.communicators.flat import FlatCommunicator
from torchmn.communicators.hierarchical import HierarchicalCommunicator
from torchmn.communicators.naive import NaiveCommunicator
from torchmn.communicators.registry import make_communicator, resolve
from torchmn.elastic import protocol
from torchmn.environments import LaunchEnvironment, detect_environment
from torchmn.environments.torchmn_run import TorchmnEnvironment
from torchmn.errors import TorchmnTypeError, TorchmnValueError


def create_communicator(name: str = "auto", backend: Optional[str] = None,
                        timeout: Union[datetime.timedelta, float, None] = None,
                        init_method: Optional[str] = None,
                        bucket_cap_mb: Optional[float] = None,
                        allreduce_grad_dtype: Any = None,
                        rank: Optional[int] = None, size: Optional[int] = None) -> Communicator:
    """The communicator for this job, setting up ``torch.distributed`` if nobody has yet.

    Detects how the job was launched (``torchmn run``, torchrun, Slurm, Open MPI, MPICH, or a plain
    ``python script.py``, a world of one that opens no port), applies the per-rank CPU thread budget,
    and reuses a default process group the script already initialised.

    Args:
        name: the gradient-averaging algorithm: ``"auto"`` (the fastest correct one for the
            topology), ``"naive"``, ``"flat"`` or ``"hierarchical"``; ChainerMN's ``"pure_nccl"``
            (``flat`` over NCCL), ``"two_dimensional"``, ``"single_node"`` and
            ``"non_cuda_aware"`` (``hierarchical``) are taken as the nearest of these.
        backend: ``"gloo"`` or ``"nccl"``; default NCCL where CUDA is available, else gloo.
        timeout: how long a collective waits for the other ranks before raising
            :class:`CollectiveTimeoutError` (a ``datetime.timedelta`` or seconds; default
            ``TORCHMN_TIMEOUT``, else 600 s).
        init_method: as ``torch.distributed.init_process_group``'s (``env://``,
            ``tcp://host:port``, ``file:///shared/path``); default: from the launcher.
        bucket_cap_mb: how many MB of gradients go in one message (default ``TORCHMN_BUCKET_CAP_MB``,
            else 25).
        allreduce_grad_dtype: ChainerMN's name for compressed gradients: ``"float16"`` (or
            ``torch.float16``, ``numpy.float16``) or ``"bfloat16"`` makes ``compression="fp16"``
            (``"bf16"``) the default of the optimizers and DDP hooks built on this communicator
            (``comm.compression``); None or float32: uncompressed.
        rank, size: with ``init_method``, this process's rank and the number of ranks, as
            ``init_process_group(init_method=..., rank=..., world_size=...)`` takes them, for ranks
            started by hand or by ``torch.multiprocessing.spawn``; the launcher's variables are then
            not read, and the ranks on one host are found from the host names.

    Returns:
        The :class:`Communicator` of this rank.

    Raises:
        TypeError: ``backend`` is not a string (ChainerMN's ``mpi_comm``, say), or ``timeout`` is
            neither seconds nor a ``timedelta``.
        ValueError: an unknown ``name`` (or ``"pure_nccl"`` without NCCL), a bad ``timeout``,
            malformed launcher variables, or ``rank`` / ``size`` without the other or without
            ``init_method``, or a rank outside ``0..size-1``.
        RuntimeError: the rendezvous cannot be reached or set up (the message names the ranks
            that never arrived, or what to check).
        CollectiveMismatchError: the ranks asked for different algorithms.

    Example::

        >>> import torchmn
        >>> comm = torchmn.create_communicator()          # "auto": the fastest correct algorithm
        >>> comm.rank, comm.size, comm.intra_rank, comm.inter_size
        (0, 1, 0, 1)
    """
    if backend is not None and not isinstance(backend, str):  # ChainerMN's second argument was mpi_comm
        raise TorchmnTypeError(f"create_communicator: backend must be 'gloo' or 'nccl', not {type(backend).__name__}; "
                               f"there is no mpi_comm argument: the ranks come from the launcher (mpiexec, srun, "
                               f"torchrun, torchmn run), and comm.split(color, key) makes a communicator of fewer ranks")
    resolve(name, backend or default_backend())  # an unknown name fails before anything starts
    creation = dict(name=name, backend=backend, timeout=timeout, bucket_cap_mb=bucket_cap_mb,
                    allreduce_grad_dtype=allreduce_grad_dtype)
    elastic = protocol.enabled(os.environ) and init_method is None and rank is None
    from torchmn.elastic import membership  # it uses this package's world module

    if elastic and not dist.is_initialized() and os.environ.get(protocol.GENERATION_VARIABLE) is None:
        # A worker an elastic job added: its place is known once the others make room for it. A
        # member lost while that world is set up makes the launcher announce another: it joins that.
        while True:
            membership.wait_for_place()
            try:
                return create_communicator(**creation)
            except Exception as error:  # noqa: BLE001 (told apart just below)
                if not membership.left_behind():
                    raise
                failure.leave_world(error)
    compression = _compression_named_by(allreduce_grad_dtype)
    timeout = _as_timedelta(timeout)
    if rank is not None or size is not None:
        env = _explicit_place(init_method, rank, size)
    else:
        try:
            env = detect_environment()
        except (ValueError, RuntimeError):
            if not dist.is_initialized():
                raise
            env = None  # the script set up the world itself; variables torchmn cannot read do not matter
    # Hand-set env:// variables without LOCAL_WORLD_SIZE (or an explicit rank and size) only guess the
    # ranks per host: the budget (and the GPU) then wait for the topology, which the communicator
    # learns from the hostnames.
    locality_known = env is not None and env.source != "init_method" and not (
        env.source == "env" and "LOCAL_WORLD_SIZE" not in os.environ)
    if locality_known:
        resources.apply_thread_budget(env.local_size)
    owns = False
    if dist.is_initialized():
        rank, size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        adopt_world(timeout)
    elif env.size == 1 and init_method is None:
        rank, size, backend = 0, 1, backend or default_backend()
    else:
        backend = backend or default_backend()
        init_world(env, backend, timeout, init_method)
        rank, size, owns = env.rank, env.size, True
    group = dist.group.WORLD if dist.is_initialized() else None
    obj_group = group
    cpu_too = "cpu:gloo" in backend  # a world of both, "cpu:gloo,cuda:nccl"
    if ":" in backend:
        backend = "nccl" if "cuda:nccl" in backend else "gloo"
    if backend == "nccl" and group is not None and not cpu_too:
        # Objects, control traffic and CPU tensors travel on the CPU through gloo.
        obj_group = world.new_group(backend="gloo")
    # A node is what the launcher calls one; else (MPI, or a world the script set up itself) a host.
    trust_launcher = env is not None and env.node_rank is not None and env.size == size
    node_key = env.node_rank if trust_launcher else socket.gethostname()
    kwargs = {}
    if bucket_cap_mb is None:
        bucket_cap_mb = resources.bucket_cap_mb_requested()
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_bytes"] = int(bucket_cap_mb * 1024 * 1024)
    cls = resolve(name, backend, size)
    comm = cls(rank=rank, size=size, group=group, obj_group=obj_group, backend=backend,
               node_key=node_key, owns_world=owns, **kwargs)
    comm.compression = compression
    if not locality_known:
        resources.apply_thread_budget(comm.intra_size)
        if backend == "nccl" and owns:  # no NCCL collective has run yet: the topology travels through gloo
            torch.cuda.set_device(comm.intra_rank % max(1, torch.cuda.device_count()))
    if size > 1:
        # An uncaught exception on this rank then ends the others at once, not at their timeout.
        failure.install()
    # The monitor and the timeline, where TORCHMN_MONITOR / _MONITOR_DIR / _TIMELINE ask for them.
    # torchmn run shows the table itself, also of a world a framework set up under it.
    monitor.start_for(comm, "torchmn" if TorchmnEnvironment.detect(os.environ) else
                      env.source if env is not None else "adopted")
    comm.creation = creation  # what an elastic job's reset asks for again in the new world
    membership.remember(comm)  # the communicator torchmn.elastic.State syncs over, and a reset rebuilds
    return comm


def _explicit_place(init_method: Optional[str], rank: Optional[int], size: Optional[int]) -> LaunchEnvironment:
    """The place ``create_communicator(init_method=..., rank=..., size=...)`` was given."""
    if rank is None or size is None or init_method is None:
        raise TorchmnValueError(f"create_communicator: rank and size go together, with init_method (got rank={rank}, "
                                f"size={size}, init_method={init_method!r}); e.g. create_communicator("
                                f"init_method='tcp://10.0.0.1:29500', rank=r, size=n)")
    if not 0 <= rank < size:
        raise TorchmnValueError(f"create_communicator: rank={rank} is outside 0..{size - 1} (size={size})")
    # Each rank alone on its host until the communicator has compared host names.
    return LaunchEnvironment(rank, size, 0, 1, None, "", None, "init_method")


def _compression_named_by(dtype: Any) -> Optional[str]:
    """The optimizers' ``compression`` that ChainerMN's ``allreduce_grad_dtype`` names."""
    name = str(getattr(dtype, "__name__", dtype)).replace("torch.", "").lower()  # numpy.float16 is a type
    if dtype is None or name == "float32":
        return None
    if name in ("float16", "half", "fp16"):
        return "fp16"
    if name in ("bfloat16", "bf16"):
        return "bf16"
    raise TorchmnValueError(f"allreduce_grad_dtype={dtype!r}: gradients can travel as float16 or bfloat16 "
                            f"(or float32, uncompressed); pass one of those, or compression= to the optimizer")


def _as_timedelta(timeout) -> Optional[datetime.timedelta]:
    if timeout is None:
        return None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    elif not isinstance(timeout, datetime.timedelta):
        raise TorchmnTypeError(f"create_communicator: timeout must be seconds or a datetime.timedelta, "
                               f"not {type(timeout).__name__}")
    if not timeout.total_seconds() > 0:
        raise TorchmnValueError(f"create_communicator: timeout must be positive, not {timeout.total_seconds()} s")
    return timeout


__all__ = ["Communicator", "CommunicatorBase", "CollectiveMismatchError", "CollectiveTimeoutError", "PeerLostError",
           "RankFailedError", "RemoteRankError", "NaiveCommunicator", "FlatCommunicator", "HierarchicalCommunicator",
           "backward_pass", "create_communicator", "make_communicator"]
