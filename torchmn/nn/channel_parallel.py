"""A convolution whose output channels are split over the ranks (channel parallelism)."""
from __future__ import annotations

import torch

from torchmn.communicators import CollectiveMismatchError, CommunicatorBase
from torchmn.errors import TorchmnValueError
from torchmn.functions import allgather
from torchmn.nn._parallel_utility import (accept_dense_state_dicts, agree_on_arguments, copy_to_parallel,
                                          gather_from_parallel, offsets, refuse_with_the_others, scatter_to_parallel,
                                          split_sizes)


class ChannelParallelConv2d(torch.nn.Module):
    """``torch.nn.Conv2d`` with its output channels split over the ranks.

    Each rank computes its slice of the output channels (``split_sizes``: the first ranks take one
    more where they do not divide evenly) from the whole input: the input's channel slices are
    gathered from every rank (``input_is_parallel=True``, as the previous channel-parallel layer
    left them) or the whole input is given on every rank. The output is this rank's slice, or the
    whole output with ``gather_output``. The result is the dense convolution's, to the last bit of
    its arithmetic.

    ``grouped=True`` is ChainerMN's variant: each rank convolves only its own slice of the input
    channels, which needs no input gathered but is another layer (a block-diagonal convolution,
    ``groups=size`` where the channels divide evenly), not the dense one.

    Every rank computes the same loss from the result, as with Megatron's layers: each rank's
    weight slice gets its exact gradient (train with a plain optimizer, or a multi-node optimizer
    over a data-parallel communicator). The layer holds a slice of the dense weight, and its
    ``state_dict`` that slice; ``load_state_dict`` also takes a dense ``torch.nn.Conv2d``'s (each
    rank keeps its slice), and :meth:`dense_state_dict` gathers the dense one.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, bias, padding_mode,
            device, dtype: as ``torch.nn.Conv2d``'s (``groups`` must be 1).
        comm: the ranks the output channels are split over.
        input_is_parallel: the input is this rank's slice of the input channels.
        gather_output: return the whole output, not this rank's slice.
        grouped: ChainerMN's block-diagonal variant.

    Raises:
        ValueError: ``groups`` other than 1, or fewer channels than ranks.
        CollectiveMismatchError: (first forward) the ranks built the layer differently; (any
            forward, with ``input_is_parallel``) their input slices do not fit the split.

    Example::

        >>> conv1 = torchmn.nn.ChannelParallelConv2d(3, 64, 3, padding=1, comm=comm, gather_output=False)
        >>> conv2 = torchmn.nn.ChannelParallelConv2d(64, 64, 3, padding=1, comm=comm, input_is_parallel=True)
        >>> y = conv2(torch.relu(conv1(x)))       # x whole on every rank; y whole on every rank
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None, *,
                 comm: CommunicatorBase, input_is_parallel: bool = False, gather_output: bool = True,
                 grouped: bool = False):
        super().__init__()
        if groups != 1:
            raise TorchmnValueError(f"ChannelParallelConv2d: groups={groups}; split a grouped convolution's channels "
                                    f"with grouped=True, or use SpatialParallelConv2d, which takes any groups")
        dense = torch.nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, 1, bias,
                                padding_mode, device, dtype)
        self.comm = comm
        self.in_channels, self.out_channels = in_channels, out_channels
        self.stride, self.padding, self.dilation = dense.stride, dense.padding, dense.dilation
        self.padding_mode = padding_mode
        self._reversed_padding = dense._reversed_padding_repeated_twice
        self.input_is_parallel, self.gather_output, self.grouped = input_is_parallel, gather_output, grouped
        self.out_sizes = split_sizes(out_channels, comm.size)
        self.in_sizes = split_sizes(in_channels, comm.size)
        if min(self.out_sizes) == 0 or (grouped or input_is_parallel) and min(self.in_sizes) == 0:
            raise TorchmnValueError(f"ChannelParallelConv2d: {out_channels} output and {in_channels} input channels "
                                    f"cannot be split over {comm.size} ranks (each needs at least one)")
        r = comm.rank
        out_lo, in_lo = offsets(self.out_sizes)[r], offsets(self.in_sizes)[r]
        weight = dense.weight.detach().narrow(0, out_lo, self.out_sizes[r])
        if grouped:
            weight = weight.narrow(1, in_lo, self.in_sizes[r])
        self.weight = torch.nn.Parameter(weight.clone())
        self.bias = torch.nn.Parameter(dense.bias.detach().narrow(0, out_lo, self.out_sizes[r]).clone()) \
            if bias else None
        self._arguments = (in_channels, out_channels, dense.kernel_size, dense.stride, dense.padding,
                           dense.dilation, bias, padding_mode, input_is_parallel, gather_output, grouped)
        self._agreed = False
        accept_dense_state_dicts(self, type(self)._dense_weight_shape, type(self)._slices_of_dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Convolve ``x``; every rank calls it.

        Args:
            x: ``(N, C, H, W)``, or unbatched ``(C, H, W)``: this rank's slice of the input channels,
                or the whole input.

        Returns:
            The output, whole or this rank's slice of its channels.

        Raises:
            ValueError: an input of another number of dimensions; with ``grouped`` and
                ``input_is_parallel``, an input that is not this rank's slice of the input channels.
            CollectiveMismatchError: the ranks' layers differ, or their input slices do not fit.

        Example::

            >>> y = conv(torch.randn(8, 3, 32, 32))   # whole input on every rank; y: (8, 64, 32, 32)
        """
        if not self._agreed:
            agree_on_arguments(self, self.comm, self._arguments)
            self._agreed = True
        comm = self.comm
        if x.dim() not in (3, 4):
            refuse_with_the_others(comm, TorchmnValueError(
                f"ChannelParallelConv2d: rank {comm.rank}'s input is {tuple(x.shape)}; a convolution takes "
                f"(N, C, H, W) or (C, H, W), as torch.nn.Conv2d does"))
        if x.dim() == 3:  # unbatched, as torch.nn.Conv2d takes it: the channels are dimension 0
            y = self.forward(x.unsqueeze(0))
            return y.squeeze(0)
        if self.input_is_parallel and self.grouped:
            if x.shape[1] != self.in_sizes[comm.rank]:
                refuse_with_the_others(comm, TorchmnValueError(
                    f"ChannelParallelConv2d: rank {comm.rank} holds input channels of {self.in_sizes[comm.rank]}, "
                    f"but its input is {tuple(x.shape)}"))
            full = x
        elif self.input_is_parallel:
            parts = allgather(comm, x)
            self._check_slices(parts)
            full = torch.cat(parts, dim=1)
        else:
            full = scatter_to_parallel(comm, x, 1) if self.grouped else copy_to_parallel(comm, x)
        if self.padding_mode != "zeros":
            full = torch.nn.functional.pad(full, self._reversed_padding, mode=self.padding_mode)
            padding = 0
        else:
            padding = self.padding
        y = torch.nn.functional.conv2d(full, self.weight, self.bias, self.stride, padding, self.dilation)
        return gather_from_parallel(comm, y, 1) if self.gather_output else y

    def _check_slices(self, parts) -> None:
        got = [tuple(p.shape) for p in parts]
        bad = [r for r, shape in enumerate(got) if shape[1] != self.in_sizes[r]
               or shape[:1] + shape[2:] != got[0][:1] + got[0][2:]]
        if bad:
            raise CollectiveMismatchError(
                f"ChannelParallelConv2d: the ranks' input slices do not fit the split of {self.in_channels} "
                f"channels into {self.in_sizes}: " + ", ".join(f"rank {r}: {s}" for r, s in enumerate(got))
                + f" (each rank passes (N, its channels, H, W), with N, H and W alike; raised on rank "
                f"{self.comm.rank})")

    def dense_state_dict(self) -> dict:
        """The dense ``torch.nn.Conv2d``'s ``state_dict``, gathered from every rank (collective).

        With ``grouped=True`` the blocks sit on the diagonal of a dense weight, zeros elsewhere.

        Returns:
            ``{"weight": ..., "bias": ...}`` of the dense layer's shapes.

        Example::

            >>> dense = torch.nn.Conv2d(3, 64, 3, padding=1)
            >>> dense.load_state_dict(conv.dense_state_dict())
        """
        blocks = self.comm.allgather(self.weight.detach())
        if self.grouped:
            weight = self.weight.new_zeros((self.out_channels, self.in_channels) + tuple(self.weight.shape[2:]))
            for r, (block, o, i) in enumerate(zip(blocks, offsets(self.out_sizes), offsets(self.in_sizes))):
                weight[o:o + self.out_sizes[r], i:i + self.in_sizes[r]] = block
        else:
            weight = torch.cat(blocks)
        out = {"weight": weight}
        if self.bias is not None:
            out["bias"] = torch.cat(self.comm.allgather(self.bias.detach()))
        return out

    @torch.no_grad()
    def load_dense_state_dict(self, state_dict: dict) -> None:
        """Take this rank's slice of a dense ``torch.nn.Conv2d``'s ``state_dict`` (no communication).

        Args:
            state_dict: ``weight`` (and ``bias``) of the dense layer's shapes.

        Raises:
            ValueError: a weight of another shape than the dense layer's.

        Example::

            >>> conv.load_dense_state_dict(torch.nn.Conv2d(3, 64, 3, padding=1).state_dict())
        """
        w = state_dict["weight"]
        if tuple(w.shape) != self._dense_weight_shape():
            raise TorchmnValueError(f"ChannelParallelConv2d: the dense weight must be {self._dense_weight_shape()}, "
                                    f"not {tuple(w.shape)}")
        for name, value in self._slices_of_dense(state_dict).items():
            getattr(self, name).copy_(value)

    def _dense_weight_shape(self) -> tuple:
        return (self.out_channels, self.in_channels) + tuple(self.weight.shape[2:])

    def _slices_of_dense(self, dense: dict) -> dict:
        """This rank's slices of a dense layer's ``weight`` (and ``bias``, where both have one)."""
        r = self.comm.rank
        mine = dense["weight"].narrow(0, offsets(self.out_sizes)[r], self.out_sizes[r])
        if self.grouped:
            mine = mine.narrow(1, offsets(self.in_sizes)[r], self.in_sizes[r])
        out = {"weight": mine}
        if self.bias is not None and "bias" in dense:
            out["bias"] = dense["bias"].narrow(0, offsets(self.out_sizes)[r], self.out_sizes[r])
        return out
