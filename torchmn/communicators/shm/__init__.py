"""Shared memory among the ranks of one node, in POSIX shared memory (``/dev/shm``), not TCP loopback.

- ``segment.py``: mapping a segment on every rank of a node, the flags ranks wait on, names, and
  the clean-up of segments a killed job left behind;
- ``collectives.py``: :class:`NodeSegment`, the collectives of a node's ranks (allreduce,
  reduce-scatter, all-gather, broadcast, small byte exchanges) through slots in one segment;
- ``arena.py``: :class:`NodeArena`, memory the ranks share for good, with a barrier (the
  optimizers keep their buffers there);
- ``mean.py``: :class:`NodeMean`, the mean of many tensors through an arena;
- ``mailbox.py``: :class:`Mailboxes`, point-to-point messages between the node's ranks;
- ``pages.py``: new tensors backed by huge pages, cheap to fill.

Example::

    >>> from torchmn.communicators import shm
    >>> shm.fits_in(shm.free_bytes()) > 0          # room for shared memory on this machine
    True
"""
from torchmn.communicators.shm.arena import NodeArena
from torchmn.communicators.shm.mailbox import Mailboxes
from torchmn.communicators.shm.collectives import (NodeSegment, fits_in, fitting_slot_bytes, free_bytes, new_job_tag,
                                                   requested_slot_bytes, sum_into)
from torchmn.communicators.shm.mean import NodeMean
from torchmn.communicators.shm.pages import empty_like_fast
from torchmn.communicators.shm.segment import SHM_DIR, leftover_segments, remove_stale_segments

__all__ = ["Mailboxes", "NodeArena", "NodeMean", "NodeSegment", "SHM_DIR", "empty_like_fast", "fits_in", "fitting_slot_bytes",
           "free_bytes", "leftover_segments", "new_job_tag", "remove_stale_segments", "requested_slot_bytes",
           "sum_into"]
