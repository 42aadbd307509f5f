"""Collectives of picklable Python objects, on the CPU (gloo) group also when tensors use NCCL.

A mixin of :class:`torchmn.communicators.Communicator`. Objects are pickled with
:func:`torchmn.communicators.pickling.dumps` (a tensor view travels as what it shows, not its
whole storage), travel as bytes in chunks (so objects over 2 GiB work), and each collective makes
a call check first, like the tensor collectives. The interface and its documentation are
:class:`~torchmn.communicators.communicator_base.CommunicatorBase`.
"""
from __future__ import annotations

import pickle
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from torchmn.communicators import _call_check, _wire
from torchmn.communicators._torch_compat import all_gather_single
from torchmn.communicators.errors import RemoteRankError
from torchmn.communicators.pickling import dumps


class ObjectCollectives:
    """``send_obj``, ``recv_obj``, ``bcast_obj``, ``gather_obj``, ``allgather_obj``, ``scatter_obj``,
    ``allreduce_obj``."""

    def _load(self, buf: torch.Tensor, kind: str, source: int) -> Any:
        try:
            return pickle.loads(buf.cpu().numpy().tobytes())
        except Exception as e:  # unpickling runs the sender's classes' code: any error can come out
            raise RemoteRankError(f"{kind}: rank {source}'s object was pickled but cannot be unpickled on rank "
                                  f"{self.rank} ({self.host}): {type(e).__name__}: {e}; is its class importable, "
                                  f"with the same code, on every rank?") from e

    def _try_dump(self, obj: Any, kind: str) -> tuple[Optional[torch.Tensor], Optional[Exception]]:
        """``obj`` pickled into a byte tensor, or the error to raise once the other ranks have been told."""
        try:
            return torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8), None
        except Exception as e:  # pickle fails in many ways (PicklingError, TypeError, AttributeError)
            err = TypeError(f"{kind}: rank {self.rank} on {self.host} cannot pickle its object "
                            f"({type(obj).__name__}): {e}")
            err.__cause__ = e
            return None, err

    def _agree_obj(self, kind: str, root: int = _wire.NONE, n: int = 0,
                   error: Optional[Exception] = None) -> torch.Tensor:
        """The call check of object collective ``kind`` (see ``_call_check.obj_header``): every
        rank's row. Under NCCL the headers travel on the CPU group: a tensor collective made meanwhile
        on another rank is then not named, only timed out."""
        return self._agree(kind, rows=[_call_check.obj_header(n, kind, root)], error=error, objects=True)

    def _obj_lengths(self, n: int, error: Optional[Exception] = None) -> list[int]:
        """Every rank's pickled length, through the call check, so a rank making another collective
        meanwhile, or one that could not pickle, is named."""
        if self.size == 1:
            if error is not None:
                raise error
            return [n]
        return self._agree_obj("allgather_obj", n=n, error=error)[:, 0, _wire.SHAPE].tolist()

    # ----------------------------------------------------------------------------- point to point
    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.check_rank(dest, "dest")
        self._send_obj(obj, dest, _wire.wire_tag(tag, "object"), "send_obj")

    def recv_obj(self, source: int, tag: int = 0) -> Any:
        self.check_rank(source, "source")
        return self._load(self._recv_obj_bytes(source, _wire.wire_tag(tag, "object"), "recv_obj"), "recv_obj", source)

    def _send_obj(self, obj: Any, dest: int, wire_tag: int, kind: str) -> None:
        buf, err = self._try_dump(obj, kind)
        dist.send(torch.tensor([buf.numel() if err is None else -1], dtype=torch.int64), self.world_rank(dest),
                  group=self._obj_group, tag=wire_tag)
        if err is not None:
            raise err  # the receiver was told
        for start in range(0, buf.numel(), _wire.OBJ_CHUNK_BYTES):
            dist.send(buf[start:start + _wire.OBJ_CHUNK_BYTES], self.world_rank(dest), group=self._obj_group,
                      tag=wire_tag)

    def _recv_obj_bytes(self, source: int, wire_tag: int, kind: str) -> torch.Tensor:
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, self.world_rank(source), group=self._obj_group, tag=wire_tag)
        if n.item() < 0:
            raise RemoteRankError(f"{kind}: rank {source} could not pickle the object it sent (see its error); "
                                  f"rank {self.rank} on {self.host} stops too")
        buf = torch.empty(int(n), dtype=torch.uint8)
        for start in range(0, buf.numel(), _wire.OBJ_CHUNK_BYTES):
            dist.recv(buf[start:start + _wire.OBJ_CHUNK_BYTES], self.world_rank(source), group=self._obj_group,
                      tag=wire_tag)
        return buf

    # ----------------------------------------------------------------------------- collectives
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self.check_rank(root, "root")
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

    def allgather_obj(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        buf, err = self._try_dump(obj, "allgather_obj")
        sizes = self._obj_lengths(buf.numel() if err is None else 0, err)
        if max(sizes) * self.size <= _wire.OBJ_CHUNK_BYTES:
            longest = max(sizes)
            out = torch.empty(self.size * longest, dtype=torch.uint8)
            all_gather_single(out, _wire.padded(buf, longest), group=self._obj_group)
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
        self.check_rank(root, "root")
        if self.size == 1:
            return [obj]
        self._agree_obj("gather_obj", root)
        tag = _wire.wire_tag(_call_check.KIND["gather_obj"], "collective")
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
        self.check_rank(root, "root")
        if self.size > 1:
            self._agree_obj("scatter_obj", root)
        tag = _wire.wire_tag(_call_check.KIND["scatter_obj"], "collective")
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
        values = self.allgather_obj(obj)
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total
