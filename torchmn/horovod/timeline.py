"""Horovod's timeline: each rank's collectives as a Chrome trace (chrome://tracing, Perfetto).

Every rank records its Horovod calls (kind, tensor name, bytes, start and end) from
:func:`start_timeline` on, through torchmn's own recorder (:mod:`torchmn.monitor.recorder`), which
adds the optimizer's phases and the communicator's collectives beneath them; :func:`stop_timeline`
gathers them to rank 0, which writes the file as ``torchmn run --timeline`` does
(:func:`torchmn.monitor.timeline.write`): a process row per rank, one complete event
(``"ph": "X"``) per phase.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

from torchmn.horovod.process_sets import job, require_comm
from torchmn.monitor import recorder, timeline

_state: dict = {"path": None, "sink": None}


def recording() -> bool:
    """Whether a timeline is being recorded.

    Returns:
        True between :func:`start_timeline` and :func:`stop_timeline`.

    Example::

        >>> if recording():
        ...     stop_timeline()
    """
    return _state["path"] is not None


def record(kind: str, name: str, nbytes: int, start: float, end: float, process_set_id: int = 0) -> None:
    """Add one collective to the timelines recording: Horovod's (:func:`start_timeline`) and the
    job's (``torchmn run --timeline``).

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
    if recorder.timeline_on:  # hvd.start_timeline's window, or the job's --timeline
        recorder.event(kind.upper(), "horovod", recorder.from_wall(start), recorder.from_wall(end),
                       {"tensor": name, "bytes": int(nbytes), "process_set_id": process_set_id})


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
    if _state["sink"] is not None:  # started again: Horovod restarts its timeline in the new file
        recorder.close_events(_state["sink"])
    _state.update(path=os.path.abspath(file_path), sink=recorder.open_events())


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
    path, sink = _state["path"], _state["sink"]
    _state.update(path=None, sink=None)
    if path is None or job.comm is None:
        return None
    # Its own sink: a job recorded with --timeline too keeps its events, and this file gets
    # only those from start_timeline on.
    events = recorder.close_events(sink)
    world = job.comm
    gathered = world.gather_obj((socket.gethostname(), events), root=0)
    if world.rank != 0:
        return None
    return timeline.write(path, [(rank, host, events) for rank, (host, events) in enumerate(gathered)])
