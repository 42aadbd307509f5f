"""Horovod's timeline: each rank's collectives as a Chrome trace (chrome://tracing, Perfetto).

Every rank records its Horovod calls (kind, tensor name, bytes, start and end) from
:func:`start_timeline` on, through torchmn's own recorder (:mod:`torchmn.monitor.recorder`), which
adds the optimizer's phases and the communicator's collectives beneath them. As Horovod's, starting
and stopping are calls of one rank alone, never collectives: each rank that records appends its part
beside the file every second, and at :func:`stop_timeline` rank 0 joins the parts it sees as
``torchmn run --timeline`` does (:mod:`torchmn.monitor.timeline`): a process row per rank, one
complete event (``"ph": "X"``) per phase.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

from torchmn.horovod.process_sets import job, require_comm
from torchmn.monitor import recorder, timeline

_state: dict = {"path": None, "since": None, "writer": None}


def recording() -> bool:
    """Whether a timeline is being recorded.

    Returns:
        True between :func:`start_timeline` and :func:`stop_timeline`.

    Example::

        >>> if recording():
        ...     stop_timeline()
    """
    return _state["writer"] is not None


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
    """Start recording this rank's collectives; as Horovod's, a call of this rank alone (every
    rank may call it, or rank 0 only).

    Each rank that records appends its events to ``file_path.rank<r>.json`` every second
    (:class:`torchmn.monitor.timeline.PartWriter`); :func:`stop_timeline` closes it, and rank 0
    joins the parts it sees into ``file_path``.

    Args:
        file_path: where rank 0 writes the JSON when the timeline stops.
        mark_cycles: accepted for Horovod's signature; torchmn has no background cycles to mark.

    Raises:
        InvalidCallError: before ``hvd.init()`` (a ``ValueError``).
        OSError: this rank cannot write its part beside ``file_path``.

    Example::

        >>> hvd.start_timeline("/tmp/timeline.json")
        >>> hvd.allreduce(x)
        >>> hvd.stop_timeline()     # rank 0 writes /tmp/timeline.json
    """
    comm = require_comm()
    if _state["writer"] is not None:  # started again: Horovod restarts its timeline in the new file
        _state["writer"].close()
        _state.update(path=None, since=None, writer=None)
    if comm is job.solo and job.world.size > 1:
        return  # a rank hvd.init(comm=[...]) left out: not in the job's timeline
    path = os.path.abspath(file_path)
    # Parts written from here on are this timeline's; older ones an earlier run left are not
    # (a second's slack for the file system's timestamps).
    since = time.time() - 1.0
    _state.update(path=path, since=since, writer=timeline.PartWriter(path, comm.rank, comm.size))


def stop_timeline() -> Optional[str]:
    """Stop recording this rank's collectives (a call of this rank alone, as Horovod's); rank 0
    then joins into the file the parts it sees (every rank's on one machine or a shared file
    system), waiting up to ``torchmn.monitor.timeline.MERGE_WAIT_S`` for parts still being written.

    Returns:
        The file's path on rank 0, None elsewhere (and where no timeline was recording).

    Raises:
        OSError: this rank's part or rank 0's file cannot be written.

    Example::

        >>> hvd.stop_timeline()
    """
    path, since, writer = _state["path"], _state["since"], _state["writer"]
    _state.update(path=None, since=None, writer=None)
    if writer is None:
        return None
    writer.close()
    if job.comm is None or job.comm.rank != 0:
        return None
    # A rank that recorded has had its part since its start_timeline: wait for those still open
    # (ranks that stop a little later); a rank without a part started none, or writes elsewhere.
    open_ = [timeline.part_rank(f) for f in timeline.wait_for_parts(path, since) if not timeline.ended(f)]
    timeline.merge(path, since=since, keep_while_missing=False)
    if open_:
        sys.stderr.write(f"torchmn.horovod: rank(s) {', '.join(map(str, open_))} had not stopped their timeline "
                         f"{timeline.MERGE_WAIT_S:.0f} s after rank 0: {path} holds their events up to then\n")
    return path
