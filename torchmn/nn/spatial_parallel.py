"""A convolution over an image split into blocks of rows (and columns) over the ranks."""
from __future__ import annotations

import bisect
from typing import Optional, Sequence

import torch

from torchmn.communicators import CollectiveMismatchError, CommunicatorBase
from torchmn.errors import TorchmnValueError
from torchmn.functions import alltoall, pseudo_connect
from torchmn.nn._parallel_utility import agree_on_arguments, offsets, refuse_with_the_others


def _grid(split: str, size: int, grid: Optional[Sequence[int]]) -> tuple[int, int]:
    if split not in ("h", "hw"):
        raise TorchmnValueError(f"SpatialParallelConv2d: split must be 'h' or 'hw', not {split!r}")
    if grid is not None:
        rows, cols = grid
        if rows * cols != size or (split == "h" and cols != 1):
            raise TorchmnValueError(
                f"SpatialParallelConv2d: grid {tuple(grid)} does not fit {size} ranks with split={split!r}")
        return rows, cols
    if split == "h":
        return size, 1
    cols = max(c for c in range(1, int(size ** 0.5) + 1) if size % c == 0)
    return size // cols, cols


def _pads(padding, kernel: int, dilation: int) -> tuple[int, int]:
    if padding == "valid":
        return 0, 0
    if padding == "same":
        total = dilation * (kernel - 1)
        return total // 2, total - total // 2
    return padding, padding


