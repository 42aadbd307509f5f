"""Rank 0 leaves its world (``failure.leave_world``, what a rank of an elastic job does before it
moves to a new world) and goes on living, while rank 1 waits for it in a gloo allreduce. On rank 0
the only reference left to what keeps the world's connections open (HOLDER: ``group``, the world's
process group; ``handle``, the handle of a finished collective) is in an old reference cycle (one a
full collection has seen survive), so the connections close only if leaving collects it. HOLDER
``split``: no cycle, but a split communicator finalized before, whose groups wait for a later split. Rank 1
writes how long its allreduce took to fail to OUT/rank1; rank 0 waits for it (at most 60 s).

Usage: python leave_with_a_group_in_a_cycle.py OUT HOLDER
"""
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torchmn
from torchmn.communicators import failure

out, holder_kind = Path(sys.argv[1]), sys.argv[2]
comm = torchmn.create_communicator()
if holder_kind == "split":
    comm.split(color=0, key=comm.rank).finalize()
handle = dist.all_reduce(torch.ones(1), async_op=True)  # through gloo, on both ranks
handle.wait()
if comm.rank == 0:
    holder = {"group": {"group": dist.group.WORLD}, "handle": {"handle": handle}, "split": {}}[holder_kind]
    holder["self"] = holder  # a reference cycle
    del handle
    gc.collect()  # the cycle survives a full collection: now in the oldest generation
    del holder  # garbage, freed only by a collection of the oldest generation
    time.sleep(1)  # rank 1 is in its allreduce
    failure.leave_world()
    deadline = time.monotonic() + 60
    while not (out / "rank1").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
else:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))  # rank 0 never makes it
        outcome = "returned"
    except RuntimeError as e:
        outcome = f"raised {str(e).splitlines()[0][:160]}"
    (out / "rank1").write_text(f"{time.monotonic() - start:.2f} {outcome}")
