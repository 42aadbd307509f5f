"""Handles of asynchronous collectives: one with nothing to wait for, one over several messages in
flight, and one whose local part runs once its network part is done."""
from __future__ import annotations

import datetime
import time


class Completed:
    """The handle of a collective that had nothing to do (a world of one, or work already done)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class AllOf:
    """The handle of several of torch's handles in flight together (the messages of one collective);
    ``wait()`` waits for all of them, within one ``timeout`` overall."""

    def __init__(self, works):
        self._works = list(works)

    def wait(self, timeout=None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            if deadline is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class AndThen:
    """The handle of a collective whose network part is in flight; ``wait()`` waits for it, then runs
    the local part that must follow it (a sum, or a step through the node's shared memory: every
    rank of the node waits its handles in the same order, as the optimizers do, so those steps
    meet). Keeps the buffers alive until then."""

    wraps_torch_work = True  # watched like torch's own handle (see watch.py)

    def __init__(self, work, then=None, keep=()):
        self._work, self._then, self._keep = work, then, keep

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()
        self._keep = ()
        return True

    def network_done(self) -> bool:
        """Whether the network part has finished (then ``wait()`` only runs the local part)."""
        return self._work is None or self._work.is_completed()

    def is_completed(self) -> bool:
        """True once ``wait()`` has run: the local part runs there, never from a poll (on one node it
        must run in the same order on every rank)."""
        return self._work is None and self._then is None


def finish(pending: AndThen, async_op: bool):
    """``pending`` itself for an asynchronous call; else waited for, and a completed handle."""
    if async_op:
        return pending
    pending.wait()
    return Completed()
