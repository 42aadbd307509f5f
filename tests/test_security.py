"""The job's token and the store's gate, with real jobs under `torchmn run` (see docs/security.md).

One job stays up while the tests of this machine probe its rendezvous store from outside
(tests/scripts/store_probe_job.py): a raw TCP client, a torch TCPStore client, processes started
with the token and with another, a greeting with a wrong token, the machine's other addresses,
the store's own port behind the gate. After each probe the job shows it still works (an allreduce
and a new store client on every rank). The multi-host tests run ranks in network namespaces
(tests/cluster/netns.py), as tests/test_multihost.py does.
"""
import datetime
import hashlib
import ipaddress
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch.distributed as dist

from cluster.netns import NetnsCluster
from jobs import REPO, clean_env
from ports import free_port
from torchmn import network
from torchmn.run.store import auth, relay, rendezvous

PROBE_JOB = str(REPO / "tests" / "scripts" / "store_probe_job.py")
ALLREDUCE = str(REPO / "tests" / "scripts" / "run_allreduce.py")
REFUSED = "refused a connection to the rendezvous store from"


class ProbedJob:
    """``torchmn run ... store_probe_job.py DIR`` in the background, its output collected as it comes."""

    def __init__(self, folder, np=2, launcher_args=(), plain=False, cwd=REPO):
        self.folder, self.np, self.rounds = folder, np, 0
        argv = [sys.executable, "-m", "torchmn", "run", "-np", str(np), *launcher_args,
                sys.executable, PROBE_JOB, str(folder)] + (["plain"] if plain else [])
        self.proc = subprocess.Popen(argv, cwd=cwd, env=clean_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()
        self.info = self._wait_for_info()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line.rstrip("\n"))

    def output(self):
        return "\n".join(self.out) + "\n--- stderr ---\n" + "\n".join(self.err)

    def _wait_for_info(self, seconds=90):
        path = os.path.join(self.folder, "job.json")
        deadline = time.monotonic() + seconds
        while not os.path.exists(path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the job never wrote {path}:\n{self.output()}")
            time.sleep(0.1)
        with open(path) as f:
            return json.load(f)

    def wait_for(self, what, predicate, seconds=30):
        deadline = time.monotonic() + seconds
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {seconds} s waiting for {what}:\n{self.output()}")
            time.sleep(0.05)

    def still_works(self):
        """Have every rank run an allreduce and open a new store client; fail unless all did."""
        self.rounds += 1
        open(os.path.join(self.folder, f"round{self.rounds}"), "w").close()
        line = f"ROUND {self.rounds} OK"
        self.wait_for(f"every rank's {line!r}", lambda: sum(line in x for x in self.out) == self.np, 60)

    def refusals(self):
        return [line for line in self.err if REFUSED in line]

    def stop(self, seconds=60):
        open(os.path.join(self.folder, "stop"), "w").close()
        try:
            self.proc.wait(seconds)
        finally:
            self.kill()
        for reader in self.readers:
            reader.join(5)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One two-rank job on this machine for every probe below; at the end it must exit 0."""
    folder = tmp_path_factory.mktemp("probed")
    started = ProbedJob(folder, launcher_args=["-v"])
    yield started
    code = started.stop()
    assert code == 0, started.output()


def launcher_refusal(job, client_port, seconds=15):
    """The launcher's line about the connection from this machine's port ``client_port``."""
    pattern = re.compile(rf"{REFUSED} 127\.0\.0\.1:{client_port}\b")
    job.wait_for(f"the launcher's line about 127.0.0.1:{client_port}",
                 lambda: any(pattern.search(line) for line in job.err), seconds)
    return [line for line in job.err if pattern.search(line)]


def test_token_reaches_every_rank_and_never_the_output(job):
    token = job.info["token"]
    assert re.fullmatch(r"[0-9a-f]{64}", token), token
    digest = hashlib.sha256(token.encode()).hexdigest()
    job.wait_for("both ranks' token lines", lambda: sum(f"TOKEN SHA256 {digest}" in x for x in job.out) == 2)
    # -v describes the job on stderr: the token is in no line the launcher writes.
    assert any("rendezvous 127.0.0.1:" in line for line in job.err), job.output()
    assert token not in job.output()
    # Nor in any command line of the job, which every user of the machine can read.
    launcher = psutil.Process(job.info["launcher_pid"])
    for process in [launcher] + launcher.children(recursive=True):
        assert token not in " ".join(process.cmdline())


def test_raw_client_without_token_is_closed_and_logged(job):
    with socket.create_connection((job.info["addr"], job.info["port"]), timeout=10) as raw:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
        try:
            answer = raw.recv(100)
        except ConnectionResetError:
            answer = b""
        client_port = raw.getsockname()[1]
    assert answer == b"", answer
    lines = launcher_refusal(job, client_port)
    assert len(lines) == 1, lines
    assert f"process {os.getpid()} (" in lines[0], lines[0]  # who: this test's process
    assert "not started with this job's token" in lines[0], lines[0]
    job.still_works()


def test_a_local_client_that_closes_at_once_is_not_called_another_host(job):
    """A process of this machine that sends a byte and closes before the gate identifies it (a port
    scanner) is named as this machine's, not as another host that skipped its relay."""
    with socket.create_connection((job.info["addr"], job.info["port"]), timeout=10) as raw:
        raw.sendall(b"\x00")
        client_port = raw.getsockname()[1]
    lines = launcher_refusal(job, client_port)
    # Named as closed before it was identified, as this process, or as a process of this user (its socket
    # still known, its process no longer holding it): whichever the race gives, never as another host.
    assert len(lines) == 1 and "another host" not in lines[0], lines
    job.still_works()


def test_a_rank_started_without_the_token_is_told_so():
    """A rank whose wrapper dropped the environment (env -u, env -i, sudo) is refused by the store:
    its error says the token is missing and how it gets lost, not to check the network."""
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", "2", "env", "-u", "TORCHMN_JOB_TOKEN",
                           sys.executable, "-c", "import torchmn; torchmn.create_communicator()"],
                          env=clean_env({"TORCHMN_TIMEOUT": "3"}), capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0
    assert "This process was started without TORCHMN_JOB_TOKEN" in proc.stderr + proc.stdout, proc.stderr[-3000:]


