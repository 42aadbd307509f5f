"""What the ranks' figures say: which rank is slowest and by how much, which waits most, and
which are stragglers (busy more than :data:`STRAGGLER_RATIO` times the median of the other
ranks). The end of ``torchmn run --monitor`` and ``torchmn doctor`` say it alike.

Each rank is compared with the *other* ranks: with two ranks, a median over both would be their
mean, and a rank however slow could never reach twice it."""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Optional

# A rank busy this many times the median of the other ranks' time per step is a straggler.
STRAGGLER_RATIO = 1.25
# A step busy this many times the rank's median, and at least STALL_S seconds, is a stall: a rank
# that stopped once (a hang that resolved, a slow disk, a checkpoint written by one rank) while
# the others waited, which a median over the last steps does not show. The others' longest step
# must be this many times shorter too: ranks that all stopped alike (an evaluation, a checkpoint
# every rank writes) did not wait for each other.
STALL_RATIO = 10.0
STALL_S = 1.0


@dataclasses.dataclass
class Comparison:
    """The ranks' figures side by side.

    Attributes:
        slowest: the rank busy longest per step.
        ratio: its busy time over ``median_busy_ms``.
        busy_ms: every rank's median busy time per step.
        median_busy_ms: the median of the other ranks' busy times.
        stragglers: the ranks busy more than ``STRAGGLER_RATIO`` times the median of the other
            ranks, slowest first.
        waits_most: the rank with the largest share of its steps spent waiting.
        wait_share: every rank's share of its steps spent waiting.
        hosts: every rank's host.
    """

    slowest: int
    ratio: float
    busy_ms: Dict[int, float]
    median_busy_ms: float
    stragglers: List[int]
    waits_most: int
    wait_share: Dict[int, float]
    hosts: Dict[int, str]


def compare(snapshots: Dict[int, dict]) -> Optional[Comparison]:
    """Compare the ranks' figures (``Publisher.snapshot``, by rank).

    Args:
        snapshots: each rank's latest figures.

    Returns:
        The comparison, or None where fewer than two ranks have finished two optimizer steps.

    Example::

        >>> compare({0: {"busy_ms": 5.0, "wait_share": 0.9, "host": "a"},
        ...          1: {"busy_ms": 50.0, "wait_share": 0.1, "host": "a"}}).slowest
        1
    """
    busy = {r: s["busy_ms"] for r, s in snapshots.items() if s.get("busy_ms") is not None}
    if len(busy) < 2:
        return None
    others = {r: _median_of_others(busy, r) for r in busy}
    slowest = max(busy, key=lambda r: (busy[r], -r))
    median = others[slowest]
    waits = {r: snapshots[r]["wait_share"] for r in busy if snapshots[r].get("wait_share") is not None}
    stragglers = sorted((r for r in busy if others[r] > 0 and busy[r] > STRAGGLER_RATIO * others[r]),
                        key=lambda r: -busy[r])
    return Comparison(slowest=slowest, ratio=busy[slowest] / median if median > 0 else float("inf"),
                      busy_ms=busy, median_busy_ms=median, stragglers=stragglers,
                      waits_most=max(waits, key=lambda r: (waits[r], -r)) if waits else slowest,
                      wait_share=waits, hosts={r: snapshots[r].get("host", "?") for r in busy})


