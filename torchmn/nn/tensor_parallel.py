"""Megatron-style tensor-parallel linear layers: a weight split over the ranks by rows or columns.

``ColumnParallelLinear(gather_output=False) -> activation -> RowParallelLinear(input_is_parallel=True)``
is an MLP that communicates once in forward (the row layer's allreduce) and once in backward (the
column layer's). Every rank computes the same loss, and each rank's slice of a weight gets its
exact gradient: train with a plain optimizer, or a multi-node optimizer over a data-parallel
communicator, not over these ranks.
"""
from __future__ import annotations

import torch

from torchmn.communicators import CommunicatorBase
from torchmn.errors import TorchmnValueError
from torchmn.nn._parallel_utility import (accept_dense_state_dicts, agree_on_arguments, copy_to_parallel,
                                          gather_from_parallel, offsets, reduce_from_parallel,
                                          refuse_with_the_others, scatter_to_parallel, split_sizes)


class _SlicedLinear(torch.nn.Module):
    """A linear layer holding slice ``rank`` of a dense ``torch.nn.Linear``'s weight along ``dim``.

    Its ``state_dict`` holds the slice; ``load_state_dict`` also takes a dense layer's (each rank
    keeps its slice), and ``dense_state_dict`` gathers the dense one.
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype, comm: CommunicatorBase):
        super().__init__()
        self.in_features, self.out_features, self.comm = in_features, out_features, comm
        # The dense layer torch would build with this random state: a model built alike on every
        # rank starts where one process would.
        dense = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        n = dense.weight.shape[self.split_dim]
        self.sizes = split_sizes(n, comm.size)
        if min(self.sizes) == 0:
            raise TorchmnValueError(f"{type(self).__name__}: {n} features cannot be split over {comm.size} ranks (each "
                                    f"needs at least one)")
        self.start = offsets(self.sizes)[comm.rank]
        self.weight = torch.nn.Parameter(self._mine(dense.weight.detach(), self.split_dim).clone())
        self.bias = None
        if bias:
            self.bias = torch.nn.Parameter(self._bias_of(dense.bias.detach()).clone())
        self._arguments = (in_features, out_features, bias, type(self).__name__)
        self._agreed = False
        accept_dense_state_dicts(self, type(self)._dense_weight_shape, type(self)._slices_of_dense)

    def _mine(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.narrow(dim, self.start, self.sizes[self.comm.rank])

    def _bias_of(self, bias: torch.Tensor) -> torch.Tensor:
        return bias

    def _check_whole_input(self, x: torch.Tensor) -> None:
        # The whole input is the same on every rank, so every rank refuses it alike, before a
        # collective (a rank's slice of it would not fit its weight, on one rank only).
        if x.shape[-1] != self.in_features:
            refuse_with_the_others(self.comm, TorchmnValueError(
                f"{type(self).__name__}({self.in_features}, {self.out_features}): expected an input of "
                f"{self.in_features} features, got shape {tuple(x.shape)} (rank {self.comm.rank})"))

    def _agree(self) -> None:
        if not self._agreed:
            agree_on_arguments(self, self.comm, self._arguments)
            self._agreed = True

    def dense_state_dict(self) -> dict:
        """The dense ``torch.nn.Linear``'s ``state_dict``, gathered from every rank (collective).

        Returns:
            ``{"weight": ..., "bias": ...}`` with the dense layer's shapes.
        """
        weight = torch.cat(self.comm.allgather(self.weight.detach()), dim=self.split_dim)
        out = {"weight": weight}
        if self.bias is not None:
            out["bias"] = self._dense_bias()
        return out

    def _dense_bias(self) -> torch.Tensor:
        return self.bias.detach().clone()

    @torch.no_grad()
    def load_dense_state_dict(self, state_dict: dict) -> None:
        """Take this rank's slice of a dense ``torch.nn.Linear``'s ``state_dict`` (no communication).

        Args:
            state_dict: with ``weight`` (and ``bias``) of the dense layer's shapes.

        Raises:
            ValueError: a tensor of another shape than the dense layer's.
        """
        dense = self._dense_weight_shape()
        if tuple(state_dict["weight"].shape) != dense:
            raise TorchmnValueError(f"{type(self).__name__}: the dense weight must be {dense}, not "
                                    f"{tuple(state_dict['weight'].shape)}")
        for name, value in self._slices_of_dense(state_dict).items():
            getattr(self, name).copy_(value)

    def _dense_weight_shape(self) -> tuple:
        return self.out_features, self.in_features

    def _slices_of_dense(self, dense: dict) -> dict:
        """This rank's slices of a dense layer's ``weight`` (and ``bias``, where both have one)."""
        out = {"weight": self._mine(dense["weight"], self.split_dim)}
        if self.bias is not None and "bias" in dense:
            out["bias"] = self._bias_of(dense["bias"])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rank {self.comm.rank} of {self.comm.size}")


class ColumnParallelLinear(_SlicedLinear):
    """``torch.nn.Linear`` with its output features split over the ranks (weight rows).

    Every rank takes the whole input and computes its slice of the output; with ``gather_output``
    the slices are joined, so every rank returns the whole output. A dense ``torch.nn.Linear``'s
    ``state_dict`` loads with ``load_state_dict`` (each rank keeps its rows).

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``'s.
        comm: the ranks the layer is split over.
        gather_output: return the whole output (an all-gather), not this rank's slice.

    Raises:
        ValueError: fewer output features than ranks.
        CollectiveMismatchError: (first forward) the ranks built the layer differently.

    Example::

        >>> up = torchmn.nn.ColumnParallelLinear(512, 2048, comm=comm, gather_output=False)
        >>> down = torchmn.nn.RowParallelLinear(2048, 512, comm=comm, input_is_parallel=True)
        >>> y = down(torch.relu(up(x)))          # one allreduce forward, one backward
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 comm: CommunicatorBase, gather_output: bool = True):
        super().__init__(in_features, out_features, bias, device, dtype, comm)
        self.gather_output = gather_output
        self._arguments += (gather_output,)

    def _bias_of(self, bias: torch.Tensor) -> torch.Tensor:
        return self._mine(bias, 0)

    def _dense_bias(self) -> torch.Tensor:
        return torch.cat(self.comm.allgather(self.bias.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply; every rank calls it.

        Args:
            x: the whole input, the same on every rank.

        Returns:
            The whole output, or this rank's slice of its features.

        Raises:
            CollectiveMismatchError: (first call) the ranks built the layer differently.

        Example::

            >>> h = up(x)                         # gather_output=False: (N, 512) of 2048 features, 4 ranks
        """
        self._agree()
        self._check_whole_input(x)
        y = torch.nn.functional.linear(copy_to_parallel(self.comm, x), self.weight, self.bias)
        return gather_from_parallel(self.comm, y, -1) if self.gather_output else y


class RowParallelLinear(_SlicedLinear):
    """``torch.nn.Linear`` with its input features split over the ranks (weight columns).

    Each rank multiplies its slice of the input by its slice of the weight; the partial results are
    summed over the ranks (one allreduce), and the bias, whole on every rank, is added once. A
    dense ``torch.nn.Linear``'s ``state_dict`` loads with ``load_state_dict`` (each rank keeps its
    columns).

    Args:
        in_features, out_features, bias, device, dtype: as ``torch.nn.Linear``'s.
        comm: the ranks the layer is split over.
        input_is_parallel: the input is already this rank's slice of features (the output of a
            :class:`ColumnParallelLinear` with ``gather_output=False``); otherwise the whole input,
            which every rank cuts its slice from.

    Raises:
        ValueError: fewer input features than ranks.
        CollectiveMismatchError: (first forward) the ranks built the layer differently.

    Example::

        >>> down = torchmn.nn.RowParallelLinear(2048, 512, comm=comm, input_is_parallel=True)
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 comm: CommunicatorBase, input_is_parallel: bool = False):
        super().__init__(in_features, out_features, bias, device, dtype, comm)
        self.input_is_parallel = input_is_parallel
        self._arguments += (input_is_parallel,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply; every rank calls it.

        Args:
            x: this rank's slice of the input features, or the whole input.

        Returns:
            The whole output, the same on every rank.

        Raises:
            ValueError: an input slice of another width than this rank's.
            CollectiveMismatchError: (first call) the ranks built the layer differently.

        Example::

            >>> y = down(torch.relu(up(x)))       # (N, 512), the same on every rank
        """
        self._agree()
        if not self.input_is_parallel:
            self._check_whole_input(x)
            x = scatter_to_parallel(self.comm, x, -1)
        elif x.shape[-1] != self.weight.shape[1]:
            refuse_with_the_others(self.comm, TorchmnValueError(
                f"{type(self).__name__}: rank {self.comm.rank} holds {self.weight.shape[1]} of the "
                f"{self.in_features} input features, but its input has {x.shape[-1]}"))
        y = reduce_from_parallel(self.comm, torch.nn.functional.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
