"""An elastic job reading its data three ways, one after the other in every epoch: scatter_dataset
+ ResumableLoader with the samples copied from rank 0 (``scatter``), the same over a SharedDataset
every rank opens (``shared``), and a multi-node iterator whose loader every rank holds
(``iterator``). Every step, the ranks gather which samples they took, and the state commits those
lists with the loaders' positions.

Run under ``torchmn run -np N --min-np M ...`` with OUT_DIR and the number of epochs as arguments.
Every rank writes its pid to OUT_DIR/pids/<worker>; rank 0 appends "<time> <step> <world size>" to
OUT_DIR/progress, keeps "<epoch> <way> <step> <its worker number>" in OUT_DIR/phase, and writes the
committed samples of every epoch, per way, to OUT_DIR/seen.json at the end, with the committed count of
steps whose multi-node batch norm matched the whole batch's, per world ("first", "shrunk", "grown").
"""
import json
import os
import sys
import time

import torch

import torchmn
import torchmn.elastic
import torchmn.nn
from torchmn.checkpoint import ResumableLoader
from torchmn.datasets import SharedDataset

N = 96


class Numbers(SharedDataset):
    """Sample i is [i.0]: a dataset every rank can read by itself."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([float(i)], dtype=torch.float64)


out, epochs = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.join(out, "pids"), exist_ok=True)
with open(os.path.join(out, "pids", os.environ.get("TORCHMN_ELASTIC_WORKER", "0")), "w") as f:
    f.write(str(os.getpid()))
comm = torchmn.create_communicator()
# The batch norm's statistics are checked against the whole global batch's at every step: a rank that
# joins brings a layer that never agreed with the others, nor shares their last mean.
norm = torchmn.nn.MultiNodeBatchNorm1d(1, affine=False, comm=comm).double()


def check_batch_norm(module, inputs, output):
    parts = comm.allgather_obj(inputs[0])
    start = sum(len(p) for p in parts[:comm.rank])
    want = torch.nn.functional.batch_norm(torch.cat(parts), None, None, training=True)[start:start + len(inputs[0])]
    assert torch.allclose(output, want, rtol=0, atol=1e-9), (comm.size, (output - want).abs().max().item())
    state.batch_norm = {**state.batch_norm, state.world: state.batch_norm[state.world] + 1}  # committed with the step


norm.register_forward_hook(check_batch_norm)
model = torch.nn.Sequential(norm, torch.nn.Linear(1, 1).double())
optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4), comm)
numbers = torch.arange(N, dtype=torch.float64).unsqueeze(1)
copied = torchmn.scatter_dataset(numbers if comm.rank == 0 else None, comm, shuffle=True, seed=2)
shared = torchmn.scatter_dataset(Numbers() if comm.rank == 0 else None, comm, shuffle=True, seed=3)
MODES = ["scatter", "shared", "iterator"]
loaders = {"scatter": ResumableLoader(copied, batch_size=3, seed=5),
           "shared": ResumableLoader(shared, batch_size=3, seed=6),
           "iterator": torchmn.create_multi_node_iterator(ResumableLoader(numbers, batch_size=9, seed=7), comm)}
state = torchmn.elastic.State(model=model, optimizer=optimizer, **loaders, epoch=0, phase=0, step=0, world="first",
                              seen={mode: [[] for _ in range(epochs)] for mode in MODES},
                              batch_norm={"first": 0, "shrunk": 0, "grown": 0})


@torchmn.elastic.run
def train(state):
    for state.epoch in range(state.epoch, epochs):
        for state.phase in range(state.phase, len(MODES)):
            mode = MODES[state.phase]
            for x in loaders[mode]:
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
                taken = comm.allgather_obj(x.reshape(-1).long().tolist())
                if mode == "iterator":
                    assert all(t == taken[0] for t in taken), taken  # every rank got the master's batch
                    taken = taken[:1]
                state.seen[mode][state.epoch] = state.seen[mode][state.epoch] + [i for part in taken for i in part]
                state.step += 1
                if comm.rank == 0:
                    with open(os.path.join(out, "progress"), "a") as f:
                        f.write(f"{time.time():.3f} {state.step} {comm.size}\n")
                    with open(os.path.join(out, "phase.tmp"), "w") as f:  # renamed into place: read whole
                        f.write(f"{state.epoch} {mode} {state.step} {os.environ['TORCHMN_ELASTIC_WORKER']}")
                    os.replace(os.path.join(out, "phase.tmp"), os.path.join(out, "phase"))
                # Until a rank first joins, the survivors step slowly: a new rank's start-up on a loaded
                # machine would otherwise outlast the rest of the job.
                if comm.size < 3 and state.world == "first":
                    state.world = "shrunk"
                elif comm.size == 3 and state.world == "shrunk":
                    state.world = "grown"
                time.sleep(0.3 if state.world == "shrunk" else 0.05)
                state.commit()
        state.phase = 0


train(state)
if comm.rank == 0:
    with open(os.path.join(out, "seen.json"), "w") as f:
        json.dump({**state.seen, "batch_norm": state.batch_norm}, f)
