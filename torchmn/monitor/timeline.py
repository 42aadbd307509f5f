"""Timelines: every rank's phases (forward+backward, averaging per bucket, the update, every
collective) as one Chrome trace / Perfetto JSON file, a process row per rank and a thread row per
thread of it.

With ``TORCHMN_TIMELINE=FILE`` (``torchmn run --timeline FILE`` sets it), each rank appends its
events to its part, ``FILE.rank<r>.json``, every second (as Horovod writes its timeline), so a rank
stopped by SIGTERM or SIGKILL leaves all but its last second; the parts are joined into ``FILE`` by
``torchmn run`` after the job, by rank 0 under other launchers (where it sees the others' parts:
one machine, or a shared file system), or afterwards by ``torchmn timeline merge FILE``; they are
removed once every rank's is joined. ``torchmn.horovod``'s ``start_timeline``/``stop_timeline``
record through the same recorder, in a sink of their own, and write the same format.

A part is JSON lines: a header ``{"rank", "size", "host"}``, one list of events per flush, and
``{"end": true}`` once its rank closed it.
"""
from __future__ import annotations

import glob
import json
import os
import shlex
import re
import socket
import sys
import threading
import time
from typing import Iterable, List, Optional, Sequence, Tuple

from torchmn.errors import TorchmnOSError, TorchmnValueError
from torchmn.monitor import recorder

# How long rank 0 waits, at its end, for the other ranks' parts (under launchers other than torchmn run).
MERGE_WAIT_S = 10.0
# Seconds between two appends to a rank's part: what a killed rank can lose, and what keeps a long
# job's events on disk instead of in memory.
FLUSH_S = 1.0
_END = json.dumps({"end": True}) + "\n"
_PART = re.compile(r"\.rank(\d+)\.json$")


def part_path(path: str, rank: int) -> str:
    """Where ``rank`` writes its part of the timeline ``path``.

    Args:
        path: the timeline's file.
        rank: the rank.

    Returns:
        The part's path, beside ``path``.

    Example::

        >>> part_path("/tmp/trace.json", 3)
        '/tmp/trace.json.rank3.json'
    """
    return f"{path}.rank{rank}.json"


def part_rank(file: str) -> int:
    """The rank whose part ``file`` is, from its name.

    Args:
        file: a part's path (:func:`part_path`).

    Returns:
        The rank.

    Raises:
        ValueError: ``file`` is not named as a part.

    Example::

        >>> part_rank("/tmp/trace.json.rank3.json")
        3
    """
    m = _PART.search(file)
    if m is None:
        raise TorchmnValueError(f"{file} is not named as a part of a timeline (FILE.rank<r>.json)")
    return int(m.group(1))


def trace(parts: Iterable[Tuple[int, str, Sequence[tuple]]]) -> dict:
    """The Chrome trace of every rank's events.

    Args:
        parts: ``(rank, host, events)`` per rank, events as ``recorder.take_events`` returns them.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``: per rank a process (named
        ``rank <r> (<host>)``), per thread a thread row, and one complete event (``"ph": "X"``) per
        phase, in microseconds from the earliest event of any rank. Complete events on one row must
        nest (Perfetto drops or misdraws those that overlap), so phases of a thread that overlap
        without nesting (buckets in flight together, asynchronous Horovod calls) go on further rows
        of that thread, named ``<thread> (2)`` and so on.

    Example::

        >>> trace([(0, "node1", [("update", "update", 10.0, 10.001, "MainThread", None)])])["traceEvents"][-1]["dur"]
        1000.0
    """
    parts = list(parts)
    starts = [e[2] for _, _, events in parts for e in events]
    origin = min(starts) if starts else 0.0
    out = []
    for rank, host, events in parts:
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({host})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        # Rounded once, so that a phase that ends where the next begins does not overlap it by 0.1 us.
        timed = [(round((t0 - origin) * 1e6, 1), round((t1 - origin) * 1e6, 1), name, category, thread, args)
                 for name, category, t0, t1, thread, args in events]
        lanes: dict = {}    # thread -> per row, the ends of the phases open on it (innermost last)
        rows: dict = {}     # (thread, lane) -> tid
        for ts, te, name, category, thread, args in sorted(timed, key=lambda e: (e[0], -e[1])):
            te = max(te, ts)
            stacks = lanes.setdefault(thread, [])
            lane = _lane(stacks, ts, te)
            if (thread, lane) not in rows:
                rows[(thread, lane)] = len(rows)
                out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": rows[(thread, lane)],
                            "args": {"name": thread if lane == 0 else f"{thread} ({lane + 1})"}})
            out.append({"name": name, "cat": category, "ph": "X", "pid": rank, "tid": rows[(thread, lane)],
                        "ts": ts, "dur": round(te - ts, 1), "args": dict(args or {})})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _lane(stacks: List[List[float]], ts: float, te: float) -> int:
    """The first row of ``stacks`` where a phase from ``ts`` to ``te`` nests (after, or inside,
    the phases open there), opening a new row if none; the phase is pushed on it."""
    for lane, stack in enumerate(stacks):
        while stack and stack[-1] <= ts:
            stack.pop()
        if not stack or te <= stack[-1]:
            stack.append(te)
            return lane
    stacks.append([te])
    return len(stacks) - 1


