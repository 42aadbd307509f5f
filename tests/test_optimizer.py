"""The multi-node optimizer against one process on the whole batch, in real multi-process jobs.

One test id per check and configuration (`pytest -k compression` runs that check alone); the
checks of one configuration share one job (see tests/jobs.py).
"""

import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job, run_one_process

CHECKS = WORKERS / "optim_checks.py"
ALL = ("equivalence", "compression", "double_buffering", "clipping", "unused_parameter", "unused_everywhere",
       "refusals", "shared_memory_where_possible", "transparency", "zero_fill_false",
       "zero_fill_false_goes_on_after_the_refused_step",
       "double_buffering_edge_cases", "half_precision_sums", "failed_backward", "skipped_step_and_abandoned_window",
       "step_skipped_on_one_rank_is_named", "channels_last_parameters_keep_their_layout",
       "every_parameter_frozen_steps",
       "scheduler_and_hooks_of_the_torch_optimizer", "closure_lbfgs", "frozen_parameters_start_equal",
       "complex_parameters", "dtype_changed_after_wrapping", "memory_format_changed_after_wrapping",
       "default_keeps_replicated_semantics", "powersgd",
       "powersgd_refusals", "rewrap_keeps_state",
       "saved_model_is_its_own_size", "state_dict_hooks", "replacing_the_optimizer_drops_the_old_ones_hooks",
       "wrapped_optimizer_alone_after_remove_hooks")


@pytest.mark.check_job("optim")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("name,np", [("hierarchical", 2), ("hierarchical", 3), ("flat", 2), ("naive", 2),
                                     ("flat", 3)])
def test_optimizer_matches_one_process(name, np, check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, ["--name", name, *checks], np=np, timeout=180,
                                                            check=False))
    assert_check_passed(proc, check)


@pytest.mark.check_job("optim-one-process")
@pytest.mark.parametrize("check", ALL)
def test_optimizer_in_a_world_of_one(check, request):
    assert_check_passed(check_job_output(request, lambda checks: run_one_process(CHECKS, checks, 120)), check)


def test_a_cpu_model_trains_on_an_nccl_communicator():
    """A CPU model with an NCCL communicator (a GPU machine's default) trains: its tensors take the
    CPU's way (the many-rank form is comm_checks.py's cpu_under_nccl)."""
    import torch

    import torchmn
    from torchmn.communicators import make_communicator

    comm = make_communicator("naive", rank=0, size=1, group=None, obj_group=None, backend="nccl", node_key=0)
    model = torch.nn.Linear(2, 2)
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert comm.wire_device(model.weight) == torch.device("cpu")
    assert torch.allclose(model.weight, before - 0.1), model.weight
