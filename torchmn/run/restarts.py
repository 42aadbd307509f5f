"""``torchmn run --max-restarts K``: start a failed job again, up to K times.

Each start is a whole new job (``torchmn.run.job.Job``): new ranks, a new rendezvous store, a new guardian,
with ``TORCHMN_RESTART_COUNT`` telling the ranks which start they are (0, 1, ...). A stop asked for
(SIGINT, SIGTERM, SIGHUP to the launcher) ends the job, never restarts it. Users' view:
``docs/launching/local.md``; design: ``docs/design/launcher.md``.
"""
from __future__ import annotations

import dataclasses
import queue
import re
import signal
import time
from typing import TYPE_CHECKING, AbstractSet, Callable, FrozenSet, List, Mapping, Optional

from torchmn.errors import TorchmnValueError
from torchmn.run.config import LaunchConfig, RunError
from torchmn.run.processes.output import describe_exit, exit_code_of, extract_traceback

if TYPE_CHECKING:
    from torchmn.run.job import Job

# Which start of the job a rank belongs to: 0 first, 1 after the first restart, ...
TORCHMN_RESTART_COUNT = "TORCHMN_RESTART_COUNT"
# Signals that stop the job (torchmn.run.job.FORWARDED_SIGNALS): a user's or a scheduler's stop, never a restart.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def parse_restart_on(text: str) -> FrozenSet[int]:
    """Read ``--restart-on``: exit codes and signal names, comma-separated.

    A signal N stands for exit code 128+N, which is how a rank killed by it ends for the launcher
    (and how ssh and shells report it), so ``SIGKILL`` and ``137`` mean the same.

    Args:
        text: e.g. ``"1,137,SIGKILL"``; names with or without ``SIG``, in any case.

    Returns:
        The exit codes.

    Raises:
        ValueError: a part is neither an exit code 1-255 nor a signal name.

    Example::

        >>> sorted(parse_restart_on("1, SIGKILL,term"))
        [1, 137, 143]
    """
    codes = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.isdigit():
            code = int(part)
            if not 0 < code < 256:
                raise TorchmnValueError(f"--restart-on: exit code {code} is outside 1-255 (0 is success; a rank "
                                        f"killed by signal N ends with 128+N)")
            codes.add(code)
            continue
        name = part.upper() if part.upper().startswith("SIG") else "SIG" + part.upper()
        try:
            codes.add(128 + signal.Signals[name].value)
        except KeyError:
            raise TorchmnValueError(f"--restart-on: {part!r} is neither an exit code nor a signal name; give "
                                    f"e.g. 1,137,SIGKILL") from None
    if not codes:
        raise TorchmnValueError("--restart-on needs at least one exit code or signal name, e.g. 1,SIGKILL")
    return frozenset(codes)


def describe_codes(codes: AbstractSet[int]) -> str:
    """``--restart-on``'s codes in words, a signal's name beside its 128+N.

    Args:
        codes: exit codes.

    Returns:
        e.g. ``1, 137 (SIGKILL)``.

    Example::

        >>> describe_codes({137, 1})
        '1, 137 (SIGKILL)'
    """
    words = []
    for code in sorted(codes):
        try:
            words.append(f"{code} ({signal.Signals(code - 128).name})" if code > 128 else str(code))
        except ValueError:
            words.append(str(code))
    return ", ".join(words)


@dataclasses.dataclass(frozen=True)
class FailedStart:
    """How one start of the job failed: its first failed rank.

    Attributes:
        start: the start's ``TORCHMN_RESTART_COUNT``.
        rank, host: the rank that failed first, and its host.
        returncode: its return code (-N: killed by signal N).
        error: the last line of its traceback (or of its stderr), "" when it printed nothing.
        seconds: how long the start ran.
    """

    start: int
    rank: int
    host: str
    returncode: int
    error: str
    seconds: float

    @property
    def exit_code(self) -> int:
        """The shell-style exit code: 128+N for a rank killed by signal N."""
        return exit_code_of(self.returncode)

    def describe(self) -> str:
        """One line: the start, the rank, its host, how it ended and its error.

        Returns:
            e.g. ``start 0 (ran 12.3 s): rank 1 (host n1) failed with exit code 3: ValueError: bad``.

        Example::

            >>> FailedStart(1, 0, "n1", -9, "", 40.2).describe()
            'start 1 (ran 40.2 s): rank 0 (host n1) was killed by signal SIGKILL (exit code 137)'
        """
        error = f": {self.error}" if self.error else ""
        return (f"start {self.start} (ran {self.seconds:.1f} s): rank {self.rank} (host {self.host}) "
                f"{describe_exit(self.returncode)}{error}")