def write(path: str, parts: Iterable[Tuple[int, str, Sequence[tuple]]]) -> str:
    """Write the trace of ``parts`` to ``path`` (whole or not at all).

    Args:
        path: the JSON file.
        parts: ``(rank, host, events)`` per rank.

    Returns:
        ``path``.

    Raises:
        OSError: it cannot be written.

    Example::

        >>> write("/tmp/trace.json", [(0, "node1", recorder.close_events(sink))])
        '/tmp/trace.json'
    """
    _save_json(trace(parts), path)
    return path


def write_part(path: str, rank: int, size: int, events: Sequence[tuple]) -> str:
    """Write this rank's whole part of the timeline ``path`` at once (:class:`PartWriter` appends
    it as the job runs).

    Args:
        path: the timeline's file; the part goes beside it (:func:`part_path`).
        rank, size: this rank and the number of ranks.
        events: this rank's events.

    Returns:
        The part's path.

    Example::

        >>> write_part("/tmp/trace.json", 0, 2, recorder.close_events(sink))
        '/tmp/trace.json.rank0.json'
    """
    target = part_path(path, rank)
    with open(target, "w") as f:
        f.write(_header(rank, size) + json.dumps(list(events)) + "\n" + _END)
    return target


def _header(rank: int, size: int) -> str:
    return json.dumps({"rank": rank, "size": size, "host": socket.gethostname()}) + "\n"


class PartWriter:
    """This rank's part of the timeline ``path``, appended every :data:`FLUSH_S` seconds by a
    thread of its own from a recorder sink, and once more at :meth:`close`.

    Args:
        path: the timeline's file; the part goes beside it (:func:`part_path`).
        rank, size: this rank and the number of ranks.

    Raises:
        OSError: the part cannot be created (a folder that is missing or not writable).

    Example::

        >>> writer = PartWriter("/tmp/trace.json", comm.rank, comm.size)
        >>> writer.close()
    """

    def __init__(self, path: str, rank: int, size: int):
        self.path = part_path(path, rank)
        self.rank = rank
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file = open(self.path, "w")
        self._file.write(_header(rank, size))
        self._file.flush()
        # A process forked from this rank (a helper that exits normally) runs the exit handlers
        # too: only the process that opened the part closes it.
        self._pid = os.getpid()
        self._sink = recorder.open_events()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchmn-timeline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_S):
            try:
                self._append(recorder.take_events(self._sink))
            except OSError as e:  # a full disk: say it once, record nothing more (nor keep it in memory)
                recorder.close_events(self._sink)
                sys.stderr.write(f"torchmn: rank {self.rank} on {socket.gethostname()} stopped writing its part "
                                 f"of the timeline {self.path}: {e}\n")
                return

    def _append(self, events: list) -> None:
        with self._lock:
            if events and not self._file.closed:
                self._file.write(json.dumps(events) + "\n")
                self._file.flush()

    def close(self) -> None:
        """Stop recording into the part, append what is left and close it (in the process that
        opened it; elsewhere, nothing).

        Raises:
            OSError: the last events cannot be written.

        Example::

            >>> writer.close()
        """
        if os.getpid() != self._pid:
            return
        self._stop.set()
        self._thread.join()
        try:
            self._append(recorder.close_events(self._sink))
            with self._lock:
                self._file.write(_END)
        finally:
            with self._lock:
                self._file.close()


