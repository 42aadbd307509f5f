"""torchmn.join: ranks with different numbers of batches, in real multi-process jobs.

Inside the context the job neither hangs nor drifts apart: every rank ends with the parameters of
a one-process run on the same batches, each step averaging the ranks that still had data (see
tests/workers/join_checks.py). Without it, a rank that leaves the loop early still fails the job
with the error naming it. One test id per check and configuration; the checks of one configuration
share one job (see tests/jobs.py).
"""

import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job, run_one_process

CHECKS = WORKERS / "join_checks.py"
ALL = ("uneven_replicated", "uneven_sharded", "uneven_default", "a_rank_without_data", "two_optimizers",
       "exchange_only_inside_join", "double_buffering_refused", "sharded_clip_refused",
       "clipping_reaches_repeating_ranks",
       "different_optimizers_named", "other_collective_inside_named", "nested_refused",
       "skipped_step_inside_named")
# A hang would surface as the communicator's timeout error, naming the ranks, well within the job's.
ENV = {"TORCHMN_TIMEOUT": "60"}


@pytest.mark.timeout(240)  # the first test of a configuration runs its whole job
@pytest.mark.check_job("join")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("name,np", [("hierarchical", 2), ("flat", 2), ("hierarchical", 3), ("hierarchical", 4),
                                     ("flat", 4)])
def test_join_matches_one_process(name, np, check, request):
    """2 ranks hold 7 and 10 batches, 3 ranks 6, 2 and 4, 4 ranks 3, 5, 5 and 8. On one node
    (hierarchical) the replicated and sharded optimizers go through shared memory and the default is
    the node-shared one; `flat` sends buckets through gloo (reduce-scatter and all-gather when sharded)."""
    proc = check_job_output(request, lambda checks: run_job(CHECKS, ["--name", name, *checks], np=np, timeout=240,
                                                            env=ENV, check=False))
    assert_check_passed(proc, check)


@pytest.mark.check_job("join-one-process")
@pytest.mark.parametrize("check", ALL)
def test_join_in_a_world_of_one(check, request):
    assert_check_passed(check_job_output(request, lambda checks: run_one_process(CHECKS, checks, 120)), check)


@pytest.mark.parametrize("name,kind,after", [("hierarchical", "default", "collective"),
                                             ("hierarchical", "sharded", "exit"),
                                             ("flat", "replicated", "collective")])
def test_leaving_the_loop_early_without_join_is_named(name, kind, after):
    """Without torchmn.join, rank 0's 7 batches end before rank 1's 10: rank 1's next averaging
    fails within the communicator's timeout (5 s) naming rank 0, whether rank 0 went on to another
    collective or ended its script; nobody waits forever."""
    out = run_job(WORKERS / "uneven_jobs.py", [name, kind, after], np=2, timeout=120).stdout
    expected = {"default": "NodeSharedOptimizer", "sharded": "ShardedMultiNodeOptimizer",
                "replicated": "MultiNodeOptimizer"}[kind]
    assert f"[1] OPTIMIZER {expected}" in out, out
    named = [line for line in out.splitlines() if line.startswith("[1] NAMED")]
    assert named and "rank 0 (" in named[0], out
    assert ("exited" in named[0] or "never called it" in named[0]) if after == "exit" else \
        ("did not arrive" in named[0] or "called allreduce instead" in named[0]), out