class _Axis:
    """One dimension of the image: which output rows each block of input rows owns, and which
    input rows (with padding) it needs for them."""

    def __init__(self, sizes: list[int], kernel: int, stride: int, dilation: int, pads: tuple[int, int]):
        self.starts = offsets(sizes)
        self.length = sum(sizes)
        lo, hi = pads
        span = dilation * (kernel - 1)
        out = (self.length + lo + hi - span - 1) // stride + 1
        if out < 1:
            raise TorchmnValueError(f"SpatialParallelConv2d: an input of {self.length} rows gives no output row")
        # An output row belongs to the block holding the centre of its window (clamped into the
        # image): with padding="same" and stride 1, the output is split as the input is.
        owners = [bisect.bisect_right(self.starts, min(max(o * stride - lo + span // 2, 0), self.length - 1)) - 1
                  for o in range(out)]
        self.out_sizes = [owners.count(b) for b in range(len(sizes))]
        self.out_starts = offsets(self.out_sizes)
        # The input rows block b needs, [begin, end) in the image's coordinates (padding outside it).
        self.need = []
        for b in range(len(sizes)):
            o0, n = self.out_starts[b], self.out_sizes[b]
            self.need.append((o0 * stride - lo, (o0 + n - 1) * stride - lo + span + 1) if n else (0, 0))
        self.sizes = sizes

    def overlap(self, holder: int, needer: int) -> tuple[int, int]:
        """Rows of block ``holder`` that block ``needer`` needs, in ``holder``'s own coordinates."""
        begin, end = self.need[needer]
        lo = max(begin, self.starts[holder])
        hi = min(end, self.starts[holder] + self.sizes[holder])
        return (lo - self.starts[holder], hi - self.starts[holder]) if hi > lo else (0, 0)


class SpatialParallelConv2d(torch.nn.Conv2d):
    """``torch.nn.Conv2d`` over an image split into blocks of rows (``split="h"``), or of rows and
    columns (``split="hw"``), one block per rank.

    Each rank passes its own block and gets its block of the output: the rows (and columns) of the
    input it needs from the others, the halo, come in one exchange, and in backward their
    gradients go back to the ranks that hold them. The result is the dense convolution's, for any
    kernel size, stride, padding (``"same"`` too), dilation and groups. Blocks may be uneven, and a
    rank may hold fewer rows than the halo, or none: the halo then comes from further ranks. An
    output row belongs to the rank holding the centre of its window, so with ``padding="same"``
    and stride 1 the output is split as the input was, ready for the next such layer.

    ``split="hw"`` lays the ranks out as a ``grid`` of (block rows, block columns), rank ``r`` at
    ``divmod(r, columns)`` (default: the squarest grid); the ranks of one block row pass blocks of
    the same height, and those of one block column of the same width.

    The layer holds the whole weight, as ``torch.nn.Conv2d`` (its ``state_dict`` loads as it is).
    Each rank's weight and bias gradients are those of its own output block; their sum over the
    ranks is the dense layer's gradient. Average them with a multi-node optimizer over these ranks:
    where every rank computes the same loss (after a :func:`torchmn.functions.allreduce` that
    joins the blocks, say), that average is exactly the dense gradient of that loss.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, device,
            dtype: as ``torch.nn.Conv2d``'s (``padding_mode`` must be ``"zeros"``).
        comm: the ranks the image is split over, in block order.
        split: ``"h"`` (blocks of rows) or ``"hw"`` (blocks of rows and columns).
        grid: for ``"hw"``, (block rows, block columns).

    Raises:
        ValueError: another ``padding_mode``, an unknown ``split``, or a ``grid`` that does not fit.
        CollectiveMismatchError: (first forward) the ranks built the layer differently; (any
            forward) their blocks do not fit together (batch, channels, heights of a block row,
            widths of a block column).

    Example::

        >>> conv = torchmn.nn.SpatialParallelConv2d(64, 64, 3, padding=1, comm=comm)
        >>> rows = image.tensor_split(comm.size, dim=2)[comm.rank]
        >>> y = conv(rows)                    # this rank's rows of the dense convolution's output
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None, *,
                 comm: CommunicatorBase, split: str = "h", grid: Optional[Sequence[int]] = None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device, dtype)
        if padding_mode != "zeros":
            raise TorchmnValueError(f"SpatialParallelConv2d: padding_mode={padding_mode!r}; only 'zeros' is taken (the "
                                    f"image's borders lie on other ranks than most of their neighbours)")
        self.comm, self.split = comm, split
        self.grid = _grid(split, comm.size, grid)
        self._arguments = (in_channels, out_channels, self.kernel_size, self.stride, self.padding, self.dilation,
                           groups, bias, split, self.grid)
        self._agreed = False
        self.last_halo_bytes = 0  # bytes this rank sent to others in the last forward (as many come back)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Convolve this rank's block; every rank calls it.

        Args:
            x: this rank's block ``(N, C, rows, columns)``.

        Returns:
            Its block of the dense convolution's output.

        Raises:
            ValueError: an input that is not 4-dimensional.
            CollectiveMismatchError: the ranks' layers differ, or their blocks do not fit together.

        Example::

            >>> rows = image.tensor_split(comm.size, dim=2)[comm.rank]     # split="h"
            >>> y = conv(rows)                    # this rank's rows of the dense output
        """
        comm = self.comm
        if not self._agreed:
            agree_on_arguments(self, comm, self._arguments)
            self._agreed = True
        if x.dim() != 4:
            refuse_with_the_others(comm, TorchmnValueError(
                f"SpatialParallelConv2d: expected (N, C, rows, columns), got {tuple(x.shape)} (rank {comm.rank})"))
        rows, cols = self._axes(x)
        r = comm.rank
        i, j = divmod(r, self.grid[1])
        pieces = []
        for q in range(comm.size):  # what each rank needs from this block
            qi, qj = divmod(q, self.grid[1])
            (r0, r1), (c0, c1) = rows.overlap(i, qi), cols.overlap(j, qj)
            pieces.append(x[:, :, r0:r1, c0:c1] if q != r else x.new_empty((x.shape[0], x.shape[1], 0, 0)))
        self.last_halo_bytes = sum(p.numel() * p.element_size() for p in pieces)
        received = alltoall(comm, pieces) if comm.size > 1 else pieces
        (top, bottom), (left, right) = rows.need[i], cols.need[j]
        window = x.new_zeros((x.shape[0], x.shape[1], bottom - top, right - left))
        for q in range(comm.size):
            qi, qj = divmod(q, self.grid[1])
            if q == r:
                (r0, r1), (c0, c1) = rows.overlap(i, i), cols.overlap(j, j)
                piece = x[:, :, r0:r1, c0:c1]
            else:
                (r0, r1), (c0, c1) = rows.overlap(qi, i), cols.overlap(qj, j)
                piece = received[q]
            if piece.numel():
                y0, x0 = rows.starts[qi] + r0 - top, cols.starts[qj] + c0 - left
                window[:, :, y0:y0 + piece.shape[2], x0:x0 + piece.shape[3]] = piece
        tied = list(received) + [x]
        if rows.out_sizes[i] == 0 or cols.out_sizes[j] == 0:
            y = window.new_zeros((x.shape[0], self.out_channels, rows.out_sizes[i], cols.out_sizes[j]))
            tied += [p for p in (self.weight, self.bias) if p is not None]  # their gradients: zeros, not None
        else:
            y = torch.nn.functional.conv2d(window, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        if comm.size == 1:
            return y
        # Every rank's backward must run the exchange's backward, also where none of what it received
        # reaches its output (a block with no output, or no halo from a rank): the output is tied to
        # all of it, and to the block itself, without changing its values.
        return pseudo_connect(torch.stack([t.sum() for t in tied]).sum(), y)

    def _axes(self, x: torch.Tensor) -> tuple[_Axis, _Axis]:
        """Every rank's block size (one small collective), checked, as the two axes' geometry."""
        comm = self.comm
        shape = torch.tensor(list(x.shape), dtype=torch.int64)
        shapes = [tuple(s.tolist()) for s in comm.allgather(shape)] if comm.size > 1 else [tuple(x.shape)]
        rows_, cols_ = self.grid
        heights = [shapes[i * cols_][2] for i in range(rows_)]
        widths = [shapes[j][3] for j in range(cols_)]
        bad = [q for q, s in enumerate(shapes)
               if s[:2] != shapes[0][:2] or s[1] != self.in_channels or s[2] != heights[q // cols_]
               or s[3] != widths[q % cols_]]
        if bad:
            raise CollectiveMismatchError(
                f"SpatialParallelConv2d: the ranks' blocks do not fit together in a grid of {rows_} x {cols_} "
                f"(rank = block row x {cols_} + block column; each block (N, {self.in_channels}, rows, columns) with N "
                f"alike, rows alike along a block row, columns alike along a block column): "
                + ", ".join(f"rank {q}: {s}" for q, s in enumerate(shapes)) + f" (raised on rank {comm.rank})")
        if isinstance(self.padding, str):
            pads = [_pads(self.padding, k, d) for k, d in zip(self.kernel_size, self.dilation)]
        else:
            pads = [(p, p) for p in self.padding]
        return (_Axis(heights, self.kernel_size[0], self.stride[0], self.dilation[0], pads[0]),
                _Axis(widths, self.kernel_size[1], self.stride[1], self.dilation[1], pads[1]))
