"""Separate "hosts" on one machine for multi-host tests: one network namespace per host, each with
its own address on a private bridge, its own hostname and its own sshd.

Needs root, ``ip`` (iproute2), ``unshare``/``mount`` (util-linux, mount), ``sshd``/``ssh``/``ssh-keygen``
(openssh-server, openssh-client). Every missing piece raises ``ClusterError`` naming the package.

Example::

    cluster = NetnsCluster(["h1", "h2"])
    cluster.start()
    try:
        subprocess.run(cluster.ssh_argv("h1") + ["hostname"])      # prints h1
    finally:
        cluster.stop()

Layout: bridge ``tmnbr<N>`` holds 10.77.<N>.1/24 in the root namespace (the launcher's side); host
k (1-based) is namespace ``tmn<N>-<name>`` with ``eth0`` = 10.77.<N>.<10+k>/24 and sshd on port 2222.
<N> is the first subnet that no interface of this machine already uses.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import psutil

SSH_PORT = 2222
CMD_TIMEOUT = 20

REQUIRED = {
    "ip": "iproute2",
    "unshare": "util-linux",
    "mount": "mount",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
}


class ClusterError(RuntimeError):
    """The test cluster cannot be set up; the message says what to install or fix."""


def missing_prerequisites() -> List[str]:
    """Messages for what is missing to build the cluster (empty when everything is there)."""
    problems = []
    for program, package in REQUIRED.items():
        if shutil.which(program) is None:
            problems.append(f"{program} not found: apt-get install -y {package}")
    if os.geteuid() != 0:
        problems.append("network namespaces need root: run the tests as root")
    return problems


def _run(argv: List[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _used_addresses() -> set:
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


class NetnsCluster:
    """Hosts ``names`` as network namespaces with sshd. Hosts named in ``bare`` lack this machine's
    Python interpreter (``sys.executable`` is replaced by an empty, non-executable file there) and
    the folder ``private_dir``, which exists on every other host."""

    def __init__(self, names: List[str], bare: tuple = ()):
        self.names = list(names)
        self.bare = set(bare)
        self.tmp: Optional[str] = None
        self.subnet: Optional[int] = None
        self.bridge: Optional[str] = None
        self.sshd: Dict[str, subprocess.Popen] = {}
        self.namespaces: List[str] = []

    # -- addresses and ssh ------------------------------------------------------------------------

    @property
    def gateway(self) -> str:
        """This machine's address on the cluster network (where the launcher's store listens)."""
        return f"10.77.{self.subnet}.1"

    def address(self, name: str) -> str:
        return f"10.77.{self.subnet}.{11 + self.names.index(name)}"

    def unused_address(self) -> str:
        """An address on the cluster network that no host answers on."""
        return f"10.77.{self.subnet}.99"

    @property
    def private_dir(self) -> str:
        """A folder that the hosts in ``bare`` do not have."""
        return os.path.join(self.tmp, "private", "work")

    @property
    def key(self) -> str:
        return os.path.join(self.tmp, "client_key")

    @property
    def ssh_command(self) -> str:
        """An ssh client command for ``torchmn run --ssh-command`` that ignores the user's ssh
        config and known_hosts (host keys here are new on every run)."""
        return ("ssh -F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=no "
                "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=5")

    def outer_link(self, name: str) -> str:
        """The bridge's end, in this machine's namespace, of host ``name``'s link (its ``eth0``)."""
        return f"tmn{self.subnet}v{self.names.index(name)}"

    def ssh_argv(self, name: str) -> List[str]:
        return shlex.split(self.ssh_command) + ["-i", self.key, "-p", str(SSH_PORT), self.address(name)]

    def launcher_options(self) -> List[str]:
        """``torchmn run`` options that reach these hosts."""
        return ["--ssh-command", self.ssh_command, "--ssh-identity-file", self.key,
                "--ssh-port", str(SSH_PORT)]

    # -- setting up -------------------------------------------------------------------------------

    def start(self) -> None:
        problems = missing_prerequisites()
        if problems:
            raise ClusterError("cannot build the multi-host test cluster: " + "; ".join(problems))
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        used = _used_addresses()
        self.subnet = next((n for n in range(77, 250) if f"10.77.{n}.1" not in used), None)
        if self.subnet is None:
            raise ClusterError("no free 10.77.N.0/24 subnet; delete leftover tmnbr* bridges")
        tag = str(self.subnet)
        self.bridge = f"tmnbr{tag}"
        self.tmp = tempfile.mkdtemp(prefix="torchmn-netns-")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key])
        shutil.copy(self.key + ".pub", os.path.join(self.tmp, "authorized_keys"))
        os.makedirs(self.private_dir)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for name in self.names:
            ns, veth = f"tmn{tag}-{name}", self.outer_link(name)
            _run(["ip", "netns", "add", ns])
            self.namespaces.append(ns)
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._start_sshd(name, ns)
        for name in self.names:
            self._wait_for_sshd(name)

    def _start_sshd(self, name: str, ns: str) -> None:
        folder = os.path.join(self.tmp, name)
        os.makedirs(folder)
        host_key = os.path.join(folder, "host_key")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key])
        config = os.path.join(folder, "sshd_config")
        with open(config, "w") as f:
            f.write(f"Port {SSH_PORT}\nListenAddress {self.address(name)}\nHostKey {host_key}\n"
                    f"PidFile {folder}/sshd.pid\nAuthorizedKeysFile {self.tmp}/authorized_keys\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nUseDNS no\n"
                    "PrintMotd no\nMaxStartups 100\nMaxSessions 100\n")
        hosts_file = os.path.join(folder, "hosts")
        with open(hosts_file, "w") as f:
            f.write(f"127.0.0.1 localhost\n{self.gateway} launcher\n")
            f.write("".join(f"{self.address(n)} {n}\n" for n in self.names))
        # Its own hostname, and an /etc/hosts naming every host, as on a real cluster.
        setup = [f"hostname {shlex.quote(name)}", f"mount --bind {shlex.quote(hosts_file)} /etc/hosts"]
        bashrc = os.path.expanduser("~/.bashrc")
        if os.path.isfile(bashrc):
            # A login there runs none of this machine's shell start-up, as on a fresh node, with this
            # interpreter first on PATH. (pyenv's start-up rehashes under a lock file that every host
            # shares; a session killed meanwhile leaves it, and each later login waits 60 s for it.)
            clean = os.path.join(folder, "bashrc")
            with open(clean, "w") as f:
                f.write(f"export PATH={shlex.quote(os.path.dirname(sys.executable))}:\"$PATH\"\n")
            setup.append(f"mount --bind {shlex.quote(clean)} {shlex.quote(bashrc)}")
        if name in self.bare:
            empty = os.path.join(folder, "not-python")
            open(empty, "w").close()
            os.chmod(empty, 0o644)
            setup.append(f"mount --bind {shlex.quote(empty)} {shlex.quote(os.path.realpath(sys.executable))}")
            setup.append(f"mount -t tmpfs tmpfs {shlex.quote(os.path.dirname(self.private_dir))}")
        script = " && ".join(setup) + f" && exec /usr/sbin/sshd -D -e -f {shlex.quote(config)}"
        log = open(os.path.join(folder, "sshd.log"), "wb")
        # ip netns exec, unshare (without --fork) and sh all exec: the Popen's pid is sshd's.
        self.sshd[name] = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--mount", "--uts", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()

    def _wait_for_sshd(self, name: str) -> None:
        deadline = time.monotonic() + 15
        while True:
            if self.sshd[name].poll() is not None:
                raise ClusterError(f"sshd for host {name} exited ({self.sshd[name].returncode}): "
                                   f"{self.log(name)[-2000:]}")
            try:
                socket.create_connection((self.address(name), SSH_PORT), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"sshd for host {name} does not answer on "
                                       f"{self.address(name)}:{SSH_PORT}: {self.log(name)[-2000:]}")
                time.sleep(0.1)
        proc = subprocess.run(self.ssh_argv(name) + ["hostname"], capture_output=True, text=True,
                              timeout=CMD_TIMEOUT, stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or proc.stdout.strip() != name:
            raise ClusterError(f"cannot log in to host {name} over ssh ({proc.returncode}): {proc.stderr} "
                               f"sshd log: {self.log(name)[-2000:]}")

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.tmp, name, "sshd.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    # -- tearing down -----------------------------------------------------------------------------

    def processes(self) -> List[psutil.Process]:
        """Every process living in one of the cluster's network namespaces (sshd included)."""
        inodes = set()
        for ns in self.namespaces:
            try:
                inodes.add(os.stat(f"/run/netns/{ns}").st_ino)
            except OSError:
                continue
        found = []
        for process in psutil.process_iter():
            try:
                if os.stat(f"/proc/{process.pid}/ns/net").st_ino in inodes:
                    found.append(process)
            except (OSError, psutil.Error):
                continue
        return found

    def stop(self) -> None:
        """Kill sshd (by PID) and every process left in the namespaces, then delete the namespaces,
        the bridge and the temporary folder."""
        for process in self.sshd.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.sshd.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        for process in self.processes():
            try:
                process.kill()
            except psutil.Error:
                pass
        # Each link goes with its bridge-side end at once; left to the namespace's deletion it
        # lingers a moment, and a cluster started next on this subnet would meet its name.
        for name, _ in zip(self.names, self.namespaces):
            _run(["ip", "link", "del", self.outer_link(name)], check=False)
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        self.namespaces = []
        if self.bridge:
            _run(["ip", "link", "del", self.bridge], check=False)
            self.bridge = None
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
