"""An elastic job reading its data through torchmn.elastic.ElasticSampler: every step, the ranks
gather which samples each of them took, and the state commits that list with the sampler's position.

Run under ``torchmn run -np N --min-np M ...`` with OUT_DIR as its first argument. Every rank writes
its pid to OUT_DIR/pids/<worker>; rank 0 appends "<time> <step> <world size>" to OUT_DIR/progress
and writes the committed samples of every epoch to OUT_DIR/seen.json at the end.
"""
import json
import os
import sys
import time

import torch

import torchmn
import torchmn.elastic

out, epochs = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.join(out, "pids"), exist_ok=True)
with open(os.path.join(out, "pids", os.environ.get("TORCHMN_ELASTIC_WORKER", "0")), "w") as f:
    f.write(str(os.getpid()))
dataset = torch.arange(97, dtype=torch.float64).unsqueeze(1)
comm = torchmn.create_communicator()
model = torch.nn.Linear(1, 1).double()
optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4), comm)
sampler = torchmn.elastic.ElasticSampler(dataset, comm, batch_size=3, shuffle=True, seed=5)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
state = torchmn.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, seen=[[] for _ in range(epochs)],
                              step=0)


@torchmn.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        sampler.set_epoch(state.epoch)
        for x in loader:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            taken = comm.allgather_obj(x.reshape(-1).long().tolist())
            state.seen[state.epoch] = state.seen[state.epoch] + [i for part in taken for i in part]
            state.step += 1
            if comm.rank == 0:
                with open(os.path.join(out, "progress"), "a") as f:
                    f.write(f"{time.time():.3f} {state.step} {comm.size}\n")
            time.sleep(0.1)
            state.commit()


train(state)
if comm.rank == 0:
    with open(os.path.join(out, "seen.json"), "w") as f:
        json.dump(state.seen, f)
