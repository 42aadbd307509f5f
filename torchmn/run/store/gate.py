"""The gate: the only door to the rendezvous store, on the job's address, for members of the job only.

torch's ``TCPStore`` has no authentication, so the launcher's store listens on 127.0.0.1 alone,
on a port only the gate can connect to (``torchmn.run.store.rendezvous``), and the gate listens
where the ranks were told (``MASTER_ADDR:MASTER_PORT``). For each connection it
reads the first byte:

- a greeting (``torchmn.run.store.auth``): another host's relay (``torchmn.run.store.relay``)
  proves it knows the token, and passes on one client of its host, which it admitted by the same
  rule as below;
- anything else is a ``TCPStore`` client (a rank's, torch's own ``env://``, or the script's). It
  is admitted when the process that holds the connection, on this machine, was started with the
  job's token (``torchmn.run.store.peers``); a client on another host never is, as the job's
  processes there reach the store through their host's relay.

An admitted client is joined to a new connection to the real store, and the gate passes bytes
both ways until either side closes (``torchmn.run.store.pipes``). A relay is the same gate on its
own host's 127.0.0.1, whose way to the store is a signed connection straight to it (or, without
signatures, a greeted connection to the job's gate).

Anything else is closed, with one line in the launcher's output saying who and why. All sockets
are served by one thread (``selectors``); working out who a client is, which reads ``/proc``,
and opening its way to the store, run on a small pool of threads meanwhile.

The door cannot be jammed by a crowd of connections that say nothing: a connection must send its
first byte within ``FIRST_BYTE_SECONDS`` and finish its greeting within ``GREETING_SECONDS``; the
connections not yet admitted are capped per source (a user of this machine, or another host's
address) and in all, the oldest of the largest source making room; a local connection of another
user is refused at once where this launcher could not look into its processes anyway, and one
where it can (as root) is identified on a thread of its own, apart from the launcher's own user's;
and the launcher's soft limit of open files is raised to the hard one, with accepting paused
briefly, never spun on, if even that runs out.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import os
import queue
import resource
import selectors
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from torchmn import network
from torchmn.run.store import auth
from torchmn.run.store.peers import holder_of, identify, socket_of
from torchmn.run.store.pipes import End, Pipes

# Seconds a new connection has to send its first byte (a TCPStore client sends it as it
# connects), and to finish its greeting.
FIRST_BYTE_SECONDS = 5.0
GREETING_SECONDS = 10.0
# Connections not yet admitted (greeting, or being identified): per source, and in all.
MAX_PENDING_PER_SOURCE = 64
MAX_PENDING = 1024
# How long accepting pauses when the launcher is out of file descriptors.
ACCEPT_PAUSE_SECONDS = 0.1
# Refusals written to the log; past this many, one line says the rest are not shown.
MAX_LOGGED_REFUSALS = 20


def listen(address: str, port: int) -> socket.socket:
    """A listening socket on ``address`` (an address or a name of this machine) and ``port``.

    Args:
        address: where to listen; never every interface.
        port: the port, 0 for one the OS picks.

    Returns:
        The socket.

    Raises:
        OSError: the address is not this machine's, or the port is taken.

    Example::

        >>> listen("127.0.0.1", 0).getsockname()[0]
        '127.0.0.1'
    """
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, where = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Only lets a new job reuse a port whose old connections linger in TIME_WAIT; Linux still
        # refuses a second listener.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def raise_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit, as servers do, so that a
    crowd of connections cannot run the gate out of file descriptors at the usual soft limit of 1024.

    Returns:
        The soft limit now.

    Example::

        >>> raise_file_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[1]   # doctest: +SKIP
        True
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            return soft
    return soft


@dataclasses.dataclass(eq=False)
class _Newcomer:
    """A connection whose first bytes have not told yet what it is."""

    sock: socket.socket
    address: Tuple[str, int]
    deadline: float
    source: tuple = ()  # whose it is, for the caps: ("user", uid) here, ("host", address) elsewhere
    data: bytes = b""
    nonces: Optional[bytes] = None  # the client's and the gate's, once the client greeted
    kind: bytes = auth.RELAY  # of greeting (auth.KINDS)
    counted: bool = True  # still among the pending


class Gate:
    """Serve the rendezvous store's door on ``address:port`` for the job whose token is ``token``.

    Args:
        address: the job's address: 127.0.0.1 for a job on one machine (and for a relay), else the
            address the other hosts reach this one on.
        port: the port (``--master-port``), 0 for one the OS picks.
        token: the job's token.
        connect_store: opens a new connection to the real store (see
            ``torchmn.run.store.rendezvous``, which alone can reach its port), or, for a relay, its
            way to the store (``torchmn.run.store.relay.Relay``).
        log: where the gate's lines go (the launcher's console).
        likely_pids: the job's ranks here, looked at first to identify a client.
        direct_port: where the store takes connections signed with ``rendezvous.store_key(token)``
            from other hosts' relays (0: nowhere; they come through the gate), told to a relay
            that asks (``auth.WHERE``).

    Attributes:
        port: the port the gate listens on.

    Raises:
        OSError: the gate cannot listen there.

    Example::

        >>> gate = Gate("127.0.0.1", 0, token, connect_to_store, print)  # doctest: +SKIP
        >>> gate.port, gate.close()  # doctest: +SKIP
    """

    def __init__(self, address: str, port: int, token: str, connect_store: Callable[[], socket.socket],
                 log: Callable[[str], None], likely_pids: Callable[[], Sequence[int]] = tuple,
                 direct_port: Callable[[], int] = lambda: 0):
        raise_file_limit()
        self.listener = listen(address, port)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.token = token
        self.connect_store = connect_store
        self.log = log
        self.likely_pids = likely_pids
        self.direct_port = direct_port
        self.refused: set = set()  # (address, who, why) already in the log
        self.named = 0  # connections refused for saying too little, whose process was looked up
        self.lock = threading.Lock()
        self.calls: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self.selector = selectors.DefaultSelector()
        self.pipes = Pipes(self.selector)
        self.newcomers: Dict[socket.socket, _Newcomer] = {}
        self.pending: "collections.Counter[tuple]" = collections.Counter()  # by source, under lock
        self.accept_paused_until = 0.0
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.workers = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="torchmn-gate")
        # Connections of another user or host, which a launcher running as root looks into too (a
        # rank may run as another user), are identified apart: reading every process of a user who
        # opens them by the hundred cannot hold up the job's own admissions.
        self.strangers = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchmn-gate-other")
        self.closing = False
        self.thread = threading.Thread(target=self._serve, name="torchmn-gate", daemon=True)
        self.thread.start()

    # -- the loop ---------------------------------------------------------------------------------

    def _in_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the gate's thread, which alone touches its sockets."""
        self.calls.put(call)
        try:
            self.wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken, or closed

    def _serve(self) -> None:
        try:
            while not self.closing:
                timeout = 0.5 if self.newcomers or self.accept_paused_until else None
                if self.accept_paused_until and time.monotonic() >= self.accept_paused_until:
                    self.accept_paused_until = 0.0
                    self.selector.register(self.listener, selectors.EVENT_READ, "listener")
                for key, events in self.selector.select(
                        timeout if not self.accept_paused_until else ACCEPT_PAUSE_SECONDS):
                    self._safely(self._ready, key.data, key.fileobj, events, sock=key.fileobj)
                while True:
                    try:
                        call = self.calls.get_nowait()
                    except queue.Empty:
                        break
                    self._safely(call)
                now = time.monotonic()
                for newcomer in [n for n in self.newcomers.values() if n.deadline < now]:
                    what = (f"finished no greeting within {GREETING_SECONDS:g} s" if newcomer.data
                            else f"sent nothing within {FIRST_BYTE_SECONDS:g} s")
                    self._refuse_named(newcomer, f"it {what}")
        finally:
            self._close_all()

    def _safely(self, call: Callable[..., None], *args, sock: Optional[socket.socket] = None) -> None:
        """Run one step of the loop; a mistake in it costs that connection, not the whole store."""
        try:
            call(*args)
        except Exception as e:  # noqa: BLE001
            self.log(f"torchmn run: the rendezvous store's gate dropped a connection after an error: "
                     f"{type(e).__name__}: {e}")
            if sock is not None and sock not in (self.listener, self.wake_r):
                try:
                    self.selector.unregister(sock)
                except (KeyError, ValueError):
                    pass
                sock.close()

    def _ready(self, data, sock: socket.socket, events: int) -> None:
        if isinstance(data, End):  # the usual case first: a request or an answer to pass on
            self.pipes.ready(data, events)
        elif data == "listener":
            self._accept()
        elif data == "wake":
            try:
                while sock.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        elif isinstance(data, _Newcomer):
            self._greeting(data)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting(e)
                return
            sock.setblocking(False)
            newcomer = _Newcomer(sock, address[:2], time.monotonic() + FIRST_BYTE_SECONDS)
            if self._admit_to_pending(newcomer):
                self.newcomers[sock] = newcomer
                self.selector.register(sock, selectors.EVENT_READ, newcomer)

    def _pause_accepting(self, error: OSError) -> None:
        """Out of file descriptors: the waiting connection stays in the kernel's queue, and the
        listener, still readable, would wake the loop at once, again and again; look away for a moment."""
        if not self.accept_paused_until:
            self.log(f"torchmn run: the rendezvous store's gate is out of file descriptors ({error.strerror}); "
                     f"new connections wait until others close (raise the hard limit, ulimit -Hn)")
        self.selector.unregister(self.listener)
        self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_SECONDS

    def _admit_to_pending(self, newcomer: _Newcomer) -> bool:
        """Count a new connection among the pending, or refuse it (see the module's docstring)."""
        found = None
        try:
            found = socket_of(newcomer.address, newcomer.sock.getsockname()[:2])
        except (OSError, ValueError):
            pass
        if found is not None:
            uid = found[1]
            newcomer.source = ("user", uid)
            if uid != os.getuid() and os.geteuid() != 0:
                # Not root: this launcher cannot read that user's /proc, so it could never admit it.
                newcomer.counted = False
                self._refuse(newcomer, f"it belongs to another user (uid {uid}), whose processes this launcher "
                             f"(uid {os.getuid()}) cannot look into; the job's processes are its own")
                return False
        else:
            newcomer.source = ("host", newcomer.address[0])
        with self.lock:
            if self.pending[newcomer.source] >= MAX_PENDING_PER_SOURCE:
                crowded = True
            else:
                crowded = False
                self.pending[newcomer.source] += 1
                total = sum(self.pending.values())
        if crowded:
            newcomer.counted = False
            self._refuse(newcomer, f"{MAX_PENDING_PER_SOURCE} connections from the same "
                         f"{'user' if found else 'host'} are already waiting to be admitted")
            return False
        if total > MAX_PENDING:
            self._make_room()
        return True

    def _make_room(self) -> None:
        """Over MAX_PENDING in all: close the oldest connection still greeting of the largest source."""
        with self.lock:
            largest = self.pending.most_common(1)[0][0]
        oldest = next((n for n in self.newcomers.values() if n.source == largest), None)
        if oldest is not None:
            self._refuse(oldest, f"more than {MAX_PENDING} connections were waiting to be admitted, most of "
                         f"them from its {largest[0]}")

    def _settled(self, newcomer: _Newcomer) -> None:
        """``newcomer`` is no longer pending: joined to the store, or closed."""
        with self.lock:
            if newcomer.counted:
                newcomer.counted = False
                self.pending[newcomer.source] -= 1
                if self.pending[newcomer.source] <= 0:
                    del self.pending[newcomer.source]

    # -- greeting ---------------------------------------------------------------------------------

    def _greeting(self, newcomer: _Newcomer) -> None:
        try:
            chunk = newcomer.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            if newcomer.nonces is None:
                self._drop(newcomer)  # a port check
            else:
                self._refuse(newcomer, "it left after the gate proved the job's token, without proving it "
                             "in turn (a launcher of another job, or a Slurm task whose token differs)")
            return
        if not newcomer.data:
            newcomer.deadline += GREETING_SECONDS - FIRST_BYTE_SECONDS
        newcomer.data += chunk
        if newcomer.nonces is None and not newcomer.data.startswith(auth.GREETING_BYTE):
            # A TCPStore client: working out who it is reads /proc.
            self._forget(newcomer)
            own = newcomer.source == ("user", os.getuid())
            (self.workers if own else self.strangers).submit(self._admit, newcomer)
            return
        if newcomer.nonces is None:
            prefix = auth.GREETING_PREFIX
            opening = len(prefix) + 1 + auth.NONCE_SIZE
            if newcomer.data[:len(prefix)] != prefix[:len(newcomer.data)] or (
                    len(newcomer.data) > len(prefix) and newcomer.data[len(prefix):len(prefix) + 1] not in auth.KINDS):
                self._refuse(newcomer, "it sent an unknown greeting")
                return
            if len(newcomer.data) < opening:
                return
            newcomer.kind = newcomer.data[len(prefix):len(prefix) + 1]
            newcomer.nonces = newcomer.data[len(prefix) + 1:opening] + os.urandom(auth.NONCE_SIZE)
            newcomer.data = newcomer.data[opening:]
            try:  # 64 bytes into an empty buffer: sent whole
                newcomer.sock.send(newcomer.nonces[auth.NONCE_SIZE:] + auth.proof(self.token, auth.SERVER,
                                                                                  newcomer.nonces, newcomer.kind))
            except OSError:
                self._drop(newcomer)
                return
        if len(newcomer.data) < auth.PROOF_SIZE:
            return
        if not auth.proof_matches(self.token, auth.CLIENT, newcomer.nonces, newcomer.data[:auth.PROOF_SIZE],
                                  newcomer.kind):
            self._refuse(newcomer, "it presented a wrong token (another job's, or a guess)")
            return
        self._forget(newcomer)
        newcomer.data = newcomer.data[auth.PROOF_SIZE:]  # the relayed client's first bytes, if already sent
        try:
            newcomer.sock.send(auth.ACCEPTED)  # one byte into an empty buffer: sent whole
        except OSError:
            self._settled(newcomer)
            newcomer.sock.close()
            return
        self.workers.submit(self._tell_where if newcomer.kind == auth.WHERE else self._open_the_way, newcomer)

    def _tell_where(self, newcomer: _Newcomer) -> None:
        """Tell a relay that asked, once greeted, where the store takes signed connections directly
        (on a worker thread: the store may have to start first), and close."""
        try:
            port = self.direct_port()
        except Exception as e:  # noqa: BLE001 - the relay then goes through the gate, which says why
            if not self.closing:  # else the job has ended, before its store was needed: nothing went wrong
                self.log(f"torchmn run: the rendezvous store could not be opened for another host's relay: {e}")
            port = 0
        self._settled(newcomer)

        def answer() -> None:
            try:
                newcomer.sock.setblocking(True)
                newcomer.sock.settimeout(5)
                newcomer.sock.sendall(port.to_bytes(2, "big"))
            except OSError:
                pass
            newcomer.sock.close()
        self._in_loop(answer)

    def _forget(self, newcomer: _Newcomer) -> None:
        self.newcomers.pop(newcomer.sock, None)
        try:
            self.selector.unregister(newcomer.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, newcomer: _Newcomer) -> None:
        """A connection closed before it said anything: a port check, nothing to log."""
        self._forget(newcomer)
        self._settled(newcomer)
        newcomer.sock.close()

    def _refuse(self, newcomer: _Newcomer, why: str, who: str = "") -> None:
        self._forget(newcomer)
        self._settled(newcomer)
        newcomer.sock.close()
        self._log_refusal(newcomer.address, who, why)

    def _refuse_named(self, newcomer: _Newcomer, why: str) -> None:
        """Refuse a connection that said too little, naming the process that holds it where it is
        this machine's: looked up on a worker thread (it reads /proc), for the first few only, so
        that a crowd of them costs no more than closing."""
        with self.lock:
            self.named += 1
            look = self.named <= MAX_LOGGED_REFUSALS
        if not look:
            self._refuse(newcomer, why)
            return
        self._forget(newcomer)

        def name_and_close() -> None:
            try:
                peer = holder_of(newcomer.address, newcomer.sock.getsockname()[:2])
                who = peer.describe() if peer.found else ""
            except Exception:  # noqa: BLE001 - a name for the log only
                who = ""
            self._settled(newcomer)
            newcomer.sock.close()
            self._log_refusal(newcomer.address, who, why)
        self.workers.submit(name_and_close)

    def _log_refusal(self, address: Tuple[str, int], who: str, why: str) -> None:
        # A TCPStore client that is refused tries again until its timeout: one line per process
        # (or per address and reason, where the process is not known), not one per try.
        with self.lock:
            if (address[0], who, why) in self.refused:
                return
            self.refused.add((address[0], who, why))
            count = len(self.refused)
        if count > MAX_LOGGED_REFUSALS:
            return
        where = f"[{address[0]}]:{address[1]}" if ":" in address[0] else f"{address[0]}:{address[1]}"
        line = (f"torchmn run: refused a connection to the rendezvous store from {where}"
                f"{f' ({who})' if who else ''}: {why}; the store admits only the job's own processes")
        if count == MAX_LOGGED_REFUSALS:
            line += " (further refusals are not shown)"
        self.log(line)

    # -- admitting a TCPStore client (on a worker thread) -----------------------------------------

    def _admit(self, newcomer: _Newcomer) -> None:
        try:
            gate_end = newcomer.sock.getsockname()[:2]
            peer = identify(newcomer.address, gate_end, self.token, first=self._likely(), own_pids=(os.getpid(),))
        except Exception as e:  # noqa: BLE001 - whatever fails, the client must not hang half-admitted
            self._settled(newcomer)
            newcomer.sock.close()
            self._log_refusal(newcomer.address, "", f"could not be identified ({e})")
            return
        if not peer.member:
            self._settled(newcomer)
            newcomer.sock.close()
            if peer.found:
                self._log_refusal(newcomer.address, peer.describe(), "it was not started with this job's token "
                                  "(TORCHMN_JOB_TOKEN) and presented none; a rank of the job needs the "
                                  "TORCHMN_JOB_TOKEN of the environment torchmn run gave it")
            elif network.is_local(newcomer.address[0]):
                # No socket of this machine holds the connection any more: its process closed it first.
                self._log_refusal(newcomer.address, "this machine", "it closed the connection before it could be "
                                  "identified")
            else:
                self._log_refusal(newcomer.address, "another host", "it did not come through that host's relay "
                                  "(a watcher or Slurm task of the job), the only way in from another host")
            return
        self._open_the_way(newcomer)

    def _open_the_way(self, newcomer: _Newcomer) -> None:
        """Join an admitted client to a new connection to the store (on a worker thread)."""
        try:
            store = self.connect_store()
        except Exception as e:  # noqa: BLE001 - whatever fails, the client must not hang half-admitted
            self._settled(newcomer)
            newcomer.sock.close()
            self._log_refusal(newcomer.address, "", f"could not be joined to the store ({e})")
            return
        self._settled(newcomer)
        self._in_loop(lambda: self._join(newcomer, store))

    def _likely(self) -> List[int]:
        try:
            return list(self.likely_pids())
        except Exception:  # noqa: BLE001 - a hint only
            return []

    def _join(self, newcomer: _Newcomer, store: socket.socket) -> None:
        if self.closing:
            newcomer.sock.close()
            store.close()
            return
        self.pipes.join(newcomer.sock, store, newcomer.data)

    # -- closing ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving: close the door and every connection through it (the ranks' store
        connections included). Safe to call more than once.

        Waits up to 5 s for the gate's thread to close its sockets (not when called on that
        thread); clients still being identified are closed when their turn comes.

        Example::

            >>> gate = Gate("127.0.0.1", 0, token, connect_to_store, print)  # doctest: +SKIP
            >>> gate.close()  # doctest: +SKIP
        """
        if self.closing:
            return
        self.closing = True
        try:
            self.wake_w.send(b"\0")
        except OSError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(5)
        # Connections still queued to be identified are dropped: a crowd of them would otherwise keep
        # the launcher from exiting (the interpreter waits for its pools' queued work).
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.strangers.shutdown(wait=False, cancel_futures=True)

    def _close_all(self) -> None:
        self.pipes.close_all()
        for key in list(self.selector.get_map().values()):
            try:
                key.fileobj.close()
            except OSError:
                pass
        self.selector.close()
        self.wake_w.close()
        while True:
            try:
                self.calls.get_nowait()()  # joins still queued: they see closing and close their sockets
            except queue.Empty:
                break
            except Exception:  # noqa: BLE001 - whatever it was, the gate is closing
                continue
