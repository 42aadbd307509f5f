"""`torchmn run -H` / `--hostfile` over ssh, against real separate hosts on this machine: network
namespaces with their own address, hostname, /etc/hosts and sshd (tests/cluster/netns.py).

Needs root and `apt-get install -y openssh-server openssh-client iproute2`; without them the
cluster fixture fails (it does not skip) with a message naming the package.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from cluster.netns import NetnsCluster
from jobs import REPO, WORKERS, assert_check_passed, check_job_output, clean_env

from torchmn import network
from torchmn.cli import main
from torchmn.run.remote import hostfile, protocol, ssh

TIMEOUT = 120


# ---- hosts, hostfiles, -x and the remote command line: no cluster needed -------------------------

def test_hosts_option_forms():
    assert hostfile.parse_hosts("a:2,b:2") == [("a", 2), ("b", 2)]
    assert hostfile.parse_hosts("a, b:3, a") == [("a", 2), ("b", 3)]  # a bare host is 1 slot; repeats add up
    assert hostfile.parse_hosts("[fe80::1]:2,10.0.0.1") == [("fe80::1", 2), ("10.0.0.1", 1)]
    for bad, words in [("a:0", "at least 1"), ("a:x", "'x' is not an integer"), ("a,,b", "separated by commas"),
                       ("", "separated by commas"), ("fe80::1:2", "brackets"), ("a b:2", "not a host"),
                       ("a:1_0", "'1_0' is not an integer"), ("a:+2", "'[+]2' is not an integer"),
                       ("-oProxyCommand=x:1", "not a host")]:
        with pytest.raises(hostfile.HostsError, match=words):
            hostfile.parse_hosts(bad)


def test_hostfile_forms_and_errors_name_the_line(tmp_path):
    text = "# cluster\n\nnode1 slots=2   # first\nnode2:3\nnode3\nnode4 slots=1 max_slots=4\n"
    assert hostfile.parse_hostfile_text(text) == [("node1", 2), ("node2", 3), ("node3", 1), ("node4", 1)]
    path = tmp_path / "hosts"
    path.write_text("node1 slots=2\nnode2 cpus=4\n")
    with pytest.raises(hostfile.HostsError, match=r"line 2 \('node2 cpus=4'\): unexpected 'cpus=4'"):
        hostfile.parse_hostfile(str(path))
    with pytest.raises(hostfile.HostsError, match="line 1 .*slot count must be at least 1"):
        hostfile.parse_hostfile_text("a slots=0\n")
    # Open MPI's spellings: spaces around "=", max-slots, an IPv6 address with slots=.
    assert hostfile.parse_hostfile_text("n1 slots = 2\nn2 slots=2 max-slots=4\n[::1] slots=3\n") == \
        [("n1", 2), ("n2", 2), ("::1", 3)]
    for bad in ("n1 slots=1 slots=5\n", "n1:2 slots=3\n", "[::1]:2 slots=3\n"):
        with pytest.raises(hostfile.HostsError, match="slots given twice"):
            hostfile.parse_hostfile_text(bad)
    with pytest.raises(hostfile.HostsError, match="names no hosts"):
        hostfile.parse_hostfile_text("# nothing\n\n")
    with pytest.raises(hostfile.HostsError, match="cannot read --hostfile"):
        hostfile.parse_hostfile(str(tmp_path / "missing"))


def test_hostfile_with_bytes_that_are_no_utf8(tmp_path):
    """A comment in another encoding is a comment; a host name with such a byte is refused naming
    the file and its line."""
    path = tmp_path / "hosts"
    path.write_bytes(b"node1 slots=2 # caf\xe9\n")
    assert hostfile.parse_hostfile(str(path)) == [("node1", 2)]
    path.write_bytes(b"node1 slots=2\ncaf\xe9 slots=1\n")
    with pytest.raises(hostfile.HostsError, match=f"hostfile {path} line 2 .*is not a host name"):
        hostfile.parse_hostfile(str(path))


def test_ranks_fill_hosts_in_order():
    hosts = [("a", 2), ("b", 2), ("c", 2)]
    assert hostfile.assign_ranks(hosts, 6) == hosts
    assert hostfile.assign_ranks(hosts, 3) == [("a", 2), ("b", 1)]
    with pytest.raises(hostfile.HostsError, match=r"-np 7 is larger than the 6 slots given \(a:2, b:2, c:2\)"):
        hostfile.assign_ranks(hosts, 7)


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["run", "-np", "5", "-H", "a:2,b:2", "true"]) == 2
    assert "-np 5 is larger than the 4 slots given" in capsys.readouterr().err
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=two\n")
    assert main(["run", "-np", "2", "--hostfile", str(hostfile), "true"]) == 2
    assert f"hostfile {hostfile} line 2 ('b slots=two'): slot count 'two' is not an integer" in capsys.readouterr().err
    assert main(["run", "-np", "1", "--network-interface", "nosuch0", "true"]) == 2
    assert "--network-interface 'nosuch0': no such interface" in capsys.readouterr().err
    assert main(["run", "-np", "1", "-H", "a:1", "-x", "TORCHMN_TEST_UNSET_VAR", "true"]) == 2
    assert "-x TORCHMN_TEST_UNSET_VAR: TORCHMN_TEST_UNSET_VAR is not set here" in capsys.readouterr().err


def test_local_hosts_run_without_ssh(capsys):
    # localhost and 127.0.0.1 are this machine: no ssh (the default ssh command would fail here),
    # and one node, as in Open MPI (else each "node" would be given the whole machine's threads).
    code = "import os; print(os.environ['TORCHMN_NODE_RANK'], os.environ['TORCHMN_LOCAL_RANK'], os.environ['X'])"
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", "3", "-H", "localhost:2,127.0.0.1:1",
                           "-x", "X=forwarded", sys.executable, "-c", code],
                          capture_output=True, text=True, env=clean_env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] 0 0 forwarded", "[1] 0 1 forwarded", "[2] 0 2 forwarded"]
    assert network.is_local(socket.gethostname()) and not network.is_local("10.255.255.254")


def test_remote_command_line_keeps_every_word_and_value(tmp_path):
    """What ssh hands the remote shell: cd, env and argv survive spaces, quotes, $ and newlines."""
    env = {"A": "x y", "B": "it's $HOME", "C": "line1\nline2", "EMPTY": ""}
    argv = [sys.executable, "-c", "import os, sys; print(repr(sys.argv[1:])); print(repr([os.environ[k] "
            "for k in ('A', 'B', 'C', 'EMPTY')])); print(os.getcwd())", "a b", "'q'", '"$PATH"', "*"]
    proc = subprocess.run(["sh", "-c", ssh.shell_command(str(tmp_path), env, argv)], capture_output=True,
                          text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [repr(argv[3:]), repr(list(env.values())), str(tmp_path)]


def test_forwarded_environment():
    env = {"PATH": "/p", "PYTHONPATH": "/pp", "VIRTUAL_ENV": "/v", "HOME": "/root", "SSH_AUTH_SOCK": "/s",
           "TORCHMN_COMM_TIMEOUT": "5", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "3", "SECRET": "x"}
    exports = ssh.parse_exports(["SECRET", "EXTRA=1=2"], env)
    assert exports == {"SECRET": "x", "EXTRA": "1=2"}
    assert ssh.forwarded_env(env, exports) == {
        "PATH": "/p", "PYTHONPATH": "/pp", "VIRTUAL_ENV": "/v", "TORCHMN_COMM_TIMEOUT": "5",
        "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "3", "SECRET": "x", "EXTRA": "1=2"}
    with pytest.raises(ssh.RemoteError, match="expected NAME or NAME=VALUE"):
        ssh.parse_exports(["1BAD=x"], env)


def test_exports_travel_on_the_watchers_stdin_but_those_python_needs_to_start():
    """-x values go through the watcher's stdin (never a command line, which `ps` shows every
    user); PYTHONPATH and the like stay on the ssh line, which starts the watcher's Python."""
    assert ssh.split_exports({"PYTHONPATH": "/src", "LD_LIBRARY_PATH": "/l", "WANDB_API_KEY": "k", "X": "a b\nc"}) \
        == ({"PYTHONPATH": "/src", "LD_LIBRARY_PATH": "/l"}, {"WANDB_API_KEY": "k", "X": "a b\nc"})
    r, w = os.pipe()
    os.write(w, protocol.exports_line({"WANDB_API_KEY": "k", "X": "a b\nc"}) + b"signal 2\n")
    os.close(w)
    assert protocol.read_exports_line(r) == {"WANDB_API_KEY": "k", "X": "a b\nc"}
    assert os.read(r, 100) == b"signal 2\n"  # what follows stays for the watcher's stdin reader
    os.close(r)


