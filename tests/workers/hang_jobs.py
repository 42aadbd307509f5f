"""Jobs in which rank 1 stops taking part in the collectives, to check that the others' error names it.

Usage: python hang_jobs.py COMMUNICATOR {collective,split,optimizer,kinds} [SLEEPER]
Rank SLEEPER (default 1) skips one call and sleeps; the others print "NAMED <error>" when the
timeout (5 s, which also bounds start-up skew) hits, or at once where the shared memory sees the
ranks in different calls. With HANG_DONE_DIR set (a folder every rank
sees), each other rank leaves a file there once it has printed, and the sleeper stops sleeping
when all have.
"""
import os
import sys
import time

import torch

import torchmn

name, where = sys.argv[1], sys.argv[2]
sleeper = int(sys.argv[3]) if len(sys.argv) > 3 else 1
comm = torchmn.create_communicator(name, timeout=5)  # seconds
comm.allreduce(torch.ones(3))  # everyone is here once
sub = comm.split(0, comm.rank) if where == "split" else None  # all ranks, in a group of its own
model = torch.nn.Linear(4, 2)
opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
started = time.monotonic()
try:
    if comm.rank == sleeper:
        # "still computing": longer than the timeout plus the others' grace period
        done_dir, until = os.environ.get("HANG_DONE_DIR"), time.monotonic() + 20
        while time.monotonic() < until and not (done_dir and len(os.listdir(done_dir)) == comm.size - 1):
            time.sleep(0.05)
    elif where == "collective":
        comm.allreduce(torch.ones(3))
    elif where == "split":
        sub.allreduce(torch.ones(3))
    elif where == "kinds":  # rank 0 in a barrier, the others in an allreduce
        comm.barrier() if comm.rank == 0 else comm.allreduce(torch.ones(3))
    else:
        model(torch.ones(2, 4)).sum().backward()  # the averaging runs here, from backward's hooks
        opt.step()
except (torchmn.CollectiveTimeoutError, torchmn.CollectiveMismatchError) as e:
    print(f"NAMED after {time.monotonic() - started:.1f} s: {e}", flush=True)
finally:
    if os.environ.get("HANG_DONE_DIR") and comm.rank != sleeper:
        open(os.path.join(os.environ["HANG_DONE_DIR"], str(comm.rank)), "w").close()
