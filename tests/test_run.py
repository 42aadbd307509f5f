"""`torchmn run` with real processes: environment, output, rendezvous, teardown, signals, errors."""
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from jobs import run_two_node_launchers, wait_until_handled
from ports import free_port

from torchmn import resources
from torchmn.cli import main

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
TIMEOUT = 90


def script(name):
    return os.path.join(SCRIPTS, name)


def torchmn_run(*args, env=None, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", "torchmn", "run", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def rank_lines(output, rank):
    prefix = f"[{rank}] "
    return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


def rank_env(output, rank):
    return dict(line.split("=", 1) for line in rank_lines(output, rank) if "=" in line)


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pids_in(pid_dir):
    pids = {}
    for name in os.listdir(pid_dir):
        if name.endswith(".pid"):
            with open(os.path.join(pid_dir, name)) as f:
                pids[name] = int(f.read())
    return pids


def assert_all_gone(pids, within: float = 5):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(pid) for pid in pids.values()):
        time.sleep(0.1)
    survivors = {name: pid for name, pid in pids.items() if alive(pid)}
    for pid in survivors.values():
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes left behind: {survivors}"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS") and k != "VECLIB_MAXIMUM_THREADS"}
    env.update(extra)
    return env


@pytest.mark.parametrize("np", [2, 4])
def test_each_rank_gets_its_place_and_prefixed_output(np):
    result = torchmn_run("-np", str(np), sys.executable, script("run_env.py"), env=clean_env())
    assert result.returncode == 0, result.stderr
    ports = set()
    for rank in range(np):
        env = rank_env(result.stdout, rank)
        assert env["TORCHMN_RANK"] == env["RANK"] == str(rank)
        assert env["TORCHMN_SIZE"] == env["WORLD_SIZE"] == str(np)
        assert env["TORCHMN_LOCAL_RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["TORCHMN_LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(np)
        assert env["TORCHMN_NODE_RANK"] == env["GROUP_RANK"] == "0"
        assert env["TORCHMN_NODE_COUNT"] == "1"
        assert env["TORCHMN_HOST"] == socket.gethostname()
        # horovodrun's names, which Horovod scripts read before hvd.init()
        assert (env["HOROVOD_RANK"], env["HOROVOD_SIZE"], env["HOROVOD_LOCAL_RANK"], env["HOROVOD_LOCAL_SIZE"],
                env["HOROVOD_CROSS_RANK"], env["HOROVOD_CROSS_SIZE"], env["HOROVOD_HOSTNAME"]) == \
            (str(rank), str(np), str(rank), str(np), "0", "1", socket.gethostname())
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["PYTHONUNBUFFERED"] == "1"
        ports.add(env["MASTER_PORT"])
    assert len(ports) == 1 and int(ports.pop()) > 0
    # Every line belongs to a rank: nothing unprefixed, nothing interleaved mid-line.
    assert all(line[:1] == "[" and "] " in line for line in result.stdout.splitlines())
    assert len(result.stdout.splitlines()) == np * len(rank_env(result.stdout, 0))


@pytest.mark.parametrize("np", [2, 4])
def test_plain_gloo_env_init_works(np):
    result = torchmn_run("-np", str(np), "--", sys.executable, script("run_allreduce.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    total = np * (np + 1) // 2
    for rank in range(np):
        assert rank_lines(result.stdout, rank) == [f"allreduce ok rank={rank} size={np} sum={total}"]


def test_master_port_is_used_and_port_in_use_is_named(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["run", "-np", "2", "--master-port", str(port), sys.executable, script("run_env.py")]) == 2
        err = capsys.readouterr().err
        assert f"port {port} is already in use" in err and "--master-port" in err
    # Now free: the launcher binds it itself.
    result = torchmn_run("-np", "2", "--master-port", str(port), sys.executable, script("run_env.py"))
    assert result.returncode == 0, result.stderr
    assert rank_env(result.stdout, 1)["MASTER_PORT"] == str(port)


def test_rank_that_ended_early_is_named_beside_the_failure():
    """Rank 1 ends with status 0 while rank 0 still runs, and rank 0 then fails (as it would, waiting
    for rank 1 in a collective): the report names rank 1's early end as the likely cause."""
    result = torchmn_run("-np", "2", sys.executable, "-c",
                         "import os, sys, time\n"
                         "if os.environ['RANK'] == '0':\n"
                         "    time.sleep(2)\n"
                         "    sys.exit(1)\n")
    assert result.returncode == 1, result.stderr
    assert "torchmn run: rank 0 (host " in result.stderr and "failed with exit code 1." in result.stderr, result.stderr
    assert "torchmn run: rank(s) 1 had ended with exit code 0 before: if rank 0 was waiting for them in a collective" \
        in result.stderr, result.stderr


def test_failing_rank_stops_the_job_and_is_reported(tmp_path):
    start = time.monotonic()
    result = torchmn_run("-np", "4", sys.executable, script("run_misbehave.py"), "raise", str(tmp_path), "2")
    assert time.monotonic() - start < 60  # stopped: the other ranks sleep 600 s
    assert result.returncode == 1
    assert "torchmn run: rank 2 (host " + socket.gethostname() + ") failed with exit code 1" in result.stderr
    summary = result.stderr.split("torchmn run: rank 2", 1)[1]
    assert "Traceback (most recent call last):" in summary
    assert "ValueError: boom from rank 2" in summary
    # Ranks the launcher stopped are not blamed.
    for rank in (0, 1, 3):
        assert f"torchmn run: rank {rank} " not in result.stderr
    pids = pids_in(tmp_path)
    assert len(pids) == 4
    assert_all_gone(pids)


def test_rank_killed_by_signal(tmp_path):
    result = torchmn_run("-np", "2", sys.executable, script("run_misbehave.py"), "sigkill", str(tmp_path), "1")
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 1 (host " in result.stderr and "killed by signal SIGKILL" in result.stderr
    assert_all_gone(pids_in(tmp_path))


def test_grandchildren_are_stopped_too(tmp_path):
    result = torchmn_run("-np", "2", sys.executable, script("run_misbehave.py"), "grandchild", str(tmp_path), "1")
    assert result.returncode == 1, result.stderr
    pids = pids_in(tmp_path)
    assert {"rank0.pid", "rank1.pid", "grandchild0.pid", "grandchild1.pid", "escaped0.pid"} <= set(pids)
    assert_all_gone(pids)


FORKING_RANK = """
import os, sys, torch, torchmn
comm = torchmn.create_communicator()
comm.allreduce(torch.ones(3))
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a helper that ends normally, running the exit handlers it inherited
os.waitpid(pid, 0)
print("rank", comm.allreduce(torch.ones(1)).item(), flush=True)
"""


def test_a_helper_a_rank_forks_exits_without_touching_the_ranks_groups(tmp_path):
    """A process forked from a rank holds the rank's process groups without their threads: at its
    exit it neither destroys them (waiting for ever for those threads) nor ends the rank's world."""
    path = tmp_path / "forking.py"
    path.write_text(FORKING_RANK)
    result = torchmn_run("-np", "2", sys.executable, str(path), env=clean_env(TORCHMN_TIMEOUT="30"), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert rank_lines(result.stdout, 0) == rank_lines(result.stdout, 1) == ["rank 2.0"], result.stdout


def test_process_detached_by_a_rank_that_exits_at_once_is_stopped(tmp_path):
    """A daemon (a new session) started by a rank that ends before the launcher ever looks: it is
    re-parented to the launcher, which stops it with the job."""
    code = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)'], start_new_session=True); "
            f"open(os.path.join({str(tmp_path)!r}, 'daemon' + os.environ['RANK'] + '.pid'), 'w').write(str(p.pid))")
    result = torchmn_run("-np", "2", sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    pids = pids_in(tmp_path)
    assert set(pids) == {"daemon0.pid", "daemon1.pid"}, pids
    assert_all_gone(pids)


def signal_when_up(command, tmp_path, *signals):
    """``torchmn run -np 2 command``; once both ranks have written their pid file into ``tmp_path``,
    send the launcher ``signals``, 0.5 s apart. Its exit code, stdout and stderr."""
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "2", *command],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(pids_in(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids_in(tmp_path)) == 2
        for i, sig in enumerate(signals):
            time.sleep(0.5 if i else 0)
            launcher.send_signal(sig)
        out, err = launcher.communicate(timeout=TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=TIMEOUT)
    return launcher.returncode, out, err


def test_sigint_is_forwarded_and_exits_130(tmp_path):
    code, out, err = signal_when_up([sys.executable, script("run_misbehave.py"), "sleep", str(tmp_path), "-1"],
                                    tmp_path, signal.SIGINT)
    assert code == 130
    assert "received SIGINT; forwarded it to all 2 ranks" in err
    # The ranks got SIGINT (a KeyboardInterrupt), not just a kill, and are not blamed.
    assert "KeyboardInterrupt" in err
    assert "failed with exit code" not in err
    assert_all_gone(pids_in(tmp_path))


def test_a_signal_the_launcher_was_started_ignoring_stays_ignored():
    """`nohup torchmn run ...`: the terminal's SIGHUP reaches neither the launcher nor its ranks."""
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable, "-c",
                                 "import time; time.sleep(4); print('finished')"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        time.sleep(2)
        launcher.send_signal(signal.SIGHUP)
        out, err = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    assert rank_lines(out, 0) == rank_lines(out, 1) == ["finished"], out


def kill_if_running(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def later_node() -> subprocess.Popen:
    """Node 1's launcher of a job of one launcher per node, waiting for node 0's store (which never comes here)."""
    return subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "1", "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--start-timeout", "100",
                             sys.executable, "-c", "pass"],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_later_node_waiting_for_node_0_stops_on_a_signal(sig):
    """One launcher per node: node 1 waits for node 0's store (which never comes here); Ctrl-C or
    SIGTERM stops it at once, as on node 0, not after --start-timeout."""
    launcher = later_node()
    try:
        # SIGTERM's handler: Python handles SIGINT from its start, torchmn run installs its own for
        # SIGINT, SIGTERM and SIGHUP together, in that order.
        wait_until_handled(launcher.pid, signal.SIGTERM)
        time.sleep(1)  # in the store's wait loop by now
        launcher.send_signal(sig)
        started = time.monotonic()
        _, err = launcher.communicate(timeout=30)
    finally:
        kill_if_running(launcher)
    assert launcher.returncode == 128 + sig and time.monotonic() - started < 10, (launcher.returncode, err)
    assert f"received {signal.Signals(sig).name} while waiting for the rendezvous store of node 0" in err, err


def test_a_later_node_waiting_for_node_0_goes_on_after_sigusr1():
    """SIGUSR1 (Slurm's --signal ahead of a time limit) while node 1 waits for node 0's store: no
    rank to pass it on to yet, so it says so and goes on waiting; SIGTERM then stops it."""
    launcher = later_node()
    try:
        wait_until_handled(launcher.pid, signal.SIGUSR1)
        time.sleep(1)  # in the store's wait loop by now
        launcher.send_signal(signal.SIGUSR1)
        time.sleep(2)
        still_waiting = launcher.poll() is None
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
    finally:
        kill_if_running(launcher)
    assert still_waiting and launcher.returncode == 128 + signal.SIGTERM, (launcher.returncode, err)
    assert "received SIGUSR1 while waiting for the rendezvous store of node 0, before any rank started" in err, err


def test_node_0_waits_for_the_other_nodes_ranks_and_says_so():
    """One launcher per node, both here: node 0's rank ends at once, node 1's 12 s later. Node 0
    keeps the store up for it, saying why it waits, and both end well."""
    results = run_two_node_launchers([], [sys.executable, "-c", "import os, time; "
                                          "time.sleep(12 * int(os.environ['GROUP_RANK'])); print('ended')"])
    assert [code for code, _, _ in results] == [0, 0], results
    assert "node(s) 1 still run theirs, which use the rendezvous store hosted here: waiting" in results[0][2], results
    assert "[1] ended" in results[1][1] and "Broken pipe" not in results[1][2], results


def test_log_dir_gets_unprefixed_output(tmp_path):
    log_dir = tmp_path / "logs"
    result = torchmn_run("-np", "2", "--log-dir", str(log_dir), "--output-ranks", "0",
                         sys.executable, script("run_env.py"))
    assert result.returncode == 0, result.stderr
    assert rank_lines(result.stdout, 1) == []  # rank 1 not shown on the console...
    for rank in (0, 1):
        text = (log_dir / f"rank.{rank}.log").read_text()
        assert f"RANK={rank}\n" in text and not text.startswith("[")  # ...but logged


LINES = "import sys\nfor i in range({n}): print('line', i, '{pad}')\n"


def test_console_closed_early_neither_hangs_nor_cuts_the_logs(tmp_path):
    """`torchmn run ... | head -2`: the job runs to its end and the log files stay whole."""
    log_dir = tmp_path / "logs"
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "2", "--log-dir", str(log_dir),
                                 sys.executable, "-c", LINES.format(n=100_000, pad='')],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = [launcher.stdout.readline() for _ in range(2)]
    launcher.stdout.close()  # as head does after its lines
    try:
        err = launcher.stderr.read().decode()
        assert launcher.wait(timeout=60) == 0, err
    finally:
        launcher.kill()
    assert all(line.startswith((b"[0] line", b"[1] line")) for line in first), first
    assert "BrokenPipe" not in err and "Traceback" not in err, err
    for rank in (0, 1):
        assert (log_dir / f"rank.{rank}.log").read_text().count("\n") == 100_000


def test_slow_console_gets_every_line(tmp_path):
    """A console slower than the ranks: the launcher waits for output that keeps coming. The
    pipes hold some 9,000 of these lines, 4-5 s of this reader, after the rank has exited."""
    reader = "import sys, time\nn = 0\nfor line in sys.stdin:\n    n += 1\n    time.sleep(0.0005)\nprint(n)\n"
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "1", "--log-dir",
                                 str(tmp_path / "logs"), sys.executable, "-c", LINES.format(n=12000, pad='')],
                                stdout=subprocess.PIPE)
    try:
        counted = subprocess.run([sys.executable, "-c", reader], stdin=launcher.stdout, capture_output=True,
                                 text=True, timeout=TIMEOUT)
        assert launcher.wait(timeout=TIMEOUT) == 0
    finally:
        launcher.kill()
    assert counted.stdout.strip() == "12000", counted
    assert (tmp_path / "logs" / "rank.0.log").read_text().count("\n") == 12000


def test_paused_console_gets_every_line(tmp_path):
    """A console that stops reading for a while (a pager, a terminal paused with Ctrl-S): the
    launcher waits for it, however long, instead of exiting with output unread."""
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "1", "--log-dir",
                                 str(tmp_path / "logs"), sys.executable, "-c", LINES.format(n=10000, pad='')],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        time.sleep(5)
        out, _ = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    assert launcher.returncode == 0 and out.count(b"\n") == 10000, out[-200:]
    assert (tmp_path / "logs" / "rank.0.log").read_text().count("\n") == 10000


