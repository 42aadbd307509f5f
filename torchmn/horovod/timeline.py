"""Horovod's timeline: each rank's collectives as a Chrome trace (chrome://tracing, Perfetto).

Every rank records its collectives (kind, tensor name, bytes, start and end) from
:func:`start_timeline` on; :func:`stop_timeline` gathers them to rank 0, which writes one JSON
file: a process row per rank, one complete event (``"ph": "X"``) per collective.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from torchmn.horovod.process_sets import job, require_comm

_state: dict = {"events": None, "path": None, "start": None}


def recording() -> bool:
    """Whether a timeline is being recorded.

    Returns:
        True between :func:`start_timeline` and :func:`stop_timeline`.

    Example::

        >>> if recording():
        ...     stop_timeline()
    """
    return _state["events"] is not None


def record(kind: str, name: str, nbytes: int, start: float, end: float, process_set_id: int = 0) -> None:
    """Add one collective to the timeline, if one is recording.

    Args:
        kind: the collective (``"allreduce"``, ...), the event's name in the trace.
        name: the tensor's name.
        nbytes: the bytes it carried.
        start, end: when it began and ended, from ``time.time()``.
        process_set_id: the set it ran on (the event's row within its rank).

    Example::

        >>> t0 = time.time(); comm.barrier()
        >>> record("barrier", "barrier.noname", 0, t0, time.time())
    """
    events = _state["events"]
    if events is not None:
        events.append((kind, name, int(nbytes), start, end, process_set_id))


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording each rank's collectives; call it on every rank.

    Args:
        file_path: where rank 0 writes the JSON when the timeline stops.
        mark_cycles: accepted for Horovod's signature; torchmn has no background cycles to mark.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``).

    Example::

        >>> hvd.start_timeline("/tmp/timeline.json")
        >>> hvd.allreduce(x)
        >>> hvd.stop_timeline()     # rank 0 writes /tmp/timeline.json
    """
    require_comm()
    _state.update(events=[], path=os.path.abspath(file_path), start=time.time())


def stop_timeline() -> Optional[str]:
    """Stop recording; rank 0 writes every rank's events to the file (a collective: call it on
    every rank).

    Returns:
        The file's path on rank 0, None elsewhere (and where no timeline was recording).

    Raises:
        OSError: rank 0 cannot write the file.

    Example::

        >>> hvd.stop_timeline()
    """
    events, path, start = _state["events"], _state["path"], _state["start"]
    _state.update(events=None, path=None, start=None)
    if events is None or job.comm is None:
        return None
    world = job.comm
    gathered = world.gather_obj((socket.gethostname(), start, events), root=0)
    if world.rank != 0:
        return None
    origin = min(s for _, s, _ in gathered)
    trace = []
    for rank, (host, _, rank_events) in enumerate(gathered):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({host})"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for kind, name, nbytes, t0, t1, ps_id in rank_events:
            trace.append({"name": kind.upper(), "cat": "collective", "ph": "X", "pid": rank, "tid": ps_id,
                          "ts": round((t0 - origin) * 1e6, 1), "dur": round(max(t1 - t0, 0.0) * 1e6, 1),
                          "args": {"tensor": name, "bytes": nbytes, "process_set_id": ps_id}})
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
    return path
