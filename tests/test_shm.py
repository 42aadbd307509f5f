"""The shared-memory path of the hierarchical communicator, in real jobs."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import WORKERS, clean_env, launcher_argv, run_job, start_forked_job
from torchmn.communicators.shm import SHM_DIR, leftover_segments

CHECKS = WORKERS / "shm_checks.py"


def segments_of(job) -> list[str]:
    """The segments in /dev/shm that ``job``'s ranks created (a segment's name ends in its creator's
    pid): other tests' jobs, running at the same time on other pytest workers, have their own."""
    return [name for name in leftover_segments() if any(name.endswith(f"-pid{pid}") for pid in job.pids)]


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("slot_mb", ["16", "0.01"])  # 0.01 MB slots: every large tensor goes in pieces
def test_same_results_as_gloo(np, slot_mb):
    out = run_job(CHECKS, ["same_as_gloo"], np=np, timeout=150, env={"TORCHMN_SHM_SLOT_MB": slot_mb}).stdout
    assert "PASS same_as_gloo" in out


@pytest.mark.parametrize("np", [2, 3, 4])
def test_small_tensors_take_one_round_with_the_same_bits(np):
    out = run_job(CHECKS, ["small_paths_same_bits"], np=np, timeout=150).stdout
    assert "PASS small_paths_same_bits" in out


@pytest.mark.parametrize("np", [2, 3])
def test_messages_inside_a_node_go_through_mailboxes(np):
    out = run_job(CHECKS, ["messages"], np=np, timeout=150).stdout
    assert "PASS messages" in out


@pytest.mark.parametrize("np", [2, 3])
def test_small_messages_leave_before_their_receive(np):
    out = run_job(CHECKS, ["small_messages_leave_before_their_receive"], np=np, timeout=60,
                  env={"TORCHMN_TIMEOUT": "15"}).stdout
    assert "PASS small_messages_leave_before_their_receive" in out


def test_a_lost_sender_is_named_by_the_mailbox_wait(tmp_path):
    t0 = time.monotonic()
    job = start_forked_job(CHECKS, ["message_peer_lost"], np=2, timeout=60, stop_on_failure=False)
    proc = job.wait()
    assert time.monotonic() - t0 < 45
    assert "PEER LOST: shared-memory receive from rank 1" in proc.stdout and "exited" in proc.stdout, proc.stdout


def test_barrier_through_shared_memory_orders_the_ranks():
    out = run_job(CHECKS, ["barrier_orders"], np=3, timeout=90).stdout
    assert "PASS barrier_orders" in out


def test_killed_rank_leaves_no_segment():
    job = start_forked_job(CHECKS, ["die"], np=2, timeout=60)
    proc = job.wait()
    assert proc.returncode != 0
    assert not segments_of(job), segments_of(job)


def test_segment_of_a_job_killed_during_setup_is_removed_by_the_next():
    """A segment has a name only while its job sets up; a job killed then leaves it in /dev/shm.
    The next job's set-up removes it once its creator is dead and it is over a minute old, and
    leaves alone one that is recent (maybe another container's, setting up right now)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = Path(SHM_DIR) / f"torchmn-0123456789abcdef-node0-pid{dead.pid}"
    recent = Path(SHM_DIR) / f"torchmn-fedcba9876543210-node0-pid{dead.pid}"
    try:
        for path in (old, recent):
            path.write_bytes(b"\0" * 4096)
        an_hour_ago = time.time() - 3600
        os.utime(old, (an_hour_ago, an_hour_ago))
        run_job(CHECKS, ["same_as_gloo"], np=2, timeout=150)
        assert not old.exists() and recent.exists()
    finally:
        for path in (old, recent):
            path.unlink(missing_ok=True)


def test_lost_peer_is_named_not_waited_for(tmp_path):
    # No launcher tears the job down for us (the ranks are started as by hand), so the surviving
    # rank must notice by itself that its peer is gone.
    t0 = time.monotonic()
    job = start_forked_job(CHECKS, ["peer_lost"], np=2, timeout=60, stop_on_failure=False)
    proc = job.wait()
    assert time.monotonic() - t0 < 45
    assert "PEER LOST" in proc.stdout and "rank 1" in proc.stdout and "exited" in proc.stdout, proc.stdout
    assert not segments_of(job), segments_of(job)


def test_different_calls_on_two_ranks_raise_at_once():
    start = time.monotonic()
    proc = run_job(CHECKS, ["different_calls"], np=2, timeout=60, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("MISMATCH rank") == 2, out
    assert time.monotonic() - start < 25, out  # not the 30 s timeout


SETUP_FAILS = """
import os, sys, torchmn
from torchmn.communicators import shm
victim = int(sys.argv[1])
if int(os.environ["RANK"]) == victim:
    real_open = os.open
    def failing_open(path, flags, *args):
        if str(path).startswith(shm.SHM_DIR):
            raise OSError(28, "injected: no space")
        return real_open(path, flags, *args)
    os.open = failing_open  # the module the shared-memory set-up opens its segment through