def test_paused_non_blocking_console_gets_every_line(tmp_path):
    """A console pipe left non-blocking (some CI runners and Node-based parents do), paused for a
    while: a full pipe refuses writes for a moment, which is no reason to drop the rest."""
    import fcntl

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETFL, fcntl.fcntl(write_end, fcntl.F_GETFL) | os.O_NONBLOCK)
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "1", sys.executable, "-c",
                                 LINES.format(n=10000, pad='')], stdout=write_end, stderr=subprocess.DEVNULL)
    os.close(write_end)
    try:
        time.sleep(3)
        with os.fdopen(read_end, "rb") as pipe:
            out = pipe.read()
        assert launcher.wait(timeout=TIMEOUT) == 0
    finally:
        launcher.kill()
    assert out.count(b"\n") == 10000 and out.endswith(b"[0] line 9999 \n"), out[-200:]


def test_console_that_fails_neither_hangs_nor_cuts_the_logs(tmp_path):
    """A console on a full disk (/dev/full), or closed: the job runs to its end, logs whole."""
    argv = [sys.executable, "-m", "torchmn", "run", "-np", "1", "--log-dir", str(tmp_path / "logs"),
            sys.executable, "-c", LINES.format(n=100_000, pad='')]
    with open("/dev/full", "wb") as full:
        assert subprocess.run(argv, stdout=full, stderr=full, timeout=60).returncode == 0
    assert (tmp_path / "logs" / "rank.0.log").read_text().count("\n") == 100_000
    argv[argv.index(str(tmp_path / "logs"))] = str(tmp_path / "logs2")
    assert subprocess.run(argv, timeout=60, preexec_fn=lambda: os.close(1)).returncode == 0
    assert (tmp_path / "logs2" / "rank.0.log").read_text().count("\n") == 100_000


