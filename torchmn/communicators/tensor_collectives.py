"""Tensor point-to-point calls and collectives of any dtype and shape, checked on every rank.

A mixin of :class:`torchmn.communicators.Communicator` (its process groups, rank order and call
check). Data moves as bytes with a header saying dtype and shape (see :mod:`._wire`), so the
receiver never needs to know them in advance. The interface and its documentation are
:class:`~torchmn.communicators.communicator_base.CommunicatorBase`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from torchmn.communicators import _call_check, _wire
from torchmn.communicators._pages import empty_like_fast
from torchmn.communicators._torch_compat import all_gather_single
from torchmn.communicators.errors import CollectiveMismatchError
from torchmn.communicators.ops import OPS, divide_before_sum


class TensorCollectives:
    """``send``, ``recv``, ``bcast``, ``gather``, ``allgather``, ``scatter``, ``alltoall``, ``allreduce``."""

    # ----------------------------------------------------------------------------- point to point
    def send(self, x: torch.Tensor, dest: int, tag: int = 0) -> None:
        self.check_rank(dest, "dest")
        tag = _wire.wire_tag(tag, "tensor")
        hdr = torch.tensor(_wire.header(_call_check.KIND["bcast"], x=x), dtype=torch.int64, device=self._data_device)
        dist.send(hdr, self.world_rank(dest), group=self._group, tag=tag)
        data = _wire.as_bytes(x.to(self._data_device))
        if data.numel():
            dist.send(data, self.world_rank(dest), group=self._group, tag=tag)

    def recv(self, source: int, tag: int = 0) -> torch.Tensor:
        self.check_rank(source, "source")
        tag = _wire.wire_tag(tag, "tensor")
        hdr = torch.empty(_wire.HEADER_LEN, dtype=torch.int64, device=self._data_device)
        dist.recv(hdr, self.world_rank(source), group=self._group, tag=tag)
        dtype, shape = _wire.meta(hdr.tolist())
        buf = torch.empty(_wire.nbytes(dtype, shape), dtype=torch.uint8, device=self._data_device)
        if buf.numel():
            dist.recv(buf, self.world_rank(source), group=self._group, tag=tag)
        return _wire.from_bytes(buf, dtype, shape)

    # ----------------------------------------------------------------------------- collectives
    def bcast(self, x: Optional[torch.Tensor], root: int = 0) -> torch.Tensor:
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

    def _allgather_bytes(self, buf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Every rank's byte buffer, sizes known in advance; unequal sizes are padded in flight."""
        if self.size == 1:
            return [buf]
        longest = max(sizes)
        out = torch.empty(self.size * longest, dtype=torch.uint8, device=buf.device)
        if longest:
            all_gather_single(out, _wire.padded(buf, longest), group=self._group)
        chunks = self._comm_order([out[g * longest:(g + 1) * longest] for g in range(self.size)])
        return [c[:n] for c, n in zip(chunks, sizes)]

    def gather(self, x: torch.Tensor, root: int = 0) -> Optional[tuple[torch.Tensor, ...]]:
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
                dist.gather(_wire.padded(mine, longest), bufs, dst=self.world_rank(root), group=self._group)
            parts = [b[:n] for b, n in zip(self._comm_order(bufs), sizes)] if self.rank == root else None
        if self.rank != root:
            return None
        return tuple(_wire.from_bytes(b, *m) for b, m in zip(parts, metas))

    def allgather(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        err = None if isinstance(x, torch.Tensor) else TypeError(f"allgather: pass a tensor, not {type(x).__name__}")
        hdrs = self._agree("allgather", x=x if err is None else None, error=err)
        metas = [_wire.meta(hdrs[r, 0].tolist()) for r in range(self.size)]
        bufs = self._allgather_bytes(_wire.as_bytes(x.to(self._data_device)), [_wire.nbytes(*m) for m in metas])
        if self.size == 1:
            return (x,)
        return tuple(_wire.from_bytes(b, *m) for b, m in zip(bufs, metas))

    def scatter(self, xs: Optional[Sequence[torch.Tensor]], root: int = 0) -> torch.Tensor:
        err = self._peer_error(root, "scatter: root")
        if err is None and self.rank == root:
            if xs is None or len(xs) != self.size or not all(isinstance(t, torch.Tensor) for t in xs):
                err = ValueError(f"scatter: root rank {root} must pass a sequence of {self.size} tensors "
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
        out = torch.empty(longest, dtype=torch.uint8, device=self._data_device)
        if longest:
            chunks = None
            if self.rank == root:
                chunks = [_wire.padded(_wire.as_bytes(t.to(self._data_device)), longest) for t in xs]
            if self.backend == "nccl":
                # NCCL has no scatter: root broadcasts the stacked chunks.
                stacked = torch.cat(self._group_order(chunks)) if chunks else \
                    torch.empty(self.size * longest, dtype=torch.uint8, device=self._data_device)
                self._bcast_bytes(stacked, root)
                g = self._group_ranks[self.rank]
                out = stacked[g * longest:(g + 1) * longest]
            else:
                dist.scatter(out, self._group_order(chunks) if chunks else None, src=self.world_rank(root),
                             group=self._group)
        return _wire.from_bytes(out[:sizes[self.rank]].clone(), *metas[self.rank])

    def alltoall(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        err = None
        if xs is None or len(xs) != self.size or not all(isinstance(t, torch.Tensor) for t in xs):
            err = ValueError(f"alltoall: pass a sequence of {self.size} tensors (one per rank)")
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
        send = self._group_order([_wire.as_bytes(t.to(self._data_device)).reshape(-1) for t in xs])
        recv_sizes = [_wire.nbytes(*m) for m in recv_metas]
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self._data_device)
        dist.all_to_all_single(recv, torch.cat(send), output_split_sizes=self._group_order(recv_sizes),
                               input_split_sizes=[b.numel() for b in send], group=self._group)
        parts = dict(zip(self._group_order(list(range(self.size))),
                         torch.split(recv, self._group_order(recv_sizes))))
        return tuple(_wire.from_bytes(parts[r], *m) for r, m in enumerate(recv_metas))

    def _allreduce_problem(self, x: torch.Tensor, op: str, name: str = "allreduce") -> Optional[Exception]:
        """What is wrong with this rank's arguments to an allreduce, or None."""
        if op not in OPS:
            return ValueError(f"{name}: op must be one of {', '.join(OPS)}, not {op!r}")
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{name}: pass a tensor, not {type(x).__name__}")
        if x.dtype in _wire.MOVE_ONLY:
            return TypeError(f"{name}: torch has no arithmetic for {x.dtype} on CPU, so it cannot be reduced; "
                             f"convert first (x.to(torch.int64), x.float()) and back")
        if x.is_complex() and op in ("max", "min"):
            return ValueError(f"{name}: op {op!r} is undefined for complex tensors ({x.dtype})")
        if x.is_complex() and op == "prod":
            # Decided here, on every rank alike: a failure inside the backend would reach only the
            # ranks that call it (between nodes, not the others of each node).
            return ValueError(f"{name}: torch.distributed has no 'prod' of complex tensors ({x.dtype}); "
                              f"multiply the gathered tensors instead (torch.stack(comm.allgather(x)).prod(0))")
        return None

    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        err = self._allreduce_problem(x, op)
        self._agree("allreduce", op=None if err else op, x=None if err else x, error=err, same_shape=True)
        return self._allreduce_agreed(x, op)

    def allreduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        err = self._allreduce_problem(x, op, "allreduce_")
        if err is None and op == "mean" and not (x.is_floating_point() or x.is_complex()):
            err = TypeError(f"allreduce_: the mean of {x.dtype} values is float64 and cannot be written into the "
                            f"tensor; use comm.allreduce(x, op='mean'), or op='sum' and divide")
        self._agree("allreduce", op=None if err else op, x=None if err else x, error=err, same_shape=True)
        if (x.is_contiguous() and x.device == self._data_device and x.dtype not in (torch.int16, torch.bool)
                and not (op == "mean" and divide_before_sum(x.dtype))):
            # The data moves in place: no new tensor, whose pages (tens of MB) would be mapped afresh.
            self.allreduce_flat(x.detach().view(-1), op="sum" if op == "mean" else op)
            if op == "mean":
                x.detach().div_(self.size)
            return x
        with torch.no_grad():
            return x.copy_(self._allreduce_agreed(x, op))

    def _allreduce_agreed(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """The reduction of ``x``, once the ranks have agreed on the call."""
        src = x.detach().to(self._data_device)
        if op == "mean" and src.dtype == torch.bool:
            src = src.to(torch.int64)  # a bool sum is a logical or: count the True values instead
        if op == "mean" and divide_before_sum(src.dtype):
            return self._allreduce_agreed(x.double(), op="mean").to(x.dtype)  # bfloat16 reaches float32's range
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
        """The reduction of contiguous ``x`` over ranks, as a new tensor (algorithms may do it faster)."""
        out = empty_like_fast(x).copy_(x)
        self.allreduce_flat(out.view(-1), op=op)
        return out