def test_a_client_that_sends_nothing_is_closed_and_named(job):
    with socket.create_connection((job.info["addr"], job.info["port"]), timeout=30) as silent:
        client_port = silent.getsockname()[1]
        started = time.monotonic()
        assert silent.recv(10) == b""
        waited = time.monotonic() - started
    assert 4 < waited < 20, waited  # the gate's first-byte deadline: 5 s
    lines = launcher_refusal(job, client_port)
    assert f"process {os.getpid()} (" in lines[0] and "it sent nothing within 5 s" in lines[0], lines


def test_tcpstore_client_without_token_cannot_get_or_set(job):
    start = time.monotonic()
    with pytest.raises((RuntimeError, OSError)):
        store = dist.TCPStore(job.info["addr"], job.info["port"], is_master=False,
                              timeout=datetime.timedelta(seconds=2))
        store.set("intruder", "was here")
    assert time.monotonic() - start < 20
    job.still_works()


def _store_client(job, token, key):
    """A process started with TORCHMN_JOB_TOKEN=token that sets and reads back one key."""
    code = (f"import datetime, torch.distributed as dist\n"
            f"s = dist.TCPStore({job.info['addr']!r}, {job.info['port']}, is_master=False, "
            f"timeout=datetime.timedelta(seconds=3))\n"
            f"s.set({key!r}, 'v'); print('GOT', s.get({key!r}).decode())\n")
    env = clean_env({auth.TOKEN_ENV: token})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_process_started_with_the_token_is_admitted(job):
    proc = _store_client(job, job.info["token"], "helper/key")
    assert proc.returncode == 0 and "GOT v" in proc.stdout, proc.stdout + proc.stderr


def test_process_started_with_another_token_is_refused(job):
    proc = _store_client(job, auth.new_token(), "stranger/key")
    assert proc.returncode != 0 and "GOT" not in proc.stdout, proc.stdout + proc.stderr
    job.wait_for("the launcher's line about the stranger", lambda: any(
        "not started with this job's token" in line and "(python" in line and str(os.getpid()) not in line
        for line in job.refusals()))
    job.still_works()


def test_a_client_proving_a_wrong_token_is_refused(job):
    """A client that greets, takes the gate's proof and answers with a wrong proof of its own."""
    with socket.create_connection((job.info["addr"], job.info["port"]), timeout=5) as sock:
        sock.sendall(auth.GREETING + os.urandom(auth.NONCE_SIZE))
        answer = b""
        while len(answer) < auth.NONCE_SIZE + auth.PROOF_SIZE:
            answer += sock.recv(64)
        sock.sendall(os.urandom(auth.PROOF_SIZE))
        assert sock.recv(1) == b"", "the gate should close the connection"
    job.wait_for("the line about a wrong token", lambda: any("presented a wrong token" in line
                                                             for line in job.refusals()))
    relay.connect(job.info["addr"], job.info["port"], job.info["token"], seconds=5).close()
    job.still_works()


