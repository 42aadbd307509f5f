"""The optimizers that update a rank's shards: which torch optimizers can be split, building one
over flat shards (with torch's fused kernel where it applies), and stepping it cheaply."""
from __future__ import annotations

import functools
import inspect

import torch

from torchmn.errors import TorchmnTypeError
from torchmn.optimizers import fused_adam

# Optimizers whose update is elementwise, so a flat slice of the parameters can be stepped alone.
# Others (LBFGS, Adafactor's factored moments, Muon's orthogonalisation, SparseAdam, subclasses
# that may add cross-element math) are refused with a clear error.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.ASGD, torch.optim.Rprop,
)


def check_optimizer(optimizer) -> None:
    """Refuse an optimizer whose update cannot be split into flat shards.

    Args:
        optimizer: the optimizer ``shard_state=True`` would wrap.

    Raises:
        TypeError: LBFGS, or any optimizer not in :data:`ELEMENTWISE_OPTIMIZERS` (a subclass of
            one of them included: it may add cross-element math).

    Example::

        >>> check_optimizer(torch.optim.Adam(model.parameters()))      # elementwise: accepted
        >>> check_optimizer(torch.optim.LBFGS(model.parameters()))
        Traceback (most recent call last):
        torchmn.errors.TorchmnTypeError: shard_state=True cannot wrap LBFGS: ...
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TorchmnTypeError("shard_state=True cannot wrap LBFGS: its update needs whole parameters and a "
                               "closure, not a shard; use shard_state=False")
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise TorchmnTypeError(f"shard_state=True only wraps elementwise optimizers ({names}), not "
                               f"{type(optimizer).__name__}: its update may need whole tensors; use shard_state=False")


# Not hyperparameters but the choice of kernel; the shard optimizers keep their own (build_inner).
IMPLEMENTATION_FLAGS = ("fused", "foreach")

# The optimizers whose fused kernel the shards take when the user left the choice to torch. Not
# SGD: its fused kernel cannot step momentum buffers that exist for some parameters and not yet for
# others (a parameter whose first gradient comes late, a checkpoint from such a run), which torch's
# default SGD does; and SGD's update is one pass over memory anyway.
AUTO_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def build_inner(cls: type, shard_params: list[torch.nn.Parameter], group: dict) -> torch.optim.Optimizer:
    """An optimizer of ``cls`` over some shard parameters of one group, with its hyperparameters
    (the caller decides which shards share one: see the sharded optimizer's constructor).

    A shard parameter is one flat tensor, which is what torch's fused kernels are for (Adam's update
    in one pass over memory instead of several). So where the user left the kernel to torch
    (``fused`` and ``foreach`` unset) and ``cls`` is one of :data:`AUTO_FUSED`, with a fused kernel
    for the shards' device and dtype, the shards use it; the arithmetic is the same up to rounding.

    Args:
        cls: the wrapped optimizer's class.
        shard_params: the flat shard parameters it updates.
        group: the wrapped optimizer's parameter group, for the hyperparameters.

    Returns:
        The shard optimizer.

    Example::

        >>> inner = build_inner(torch.optim.Adam, bucket.shard_params, optimizer.param_groups[0])
    """
    hyper = {k: v for k, v in group.items() if k != "params"}
    accepted = inspect.signature(cls.__init__).parameters
    # Constructor arguments validate (and set flags like fused); the group dict then carries them all.
    ctor = {k: v for k, v in hyper.items() if k in accepted}
    # torch checks a fused kernel's device and dtype only at the first step(), so choose it only
    # where every optimizer that has one supports it: CPU, float32/float64.
    if cls in AUTO_FUSED and hyper.get("fused") is None and hyper.get("foreach") is None \
            and not hyper.get("differentiable") and shard_params[0].device.type == "cpu" \
            and shard_params[0].dtype in (torch.float32, torch.float64):
        try:
            return cls([{**hyper, "fused": True, "params": shard_params}], **{**ctor, "fused": True})
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # an option that rules the fused kernel out (its constructor says so)
    return cls([{**hyper, "params": shard_params}], **ctor)


def step_function(optimizer: torch.optim.Optimizer):
    """A function that steps one of the shard optimizers, as cheaply as torch allows.

    Each runs once per training step, between backward and forward, when the interpreter runs
    cold and Python around the update costs a good part of what the update itself does. The
    shard optimizers are private (no hooks, no closure, one group of flat shards), so they can
    skip the wrapper torch puts around every step (step hooks, a profiler range) and, for fused
    Adam and AdamW, everything around torch's fused kernel.

    Args:
        optimizer: a shard optimizer from :func:`build_inner`.

    Returns:
        A function of no arguments that makes one step.

    Example::

        >>> step = step_function(inner); step()
    """
    step = type(optimizer).step
    if getattr(step, "hooked", False) and callable(getattr(step, "__wrapped__", None)):
        step = functools.partial(step.__wrapped__, optimizer)
    else:
        step = optimizer.step
    return fused_adam.direct_step(optimizer, step) or step
