"""A reduce-scatter for gloo, which has none of its own."""
from __future__ import annotations

import torch
import torch.distributed as dist

from torchmn.communicators import _torch_compat
from torchmn.communicators._async_utility import AndThen, finish


def reduce_scatter_single(shard: torch.Tensor, flat: torch.Tensor, group, async_op: bool = False):
    """torch's single-tensor reduce-scatter, except through gloo: there an all-to-all, then a local sum.

    gloo has no reduce-scatter of its own: torch runs one as an allreduce of the whole buffer and
    keeps a chunk, twice the traffic. An all-to-all moves each rank only the chunks it sums
    (``bench/bench_allreduce.py --collective reduce_scatter`` compares the two).

    Args:
        shard: where this rank's ``k`` summed elements go.
        flat: ``size * k`` elements; chunk ``r`` is what rank ``r`` receives, summed.
        group: the process group.
        async_op: return a handle instead of waiting.

    Returns:
        A handle with ``wait()`` (already completed unless ``async_op``).

    Example::

        >>> reduce_scatter_single(mine, torch.ones(size * k), group)   # mine: k elements, all == size
    """
    backend = dist.get_backend(group)  # "gloo", or per device: "cpu:gloo,cuda:nccl"
    if not (backend == "gloo" or (flat.device.type == "cpu" and "cpu:gloo" in backend)):
        return _torch_compat.reduce_scatter_single(shard, flat, group=group, async_op=async_op)
    chunks = torch.empty_like(flat)
    work = dist.all_to_all_single(chunks, flat, group=group, async_op=True)
    n = dist.get_world_size(group)
    return finish(AndThen(work, lambda: torch.sum(chunks.view(n, shard.numel()), dim=0, out=shard),
                          keep=(flat, chunks)), async_op)