def test_watcher_stops_the_rank_when_its_stdin_closes(tmp_path):
    """The remote side of a rank, run here through ``sh`` as sshd would: the watcher starts the
    rank without loading torch itself, and closing its stdin (what ssh does when the launcher
    kills it or dies) stops the rank and what the rank started."""
    pid_file = tmp_path / "pids"
    code = ("import os, subprocess, time; child = subprocess.Popen(['sleep', '300']); "
            "torch_in_watcher = 'libtorch' in open(f'/proc/{os.getppid()}/maps').read(); "
            f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}} {{torch_in_watcher}}'); "
            "time.sleep(300)")
    env = {"TORCHMN_RANK": "0", "TORCHMN_LOCAL_SIZE": "1", "PYTHONPATH": str(REPO)}
    line = ssh.rank_command(str(tmp_path), sys.executable, env, [sys.executable, "-c", code])
    watcher = subprocess.Popen(["sh", "-c", line], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=clean_env())
    try:
        assert watcher.stdout.readline().decode().strip() == protocol.STARTED_MARKER
        deadline = time.monotonic() + 30
        while len(pid_file.exists() and pid_file.read_text().split() or []) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        rank, child, torch_in_watcher = pid_file.read_text().split()
        assert torch_in_watcher == "False"
        watcher.stdin.close()
        watcher.wait(timeout=15)
        assert_gone([int(rank), int(child)])
    finally:
        watcher.kill()
        watcher.wait()


