"""MultiNodeStudy checks, run on every rank of a real job (see tests/test_tune.py).

Usage: python tune_checks.py STORAGE_URL CHECK
"""
import sys

import optuna

import torchmn

optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_on_every_rank(comm, storage, name):
    study = optuna.create_study(storage=storage, study_name=name) if comm.rank == 0 else None
    comm.barrier()
    return study if comm.rank == 0 else optuna.load_study(storage=storage, study_name=name)


def check_states(comm, storage):
    """Trial 0 raises on rank 1 only (caught: the study goes on), trial 1 is pruned by rank 0 only,
    trial 2 completes: every rank's study holds FAIL, PRUNED, COMPLETE."""
    study = study_on_every_rank(comm, storage, "states")

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        if trial.number == 0 and comm.rank == 1:
            raise ValueError("bad batch on rank 1")
        trial.report(x, 0)
        if trial.number == 1 and comm.rank == 0:
            raise optuna.TrialPruned()
        return x

    torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=3, catch=(ValueError,))
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "PRUNED", "COMPLETE"], trials
    assert trials[0].user_attrs["error"] == "rank 1: ValueError: bad batch on rank 1", trials[0].user_attrs
    assert trials[2].value == trials[2].params["x"]


def check_uncaught(comm, storage):
    """An exception the study does not catch stops it on every rank: the raising rank gets its own,
    the others a RuntimeError naming it; the trial is marked failed."""
    study = study_on_every_rank(comm, storage, "uncaught")

    def objective(trial):
        trial.suggest_int("n", 1, 3)
        if comm.rank == 1:
            raise KeyError("missing")
        return 1.0

    try:
        torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=2)
        raise AssertionError("the study went on")
    except KeyError:
        assert comm.rank == 1
    except RuntimeError as e:
        assert comm.rank != 1 and "failed on rank 1 (KeyError: 'missing')" in str(e), e
    assert [t.state.name for t in study.get_trials()] == ["FAIL"]


if __name__ == "__main__":
    comm = torchmn.create_communicator()
    globals()[f"check_{sys.argv[2]}"](comm, sys.argv[1])
    if comm.rank == 0:
        print(f"PASS {sys.argv[2]}", flush=True)
    comm.finalize()
