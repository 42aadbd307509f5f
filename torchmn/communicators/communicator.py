"""The communicator over ``torch.distributed``: who the ranks are, where they live, and every
collective among them.

:class:`Communicator` implements :class:`~torchmn.communicators.communicator_base.CommunicatorBase`, where every
public method is documented. Its parts, in this order: topology; the plumbing every collective shares (rank order,
the call check, byte broadcasts); tensor point-to-point calls and collectives (data moves as bytes behind a header
saying dtype and shape, see :mod:`._wire`, so a receiver never needs to know them); object collectives (pickled with
:func:`~torchmn.communicators.pickling.dumps`, in chunks, on the CPU group also under NCCL); collectives over a
model's tensors (ChainerMN's ``bcast_data`` and ``multi_node_mean_grad``); control (barrier, split, finalize); the
gradient primitives.

Each call's data travels the way of its tensors' device (:meth:`Communicator._route`): CUDA tensors under NCCL through
the tensor group on this rank's GPU; everything else on the CPU through the CPU (gloo) group, so a CPU model on a
machine with GPUs keeps the CPU paths (shared memory inside a node). Call checks and objects always travel on the CPU.

The gradient-averaging algorithms (``naive.py``, ``flat.py``, ``hierarchical.py``) subclass it, give
:meth:`mean_tensors` and, where they have a faster way, override the algorithm hooks: ``allreduce_flat``,
``reduce_scatter_flat``, ``allgather_flat``, ``allreduce_copy``, ``exchange_headers``, ``allgather_obj_as``,
``open_node_arena``. Each collective is numbered and watched (:mod:`.watch`): a subclass that overrides one
decorates it the same way.
"""
from __future__ import annotations

import functools
import socket
import zlib
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from torchmn.communicators import _call_check, _gloo_utility, _wire, failure, gpu_sharing, watch, world
from torchmn.communicators._async_utility import Completed
from torchmn.communicators._group_utility import (group_for, idle_groups, match_group_counts, release,
                                                  reuse_budget, torch_group_count)
from torchmn.communicators._torch_compat import all_gather_single
from torchmn.communicators.communicator_base import CommunicatorBase
from torchmn.communicators.errors import CollectiveMismatchError, RemoteRankError
from torchmn.communicators.ops import OPS, divide_before_sum, reduce_in_order
from torchmn.communicators.pickling import as_if_sent, pickle_for_call, unpickle_from
from torchmn.communicators.shm.pages import empty_like_fast
from torchmn.errors import TorchmnTypeError, TorchmnValueError

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# The dtypes a small allreduce may reduce as it travels (others convert first: int16, bool, halves' means).
_ONE_ROUND_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_worlds = 0  # world communicators created by this process, for their call logs' tags
_CPU = torch.device("cpu")


