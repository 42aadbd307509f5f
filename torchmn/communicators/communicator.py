"""The communicator: ranks, node topology, tensor and object collectives.

Built on ``torch.distributed``. Tensor collectives check, on every rank, that all ranks made the
same call (collective, root, op, dtype, shape where it must agree) before moving data, so a
mismatch raises the same error everywhere instead of hanging. The gradient paths
(:meth:`Communicator.multi_node_mean_grad` and the optimizer) skip that check: they move
tensors whose layout all ranks already agree on.
"""
from __future__ import annotations

import abc
import pickle
import socket
import zlib
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from torchmn.communicators import _wire, watch
from torchmn.communicators._pickle import dumps
from torchmn.communicators.errors import CollectiveMismatchError, RemoteRankError

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
_OP_CODES = {name: i for i, name in enumerate(_OPS)}


def divide_before_sum(dtype: torch.dtype) -> bool:
    """Whether a mean over ranks divides before the sum rather than after: in float16 and bfloat16,
    where the sum of a few ranks' large values overflows (65504 is float16's largest)."""
    return dtype in (torch.float16, torch.bfloat16)

# Collective kinds, as they travel in headers. INVALID marks a rank whose own arguments were bad:
# it still takes part in the header exchange, so the others fail with it instead of hanging.
_KINDS = ("invalid", "bcast", "gather", "allgather", "scatter", "alltoall", "allreduce", "allgather_obj",
          "bcast_obj", "gather_obj", "scatter_obj", "multi_node_mean_grad")
_KIND = {name: i for i, name in enumerate(_KINDS)}

# Point-to-point messages of send/recv, of send_obj/recv_obj and of the object collectives share one
# process group; each travels in its own tag space, so that none can match another's message (a
# user's send_obj(tag=2) once matched gather_obj's own, and send() against recv_obj() aborted gloo).
_TAG_SPACES = {"tensor": 0, "object": 1, "collective": 2}
MAX_TAG = 2 ** 28


