"""The Horovod layer's background thread, where its tensor collectives run.

Horovod runs every collective on a thread of its own: an ``*_async`` call returns at once, its
handle polls False while the collective is in flight, and a rank may start a collective that the
others will only start later (after a barrier, say) without blocking. Here one daemon thread per
process runs the tensor collectives (allreduce, allgather, broadcast, alltoall, reducescatter,
their grouped forms, and a joined rank's part in them) in the order the script started them, on
communicators of their own (one per process set, see :mod:`~torchmn.horovod.process_sets`), so
the main thread's own collectives (barrier, object collectives, ``DistributedOptimizer`` steps) can
never meet them out of order on the wire. The collectives of one communicator run in one order on
every rank, which is also what keeps a node's shared-memory steps matched.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional


class Job:
    """One piece of work for the background thread and, once it has run, its outcome.

    Args:
        work: the function to run there.

    Example::

        >>> job = start(lambda: comm.allgather_obj(1))
        >>> job.done.is_set()            # False while it waits for the other ranks
    """

    def __init__(self, work: Callable[[], Any]):
        self.work = work
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        """Run the work on this thread (the background thread calls it); keep its result or error.

        Example::

            >>> job.run()
            >>> job.done.is_set()
            True
        """
        try:
            self.result = self.work()
        except BaseException as e:  # noqa: BLE001 (handed to whoever waits for the job)
            self.error = e
        finally:
            self.work = None
            self.done.set()

    def wait(self) -> Any:
        """Wait for the job; return its result or raise what it raised.

        Returns:
            What the job's function returned.

        Raises:
            BaseException: whatever the job's function raised (a collective's error).

        Example::

            >>> start(lambda: comm.allgather_obj(1)).wait()
        """
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


_queue: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
_thread: Optional[threading.Thread] = None
_STOP = None


def _loop() -> None:
    while True:
        job = _queue.get()
        if job is _STOP:
            return
        job.run()


def start(work: Callable[[], Any]) -> Job:
    """Run ``work()`` on the background thread, after the work started before it.

    Args:
        work: the collective, start to end (its agreement, its network part and its local part).

    Returns:
        The :class:`Job`, done once ``work`` has run.

    Example::

        >>> job = start(lambda: tensor_comm.allgather(x))
        >>> parts = job.wait()
    """
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_loop, name="torchmn.horovod background", daemon=True)
        _thread.start()
    job = Job(work)
    _queue.put(job)
    return job


def stop() -> None:
    """Let the background thread finish the work it has, then end it (``hvd.shutdown`` calls this).

    Example::

        >>> stop()
    """
    global _thread
    if _thread is not None and _thread.is_alive():
        _queue.put(_STOP)
        _thread.join()
    _thread = None