def read_part(file: str) -> Tuple[int, str, int, List[tuple]]:
    """Read one rank's part of a timeline.

    A part ends with a partly written line where its rank was killed while appending; that line
    is left out.

    Args:
        file: the part's path.

    Returns:
        ``(rank, host, size, events)``.

    Raises:
        OSError: it cannot be read.
        ValueError: it is not a part of a torchmn timeline (names the file).

    Example::

        >>> read_part("/tmp/trace.json.rank0.json")[:3]
        (0, 'node1', 2)
    """
    with open(file) as f:
        lines = f.read().split("\n")
    try:
        header = json.loads(lines[0])
        rank, host, size = int(header["rank"]), str(header["host"]), int(header["size"])
        events: List[tuple] = []
        for i, line in enumerate(lines[1:], start=2):
            if not line:
                continue
            try:
                chunk = json.loads(line)
            except ValueError:
                if i == len(lines):  # the last line, without its newline: a kill mid-append
                    break
                raise
            if isinstance(chunk, list):
                events.extend(tuple(e) for e in chunk)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise TorchmnValueError(f"{file} is not a part of a torchmn timeline ({e}); move it away and merge "
                                f"again") from e
    return rank, host, size, events


def _save_json(data, path: str) -> None:
    """``data`` as JSON in ``path``, whole or not at all (the checkpoints' atomic write)."""
    # Imported here: it imports torch, needed only when a timeline is written.
    from torchmn.checkpoint.files import atomic_save

    atomic_save(data, path, savefun=lambda obj, f: f.write(json.dumps(obj).encode()))


def parts_of(path: str, since: Optional[float] = None) -> List[str]:
    """The parts of the timeline ``path`` present here.

    Args:
        path: the timeline's file.
        since: only parts written at or after this time (``time.time()``): a job's own, not those
            an earlier run of the same path left unjoined. None: every part.

    Returns:
        The parts' paths, by rank.

    Example::

        >>> parts_of("/tmp/trace.json")
        ['/tmp/trace.json.rank0.json', '/tmp/trace.json.rank1.json']
    """
    found = []
    for p in glob.glob(glob.escape(path) + ".rank*.json"):
        m = _PART.search(p)
        try:
            if m is not None and (since is None or os.path.getmtime(p) >= since):
                found.append((int(m.group(1)), p))
        except OSError:  # removed meanwhile (a merge elsewhere)
            continue
    return [p for _, p in sorted(found)]


def ended(file: str) -> bool:
    """Whether the rank of part ``file`` closed it (wrote its last events).

    Args:
        file: a part's path.

    Returns:
        True once the part ends with ``{"end": true}``; False while its rank runs, or where it was
        killed, or the file is gone.

    Example::

        >>> ended("/tmp/trace.json.rank1.json")
        True
    """
    try:
        with open(file, "rb") as f:
            f.seek(max(0, os.path.getsize(file) - len(_END)))
            return f.read().decode(errors="replace") == _END
    except OSError:
        return False


