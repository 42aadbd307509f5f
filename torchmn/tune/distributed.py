"""One Optuna trial run jointly by all ranks of a job (:class:`DistributedTrial`), and a study whose
``optimize`` every rank calls (:class:`MultiNodeStudy`, ChainerMN's ``create_multi_node_study``).

Rank 0 talks to the study's storage; the other ranks follow through the communicator: each
suggestion and each pruning decision is rank 0's, broadcast. optuna-integration's
``TorchDistributedTrial`` does the same over ``torch.distributed``'s default group; this one goes
through a torchmn communicator (any of them, ``comm.split`` ones included), and the study adds what
that trial lacks: at the end of every trial the ranks exchange how it went, so an exception or a
prune on one rank ends the trial the same way on every rank, instead of leaving the others waiting
for a rank that left.

A rank whose objective raises while the others are still in one of the trial's collectives (a
suggestion's broadcast, say) reaches the end-of-trial exchange while they are in that collective:
torchmn's call check raises CollectiveMismatchError on every rank, which ends the others'
objectives too (a consequence, not a failure of their own) and sends the raising rank back into
the exchange, where all meet. This works where the objective's collectives go through the study's
communicator; on another one (a ``comm.split``, torch.distributed's own groups) the ranks still
wait for each other until the collectives time out.
"""
from __future__ import annotations

import socket
from typing import Callable, NamedTuple, Optional, Sequence

from torchmn.communicators import Communicator
from torchmn.communicators.errors import CollectiveMismatchError, RemoteRankError
from torchmn.errors import TorchmnRuntimeError, TorchmnValueError


