"""Where the ranks meet: the rendezvous store the launcher hosts, behind its gate, and the address
it is reached on. Who may pass the gate is in ``torchmn.run.store.gate`` and ``docs/security.md``."""
from __future__ import annotations

import errno
import ipaddress
import os
import secrets
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from torchmn import network
from torchmn.run.config import RunError
from torchmn.run.processes import tree
from torchmn.run.remote.ssh import HostCheck
from torchmn.run.store import auth
from torchmn.run.store.gate import Gate
from torchmn.run.store.peers import holder_of

# Linux's TCP MD5 signature option with an address prefix (linux/tcp.h).
TCP_MD5SIG_EXT = 32
TCP_MD5SIG_FLAG_PREFIX = 1


def sign(sock: socket.socket, key: bytes) -> None:
    """Have the kernel sign every TCP segment of ``sock`` with ``key`` (RFC 2385), and, on a
    listening socket, drop every connection from an IPv4 address that does not sign with it.

    Args:
        sock: an IPv4 TCP socket, before it connects or once it listens.
        key: up to 80 bytes.

    Raises:
        OSError: the kernel has no TCP MD5 signatures (``CONFIG_TCP_MD5SIG``).

    Example::

        >>> listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
        >>> sign(listener, b"k" * 32)   # from now on, only sockets signed with b"k" * 32 connect
    """
    # struct tcp_md5sig: the address (a sockaddr_storage), flags, prefix length, key length,
    # interface index, key. Prefix 0 of 0.0.0.0 covers every IPv4 peer, including the other
    # loopback addresses and this machine's own addresses used as a source.
    address = struct.pack("=HH4s", socket.AF_INET, 0, bytes(4)).ljust(128, b"\0")
    option = address + struct.pack("=BBHi", TCP_MD5SIG_FLAG_PREFIX, 0, len(key), 0) + key.ljust(80, b"\0")
    sock.setsockopt(socket.IPPROTO_TCP, TCP_MD5SIG_EXT, option)


class _TorchStore:
    """torch's ``TCPStore`` on the gate's address (127.0.0.1 where the kernel cannot sign), started
    on first use, and the way to it through the kernel's signature check. The gate and the thread
    that starts it hold this, not the ``HostedStore``, so that dropping the ``HostedStore`` still
    closes everything.

    The store starts on a daemon thread of its own (``torchmn-store-start``), never on the thread
    that asks for it: starting means importing torch (seconds), and a job can end meanwhile (its
    ranks never used the store: `torchmn run -H a,b hostname`; a script that failed at once).
    Whoever waits for the start stops waiting when the store is closed, and the process's exit
    waits for neither (the gate's workers are joined at exit, a daemon thread is not)."""

    def __init__(self, log: Callable[[str], None], address: str, key: Optional[bytes]):
        self.log = log
        self.address = address
        self.key = key
        self.lock = threading.Lock()  # guards store, port, starting, failure
        self.changed = threading.Condition(self.lock)
        self.closed = threading.Event()
        self.store = None
        self.port = 0
        self.starting = False
        self.failure: Optional[BaseException] = None

    def start_soon(self) -> None:
        """Start the store on its own thread unless it is started, starting or closed."""
        with self.lock:
            self._start_unless_started()

    def _start_unless_started(self) -> None:  # under the lock
        if self.store is None and not self.starting and not self.closed.is_set():
            # Marked once the thread runs (a thread that cannot start leaves nobody waiting); it
            # cannot clear the mark first, as it needs the lock held here.
            threading.Thread(target=self._start, name="torchmn-store-start", daemon=True).start()
            self.starting = True

    def _start(self) -> None:
        failure = None
        try:
            from torch.distributed import TCPStore  # noqa: F401 (the seconds: outside the lock)
            with self.lock:  # starting the store itself takes milliseconds; close() waits for them
                if not self.closed.is_set():
                    self.store, self.port = _start_tcp_store(self.address, self.key, self.log)
        except BaseException as e:  # noqa: BLE001 - told to whoever waits (see open)
            failure = e
        with self.lock:
            self.starting = False
            self.failure = failure
            self.changed.notify_all()

    def open(self):
        """The store, once started (started now if it was not yet; again after a failed start).

        Raises:
            RunError: the store is closed, or could not start.
        """
        with self.lock:
            self._start_unless_started()
            while self.starting and not self.closed.is_set():
                self.changed.wait()  # the start's end and close() both notify, under the lock
            if self.closed.is_set():
                raise RunError("the rendezvous store is closed: the job has ended")
            if self.store is None:
                failure = self.failure
                if isinstance(failure, RunError):
                    raise RunError(str(failure)) from failure
                raise RunError(f"could not start the rendezvous store on {self.address}: {failure!r}") from failure
            return self.store

    def connect(self) -> socket.socket:
        self.open()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.key is not None:
                sign(sock, self.key)
            sock.settimeout(10)
            sock.connect((self.address, self.port))
        except OSError:
            sock.close()
            raise
        return sock

    def direct_port(self) -> int:
        """Where other hosts' relays reach the store with signed connections; 0 where they cannot
        (no signatures, or a store on loopback, as for a job on one machine)."""
        if self.key is None or network.is_loopback(self.address):
            return 0
        self.open()
        return self.port

    def start_when_torch_loads(self, pids: Callable[[], Sequence[int]]) -> None:
        """On this thread: start the store once one of ``pids`` loads torch, unless closed first."""
        pause = 0.05
        while not self.closed.is_set():
            try:
                children = tree.look()
                loaded = any(_loads_torch(pid, children) for pid in pids())
            except Exception:  # noqa: BLE001 - a hint only: the first client starts the store anyway
                return
            if loaded:
                self.start_soon()
                return
            # Ranks load torch within a second of starting; a job that does not is looked at less often.
            self.closed.wait(pause)
            pause = min(1.0, pause * 1.2)

    def close(self) -> None:
        self.closed.set()
        with self.lock:  # a start past torch's import is waited for (milliseconds), then dropped
            self.store = None  # the server stops, and frees its port, with the last reference
            self.changed.notify_all()


