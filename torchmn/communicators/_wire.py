"""How tensors travel: a fixed-size int64 header describing one tensor, its bytes, the tags of
point-to-point messages, and tensors fused into buckets.

Every data-moving collective sends raw bytes (a ``uint8`` view), so any dtype torch has travels
over gloo and NCCL alike, and the receiver learns dtype and shape from the header.
"""
from __future__ import annotations

import functools
from typing import Iterable, Sequence

import torch

from torchmn.errors import TorchmnTypeError, TorchmnValueError

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

# Header layout: [kind, root, op, dtype, ndim, shape[0..MAX_NDIM), device]
HEADER_LEN = 6 + MAX_NDIM
SHAPE = 5  # where the shape starts
DEVICE = 5 + MAX_NDIM  # where the tensor lies: DEVICE_CODES, or NONE without a tensor
NONE = -1
# A call's data travels the way of its tensors' device (Communicator routes by it): a rank that
# has no tensor of its own (a broadcast's receivers) learns the way from the header.
DEVICE_TYPES = ("cpu", "cuda")  # by code
DEVICE_CODES = {name: code for code, name in enumerate(DEVICE_TYPES)}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _CODE[dtype]
    except KeyError:
        raise TorchmnTypeError(f"torchmn cannot send tensors of dtype {dtype}; supported: "
                               f"{', '.join(str(d) for d in DTYPES)}") from None


def header(kind: int, root: int = NONE, op: int = NONE, x: torch.Tensor | None = None) -> list[int]:
    """The header of one call: what collective, with which root and op, on what tensor (a new list)."""
    if x is None:
        return [kind, root, op, NONE, NONE] + [0] * MAX_NDIM + [NONE]
    return list(_tensor_header(kind, root, op, x.dtype, x.shape, x.device.type))


@functools.lru_cache(maxsize=1024)  # a small collective's time is mostly such Python work
def _tensor_header(kind: int, root: int, op: int, dtype: torch.dtype, shape: torch.Size, device: str) -> tuple:
    if len(shape) > MAX_NDIM:
        raise TorchmnValueError(f"tensors of more than {MAX_NDIM} dimensions cannot be sent (got {len(shape)})")
    return (kind, root, op, dtype_code(dtype), len(shape), *shape, *[0] * (MAX_NDIM - len(shape)),
            DEVICE_CODES.get(device, 0))


def meta(row: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """The dtype and shape a header row describes, or None if it describes no tensor."""
    code, ndim = int(row[3]), int(row[4])
    if code == NONE:
        return None
    return DTYPES[code], tuple(int(s) for s in row[5:5 + ndim])


def device_type(row: Sequence[int]) -> str | None:
    """The device type (``"cpu"`` or ``"cuda"``) of the tensor a header row describes, or None."""
    code = int(row[DEVICE])
    return None if code == NONE else DEVICE_TYPES[code]


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``x`` (a contiguous copy first if needed)."""
    # Conjugate and negative views are lazy bits on the tensor, not in its memory: apply them first.
    flat = x.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        # One element expanded (stride 0) counts as contiguous, but cannot be viewed as bytes.
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return buf.view(dtype).reshape(tuple(shape))


def padded(buf: torch.Tensor, length: int) -> torch.Tensor:
    """``buf`` followed by zeros up to ``length`` bytes (gloo gathers equal sizes only)."""
    if buf.numel() == length:
        return buf
    out = torch.zeros(length, dtype=buf.dtype, device=buf.device)
    out[:buf.numel()] = buf
    return out


# gloo and NCCL count elements in 32-bit integers; objects travel in chunks below that.
OBJ_CHUNK_BYTES = 256 * 1024 * 1024

# Point-to-point messages of send/recv, of send_obj/recv_obj and of the object collectives share one
# process group; each travels in its own tag space, so that none can match another's message (a
# user's send_obj(tag=2) must not match gather_obj's own, nor send() a recv_obj()).
TAG_SPACES = {"tensor": 0, "object": 1, "collective": 2}
MAX_TAG = 2 ** 28
# torch.distributed point-to-point tags of torchmn's own collectives made of messages: above every
# tag a user's message can take (wire_tag), and apart from gloo's collectives, whose slots carry a
# prefix. One tag each, so that a collective's messages never pair with another's.
INTERNAL_TAGS = {name: MAX_TAG * len(TAG_SPACES) + i
                 for i, name in enumerate(("doubling", "reduce_scatter", "allgather"))}


def wire_tag(tag: int, space: str) -> int:
    """The torch.distributed tag of a user's ``tag`` in tag space ``space`` (see TAG_SPACES)."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < MAX_TAG:
        raise TorchmnValueError(f"tag must be an integer from 0 to {MAX_TAG - 1}, not {tag!r}")
    return tag * len(TAG_SPACES) + TAG_SPACES[space]


def buckets(tensors: Iterable[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each run at most ``cap_bytes`` (or one tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if out and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device and size + n <= cap_bytes:
            out[-1].append(t)
            size += n
        else:
            out.append([t])
            size = n
    return out


def unpack_into(bucket: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` back into the tensors of ``bucket``, in order."""
    offset = 0
    for t in bucket:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
