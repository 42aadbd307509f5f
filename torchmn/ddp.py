"""A DistributedDataParallel communication hook that averages DDP's gradient buckets through torchmn.

A DDP script keeps its model, optimizer and loop; one line hands the averaging to torchmn, which on
one node sums the buckets in shared memory instead of gloo's TCP loopback, and across nodes sums
inside each node first, then once per node over the network (the hierarchical communicator)::

    comm = torchmn.create_communicator()          # after, or instead of, init_process_group
    model = DistributedDataParallel(net)
    model.register_comm_hook(None, torchmn.ddp_comm_hook(comm))

DDP calls the hook once per bucket, in bucket order, on every rank, so torchmn's collectives meet.
The sum of a bucket inside a node is done when the hook returns; the part across nodes of one bucket
runs while backward computes the next, and the last bucket's is waited for before DDP's own end of
backward, which needs every bucket's result.
"""
# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real types.
import gc
from typing import Callable, Optional

import torch
import torch.distributed as dist

from torchmn.communicators import CommunicatorBase
from torchmn.errors import TorchmnTypeError, TorchmnValueError
from torchmn.optimizers.gradient_sync import COMPRESSION  # the dtypes gradients travel in, by name


def ddp_comm_hook(comm, compression: Optional[str] = None) -> Callable:
    """A communication hook for ``DistributedDataParallel.register_comm_hook``: DDP's buckets are
    averaged over ``comm``'s ranks through torchmn (shared memory inside a node).

    Args:
        comm: the communicator (``torchmn.create_communicator()``), over the same ranks as the DDP
            model's process group (the default group).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype floating-point buckets travel
            in (each rank divides by the number of ranks first, so that a half-precision sum does
            not overflow); the result is cast back to the gradients' dtype. Default: the
            communicator's ``compression`` (``allreduce_grad_dtype``); ``"none"``: uncompressed.

    Returns:
        The hook, called by DDP as ``hook(state, bucket)``; register it with ``None`` as the state.

    Raises:
        TypeError: ``comm`` is not a torchmn communicator (a process group, None).
        ValueError: an unknown ``compression`` (``"powersgd"`` too). On the first bucket, on every rank: a communicator
            over other ranks than the DDP model's process group, which DDP averages over, or ranks whose hooks
            compress differently (their buckets would be summed in different dtypes).

    Example::

        >>> comm = torchmn.create_communicator()
        >>> model = torch.nn.parallel.DistributedDataParallel(net)
        >>> model.register_comm_hook(None, torchmn.ddp_comm_hook(comm, compression="bf16"))
    """
    if not isinstance(comm, CommunicatorBase):
        raise TorchmnTypeError(f"ddp_comm_hook: comm must be a torchmn communicator (torchmn.create_communicator()), "
                               f"not {type(comm).__name__}; DDP's process group is the model's own, and the hook "
                               f"checks that the communicator spans the same ranks")
    if compression is None:
        compression = getattr(comm, "compression", None)
    check_compression(compression)
    averager = _BucketAverager(comm, COMPRESSION[compression])

    # A function, with the names and annotations DDP checks (register_comm_hook).
    def torchmn_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not averager.checked:
            averager.check(_ddp_process_group(torchmn_hook))
        return averager.average(bucket)
    return torchmn_hook


def check_compression(compression: Optional[str]) -> None:
    """Refuse a ``compression`` the hook cannot apply to DDP's buckets.

    Args:
        compression: ``None``, ``"none"``, ``"fp16"`` or ``"bf16"``.

    Raises:
        ValueError: anything else; ``"powersgd"`` with the hook to use instead.

    Example::

        >>> check_compression("bf16")     # before the world exists (TorchmnStrategy's constructor)
    """
    if compression == "powersgd":
        raise TorchmnValueError("ddp_comm_hook(compression='powersgd'): for DDP use torch's own hook, "
                                "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook; torchmn's PowerSGD "
                                "is create_multi_node_optimizer(..., compression='powersgd')")
    if compression not in COMPRESSION:
        raise TorchmnValueError(f"compression must be one of None, 'fp16', 'bf16', not {compression!r}")