class HostedStore:
    """The job's rendezvous store as the launcher hosts it: torch's ``TCPStore`` on the job's
    address, on a port that takes only signed connections: the gate's (``torchmn.run.store.gate``),
    through which this machine's ranks reach it, and other hosts' relays'.

    The ``TCPStore`` starts when it is first needed, as starting it means importing torch (about
    2 CPU-seconds): when the first client passes the gate, when ``open_when_torch_loads`` sees a
    rank of this machine load torch, or when ``store`` is read. A job whose ranks never use torch
    (``torchmn run -np 4 hostname``) starts at once. ``start_store`` makes one.

    Args:
        gate: the gate, whose way to the store is ``torch_store.connect``.
        torch_store: the ``TCPStore`` to be.
        address: where the gate listens.

    Attributes:
        port: the gate's port, which the ranks are told (``MASTER_PORT``).
        address: as given.
    """

    def __init__(self, gate: Gate, torch_store: _TorchStore, address: str):
        self.port = gate.port
        self.address = address
        self._torch_store = torch_store
        # Dropping the last reference closes the gate, as it closes the store.
        self._finalizer = weakref.finalize(self, _close, gate, torch_store)

    @property
    def store(self):
        """The launcher's own client of the store (the ``TCPStore`` that hosts it), started now if
        it was not yet.

        Raises:
            RunError: the store cannot start.
        """
        return self._torch_store.open()

    def open_when_torch_loads(self, pids: Callable[[], Sequence[int]]) -> None:
        """Start the store, on a thread of its own, as soon as one of ``pids`` (this machine's ranks)
        or a process below them loads torch: its import then overlaps the ranks' own, instead of
        starting when the first rank reaches the gate.

        Args:
            pids: the ranks' processes here, asked again and again (they may not all run yet).

        Example::

            >>> hosted.open_when_torch_loads(lambda: [rank.pid for rank in ranks])  # doctest: +SKIP
        """
        threading.Thread(target=self._torch_store.start_when_torch_loads, args=(pids,),
                         name="torchmn-store-wait-for-torch", daemon=True).start()

    def open_in_background(self) -> None:
        """Start the store now, on a thread of its own: for ranks on other hosts, whose imports this
        machine cannot see.

        Example::

            >>> hosted.open_in_background()  # doctest: +SKIP
        """
        self._torch_store.start_soon()

    def close(self) -> None:
        """Close the gate and every connection through it, and the store.

        Safe to call more than once.

        Example::

            >>> hosted = start_store("127.0.0.1", None)
            >>> hosted.close()
        """
        self._finalizer()