def test_a_client_with_another_token_refuses_the_gate(job):
    """The greeting is mutual: the gate proves the token first, and a client holding another token
    stops there, before it proves anything."""
    with pytest.raises(auth.ImpostorError, match="did not prove it knows the job's token"):
        relay.connect(job.info["addr"], job.info["port"], auth.new_token(), seconds=5)
    job.wait_for("the line about the client that left", lambda: any(
        "left after the gate proved the job's token" in line for line in job.refusals()))
    job.still_works()


def _other_addresses():
    found = []
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(address.address.split("%")[0])
            if not ip.is_loopback and not ip.is_link_local:
                found.append(str(ip))
    return found


def test_loopback_job_is_not_reachable_on_other_addresses(job):
    others = _other_addresses()
    assert others, "this machine has no address but loopback ones: nothing to check against"
    for address in others:
        try:
            socket.create_connection((address, job.info["port"]), timeout=5).close()
        except ConnectionRefusedError:
            continue
        except OSError:
            # The network-namespace hosts of other tests add and remove bridge addresses meanwhile.
            if address not in _other_addresses():
                continue
            raise
        raise AssertionError(f"the job's port {job.info['port']} is reachable on {address}")
    # Nothing the launcher listens on is on every interface, or off loopback.
    listening = [c.laddr for c in psutil.Process(job.info["launcher_pid"]).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN]
    assert len(listening) == 2, listening  # the gate and the store's own port
    assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening
    job.still_works()


def test_store_port_behind_the_gate_drops_direct_connections(job):
    listening = [c.laddr for c in psutil.Process(job.info["launcher_pid"]).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port != job.info["port"]]
    assert len(listening) == 1, listening
    store = listening[0]
    # The kernel drops every connection not signed with the launcher's key: nothing answers.
    for source in ("127.0.0.1", "127.0.0.2"):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.settimeout(2)
        with pytest.raises(TimeoutError):
            sock.connect((store.ip, store.port))
        sock.close()
    job.still_works()


def test_plain_env_script_job_survives_probes(tmp_path):
    """A plain init_process_group script is admitted (its processes carry the token) while a
    stranger is refused."""
    plain = ProbedJob(tmp_path, plain=True)
    try:
        with socket.create_connection((plain.info["addr"], plain.info["port"]), timeout=10) as raw:
            raw.sendall(b"\x00" * 16)
            assert raw.recv(10) == b""
        plain.still_works()
    finally:
        code = plain.stop()
    assert code == 0, plain.output()
    assert len(plain.refusals()) == 1, plain.output()


# -- several hosts ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    hosts = NetnsCluster(["h1", "h2"])
    hosts.start()  # raises (fails the tests) with what to install when something is missing
    yield hosts
    hosts.stop()


def _hosts(cluster, *entries):
    return ",".join(f"{cluster.address(name)}:{slots}" for name, slots in entries)


def test_plain_script_on_other_hosts_comes_through_the_relay(cluster):
    """Ranks on two other hosts, set up by plain init_process_group (env://): each reaches the store
    through its host's relay (MASTER_ADDR is that host's loopback), which the gate admits."""
    argv = [sys.executable, "-m", "torchmn", "run", *cluster.launcher_options(), "-np", "2",
            "-H", _hosts(cluster, ("h1", 1), ("h2", 1)), sys.executable, ALLREDUCE]
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1] allreduce ok rank=1 size=2 sum=3" in proc.stdout, proc.stdout
    assert REFUSED not in proc.stderr, proc.stderr


def _connect_from(cluster, host, address, port):
    """On ``host``, a raw client of address:port; prints what it got back."""
    code = (f"import socket\ns = socket.create_connection(({address!r}, {port}), timeout=10)\n"
            f"s.sendall(b'hello'); print('LOCAL', s.getsockname()[1], 'GOT', repr(s.recv(10)))\n")
    return subprocess.run(cluster.ssh_argv(host) + [shlex.join([sys.executable, "-c", code])],
                          capture_output=True, text=True, timeout=60)


