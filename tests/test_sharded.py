"""The sharded (ZeRO stage 1) optimizer against one process on the whole batch, in real multi-process jobs."""
import subprocess
import sys

import pytest

from jobs import WORKERS, clean_env, run_job

CHECKS = WORKERS / "shard_checks.py"
ALL = ("equivalence", "accumulation", "overlap", "compression", "state_is_sharded", "refusals", "unused_parameter",
       "state_dict_format", "shared_memory_where_possible",
       "kernel_choice", "edited_gradients_refused", "clip_grad_norm", "parameters_used_through_cat",
       "skipped_step_is_named", "state_per_parameter", "odd_sizes", "state_replaced_mid_run",
       "piecewise_update_is_exact", "clip_after_non_finite_step", "late_parameter",
       "half_precision_sums")


def _one_process(args):
    proc = subprocess.run([sys.executable, str(CHECKS)] + args, env=clean_env(), capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("np", [2, 3])
def test_sharded_matches_one_process(np):
    """The default communicator on one node: parameters and gradients in shared memory."""
    out = run_job(CHECKS, ["all"], np=np, timeout=90).stdout
    for check in ALL:
        assert f"PASS {check}" in out, out


@pytest.mark.parametrize("np", [2, 3])
def test_sharded_through_torch_distributed(np):
    """The `flat` communicator: reduce-scatter and all-gather through gloo, as across nodes."""
    out = run_job(CHECKS, ["--name", "flat", "all"], np=np, timeout=90).stdout
    for check in ALL:
        assert f"PASS {check}" in out, out


def test_sharded_in_a_world_of_one():
    out = _one_process(["all"])
    assert all(f"PASS {c}" in out for c in ALL), out


def test_checkpoint_moves_between_rank_counts(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    assert "PASS save" in run_job(CHECKS, ["--path", ckpt, "save"], np=3, timeout=90).stdout
    # plain_resume loads into a plain torch optimizer with no communicator: one process's view.
    out = run_job(CHECKS, ["--path", ckpt, "resume", "plain_resume"], np=2, timeout=90).stdout
    assert "PASS resume" in out and "PASS plain_resume" in out, out
