"""One Optuna trial run jointly by all ranks of a job (:class:`DistributedTrial`), and a study whose
``optimize`` every rank calls (:class:`MultiNodeStudy`, ChainerMN's ``create_multi_node_study``).

Rank 0 talks to the study's storage; the other ranks follow through the communicator: each
suggestion and each pruning decision is rank 0's, broadcast. optuna-integration's
``TorchDistributedTrial`` does the same over ``torch.distributed``'s default group; this one goes
through a torchmn communicator (any of them, ``comm.split`` ones included), and the study adds what
that trial lacks: at the end of every trial the ranks exchange how it went, so an exception or a
prune on one rank ends the trial the same way on every rank, instead of leaving the others waiting
for a rank that left.
"""
from __future__ import annotations

import socket
from typing import Callable, Optional, Sequence

from torchmn.communicators import Communicator
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

    @property
    def params(self) -> dict:
        """The parameters suggested so far (collective)."""
        return self.comm.bcast_obj(dict(self._trial.params) if self.comm.rank == 0 else None)


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
        and any other rank's loaded from the same storage) holds the same states.

        Args:
            objective: called with a :class:`DistributedTrial` on every rank; returns the value
                (rank 0's is stored).
            n_trials: the trials to run.
            catch: exception types that fail a trial without stopping the study.

        Raises:
            Exception: the first rank's exception that ``catch`` does not cover, on that rank; on the
                others a RuntimeError naming it (after the trial is marked failed).

        Example::

            >>> torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=20, catch=(ValueError,))
        """
        import optuna
        from optuna.trial import TrialState

        for _ in range(n_trials):
            trial = self.study.ask() if self.comm.rank == 0 else None
            shared = DistributedTrial(trial, self.comm)
            mine, error = ("complete", None, ""), None
            try:
                mine = ("complete", objective(shared), "")
            except optuna.TrialPruned:
                mine = ("pruned", None, "")
            except Exception as e:  # every kind: the other ranks must hear of it
                error = e
                mine = ("failed", None, f"{type(e).__name__}: {e}", isinstance(e, catch))
            outcomes = self.comm.allgather_obj(mine)
            failed = [(r, o) for r, o in enumerate(outcomes) if o[0] == "failed"]
            if self.comm.rank == 0:
                if failed:
                    r, o = failed[0]
                    trial.set_user_attr("error", f"rank {r}: {o[2]}")
                    self.study.tell(trial, state=TrialState.FAIL)
                elif any(o[0] == "pruned" for o in outcomes):
                    self.study.tell(trial, state=TrialState.PRUNED)
                else:
                    self.study.tell(trial, float(outcomes[0][1]))
            self.comm.barrier()  # the state is stored before any rank reads it
            uncaught = [(r, o) for r, o in failed if not o[3]]
            if uncaught:
                if error is not None and not isinstance(error, catch):
                    raise error
                r, o = uncaught[0]
                raise TorchmnRuntimeError(
                    f"rank {self.comm.rank} on {socket.gethostname()}: trial {shared.number} failed on "
                    f"rank {r} ({o[2]}); the study stops on every rank (pass catch=... to go on)")

    @property
    def trials(self) -> Optional[list]:
        """This rank's study's trials (None on a rank that passed no study)."""
        return self.study.trials if self.study is not None else None