def describe(snapshots: Dict[int, dict]) -> List[str]:
    """The summary in words, one finding per line.

    Args:
        snapshots: each rank's latest figures.

    Returns:
        Lines naming the slowest rank and by how much, the stragglers and the ranks waiting for
        them, or why there is nothing to compare.

    Example::

        >>> describe({0: {"busy_ms": 5.0, "wait_share": 0.9, "host": "a"},
        ...           1: {"busy_ms": 50.0, "wait_share": 0.1, "host": "a"}})[0]
        "slowest: rank 1 (a), busy 50.0 ms per step, 10.00x the other ranks' median (5.0 ms)"
    """
    c = compare(snapshots)
    if c is None and len(snapshots) < 2:
        return [f"{len(snapshots)} rank(s) sent figures: nothing to compare"]
    if c is None:
        stepped = sum(1 for s in snapshots.values() if s.get("steps"))
        return [f"{stepped} of {len(snapshots)} rank(s) reported optimizer steps and fewer than 2 have two or "
                f"more: nothing to compare (a step's time is the time between two steps of torchmn's optimizers)"]
    lines = [f"slowest: rank {c.slowest} ({c.hosts[c.slowest]}), busy {c.busy_ms[c.slowest]:.1f} ms per step, "
             f"{c.ratio:.2f}x the other ranks' median ({c.median_busy_ms:.1f} ms)"]
    if c.stragglers:
        victims = [r for r in sorted(c.wait_share) if r not in c.stragglers]
        shares = ", ".join(f"rank {r} {100 * c.wait_share[r]:.0f}%" for r in victims)
        lines.append(f"straggler{'s' if len(c.stragglers) > 1 else ''}: rank(s) {', '.join(map(str, c.stragglers))} "
                     f"(busy over {STRAGGLER_RATIO}x the other ranks' median); the others wait for "
                     f"{'them' if len(c.stragglers) > 1 else 'it'} in averaging and collectives: {shares} of their steps")
    else:
        lines.append(f"no straggler: every rank is busy within {STRAGGLER_RATIO}x the other ranks' median")
    w = c.waits_most
    lines.append(f"waits most: rank {w} ({c.hosts[w]}), {100 * c.wait_share.get(w, 0.0):.0f}% of its steps")
    stalls = stalled(snapshots)
    if stalls:
        r = stalls[0]
        lines.append(f"stall: rank {r} ({c.hosts.get(r, '?')}) was busy {snapshots[r]['max_busy_ms'] / 1e3:.1f} s in "
                     f"one step (its median {snapshots[r]['busy_ms']:.1f} ms), while the others waited for it" +
                     (f"; also rank(s) {', '.join(map(str, stalls[1:]))}" if len(stalls) > 1 else ""))
    elif len(_long_steps(snapshots)) == len(snapshots):
        longest = max(s["max_busy_ms"] for s in snapshots.values()) / 1e3
        lines.append(f"pause: every rank was busy up to {longest:.1f} s in one step, alike, so none waited for another "
                     f"(work every rank does now and then: an evaluation, a checkpoint)")
    return lines


def stalled(snapshots: Dict[int, dict]) -> List[int]:
    """The ranks with a stall among their last steps: one step busy over :data:`STALL_RATIO`
    times their median and :data:`STALL_S` seconds, and over :data:`STALL_RATIO` times the
    other ranks' longest steps (their median), longest first.

    Args:
        snapshots: each rank's latest figures.

    Returns:
        The ranks, longest stall first.

    Example::

        >>> stalled({0: {"busy_ms": 10.0, "max_busy_ms": 12.0}, 1: {"busy_ms": 10.0, "max_busy_ms": 4000.0}})
        [1]
    """
    longest = {r: s["max_busy_ms"] for r, s in snapshots.items() if s.get("max_busy_ms") is not None}
    found = [r for r in _long_steps(snapshots)
             if len(longest) < 2 or longest[r] >= STALL_RATIO * _median_of_others(longest, r)]
    return sorted(found, key=lambda r: -snapshots[r]["max_busy_ms"])


def _long_steps(snapshots: Dict[int, dict]) -> List[int]:
    """The ranks with one step busy over STALL_RATIO times their median and STALL_S seconds."""
    return [r for r, s in snapshots.items()
            if s.get("max_busy_ms") is not None and s.get("busy_ms") is not None
            and s["max_busy_ms"] >= max(STALL_RATIO * s["busy_ms"], 1e3 * STALL_S)]


def _median_of_others(values: Dict[int, float], rank: int) -> float:
    """The median of ``values`` without ``rank``'s."""
    return statistics.median(v for r, v in values.items() if r != rank)
