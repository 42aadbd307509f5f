"""Each rank's figures, sent every few seconds by a thread of its own: into the job's store, where
``torchmn run --monitor`` (or rank 0, under other launchers) reads them, and into the folder
``TORCHMN_MONITOR_DIR`` names, where ``torchmn doctor`` reads them. No collective, and nothing on the
training thread: the figures travel beside the training, not in its way."""
from __future__ import annotations

import atexit
import glob
import json
import os
import socket
import threading
import time
from typing import Optional

import psutil

from torchmn.monitor import recorder

INTERVAL_S = 2.0


def key(rank: int) -> str:
    """The store key of ``rank``'s figures.

    Args:
        rank: the rank in the world.

    Returns:
        The key (not under a world's prefix: it outlives a world set up again).

    Example::

        >>> key(3)
        'torchmn/monitor/3'
    """
    return f"torchmn/monitor/{rank}"


def file_name(rank) -> str:
    """The file of ``rank``'s figures in ``TORCHMN_MONITOR_DIR``.

    Args:
        rank: the rank in the world (``"*"``: the pattern of every rank's file).

    Returns:
        The file's name.

    Example::

        >>> file_name(3)
        'rank-3.json'
    """
    return f"rank-{rank}.json"


def read_folder(folder: Optional[str]) -> dict:
    """The figures the ranks wrote into ``folder`` (``TORCHMN_MONITOR_DIR``), by rank.

    Args:
        folder: the folder, or None.

    Returns:
        ``{rank: figures}`` for the files that could be read (one being replaced is skipped).

    Example::

        >>> read_folder("/tmp/torchmn-doctor-x1y2")   # doctest: +SKIP
        {0: {'steps': 120, ...}, 1: {...}}
    """
    found = {}
    for path in glob.glob(os.path.join(glob.escape(folder), file_name("*"))) if folder else ():
        try:
            with open(path) as f:
                data = json.load(f)
            found[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not ours: the others still tell
    return found


class Publisher:
    """Sends this rank's figures (``recorder.figures`` with CPU, memory and GPU use) every
    :data:`INTERVAL_S` seconds, and once more, marked final, when closed or at exit.

    Args:
        rank: this rank in the world.
        store: the job's store (``world.job_store``), or None.
        folder: where to write ``rank-<r>.json`` as well, or None.

    Example::

        >>> publisher = Publisher(comm.rank, world.job_store(), None)
        >>> publisher.close()
    """

    def __init__(self, rank: int, store, folder: Optional[str]):
        self.rank, self.store, self.folder = rank, store, folder
        self.host = socket.gethostname()
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first reading only starts the count
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.pid = os.getpid()  # a process forked from the rank runs its exit handlers too: not this one's
        self.thread = threading.Thread(target=self._loop, name="torchmn-monitor", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def snapshot(self, final: bool = False) -> dict:
        """This rank's figures now.

        Args:
            final: the rank is ending (its last snapshot).

        Returns:
            ``recorder.figures()`` plus ``rank``, ``host``, ``pid``, ``cpu_percent`` (of one CPU,
            since the last snapshot), ``rss_mb``, ``gpu_percent`` (None without a GPU in use),
            ``time`` and ``final``.

        Example::

            >>> publisher.snapshot()["rank"]
            0
        """
        out = recorder.figures()
        try:
            cpu, rss = self.process.cpu_percent(None), self.process.memory_info().rss / 2**20
        except psutil.Error:
            cpu = rss = None
        out.update(rank=self.rank, host=self.host, pid=os.getpid(), cpu_percent=cpu, rss_mb=rss,
                   gpu_percent=_gpu_percent(), time=time.time(), final=final)
        return out

    def publish(self, final: bool = False) -> None:
        """Send one snapshot now; a store or folder that is gone is skipped (the job may be ending).

        Args:
            final: the rank is ending.

        Example::

            >>> publisher.publish()
        """
        with self.lock:
            data = json.dumps(self.snapshot(final))
            if self.store is not None:
                try:
                    self.store.set(key(self.rank), data)
                except Exception:  # noqa: BLE001 - the store went with its host at the job's end
                    self.store = None
            if self.folder is not None:
                path = os.path.join(self.folder, file_name(self.rank))
                try:
                    with open(f"{path}.tmp", "w") as f:
                        f.write(data)
                    os.replace(f"{path}.tmp", path)
                except OSError:
                    self.folder = None

    def _loop(self) -> None:
        while not self.stopped.wait(INTERVAL_S):
            self.publish()

    def close(self) -> None:
        """Stop the thread and send the final snapshot (once; also at interpreter exit).

        Example::

            >>> publisher.close()
        """
        if self.stopped.is_set() or os.getpid() != self.pid:
            return
        self.stopped.set()
        self.publish(final=True)


def _gpu_percent() -> Optional[float]:
    """The utilisation of this rank's GPU, where it uses one and the driver's library tells."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        return float(torch.cuda.utilization())
    except Exception:  # noqa: BLE001 - no NVML (pynvml) or AMD SMI to ask
        return None
