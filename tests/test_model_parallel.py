"""Model parallelism (torchmn.functions, torchmn.nn.MultiNodeSequential, torchmn.nn.Pipeline)
against one process, in real multi-process jobs.

One test id per check and rank count; the checks of one rank count share one job (tests/jobs.py).
"""
import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job

CHECKS = WORKERS / "model_parallel_checks.py"
ALL = ("ring", "send_then_other_loss", "allgather_backward", "alltoall_backward", "scatter_gather_bcast_backward",
       "double_backward_refused", "backward_skipped_on_one_rank_is_named", "mismatched_functions_raise", "send_recv_arguments_refused", "chain", "cycle", "branch_merge", "tuple_data",
       "recv_after_a_delegate_outside_the_graph", "merge_after_a_frozen_branch", "hundred_passes",
       "topology_refused", "topology_waiting_in_a_cycle_refused", "pipeline_gpipe", "pipeline_1f1b", "pipeline_micro_batches_mismatch_refused", "pipeline_schedule_mismatch_refused",
       "pipeline_stage_returning_a_list",
       "pipeline_memory", "pipeline_memory_leaves_out_the_weights", "pipeline_with_data_parallel")


@pytest.mark.check_job("model-parallel")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_model_parallel(np, check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=np, timeout=240, check=False))
    assert_check_passed(proc, check)


def test_one_stage_memory_holds_fewer_micro_batches_with_1f1b():
    """On 2 stages and 8 micro-batches, stage 0 keeps 2 micro-batches' activations with 1F1B, 8 with GPipe."""
    out = run_job(CHECKS, ["pipeline_memory"], np=2, timeout=120).stdout
    row = next(line for line in out.splitlines() if "MEMORY rank=0" in line)
    gpipe, one = (int(part.split("=")[1]) for part in row.split()[-2:])
    assert 3.5 <= gpipe / one <= 4.5, row


def test_a_wrong_shape_names_the_failing_rank():
    """Rank 1's part gets a tensor of another shape: its own error there; rank 0, waiting for the
    gradient, is told that rank 1 left instead of waiting out the timeout."""
    proc = run_job(CHECKS, ["wrong_shape_is_named"], np=2, timeout=90, env={"TORCHMN_TIMEOUT": "60"})
    assert "OWN_ERROR" in proc.stdout and "shapes cannot be multiplied" in proc.stdout, proc.stdout
    assert "NAMED" in proc.stdout and "rank 1" in proc.stdout, proc.stdout
