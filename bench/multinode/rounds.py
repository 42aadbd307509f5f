"""Timing on every rank of a job: rounds that interleave several ways of doing one thing, so that
the machine's noise hits them alike (what the multi-node benchmarks' ranks run)."""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, Optional, Tuple


def time_rounds(comm, ways: Dict[str, Callable], cases: Iterable[Tuple[object, object, int]],
                rounds: int) -> Optional[dict]:
    """Time each way on each case, in rounds (collective: every rank calls it alike).

    Args:
        comm: the job's communicator (barriers before each timing; the figures gather on rank 0).
        ways: name -> function of the case's input.
        cases: ``(label, input, calls)``: each way is warmed up once on ``input``, then called
            ``calls`` times in a row per round, after a barrier.
        rounds: how many rounds.

    Returns:
        On rank 0, ``{"<label>|<way>": [seconds per call, per round]}``, each the slowest rank's;
        None on the other ranks.

    Example::

        >>> time_rounds(comm, {"gloo": dist.all_reduce}, [(1.0, torch.ones(256), 100)], rounds=5)
        {'1.0|gloo': [0.00031, 0.00029, ...]}
    """
    figures: dict = {}
    for label, x, calls in cases:
        for fn in ways.values():
            fn(x)  # warm-up: connections, buffers
        for _ in range(rounds):
            for way, fn in ways.items():
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(x)
                figures.setdefault(f"{label}|{way}", []).append((time.perf_counter() - t0) / calls)
    every = comm.gather_obj(figures)
    if comm.rank != 0:
        return None
    return {k: [max(f[k][i] for f in every) for i in range(rounds)] for k in figures}
