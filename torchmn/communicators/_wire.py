"""How tensors travel: a fixed-size int64 header describing one tensor, and its bytes.

Every data-moving collective sends raw bytes (a ``uint8`` view), so any dtype torch has travels
over gloo and NCCL alike, and the receiver learns dtype and shape from the header.
"""
from __future__ import annotations

from typing import Sequence

import torch

MAX_NDIM = 16

# Order is part of the wire format: append, never reorder.
DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
) + tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
          if hasattr(torch, name))  # newer torch only
# Dtypes that travel (as bytes) but that torch cannot add or compare on CPU: not reduced.
MOVE_ONLY = frozenset(DTYPES[12:])
_CODE = {dt: i for i, dt in enumerate(DTYPES)}

# Header layout: [kind, root, op, dtype, ndim, shape[0..MAX_NDIM)]
HEADER_LEN = 5 + MAX_NDIM
SHAPE = 5  # where the shape starts
NONE = -1


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _CODE[dtype]
    except KeyError:
        raise TypeError(f"torchmn cannot send tensors of dtype {dtype}; supported: "
                        f"{', '.join(str(d) for d in DTYPES)}") from None


def header(kind: int, root: int = NONE, op: int = NONE, x: torch.Tensor | None = None) -> list[int]:
    """The header of one call: what collective, with which root and op, on what tensor."""
    if x is None:
        return [kind, root, op, NONE, NONE] + [0] * MAX_NDIM
    if x.dim() > MAX_NDIM:
        raise ValueError(f"tensors of more than {MAX_NDIM} dimensions cannot be sent (got {x.dim()})")
    shape = list(x.shape) + [0] * (MAX_NDIM - x.dim())
    return [kind, root, op, dtype_code(x.dtype), x.dim()] + shape


def meta(row: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The dtype and shape a header row describes, or None if it describes no tensor."""
    code, ndim = int(row[3]), int(row[4])
    if code == NONE:
        return None
    return DTYPES[code], tuple(int(s) for s in row[5:5 + ndim])


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``x`` (a contiguous copy first if needed)."""
    # Conjugate and negative views are lazy bits on the tensor, not in its memory: apply them first.
    return x.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return buf.view(dtype).reshape(tuple(shape))
