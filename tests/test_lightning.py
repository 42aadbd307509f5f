"""torchmn.lightning: a Lightning Trainer with TorchmnStrategy in real multi-process jobs, against
Lightning's own DDPStrategy in the same job (see tests/workers/lightning_checks.py)."""

import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job

CHECKS = WORKERS / "lightning_checks.py"
ALL = ("matches_lightnings_ddp", "collectives_go_through_the_communicator",
       "devices_that_differ_from_the_launcher_are_refused")


@pytest.mark.timeout(240)  # the first test runs the whole job
@pytest.mark.check_job("lightning")
@pytest.mark.parametrize("check", ALL)
def test_lightning_strategy(check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, list(checks), np=2, timeout=240,
                                                            env={"TORCHMN_TIMEOUT": "60"}, check=False))
    assert_check_passed(proc, check)
