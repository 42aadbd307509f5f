"""An elastic job reading its data through scatter_dataset + ResumableLoader (``scatter``: the
samples copied from rank 0; ``shared``: a SharedDataset every rank opens) or a multi-node iterator
whose loader every rank holds (``iterator``). Every step, the ranks gather which samples they
took, and the state commits that list with the loader's position.

Run under ``torchmn run -np N --min-np M ...`` with OUT_DIR, the mode and the number of epochs as
arguments. Every rank writes its pid to OUT_DIR/pids/<worker>; rank 0 appends "<time> <step>
<world size>" to OUT_DIR/progress and writes the committed samples of every epoch to
OUT_DIR/seen.json at the end.
"""
import json
import os
import sys
import time

import torch

import torchmn
import torchmn.elastic
from torchmn.checkpoint import ResumableLoader
from torchmn.datasets import SharedDataset

N = 96


class Numbers(SharedDataset):
    """Sample i is [i.0]: a dataset every rank can read by itself."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([float(i)], dtype=torch.float64)


out, mode, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(os.path.join(out, "pids"), exist_ok=True)
with open(os.path.join(out, "pids", os.environ.get("TORCHMN_ELASTIC_WORKER", "0")), "w") as f:
    f.write(str(os.getpid()))
comm = torchmn.create_communicator()
model = torch.nn.Linear(1, 1).double()
optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4), comm)
if mode == "iterator":
    data = torchmn.create_multi_node_iterator(
        ResumableLoader(torch.arange(N, dtype=torch.float64).unsqueeze(1), batch_size=4, seed=5), comm)
else:
    dataset = Numbers() if mode == "shared" else torch.arange(N, dtype=torch.float64).unsqueeze(1)
    part = torchmn.scatter_dataset(dataset if comm.rank == 0 else None, comm, shuffle=True, seed=2)
    data = ResumableLoader(part, batch_size=3, seed=5)
state = torchmn.elastic.State(model=model, optimizer=optimizer, data=data, epoch=0, seen=[[] for _ in range(epochs)],
                              step=0)


@torchmn.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        for x in data:
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            taken = comm.allgather_obj(x.reshape(-1).long().tolist())
            if mode == "iterator":
                assert all(t == taken[0] for t in taken), taken  # every rank got the master's batch
                taken = taken[:1]
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