class _BucketAverager:
    """What the hook keeps between buckets: the one whose part across nodes is still in flight."""

    def __init__(self, comm, wire_dtype: Optional[torch.dtype]):
        self.comm = comm
        self.wire_dtype = wire_dtype
        self.checked = False
        self.pending: Optional[tuple] = None  # (handle, future, wire, buffer) of the previous bucket

    def average(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        wire = buffer
        if self.wire_dtype is not None and buffer.is_floating_point() and buffer.dtype != self.wire_dtype:
            wire = buffer.to(self.wire_dtype)
        wire.div_(self.comm.size)  # before the sum, as DDP's own hooks do: a half-precision sum stays in range
        handle = self.comm.allreduce_flat(wire, async_op=True)
        future: torch.futures.Future = torch.futures.Future()
        previous, self.pending = self.pending, (handle, future, wire, buffer)
        if previous is not None:
            _finish(*previous)
        if bucket.is_last():
            pending, self.pending = self.pending, None
            _finish(*pending)
        return future

    def check(self, ddp_group) -> None:
        """Refuse, on the first bucket, a communicator over other ranks than DDP's process group
        (``ddp_group``; None where it could not be found, as for a hook inside a wrapper such as
        torch's ``fp16_compress_wrapper``: then the ranks cannot be compared, and are not)."""
        comm = self.comm
        rank = dist.get_rank() if dist.is_initialized() else comm.rank  # in the job, not in a split communicator
        where = f"torchmn.ddp_comm_hook on rank {rank} ({comm.host})"
        if ddp_group is not None:
            ddp_ranks = sorted(dist.get_process_group_ranks(ddp_group))
            comm_ranks = sorted(comm.world_rank(r) for r in range(comm.size))
            if ddp_ranks != comm_ranks:
                raise TorchmnValueError(
                    f"{where}: the DDP model averages over ranks {ddp_ranks} (its process_group), but the "
                    f"communicator spans ranks {comm_ranks}. Give the hook a communicator of the same ranks "
                    f"(comm.split(color, key) to the model's group), or build DDP over the communicator's ranks.")
        # Every rank's buckets must travel in one dtype: summing float16 bytes with float32 ones
        # gives garbage, not an error.
        wires = comm.allgather_obj("none" if self.wire_dtype is None else str(self.wire_dtype).replace("torch.", ""))
        if len(set(wires)) > 1:
            raise TorchmnValueError(
                f"{where}: the ranks' hooks compress differently ({', '.join(f'rank {r}: {w}' for r, w in enumerate(wires))}"
                f"), so their buckets would be summed in different dtypes. Pass the same compression= to "
                f"ddp_comm_hook (or allreduce_grad_dtype= to create_communicator) on every rank.")
        self.checked = True


def _ddp_process_group(hook: Callable):
    """The process group of the DDP model ``hook`` is registered on, found through DDP's own list of
    its hooks (``register_comm_hook`` keeps ``(hook, state)`` there); None where it is not found.
    Looked up once, on the first bucket: the hook is not handed the model."""
    from torch.nn.parallel import DistributedDataParallel

    for pair in gc.get_referrers(hook):
        if not (isinstance(pair, tuple) and pair and pair[0] is hook):
            continue
        for hooks in gc.get_referrers(pair):
            if not isinstance(hooks, list):
                continue
            for owner in gc.get_referrers(hooks):
                # The model itself, or its attribute dict where Python made one.
                owners = [owner] if isinstance(owner, DistributedDataParallel) else \
                    [o for o in gc.get_referrers(owner) if isinstance(o, DistributedDataParallel)] \
                    if isinstance(owner, dict) else []
                for model in owners:
                    if getattr(model, "_comm_hooks", None) is hooks:
                        return model.process_group
    return None


def _finish(handle, future: torch.futures.Future, wire: torch.Tensor, buffer: torch.Tensor) -> None:
    handle.wait()
    future.set_result(wire if wire is buffer else buffer.copy_(wire))
