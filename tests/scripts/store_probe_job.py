"""A job that stays up while a test probes its rendezvous store, and shows after each probe that it
still works.

``python store_probe_job.py DIR [plain]``: rank 0 writes DIR/job.json (the store's address, its
port, the job's token, the launcher's pid); then, each time DIR/round<N> appears, every rank runs
an allreduce and opens a new client of the launcher's store (set, then wait for every rank's key)
and prints ``ROUND <N> OK``; DIR/stop ends the job. With ``plain`` the ranks set up
torch.distributed themselves (``init_process_group("gloo")``, env://), without torchmn.
"""
import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

folder = sys.argv[1]
plain = sys.argv[2:] == ["plain"]
if plain:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    def allreduce(x):
        dist.all_reduce(x)
        return x
else:
    import torchmn

    comm = torchmn.create_communicator()
    rank, size, allreduce = comm.rank, comm.size, comm.allreduce
token = os.environ["TORCHMN_JOB_TOKEN"]
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
print(f"TOKEN SHA256 {hashlib.sha256(token.encode()).hexdigest()}", flush=True)
if rank == 0:
    info = {"addr": addr, "port": port, "token": token, "launcher_pid": os.getppid()}
    with open(os.path.join(folder, "job.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(folder, "job.json.tmp"), os.path.join(folder, "job.json"))
done = 0
deadline = time.monotonic() + 300
while not os.path.exists(os.path.join(folder, "stop")):
    if time.monotonic() > deadline:
        raise SystemExit("the test never wrote DIR/stop")
    if not os.path.exists(os.path.join(folder, f"round{done + 1}")):
        time.sleep(0.05)
        continue
    done += 1
    total = allreduce(torch.ones(1)).item()
    store = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=30))
    store.set(f"probe/round{done}/{rank}", "here")
    store.wait([f"probe/round{done}/{r}" for r in range(size)])
    assert total == size, total
    print(f"ROUND {done} OK", flush=True)
if plain:
    dist.destroy_process_group()