def _close(gate: Gate, torch_store: _TorchStore) -> None:
    gate.close()
    torch_store.close()


def _loads_torch(pid: int, children) -> bool:
    """Whether ``pid`` or a process below it has torch's library mapped (``children``: what
    ``torchmn.run.processes.tree.look`` returned)."""
    for process in [pid] + tree.descendants(pid, children):
        try:
            with open(f"/proc/{process}/maps", "rb") as maps:
                if b"libtorch" in maps.read():
                    return True
        except OSError:
            continue
    return False


# How many times a new store is made when strangers who connected to the one before, in the
# moment before its port was signed, managed to write into it; each try takes milliseconds.
STORE_TRIES = 5
# How long the strangers' connections may take to be accepted by the store, and then closed.
CUT_OFF_SECONDS = 2.0


def _start_tcp_store(address: str, key: Optional[bytes], log: Callable[[str], None]):
    """torch's ``TCPStore`` on ``address`` (an IPv4 address), on a port only connections signed
    with ``key`` reach (where ``key`` is None: any connection): (store, port).

    The ``TCPStore`` connects its own client to its port, unsigned, as it starts, so the port can be
    signed only afterwards, and another program that watches for new listening ports may connect in
    between. Such connections are shut down, and the store is used only once they are closed and
    it holds nothing (it then is as new); otherwise it is dropped before anyone of the job used
    it, and a new one made."""
    strangers: List[str] = []
    for _ in range(STORE_TRIES if key is not None else 1):
        store, store_port = _new_tcp_store(address, key)
        if key is None:
            return store, store_port
        strangers, closed = _cut_off_strangers(store_port)
        # Read once every stranger is closed (or the wait is over): one may have written and left,
        # with no connection left to name.
        keys = store.num_keys()
        if not strangers and not keys:
            return store, store_port
        if not strangers:
            strangers = [f"a connection that wrote {keys} key(s) and closed before it could be named"]
        log(f"torchmn run: cut off connections to the rendezvous store's port on {address} made before the "
            f"kernel closed it to all but the gate: {'; '.join(strangers)}")
        if closed and keys == 0:
            return store, store_port
        del store  # the server stops, and its connections close, with the last reference
    raise RunError(f"another program connected to the rendezvous store's port on {address} each of "
                   f"{STORE_TRIES} times, in the moment between the store starting and the kernel closing its "
                   f"port to all but the gate, and wrote into it: {'; '.join(strangers)}. It watches for new "
                   f"ports to take over jobs; stop it (or have the machine's administrator stop it) and "
                   f"start the job again.")


def _new_tcp_store(address: str, key: Optional[bytes]):
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(1024)
        # Given a listening socket, the store listens on it alone; by itself it would listen on
        # every interface.
        store = TCPStore(address, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.fileno())
    except (OSError, RuntimeError) as e:
        listener.close()
        raise RunError(f"could not start the rendezvous store on {address}: {e}") from e
    store_port = listener.getsockname()[1]
    try:
        if key is not None:
            # The store's own client is connected by now; from here on only signed connections
            # (the gate's, and other hosts' relays') reach that port.
            sign(listener, key)
    finally:
        listener.detach()  # the store owns the socket now, and closes it
    return store, store_port


