"""What the differentiable communication functions share: delegates, anchors and gradients."""
from __future__ import annotations

import torch


def delegate(device: torch.device) -> torch.Tensor:
    """The value of a delegate variable: a scalar zero, so that ``delegate.backward()`` needs no
    gradient argument."""
    return torch.zeros((), device=device)


def anchor(device: torch.device) -> torch.Tensor:
    """An input that requires grad for a function with no input of its own on this rank (a
    receiver), so that its output joins the graph and its backward runs."""
    return torch.zeros((), device=device, requires_grad=True)


def differentiable(x: torch.Tensor) -> bool:
    """Whether gradients flow through ``x`` (floating-point and complex tensors)."""
    return x.is_floating_point() or x.is_complex()
