"""What the shared-memory collectives and arenas share: mapping a segment on every rank of a
node, the flags ranks wait on, and finding segments that killed jobs left behind."""
from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from torchmn.communicators.errors import CollectiveMismatchError, PeerLostError, RemoteRankError
from torchmn.errors import TorchmnOSError

SHM_DIR = "/dev/shm"
ALIGN = 64  # chunk boundaries on cache lines, so ranks never write the same line
# A wait's sleeps, once spinning and yielding have not sufficed: from the first to the longest.
SLEEP_FIRST_S = 5e-5
SLEEP_LONGEST_S = 1e-3
# A long wait (for a peer validating, saving a checkpoint or starting anew) sleeps longer, up to
# this share of the time waited so far (so it ends at most 1% late) and never past the next look:
# a rank waking every millisecond costs 5% of a core on its own, taken from the peer it waits for
# where ranks share cores.
LATE_SHARE = 0.01
KINDS = 16  # a flag word is seq * KINDS + the kind of call (see Flags.arrive_and_wait)
# What a rank ending with an uncaught exception writes into its flag words (mark_failed): below
# every call number, so its peers keep waiting until their next look, which then tells them at
# once, instead of when its process is gone (module teardown takes a second or more with torch).
FAILED = -1
LOOK_EVERY_S = 0.02  # how often a waiting rank looks whether its peers are alive and its timeout has passed
_live_flags: "weakref.WeakSet[Flags]" = weakref.WeakSet()  # every Flags of this process, for mark_failed


def segment_name(job_tag: str, node: int, creator_pid: int) -> str:
    """The name in /dev/shm of a node's segment while its job sets it up.

    Args:
        job_tag: the job's tag (:func:`~torchmn.communicators.shm.new_job_tag`; an arena adds
            ``"arena"``).
        node: the node's index.
        creator_pid: the process id of the local rank that creates it (local rank 0).

    Returns:
        ``torchmn-<job_tag>-node<node>-pid<creator_pid>``.

    Example::

        >>> segment_name("3f2a9c1e5b7d4a60", 0, 4242)
        'torchmn-3f2a9c1e5b7d4a60-node0-pid4242'
    """
    # The creator's pid in the name lets a later job tell a segment left by a killed one.
    return f"torchmn-{job_tag}-node{node}-pid{creator_pid}"


# A segment has a name only while its job sets up (created, mapped by every rank of the node,
# unlinked: seconds). One whose creator is dead and that is older than this was left by a job
# killed in that window. The age also spares a segment from another PID namespace sharing /dev/shm.
STALE_AFTER_S = 60.0


def remove_stale_segments() -> list[str]:
    """Delete the segments of jobs killed while they set up shared memory.

    A segment counts as left behind when the process that created it is gone and it is older than
    ``STALE_AFTER_S`` seconds; others (a job setting up now, another PID namespace) are left alone.

    Returns:
        The names of the segments deleted, in /dev/shm.

    Example::

        >>> remove_stale_segments()          # local rank 0 does this before creating a segment
        ['torchmn-3f2a9c1e5b7d4a60-node0-pid4242']
    """
    removed = []
    now = time.time()
    for name in leftover_segments():
        pid = name.rpartition("-pid")[2]
        path = os.path.join(SHM_DIR, name)
        try:
            old = now - os.stat(path).st_mtime > STALE_AFTER_S
        except FileNotFoundError:
            continue
        if pid.isdigit() and old and not alive(int(pid)):
            unlink(path)
            removed.append(name)
    return removed


def leftover_segments(job_tag: Optional[str] = None) -> list[str]:
    """Names in /dev/shm that look like torchmn's segments (tests check that none is left behind).

    Args:
        job_tag: only the segments of this job; ``None`` for every job's.

    Returns:
        The names, sorted; empty where there is no /dev/shm.

    Example::

        >>> leftover_segments()              # every segment is unlinked once mapped
        []
    """
    prefix = "torchmn-" + (job_tag or "")
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


