"""The store an elastic generation's world is set up through: torch.distributed's own waits for
the members' keys, which give up when the launcher moves the job on.

Every member of a generation has arrived before any sets up its world (:mod:`.membership`), but
one can still die inside the set-up. The others then wait, inside ``init_process_group`` or
``new_group``, for keys it never writes, for the whole collective timeout (600 s by default),
although the launcher has meanwhile announced a newer generation without it. Through this store
such a wait ends as soon as a newer generation or the job's end is announced; the error then
reaches the reset, which moves the rank to the newer generation.
"""
from __future__ import annotations

import datetime
import time
from typing import List, Optional

import torch.distributed as dist

from torchmn.elastic import protocol

POLL_S = 0.02  # how often a wait looks at its keys and at the launcher's generation


class SetupStore(dist.Store):
    """The launcher's store for the set-up of generation ``generation``: waits end when a newer
    generation is announced or the job ends.

    Args:
        store: a client of the launcher's store (unprefixed: the generation's keys are read there).
        generation: the generation whose world is set up through this store.
        root: the store this one was cloned from (torch clones a store for its threads); None for
            the first.

    Example::

        >>> store = SetupStore(launcher_store(), 3)
        >>> dist.init_process_group("gloo", store=dist.PrefixStore("w/", store), rank=0, world_size=2)
    """

    def __init__(self, store: dist.Store, generation: int, root: Optional["SetupStore"] = None):
        super().__init__()
        self.store, self.generation = store, generation
        self.set_timeout(store.timeout)
        # A store torch holds only on its C++ side loses its Python methods when its Python object
        # goes: the clones live as long as the first one, which the world keeps.
        self._clones: List["SetupStore"] = []
        self._root = root or self

    def moved_on(self) -> Optional[str]:
        """Why this generation's set-up should give up, if it should.

        Returns:
            A sentence naming the newer generation or the job's end; None while this one is the
            newest.

        Example::

            >>> store.moved_on()
            'the launcher announced generation 4 while this rank set up generation 3'
        """
        if self.store.check([protocol.ENDED_KEY]):
            return f"the launcher ended the job while this rank set up generation {self.generation}"
        latest = int(self.store.get(protocol.GENERATION_KEY).decode())
        if latest > self.generation:
            return f"the launcher announced generation {latest} while this rank set up generation {self.generation}"
        return None

    # -- what torch.distributed calls ------------------------------------------------------------

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
                raise RuntimeError(f"torchmn.elastic: gave up waiting for {', '.join(keys)}: {why}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchmn.elastic: timed out after {limit:g} s waiting for {', '.join(keys)} "
                                   f"while setting up generation {self.generation}")
            time.sleep(POLL_S)

    def clone(self):
        clone = SetupStore(self.store.clone(), self.generation, self._root)
        self._root._clones.append(clone)
        return clone
