"""Horovod's gradient compression: ``hvd.Compression.none`` and ``hvd.Compression.fp16``."""
from __future__ import annotations

import torch


class Compressor:
    """How a tensor travels: ``compress`` before the collective, ``decompress`` after it.

    Example::

        >>> sent, ctx = hvd.Compression.fp16.compress(grad)
        >>> grad = hvd.Compression.fp16.decompress(hvd.allreduce(sent), ctx)
    """

    #: the ``compression=`` of :func:`torchmn.create_multi_node_optimizer` that does the same
    wire_name = None

    @staticmethod
    def compress(tensor: torch.Tensor):
        """The tensor to send in place of ``tensor``.

        Args:
            tensor: the tensor before the collective.

        Returns:
            ``(tensor to send, ctx)``: ``ctx`` is what :meth:`decompress` needs.

        Example::

            >>> sent, ctx = hvd.Compression.none.compress(x)     # (x, None)
        """
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        """The received tensor in its original form.

        Args:
            tensor: the collective's result.
            ctx: what :meth:`compress` returned with the tensor it sent.

        Returns:
            The result as the caller's tensor was (its dtype).

        Example::

            >>> x = hvd.Compression.none.decompress(received, None)
        """
        return tensor


class NoneCompressor(Compressor):
    """Tensors travel as they are (``hvd.Compression.none``).

    Example::

        >>> hvd.allreduce(x, compression=hvd.Compression.none)
    """


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes); others as they are
    (``hvd.Compression.fp16``).

    Example::

        >>> hvd.allreduce(x, compression=hvd.Compression.fp16)     # float32 result, float16 on the wire
    """

    wire_name = "fp16"

    @staticmethod
    def compress(tensor: torch.Tensor):
        """``tensor`` as float16 where it is of another floating-point dtype.

        Args:
            tensor: the tensor before the collective.

        Returns:
            ``(tensor to send, its original dtype)``.

        Example::

            >>> sent, dtype = hvd.Compression.fp16.compress(torch.ones(2))   # float16, torch.float32
        """
        dtype = tensor.dtype
        if tensor.is_floating_point() and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx) -> torch.Tensor:
        """The received tensor back in its original dtype.

        Args:
            tensor: the collective's result.
            ctx: the original dtype, as :meth:`compress` returned it.

        Returns:
            ``tensor`` in dtype ``ctx``.

        Example::

            >>> x = hvd.Compression.fp16.decompress(received, torch.float32)
        """
        return tensor.to(ctx) if ctx is not None and tensor.dtype != ctx else tensor


class Compression:
    """The compression algorithms, as ``hvd.Compression.none`` and ``hvd.Compression.fp16``.

    Example::

        >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
        ...                                compression=hvd.Compression.fp16)
    """

    none = NoneCompressor
    fp16 = FP16Compressor
