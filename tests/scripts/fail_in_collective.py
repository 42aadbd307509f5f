"""A torchmn job in which rank 1 fails while the other ranks wait for it in a collective.

Usage: fail_in_collective.py MODE OUT_DIR
  raise      rank 1 raises ValueError("boom from rank 1") while the others wait in an allreduce;
             it writes the time of the raise (time.time()) to OUT_DIR/raised_at first.
  optimizer  the same, the others waiting in the multi-node optimizer's gradient averaging.
  catch      like raise, but the others catch torchmn.CollectiveTimeoutError and print
             "CAUGHT <class> failed_rank=<r> after=<seconds since the raise>", then exit 0.
             Rank 3 comes to its next collective 1.5 s late, when rank 0 (which hosts the store
             where the ranks are started by hand) has caught the error and is ending.
  split      like catch, with a split communicator finalized before, and rank 1 still running a
             thread that is not a daemon (its process goes on for 30 s after the raise): the
             others learn of the failure from rank 1's closed connections, not from its exit.
  kill       rank 1 writes its pid to OUT_DIR/pid, and every rank loops on allreduces until the
             test kills rank 1.
"""
import os
import sys
import threading
import time

import torch

import torchmn

mode, out = sys.argv[1], sys.argv[2]
comm = torchmn.create_communicator()
if mode == "optimizer":  # only here: building a torch optimizer imports torch._dynamo (seconds of CPU)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm)
x = torch.ones(1000)


def write(name, text):
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def work():
    """One step of what the ranks wait in when rank 1 fails."""
    if mode == "optimizer":
        optimizer.zero_grad()
        model(torch.ones(8, 16)).sum().backward()  # the averaging runs from backward's hooks
        optimizer.step()
    else:
        comm.allreduce(x)


for _ in range(3):
    work()
if mode == "split":  # its groups wait, idle, for a later split
    comm.split(color=comm.rank % 2, key=comm.rank).finalize()
    if comm.rank == 1:
        threading.Thread(target=time.sleep, args=(30,), daemon=False).start()
comm.barrier()  # every rank has started and is in the loop below
if comm.rank == 1 and mode != "kill":
    time.sleep(0.5)  # the others are waiting for this rank in work() by now
    write("raised_at", repr(time.time()))
    raise ValueError("boom from rank 1")
if comm.rank == 1:
    write("pid", str(os.getpid()))
if comm.rank == 3 and mode in ("catch", "split"):
    time.sleep(1.5)
try:
    while True:
        work()
except torchmn.CollectiveTimeoutError as e:
    if mode not in ("catch", "split"):
        raise
    raised = float(open(os.path.join(out, "raised_at")).read())
    failed = getattr(e, "failure", None)
    print(f"CAUGHT {type(e).__name__} failed_rank={failed.rank if failed else None} "
          f"after={time.time() - raised:.2f} message={e}", flush=True)
