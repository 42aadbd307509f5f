"""`torchmn run --max-restarts`: real jobs whose ranks fail, and the launcher starting them again.

A restart is a new job (new ranks, a new rendezvous store); the ranks see TORCHMN_RESTART_COUNT.
A stop asked for (SIGTERM to the launcher) never restarts. Slurm's side (refusal in a multi-node
step, requeue) is in test_slurm.py; restarts across ssh hosts in test_multihost.py.
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from jobs import REPO, clean_env, run_job
from torchmn.cli import main

PY = sys.executable
TRAIN = str(REPO / "tests" / "scripts" / "train_restartable.py")
TIMEOUT = 120


def torchmn_run(*args, timeout=TIMEOUT, cwd=None):
    return subprocess.run([PY, "-m", "torchmn", "run", *args], capture_output=True, text=True, env=clean_env(),
                          timeout=timeout, cwd=cwd or REPO)


def starts(output, rank=0):
    """The TORCHMN_RESTART_COUNT values that ``rank`` printed as ``start N``."""
    return [int(n) for n in re.findall(rf"^\[{rank}\] start (\d+)", output, re.M)]


# Rank 0 prints its start and exits with 10 + its start (so each start's code differs); rank 1 waits.
FAIL_EVERY_TIME = ("import os, sys, time\n"
                   "count = int(os.environ['TORCHMN_RESTART_COUNT'])\n"
                   "if os.environ['RANK'] == '0':\n"
                   "    print('start', count, flush=True)\n"
                   "    sys.exit(10 + count)\n"
                   "time.sleep(60)\n")


@pytest.mark.timeout(300)
def test_crash_once_resumes_and_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path):
    """Rank 1 crashes at step 35 of 60 in the first start only (checkpoints every 10 steps): with
    --max-restarts 2 the job restarts once, resumes from step 30 and ends with exactly the weights
    of a run that never crashed."""
    common = ["--steps", "60", "--every", "10"]
    # The uninterrupted run is the script's part alone: forked ranks.
    run_job(TRAIN, [*common, "--checkpoint", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt")], np=2)
    proc = torchmn_run("-np", "2", "--max-restarts", "2", "--restart-delay", "0.5", PY, TRAIN, *common,
                       "--checkpoint", str(tmp_path / "crash"), "--out", str(tmp_path / "crash.pt"),
                       "--crash-at", "35")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, err
    assert starts(out) == [0, 1], out
    assert "[0] start 1: from step 30" in out, out
    assert "[0] done: 60 steps" in out, out
    # The restart is named: the rank, its host, its exit code and its error.
    assert err.count("torchmn run: restarting the job in 0.5 s") == 1, err
    restart = re.search(r"restarting the job in 0\.5 s \(restart 1 of --max-restarts 2; its ranks see "
                        r"TORCHMN_RESTART_COUNT=1\), after start 0 \(ran [\d.]+ s\): rank 1 \(host \S+\) failed "
                        r"with exit code 1: RuntimeError: injected crash at step 35", err)
    assert restart, err
    assert "torchmn run: the job completed after 1 restart (--max-restarts 2)" in err, err
    resumed, whole = torch.load(tmp_path / "crash.pt"), torch.load(tmp_path / "ref.pt")
    assert resumed.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name


def test_script_that_always_fails_gives_up_after_max_restarts():
    """Every start fails: 1 + K starts, one clear message, the last failure's exit code."""
    proc = torchmn_run("-np", "2", "--max-restarts", "2", "--restart-delay", "0", PY, "-c", FAIL_EVERY_TIME,
                       timeout=60)
    assert proc.returncode == 12, proc.stderr  # start 2 exited with 10 + 2
    assert starts(proc.stdout) == [0, 1, 2], proc.stdout
    err = proc.stderr
    assert err.count("gave up") == 1, err
    assert ("torchmn run: gave up after 2 restarts (--max-restarts 2): the job failed every time it started, "
            "last with exit code 12:") in err, err
    for count in range(3):
        assert re.search(rf"^  start {count} \(ran [\d.]+ s\): rank 0 \(host \S+\) failed with exit code "
                         rf"{10 + count}$", err, re.M), err


