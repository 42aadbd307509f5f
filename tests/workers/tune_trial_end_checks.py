"""How MultiNodeStudy ends a trial, run on every rank of a real job (see tests/test_tune.py): a rank
that raises while the others are in one of the trial's collectives, objectives that return None or
one value per objective, and the ``optuna.Trial`` methods a DistributedTrial shares.

Each check makes its own in-memory study on rank 0 (the other ranks pass None).

Usage: python tune_trial_end_checks.py CHECK [CHECK ...]
"""
import warnings

import optuna
from check_runner import expect, run_checks

import torchmn

optuna.logging.set_verbosity(optuna.logging.ERROR)


def states(study):
    return [t.state.name for t in study.trials]


def check_caught_failure_while_others_are_in_a_collective(comm):
    """Trial 0 raises on rank 1 before its first suggestion, while rank 0 is in that suggestion's
    broadcast; trial 1 raises on rank 0 between two pruning decisions, while rank 1 is in the
    second; both are caught: the trials fail with the raising rank's error, and the next trial
    runs on every rank with the same suggestions."""
    study = optuna.create_study() if comm.rank == 0 else None
    seen = []

    def objective(trial):
        if trial.number == 0 and comm.rank == 1:
            raise ValueError("rank 1 could not load its shard")
        x = trial.suggest_float("x", 0.0, 1.0)
        trial.report(x, 0)
        trial.should_prune()
        if trial.number == 1 and comm.rank == 0:
            raise ValueError("rank 0 ran out of data")
        trial.should_prune()
        seen.append((trial.number, x))
        return x

    torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=4, catch=(ValueError,))
    everyone = comm.allgather_obj(seen)
    assert all(s == everyone[0] for s in everyone), everyone  # the same trials, the same values
    if comm.rank == 0:
        assert states(study) == ["FAIL", "FAIL", "COMPLETE", "COMPLETE"], states(study)
        assert study.trials[0].user_attrs["error"] == "rank 1: ValueError: rank 1 could not load its shard", \
            study.trials[0].user_attrs
        assert study.trials[1].user_attrs["error"] == "rank 0: ValueError: rank 0 ran out of data", \
            study.trials[1].user_attrs
        assert [n for n, _ in seen] == [2, 3] and study.trials[2].value == seen[0][1], seen


def check_uncaught_failure_while_others_are_in_a_collective(comm):
    """Rank 1 raises an exception the study does not catch before its first suggestion, while rank
    0 is in its broadcast: rank 1 gets its own exception, rank 0 a RuntimeError naming it, the trial
    is failed, and the communicator still works."""
    study = optuna.create_study() if comm.rank == 0 else None

    def objective(trial):
        if comm.rank == 1:
            raise KeyError("missing")
        return trial.suggest_float("x", 0.0, 1.0)

    run = torchmn.tune.MultiNodeStudy(study, comm).optimize
    if comm.rank == 1:
        expect(KeyError, lambda: run(objective, n_trials=2, catch=(ValueError,)))
    else:
        e = expect(RuntimeError, lambda: run(objective, n_trials=2, catch=(ValueError,)))
        assert "trial 0 failed on rank 1 (KeyError: 'missing')" in str(e), e
    if comm.rank == 0:
        assert states(study) == ["FAIL"], states(study)
    assert comm.allgather_obj(comm.rank) == list(range(comm.size))


def check_none_value_fails_the_trial_and_the_study_goes_on(comm):
    """As in optuna's optimize: None, or NaN, fails the trial (with Optuna's warning) and the
    study goes on, on every rank."""
    study = optuna.create_study() if comm.rank == 0 else None
    returned = [None, float("nan"), 0.25]

    def objective(trial):
        trial.suggest_float("x", 0.0, 1.0)
        return returned[trial.number]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's "could not be cast to float"
        torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=3)
    if comm.rank == 0:
        assert states(study) == ["FAIL", "FAIL", "COMPLETE"] and study.trials[2].value == 0.25, study.trials


def check_multi_objective_values_complete_the_trial(comm):
    """A study of two objectives: the objective returns both, rank 0's are stored."""
    study = optuna.create_study(directions=["minimize", "maximize"]) if comm.rank == 0 else None

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        return x, 1.0 - x

    torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=2)
    if comm.rank == 0:
        assert states(study) == ["COMPLETE", "COMPLETE"], study.trials
        assert all(t.values == [t.params["x"], 1.0 - t.params["x"]] for t in study.trials), study.trials


def check_optuna_trial_methods_are_shared(comm):
    """The ``optuna.Trial`` methods Optuna still has besides suggest_float/int/categorical give rank
    0's answer on every rank: the deprecated suggest_uniform, suggest_loguniform and
    suggest_discrete_uniform, and user_attrs, distributions, datetime_start, relative_params."""
    study = optuna.create_study() if comm.rank == 0 else None
    got = []

    def objective(trial):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # Optuna deprecates the three
            values = (trial.suggest_uniform("u", 0.0, 1.0), trial.suggest_loguniform("lr", 1e-5, 1e-1),
                      trial.suggest_discrete_uniform("q", 0.0, 1.0, 0.25))
        trial.set_user_attr("batch", 64)
        got.append((values, trial.user_attrs, sorted(trial.distributions), trial.datetime_start,
                    trial.relative_params))
        return values[1]

    torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=1)
    everyone = comm.allgather_obj(got)
    assert all(g == everyone[0] for g in everyone), everyone
    (values, attrs, names, start, relative), = got
    assert attrs == {"batch": 64} and names == ["lr", "q", "u"] and relative == {}, got
    assert 1e-5 <= values[1] <= 1e-1 and values[2] in (0.0, 0.25, 0.5, 0.75, 1.0), values
    if comm.rank == 0:
        (t,) = study.trials
        assert t.params == {"u": values[0], "lr": values[1], "q": values[2]} and t.datetime_start == start, t


if __name__ == "__main__":
    run_checks(globals())
