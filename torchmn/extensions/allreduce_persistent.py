"""Buffers (BatchNorm running statistics) averaged over ranks."""
from __future__ import annotations

from typing import Optional

import torch
from pytorch_pfn_extras.training import extension


class AllreducePersistent(extension.Extension):
    """Average every persistent floating-point buffer of ``model`` over the ranks.

    Gradient averaging keeps parameters equal on every rank, but buffers such as BatchNorm's
    ``running_mean`` and ``running_var`` are updated from each rank's own batches and drift
    apart. Run this before evaluating or saving (its default trigger is once an epoch, with a
    priority just above evaluators'), or call it directly: ``AllreducePersistent(model, comm)()``.
    Integer buffers (``num_batches_tracked``) are left alone: ranks stepping in lockstep already
    agree on them; so are non-persistent buffers (masks, tables a module computes), which are not
    state, as in ChainerMN. The mean is taken in float64, so a buffer equal on every rank comes
    back bit for bit, and a float16 one whose sum over ranks passes 65504 does not overflow.
    Every rank must call it together, with the same model structure.

    Args:
        model: the module whose buffers are averaged.
        comm: the communicator whose ranks hold copies of ``model``.

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
        """Average the buffers now, in place.

        Args:
            manager: the ``ExtensionsManager`` when run as an extension; not used.

        Example::

            >>> torchmn.extensions.AllreducePersistent(model, comm)()    # before saving the model
        """
        groups: dict[torch.device, list[torch.Tensor]] = {}
        seen = set()
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if (buf is None or not buf.is_floating_point() or name in module._non_persistent_buffers_set
                        or id(buf) in seen):
                    continue
                seen.add(id(buf))
                groups.setdefault(buf.device, []).append(buf)
        # One allreduce per device, over all buffers flattened together.
        for bufs in groups.values():
            flat = torch.cat([b.reshape(-1).to(torch.float64) for b in bufs])
            flat = self.comm.allreduce(flat, op="mean")
            offset = 0
            for b in bufs:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