def test_strangers_on_other_hosts_are_refused(cluster, tmp_path):
    """A raw client on the host of a rank and on a host without ranks, straight to the job's gate:
    both are closed, since from another host only a relay (which proves the token) gets in; and one
    on the rank's host at that host's relay is closed by the relay. Each is named."""
    remote = ProbedJob(tmp_path, np=1,
                       launcher_args=["-v", *cluster.launcher_options(), "-H", _hosts(cluster, ("h1", 1))])
    try:
        assert (remote.info["addr"], remote.info["port"] > 0) == ("127.0.0.1", True), remote.info  # the relay
        told = next(re.search(r"rendezvous (\S+):(\d+),", line) for line in remote.err if "rendezvous" in line)
        addr, port = told.group(1), int(told.group(2))
        assert addr == cluster.gateway, remote.err
        for host in ("h1", "h2"):
            proc = _connect_from(cluster, host, addr, port)
            assert "GOT b''" in proc.stdout, proc.stdout + proc.stderr
            pattern = f"{REFUSED} {cluster.address(host)}:{proc.stdout.split()[1]} (another host): it did not " \
                      f"come through that host's relay"
            remote.wait_for(f"the line about {host}", lambda: any(pattern in x for x in remote.err))
        proc = _connect_from(cluster, "h1", "127.0.0.1", remote.info["port"])
        assert "GOT b''" in proc.stdout, proc.stdout + proc.stderr
        pattern = re.compile(rf"{REFUSED} 127\.0\.0\.1:{proc.stdout.split()[1]} \(process \d+ \(python\).*"
                             rf"not started with this job's token.*\(at the relay on ")
        remote.wait_for("the relay's line", lambda: any(pattern.search(x) for x in remote.err))
        remote.still_works()
    finally:
        code = remote.stop()
    assert code == 0, remote.output()


NO_ANSWER = """
import socket, sys
s = socket.socket()
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("CONNECTED")
except socket.timeout:
    print("NO ANSWER")
"""


def test_other_hosts_reach_the_store_port_only_signed(cluster, tmp_path):
    """Other hosts' relays reach the store straight, on a port whose every TCP segment the kernel
    signs with a key made from the token: the gate tells a greeted relay where it is, a stranger on
    another host gets no answer there at all, and a connection signed with the key gets in."""
    remote = ProbedJob(tmp_path, np=1,
                       launcher_args=["-v", *cluster.launcher_options(), "-H", _hosts(cluster, ("h1", 1))])
    try:
        told = next(re.search(r"rendezvous (\S+):(\d+),", line) for line in remote.err if "rendezvous" in line)
        addr, port, token = told.group(1), int(told.group(2)), remote.info["token"]
        with relay.connect(addr, port, token, 10, kind=auth.WHERE) as asked:
            asked.settimeout(30)
            store_port = int.from_bytes(auth.read_exactly(asked, 2), "big")
        assert store_port not in (0, port), store_port
        stranger = subprocess.run(cluster.ssh_argv("h2") + [shlex.join([sys.executable, "-c", NO_ANSWER, addr,
                                                                         str(store_port)])],
                                  capture_output=True, text=True, timeout=60)
        assert stranger.stdout.strip() == "NO ANSWER", stranger.stdout + stranger.stderr
        relay.connect_signed(addr, store_port, auth.store_key(token)).close()
        remote.still_works()
    finally:
        code = remote.stop()
    assert code == 0, remote.output()


# -- the store's own port ---------------------------------------------------------------------

SNATCH = str(REPO / "tests" / "scripts" / "snatch_ports.py")


def _store_connections_not_ours(store_port):
    ours = {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == store_port}
    return [c for c in psutil.net_connections("tcp") if c.laddr.port == store_port and c.raddr
            and c.raddr.port not in ours and c.status == psutil.CONN_ESTABLISHED]


def test_a_stranger_who_connects_before_the_store_port_is_signed_is_cut_off():
    """torch's TCPStore connects its own client, unsigned, as it starts, so its port is signed just
    after it listens; another user watching for new ports can connect in between (here: in about
    one try of three; the watcher takes only this process's ports, leaving other tests' jobs alone).
    Every such connection is shut down before the store is used, and the launcher says so."""
    snatcher = subprocess.Popen([sys.executable, SNATCH, "120", str(os.getpid())], stdout=subprocess.PIPE, text=True)
    lines, tries = [], 0
    try:
        assert snatcher.stdout.readline().strip() == "READY"
        while tries < 60 and len(lines) < 3:
            tries += 1
            hosted = rendezvous.start_store("127.0.0.1", None, log=lines.append)
            try:
                port = hosted.store.port
                time.sleep(0.02)
                assert not _store_connections_not_ours(port), (tries, lines)
                hosted.store.set("still/works", "yes")
                assert hosted.store.get("still/works") == b"yes"
            finally:
                hosted.close()
    finally:
        snatcher.kill()
        snatcher.wait()
    assert lines, f"the snatcher never got in within {tries} tries: nothing was checked"
    assert all("cut off connections to the rendezvous store's port on 127.0.0.1 made before the kernel "
               "closed it to all but the gate: from 127.0.0.1:" in line for line in lines), lines
    assert f"(python) of user {psutil.Process().username()}" in lines[0], lines


