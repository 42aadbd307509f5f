"""The parallel layers (multi-node BatchNorm, spatial-, channel- and tensor-parallel) against their
dense counterparts in one process, in real multi-process jobs (float64).

One test id per check and rank count; the checks of one rank count share one job (tests/jobs.py).
"""
import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job

CHECKS = WORKERS / "parallel_layer_checks.py"
ALL = ("bn_four_way", "bn_four_way_images", "bn_rank_without_samples",
       "bn_constant_channel_and_single_sample", "bn_large_mean_keeps_the_variance",
       "bn_recovers_after_a_batch_with_nan", "bn_global_batch_of_one_refused", "bn_empty_global_batch_keeps_statistics",
       "bn_cumulative_average", "bn_eval_makes_no_collective",
       "bn_channel_mismatch_refused", "bn_wrong_input_refused_on_every_rank", "bn_deep_copy_shares_the_communicator", "create_mnbn_model",
       "create_mnbn_model_converts_subclasses", "spatial_conv", "spatial_conv_width_split",
       "spatial_conv_empty_blocks", "spatial_conv_then_inplace_relu", "spatial_conv_refuses_misfit_blocks", "channel_conv", "channel_conv_grouped",
       "channel_conv_unbatched",
       "column_row_mlp", "column_and_row_alone",
       "dense_state_dict_loads_as_it_is", "arguments_refused",
       "input_refused_on_one_rank_is_named_on_every_rank")


@pytest.mark.check_job("parallel-layers")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("np", [2, 3, 4])
def test_parallel_layers(np, check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=np, timeout=240, check=False,
                                                            env={"TORCHMN_TIMEOUT": "60"}))
    assert_check_passed(proc, check)
