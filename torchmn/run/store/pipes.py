"""Passing bytes both ways between an admitted client and the rendezvous store, for the gate.

The gate (``torchmn.run.store.gate``) joins each admitted client's socket to a new connection to the
real store; ``Pipes`` then moves bytes between the two on the gate's own thread, with its
``selectors`` loop: non-blocking sockets, a buffer per side, and a side not read while its peer
has ``HIGH_WATER`` bytes waiting (a large value in the store must not fill the launcher's memory).
When either side closes, both are closed: a ``TCPStore`` connection has no half-closed state.
"""
from __future__ import annotations

import dataclasses
import selectors
import socket
from typing import Optional, Set

# A side whose peer has this many bytes waiting to be written is not read until they drain.
HIGH_WATER = 4 << 20


@dataclasses.dataclass(eq=False)
class End:
    """One side of a joined pair: the client's socket, or the store's.

    Attributes:
        sock: the socket.
        other: the other side.
        out: bytes waiting to be written to ``sock``.
        events: what the selector watches ``sock`` for (0: not registered).
        closed: the pair was closed.
    """

    sock: socket.socket
    other: Optional["End"] = None
    out: bytearray = dataclasses.field(default_factory=bytearray)
    events: int = 0
    closed: bool = False


class Pipes:
    """The joined pairs of one selector loop; call every method from the loop's thread.

    Args:
        selector: the loop's selector; the sockets of this object's pairs are registered with an
            ``End`` as their data, which the loop hands to ``ready``.

    Example::

        >>> pipes = Pipes(selectors.DefaultSelector())
        >>> pipes.join(client_sock, store_sock, b"what the client sent first")  # doctest: +SKIP
    """

    def __init__(self, selector: selectors.BaseSelector):
        self.selector = selector
        self.ends: Set[End] = set()

    def join(self, client: socket.socket, store: socket.socket, first: bytes = b"") -> None:
        """Join ``client`` to ``store``.

        Both sockets are made non-blocking, without Nagle's delay; ``first`` goes to the store at
        once, and the pair is registered with the selector. From then on ``ready`` moves the bytes.

        Args:
            client: the admitted client's socket.
            store: a new connection to the store.
            first: what the client sent before it was admitted, for the store.

        Example::

            >>> pipes.join(client_sock, store_sock, b"what the client sent first")  # doctest: +SKIP
        """
        for sock in (client, store):
            sock.setblocking(False)
            # The store's requests are small and wait for their answer: no Nagle delay on either hop.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        a, b = End(client), End(store)
        a.other, b.other = b, a
        self.ends.update((a, b))
        b.out += first
        self._flush(b)
        if not a.closed:
            self._watch(a)

    def ready(self, end: End, events: int) -> None:
        """Handle what the selector found ready on ``end``'s socket.

        Writes what waits for ``end``'s socket, then reads what it sent and passes it to the other
        side. When either side closes or fails, both are closed.

        Args:
            end: the registered data.
            events: the ready events.

        Example::

            >>> for key, events in selector.select():  # doctest: +SKIP
            ...     if isinstance(key.data, End):
            ...         pipes.ready(key.data, events)
        """
        if events & selectors.EVENT_WRITE:
            self._flush(end)
        if events & selectors.EVENT_READ and not end.closed:
            self._read(end)

    def _watch(self, end: End) -> None:
        for side in (end, end.other):
            if side.closed:
                continue
            wanted = ((selectors.EVENT_READ if len(side.other.out) < HIGH_WATER else 0)
                      | (selectors.EVENT_WRITE if side.out else 0))
            if wanted == side.events:
                continue
            if side.events == 0:
                self.selector.register(side.sock, wanted, side)
            elif wanted == 0:
                self.selector.unregister(side.sock)
            else:
                self.selector.modify(side.sock, wanted, side)
            side.events = wanted

    def _read(self, end: End) -> None:
        try:
            chunk = end.sock.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(end)
            return
        other = end.other
        if not other.out:
            # The usual case, a request or its answer: straight on, with no bookkeeping when it
            # goes whole (the selector's interest in either socket does not change).
            try:
                sent = other.sock.send(chunk)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(end)
                return
            if sent == len(chunk):
                return
            chunk = chunk[sent:]
        other.out += chunk
        self._flush(other)

    def _flush(self, end: End) -> None:
        while end.out and not end.closed:
            try:
                sent = end.sock.send(end.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(end)
                return
            del end.out[:sent]
        if not end.closed:
            self._watch(end)

    def _close(self, end: End) -> None:
        for side in (end, end.other):
            if side.closed:
                continue
            side.closed = True
            if side.out:
                try:
                    side.sock.send(side.out)  # what the other side said last, as far as it goes
                except OSError:
                    pass
            if side.events:
                self.selector.unregister(side.sock)
                side.events = 0
            side.sock.close()
            self.ends.discard(side)

    def close_all(self) -> None:
        """Close every pair's sockets (the loop is ending).

        The sockets are not unregistered from the selector, which the loop closes next; bytes not
        yet written are dropped.

        Example::

            >>> pipes.close_all(); selector.close()  # doctest: +SKIP
        """
        for end in list(self.ends):
            end.closed = True
            try:
                end.sock.close()
            except OSError:
                pass
        self.ends.clear()