# What a stranger runs in the moment between the store's start and the signing of its port.
HIT_AND_RUN = """
import sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, wait_for_workers=False)
store.set("stranger/key", "planted")
"""  # and exits, closing its connection before anyone can name it
SAME_PORT_ELSEWHERE = """
import socket, sys, time
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.2", int(sys.argv[2])))  # the port number of the store's own client
sock.connect(("127.0.0.1", int(sys.argv[1])))
print("HELD", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("stranger", ["hit_and_run", "same_port_elsewhere"])
def test_a_stranger_the_store_cannot_see_by_port_is_cut_off_too(monkeypatch, stranger):
    """Strangers in the moment before the store's port is signed that the port numbers alone do not
    show: one that writes and leaves (no connection left to see: the store holds its key), and one
    connecting from another loopback address with the port number of the store's own client. The
    store the job gets holds nothing and serves no stranger, and the launcher says so."""
    sign, started = rendezvous.sign, []

    def stranger_then_sign(listener, key):
        store_port = listener.getsockname()[1]
        client = [c.laddr.port for c in psutil.Process().net_connections("tcp")
                  if c.raddr and c.raddr.port == store_port]
        if client and not started:  # the first store's port only (not the gate's): a stranger is there once
            if stranger == "hit_and_run":
                subprocess.run([sys.executable, "-c", HIT_AND_RUN, str(store_port)], check=True, timeout=60)
            else:
                held = subprocess.Popen([sys.executable, "-c", SAME_PORT_ELSEWHERE, str(store_port), str(client[0])],
                                        stdout=subprocess.PIPE, text=True)
                assert held.stdout.readline().strip() == "HELD"
            started.append(held if stranger != "hit_and_run" else None)
        return sign(listener, key)

    monkeypatch.setattr(rendezvous, "sign", stranger_then_sign)
    lines = []
    hosted = rendezvous.start_store("127.0.0.1", None, log=lines.append)
    try:
        port = hosted.store.port
        assert started, "the stranger never ran: nothing was checked"
        assert hosted.store.num_keys() == 0 or not hosted.store.check(["stranger/key"]), "the stranger's key is in the job's store"
        strangers = [c for c in psutil.net_connections("tcp") if c.laddr.port == port and c.raddr
                     and c.raddr.ip == "127.0.0.2" and c.status == psutil.CONN_ESTABLISHED]
        assert not strangers, strangers
        hosted.store.set("still/works", "yes")
        assert hosted.store.get("still/works") == b"yes"
    finally:
        hosted.close()
        if started and started[0] is not None:
            started[0].kill()
            started[0].wait()
    assert len(lines) == 1 and "cut off connections to the rendezvous store's port on 127.0.0.1" in lines[0], lines
    words = "wrote 1 key(s) and closed" if stranger == "hit_and_run" else "from 127.0.0.2:"
    assert words in lines[0], lines


CLOSE_WHILE_STARTING = """
import sys, threading
import psutil

held, asked = threading.Event(), threading.Event()

class HoldTorch:  # holds the store's start where it imports torch, as a slow import would
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            asked.set()
            held.wait()
        return None

sys.meta_path.insert(0, HoldTorch())
from torchmn.run.config import RunError
from torchmn.run.store.rendezvous import start_store

hosted = start_store("127.0.0.1", None)
hosted.open_in_background()
assert asked.wait(60), "the store's start never imported torch"
refused = []

def client():  # as the gate's workers wait for the store (exit waits for them)
    try:
        hosted.store
    except RunError as e:
        refused.append(str(e))

waiting = threading.Thread(target=client)
waiting.start()
hosted.close()  # returns while the start is held
print("CLOSED WHILE STARTING", flush=True)
waiting.join(60)
print("REFUSED:", refused, flush=True)
held.set()
for thread in threading.enumerate():
    if thread.name == "torchmn-store-start":
        thread.join(60)
