"""``torchmn tune -- COMMAND``: search thread, worker and bucket settings of a training command with
Optuna, each trial a real run of it."""
from __future__ import annotations

import argparse
import collections
import math
import os
import signal
import sys


def add_tune(subparsers) -> None:
    """Register ``torchmn tune`` on the ``torchmn`` command's subparsers.

    Its options: ``-np``, ``--n-trials``, ``--timeout``, ``--trial-timeout``, ``--storage``,
    ``--study-name``, ``--param`` (repeatable), ``--only-params``, ``--log``, ``--plot``, and the
    command after ``--``; the subcommand's ``handler`` is :func:`run_tune`. Nothing here imports
    torch or Optuna.

    Args:
        subparsers: what ``argparse.ArgumentParser.add_subparsers`` returned.

    Example::

        >>> parser = argparse.ArgumentParser(prog="torchmn")
        >>> add_tune(parser.add_subparsers())
        >>> parser.parse_args(["tune", "--param", "OMP_NUM_THREADS=int:1:4", "--", "python", "train.py"]).param
        ['OMP_NUM_THREADS=int:1:4']
    """
    p = subparsers.add_parser(
        "tune", allow_abbrev=False, help="search threads, DataLoader workers and bucket size with Optuna",
        description="Run COMMAND once per trial with settings Optuna suggests (torchmn's thread, inter-op, "
                    "DataLoader-worker and bucket-size variables, and any --param), minimizing the time it "
                    "reports: a line 'torchmn-objective: SECONDS', else the elapsed_time of its LogReport "
                    "(--log), else its wall time. The study lives in --storage, so running the same search "
                    "again resumes it.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=None, metavar="N",
                   help="run each trial under torchmn run -np N")
    p.add_argument("--n-trials", type=int, default=20, help="trials the study should hold in the end (20)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="stop starting trials after this")
    p.add_argument("--trial-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop and prune a trial that runs longer")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage (default sqlite:///torchmn-tune.db in the working directory)")
    p.add_argument("--study-name", default=None, help="default: derived from the command and the parameters")
    p.add_argument("--param", action="append", default=[], metavar="NAME=KIND:...",
                   help="search this too: NAME=int:LOW:HIGH, float:LOW:HIGH, log:LOW:HIGH or cat:A,B; NAME an "
                        "environment variable, or --option to pass as an argument (repeatable)")
    p.add_argument("--only-params", action="store_true", help="search only the --param ones, not torchmn's own")
    p.add_argument("--log", default=None, metavar="FILE",
                   help="the LogReport file the command writes (its elapsed_time is the objective, and its "
                        "entries feed the pruner)")
    p.add_argument("--plot", default=None, metavar="FILE", help="write the optimization history (PNG, PDF, ...)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(handler=run_tune, subparser=p)


def join_option_params(argv: list[str]) -> list[str]:
    """``--param --lr=log:1e-4:1e-1`` as ``--param=--lr=log:1e-4:1e-1``: argparse takes a value that
    starts with ``-`` for an option of its own, while a parameter passed to the command as an
    argument is named ``--option``. Everything from ``--`` on (the command) is left as it is.

    Args:
        argv: the arguments after ``torchmn tune``.

    Returns:
        The same arguments, each ``--param`` followed by an option-like value joined to it.

    Example::

        >>> join_option_params(["--param", "--lr=log:1e-4:1e-1", "--", "python", "t.py", "--param", "-x"])
        ['--param=--lr=log:1e-4:1e-1', '--', 'python', 't.py', '--param', '-x']
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] == "--param" and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--":
            out.append(f"--param={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def run_tune(args, parser) -> int:
    """The handler of ``torchmn tune``: run the search, print its summary, write the plots.

    The searched parameters are torchmn's own settings (:func:`~torchmn.tune.space.default_space`,
    sized for this process's CPUs and ``-np``) unless ``--only-params``, then every ``--param``.
    A SIGTERM ends the search as Ctrl-C does, stopping the running trial. Errors are reported on
    stderr, not raised.

    Args:
        args: the parsed options (``np``, ``n_trials``, ``timeout``, ``trial_timeout``,
            ``storage``, ``study_name``, ``param``, ``only_params``, ``log``, ``plot``,
            ``command``).
        parser: the subcommand's parser.

    Returns:
        0 once the search is done; 1 when it ran but no trial completed; 2 when it cannot run or
        go on: Optuna is not installed, no command, ``--n-trials`` or ``-np`` below 1, a malformed
        ``--param``, ``--only-params`` without a ``--param``, a ``--plot`` file in a folder that
        does not exist, or a :class:`~torchmn.tune.TuneError` (a storage it cannot open, trials
        failing in a row).

    Example::

        >>> from torchmn.cli import main
        >>> main(["tune", "-np", "2", "--n-trials", "10", "--", "python", "train.py"])   # doctest: +SKIP
        0
    """
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        from torchmn import resources
        from torchmn.tune.space import default_space, parse_param
        from torchmn.tune.study import Tuner, TuneError
    except ImportError as e:
        return _refuse(f"{e.name} is missing: pip install -e '.[tune]' in torchmn's checkout (or pip install optuna matplotlib)")
    if not command:
        return _refuse("no command to tune: torchmn tune [options] -- python train.py")
    if args.n_trials < 1 or (args.np is not None and args.np < 1):
        return _refuse("--n-trials and -np must be at least 1")
    for option, value in (("--timeout", args.timeout), ("--trial-timeout", args.trial_timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            return _refuse(f"{option} must be a positive number of seconds, not {value:g}")
    try:
        extra = [parse_param(spec) for spec in args.param]
    except ValueError as e:
        return _refuse(str(e))
    repeated = sorted(name for name, n in collections.Counter(p.name for p in extra).items() if n > 1)
    if repeated:
        return _refuse(f"--param names {', '.join(repeated)} more than once: give each setting one range")
    if args.only_params and not extra:
        return _refuse("--only-params needs at least one --param")
    # Checked now: the plot is written after the whole search, too late to find the folder missing.
    folder = os.path.dirname(args.plot) if args.plot else ""
    if folder and not os.path.isdir(folder):
        return _refuse(f"--plot {args.plot}: no folder {folder!r} to write it in; create it first, or give "
                       f"a file in an existing folder")
    # A --param of one of torchmn's own settings replaces its default range.
    mine = {p.name for p in extra}
    defaults = [] if args.only_params else default_space(resources.cpu_count_available(), args.np or 1)
    params = [p for p in defaults if p.name not in mine] + extra
    # A SIGTERM (a scheduler's, a CI's) ends the search like Ctrl-C: the running trial is stopped.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        tuner = Tuner(command, np=args.np, params=params, storage=args.storage, study_name=args.study_name,
                      trial_timeout=args.trial_timeout, log=args.log)
        study = tuner.optimize(args.n_trials, args.timeout)
    except TuneError as e:
        return _refuse(str(e))
    print(tuner.summary(study), flush=True)
    import optuna

    if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        sys.stderr.write("torchmn tune: error: no trial completed: see the failed trials' last lines above, and "
                         "run the command alone (without torchmn tune) to see it fail\n")
        return 1
    if args.plot:
        for path in tuner.plot(study, args.plot):
            print(f"plot: {path}", flush=True)
    return 0


def _refuse(message: str) -> int:
    sys.stderr.write(f"torchmn tune: error: {message}\n")
    return 2


def _terminated(signum, frame):
    raise SystemExit(128 + signum)
