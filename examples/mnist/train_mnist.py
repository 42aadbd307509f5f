"""Train a multilayer perceptron on MNIST on several processes: data parallel with torchmn.

    torchmn run -np 2 python examples/mnist/train_mnist.py
    torchrun --nproc-per-node 2 examples/mnist/train_mnist.py     # works too, as do srun and mpirun

This is train_mnist_single.py with the few changes ChainerMN users know, each marked "# torchmn:".
All of them show in

    diff examples/mnist/train_mnist_single.py examples/mnist/train_mnist.py

Each rank trains on its own part of the data with batches of --batch-size (100
per rank, as in ChainerMN: the global batch grows with the rank count); gradients are averaged
over ranks at every step, so every rank holds the same model. Only rank 0 prints and logs.

Every epoch appends {"epoch", "main/loss", "validation/main/loss", "validation/main/accuracy",
"elapsed_time"} to the JSON list in --log (elapsed_time: seconds since training started).

With --checkpoint DIR, every epoch ends with a checkpoint, and a run started again (after a crash,
or by `torchmn run --max-restarts 3`) continues from the newest epoch every rank saved, with
the results an uninterrupted run would have given.
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import torchmn  # torchmn: the library
import torchmn.checkpoint
import torchmn.datasets
import torchmn.resources
import torchmn.evaluators
from data import add_data_arguments, check_data_arguments, load_mnist, positive_int
from device_choice import add_device_argument, training_device


def make_model(n_units=1000, n_out=10):
    return nn.Sequential(nn.Linear(784, n_units), nn.ReLU(),
                         nn.Linear(n_units, n_units), nn.ReLU(),
                         nn.Linear(n_units, n_out))


def report(log, entry, path):
    """Print one epoch's results and rewrite the JSON log with it appended."""
    log.append(entry)
    tqdm.write(f"epoch {entry['epoch']:3d}  train loss {entry['main/loss']:.4f}  "
               f"val loss {entry['validation/main/loss']:.4f}  "
               f"val accuracy {entry['validation/main/accuracy']:.4f}  elapsed {entry['elapsed_time']:.1f} s")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(log, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description="MNIST MLP, data parallel")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--batch-size", type=positive_int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", "--log-file", default="result/log.json",
                        help="JSON log, one entry per epoch (under torchrun, spell it --log-file)")
    parser.add_argument("--communicator", default="auto",
                        choices=["auto", "naive", "flat", "hierarchical",  # and ChainerMN's names for them:
                                 "pure_nccl", "two_dimensional", "single_node", "non_cuda_aware"],
                        help="gradient averaging")
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint directory: save after every epoch, and resume from the newest there")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                        help="how gradients travel: whole, in half precision, or as PowerSGD's low-rank "
                             "approximations (for slow links)")
    parser.add_argument("--shard-state", action="store_true", default=None,
                        help="ZeRO stage 1 everywhere (by default the ranks of one node already split the update)")
    add_data_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    check_data_arguments(parser, args)
    if args.shard_state and args.compression == "powersgd":
        # Each rank updates its slice from reduce-scattered gradients, which low-rank messages do not give.
        parser.error("--shard-state and --compression powersgd do not go together: drop one "
                     "(--compression fp16 or bf16 shards fine)")
    torch.manual_seed(args.seed)
    comm = torchmn.create_communicator(args.communicator)  # torchmn: who am I, how many are we
    device = training_device(comm, args.device)  # torchmn: this rank's own GPU (comm.device), or the CPU

    # torchmn: rank 0 reads the data and hands every rank its own part
    train, val = load_mnist(args.n_train, args.data_dir) if comm.rank == 0 else (None, None)
    train = torchmn.datasets.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    val = torchmn.datasets.scatter_dataset(val, comm, shuffle=True, seed=args.seed, force_equal_length=False)
    workers = torchmn.resources.dataloader_workers_budget(comm.intra_size)  # torchmn: CPUs left to this rank
    train_loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                               num_workers=workers, persistent_workers=workers > 0)
    val_loader = torch.utils.data.DataLoader(val, batch_size=args.batch_size)

    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer = torchmn.create_multi_node_optimizer(  # torchmn: averages gradients
        optimizer, comm, shard_state=args.shard_state,
        compression=None if args.compression == "none" else args.compression)

    @torch.no_grad()
    def evaluate_local():
        """Mean loss and accuracy over the validation set, and how many images that was."""
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

    evaluate = torchmn.evaluators.create_multi_node_evaluator(evaluate_local, comm)  # torchmn: all ranks

    log, done = [], 0
    if args.checkpoint:  # torchmn: resume from the newest epoch every rank saved (RNG states too)
        ckpt = torchmn.checkpoint.Checkpointer(args.checkpoint, comm, keep=2, model=model, optimizer=optimizer)
        done = ckpt.load_latest() or 0
        log = ckpt.extra.get("log", [])
    progress = tqdm(total=args.epochs * len(train_loader), initial=done * len(train_loader), unit="batch",
                    disable=comm.rank != 0)  # torchmn: progress bar on rank 0
    start = time.perf_counter() - (log[-1]["elapsed_time"] if log else 0.0)
    for epoch in range(done + 1, args.epochs + 1):
        loss_sum = 0.0
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
            progress.update()
        train_loss = loss_sum / len(train_loader)
        train_loss = comm.allreduce(torch.tensor(train_loss), op="mean").item()  # torchmn: mean over ranks
        metrics = evaluate()
        entry = {"epoch": epoch, "main/loss": train_loss, "validation/main/loss": metrics["loss"],
                 "validation/main/accuracy": metrics["accuracy"], "elapsed_time": time.perf_counter() - start}
        if comm.rank == 0:  # torchmn: rank 0 prints and logs
            report(log, entry, args.log)
        if args.checkpoint:
            ckpt.save(epoch, log=log)  # torchmn: every rank, together
    progress.close()
    comm.finalize()  # torchmn: done


if __name__ == "__main__":
    main()
