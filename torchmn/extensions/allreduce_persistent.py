"""Buffers (BatchNorm running statistics) averaged over ranks."""
from __future__ import annotations

from typing import Optional

import torch
from pytorch_pfn_extras.training import extension


class AllreducePersistent(extension.Extension):
    """Average every floating-point buffer of ``model`` over the ranks.

    Gradient averaging keeps parameters equal on every rank, but buffers such as BatchNorm's
    ``running_mean`` and ``running_var`` are updated from each rank's own batches and drift
    apart. Run this before evaluating or saving (its default trigger is once an epoch, with a
    priority just above evaluators'), or call it directly: ``AllreducePersistent(model, comm)()``.
    Integer buffers (``num_batches_tracked``) are left alone: ranks stepping in lockstep already
    agree on them. Every rank must call it together, with the same model structure.

    Example::

        >>> manager.extend(torchmn.extensions.AllreducePersistent(model, comm))
    """

    trigger = 1, "epoch"
    priority = extension.PRIORITY_WRITER + 1

    def __init__(self, model: torch.nn.Module, comm):
        self.model = model
        self.comm = comm

    @torch.no_grad()
    def __call__(self, manager: Optional[object] = None) -> None:
        groups: dict[tuple, list[torch.Tensor]] = {}
        for buf in self.model.buffers():
            if buf.is_floating_point():
                groups.setdefault((buf.dtype, buf.device), []).append(buf)
        # One allreduce per dtype and device, over all buffers flattened together.
        for bufs in groups.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            flat = self.comm.allreduce(flat, op="mean")
            offset = 0
            for b in bufs:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
