"""The Accelerate recipe (docs/coming-from-torchrun.md): a model Accelerate prepared, averaged through
torchmn.ddp_comm_hook under torchmn run, against Accelerate's own averaging in the same job."""

from jobs import WORKERS, run_job


def test_accelerate_recipe_matches_accelerates_own_averaging():
    out = run_job(WORKERS / "accelerate_checks.py", ["matches_accelerates_own_averaging"], np=2, launcher="torchmn",
                  timeout=120).stdout
    assert "[0] PASS matches_accelerates_own_averaging" in out, out
