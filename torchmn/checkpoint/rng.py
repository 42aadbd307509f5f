"""The random number generators a bit-exact resume must put back: torch's (CPU and every CUDA
device already in use), numpy's global one and Python's ``random``."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict:
    """This process's random number generator states.

    Returns:
        ``{"python": ..., "numpy": ..., "torch": ..., "cuda": [...]}``; ``cuda`` is empty when CUDA
        was never initialised (asking would initialise it).

    Example::

        >>> state = rng_state(); torch.rand(1); set_rng_state(state)
    """
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": cuda}


def set_rng_state(state: dict) -> None:
    """Put back states from :func:`rng_state`.

    CUDA states are restored for as many devices as both the saved state and this process have.

    Args:
        state: what :func:`rng_state` returned.

    Example::

        >>> set_rng_state(rng_state())
    """
    random.setstate(_tuples(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _tuples(value: Any) -> Any:
    """Python's ``random.setstate`` wants tuples where a round trip may give lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