def test_watcher_ends_with_its_rank_and_stops_what_the_rank_detached(tmp_path):
    """A rank that starts a process in a new session and exits: the detached process inherits the
    rank's stdout, yet the watcher's own stdout (the ssh channel) must close when the rank exits, or
    sshd keeps the session and the job open; and the detached process goes with its rank."""
    pid_file = tmp_path / "pid"
    code = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('out', flush=True); sys.exit(3)")
    env = {"TORCHMN_RANK": "0", "TORCHMN_LOCAL_SIZE": "1", "PYTHONPATH": str(REPO)}
    line = ssh.rank_command(str(tmp_path), sys.executable, env, [sys.executable, "-c", code])
    stdin, keep_open = os.pipe()  # stdin stays open: the rank's own exit must end the watcher
    watcher = subprocess.Popen(["sh", "-c", line], stdin=stdin, stdout=subprocess.PIPE, env=clean_env())
    os.close(stdin)
    try:
        out, _ = watcher.communicate(timeout=20)
        assert watcher.returncode == 3
        assert out.decode().splitlines() == [protocol.STARTED_MARKER, "out"]
        assert_gone([int(pid_file.read_text())])
    finally:
        os.close(keep_open)
        watcher.kill()
        watcher.wait()
        if pid_file.exists() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_ctrl_c_while_hosts_are_checked_stops_at_once(tmp_path):
    """A host whose login hangs: Ctrl-C stops the launcher and its ssh client at once, instead of
    after --start-timeout."""
    pids = tmp_path / "ssh.pids"
    hanging_ssh = tmp_path / "ssh"
    hanging_ssh.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 60\n")
    hanging_ssh.chmod(0o755)
    # More hosts than are checked at once (32): the ones still queued must not start after Ctrl-C.
    hosts = ",".join(f"10.255.254.{i}:1" for i in range(1, 35))
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "34", "-H", hosts,
                                 "--ssh-command", str(hanging_ssh), "--start-timeout", "40", sys.executable, "-c",
                                 "print('ran')"], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        deadline = time.monotonic() + 20
        while (not pids.exists() or len(pids.read_text().split()) < 32) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids.exists(), "the ssh clients never started"
        start = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 130 and took < 10, (launcher.returncode, took, err)
    assert "received SIGINT while checking the hosts" in err, err
    assert_gone([int(pid) for pid in pids.read_text().split()])


def test_watcher_waits_for_a_paused_console(tmp_path):
    """The reader of a remote rank's output pauses after the rank has exited (a pager, a slow
    console): the watcher relays the rest once it reads again, however long the pause, instead of
    dropping what is still in the pipe."""
    n = 200_000
    code = f"for i in range({n}): print(i)\nprint('LAST', flush=True)\n"
    env = {"TORCHMN_RANK": "0", "TORCHMN_LOCAL_SIZE": "1", "PYTHONPATH": str(REPO)}
    line = ssh.rank_command(str(tmp_path), sys.executable, env, [sys.executable, "-c", code])
    stdin, keep_open = os.pipe()
    watcher = subprocess.Popen(["sh", "-c", line], stdin=stdin, stdout=subprocess.PIPE, env=clean_env())
    os.close(stdin)
    try:
        lines = []
        while not lines or lines[-1] != str(n - 12_000).encode():  # ~80 KB left: more than a pipe holds
            lines.append(watcher.stdout.readline().strip())
        time.sleep(5)   # the rank exits meanwhile; the watcher must not give up on its output
        lines += watcher.stdout.read().split()
        assert watcher.wait(timeout=20) == 0
    finally:
        os.close(keep_open)
        watcher.kill()
        watcher.wait()
    assert lines[-1] == b"LAST" and len(lines) == n + 2, (len(lines), lines[-1])  # + the start marker


# ---- real hosts -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def cluster():
    """h1 and h2: normal hosts; h3: a host without this Python interpreter or cluster.private_dir."""
    hosts = NetnsCluster(["h1", "h2", "h3"], bare=("h3",))
    hosts.start()  # raises (fails the tests) with what to install when something is missing
    yield hosts
    hosts.stop()


def launch(cluster, *args, timeout=TIMEOUT, env=None, cwd=REPO):
    argv = [sys.executable, "-m", "torchmn", "run", *cluster.launcher_options(), *args]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, env=clean_env(env), capture_output=True, text=True, timeout=timeout)
    proc.elapsed = time.monotonic() - start
    return proc


def hosts_arg(cluster, *entries):
    return ",".join(f"{cluster.address(name)}:{slots}" for name, slots in entries)


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(pids, seconds=15):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def assert_hosts_idle(cluster, seconds=15):
    """Nothing but the sshd daemons themselves left running on any host."""
    daemons = {process.pid for process in cluster.sshd.values()}
    deadline = time.monotonic() + seconds
    while True:
        others = [p for p in cluster.processes() if p.pid not in daemons]
        if not others or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not others, f"left running on the hosts: {[_cmdline(p) for p in others]}"


def _cmdline(process):
    try:
        return process.cmdline()
    except psutil.Error:
        return []


# Across two nodes, auto is the hierarchical communicator: shared memory inside each host, the
# hosts' first ranks over the network; split() builds sub-communicators that span both hosts.
TWO_HOST_CHECKS = ("topology", "collectives", "objects", "split", "nested_split", "mean_grad", "shard_primitives", "flat_in_flight",
                   "mismatch")


