"""Early stopping that every rank decides alike."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Optional

import torch
from pytorch_pfn_extras.training.triggers import EarlyStoppingTrigger

from torchmn.errors import TorchmnTypeError
from torchmn.extensions._triggers import agreed
from torchmn.extensions._values import to_float


class MultiNodeEarlyStoppingTrigger(EarlyStoppingTrigger):
    """pytorch-pfn-extras' ``EarlyStoppingTrigger``, judged on the value averaged over ranks.

    Within each ``check_trigger`` interval every rank accumulates its observations of
    ``monitor``; at the end of the interval the sums and counts are allreduced (float64), and the
    global mean is compared with the best so far. All ranks therefore see the same number and
    stop at the same iteration, even when each rank's own values would say otherwise. A rank that
    observed nothing contributes nothing; if no rank did, the interval is skipped with a warning.
    Every rank must use it with the same arguments; a ``check_trigger`` that may fire at different
    iterations on different ranks (a ``TimeTrigger``) fires where rank 0's does.
    ``mode``: ``"min"``, ``"max"`` or ``"auto"``
    (``"max"`` when ``monitor`` names an accuracy).

    The arguments are ChainerMN's (and ppe's), in their order and with their defaults.

    Args:
        comm: the communicator whose ranks train together.
        check_trigger: the interval at whose end the mean is compared.
        monitor: the observation key judged, e.g. ``"val/loss"``.
        patience: how many checks without improvement stop training.
        mode: ``"min"``, ``"max"`` or ``"auto"``, as above.
        verbose: print, on rank 0, the operator chosen and when training stops.
        max_trigger: stops training in any case: ``(period, unit)``, e.g. ``(100, "epoch")``, as
            ppe's (which also reports it as the training length).

    Raises:
        TypeError: ``monitor`` is not a str (arguments in another order than ChainerMN's), or
            ``max_trigger`` is not a ``(period, unit)`` pair.

    Example::

        >>> stop = torchmn.extensions.MultiNodeEarlyStoppingTrigger(comm, monitor="val/loss", patience=3)
        >>> manager = ppe.training.ExtensionsManager(model, opt, 100, iters_per_epoch=n,
        ...                                          stop_trigger=stop)
        >>> while not manager.stop_trigger:
        ...     ...
    """

    def __init__(self, comm, check_trigger: Any = (1, "epoch"), monitor: str = "main/loss", patience: int = 3,
                 mode: str = "auto", verbose: bool = False, max_trigger: Any = (100, "epoch")):
        if not isinstance(monitor, str):
            raise TorchmnTypeError(f"MultiNodeEarlyStoppingTrigger: monitor must be an observation key (a str), not "
                                   f"{monitor!r}; the arguments are ChainerMN's: (comm, check_trigger, monitor, "
                                   f"patience, mode, verbose, max_trigger)")
        if not (isinstance(max_trigger, (tuple, list)) and len(max_trigger) == 2):
            raise TorchmnTypeError(f"MultiNodeEarlyStoppingTrigger: max_trigger must be (period, unit), e.g. (100, "
                                   f"'epoch'), not {max_trigger!r}: it is also the training length the manager "
                                   f"reports, which only an interval has")
        # ppe's constructor prints its choice of operator when verbose: on rank 0 only.
        super().__init__(check_trigger=check_trigger, monitor=monitor, patience=patience, mode=mode,
                         verbose=verbose and comm.rank == 0, max_trigger=max_trigger)
        # A trigger that reads the clock or a rank's own values fires at different iterations on
        # different ranks; the check is an allreduce, so every rank follows rank 0's.
        self._interval_trigger = agreed(self._interval_trigger, comm)
        self.verbose = verbose
        self.comm = comm
        self._sum = 0.0
        self._count = 0
        self._checked: Optional[int] = None  # the iteration of the last check
        self._pending: Optional[dict] = None  # a check a snapshot was taken before (see state_dict)
        # The triggers' answers a snapshot asked for ahead of this iteration's check, which uses them:
        # a trigger with a state of its own (TimeTrigger) answers True once per firing.
        self._asked: Optional[dict] = None

    def __deepcopy__(self, memo: dict) -> "MultiNodeEarlyStoppingTrigger":
        """A copy with counters of its own that shares this trigger's communicator.

        Args:
            memo: ``copy.deepcopy``'s table of the objects copied so far.

        Returns:
            The copy: every attribute deep-copied but ``comm``, which is the same object.

        Example::

            >>> twin = copy.deepcopy(stop)        # ppe's manager does this with its stop trigger
            >>> twin.comm is stop.comm
            True
        """
        # The manager keeps a deep copy of its stop trigger; the copy must share the communicator
        # (process groups cannot be copied), while its counters stay its own.
        new = copy.copy(self)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name != "comm":
                setattr(new, name, copy.deepcopy(value, memo))
        return new

    def __call__(self, manager) -> bool:
        """Take this iteration's observation of ``monitor``; at the end of an interval, decide.

        The manager calls it every iteration, on every rank. When ``check_trigger`` fires, the
        ranks' sums and counts are allreduced and the global mean is compared with the best so far,
        so every rank gives the same answer. After a resume, the check the snapshot was taken ahead
        of (see :meth:`state_dict`) is made first.

        Args:
            manager: the ``ExtensionsManager`` whose stop trigger this is.

        Returns:
            True to stop training: ``max_trigger`` fired, or ``patience`` checks in a row did not
            improve on the best mean.

        Example::

            >>> while not stop(manager):          # what ppe's manager does with its stop_trigger
            ...     ...
        """
        pending, self._pending = self._pending, None
        self._checked = manager.iteration
        if pending is not None and pending["iteration"] != manager.iteration:
            # Resumed, and first called after the snapshot's iteration (ppe's manager keeps a second
            # copy of its stop trigger, called at the end of each iteration): that check first.
            # The snapshot's max_trigger decision holds only for a run of the same length: a run
            # resumed to train longer goes on (one resumed shorter stopped at its own length above).
            same_length = pending.get("length") == self._training_length()
            if self._check(pending["value"], lambda: pending["max"] and same_length, lambda: pending["interval"],
                           manager):
                return True
            pending = None
        if pending is not None:
            value = pending["value"]  # what the snapshot saw: the resumed manager has no observation yet
        else:
            observed = manager.observation.get(self.monitor)
            value = None if observed is None else to_float(observed, self.monitor)
        asked, self._asked = self._asked, None
        if asked is not None and asked["iteration"] == manager.iteration:
            return self._check(value, lambda: asked["max"], lambda: asked["interval"], manager)
        return self._check(value, lambda: self._max_trigger(manager), lambda: self._interval_trigger(manager),
                           manager)

    def _check(self, value: Optional[float], max_fires: Callable[[], bool], fires: Callable[[], bool],
               manager) -> bool:
        """Add this iteration's observation; at the end of an interval, compare the ranks' mean."""
        if value is not None:
            self._sum += value
            self._count += 1
        if max_fires():
            return True
        if not fires():
            return False
        total = self.comm.allreduce(torch.tensor([self._sum, float(self._count)], dtype=torch.float64))
        self._sum, self._count = 0.0, 0
        value_sum, count = float(total[0]), int(total[1])
        if count == 0:
            warnings.warn(f"{self.monitor} was not observed on any rank in this interval; "
                          f"early stopping skips it")
            return False
        current = value_sum / count
        if self._compare(current, self.best):
            self.best = current
            self.count = 0
        else:
            self.count += 1
        if self._stop_condition():
            if self.verbose and self.comm.rank == 0:
                print(f"Epoch {manager.epoch}: early stopping ({self.monitor} = {current})")
            return True
        return False

    def state_dict(self, manager=None) -> dict:
        """The best value, the patience used up, and this interval's observations so far.

        ``manager``: what :func:`~torchmn.extensions.multi_node_snapshot` passes. A snapshot is
        taken among an iteration's extensions, ahead of this trigger's check of that iteration;
        the state then also holds that check (the observation, whether the intervals end there),
        which the restored trigger makes first, so that a resumed run stops where an uninterrupted
        one would.

        Args:
            manager: the ``ExtensionsManager`` being snapshotted, or ``None`` for the trigger's
                own state alone.

        Returns:
            A dict for :meth:`load_state_dict`.

        Example::

            >>> state = stop.state_dict()
            >>> stop.load_state_dict(state)
        """
        state = {"best": self.best, "count": self.count, "sum": self._sum, "observed": self._count}
        if manager is not None and self._checked != manager.iteration:
            observed = manager.observation.get(self.monitor)
            state["pending"] = {"iteration": manager.iteration,
                                "value": None if observed is None else to_float(observed, self.monitor),
                                "max": bool(self._max_trigger(manager)),
                                "length": self._training_length(),
                                "interval": bool(self._interval_trigger(manager))}
            self._asked = {k: state["pending"][k] for k in ("iteration", "max", "interval")}
        return state

    def _training_length(self) -> Optional[list]:
        """``max_trigger``'s training length (ppe's triggers say it), as a snapshot stores it."""
        length = getattr(self._max_trigger, "get_training_length", None)
        return None if length is None else list(length())

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: a dict :meth:`state_dict` returned.

        Example::

            >>> state = stop.state_dict()       # saved with the run's snapshot
            >>> stop.load_state_dict(state)     # multi_node_snapshot's autoload does this on resume
        """
        self.best = state["best"]
        self.count = state["count"]
        self._sum = state.get("sum", 0.0)
        self._count = state.get("observed", 0)
        self._pending = state.get("pending")