try:
    torchmn.create_communicator("hierarchical", timeout=30)
except (OSError, torchmn.communicators.RemoteRankError) as e:
    sys.stdout.write(f"RAISED {type(e).__name__}: {e}\\n")
"""


@pytest.mark.parametrize("victim", [0, 1])
def test_shared_memory_set_up_failing_on_one_rank_fails_on_all(tmp_path, victim):
    """The creator (0) or a rank that maps the segment (1) fails: every rank raises at once, and
    none is left with a segment its peer never attached to (which hung at the first collective)."""
    script = tmp_path / "job.py"
    script.write_text(SETUP_FAILS)
    start = time.monotonic()
    job = start_forked_job(script, [str(victim)], np=2, timeout=60)
    proc = job.wait()
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "RAISED OSError: [Errno 28] injected" in out and "RAISED RemoteRankError" in out, out
    assert f"failed on rank(s) {victim}" in out, out
    assert time.monotonic() - start < 25 and not segments_of(job), out


def test_two_jobs_at_once_do_not_interfere():
    jobs = []
    for value in (10, 1000):
        argv = launcher_argv("torchmn", 2) + [sys.executable, str(CHECKS), "busy", "--value", str(value)]
        jobs.append(subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True))
    outs = []
    try:
        for job in jobs:
            outs.append(job.communicate(timeout=120)[0])
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    for job, out in zip(jobs, outs):
        assert job.returncode == 0 and "PASS busy" in out, out


# Inside the namespace: fork the ranks as run_job does (from one process that imports torch once).
IN_NAMESPACE = ("import sys; sys.path.insert(0, sys.argv[1]); from jobs import run_job; "
                "proc = run_job(sys.argv[2], [sys.argv[3]], np=int(sys.argv[4]), timeout=100, check=False); "
                "sys.stdout.write(proc.stdout); sys.stderr.write(proc.stderr); sys.exit(proc.returncode)")


def in_small_dev_shm(size_mb, np, check, env):
    """Run CHECK on np ranks in a mount namespace whose /dev/shm is a SIZE_MB tmpfs. The namespace is
    a user namespace's own, so that no root is needed (unprivileged user namespaces, Debian's default)."""
    argv = [sys.executable, "-c", IN_NAMESPACE, str(Path(__file__).parent), str(CHECKS), check, str(np)]
    script = f"mount -t tmpfs -o size={size_mb}m tmpfs /dev/shm && exec " + " ".join(f"'{a}'" for a in argv)
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
                           "sh", "-c", script],
                          env=clean_env(env), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"PASS {check}" in proc.stdout
    return proc


def test_small_dev_shm_optimizers_fall_back():
    in_small_dev_shm(24, 2, "small_dev_shm", {"TORCHMN_SHM_SLOT_MB": "1"})


def test_segment_fits_a_small_dev_shm():
    # 3 ranks' default 16 MB slots need 64 MB; a 24 MB /dev/shm gets smaller ones.
    in_small_dev_shm(24, 3, "segment_fits_dev_shm", {"EXPECT_SEGMENT": "smaller"})
    # 1 MB: not even the smallest slots; TCP inside the node, and a warning that says so.
    proc = in_small_dev_shm(1, 3, "segment_fits_dev_shm", {"EXPECT_SEGMENT": "none"})
    assert "too little for shared-memory collectives" in proc.stderr and "--shm-size" in proc.stderr