def _two_host_job(cluster, worker, checks):
    proc = launch(cluster, "-np", "4", "-H", hosts_arg(cluster, ("h1", 2), ("h2", 2)),
                  sys.executable, str(WORKERS / worker), *checks)
    assert_hosts_idle(cluster)
    print(f"2 hosts x 2 ranks, {worker} {' '.join(checks)}: {proc.elapsed:.1f} s")
    return proc


@pytest.mark.check_job("two-hosts-comm")
@pytest.mark.parametrize("check", TWO_HOST_CHECKS)
def test_two_hosts_two_ranks_each(cluster, check, request):
    proc = check_job_output(request, lambda checks: _two_host_job(cluster, "comm_checks.py", checks))
    assert_check_passed(proc, check)
    if check == "topology":
        assert "[0] TOPOLOGY size=4 inter_size=2 intra_size=2" in proc.stdout, proc.stdout


@pytest.mark.parametrize("algorithm", ["ring", "doubling"])
def test_two_hosts_average_with_each_cross_node_algorithm(cluster, algorithm):
    """Across two hosts, the hosts' first ranks allreduce by gloo's ring or by recursive doubling
    (TORCHMN_CROSS_NODE_ALGORITHM, forwarded to the remote ranks); auto's measured choice runs in
    the test above. Collectives and the gradient mean come out right either way."""
    checks = ("collectives", "mean_grad", "flat_in_flight")
    proc = launch(cluster, "-np", "4", "-H", hosts_arg(cluster, ("h1", 2), ("h2", 2)), sys.executable,
                  str(WORKERS / "comm_checks.py"), *checks, env={"TORCHMN_CROSS_NODE_ALGORITHM": algorithm})
    assert_hosts_idle(cluster)
    for check in checks:
        assert_check_passed(proc, check)


def test_hosts_of_different_rank_counts(cluster):
    """2 ranks on h1, 1 on h2: setting up shared memory (the segment, the mailboxes) is decided
    alike on every rank, and messages inside h1 and across the hosts arrive."""
    checks = ("ring", "collectives", "objects", "mean_grad")
    proc = launch(cluster, "-np", "3", "-H", hosts_arg(cluster, ("h1", 2), ("h2", 1)),
                  sys.executable, str(WORKERS / "comm_checks.py"), *checks)
    assert_hosts_idle(cluster)
    for check in checks:
        assert_check_passed(proc, check)


SHARDED_CHECKS = ("equivalence", "state_dict_format", "unused_parameter", "shared_memory_where_possible",
                  "clip_grad_norm", "state_per_parameter")


@pytest.mark.check_job("two-hosts-shard")
@pytest.mark.parametrize("check", SHARDED_CHECKS)
def test_sharded_optimizer_on_two_hosts(cluster, check, request):
    """ZeRO-1 across 2 hosts x 2 ranks: reduce-scatter and all-gather through shared memory inside
    each host and over rails (local rank i of each host) between them; one-process results."""
    proc = check_job_output(request, lambda checks: _two_host_job(cluster, "shard_checks.py", checks))
    assert_check_passed(proc, check)


DDP_HOOK_CHECKS = ("equals_ddps_own_averaging", "find_unused_parameters", "no_sync", "fp16_and_bf16_compression")


@pytest.mark.check_job("two-hosts-ddp-hook")
@pytest.mark.parametrize("check", DDP_HOOK_CHECKS)
def test_ddp_comm_hook_on_two_hosts(cluster, check, request):
    """DDP averaging through torchmn.ddp_comm_hook across 2 hosts x 2 ranks: each bucket summed in
    shared memory inside each host, then between the hosts; DDP's own averaging in the same job."""
    proc = check_job_output(request, lambda checks: _two_host_job(cluster, "ddp_checks.py", checks))
    assert_check_passed(proc, check)


LIGHTNING_CHECKS = ("matches_lightnings_ddp", "collectives_go_through_the_communicator")


@pytest.mark.check_job("two-hosts-lightning")
@pytest.mark.parametrize("check", LIGHTNING_CHECKS)
def test_lightning_strategy_on_two_hosts(cluster, check, request):
    """TorchmnStrategy across 2 hosts x 2 ranks (Trainer(devices=2, num_nodes=2)): the hierarchical
    path under Lightning, against Lightning's DDPStrategy in the same job."""
    proc = check_job_output(request, lambda checks: _two_host_job(cluster, "lightning_checks.py", checks))
    assert_check_passed(proc, check)