def _cut_off_strangers(store_port: int) -> Tuple[List[str], bool]:
    """Shut down the connections to ``store_port`` that this process did not make, from the store's
    side (its sockets are this process's), and wait for the store to close them.

    Connections still in the handshake are no concern: the port is signed by now, so they never
    complete. Returns the strangers, described, and whether all were closed in time."""
    import psutil

    deadline = time.monotonic() + CUT_OFF_SECONDS
    described: Dict[tuple, str] = {}
    while True:
        mine = psutil.Process().net_connections("tcp")
        # This process's own client connections, by their whole address: a stranger may use the same
        # port number from another loopback address (127.0.0.2).
        ours = {_endpoint(c.laddr) for c in mine if c.raddr and c.raddr.port == store_port}
        served = {_endpoint(c.raddr): c.fd for c in mine if c.laddr.port == store_port and c.raddr}
        strangers = {_endpoint(c.raddr): c for c in psutil.net_connections("tcp") if c.laddr.port == store_port
                     and c.raddr and _endpoint(c.raddr) not in ours and c.status in _OPEN}
        for peer, c in strangers.items():
            if peer not in described:
                held = holder_of(tuple(c.raddr), tuple(c.laddr))
                described[peer] = f"from {c.raddr.ip}:{c.raddr.port} ({held.describe() if held.found else 'elsewhere'})"
        if not strangers:
            return list(described.values()), True
        for peer in strangers.keys() & served.keys():
            try:
                with socket.socket(fileno=os.dup(served[peer])) as server_side:
                    server_side.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile
        if time.monotonic() > deadline:
            return list(described.values()), False
        time.sleep(0.01)


def _endpoint(addr) -> Tuple[str, int]:
    """(address, port) of a psutil address, an IPv4 address seen through an IPv6 socket
    (``::ffff:127.0.0.1``, as the store's own client is) written as IPv4."""
    ip = ipaddress.ip_address(addr.ip)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip), addr.port


_OPEN = ("ESTABLISHED", "CLOSE_WAIT")  # psutil's names: states in which the store may still read requests