class DistributedTrial:
    """An ``optuna.Trial`` shared by every rank: suggestions and pruning decisions are rank 0's.

    Every rank must make the same calls in the same order (they are collective).

    Args:
        trial: the trial on rank 0, None on the other ranks.
        comm: the communicator.

    Raises:
        ValueError: a trial is missing on rank 0, or given on another rank.

    Example::

        >>> def objective(trial):                      # a DistributedTrial on every rank
        ...     lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        ...     for epoch in range(10):
        ...         loss = train_one_epoch(lr)
        ...         trial.report(loss, epoch)
        ...         if trial.should_prune():
        ...             raise optuna.TrialPruned()
        ...     return loss
    """

    def __init__(self, trial, comm: Communicator):
        if (trial is None) != (comm.rank != 0):
            raise TorchmnValueError(
                f"rank {comm.rank}: DistributedTrial takes the trial on rank 0 and None on the others")
        self._trial, self.comm = trial, comm
        self.number = comm.bcast_obj(trial.number if trial is not None else None)

    def _from_rank0(self, method: str, *args, **kwargs):
        value = getattr(self._trial, method)(*args, **kwargs) if self.comm.rank == 0 else None
        return self.comm.bcast_obj(value)

    def suggest_float(self, name: str, low: float, high: float, *, step=None, log: bool = False) -> float:
        """Suggest a float on rank 0 and give it to every rank (collective).

        Args:
            name: the parameter's name in the study.
            low: the smallest value.
            high: the largest value.
            step: the spacing of the values (None: any value in the range).
            log: search on a log scale.

        Returns:
            Rank 0's ``optuna.Trial.suggest_float(name, low, high, step=step, log=log)``, the same
            on every rank (the other ranks' arguments are not used).

        Example::

            >>> lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        """
        return self._from_rank0("suggest_float", name, low, high, step=step, log=log)

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        """Suggest an integer on rank 0 and give it to every rank (collective).

        Args:
            name: the parameter's name in the study.
            low: the smallest value.
            high: the largest value (included).
            step: the spacing of the values.
            log: search on a log scale.

        Returns:
            Rank 0's ``optuna.Trial.suggest_int(name, low, high, step=step, log=log)``, the same on
            every rank (the other ranks' arguments are not used).

        Example::

            >>> layers = trial.suggest_int("layers", 1, 4)
        """
        return self._from_rank0("suggest_int", name, low, high, step=step, log=log)

    def suggest_categorical(self, name: str, choices: Sequence):
        """Suggest one of ``choices`` on rank 0 and give it to every rank (collective).

        Args:
            name: the parameter's name in the study.
            choices: the values to choose from (None, bools, numbers or strings, as Optuna takes).

        Returns:
            Rank 0's ``optuna.Trial.suggest_categorical(name, choices)``, the same on every rank.

        Example::

            >>> optimizer_name = trial.suggest_categorical("optimizer", ["sgd", "adam"])
        """
        return self._from_rank0("suggest_categorical", name, choices)

    def report(self, value: float, step: int) -> None:
        """Report an intermediate value to the pruner; only rank 0's call reaches the study.

        No communication: the other ranks' calls do nothing, so the value rank 0 reports is the
        one the pruner judges (report one that stands for every rank, their average say).

        Args:
            value: the objective's value so far (a validation loss, say).
            step: the step it was reached at (an epoch).

        Example::

            >>> trial.report(val_loss, epoch)
        """
        if self.comm.rank == 0:
            self._trial.report(value, step)

    def should_prune(self) -> bool:
        """Whether to stop the trial now: rank 0's pruner decides, every rank learns it (collective).

        Returns:
            Rank 0's ``optuna.Trial.should_prune()``, the same on every rank.

        Example::

            >>> if trial.should_prune():
            ...     raise optuna.TrialPruned()
        """
        return bool(self._from_rank0("should_prune"))

    def set_user_attr(self, key: str, value) -> None:
        """Set a user attribute of the trial; only rank 0's call reaches the study.

        No communication: the other ranks' calls do nothing.

        Args:
            key: the attribute's name.
            value: its value (JSON-serialisable, as Optuna's storages need).

        Example::

            >>> trial.set_user_attr("batch_size", 64)
        """
        if self.comm.rank == 0:
            self._trial.set_user_attr(key, value)

    def suggest_uniform(self, name: str, low: float, high: float) -> float:
        """Optuna's deprecated ``suggest_uniform``, rank 0's, given to every rank (collective).

        Args:
            name: the parameter's name in the study.
            low: the smallest value.
            high: the largest value.

        Returns:
            Rank 0's ``optuna.Trial.suggest_uniform(name, low, high)`` (``suggest_float(name, low,
            high)``), the same on every rank.

        Example::

            >>> dropout = trial.suggest_uniform("dropout", 0.0, 0.5)
        """
        return self._from_rank0("suggest_uniform", name, low, high)

    def suggest_loguniform(self, name: str, low: float, high: float) -> float:
        """Optuna's deprecated ``suggest_loguniform``, rank 0's, given to every rank (collective).

        Args:
            name: the parameter's name in the study.
            low: the smallest value (above 0).
            high: the largest value.

        Returns:
            Rank 0's ``optuna.Trial.suggest_loguniform(name, low, high)`` (``suggest_float(name,
            low, high, log=True)``), the same on every rank.

        Example::

            >>> lr = trial.suggest_loguniform("lr", 1e-5, 1e-1)
        """
        return self._from_rank0("suggest_loguniform", name, low, high)

    def suggest_discrete_uniform(self, name: str, low: float, high: float, q: float) -> float:
        """Optuna's deprecated ``suggest_discrete_uniform``, rank 0's, given to every rank (collective).

        Args:
            name: the parameter's name in the study.
            low: the smallest value.
            high: the largest value.
            q: the spacing of the values.

        Returns:
            Rank 0's ``optuna.Trial.suggest_discrete_uniform(name, low, high, q)``
            (``suggest_float(name, low, high, step=q)``), the same on every rank.

        Example::

            >>> momentum = trial.suggest_discrete_uniform("momentum", 0.8, 0.99, 0.01)
        """
        return self._from_rank0("suggest_discrete_uniform", name, low, high, q)

    @property
    def params(self) -> dict:
        """The parameters suggested so far (collective)."""
        return self.comm.bcast_obj(dict(self._trial.params) if self.comm.rank == 0 else None)

    @property
    def distributions(self) -> dict:
        """Each suggested parameter's ``optuna.distributions`` object, rank 0's (collective)."""
        return self.comm.bcast_obj(dict(self._trial.distributions) if self.comm.rank == 0 else None)

    @property
    def user_attrs(self) -> dict:
        """The trial's user attributes, rank 0's: those :meth:`set_user_attr` set (collective)."""
        return self.comm.bcast_obj(dict(self._trial.user_attrs) if self.comm.rank == 0 else None)

    @property
    def datetime_start(self):
        """When rank 0's study started the trial, a ``datetime.datetime`` (collective)."""
        return self.comm.bcast_obj(self._trial.datetime_start if self.comm.rank == 0 else None)

    @property
    def relative_params(self) -> dict:
        """The parameters rank 0's sampler chose for the whole trial at its start (collective)."""
        return self.comm.bcast_obj(dict(self._trial.relative_params) if self.comm.rank == 0 else None)


# How often a rank whose objective raised tries to meet the others at the end of the trial.
_EXCHANGE_TRIES = 16


class _Outcome(NamedTuple):
    """How the objective ended on one rank, as the ranks exchange it at the end of a trial."""

    state: str  # "complete", "pruned" or "failed"
    error: str = ""  # the exception, where failed
    caught: bool = False  # it is one of optimize's catch types
    knock_on: bool = False  # a collective failed because another rank was elsewhere


