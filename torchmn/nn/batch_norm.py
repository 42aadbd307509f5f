"""BatchNorm over the global batch of every rank, on CPU (gloo, shared memory) as on GPU (NCCL).

torch's ``SyncBatchNorm`` refuses CPU tensors. Here each forward makes one collective (every
rank's per-channel sum, sum of squares and count, together) and each backward one (every rank's
sums of the gradient and of the gradient times the normalized input), so uneven local batches give
exactly the global statistics. The data is read twice forward (the moments, the normalization) and
three times backward (torch's fused batch-norm reduction, then the input's gradient in two fused
multiply-adds), instead of autograd's pass per elementwise operation.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from torchmn.communicators import CollectiveMismatchError, CommunicatorBase, RemoteRankError, backward_pass
from torchmn.elastic import membership
from torchmn.errors import TorchmnValueError
from torchmn.nn._parallel_utility import agree_on_arguments, refuse_with_the_others


class MultiNodeBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization with statistics over the batch of every rank of ``comm``.

    Takes ``torch.nn.BatchNorm2d``'s arguments in its order, plus ``comm``; parameter and buffer
    names are BatchNorm's, so its ``state_dict`` loads as it is. In training (or without running
    statistics) the mean and variance are those of the global batch: the per-channel sums, sums of
    squares and counts of every rank, in one allreduce; backward sends their gradients back in one
    allreduce too. In eval mode with running statistics it makes no collective. ``momentum=None``
    is the cumulative average, as in torch. The running statistics (unbiased variance over the
    global batch) and ``num_batches_tracked`` are those one process on the whole batch would keep.

    The gradient each rank gets for the weight and bias is its own batch's part, as with the other
    layers of a data-parallel model: average them with the multi-node optimizer.

    It is a ``torch.nn.modules.batchnorm._BatchNorm``, as torch's BatchNorm layers are, so code that
    finds BatchNorm layers by class (no weight decay for them, freezing them) finds it; a deep copy
    of a model (an EMA) shares ``comm``.

    This base class takes inputs of any number of dimensions ``>= 2`` (as ``SyncBatchNorm``);
    :class:`MultiNodeBatchNorm1d`, ``2d`` and ``3d`` check theirs as torch's do.

    Args:
        num_features: channels ``C`` of an input ``(N, C, ...)``.
        eps, momentum, affine, track_running_stats, device, dtype: as ``torch.nn.BatchNorm2d``'s.
        comm: the ranks whose batches make the global one.

    Raises:
        CollectiveMismatchError: (first forward) the ranks built the layer with different arguments.
        ValueError: (any forward, on the rank concerned) an input whose channels are not
            ``num_features``; under a launcher, the others stop with that rank's failure.

    Example::

        >>> bn = torchmn.nn.MultiNodeBatchNorm2d(64, comm=comm)
        >>> y = bn(x)                     # statistics over every rank's images
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, *, comm: CommunicatorBase):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.comm = comm
        self._agreed = False
        # The last global batch mean, alike on every rank: the next batch's sums are taken about it
        # (see _global_moments), so that a large mean does not cancel the variance's digits.
        self._shift: Optional[torch.Tensor] = None
        # The elastic job's generation the two above belong to (None outside one): in a new world a
        # rank that joined has a layer that never agreed, so every rank agrees again, from no shift.
        self._world = membership.generation()

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise TorchmnValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {x.dim()}")

    def _agree_on_arguments(self) -> None:
        agree_on_arguments(self, self.comm, (self.num_features, self.eps, self.momentum, self.affine,
                                             self.track_running_stats))
        self._agreed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` (this rank's part of the batch) with the global batch's statistics.

        Args:
            x: ``(N, C, ...)``; ``N`` may differ between ranks.

        Returns:
            The normalized tensor, of ``x``'s shape.

        Raises:
            ValueError: an input of another number of dimensions or channels.
            CollectiveMismatchError: the ranks' layers or channel counts differ.

        Example::

            >>> bn = torchmn.nn.MultiNodeBatchNorm2d(3, comm=comm)
            >>> bn(torch.randn(8 if comm.rank == 0 else 5, 3, 32, 32)).shape   # rank 0
            torch.Size([8, 3, 32, 32])
        """
        use_batch = self.training or not self.track_running_stats
        world = membership.generation()
        if world != self._world:
            self._agreed, self._shift, self._world = False, None, world
        try:
            self._check_input_dim(x)
            if x.shape[1] != self.num_features:
                raise TorchmnValueError(f"{type(self).__name__}: expected {self.num_features} channels, got input of "
                                        f"shape {tuple(x.shape)}")
        except TorchmnValueError as error:
            if use_batch:  # the other ranks, in the statistics' collective, are told instead of waiting
                if not self._agreed:
                    self._agree_on_arguments()
                refuse_with_the_others(self.comm, error)
            raise
        if not use_batch:
            return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                                  False, 0.0, self.eps)
        if not self._agreed:
            self._agree_on_arguments()
        compute = torch.promote_types(x.dtype, torch.float32)  # half precision normalizes in float32
        xc = x.to(compute)
        with torch.no_grad():
            try:
                mean, var, n = _global_moments(self.comm, xc, self._shift)
            except RemoteRankError as error:  # another rank refused its input (refuse_with_the_others)
                raise CollectiveMismatchError(
                    f"{type(self).__name__}: another rank refused its own input (its error says why: a wrong number "
                    f"of channels or dimensions), so the batch statistics cannot be summed: {error}") from error
        if n > 0:  # a channel whose batch held NaN or inf keeps its shift: the next batch's sums start clean
            kept = torch.zeros_like(mean) if self._shift is None else self._shift
            self._shift = torch.where(mean.isfinite(), mean, kept)
        if n == 1:  # known alike on every rank: n is the global batch's count
            raise TorchmnValueError(
                f"{type(self).__name__}: expected more than 1 value per channel when training, got 1 over the "
                f"global batch of {self.comm.size} ranks (this rank's input: {tuple(x.shape)}); give the ranks "
                f"larger batches, or call model.eval() for single samples")
        if n == 0:  # every rank's batch is empty: as torch's BatchNorm, nothing to normalize, statistics kept
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
            mean, var, n = torch.zeros_like(mean), torch.ones_like(var), torch.ones_like(n)
        elif self.training and self.track_running_stats:
            self._update_running_stats(mean, var, n)
        invstd = torch.rsqrt(var + self.eps).to(compute)
        return _GlobalNormalization.apply(xc, mean.to(compute), invstd, self.weight, self.bias, self.comm,
                                          float(n)).to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (n / (n - 1)) if n > 1 else var
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def _global_moments(comm: CommunicatorBase, xc: torch.Tensor, shift: Optional[torch.Tensor] = None):
    """The global batch's per-channel mean and (biased) variance, and its count: this rank's mean
    and variance by torch's batch-norm kernel (Welford, per channel; ``torch.var_mean`` over the
    batch and spatial dimensions takes several times longer on the CPU), then every rank's count,
    count x (mean - shift) and count x (variance + (mean - shift)^2) summed in float64, in one
    collective of 2C + 1 numbers.

    ``shift`` (the last batch's global mean, the same on every rank; else 0) keeps the second
    moment near the variance: about 0, a mean far larger than the spread (raw timestamps, say)
    would cancel the variance's digits in ``E[x^2] - E[x]^2``. Where the mean still lies more than
    100 spreads from the shift (the first batch of such data), the sums are taken again about the
    global mean just found: a second collective, decided alike on every rank from the same sums."""
    c = xc.shape[1]
    n_l = xc.numel() // max(1, c)
    if n_l:
        # With eps 0 the kernel's invstd is 1 / sqrt(variance), and 0 (not inf) where a channel's
        # variance is 0 (a constant channel, or one value per channel on this rank).
        _, mean_l, invstd_l = torch.ops.aten.native_batch_norm(xc, None, None, None, None, True, 0.0, 0.0)
        invstd_l = invstd_l.double()
        var_l = torch.where(invstd_l > 0, invstd_l.pow(-2), torch.zeros_like(invstd_l))
    else:  # no samples on this rank: it adds nothing to the sums
        mean_l = var_l = torch.zeros(c, dtype=torch.float64, device=xc.device)
    mean_l, var_l = mean_l.double(), var_l.double()
    count = torch.full((1,), float(n_l), dtype=torch.float64, device=xc.device)

    def about(base: torch.Tensor):
        d = mean_l - base
        total = comm.allreduce(torch.cat([d * n_l, (var_l + d * d) * n_l, count]))
        n = total[2 * c]
        offset = total[:c] / n
        return offset, (total[c:2 * c] / n - offset * offset).clamp_min(0), n

    base = torch.zeros_like(mean_l) if shift is None else shift.to(mean_l)
    offset, var, n = about(base)
    if bool(n > 0) and bool((offset * offset > 1e4 * var).any()):
        base = base + offset
        offset, var, n = about(base)
    return base + offset, var, n


