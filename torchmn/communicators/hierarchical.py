"""``hierarchical``: reduce inside each node, allreduce across nodes (one rank per node), then
share the result inside the node.

On CPU the inside-node part goes through shared memory (:mod:`torchmn.communicators.shm`), never
TCP loopback; only the node's first rank talks to other nodes, through torch.distributed. On GPU,
NCCL already does this inside and across nodes, so the fused NCCL allreduce is used as is.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from torchmn.communicators import shm
from torchmn.communicators._setup import collective_timeout_s
from torchmn.communicators.communicator import _OPS, _Completed
from torchmn.communicators.flat import FlatCommunicator


_UNSET = object()


def _new_inter_group(world_leaders: list[int]):
    """The group of the nodes' first ranks (None on one node); every rank must call this."""
    return dist.new_group(world_leaders, backend="gloo") if len(world_leaders) > 1 else None


class HierarchicalCommunicator(FlatCommunicator):
    """Shared memory inside a node, one rank per node across nodes.

    Example::

        >>> comm = torchmn.create_communicator("hierarchical")
        >>> comm.allreduce(torch.ones(1_000_000))     # no byte of it crosses TCP on one node
    """

    name = "hierarchical"

    def __init__(self, inter_group=_UNSET, **kwargs):
        super().__init__(**kwargs)
        self._segment = None
        self._inter_group = None
        if self.size == 1 or self.backend == "nccl":
            return
        if inter_group is _UNSET:  # a world communicator: all its ranks are here to create it
            leaders = [self._global(node[0]) for node in self._node_members]
            inter_group = _new_inter_group(leaders)
        self._inter_group = inter_group
        tag = self.bcast_obj(shm.new_job_tag())
        pids = self.allgather_obj(os.getpid())
        my_node = self._node_members[self.inter_rank]
        self._shm_args = dict(
            node=self.inter_rank, local_rank=self.intra_rank, local_size=self.intra_size,
            pids=[pids[r] for r in my_node], barrier=self.barrier,
            timeout=collective_timeout_s(),
            describe=lambda i: f"rank {my_node[i]} (node {self.inter_rank}, {self.host})")
        self._segment = shm.NodeSegment.open(tag, **self._shm_args)

    @classmethod
    def split_groups(cls, parent, members: list[int]) -> dict:
        if parent.backend == "nccl" or len(members) == 1:
            return {"inter_group": None}
        leaders, seen = [], set()
        for r in members:
            node = parent._node_keys[r]
            if node not in seen:
                seen.add(node)
                leaders.append(parent._global(r))
        return {"inter_group": _new_inter_group(leaders)}

    @property
    def _single_node(self) -> bool:
        return self.inter_size == 1

    def _shm_ok(self, t: torch.Tensor) -> bool:
        return self._segment is not None and t.device.type == "cpu" and t.is_contiguous()

    def allreduce_flat(self, flat: torch.Tensor, async_op: bool = False, op: str = "sum"):
        if not self._shm_ok(flat):
            return super().allreduce_flat(flat, async_op=async_op, op=op)
        self._segment.allreduce_(flat, op)
        self._across_nodes(flat, op)
        return _Completed()

    def _across_nodes(self, flat: torch.Tensor, op: str) -> None:
        """Node sums to the global result: the nodes' first ranks allreduce, then share it locally."""
        if self._single_node:
            return
        if self.intra_rank == 0:
            dist.all_reduce(flat, op=_OPS[op], group=self._inter_group)
        self._segment.broadcast_(flat, root=0)

    def _allreduce_copy(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if not self._shm_ok(x):
            return super()._allreduce_copy(x, op)
        # Straight from x into shared memory and from there into the result: no staging copy.
        out = torch.empty_like(x)
        self._segment.allreduce_(x.view(-1), op, out=out.view(-1))
        self._across_nodes(out.view(-1), op)
        return out

    def reduce_scatter_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if not (self._shm_ok(flat) and self._single_node):
            return super().reduce_scatter_flat(flat, shard, async_op=async_op)
        self._segment.reduce_scatter(flat, shard)
        return _Completed()

    def allgather_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if not (self._shm_ok(flat) and self._single_node):
            return super().allgather_flat(flat, shard, async_op=async_op)
        self._segment.allgather(flat, shard)
        return _Completed()

    def _open_node_arena(self, shared_bytes: int, region_bytes: int):
        if self._segment is None or not self._single_node:
            return None
        return shm.NodeArena.open(self.bcast_obj(shm.new_job_tag()), shared_bytes=shared_bytes,
                                  region_bytes=region_bytes, **self._shm_args)

    def _exchange_headers(self, rows: list[list[int]]) -> torch.Tensor:
        # The call check of every collective: through shared memory too, so small collectives
        # do not pay a TCP round trip before their data moves.
        if self._segment is None or not self._single_node or self._data_device.type != "cpu":
            return super()._exchange_headers(rows)
        mine = torch.tensor(rows, dtype=torch.int64)
        parts = self._segment.allgather_bytes(mine.reshape(-1).view(torch.uint8))
        # On one node, local rank order is this communicator's rank order.
        return torch.stack([p.view(torch.int64).reshape(mine.shape) for p in parts])

    def finalize(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        super().finalize()

