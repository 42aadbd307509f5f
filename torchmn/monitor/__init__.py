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

_started = {"publisher": None, "display": None}


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
    if _started["publisher"] is not None or recorder.timeline_on:
        return
    monitor, folder = asked(), os.environ.get(FOLDER_VARIABLE) or None
    path = os.environ.get(TIMELINE_VARIABLE) or None
    if not (monitor or folder or path):
        return
    recorder.start(timeline=path is not None)
    if path is not None:
        from torchmn.monitor import timeline

        path = os.path.abspath(path)
        atexit.register(timeline.write_at_exit, path, comm.rank, comm.size,
                        comm.rank == 0 and launched_by != "torchmn")
    if not (monitor or folder):
        return
    from torchmn.communicators import world
    from torchmn.monitor.publisher import Publisher

    store = world.job_store() if monitor else None
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
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


def _finish_display() -> None:
    from torchmn.monitor import publisher

    sender, shown = _started["publisher"], _started["display"]
    if sender is not None:
        sender.close()
    if shown is not None:
        shown.finish(wait_final_s=2 * publisher.INTERVAL_S)
