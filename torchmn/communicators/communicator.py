"""The communicator over ``torch.distributed``: who the ranks are, where they live, and the
plumbing every collective shares (rank order, call checks, byte broadcasts, split).

The collectives themselves come from three parts, one family each: tensor collectives
(:mod:`.tensor_collectives`), object collectives (:mod:`.object_collectives`) and collectives over a
model's tensors (:mod:`.model_collectives`). The gradient-averaging algorithms subclass
:class:`Communicator` and give :meth:`mean_tensors` and, where they have a faster way, the
gradient primitives (``allreduce_flat``, ``reduce_scatter_flat``, ``allgather_flat``).
"""
from __future__ import annotations

import socket
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from torchmn.communicators import _call_check, _wire, watch
from torchmn.communicators._torch_compat import all_gather_single
from torchmn.communicators._async_utility import Completed
from torchmn.communicators._gloo_utility import reduce_scatter_single
from torchmn.communicators._group_utility import match_group_counts, torch_group_count
from torchmn.communicators.communicator_base import CommunicatorBase
from torchmn.communicators.errors import CollectiveMismatchError
from torchmn.communicators.model_collectives import ModelCollectives
from torchmn.communicators.object_collectives import ObjectCollectives
from torchmn.communicators.ops import OPS
from torchmn.communicators.tensor_collectives import TensorCollectives

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
_worlds = 0  # world communicators created by this process, for their call logs' tags
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()  # this process's communicators (release_groups)


def release_groups() -> None:
    """Finalize every communicator of this process and drop its references to its process groups.

    For a rank that is ending with an error (:mod:`torchmn.communicators.failure`): a gloo group's
    connections close only when the last reference to it goes, and a communicator holds its groups
    for as long as the script holds it, so destroying the groups alone would leave the ranks
    waiting for this one until its process is gone.

    Example::

        >>> release_groups()
        >>> comm.allreduce(x)    # RuntimeError: ... a communicator that was finalized
    """
    for comm in list(_live):
        comm._let_go()