def test_rank_missing_on_the_other_host_is_named(cluster):
    """Across nodes: host 2's first rank never joins the optimizer's averaging. Rank 0,
    whose network allreduce with it runs in the background during backward, names it when the
    timeout hits; so does host 2's other rank, which waits for it in shared memory."""
    proc = launch(cluster, "-np", "4", "-H", hosts_arg(cluster, ("h1", 2), ("h2", 2)),
                  sys.executable, str(WORKERS / "hang_jobs.py"), "hierarchical", "optimizer", "2", timeout=90)
    named = {line.split("]", 1)[0]: line for line in proc.stdout.splitlines() if "NAMED" in line}
    assert "[0" in named and "rank 2 (" in named["[0"] and "never called it within the timeout" in named["[0"], \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[3" in named and "rank 2 (" in named["[3"], proc.stdout[-3000:]
    assert_hosts_idle(cluster)


def test_hostfile_places_ranks_and_forwards_environment(cluster, tmp_path):
    """-np 3 over 2+3 slots: h1 gets ranks 0-1, h2 rank 2. Each rank runs in the launcher's working
    directory, with PATH forwarded (the command is found only through it) and -x variables, bound by
    the watcher on its host to cores of its own (--bind core) with their count of threads."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tmn-python").symlink_to(sys.executable)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# test hosts\n{cluster.address('h1')} slots=2\n\n{cluster.address('h2')}:3  # more\n")
    code = textwrap.dedent("""
        import json, os, socket
        names = ["TORCHMN_RANK", "TORCHMN_LOCAL_RANK", "TORCHMN_LOCAL_SIZE", "TORCHMN_NODE_RANK",
                 "TORCHMN_NODE_COUNT", "TORCHMN_HOST", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "FOO", "BAR",
                 "OMP_NUM_THREADS", "SSH_CONNECTION"]
        row = {n: os.environ.get(n, "-") for n in names}
        # The hosts share this machine's processes: no command line that starts a rank (the
        # launcher's ssh clients, the remote shells) shows a -x value (the launcher's own shows
        # what the user typed).
        shown = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                shown.append(open(f"/proc/{pid}/cmdline", "rb").read())
            except OSError:
                pass
        # Both in two pieces: this code is on those command lines, and on the launcher's.
        needle, watcher = ("sekrit" + "-7f3a2").encode(), ("torchmn.run.remote" + ".watcher").encode()
        leaked = any(needle in line for line in shown if watcher in line)
        print(json.dumps(dict(row, host=socket.gethostname(), cwd=os.getcwd(), cpus=sorted(os.sched_getaffinity(0)),
                              leaked=leaked)))
    """)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "BAR": "from launcher's env sekrit-7f3a2"}
    proc = launch(cluster, "-np", "3", "--hostfile", str(hostfile), "-x", "FOO=x y sekrit-7f3a2", "-x", "BAR",
                  "--bind", "core", "tmn-python", "-c", code, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The ranks end before their store is needed: that is no error.
    assert "could not be opened" not in proc.stderr, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        rank, _, rest = line.partition("] ")
        rows[int(rank[1:])] = json.loads(rest)
    assert sorted(rows) == [0, 1, 2]
    expect = {0: ("h1", "0", "0", "2"), 1: ("h1", "0", "1", "2"), 2: ("h2", "1", "0", "1")}
    for rank, (host, node, local, local_size) in expect.items():
        row = rows[rank]
        assert (row["host"], row["TORCHMN_NODE_RANK"], row["TORCHMN_LOCAL_RANK"], row["TORCHMN_LOCAL_SIZE"]) \
            == (host, node, local, local_size), row
        assert row["TORCHMN_NODE_COUNT"] == "2" and row["TORCHMN_HOST"] == cluster.address(host)
        assert row["SSH_CONNECTION"] != "-", row  # it really ran over ssh
        assert row["cwd"] == str(tmp_path) and row["FOO"] == "x y sekrit-7f3a2"
        assert row["BAR"] == "from launcher's env sekrit-7f3a2" and not row["leaked"], row
        # The store through the host's relay on its loopback; gloo on the interface that reaches the launcher.
        assert row["MASTER_ADDR"] == "127.0.0.1" and row["GLOO_SOCKET_IFNAME"] == "eth0"
        assert int(row["OMP_NUM_THREADS"]) == len(row["cpus"]), row
    cpus = sorted(os.sched_getaffinity(0))  # the hosts share this machine's CPUs
    assert rows[2]["cpus"] == cpus and not set(rows[0]["cpus"]) & set(rows[1]["cpus"]), rows
    assert sorted(rows[0]["cpus"] + rows[1]["cpus"]) == cpus, rows
    assert_hosts_idle(cluster)


def test_tiny_training_on_two_hosts(cluster):
    """The multi-node optimizer gives the one-process result across two hosts; the rendezvous
    address is picked by interface name."""
    proc = launch(cluster, "-np", "2", "-H", hosts_arg(cluster, ("h1", 1), ("h2", 1)),
                  "--network-interface", cluster.bridge, "-v",
                  sys.executable, str(WORKERS / "optim_checks.py"), "equivalence")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[0] PASS equivalence" in proc.stdout
    assert f"rendezvous {cluster.gateway}:" in proc.stderr
    print(f"training on 2 hosts: {proc.elapsed:.1f} s")


def test_optimizer_on_two_hosts_two_ranks_each(cluster):
    """Shared memory inside each host and the network between them: the multi-node optimizer's
    buckets leave for the other host in the background while backward goes on (double buffering
    keeps them in flight into the next step); one-process results either way."""
    checks = ("equivalence", "double_buffering", "clipping", "unused_parameter")
    proc = launch(cluster, "-np", "4", "-H", hosts_arg(cluster, ("h1", 2), ("h2", 2)),
                  sys.executable, str(WORKERS / "optim_checks.py"), *checks)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for check in checks:
        assert f"[0] PASS {check}" in proc.stdout, proc.stdout[-3000:]
    assert_hosts_idle(cluster)


def test_unreachable_host_is_named_quickly(cluster):
    bad = cluster.unused_address()
    proc = launch(cluster, "-np", "2", "-H", f"{cluster.address('h1')}:1,{bad}:1", sys.executable, "-c",
                  "print('started')", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"host {bad}: cannot be reached over ssh" in proc.stderr, proc.stderr
    assert f"host {cluster.address('h1')}" not in proc.stderr  # the good host is not blamed
    assert "started" not in proc.stdout  # no rank was started anywhere
    assert proc.elapsed < 30, proc.elapsed


def test_host_without_the_interpreter_is_named(cluster):
    proc = launch(cluster, "-np", "2", "-H", hosts_arg(cluster, ("h1", 1), ("h3", 1)), sys.executable, "-c",
                  "print('started')", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"host {cluster.address('h3')}: has no Python interpreter at {sys.executable}" in proc.stderr, proc.stderr
    assert "started" not in proc.stdout


def test_host_without_the_working_directory_is_named(cluster):
    proc = launch(cluster, "-np", "2", "-H", hosts_arg(cluster, ("h1", 1), ("h3", 1)), sys.executable, "-c",
                  "print('started')", timeout=60, cwd=cluster.private_dir)
    assert proc.returncode == 2, proc.stderr
    assert f"host {cluster.address('h3')}: has no directory {cluster.private_dir}" in proc.stderr, proc.stderr
    assert "started" not in proc.stdout


def test_failing_rank_on_second_host_stops_every_host(cluster, tmp_path):
    script, raised = tmp_path / "fail_on_rank_3.py", tmp_path / "raised_at"
    script.write_text(textwrap.dedent(f"""
        import time, torchmn
        comm = torchmn.create_communicator()
        comm.barrier()
        print("ready", flush=True)
        if comm.rank == 3:
            time.sleep(1)
            open({str(raised)!r}, "w").write(str(time.time()))
            raise RuntimeError("boom on rank 3")
        time.sleep(300)
    """))
    proc = launch(cluster, "-np", "4", "-H", hosts_arg(cluster, ("h1", 2), ("h2", 2)), sys.executable,
                  str(script), timeout=90)
    stopped_after = time.time() - float(raised.read_text())
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.count("ready") == 4, proc.stdout
    assert f"rank 3 (host {cluster.address('h2')}) failed with exit code 1; stopped the other 3 running rank(s)" \
        in proc.stderr, proc.stderr
    assert "RuntimeError: boom on rank 3" in proc.stderr
    assert stopped_after < 30, stopped_after  # from the raise: not the others' 300 s sleep
    assert_hosts_idle(cluster)
    assert not [p for p in psutil.process_iter() if str(script) in " ".join(_cmdline(p))]


@pytest.mark.timeout(200)
def test_restart_starts_every_host_again(cluster, tmp_path):
    """--max-restarts with ranks on two hosts: a rank on h2 fails in the first start only; the
    launcher stops both hosts' ranks, starts them again (TORCHMN_RESTART_COUNT reaches the remote
    ranks), they meet in a new rendezvous and finish; nothing is left on the hosts."""
    script = tmp_path / "fail_once_on_h2.py"
    script.write_text(textwrap.dedent("""
        import os, torchmn
        comm = torchmn.create_communicator()
        count = int(os.environ["TORCHMN_RESTART_COUNT"])
        comm.barrier()
        print(f"start {count} on {comm.host}", flush=True)
        if count == 0 and comm.rank == 1:
            raise RuntimeError("rank 1 fails in the first start")
        comm.barrier()
        comm.finalize()
    """))
    proc = launch(cluster, "-np", "2", "-H", hosts_arg(cluster, ("h1", 1), ("h2", 1)), "--max-restarts", "1",
                  "--restart-delay", "0", sys.executable, str(script), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        starts = [int(n) for n in re.findall(rf"^\[{rank}\] start (\d) on ", proc.stdout, re.M)]
        assert starts == [0, 1], proc.stdout
    # The restart names where the failure began: rank 1 on h2, as the first rank to fail, or, where
    # rank 0's exit reached the launcher first, in rank 0's error, which names rank 1 and its error.
    h1, h2 = (re.escape(cluster.address(name)) for name in ("h1", "h2"))
    assert re.search(rf"after start 0 \(ran [\d.]+ s\): (rank 1 \(host {h2}\) failed with exit code 1: RuntimeError"
                     rf"|rank 0 \(host {h1}\) failed with exit code 1: RankFailedError: .* rank 1 \(h2\) ended with "
                     rf"an uncaught RuntimeError): rank 1 fails in the first start", proc.stderr), proc.stderr
    assert "the job completed after 1 restart (--max-restarts 1)" in proc.stderr, proc.stderr
    assert_hosts_idle(cluster)


@pytest.mark.parametrize("exit_code, helper_output", [(1, "inherited"), (0, "inherited"), (1, "devnull")])
def test_rank_that_detaches_a_process_is_reported_and_leaves_nothing(cluster, tmp_path, exit_code, helper_output):
    """Every rank starts a process in a new session, then rank 1 on h2 exits: the job must end at
    once (a detached process that kept the rank's stdout must not hold rank 1's ssh session open)
    naming rank 1 when it failed, and neither rank's detached process may outlive the job, whether
    its rank exited on its own (rank 1) or was stopped by the launcher (rank 0)."""
    stdio = "" if helper_output == "inherited" else ", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL"
    script = tmp_path / "detach.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        rank = os.environ["TORCHMN_RANK"]
        helper = subprocess.Popen(["sleep", "300"], start_new_session=True{stdio})
        open(os.path.join({str(tmp_path)!r}, rank + ".pid"), "w").write(str(helper.pid))
        print("detached", flush=True)
        if rank == "1":
            deadline = time.monotonic() + 30  # until rank 0 has detached its own
            while not os.path.exists(os.path.join({str(tmp_path)!r}, "0.pid")) and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit({exit_code})
        time.sleep(300 if {exit_code} else 0)
    """))
    proc = launch(cluster, "-np", "2", "-H", hosts_arg(cluster, ("h1", 1), ("h2", 1)), sys.executable,
                  str(script), timeout=150)
    assert proc.returncode == exit_code, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(proc.stdout.splitlines()) == ["[0] detached", "[1] detached"], proc.stdout
    if exit_code:
        assert f"rank 1 (host {cluster.address('h2')}) failed with exit code 1; stopped the other 1 running " \
               f"rank(s)" in proc.stderr, proc.stderr
    # Held open by a helper, the job would last its 300 s; ending at once takes seconds, or 33 s over
    # ssh beside the full suite on a slow day of a 2-core machine.
    assert proc.elapsed < 90, proc.elapsed
    assert_hosts_idle(cluster)


