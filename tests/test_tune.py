"""`torchmn tune` on tiny real commands: resuming a killed search, pruning a trial past its timeout,
stopping on a command that always fails, and one clear line for bad input."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, clean_env, run_job

# The "tune" extra's dependency (installed with the dev tools): missing, it fails the tests, not skips them.
import optuna  # noqa: E402

from torchmn import resources  # noqa: E402

# Prints its objective from X; hangs where the file HANG names exists and is then removed (once).
TRIAL = ("import os, sys, time\n"
         "hang = os.environ.get('HANG')\n"
         "if hang and os.path.exists(hang):\n"
         "    os.remove(hang); time.sleep(60)\n"
         "time.sleep(0.3)\n"
         "print('torchmn-objective:', float(os.environ['X']))\n")


def tune(args, cwd, env=None, timeout=90):
    return subprocess.run([sys.executable, "-m", "torchmn", "tune", *args], cwd=cwd, env=clean_env(env),
                          capture_output=True, text=True, timeout=timeout)


def trials(storage):
    study = optuna.load_study(study_name="t", storage=storage)
    return study.get_trials(deepcopy=False)


@pytest.mark.timeout(120)
def test_tune_resumes_after_being_killed(tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    args = ["--storage", storage, "--study-name", "t", "--only-params", "--param", "X=int:1:9", "--n-trials", "3",
            "--", sys.executable, "-c", TRIAL]
    hang = tmp_path / "hang"
    hang.touch()
    # The first trial hangs: kill the search while it runs, as a node failure or Ctrl-C would.
    proc = subprocess.Popen([sys.executable, "-m", "torchmn", "tune", *args], cwd=tmp_path,
                            env=clean_env({"HANG": str(hang)}), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while hang.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    # SIGKILL leaves no time to stop the trial (in a session of its own): end it by its pid too.
    orphans = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for p in orphans:
        p.kill()
    assert [t.state.name for t in trials(storage)] == ["RUNNING"]
    out = tune(["--plot", "history.png", *args], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resuming study 't' (1 trial(s) done)" in out.stderr, out.stderr
    assert (tmp_path / "history.png").stat().st_size > 1000 and "plot: history.png" in out.stdout, out.stdout
    states = [t.state.name for t in trials(storage)]
    assert states == ["FAIL", "COMPLETE", "COMPLETE"], states  # the killed one, marked failed; then the rest
    best = min(t.value for t in trials(storage) if t.value is not None)
    assert f"best ({best:.3f} s): X={int(best)} " in out.stdout and "| trial | state | time s | X |" in out.stdout, \
        out.stdout
    again = tune(args, tmp_path)  # the study holds its 3 finished trials: nothing more to run
    assert again.returncode == 0 and "resuming study 't' (3 trial(s) done)" in again.stderr, again.stderr
    assert len(trials(storage)) == 3


@pytest.mark.timeout(120)
def test_tune_leaves_the_running_trial_of_another_live_search_alone(tmp_path):
    """Two searches of one study at once (same --storage and --study-name): the second does not take
    the first's running trial for a killed search's, and both finish."""
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    command = ("import os, time\n"
               "while os.environ.get('WAIT') and not os.path.exists('release'):\n"
               "    time.sleep(0.1)\n"
               "print('torchmn-objective:', os.environ['X'])\n")
    args = ["--storage", storage, "--study-name", "t", "--only-params", "--param", "X=int:1:9", "--", sys.executable,
            "-c", command]
    first = subprocess.Popen([sys.executable, "-m", "torchmn", "tune", "--n-trials", "1", *args], cwd=tmp_path,
                             env=clean_env({"WAIT": "1"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Read only once the first search has made the storage: two processes creating its tables
        # at once would collide in sqlite ("table ... already exists").
        said = []
        reader = threading.Thread(target=lambda: said.extend(first.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any("A new study created" in line for line in said) and \
                    [t.state.name for t in trials(storage)] == ["RUNNING"]:
                break
            time.sleep(0.2)
        second = tune(["--n-trials", "2", *args], tmp_path)
        assert second.returncode == 0, second.stderr
        (tmp_path / "release").touch()
        first.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        first.kill()
    assert first.returncode == 0, "".join(said)
    assert [t.state.name for t in trials(storage)] == ["COMPLETE"] * 3, trials(storage)


@pytest.mark.timeout(120)
def test_tune_takes_a_command_option_as_documented(tmp_path):
    """`--param --x=int:...` as docs/cpu.md writes it (argparse alone takes `--x=...` for an option of
    its own); the value reaches the command as `--x N`."""
    command = "import sys; print('torchmn-objective:', sys.argv[sys.argv.index('--x') + 1])"
    out = tune(["--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--only-params", "--param", "--x=int:2:2",
                "--n-trials", "1", "--", sys.executable, "-c", command], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "best (2.000 s): " in out.stdout and "--x 2" in out.stdout, out.stdout


@pytest.mark.timeout(120)
def test_tune_prunes_a_trial_past_its_timeout(tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    (tmp_path / "hang").touch()
    out = tune(["--storage", storage, "--study-name", "t", "--only-params", "--param", "X=int:1:9", "--n-trials", "2",
                "--trial-timeout", "3", "--", sys.executable, "-c", TRIAL], tmp_path, {"HANG": str(tmp_path / "hang")})
    assert out.returncode == 0, out.stderr
    first, second = trials(storage)
    assert first.state.name == "PRUNED" and "--trial-timeout" in first.user_attrs["reason"], first
    assert second.state.name == "COMPLETE" and second.value == second.params["X"], second


@pytest.mark.timeout(120)
def test_tune_trial_past_its_timeout_leaves_no_process(tmp_path):
    """The trial's command exits on SIGTERM, a child it started ignores it: the child is killed too."""
    child = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); time.sleep(100)"
    command = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}], "
               f"stdout=open({str(tmp_path / 'child')!r}, 'w'))\ntime.sleep(100)")
    out = tune(["--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--study-name", "t", "--only-params", "--param",
                "X=int:1:9", "--n-trials", "1", "--trial-timeout", "3", "--", sys.executable, "-c", command], tmp_path)
    pid = int((tmp_path / "child").read_text())
    try:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, out.stderr
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_tune_stops_when_every_trial_fails(tmp_path):
    out = tune(["--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--n-trials", "10", "--", sys.executable, "-c",
                "import sys; print('bad config'); sys.exit(3)"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert "torchmn tune: error: 3 trials in a row failed" in out.stderr and "exit code 3" in out.stderr \
        and "bad config" in out.stderr, out.stderr
    # Each failed trial's line shows the command's last line of output.
    assert "-> failed, exit code 3; its last line: bad config" in out.stderr, out.stderr


@pytest.mark.timeout(120)
def test_tune_param_replaces_the_range_of_a_torchmn_setting(tmp_path):
    command = "import os; print('torchmn-objective:', os.environ['TORCHMN_NUM_THREADS'])"
    out = tune(["--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--param", "TORCHMN_NUM_THREADS=int:7:7",
                "--n-trials", "1", "--", sys.executable, "-c", command], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "best (7.000 s): " in out.stdout and out.stdout.splitlines()[0].count("TORCHMN_NUM_THREADS") == 1, \
        out.stdout


@pytest.mark.timeout(120)
def test_tune_searches_the_threads_despite_the_users_omp_num_threads(tmp_path):
    """The user's OMP_NUM_THREADS would win over the searched TORCHMN_NUM_THREADS in every trial
    (torchmn run leaves the thread configuration to a user who set it): the trials run without it,
    once warned, and the best command line unsets it too."""
    command = "import os; print('torchmn-objective:', os.environ['OMP_NUM_THREADS'])"  # what the pools get
    # The user's OMP_NUM_THREADS alone (a pytest worker's environment may hold other thread variables).
    env = {name: value for name, value in clean_env({"OMP_NUM_THREADS": "5"}).items()
           if name == "OMP_NUM_THREADS" or name not in resources.THREAD_VARIABLES}
    out = subprocess.run([sys.executable, "-m", "torchmn", "tune", "-np", "1", "--storage",
                          f"sqlite:///{tmp_path / 'tune.db'}", "--only-params", "--param", "TORCHMN_NUM_THREADS=int:3:3",
                          "--n-trials", "2", "--", sys.executable, "-c", command], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("OMP_NUM_THREADS=5 in the environment would override the searched thread") == 1, \
        out.stderr
    best = out.stdout.splitlines()[-1]
    assert best.startswith("best (3.000 s): env -u OMP_NUM_THREADS TORCHMN_NUM_THREADS=3 torchmn run -np 1 "), best


@pytest.mark.timeout(120)
def test_tune_resumes_a_study_with_a_param_added(tmp_path):
    """Trials from before the --param was added lack it: the best one's command line leaves it out."""
    command = "import os; print('torchmn-objective:', os.environ['X'])"
    args = ["--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--study-name", "t", "--only-params", "--param",
            "X=int:2:2"]
    assert tune([*args, "--n-trials", "1", "--", sys.executable, "-c", command], tmp_path).returncode == 0
    out = tune([*args, "--param", "Y=int:5:5", "--n-trials", "2", "--", sys.executable, "-c", command], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "| 0 | complete | 2.000 | 2 | - |" in out.stdout and "best (2.000 s): X=2 " in out.stdout \
        and "Y=" not in out.stdout.splitlines()[-1], out.stdout


@pytest.mark.timeout(120)
def test_tune_plot_without_a_suffix_writes_and_names_a_png(tmp_path):
    out = tune(["--storage", f"sqlite:///{tmp_path / 'tune.db'}", "--only-params", "--param", "X=int:1:9",
                "--n-trials", "2", "--plot", "history", "--", sys.executable, "-c", TRIAL], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "plot: history.png\n" in out.stdout and (tmp_path / "history.png").stat().st_size > 1000, out.stdout


@pytest.mark.timeout(120)
def test_tune_fails_a_trial_whose_objective_line_holds_no_number(tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    out = tune(["--storage", storage, "--study-name", "t", "--only-params", "--param", "X=int:1:9", "--n-trials", "1",
                "--", sys.executable, "-c", "print('torchmn-objective: abc')"], tmp_path)
    (trial,) = trials(storage)
    assert trial.state.name == "FAIL" and "-> failed, its objective line 'torchmn-objective: abc' holds no finite number" \
        in out.stderr, (trial, out.stderr)
    # A search without a completed trial is no success: a script running it notices.
    assert out.returncode == 1 and "torchmn tune: error: no trial completed" in out.stderr, (out.returncode, out.stderr)


@pytest.mark.timeout(120)
def test_tune_fails_a_trial_whose_objective_is_not_finite(tmp_path):
    """An objective of nan or inf is no time: the trial fails (3 in a row stop the search), not
    "completes" with it."""
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    out = tune(["--storage", storage, "--study-name", "t", "--only-params", "--param", "X=int:1:9", "--n-trials", "5",
                "--", sys.executable, "-c", "print('torchmn-objective: nan')"], tmp_path)
    assert [t.state.name for t in trials(storage)] == ["FAIL"] * 3, out.stderr
    assert out.returncode == 2 and "holds no finite number" in out.stderr, (out.returncode, out.stderr)


@pytest.mark.timeout(120)
def test_tune_reads_on_past_a_progress_line_without_a_number(tmp_path):
    """A progress line whose value is no number is passed over: the output is still read (a
    command printing much more would otherwise block on a full pipe) and the objective found."""
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    command = ("print('torchmn-intermediate: 1 .')\nfor i in range(20000): print('line', i)\n"
               "print('torchmn-intermediate: 2 e')\nprint('torchmn-objective: 42.5')")
    out = tune(["--storage", storage, "--study-name", "t", "--only-params", "--param", "X=int:1:9", "--n-trials", "1",
                "--trial-timeout", "30", "--", sys.executable, "-c", command], tmp_path)
    (trial,) = trials(storage)
    assert out.returncode == 0 and trial.state.name == "COMPLETE" and trial.value == 42.5, (trial, out.stderr)


@pytest.mark.timeout(120)
def test_tune_with_other_ranges_is_another_study(tmp_path):
    """The default study is named after the parameters' ranges too: a search over another range
    starts afresh instead of resuming one whose trials lie outside it."""
    command = "import os; print('torchmn-objective:', os.environ['X'])"
    first = tune(["--only-params", "--param", "X=int:1:2", "--n-trials", "1", "--", sys.executable, "-c", command],
                 tmp_path)
    other = tune(["--only-params", "--param", "X=int:50:60", "--n-trials", "1", "--", sys.executable, "-c", command],
                 tmp_path)
    assert first.returncode == other.returncode == 0, (first.stderr, other.stderr)
    assert "resuming" not in other.stderr and re.search(r"best \((5\d|60)\.", other.stdout), (other.stderr, other.stdout)


def test_tune_sizes_its_space_from_the_cpus_the_job_may_use(monkeypatch):
    """Slurm's allocation (1 CPU here), not the affinity alone, as torchmn info and the budget count."""
    from torchmn.tune import Tuner
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "1")
    ranges = {p.name: (p.low, p.high) for p in Tuner(["true"]).params if p.kind == "int"}
    assert ranges["TORCHMN_NUM_THREADS"] == (1, 1) and ranges["TORCHMN_INTEROP_THREADS"] == (1, 1), ranges


@pytest.mark.parametrize("args,words", [
    ([], "no command to tune"),
    (["--param", "X=int:5", "--", "true"], "--param 'X=int:5'"),
    (["--param", "X=lognormal:1:2", "--", "true"], "expected NAME=int:LOW:HIGH"),
    (["--storage", "sqlite:////nonexistent-dir/x/tune.db", "--", "true"], "cannot open the storage"),
    (["--timeout", "-1", "--", "true"], "--timeout must be a positive number of seconds, not -1"),
    (["--trial-timeout", "0", "--", "true"], "--trial-timeout must be a positive number of seconds, not 0"),
    (["--trial-timeout", "nan", "--", "true"], "--trial-timeout must be a positive number of seconds, not nan"),
    (["--param", "X=int:1:2", "--param", "X=int:30:40", "--", "true"], "--param names X more than once"),
    (["--plot", "nodir/x.png", "--", "true"], "--plot nodir/x.png: no folder 'nodir' to write it in"),
    (["--param", "X=float:nan:1", "--", "true"], "LOW and HIGH must be finite numbers"),
    (["--param", "X=log:1e-3:inf", "--", "true"], "LOW and HIGH must be finite numbers"),
])
def test_tune_refuses_bad_input(args, words, tmp_path):
    out = tune(args, tmp_path)
    assert out.returncode == 2 and words in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", ["states", "uncaught"])
def test_multi_node_study(check, tmp_path):
    """2 ranks run each trial together; a failure or a prune on one rank ends it alike on both."""
    out = run_job(WORKERS / "tune_checks.py", [f"sqlite:///{tmp_path / 'study.db'}", check], np=2, timeout=90)
    assert f"PASS {check}" in out.stdout, out.stdout + out.stderr


TRIAL_END_CHECKS = ("caught_failure_while_others_are_in_a_collective",
                    "uncaught_failure_while_others_are_in_a_collective",
                    "none_value_fails_the_trial_and_the_study_goes_on", "multi_objective_values_complete_the_trial",
                    "optuna_trial_methods_are_shared")


@pytest.mark.timeout(180)
@pytest.mark.check_job("tune-trial-end")
@pytest.mark.parametrize("check", TRIAL_END_CHECKS)
@pytest.mark.parametrize("name,np", [("hierarchical", 2), ("flat", 2), ("hierarchical", 3)])
def test_multi_node_study_ends_each_trial_alike_on_every_rank(name, np, check, request):
    """A rank raising while the others are in a collective, None or several values returned, and
    the optuna.Trial methods a DistributedTrial shares (tune_trial_end_checks.py)."""
    proc = check_job_output(request, lambda checks: run_job(WORKERS / "tune_trial_end_checks.py",
                                                            ["--name", name, *checks], np=np, timeout=150,
                                                            check=False))
    assert_check_passed(proc, check)


# Three quick trials, then one whose progress is far slower: the median pruner stops it early.
PROGRESS = ("import os, sys, time\n"
            "count = os.path.join(os.getcwd(), 'count')\n"
            "n = int(open(count).read()) if os.path.exists(count) else 0\n"
            "open(count, 'w').write(str(n + 1))\n"
            "slow = 100.0 if n == 3 else 1.0\n"
            "for step in range(4):\n"
            "    print('torchmn-intermediate:', step, slow * (step + 1), flush=True)\n"
            "    time.sleep(0.2 if slow == 1.0 else 4)\n"
            "print('torchmn-objective:', slow * 4)\n")


@pytest.mark.timeout(120)
def test_tune_prunes_a_slow_trial_from_its_progress(tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    out = tune(["--storage", storage, "--study-name", "t", "--only-params", "--param", "X=int:1:9", "--n-trials", "4",
                "--", sys.executable, "-c", PROGRESS], tmp_path)
    assert out.returncode == 0, out.stderr
    states = [t.state.name for t in trials(storage)]
    assert states == ["COMPLETE"] * 3 + ["PRUNED"], (states, out.stderr)
    assert "pruned at step 2" in trials(storage)[3].user_attrs["reason"]