def signing_refused() -> Optional[str]:
    """Why this kernel cannot sign TCP connections (``sign``), or None when it can.

    Returns:
        The kernel's words, or None.

    Example::

        >>> signing_refused() is None   # a kernel with CONFIG_TCP_MD5SIG
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            sign(probe, secrets.token_bytes(32))
            return None
        except OSError as e:
            return e.strerror or str(e)


def check_signing(allow_unsigned: bool) -> Optional[str]:
    """Whether this kernel can sign TCP connections (``sign``), which closes the store's own port to
    all but the gate; where it cannot, refuse unless ``allow_unsigned``.

    Args:
        allow_unsigned: go on without signatures (``--allow-unsigned-store``).

    Returns:
        None when the kernel signs; else the warning to show, as ``allow_unsigned`` asked.

    Raises:
        RunError: the kernel cannot sign and ``allow_unsigned`` is False; the message says why that
            matters and what to do.

    Example::

        >>> check_signing(allow_unsigned=False) is None   # a kernel with CONFIG_TCP_MD5SIG
        True
    """
    why = signing_refused()
    if why is None:
        return None
    if not allow_unsigned:
        raise RunError(f"this kernel cannot sign TCP connections ({why}; Linux's CONFIG_TCP_MD5SIG), which is "
                       f"how torchmn keeps the rendezvous store's own port closed to all but its "
                       f"gate: without it, any user of this machine could reach the store without the job's "
                       f"token and take over the job. Run on a kernel with CONFIG_TCP_MD5SIG (the common "
                       f"distributions' kernels have it), or, where no other user can run programs on this "
                       f"machine (a container or VM of your own), pass --allow-unsigned-store; see "
                       f"docs/security.md.")
    return (f"torchmn run: warning: this kernel cannot sign TCP connections ({why}); as --allow-unsigned-store "
            f"asked, the rendezvous store's own port on 127.0.0.1 is open to every program of this machine, "
            f"which can take over the job; see docs/security.md")


def _stderr(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def start_store(host: str, port: Optional[int], port_origin: Optional[str] = None, token: Optional[str] = None,
                log: Optional[Callable[[str], None]] = None,
                likely_pids: Callable[[], Sequence[int]] = tuple, allow_unsigned: bool = False) -> HostedStore:
    """Host the rendezvous store, as torchrun does (every rank is a client of it), for the job
    members alone: the ``TCPStore`` listens on ``host`` too, on a port the kernel keeps for
    connections signed with ``auth.store_key(token)`` (``sign``: the gate's and other hosts'
    relays'; on 127.0.0.1 alone, unsigned, with ``allow_unsigned`` on a kernel that cannot sign),
    and the gate listens on ``host``, never on every interface. The gate listens
    from now on; the ``TCPStore`` starts when first needed (see ``HostedStore``).

    Args:
        host: the job's address: 127.0.0.1 on one machine, else the address the other hosts
            reach this one on (``--network-interface``'s, or ``address_for_hosts``).
        port: the gate's port; None lets the OS pick a free one, so there is no race for it.
        port_origin: where a given port came from, for the error when it is taken (default:
            ``--master-port``).
        token: the job's token (default: a new one).
        log: where refused connections are reported (default: stderr).
        likely_pids: the job's processes on this machine, looked at first to identify a client.
        allow_unsigned: on a kernel that cannot sign TCP connections, go on with the store's own
            port open to every program of this machine (``--allow-unsigned-store``), instead of
            refusing.

    Returns:
        The store; dropping the last reference closes it.

    Raises:
        RunError: the port is taken, ``host`` is not this machine's, or the kernel cannot sign TCP
            connections and ``allow_unsigned`` is False.

    Example::

        >>> hosted = start_store("127.0.0.1", None); hosted.port > 0
        True
    """
    log = log or _stderr
    unsigned = check_signing(allow_unsigned)
    if unsigned is not None:
        log(unsigned)
    token = token or auth.new_token()
    # The store on the gate's address, signed, where other hosts' relays reach it directly; else
    # on loopback, behind the gate alone.
    store_address = _ipv4_of(host) if unsigned is None else None
    key = auth.store_key(token) if unsigned is None else None
    torch_store = _TorchStore(log, store_address or "127.0.0.1", key)
    try:
        gate = Gate(host, port or 0, token, torch_store.connect, log, likely_pids, torch_store.direct_port)
    except OSError as e:
        if port and e.errno == errno.EADDRINUSE:
            if port_origin:
                raise RunError(f"port {port} ({port_origin}) is already in use on this machine. "
                               f"Choose another: set MASTER_PORT, or pass --master-port.") from e
            raise RunError(f"port {port} is already in use on this machine (--master-port {port}). "
                           f"Pick another port, or leave --master-port out so torchmn picks a free one.") from e
        if e.errno == errno.EADDRNOTAVAIL:
            raise RunError(f"cannot listen for the ranks on {host}: it is not an address of this machine "
                           f"({socket.gethostname()}); name this machine's address or interface "
                           f"(MASTER_ADDR, --network-interface)") from e
        raise RunError(f"could not start the rendezvous store on {host}:{port or 0}: {e.strerror or e}") from e
    return HostedStore(gate, torch_store, host)


def _ipv4_of(host: str) -> Optional[str]:
    """``host``'s IPv4 address, where it has one (the store's listener is IPv4, see ``sign``)."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def address_for_hosts(checks: Sequence[HostCheck], remote_hosts: Sequence[str], ssh_port: Optional[int]) -> str:
    """The address of this machine that the other hosts reach the store on.

    The address the first host saw the ssh connection come from, when it is one of this machine's;
    else the address this machine routes to the first host from; else its fully qualified name.

    Args:
        checks: what checking the remote hosts found, in the order of ``remote_hosts``.
        remote_hosts: the other hosts.
        ssh_port: the hosts' ssh port (None: 22), to find the route.

    Returns:
        The rendezvous address.

    Raises:
        RunError: the only address found is a loopback address, which the other hosts would take
            for themselves (behind an ssh tunnel or ProxyJump, they log in from this machine's
            loopback).

    Example::

        >>> checks = check_hosts(["node2"], SshOptions(), sys.executable, os.getcwd(), {}, 30)  # doctest: +SKIP
        >>> address_for_hosts(checks, ["node2"], None)  # doctest: +SKIP
        '10.0.0.1'
    """
    local = network.local_addresses()
    seen = checks[0].client_address
    if seen and seen in local and not seen.startswith("127."):
        address = seen
    else:
        address = network.route_address(remote_hosts[0], ssh_port or 22) or socket.getfqdn()
    if network.is_loopback(address):
        raise RunError(f"cannot tell which address of this machine the hosts {', '.join(remote_hosts)} "
                       f"reach it on (found only {address}, a loopback address); name the "
                       f"network with --network-interface (e.g. eth0)")
    return address
