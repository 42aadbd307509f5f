"""A small data-parallel job whose rank 1 sleeps 50 ms per step, after backward: the straggler.

Usage: python straggler.py STEPS [START_DELAY_S] [--thread]
START_DELAY_S: seconds each rank sleeps before it creates its communicator (a start-up that stalls
on the clock, as one waiting on a cold disk does, without using CPU).
--thread: train in a thread of its own, not the main thread (as Ray Train runs a training function).
--stall: rank 1 also stops for 5 s once, halfway (a stall the others wait through).
Each rank prints "OWN <rank> <ms>": the median time per step it spent outside torchmn's calls (its
forward, backward and sleep), timed here, against which the monitor's busy time is checked.
"""
import sys
import time

import torch

import torchmn

import threading

args = [a for a in sys.argv[1:] if not a.startswith("--")]
steps = int(args[0])
time.sleep(float(args[1]) if len(args) > 1 else 0.0)


def train():
    comm = torchmn.create_communicator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 50), torch.nn.ReLU(), torch.nn.Linear(50, 2))
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), comm)
    x, t = torch.randn(32, 20), torch.randint(0, 2, (32,))
    own = []
    for step in range(steps):
        optimizer.zero_grad()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), t)
        with optimizer.no_sync():  # backward alone, timed apart from the averaging
            loss.backward()
        if comm.rank == 1:
            time.sleep(5.0 if "--stall" in sys.argv and step == steps // 2 else 0.05)
        own.append(time.perf_counter() - t0)
        optimizer.synchronize()
        optimizer.step()
    print(f"OWN {comm.rank} {1e3 * sorted(own)[len(own) // 2]:.2f}", flush=True)
    comm.finalize()


if "--thread" in sys.argv:
    trainer = threading.Thread(target=train)
    trainer.start()
    trainer.join()
else:
    train()