def _wire_tag(tag: int, space: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < MAX_TAG:
        raise ValueError(f"tag must be an integer from 0 to {MAX_TAG - 1}, not {tag!r}")
    return tag * len(_TAG_SPACES) + _TAG_SPACES[space]

# gloo and NCCL count elements in 32-bit integers; objects travel in chunks below that.
OBJ_CHUNK_BYTES = 256 * 1024 * 1024
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class Communicator(abc.ABC):
    """A group of ranks and the collectives among them.

    Do not build one directly: :func:`torchmn.create_communicator` detects the launcher, sets up
    ``torch.distributed`` and returns the subclass for the gradient-averaging algorithm asked for.

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
        global _WORLDS
        if tag is None:
            _WORLDS += 1
            tag = f"world{_WORLDS}"
        self._tag = tag
        self._calls = 0
        self._watch_depth = 0
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
        self._finalized = False
        self._node_key = node_key
        self._data_device = torch.device("cpu")  # until the topology tells which GPU (NCCL)
        self._set_topology(node_key)
        if backend == "nccl":
            self.device = torch.device("cuda", self.intra_rank)
        else:
            self.device = torch.device("cpu")
        self._data_device = self.device  # where headers and byte buffers live for this backend

    # ----------------------------------------------------------------------------- topology
    def _set_topology(self, node_key: Any) -> None:
        mine = (node_key, socket.gethostname(), self.name)
        both = self.allgather_obj(mine) if self.size > 1 else [mine]
        keys = [k for k, _, _ in both]
        self._hosts = [h for _, h, _ in both]
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
        self._node_keys = keys

    @property
    def host(self) -> str:
        return socket.gethostname()

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} rank {self.rank}/{self.size} intra {self.intra_rank}/"
                f"{self.intra_size} inter {self.inter_rank}/{self.inter_size} {self.backend}>")

    # ----------------------------------------------------------------------------- plumbing
    def _global(self, r: int) -> int:
        """The world rank of this communicator's rank ``r`` (torch.distributed speaks world ranks)."""
        g = self._group_ranks[r]
        if self._group is None or self._group is dist.GroupMember.WORLD:
            return g
        return dist.get_global_rank(self._group, g)

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

    def _check_peer(self, r: int, what: str) -> None:
        err = self._peer_error(r, what)
        if err is not None:
            raise err

    def _peer_error(self, r: int, what: str) -> Optional[ValueError]:
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
        dist.all_gather_single(out, mine.reshape(-1), group=group)
        out = out.reshape((self.size,) + tuple(mine.shape)).cpu()
        return out if self._identity_order else out[self._group_ranks]

    def _agree(self, kind: str, *, root: int = _wire.NONE, op: str | None = None,
               x: torch.Tensor | None = None, rows: list[list[int]] | None = None,
               error: Exception | None = None, same_shape: bool = False,
               same_dtype: bool = True, objects: bool = False) -> torch.Tensor:
        """Exchange one call's headers and raise on every rank if the ranks disagree.

        ``error``: this rank's own arguments were bad; the others are told, then it is raised here.
        """
        op_code = _OP_CODES[op] if op is not None else _wire.NONE
        if error is None and rows is None:
            try:  # a tensor the wire cannot describe (too many dimensions, an unknown dtype)
                rows = [_wire.header(_KIND[kind], root, op_code, x)]
            except (TypeError, ValueError) as e:
                error = type(e)(f"{kind}: {e}")
        if error is not None:
            rows = [_wire.header(_KIND["invalid"], _wire.NONE, op_code)] * (len(rows) if rows else 1)
        if len(rows) > 1 and self.size > 1:
            # A call of several rows (scatter, alltoall) first agrees on what it is in one row, so
            # that a rank making a one-row call meanwhile exchanges as many bytes as this one and
            # the mismatch is named, instead of the exchange itself failing.
            what = [rows[0][:3] + [_wire.NONE, _wire.NONE] + [0] * _wire.MAX_NDIM]
            self._check_headers(kind, self._exchange_headers(what, objects), error, same_shape, same_dtype)
        hdrs = self._exchange_headers(rows, objects)
        self._check_headers(kind, hdrs, error, same_shape, same_dtype)
        return hdrs

    def _check_headers(self, kind: str, hdrs: torch.Tensor, error: Exception | None, same_shape: bool,
                       same_dtype: bool) -> None:
        if error is not None:
            raise error
        bad = [r for r in range(self.size) if hdrs[r, 0, 0] == _KIND["invalid"]]
        if bad:
            raise RemoteRankError(f"{kind}: rank {bad[0]} rejected its arguments (see its error); "
                                  f"rank {self.rank} on {self.host} stops too")
        first = hdrs[:, 0, :]
        problems = []
        for field, col, names in (("collective", 0, _KINDS), ("root", 1, None), ("op", 2, tuple(_OPS))):
            vals = first[:, col].tolist()
            if len(set(vals)) > 1:
                shown = [names[v] if names and v >= 0 else v for v in vals]
                problems.append(f"{field} differs: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
        if not problems and hdrs.shape[1] == 1:
            metas = [_wire.meta(first[r].tolist()) for r in range(self.size)]
            present = [(r, m) for r, m in enumerate(metas) if m is not None]
            if same_dtype and len({m[0] for _, m in present}) > 1:
                problems.append("dtype differs: " + ", ".join(f"rank {r}: {m[0]}" for r, m in present))
            if same_shape and len({m[1] for _, m in present}) > 1:
                problems.append("shape differs: " + ", ".join(f"rank {r}: {tuple(m[1])}" for r, m in present))
        if problems:
            raise CollectiveMismatchError(f"ranks called {kind} inconsistently ({'; '.join(problems)}); "
                                          f"every rank must make the same call")

    # ----------------------------------------------------------------------------- point to point
    def send(self, x: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Send a tensor of any shape and dtype to rank ``dest``; it calls ``recv(source)``.

        Example::

            >>> if comm.rank == 0: comm.send(torch.ones(3, 2), dest=1)
            >>> if comm.rank == 1: x = comm.recv(source=0)
        """
        self._check_peer(dest, "dest")
        tag = _wire_tag(tag, "tensor")
        hdr = torch.tensor(_wire.header(_KIND["bcast"], x=x), dtype=torch.int64, device=self._data_device)
        dist.send(hdr, self._global(dest), group=self._group, tag=tag)
        data = _wire.as_bytes(x.to(self._data_device))
        if data.numel():
            dist.send(data, self._global(dest), group=self._group, tag=tag)

    def recv(self, source: int, tag: int = 0) -> torch.Tensor:
        """Receive the tensor rank ``source`` sent with :meth:`send`; shape and dtype come with it."""
        self._check_peer(source, "source")
        tag = _wire_tag(tag, "tensor")
        hdr = torch.empty(_wire.HEADER_LEN, dtype=torch.int64, device=self._data_device)
        dist.recv(hdr, self._global(source), group=self._group, tag=tag)
        dtype, shape = _wire.meta(hdr.tolist())
        buf = torch.empty(_wire.nbytes(dtype, shape), dtype=torch.uint8, device=self._data_device)
        if buf.numel():
            dist.recv(buf, self._global(source), group=self._group, tag=tag)
        return _wire.from_bytes(buf, dtype, shape)

    # ----------------------------------------------------------------------------- collectives
    def bcast(self, x: Optional[torch.Tensor], root: int = 0) -> torch.Tensor:
        """Root's tensor on every rank. Non-root ranks may pass ``None``.

        Example::

            >>> w = comm.bcast(torch.randn(3, 3) if comm.rank == 0 else None)
        """
        err = self._peer_error(root, "bcast: root")
        if err is None and self.rank == root and not isinstance(x, torch.Tensor):
            err = TypeError(f"bcast: root rank {root} must pass a tensor, not {type(x).__name__}")
        hdrs = self._agree("bcast", root=root, x=x if self.rank == root else None, error=err)
        dtype, shape = _wire.meta(hdrs[root, 0].tolist())
        if self.rank == root:
            buf = _wire.as_bytes(x.to(self._data_device))
        else:
            buf = torch.empty(_wire.nbytes(dtype, shape), dtype=torch.uint8, device=self._data_device)
        self._bcast_bytes(buf, root)
        return x if self.rank == root else _wire.from_bytes(buf, dtype, shape)

    def _bcast_bytes(self, buf: torch.Tensor, root: int, group=None) -> None:
        group = self._group if group is None else group
        if self.size == 1 or buf.numel() == 0:
            return
        for start in range(0, buf.numel(), OBJ_CHUNK_BYTES):
            dist.broadcast(buf[start:start + OBJ_CHUNK_BYTES], self._global(root), group=group)

    def _allgather_bytes(self, buf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Every rank's byte buffer, sizes known in advance; unequal sizes are padded in flight."""
        if self.size == 1:
            return [buf]
        longest = max(sizes)
        out = torch.empty(self.size * longest, dtype=torch.uint8, device=buf.device)
        if longest:
            dist.all_gather_single(out, _padded(buf, longest), group=self._group)
        chunks = self._comm_order([out[g * longest:(g + 1) * longest] for g in range(self.size)])
        return [c[:n] for c, n in zip(chunks, sizes)]

    def gather(self, x: torch.Tensor, root: int = 0) -> Optional[tuple[torch.Tensor, ...]]:
        """Every rank's tensor, in rank order, on ``root`` (``None`` elsewhere). Shapes may differ.

        Example::

            >>> parts = comm.gather(torch.arange(comm.rank + 1))   # root: (tensor([0]), tensor([0, 1]), ...)
        """
        err = self._peer_error(root, "gather: root")
        if err is None and not isinstance(x, torch.Tensor):
            err = TypeError(f"gather: pass a tensor, not {type(x).__name__}")
        hdrs = self._agree("gather", root=root, x=x if err is None else None, error=err)
        if self.size == 1:
            return (x,)
        metas = [_wire.meta(hdrs[r, 0].tolist()) for r in range(self.size)]
        sizes = [_wire.nbytes(*m) for m in metas]
        mine = _wire.as_bytes(x.to(self._data_device))
        if self.backend == "nccl":  # NCCL has no gather: all-gather and keep root's copy
            parts = self._allgather_bytes(mine, sizes)
        else:
            longest = max(sizes)
            bufs = [torch.empty(longest, dtype=torch.uint8, device=self._data_device)
                    for _ in range(self.size)] if self.rank == root else None
            if longest:
                dist.gather(_padded(mine, longest), bufs, dst=self._global(root), group=self._group)
            parts = [b[:n] for b, n in zip(self._comm_order(bufs), sizes)] if self.rank == root else None
        if self.rank != root:
            return None
        return tuple(_wire.from_bytes(b, *m) for b, m in zip(parts, metas))

    def allgather(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every rank's tensor, in rank order, on every rank. Shapes may differ (dtypes may not).

        Example::

            >>> xs = comm.allgather(torch.full((comm.rank + 1, 2), comm.rank))
        """
        err = None if isinstance(x, torch.Tensor) else TypeError(f"allgather: pass a tensor, not {type(x).__name__}")
        hdrs = self._agree("allgather", x=x if err is None else None, error=err)
        metas = [_wire.meta(hdrs[r, 0].tolist()) for r in range(self.size)]
        bufs = self._allgather_bytes(_wire.as_bytes(x.to(self._data_device)), [_wire.nbytes(*m) for m in metas])
        if self.size == 1:
            return (x,)
        return tuple(_wire.from_bytes(b, *m) for b, m in zip(bufs, metas))

    def scatter(self, xs: Optional[Sequence[torch.Tensor]], root: int = 0) -> torch.Tensor:
        """Rank ``i`` receives ``xs[i]`` from root; other ranks pass ``None``. Shapes may differ.

        Example::

            >>> mine = comm.scatter([torch.full((2,), i) for i in range(comm.size)] if comm.rank == 0 else None)
        """
        err = self._peer_error(root, "scatter: root")
        if err is None and self.rank == root:
            if xs is None or len(xs) != self.size or not all(isinstance(t, torch.Tensor) for t in xs):
                err = ValueError(f"scatter: root rank {root} must pass a sequence of {self.size} tensors "
                                 f"(one per rank), got {type(xs).__name__}"
                                 + (f" of length {len(xs)}" if hasattr(xs, '__len__') else ""))
        rows = [_wire.header(_KIND["scatter"], root if err is None else _wire.NONE)] * self.size
        if self.rank == root and err is None:
            try:
                rows = [_wire.header(_KIND["scatter"], root, _wire.NONE, t) for t in xs]
            except (TypeError, ValueError) as e:
                err = type(e)(f"scatter: {e}")
        hdrs = self._agree("scatter", root=root, rows=rows, error=err)
        metas = [_wire.meta(hdrs[root, i].tolist()) for i in range(self.size)]
        if self.size == 1:
            return xs[0]
        sizes = [_wire.nbytes(*m) for m in metas]
        longest = max(sizes)
        out = torch.empty(longest, dtype=torch.uint8, device=self._data_device)
        if longest:
            chunks = None
            if self.rank == root:
                chunks = [_padded(_wire.as_bytes(t.to(self._data_device)), longest) for t in xs]
            if self.backend == "nccl":
                # NCCL has no scatter: root broadcasts the stacked chunks.
                stacked = torch.cat(self._group_order(chunks)) if chunks else torch.empty(self.size * longest, dtype=torch.uint8,
                                                                      device=self._data_device)
                self._bcast_bytes(stacked, root)
                g = self._group_ranks[self.rank]
                out = stacked[g * longest:(g + 1) * longest]
            else:
                dist.scatter(out, self._group_order(chunks) if chunks else None, src=self._global(root),
                             group=self._group)
        return _wire.from_bytes(out[:sizes[self.rank]].clone(), *metas[self.rank])

    def alltoall(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Rank ``i`` sends ``xs[j]`` to rank ``j`` and receives, in rank order, what each sent it.

        Example::

            >>> got = comm.alltoall([torch.tensor([comm.rank, j]) for j in range(comm.size)])
        """
        err = None
        if xs is None or len(xs) != self.size or not all(isinstance(t, torch.Tensor) for t in xs):
            err = ValueError(f"alltoall: pass a sequence of {self.size} tensors (one per rank)")
        rows = [_wire.header(_KIND["alltoall"])] * self.size
        if err is None:
            try:
                rows = [_wire.header(_KIND["alltoall"], x=t) for t in xs]
            except (TypeError, ValueError) as e:
                err = type(e)(f"alltoall: {e}")
        hdrs = self._agree("alltoall", rows=rows, error=err)
        dtypes = [sorted({str(_wire.meta(hdrs[r, j].tolist())[0]) for j in range(self.size)}) for r in range(self.size)]
        if len({d for ds in dtypes for d in ds}) > 1:
            shown = ", ".join(f"rank {r}: {'/'.join(d.replace('torch.', '') for d in ds)}" for r, ds in enumerate(dtypes))
            raise CollectiveMismatchError(f"ranks called alltoall with different dtypes ({shown}); every tensor "
                                          f"of every rank must have one dtype (raised on rank {self.rank})")
        if self.size == 1:
            return (xs[0],)
        # What rank r sends to me is described by header row [r, me].
        recv_metas = [_wire.meta(hdrs[r, self.rank].tolist()) for r in range(self.size)]
        # One buffer each way with per-rank splits: gloo's list all_to_all takes equal sizes only.
        send = self._group_order([_wire.as_bytes(t.to(self._data_device)).reshape(-1) for t in xs])
        recv_sizes = [_wire.nbytes(*m) for m in recv_metas]
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self._data_device)
        dist.all_to_all_single(recv, torch.cat(send), output_split_sizes=self._group_order(recv_sizes),
                               input_split_sizes=[b.numel() for b in send], group=self._group)
        parts = dict(zip(self._group_order(list(range(self.size))),
                         torch.split(recv, self._group_order(recv_sizes))))
        return tuple(_wire.from_bytes(parts[r], *m) for r, m in enumerate(recv_metas))

    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The elementwise reduction of every rank's ``x``, as a new tensor (``x`` is unchanged).

        ``op``: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``. ``"mean"`` of an integer
        or bool tensor is a float64 tensor (exact for int64 sums below 2**53); float16 and bfloat16
        means are summed in float64, so that a sum beyond their range does not overflow.

        Example::

            >>> comm.allreduce(torch.arange(4) + comm.rank)   # arange(4) * size + sum(ranks)
        """
        err = None
        if op not in _OPS:
            err = ValueError(f"allreduce: op must be one of {', '.join(_OPS)}, not {op!r}")
        elif not isinstance(x, torch.Tensor):
            err = TypeError(f"allreduce: pass a tensor, not {type(x).__name__}")
        elif x.dtype in _wire.MOVE_ONLY:
            err = TypeError(f"allreduce: torch has no arithmetic for {x.dtype} on CPU, so it cannot be reduced; "
                            f"convert first (x.to(torch.int64), x.float()) and back")
        elif x.is_complex() and op in ("max", "min"):
            err = ValueError(f"allreduce: op {op!r} is undefined for complex tensors ({x.dtype})")
        elif x.is_complex() and op == "prod":
            # Decided here, on every rank alike: a failure inside the backend would reach only the
            # ranks that call it (between nodes, not the others of each node).
            err = ValueError(f"allreduce: torch.distributed has no 'prod' of complex tensors ({x.dtype}); "
                             f"multiply the gathered tensors instead (torch.stack(comm.allgather(x)).prod(0))")
        self._agree("allreduce", op=None if err else op, x=None if err else x, error=err, same_shape=True)
        src = x.detach().to(self._data_device)
        if op == "mean" and src.dtype == torch.bool:
            src = src.to(torch.int64)  # a bool sum is a logical or: count the True values instead
        if op == "mean" and divide_before_sum(src.dtype):
            return self.allreduce(x.double(), op="mean").to(x.dtype)  # bfloat16 reaches float32's range
        # gloo has no int16 reduction; int32 gives the same bits once cast back (two's complement
        # wraps alike), except "mean", whose result is floating-point anyway.
        widen = src.dtype == torch.int16
        out = self._allreduce_copy((src.to(torch.int32) if widen else src).contiguous(),
                                   "sum" if op == "mean" else op)
        if widen and op != "mean":
            out = out.to(torch.int16)
        if op == "mean":
            out = out.to(torch.float64).div_(self.size) if not out.is_floating_point() and not out.is_complex() \
                else out.div_(self.size)
        return out.to(x.device)

    def _allreduce_copy(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """The reduction of contiguous ``x`` over ranks, as a new tensor."""
        out = x.clone()
        self.allreduce_flat(out.view(-1), op=op)
        return out

    # ----------------------------------------------------------------------------- objects
    def _dump(self, obj: Any) -> torch.Tensor:
        return torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8)

    def _load(self, buf: torch.Tensor, kind: str, source: int) -> Any:
        try:
            return pickle.loads(buf.cpu().numpy().tobytes())
        except Exception as e:  # unpickling runs the sender's classes' code: any error can come out
            raise RemoteRankError(f"{kind}: rank {source}'s object was pickled but cannot be unpickled on rank "
                                  f"{self.rank} ({self.host}): {type(e).__name__}: {e}; is its class importable, "
                                  f"with the same code, on every rank?") from e

    def _obj_lengths(self, n: int, error: Optional[Exception] = None) -> list[int]:
        """Every rank's pickled length, in a call header like the tensor collectives', so a rank
        making another collective meanwhile, or one that could not pickle, is named. Under NCCL the
        object collectives' headers travel on the CPU group: a tensor collective made meanwhile on
        another rank is then not named, only timed out."""
        if self.size == 1:
            if error is not None:
                raise error
            return [n]
        return self._agree_obj("allgather_obj", n=n, error=error)[:, 0, _wire.SHAPE].tolist()

    def _agree_obj(self, kind: str, root: int = _wire.NONE, n: int = 0,
                   error: Optional[Exception] = None) -> torch.Tensor:
        """The call check of object collective ``kind`` (see ``_obj_header``): every rank's row."""
        return self._agree(kind, rows=[_obj_header(n, kind, root)], error=error, objects=True)

    def _try_dump(self, obj: Any, kind: str) -> tuple[Optional[torch.Tensor], Optional[Exception]]:
        """``obj`` pickled, or the error to raise once the other ranks have been told."""
        try:
            return self._dump(obj), None
        except Exception as e:  # pickle fails in many ways (PicklingError, TypeError, AttributeError)
            err = TypeError(f"{kind}: rank {self.rank} on {self.host} cannot pickle its object "
                            f"({type(obj).__name__}): {e}")
            err.__cause__ = e
            return None, err

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Root's picklable object on every rank. Sent in chunks, so objects over 2 GiB work.

        Example::

            >>> config = comm.bcast_obj(load_config() if comm.rank == 0 else None)
        """
        self._check_peer(root, "root")
        if self.size == 1:
            return obj
        buf, err = self._try_dump(obj, "bcast_obj") if self.rank == root else (None, None)
        # The call header names ranks that pass another root, or make another call, instead of hanging.
        hdrs = self._agree_obj("bcast_obj", root, buf.numel() if buf is not None else 0, err)
        n = int(hdrs[root, 0, _wire.SHAPE])
        if buf is None:
            buf = torch.empty(n, dtype=torch.uint8)
        self._bcast_bytes(buf, root, group=self._obj_group)
        return obj if self.rank == root else self._load(buf, "bcast_obj", root)

    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send a picklable object to rank ``dest``, which calls :meth:`recv_obj`."""
        self._check_peer(dest, "dest")
        self._send_obj(obj, dest, _wire_tag(tag, "object"), "send_obj")

    def recv_obj(self, source: int, tag: int = 0) -> Any:
        """Receive the object rank ``source`` sent with :meth:`send_obj`."""
        self._check_peer(source, "source")
        return self._load(self._recv_obj_bytes(source, _wire_tag(tag, "object"), "recv_obj"), "recv_obj", source)

    def _send_obj(self, obj: Any, dest: int, wire_tag: int, kind: str) -> None:
        buf, err = self._try_dump(obj, kind)
        dist.send(torch.tensor([buf.numel() if err is None else -1], dtype=torch.int64), self._global(dest),
                  group=self._obj_group, tag=wire_tag)
        if err is not None:
            raise err  # the receiver was told
        for start in range(0, buf.numel(), OBJ_CHUNK_BYTES):
            dist.send(buf[start:start + OBJ_CHUNK_BYTES], self._global(dest), group=self._obj_group, tag=wire_tag)

    def _recv_obj_bytes(self, source: int, wire_tag: int, kind: str) -> torch.Tensor:
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, self._global(source), group=self._obj_group, tag=wire_tag)
        if n.item() < 0:
            raise RemoteRankError(f"{kind}: rank {source} could not pickle the object it sent (see its error); "
                                  f"rank {self.rank} on {self.host} stops too")
        buf = torch.empty(int(n), dtype=torch.uint8)
        for start in range(0, buf.numel(), OBJ_CHUNK_BYTES):
            dist.recv(buf[start:start + OBJ_CHUNK_BYTES], self._global(source), group=self._obj_group, tag=wire_tag)
        return buf

    def allgather_obj(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank.

        Example::

            >>> hosts = comm.allgather_obj(socket.gethostname())
        """
        if self.size == 1:
            return [obj]
        buf, err = self._try_dump(obj, "allgather_obj")
        sizes = self._obj_lengths(buf.numel() if err is None else 0, err)
        if max(sizes) * self.size <= OBJ_CHUNK_BYTES:
            longest = max(sizes)
            out = torch.empty(self.size * longest, dtype=torch.uint8)
            dist.all_gather_single(out, _padded(buf, longest), group=self._obj_group)
            chunks = self._comm_order([out[g * longest:(g + 1) * longest] for g in range(self.size)])
            return [self._load(c[:n], "allgather_obj", r) for r, (c, n) in enumerate(zip(chunks, sizes))]
        # Large objects: each rank broadcasts its own in turn, in chunks.
        result = []
        for r, n in enumerate(sizes):
            b = buf if r == self.rank else torch.empty(n, dtype=torch.uint8)
            self._bcast_bytes(b, r, group=self._obj_group)
            result.append(obj if r == self.rank else self._load(b, "allgather_obj", r))
        return result

    def gather_obj(self, obj: Any, root: int = 0) -> Optional[list[Any]]:
        """Every rank's object, in rank order, on ``root``; ``None`` elsewhere."""
        self._check_peer(root, "root")
        if self.size == 1:
            return [obj]
        self._agree_obj("gather_obj", root)
        tag = _wire_tag(_KIND["gather_obj"], "collective")
        if self.rank != root:
            self._send_obj(obj, root, tag, "gather_obj")
            return None
        # Every rank's message is received before a failure is raised: a rank whose send is never
        # matched would wait out the timeout.
        results, problem = [], None
        for r in range(self.size):
            if r == root:
                results.append(obj)
                continue
            try:
                results.append(self._load(self._recv_obj_bytes(r, tag, "gather_obj"), "gather_obj", r))
            except RemoteRankError as e:
                problem = problem or e
                results.append(None)
        if problem is not None:
            raise problem
        return results

    def scatter_obj(self, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
        """Rank ``i`` receives ``objs[i]`` from root; other ranks pass ``None``."""
        self._check_peer(root, "root")
        if self.size > 1:
            self._agree_obj("scatter_obj", root)
        tag = _wire_tag(_KIND["scatter_obj"], "collective")
        if self.rank != root:
            problem, obj = self._load(self._recv_obj_bytes(root, tag, "scatter_obj"), "scatter_obj", root)
            if problem is not None:
                raise RemoteRankError(f"scatter_obj: root rank {root} failed: {problem} (raised on rank {self.rank})")
            return obj
        problem = None
        if objs is None or len(objs) != self.size:
            problem = ValueError(f"scatter_obj: root must pass {self.size} objects (one per rank), not "
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

    def allreduce_obj(self, obj: Any) -> Any:
        """The sum (by ``+``) of every rank's object, on every rank.

        Example::

            >>> n_seen = comm.allreduce_obj(len(local_shard))
        """
        values = self.allgather_obj(obj)
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total

    # ----------------------------------------------------------------------------- control
    def barrier(self) -> None:
        """Wait until every rank of this communicator gets here."""
        if self.size > 1:
            dist.barrier(group=self._obj_group)

    def split(self, color: int, key: int = 0) -> "Communicator":
        """A new communicator of the ranks that pass the same ``color``, ordered by ``(key, rank)``.

        Every rank must call it. Example::

            >>> half = comm.split(color=comm.rank % 2, key=comm.rank)
        """
        from torchmn.communicators import _resolve  # the factory knows the subclasses

        cls = _resolve(self.name, self.backend, self.size)
        self._splits += 1
        entries = self.allgather_obj((color, key, self.rank, _torch_group_count()))
        colors = sorted({e[0] for e in entries}, key=repr)
        whole_world = self.size == (dist.get_world_size() if dist.is_initialized() else 1)
        mine = None
        for c in colors:
            members = [e[2] for e in sorted((e for e in entries if e[0] == c), key=lambda e: (e[1], e[2]))]
            if not whole_world and c != color:
                continue
            world = [self._global(r) for r in members]
            if whole_world:
                # Every rank of the world takes part in creating every group, in the same order,
                # as torch wants by default (it names them by a count every rank keeps alike).
                group = dist.new_group(world) if self.size > 1 else None
            else:
                # Only this communicator's ranks are here: each color's members make their group
                # alone (torch then names it by its ranks, so splits of other sub-communicators
                # running at the same time cannot take its name, and the world's count is left alone).
                _match_group_counts([e[3] for e in entries if e[0] == c])
                group = dist.new_group(world, use_local_synchronization=True)
            obj_group = group
            if self.backend == "nccl":
                obj_group = dist.new_group(world, backend="gloo", use_local_synchronization=not whole_world)
            extra = cls.split_groups(self, members, local=not whole_world)
            if c == color:
                by_world = sorted(world)
                mine = (members.index(self.rank), len(members), group, obj_group,
                        [by_world.index(w) for w in world], extra, f"{self._tag}.{self._splits}.{colors.index(c)}")
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
        """Tear down ``torch.distributed`` if this communicator set it up. Safe to call twice."""
        if self._finalized:
            return
        self._finalized = True
        if self._owns_world:
            from torchmn.communicators._setup import shutdown_world
            shutdown_world()

    # ----------------------------------------------------------------------------- models
    def bcast_data(self, model: torch.nn.Module, root: int = 0) -> None:
        """Make every parameter and buffer of ``model`` root's, bit for bit.

        Example::

            >>> comm.bcast_data(model)   # all ranks now start from rank 0's weights
        """
        self._check_peer(root, "root")
        tensors = list(model.parameters()) + list(model.buffers())
        self._check_same_layout(tensors, "bcast_data: the model's parameters and buffers", root,
                                "build the same model on every rank")
        self.bcast_tensors(tensors, root)

    def _check_same_layout(self, tensors: list[torch.Tensor], what: str, root: int, advice: str) -> None:
        """Raise on every rank, naming the first difference, unless every rank's ``tensors`` have
        root's count, shapes and dtypes (a collective over them would otherwise hang or mix data)."""
        if self.size == 1:
            return
        layouts = self.allgather_obj([(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in tensors])
        bad = [r for r, lay in enumerate(layouts) if lay != layouts[root]]
        if not bad:
            return
        theirs, ours = layouts[bad[0]], layouts[root]
        diff = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
        if diff is None:
            detail = f"{len(theirs)} tensors there, {len(ours)} on rank {root}"
        else:
            detail = (f"tensor {diff} is {theirs[diff][0]} {theirs[diff][1]} there, "
                      f"{ours[diff][0]} {ours[diff][1]} on rank {root}")
        raise CollectiveMismatchError(
            f"{what} differ between ranks: rank(s) {bad} (on {self._hosts[bad[0]]}) differ from root rank {root}'s "
            f"({detail}); {advice} (raised on rank {self.rank})")

    def bcast_tensors(self, tensors: list[torch.Tensor], root: int = 0) -> None:
        """Overwrite each tensor, in place, with root's, bit for bit (all ranks pass the same layout)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for bucket in _buckets(tensors, self.bucket_cap_bytes):
                if self.rank == root:
                    flat = torch.cat([_wire.as_bytes(t.detach()) for t in bucket]).to(self._data_device)
                else:
                    n = sum(t.numel() * t.element_size() for t in bucket)
                    flat = torch.empty(n, dtype=torch.uint8, device=self._data_device)
                self._bcast_bytes(flat, root)
                if self.rank != root:
                    offset = 0
                    for t in bucket:
                        n = t.numel() * t.element_size()
                        t.copy_(_wire.from_bytes(flat[offset:offset + n], t.dtype, t.shape))
                        offset += n

    def multi_node_mean_grad(self, model: torch.nn.Module, zero_fill: bool = False) -> None:
        """Make every ``.grad`` of ``model`` its mean over ranks, with this communicator's algorithm.

        A parameter whose ``.grad`` is ``None`` on every rank is skipped; with ``zero_fill=True`` a
        missing gradient counts as zeros (its ``.grad`` becomes the mean). With ``zero_fill=False``, a
        gradient missing on some ranks only raises :class:`CollectiveMismatchError` on every rank.

        Example::

            >>> loss.backward(); comm.multi_node_mean_grad(model); optimizer.step()
        """
        params = [p for p in model.parameters() if p.requires_grad]
        sparse_fill = [0] * len(params)  # the sparse_dim a missing gradient's zeros take; 0: dense
        if self.size > 1:
            # Buckets pair the ranks' gradients by position: a model of another layout would mix them
            # silently (shared memory) or abort the process (gloo). A checksum of the layout costs one
            # small exchange; the full layouts are compared only when it differs.
            row = _wire.header(_KIND["multi_node_mean_grad"])
            row[_wire.SHAPE] = zlib.crc32(repr([(tuple(p.shape), p.dtype) for p in params]).encode())
            row[_wire.SHAPE + 1] = sum(1 for p in params if p.grad is not None and p.grad.is_sparse)
            row[_wire.SHAPE + 2] = sum(1 for p in params if p.grad is None)
            hdrs = self._agree("multi_node_mean_grad", rows=[row], objects=True)[:, 0]
            if len(set(hdrs[:, _wire.SHAPE].tolist())) > 1:
                self._check_same_layout(params, "multi_node_mean_grad: the model's trainable parameters", 0,
                                        "build the same model on every rank")
            if zero_fill and hdrs[:, _wire.SHAPE + 1].any() and hdrs[:, _wire.SHAPE + 2].any():
                # A missing gradient counts as zeros of the kind the other ranks have: a dense fill
                # of a sparse gradient would pair it with another bucket, and wait for ever.
                # Each sparse gradient's sparse_dim (1 for nn.Embedding), which the zeros must share.
                dims = self.allgather_obj([p.grad.sparse_dim() if p.grad is not None and p.grad.is_sparse else 0
                                           for p in params])
                sparse_fill = [max(d[i] for d in dims) for i in range(len(params))]
        if not zero_fill and self.size > 1:
            # Skipping must be agreed on: a tensor left out on some ranks only would pair the rest wrongly.
            masks = self.allgather_obj([p.grad is not None for p in params])
            mixed = [i for i in range(len(params)) if len({m[i] for m in masks}) > 1]
            if mixed:
                without = [r for r, m in enumerate(masks) if not m[mixed[0]]]
                raise CollectiveMismatchError(
                    f"multi_node_mean_grad: the gradient of parameter {mixed[0]} (shape "
                    f"{tuple(params[mixed[0]].shape)}) is None on rank(s) {without} only ({len(mixed)} such "
                    f"parameters); pass zero_fill=True to count a missing gradient as zeros (raised on rank "
                    f"{self.rank})")
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
            dist.all_reduce(g, group=self._obj_group)
            g.div_(self.size)
            if g is not p.grad:
                p.grad = g.to(p.device)
        self.mean_tensors([p.grad for p in grads])

    @property
    def grad_bucket_cap_bytes(self) -> int:
        """How many bytes of gradients this algorithm fuses into one message (0: one per tensor)."""
        return self.bucket_cap_bytes

    def allreduce_flat(self, flat: torch.Tensor, async_op: bool = False, op: str = "sum"):
        """Reduce one contiguous 1-D buffer over all ranks, in place: the gradient paths' primitive.

        No call checking: callers guarantee every rank passes the same layout.
        """
        if self.size == 1:
            return _Completed()
        return dist.all_reduce(flat, op=_OPS[op], group=self._group, async_op=async_op)

    def reduce_scatter_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Sum ``flat`` (``size * k`` elements) over ranks; rank ``r`` gets elements ``[r*k, (r+1)*k)``
        in ``shard`` (``k`` elements). The sharded optimizer's primitive; no call checking."""
        if self.size == 1:
            shard.copy_(flat)
            return _Completed()
        if not self._identity_order:
            # torch numbers a group's ranks by world rank; after split(key=...) this communicator's
            # rank r is another group rank, so hand torch the chunks in its order.
            chunks = self._group_order(list(flat.split(shard.numel())))
            return dist.reduce_scatter(shard, chunks, group=self._group, async_op=async_op)
        return reduce_scatter_single(shard, flat, self._group, async_op)

    def allgather_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Every rank's ``shard`` (``k`` elements) into ``flat`` (``size * k``), in rank order."""
        if self.size == 1:
            flat.copy_(shard)
            return _Completed()
        if not self._identity_order:  # as in reduce_scatter_flat
            chunks = self._group_order(list(flat.split(shard.numel())))
            return dist.all_gather(chunks, shard, group=self._group, async_op=async_op)
        return dist.all_gather_single(flat, shard, group=self._group, async_op=async_op)

    def _open_node_arena(self, shared_bytes: int, region_bytes: int):
        """Memory shared by all ranks of this communicator for good (a ``shm.NodeArena``), or None
        where they cannot share memory (several nodes, GPU, or a communicator without shared
        memory). Collective; every rank gets the same answer."""
        return None

    @abc.abstractmethod
    def mean_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor, in place, by its mean over ranks (each algorithm's own)."""


watch.install(Communicator)
_WORLDS = 0  # world communicators created by this process, for their tags


def _torch_group_count() -> Optional[int]:
    """How many process groups this process belongs to (None if torch does not say). torch names a
    group that only its own ranks create (``use_local_synchronization=True``) after its ranks and
    this number, so those ranks must agree on it."""
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if names is not None else None


def _match_group_counts(counts: list[Optional[int]]) -> None:
    """Bring this process's group count up to the highest of ``counts`` (the future members') with
    groups of itself alone, so that torch gives all members the same name for their new group.

    Counts differ where ranks have lived differently: only a node's first rank belongs to the
    group between nodes, only the members of a sub-communicator to the groups of its splits.
    """
    if None in counts:
        return
    target = max(counts)
    while _torch_group_count() < target:
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


def _obj_header(n: int, kind: str = "allgather_obj", root: int = _wire.NONE) -> list[int]:
    """The call header of object collective ``kind`` from ``root``, with ``n`` pickled bytes (this
    rank's, or root's in bcast_obj) where the shape goes."""
    row = _wire.header(_KIND[kind], root)
    row[_wire.SHAPE] = n
    return row


def _padded(buf: torch.Tensor, length: int) -> torch.Tensor:
    """``buf`` followed by zeros up to ``length`` bytes (gloo gathers equal sizes only)."""
    if buf.numel() == length:
        return buf
    out = torch.zeros(length, dtype=buf.dtype, device=buf.device)
    out[:buf.numel()] = buf
    return out


def _buckets(tensors: Iterable[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each run at most ``cap_bytes`` (or one tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if out and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device and size + n <= cap_bytes:
            out[-1].append(t)
            size += n
        else:
            out.append([t])
            size = n
    return out


class _Completed:
    """The handle of a collective that had nothing to do (a world of one)."""

    def wait(self) -> bool:
        return True


class _AndThen:
    """The handle of a collective whose network part is in flight; ``wait()`` waits for it, then runs
    the local part that must follow it (a sum, or a step through the node's shared memory: every
    rank of the node waits its handles in the same order, as the optimizers do, so those steps
    meet). Keeps the buffers alive until then."""

    wraps_torch_work = True  # watched like torch's own handle (see watch.py)

    def __init__(self, work, then=None, keep=()):
        self._work, self._then, self._keep = work, then, keep

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()
        self._keep = ()
        return True

    def is_completed(self) -> bool:
        """True once ``wait()`` has run: the local part runs there, never from a poll (on one node it
        must run in the same order on every rank)."""
        return self._work is None and self._then is None


def _finish(pending: _AndThen, async_op: bool):
    if async_op:
        return pending
    pending.wait()
    return _Completed()


def reduce_scatter_single(shard: torch.Tensor, flat: torch.Tensor, group, async_op: bool = False):
    """``dist.reduce_scatter_single``, except through gloo: there an all-to-all, then a local sum.

    gloo has no reduce-scatter of its own: torch runs one as an allreduce of the whole buffer and
    keeps a chunk, twice the traffic. An all-to-all moves each rank only the chunks it sums: 1.3-3.8x
    faster between 2 ranks, 1.7x at 7.2 MB (``bench/bench_allreduce.py --collective reduce_scatter``).

    Example::

        >>> reduce_scatter_single(mine, torch.ones(size * k), group)   # mine: k elements, all == size
    """
    backend = dist.get_backend(group)  # "gloo", or per device: "cpu:gloo,cuda:nccl"
    if not (backend == "gloo" or (flat.device.type == "cpu" and "cpu:gloo" in backend)):
        return dist.reduce_scatter_single(shard, flat, group=group, async_op=async_op)
    chunks = torch.empty_like(flat)
    work = dist.all_to_all_single(chunks, flat, group=group, async_op=True)
    n = dist.get_world_size(group)
    return _finish(_AndThen(work, lambda: torch.sum(chunks.view(n, shard.numel()), dim=0, out=shard),
                            keep=(flat, chunks)), async_op)
