"""Jobs in which rank 1 fails while the others wait for it in a collective
(``scripts/fail_in_collective.py``), and what the job's output must then show, whichever launcher
started it."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from jobs import REPO, clean_env, start_forked_job

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fail_in_collective.py"
# From rank 1's raise to the end of the job: 1 to 3 s on a quiet machine; generous for a loaded one.
BOUND_S = 30


def failing_argv(mode: str, out: Path) -> list:
    """The rank's command line: ``python fail_in_collective.py MODE OUT``."""
    return [sys.executable, str(SCRIPT), mode, str(out)]


def seconds_since_raise(out: Path, output: str) -> float:
    """Seconds from rank 1's raise (the time it wrote to OUT/raised_at) to now."""
    now = time.time()
    path = out / "raised_at"
    assert path.exists(), f"rank 1 never raised:\n{output[-6000:]}"
    return now - float(path.read_text())


def run_failing(argv: list, out: Path, env: dict | None = None, timeout: float = 120) -> tuple:
    """Run a launcher command line whose ranks run ``failing_argv``; returns (output, exit code,
    seconds from the raise to the launcher's exit)."""
    proc = subprocess.run(argv, cwd=REPO, env=env if env is not None else clean_env(), capture_output=True,
                          text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    return output, proc.returncode, seconds_since_raise(out, output)


def run_by_hand(mode: str, out: Path, np: int = 4, timeout: float = 120) -> tuple:
    """Start ``np`` ranks as plain processes with torch's env:// variables, as a batch script
    without a launcher would: nobody stops the others when one fails (they are forked, see
    ``rank_forks.py``, with ``stop_on_failure=False``). Returns (outputs by rank, exit codes by
    rank, seconds from the raise until the last rank ended)."""
    job = start_forked_job(SCRIPT, [mode, str(out)], np=np, timeout=timeout, stop_on_failure=False)
    proc = job.wait()
    outputs = job.rank_outputs
    return outputs, job.codes, seconds_since_raise(out, proc.stdout + proc.stderr)


def assert_failure_shown_once(output: str, seconds: float, others_named: set | None = None,
                              copies: int = 1) -> None:
    """Rank 1's traceback appears ``copies`` times (torchmn run repeats it in its summary), no other
    rank prints a traceback, every other rank that says why it stopped names rank 1's error, and
    the job ended within BOUND_S of the raise. ``others_named``: the ranks that must say so (a
    launcher that stops the job may stop them before they do)."""
    assert seconds < BOUND_S, f"the job took {seconds:.1f} s to end after rank 1 raised:\n{output[-6000:]}"
    assert output.count('raise ValueError("boom from rank 1")') == copies, output[-6000:]
    # torch's excepthook prefixes every line of a rank's traceback with [rankN]:
    assert re.findall(r"\[rank(\d+)\]: Traceback", output) == ["1"] * copies, output[-6000:]
    named = re.findall(r"\[rank(\d+)\]: RankFailedError: (.*)", output)
    for rank, line in named:
        assert "rank 1 (" in line and "ended with an uncaught ValueError: boom from rank 1" in line, line
    if others_named is not None:
        assert {int(rank) for rank, _ in named} == others_named, output[-6000:]


def pid_of_rank_1(out: Path, proc: subprocess.Popen, timeout: float = 90) -> int:
    """Wait until rank 1 of a ``kill`` job is in its loop; returns its pid."""
    deadline = time.monotonic() + timeout
    path = out / "pid"
    while not path.exists():
        assert proc.poll() is None, f"the job ended before rank 1 started: {proc.returncode}"
        assert time.monotonic() < deadline, "rank 1 did not start"
        time.sleep(0.05)
    time.sleep(0.5)  # the others are back in the loop's allreduce
    return int(path.read_text())

