"""``hvd.elastic``: Horovod's elastic names over :mod:`torchmn.elastic`.

A Horovod elastic script runs as it is under ``torchmn run -np 4 --min-np 2 --max-np 4
[--host-discovery-script S]`` (horovodrun's flags)::

    state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        ...                       # state.commit() every few batches

    train(state)

When a rank dies, the others go back to their last commit and go on without it; ``hvd.size()``
and ``hvd.rank()`` then describe the new world (the reset callbacks see it). Ranks the launcher
adds join at the next commit and receive the state from rank 0. Process sets other than the
global one are not carried into a new world.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torchmn.elastic.errors import HostsUpdatedInterrupt
from torchmn.elastic.reset import add_world_hook, run
from torchmn.elastic.state import State
from torchmn.horovod.errors import HorovodInternalError
from torchmn.horovod.process_sets import job, register_global


def _new_world() -> None:
    """At a reset: the global process set becomes the new world's (its communicator for the
    background thread is split off again, as ``hvd.init`` does)."""
    if job.comm is not None:
        register_global(job.comm)


add_world_hook(_new_world)


class TorchState(State):
    """Horovod's ``hvd.elastic.TorchState``: a model, an optimizer (``hvd.DistributedOptimizer`` or
    a torch one) and values, committed in memory and handed to new ranks; see
    :class:`torchmn.elastic.State`.

    Args:
        model: the ``torch.nn.Module``, or None.
        optimizer: the optimizer, or None.
        **kwargs: values, each an attribute (``state.epoch``).

    Example::

        >>> state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any):
        super().__init__(model=model, optimizer=optimizer, **kwargs)


class ObjectState(State):
    """Horovod's ``hvd.elastic.ObjectState``: values alone, committed and handed on as
    :class:`torchmn.elastic.State` does (the broadcast and the rank come from the communicator,
    so ``bcast_object`` and ``get_rank`` are accepted and not needed).

    Args:
        bcast_object: Horovod's broadcast function (unused).
        get_rank: Horovod's rank function (unused).
        **kwargs: the values.

    Example::

        >>> state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0)
    """

    def __init__(self, bcast_object: Optional[Callable] = None, get_rank: Optional[Callable] = None, **kwargs: Any):
        super().__init__(**kwargs)


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "TorchState", "run"]


def __getattr__(name: str):
    """Answer for Horovod's elastic names this module does not define, as Python asks for them.

    Args:
        name: the attribute asked for.

    Raises:
        AttributeError: always; for ``ElasticSampler``, naming torchmn's sampler to use instead.

    Example::

        >>> hvd.elastic.ElasticSampler
        Traceback (most recent call last):
        AttributeError: torchmn.horovod.elastic has no ElasticSampler: ...
    """
    if name == "ElasticSampler":
        raise AttributeError(
            "torchmn.horovod.elastic has no ElasticSampler: use torchmn.elastic.ElasticSampler(dataset, "
            "comm=hvd.global_process_set.comm, batch_size=...) as the DataLoader's batch_sampler, and put it in the state "
            "(TorchState(model, optimizer, sampler=sampler)); it keeps its place across resets without "
            "record_batch() (docs/elastic.md)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
