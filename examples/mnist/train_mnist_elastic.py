"""Train the MNIST MLP as an elastic job: ranks may die and new ones join while it trains, and
nobody restarts.

    torchmn run -np 4 --min-np 2 --max-np 4 python examples/mnist/train_mnist_elastic.py

This is train_mnist.py made elastic; each change is marked "# elastic:". When a rank dies, the
others go back to their last commit (every --commit-every steps, and at each epoch's end), form a
new world and go on with the rest of the epoch split over themselves; the launcher starts a rank in
the freed slot, which joins at the next commit and receives the model, the optimizer's state and
the data from the others. The global batch is --batch-size per rank, so it shrinks and grows with
the world.

Every epoch appends {"epoch", "main/loss", "validation/main/loss", "validation/main/accuracy",
"elapsed_time", "ranks"} to the JSON list in --log (ranks: the world's size at the epoch's end).
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchmn
import torchmn.checkpoint
import torchmn.datasets
import torchmn.elastic  # elastic: State and run
import torchmn.evaluators
from data import add_data_arguments, check_data_arguments, load_mnist, positive_int
from device_choice import add_device_argument, training_device


def make_model(n_units=1000, n_out=10):
    return nn.Sequential(nn.Linear(784, n_units), nn.ReLU(),
                         nn.Linear(n_units, n_units), nn.ReLU(),
                         nn.Linear(n_units, n_out))


def main():
    parser = argparse.ArgumentParser(description="MNIST MLP, data parallel, elastic")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--batch-size", type=positive_int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default="result/log_elastic.json", help="JSON log, one entry per epoch")
    parser.add_argument("--commit-every", type=int, default=10, metavar="STEPS",
                        help="commit the state in memory every STEPS steps (a lost rank costs the steps since)")
    add_data_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    check_data_arguments(parser, args)
    torch.manual_seed(args.seed)
    comm = torchmn.create_communicator()
    device = training_device(comm, args.device)  # torchmn: this rank's own GPU (comm.device), or the CPU

    train, val = load_mnist(args.n_train, args.data_dir) if comm.rank == 0 else (None, None)
    # elastic: every rank keeps the whole dataset here, and its part follows the world
    train = torchmn.datasets.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    val = torchmn.datasets.scatter_dataset(val, comm, shuffle=True, seed=args.seed, force_equal_length=False)
    # elastic: a loader whose position the state keeps, so a reset goes on with the rest of the epoch
    train_loader = torchmn.checkpoint.ResumableLoader(train, batch_size=args.batch_size, seed=args.seed)
    val_loader = torch.utils.data.DataLoader(val, batch_size=args.batch_size)

    model = make_model().to(device)
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)

    @torch.no_grad()
    def evaluate_local():
        model.eval()
        loss_sum, correct, n = 0.0, 0, 0
        for x, y in val_loader:
            x, y = x.to(device), y.to(device)
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(dim=1) == y).sum().item()
            n += len(y)
        model.train()
        return {"loss": loss_sum / max(n, 1), "accuracy": correct / max(n, 1)}, n

    evaluate = torchmn.evaluators.create_multi_node_evaluator(evaluate_local, comm)

    # elastic: what a rank needs to go on, committed in memory and handed to new ranks
    state = torchmn.elastic.State(model=model, optimizer=optimizer, loader=train_loader, loss_sum=0.0, steps=0,
                                  log=[], elapsed=0.0)

    def say_world():
        if comm.rank == 0:
            print(f"now {comm.size} ranks", flush=True)
    state.register_reset_callbacks([say_world])

    @torchmn.elastic.run  # elastic: goes on in a new world when ranks die or join
    def train_epochs(state):
        start = time.perf_counter() - state.elapsed
        while train_loader.epoch < args.epochs:
            for x, y in train_loader:
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.loss_sum += loss.item()
                state.steps += 1
                if state.steps % args.commit_every == 0:
                    state.elapsed = time.perf_counter() - start
                    state.commit()  # elastic: every rank, at the same step
            train_loss = comm.allreduce(torch.tensor(state.loss_sum / state.steps), op="mean").item()
            metrics = evaluate()
            state.elapsed = time.perf_counter() - start
            state.log.append({"epoch": train_loader.epoch, "main/loss": train_loss,
                              "validation/main/loss": metrics["loss"],
                              "validation/main/accuracy": metrics["accuracy"], "elapsed_time": state.elapsed,
                              "ranks": comm.size})
            if comm.rank == 0:
                entry = state.log[-1]
                print(f"epoch {entry['epoch']:3d}  ranks {comm.size}  train loss {train_loss:.4f}  "
                      f"val loss {metrics['loss']:.4f}  val accuracy {metrics['accuracy']:.4f}  "
                      f"elapsed {state.elapsed:.1f} s", flush=True)
                os.makedirs(os.path.dirname(args.log) or ".", exist_ok=True)
                with open(args.log, "w") as f:
                    json.dump(state.log, f, indent=1)
            state.loss_sum, state.steps = 0.0, 0
            state.commit()  # elastic: the epoch's end, so a reset does not repeat it

    train_epochs(state)
    comm.finalize()


if __name__ == "__main__":
    main()