class Communicator(CommunicatorBase):
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

    def __init__(self, *, rank: int, size: int, group: Optional[dist.ProcessGroup],
                 obj_group: Optional[dist.ProcessGroup], backend: str, node_key: Any,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_BYTES, owns_world: bool = False,
                 group_ranks: Optional[Sequence[int]] = None, tag: Optional[str] = None):
        """Set up a communicator over existing process groups and learn the topology (collective).

        :func:`torchmn.create_communicator`, ``split`` and
        :func:`~torchmn.communicators.registry.make_communicator` call it; scripts do not. With more
        than one rank it exchanges every rank's node key, host and algorithm, so every rank of the
        group must construct it together.

        Args:
            rank: this rank in the new communicator.
            size: the number of ranks.
            group: the ``torch.distributed`` group of its tensor collectives; None for a world of one
                without ``torch.distributed``.
            obj_group: the CPU (gloo) group of object collectives, control traffic and every
                call's CPU tensors (``group`` itself unless the backend is NCCL).
            backend: ``"gloo"`` or ``"nccl"``.
            node_key: what identifies this rank's node; ranks with equal keys share a node.
            bucket_cap_bytes: how many bytes of gradients the fusing algorithms put in one message.
            owns_world: :meth:`finalize` tears ``torch.distributed`` down (it set it up).
            group_ranks: the process-group rank of each of its ranks, ``None`` for the same
                numbers (``split(key=...)`` may order them otherwise).
            tag: tells its calls apart in the job's store (see :mod:`.watch`); ``None`` names a new
                world communicator.

        Raises:
            CollectiveMismatchError: the ranks asked for different algorithms (on every rank).

        Example::

            >>> solo = NaiveCommunicator(rank=0, size=1, group=None, obj_group=None, backend="gloo", node_key=0)
            >>> solo.node_ranks
            [[0]]
        """
        # Collectives are numbered per communicator (see watch.py); the tag tells communicators apart.
        global _worlds
        if tag is None:
            _worlds += 1
            tag = f"world{_worlds}"
        self.call_log = watch.CallLog(tag)
        failure.track(self)  # so that a rank ending with an uncaught exception can let go of its groups
        self._splits = 0
        self.rank = rank
        self.size = size
        self.backend = backend
        self.bucket_cap_bytes = bucket_cap_bytes
        self.process_group = group   # tensors' group; None: a world of one with no process group at all
        # torch orders a group's ranks by world rank; split(key=...) may order them otherwise.
        # _group_ranks[r] is the process-group rank of this communicator's rank r.
        self._group_ranks = list(group_ranks) if group_ranks is not None else list(range(size))
        self._identity_order = self._group_ranks == list(range(size))
        self.object_group = obj_group  # always a CPU (gloo) group: objects and control traffic
        self._owns_world = owns_world
        self.made_groups = []  # what finalize lets go of where the world stays (split's groups)
        self.node_key = node_key
        self._shared_gpu = None  # under NCCL, what to say if ranks of a node would share a GPU
        self._set_topology(node_key)
        if backend == "nccl":
            # The GPU set-up chose (world.init_world): a launcher that shows each rank only its
            # own GPUs (Slurm's --gpus-per-task, CUDA_VISIBLE_DEVICES) numbers them from 0 again.
            self.device = torch.device("cuda", self.intra_rank % max(1, torch.cuda.device_count()))
        else:
            self.device = _CPU

    # ----------------------------------------------------------------------------- topology
    def _set_topology(self, node_key: Any) -> None:
        # Under NCCL, which GPUs each rank sees, to tell ranks that would share one.
        gpus = gpu_sharing.view() if self.backend == "nccl" else None
        mine = (node_key, socket.gethostname(), self.name, gpus)
        both = self.allgather_obj(mine) if self.size > 1 else [mine]
        keys = [k for k, _, _, _ in both]
        self._hosts = [h for _, h, _, _ in both]
        self.call_log.hosts = self._hosts
        names = [n for _, _, n, _ in both]
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
        self.node_ranks = [[r for r, k in enumerate(keys) if k == n] for n in nodes]
        self._node_index = [nodes.index(k) for k in keys]
        if gpus is not None:
            self._shared_gpu = gpu_sharing.shared_gpu([g for _, _, _, g in both], self.node_ranks, self._hosts)

    @functools.cached_property
    def host(self) -> str:
        # Looked up once: every call check passes it on, for a message it may have to raise.
        return socket.gethostname()

    def world_rank(self, r: int) -> int:
        g = self._group_ranks[r]
        if self.process_group is None or self.process_group is dist.GroupMember.WORLD:
            return g
        return dist.get_global_rank(self.process_group, g)

    def node_of(self, r: int) -> int:
        return self._node_index[r]

    def __repr__(self) -> str:
        """Who this rank is, for logs and the interactive prompt.

        Returns:
            The class, the rank among all ranks, among its node's and the node among all nodes, and
            the backend.

        Example::

            >>> comm
            <HierarchicalCommunicator rank 1/4 intra 1/2 inter 0/2 gloo>
        """
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
        if (err := self._peer_error(r, what)) is not None:
            raise err

    def _peer_error(self, r: Any, what: str) -> Optional[ValueError]:
        if isinstance(r, bool) or not isinstance(r, int):  # a numpy integer too: int() it
            return TorchmnValueError(f"{what}={r!r} is not a rank: a rank is a Python int, 0 to {self.size - 1}")
        if not 0 <= r < self.size:
            return TorchmnValueError(f"{what}={r!r} is not a rank of this communicator (size {self.size})")
        if what in ("dest", "source") and r == self.rank:  # it would wait for itself
            return TorchmnValueError(f"{what}={r} is this rank: send and recv pair two ranks; keep the value instead")
        return None

    def _route(self, device_type: Optional[str]) -> tuple[Optional[dist.ProcessGroup], torch.device]:
        """The group and the device a call's data travels on, by its tensors' device type:
        CUDA tensors under NCCL through the tensor group, from this rank's GPU; anything else
        through the CPU (gloo) group, on the CPU.

        Raises:
            TorchmnValueError: CUDA tensors where ranks of a node would share a GPU (on every rank).
        """
        if device_type == "cuda" and self.backend == "nccl":
            if self._shared_gpu is not None:
                raise TorchmnValueError(f"rank {self.rank} on {self.host}: CUDA tensors cannot travel: "
                                        f"{self._shared_gpu}")
            return self.process_group, self.device
        return self.object_group, _CPU

    def wire_device(self, x: torch.Tensor | torch.device) -> torch.device:
        return self._route((x.device if isinstance(x, torch.Tensor) else torch.device(x)).type)[1]

    def wire_group(self, x: torch.Tensor) -> Optional[dist.ProcessGroup]:
        return self._route(x.device.type)[0]

    def exchange_headers(self, rows: list[list[int]]) -> torch.Tensor:
        """Every rank's call-check header rows, gathered over the CPU group (under NCCL too: a
        call check then neither waits for the GPU nor queues behind gradients in flight).

        Args:
            rows: this rank's rows, each ``_wire.HEADER_LEN`` integers; every rank passes as many.

        Returns:
            An int64 tensor ``[size, len(rows), HEADER_LEN]`` on the CPU, in this communicator's order.

        Example::

            >>> comm.exchange_headers([[1] * 22]).shape       # 2 ranks
            torch.Size([2, 1, 22])
        """
        mine = torch.tensor(rows, dtype=torch.int64)
        if self.size == 1:
            return mine.unsqueeze(0)
        out = torch.empty(self.size * mine.numel(), dtype=torch.int64)
        all_gather_single(out, mine.reshape(-1), group=self.object_group)
        out = out.reshape((self.size,) + tuple(mine.shape))
        return out if self._identity_order else out[self._group_ranks]

    def exchange_headers_with_data(self, rows: list[list[int]],
                                   data: torch.Tensor) -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
        """Every rank's call-check header rows and, where the algorithm can carry it in the same
        round, every rank's small ``data`` (an algorithm hook: the hierarchical communicator does,
        through shared memory on one node; here, only the headers travel).

        Args:
            rows: this rank's header rows, as for :meth:`exchange_headers`.
            data: this rank's data (a contiguous 1-D tensor), alike in length and dtype where headers agree.

        Returns:
            ``(headers, parts)``: the headers as :meth:`exchange_headers` returns them, and every
            rank's data in rank order (in ``data``'s dtype), or None on every rank alike where it
            did not travel (the caller then moves it its general way).

        Example::

            >>> headers, parts = comm.exchange_headers_with_data(rows, x.reshape(-1))
        """
        return self.exchange_headers(rows), None

    def _agree(self, kind: str, *, root: int = _wire.NONE, op: str | None = None, x: torch.Tensor | None = None,
               rows: list[list[int]] | None = None, error: Exception | None = None, same_shape: bool = False,
               same_dtype: bool = True, data: torch.Tensor | None = None):
        """Exchange one call's headers (see :mod:`._call_check`) and raise on every rank if the
        ranks disagree. ``error``: this rank's own arguments were bad; the others are told, then it
        is raised here. Returns the headers; with ``data`` (see :meth:`exchange_headers_with_data`),
        every rank's data instead, or None where it did not travel."""
        if error is None and rows is None:
            try:  # a tensor the wire cannot describe (too many dimensions, an unknown dtype)
                rows = [_wire.header(_call_check.KIND[kind], root, _call_check.op_code(op), x)]
            except (TypeError, ValueError) as e:
                error = type(e)(f"{kind}: {e}")
        if error is not None:
            rows = _call_check.invalid_rows(len(rows) if rows else 1, op)
        rows = _call_check.mark_backward(rows)
        if len(rows) > 1 and self.size > 1:
            what = self.exchange_headers([_call_check.summary_row(rows)])
            _call_check.check_headers(kind, what, error, same_shape, same_dtype, self.rank, self.call_log.hosts)
        if data is not None and len(rows) == 1:
            hdrs, parts = self.exchange_headers_with_data(rows, data)
            _call_check.check_headers(kind, hdrs, error, same_shape, same_dtype, self.rank, self.call_log.hosts)
            return parts
        hdrs = self.exchange_headers(rows)
        _call_check.check_headers(kind, hdrs, error, same_shape, same_dtype, self.rank, self.call_log.hosts)
        return None if data is not None else hdrs

    def _bcast_bytes(self, buf: torch.Tensor, root: int) -> None:
        """Root's bytes into every rank's ``buf`` (of root's length), in chunks gloo and NCCL can count."""
        group = self.wire_group(buf)
        if self.size == 1 or buf.numel() == 0:
            return
        for start in range(0, buf.numel(), _wire.OBJ_CHUNK_BYTES):
            dist.broadcast(buf[start:start + _wire.OBJ_CHUNK_BYTES], self.world_rank(root), group=group)

    # ----------------------------------------------------------------------------- tensors: point to point
    @watch.point_to_point("dest")
    def send(self, x: torch.Tensor, dest: int, tag: int = 0) -> None:
        self.check_rank(dest, "dest")
        problem = _call_check.unsendable(x)
        if problem is not None:
            # The receiver, already waiting for a header, is told instead of waiting out the timeout.
            self.send_tensor(None, dest, _wire.wire_tag(tag, "tensor"))
            raise TorchmnTypeError(f"send to rank {dest}: {problem} (raised on rank {self.rank}; rank {dest}'s recv "
                                   f"raises too)")
        self.send_tensor(x, dest, _wire.wire_tag(tag, "tensor"))

    @watch.point_to_point("source")
    def recv(self, source: int, tag: int = 0) -> torch.Tensor:
        self.check_rank(source, "source")
        return self.recv_tensor(source, _wire.wire_tag(tag, "tensor"))

    def send_tensor(self, x: Optional[torch.Tensor], dest: int, wire_tag: int) -> None:
        if x is None:  # the header of a send that failed here
            hdr = torch.tensor(_call_check.invalid_rows(1)[0], dtype=torch.int64)
            dist.send(hdr, self.world_rank(dest), group=self.object_group, tag=wire_tag)
            return
        group, device = self._route(x.device.type)
        hdr = torch.tensor(_wire.header(_call_check.KIND["bcast"], x=x), dtype=torch.int64)
        dist.send(hdr, self.world_rank(dest), group=self.object_group, tag=wire_tag)
        data = _wire.as_bytes(x.to(device))
        if data.numel():
            dist.send(data, self.world_rank(dest), group=group, tag=wire_tag)

    def recv_tensor(self, source: int, wire_tag: int) -> torch.Tensor:
        hdr = torch.empty(_wire.HEADER_LEN, dtype=torch.int64)
        dist.recv(hdr, self.world_rank(source), group=self.object_group, tag=wire_tag)
        row = hdr.tolist()
        _call_check.refuse_failed_send(row, source, self.rank)
        dtype, shape = _wire.meta(row)
        group, device = self._route(_wire.device_type(row))
        buf = torch.empty(_wire.nbytes(dtype, shape), dtype=torch.uint8, device=device)
        if buf.numel():
            dist.recv(buf, self.world_rank(source), group=group, tag=wire_tag)
        return _wire.from_bytes(buf, dtype, shape)

    # ----------------------------------------------------------------------------- tensors: collectives
    @watch.collective
    def bcast(self, x: Optional[torch.Tensor], root: int = 0) -> torch.Tensor:
        err = self._peer_error(root, "bcast: root")
        if err is None and self.rank == root and not isinstance(x, torch.Tensor):
            err = TorchmnTypeError(f"bcast: root rank {root} must pass a tensor, not {type(x).__name__}")
        hdrs = self._agree("bcast", root=root, x=x if self.rank == root else None, error=err)
        row = hdrs[root, 0].tolist()
        dtype, shape = _wire.meta(row)
        _, device = self._route(_wire.device_type(row))
        if self.rank == root:
            buf = _wire.as_bytes(x.to(device))
        else:
            buf = torch.empty(_wire.nbytes(dtype, shape), dtype=torch.uint8, device=device)
        self._bcast_bytes(buf, root)
        return x if self.rank == root else _wire.from_bytes(buf, dtype, shape)

    def _allgather_bytes(self, buf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Every rank's byte buffer, sizes known in advance; unequal sizes are padded in flight."""
        if self.size == 1:
            return [buf]
        longest = max(sizes)
        out = torch.empty(self.size * longest, dtype=torch.uint8, device=buf.device)
        if longest:
            all_gather_single(out, _wire.padded(buf, longest), group=self.wire_group(buf))
        chunks = self._comm_order([out[g * longest:(g + 1) * longest] for g in range(self.size)])
        return [c[:n] for c, n in zip(chunks, sizes)]

    @watch.collective
    def gather(self, x: torch.Tensor, root: int = 0) -> Optional[tuple[torch.Tensor, ...]]:
        err = self._peer_error(root, "gather: root")
        if err is None and not isinstance(x, torch.Tensor):
            err = TorchmnTypeError(f"gather: pass a tensor, not {type(x).__name__}")
        hdrs = self._agree("gather", root=root, x=x if err is None else None, error=err)
        if self.size == 1:
            return (x,)
        metas = [_wire.meta(hdrs[r, 0].tolist()) for r in range(self.size)]
        sizes = [_wire.nbytes(*m) for m in metas]
        group, device = self._route(x.device.type)
        mine = _wire.as_bytes(x.to(device))
        if device.type == "cuda":  # NCCL has no gather: all-gather and keep root's copy
            parts = self._allgather_bytes(mine, sizes)
        else:
            longest = max(sizes)
            bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)] if self.rank == root else None
            if longest:
                dist.gather(_wire.padded(mine, longest), bufs, dst=self.world_rank(root), group=group)
            parts = [b[:n] for b, n in zip(self._comm_order(bufs), sizes)] if self.rank == root else None
        if self.rank != root:
            return None
        return tuple(_wire.from_bytes(b, *m) for b, m in zip(parts, metas))

    @watch.collective
    def allgather(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        err = None if isinstance(x, torch.Tensor) else TorchmnTypeError(
            f"allgather: pass a tensor, not {type(x).__name__}")
        hdrs = self._agree("allgather", x=x if err is None else None, error=err)
        metas = [_wire.meta(hdrs[r, 0].tolist()) for r in range(self.size)]
        if self.size == 1:
            return (x,)
        bufs = self._allgather_bytes(_wire.as_bytes(x.to(self.wire_device(x))), [_wire.nbytes(*m) for m in metas])
        return tuple(_wire.from_bytes(b, *m) for b, m in zip(bufs, metas))

    @watch.collective
    def scatter(self, xs: Optional[Sequence[torch.Tensor]], root: int = 0) -> torch.Tensor:
        err = self._peer_error(root, "scatter: root")
        if err is None and self.rank == root:
            if xs is None or len(xs) != self.size or not all(isinstance(t, torch.Tensor) for t in xs):
                err = TorchmnValueError(f"scatter: root rank {root} must pass a sequence of {self.size} tensors "
                                        f"(one per rank), got {type(xs).__name__}"
                                        + (f" of length {len(xs)}" if hasattr(xs, '__len__') else ""))
        kind = _call_check.KIND["scatter"]
        rows = [_wire.header(kind, root if err is None else _wire.NONE)] * self.size
        if self.rank == root and err is None:
            try:
                rows = [_wire.header(kind, root, _wire.NONE, t) for t in xs]
            except (TypeError, ValueError) as e:
                err = type(e)(f"scatter: {e}")
        hdrs = self._agree("scatter", root=root, rows=rows, error=err)
        metas = [_wire.meta(hdrs[root, i].tolist()) for i in range(self.size)]
        if self.size == 1:
            return xs[0]
        sizes = [_wire.nbytes(*m) for m in metas]
        longest = max(sizes)
        group, device = self._route(_wire.device_type(hdrs[root, 0].tolist()))
        out = torch.empty(longest, dtype=torch.uint8, device=device)
        if longest:
            chunks = None
            if self.rank == root:
                chunks = [_wire.padded(_wire.as_bytes(t.to(device)), longest) for t in xs]
            if device.type == "cuda":
                # NCCL has no scatter: root broadcasts the stacked chunks.
                stacked = torch.cat(self._group_order(chunks)) if chunks else \
                    torch.empty(self.size * longest, dtype=torch.uint8, device=device)
                self._bcast_bytes(stacked, root)
                g = self._group_ranks[self.rank]
                out = stacked[g * longest:(g + 1) * longest]
            else:
                dist.scatter(out, self._group_order(chunks) if chunks else None, src=self.world_rank(root),
                             group=group)
        return _wire.from_bytes(out[:sizes[self.rank]].clone(), *metas[self.rank])

    @watch.collective
    def alltoall(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        err = None
        if xs is None or len(xs) != self.size or not all(isinstance(t, torch.Tensor) for t in xs):
            err = TorchmnValueError(f"alltoall: pass a sequence of {self.size} tensors (one per rank)")
        kind = _call_check.KIND["alltoall"]
        rows = [_wire.header(kind)] * self.size
        if err is None:
            try:
                rows = [_wire.header(kind, x=t) for t in xs]
            except (TypeError, ValueError) as e:
                err = type(e)(f"alltoall: {e}")
        hdrs = self._agree("alltoall", rows=rows, error=err)
        dtypes = [sorted({str(_wire.meta(hdrs[r, j].tolist())[0]) for j in range(self.size)})
                  for r in range(self.size)]
        if len({d for ds in dtypes for d in ds}) > 1:
            shown = ", ".join(f"rank {r}: {'/'.join(d.replace('torch.', '') for d in ds)}" for r, ds in enumerate(dtypes))
            raise CollectiveMismatchError(f"ranks called alltoall with different dtypes ({shown}); every tensor "
                                          f"of every rank must have one dtype (raised on rank {self.rank})")
        if self.size == 1:
            return (xs[0],)
        # What rank r sends to me is described by header row [r, me].
        recv_metas = [_wire.meta(hdrs[r, self.rank].tolist()) for r in range(self.size)]
        # One buffer each way with per-rank splits: gloo's list all_to_all takes equal sizes only.
        group, device = self._route(xs[0].device.type)
        send = self._group_order([_wire.as_bytes(t.to(device)).reshape(-1) for t in xs])
        recv_sizes = [_wire.nbytes(*m) for m in recv_metas]
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(recv, torch.cat(send), output_split_sizes=self._group_order(recv_sizes),
                               input_split_sizes=[b.numel() for b in send], group=group)
        parts = dict(zip(self._group_order(list(range(self.size))), torch.split(recv, self._group_order(recv_sizes))))
        return tuple(_wire.from_bytes(parts[r], *m) for r, m in enumerate(recv_metas))

    def _allreduce_problem(self, x: torch.Tensor, op: str, name: str = "allreduce") -> Optional[Exception]:
        """What is wrong with this rank's arguments to an allreduce, or None."""
        if op not in OPS:
            return TorchmnValueError(f"{name}: op must be one of {', '.join(OPS)}, not {op!r}")
        if not isinstance(x, torch.Tensor):
            return TorchmnTypeError(f"{name}: pass a tensor, not {type(x).__name__}")
        if x.dtype in _wire.MOVE_ONLY:
            return TorchmnTypeError(f"{name}: torch has no arithmetic for {x.dtype} on CPU, so it cannot be reduced; "
                                    f"convert first (x.to(torch.int64), x.float()) and back")
        if x.is_complex() and op in ("max", "min"):
            return TorchmnValueError(f"{name}: op {op!r} is undefined for complex tensors ({x.dtype})")
        if x.is_complex() and op == "prod":
            # Decided here, on every rank alike: a failure inside the backend would reach only the
            # ranks that call it (between nodes, not the others of each node).
            return TorchmnValueError(f"{name}: torch.distributed has no 'prod' of complex tensors ({x.dtype}); "
                                     f"multiply the gathered tensors instead (torch.stack(comm.allgather(x)).prod(0))")
        return None

    @watch.collective
    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        err = self._allreduce_problem(x, op)
        # A small tensor may travel with its call check (exchange_headers_with_data): every rank
        # offers it alike, as it depends on what the check compares (dtype, shape, op).
        one_round = err is None and x.device.type == "cpu" and x.dtype in _ONE_ROUND_DTYPES and \
            op in OPS and (op != "mean" or x.is_floating_point())
        data = None
        if one_round:
            data = x.detach().reshape(-1)
            if data.stride(0) != 1:  # one element expanded from a scalar: stride 0, which clone() keeps
                data = torch.empty(data.shape, dtype=data.dtype).copy_(data)
        parts = self._agree("allreduce", op=None if err else op, x=None if err else x, error=err, same_shape=True,
                            data=data)
        if data is None or parts is None:  # without data, _agree returns the headers
            return self._allreduce_agreed(x, op)
        out = reduce_in_order(parts, op).view(x.shape)
        return out.div_(self.size) if op == "mean" else out

    @watch.collective
    def allreduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        err = self._allreduce_problem(x, op, "allreduce_")
        if err is None and op == "mean" and not (x.is_floating_point() or x.is_complex()):
            err = TorchmnTypeError(
                f"allreduce_: the mean of {x.dtype} values is float64 and cannot be written into the "
                f"tensor; use comm.allreduce(x, op='mean'), or op='sum' and divide")
        self._agree("allreduce", op=None if err else op, x=None if err else x, error=err, same_shape=True)
        if (x.is_contiguous() and x.device == self.wire_device(x) and x.dtype not in (torch.int16, torch.bool)
                and not (op == "mean" and divide_before_sum(x.dtype)) and not x.is_conj() and not x.is_neg()):
            # The data moves in place: no new tensor, whose pages (tens of MB) would be mapped afresh.
            self.allreduce_flat(x.detach().view(-1), op="sum" if op == "mean" else op)
            if op == "mean":
                x.detach().div_(self.size)
            return x
        with torch.no_grad():
            return x.copy_(self._allreduce_agreed(x, op))

    def _allreduce_agreed(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """The reduction of ``x``, once the ranks have agreed on the call."""
        src = x.detach().to(self.wire_device(x))
        if op == "mean" and not (src.is_floating_point() or src.is_complex()):
            # The float64 mean of integers, summed in float64: exact below 2**53 and never wrapping
            # (int64's sum would wrap past 2**63; a bool sum would be a logical or, not a count).
            src = src.to(torch.float64)
        if op == "mean" and divide_before_sum(src.dtype):
            return self._allreduce_agreed(x.double(), op="mean").to(x.dtype)  # bfloat16 reaches float32's range
        # gloo has no int16 reduction; int32 gives the same bits once cast back (two's complement
        # wraps alike), except "mean", whose result is floating-point anyway.
        widen = src.dtype == torch.int16
        out = self.allreduce_copy((src.to(torch.int32) if widen else src).contiguous(), "sum" if op == "mean" else op)
        if widen and op != "mean":
            out = out.to(torch.int16)
        if op == "mean":
            out = out.to(torch.float64).div_(self.size) if not out.is_floating_point() and not out.is_complex() \
                else out.div_(self.size)
        return out.to(x.device)

    def allreduce_copy(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """The reduction of contiguous ``x`` over ranks, as a new tensor (algorithms may do it faster).

        Copies ``x`` into a new tensor (on huge pages where it is large) and reduces that in place
        with :meth:`allreduce_flat`.

        Args:
            x: a contiguous tensor on this rank's data device.
            op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``.

        Returns:
            A new tensor holding the reduction; ``x`` is left as it is.

        Example::

            >>> total = comm.allreduce_copy(x.contiguous(), "sum")   # no call check: use allreduce
        """
        out = empty_like_fast(x).copy_(x)
        self.allreduce_flat(out.view(-1), op=op)
        return out

    # ----------------------------------------------------------------------------- objects: the call check
    def _agree_obj(self, kind: str, root: int = _wire.NONE, n: int = 0,
                   error: Optional[Exception] = None) -> torch.Tensor:
        """The call check of object collective ``kind`` (see ``_call_check.obj_header``): every rank's row."""
        return self._agree(kind, rows=[_call_check.obj_header(n, kind, root)], error=error)

    def _obj_lengths(self, n: int, error: Optional[Exception], kind: str, root: int) -> list[int]:
        """Every rank's pickled length, through the call check of ``kind``, so a rank making another
        collective meanwhile, or one that could not pickle, is named."""
        if self.size == 1:
            if error is not None:
                raise error
            return [n]
        return self._agree_obj(kind, root=root, n=n, error=error)[:, 0, _wire.SHAPE].tolist()

    # ----------------------------------------------------------------------------- objects: point to point
    @watch.point_to_point("dest")
    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.check_rank(dest, "dest")
        self._send_obj(obj, dest, _wire.wire_tag(tag, "object"), "send_obj")

    @watch.point_to_point("source")
    def recv_obj(self, source: int, tag: int = 0) -> Any:
        self.check_rank(source, "source")
        return self._unpickle(self._recv_obj_bytes(source, _wire.wire_tag(tag, "object"), "recv_obj"), "recv_obj", source)

    def _send_obj(self, obj: Any, dest: int, wire_tag: int, kind: str) -> None:
        buf, err = pickle_for_call(obj, kind, self.rank, self.host)
        self.send_bytes(buf if err is None else None, dest, wire_tag)
        if err is not None:
            raise err  # the receiver was told

    def _recv_obj_bytes(self, source: int, wire_tag: int, kind: str) -> torch.Tensor:
        buf = self.recv_bytes(source, wire_tag)
        if buf is None:
            raise RemoteRankError(f"{kind}: rank {source} could not pickle the object it sent (see its error); "
                                  f"rank {self.rank} on {self.host} stops too")
        return buf

    def send_bytes(self, buf: Optional[torch.Tensor], dest: int, wire_tag: int) -> None:
        dist.send(torch.tensor([buf.numel() if buf is not None else -1], dtype=torch.int64), self.world_rank(dest),
                  group=self.object_group, tag=wire_tag)
        if buf is None:
            return
        for start in range(0, buf.numel(), _wire.OBJ_CHUNK_BYTES):
            dist.send(buf[start:start + _wire.OBJ_CHUNK_BYTES], self.world_rank(dest), group=self.object_group,
                      tag=wire_tag)

    def recv_bytes(self, source: int, wire_tag: int) -> Optional[torch.Tensor]:
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, self.world_rank(source), group=self.object_group, tag=wire_tag)
        if n.item() < 0:
            return None
        buf = torch.empty(int(n), dtype=torch.uint8)
        for start in range(0, buf.numel(), _wire.OBJ_CHUNK_BYTES):
            dist.recv(buf[start:start + _wire.OBJ_CHUNK_BYTES], self.world_rank(source), group=self.object_group,
                      tag=wire_tag)
        return buf

    # ----------------------------------------------------------------------------- objects: collectives
    @watch.collective
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        if self.size == 1:
            self.check_rank(root, "root")
            return as_if_sent(obj, "bcast_obj", self.rank, self.host, keep=True)
        # The call check tells every rank of one's bad root or object, another root or another call.
        err = self._peer_error(root, "bcast_obj: root")
        buf, err = (None, err) if err or self.rank != root else pickle_for_call(obj, "bcast_obj", self.rank, self.host)
        hdrs = self._agree_obj("bcast_obj", root, buf.numel() if buf is not None else 0, err)
        n = int(hdrs[root, 0, _wire.SHAPE])
        if buf is None:
            buf = torch.empty(n, dtype=torch.uint8)
        self._bcast_bytes(buf, root)
        return obj if self.rank == root else self._unpickle(buf, "bcast_obj", root)

    @watch.collective
    def allgather_obj(self, obj: Any) -> list[Any]:
        return self.allgather_obj_as(obj, "allgather_obj")

    @watch.collective
    def allgather_obj_as(self, obj: Any, kind: str, root: Optional[int] = None) -> list[Any]:
        if self.size == 1:
            return [as_if_sent(obj, kind, self.rank, self.host)]
        buf, err = pickle_for_call(obj, kind, self.rank, self.host)
        sizes = self._obj_lengths(buf.numel() if err is None else 0, err, kind, _wire.NONE if root is None else root)
        if max(sizes) * self.size <= _wire.OBJ_CHUNK_BYTES:
            longest = max(sizes)
            out = torch.empty(self.size * longest, dtype=torch.uint8)
            all_gather_single(out, _wire.padded(buf, longest), group=self.object_group)
            chunks = self._comm_order([out[g * longest:(g + 1) * longest] for g in range(self.size)])
            return [self._unpickle(c[:n], kind, r) for r, (c, n) in enumerate(zip(chunks, sizes))]
        # Large objects: each rank broadcasts its own in turn, in chunks.
        result = []
        for r, n in enumerate(sizes):
            b = buf if r == self.rank else torch.empty(n, dtype=torch.uint8)
            self._bcast_bytes(b, r)
            result.append(self._unpickle(b, kind, r))  # this rank's own too: copies, whatever the size
        return result

    @watch.collective
    def gather_obj(self, obj: Any, root: int = 0) -> Optional[list[Any]]:
        if self.size > 1:  # a bad root is told to every rank, in the call check
            self._agree_obj("gather_obj", root, error=self._peer_error(root, "gather_obj: root"))
        self.check_rank(root, "root")
        if self.size == 1:
            return [as_if_sent(obj, "gather_obj", self.rank, self.host, keep=True)]
        tag = _wire.wire_tag(_call_check.KIND["gather_obj"], "collective")
        if self.rank != root:
            self._send_obj(obj, root, tag, "gather_obj")
            return None
        # Every rank's message is received before a failure is raised (an unmatched send waits out the timeout).
        results, problem = [], None
        for r in range(self.size):
            if r == root:
                results.append(obj)
                continue
            try:
                results.append(self._unpickle(self._recv_obj_bytes(r, tag, "gather_obj"), "gather_obj", r))
            except RemoteRankError as e:
                problem = problem or e
                results.append(None)
        if problem is not None:
            raise problem
        return results

    @watch.collective
    def scatter_obj(self, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
        if self.size > 1:  # a bad root is told to every rank, in the call check
            self._agree_obj("scatter_obj", root, error=self._peer_error(root, "scatter_obj: root"))
        self.check_rank(root, "root")
        tag = _wire.wire_tag(_call_check.KIND["scatter_obj"], "collective")
        if self.rank != root:
            problem, obj = self._unpickle(self._recv_obj_bytes(root, tag, "scatter_obj"), "scatter_obj", root)
            if problem is not None:
                raise RemoteRankError(f"scatter_obj: root rank {root} failed: {problem} (raised on rank {self.rank})")
            return obj
        problem = None
        if objs is None or len(objs) != self.size:
            problem = TorchmnValueError(f"scatter_obj: root must pass {self.size} objects (one per rank), not "
                                        f"{'None' if objs is None else len(objs)}")
        for r in range(self.size):
            if r == root:
                continue
            if problem is None:
                try:
                    self._send_obj((None, objs[r]), r, tag, "scatter_obj")
                except Exception as e:  # could not pickle: send_obj has told rank r
                    problem = e
                continue
            # Every rank still waiting hears why, instead of waiting until the timeout.
            self._send_obj((f"{type(problem).__name__}: {problem}", None), r, tag, "scatter_obj")
        if problem is not None:
            raise problem
        return objs[root]

    @watch.collective
    def allreduce_obj(self, obj: Any) -> Any:
        return functools.reduce(lambda total, v: total + v, self.allgather_obj_as(obj, "allreduce_obj"))

    def _unpickle(self, buf: torch.Tensor, kind: str, source: int) -> Any:
        return unpickle_from(buf, kind, source, self.rank, self.host)

    # ----------------------------------------------------------------------------- a model's tensors
    @watch.collective
    def bcast_data(self, model: torch.nn.Module, root: int = 0) -> None:
        if self.size > 1 and (err := self._peer_error(root, "bcast_data: root")):  # told in the others' layout check
            self._agree_obj("check_same_layout", error=err)
        self.check_rank(root, "root")
        tensors = list(model.parameters()) + list(model.buffers())
        self.check_same_layout(tensors, "bcast_data: the model's parameters and buffers", root,
                               "build the same model on every rank")
        self.bcast_tensors(tensors, root)

    @watch.collective
    def check_same_layout(self, tensors: list[torch.Tensor], what: str, root: int = 0,
                          advice: str = "build the same model on every rank") -> None:
        if self.size == 1:
            return
        layouts = self.allgather_obj_as([(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors],
                                        "check_same_layout", root=root)
        found = _call_check.layout_difference(layouts, root)
        if found is not None:
            bad, detail = found
            raise CollectiveMismatchError(
                f"{what} differ between ranks: rank(s) {bad} (on {self._hosts[bad[0]]}) differ from root rank "
                f"{root}'s ({detail}); {advice} (raised on rank {self.rank})")

    def _layout_checksum(self, params: list[torch.Tensor]) -> int:
        """A checksum of the parameters' shapes and dtypes, remembered for the last layout seen."""
        key = tuple((p.shape, p.dtype) for p in params)
        cached = getattr(self, "_last_layout", None)
        if cached is None or cached[0] != key:
            cached = (key, zlib.crc32(repr([(tuple(s), d) for s, d in key]).encode()))
            self._last_layout = cached
        return cached[1]

    @watch.collective
    def bcast_tensors(self, tensors: list[torch.Tensor], root: int = 0) -> None:
        if self.size == 1:
            return
        with torch.no_grad():
            for bucket in _wire.buckets(tensors, self.bucket_cap_bytes):
                # Each rank's bucket lies on its own device alike (the layout check compares them).
                device = self.wire_device(bucket[0])
                if self.rank == root:
                    flat = torch.cat([_wire.as_bytes(t.detach()) for t in bucket]).to(device)
                else:
                    n = sum(t.numel() * t.element_size() for t in bucket)
                    flat = torch.empty(n, dtype=torch.uint8, device=device)
                self._bcast_bytes(flat, root)
                if self.rank != root:
                    offset = 0
                    for t in bucket:
                        n = t.numel() * t.element_size()
                        t.copy_(_wire.from_bytes(flat[offset:offset + n], t.dtype, t.shape))
                        offset += n

    @watch.collective
    def multi_node_mean_grad(self, model: torch.nn.Module, zero_fill: bool = False) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        sparse_fill = [0] * len(params)  # the sparse_dim a missing gradient's zeros take; 0: dense
        if self.size > 1:
            # Buckets pair the ranks' gradients by position: a model of another layout would mix them silently
            # (shared memory) or abort the process (gloo). One small exchange carries a checksum of the layout,
            # one of which gradients are None, and zero_fill; layouts or masks go only where a checksum differs.
            row = _call_check.mean_grad_row(self._layout_checksum(params), params, zero_fill)
            hdrs = self._agree("multi_node_mean_grad", rows=[row])[:, 0]
            _call_check.check_zero_fill(hdrs[:, _wire.SHAPE + 4].tolist(), self.rank)
            if len(set(hdrs[:, _wire.SHAPE].tolist())) > 1:
                self.check_same_layout(params, "multi_node_mean_grad: the model's trainable parameters", 0,
                                       "build the same model on every rank")
            if zero_fill and hdrs[:, _wire.SHAPE + 1].any() and hdrs[:, _wire.SHAPE + 2].any():
                # A missing gradient counts as zeros of the kind the other ranks have: a dense fill of a sparse
                # gradient would pair it with another bucket, and wait for ever. Each sparse gradient's
                # sparse_dim (1 for nn.Embedding), which the zeros must share.
                dims = self.allgather_obj([p.grad.sparse_dim() if p.grad is not None and p.grad.is_sparse else 0
                                           for p in params])
                sparse_fill = [max(d[i] for d in dims) for i in range(len(params))]
            if not zero_fill and len(set(hdrs[:, _wire.SHAPE + 3].tolist())) > 1:
                # Skipping must be agreed on: a tensor left out on some ranks only would pair the
                # rest wrongly. The masks differ: find where, to say so.
                masks = self.allgather_obj([p.grad is not None for p in params])
                raise _call_check.missing_grads_error(masks, params, self.rank)
        grads, sparse = [], []
        for i, p in enumerate(params):
            if p.grad is None:
                if not zero_fill:
                    continue
                p.grad = torch.zeros_like(p).to_sparse(sparse_fill[i]) if sparse_fill[i] else torch.zeros_like(p)
            (sparse if p.grad.is_sparse else grads).append(p)
        # Sparse gradients (nn.Embedding(sparse=True)) cannot be packed into buckets: each has its own
        # allreduce, whose result is the union of the ranks' rows; through gloo, as NCCL has none.
        for p in sparse if self.size > 1 else ():
            g = p.grad if p.grad.device.type == "cpu" else p.grad.cpu()
            dist.all_reduce(g, group=self.object_group)
            g.div_(self.size)
            if g is not p.grad:
                p.grad = g.to(p.device)
        self.mean_tensors([p.grad for p in grads])

    # ----------------------------------------------------------------------------- control
    @watch.collective
    def barrier(self) -> None:
        # The call check's exchange waits for every rank, so it is the barrier, and a rank at
        # another collective meanwhile is named instead of hanging both.
        if self.size > 1:
            self._agree("barrier", rows=[_wire.header(_call_check.KIND["barrier"])])

    @watch.collective
    def split(self, color: int, key: int = 0) -> "Communicator":
        cls = type(self)
        self._splits += 1
        entries = self.allgather_obj_as((color, key, self.rank, torch_group_count(), idle_groups()), "split")
        reuse = reuse_budget({self.world_rank(e[2]): e[4] for e in entries})  # finalized ones' groups
        colors = sorted({e[0] for e in _call_check.split_entries(entries, self.rank)}, key=repr)
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
                group = group_for(world, reuse) if self.size > 1 else None
            else:
                # Only this communicator's ranks are here: each color's members make their group alone
                # (torch names it by its ranks, so concurrent splits elsewhere cannot take its name).
                match_group_counts([e[3] for e in entries if e[0] == c])
                group = group_for(world, reuse, use_local_synchronization=True)
            obj_group = group
            if self.backend == "nccl":
                obj_group = group_for(world, reuse, backend="gloo", use_local_synchronization=not whole_world)
            extra = cls.split_groups(self, members, local=not whole_world, reuse=reuse)
            if c == color:
                by_world = sorted(world)
                mine = (members.index(self.rank), len(members), group, obj_group, [by_world.index(w) for w in world],
                        extra, f"{self.call_log.tag}.{self._splits}.{colors.index(c)}")
        rank, size, group, obj_group, group_ranks, extra, tag = mine
        child = cls(rank=rank, size=size, group=group, obj_group=obj_group, backend=self.backend,
                    node_key=self.node_key, bucket_cap_bytes=self.bucket_cap_bytes, group_ranks=group_ranks,
                    tag=tag, **extra)
        child.compression = self.compression  # allreduce_grad_dtype holds for what is split off too
        child.made_groups = [group, obj_group] + [g for v in extra.values() for g in (v if isinstance(v, list) else [v])]
        return child

    @classmethod
    def split_groups(cls, parent: "Communicator", members: list[int], local: bool = False, reuse=None) -> dict:
        """The extra process groups a new communicator of ``members`` needs, as constructor keyword
        arguments (:meth:`split` calls it; its ``finalize`` releases them): none here, the group
        across nodes and the rails for ``hierarchical``.

        Args:
            parent: the communicator being split.
            members: the new communicator's ranks, as ranks of ``parent``, in the new order.
            local: ``False``: every rank of the world calls it for every color, in order; ``True``:
                the members alone do (``use_local_synchronization=True``).
            reuse: idle groups to take first (``_group_utility.group_for``'s budget).

        Returns:
            Keyword arguments for the new communicator's constructor: groups or lists of them.

        Example::

            >>> type(comm).split_groups(comm, [0, 2], local=False)    # flat or naive
            {}
        """
        return {}

    def finalize(self) -> None:
        if self.call_log.closed:
            return
        self.call_log.closed = True
        if self._owns_world:
            world.shutdown_world()
        for group in dict.fromkeys(self.made_groups):  # kept for a later split of these ranks (_group_utility)
            release(group)

    def drop_process_groups(self) -> None:
        """Finalize this communicator and drop its process groups at once, for a rank ending with an uncaught
        exception (:func:`.failure.release_groups`): a gloo group's connections close only when the last
        reference to it goes. Algorithms holding more drop them too.

        Example::

            >>> comm.drop_process_groups()
            >>> comm.allreduce(x)    # RuntimeError: ... a communicator that was finalized
        """
        self.call_log.closed = True
        self.process_group, self.object_group, self.made_groups = None, None, []

    def take_over(self, fresh: "Communicator") -> None:
        """Become ``fresh``, a communicator of a new world (an elastic job's reset, :mod:`torchmn.elastic`), so
        that what holds this one reaches that world through it: rank, size, topology and class are ``fresh``'s.
        Communicators split off this one stay finalized.

        Args:
            fresh: a communicator just made by :func:`torchmn.create_communicator` for the new world.

        Example::

            >>> comm.take_over(torchmn.create_communicator())   # after the world was set up again
            >>> comm.size                                       # the new world's
            3
        """
        # One set of attributes for both: what fresh handed out bound to itself (its groups' and
        # shared memory's callbacks) and this object then see the same state.
        self.__class__ = type(fresh)
        self.__dict__ = fresh.__dict__

    # ----------------------------------------------------------------------------- gradient primitives
    @property
    def grad_bucket_cap_bytes(self) -> int:
        return self.bucket_cap_bytes

    @watch.collective
    def allreduce_flat(self, flat: torch.Tensor, async_op: bool = False, op: str = "sum"):
        if self.size == 1:
            return Completed()
        return _gloo_utility.all_reduce(flat, op, self.wire_group(flat), async_op=async_op)

    @watch.collective
    def reduce_scatter_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if self.size == 1:
            shard.copy_(flat)
            return Completed()
        if not self._identity_order:
            # torch numbers a group's ranks by world rank; after split(key=...) this communicator's
            # rank r is another group rank, so hand torch the chunks in its order.
            chunks = self._group_order(list(flat.split(shard.numel())))
            return dist.reduce_scatter(shard, chunks, group=self.wire_group(flat), async_op=async_op)
        return _gloo_utility.reduce_scatter_single(shard, flat, self.wire_group(flat), async_op, self.inter_size > 1)

    @watch.collective
    def allgather_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if self.size == 1:
            flat.copy_(shard)
            return Completed()
        if not self._identity_order:  # as in reduce_scatter_flat
            chunks = self._group_order(list(flat.split(shard.numel())))
            return dist.all_gather(chunks, shard, group=self.wire_group(flat), async_op=async_op)
        return _gloo_utility.all_gather_single(flat, shard, self.wire_group(flat), async_op, self.inter_size > 1)

    def open_node_arena(self, shared_bytes: int, region_bytes: int, points: Sequence[str],
                        owned_shared: Sequence[Tuple[int, int]] = ()):
        return None

    def may_share_node_memory(self) -> bool:
        return False

