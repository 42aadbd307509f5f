"""What the backends lack or do otherwise than torch's own reductions: gloo's reduce-scatter, its
all-gather of large buffers in pieces, and a max or min where a NaN wins."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from torchmn.communicators import _torch_compat, _wire
from torchmn.communicators._async_utility import AllOf, AndThen, finish
from torchmn.communicators.ops import OPS

# Between nodes, chunks larger than this travel in pieces of it, all in flight at once, not as one
# message per peer. On 2 nodes emulated with links shaped by tc (bench/multinode/bench_allreduce.py
# --collective shard), a reduce-scatter and all-gather of 64 MB took 1027 ms as single messages
# (gloo's all_to_all and all_gather) and 642 ms in pieces over 1 Gbit/s (the floor: 537), 233 and
# 188 ms over 10 Gbit/s; the sharded optimizer's step of the MNIST MLP over 1 Gbit/s took 1.03x
# DDP's time, against 1.27x whole. Where a node's single core and not the link set the pace (7.2 MB
# over 10 Gbit/s) the pieces cost 0-30% more. Inside a node (TCP loopback) they cost more than they
# save (7.2 MB: 5.5 ms whole, 9-12 ms in pieces), so they are for links only; and chunks up to this
# size keep gloo's collectives: one call costs less than several messages.
PIECE_BYTES = 512 << 10


def _is_gloo(group, tensor: torch.Tensor) -> bool:
    backend = dist.get_backend(group)  # "gloo", or per device: "cpu:gloo,cuda:nccl"
    return backend == "gloo" or (tensor.device.type == "cpu" and "cpu:gloo" in backend)


def _in_pieces(k: int, element_size: int, across_nodes: bool) -> bool:
    return across_nodes and k * element_size > PIECE_BYTES


def _exchange(sent: Callable[[int], torch.Tensor], received: Callable[[int], torch.Tensor], k: int,
              group, tag: int) -> AllOf:
    """Copy ``sent(me)`` into ``received(me)`` and post, for every other rank and every piece of
    its ``k`` elements, the send of ``sent(peer)`` and the receive into ``received(peer)``; the
    handle of them all."""
    group = group if group is not None else dist.group.WORLD
    n, me = dist.get_world_size(group), dist.get_rank(group)
    received(me).copy_(sent(me))
    per = max(1, PIECE_BYTES // sent(me).element_size())
    ops = []
    for start in range(0, k, per):
        stop = min(k, start + per)
        for step in range(1, n):
            to, source = (me + step) % n, (me - step) % n
            ops.append(dist.P2POp(dist.isend, sent(to)[start:stop], dist.get_global_rank(group, to),
                                  group=group, tag=tag))
            ops.append(dist.P2POp(dist.irecv, received(source)[start:stop], dist.get_global_rank(group, source),
                                  group=group, tag=tag))
    return AllOf(dist.batch_isend_irecv(ops))


def reduce_scatter_single(shard: torch.Tensor, flat: torch.Tensor, group, async_op: bool = False,
                          across_nodes: bool = False):
    """torch's single-tensor reduce-scatter, except through gloo: there an all-to-all, then a local sum.

    gloo has no reduce-scatter of its own: torch runs one as an allreduce of the whole buffer and
    keeps a chunk, twice the traffic. An all-to-all moves each rank only the chunks it sums
    (``bench/bench_allreduce.py --collective reduce_scatter`` compares the two); between nodes,
    chunks over ``PIECE_BYTES`` travel in pieces.

    Args:
        shard: where this rank's ``k`` summed elements go.
        flat: ``size * k`` contiguous elements; chunk ``r`` is what rank ``r`` receives, summed.
        group: the process group.
        async_op: return a handle instead of waiting.
        across_nodes: the group's ranks talk over a network (not only inside one node).

    Returns:
        A handle with ``wait()`` (already completed unless ``async_op``).

    Example::

        >>> reduce_scatter_single(mine, torch.ones(size * k), group)   # mine: k elements, all == size
    """
    if not _is_gloo(group, flat):
        return _torch_compat.reduce_scatter_single(shard, flat, group=group, async_op=async_op)
    n, k = dist.get_world_size(group), shard.numel()
    chunks = torch.empty_like(flat)
    if _in_pieces(k, flat.element_size(), across_nodes):
        work = _exchange(lambda peer: flat[peer * k:(peer + 1) * k], lambda peer: chunks[peer * k:(peer + 1) * k],
                         k, group, _wire.INTERNAL_TAGS["reduce_scatter"])
    else:
        work = dist.all_to_all_single(chunks, flat, group=group, async_op=True)
    # The rows in rank order, however they came: the same sum, to the bit, either way.
    return finish(AndThen(work, lambda: torch.sum(chunks.view(n, k), dim=0, out=shard), keep=(flat, chunks)),
                  async_op)


def all_gather_single(flat: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False,
                      across_nodes: bool = False):
    """torch's single-tensor all-gather; through gloo between nodes, shards over ``PIECE_BYTES`` in pieces.

    Args:
        flat: ``size * k`` contiguous elements; chunk ``r`` receives rank ``r``'s shard.
        shard: this rank's ``k`` elements.
        group: the process group.
        async_op: return a handle instead of waiting.
        across_nodes: the group's ranks talk over a network (not only inside one node).

    Returns:
        A handle with ``wait()`` (already completed unless ``async_op``).

    Example::

        >>> all_gather_single(everyone, torch.full((k,), float(rank)), group)  # everyone: size * k
    """
    k = shard.numel()
    if not (_in_pieces(k, shard.element_size(), across_nodes) and _is_gloo(group, flat)):
        return _torch_compat.all_gather_single(flat, shard, group=group, async_op=async_op)
    sent = shard.contiguous()
    work = _exchange(lambda peer: sent, lambda peer: flat[peer * k:(peer + 1) * k], k, group,
                     _wire.INTERNAL_TAGS["allgather"])
    return finish(AndThen(work, keep=(sent,)), async_op)


def all_reduce(flat: torch.Tensor, op: str, group, async_op: bool = False):
    """torch's all-reduce of ``flat`` in place, except that a NaN on any rank wins a max or a min.

    gloo's max keeps a NaN only where it comes first (``std::max``), so a diverged rank's NaN loss
    could vanish from a max taken to find it, and the result would differ from the shared-memory
    path's and the small calls' (``torch.maximum``). A floating-point max or min therefore travels
    with a second half that flags each rank's NaNs, and the NaNs go back where any rank had one:
    twice the bytes, for ops that are rare on large tensors.

    Args:
        flat: a contiguous tensor.
        op: a name of :data:`~torchmn.communicators.ops.OPS` (``"mean"`` sums; the caller divides).
        group: the process group.
        async_op: return a handle instead of waiting.

    Returns:
        torch's handle, or one whose ``wait()`` also puts the NaNs back.

    Example::

        >>> x = torch.tensor([1.0, 2.0]) if rank == 0 else torch.tensor([float("nan"), 0.0])
        >>> all_reduce(x, "max", group)   # x: tensor([nan, 2.]) on every rank
    """
    if op not in ("max", "min") or not flat.is_floating_point():
        return dist.all_reduce(flat, op=OPS[op], group=group, async_op=async_op)
    n = flat.numel()
    nan = torch.isnan(flat)
    packed = torch.empty(2 * n, dtype=flat.dtype, device=flat.device)
    # The flags: 1 where this rank has a NaN for a max, -1 for a min, so that the op itself says
    # whether any rank had one; the NaNs meanwhile stand as the value that cannot change the result.
    flag = 1.0 if op == "max" else -1.0
    torch.where(nan, torch.tensor(-flag * float("inf"), dtype=flat.dtype, device=flat.device), flat,
                out=packed[:n])
    torch.mul(nan, flag, out=packed[n:])
    work = dist.all_reduce(packed, op=OPS[op], group=group, async_op=True)

    def put_back():
        flat.copy_(packed[:n]).masked_fill_(packed[n:] != 0, float("nan"))

    return finish(AndThen(work, put_back, keep=(packed,)), async_op)