class _GlobalNormalization(torch.autograd.Function):
    """``y = (x - mean) * invstd * weight + bias`` with the global batch's statistics, and its
    backward in three passes over the data: torch's fused batch-norm reduction for this rank's
    sums of the gradient and of the gradient times the normalized input, one collective of those
    (2C numbers), then ``dx = A * dy + B * x + C`` per channel, which is the gradient through the
    normalization and through the global statistics together."""

    @staticmethod
    def forward(ctx, xc, mean, invstd, weight, bias, comm, n):
        shape = [1, xc.shape[1]] + [1] * (xc.dim() - 2)
        scale = invstd if weight is None else invstd * weight.to(xc.dtype)
        shift = scale * mean if bias is None else scale * mean - bias.to(xc.dtype)
        ctx.save_for_backward(xc, mean, invstd, weight)
        ctx.comm, ctx.n, ctx.has_bias = comm, n, bias is not None
        return torch.addcmul(-shift.view(shape), xc, scale.view(shape))  # one pass

    @staticmethod
    @once_differentiable
    @backward_pass()
    def backward(ctx, grad):
        xc, mean, invstd, weight = ctx.saved_tensors
        grad = grad.contiguous()
        shape = [1, xc.shape[1]] + [1] * (xc.dim() - 2)
        # This rank's sum of grad * (x - mean) * invstd and of grad, in one fused pass.
        if xc.numel():
            ones = torch.ones_like(invstd)
            _, local_gx, local_g = torch.ops.aten.native_batch_norm_backward(grad, xc, ones, None, None, mean, invstd,
                                                                             True, 0.0, [False, True, True])
        else:  # no samples on this rank (torch's kernel divides by their count): it adds nothing
            local_gx = local_g = torch.zeros_like(invstd)
        c = xc.shape[1]
        total = ctx.comm.allreduce(torch.cat([local_g, local_gx]).double())
        sum_g, sum_gx = total[:c], total[c:]
        w = invstd.double() if weight is None else invstd.double() * weight.detach().double()
        a = w
        b = -w * invstd.double() * sum_gx / ctx.n
        c_ = -w * sum_g / ctx.n - b * mean.double()
        dx = torch.addcmul(c_.to(xc.dtype).view(shape), xc, b.to(xc.dtype).view(shape))
        dx.addcmul_(grad, a.to(xc.dtype).view(shape))
        grad_weight = local_gx.to(weight.dtype) if weight is not None and ctx.needs_input_grad[3] else None
        grad_bias = local_g.to(weight.dtype if weight is not None else local_g.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[4] else None
        return dx, None, None, grad_weight, grad_bias, None, None


class MultiNodeBatchNorm1d(MultiNodeBatchNorm):
    """:class:`MultiNodeBatchNorm` for ``(N, C)`` or ``(N, C, L)`` inputs, as ``torch.nn.BatchNorm1d``.

    Example::

        >>> bn = torchmn.nn.MultiNodeBatchNorm1d(100, comm=comm)
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() not in (2, 3):
            raise TorchmnValueError(f"expected 2D or 3D input (got {x.dim()}D input)")


class MultiNodeBatchNorm2d(MultiNodeBatchNorm):
    """:class:`MultiNodeBatchNorm` for ``(N, C, H, W)`` inputs, as ``torch.nn.BatchNorm2d``.

    Example::

        >>> bn = torchmn.nn.MultiNodeBatchNorm2d(64, comm=comm)
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() != 4:
            raise TorchmnValueError(f"expected 4D input (got {x.dim()}D input)")


class MultiNodeBatchNorm3d(MultiNodeBatchNorm):
    """:class:`MultiNodeBatchNorm` for ``(N, C, D, H, W)`` inputs, as ``torch.nn.BatchNorm3d``.

    Example::

        >>> bn = torchmn.nn.MultiNodeBatchNorm3d(16, comm=comm)
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() != 5:
            raise TorchmnValueError(f"expected 5D input (got {x.dim()}D input)")


# Subclasses too, as torch's convert_sync_batchnorm and ChainerMN do: a model's own BatchNorm class
# left alone would keep per-rank statistics without a word.
_REPLACEMENTS = ((torch.nn.BatchNorm1d, MultiNodeBatchNorm1d), (torch.nn.BatchNorm2d, MultiNodeBatchNorm2d),
                 (torch.nn.BatchNorm3d, MultiNodeBatchNorm3d), (torch.nn.SyncBatchNorm, MultiNodeBatchNorm))


def create_mnbn_model(module: torch.nn.Module, comm: CommunicatorBase) -> torch.nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` in ``module`` (their subclasses
    included) by its multi-node one.

    Each replacement keeps the original's arguments, parameters, running statistics,
    ``num_batches_tracked``, training mode and ``requires_grad``; the rest of the model is untouched.
    A subclass's own ``forward`` is not kept (as with torch's ``convert_sync_batchnorm``).

    Args:
        module: the model (or a BatchNorm layer itself).
        comm: the ranks whose batches make the global one.

    Returns:
        The model, changed in place (or the new layer, where ``module`` is a BatchNorm).

    Example::

        >>> model = torchmn.nn.create_mnbn_model(torchvision.models.resnet18(), comm)

    Raises:
        ValueError: a lazy BatchNorm has not seen its first batch (its size is not known yet).
    """
    if isinstance(module, MultiNodeBatchNorm):
        return module
    # A lazy BatchNorm becomes a BatchNorm1d/2d/3d at its first batch; before, its size is unknown.
    lazy = isinstance(module, torch.nn.modules.lazy.LazyModuleMixin)
    if lazy and isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.has_uninitialized_params():
        raise TorchmnValueError(f"create_mnbn_model: {type(module).__name__} does not know its number of features "
                                f"before its first batch; run one forward pass first, then convert the model")
    cls = next((new for old, new in _REPLACEMENTS if isinstance(module, old)), None)
    if cls is not None:
        return rebuild_batch_norm(module, cls, comm=comm)
    for name, child in module.named_children():
        replaced = create_mnbn_model(child, comm)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def rebuild_batch_norm(module: torch.nn.Module, cls: type, **kwargs) -> torch.nn.Module:
    """A BatchNorm layer of class ``cls`` in place of ``module``, with its arguments, parameters,
    running statistics, ``num_batches_tracked``, device, dtype, ``requires_grad`` and mode.

    Args:
        module: a BatchNorm layer (torch's or a multi-node one).
        cls: the class of the new layer.
        **kwargs: more arguments of ``cls`` (``comm`` for a multi-node one).

    Returns:
        The new layer.

    Example::

        >>> plain = rebuild_batch_norm(multi_node_bn, torch.nn.BatchNorm2d)
    """
    new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, **kwargs)
    ref = module.weight if module.affine else (module.running_mean if module.track_running_stats else None)
    if ref is not None:
        new = new.to(device=ref.device, dtype=ref.dtype)
    new.load_state_dict(module.state_dict())
    if module.affine:
        new.weight.requires_grad_(module.weight.requires_grad)
        new.bias.requires_grad_(module.bias.requires_grad)
    return new.train(module.training)
