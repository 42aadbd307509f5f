"""One trial of ``torchmn tune``: a real run of the command, its objective, its progress for the
pruner, and its end (completed, failed with its error, or pruned).

The objective is the time the command reports, in this order: the last line
``torchmn-objective: <seconds>`` it prints; the ``elapsed_time`` of the last entry of its
pytorch-pfn-extras ``LogReport`` (``--log``); its wall time. Progress for the pruner comes from
lines ``torchmn-intermediate: <step> <seconds>`` and from the log's entries (``elapsed_time`` at
each ``epoch`` or ``iteration``) as they appear.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import subprocess
import threading
import time
from typing import Optional

from torchmn.run.processes.groups import stop_group

OBJECTIVE = re.compile(r"torchmn-objective:(.*)")
INTERMEDIATE = re.compile(r"torchmn-intermediate:\s*(\d+)\s+([-+0-9.eE]+)")
COMPLETE, FAILED, PRUNED = "complete", "failed", "pruned"


@dataclasses.dataclass
class Outcome:
    """How a trial ended.

    Attributes:
        state: :data:`COMPLETE`, :data:`FAILED` or :data:`PRUNED`.
        value: the objective (seconds), where complete.
        reason: why it failed or was pruned (the command's last lines where it failed).
        wall: its wall time.
    """

    state: str
    value: Optional[float]
    reason: str
    wall: float


class _Output:
    """Reads the command's output as it comes: the last lines, objective and progress lines."""

    def __init__(self, stream):
        self.tail = collections.deque(maxlen=15)
        self.objective: Optional[float] = None
        self.bad_objective: Optional[str] = None  # the last objective line that held no number
        self.progress: list = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            line = line.rstrip("\n")
            self.tail.append(line)
            for found in OBJECTIVE.findall(line):
                seconds = _seconds(found)
                self.objective, self.bad_objective = (seconds, None) if seconds is not None else (None, line)
            for step, value in INTERMEDIATE.findall(line):
                seconds = _seconds(value)
                if seconds is not None:  # a progress line without a number is no progress, and reading goes on
                    self.progress.append((int(step), seconds))

    def join(self) -> None:
        self._thread.join(timeout=5)


def _seconds(text: str) -> Optional[float]:
    """The finite number ``text`` holds, or None (no number, NaN, infinite)."""
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _log_progress(path: Optional[str]) -> list:
    """(step, elapsed_time) of each entry of a LogReport file so far ([] where none can be read yet)."""
    if not path:
        return []
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return []
    out = []
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        if isinstance(entry, dict) and isinstance(entry.get("elapsed_time"), (int, float)):
            step = entry.get("epoch", entry.get("iteration", i + 1))
            out.append((int(step), float(entry["elapsed_time"])))
    return out


def run_trial(argv: list, env: dict, trial, timeout: Optional[float], log: Optional[str] = None,
              poll: float = 0.2) -> Outcome:
    """Run one trial's command and judge it.

    Args:
        argv: the command line.
        env: its environment.
        trial: the ``optuna.Trial`` (its pruner sees the progress).
        timeout: seconds the command may run (None: no limit); past it, it is stopped and pruned.
        log: a LogReport file the command writes (removed first, so that an old one is not read).
        poll: seconds between two looks at the command.

    Returns:
        The :class:`Outcome`.

    Example::

        >>> run_trial(["python", "train.py"], dict(os.environ), trial, timeout=600).state
        'complete'
    """
    if log and os.path.exists(log):
        os.remove(log)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    except OSError as e:
        return Outcome(FAILED, None, f"cannot start {argv[0]!r}: {e}", 0.0)
    out = _Output(proc.stdout)
    reported = set()
    try:
        while proc.poll() is None:
            if timeout is not None and time.monotonic() - start > timeout:
                stop_group(proc)
                return Outcome(PRUNED, None, f"ran past --trial-timeout ({timeout:g} s): stopped",
                               time.monotonic() - start)
            for step, value in sorted(set(out.progress) | set(_log_progress(log))):
                if step not in reported:
                    reported.add(step)
                    trial.report(value, step)
                    if trial.should_prune():
                        stop_group(proc)
                        return Outcome(PRUNED, None, f"pruned at step {step} ({value:.3g} s, slower than the "
                                                     f"median of earlier trials there)", time.monotonic() - start)
            time.sleep(poll)
    finally:
        if proc.poll() is None:
            stop_group(proc)
    wall = time.monotonic() - start
    out.join()
    if proc.returncode != 0:
        last = "\n".join(out.tail) or "(no output)"
        return Outcome(FAILED, None, f"exit code {proc.returncode}; its last lines:\n{last}", wall)
    if out.bad_objective is not None:
        return Outcome(FAILED, None, f"its objective line {out.bad_objective.strip()!r} holds no finite number: print "
                                     f"'torchmn-objective: SECONDS', e.g. torchmn-objective: 12.5", wall)
    logged = _log_progress(log)
    value = out.objective if out.objective is not None else logged[-1][1] if logged else wall
    return Outcome(COMPLETE, value, "", wall)
