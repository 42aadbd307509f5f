"""Seeing a running job: each rank's step figures (``recorder``), sent beside the training
(``publisher``), shown as a live per-rank table with a straggler summary (``display``, ``summary``),
and timelines of every rank's phases (``timeline``, drawn by ``plot``).

A rank records only when asked, by variables its launcher (or the user) sets:

- ``TORCHMN_MONITOR=1`` (``torchmn run --monitor``): the figures go to the job's store every few
  seconds; ``torchmn run`` shows the table, and under srun, mpirun and torchrun rank 0 does;
- ``TORCHMN_MONITOR_DIR=DIR``: the figures go to ``DIR/rank-<r>.json`` (``torchmn doctor``);
- ``TORCHMN_TIMELINE=FILE`` (``torchmn run --timeline FILE``): the phases go to a timeline.
"""
from __future__ import annotations

import atexit
import os

from torchmn.monitor import recorder

MONITOR_VARIABLE = "TORCHMN_MONITOR"
FOLDER_VARIABLE = "TORCHMN_MONITOR_DIR"
TIMELINE_VARIABLE = "TORCHMN_TIMELINE"

_started = {"started": False, "publisher": None, "display": None}


def asked(environ=os.environ) -> bool:
    """Whether ``TORCHMN_MONITOR`` asks for the monitor (set, and not ``0`` or empty).

    Args:
        environ: the environment to read.

    Returns:
        True where the monitor is asked for.

    Example::

        >>> asked({"TORCHMN_MONITOR": "1"})
        True
    """
    return environ.get(MONITOR_VARIABLE, "0").strip().lower() not in ("", "0", "false", "no")


def start_for(comm, launched_by: str) -> None:
    """Start what the variables ask for on this rank, once per process (``create_communicator``
    calls it with the world's communicator).

    Args:
        comm: the world's communicator.
        launched_by: the launcher detected (``"torchmn"`` shows the table itself; under others
            rank 0 does).

    Example::

        >>> start_for(comm, "slurm")
    """
    if _started["started"]:
        return
    monitor, folder = asked(), os.environ.get(FOLDER_VARIABLE) or None
    path = os.environ.get(TIMELINE_VARIABLE) or None
    if not (monitor or folder or path):
        return
    _started["started"] = True
    recorder.start()
    if path is not None:
        _start_timeline(os.path.abspath(path), comm, join=comm.rank == 0 and launched_by != "torchmn")
    if folder is not None:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:  # seeing the job must never stop it
            _warn(comm, f"the monitor's folder {folder} ({FOLDER_VARIABLE}) cannot be made ({e}); this rank's "
                        f"figures go to the job's store only")
            folder = None
    if not (monitor or folder):
        return
    from torchmn.communicators import world
    from torchmn.monitor.publisher import Publisher

    store = world.job_store() if monitor else None
    _started["publisher"] = Publisher(comm.rank, store, folder)
    if monitor and comm.rank == 0 and launched_by != "torchmn" and store is not None:
        import sys

        from torchmn.monitor import display

        shown = display.Display(lambda: display.read_store(store, comm.size), comm.size,
                                display.show_on_stderr, sys.stderr)
        shown.start()
        _started["display"] = shown
        # Registered after the publisher's: runs before it (atexit is last in, first out), so
        # the wait for the others' final figures counts this rank's too.
        atexit.register(_finish_display)


def _start_timeline(path: str, comm, join: bool) -> None:
    from torchmn.monitor import timeline

    try:
        writer = timeline.PartWriter(path, comm.rank, comm.size)
    except OSError as e:
        _warn(comm, f"cannot write its part of the timeline {path} ({e}); it records none: give "
                    f"{TIMELINE_VARIABLE} (--timeline) a path in a folder every rank can write")
        return
    atexit.register(timeline.finish, writer, path, comm.rank, comm.size, join)


def _warn(comm, what: str) -> None:
    import socket
    import sys

    sys.stderr.write(f"torchmn: rank {comm.rank} on {socket.gethostname()}: {what}\n")


def _finish_display() -> None:
    from torchmn.monitor import publisher

    sender, shown = _started["publisher"], _started["display"]
    if sender is not None:
        sender.close()
    if shown is not None:
        shown.finish(wait_final_s=2 * publisher.INTERVAL_S)
