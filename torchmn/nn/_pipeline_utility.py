"""What the pipeline's schedules share: cutting batches, preparing received activations, and
counting the activation memory a stage holds."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from torchmn.errors import TorchmnValueError


def chunk(x: Any, m: int) -> list:
    """``x`` (a tensor, or a tuple of tensors cut alike) cut into ``m`` pieces along dimension 0."""
    if isinstance(x, torch.Tensor):
        if len(x) < m:
            raise TorchmnValueError(f"Pipeline: a batch of {len(x)} cannot be cut into {m} micro-batches")
        return list(torch.tensor_split(x, m))
    parts = [chunk(t, m) for t in x]
    return [tuple(p[k] for p in parts) for k in range(m)]


def differentiable_inputs(x: Any) -> Any:
    """Received activations as leaves whose gradient backward fills (integer ones stay as they are)."""
    if isinstance(x, tuple):
        return tuple(differentiable_inputs(t) for t in x)
    return x.detach().requires_grad_() if x.is_floating_point() or x.is_complex() else x


def grads_of(x: Any) -> Any:
    """The gradients of received activations, one per tensor (zeros where there is none), so that
    the sending stage can pair them with its outputs."""
    if isinstance(x, tuple):
        return tuple(grads_of(t) for t in x)
    return x.grad if x.grad is not None else torch.zeros_like(x)


def payload_bytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (a tensor or a tuple of them)."""
    if isinstance(x, tuple):
        return sum(payload_bytes(t) for t in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _storage(t: torch.Tensor):
    """Where ``t``'s memory starts (shared by a tensor and its views); None for tensors without storage."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class ActivationMeter:
    """Bytes of activations a stage holds for backward, per micro-batch, and their peak.

    The tensors autograd saves for backward are counted as they are saved (each once), plus the
    stage's input and output, and released when the micro-batch's backward is done. Parameters are
    not activations, and neither are views of them: a layer computing ``x @ w.T`` saves the view
    ``w.T``, which would otherwise count the weight once per micro-batch.
    """

    def __init__(self):
        self.live: dict = {}
        self.current = 0
        self.peak = 0

    @contextlib.contextmanager
    def recording(self, k: int, parameters):
        """Count what autograd saves for micro-batch ``k`` inside the block.

        Args:
            k: the micro-batch.
            parameters: the stage's parameters, whose storage is left out.

        Example::

            >>> with meter.recording(k, stage.parameters()):
            ...     out = stage(x)
        """
        seen, total = set(), [0]
        weights = {_storage(p) for p in parameters}

        def pack(t: torch.Tensor):
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            # Leaves that require grad are the parameters and the received inputs (counted by hold).
            if not (t.requires_grad and t.is_leaf) and key not in seen and _storage(t) not in weights:
                seen.add(key)
                total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.hold(k, total[0])

    def hold(self, k: int, n: int) -> None:
        self.live[k] = self.live.get(k, 0) + n
        self.current += n
        self.peak = max(self.peak, self.current)

    def release(self, k: int) -> None:
        self.current -= self.live.pop(k, 0)
