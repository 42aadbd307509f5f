"""A host's door to the job's rendezvous store, on another host than the one that hosts it.

The store's gate (``torchmn.run.store.gate``) can tell who holds a connection only on its own
host, where it reads ``/proc``. So each remote rank's watcher, and each Slurm task but the first,
runs a relay: the same gate, on its own host's 127.0.0.1, where it admits that host's processes of
the job by the same rule. The ranks there are told the relay's address (``MASTER_ADDR`` =
127.0.0.1, ``MASTER_PORT`` = the relay's port), so the job's gate trusts no source address: a
connection from another host that does not prove the token is refused.

Each client the relay admits is passed on over a connection of its own: straight to the store,
whose port takes only connections every TCP segment of which the kernel signs with a key made
from the token (``auth.store_key``; TCP MD5 signatures, which also keep anyone on the path from
injecting into the connection); or, where the store cannot take those (a kernel without
signatures on either side), to the job's gate, opened with the mutual greeting of
``torchmn.run.store.auth``. Opening the relay asks the gate, over a greeted connection, where the
store is; that also checks, once, that the job's gate is reachable from this host and knows the
token, and tells which of the host's addresses reaches it (for ``GLOO_SOCKET_IFNAME``).

Standard library only: the watcher loads this module on hosts where torch must not be imported.
"""
from __future__ import annotations

import functools
import socket
import threading
import time
from typing import Callable, Optional, Sequence

from torchmn.run.store import auth
from torchmn.run.store.gate import Gate
from torchmn.run.store.rendezvous import sign, signing_refused

LOCAL_ADDR = "127.0.0.1"
# Seconds a connection to the job's gate, greeting included, may take once the relay is open.
CONNECT_SECONDS = 10.0
# Seconds the gate may take to say where the store is: it starts the store first (importing torch).
STORE_START_SECONDS = 120.0


def connect(address: str, port: int, token: str, seconds: float, kind: bytes = auth.RELAY,
            interrupt: Callable[[], None] = lambda: None) -> socket.socket:
    """A connection to the job's gate at ``address:port``, greeted (see ``torchmn.run.store.auth``),
    retrying for ``seconds`` while nothing listens there yet (another node's launcher may start later).

    Args:
        address, port: the job's gate.
        token: the job's token.
        seconds: how long to keep trying to connect.
        kind: the kind of greeting: ``auth.RELAY`` (the connection then carries a client's
            bytes to the store) or ``auth.WHERE`` (the gate then says where the store takes
            signed connections directly, see ``Relay``).
        interrupt: called between two tries; what it raises (a launcher's Ctrl-C) ends the wait.

    Returns:
        The connection, blocking and without a timeout, ready to carry a ``TCPStore`` client's bytes.

    Raises:
        auth.ImpostorError: what listens there did not prove it knows the token (not this job's
            gate); it was sent nothing but a nonce.
        auth.TokenError: the gate refused the token.
        OSError: nothing could be reached within ``seconds``.

    Example::

        >>> sock = connect(os.environ["MASTER_ADDR"], 29500, token, 10)  # doctest: +SKIP
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            sock = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise
            interrupt()
            time.sleep(0.5)
    try:
        # In one-second slices: what listens there (another job's gate, a busy one) may be slow to
        # answer, and the launcher's Ctrl-C or SIGTERM is handled between two.
        sock.settimeout(1.0)
        auth.greet(sock, token, kind, interrupt, max(time.monotonic() + 5.0, deadline))
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


def connect_signed(address: str, port: int, key: bytes) -> socket.socket:
    """A connection straight to the job's store, every TCP segment of it signed with ``key`` by the
    kernel (``auth.store_key``): the store's port takes no other.

    Args:
        address: the store's host.
        port: the store's port, as the gate told (``auth.WHERE``).
        key: the job's store key.

    Returns:
        The connection.

    Raises:
        OSError: it could not be made (no signatures in this kernel, or no answer within 10 s:
            a SYN without the right signature gets none).

    Example::

        >>> sock = connect_signed("10.0.0.1", 41234, auth.store_key(token))  # doctest: +SKIP
    """
    ipv4 = socket.getaddrinfo(address, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sign(sock, key)
        sock.settimeout(CONNECT_SECONDS)
        sock.connect(ipv4)
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


class Relay:
    """This host's relay to the job's gate at ``address:port``; see the module's docstring.

    Each admitted client is passed on over a connection of its own: straight to the store, signed
    by the kernel with the job's store key, where the gate says the store takes those (and this
    kernel can sign); else to the gate, greeted. The first way crosses one relaying process (this
    one) instead of two.

    Args:
        address, port: the job's gate (the launcher's ``MASTER_ADDR`` and ``MASTER_PORT``).
        token: the job's token.
        seconds: how long the first connection may take to reach the gate (the job's gate may
            start later than this host's launcher).
        log: where refused connections are reported.
        likely_pids: this host's ranks, looked at first to identify a client.
        interrupt: called while the first connection is retried; what it raises ends the wait.

    Attributes:
        port: the relay's port on 127.0.0.1, which this host's ranks are told.
        local_address: this host's address that reaches the job's gate.
        direct: whether clients go straight to the store (else through the gate), known once the
            first client came.

    Raises:
        auth.ImpostorError, auth.TokenError, OSError: as ``connect``; nothing listens then.

    Example::

        >>> relay = Relay(os.environ["MASTER_ADDR"], 29500, token, 60, print)  # doctest: +SKIP
        >>> env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(relay.port))  # doctest: +SKIP
    """

    def __init__(self, address: str, port: int, token: str, seconds: float, log: Callable[[str], None],
                 likely_pids: Callable[[], Sequence[int]] = tuple, interrupt: Callable[[], None] = lambda: None):
        self.address, self.gate_port, self.token = address, port, token
        # The greeting proves the gate and checks the way; the answer, where the store is, comes once
        # the store has started (it imports torch), which this host's rank need not wait for.
        self.asked = connect(address, port, token, seconds, kind=auth.WHERE, interrupt=interrupt)
        self.local_address = self.asked.getsockname()[0]
        self.way: Optional[Callable[[], socket.socket]] = None
        self.direct = False
        self.lock = threading.Lock()
        host = socket.gethostname()
        self.gate = Gate(LOCAL_ADDR, 0, token, self._connect, lambda line: log(f"{line} (at the relay on {host})"),
                         likely_pids)
        self.port = self.gate.port

    def _connect(self) -> socket.socket:
        """A new connection to the store for one admitted client (on the gate's worker threads)."""
        with self.lock:
            if self.way is None:
                try:
                    self.asked.settimeout(STORE_START_SECONDS)
                    store_port = int.from_bytes(auth.read_exactly(self.asked, 2), "big")
                except OSError:
                    store_port = 0  # the gate's way still works
                finally:
                    self.asked.close()
                self.direct = bool(store_port) and signing_refused() is None
                if self.direct:
                    self.way = functools.partial(connect_signed, self.address, store_port,
                                                 auth.store_key(self.token))
                else:
                    self.way = functools.partial(connect, self.address, self.gate_port, self.token,
                                                 CONNECT_SECONDS)
        return self.way()

    def close(self) -> None:
        """Stop relaying: close the relay's door and every connection through it. Safe to call
        more than once.

        Example::

            >>> relay.close()  # doctest: +SKIP
        """
        self.gate.close()
        self.asked.close()
