"""MNIST data parallel with a pytorch-pfn-extras training loop (Chainer's trainer, for PyTorch).

    torchmn run -np 2 python examples/mnist/train_mnist_ppe.py --out result/ppe
    torchmn run -np 2 python examples/mnist/train_mnist_ppe.py --batchnorm   # with BatchNorm layers

The model, data and optimizer are those of train_mnist.py; the loop is ppe's ExtensionsManager, with
torchmn's multi-node extensions:

- ObservationAggregator: the training loss of each epoch, averaged over ranks ("main/loss");
- MultiNodeEarlyStoppingTrigger: stops every rank at the same epoch once the validation loss,
  averaged over ranks, has not improved for --patience epochs (at the latest after --epochs);
- AllreducePersistent: averages the model's buffers over ranks before each validation. The plain
  MLP has none; with --batchnorm, BatchNorm's running statistics are averaged.

Rank 0 alone prints (PrintReport, ProgressBar) and writes ppe's LogReport: --out/log, a JSON list with
one entry per epoch ("epoch", "iteration", "elapsed_time", "main/loss", "validation/main/loss",
"validation/main/accuracy"). Every rank must register the torchmn extensions: they communicate.
"""
import argparse

import pytorch_pfn_extras as ppe
import pytorch_pfn_extras.training.extensions as extensions
import torch
import torch.nn.functional as F
from torch import nn

import torchmn
import torchmn.datasets
import torchmn.evaluators
import torchmn.extensions
from data import add_data_arguments, check_data_arguments, load_mnist, positive_int
from device_choice import add_device_argument, training_device


def make_model(batchnorm=False, n_units=1000, n_out=10):
    norm = (lambda: nn.BatchNorm1d(n_units)) if batchnorm else nn.Identity
    return nn.Sequential(nn.Linear(784, n_units), norm(), nn.ReLU(),
                         nn.Linear(n_units, n_units), norm(), nn.ReLU(),
                         nn.Linear(n_units, n_out))


def main():
    parser = argparse.ArgumentParser(description="MNIST MLP, data parallel, pytorch-pfn-extras loop")
    parser.add_argument("--epochs", type=positive_int, default=20, help="at most this many epochs")
    parser.add_argument("--patience", type=int, default=5,
                        help="stop after this many epochs without a better validation loss")
    parser.add_argument("--batch-size", type=positive_int, default=100, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batchnorm", action="store_true", help="add BatchNorm1d after the hidden layers")
    parser.add_argument("--out", default="result/ppe", help="directory for ppe's LogReport ('log')")
    parser.add_argument("--communicator", default="auto", help="gradient averaging: auto, flat, naive, ...")
    add_data_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    check_data_arguments(parser, args)
    torch.manual_seed(args.seed)
    comm = torchmn.create_communicator(args.communicator)
    device = training_device(comm, args.device)

    train, val = load_mnist(args.n_train, args.data_dir) if comm.rank == 0 else (None, None)
    train = torchmn.datasets.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    val = torchmn.datasets.scatter_dataset(val, comm, shuffle=True, seed=args.seed, force_equal_length=False)
    # BatchNorm cannot train on a last batch of one sample (a part of 101 in batches of 100, say).
    train_loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                               drop_last=args.batchnorm)
    val_loader = torch.utils.data.DataLoader(val, batch_size=args.batch_size)
    if len(train_loader) == 0:  # every rank's part has the same length: all stop here
        parser.error(f"with --batchnorm every batch must be whole, but each rank's part of the training set "
                     f"has {len(train)} samples, fewer than --batch-size {args.batch_size}: lower --batch-size "
                     f"or raise --n-train")

    model = make_model(args.batchnorm).to(device)
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

    def validation(manager):
        metrics = evaluate()  # the same global means on every rank
        ppe.reporting.report({"validation/main/loss": metrics["loss"],
                              "validation/main/accuracy": metrics["accuracy"]})

    stop = torchmn.extensions.MultiNodeEarlyStoppingTrigger(
        comm, monitor="validation/main/loss", patience=args.patience, max_trigger=(args.epochs, "epoch"))
    manager = ppe.training.ExtensionsManager(model, optimizer, args.epochs, iters_per_epoch=len(train_loader),
                                             out_dir=args.out, stop_trigger=stop)
    # On every rank (they communicate). Order within an epoch's end: buffers, validation, aggregation.
    manager.extend(torchmn.extensions.AllreducePersistent(model, comm))
    manager.extend(validation, name="validation", trigger=(1, "epoch"), priority=ppe.training.PRIORITY_WRITER)
    manager.extend(torchmn.extensions.ObservationAggregator(  # one allgather an epoch, not one a batch
        comm, "main/loss_local", "main/loss", comm_trigger=(1, "epoch")))
    # On rank 0 only: reporting.
    if comm.rank == 0:
        keys = ["epoch", "iteration", "main/loss", "validation/main/loss", "validation/main/accuracy",
                "elapsed_time"]
        manager.extend(extensions.LogReport(keys=keys[2:-1], trigger=(1, "epoch")))
        manager.extend(extensions.PrintReport(keys))
        manager.extend(extensions.ProgressBar(update_interval=5))

    while not manager.stop_trigger:
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            with manager.run_iteration():
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                ppe.reporting.report({"main/loss_local": loss.item()})  # this rank's batch
    comm.finalize()


if __name__ == "__main__":
    main()
