"""`torchmn run` takes horovodrun's command lines: its common flags as torchmn's own, the tuning
flags with a note or mapped to what does the same here, the rest refused with what to use instead."""
import json
import subprocess
import sys

import pytest

from jobs import REPO, clean_env

HVD_SCRIPT = ("import torch, torchmn.horovod as hvd\n"
              "hvd.init()\n"
              "print('sum', hvd.allreduce(torch.ones(2), op=hvd.Sum, name='metric').tolist(), flush=True)\n")


def torchmn_run(*args, timeout=90):
    return subprocess.run([sys.executable, "-m", "torchmn", "run", *args], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_horovodrun_common_flags_run_the_job():
    """horovodrun -np 2 -H localhost:2 --start-timeout 30 --network-interface lo -p 2222 -i KEY --verbose."""
    proc = torchmn_run("-np", "2", "-H", "localhost:2", "--start-timeout", "30", "--network-interface", "lo",
                       "-p", "2222", "-i", "/nonexistent/key", "--verbose", sys.executable, "-c", HVD_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert "[0] sum [2.0, 2.0]" in proc.stdout and "[1] sum [2.0, 2.0]" in proc.stdout
    assert "torchmn run: 2 ranks on localhost:2" in proc.stderr  # --verbose


def test_horovodrun_single_dash_hostfile(tmp_path):
    """horovodrun's own spelling, `-hostfile FILE` (its docs write it so), is --hostfile."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    proc = torchmn_run("-np", "2", "-hostfile", str(hostfile), sys.executable, "-c", HVD_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert "[0] sum [2.0, 2.0]" in proc.stdout and "[1] sum [2.0, 2.0]" in proc.stdout


def test_horovodrun_log_level_debug_is_verbose():
    proc = torchmn_run("-np", "1", "--log-level", "debug", sys.executable, "-c", "print('hi')")
    assert proc.returncode == 0 and "threads per rank" in proc.stderr, proc.stderr   # what --verbose prints
    quiet = torchmn_run("-np", "1", "--log-level", "warning", sys.executable, "-c", "print('hi')")
    assert quiet.returncode == 0 and "threads per rank" not in quiet.stderr, quiet.stderr


def test_horovodrun_tuning_flag_is_accepted_with_a_note():
    proc = torchmn_run("-np", "1", "--gloo", "--cycle-time-ms", "5", sys.executable, "-c", "print('ran')")
    assert proc.returncode == 0 and "[0] ran" in proc.stdout, proc.stderr
    assert "note: --gloo has no effect" in proc.stderr and "note: --cycle-time-ms has no effect" in proc.stderr


def test_horovodrun_flag_of_two_values_takes_both():
    """horovodrun's --blacklist-cooldown-range MIN MAX: both numbers are the flag's, not the command's."""
    from torchmn.cli import build_parser
    from torchmn.run.horovodrun_flags import translate

    args = build_parser().parse_args(["run", "-np", "2", "--blacklist-cooldown-range", "10", "100", "python", "x.py"])
    assert args.horovodrun_blacklist_cooldown_range == ["10", "100"]
    assert args.command == ["python", "x.py"]
    notes, refusal = translate(args)
    assert refusal is None and notes == ["torchmn run: note: --blacklist-cooldown-range has no effect: torchmn run "
                                         "waits 10 s before starting a new worker on a host where one failed before "
                                         "joining"], notes


def test_horovodrun_timeline_flag_writes_the_timeline(tmp_path):
    path = tmp_path / "timeline.json"
    proc = torchmn_run("-np", "2", "--timeline-filename", str(path), "--fusion-threshold-mb", "8",
                       sys.executable, "-c", HVD_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["pid"] for e in events if e["args"].get("tensor") == "metric") == [0, 1]


@pytest.mark.parametrize("flag, advice", [
    (["--mpi"], "start the ranks with mpirun itself"),
    (["--slots-per-host", "2"], "give slots with -H host:N"),
    (["--config-file", "x.yaml"], "pass the settings as flags"),
])
def test_horovodrun_flag_without_counterpart_is_refused(flag, advice):
    proc = torchmn_run("-np", "1", *flag, sys.executable, "-c", "print('ran')")
    assert proc.returncode == 2 and "[0] ran" not in proc.stdout
    assert f"error: {flag[0]} is horovodrun's and has no counterpart here" in proc.stderr and advice in proc.stderr


def test_horovodrun_check_build_says_what_is_there():
    proc = torchmn_run("--check-build")
    assert proc.returncode == 0
    assert "[X] PyTorch" in proc.stdout and "[X] Gloo" in proc.stdout and "[ ] MPI" in proc.stdout