def test_same_failure_every_time_says_restarting_does_not_help():
    code = "import sys; raise SystemExit('config file missing')"
    proc = torchmn_run("-np", "1", "--max-restarts", "1", "--restart-delay", "0", PY, "-c", code, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "gave up after 1 restart (--max-restarts 1)" in proc.stderr, proc.stderr
    assert "failed with exit code 1: config file missing" in proc.stderr, proc.stderr
    assert "every start failed the same way, so restarting does not help here" in proc.stderr, proc.stderr


def test_log_dir_keeps_every_starts_output(tmp_path):
    """--log-dir with restarts: rank.<r>.log holds the failed start's output (its traceback), then a
    line naming the restart, then the next start's."""
    script = ("import os\n"
              "count = os.environ['TORCHMN_RESTART_COUNT']\n"
              "print('rank', os.environ['RANK'], 'start', count, flush=True)\n"
              "if count == '0' and os.environ['RANK'] == '1':\n"
              "    raise RuntimeError('first-start crash')\n")
    proc = torchmn_run("-np", "2", "--max-restarts", "1", "--restart-delay", "0", "--log-dir", str(tmp_path / "logs"),
                       PY, "-c", script)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "rank.1.log").read_text()
    first, crash = log.index("rank 1 start 0"), log.index("RuntimeError: first-start crash")
    marker = log.index("----- torchmn run: start 1 (TORCHMN_RESTART_COUNT=1) -----")
    # stdout and stderr reach the log as they come: the crash may be written before the print.
    assert max(first, crash) < marker < log.index("rank 1 start 1"), log