listening = [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
print("LISTENING:", listening, flush=True)
"""


def test_closing_the_store_does_not_wait_for_its_start():
    """A job that ends before its store has started (its ranks never used it: `torchmn run -H a,b
    hostname`, a script that failed at once) ends without waiting for the start's import of torch
    (seconds): a client waiting for the store (as the gate's workers, which the exit waits for) is
    refused at once, and the start, once its import is done, opens no port."""
    proc = subprocess.run([sys.executable, "-c", CLOSE_WHILE_STARTING], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["CLOSED WHILE STARTING",
                         "REFUSED: ['the rendezvous store is closed: the job has ended']"], proc.stdout
    assert lines[2] == "LISTENING: []", proc.stdout


UNSIGNED_LAUNCHER = """
import errno, sys
import torchmn.run.store.rendezvous as rendezvous
from torchmn.cli import main

def no_signatures(sock, key):  # what a kernel without CONFIG_TCP_MD5SIG answers
    raise OSError(errno.ENOPROTOOPT, "Protocol not available")

rendezvous.sign = no_signatures
sys.exit(main(sys.argv[1:]))
"""


def test_a_kernel_without_tcp_signatures_is_refused_unless_allowed():
    """Closed by default: without TCP MD5 signatures the store's own port would be open to every
    local user, so the launcher refuses before any rank starts, with the reason and the opt-in;
    with --allow-unsigned-store it warns and runs."""
    argv = [sys.executable, "-c", UNSIGNED_LAUNCHER, "run", "-np", "2"]
    refused = subprocess.run(argv + [sys.executable, ALLREDUCE], cwd=REPO, env=clean_env(), capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "this kernel cannot sign TCP connections (Protocol not available; Linux's CONFIG_TCP_MD5SIG)" \
        in refused.stderr and "pass --allow-unsigned-store" in refused.stderr, refused.stderr
    assert "allreduce ok" not in refused.stdout, refused.stdout
    allowed = subprocess.run(argv + ["--allow-unsigned-store", sys.executable, ALLREDUCE], cwd=REPO,
                             env=clean_env(), capture_output=True, text=True, timeout=120)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "as --allow-unsigned-store asked, the rendezvous store's own port on 127.0.0.1 is open" \
        in allowed.stderr, allowed.stderr
    assert allowed.stdout.count("allreduce ok") == 2, allowed.stdout


STORE_ROUNDS = """
import datetime, os, sys, time
from torch.distributed import TCPStore

rank, go = int(os.environ["RANK"]), sys.argv[1]

def meet(round):
    started = time.monotonic()
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=60))
    store.set(f"{round}/{rank}", "here")
    store.wait([f"{round}/{1 - rank}"])
    return time.monotonic() - started

