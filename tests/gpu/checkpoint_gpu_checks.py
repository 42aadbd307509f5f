"""torchmn.checkpoint on the GPU (CI has none: run this by hand there). Rank 0 prints "PASS <check>".

A model with CUDA dropout trains 12 steps and checkpoints at step 6; a second model, with the CUDA
generator reseeded, resumes from step 6 and must end with the same parameters bit for bit: the
CUDA RNG state, the optimizer state (replicated, and a sharded optimizer's parts) and the data
position all come back onto the GPU.

    torchmn run -np 2 bash -c 'NCCL_HOSTID=h$RANK exec python tests/gpu/checkpoint_gpu_checks.py DIR'
    python tests/gpu/checkpoint_gpu_checks.py DIR        # a world of one, over NCCL
"""
import faulthandler
import os
import shutil
import sys

import torch

import torchmn
from torchmn.checkpoint import Checkpointer, ResumableLoader


def run(comm, directory, shard_state, steps, save_at, resume):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(64, 3)).to(comm.device)
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm,
                                                    shard_state=shard_state)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(96, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
    loader = ResumableLoader(data, batch_size=16, seed=comm.rank)
    ckpt = Checkpointer(directory, comm, model=model, optimizer=optimizer, loader=loader)
    torch.cuda.manual_seed(1000 + comm.rank)
    step = 0
    if resume:
        torch.cuda.manual_seed(4242)  # the checkpoint must put the CUDA generator back
        step = ckpt.load_latest()
        assert step == save_at, step
        assert next(model.parameters()).device.type == "cuda"
    while step < steps:
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb.to(comm.device)), yb.to(comm.device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == save_at and not resume:
                ckpt.save(step)
            if step == steps:
                break
    return [p.detach().clone() for p in model.parameters()]


def check_resume(comm, root, shard_state):
    directory = os.path.join(root, f"shard_{shard_state}")
    if comm.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    comm.allgather_obj(None)
    whole = run(comm, directory, shard_state, 12, 6, resume=False)
    resumed = run(comm, directory, shard_state, 12, 6, resume=True)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed)), "the resumed run differs"


if __name__ == "__main__":
    # A hang prints every thread's stack into run_all.sh's log before its limit ends the check.
    faulthandler.dump_traceback_later(90)
    alone = "RANK" not in os.environ
    comm = torchmn.create_communicator(backend="nccl", init_method="tcp://127.0.0.1:29431" if alone else None)
    assert comm.device.type == "cuda", comm.device
    for shard in (False, True):
        check_resume(comm, sys.argv[1], shard)
        if comm.rank == 0:
            print(f"PASS checkpoint_resume_on_gpu shard_state={shard}", flush=True)
    comm.finalize()
