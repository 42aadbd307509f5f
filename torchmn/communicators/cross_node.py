"""The allreduce among nodes, by message size: gloo's ring for large messages, recursive doubling
for small ones (:class:`CrossNodeAllreduce`).

gloo's allreduce is a ring whatever the size: ``2(p - 1)`` steps one after another, each a network
round trip, so a 4 KB allreduce over 64 nodes waits for 126 round trips. Recursive doubling takes
``log2 q`` steps, ``q`` the largest power of two up to ``p`` (two more where ``p`` is not one), each
sending the whole message:
fewer round trips, more bytes. Which wins at a size depends on the network's latency and bandwidth
and on the per-step cost of each implementation, so a communicator spanning nodes measures both
on its own nodes when it is set up, and sends messages up to the largest size at which doubling
won that way (``TORCHMN_CROSS_NODE_ALGORITHM=ring`` or ``doubling`` fixes the choice instead).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from torchmn.communicators import _gloo_utility, _wire
from torchmn.communicators._async_utility import Completed
from torchmn.communicators.ops import reduce_in_order
from torchmn.errors import TorchmnValueError

log = logging.getLogger("torchmn")

VARIABLE = "TORCHMN_CROSS_NODE_ALGORITHM"
CHOICES = ("auto", "ring", "doubling")
# The sizes measured at set-up, smallest first; the measuring stops at the first where the ring wins.
PROBE_BYTES = (1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22)
# Each algorithm's time at a size is its best of these runs: what it costs, not what the machine's
# scheduler added to one run.
PROBE_REPEATS = 7
PROBE_LONGEST_S = 0.02
_TAG = _wire.INTERNAL_TAGS["doubling"]
_ALWAYS = 1 << 62  # the threshold of doubling at every size
# What the group's first rank tells the others at set-up, where not a threshold (see _agreed).
_RING, _DOUBLING, _UNMEASURED = -2.0, -3.0, -1.0
# What set-up measured, per number of ranks that talk across nodes: communicators made later (a
# split, an elastic job's next world) take it from their first rank instead of measuring again.
_measured: dict = {}


def doubling_allreduce(flat: torch.Tensor, op: str, group, ranks: Sequence[int], me: int) -> torch.Tensor:
    """Allreduce ``flat`` in place over ``group`` by recursive doubling (collective over the group).

    With ``p`` ranks and ``q`` the largest power of two ``<= p``, the first ``2(p - q)`` ranks pair
    up and the odd one of each pair takes over its partner's data; the ``q`` left exchange whole
    messages with the rank ``1, 2, 4, ...`` places away and reduce; the odd ones hand the result back.
    Reductions are commutative, so both sides of an exchange compute the same bits, and every rank
    ends with the same result.

    Args:
        flat: a contiguous CPU tensor, this rank's values in, the reduction out.
        op: a name of :data:`~torchmn.communicators.ops.OPS` (``"mean"`` sums; the caller divides).
        group: the gloo process group.
        ranks: the group's members as world ranks, in group order.
        me: this rank's index in ``ranks``.

    Returns:
        ``flat``.

    Example::

        >>> doubling_allreduce(torch.ones(4), "sum", group, [0, 1, 2], me=dist.get_rank())
        tensor([3., 3., 3., 3.])
    """
    p = len(ranks)
    if p == 1:
        return flat
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    theirs = torch.empty_like(flat)

    def combine(lower_first: bool) -> None:
        parts = [theirs, flat] if lower_first else [flat, theirs]
        reduce_in_order(parts, op, flat)

    if me < 2 * extra and me % 2 == 0:  # hands its data to its odd partner, and waits for the result
        dist.send(flat, ranks[me + 1], group=group, tag=_TAG)
        dist.recv(flat, ranks[me + 1], group=group, tag=_TAG)
        return flat
    if me < 2 * extra:
        dist.recv(theirs, ranks[me - 1], group=group, tag=_TAG)
        combine(lower_first=True)
        virtual = me // 2
    else:
        virtual = me - extra
    mask = 1
    while mask < q:
        other = virtual ^ mask
        partner = ranks[2 * other + 1] if other < extra else ranks[other + extra]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, flat, partner, group=group, tag=_TAG),
                                        dist.P2POp(dist.irecv, theirs, partner, group=group, tag=_TAG)])
        for work in works:
            work.wait()
        combine(lower_first=other < virtual)
        mask <<= 1
    if me < 2 * extra:
        dist.send(flat, ranks[me - 1], group=group, tag=_TAG)
    return flat


def requested(env) -> str:
    """The algorithm ``TORCHMN_CROSS_NODE_ALGORITHM`` asks for.

    Args:
        env: the environment (``os.environ``).

    Returns:
        ``"auto"`` (also where it is not set), ``"ring"`` or ``"doubling"``.

    Raises:
        ValueError: it holds something else.

    Example::

        >>> requested({"TORCHMN_CROSS_NODE_ALGORITHM": "ring"})
        'ring'
    """
    choice = env.get(VARIABLE, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise TorchmnValueError(f"{VARIABLE}={env[VARIABLE]!r}: choose one of {', '.join(CHOICES)} "
                                f"(auto measures which is faster at set-up)")
    return choice


def threshold_from(sizes: Sequence[int], ring_s: Sequence[float], doubling_s: Sequence[float]) -> int:
    """The largest message size up to which doubling was faster than the ring at every size
    measured (0 where the ring won at the smallest).

    Args:
        sizes: the sizes measured, in bytes, ascending.
        ring_s: the ring's time at each size (seconds).
        doubling_s: doubling's time at each size.

    Returns:
        The threshold in bytes: messages up to it take doubling.

    Example::

        >>> threshold_from([1024, 8192, 65536], [3e-4, 4e-4, 9e-4], [1e-4, 2e-4, 1.2e-3])
        8192
    """
    threshold = 0
    for size, ring, doubling in zip(sizes, ring_s, doubling_s):
        if doubling >= ring:
            break
        threshold = size
    return threshold


class CrossNodeAllreduce:
    """The allreduce of the ranks that talk across nodes (one per node, or every rank where each
    node has one), choosing its algorithm by message size.

    Args:
        group: the gloo process group of those ranks.
        ranks: its members as world ranks, in group order.
        me: this rank's index in ``ranks``.
        threshold: messages of up to this many bytes take recursive doubling, larger ones gloo's ring.
        measured: what set-up measured, for :meth:`describe`: ``{size: (ring s, doubling s)}``.

    Attributes:
        threshold: as above.

    Example::

        >>> cross = CrossNodeAllreduce.set_up(group, [0, 4], me=0)
        >>> cross.describe()[:75]
        'across 2 ranks of different nodes: recursive doubling up to 8 KB, gloo's ring'
    """

    def __init__(self, group, ranks: Sequence[int], me: int, threshold: int, measured: Optional[dict] = None):
        self.group, self.ranks, self.me = group, list(ranks), me
        self.threshold = threshold
        self.measured = measured or {}

    @classmethod
    def set_up(cls, group, ranks: Sequence[int], me: int) -> "CrossNodeAllreduce":
        """Choose the threshold: from ``TORCHMN_CROSS_NODE_ALGORITHM`` where it is ``ring`` or
        ``doubling``; else measured on ``group`` (each size's time is the slowest rank's best of a
        few runs, so every rank decides alike), or, where the group's first rank measured a group
        of this size before, its measurement. Collective over the group: the group's first rank's
        variable and earlier measurement decide for every rank.

        Args:
            group: the gloo process group of the ranks that talk across nodes.
            ranks: its members as world ranks, in group order.
            me: this rank's index in ``ranks``.

        Returns:
            The allreduce.

        Raises:
            ValueError: the variable holds something else.

        Example::

            >>> CrossNodeAllreduce.set_up(group, [0, 4], me=0).threshold
            8192
        """
        threshold, measured = _agreed(group, ranks, me, requested(os.environ))
        cross = cls(group, ranks, me, threshold, measured)
        if me == 0 and measured:
            log.info("torchmn: %s", cross.describe())
        return cross

    def algorithm_for(self, nbytes: int) -> str:
        """The algorithm a message of ``nbytes`` takes.

        Args:
            nbytes: the message's size.

        Returns:
            ``"doubling"`` or ``"ring"``.

        Example::

            >>> cross.algorithm_for(4096), cross.algorithm_for(1 << 20)
            ('doubling', 'ring')
        """
        return "doubling" if nbytes <= self.threshold else "ring"

    def allreduce(self, flat: torch.Tensor, op: str, async_op: bool = False):
        """Allreduce ``flat`` in place over the group (collective over it).

        Args:
            flat: a contiguous CPU tensor.
            op: a name of :data:`~torchmn.communicators.ops.OPS`.
            async_op: return at once with a handle (the ring); doubling's small messages are done
                by the time it returns either way.

        Returns:
            A handle whose ``wait()`` returns once ``flat`` holds the result.

        Example::

            >>> cross.allreduce(torch.ones(4), "sum").wait()
            True
        """
        if self.algorithm_for(flat.numel() * flat.element_size()) == "doubling":
            doubling_allreduce(flat, op, self.group, self.ranks, self.me)
            return Completed()
        work = _gloo_utility.all_reduce(flat, op, self.group, async_op=async_op)
        return work if async_op else Completed()

    def describe(self) -> str:
        """The choice in words, with what set-up measured.

        Returns:
            One line.

        Example::

            >>> cross.describe()
            "across 2 ranks of different nodes: gloo's ring at every size (TORCHMN_CROSS_NODE_ALGORITHM=ring)"
        """
        n = f"across {len(self.ranks)} ranks of different nodes"
        if self.threshold >= _ALWAYS:
            return f"{n}: recursive doubling at every size ({VARIABLE}=doubling)"
        if not self.measured:
            return f"{n}: gloo's ring at every size ({VARIABLE}=ring)"
        timings = ", ".join(f"{_size(s)} ring {r * 1e6:.0f} us / doubling {d * 1e6:.0f} us"
                            for s, (r, d) in self.measured.items())
        rule = (f"recursive doubling up to {_size(self.threshold)}, gloo's ring above" if self.threshold
                else "gloo's ring at every size")
        return f"{n}: {rule} (measured at set-up: {timings})"


def _agreed(group, ranks: Sequence[int], me: int, choice: str) -> tuple[int, dict]:
    """The threshold every rank of the group takes, and what was measured for it: the group's first
    rank says, in one small broadcast, whether its variable fixes the algorithm or it measured a
    group of this size before (a rank that joined later has no measurement of its own, and must
    not measure alone); where neither, every rank measures together."""
    row = torch.full((1 + 3 * len(PROBE_BYTES),), _UNMEASURED, dtype=torch.float64)
    earlier = _measured.get(len(ranks))
    if me == 0:
        if choice != "auto":
            row[0] = _RING if choice == "ring" else _DOUBLING
        elif earlier is not None:
            row[0] = earlier[0]
            for i, (size, (ring, doubling)) in enumerate(earlier[1].items()):
                row[1 + 3 * i:4 + 3 * i] = torch.tensor([size, ring, doubling], dtype=torch.float64)
    dist.broadcast(row, ranks[0], group=group)
    values = row.tolist()
    if values[0] in (_RING, _DOUBLING):
        return (0 if values[0] == _RING else _ALWAYS), {}
    if values[0] >= 0:
        measured = {int(values[i]): (values[i + 1], values[i + 2]) for i in range(1, len(values), 3) if values[i] >= 0}
        _measured[len(ranks)] = (int(values[0]), measured)
    else:
        _measured[len(ranks)] = _measure(group, ranks, me)
    return _measured[len(ranks)]


def _measure(group, ranks: Sequence[int], me: int) -> tuple[int, dict]:
    """Time both algorithms at growing sizes until the ring wins: the threshold, and the timings."""
    measured = {}
    for size in PROBE_BYTES:
        x = torch.ones(size // 4, dtype=torch.float32)
        times = []
        for run in (lambda: dist.all_reduce(x, group=group), lambda: doubling_allreduce(x, "sum", group, ranks, me)):
            run()  # warm-up: connections, buffers
            runs = []
            for _ in range(PROBE_REPEATS):
                start = time.perf_counter()
                run()
                runs.append(time.perf_counter() - start)
            times.append(min(runs))
        # The slowest rank's figures, the same on every rank, so that every rank decides alike.
        agreed = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        ring, doubling = agreed.tolist()
        measured[size] = (ring, doubling)
        # Past a size where either takes this long, the link's bandwidth, not doubling's fewer
        # round trips, sets the time: measuring larger sizes would only slow the set-up.
        if doubling >= ring or min(ring, doubling) > PROBE_LONGEST_S:
            break
    sizes = list(measured)
    return threshold_from(sizes, [measured[s][0] for s in sizes], [measured[s][1] for s in sizes]), measured


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"
