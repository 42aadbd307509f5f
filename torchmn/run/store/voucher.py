"""The voucher: a watcher's or launcher's connection to the job's gate, answering for its host.

A ``TCPStore`` client on another host than the launcher's cannot be identified from the
launcher's machine (see ``torchmn.run.store.gate``). So each remote rank's watcher, and each Slurm
task's launcher, connects to the gate first, proves it knows the job's token (the greeting of
``torchmn.run.store.auth``), and then answers the gate's questions about its host's connections:

- the gate sends ``Q <n> <client address> <client port> <gate address> <gate port>\\n``;
- the voucher looks the connection up in its own ``/proc`` (``torchmn.run.store.peers``) and answers
  ``A <n> 1 <who>\\n`` when the process holding it was started with the token (or is the voucher's
  own process), ``A <n> 0 <who>\\n`` otherwise.

The same connection is the watcher's check that the store is reachable from its host, and tells
it which of the host's addresses reaches the launcher (for ``GLOO_SOCKET_IFNAME``). Standard
library only: the watcher loads this module on hosts where torch must not be imported.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, Optional, Sequence

from torchmn.run.store import auth
from torchmn.run.store.peers import identify


class Voucher:
    """A connection to the gate that answers for this host; see the module's docstring.

    Args:
        sock: connected to the gate, greeting done (see ``connect``).
        token: the job's token.
        likely_pids: processes to look at first (the watcher's rank).

    Attributes:
        local_address: this host's address that the connection leaves from.
    """

    def __init__(self, sock: socket.socket, token: str, likely_pids: Callable[[], Sequence[int]] = tuple):
        self.sock = sock
        self.token = token
        self.likely_pids = likely_pids
        self.local_address = sock.getsockname()[0]
        self.thread: Optional[threading.Thread] = None

    @classmethod
    def connect(cls, address: str, port: int, token: str, seconds: float,
                likely_pids: Callable[[], Sequence[int]] = tuple) -> "Voucher":
        """Connect to the gate at ``address:port`` and greet it, retrying for ``seconds`` while
        nothing listens there yet (another node's launcher may start later).

        Args:
            address, port: the rendezvous store's address (``MASTER_ADDR``, ``MASTER_PORT``).
            token: the job's token.
            seconds: how long to keep trying to connect.
            likely_pids: see ``Voucher``.

        Returns:
            The voucher, not yet answering (see ``serve``).

        Raises:
            auth.ImpostorError: what listens there did not prove it knows the token (not this job's
                gate); it was sent nothing but a nonce.
            auth.TokenError: the gate refused the token.
            OSError: nothing could be reached within ``seconds``.

        Example::

            >>> voucher = Voucher.connect(os.environ["MASTER_ADDR"], 29500, token, 10)  # doctest: +SKIP
            >>> voucher.serve()  # doctest: +SKIP
        """
        deadline = time.monotonic() + seconds
        while True:
            try:
                sock = socket.create_connection((address, port), timeout=5)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
        try:
            sock.settimeout(max(5.0, deadline - time.monotonic()))
            auth.greet(sock, token)
            sock.settimeout(None)
        except OSError:
            sock.close()
            raise
        return cls(sock, token, likely_pids)

    def serve(self) -> None:
        """Answer the gate's questions on a daemon thread until the connection closes.

        Each question line gets ``answer``'s line back; the thread ends when the gate closes the
        connection or it fails.

        Example::

            >>> voucher = Voucher.connect(os.environ["MASTER_ADDR"], 29500, token, 10)  # doctest: +SKIP
            >>> voucher.serve()  # doctest: +SKIP
        """
        self.thread = threading.Thread(target=self._answer, name="torchmn-voucher", daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        pending = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                answer = self.answer(line)
                if answer is not None:
                    try:
                        self.sock.sendall(answer)
                    except OSError:
                        return

    def answer(self, line: bytes) -> Optional[bytes]:
        """The answer to one question line from the gate.

        Args:
            line: ``Q <n> <client address> <client port> <gate address> <gate port>``.

        Returns:
            The answer line, or None for a line that is no question.

        Example::

            >>> voucher.answer(b"Q 7 10.0.0.2 40000 10.0.0.1 29500")  # doctest: +SKIP
            b'A 7 1 process 812 (python) of user me\\n'
        """
        words = line.decode(errors="replace").split()
        if len(words) != 6 or words[0] != "Q" or not words[1].isdigit():
            return None
        try:
            client, gate = (words[2], int(words[3])), (words[4], int(words[5]))
            peer = identify(client, gate, self.token, first=list(self.likely_pids()), own_pids=(os.getpid(),))
            member, who = peer.member, peer.describe()
        except (ValueError, OSError) as e:
            member, who = False, f"cannot tell ({e})"
        return f"A {words[1]} {1 if member else 0} {who}\n".encode()

    def close(self) -> None:
        """Close the connection; the gate then forgets this voucher.

        The serving thread, if any, ends as its read fails.

        Example::

            >>> voucher.close()  # doctest: +SKIP
        """
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