def merge(path: str, remove: bool = True, since: Optional[float] = None, keep_while_missing: bool = True,
          finished: bool = False) -> Tuple[str, List[int], Optional[int], List[str]]:
    """Join the parts of the timeline ``path`` found here into ``path``.

    Only the parts of one job are joined: those with as many ranks as the newest part's. A job of
    more ranks before it left parts that the ranks of this one did not overwrite (rank 2 of 3 beside
    a 2-rank job's); they are left where they are, and named.

    Args:
        path: the timeline's file.
        remove: delete the parts once joined.
        since: join only parts written at or after this time (a job's own; see :func:`parts_of`).
        keep_while_missing: keep them while a rank's part is missing, to join again once it is
            here (False: the ranks without a part recorded none, as in a Horovod timeline that
            rank 0 alone started).
        finished: every rank has stopped (the launcher, after the job): the parts are removed
            even where a rank did not close its own (killed); otherwise such a part is being
            written, and every part is kept.

    Returns:
        ``(path, ranks joined, ranks the job had, parts left out)``: the third is None where no
        part says; the last are another job's parts, kept.

    Raises:
        OSError: no part of ``path`` is here (``TorchmnOSError``), or one cannot be read.
        ValueError: a part is not a timeline part (names the file).

    Example::

        >>> merge("/tmp/trace.json")
        ('/tmp/trace.json', [0, 1], 2, [])
    """
    files = parts_of(path, since)
    if not files:
        raise TorchmnOSError(f"no part of the timeline {path} here: each rank writes {part_path(path, 0)} "
                                f"and so on as it ends (TORCHMN_TIMELINE={path}); were they written on other "
                                f"machines? Copy them here first")
    read = {file: read_part(file) for file in files}
    size = read[max(files, key=_modified)][2]
    files, left_out = [f for f in files if read[f][2] == size], [f for f in files if read[f][2] != size]
    parts = [(rank, host, events) for rank, host, _, events in (read[f] for f in files)]
    write(path, parts)
    joined = [r for r, _, _ in parts]
    # Kept while a rank is missing: its part, copied here later, is joined with them all.
    # Kept while a part is being written too (a merge by hand during the run): the next merge
    # needs every part.
    if remove and (not keep_while_missing or set(joined) >= set(range(size or 0))) and \
            (finished or all(map(ended, files))):
        for file in files:
            os.unlink(file)
    return path, joined, size, left_out


def _modified(file: str) -> float:
    try:
        return os.path.getmtime(file)
    except OSError:  # removed meanwhile
        return 0.0


def wait_for_parts(path: str, since: float, size: int = 0) -> List[str]:
    """Wait, up to :data:`MERGE_WAIT_S`, until every part of the timeline ``path`` written since
    ``since`` is closed by its rank (ranks that stop a little later), and there are ``size`` of them.

    Args:
        path: the timeline's file.
        since: only parts written at or after this time (see :func:`parts_of`).
        size: how many parts to wait for (0: those there are).

    Returns:
        The parts found at the end of the wait (see :func:`ended` for which are closed).

    Example::

        >>> [p for p in wait_for_parts("/tmp/trace.json", started, 2) if not ended(p)]
        []
    """
    deadline = time.monotonic() + MERGE_WAIT_S
    while True:
        parts = parts_of(path, since)
        if (len(parts) >= size and all(map(ended, parts))) or time.monotonic() >= deadline:
            return parts
        time.sleep(0.1)


def finish(writer: PartWriter, path: str, rank: int, size: int, join: bool) -> None:
    """What each rank does at its end while a timeline is recorded: close its part and, if ``join``
    (rank 0 under launchers other than torchmn run), wait up to :data:`MERGE_WAIT_S` for the
    others' parts and join them.

    Args:
        writer: this rank's part.
        path: the timeline's file (``TORCHMN_TIMELINE``).
        rank, size: this rank and the number of ranks.
        join: join the parts here.

    Example::

        >>> atexit.register(finish, writer, "/tmp/trace.json", comm.rank, comm.size, comm.rank == 0)
    """
    if os.getpid() != writer._pid:
        return  # a process forked from the rank: the part and the join are the rank's
    try:
        writer.close()
    except OSError as e:
        sys.stderr.write(f"torchmn: rank {rank} on {socket.gethostname()} could not write its part of the "
                         f"timeline {path}: {e}\n")
        return
    if not join:
        return
    # This job's parts are written after its ranks met, so after this process started; older ones
    # are an earlier run's, left unjoined, and are not this job's.
    since = _process_start_time()
    found = sum(map(ended, wait_for_parts(path, since, size)))
    if found < size:
        sys.stderr.write(f"torchmn: rank 0 found {found} of {size} finished parts of the timeline {path} "
                         f"within {MERGE_WAIT_S:.0f} s (the others run on other machines, or have not ended): "
                         f"once they are here, join them with: torchmn timeline merge {shlex.quote(path)}\n")
        return
    merge(path, since=since)


def _process_start_time() -> float:
    """When this process started (``time.time()``'s clock), rounded down to allow for the file
    system's timestamps."""
    import psutil

    return psutil.Process().create_time() - 1.0
