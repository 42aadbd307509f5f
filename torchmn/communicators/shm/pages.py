"""New output tensors that are cheap to fill: huge pages for the large ones.

glibc maps every allocation above 32 MB afresh from the operating system and returns it when
freed, so a collective that returns a new tensor of tens of MB takes one page fault per 4 KB of
it, on every call: 64 MB cost more to fault in (about 15 ms here) than to reduce. Asking the kernel
for transparent huge pages on such a tensor (``madvise(MADV_HUGEPAGE)``, Linux) makes that one fault
per 2 MB (about 6 ms). Smaller allocations come back from glibc's heap already faulted in.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

_HUGE = 2 << 20          # the huge page size on x86-64 and arm64 (4 KB base pages)
_FRESH = 32 << 20        # glibc's largest mmap threshold: allocations above it are always mapped anew
_MADV_HUGEPAGE = 14


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()


def empty_like_fast(x: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(x)`` (contiguous), backed by huge pages where it is large and on the CPU.

    From 32 MB up on Linux, the kernel is asked (``madvise``) for transparent huge pages over the
    new tensor; a kernel without them ignores the advice. Elsewhere it is a plain empty tensor.

    Args:
        x: the tensor whose shape, dtype and device the new one takes.

    Returns:
        A new, uninitialized, contiguous tensor of ``x``'s shape, dtype and device.

    Example::

        >>> out = empty_like_fast(x).copy_(x)   # x of 64 MB: faulted in 2 MB at a time
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    nbytes = out.numel() * out.element_size()
    if _madvise_fn is not None and out.device.type == "cpu" and nbytes >= _FRESH:
        start = out.data_ptr()
        lo, hi = -(-start // _HUGE) * _HUGE, (start + nbytes) // _HUGE * _HUGE
        if hi > lo:
            _madvise_fn(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a kernel without THP ignores it
    return out
