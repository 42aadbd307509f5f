"""Reported values as plain floats."""
from __future__ import annotations

from typing import Any

import torch

from torchmn.errors import TorchmnValueError


def to_float(value: Any, key: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TorchmnValueError(f"observation {key!r} is a tensor of shape {tuple(value.shape)}; "
                                    f"only single numbers can be averaged over ranks")
        return float(value.detach().cpu().double().item())
    return float(value)
