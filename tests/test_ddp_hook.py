"""torchmn.ddp_comm_hook: DistributedDataParallel averaging its buckets through torchmn, in real
multi-process jobs, against DDP's own averaging in the same job (see tests/workers/ddp_checks.py).
One test id per check and configuration; the checks of one configuration share one job."""

import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job

CHECKS = WORKERS / "ddp_checks.py"
ALL = ("equals_ddps_own_averaging", "find_unused_parameters", "no_sync", "fp16_and_bf16_compression",
       "bad_compression_refused", "hook_without_a_communicator_refused", "ranks_compressing_differently_refused",
       "communicator_of_another_size_refused", "ddp_over_other_ranks_refused", "wrapped_hook_over_a_split_trains")


@pytest.mark.timeout(240)  # the first test of a configuration runs its whole job
@pytest.mark.check_job("ddp-hook")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("name,np", [("hierarchical", 2), ("hierarchical", 3), ("flat", 2)])
def test_ddp_comm_hook(name, np, check, request):
    """hierarchical: the buckets are summed in shared memory; flat: through gloo."""
    proc = check_job_output(request, lambda checks: run_job(CHECKS, ["--name", name, *checks], np=np, timeout=240,
                                                            env={"TORCHMN_TIMEOUT": "60"}, check=False))
    assert_check_passed(proc, check)
