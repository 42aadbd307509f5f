"""The multi-node optimizer against one process on the whole batch, in real multi-process jobs."""
import pytest

from jobs import WORKERS, run_job

CHECKS = WORKERS / "optim_checks.py"
ALL = ("equivalence", "compression", "double_buffering", "clipping", "unused_parameter", "unused_everywhere",
       "refusals", "shared_memory_where_possible", "transparency", "zero_fill_false",
       "double_buffering_edge_cases", "half_precision_sums", "failed_backward", "frozen_parameters_start_equal",
       "complex_parameters", "dtype_changed_after_wrapping")


@pytest.mark.parametrize("name,np", [("hierarchical", 2), ("hierarchical", 3), ("flat", 2), ("naive", 2),
                                     ("flat", 3)])
def test_optimizer_matches_one_process(name, np):
    out = run_job(CHECKS, ["--name", name, "all"], np=np, timeout=180).stdout
    for check in ALL:
        assert f"PASS {check}" in out, out


def test_optimizer_in_a_world_of_one():
    import subprocess
    import sys

    from jobs import clean_env
    proc = subprocess.run([sys.executable, str(CHECKS), "all"], env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(f"PASS {c}" in proc.stdout for c in ALL)
