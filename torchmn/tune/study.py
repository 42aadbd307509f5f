"""``torchmn tune``'s study: trials of a command over a search space, kept in an Optuna storage so
that an interrupted search resumes, and the summary (a table of trials, the best command line)."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from torchmn import resources
from torchmn.errors import TorchmnError, TorchmnValueError
from torchmn.tune import space as space_
from torchmn.tune.trial_run import COMPLETE, PRUNED, run_trial

DEFAULT_STORAGE = "sqlite:///torchmn-tune.db"
FAILURES_IN_A_ROW = 3
# The user attribute naming the search that runs a trial: {"host", "pid", "started"}.
SEARCH = "torchmn_tune_search"


class TuneError(TorchmnError, RuntimeError):
    """``torchmn tune`` cannot go on (a storage it cannot open, a command that fails every time)."""


class Tuner:
    """Search settings of a training command: each trial is a real run of it.

    Args:
        command: the command (``["python", "train.py"]``).
        np: run each trial under ``torchmn run -np np`` (None: the command as it is).
        params: the :class:`~torchmn.tune.space.Param` list (default: torchmn's own settings,
            :func:`~torchmn.tune.space.default_space`).
        storage: an Optuna storage URL (default ``sqlite:///torchmn-tune.db``, in the working directory).
        study_name: the study's name (default: one derived from the command, so that running the
            same search again resumes it).
        trial_timeout: seconds a trial may run; past it, it is stopped and pruned.
        log: a pytorch-pfn-extras ``LogReport`` file the command writes (objective and progress).

    Raises:
        ValueError: ``command`` is empty.

    Example::

        >>> tuner = Tuner(["python", "train.py"], np=2,
        ...               params=default_space(8, 2) + [parse_param("--lr=log:1e-4:1e-1")])
        >>> study = tuner.optimize(n_trials=20)
        >>> print(tuner.summary(study))
    """

    def __init__(self, command: list, *, np: Optional[int] = None, params: Optional[list] = None,
                 storage: Optional[str] = None, study_name: Optional[str] = None,
                 trial_timeout: Optional[float] = None, log: Optional[str] = None):
        if not command:
            raise TorchmnValueError("torchmn tune needs a command: torchmn tune [options] -- python train.py")
        self.command, self.np = list(command), np
        self.params = (list(params) if params is not None else
                       space_.default_space(resources.cpu_count_available(), np or 1))
        self.storage = storage or DEFAULT_STORAGE
        # Another range or kind of a setting is another search: resuming the old one would run no
        # trial and could name a best outside the range asked for.
        key = json.dumps([self.command, np, [[p.name, p.kind, p.low, p.high, list(p.choices)] for p in self.params]])
        self.study_name = study_name or f"torchmn-tune-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
        self.trial_timeout, self.log = trial_timeout, log
        self.launch = [sys.executable, "-m", "torchmn", "run", "-np", str(np)] if np is not None else []

    def open(self, progress=None):
        """The study, created or loaded; trials a killed search left running are marked failed.

        A running trial is left alone where the search running it still lives: one on this host
        whose process is alive, or one on another host (which this one cannot check; a line says
        so). Two searches may share a study this way.

        Args:
            progress: called with a line per running trial of another host left alone (default:
                print to stderr).

        Returns:
            The ``optuna.Study`` named :attr:`study_name` in :attr:`storage`: minimizing, with a
            ``MedianPruner`` that prunes nothing until three trials have finished, nor a trial
            before its step 2 (the first steps' times are mostly start-up noise).

        Raises:
            TuneError: the storage cannot be opened.

        Example::

            >>> study = tuner.open()
        """
        import optuna

        try:
            study = optuna.create_study(storage=self.storage, study_name=self.study_name, direction="minimize",
                                        load_if_exists=True,
                                        # Not on the first steps, whose times are mostly start-up noise.
                                        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2))
        except Exception as e:  # sqlalchemy's, optuna's and the OS's errors alike
            raise TuneError(f"cannot open the storage {self.storage!r}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
        progress = progress or _to_stderr
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            owner = trial.user_attrs.get(SEARCH)
            if owner is not None and owner.get("host") != socket.gethostname():
                progress(f"torchmn tune: trial {trial.number} is running on {owner.get('host')} (pid "
                         f"{owner.get('pid')}), left to that search; if it was killed, mark the trial failed: "
                         f"optuna.load_study(...).tell({trial.number}, state=TrialState.FAIL)")
            elif owner is None or not _alive(owner):
                # skip_if_finished: another search opening the study meanwhile may have marked it.
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        return study

    def optimize(self, n_trials: int, timeout: Optional[float] = None, progress=None):
        """Run trials until the study holds ``n_trials`` finished ones (earlier runs' count) or
        ``timeout`` seconds pass.

        Args:
            n_trials: trials the study should hold in the end.
            timeout: seconds for this call (None: no limit).
            progress: called with a line per trial (default: print to stderr).

        Returns:
            The ``optuna.Study``.

        Raises:
            TuneError: the storage cannot be opened, or 3 trials in a row failed (the last error in
                the message).

        Example::

            >>> study = tuner.optimize(20, timeout=3600)
        """
        import optuna
        from optuna.trial import TrialState

        progress = progress or _to_stderr
        study = self.open(progress)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}
        done = sum(1 for t in study.get_trials(deepcopy=False) if t.state.is_finished())
        if done:
            progress(f"torchmn tune: resuming study {self.study_name!r} ({done} trial(s) done)")
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = 0
        unset = space_.overriding_thread_variables(self.params, os.environ)
        if unset and done < n_trials:
            # Kept, they would win over the searched value in every trial: the search would change nothing.
            shown = ", ".join(f"{name}={os.environ[name]}" for name in unset)
            them = "them" if len(unset) > 1 else "it"
            progress(f"torchmn tune: warning: {shown} in the environment would override the searched thread "
                     f"settings in every trial; the trials run without {them} (env -u), and so does the best "
                     f"command line")
        base_env = {k: v for k, v in os.environ.items() if k not in unset}
        while done < n_trials and (deadline is None or time.monotonic() < deadline):
            trial = study.ask()
            trial.set_user_attr(SEARCH, me)  # so that a search opening the study meanwhile leaves it alone
            values = {p.name: p.suggest(trial) for p in self.params}
            argv, env = space_.trial_command(self.params, values, self.launch + self.command, base_env)
            try:
                outcome = run_trial(argv, env, trial, self.trial_timeout, self.log)
                trial.set_user_attr("wall_s", round(outcome.wall, 3))
                if outcome.state == COMPLETE:
                    study.tell(trial, outcome.value)
                    failures = 0
                elif outcome.state == PRUNED:
                    trial.set_user_attr("reason", outcome.reason)
                    study.tell(trial, state=TrialState.PRUNED)
                    failures = 0
                else:
                    trial.set_user_attr("error", outcome.reason[-2000:])
                    study.tell(trial, state=TrialState.FAIL)
                    failures += 1
            except optuna.exceptions.UpdateFinishedTrialError:
                # Not this search's doing: another process (a search of an older torchmn, a script)
                # finished the trial while it ran. The study holds that state; this one goes on.
                state = study.get_trials(deepcopy=False)[trial.number].state.name.lower()
                progress(f"trial {trial.number}: {_settings(values)} -> not stored: another process marked it "
                         f"{state} while it ran (a second search of study {self.study_name!r} in "
                         f"{self.storage!r}?); going on")
                done += 1
                continue
            done += 1
            shown = f"{outcome.value:.3f} s" if outcome.value is not None else _first_and_last(outcome.reason)
            progress(f"trial {trial.number}: {_settings(values)} -> {outcome.state}, {shown}")
            if failures >= FAILURES_IN_A_ROW:
                raise TuneError(f"{failures} trials in a row failed, so the command fails whatever the settings; "
                                f"stopping. The last one: {outcome.reason}")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return study

    def best_command(self, study) -> Optional[str]:
        """The best trial's settings as one shell command line, to run the command with them.

        Args:
            study: the study :meth:`optimize` returned.

        Returns:
            The environment parameters as ``NAME=value`` (those the best trial had: a study resumed
            with a parameter added holds trials without it), then ``torchmn run -np N`` where ``np``
            was given, then the command with the argument parameters appended, shell-quoted; led by
            ``env -u NAME`` for each thread variable of this environment that would override the
            searched thread settings (as the trials ran without them); None where no trial completed.

        Example::

            >>> print(tuner.best_command(study))
            TORCHMN_NUM_THREADS=1 ... torchmn run -np 2 python train.py
        """
        try:
            best = study.best_trial
        except ValueError:
            return None
        # A study resumed with a --param added: trials from before it ran without it.
        searched = [p for p in self.params if p.name in best.params]
        argv, env = space_.trial_command(searched, best.params, self.command, {})
        launch = ["torchmn", "run", "-np", str(self.np)] if self.np is not None else []
        unset = [f"-u {name}" for name in space_.overriding_thread_variables(self.params, os.environ)]
        return " ".join((["env", *unset] if unset else []) + [f"{k}={shlex.quote(v)}" for k, v in env.items()]
                        + [shlex.quote(a) for a in launch + argv])

    def summary(self, study) -> str:
        """The study's trials as a table, and the best command line.

        Args:
            study: the study :meth:`optimize` returned.

        Returns:
            A Markdown table with a row per trial (number, state, time in seconds where it
            completed, each parameter's value), a blank line, then ``best (T s): COMMAND`` (see
            :meth:`best_command`) or ``no trial completed``.

        Example::

            >>> print(tuner.summary(study))
        """
        names = [p.name for p in self.params]
        rows = ["| trial | state | time s | " + " | ".join(names) + " |", "|---" * (len(names) + 3) + "|"]
        for t in study.get_trials(deepcopy=False):
            value = f"{t.value:.3f}" if t.state.name == "COMPLETE" else "-"  # a pruned one's is its last progress
            rows.append(f"| {t.number} | {t.state.name.lower()} | {value} | "
                        + " | ".join(str(t.params.get(n, "-")) for n in names) + " |")
        best = self.best_command(study)
        rows.append("")
        rows.append(f"best ({study.best_value:.3f} s): {best}" if best else "no trial completed")
        return "\n".join(rows)

    def plot(self, study, path: str) -> list:
        """Write the optimization history to ``path`` and, where Optuna can compute them, the
        parameter importances next to it (``<name>-importances<suffix>``), with matplotlib.

        The importances are left out where Optuna cannot compute them (fewer than two completed
        trials, or no parameter that varied).

        Args:
            study: the study :meth:`optimize` returned.
            path: the file of the history; its suffix picks the format (``.png``, ``.pdf``, ...);
                without one, ``.png`` is added.

        Returns:
            The files written.

        Example::

            >>> tuner.plot(study, "tune.png")
            ['tune.png', 'tune-importances.png']
        """
        import warnings

        import matplotlib
        from optuna.exceptions import ExperimentalWarning

        matplotlib.use("Agg")
        from optuna.visualization import matplotlib as plots

        # Without a suffix matplotlib would add its default format's to the history, not to the name
        # returned, nor to the importances' file: the name says what is written.
        path = path if Path(path).suffix else f"{path}.png"
        written = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            ax = plots.plot_optimization_history(study)
        ax.figure.savefig(path, bbox_inches="tight")
        written.append(path)
        target = Path(path)
        try:
            with warnings.catch_warnings():  # optuna marks its matplotlib plots experimental
                warnings.simplefilter("ignore", ExperimentalWarning)
                ax = plots.plot_param_importances(study)
            other = str(target.with_name(f"{target.stem}-importances{target.suffix}"))
            ax.figure.savefig(other, bbox_inches="tight")
            written.append(other)
        except (RuntimeError, ValueError):
            pass  # fewer than two completed trials, or no parameter varied
        return written


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _started(pid: int) -> Optional[float]:
    """When process ``pid`` started (None where it does not exist): with the pid, it names a process
    even after the pid is reused."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(owner: dict) -> bool:
    """Whether the search ``owner`` names (``{"host", "pid", "started"}``, on this host) still runs."""
    started = _started(owner.get("pid", -1))
    return started is not None and started == owner.get("started")


def _settings(values: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


def _first_and_last(reason: str) -> str:
    """A failed trial's reason in one line: how it ended, and the last line its command printed
    (the error, as a rule; every line goes to the trial's ``error`` attribute and, when trials keep
    failing, to the final message)."""
    lines = [line for line in reason.splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else reason
    return f"{lines[0].removesuffix('; its last lines:').removesuffix(':')}; its last line: {lines[-1].strip()}"