class MultiNodeStudy:
    """An ``optuna.Study`` whose ``optimize`` every rank calls, each trial run by all ranks together.

    Args:
        study: the study on rank 0 (the other ranks may pass theirs, loaded from the same storage,
            or None).
        comm: the communicator.

    Raises:
        ValueError: ``study`` is None on rank 0.

    Example::

        >>> study = optuna.create_study(storage=url, study_name="mnist", load_if_exists=True) \\
        ...     if comm.rank == 0 else None
        >>> torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=20)
    """

    def __init__(self, study, comm: Communicator):
        if comm.rank == 0 and study is None:
            raise TorchmnValueError("MultiNodeStudy needs the study on rank 0")
        self.study, self.comm = study, comm

    def optimize(self, objective: Callable, n_trials: int, catch: tuple = ()) -> None:
        """Run ``n_trials`` trials, each by every rank: ``objective(DistributedTrial)``.

        A trial fails where any rank's objective raised, and is pruned where any rank's raised
        ``optuna.TrialPruned`` (and none failed); every rank learns which, and its study (rank 0's,
        and any other rank's loaded from the same storage) holds the same states. A rank may raise
        while the others are still in one of the trial's collectives: theirs then fails with
        CollectiveMismatchError, which counts as a consequence of that rank's error, not a failure
        of its own. As in ``optuna.Study.optimize``, rank 0's return value is judged by Optuna: a
        number (or one per objective of a multi-objective study) completes the trial, anything else
        (None, NaN) fails it with Optuna's warning and the study goes on.

        Args:
            objective: called with a :class:`DistributedTrial` on every rank; returns the value
                (rank 0's is stored).
            n_trials: the trials to run.
            catch: exception types that fail a trial without stopping the study.

        Raises:
            Exception: the first rank's exception that ``catch`` does not cover, on that rank; on the
                others a RuntimeError naming it (after the trial is marked failed). Where rank 0's
                study cannot store the trial, that error on rank 0 and a RuntimeError naming it on
                the others.

        Example::

            >>> torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=20, catch=(ValueError,))
        """
        import optuna

        for _ in range(n_trials):
            trial = self.study.ask() if self.comm.rank == 0 else None
            shared = DistributedTrial(trial, self.comm)
            value, error = None, None
            try:
                # Only rank 0's value is stored: it stays here, it does not travel.
                value, mine = objective(shared), _Outcome("complete")
            except optuna.TrialPruned:
                mine = _Outcome("pruned")
            except Exception as e:  # every kind: the other ranks must hear of it
                error = e
                mine = _Outcome("failed", f"{type(e).__name__}: {e}", isinstance(e, catch),
                                isinstance(e, (CollectiveMismatchError, RemoteRankError)))
            outcomes = self._exchange_outcomes(mine)
            failed = [(r, o) for r, o in enumerate(outcomes) if o.state == "failed"]
            # A collective that failed because another rank left the objective (or rejected its own
            # arguments) is that rank's failure; only where no rank has another error is it the cause.
            causes = [(r, o) for r, o in failed if not o.knock_on] or failed
            stored = self._store(trial, causes, any(o.state == "pruned" for o in outcomes), value)
            if stored is not None:
                if self.comm.rank == 0:
                    raise stored[0]
                raise TorchmnRuntimeError(
                    f"rank {self.comm.rank} on {socket.gethostname()}: rank 0 could not store trial "
                    f"{shared.number} in its study ({stored[1]}); the study stops on every rank")
            uncaught = [(r, o) for r, o in causes if not o.caught]
            if uncaught:
                if self.comm.rank in [r for r, _ in uncaught]:
                    raise error
                r, o = uncaught[0]
                raise TorchmnRuntimeError(
                    f"rank {self.comm.rank} on {socket.gethostname()}: trial {shared.number} failed on "
                    f"rank {r} ({o.error}); the study stops on every rank (pass catch=... to go on)") from error

    def _exchange_outcomes(self, mine: "_Outcome") -> list:
        """Every rank's outcome of the trial, in rank order (collective).

        A rank whose objective raised while the others were still in one of the trial's collectives
        meets them here in another collective: the call check raises CollectiveMismatchError on
        every rank, ending the others' objectives, and this rank calls the exchange again, until
        every rank is in it.
        """
        # Each retry meets the others one collective later; an objective that catches the error
        # and calls collectives again and again would keep them apart: give up then.
        for _ in range(_EXCHANGE_TRIES - 1):
            try:
                return self.comm.allgather_obj(mine)
            except CollectiveMismatchError:
                continue
        return self.comm.allgather_obj(mine)

    def _store(self, trial, causes: list, pruned: bool, value) -> Optional[tuple]:
        """Tell rank 0's study how the trial ended; every rank learns whether it could (collective).

        Returns:
            None where rank 0 stored the trial (every rank reads its state afterwards), else
            ``(rank 0's exception or None, its text)``.
        """
        from optuna.trial import TrialState

        failure = None
        if self.comm.rank == 0:
            try:
                if causes:
                    r, o = causes[0]
                    trial.set_user_attr("error", f"rank {r}: {o.error}")
                    self.study.tell(trial, state=TrialState.FAIL)
                elif pruned:
                    self.study.tell(trial, state=TrialState.PRUNED)
                else:
                    # Optuna judges the value, as its own optimize does: a number, or one per
                    # objective, completes the trial; None or NaN fails it, with a warning.
                    self.study.tell(trial, value)
            except Exception as e:  # a storage's error: every rank must hear of it, not wait
                failure = e
        # Also the barrier: the state is stored before any rank reads it.
        text = self.comm.bcast_obj(f"{type(failure).__name__}: {failure}" if failure is not None else None)
        return None if text is None else (failure, text)

    @property
    def trials(self) -> Optional[list]:
        """This rank's study's trials (None on a rank that passed no study)."""
        return self.study.trials if self.study is not None else None
