"""Collectives among the ranks of one node through POSIX shared memory, not TCP loopback.

One segment per node: a row of flags, one slot per rank and a result area. An allreduce is a
reduce-scatter then an all-gather: every rank copies its input into its slot, each rank sums its
own chunk across all slots into the result area, and every rank copies the result out. Ranks wait
for each other by watching the flags (a sequence number per rank and phase), never through a
socket. The segment's name is unlinked as soon as every rank has mapped it, so a crash, even a
SIGKILL, leaves nothing behind in /dev/shm; the memory goes when the last rank exits.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import uuid
from typing import Callable, Optional

import numpy as np
import torch

from torchmn.communicators.errors import CollectiveMismatchError, CollectiveTimeoutError, RemoteRankError

SHM_DIR = "/dev/shm"
DEFAULT_SLOT_MB = 16  # per rank; TORCHMN_SHM_SLOT_MB overrides. Larger tensors go in pieces.
_ALIGN = 64  # chunk boundaries on cache lines, so ranks never write the same line
_PHASES = 2  # "my slot is written", "my chunk is reduced"
_KINDS = 16  # a flag word is seq * _KINDS + the kind of call (see _Flags.arrive_and_wait)

_REDUCE = {
    "sum": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
    "prod": torch.mul,
}


class PeerLostError(CollectiveTimeoutError):
    """A rank of this node stopped taking part in a shared-memory collective (exited, or did not
    arrive within the timeout)."""


def segment_name(job_tag: str, node: int, creator_pid: int) -> str:
    # The creator's pid in the name lets a later job tell a segment left by a killed one.
    return f"torchmn-{job_tag}-node{node}-pid{creator_pid}"


# A segment has a name only while its job sets up (created, mapped by every rank of the node,
# unlinked: seconds). One whose creator is dead and that is older than this was left by a job
# killed in that window. The age also spares a segment from another PID namespace sharing /dev/shm.
STALE_AFTER_S = 60.0


def remove_stale_segments() -> list[str]:
    """Delete the segments of jobs killed while they set up shared memory; returns their names."""
    removed = []
    now = time.time()
    for name in leftover_segments():
        pid = name.rpartition("-pid")[2]
        path = os.path.join(SHM_DIR, name)
        try:
            old = now - os.stat(path).st_mtime > STALE_AFTER_S
        except FileNotFoundError:
            continue
        if pid.isdigit() and old and not _alive(int(pid)):
            _unlink(path)
            removed.append(name)
    return removed


def new_job_tag() -> str:
    """A tag unique to this job: two jobs on one machine never share a segment."""
    return uuid.uuid4().hex[:16]


# What a NodeSegment operation is, as the other ranks' mismatch check names it: ranks at the same
# call number in different operations (one rank's call check against another's gradient sum) raise
# instead of reading each other's data.
SEGMENT_CALLS = ("an allreduce", "a reduce-scatter", "an all-gather", "a broadcast",
                 "an exchange of small buffers (a collective call check, or objects)")
_ALLREDUCE, _REDUCE_SCATTER, _ALLGATHER, _BROADCAST, _ALLGATHER_BYTES = range(len(SEGMENT_CALLS))


class NodeSegment:
    """The shared-memory collectives of the ``local_size`` ranks of one node.

    Built collectively: the node's first rank creates the segment, the others map it once
    ``agree`` says it exists, and the creator unlinks the name once ``agree`` says all mapped it.

    Example::

        >>> seg = NodeSegment.open(tag, node=0, local_rank=r, local_size=2, pids=pids, agree=comm.allgather_obj)
        >>> seg.allreduce_(flat)                      # in place, summed over the node's ranks
    """

    def __init__(self, buf: mmap.mmap, local_rank: int, local_size: int, slot_bytes: int,
                 pids: list[int], timeout: float, describe: Callable[[int], str]):
        self._buf = buf
        self.local_rank = local_rank
        self.local_size = local_size
        self.slot_bytes = slot_bytes
        self._seq = 0
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        flags_bytes = _Flags.nbytes(_PHASES, local_size)
        self._flags = _Flags(buf, _PHASES, local_rank, local_size, pids, timeout, describe)
        self._slots = [raw[flags_bytes + i * slot_bytes: flags_bytes + (i + 1) * slot_bytes]
                       for i in range(local_size)]
        start = flags_bytes + local_size * slot_bytes
        self._result = raw[start:start + slot_bytes]

    # ----------------------------------------------------------------------------- set-up
    @staticmethod
    def size_for(local_size: int, slot_bytes: int) -> int:
        return _Flags.nbytes(_PHASES, local_size) + (local_size + 1) * slot_bytes

    @classmethod
    def open(cls, job_tag: str, node: int, local_rank: int, local_size: int, pids: list[int],
             agree: Callable[[bool], list], slot_bytes: Optional[int] = None, timeout: float = 600.0,
             describe: Callable[[int], str] = lambda r: f"local rank {r}") -> "NodeSegment":
        if slot_bytes is None:
            slot_bytes = requested_slot_bytes()
        slot_bytes = max(_ALIGN, _align(slot_bytes))  # every dtype's view needs aligned slots
        nbytes = cls.size_for(local_size, slot_bytes)
        buf = _map_segment(segment_name(job_tag, node, pids[0]), nbytes, local_rank, agree, "set TORCHMN_SHM_SLOT_MB lower")
        return cls(buf, local_rank, local_size, slot_bytes, pids, timeout, describe)

    # ----------------------------------------------------------------------------- waiting
    def _arrive_and_wait(self, phase: int, call: int) -> None:
        self._flags.arrive_and_wait(phase, self._seq, call, SEGMENT_CALLS)

    # ----------------------------------------------------------------------------- collectives
    def _chunk(self, n: int, itemsize: int, r: int) -> tuple[int, int]:
        return chunk_bounds(n, itemsize, r, self.local_size)

    def allreduce_(self, flat: torch.Tensor, op: str = "sum", out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Reduce a contiguous 1-D CPU tensor over the node's ranks, in place (or into ``out``);
        every rank gets the same bits, since each chunk is reduced by one rank in one order."""
        reduce = _REDUCE[op]
        out = flat if out is None else out
        item = flat.element_size()
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
                if self.local_size == 1:
                    result[lo:hi].copy_(slots[0][lo:hi])
                else:
                    reduce(slots[0][lo:hi], slots[1][lo:hi], out=result[lo:hi])
                    for s in slots[2:]:
                        reduce(result[lo:hi], s[lo:hi], out=result[lo:hi])
            self._arrive_and_wait(1, _ALLREDUCE)
            out[start:start + n].copy_(result)
        return out

    def reduce_scatter(self, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Sum ``flat`` (local_size * k elements) over the node; local rank r gets chunk r in ``shard``."""
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
        """Every local rank's ``shard`` (k elements) into ``flat`` (local_size * k), in rank order."""
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
        """Local rank ``root``'s ``flat`` into every local rank's ``flat``."""
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
        """Every local rank's uint8 buffer, in rank order; ``None`` on every rank if one rank's does
        not fit a slot (the caller then takes another path, on every rank alike)."""
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
        self._slots = []
        self._result = None
        self._flags = None
        _close(self._buf)


class _Flags:
    """Rows of sequence numbers at the start of a segment, one row per phase, one column per rank:
    a rank arrives by writing its number and waits until every column has reached it."""

    def __init__(self, buf: mmap.mmap, phases: int, local_rank: int, local_size: int, pids: list[int],
                 timeout: float, describe: Callable[[int], str]):
        self._rows = np.frombuffer(buf, dtype=np.int64, count=phases * local_size).reshape(phases, local_size)
        # The same words as plain Python ints: the wait loop reads them without numpy's per-call
        # cost, which matters run cold between backward and forward (twice a sharded step).
        self._words = memoryview(self._rows).cast("B").cast("q")
        self.local_rank = local_rank
        self.local_size = local_size
        self._pids = pids
        self._timeout = timeout
        self._describe = describe

    @staticmethod
    def nbytes(phases: int, local_size: int) -> int:
        return _align(phases * local_size * 8)

    def arrive_and_wait(self, phase: int, seq: int, kind: int = 0, kinds: tuple = ()) -> None:
        """Arrive at call ``seq`` and wait for every rank to reach it. ``kind`` (an index into
        ``kinds``, the names of the calls) travels in the same word as ``seq``, so ranks that reach
        call ``seq`` from different places in their code raise instead of pairing silently."""
        _fence()  # this rank's data writes before its flag
        mark = seq * _KINDS + kind
        lowest = seq * _KINDS
        first = phase * self.local_size
        self._words[first + self.local_rank] = mark
        row = self._words[first:first + self.local_size]  # a live view of the phase's flags
        deadline = None
        spins = 0
        while min(row) < lowest:
            spins += 1
            if spins < 64:
                continue
            # Yield the core, then back off to short sleeps: with more ranks than cores (or a busy
            # machine), spinning would starve the very peer we wait for.
            if spins < 2048:
                os.sched_yield()
            else:
                time.sleep(5e-5)
            if spins % 1024 == 0:
                now = time.monotonic()
                deadline = deadline or now + self._timeout
                self._check_peers(phase, seq, now > deadline)
        _fence()  # the others' flags before their data
        if kinds:
            top = lowest + _KINDS
            # A rank still at call seq (not past it) with another kind of call is a mismatch.
            if any(v != mark and v < top for v in row):
                self._check_kinds(self._rows[phase], seq, kind, kinds)

    def _check_kinds(self, row: np.ndarray, seq: int, kind: int, kinds: tuple) -> None:
        # A rank already past call seq has checked it itself; compare those still at it.
        marks = row.copy()
        other = next((r for r in range(self.local_size) if marks[r] // _KINDS == seq and marks[r] % _KINDS != kind),
                     None)
        if other is not None:
            raise CollectiveMismatchError(
                f"shared-memory call #{seq}: {self._describe(other)} is at {kinds[marks[other] % _KINDS]!r} while "
                f"{self._describe(self.local_rank)} is at {kinds[kind]!r}: the ranks are not taking the same "
                f"steps (did one rank skip backward() or step(), say on a check of its own loss, or call a "
                f"collective such as the sharded optimizer's state_dict() alone?). Decide such things on every "
                f"rank alike, e.g. from comm.allreduce of a flag")

    def _check_peers(self, phase: int, seq: int, timed_out: bool) -> None:
        missing = [r for r in range(self.local_size) if self._rows[phase, r] // _KINDS < seq]
        dead = [r for r in missing if not _alive(self._pids[r])]
        if dead or timed_out:
            who = ", ".join(self._describe(r) for r in (dead or missing))
            why = "exited" if dead else (
                f"did not arrive within {self._timeout:.0f} s (still computing, or waiting in a call the "
                f"others did not make: every rank must make the same collective calls in the same order; "
                f"with shard_state=True, optimizer.state_dict() is one)")
            raise PeerLostError(f"shared-memory collective #{seq}: {who} {why}; "
                                f"{self._describe(self.local_rank)} gives up")


# The points at which users of a NodeArena meet (names for the errors when ranks disagree). The
# sharded optimizer's first barrier of a step says how many backward passes sent gradients since
# the last step (index: that count, at most 3), so a rank that skipped a step() is told apart.
STEP_AFTER_SENDS = ("step() after 0 backward passes that sent gradients",
                    "step() after 1 backward pass that sent gradients",
                    "step() after 2 backward passes that sent gradients",
                    "step() after 3 or more backward passes that sent gradients")
ARENA_BARRIERS = ("barrier", "set-up", "backward done (gradients in)", "averaged gradients ready",
                  "step done (shards updated)") + STEP_AFTER_SENDS
_BARRIER_CODE = {name: code for code, name in enumerate(ARENA_BARRIERS)}


class NodeArena:
    """Memory the ``local_size`` ranks of one node share for good, plus a barrier through flags.

    ``job_tag`` must be new for every arena (see :func:`new_job_tag`). ``shared`` is one region
    every rank reads and writes (the sharded optimizer keeps the model's parameters there: one copy
    per node, and an update of a shard is seen by every rank without an all-gather);
    ``regions[r]`` is local rank r's own region, which the others may read (its gradients).
    Created collectively, like :class:`NodeSegment`.

    Example::

        >>> arena = NodeArena.open(tag, 0, r, 2, pids, comm.allgather_obj, shared_bytes=4096, region_bytes=4096)
        >>> arena.regions[r].view(torch.float32)[:4] = 1.0
        >>> arena.barrier()                      # every rank's writes before it are visible after it
    """

    def __init__(self, buf: mmap.mmap, local_rank: int, local_size: int, shared_bytes: int, region_bytes: int,
                 pids: list[int], timeout: float, describe: Callable[[int], str]):
        self._buf = buf
        self.local_rank = local_rank
        self.local_size = local_size
        self._seq = 0
        self._flags = _Flags(buf, 1, local_rank, local_size, pids, timeout, describe)
        start = _Flags.nbytes(1, local_size)
        # Each region is its own tensor over its own range of the mapping (not a view of one big
        # tensor), so saving a tensor that views the shared region saves that region only.
        self.shared = torch.frombuffer(buf, dtype=torch.uint8, offset=start, count=shared_bytes) \
            if shared_bytes else torch.empty(0, dtype=torch.uint8)
        start += shared_bytes
        self.regions = [torch.frombuffer(buf, dtype=torch.uint8, offset=start + r * region_bytes, count=region_bytes)
                        if region_bytes else torch.empty(0, dtype=torch.uint8) for r in range(local_size)]

    @staticmethod
    def size_for(local_size: int, shared_bytes: int, region_bytes: int) -> int:
        return _Flags.nbytes(1, local_size) + _align(shared_bytes) + local_size * _align(region_bytes)

    @classmethod
    def open(cls, job_tag: str, node: int, local_rank: int, local_size: int, pids: list[int],
             agree: Callable[[bool], list], shared_bytes: int, region_bytes: int, timeout: float = 600.0,
             describe: Callable[[int], str] = lambda r: f"local rank {r}") -> "NodeArena":
        nbytes = cls.size_for(local_size, shared_bytes, region_bytes)
        shared_bytes, region_bytes = _align(shared_bytes), _align(region_bytes)
        buf = _map_segment(segment_name(job_tag + "arena", node, pids[0]), nbytes, local_rank, agree,
                           "or give the machine (container: --shm-size) a larger /dev/shm")
        return cls(buf, local_rank, local_size, shared_bytes, region_bytes, pids, timeout, describe)

    def my_chunk(self, n: int, itemsize: int) -> tuple[int, int]:
        """This rank's share ``[lo, hi)`` of n elements when the node's ranks split work on them."""
        return chunk_bounds(n, itemsize, self.local_rank, self.local_size)

    def barrier(self, what: str = "barrier") -> None:
        """Wait for every local rank; writes to the arena before it are visible to all after it.

        ``what`` names the point in the caller's work (one of :data:`ARENA_BARRIERS`): ranks that
        reach the same barrier number at different points raise :class:`CollectiveMismatchError`.
        """
        self._seq += 1
        self._flags.arrive_and_wait(0, self._seq, _BARRIER_CODE[what], ARENA_BARRIERS)

    def close(self) -> None:
        self.shared = None
        self.regions = []
        self._flags = None
        _close(self._buf)


def _map_segment(name: str, nbytes: int, local_rank: int, agree: Callable[[bool], list],
                 remedy: str) -> mmap.mmap:
    """Local rank 0 creates /dev/shm/NAME, every local rank maps it, then the name is unlinked.

    ``agree(ok)`` is every rank's ``ok``, collectively: after creating and after mapping, the ranks
    tell each other whether that worked, so that a failure on one rank raises on all of them
    instead of leaving the others with a segment their peer never attached to."""
    path = os.path.join(SHM_DIR, name)
    fd = -1
    try:
        error = None
        if local_rank == 0:
            remove_stale_segments()
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)  # fail now, not with SIGBUS mid-collective
                except OSError as e:
                    raise OSError(e.errno, f"cannot reserve {nbytes >> 20} MiB of shared memory in "
                                           f"{SHM_DIR} ({e.strerror}); free space there, {remedy}") from e
            except OSError as e:
                error = e
        _all_succeeded(agree, error, f"creating {path}")
        buf = None
        try:
            if local_rank != 0:
                fd = os.open(path, os.O_RDWR)
            buf = mmap.mmap(fd, nbytes)
        except OSError as e:
            error = e
        _all_succeeded(agree, error, f"mapping {path}")
        return buf
    finally:
        if fd >= 0:
            os.close(fd)
        # Everyone has mapped it, or the set-up failed everywhere: the name is no longer needed.
        if local_rank == 0:
            _unlink(path)


def _all_succeeded(agree: Callable[[bool], list], error: Optional[BaseException], what: str) -> None:
    """Raise this rank's own ``error``, or, if another rank had one, an error naming it."""
    oks = agree(error is None)
    if error is not None:
        raise error
    failed = [r for r, ok in enumerate(oks) if not ok]
    if failed:
        raise RemoteRankError(f"shared memory could not be set up: {what} failed on rank(s) "
                              f"{', '.join(map(str, failed))} (see that rank's error)")


def _close(buf: mmap.mmap) -> None:
    # A tensor may still view the mapping; then it is released with the process.
    with contextlib.suppress(BufferError):
        buf.close()


def sum_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``out`` = the sum of ``parts``, added in list (rank) order, so whichever rank computes a
    chunk gets the bits any other would."""
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier between this thread's earlier and later loads and stores.

    The flags and the data are plain memory: on x86 stores are seen in order anyway, but on Arm
    a flag could become visible before the data it announces. Taking and releasing a lock is an
    acquire and a release operation (pthread atomics), which orders them on every CPU; ~50 ns.
    """
    with _FENCE:
        pass


def chunk_bounds(n: int, itemsize: int, r: int, parts: int) -> tuple[int, int]:
    """Part r of n elements split in ``parts``, cut on cache-line boundaries (ranks never write
    the same line)."""
    per = _align(-(-n // parts) * itemsize) // itemsize
    return min(n, r * per), min(n, (r + 1) * per)


MIN_SLOT_BYTES = 256 << 10  # below this, TCP is as good as shared memory in pieces


def requested_slot_bytes() -> int:
    return int(float(os.environ.get("TORCHMN_SHM_SLOT_MB", DEFAULT_SLOT_MB)) * 1024 * 1024)


def fitting_slot_bytes(local_size: int, free: int) -> int:
    """The slot size to use with ``free`` bytes in /dev/shm: the requested one, or the largest
    that takes at most half of it (0: shared memory too small to be worth it)."""
    want = requested_slot_bytes()
    spare = fits_in(free) - _Flags.nbytes(_PHASES, local_size)
    fits = spare // (local_size + 1) // _ALIGN * _ALIGN
    if fits >= want:
        return want
    return fits if fits >= MIN_SLOT_BYTES else 0


def fits_in(free: int) -> int:
    """How much of ``free`` bytes of /dev/shm torchmn takes at most: half, the rest is others'."""
    return free // 2


def free_bytes() -> int:
    """Bytes free in /dev/shm (0 if there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return


def leftover_segments(job_tag: Optional[str] = None) -> list[str]:
    """Names in /dev/shm that look like torchmn's (for tests and `torchmn doctor`)."""
    prefix = "torchmn-" + (job_tag or "")
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []
