"""Collectives over a model's tensors: broadcasting its weights, checking that every rank holds the
same layout, and averaging its gradients (ChainerMN's ``bcast_data`` and ``multi_node_mean_grad``).

A mixin of :class:`torchmn.communicators.Communicator`. The averaging itself is each algorithm's
:meth:`mean_tensors`. The interface and its documentation are
:class:`~torchmn.communicators.communicator_base.CommunicatorBase`.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from torchmn.communicators import _call_check, _wire
from torchmn.communicators.errors import CollectiveMismatchError


class ModelCollectives:
    """``bcast_data``, ``bcast_tensors``, ``check_same_layout``, ``multi_node_mean_grad``."""

    def bcast_data(self, model: torch.nn.Module, root: int = 0) -> None:
        self.check_rank(root, "root")
        tensors = list(model.parameters()) + list(model.buffers())
        self.check_same_layout(tensors, "bcast_data: the model's parameters and buffers", root,
                               "build the same model on every rank")
        self.bcast_tensors(tensors, root)

    def check_same_layout(self, tensors: list[torch.Tensor], what: str, root: int = 0,
                          advice: str = "build the same model on every rank") -> None:
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

    def _layout_checksum(self, params: list[torch.Tensor]) -> int:
        """A checksum of the parameters' shapes and dtypes, remembered for the last layout seen."""
        key = tuple((p.shape, p.dtype) for p in params)
        cached = getattr(self, "_last_layout", None)
        if cached is None or cached[0] != key:
            cached = (key, zlib.crc32(repr([(tuple(s), d) for s, d in key]).encode()))
            self._last_layout = cached
        return cached[1]

    def bcast_tensors(self, tensors: list[torch.Tensor], root: int = 0) -> None:
        if self.size == 1:
            return
        with torch.no_grad():
            for bucket in _wire.buckets(tensors, self.bucket_cap_bytes):
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
        params = [p for p in model.parameters() if p.requires_grad]
        sparse_fill = [0] * len(params)  # the sparse_dim a missing gradient's zeros take; 0: dense
        if self.size > 1:
            # Buckets pair the ranks' gradients by position: a model of another layout would mix them
            # silently (shared memory) or abort the process (gloo). One small exchange carries a
            # checksum of the layout and one of which gradients are None; the full layouts or masks
            # are exchanged only when a checksum differs.
            missing = bytes(p.grad is None for p in params)
            row = _wire.header(_call_check.KIND["multi_node_mean_grad"])
            row[_wire.SHAPE] = self._layout_checksum(params)
            row[_wire.SHAPE + 1] = sum(1 for p in params if p.grad is not None and p.grad.is_sparse)
            row[_wire.SHAPE + 2] = missing.count(1)
            row[_wire.SHAPE + 3] = zlib.crc32(missing)
            hdrs = self._agree("multi_node_mean_grad", rows=[row], objects=True)[:, 0]
            if len(set(hdrs[:, _wire.SHAPE].tolist())) > 1:
                self.check_same_layout(params, "multi_node_mean_grad: the model's trainable parameters", 0,
                                       "build the same model on every rank")
            if zero_fill and hdrs[:, _wire.SHAPE + 1].any() and hdrs[:, _wire.SHAPE + 2].any():
                # A missing gradient counts as zeros of the kind the other ranks have: a dense fill
                # of a sparse gradient would pair it with another bucket, and wait for ever.
                # Each sparse gradient's sparse_dim (1 for nn.Embedding), which the zeros must share.
                dims = self.allgather_obj([p.grad.sparse_dim() if p.grad is not None and p.grad.is_sparse else 0
                                           for p in params])
                sparse_fill = [max(d[i] for d in dims) for i in range(len(params))]
            if not zero_fill and len(set(hdrs[:, _wire.SHAPE + 3].tolist())) > 1:
                # Skipping must be agreed on: a tensor left out on some ranks only would pair the
                # rest wrongly. The masks differ: find where, to say so.
                masks = self.allgather_obj([p.grad is not None for p in params])
                mixed = [i for i in range(len(params)) if len({m[i] for m in masks}) > 1]
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
