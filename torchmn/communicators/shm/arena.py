"""Memory the ranks of one node share for good, with a barrier: where the optimizers keep their
buffers on one node (see ``Communicator.open_node_arena``).

Whoever opens an arena names the points its ranks meet at (``points``): a barrier carries the
point's index, so ranks that reach one barrier from different points of their work raise, naming
both, instead of pairing silently."""
from __future__ import annotations

import mmap
from typing import Callable, Sequence, Tuple

import torch

from torchmn.communicators.shm.segment import (KINDS, Flags, align, chunk_bounds, close_mapping, map_segment,
                                                segment_name)
from torchmn.errors import TorchmnValueError


class NodeArena:
    """Memory the ``local_size`` ranks of one node share for good, plus a barrier through flags.

    ``job_tag`` must be new for every arena (see :func:`new_job_tag`). ``shared`` is one region
    every rank reads and writes (the sharded optimizer keeps the model's parameters there: one copy
    per node, and an update of a shard is seen by every rank without an all-gather);
    ``regions[r]`` is local rank r's own region, which the others may read (its gradients).
    Created collectively, like :class:`NodeSegment`.

    Example::

        >>> arena = NodeArena.open(tag, 0, r, 2, pids, comm.allgather_obj, shared_bytes=4096, region_bytes=4096,
        ...                        points=("written", "summed"))
        >>> arena.regions[r].view(torch.float32)[:4] = 1.0
        >>> arena.barrier("written")             # every rank's writes before it are visible after it
    """

    def __init__(self, buf: mmap.mmap, local_rank: int, local_size: int, shared_bytes: int, region_bytes: int,
                 pids: list[int], timeout: float, describe: Callable[[int], str], points: Sequence[str]):
        """Lay the arena out over a mapped segment: the flags, the shared region, then each rank's.

        :meth:`open` rounds the sizes up to multiples of 64, maps the segment and calls it.

        Args:
            buf: the mapping, at least :meth:`size_for` bytes.
            local_rank, local_size: this rank among the node's ranks.
            shared_bytes: the bytes of the region every rank reads and writes.
            region_bytes: the bytes of each rank's own region.
            pids, timeout, describe: as for :meth:`open`.
            points: the names of the points where the ranks meet (:meth:`barrier`).

        Raises:
            ValueError: ``points`` is empty or holds more than 16 names.

        Example::

            >>> arena = NodeArena(buf, r, 2, 4096, 4096, pids, 600.0, lambda i: f"local rank {i}",
            ...                   points=("written", "summed"))
        """
        if not 0 < len(points) <= KINDS:
            raise TorchmnValueError(f"an arena's barrier points must be 1 to {KINDS} names, not {len(points)}")
        self._points = tuple(points)
        self._buf = buf
        self.local_rank = local_rank
        self.local_size = local_size
        self._seq = 0
        self._flags = Flags(buf, 1, local_rank, local_size, pids, timeout, describe)
        start = Flags.nbytes(1, local_size)
        # Each region is its own tensor over its own range of the mapping (not a view of one big
        # tensor), so saving a tensor that views the shared region saves that region only.
        self.shared = torch.frombuffer(buf, dtype=torch.uint8, offset=start, count=shared_bytes) \
            if shared_bytes else torch.empty(0, dtype=torch.uint8)
        start += shared_bytes
        self.regions = [torch.frombuffer(buf, dtype=torch.uint8, offset=start + r * region_bytes, count=region_bytes)
                        if region_bytes else torch.empty(0, dtype=torch.uint8) for r in range(local_size)]

    @staticmethod
    def size_for(local_size: int, shared_bytes: int, region_bytes: int) -> int:
        """The bytes of /dev/shm an arena of these sizes takes.

        Args:
            local_size: the number of ranks of the node.
            shared_bytes: the bytes of the shared region.
            region_bytes: the bytes of each rank's own region.

        Returns:
            The flags' bytes plus both regions' sizes, each rounded up to a multiple of 64.

        Example::

            >>> NodeArena.size_for(2, shared_bytes=4096, region_bytes=4096)
            12352
        """
        return Flags.nbytes(1, local_size) + align(shared_bytes) + local_size * align(region_bytes)

    @classmethod
    def open(cls, job_tag: str, node: int, local_rank: int, local_size: int, pids: list[int],
             agree: Callable[[bool], list], shared_bytes: int, region_bytes: int, points: Sequence[str],
             timeout: float = 600.0, describe: Callable[[int], str] = lambda r: f"local rank {r}",
             owned_shared: Sequence[Tuple[int, int]] = ()) -> "NodeArena":
        """Create the arena on local rank 0 and map it on every local rank (collective).

        Each rank's own region, and the ranges of the shared region it names, are reserved by that
        rank, so that on a node of several NUMA domains their pages are on its domain
        (:func:`~torchmn.communicators.shm.segment.map_segment`).

        Args:
            job_tag, node, local_rank, local_size, pids, agree, describe: as for
                :meth:`torchmn.communicators.shm.NodeSegment.open`.
            shared_bytes, region_bytes: sizes of the shared region and of each rank's own.
            points: the names of the points where the ranks meet (:meth:`barrier`), at most 16.
            timeout: seconds a barrier waits for the other ranks.
            owned_shared: ``(offset, length)`` byte ranges of the shared region that this rank
                writes most (its slices of the parameters and of the optimizer's state).

        Returns:
            The arena, the same memory on every rank of the node.

        Raises:
            OSError: /dev/shm has no room (on the rank that failed; the others get RemoteRankError).

        Example::

            >>> tag, pids = comm.bcast_obj(new_job_tag()), comm.allgather_obj(os.getpid())
            >>> arena = NodeArena.open(tag, 0, comm.intra_rank, comm.intra_size, pids, comm.allgather_obj,
            ...                        shared_bytes=1 << 20, region_bytes=1 << 20, points=("written", "summed"))
        """
        nbytes = cls.size_for(local_size, shared_bytes, region_bytes)
        shared_bytes, region_bytes = align(shared_bytes), align(region_bytes)
        start = Flags.nbytes(1, local_size)  # the layout of __init__
        owned = [(start + offset, length) for offset, length in owned_shared]
        owned.append((start + shared_bytes + local_rank * region_bytes, region_bytes))
        buf = map_segment(segment_name(job_tag + "arena", node, pids[0]), nbytes, local_rank, agree,
                          "or give the machine (container: --shm-size) a larger /dev/shm", owned=owned)
        return cls(buf, local_rank, local_size, shared_bytes, region_bytes, pids, timeout, describe, points)

    def my_chunk(self, n: int, itemsize: int) -> tuple[int, int]:
        """This rank's share of ``n`` elements when the node's ranks split work on them.

        Args:
            n: the number of elements.
            itemsize: the bytes of one element.

        Returns:
            ``(lo, hi)``, cut on cache lines so that no two ranks write the same line.

        Example::

            >>> arena.my_chunk(1000, 4)        # float32, local rank 1 of 2
            (512, 1000)
        """
        return chunk_bounds(n, itemsize, self.local_rank, self.local_size)

    def barrier(self, what: str) -> None:
        """Wait for every local rank; writes to the arena before it are visible to all after it.

        Args:
            what: the point in the caller's work, one of the arena's ``points``.

        Raises:
            CollectiveMismatchError: ranks reached the same barrier number at different points.
            PeerLostError: a rank of the node exited, or did not come within the timeout.

        Example::

            >>> arena.regions[arena.local_rank].copy_(grads_as_bytes)
            >>> arena.barrier("written")       # now every rank may read every region
        """
        self._seq += 1
        self._flags.arrive_and_wait(0, self._seq, self._points.index(what), self._points)

    def close(self) -> None:
        """Unmap the arena (memory a tensor still views is released with the process).

        Its ``shared`` and ``regions`` tensors are dropped; the arena cannot be used afterwards.

        Example::

            >>> arena.close()
        """
        self.shared = None
        self.regions = []
        self._flags = None
        close_mapping(self._buf)
