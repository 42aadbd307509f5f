"""The Accelerate recipe (docs/coming-from-torchrun.md): a model Accelerate prepared, averaged through
torchmn.ddp_comm_hook under torchmn run, against Accelerate's own averaging in the same job."""

import pytest

from jobs import WORKERS, run_job, run_one_process


def test_accelerate_recipe_matches_accelerates_own_averaging():
    out = run_job(WORKERS / "accelerate_checks.py", ["matches_accelerates_own_averaging"], np=2, launcher="torchmn",
                  timeout=120).stdout
    assert "[0] PASS matches_accelerates_own_averaging" in out, out


@pytest.mark.timeout(150)
def test_accelerate_recipe_runs_alone():
    """A plain `python train.py`: Accelerate does not wrap the model, and the recipe leaves the hook off."""
    proc = run_one_process(WORKERS / "accelerate_checks.py", ["matches_accelerates_own_averaging"], timeout=120)
    assert proc.returncode == 0 and "PASS matches_accelerates_own_averaging" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
