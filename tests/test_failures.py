"""One rank fails while the others wait for it in a collective: the whole job ends within seconds,
rank 1's traceback is shown once, and the other ranks say in one line that rank 1 failed.

Here under ``torchmn run``, ``torchrun``, and ranks started by hand (nobody stops the others: only
torchmn's exception hook ends them). The same under ``mpirun`` is in test_mpi.py, under ``srun``
in test_slurm.py. ``bench/bench_failures.py`` measures the times.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from failure_jobs import (BOUND_S, assert_failure_shown_once, failing_argv, pid_of_rank_1, run_by_hand,
                          run_failing)
from jobs import REPO, clean_env, launcher_argv, start_forked_job

pytestmark = pytest.mark.timeout(200)


def test_kill_9_of_a_rank_in_a_collective_ends_torchmn_run_within_seconds(tmp_path):
    """kill -9 of one of 4 ranks while every rank is in an allreduce: the launcher stops the others
    and exits (about a second on a quiet machine)."""
    launcher = subprocess.Popen(launcher_argv("torchmn", 4) + failing_argv("kill", tmp_path), cwd=REPO,
                                env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = pid_of_rank_1(tmp_path, launcher)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGKILL, err
    assert f"rank 1 (host {socket.gethostname()}) was killed by signal SIGKILL" in err, err
    assert seconds < BOUND_S, f"{seconds:.1f} s from the kill to the launcher's exit\n{err}"


@pytest.mark.parametrize("mode", ["raise", "optimizer"])
def test_exception_in_a_collective_ends_torchmn_run(mode, tmp_path):
    """The launcher names rank 1 (its traceback again in the summary), not a rank it stopped."""
    output, code, seconds = run_failing(launcher_argv("torchmn", 4) + failing_argv(mode, tmp_path), tmp_path)
    assert code == 1, output
    assert f"torchmn run: rank 1 (host {socket.gethostname()}) failed with exit code 1" in output, output
    assert_failure_shown_once(output, seconds, copies=2)


def test_exception_in_a_collective_ends_torchrun(tmp_path):
    """torchrun's own summary names rank 1 as the root cause: the others waited for it to exit first."""
    output, code, seconds = run_failing(launcher_argv("torchrun", 4)[:-1] + failing_argv("raise", tmp_path),
                                        tmp_path)
    assert code != 0, output
    root_cause = output.split("Root Cause (first observed failure):", 1)[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), output[-6000:]
    assert_failure_shown_once(output, seconds)


def test_exception_in_a_collective_ends_ranks_started_by_hand(tmp_path):
    """No launcher stops the others: each learns of rank 1's failure and ends, with one line."""
    outputs, codes, seconds = run_by_hand("raise", tmp_path)
    assert codes == [1, 1, 1, 1], outputs
    assert_failure_shown_once("".join(outputs), seconds, others_named={0, 2, 3})


def test_other_ranks_can_catch_the_named_error(tmp_path):
    """The error the others get is a CollectiveTimeoutError (a RankFailedError) naming rank 1, and
    comes at once, not after the collective timeout or the grace period for slow ranks; also to
    rank 3, which comes late, after rank 0 (the store's host) has caught the error and is ending."""
    outputs, codes, _ = run_by_hand("catch", tmp_path)
    assert codes == [0, 1, 0, 0], outputs
    for rank in (0, 2, 3):
        match = re.search(r"CAUGHT (\w+) failed_rank=(\S+) after=([\d.]+)", outputs[rank])
        assert match, outputs[rank]
        assert match.group(1, 2) == ("RankFailedError", "1"), outputs[rank]
        assert float(match.group(3)) < BOUND_S, outputs[rank]
        assert "ended with an uncaught ValueError: boom from rank 1" in outputs[rank], outputs[rank]


def test_a_failed_rank_that_finalized_a_split_is_seen_at_once(tmp_path):
    """A rank that finalized a split communicator (whose groups wait for a later split) and then
    raises, with a thread still keeping its process alive, closes its connections as it fails:
    the others raise within seconds, not when its process ends 30 s later."""
    outputs, codes, _ = run_by_hand("split", tmp_path)
    for rank in (0, 2, 3):
        match = re.search(r"CAUGHT (\w+) failed_rank=(\S+) after=([\d.]+)", outputs[rank])
        assert match, outputs[rank]
        assert match.group(1, 2) == ("RankFailedError", "1"), outputs[rank]
        assert float(match.group(3)) < 15, outputs[rank]


@pytest.mark.parametrize("holder", ["group", "handle", "split"])
def test_leaving_the_world_closes_connections_held_in_an_old_reference_cycle(holder, tmp_path):
    """A rank that leaves its world and goes on (an elastic rank moving to a new world) closes the
    gloo connections that only an old, garbage reference cycle still holds (through the world's
    group, or a finished collective's handle): the rank waiting for it in an allreduce raises within
    seconds, not when the leaving rank's process ends (60 s later)."""
    script = REPO / "tests" / "scripts" / "leave_with_a_group_in_a_cycle.py"
    job = start_forked_job(script, [str(tmp_path), holder], np=2, timeout=120, stop_on_failure=False)
    proc = job.wait()
    report = (tmp_path / "rank1").read_text() if (tmp_path / "rank1").exists() else ""
    assert report, proc.stdout[-3000:] + proc.stderr[-3000:]
    seconds, outcome = report.split(" ", 1)
    assert outcome.startswith("raised"), report
    assert float(seconds) < 20, report


SUB_COMMUNICATOR_JOB = r"""
import sys, time, torch, torchmn
comm = torchmn.create_communicator(timeout=4)
sub = comm.split(color=0 if comm.rank == 0 else 1, key=comm.rank)  # job ranks 1, 2 are its ranks 0, 1
comm.barrier()
if comm.rank == 2:
    if sys.argv[1] == "stall":
        time.sleep(10)
        sys.exit(0)
    raise ValueError("boom from rank 2")
if comm.rank == 1:
    try:
        sub.allreduce(torch.ones(2))
    except Exception as e:
        print("CAUGHT", type(e).__name__, e, flush=True)
"""


@pytest.mark.parametrize("mode", ["stall", "raise"])
def test_a_split_communicators_errors_name_the_jobs_ranks_too(mode):
    """On a communicator split off the job, whose rank r is another rank of the job, the errors
    name each rank with its rank in the job (what the launcher's prefixes and summary show), so
    that rank 2 of the job stalling or raising is not reported as rank 1 or 0."""
    proc = subprocess.run(launcher_argv("torchmn", 3) + [sys.executable, "-c", SUB_COMMUNICATOR_JOB, mode], cwd=REPO,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    caught = [line for line in proc.stdout.splitlines() if line.startswith("[1] CAUGHT")]
    assert caught, proc.stdout + proc.stderr
    if mode == "stall":
        assert "rank 1 (rank 2 of the job, " in caught[0] and "rank 0 (rank 1 of the job, " in caught[0], caught[0]
    else:
        assert "stopped on rank 0 (rank 1 of the job, " in caught[0], caught[0]
        assert "rank 2 of the job (" in caught[0] and "ValueError: boom from rank 2" in caught[0], caught[0]
