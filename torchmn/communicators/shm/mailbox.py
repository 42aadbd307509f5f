"""Point-to-point messages among the ranks of one node through shared memory, not TCP loopback.

One mailbox per ordered pair of ranks (sender, receiver), in one segment per node. A box holds one
chunk at a time: the sender waits until the receiver has taken the previous chunk, writes the
message's tag and length and the chunk, then counts it posted; the receiver waits for a posted
chunk, copies it out and counts it taken. A message longer than a box goes in consecutive chunks.
A receiver that meets a message of another tag than it asked for keeps it for a later receive, so
messages of one tag from one sender arrive in order, and tags may be received out of order (as
``torch.distributed.recv`` allows). Waits spin, yield and sleep (``segment.wait_until``), and
name the peer where it exited, broke off with an error, or outlasted the timeout.
"""
from __future__ import annotations

import collections
import mmap
from typing import Callable

import numpy as np
import torch

from torchmn.communicators.errors import PeerLostError
from torchmn.communicators.shm.segment import (Flags, align, alive, close_mapping, fence, map_segment, segment_name,
                                                wait_until)

HEADER_WORDS = 8  # posted, taken, tag, message bytes, chunk bytes; then padding to a cache line
_POSTED, _TAKEN, _TAG, _TOTAL, _CHUNK = range(5)
# Per box: large enough that a pipeline's activations go in a chunk or a few, small enough that
# local_size ** 2 boxes stay a small part of /dev/shm.
MAX_BOX_BYTES = 1 << 20
MIN_BOX_BYTES = 64 << 10


