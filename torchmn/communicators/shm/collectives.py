"""Collectives among the ranks of one node through POSIX shared memory, not TCP loopback.

One segment per node: a row of flags, one slot per rank and a result area. An allreduce is a
reduce-scatter then an all-gather: every rank copies its input into its slot, each rank sums its
own chunk across all slots into the result area, and every rank copies the result out. Ranks wait
for each other by watching the flags (a sequence number per rank and phase), never through a
socket. The segment's name is unlinked as soon as every rank has mapped it, so a crash, even a
SIGKILL, leaves nothing behind in /dev/shm; the memory goes when the last rank exits.
"""
from __future__ import annotations

import mmap
import os
import uuid
from typing import Callable, Optional

import numpy as np
import torch

from torchmn import resources
from torchmn.communicators.ops import reduce_in_order
from torchmn.communicators.shm.segment import (ALIGN, SHM_DIR, Flags, align, chunk_bounds, close_mapping,
                                                map_segment, segment_name)

DEFAULT_SLOT_MB = 16  # per rank; TORCHMN_SHM_SLOT_MB overrides. Larger tensors go in pieces.
PHASES = 2  # "my slot is written", "my chunk is reduced"


def new_job_tag() -> str:
    """A tag unique to this job, so that two jobs on one machine never share a segment.

    Returns:
        16 hex digits.

    Example::

        >>> tag = comm.bcast_obj(new_job_tag())    # one rank's tag, the same on every rank
    """
    return uuid.uuid4().hex[:16]


# What a NodeSegment operation is, as the other ranks' mismatch check names it: ranks at the same
# call number in different operations (one rank's call check against another's gradient sum) raise
# instead of reading each other's data.
SEGMENT_CALLS = ("an allreduce", "a reduce-scatter", "an all-gather", "a broadcast",
                 "an exchange of small buffers (a collective call check, or objects)", "a barrier",
                 "an allreduce of a small tensor", "a collective call check")
(_ALLREDUCE, _REDUCE_SCATTER, _ALLGATHER, _BROADCAST, _ALLGATHER_BYTES, _BARRIER,
 _ALLREDUCE_SMALL, _CALL_CHECK) = range(len(SEGMENT_CALLS))
# Tensors up to this many bytes are reduced in one round: each rank writes its tensor into a small
# buffer of its own and reads every rank's (see NodeSegment.allreduce_).
SMALL_BYTES = 32 << 10