def start_up_on_two_hosts(cluster, script, stderr):
    """``torchmn run`` of ``script`` with a rank on h1 and one on h2, once both have printed 'up'."""
    argv = [sys.executable, "-m", "torchmn", "run", *cluster.launcher_options(), "-np", "2",
            "-H", hosts_arg(cluster, ("h1", 1), ("h2", 1)), sys.executable, str(script)]
    launcher = subprocess.Popen(argv, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines = [launcher.stdout.readline(), launcher.stdout.readline()]
    if sorted(lines) != ["[0] up\n", "[1] up\n"]:
        launcher.kill()
        launcher.wait(timeout=10)
        raise AssertionError(f"the ranks did not come up: {lines}")
    return launcher


def signal_when_up(cluster, script, sig):
    """Start ``script`` on h1 and h2, send the launcher ``sig`` once both ranks are up; its exit
    code, stdout and stderr."""
    launcher = start_up_on_two_hosts(cluster, script, stderr=subprocess.PIPE)
    try:
        launcher.send_signal(sig)
        # From the signal to the launcher's exit: 3-8 s on an idle 2-core machine (mostly the ranks'
        # own end: Python's exit after torch; the launcher and watchers add about 0.1 s); beside the
        # full suite it took more than 30.
        out, err = launcher.communicate(timeout=90)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    return launcher.returncode, out, err


def test_killed_launcher_leaves_nothing_on_the_hosts(cluster, tmp_path):
    """SIGKILL to the launcher: its ssh clients see stdin close, the watchers stop the ranks."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    launcher = start_up_on_two_hosts(cluster, script, stderr=subprocess.DEVNULL)
    try:
        ssh_clients = [p.pid for p in psutil.Process(launcher.pid).children()]
        assert len(ssh_clients) == 2
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    assert_gone(ssh_clients, seconds=20)
    assert_hosts_idle(cluster)


@pytest.mark.timeout(200)
def test_ctrl_c_reaches_remote_ranks_as_sigint(cluster, tmp_path):
    """Ctrl-C (SIGINT to the launcher) reaches every rank as SIGINT, remote ones too (their
    KeyboardInterrupt handlers run), as the launcher's message says; they used to get SIGTERM."""
    script = tmp_path / "report.py"
    script.write_text("import os, signal, sys, time\n"
                      "def said(s, f):\n"
                      "    print('got', signal.Signals(s).name, flush=True)\n"
                      "    sys.exit(1)\n"
                      "for s in (signal.SIGINT, signal.SIGTERM):\n"
                      "    signal.signal(s, said)\n"
                      "print('up', flush=True)\n"
                      "time.sleep(60)\n")
    code, out, err = signal_when_up(cluster, script, signal.SIGINT)
    assert code == 130, err
    assert sorted(line for line in out.splitlines() if "got" in line) == ["[0] got SIGINT", "[1] got SIGINT"], out
    assert_hosts_idle(cluster)


@pytest.mark.timeout(200)
def test_usr1_reaches_remote_ranks_which_go_on(cluster, tmp_path):
    """SIGUSR1 to the launcher is passed on to every rank, remote ones through their watcher, and
    the job goes on to exit 0 (the warning Slurm's --signal=USR1@120 gives before a time limit)."""
    script = tmp_path / "notified.py"
    script.write_text("import signal, time\n"
                      "got = []\n"
                      "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
                      "print('up', flush=True)\n"
                      "deadline = time.monotonic() + 20\n"
                      "while not got and time.monotonic() < deadline:\n"
                      "    time.sleep(0.05)\n"
                      "time.sleep(0.5)\n"
                      "print('got', len(got), 'alive', flush=True)\n")
    code, out, err = signal_when_up(cluster, script, signal.SIGUSR1)
    assert code == 0, err
    assert sorted(line for line in out.splitlines() if "got" in line) == ["[0] got 1 alive", "[1] got 1 alive"], out
    assert_hosts_idle(cluster)


def test_rank_that_never_starts_hits_the_start_timeout(cluster, tmp_path):
    """An ssh that logs in for the check but then hangs when starting the rank on h2."""
    h2 = cluster.address("h2")
    wrapper = tmp_path / "slow-ssh"
    wrapper.write_text("#!/bin/sh\ncase \"$*\" in *\" %s \"*torchmn.run.remote.watcher*) exec sleep 300;; esac\n"
                       "exec %s \"$@\"\n" % (h2, cluster.ssh_command))
    wrapper.chmod(0o755)
    proc = launch(cluster, "-np", "2", "-H", hosts_arg(cluster, ("h1", 1), ("h2", 1)), "--start-timeout", "10",
                  "--ssh-command", str(wrapper), sys.executable, "-c", "import time; time.sleep(300)", timeout=90)
    assert proc.returncode == 124, proc.stderr
    assert f"rank(s) 1 on host(s) {h2} did not start within 10 s (--start-timeout)" in proc.stderr, proc.stderr
    assert proc.elapsed < 80, proc.elapsed  # the 10 s start timeout, not the rank's 300 s sleep
    assert_hosts_idle(cluster)
    assert not [p for p in psutil.process_iter() if str(wrapper) in " ".join(_cmdline(p))]


def test_loopback_rendezvous_address_is_never_handed_to_other_hosts():
    """Behind an ssh tunnel the address the hosts log in from is this machine's loopback, and the
    fallback may be too: other hosts must not be told to connect to themselves."""
    from torchmn.network import is_loopback as _is_loopback

    assert _is_loopback("127.0.0.1") and _is_loopback("127.0.1.1") and _is_loopback("localhost")
    assert _is_loopback("::1")
    assert not _is_loopback("10.1.2.3") and not _is_loopback("no-such-host.invalid")


def test_default_ssh_trusts_a_new_host_but_never_a_changed_host_key(cluster, tmp_path):
    """torchmn run's default ssh client: a host seen for the first time is remembered
    (accept-new), a host whose key differs from the remembered one is refused, as an impostor at
    that address would otherwise receive the job's token."""
    from cluster.netns import SSH_PORT

    addr = cluster.address("h1")
    known = tmp_path / "known_hosts"
    ssh_command = ssh.DEFAULT_SSH_COMMAND + f" -F /dev/null -o UserKnownHostsFile={known} -o LogLevel=ERROR"
    argv = [sys.executable, "-m", "torchmn", "run", "--ssh-command", ssh_command, "--ssh-identity-file", cluster.key,
            "--ssh-port", str(SSH_PORT), "-np", "1", "-H", f"{addr}:1", sys.executable, "-c", "print('started')"]

    def run():
        return subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)

    known.write_text("")
    first = run()
    assert first.returncode == 0 and "started" in first.stdout, first.stderr
    assert addr in known.read_text()  # remembered
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "impostor")], check=True)
    impostor = (tmp_path / "impostor.pub").read_text().split()[:2]
    remembered = known.read_text().splitlines()
    known.write_text("".join(f"{line.split()[0]} {' '.join(impostor)}\n" for line in remembered))
    changed = run()
    assert changed.returncode != 0 and "started" not in changed.stdout, changed.stdout + changed.stderr
    assert f"host {addr}" in changed.stderr and "Host key verification failed" in changed.stderr, changed.stderr