class Mailboxes:
    """The mailboxes of this rank: its outgoing box to every other rank of the node, and theirs to it.

    Example::

        >>> boxes = Mailboxes.open(tag, 0, local_rank, local_size, pids, comm.allgather_obj, box_bytes=1 << 20)
        >>> boxes.send(1, torch.arange(4).view(torch.uint8), tag=7)      # on local rank 0
        >>> boxes.recv(0, tag=7)                                        # on local rank 1: 32 bytes
    """

    def __init__(self, buf: mmap.mmap, local_rank: int, local_size: int, box_bytes: int, pids: list[int],
                 timeout: float, describe: Callable[[int], str]):
        """Lay the boxes out over a mapping (:meth:`open` maps it and calls this).

        Args:
            buf: the mapping, :meth:`size_for` bytes.
            local_rank, local_size: this rank among the node's ranks.
            box_bytes: the data bytes of each box (a multiple of 64).
            pids, timeout, describe: as for :meth:`open`.

        Example::

            >>> boxes = Mailboxes(buf, r, 2, 1 << 20, pids, 600.0, lambda i: f"local rank {i}")
        """
        self._buf = buf
        self.local_rank = local_rank
        self.local_size = local_size
        self.box_bytes = box_bytes
        self._pids = pids
        self._timeout = timeout
        self._describe = describe
        # One row of flags: only for marking this rank failed (segment.mark_failed) and reading
        # whether a peer did.
        self._flags = Flags(buf, 1, local_rank, local_size, pids, timeout, describe)
        start = Flags.nbytes(1, local_size)
        stride = HEADER_WORDS * 8 + box_bytes
        raw = torch.frombuffer(buf, dtype=torch.uint8)

        def box(sender: int, receiver: int):
            at = start + (sender * local_size + receiver) * stride
            words = memoryview(np.frombuffer(buf, dtype=np.int64, count=HEADER_WORDS, offset=at)).cast("B").cast("q")
            return words, raw[at + HEADER_WORDS * 8:at + stride]
        self._out = {r: box(local_rank, r) for r in range(local_size) if r != local_rank}
        self._in = {r: box(r, local_rank) for r in range(local_size) if r != local_rank}
        self._kept: dict = collections.defaultdict(collections.deque)  # (sender, tag) -> messages received early

    @staticmethod
    def size_for(local_size: int, box_bytes: int) -> int:
        """The bytes of /dev/shm the boxes of a node take.

        Args:
            local_size: the number of ranks of the node.
            box_bytes: the data bytes of each box.

        Returns:
            A row of flags and ``local_size ** 2`` boxes (the diagonal unused, for plain indexing).

        Example::

            >>> Mailboxes.size_for(2, 1 << 20)
            4194560
        """
        return Flags.nbytes(1, local_size) + local_size * local_size * (HEADER_WORDS * 8 + align(box_bytes))

    @staticmethod
    def box_bytes_for(local_size: int, free: int) -> int:
        """The box size for ``local_size`` ranks with ``free`` bytes of /dev/shm left, or 0 for none.

        Args:
            local_size: the number of ranks of the node.
            free: the bytes /dev/shm has left after the node's other segments.

        Returns:
            ``MAX_BOX_BYTES`` where the boxes take at most a quarter of ``free``, less down to
            ``MIN_BOX_BYTES``, else 0 (messages then go over TCP).

        Example::

            >>> Mailboxes.box_bytes_for(2, 8 << 30)
            1048576
        """
        pairs = max(1, local_size * local_size)
        fits = (free // 4) // pairs - HEADER_WORDS * 8
        box = min(MAX_BOX_BYTES, fits) // 64 * 64
        return box if box >= MIN_BOX_BYTES else 0

    @classmethod
    def open(cls, job_tag: str, node: int, local_rank: int, local_size: int, pids: list[int],
             agree: Callable[[bool], list], box_bytes: int, timeout: float = 600.0,
             describe: Callable[[int], str] = lambda r: f"local rank {r}") -> "Mailboxes":
        """Create the boxes on local rank 0 and map them on every local rank (collective).

        Args:
            job_tag, node, local_rank, local_size, pids, agree, timeout, describe: as for
                :meth:`torchmn.communicators.shm.NodeSegment.open`.
            box_bytes: the data bytes of each box (:meth:`box_bytes_for`).

        Returns:
            This rank's mailboxes.

        Raises:
            OSError: /dev/shm has no room (on the rank that failed; the others get RemoteRankError).

        Example::

            >>> boxes = Mailboxes.open(tag, 0, r, 2, pids, comm.allgather_obj, box_bytes=1 << 20)
        """
        box_bytes = align(box_bytes)
        buf = map_segment(segment_name(job_tag + "mail", node, pids[0]), cls.size_for(local_size, box_bytes),
                          local_rank, agree, "or give the machine (container: --shm-size) a larger /dev/shm")
        return cls(buf, local_rank, local_size, box_bytes, pids, timeout, describe)

    # ----------------------------------------------------------------------------- messages
    def send(self, receiver: int, data: torch.Tensor, tag: int) -> None:
        """Send ``data`` (a contiguous ``uint8`` CPU tensor) to local rank ``receiver``.

        Returns once the last chunk is in the box: ``data`` may be changed then.

        Args:
            receiver: the local rank it goes to.
            data: the bytes.
            tag: what the receiver's :meth:`recv` names.

        Raises:
            PeerLostError: the receiver exited, broke off, or took no chunk within the timeout.

        Example::

            >>> boxes.send(1, payload, tag=3)
        """
        words, room = self._out[receiver]
        total = data.numel()
        offset = 0
        while True:
            if words[_POSTED] != words[_TAKEN]:  # the previous chunk is still there
                wait_until(lambda: words[_POSTED] == words[_TAKEN],
                           lambda timed_out: self._look(receiver, timed_out, f"send to {self._describe(receiver)}"),
                           self._timeout)
                fence()  # the receiver's copy-out before our overwrite
            n = min(self.box_bytes, total - offset)
            if n:
                room[:n].copy_(data[offset:offset + n])
            words[_TAG], words[_TOTAL], words[_CHUNK] = tag, total, n
            fence()  # the chunk before the count that announces it
            words[_POSTED] += 1
            offset += n
            if offset >= total:
                return

    def recv(self, sender: int, tag: int) -> torch.Tensor:
        """The next message with ``tag`` from local rank ``sender``, as a new ``uint8`` tensor.

        Messages of other tags met on the way are kept for the receives that ask for them.

        Args:
            sender: the local rank it comes from.
            tag: the tag its :meth:`send` gave.

        Returns:
            The message's bytes, a ``uint8`` CPU tensor of its own.

        Raises:
            PeerLostError: the sender exited, broke off, or sent nothing within the timeout.

        Example::

            >>> payload = boxes.recv(0, tag=3)
        """
        kept = self._kept.get((sender, tag))
        if kept:
            return kept.popleft()
        while True:
            got_tag, message = self._take(sender)
            if got_tag == tag:
                return message
            self._kept[(sender, got_tag)].append(message)

    def _take(self, sender: int) -> tuple[int, torch.Tensor]:
        """The next message in ``sender``'s box to this rank, whatever its tag, chunk by chunk."""
        words, room = self._in[sender]
        out = None
        offset = 0
        while True:
            if words[_POSTED] == words[_TAKEN]:
                wait_until(lambda: words[_POSTED] != words[_TAKEN],
                           lambda timed_out: self._look(sender, timed_out, f"receive from {self._describe(sender)}"),
                           self._timeout)
            fence()  # the count before the chunk it announces
            tag, total, n = words[_TAG], words[_TOTAL], words[_CHUNK]
            if out is None:
                out = torch.empty(total, dtype=torch.uint8)
            if n:
                out[offset:offset + n].copy_(room[:n])
            fence()  # our copy-out before the count that frees the box
            words[_TAKEN] += 1
            offset += n
            if offset >= total:
                return tag, out

    def _look(self, peer: int, timed_out: bool, what: str) -> None:
        failed = self._flags.failed(peer)
        if failed or timed_out or not alive(self._pids[peer]):
            why = "ended with an error" if failed else (
                f"did not answer within {self._timeout:.0f} s (every send needs the matching recv on the "
                f"other rank, with the same tag)" if timed_out and alive(self._pids[peer]) else "exited")
            raise PeerLostError(f"shared-memory {what}: {self._describe(peer)} {why}; "
                                f"{self._describe(self.local_rank)} gives up")

    def close(self) -> None:
        """Unmap the boxes (messages kept for later receives are dropped).

        Example::

            >>> boxes.close()
        """
        self._out = self._in = {}
        self._kept.clear()
        close_mapping(self._buf)
