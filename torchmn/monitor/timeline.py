"""Timelines: every rank's phases (forward+backward, averaging per bucket, the update, every
collective) as one Chrome trace / Perfetto JSON file, a process row per rank and a thread row per
thread of it.

With ``TORCHMN_TIMELINE=FILE`` (``torchmn run --timeline FILE`` sets it), each rank writes its part,
``FILE.rank<r>.json``, when it ends; the parts are joined into ``FILE`` by ``torchmn run`` after the
job, by rank 0 under other launchers (where it sees the others' parts: one machine, or a shared file
system), or afterwards by ``torchmn timeline merge FILE``. ``torchmn.horovod``'s
``start_timeline``/``stop_timeline`` record through the same recorder and write the same format.
"""
from __future__ import annotations

import glob
import json
import os
import re
import socket
import sys
import time
from typing import Iterable, List, Optional, Sequence, Tuple

from torchmn.errors import TorchmnOSError, TorchmnValueError
from torchmn.monitor import recorder

# How long rank 0 waits, at its end, for the other ranks' parts (under launchers other than torchmn run).
MERGE_WAIT_S = 10.0
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


def trace(parts: Iterable[Tuple[int, str, Sequence[tuple]]]) -> dict:
    """The Chrome trace of every rank's events.

    Args:
        parts: ``(rank, host, events)`` per rank, events as ``recorder.stop_timeline`` returns them.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``: per rank a process (named
        ``rank <r> (<host>)``), per thread a thread row, and one complete event (``"ph": "X"``) per
        phase, in microseconds from the earliest event of any rank.

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
        threads: dict = {}
        for name, category, t0, t1, thread, args in events:
            if thread not in threads:
                threads[thread] = len(threads)
                out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": threads[thread],
                            "args": {"name": thread}})
            out.append({"name": name, "cat": category, "ph": "X", "pid": rank, "tid": threads[thread],
                        "ts": round((t0 - origin) * 1e6, 1), "dur": round(max(t1 - t0, 0.0) * 1e6, 1),
                        "args": dict(args or {})})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


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

        >>> write("/tmp/trace.json", [(0, "node1", recorder.stop_timeline())])
        '/tmp/trace.json'
    """
    _save_json(trace(parts), path)
    return path


def write_part(path: str, rank: int, size: int, events: Sequence[tuple]) -> str:
    """Write this rank's part of the timeline ``path``.

    Args:
        path: the timeline's file; the part goes beside it (:func:`part_path`).
        rank, size: this rank and the number of ranks.
        events: this rank's events.

    Returns:
        The part's path.

    Example::

        >>> write_part("/tmp/trace.json", 0, 2, recorder.stop_timeline())
        '/tmp/trace.json.rank0.json'
    """
    target = part_path(path, rank)
    _save_json({"rank": rank, "size": size, "host": socket.gethostname(), "events": list(events)}, target)
    return target


def _save_json(data, path: str) -> None:
    """``data`` as JSON in ``path``, whole or not at all (the checkpoints' atomic write)."""
    from torchmn.checkpoint.files import atomic_save  # imports torch: only when a timeline is written

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


def merge(path: str, remove: bool = True, since: Optional[float] = None) -> Tuple[str, List[int], Optional[int]]:
    """Join the parts of the timeline ``path`` found here into ``path``.

    Args:
        path: the timeline's file.
        remove: delete the parts once joined.
        since: join only parts written at or after this time (a job's own; see :func:`parts_of`).

    Returns:
        ``(path, ranks joined, ranks the job had)``; the last is None where no part says.

    Raises:
        OSError: no part of ``path`` is here (``TorchmnOSError``), or one cannot be read.
        ValueError: a part is not a timeline part (names the file).

    Example::

        >>> merge("/tmp/trace.json")
        ('/tmp/trace.json', [0, 1], 2)
    """
    files = parts_of(path, since)
    if not files:
        raise TorchmnOSError(f"no part of the timeline {path} here: each rank writes {part_path(path, 0)} "
                                f"and so on as it ends (TORCHMN_TIMELINE={path}); were they written on other "
                                f"machines? Copy them here first")
    parts, size = [], None
    for file in files:
        try:
            with open(file) as f:
                data = json.load(f)
            parts.append((int(data["rank"]), str(data["host"]), [tuple(e) for e in data["events"]]))
            size = int(data["size"])
        except (ValueError, KeyError, TypeError) as e:
            raise TorchmnValueError(f"{file} is not a part of a torchmn timeline ({e}); move it away and merge again") from e
    write(path, parts)
    if remove:
        for file in files:
            os.unlink(file)
    return path, [r for r, _, _ in parts], size


def write_at_exit(path: str, rank: int, size: int, join: bool) -> None:
    """What each rank does at its end while a timeline is recorded: write its part and, if ``join``
    (rank 0 under launchers other than torchmn run), wait up to :data:`MERGE_WAIT_S` for the
    others' parts and join them.

    Args:
        path: the timeline's file (``TORCHMN_TIMELINE``).
        rank, size: this rank and the number of ranks.
        join: join the parts here.

    Example::

        >>> atexit.register(write_at_exit, "/tmp/trace.json", comm.rank, comm.size, comm.rank == 0)
    """
    try:
        write_part(path, rank, size, recorder.stop_timeline())
    except OSError as e:
        sys.stderr.write(f"torchmn: rank {rank} on {socket.gethostname()} could not write its part of the "
                         f"timeline {path}: {e}\n")
        return
    if not join:
        return
    # This job's parts are written after its ranks met, so after this process started; older ones
    # are an earlier run's, left unjoined, and are not this job's.
    since = _process_start_time()
    deadline = time.monotonic() + MERGE_WAIT_S
    while len(parts_of(path, since)) < size and time.monotonic() < deadline:
        time.sleep(0.1)
    found = len(parts_of(path, since))
    if found < size:
        sys.stderr.write(f"torchmn: rank 0 found {found} of {size} parts of the timeline {path} within "
                         f"{MERGE_WAIT_S:.0f} s (the others run on other machines, or have not ended): once "
                         f"they are here, join them with: torchmn timeline merge {path}\n")
        return
    merge(path, since=since)


def _process_start_time() -> float:
    """When this process started (``time.time()``'s clock), rounded down to allow for the file
    system's timestamps."""
    import psutil

    return psutil.Process().create_time() - 1.0