class NodeSegment:
    """The shared-memory collectives of the ``local_size`` ranks of one node.

    Layout: the flags, one slot per rank, the result area, then two small buffers per rank (for
    tensors up to :data:`SMALL_BYTES`, used by turns: call ``k`` writes buffer ``k % 2``, which call
    ``k + 2`` can only reach once every rank has passed call ``k + 1``, so done reading call ``k``).

    Built collectively: the node's first rank creates the segment, the others map it once
    ``agree`` says it exists, and the creator unlinks the name once ``agree`` says all mapped it.

    Example::

        >>> seg = NodeSegment.open(tag, node=0, local_rank=r, local_size=2, pids=pids, agree=comm.allgather_obj)
        >>> seg.allreduce_(flat)                      # in place, summed over the node's ranks
    """

    def __init__(self, buf: mmap.mmap, local_rank: int, local_size: int, slot_bytes: int,
                 pids: list[int], timeout: float, describe: Callable[[int], str]):
        """Lay the segment out over a mapping: the flags, one slot per rank, then the result area.

        :meth:`open` maps the segment and calls it.

        Args:
            buf: the mapping, at least :meth:`size_for` bytes.
            local_rank, local_size: this rank among the node's ranks.
            slot_bytes: the bytes of each slot and of the result area (a multiple of 64).
            pids, timeout, describe: as for :meth:`open`.

        Example::

            >>> seg = NodeSegment(buf, r, 2, 1 << 20, pids, 600.0, lambda i: f"local rank {i}")
        """
        self._buf = buf
        self.local_rank = local_rank
        self.local_size = local_size
        self.slot_bytes = slot_bytes
        self._seq = 0
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        flags_bytes = Flags.nbytes(PHASES, local_size)
        self._flags = Flags(buf, PHASES, local_rank, local_size, pids, timeout, describe)
        self._slots = [raw[flags_bytes + i * slot_bytes: flags_bytes + (i + 1) * slot_bytes]
                       for i in range(local_size)]
        start = flags_bytes + local_size * slot_bytes
        self._result = raw[start:start + slot_bytes]
        start += slot_bytes
        self._small_views: dict = {}
        # Per call header seen (rows, payload length): its words, as bytes and as an array, and
        # every rank's headers where all sent the same, so that the common case costs a compare.
        self._calls: dict = {}
        self._payload_views: dict = {}
        self._small = [[raw[start + (2 * i + k) * SMALL_BYTES:start + (2 * i + k + 1) * SMALL_BYTES]
                        for k in range(2)] for i in range(local_size)]
        # The same buffers as int64 words, for call headers (numpy takes Python lists fastest).
        self._small_words = [[np.frombuffer(buf, dtype=np.int64, count=SMALL_BYTES // 8,
                                            offset=start + (2 * i + k) * SMALL_BYTES) for k in range(2)]
                             for i in range(local_size)]
        # The other ranks' words: a call check compares only theirs with the call this rank wrote.
        self._peer_words = [w for i, w in enumerate(self._small_words) if i != self.local_rank]

    # ----------------------------------------------------------------------------- set-up
    @staticmethod
    def size_for(local_size: int, slot_bytes: int) -> int:
        """The bytes of /dev/shm a segment with these slots takes.

        Args:
            local_size: the number of ranks of the node.
            slot_bytes: the bytes of each rank's slot.

        Returns:
            The flags' bytes, ``local_size + 1`` slots (the last is the result area) and two
            small buffers per rank.

        Example::

            >>> NodeSegment.size_for(2, 1 << 20)
            3276864
        """
        return Flags.nbytes(PHASES, local_size) + (local_size + 1) * slot_bytes + 2 * local_size * SMALL_BYTES

    @classmethod
    def open(cls, job_tag: str, node: int, local_rank: int, local_size: int, pids: list[int],
             agree: Callable[[bool], list], slot_bytes: Optional[int] = None, timeout: float = 600.0,
             describe: Callable[[int], str] = lambda r: f"local rank {r}") -> "NodeSegment":
        """Create the segment on local rank 0 and map it on every local rank (collective).

        Args:
            job_tag: new for every segment (:func:`torchmn.communicators.shm.new_job_tag`), the same on
                every rank of the node.
            node: the node's index, in the segment's name.
            local_rank, local_size: this rank among the node's ranks.
            pids: the node's ranks' process ids, to tell a dead peer from a slow one.
            agree: a collective that returns every rank's value (``comm.allgather_obj``).
            slot_bytes: each rank's slot (default ``TORCHMN_SHM_SLOT_MB``, 16 MB); larger tensors go
                in pieces.
            timeout: seconds a collective waits for the other ranks.
            describe: names local rank ``r`` in errors.

        Returns:
            The segment.

        Raises:
            OSError: /dev/shm has no room (on the rank that failed; the others get RemoteRankError).

        Example::

            >>> tag, pids = comm.bcast_obj(new_job_tag()), comm.allgather_obj(os.getpid())
            >>> seg = NodeSegment.open(tag, 0, comm.intra_rank, comm.intra_size, pids, comm.allgather_obj)
        """
        if slot_bytes is None:
            slot_bytes = requested_slot_bytes()
        slot_bytes = max(ALIGN, align(slot_bytes))  # every dtype's view needs aligned slots
        nbytes = cls.size_for(local_size, slot_bytes)
        buf = map_segment(segment_name(job_tag, node, pids[0]), nbytes, local_rank, agree,
                          "set TORCHMN_SHM_SLOT_MB lower")
        return cls(buf, local_rank, local_size, slot_bytes, pids, timeout, describe)

    # ----------------------------------------------------------------------------- waiting
    def _arrive_and_wait(self, phase: int, call: int) -> None:
        self._flags.arrive_and_wait(phase, self._seq, call, SEGMENT_CALLS)

    # ----------------------------------------------------------------------------- collectives
    def _chunk(self, n: int, itemsize: int, r: int) -> tuple[int, int]:
        return chunk_bounds(n, itemsize, r, self.local_size)

    def allreduce_(self, flat: torch.Tensor, op: str = "sum", out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Reduce a contiguous 1-D CPU tensor over the node's ranks, in place (or into ``out``).

        Every rank gets the same bits, since each chunk is reduced by one rank in one order.

        Args:
            flat: this rank's tensor.
            op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``.
            out: where the result goes (default: ``flat``).

        Returns:
            ``out``.

        Example::

            >>> seg.allreduce_(flat, "max")                 # flat now holds the node's maximum
        """
        out = flat if out is None else out
        item = flat.element_size()
        if flat.numel() * item <= SMALL_BYTES and self.local_size > 1:
            return self._allreduce_small(flat, op, out)
        per_piece = self.slot_bytes // item
        for start in range(0, flat.numel(), per_piece):
            piece = flat[start:start + per_piece]
            n = piece.numel()
            slots = [s[:n * item].view(flat.dtype) for s in self._slots]
            result = self._result[:n * item].view(flat.dtype)
            self._seq += 1
            slots[self.local_rank].copy_(piece)
            self._arrive_and_wait(0, _ALLREDUCE)
            lo, hi = self._chunk(n, item, self.local_rank)
            if hi > lo:
                reduce_in_order([s[lo:hi] for s in slots], op, result[lo:hi])
            self._arrive_and_wait(1, _ALLREDUCE)
            out[start:start + n].copy_(result)
        return out

    def _allreduce_small(self, flat: torch.Tensor, op: str, out: torch.Tensor) -> torch.Tensor:
        """One round instead of two: every rank reduces the whole (small) tensor from every rank's
        buffer, in rank order, as the owner of each chunk does in the large path: the same bits."""
        self._seq += 1
        key = (self._seq % 2, flat.numel(), flat.dtype)
        parts = self._small_views.get(key)
        if parts is None:  # views made once per size: making them costs more than the copy
            if len(self._small_views) >= 64:
                self._small_views.clear()
            nbytes = flat.numel() * flat.element_size()
            parts = self._small_views[key] = [buffers[key[0]][:nbytes].view(flat.dtype) for buffers in self._small]
        parts[self.local_rank].copy_(flat)
        self._arrive_and_wait(0, _ALLREDUCE_SMALL)
        return reduce_in_order(parts, op, out)

    def exchange_rows(self, rows: list[list[int]], payload: Optional[torch.Tensor] = None) -> Optional[tuple]:
        """Every local rank's call-header rows, with a small payload beside them where every rank
        sends one, in one round through the small buffers.

        Every call check of the node goes this way, with or without a payload, so that ranks in
        different calls meet here and the check can name both calls.

        Args:
            rows: this rank's rows (int64 values, ``HEADER_LEN`` each).
            payload: data to send with them (a contiguous 1-D tensor), or None. Sent only where
                rows and payload fit a small buffer.

        Returns:
            ``(headers, payloads)``. ``headers``: an int64 tensor ``[local_size, len(rows),
            len(rows[0])]``; where another rank sent another number of rows (it makes another
            call), every rank's first row only, ``[local_size, 1, len(rows[0])]``, for the call check
            to name the calls. ``payloads``: every rank's payload, in rank order and this payload's dtype
            (views into shared memory, valid until the next call but one), where every rank sent
            one of this length in bytes;
            else None, on every rank alike. None instead of the tuple where this rank's rows do not
            fit a small buffer (the caller takes the general way; the others in the same call do
            alike, having as many rows).

        Example::

            >>> headers, _ = seg.exchange_rows([[6, -1, 0, 7, 1, 1024] + [-1] * 10])
            >>> headers.shape                                   # 2 local ranks
            torch.Size([2, 1, 16])
        """
        flat = [v for row in rows for v in row]
        n = len(flat)
        at = align((n + 2) * 8)  # where the payload starts, on a cache line
        if at > SMALL_BYTES:
            return None
        size = payload.numel() * payload.element_size() if payload is not None else -1
        nbytes = size if 0 <= size and at + size <= SMALL_BYTES else -1
        width = len(rows[0])
        call = self._call(flat, nbytes, len(rows), width)
        self._seq += 1
        turn = self._seq % 2
        words = self._small_words[self.local_rank][turn]
        words[:n + 2] = call[1]
        views = self._payloads(turn, at, nbytes, payload.dtype) if nbytes >= 0 else None
        if views is not None:
            views[self.local_rank].copy_(payload)
        self._arrive_and_wait(0, _CALL_CHECK)
        if all(w[turn][:n + 2].tobytes() == call[0] for w in self._peer_words):
            # Every rank made this very call (the common case): the headers and payloads are known.
            return call[2], views
        theirs = [w[turn] for w in self._small_words]
        if any(int(w[0]) != n for w in theirs):
            return torch.from_numpy(np.stack([w[2:width + 2] for w in theirs])).view(self.local_size, 1, width), None
        headers = torch.from_numpy(np.stack([w[2:n + 2] for w in theirs])).view(self.local_size, len(rows), width)
        return headers, (views if views is not None and all(int(w[1]) == nbytes for w in theirs) else None)

    def _call(self, flat: list, nbytes: int, rows: int, width: int) -> tuple:
        """``(words as bytes, words as an array, every rank's headers were they all this call's)``
        for this header and payload length, made once per call header."""
        key = (tuple(flat), nbytes)
        call = self._calls.get(key)
        if call is None:
            if len(self._calls) >= 256:
                self._calls.clear()
            packed = np.array([len(flat), nbytes, *flat], dtype=np.int64)
            same = torch.from_numpy(np.tile(packed[2:], (self.local_size, 1))).view(self.local_size, rows, width)
            call = self._calls[key] = (packed.tobytes(), packed, same)
        return call

    def _payloads(self, turn: int, at: int, nbytes: int, dtype: torch.dtype) -> list:
        """Every rank's payload of ``nbytes`` at ``at`` in its small buffer of ``turn``, as ``dtype``
        (views made once: making them costs more than the copy of a small payload)."""
        key = (turn, at, nbytes, dtype)
        views = self._payload_views.get(key)
        if views is None:
            if len(self._payload_views) >= 256:
                self._payload_views.clear()
            views = self._payload_views[key] = [buffers[turn][at:at + nbytes].view(dtype) for buffers in self._small]
        return views

    def calls_now(self) -> dict:
        """What each local rank is at in this rank's current call, for naming a mismatch: a rank in
        a barrier ``"barrier"``; in a call check, the collective code of its first header row
        (``_call_check.KINDS``); in another operation, its description (``SEGMENT_CALLS``).

        Returns:
            ``{local rank: call}`` for the ranks at this rank's call number.

        Example::

            >>> seg.calls_now()                  # rank 0 in a barrier, rank 1 checking an allreduce
            {0: 'barrier', 1: 6}
        """
        turn = self._seq % 2
        out = {}
        for r, kind in self._flags.calls_at(0, self._seq).items():
            if kind == _BARRIER:
                out[r] = "barrier"
            elif kind == _CALL_CHECK:
                out[r] = int(self._small_words[r][turn][2])
            else:
                out[r] = SEGMENT_CALLS[kind]
        return out

    def barrier(self) -> None:
        """Return once every local rank has called it (one flag each, no data).

        Raises:
            PeerLostError: a rank of the node ended, or did not come within the timeout.
            CollectiveMismatchError: a rank is at another call of the segment.

        Example::

            >>> seg.barrier()
        """
        self._seq += 1
        self._arrive_and_wait(0, _BARRIER)

    def reduce_scatter(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Sum ``flat`` (local_size * k elements) over the node; local rank r gets chunk r in ``shard``.

        Args:
            flat: this rank's contiguous CPU tensor of ``local_size * k`` elements.
            shard: ``k`` elements, overwritten with elements ``[r*k, (r+1)*k)`` of the sum.

        Example::

            >>> seg.reduce_scatter(grads, my_shard)           # grads: local_size * k elements, my_shard: k
        """
        k = shard.numel()
        item = flat.element_size()
        per_piece = max(1, self.slot_bytes // (item * self.local_size))
        for start in range(0, k, per_piece):
            n = min(per_piece, k - start)
            self._seq += 1
            mine = self._slots[self.local_rank][:self.local_size * n * item].view(flat.dtype)
            for r in range(self.local_size):
                mine[r * n:(r + 1) * n].copy_(flat[r * k + start:r * k + start + n])
            self._arrive_and_wait(0, _REDUCE_SCATTER)
            me = self.local_rank
            parts = [s[:self.local_size * n * item].view(flat.dtype)[me * n:(me + 1) * n] for s in self._slots]
            out = shard[start:start + n]
            sum_into(out, parts)
            self._arrive_and_wait(1, _REDUCE_SCATTER)

    def allgather(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Every local rank's ``shard`` (k elements) into ``flat`` (local_size * k), in rank order.

        Args:
            flat: ``local_size * k`` elements, overwritten; local rank r's shard lands at ``[r*k, (r+1)*k)``.
            shard: this rank's ``k`` elements.

        Example::

            >>> seg.allgather(params, my_shard)               # params: local_size * k elements
        """
        k = shard.numel()
        item = flat.element_size()
        per_piece = max(1, self.slot_bytes // item)
        for start in range(0, k, per_piece):
            n = min(per_piece, k - start)
            self._seq += 1
            self._slots[self.local_rank][:n * item].view(flat.dtype).copy_(shard[start:start + n])
            self._arrive_and_wait(0, _ALLGATHER)
            for r in range(self.local_size):
                flat[r * k + start:r * k + start + n].copy_(self._slots[r][:n * item].view(flat.dtype))
            self._arrive_and_wait(1, _ALLGATHER)

    def broadcast_(self, flat: torch.Tensor, root: int = 0) -> None:
        """Local rank ``root``'s ``flat`` into every local rank's ``flat``.

        Args:
            flat: a contiguous 1-D CPU tensor of the same length and dtype on every rank;
                overwritten except on root.
            root: the local rank whose tensor everyone gets.

        Example::

            >>> seg.broadcast_(flat, root=0)
        """
        item = flat.element_size()
        per_piece = self.slot_bytes // item
        for start in range(0, flat.numel(), per_piece):
            piece = flat[start:start + per_piece]
            result = self._result[:piece.numel() * item].view(flat.dtype)
            self._seq += 1
            if self.local_rank == root:
                result.copy_(piece)
            self._arrive_and_wait(0, _BROADCAST)
            if self.local_rank != root:
                piece.copy_(result)
            self._arrive_and_wait(1, _BROADCAST)

    def allgather_bytes(self, data: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every local rank's bytes, in rank order.

        Args:
            data: this rank's uint8 buffer (lengths may differ between ranks).

        Returns:
            Copies of every rank's buffer; ``None`` on every rank if one rank's does not fit a slot
            (the caller then takes another path, on every rank alike).

        Example::

            >>> parts = seg.allgather_bytes(torch.frombuffer(bytearray(b"ready"), dtype=torch.uint8))
            >>> [bytes(p.numpy()) for p in parts]                 # 2 local ranks
            [b'ready', b'ready']
        """
        n = data.numel()
        self._seq += 1
        slot = self._slots[self.local_rank]
        slot[:8].view(torch.int64)[0] = n
        if n + 8 <= self.slot_bytes:
            slot[8:8 + n].copy_(data)
        self._arrive_and_wait(0, _ALLGATHER_BYTES)
        lengths = [int(s[:8].view(torch.int64)[0]) for s in self._slots]
        out = None
        if all(m + 8 <= self.slot_bytes for m in lengths):
            out = [s[8:8 + m].clone() for s, m in zip(self._slots, lengths)]
        self._arrive_and_wait(1, _ALLGATHER_BYTES)
        return out

    def close(self) -> None:
        """Unmap the segment; it cannot be used afterwards.

        Example::

            >>> seg.close()
        """
        self._slots = []
        self._result = None
        self._flags = None
        close_mapping(self._buf)


def sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``out`` = the sum of ``parts``, added in list (rank) order, so whichever rank computes a
    chunk gets the bits any other would.

    Args:
        out: where the sum goes.
        parts: tensors of ``out``'s shape, one per rank.

    Example::

        >>> out = torch.empty(3)
        >>> sum_into(out, [torch.ones(3), torch.full((3,), 2.0)])
        >>> out
        tensor([3., 3., 3.])
    """
    reduce_in_order(parts, "sum", out)


MIN_SLOT_BYTES = 256 << 10  # below this, TCP is as good as shared memory in pieces


def requested_slot_bytes() -> int:
    """The slot size asked for, from ``TORCHMN_SHM_SLOT_MB`` (default 16 MB).

    Returns:
        The slot size, in bytes.

    Raises:
        ValueError: ``TORCHMN_SHM_SLOT_MB`` is not a number (``resources.shm_slot_mb_requested``).

    Example::

        >>> requested_slot_bytes()          # TORCHMN_SHM_SLOT_MB not set
        16777216
    """
    mb = resources.shm_slot_mb_requested()
    return int((DEFAULT_SLOT_MB if mb is None else mb) * 1024 * 1024)


def fitting_slot_bytes(local_size: int, free: int) -> int:
    """The slot size for a segment of ``local_size`` ranks when /dev/shm has ``free`` bytes.

    Args:
        local_size: the number of ranks of the node.
        free: the bytes free in /dev/shm (:func:`free_bytes`).

    Returns:
        The requested size (:func:`requested_slot_bytes`) where it fits, else the largest with
        which the segment takes at most half of ``free``; 0 where that is under 256 KiB, too small
        to be worth it.

    Example::

        >>> fitting_slot_bytes(4, 1 << 30), fitting_slot_bytes(4, 64 << 20), fitting_slot_bytes(4, 1 << 20)
        (16777216, 6710848, 0)
    """
    want = requested_slot_bytes()
    spare = fits_in(free) - Flags.nbytes(PHASES, local_size)
    fits = spare // (local_size + 1) // ALIGN * ALIGN
    if fits >= want:
        return want
    return fits if fits >= MIN_SLOT_BYTES else 0


def fits_in(free: int) -> int:
    """How much of /dev/shm torchmn takes at most (half: the rest is others').

    Args:
        free: the bytes free in /dev/shm.

    Returns:
        ``free // 2``.

    Example::

        >>> fits_in(64 << 20)               # Docker's default /dev/shm
        33554432
    """
    return free // 2


def free_bytes() -> int:
    """The bytes free in /dev/shm, for an unprivileged process.

    Returns:
        The bytes available; 0 where there is no /dev/shm.

    Example::

        >>> free_bytes() >> 20              # MiB
        31744
    """
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