def test_a_line_of_many_megabytes_comes_through_whole():
    """A 64 MB line (a big JSON record) comes through in seconds: a launcher that rescanned its
    pending bytes at every 64 KB read would take minutes."""
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", "1", sys.executable, "-c",
                           "import sys; sys.stdout.write('x' * (64 << 20) + '\\n')"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == b"[0] " + b"x" * (64 << 20) + b"\n", proc.stderr[-500:]


RANK_WITH_A_CHILD = ("import os, signal, subprocess, sys, time\n"
                     "if os.environ['RANK'] == '1':\n"
                     "    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank deaf to SIGTERM\n"
                     "child = subprocess.Popen(['sleep', '60'])  # in the rank's process group\n"
                     "for name, pid in (('rank', os.getpid()), ('child', child.pid)):\n"
                     "    path = os.path.join(sys.argv[1], name + os.environ['RANK'] + '.pid')\n"
                     "    open(path + '.tmp', 'w').write(str(pid))\n"
                     "    os.replace(path + '.tmp', path)  # whole or not at all, for the test's polling\n"
                     "time.sleep(60)\n")


def test_ranks_end_when_the_launcher_is_killed(tmp_path):
    """SIGKILL, which the launcher cannot forward (the OOM killer, a scheduler): the ranks end
    anyway, also one that ignores SIGTERM, and so does what they started (the kernel's death signal
    reaches only the ranks themselves; the launcher's guardian process does the rest)."""
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable, "-c",
                                 RANK_WITH_A_CHILD, str(tmp_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(pids_in(tmp_path)) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)  # the pid files are written: the ranks are up
    pids = pids_in(tmp_path)
    # Slurm signals every process of a step (--signal=USR1@120): the guardian must outlive that.
    import psutil
    guardians = [p for p in psutil.Process(launcher.pid).children() if "guardian" in " ".join(p.cmdline())]
    assert len(guardians) == 1, psutil.Process(launcher.pid).children()
    guardians[0].send_signal(signal.SIGUSR1)
    time.sleep(0.3)
    launcher.kill()
    launcher.wait(timeout=10)
    assert len(pids) == 4, pids
    # The guardian's grace period (3 s) for the rank that ignores SIGTERM, and its look through
    # /proc for what the ranks started, on a machine that may be busy.
    assert_all_gone(pids, within=30)


