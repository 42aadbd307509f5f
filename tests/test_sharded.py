"""The sharded (ZeRO stage 1) optimizer against one process on the whole batch, in real multi-process jobs.

One test id per check and configuration; the checks of one configuration share one job (see
tests/jobs.py).
"""

import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job, run_one_process

CHECKS = WORKERS / "shard_checks.py"
ALL = ("equivalence", "accumulation", "overlap", "compression", "state_is_sharded", "refusals", "unused_parameter",
       "state_dict_format", "shared_memory_where_possible",
       "kernel_choice", "edited_gradients_refused", "clip_grad_norm", "parameters_used_through_cat",
       "skipped_step_is_named", "state_per_parameter", "odd_sizes", "state_replaced_mid_run",
       "piecewise_update_is_exact", "clip_after_non_finite_step", "late_parameter",
       "half_precision_sums")


@pytest.mark.check_job("shard", name="auto")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("np", [2, 3])
def test_sharded_matches_one_process(np, check, request):
    """The default communicator on one node: parameters and gradients in shared memory."""
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=np, timeout=90, check=False))
    assert_check_passed(proc, check)


@pytest.mark.check_job("shard", name="flat")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("np", [2, 3])
def test_sharded_through_torch_distributed(np, check, request):
    """The `flat` communicator: reduce-scatter and all-gather through gloo, as across nodes."""
    proc = check_job_output(request, lambda checks: run_job(CHECKS, ["--name", "flat", *checks], np=np, timeout=90,
                                                            check=False))
    assert_check_passed(proc, check)


@pytest.mark.check_job("shard-one-process")
@pytest.mark.parametrize("check", ALL)
def test_sharded_in_a_world_of_one(check, request):
    assert_check_passed(check_job_output(request, lambda checks: run_one_process(CHECKS, checks, 90)), check)


def test_checkpoint_moves_between_rank_counts(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    assert_check_passed(run_job(CHECKS, ["--path", ckpt, "save"], np=3, timeout=90), "save")
    # plain_resume loads into a plain torch optimizer with no communicator: one process's view.
    out = run_job(CHECKS, ["--path", ckpt, "resume", "plain_resume"], np=2, timeout=90)
    assert_check_passed(out, "resume")
    assert_check_passed(out, "plain_resume")
