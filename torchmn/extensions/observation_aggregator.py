"""A reported value, aggregated over ranks."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from pytorch_pfn_extras import reporting
from pytorch_pfn_extras.training import extension
from pytorch_pfn_extras.training import trigger as trigger_module
from pytorch_pfn_extras.training.triggers import IntervalTrigger

from torchmn.errors import TorchmnValueError
from torchmn.extensions._triggers import agreed
from torchmn.extensions._values import to_float


def mean(observations: Sequence[Sequence[float]]) -> float:
    """The mean of every rank's observations: :class:`ObservationAggregator`'s default ``aggregator``
    (ChainerMN's ``_average_2d``).

    Args:
        observations: one list per rank, of that rank's observations in the interval (some may
            be empty; never all: when no rank observed the key, nothing is aggregated).

    Returns:
        The sum of all observations over their count: each observation weighs alike, whichever
        rank made it.

    Example::

        >>> torchmn.extensions.observation_aggregator.mean([[1.0, 2.0, 3.0], [10.0]])
        4.0
    """
    flat = [v for rank in observations for v in rank]
    return sum(flat) / len(flat)


class ObservationAggregator(extension.Extension):
    """Report ``aggregated_key``: the value observed under ``original_key``, aggregated over ranks.

    ChainerMN's extension, with its signature and its arithmetic. It runs every iteration to
    collect this rank's observations of ``original_key``; whenever ``comm_trigger`` fires (by
    default every iteration) it gathers every rank's list of observations over the interval and
    reports ``aggregator(list_of_lists)`` (by default the mean of all observations) under
    ``aggregated_key``, which defaults to ``original_key`` (the local value is replaced in place).
    When no rank observed the key in the interval, nothing is reported.
    Its priority is ``PRIORITY_EDITOR``: after evaluators report, before ``LogReport`` reads.
    Every rank must register it with the same triggers.

    Replacing in place needs ``comm_trigger`` to fire every iteration: otherwise ``LogReport``
    would average the global value of one iteration with local values of the others, so that
    combination is refused. With a coarser ``comm_trigger`` (one allgather per epoch instead of
    per iteration), report under a new key.

    Args:
        comm: the communicator whose ranks report ``original_key``.
        original_key: the observation key to aggregate.
        aggregated_key: the key to report the aggregate under; ``None`` for ``original_key``.
        comm_trigger: when to aggregate (ppe's trigger forms), by default every iteration.
        aggregator: turns the ranks' lists of observations (one list per rank, in rank order)
            into the reported value; ``None`` for :func:`mean`.

    Raises:
        ValueError: ``aggregated_key`` is ``original_key`` (or ``None``) and ``comm_trigger``
            does not fire every iteration.

    Example::

        >>> manager.extend(torchmn.extensions.ObservationAggregator(comm, "main/loss"))
        >>> manager.extend(torchmn.extensions.ObservationAggregator(
        ...     comm, "main/loss", "main/loss/global", comm_trigger=(1, "epoch")))
    """

    trigger = 1, "iteration"
    priority = extension.PRIORITY_EDITOR

    def __init__(self, comm, original_key: str, aggregated_key: Optional[str] = None, *,
                 comm_trigger: Any = (1, "iteration"),
                 aggregator: Optional[Callable[[Sequence[Sequence[float]]], Any]] = None):
        self.comm = comm
        self.original_key = original_key
        self.aggregated_key = original_key if aggregated_key is None else aggregated_key
        self.comm_trigger = trigger_module.get_trigger(comm_trigger)
        every_iteration = isinstance(self.comm_trigger, IntervalTrigger) \
            and (self.comm_trigger.period, self.comm_trigger.unit) == (1, "iteration")
        if self.aggregated_key == original_key and not every_iteration:
            raise TorchmnValueError(
                f"ObservationAggregator: replacing {original_key!r} in place needs comm_trigger=(1, 'iteration'), "
                f"not {comm_trigger!r}: LogReport would mix one iteration's global value with the other "
                f"iterations' local ones. Pass a new aggregated_key, e.g. "
                f"ObservationAggregator(comm, {original_key!r}, {original_key + '/global'!r}, "
                f"comm_trigger={comm_trigger!r})")
        self.aggregator = mean if aggregator is None else aggregator
        self._values: list[float] = []

    def initialize(self, manager) -> None:
        """Make ``comm_trigger`` fire at the same iterations on every rank.

        A trigger that is not a function of the iteration alone (ppe's ``TimeTrigger``) then fires
        as rank 0 decides, broadcast at each of its calls; one of the iteration alone is kept as it
        is. No communication here.

        Args:
            manager: the ``ExtensionsManager`` running this extension.

        Example::

            >>> manager.extend(agg)       # the manager calls agg.initialize(manager) as training starts
        """
        self.comm_trigger = agreed(self.comm_trigger, self.comm)  # fires alike on every rank: see agreed()

    def state_dict(self) -> dict:
        """This rank's observations of the open interval, and ``comm_trigger``'s state.

        Returns:
            A dict for :meth:`load_state_dict`.

        Example::

            >>> agg.state_dict()
            {'values': [0.52, 0.49], 'comm_trigger': {}}
        """
        # This rank's observations of an interval still open, so that a resumed run reports the
        # same value for it as an uninterrupted one.
        return {"values": list(self._values), "comm_trigger": self.comm_trigger.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: a dict :meth:`state_dict` returned.

        Example::

            >>> agg.load_state_dict(agg.state_dict())
        """
        self._values = list(state.get("values", []))
        if "comm_trigger" in state:
            self.comm_trigger.load_state_dict(state["comm_trigger"])

    def __call__(self, manager) -> None:
        """Collect this iteration's observation; when ``comm_trigger`` fires, report the aggregate.

        Collective when ``comm_trigger`` fires: every rank's observations over the interval are
        gathered (one ``allgather_obj``), and ``aggregator`` of them is reported under
        ``aggregated_key`` where any rank observed the key.

        Args:
            manager: the ``ExtensionsManager`` running this extension.

        Example::

            >>> agg(manager)              # the manager does this every iteration
        """
        observation = manager.observation
        if self.original_key in observation:
            self._values.append(to_float(observation[self.original_key], self.original_key))
        if not self.comm_trigger(manager):
            return
        local, self._values = self._values, []
        every = self.comm.allgather_obj(local)
        if any(every):
            reporting.report({self.aggregated_key: self.aggregator(every)})
