"""A reported value, aggregated over ranks."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from pytorch_pfn_extras import reporting
from pytorch_pfn_extras.training import extension
from pytorch_pfn_extras.training import trigger as trigger_module

from torchmn.extensions._values import to_float


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class ObservationAggregator(extension.Extension):
    """Report ``aggregated_key``: the value observed under ``original_key``, aggregated over ranks.

    Runs every iteration (its default ``trigger``) to collect this rank's observations of
    ``original_key``; whenever ``trigger`` fires it reduces them to this rank's mean over the
    interval, gathers every rank's mean and reports ``aggregator(list_of_rank_means)`` (by default
    their mean) under ``aggregated_key`` (``original_key`` when ``None``, i.e. replaced in place).
    Ranks that observed nothing in the interval are left out; when none did, nothing is
    reported. Its priority is ``PRIORITY_EDITOR``: after evaluators report, before ``LogReport``
    reads. Every rank must register it with the same triggers.

    Example::

        >>> manager.extend(torchmn.extensions.ObservationAggregator(
        ...     comm, "train/loss", "train/loss/global", trigger=(1, "epoch")))
    """

    trigger = 1, "iteration"
    priority = extension.PRIORITY_EDITOR

    def __init__(self, comm, original_key: str, aggregated_key: Optional[str] = None,
                 trigger: Any = (1, "epoch"),
                 aggregator: Callable[[Sequence[float]], Any] = mean):
        self.comm = comm
        self.original_key = original_key
        self.aggregated_key = original_key if aggregated_key is None else aggregated_key
        self.comm_trigger = trigger_module.get_trigger(trigger)
        self.aggregator = aggregator
        self._values: list[float] = []

    def __call__(self, manager) -> None:
        observation = manager.observation
        if self.original_key in observation:
            self._values.append(to_float(observation[self.original_key], self.original_key))
        if not self.comm_trigger(manager):
            return
        local = mean(self._values) if self._values else None
        self._values = []
        present = [v for v in self.comm.allgather_obj(local) if v is not None]
        if present:
            reporting.report({self.aggregated_key: self.aggregator(present)})