def test_log_file_that_cannot_be_written_starts_no_rank(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    (log_dir / "rank.1.log").mkdir(parents=True)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # The pid file appears whole or not at all: the launcher may stop a rank between the two.
    code = main(["run", "-np", "2", "--log-dir", str(log_dir), sys.executable, "-c",
                 f"import os, time; path = os.path.join({str(pid_dir)!r}, os.environ['RANK'] + '.pid'); "
                 f"open(path + '.tmp', 'w').write(str(os.getpid())); os.replace(path + '.tmp', path); time.sleep(60)"])
    assert code == 2
    assert "cannot write rank 1's log file" in capsys.readouterr().err
    assert_all_gone(pids_in(pid_dir))


def test_thread_budget_reaches_ranks_unless_user_set_it():
    result = torchmn_run("-np", "2", sys.executable, script("run_env.py"), env=clean_env())
    assert result.returncode == 0, result.stderr
    expected = str(max(1, resources.cpu_count_available() // 2))
    for rank in (0, 1):
        env = rank_env(result.stdout, rank)
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["TORCHMN_NUM_THREADS"] == expected

    result = torchmn_run("-np", "2", sys.executable, script("run_env.py"), env=clean_env(OMP_NUM_THREADS="3"))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        env = rank_env(result.stdout, rank)
        assert env["OMP_NUM_THREADS"] == "3"
        assert env["TORCHMN_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "<unset>"

    # An empty OMP_NUM_THREADS (which OpenMP ignores: a thread per core) does not switch the budget off.
    result = torchmn_run("-np", "2", sys.executable, script("run_env.py"), env=clean_env(OMP_NUM_THREADS=""))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        env = rank_env(result.stdout, rank)
        assert env["OMP_NUM_THREADS"] == env["TORCHMN_NUM_THREADS"] == expected


@pytest.mark.parametrize("argv, message", [
    (["run", "-np", "0", "true"], "-np must be at least 1, got 0"),
    (["run", "-np", "2"], "no command given"),
    (["run", "-np", "2", "--"], "no command given"),
    (["run", "-np", "1", "--start-timeout", "nan", "true"], "--start-timeout must be a positive number of seconds"),
    (["run", "-np", "1", "--start-timeout", "inf", "true"], "--start-timeout must be a positive number of seconds"),
])
def test_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_command_not_found_is_named(capsys):
    assert main(["run", "-np", "2", "no-such-command-xyz", "arg"]) == 127
    err = capsys.readouterr().err
    assert "command not found: 'no-such-command-xyz'" in err and "rank 0 on host" in err


def test_command_on_the_exported_path_is_found(tmp_path):
    """-x PATH=... is the PATH the ranks get, so the command is looked up on it."""
    tool = tmp_path / "mytool"
    tool.write_text("#!/bin/sh\necho TOOL RAN\n")
    tool.chmod(0o755)
    proc = torchmn_run("-np", "1", "-x", f"PATH={tmp_path}:{os.environ['PATH']}", "mytool", timeout=60)
    assert proc.returncode == 0 and "[0] TOOL RAN" in proc.stdout, proc.stderr


def test_orphans_that_end_are_reaped():
    """The launcher adopts what ranks leave running (it is their subreaper); those that end must not
    stay zombies for the whole job."""
    code = ("import os, subprocess, time, psutil\n"
            "for _ in range(20):\n"
            "    os.system('sleep 0.1 &')\n"
            # An orphan the launcher saw while its parent still ran (it notes descendants every 0.5 s).
            "subprocess.run(['sh', '-c', 'sleep 1 & sleep 0.8'])\n"
            "time.sleep(2.5)\n"
            "launcher = psutil.Process(os.getppid())\n"
            "print('ZOMBIES', sum(c.status() == psutil.STATUS_ZOMBIE for c in launcher.children()))\n")
    proc = torchmn_run("-np", "1", sys.executable, "-c", code, timeout=60)
    assert "[0] ZOMBIES 0" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("source", ["kernel_lists", "process_table"])
def test_process_tree_finds_what_psutil_finds(source, monkeypatch):
    """The launcher's look at the ranks' processes (twice a second) finds the same descendants as
    psutil's own walk, from the kernel's per-thread children lists and from the whole table."""
    from torchmn.run.processes import tree

    if source == "process_table":
        monkeypatch.setattr(tree, "_children_files_exist", lambda: False)
    elif not tree._children_files_exist():
        pytest.fail("this kernel names no children in /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
    # A child, a grandchild, and one started from a thread that is not the main one (the kernel
    # lists it under that thread while the thread lives).
    code = ("import subprocess, threading, time\n"
            "subprocess.Popen(['sh', '-c', 'sleep 30 & sleep 30'])\n"
            "threading.Thread(target=lambda: subprocess.Popen(['sleep', '30']).wait(), daemon=True).start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n")
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert root.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while len(psutil.Process(root.pid).children(recursive=True)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        expected = sorted(p.pid for p in psutil.Process(root.pid).children(recursive=True))
        assert len(expected) == 4, expected
        assert sorted(tree.descendants(root.pid, tree.look())) == expected
        assert tree.descendants(2**22 + 1, tree.look()) == []  # no such process
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()


def test_children_of_the_caller_keep_their_exit_codes():
    """run() as a library call: the launcher reaps orphans that ranks leave, never the caller's
    own children, whose Popen would then see exit code 0."""
    from torchmn.run.launch import LaunchConfig, run

    own = subprocess.Popen(["sh", "-c", "exit 3"])
    assert run(LaunchConfig([sys.executable, "-c", "import time; time.sleep(1.5)"], np=1)) == 0
    assert own.wait(timeout=10) == 3


def test_guardian_outlives_a_signal_sent_while_it_starts():
    """Slurm signals every process of a step; one that reaches the guardian before its interpreter
    has set its handlers (at once, here) must wait for them, not end it with SIGUSR1's default."""
    from torchmn.run.processes.supervisor import start_guardian

    process = start_guardian("no-such-job", grace=1.0)
    try:
        process.send_signal(signal.SIGUSR1)
        process.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert process.poll() is None, f"the guardian ended with {process.returncode}"
        process.stdin.write(b"done\n")
        process.stdin.close()
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    # The launcher's own mask is as it was.
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_watcher_and_guardian_start_without_torch():
    """The remote watcher and the guardian run beside the ranks for the whole job, started as the
    launcher starts them (``python -m MODULE``): the package root loads its names lazily, so neither
    imports torch (``-X importtime`` lists every module a process imports)."""
    from torchmn.run.processes import guardian
    from torchmn.run.remote.protocol import WATCHER_MODULE

    # The watcher's stdin stays open until it ends: its end is the launcher's teardown, which would
    # stop the rank (`true`) if it came first. The guardian ends when told "done".
    for module, args, stdin in ((WATCHER_MODULE, ["--", "true"], None),
                                (guardian.__name__, ["TORCHMN_JOB_ID", "no-such-job", "1"], b"done\n")):
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", module, *args], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=err, env=clean_env())
            if stdin is not None:
                proc.stdin.write(stdin)
                proc.stdin.close()
            try:
                code = proc.wait(timeout=60)
            finally:
                proc.stdin.close()
                proc.kill()
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        imported = {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if "|" in line}
        # ``-m`` runs the module as __main__ after importing its packages, the root among them.
        assert code == 0 and "torchmn" in imported, stderr[-3000:]
        assert "torch" not in imported and "torch.distributed" not in imported, sorted(imported)


def test_bad_log_dir(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert main(["run", "-np", "2", "--log-dir", str(not_a_dir / "sub"), "true"]) == 2
    err = capsys.readouterr().err
    assert "cannot create --log-dir" in err and str(not_a_dir / "sub") in err


def test_unreachable_hosts_are_named(capsys):
    assert main(["run", "-np", "2", "-H", "nosuchhost-a:1,nosuchhost-b:1", "true"]) == 2
    err = capsys.readouterr().err
    assert "host nosuchhost-a: cannot be reached over ssh" in err and "host nosuchhost-b" in err


def test_console_script_entry_point_and_help():
    result = subprocess.run([sys.executable, "-m", "torchmn", "run", "--help"], capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0 and "-np N" in result.stdout and "--start-timeout" in result.stdout


def test_progress_bar_redraws_come_through_prefixed():
    """tqdm-style "\r" redraws are forwarded as they happen, each with its rank's prefix; a
    "\r\n" line end is kept whole."""
    code = ("import sys, time\n"
            "for p in (10, 20):\n"
            "    sys.stderr.write(f'{p}%\\r'); sys.stderr.flush(); time.sleep(0.2)\n"
            "sys.stderr.write('done\\r\\n'); sys.stderr.flush()\n")
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", "1", sys.executable, "-c", code],
                          capture_output=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert b"[0] 10%\r[0] 20%\r[0] done\r\n" in proc.stderr, proc.stderr


def test_usr1_and_usr2_reach_the_ranks_which_go_on(tmp_path):
    """SIGUSR1/SIGUSR2 (Slurm's --signal=USR1@120 before a time limit) are notifications: passed on to
    every rank, as mpirun does, and the job goes on; the launcher does not die of them."""
    code = ("import os, signal, sys, time\n"
            "got = []\n"
            "for s in (signal.SIGUSR1, signal.SIGUSR2):\n"
            "    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))\n"
            f"path = os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK'] + '.pid')\n"
            "open(path + '.tmp', 'w').write(str(os.getpid()))\n"
            "os.replace(path + '.tmp', path)  # whole, when the test reads it\n"
            "deadline = time.monotonic() + 30\n"
            "while len(got) < 2 and time.monotonic() < deadline:\n"
            "    time.sleep(0.05)\n"
            "print('got', ' '.join(got), flush=True)\n")
    returncode, out, err = signal_when_up([sys.executable, "-c", code], tmp_path, signal.SIGUSR1, signal.SIGUSR2)
    assert returncode == 0, err
    assert sorted(line for line in out.splitlines() if "got" in line) == \
        ["[0] got SIGUSR1 SIGUSR2", "[1] got SIGUSR1 SIGUSR2"], out
    assert "received SIGUSR1; passed it on to 2 running rank(s)" in err, err


def test_runs_with_env_variables_a_script_exported():
    """RANK and WORLD_SIZE in torchmn run's own environment (a batch script's, a Kubeflow pod's) are
    no launcher that started copies of it: the job runs."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    result = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable, "-c",
                             "import os; print('rank', os.environ['TORCHMN_RANK'])"], env=env, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "rank" in line) == ["[0] rank 0", "[1] rank 1"]
    # ... but a scheduler may have started a copy on each host: the launcher says what that means.
    assert "warning: RANK=0 and WORLD_SIZE=2 are set; if a scheduler started this command" in result.stderr


def test_command_options_that_abbreviate_the_launchers_pass_through():
    """--log, --out, --verb belong to the command: never taken for (or refused as ambiguous with)
    --log-dir/--log-level, --output-ranks/--output-filename, --verbose."""
    proc = torchmn_run("-np", "1", sys.executable, "-c", "import sys; print(sys.argv[1:])",
                       "--log", "x", "--out", "y", "--verb", "--log-level", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "[0] ['--log', 'x', '--out', 'y', '--verb', '--log-level']" in proc.stdout


# -- torchmn run --dry-run ------------------------------------------------------------------------

def dry_run_ranks(output):
    """{rank: {"place": the rank's line, "command": its command line, "env": {NAME: VALUE}, "stdin":
    {NAME: VALUE}}} of a dry run ("stdin": the -x variables written to a remote rank's watcher)."""
    ranks, current, section = {}, None, "env"
    for line in output.splitlines():
        if line.startswith("rank ") and ": host " in line:
            current = ranks.setdefault(int(line.split()[1].rstrip(":")), {"place": line, "env": {}, "stdin": {}})
            section = "env"
        elif current is not None and line.startswith("  command: "):
            current["command"] = line[len("  command: "):]
        elif current is not None and line.startswith("  -x variables (written to the watcher's stdin"):
            section = "stdin"
        elif current is not None and line.startswith("    ") and "=" in line:
            name, value = line.strip().split("=", 1)
            current[section][name] = value
    return ranks


def assert_no_secret(output, *secrets):
    assert "TORCHMN_JOB_TOKEN=<secret>" in output
    # A job token is 64 hex digits; nothing of the kind is printed.
    assert not re.search(r"[0-9a-f]{32}", output), output
    for secret in secrets:
        assert secret not in output


def test_dry_run_gives_each_rank_the_variables_a_real_run_gives(tmp_path):
    """The dry run's variables are those a real run's ranks get (run_env.py prints them), but for
    what only the start chooses; and it starts nothing: its command would leave a file."""
    marker = tmp_path / "started"
    env = clean_env(TORCHMN_JOB_TOKEN="f" * 64)  # a batch script's: never printed
    real = torchmn_run("-np", "2", sys.executable, script("run_env.py"), env=env)
    assert real.returncode == 0, real.stderr
    dry = torchmn_run("--dry-run", "-np", "2", sys.executable, script("run_env.py"), str(marker), env=env)
    assert dry.returncode == 0, dry.stderr
    assert not marker.exists() and "nothing was started" in dry.stdout
    assert_no_secret(dry.stdout, "f" * 64)
    ranks = dry_run_ranks(dry.stdout)
    assert sorted(ranks) == [0, 1]
    for rank in (0, 1):
        seen = rank_env(real.stdout, rank)
        planned = ranks[rank]["env"]
        assert ranks[rank]["command"] == f"{sys.executable} {script('run_env.py')} {marker}"
        assert f"rank {rank}: host {socket.gethostname()}, this machine; local rank {rank} of 2, node 0 of 1" \
            == ranks[rank]["place"]
        for name, value in seen.items():
            shown = planned.get(name, env.get(name, "<unset>"))  # only what torchmn adds or changes is listed
            if name == "MASTER_PORT":
                assert shown == "<chosen at start>"
            else:
                assert shown == value, name
        assert planned["TORCHMN_JOB_ID"] == "<chosen at start>" and planned["TORCHMN_RESTART_COUNT"] == "0"
    assert "MASTER_PORT=<chosen at start> (a free port the OS picks)" in dry.stdout


def test_dry_run_of_a_later_node_shows_its_relay(capsys):
    """A node above 0 gives its ranks its relay to node 0's store, as the real run does."""
    assert main(["run", "--dry-run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.2.3",
                 "--master-port", "29731", "-np", "2", sys.executable, "train.py"]) == 0
    out = capsys.readouterr().out
    env = dry_run_ranks(out)[3]["env"]
    assert env["MASTER_ADDR"] == "127.0.0.1", env
    assert env["MASTER_PORT"] == "<chosen at start> (this node's relay to the store of node 0 at 10.1.2.3:29731)", env
    assert "rendezvous: node 0 on " in out, out


def test_one_launcher_per_node_takes_master_port_from_the_environment(capsys, monkeypatch):
    """--nnodes without --master-port: node 0's port is MASTER_PORT (docs/launching/nodes.md)."""
    monkeypatch.setenv("MASTER_PORT", "29752")
    assert main(["run", "--dry-run", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "-np", "1",
                 sys.executable, "train.py"]) == 0
    assert "\n  MASTER_PORT=29752\n" in capsys.readouterr().out


def test_dry_run_opens_no_store_and_starts_no_process(monkeypatch, capsys):
    """In the launcher itself: no socket is bound or connected, no process started."""
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run started something")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(socket.socket, "bind", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    assert main(["run", "--dry-run", "-np", "2", "--master-port", "29555", sys.executable, "train.py"]) == 0
    out = capsys.readouterr().out
    assert dry_run_ranks(out)[1]["env"]["MASTER_PORT"] == "29555"
    assert main(["run", "--dry-run", "-np", "2", "-H", "nosuchhost-a:1,nosuchhost-b:1", "train.py"]) == 0
    assert "rank 1: host nosuchhost-b, over ssh" in capsys.readouterr().out


def test_dry_run_for_other_hosts_shows_the_ssh_command_lines(tmp_path):
    """Hosts that do not resolve are fine: nothing contacts them. Each rank's ssh command line is
    the one a real run would start, its variables those listed, the token on none of them."""
    key = tmp_path / "id_test"
    dry = torchmn_run("--dry-run", "-np", "4", "-H", "nosuchhost-a:2,nosuchhost-b:2", "-p", "2222", "-i", str(key),
                      "-x", "WANDB_API_KEY=sekrit-value", "-x", "NCCL_DEBUG=INFO",
                      "python", "train.py", "--epochs", "1", env=clean_env(OMP_NUM_THREADS="2"))
    assert dry.returncode == 0, dry.stderr
    assert_no_secret(dry.stdout, "sekrit-value")
    assert "nosuchhost-a  2 slots, ranks 0-1: another host" in dry.stdout
    assert "MASTER_ADDR=<chosen at start> (the address of this machine that the remote hosts see" in dry.stdout
    ranks = dry_run_ranks(dry.stdout)
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, info in ranks.items():
        host, local = ("nosuchhost-a", rank) if rank < 2 else ("nosuchhost-b", rank - 2)
        assert info["place"] == f"rank {rank}: host {host}, over ssh; local rank {local} of 2, node {rank // 2} of 2"
        argv = shlex.split(info["command"])
        assert argv[:2] == ["ssh", "-o"] and argv[-6:-2] == ["-i", str(key), "-p", "2222"] and argv[-2] == host
        words = shlex.split(argv[-1])
        assert words[:5] == ["cd", os.getcwd(), "&&", "exec", "env"]
        command_at = words.index(sys.executable)
        assert words[command_at:] == [sys.executable, "-m", "torchmn.run.remote.watcher", "--", "python", "train.py",
                                      "--epochs", "1"]
        on_line = dict(word.split("=", 1) for word in words[5:command_at])
        assert on_line == info["env"]
        assert on_line["RANK"] == on_line["TORCHMN_RANK"] == str(rank)
        assert on_line["LOCAL_RANK"] == str(local) and on_line["GROUP_RANK"] == str(rank // 2)
        assert on_line["WORLD_SIZE"] == "4" and on_line["TORCHMN_HOST"] == host
        # -x values go to the watcher's stdin, not on the command line: shown apart, masked.
        assert "WANDB_API_KEY" not in on_line and "NCCL_DEBUG" not in on_line
        assert on_line["TORCHMN_EXPORTS_ON_STDIN"] == "1"
        assert info["stdin"] == {"NCCL_DEBUG": "INFO", "WANDB_API_KEY": "<secret>"}, info
        assert on_line["OMP_NUM_THREADS"] == "2" and on_line["TORCHMN_JOB_TOKEN_ON_STDIN"] == "1"
        assert "TORCHMN_JOB_TOKEN" not in on_line


@pytest.mark.parametrize("args, code, message", [
    (["-np", "5", "-H", "nosuchhost-a:2,nosuchhost-b:2", "true"], 2, "-np 5 is larger than the 4 slots given"),
    (["-np", "2", "-H", "a:x", "true"], 2, "slot count 'x' is not an integer"),
    (["-np", "2", "no-such-command-xyz"], 127, "command not found: 'no-such-command-xyz'"),
    (["-np", "2", os.path.abspath(__file__)], 126, "is a file without permission to run it"),
    (["-np", "2", "--output-ranks", "5", "true"], 2, "--output-ranks names ranks [5]"),
    (["-np", "1", "--network-interface", "nosuch0", "true"], 2, "--network-interface 'nosuch0': no such interface"),
    (["-np", "1", "--log-dir", os.path.join(os.path.abspath(__file__), "logs"), "true"], 2,
     "logs': Not a directory"),
    (["-np", "1", "--log-dir", "/proc/torchmn-logs", "true"], 2, "cannot create --log-dir '/proc/torchmn-logs'"),
    (["-np", "1", "--timeline", "/proc/torchmn-x/t.json", "true"], 2,
     "--timeline /proc/torchmn-x/t.json: the ranks cannot write their parts"),
])
def test_dry_run_refuses_what_a_real_run_refuses(args, code, message, capsys):
    assert main(["run", "--dry-run", *args]) == code
    dry = capsys.readouterr()
    assert main(["run", *args]) == code
    real = capsys.readouterr()
    assert message in dry.err and dry.err == real.err and dry.out == ""


def test_dry_run_leaves_no_log_dir_behind(tmp_path, capsys):
    """The dry run checks --log-dir as the real run does, by making it, and removes what it made."""
    assert main(["run", "--dry-run", "-np", "1", "--log-dir", str(tmp_path / "a" / "b"), "true"]) == 0
    assert "log files: " in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_dry_run_leaves_no_timeline_folder_behind(tmp_path, capsys):
    """The dry run checks --timeline's folder as the real run does, by making it, and removes what it made."""
    assert main(["run", "--dry-run", "-np", "1", "--timeline", str(tmp_path / "a" / "t.json"), "true"]) == 0
    assert list(tmp_path.iterdir()) == [], capsys.readouterr()


def test_dry_run_names_a_host_without_ranks_by_where_it_is(capsys):
    """A host given more slots than the ranks need is still shown as another host where it is one."""
    assert main(["run", "--dry-run", "-np", "1", "-H", "localhost:2,nosuchhost-a:1", "true"]) == 0
    out = capsys.readouterr().out
    assert "localhost     2 slots, rank 0: this machine" in out and "nosuchhost-a  1 slot, no rank: another host" in out, out


def test_verbose_says_the_threads_the_exports_give(tmp_path):
    """-v's threads per rank are those the ranks get, -x exports included."""
    code = "import os; print(os.environ['OMP_NUM_THREADS'])"
    # Without the thread settings this test process got from a budget applied here (import torchmn).
    env = {k: v for k, v in clean_env().items() if not k.endswith("_NUM_THREADS") and k != "TORCHMN_THREAD_VARIABLES"}
    user = torchmn_run("-np", "2", "-v", "-x", "OMP_NUM_THREADS=3", sys.executable, "-c", code, env=env)
    budget = torchmn_run("-np", "1", "-v", "-x", "TORCHMN_NUM_THREADS=1", sys.executable, "-c", code, env=env)
    assert user.returncode == budget.returncode == 0, (user.stderr, budget.stderr)
    assert "threads per rank: set by user (OMP_NUM_THREADS=3)" in user.stderr and "[0] 3" in user.stdout, user.stderr
    assert "threads per rank: 1," in budget.stderr and "[0] 1" in budget.stdout, budget.stderr


def test_a_launcher_inside_a_torchmn_process_gives_its_ranks_their_own_budget():
    """torchmn run started from a rank (whose budget set OMP_NUM_THREADS=2 and listed it as
    torchmn's): its ranks get their own budget, and -x TORCHMN_NUM_THREADS=1 gives them 1, not the
    outer rank's 2 as if the user had set it."""
    code = "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])"
    outer = {**clean_env(), "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "TORCHMN_NUM_THREADS": "2",
             "TORCHMN_THREAD_VARIABLES": "OMP_NUM_THREADS,MKL_NUM_THREADS,TORCHMN_NUM_THREADS"}
    asked = torchmn_run("-np", "2", "-x", "TORCHMN_NUM_THREADS=1", sys.executable, "-c", code, env=outer)
    assert asked.returncode == 0 and rank_lines(asked.stdout, 0) == ["1 1"], asked.stdout + asked.stderr
    user = torchmn_run("-np", "2", "-x", "OMP_NUM_THREADS=3", sys.executable, "-c",
                       "import os; print(os.environ['OMP_NUM_THREADS'], os.environ.get('MKL_NUM_THREADS'))", env=outer)
    # The user's OMP_NUM_THREADS makes the thread configuration theirs: the outer rank's MKL count is not passed on.
    assert user.returncode == 0 and rank_lines(user.stdout, 0) == ["3 None"], user.stdout + user.stderr


def test_dry_run_does_not_import_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "torchmn", "run", "--dry-run", "-np", "2", "true"],
                          capture_output=True, text=True, timeout=60, env=clean_env())
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert proc.returncode == 0 and "torchmn.run.dry_run" in imported, proc.stderr[-3000:]
    assert "torch" not in imported, sorted(imported)


PGID_REUSE = """
import os, signal, subprocess, sys, time
from torchmn.run.processes.groups import signal_rank_group

rank = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True, env={"TORCHMN_JOB_ID": "job-1"})
rank.wait()  # the rank is reaped: its pid, the id of its group, is free again
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(rank.pid - 1))
stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
time.sleep(0.3)
signal_rank_group(rank, signal.SIGTERM, "TORCHMN_JOB_ID", "job-1")  # a teardown that comes late
time.sleep(0.3)
print("SAME ID", stranger.pid == rank.pid, "STRANGER ALIVE", stranger.poll() is None, flush=True)
stranger.kill()
"""


def test_a_late_stop_does_not_signal_another_group_that_took_the_ranks_id():
    """A rank's process group has the rank's pid as its id; once the rank is reaped and its group
    empty, the id can go to another session (another job's rank, a user's shell). Stopping the rank
    late must not signal that one. Forced in a PID namespace of its own, where the next pid can be
    chosen."""
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
                           sys.executable, "-c", PGID_REUSE], env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SAME ID True STRANGER ALIVE True" in proc.stdout, proc.stdout


def test_torchrun_started_by_a_rank_gives_its_workers_their_places(tmp_path):
    """`torchmn run -np 1 torchrun --nproc-per-node 2 ...`: the workers inherit the rank's TORCHMN_*
    variables, yet torchmn reads torchrun's: one world of two, not two worlds of one."""
    code = tmp_path / "world.py"
    code.write_text("import torch, torchmn\nc = torchmn.create_communicator()\n"
                    "import sys\nsys.stdout.write(f'WORLD {c.size} SUM {int(c.allreduce(torch.ones(1)).item())}\\n')\n")
    proc = torchmn_run("-np", "1", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-port", str(free_port()), str(code), timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("WORLD 2 SUM 2") == 2, proc.stdout + proc.stderr


def test_torchmn_run_inside_a_rank_of_several_is_refused():
    """torchmn run started by each rank of a torchmn run job would start a job per rank, apart."""
    proc = torchmn_run("-np", "2", sys.executable, "-m", "torchmn", "run", "-np", "1", sys.executable, "-c",
                       "print('RAN')")
    assert proc.returncode != 0 and "RAN" not in proc.stdout, proc.stdout + proc.stderr
    assert "torchmn run was started as one of 2 torchmn processes" in proc.stdout + proc.stderr, proc.stdout


def test_a_master_addr_that_only_resolves_to_loopback_here_is_warned_of():
    """--nnodes: node 0 given a name that resolves to a loopback address only here (Debian's
    /etc/hosts line for the machine's own name) listens there, where no other machine reaches it:
    it says so. A literal loopback address (every node on this machine) brings no warning. The
    first half runs where this machine's name resolves to loopback, as on Debian and here."""
    def node_0(addr):
        return torchmn_run("--nnodes", "2", "--node-rank", "0", "--master-addr", addr, "--master-port",
                           str(free_port()), "--start-timeout", "2", "-np", "1", sys.executable, "-c", "pass",
                           env=clean_env())
    name = socket.gethostname()
    try:
        own_name_is_loopback = socket.gethostbyname(name).startswith("127.")
    except OSError:
        own_name_is_loopback = False
    if own_name_is_loopback:
        proc = node_0(name)
        assert proc.returncode == 2, proc.stderr
        assert f"warning: {name!r} is a loopback address on this node" in proc.stderr, proc.stderr
        assert "pass node 0's IP address as --master-addr on every node" in proc.stderr, proc.stderr
    proc = node_0("127.0.0.1")
    assert proc.returncode == 2 and "is a loopback address on this node" not in proc.stderr, proc.stderr