print("BEFORE", meet("before"), flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
print("UNDER ATTACK", meet("attacked"), flush=True)
"""

HOARDER = """
import os, socket, sys, time
os.setgroups([]); os.setgid(65534); os.setuid(65534)  # another user: nobody
port, count = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(count):
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    held.append(sock)
if len(sys.argv) > 3:  # a first byte of a greeting, and nothing more
    time.sleep(0.5)
    for sock in held:
        try:
            sock.send(b"\\xff")
        except OSError:
            pass
print("HOARDING", len(held), flush=True)
time.sleep(60)
"""


@pytest.mark.cluster  # needs root: the crowd comes from another user (nobody)
@pytest.mark.parametrize("greeting", [False, True], ids=["idle", "half_greeting"])
def test_hundreds_of_idle_connections_do_not_delay_the_job(tmp_path, greeting):
    """Another user opens 600 connections to the gate and sends nothing (or the first byte of a
    greeting), with the launcher's soft file limit at 256: the job's ranks still meet at the store
    within 4 s of their time without the crowd (a gate that waited out the crowd's connections would
    take their FIRST_BYTE_SECONDS, 5 s; the margin is for a busy machine)."""
    go = tmp_path / "go"
    script = tmp_path / "rounds.py"
    script.write_text(STORE_ROUNDS)
    port = free_port()
    launcher = subprocess.Popen(["prlimit", "--nofile=256:", sys.executable, "-m", "torchmn", "run", "-np", "2",
                                 "--master-port", str(port), sys.executable, str(script), str(go)],
                                cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hoarder = None
    try:
        before = [launcher.stdout.readline() for _ in range(2)]
        assert all("BEFORE" in line for line in before), before
        hoarder = subprocess.Popen([sys.executable, "-c", HOARDER, str(port), "600"] + (["greet"] if greeting else []),
                                   stdout=subprocess.PIPE, text=True)
        assert hoarder.stdout.readline().startswith("HOARDING 600")
        go.touch()
        out, err = launcher.communicate(timeout=90)
    finally:
        for proc in (launcher, hoarder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert launcher.returncode == 0, out + err
    baseline = max(float(line.split()[-1]) for line in before)
    attacked = [float(line.split()[-1]) for line in out.splitlines() if "UNDER ATTACK" in line]
    assert len(attacked) == 2 and max(attacked) < baseline + 4.0, (baseline, attacked, err[-2000:])


PID_REUSE = """
import os, signal, sys, time
from torchmn.run.store.peers import ProcessDir

token = "f" * 64

def child(token=None):
    pid = os.fork()
    if pid == 0:
        env = {"TORCHMN_JOB_TOKEN": token} if token else {}
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"], env)
    return pid

stranger = child()
process = ProcessDir(stranger)  # the gate found a stranger holding the connection
os.kill(stranger, signal.SIGKILL)
os.waitpid(stranger, 0)
with open("/proc/sys/kernel/ns_last_pid", "w") as f:  # the next process gets the stranger's pid
    f.write(str(stranger - 1))
member = child(token)
time.sleep(0.5)  # let it exec, so that its environment holds the token
print("SAME PID", member == stranger, "ADMITTED", process.started_with(token), flush=True)
os.kill(member, signal.SIGKILL)
"""


def test_a_reused_pid_is_not_taken_for_the_process_that_held_the_connection():
    """The gate reads a client's file descriptors and then its environment: if the client's process
    ends in between and its pid goes to a rank of the job (started with the token), the second read
    must not admit the stranger's connection. Forced in a PID namespace of its own, where the next
    pid can be chosen."""
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
                           sys.executable, "-c", PID_REUSE], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SAME PID True ADMITTED False" in proc.stdout, proc.stdout


# -- the tasks of a Slurm step ------------------------------------------------------------------

def _slurm_task(task, port, home, token=None):
    """One `torchmn run -np 1` as task ``task`` of a two-task step on this machine: Slurm's own
    variables (tests/test_slurm.py runs the same under a real cluster)."""
    env = clean_env({"SLURM_PROCID": str(task), "SLURM_NODEID": str(task), "SLURM_LOCALID": "0",
                     "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "4242",
                     "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost,localhost",
                     "MASTER_PORT": str(port), "HOME": str(home)})
    env.pop("XDG_CONFIG_HOME", None)
    if token:
        env[auth.TOKEN_ENV] = token
    code = "import os; print('RANK', os.environ['RANK'], 'TOKEN', len(os.environ['TORCHMN_JOB_TOKEN']))"
    return subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "1", "--start-timeout", "20",
                             sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(procs, seconds=90):
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=seconds)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        results.append((proc.returncode, out, err))
    return results


def test_slurm_tasks_share_a_token_through_the_users_key(tmp_path):
    """Without TORCHMN_JOB_TOKEN, the tasks derive one token from the key in the shared home."""
    port = free_port()
    results = _finish([_slurm_task(0, port, tmp_path), _slurm_task(1, port, tmp_path)])
    for code, out, err in results:
        assert code == 0, out + err
        assert REFUSED not in err, err
    assert "[0] RANK 0 TOKEN 64" in results[0][1] and "[1] RANK 1 TOKEN 64" in results[1][1], results
    key = tmp_path / ".config" / "torchmn" / "job-key"
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 64


def test_slurm_task_with_another_token_is_refused(tmp_path):
    """Tasks that do not share a token (different homes, different exported tokens): task 0's store
    refuses task 1, which says how to fix it."""
    port = free_port()
    first = _slurm_task(0, port, tmp_path / "a", token=auth.new_token())
    second = _slurm_task(1, port, tmp_path / "b", token=auth.new_token())
    (code1, out1, err1), = _finish([second])
    assert code1 == 2, out1 + err1
    assert "did not prove it knows the job's token, so this Slurm task did not check in" in err1, err1
    assert "the Slurm tasks do not share a token" in err1 and "export TORCHMN_JOB_TOKEN=" in err1, err1
    # Task 0 still waits for task 1 to check in (--start-timeout 20): SIGTERM (scancel's) ends it at once.
    first.terminate()
    stopped = time.monotonic()
    (code0, out0, err0), = _finish([first])
    assert time.monotonic() - stopped < 10 and code0 == 128 + signal.SIGTERM, (code0, err0)
    assert "received SIGTERM while waiting for the other Slurm tasks" in err0, err0
    assert "left after the gate proved the job's token" in err0, err0
    assert "RANK" not in out0 + out1


IMPOSTOR = """
import os, socket, sys
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("LISTENING", flush=True)
sock, _ = listener.accept()
sock.settimeout(10)
got = sock.recv(4096)
# 32 bytes and a byte of 1: what a one-way greeting's client took for a gate that accepted it;
# padded to a nonce and a proof, as a gate of the mutual greeting sends, made up.
sock.sendall(os.urandom(32) + b"\\x01" + os.urandom(31))
try:
    while True:
        more = sock.recv(4096)
        if not more:
            break
        got += more
except OSError:
    pass
print("GOT", len(got), flush=True)
"""


def test_a_slurm_task_refuses_a_store_that_cannot_prove_the_token(tmp_path):
    """Another user who binds the step's port on node 0 first (it is a function of public job and
    step ids) receives the other tasks' greetings: they check its proof, refuse it, name it, start
    no rank and send it nothing but a nonce."""
    port = free_port()
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout.readline().strip() == "LISTENING"
        (code, out, err), = _finish([_slurm_task(1, port, tmp_path)])
        seen, _ = impostor.communicate(timeout=30)
    finally:
        if impostor.poll() is None:
            impostor.kill()
    assert code == 2, out + err
    assert f"Slurm task 1: the process listening on localhost:{port}, where Slurm task 0 hosts the job's " \
           f"rendezvous store, did not prove it knows the job's token" in err, err
    assert "another program (perhaps another user's) holds the port" in err, err
    assert "RANK" not in out, out
    assert f"GOT {len(auth.GREETING) + auth.NONCE_SIZE}" in seen, seen


@pytest.mark.parametrize("spoil, words", [
    (lambda key: key.write_bytes(b""), "holds 0 characters, fewer than"),
    (lambda key: key.chmod(0o644), "can be read by others (mode 644); run chmod 600"),
    pytest.param(lambda key: os.chown(key, os.getuid() + 4242, -1), "belongs to user id",
                 marks=pytest.mark.cluster),  # needs root: giving a file away
], ids=["empty", "readable_by_others", "another_owner"])
def test_a_spoiled_slurm_key_file_is_refused(tmp_path, spoil, words):
    """The key that Slurm tasks derive their token from: a file anyone could guess (empty), read
    (mode 644) or write (another user's) is refused with the fix, not used."""
    env = {"HOME": str(tmp_path)}
    auth.user_key(env)  # made once, mode 600
    key = tmp_path / ".config" / "torchmn" / "job-key"
    spoil(key)
    with pytest.raises(auth.TokenError) as refused:
        auth.user_key(env)
    assert words in str(refused.value) and f"remove {key}" in str(refused.value), refused.value


LISTENERS = """
import psutil, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)
me = psutil.Process()
print("LISTENING", sorted({c.laddr.ip for p in [me, *me.children(recursive=True)] for c in p.net_connections("tcp")
                           if c.status == psutil.CONN_LISTEN}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_one_machine_job_listens_on_loopback_only(tmp_path):
    """Under a host name that resolves to a network address (as on many machines), gloo would listen
    there, reachable from the network, with no authentication of its pair set-up: the ranks of a
    one-machine job listen on loopback alone. Run in a user namespace with its own host name and
    /etc/hosts, so that no root is needed and the machine's own are untouched."""
    address = next((a for a in network.local_addresses() if not network.is_loopback(a) and ":" not in a), None)
    assert address, "this test needs a non-loopback IPv4 address on the machine"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} torchmn-test-host\n")
    script = tmp_path / "listeners.py"
    script.write_text(LISTENERS)
    argv = [sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable, str(script)]
    inner = f"hostname torchmn-test-host && mount --bind {hosts} /etc/hosts && exec {shlex.join(argv)}"
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--uts", "--mount", "--propagation", "private",
                           "sh", "-c", inner], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "LISTENING" in line]
    assert len(lines) == 2 and all(line.endswith("LISTENING ['127.0.0.1']") for line in lines), proc.stdout


def test_a_one_machine_torchrun_job_listens_on_loopback_only(tmp_path):
    """The same under torchrun, which sets no interface: torchmn's communicator keeps gloo to
    loopback when every rank is on this machine (torchrun's own store is torchrun's)."""
    address = next((a for a in network.local_addresses() if not network.is_loopback(a) and ":" not in a), None)
    assert address, "this test needs a non-loopback IPv4 address on the machine"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} torchmn-test-host\n")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
            str(REPO / "tests" / "scripts" / "listening_ports.py")]
    inner = f"hostname torchmn-test-host && mount --bind {hosts} /etc/hosts && exec {shlex.join(argv)}"
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--uts", "--mount", "--propagation", "private",
                           "sh", "-c", inner], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LISTENING")]
    assert len(lines) == 2 and all(line.endswith("['127.0.0.1']") for line in lines), proc.stdout