class Communicator(TensorCollectives, ObjectCollectives, ModelCollectives, CommunicatorBase):
    """A group of ranks and the collectives among them, over ``torch.distributed``.

    Do not build one directly: :func:`torchmn.create_communicator` detects the launcher, sets up
    ``torch.distributed`` and returns the subclass for the gradient-averaging algorithm asked for.
    Every public method is documented in :class:`CommunicatorBase`.

    Example::

        >>> comm = torchmn.create_communicator()
        >>> total = comm.allreduce(torch.tensor([comm.rank]))   # sum of all ranks
        >>> hello = comm.bcast_obj({"from": "root"} if comm.rank == 0 else None)
    """

    name = "base"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        watch.install(cls)

    def __init__(self, *, rank: int, size: int, group: Optional[dist.ProcessGroup],
                 obj_group: Optional[dist.ProcessGroup], backend: str, node_key: Any,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_BYTES, owns_world: bool = False,
                 group_ranks: Optional[Sequence[int]] = None, tag: Optional[str] = None):
        # Collectives are numbered per communicator (see watch.py); the tag tells communicators apart.
        global _worlds
        if tag is None:
            _worlds += 1
            tag = f"world{_worlds}"
        self.call_log = watch.CallLog(tag)
        _live.add(self)
        self._splits = 0
        self.rank = rank
        self.size = size
        self.backend = backend
        self.bucket_cap_bytes = bucket_cap_bytes
        self._group = group          # None: a world of one with no process group at all
        # torch orders a group's ranks by world rank; split(key=...) may order them otherwise.
        # _group_ranks[r] is the process-group rank of this communicator's rank r.
        self._group_ranks = list(group_ranks) if group_ranks is not None else list(range(size))
        self._identity_order = self._group_ranks == list(range(size))
        self._obj_group = obj_group  # always a CPU (gloo) group: objects and control traffic
        self._owns_world = owns_world
        self._node_key = node_key
        self._data_device = torch.device("cpu")  # until the topology tells which GPU (NCCL)
        self._set_topology(node_key)
        if backend == "nccl":
            # The GPU set-up chose (_setup.init_world): a launcher that shows each rank only its
            # own GPUs (Slurm's --gpus-per-task, CUDA_VISIBLE_DEVICES) numbers them from 0 again.
            self.device = torch.device("cuda", self.intra_rank % max(1, torch.cuda.device_count()))
        else:
            self.device = torch.device("cpu")
        self._data_device = self.device  # where headers and byte buffers live for this backend

    # ----------------------------------------------------------------------------- topology
    def _set_topology(self, node_key: Any) -> None:
        mine = (node_key, socket.gethostname(), self.name)
        both = self.allgather_obj(mine) if self.size > 1 else [mine]
        keys = [k for k, _, _ in both]
        self._hosts = [h for _, h, _ in both]
        self.call_log.hosts = self._hosts
        names = [n for _, _, n in both]
        if len(set(names)) > 1:
            # Each algorithm makes its own calls: they would pair wrongly or wait out the timeout.
            raise CollectiveMismatchError(
                f"rank {self.rank}: the ranks asked for different communicators ("
                f"{', '.join(f'rank {r}: {n!r}' for r, n in enumerate(names))}); pass the same name to "
                f"create_communicator on every rank")
        nodes: list[Any] = []
        for k in keys:
            if k not in nodes:
                nodes.append(k)
        members = [r for r, k in enumerate(keys) if k == node_key]
        self.inter_rank = nodes.index(node_key)
        self.inter_size = len(nodes)
        self.intra_rank = members.index(self.rank)
        self.intra_size = len(members)
        self._node_members = [[r for r, k in enumerate(keys) if k == n] for n in nodes]
        self._node_index = [nodes.index(k) for k in keys]

    @property
    def host(self) -> str:
        return socket.gethostname()

    def world_rank(self, r: int) -> int:
        g = self._group_ranks[r]
        if self._group is None or self._group is dist.GroupMember.WORLD:
            return g
        return dist.get_global_rank(self._group, g)

    def node_of(self, r: int) -> int:
        return self._node_index[r]

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} rank {self.rank}/{self.size} intra {self.intra_rank}/"
                f"{self.intra_size} inter {self.inter_rank}/{self.inter_size} {self.backend}>")

    # ----------------------------------------------------------------------------- plumbing
    def _comm_order(self, items: list) -> list:
        """Per-rank results that torch returns in process-group order, put in communicator order."""
        return items if self._identity_order else [items[g] for g in self._group_ranks]

    def _group_order(self, items: list) -> list:
        """Per-rank inputs given in communicator order, put in the process-group order torch wants."""
        if self._identity_order:
            return items
        out = [None] * self.size
        for r, g in enumerate(self._group_ranks):
            out[g] = items[r]
        return out

    def check_rank(self, r: Any, what: str = "rank") -> None:
        err = self._peer_error(r, what)
        if err is not None:
            raise err

    def _peer_error(self, r: Any, what: str) -> Optional[ValueError]:
        if not isinstance(r, int) or not 0 <= r < self.size:
            return ValueError(f"{what}={r!r} is not a rank of this communicator (size {self.size})")
        return None

    def _exchange_headers(self, rows: list[list[int]], objects: bool = False) -> torch.Tensor:
        """All ranks' header rows: a [size, len(rows), HEADER_LEN] int64 tensor. ``objects``: the
        call moves no tensor data, so under NCCL its header goes through the CPU (gloo) group, as its
        data does, instead of syncing with the GPU and queueing behind gradients in flight."""
        group, device = self._group, self._data_device
        if objects and self.backend == "nccl":
            group, device = self._obj_group, torch.device("cpu")
        mine = torch.tensor(rows, dtype=torch.int64, device=device)
        if self.size == 1:
            return mine.unsqueeze(0).cpu()
        out = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=device)
        all_gather_single(out, mine.reshape(-1), group=group)
        out = out.reshape((self.size,) + tuple(mine.shape)).cpu()
        return out if self._identity_order else out[self._group_ranks]

    def _agree(self, kind: str, *, root: int = _wire.NONE, op: str | None = None,
               x: torch.Tensor | None = None, rows: list[list[int]] | None = None,
               error: Exception | None = None, same_shape: bool = False,
               same_dtype: bool = True, objects: bool = False) -> torch.Tensor:
        """Exchange one call's headers (see :mod:`._call_check`) and raise on every rank if the
        ranks disagree. ``error``: this rank's own arguments were bad; the others are told, then it
        is raised here."""
        if error is None and rows is None:
            try:  # a tensor the wire cannot describe (too many dimensions, an unknown dtype)
                rows = [_wire.header(_call_check.KIND[kind], root, _call_check.op_code(op), x)]
            except (TypeError, ValueError) as e:
                error = type(e)(f"{kind}: {e}")
        if error is not None:
            rows = _call_check.invalid_rows(len(rows) if rows else 1, op)
        if len(rows) > 1 and self.size > 1:
            what = self._exchange_headers([_call_check.summary_row(rows)], objects)
            _call_check.check_headers(kind, what, error, same_shape, same_dtype, self.rank, self.host)
        hdrs = self._exchange_headers(rows, objects)
        _call_check.check_headers(kind, hdrs, error, same_shape, same_dtype, self.rank, self.host)
        return hdrs

    def _bcast_bytes(self, buf: torch.Tensor, root: int, group=None) -> None:
        """Root's bytes into every rank's ``buf`` (of root's length), in chunks gloo and NCCL can count."""
        group = self._group if group is None else group
        if self.size == 1 or buf.numel() == 0:
            return
        for start in range(0, buf.numel(), _wire.OBJ_CHUNK_BYTES):
            dist.broadcast(buf[start:start + _wire.OBJ_CHUNK_BYTES], self.world_rank(root), group=group)

    # ----------------------------------------------------------------------------- control
    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self._obj_group)

    def split(self, color: int, key: int = 0) -> "Communicator":
        from torchmn.communicators.registry import resolve  # the registry knows the subclasses

        cls = resolve(self.name, self.backend, self.size)
        self._splits += 1
        entries = self.allgather_obj((color, key, self.rank, torch_group_count()))
        colors = sorted({e[0] for e in entries}, key=repr)
        whole_world = self.size == (dist.get_world_size() if dist.is_initialized() else 1)
        mine = None
        for c in colors:
            members = [e[2] for e in sorted((e for e in entries if e[0] == c), key=lambda e: (e[1], e[2]))]
            if not whole_world and c != color:
                continue
            world = [self.world_rank(r) for r in members]
            if whole_world:
                # Every rank of the world takes part in creating every group, in the same order,
                # as torch wants by default (it names them by a count every rank keeps alike).
                group = dist.new_group(world) if self.size > 1 else None
            else:
                # Only this communicator's ranks are here: each color's members make their group
                # alone (torch then names it by its ranks, so splits of other sub-communicators
                # running at the same time cannot take its name, and the world's count is left alone).
                match_group_counts([e[3] for e in entries if e[0] == c])
                group = dist.new_group(world, use_local_synchronization=True)
            obj_group = group
            if self.backend == "nccl":
                obj_group = dist.new_group(world, backend="gloo", use_local_synchronization=not whole_world)
            extra = cls.split_groups(self, members, local=not whole_world)
            if c == color:
                by_world = sorted(world)
                mine = (members.index(self.rank), len(members), group, obj_group, [by_world.index(w) for w in world],
                        extra, f"{self.call_log.tag}.{self._splits}.{colors.index(c)}")
        rank, size, group, obj_group, group_ranks, extra, tag = mine
        return cls(rank=rank, size=size, group=group, obj_group=obj_group, backend=self.backend,
                   node_key=self._node_key, bucket_cap_bytes=self.bucket_cap_bytes, group_ranks=group_ranks,
                   tag=tag, **extra)

    @classmethod
    def split_groups(cls, parent: "Communicator", members: list[int], local: bool = False) -> dict:
        """Extra process groups a new communicator of ``members`` (parent ranks, in the new order)
        needs, as constructor keyword arguments. ``local=False``: called on every rank of the world
        for every color, in the same order; ``local=True``: by the members alone, which then create
        their groups with ``use_local_synchronization=True``."""
        return {}

    def finalize(self) -> None:
        if self.call_log.closed:
            return
        self.call_log.closed = True
        if self._owns_world:
            from torchmn.communicators._setup import shutdown_world
            shutdown_world()

    def _let_go(self) -> None:
        """Finalized, without its process groups (see :func:`release_groups`)."""
        self.call_log.closed = True
        self._group = self._obj_group = None

    # ----------------------------------------------------------------------------- gradient primitives
    @property
    def grad_bucket_cap_bytes(self) -> int:
        return self.bucket_cap_bytes

    def allreduce_flat(self, flat: torch.Tensor, async_op: bool = False, op: str = "sum"):
        if self.size == 1:
            return Completed()
        return dist.all_reduce(flat, op=OPS[op], group=self._group, async_op=async_op)

    def reduce_scatter_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if self.size == 1:
            shard.copy_(flat)
            return Completed()
        if not self._identity_order:
            # torch numbers a group's ranks by world rank; after split(key=...) this communicator's
            # rank r is another group rank, so hand torch the chunks in its order.
            chunks = self._group_order(list(flat.split(shard.numel())))
            return dist.reduce_scatter(shard, chunks, group=self._group, async_op=async_op)
        return reduce_scatter_single(shard, flat, self._group, async_op)

    def allgather_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if self.size == 1:
            flat.copy_(shard)
            return Completed()
        if not self._identity_order:  # as in reduce_scatter_flat
            chunks = self._group_order(list(flat.split(shard.numel())))
            return dist.all_gather(chunks, shard, group=self._group, async_op=async_op)
        return all_gather_single(flat, shard, group=self._group, async_op=async_op)

    def open_node_arena(self, shared_bytes: int, region_bytes: int):
        return None

    def may_share_node_memory(self) -> bool:
        return False


watch.install(Communicator)