def test_restart_count_is_zero_without_restarts():
    proc = torchmn_run("-np", "2", PY, "-c", "import os; print('start', os.environ['TORCHMN_RESTART_COUNT'])",
                       timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert starts(proc.stdout, 0) == starts(proc.stdout, 1) == [0], proc.stdout
    assert "restart" not in proc.stderr, proc.stderr


def test_restart_on_that_does_not_match_does_not_restart():
    proc = torchmn_run("-np", "2", "--max-restarts", "3", "--restart-on", "1,SIGKILL", "--restart-delay", "0",
                       PY, "-c", FAIL_EVERY_TIME, timeout=60)
    assert proc.returncode == 10, proc.stderr
    assert starts(proc.stdout) == [0], proc.stdout
    assert ("torchmn run: not restarting: exit code 10 is not one that --restart-on names "
            "(1, 137 (SIGKILL)).") in proc.stderr, proc.stderr
    assert "restarting the job" not in proc.stderr, proc.stderr


def test_restart_on_a_signal_name_restarts_a_rank_killed_by_it():
    """The report says the rank was killed by the signal, and nothing more: not its last line of
    output (progress, or a traceback it handled long before) as if that were the error."""
    code = ("import os, signal, sys\n"
            "count = int(os.environ['TORCHMN_RESTART_COUNT'])\n"
            "print('start', count, flush=True)\n"
            "if count == 0 and os.environ['RANK'] == '1':\n"
            "    sys.stderr.write('Traceback (most recent call last):\\n  File \"x.py\", line 1\\n'\n"
            "                     'ValueError: handled long ago\\nloading batch 17 ...\\n')\n"
            "    sys.stderr.flush()\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = torchmn_run("-np", "2", "--max-restarts", "1", "--restart-on", "3,SIGKILL", "--restart-delay", "0",
                       PY, "-c", code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert starts(proc.stdout, 1) == [0, 1], proc.stdout
    assert re.search(r"after start 0 \(ran [\d.]+ s\): rank 1 \(host \S+\) was killed by signal SIGKILL "
                     r"\(exit code 137\)$", proc.stderr, re.MULTILINE), proc.stderr


def test_restart_keeps_a_fixed_master_port(tmp_path):
    """--master-port: the second start's store listens on the port the first one's freed."""
    port = 20000 + (os.getpid() * 7) % 10000
    code = ("import os, sys, torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='env://')\n"
            "count = int(os.environ['TORCHMN_RESTART_COUNT'])\n"
            "print('start', count, 'port', os.environ['MASTER_PORT'], flush=True)\n"
            "dist.barrier()\n"
            "sys.exit(5 if count == 0 and dist.get_rank() == 0 else 0)\n")
    proc = torchmn_run("-np", "2", "--master-port", str(port), "--max-restarts", "1", "--restart-delay", "0",
                       PY, "-c", code, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"^\[1\] start (\d) port (\d+)", proc.stdout, re.M) == [("0", str(port)), ("1", str(port))], \
        proc.stdout


def _launch(*args, pid_dir):
    """A launcher whose ranks write their pid files into ``pid_dir`` and sleep; its stderr is read
    line by line by the caller."""
    # The start line first, then the pid file whole (renamed into place): once the file is there,
    # the rank has printed and the file holds its pid.
    code = ("import os, sys, time\n"
            "print('start', os.environ['TORCHMN_RESTART_COUNT'], flush=True)\n"
            f"path = os.path.join({str(pid_dir)!r}, os.environ['RANK'] + '.' + "
            "os.environ['TORCHMN_RESTART_COUNT'] + '.pid')\n"
            "open(path + '.tmp', 'w').write(str(os.getpid()))\n"
            "os.replace(path + '.tmp', path)\n"
            "time.sleep(120)\n")
    return subprocess.Popen([PY, "-m", "torchmn", "run", "-np", "2", *args, PY, "-c", code], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _wait_for_files(pid_dir, count, timeout=60):
    deadline = time.monotonic() + timeout
    while len(_pid_files(pid_dir)) < count:
        assert time.monotonic() < deadline, os.listdir(pid_dir)
        time.sleep(0.05)


def _pid_files(pid_dir):
    return [name for name in os.listdir(pid_dir) if name.endswith(".pid")]


def _pids_gone(pid_dir):
    pids = [int(open(os.path.join(pid_dir, name)).read()) for name in _pid_files(pid_dir)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_sigterm_to_the_launcher_ends_a_restartable_job(tmp_path):
    launcher = _launch("--max-restarts", "3", "--restart-delay", "0", pid_dir=tmp_path)
    try:
        _wait_for_files(tmp_path, 2)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM; forwarded it to all 2 ranks and stopped them" in err, err
    assert "restart" not in err, err
    assert starts(out, 0) == starts(out, 1) == [0], out
    assert sorted(os.listdir(tmp_path)) == ["0.0.pid", "1.0.pid"]
    assert not _pids_gone(tmp_path)


def test_sigterm_while_waiting_to_restart_stops_without_restarting(tmp_path):
    code = "import sys; print('start', flush=True); sys.exit(4)"
    launcher = subprocess.Popen([PY, "-m", "torchmn", "run", "-np", "1", "--max-restarts", "2",
                                 "--restart-delay", "60", PY, "-c", code], env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        err = ""
        deadline = time.monotonic() + 60
        while "restarting the job in 60 s" not in err and time.monotonic() < deadline:
            line = launcher.stderr.readline()
            if not line:
                break
            err += line
        assert "restarting the job in 60 s" in err, err
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        out, rest = launcher.communicate(timeout=30)
        err += rest
        took = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert took < 20, took  # not the 60 s restart delay
    assert out.count("start") == 1, out
    assert ("torchmn run: received SIGTERM while waiting to restart; stopped (restart 1 of 2 did not start)."
            in err), err


@pytest.mark.parametrize("argv, message", [
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
    (["--max-restarts", "1", "--restart-delay", "-2"], "--restart-delay must be 0 or more seconds, got -2"),
    (["--max-restarts", "1", "--restart-on", "SIGNOPE"], "'SIGNOPE' is neither an exit code nor a signal name"),
    (["--max-restarts", "1", "--restart-on", "0"], "exit code 0 is outside 1-255"),
])
def test_restart_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(["run", "-np", "2", *argv, PY, "-c", "pass"]))
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
