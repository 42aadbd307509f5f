"""The Horovod layer's background threads, where its tensor collectives run.

Horovod runs every collective on a thread of its own: an ``*_async`` call returns at once, its
handle polls False while the collective is in flight, and a rank may start a collective that the
others will only start later (after a barrier, say) without blocking. Here each process set's
tensor collectives (allreduce, allgather, broadcast, alltoall, reducescatter, their grouped forms,
and a joined rank's part in them) run on a daemon thread of that set, in the order the script
started them, over the set's own communicator (see :mod:`~torchmn.horovod.process_sets`), so the
main thread's collectives (barrier, object collectives, ``DistributedOptimizer`` steps) never meet
them out of order on the wire, and one set's collectives never wait behind another's. The
collectives of one communicator run in one order on every rank, which is also what keeps a node's
shared-memory steps matched.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional


class Job:
    """One piece of work for the background thread and, once it has run, its outcome.

    Args:
        work: the function to run there.

    Example::

        >>> job = start(tensor_comm, lambda: tensor_comm.allgather_obj(1))
        >>> job.done.is_set()            # False while it waits for the other ranks
    """

    def __init__(self, work: Callable[[], Any]):
        self.work = work
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.finished: Optional[float] = None   # time.time() when it had run

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
            self.finished = time.time()
            self.done.set()

    def wait(self) -> Any:
        """Wait for the job; return its result or raise what it raised.

        Returns:
            What the job's function returned.

        Raises:
            BaseException: whatever the job's function raised (a collective's error).

        Example::

            >>> start(tensor_comm, lambda: tensor_comm.allgather_obj(1)).wait()
        """
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class _Worker:
    """A daemon thread and the queue of jobs it runs in order."""

    def __init__(self, name: str):
        self.queue: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self.running = threading.Lock()   # held while a job of this communicator runs, there or in run_here
        self.counting = threading.Lock()
        self.queued = 0                   # jobs put in the queue and not yet run
        self.thread = threading.Thread(target=self.loop, name=name, daemon=True)
        self.thread.start()

    def put(self, job: Job) -> None:
        with self.counting:
            self.queued += 1
        self.queue.put(job)

    def loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            with self.running:
                job.run()
                with self.counting:
                    self.queued -= 1


_workers: dict = {}   # id of a communicator -> (communicator, its _Worker)


def _worker(comm) -> _Worker:
    entry = _workers.get(id(comm))
    if entry is None or entry[0] is not comm or not entry[1].thread.is_alive():
        entry = (comm, _Worker(f"torchmn.horovod background {len(_workers)}"))
        _workers[id(comm)] = entry
    return entry[1]


def run_here(comm, work: Callable[[], Any]) -> Any:
    """Run ``work()`` now and return its result, in order with the work started on ``comm``'s
    background thread: on this thread when nothing is queued there (a blocking collective then
    costs no hand-off between threads), else there, after the rest.

    Args:
        comm: the tensor communicator the work's collectives run on.
        work: the collective, start to end.

    Returns:
        What ``work`` returned.

    Raises:
        BaseException: whatever ``work`` raised.

    Example::

        >>> parts = run_here(tensor_comm, lambda: tensor_comm.allgather(x))
    """
    worker = _worker(comm)
    with worker.running:
        with worker.counting:
            idle = worker.queued == 0
        if idle:
            return work()
    return start(comm, work).wait()


def start(comm, work: Callable[[], Any]) -> Job:
    """Run ``work()`` on ``comm``'s background thread, after the work started there before it.

    Args:
        comm: the tensor communicator the work's collectives run on (one thread each).
        work: the collective, start to end (its agreement, its network part and its local part).

    Returns:
        The :class:`Job`, done once ``work`` has run.

    Example::

        >>> job = start(tensor_comm, lambda: tensor_comm.allgather(x))
        >>> parts = job.wait()
    """
    job = Job(work)
    _worker(comm).put(job)
    return job


def retire(comm) -> None:
    """Let ``comm``'s background thread finish the work it has, then end it (its process set is
    removed); the next work on ``comm`` would start a new one.

    Args:
        comm: the tensor communicator.

    Example::

        >>> retire(tensor_comm)
        >>> tensor_comm.finalize()
    """
    comm_and_worker = _workers.pop(id(comm), None)
    if comm_and_worker is not None and comm_and_worker[0] is comm and comm_and_worker[1].thread.is_alive():
        comm_and_worker[1].queue.put(None)
        comm_and_worker[1].thread.join()


def stop() -> None:
    """Let the background threads finish the work they have, then end them (``hvd.shutdown``
    calls this).

    Example::

        >>> stop()
    """
    for _, worker in _workers.values():
        if worker.thread.is_alive():
            worker.queue.put(None)
            worker.thread.join()
    _workers.clear()
