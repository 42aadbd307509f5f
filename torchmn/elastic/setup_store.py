"""The store an elastic generation's world is set up through: torch.distributed's own waits for
the members' keys, which give up when the launcher moves the job on.

Every member of a generation has arrived before any sets up its world (:mod:`.membership`), but
one can still die inside the set-up. The others then wait, inside ``init_process_group`` or
``new_group``, for keys it never writes, for the whole collective timeout (600 s by default),
although the launcher has meanwhile announced a newer generation without it. Through this store
such a wait ends as soon as the launcher marks the generation broken (a member lost) or ends the
job; the error then reaches the reset, which moves the rank to the newer generation.
"""
from __future__ import annotations

import datetime
import time
from typing import List, Optional

import torch.distributed as dist

from torchmn.elastic import protocol
from torchmn.errors import TorchmnRuntimeError

POLL_S = 0.02  # how often a wait looks at its keys and at the launcher's generation
# The longest a generation's group may take to set up. gloo's connections to the members, made
# inside C++ once their addresses are in the store, do not see the launcher move on: a member that
# left meanwhile is retried for this long (a healthy set-up takes well under a second).
SETUP_TIMEOUT_S = 60.0


def watched(store: dist.Store, generation: int) -> dist.Store:
    """``store`` as generation ``generation``'s set-up should use it: its waits end (with an error)
    when the launcher announces a newer generation or ends the job.

    Keep the result for as long as the world lives: torch holds it only on its C++ side, where it
    would lose its Python methods.

    Args:
        store: a client of the launcher's store (unprefixed: the generation's keys are read there).
        generation: the generation whose world is set up through it.

    Returns:
        A store to give ``init_process_group`` (inside a ``PrefixStore``).

    Example::

        >>> setup = watched(launcher_store(), 3)
        >>> dist.init_process_group("gloo", store=dist.PrefixStore("w/", setup), rank=0, world_size=2)
    """
    return _SetupStore(store, generation)


class _SetupStore(dist.Store):
    """torch's ``Store`` interface over ``store``, whose waits look at the launcher's generation."""

    def __init__(self, store: dist.Store, generation: int, root: Optional["_SetupStore"] = None):
        super().__init__()
        self.store, self.generation = store, generation
        self.set_timeout(store.timeout)
        # torch clones a store for its threads; a clone held only on the C++ side would lose its
        # Python methods, so the clones live as long as the first one.
        self._clones: List["_SetupStore"] = []
        self._root = root or self

    def moved_on(self) -> Optional[str]:
        """Why this generation's set-up should give up (a member lost, the job's end), or None.

        A newer generation that only adds workers is no reason: every member of this one is alive
        and setting it up, and leaving would strand one already connecting to this rank inside
        gloo (see ``SETUP_TIMEOUT_S``). They all move at their next commit instead."""
        if protocol.end_reason(self.store) is not None:
            return f"the launcher ended the job while this rank set up generation {self.generation}"
        latest = protocol.read_generation(self.store)
        for g in range(self.generation, latest):
            if self.store.check([protocol.broken_key(g)]):
                return (f"the launcher lost a member of generation {g} and announced generation {latest} while "
                        f"this rank set up generation {self.generation}")
        return None

    def set(self, key, value):
        self.store.set(key, value)

    def get(self, key):
        self.wait([key])
        return self.store.get(key)

    def add(self, key, value):
        return self.store.add(key, value)

    def compare_set(self, key, expected, desired):
        return self.store.compare_set(key, expected, desired)

    def check(self, keys):
        return self.store.check(keys)

    def delete_key(self, key):
        return self.store.delete_key(key)

    def num_keys(self):
        return self.store.num_keys()

    def has_extended_api(self):
        return False

    def wait(self, keys, timeout: Optional[datetime.timedelta] = None):
        limit = (timeout if timeout is not None and timeout.total_seconds() > 0 else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.store.check(keys):
            why = self.moved_on()
            if why is not None:
                raise TorchmnRuntimeError(f"torchmn.elastic: gave up waiting for {', '.join(keys)}: {why}")
            if time.monotonic() > deadline:
                raise TorchmnRuntimeError(f"torchmn.elastic: timed out after {limit:g} s waiting for "
                                          f"{', '.join(keys)} while setting up generation {self.generation}")
            time.sleep(POLL_S)

    def clone(self):
        clone = _SetupStore(self.store.clone(), self.generation, self._root)
        self._root._clones.append(clone)
        return clone
