"""``torchmn doctor``: run a command (or attach to a running job), sample its processes, and say in
plain words whether it is oversubscribed, under-used or fine, and what to change."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import psutil

from torchmn import monitor
from torchmn.monitor import publisher
from torchmn.doctor import pools, processes, sampling, verdict
from torchmn.run.processes.groups import stop_group

EXIT_OVERSUBSCRIBED = 1
EXIT_BAD_INPUT = 2
# After --warmup, how long a started command may take to report optimizer steps: measured in the CPU
# time its processes use (per rank), since a start-up starved of CPU or waiting on a cold disk makes
# no progress however long the clock runs, with a limit on the clock for a command that stays idle.
STEP_WAIT_CPU_S = 10.0
STEP_WAIT_MAX_S = 60.0


def add_doctor(subparsers) -> None:
    """Register ``torchmn doctor`` on the ``torchmn`` command's subparsers.

    Its options: ``--pid`` or ``--job`` (a running job), ``-np`` (run the command under
    ``torchmn run``), ``--seconds``, ``--warmup``, ``--json``, and the command after ``--``; the
    subcommand's ``handler`` is :func:`run_doctor`.

    Args:
        subparsers: what ``argparse.ArgumentParser.add_subparsers`` returned.

    Example::

        >>> parser = argparse.ArgumentParser(prog="torchmn")
        >>> add_doctor(parser.add_subparsers())
        >>> parser.parse_args(["doctor", "--pid", "1234"]).pid
        1234
    """
    p = subparsers.add_parser(
        "doctor", allow_abbrev=False, help="find out why a job is slow: threads vs CPUs, per rank",
        description="Sample a job's processes for a few seconds and say whether it is oversubscribed "
                    "(more runnable threads than CPUs), under-used or fine, with the fix. Give a command "
                    "after --, run under torchmn run with -np, or attach to a running job with --pid or --job.",
        epilog="Exit status: 0 fine or under-used, 1 oversubscribed, 2 bad input. The command is stopped once "
               "it has been sampled.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--pid", type=int, default=None, help="a running process: it and its descendants")
    where.add_argument("--job", default=None, metavar="JOB_ID",
                       help="a running job's processes on this machine (TORCHMN_JOB_ID, SLURM_JOB_ID or "
                            "TORCHELASTIC_RUN_ID)")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=None, metavar="N",
                   help="run the command under torchmn run -np N")
    p.add_argument("--seconds", type=float, default=3.0, help="how long to sample (default 3)")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds to let a started command get past its imports before sampling (default 3)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(handler=run_doctor, subparser=p)


def run_doctor(args, parser) -> int:
    """The handler of ``torchmn doctor``: find the job's ranks, sample them, print the verdict.

    A command given after ``--`` is started (under ``torchmn run -np N`` with ``-np``), left
    ``--warmup`` seconds to get past its imports, sampled for ``--seconds``, then stopped with
    every process it started; with ``--pid`` or ``--job`` the running processes are only
    sampled. The findings go to stdout, as text or (``--json``) as JSON; a started command's own
    output goes to stderr. Bad input is reported on stderr, not raised.

    Args:
        args: the parsed options (``pid``, ``job``, ``np``, ``seconds``, ``warmup``, ``json``,
            ``command``).
        parser: the subcommand's parser.

    Returns:
        :data:`EXIT_OVERSUBSCRIBED` where the job is oversubscribed, :data:`EXIT_BAD_INPUT` on bad
        input (conflicting options, a process or job that is not there, a command that ends
        before it is sampled), else 0.

    Example::

        >>> from torchmn.cli import main
        >>> main(["doctor", "-np", "2", "--", "python", "train.py"])   # doctest: +SKIP
        0
    """
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not (math.isfinite(args.seconds) and math.isfinite(args.warmup)) or args.seconds <= 0 or args.warmup < 0:
        return _refuse(f"--seconds must be a positive number and --warmup not negative (got --seconds "
                       f"{args.seconds:g}, --warmup {args.warmup:g})")
    if (args.pid is not None or args.job is not None) and (command or args.np is not None):
        return _refuse("give either --pid/--job or a command (with -np), not both")
    if args.pid is not None and args.pid <= 0:
        return _refuse(f"--pid {args.pid} is no process id: give the positive id of a running process")
    started = None
    # The ranks' own step figures (torchmn.monitor): a command started here writes them into a
    # folder of the doctor's; a running job, where its ranks were given one.
    folder = tempfile.mkdtemp(prefix="torchmn-doctor-") if command and args.pid is None and args.job is None else None
    try:
        if args.pid is not None:
            roots, where = [processes.process_tree(args.pid)], f"pid {args.pid}"
        elif args.job is not None:
            roots, where = processes.job_roots(args.job), f"job {args.job}"
        elif command:
            if args.np is not None and args.np < 1:
                return _refuse(f"-np must be at least 1, not {args.np}")
            started = _start(command, args.np, folder)
            roots, where = [psutil.Process(started.pid)], " ".join(command)
            failed = _warm_up(started, args.warmup) or _wait_for_steps(started, folder, args.np or 1)
            if failed is not None:
                return _refuse(failed)
        else:
            return _refuse("nothing to inspect: give a command after -- (e.g. torchmn doctor -np 2 -- python "
                           "train.py), --pid PID or --job JOB_ID")
        ranks = processes.ranks_in_trees(roots)
        if not ranks:
            return _refuse(f"the processes of {where} ended before they could be sampled")

        def job_pids():  # again and again: DataLoader workers start at a rank's first batch
            nonlocal ranks
            ranks = processes.ranks_in_trees(roots) or ranks
            return [r.pid for r in ranks] + [w for r in ranks for w in r.workers]
        samples = sampling.sample(job_pids, args.seconds)
        steps = _of_these_ranks(publisher.read_folder(folder or _folder_of(ranks)), ranks)
    except processes.ProcessGone as e:
        return _refuse(str(e))
    finally:
        if started is not None:
            if started.poll() is None:  # said first, so that the launcher's "received SIGTERM" that follows is ours
                print("torchmn doctor: stopping the command (SIGTERM), as after every sample", file=sys.stderr,
                      flush=True)
            stop_group(started)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    limits = processes.job_cpu_limits(ranks)
    d = verdict.diagnose(ranks, samples, limits, args.seconds, pools.probe(ranks[0].settings), steps)
    print(json.dumps(d.to_json(), indent=1) if args.json else verdict.report(d, where), flush=True)
    return EXIT_OVERSUBSCRIBED if d.verdict == verdict.OVERSUBSCRIBED else 0


def _refuse(message: str) -> int:
    sys.stderr.write(f"torchmn doctor: error: {message}\n")
    return EXIT_BAD_INPUT


def _wait_for_steps(proc: subprocess.Popen, folder: str, ranks: int) -> Optional[str]:
    """After the warm-up, wait for the started command's ranks to report optimizer steps, so that the
    sampling window covers training, not start-up; a message where the command ended meanwhile.

    A rank reports once it has created a communicator. The wait ends when ``ranks`` ranks have
    reported at least two steps each. It gives up (the CPU samples still tell, the step figures
    stay empty) once the command's processes have used STEP_WAIT_CPU_S seconds of CPU per rank
    without any report -- a command that makes no communicator -- or as much again after the
    first report, or after STEP_WAIT_MAX_S on the clock in either phase. The budget is CPU time,
    not the clock, because a start-up (several ranks importing torch) on a loaded machine or a
    cold disk can take any time on the clock but takes a few CPU-seconds per rank.
    """
    def phase():
        return time.monotonic() + STEP_WAIT_MAX_S, _cpu_seconds(proc) + STEP_WAIT_CPU_S * ranks

    (deadline, cpu_budget), reported = phase(), False
    while time.monotonic() < deadline and _cpu_seconds(proc) < cpu_budget:
        if proc.poll() is not None:
            return _ended(proc.returncode, f"before it could be sampled: after the warm-up, torchmn doctor waits "
                                           f"for its ranks to report optimizer steps (from torchmn's optimizers), up "
                                           f"to {STEP_WAIT_CPU_S:g} CPU-seconds per rank or {STEP_WAIT_MAX_S:g} s, "
                                           f"so a command that makes none needs to run longer: give it more work, or "
                                           f"a shorter --warmup")
        figures = publisher.read_folder(folder)
        if figures and not reported:
            (deadline, cpu_budget), reported = phase(), True
        if len(figures) >= ranks and all((s.get("steps") or 0) >= 3 for s in figures.values()):  # two step times
            return None
        time.sleep(0.1)
    return None


def _cpu_seconds(proc: subprocess.Popen) -> float:
    """The CPU time (user and system) the started command and its living descendants have used."""
    try:
        root = psutil.Process(proc.pid)
        tree = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in tree:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _of_these_ranks(figures: dict, ranks: list) -> dict:
    """The figures the sampled ranks wrote: a folder a user gives every job keeps the files of
    earlier ones (other ranks, other rank counts), which are not this job's."""
    pids = {r.pid for r in ranks} | {w for r in ranks for w in r.workers}  # a rank may run under a shell
    return {rank: f for rank, f in figures.items() if f.get("pid") in pids}