@pytest.mark.timeout(240)  # the job's own limit is 150 s
def test_elastic_job_refills_a_lost_host_over_ssh(cluster, tmp_path):
    """An elastic job over two hosts (--min-np 1): the rank on h2 is killed; the one on h1 goes on
    alone, the launcher starts a new rank on h2 over ssh in the freed slot, it joins at the next
    commit, and the result equals a one-process replay of the membership; nothing is left on the hosts."""
    from test_elastic import ElasticRun, check_against_replay

    job = ElasticRun(tmp_path, 2, [*cluster.launcher_options(), "--min-np", "1", "--max-np", "2",
                                   "-H", hosts_arg(cluster, ("h1", 1), ("h2", 1))],
                     ["--steps", "100000", "--step-sleep", "0.05"], timeout=150)
    try:
        job.wait_for(lambda: job.steps_at(2) >= 5, "the first steps on two hosts")
        step = job.kill(1)
        job.wait_for(lambda: job.steps_at(1, after=step) >= 1, "the survivor's steps alone")
        alone = job.progress()[-1][1]
        job.wait_for(lambda: job.steps_at(2, after=alone) >= 3, "two hosts again")
        done = job.finish()
    finally:
        job.stop()
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"started worker 2 on {cluster.address('h2')}" in done.stdout, done.stdout[-3000:]
    check_against_replay(tmp_path)
    assert_hosts_idle(cluster)