class Flags:
    """Rows of sequence numbers at the start of a segment, one row per phase, one column per rank:
    a rank arrives by writing its number and waits until every column has reached it."""

    def __init__(self, buf: mmap.mmap, phases: int, local_rank: int, local_size: int, pids: list[int],
                 timeout: float, describe: Callable[[int], str]):
        """View the flag rows at the start of ``buf``, and register them for :func:`mark_failed`.

        Args:
            buf: the mapped segment; the flags are its first ``phases * local_size`` int64 words.
            phases: how many rows (phases of a call) there are.
            local_rank: this rank's column.
            local_size: the number of columns, one per rank of the node.
            pids: the node's ranks' process ids, to tell a dead peer from a slow one.
            timeout: seconds :meth:`arrive_and_wait` waits for the other ranks.
            describe: names local rank ``r`` in errors.

        Example::

            >>> flags = Flags(buf, phases=2, local_rank=r, local_size=2, pids=pids, timeout=600.0,
            ...               describe=lambda i: f"local rank {i}")
        """
        self._rows = np.frombuffer(buf, dtype=np.int64, count=phases * local_size).reshape(phases, local_size)
        # The same words as plain Python ints: the wait loop reads them without numpy's per-call
        # cost, which matters run cold between backward and forward (twice a sharded step).
        self._words = memoryview(self._rows).cast("B").cast("q")
        self.local_rank = local_rank
        self.local_size = local_size
        self._pids = pids
        self._timeout = timeout
        self._describe = describe
        _live_flags.add(self)

    @staticmethod
    def nbytes(phases: int, local_size: int) -> int:
        """The bytes the flags take at the start of a segment, up to a cache line.

        Args:
            phases: how many rows there are.
            local_size: the number of ranks of the node.

        Returns:
            ``phases * local_size`` 8-byte words, rounded up to a multiple of 64.

        Example::

            >>> Flags.nbytes(2, 4)
            64
        """
        return align(phases * local_size * 8)

    def arrive_and_wait(self, phase: int, seq: int, kind: int = 0, kinds: tuple = ()) -> None:
        """Arrive at call ``seq`` and wait for every rank to reach it.

        ``kind`` travels in the same word as ``seq``, so ranks that reach call ``seq`` from
        different places in their code raise instead of pairing silently. The wait spins, then
        yields the core, then sleeps briefly, so that more ranks than cores still make progress.

        Args:
            phase: the row to arrive in.
            seq: the call's number; the callers count their calls up from 1.
            kind: the kind of call, an index into ``kinds``.
            kinds: the names of the kinds of call, for the message; empty: ranks at the same call
                are not compared.

        Raises:
            CollectiveMismatchError: a rank is at call ``seq`` with another kind of call.
            PeerLostError: a rank of the node ended with an error, exited, or did not arrive within
                the timeout.

        Example::

            >>> flags.arrive_and_wait(0, seq, kind=1, kinds=("an allreduce", "a broadcast"))
        """
        fence()  # this rank's data writes before its flag
        mark = seq * KINDS + kind
        lowest = seq * KINDS
        first = phase * self.local_size
        self._words[first + self.local_rank] = mark
        row = self._words[first:first + self.local_size]  # a live view of the phase's flags
        if min(row) < lowest:
            wait_until(lambda: min(row) >= lowest, lambda timed_out: self._check_peers(phase, seq, timed_out),
                       self._timeout)
        fence()  # the others' flags before their data
        if kinds:
            top = lowest + KINDS
            # A rank still at call seq (not past it) with another kind of call is a mismatch.
            if any(v != mark and v < top for v in row):
                self._check_kinds(self._rows[phase], seq, kind, kinds)

    def _check_kinds(self, row: np.ndarray, seq: int, kind: int, kinds: tuple) -> None:
        # A rank already past call seq has checked it itself; compare those still at it.
        marks = row.copy()
        other = next((r for r in range(self.local_size) if marks[r] // KINDS == seq and marks[r] % KINDS != kind),
                     None)
        if other is not None:
            raise CollectiveMismatchError(
                f"shared-memory call #{seq}: {self._describe(other)} is at {kinds[marks[other] % KINDS]!r} while "
                f"{self._describe(self.local_rank)} is at {kinds[kind]!r}: the ranks are not taking the same "
                f"steps (did one rank skip backward() or step(), say on a check of its own loss, or call a "
                f"collective such as the sharded optimizer's state_dict() alone?). Decide such things on every "
                f"rank alike, e.g. from comm.allreduce of a flag")

    def failed(self, r: int) -> bool:
        """Whether local rank ``r`` marked itself failed (:meth:`mark_failed`).

        Args:
            r: a local rank.

        Returns:
            True once ``r`` broke off with an error.

        Example::

            >>> flags.failed(1)
            False
        """
        return self._rows[0, r] == FAILED

    def calls_at(self, phase: int, seq: int) -> dict:
        """What each local rank is at, where it is at call ``seq`` of ``phase``'s row.

        Args:
            phase: the row.
            seq: the call's number.

        Returns:
            ``{local rank: kind}`` for the ranks at that call (see :meth:`arrive_and_wait`).

        Example::

            >>> flags.calls_at(0, 12)
            {0: 5, 1: 7}
        """
        marks = self._rows[phase].copy()
        return {r: int(marks[r] % KINDS) for r in range(self.local_size) if marks[r] // KINDS == seq}

    def mark_failed(self) -> None:
        """Tell the node's other ranks, waiting now or later, that this rank will not come.

        Writes ``FAILED`` into this rank's column of every row: a peer waiting on it raises
        PeerLostError ("ended with an error") at its next look, without waiting for the process to go.

        Example::

            >>> flags.mark_failed()
        """
        for phase in range(self._rows.shape[0]):
            self._words[phase * self.local_size + self.local_rank] = FAILED

    def _check_peers(self, phase: int, seq: int, timed_out: bool) -> None:
        missing = [r for r in range(self.local_size) if self._rows[phase, r] // KINDS < seq]
        if not missing:  # the last rank arrived as the timeout passed: the wait ends, it did not time out
            return
        failed = [r for r in missing if self._rows[phase, r] == FAILED]
        dead = failed or [r for r in missing if not alive(self._pids[r])]
        if dead or timed_out:
            who = ", ".join(self._describe(r) for r in (dead or missing))
            why = "ended with an error" if failed else "exited" if dead else (
                f"did not arrive within {self._timeout:.0f} s (still computing, or waiting in a call the "
                f"others did not make: every rank must make the same collective calls in the same order; "
                f"with shard_state=True, optimizer.state_dict() is one)")
            raise PeerLostError(f"shared-memory collective: {who} {why}; "
                                f"{self._describe(self.local_rank)} gives up")


def wait_until(done: Callable[[], bool], look: Callable[[bool], None], timeout: float) -> None:
    """Wait for ``done()`` without a system call on the fast path: spin, then yield the core, then
    sleep, in steps growing from 50 us to 1 ms, so that more ranks than cores still make progress;
    past a tenth of a second the steps grow on, to 1% of the time waited (at most ``LOOK_EVERY_S``).

    Args:
        done: what is awaited, read from shared memory (cheap: it runs on every spin).
        look: called every ``LOOK_EVERY_S`` with whether ``timeout`` has passed; it raises where a
            peer is gone or the wait timed out.
        timeout: seconds before ``look`` is told so.

    Example::

        >>> wait_until(lambda: words[peer] >= seq, lambda timed_out: check(timed_out), 600.0)
    """
    deadline = next_look = None
    spins = 0
    pause, longest = SLEEP_FIRST_S, SLEEP_LONGEST_S
    while not done():
        spins += 1
        if spins < 64:
            continue
        # Yield the core, then back off to sleeps: with more ranks than cores (or a busy
        # machine), spinning would starve the very peer we wait for. The sleeps grow, so that a
        # rank waiting long (for one computing with every core's threads) wakes up rarely:
        # each wake-up preempts a thread of the job, and OpenMP's threads wait for each other.
        if spins < 2048:
            os.sched_yield()
            if spins % 256:
                continue
        else:
            time.sleep(pause)
            pause = min(pause * 1.1, longest)
        # Looks go by the clock, not by a count of sleeps: on a busy machine a 50 us sleep can
        # last milliseconds, and the timeout must still fire when it says, since ranks waiting
        # over TCP meanwhile give the others only watch.GRACE_S to say where they are.
        now = time.monotonic()
        if next_look is None:
            start, deadline, next_look = now, now + timeout, now + LOOK_EVERY_S
        elif now >= next_look:
            next_look = now + LOOK_EVERY_S
            look(now > deadline)
            longest = min(max(SLEEP_LONGEST_S, LATE_SHARE * (now - start)), LOOK_EVERY_S)


def mark_failed() -> None:
    """Mark this rank failed in every shared-memory segment it has open (see ``FAILED``).

    Example::

        >>> segment.mark_failed()    # the exception hook does this as this rank breaks off
    """
    for flags in list(_live_flags):
        flags.mark_failed()


def map_segment(name: str, nbytes: int, local_rank: int, agree: Callable[[bool], list],
                 remedy: str, owned: Optional[Sequence[Tuple[int, int]]] = None) -> mmap.mmap:
    """Local rank 0 creates /dev/shm/NAME, every local rank maps it, then the name is unlinked.

    Collective on the node's ranks. After creating and after mapping, the ranks tell each other
    through ``agree`` whether that worked, so that a failure on one rank raises on all of them
    instead of leaving the others with a segment their peer never attached to. Local rank 0 first
    deletes the segments that killed jobs left behind (:func:`remove_stale_segments`), and reserves the
    memory at once, so that a full /dev/shm fails here rather than with SIGBUS mid-collective.

    With ``owned``, each rank first reserves the byte ranges it uses most, and local rank 0 the
    rest after them: Linux puts a page of shared memory on the NUMA domain of the process that
    reserves it, so on a node of several domains (ranks bound to them by ``torchmn run --bind``)
    each rank's pages are its domain's.

    Args:
        name: the segment's name (:func:`segment_name`).
        nbytes: its size.
        local_rank: this rank among the node's ranks.
        agree: a collective that returns every rank's value (``comm.allgather_obj``).
        remedy: what to do where /dev/shm has no room, for the message.
        owned: ``(offset, length)`` byte ranges of this rank's; None (on every rank alike): local
            rank 0 reserves the whole segment.

    Returns:
        The mapping, ``nbytes`` long, the same memory on every rank of the node.

    Raises:
        OSError: creating or mapping the segment failed on this rank.
        RemoteRankError: it failed on another rank.

    Example::

        >>> buf = map_segment(segment_name(tag, 0, pids[0]), 1 << 20, local_rank, comm.allgather_obj,
        ...                   "set TORCHMN_SHM_SLOT_MB lower")
    """
    path = os.path.join(SHM_DIR, name)
    fd = -1
    try:
        error = None
        if local_rank == 0:
            remove_stale_segments()
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                if owned is None:
                    _reserve(fd, [(0, nbytes)], nbytes, remedy)
                else:
                    os.ftruncate(fd, nbytes)  # the pages come with the owners' reservations below
            except OSError as e:
                error = e
        all_succeeded(agree, error, f"creating {path}")
        buf = None
        try:
            if local_rank != 0:
                fd = os.open(path, os.O_RDWR)
            if owned is not None:
                _reserve(fd, owned, nbytes, remedy)
            buf = mmap.mmap(fd, nbytes)
        except OSError as e:
            error = e
        all_succeeded(agree, error, f"mapping {path}")
        if owned is not None:
            error = None
            if local_rank == 0:
                try:  # what no rank owns; the owned pages are reserved already and stay where they are
                    _reserve(fd, [(0, nbytes)], nbytes, remedy)
                except OSError as e:
                    error = e
            all_succeeded(agree, error, f"reserving {path}")
        return buf
    finally:
        if fd >= 0:
            os.close(fd)
        # Everyone has mapped it, or the set-up failed everywhere: the name is no longer needed.
        if local_rank == 0:
            unlink(path)


def _reserve(fd: int, ranges: Sequence[Tuple[int, int]], nbytes: int, remedy: str) -> None:
    """Reserve the pages of ``ranges`` of a segment: a full /dev/shm fails here, not with SIGBUS
    mid-collective."""
    for offset, length in ranges:
        if length <= 0:
            continue
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as e:
            raise TorchmnOSError(e.errno, f"cannot reserve {nbytes >> 20} MiB of shared memory in "
                                 f"{SHM_DIR} ({e.strerror}); free space there, {remedy}") from e


def all_succeeded(agree: Callable[[bool], list], error: Optional[BaseException], what: str) -> None:
    """Raise this rank's own ``error``, or, if another rank had one, an error naming it (collective).

    Args:
        agree: a collective that returns every rank's value (``comm.allgather_obj``).
        error: what this step raised on this rank, or None.
        what: the step, for the message (``"creating /dev/shm/..."``).

    Raises:
        OSError: this rank's own ``error``, raised as it is (creating or mapping a segment fails with one).
        RemoteRankError: this rank succeeded, another did not.

    Example::

        >>> all_succeeded(comm.allgather_obj, error, f"mapping {path}")
    """
    oks = agree(error is None)
    if error is not None:
        raise error
    failed = [r for r, ok in enumerate(oks) if not ok]
    if failed:
        raise RemoteRankError(f"shared memory could not be set up: {what} failed on rank(s) "
                              f"{', '.join(map(str, failed))} (see that rank's error)")


def close_mapping(buf: mmap.mmap) -> None:
    """Unmap a segment, unless a tensor still views it.

    Args:
        buf: the mapping.

    Example::

        >>> close_mapping(buf)       # after dropping the tensors over it
    """
    # A tensor may still view the mapping; then it is released with the process.
    with contextlib.suppress(BufferError):
        buf.close()


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier between this thread's earlier and later loads and stores.

    The flags and the data are plain memory: on x86 stores are seen in order anyway, but on Arm
    a flag could become visible before the data it announces. Taking and releasing a lock is an
    acquire and a release operation (pthread atomics), which orders them on every CPU; ~50 ns.

    Example::

        >>> slot.copy_(piece)
        >>> fence()                  # the data is visible before the flag written after it
    """
    with _FENCE:
        pass


def chunk_bounds(n: int, itemsize: int, r: int, parts: int) -> tuple[int, int]:
    """Part r of n elements split in ``parts``, cut on cache-line boundaries (ranks never write
    the same line).

    Args:
        n: the number of elements.
        itemsize: the bytes of one element.
        r: the part wanted, from 0 to ``parts - 1``.
        parts: how many parts (the node's ranks).

    Returns:
        ``(lo, hi)``, the part's elements; empty (``lo == hi``) for the last parts where ``n`` is small.

    Example::

        >>> chunk_bounds(1000, 4, 1, 4), chunk_bounds(1000, 4, 3, 4)
        ((256, 512), (768, 1000))
    """
    per = align(-(-n // parts) * itemsize) // itemsize
    return min(n, r * per), min(n, (r + 1) * per)


def align(n: int) -> int:
    """Round a byte count up to a whole number of cache lines.

    Args:
        n: the bytes.

    Returns:
        The least multiple of ``ALIGN`` (64) that is at least ``n``.

    Example::

        >>> align(100), align(128)
        (128, 128)
    """
    return -(-n // ALIGN) * ALIGN


def alive(pid: int) -> bool:
    """Whether the process ``pid`` is still running, to tell a dead peer from a slow one.

    Args:
        pid: a process id on this machine.

    Returns:
        False where there is no such process or it is a zombie; True otherwise, also for another
        user's process and where /proc cannot be read.

    Example::

        >>> alive(os.getpid())
        True
    """
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


def unlink(path: str) -> None:
    """Remove a file, where it is still there.

    Args:
        path: the file (a segment in /dev/shm).

    Example::

        >>> unlink(os.path.join(SHM_DIR, name))     # a second call does nothing
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        return


