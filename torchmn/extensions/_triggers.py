"""Triggers that fire at the same iteration on every rank."""
from __future__ import annotations

from typing import Any

from pytorch_pfn_extras.training import trigger as trigger_module
from pytorch_pfn_extras.training.triggers import IntervalTrigger, ManualScheduleTrigger

# Triggers that depend on the iteration and epoch alone, which every rank shares.
_SAME_ON_EVERY_RANK = (IntervalTrigger, ManualScheduleTrigger)


class AgreedTrigger(trigger_module.Trigger):
    """``trigger`` as rank 0 decides it, on every rank (one small broadcast per call).

    A trigger that reads the clock (``TimeTrigger``: each rank's hour starts at its own first
    iteration) or a rank's own values fires at different iterations on different ranks; an
    extension that takes part in collectives (a sharded optimizer's state_dict, an allgather)
    would then wait for ranks that never come, and per-rank snapshots would share no iteration.
    Every rank still evaluates its own copy, so that the trigger's state advances alike.
    """

    def __init__(self, trigger: Any, comm):
        self.trigger, self.comm = trigger, comm

    def __call__(self, manager) -> bool:
        return bool(self.comm.bcast_obj(bool(self.trigger(manager)), root=0))

    def may_fire(self, iteration: int, epoch_len: int) -> bool:
        return self.trigger.may_fire(iteration, epoch_len)

    def state_dict(self) -> dict:
        return self.trigger.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.trigger.load_state_dict(state)

    @property
    def finished(self) -> bool:
        return getattr(self.trigger, "finished", False)


def agreed(trigger: Any, comm) -> Any:
    """``trigger`` (anything ppe's ``get_trigger`` takes) as one that fires alike on every rank:
    itself where it depends on the iteration alone, else an :class:`AgreedTrigger`."""
    trigger = trigger_module.get_trigger(trigger)
    if comm.size == 1 or isinstance(trigger, (_SAME_ON_EVERY_RANK + (AgreedTrigger,))):
        return trigger
    return AgreedTrigger(trigger, comm)


def agree_on_own_trigger(extension: Any, manager, comm) -> None:
    """Make the trigger ``manager`` runs ``extension`` on fire alike on every rank (see
    :class:`AgreedTrigger`). Called from the extension's ``initialize``, once the manager holds it."""
    for entry in getattr(manager, "_extensions", {}).values():
        if entry.extension is extension:
            entry.trigger = agreed(entry.trigger, comm)
