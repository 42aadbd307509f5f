"""Ports for the rendezvous of test jobs, which nothing else takes between the choice and the bind.

A port the kernel hands out for ``bind(("", 0))`` lies in Linux's ephemeral range (32768-60999),
from which it also picks the local port of every outgoing connection: between the test's choice
and the job's bind seconds later, another job's gloo connection may take it ("address in use").
Ports here come from 10000-16999 instead, below Slurm's test cluster (17000-17002), torchmn's
derived ports (20000-31999) and the ephemeral range, one slice per pytest-xdist worker, so that
workers never choose the same port; each is checked free before it is handed out.
"""
import itertools
import os
import socket

FIRST, LAST = 10000, 16999
SLICES = 9  # eight pytest-xdist workers at most, and a run without workers (-n0)
SLICE_SIZE = (LAST + 1 - FIRST) // SLICES

# The pytest worker and its rank_forks.py process share a slice: each starts at its own place in it.
_turn = itertools.count(os.getpid() % SLICE_SIZE)


def _slice_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    index = int(worker[2:]) % (SLICES - 1) if worker.startswith("gw") and worker[2:].isdigit() else SLICES - 1
    return FIRST + index * SLICE_SIZE


def free_port() -> int:
    """A TCP port nobody listens on or connects from now, in this pytest worker's slice.

    Returns:
        The port.

    Raises:
        RuntimeError: every port of the slice is in use.

    Example::

        >>> port = free_port()
        >>> 10000 <= port <= 16999
        True
    """
    start = _slice_start()
    for _ in range(SLICE_SIZE):
        port = start + next(_turn) % SLICE_SIZE
        with socket.socket() as s:
            try:
                s.bind(("", port))  # all addresses, without SO_REUSEADDR: a port in TIME_WAIT fails too
            except OSError:
                continue
        return port
    raise RuntimeError(f"every port in {start}-{start + SLICE_SIZE - 1} is in use")
