"""The training job bench_elastic.py kills: the MNIST MLP (784-1000-1000-10, 1.8 M parameters) on
synthetic data, Adam, a global batch of 128 split over the ranks.

    --mode elastic:  torchmn.elastic.State and @torchmn.elastic.run, a commit every --every steps
                     (under torchmn run --min-np ...)
    --mode torchrun: the same training resuming from a checkpoint rank 0 writes every --every steps
                     (under torchrun --max-restarts, which restarts every rank when one dies)

Each rank writes its pid to OUT/pids/<rank or worker>; rank 0 appends "<unix time> <step> <world
size>" to OUT/progress after every step. The job ends at the next commit once OUT/stop exists.
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F

import torchmn
import torchmn.elastic

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--mode", choices=("elastic", "torchrun"), required=True)
parser.add_argument("--every", type=int, default=10, help="steps between commits (checkpoints)")
args = parser.parse_args()
BATCH = 128


def model_and_optimizer(comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 1000), torch.nn.ReLU(), torch.nn.Linear(1000, 1000),
                                torch.nn.ReLU(), torch.nn.Linear(1000, 10))
    return model, torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), comm)


def step(model, optimizer, comm, n):
    g = torch.Generator().manual_seed(n * 1000 + comm.rank)
    x = torch.randn(BATCH // comm.size, 784, generator=g)
    y = torch.randint(0, 10, (BATCH // comm.size,), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def progress(comm, n):
    if comm.rank == 0:
        with open(os.path.join(args.out, "progress"), "a") as f:
            f.write(f"{time.time():.4f} {n} {comm.size}\n")


def stop_agreed(comm):
    flag = torch.tensor([float(os.path.exists(os.path.join(args.out, "stop")))])
    return comm.allreduce(flag, "max").item() > 0


def main():
    os.makedirs(os.path.join(args.out, "pids"), exist_ok=True)
    me = os.environ.get("TORCHMN_ELASTIC_WORKER", os.environ.get("RANK", "0"))
    with open(os.path.join(args.out, "pids", me), "w") as f:
        f.write(str(os.getpid()))
    comm = torchmn.create_communicator()
    model, optimizer = model_and_optimizer(comm)
    if args.mode == "elastic":
        state = torchmn.elastic.State(model=model, optimizer=optimizer, step=0)

        @torchmn.elastic.run
        def train(state):
            while True:
                step(model, optimizer, comm, state.step)
                state.step += 1
                progress(comm, state.step)
                if state.step % args.every == 0:
                    state.commit()
                    if stop_agreed(comm):
                        return
        train(state)
        return
    path = os.path.join(args.out, "checkpoint.pt")
    n = 0
    if os.path.exists(path):
        saved = torch.load(path)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        n = saved["step"]
    while True:
        step(model, optimizer, comm, n)
        n += 1
        progress(comm, n)
        if n % args.every == 0:
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": n}
            if comm.rank == 0:
                torch.save(saved, path + ".tmp")
                os.replace(path + ".tmp", path)
            if stop_agreed(comm):
                return


if __name__ == "__main__":
    main()
