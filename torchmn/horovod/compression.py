"""Horovod's gradient compression: ``hvd.Compression.none`` and ``hvd.Compression.fp16``."""
from __future__ import annotations

import torch


class Compressor:
    """How a tensor travels: ``compress`` before the collective, ``decompress`` after it."""

    #: the ``compression=`` of :func:`torchmn.create_multi_node_optimizer` that does the same
    wire_name = None

    @staticmethod
    def compress(tensor: torch.Tensor):
        """Returns: the tensor to send, and what :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        """Returns: the received tensor in its original form."""
        return tensor


class NoneCompressor(Compressor):
    """Tensors travel as they are."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes); others as they are."""

    wire_name = "fp16"

    @staticmethod
    def compress(tensor: torch.Tensor):
        dtype = tensor.dtype
        if tensor.is_floating_point() and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None and tensor.dtype != ctx else tensor


class Compression:
    """The compression algorithms, as ``hvd.Compression.none`` and ``hvd.Compression.fp16``.

    Example::

        >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
        ...                                compression=hvd.Compression.fp16)
    """

    none = NoneCompressor
    fp16 = FP16Compressor