def _failure_of(job: "Job", start: int, seconds: float) -> Optional[FailedStart]:
    """The rank failure that ended ``job``, or None when something else ended it (success, a stop,
    a rank that did not start in time, another node's failure)."""
    failed = job.first_failure
    if failed is None or job.received_signal is not None or job.start_failure or job.node_failure:
        return None
    if failed.returncode < 0:
        # Killed by a signal: that is the cause; its last line of output (progress, or a traceback it
        # handled long before) is not an error.
        return FailedStart(start, failed.slot.rank, failed.slot.host, failed.returncode, "", seconds)
    # torch.distributed prefixes a rank's traceback lines with "[rank1]: ": the rank is named already.
    lines = [_TORCH_PREFIX.sub("", line).strip() for line in extract_traceback(list(failed.output.tail))]
    lines = [line for line in lines if line]
    return FailedStart(start, failed.slot.rank, failed.slot.host, failed.returncode, lines[-1] if lines else "", seconds)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class Restarts:
    """Runs a job, and starts it again after a rank fails, as ``config`` allows.

    Args:
        config: the job's settings (``max_restarts``, ``restart_on``, ``restart_delay``).
        env: the launcher's environment; each start's ranks get it with ``TORCHMN_RESTART_COUNT``.
        make_job: builds one start of the job from the config and its environment (``torchmn.run.job.Job``).

    Attributes:
        failures: how each failed start failed, in order.
        stop_signal: the first SIGINT/SIGTERM/SIGHUP the launcher received, if any.
    """

    def __init__(self, config: LaunchConfig, env: Mapping[str, str],
                 make_job: Callable[[LaunchConfig, Mapping[str, str]], "Job"]):
        self.config = config
        self.env = dict(env)
        self.make_job = make_job
        self.job: Optional["Job"] = None
        self.failures: List[FailedStart] = []
        self.stop_signal: Optional[int] = None
        self.between_starts: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        self.console = None

    def on_signal(self, signum: int, frame) -> None:
        """The launcher's signal handler (``torchmn.run.launch.run`` installs it): a stop is remembered,
        so that it is never followed by a restart, and every signal goes to the running job, if any.

        Between two starts, a signal is queued instead: a stop ends the wait for the restart, any
        other signal is reported as having no rank to go to.

        Args:
            signum: the signal received.
            frame: passed on.

        Example::

            >>> for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):   # doctest: +SKIP
            ...     signal.signal(sig, restarts.on_signal)
        """
        if signum in STOP_SIGNALS and self.stop_signal is None:
            self.stop_signal = signum
        job = self.job
        if job is not None:
            job.on_signal(signum, frame)
        else:
            self.between_starts.put(signum)  # reentrant, as the job's own queue

    def run(self) -> int:
        """Start the job, and again after each failure that may be restarted.

        A start that fails is started again, after ``restart_delay`` seconds, while the failure's
        exit code is one ``restart_on`` names (any, when None), fewer than ``max_restarts``
        restarts have been made, and no stop signal came. What the restarts were for is reported
        on the console when the job ends.

        Returns:
            The exit code of the last start (see ``torchmn.run.job.Job.watch``), or 128+N when
            signal N stopped the launcher while it waited to restart.

        Raises:
            RunError: the job cannot run as asked (also: a restart that cannot start, its message
                then naming the restart).

        Example::

            >>> import os
            >>> from torchmn.run.job import Job
            >>> config = LaunchConfig(["python", "train.py"], np=2, max_restarts=3, restart_on={137})
            >>> code = Restarts(config, os.environ, Job).run()   # doctest: +SKIP
        """
        config = self.config
        count = 0
        while True:
            job = self.make_start(count)
            self.console = job.console
            started = time.monotonic()
            self.job = job
            try:
                code = job.run_once()
            except RunError as e:
                if count == 0:
                    raise
                raise RunError(f"restart {count} of {config.max_restarts} could not start: {e}",
                               exit_code=e.exit_code) from e
            finally:
                self.job = None
            failure = _failure_of(job, count, time.monotonic() - started)
            if failure is None:
                self._report_end(code)
                return code
            self.failures.append(failure)
            if not self._may_restart(failure):
                return code
            count += 1
            if not self._wait(count, failure):
                return 128 + self.stop_signal

    def make_start(self, count: int) -> "Job":
        """Build one start of the job, nothing started yet: its ranks' environment is the launcher's
        with ``TORCHMN_RESTART_COUNT`` set to ``count``. ``torchmn run --dry-run`` shows start 0.

        Args:
            count: which start: 0 first, 1 after the first restart, ...

        Returns:
            The job (``make_job``'s).

        Raises:
            RunError: the job cannot run as asked; also ``--max-restarts`` in a Slurm step of
                several ``torchmn run`` tasks.

        Example::

            >>> from torchmn.run.job import Job
            >>> restarts = Restarts(LaunchConfig(["python", "train.py"], np=2), {"PATH": "/usr/bin"}, Job)
            >>> restarts.make_start(1).base_env["TORCHMN_RESTART_COUNT"]
            '1'
        """
        job = self.make_job(self.config, {**self.env, TORCHMN_RESTART_COUNT: str(count)})
        if count == 0:
            self._refuse_one_launcher_per_node(job)
        return job

    def _refuse_one_launcher_per_node(self, job: "Job") -> None:
        if self.config.max_restarts and job.nodes is not None:
            step = job.nodes.step
            if step.kind == "Slurm task":
                instead = ("Let Slurm restart the job instead: `#SBATCH --requeue`, and `scontrol requeue "
                           "$SLURM_JOB_ID` when it fails (docs/launching/slurm.md)")
            else:
                instead = "Let the platform restart the nodes' launchers instead (a restart policy)"
            raise RunError(
                f"--max-restarts does not work with one torchmn run per node ({step.tasks} {step.kind}s): the "
                f"launchers on every node would have to restart together. {instead}, or run one torchmn run "
                f"for all nodes with -H/--hostfile.")

    def _may_restart(self, failure: FailedStart) -> bool:
        """Whether ``failure`` is followed by a restart; if not, say why (with --max-restarts)."""
        config = self.config
        if config.max_restarts == 0:
            return False
        if self.stop_signal is not None:
            self._say(f"torchmn run: received {signal.Signals(self.stop_signal).name}; not restarting.",
                      earlier=True)
            return False
        if config.restart_on is not None and failure.exit_code not in config.restart_on:
            self._say(f"torchmn run: not restarting: exit code {failure.exit_code} is not one that "
                      f"--restart-on names ({describe_codes(config.restart_on)}).", earlier=True)
            return False
        if failure.start >= config.max_restarts:
            self._give_up()
            return False
        return True

    def _wait(self, count: int, failure: FailedStart) -> bool:
        """Announce restart ``count`` and wait ``restart_delay``; False when a stop came meanwhile."""
        config = self.config
        self._say(f"torchmn run: restarting the job in {config.restart_delay:g} s (restart {count} of "
                  f"--max-restarts {config.max_restarts}; its ranks see {TORCHMN_RESTART_COUNT}={count}), "
                  f"after {failure.describe()}")
        deadline = time.monotonic() + config.restart_delay
        while self.stop_signal is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            try:
                signum = self.between_starts.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if signum not in STOP_SIGNALS:
                self._say(f"torchmn run: received {signal.Signals(signum).name} while waiting to restart, with "
                          f"no rank running to pass it to; restarting as planned.")
        self._say(f"torchmn run: received {signal.Signals(self.stop_signal).name} while waiting to restart; "
                  f"stopped (restart {count} of {config.max_restarts} did not start).", earlier=True)
        return False

    def _give_up(self) -> None:
        failures = self.failures
        lines = [f"torchmn run: gave up after {_plural(len(failures) - 1, 'restart')} (--max-restarts "
                 f"{self.config.max_restarts}): the job failed every time it started, last with exit code "
                 f"{failures[-1].exit_code}:"]
        lines += [f"  {f.describe()}" for f in failures]
        if len({(f.returncode, f.error) for f in failures}) == 1:
            lines.append("torchmn run: every start failed the same way, so restarting does not help here: "
                         "fix its cause (see the failed rank's output above).")
        self._say("\n".join(lines))

    def _report_end(self, code: int) -> None:
        """The end of a job that restarted: what the restarts were for."""
        if not self.failures:
            return
        how = "completed" if code == 0 else f"ended with exit code {code}"
        self._say(f"torchmn run: the job {how} after {_plural(len(self.failures), 'restart')} (--max-restarts "
                  f"{self.config.max_restarts}), which followed:\n"
                  + "\n".join(f"  {f.describe()}" for f in self.failures))

    def _say(self, text: str, earlier: bool = False) -> None:
        """One launcher message; ``earlier`` adds the failures that restarted the job before the last."""
        if earlier and len(self.failures) > 1:
            text += "\ntorchmn run: the job had restarted after:\n" + "\n".join(
                f"  {f.describe()}" for f in self.failures[:-1])
        self.console.message(text)