def _folder_of(ranks: list) -> Optional[str]:
    """The figures folder a running job's ranks were given, if any."""
    for r in ranks:
        try:
            folder = psutil.Process(r.pid).environ().get(monitor.FOLDER_VARIABLE)
        except psutil.Error:
            continue
        if folder:
            return folder
    return None


def _start(command: list, np: Optional[int], folder: Optional[str]) -> subprocess.Popen:
    argv = [sys.executable, "-m", "torchmn", "run", "-np", str(np)] + command if np is not None else command
    env = dict(os.environ, **{monitor.FOLDER_VARIABLE: folder}) if folder else None
    # Its own session, so that stopping it reaches every process it started; its output goes to
    # stderr, so that --json output stays clean.
    try:
        return subprocess.Popen(argv, stdout=sys.stderr, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    except OSError as e:
        raise processes.ProcessGone(f"cannot start {argv[0]!r}: {e}") from None


def _ended(code: int, early: str) -> str:
    """What to say of a command that ended before it was sampled: failed (its own output says why),
    or ended of itself ``early``."""
    if code != 0:
        return (f"the command failed (exit code {code}) before it could be sampled: its output above says why; "
                f"run it alone until it trains, then under torchmn doctor")
    return f"the command ended (exit code {code}) {early}"


def _warm_up(proc: subprocess.Popen, warmup: float) -> Optional[str]:
    """Wait ``warmup`` seconds; a message where the command ended meanwhile."""
    deadline = time.monotonic() + warmup
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return _ended(proc.returncode, f"within the {warmup:g} s warm-up, before it could be sampled: give it "
                                           f"more work, or a shorter --warmup")
        time.sleep(0.05)
    return None
