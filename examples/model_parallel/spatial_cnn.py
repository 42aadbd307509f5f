"""Train a small CNN on MNIST with every image split by rows over the ranks (spatial parallelism).

    torchmn run -np 2 python examples/model_parallel/spatial_cnn.py       # each rank: 14 of the 28 rows
    python examples/model_parallel/spatial_cnn.py                          # one process: the reference

Every rank holds its rows of every image. The convolutions are ``SpatialParallelConv2d`` (each
fetches the rows around its block from the neighbours: the halo), the BatchNorms are
``MultiNodeBatchNorm2d`` (statistics over the whole images, not a rank's rows), and the linear
classifier, whole on every rank, sums each rank's rows' part of its product
(``torchmn.functions.allreduce``). Every rank thus computes the same loss; the multi-node optimizer
averages the ranks' gradients, which makes them the one-process model's. Rank 0 prints the
validation accuracy after every epoch; it reaches that of one process (about 0.96).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchmn
import torchmn.functions
from torchmn.nn import MultiNodeBatchNorm2d, SpatialParallelConv2d

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mnist"))
from data import add_data_arguments, check_data_arguments, load_mnist, positive_int  # noqa: E402
from device_choice import add_device_argument, training_device  # noqa: E402


class SpatialCNN(nn.Module):
    """Three 3x3 convolutions (28 -> 28 -> 14 -> 7 rows) with BatchNorm, then a linear classifier."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm
        layers = []
        for c_in, c_out, stride in ((1, 16, 1), (16, 32, 2), (32, 64, 2)):
            layers += [SpatialParallelConv2d(c_in, c_out, 3, stride=stride, padding=1, comm=comm),
                       MultiNodeBatchNorm2d(c_out, comm=comm), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(64 * 7 * 7, 10)
        self.first_row = None

    def forward(self, rows):
        h = self.features(rows)  # this rank's rows of the 64 x 7 x 7 feature maps
        if self.first_row is None:  # where they start: the heights of the ranks before this one
            self.first_row = sum(self.comm.allgather_obj(h.shape[2])[:self.comm.rank])
        weight = self.classifier.weight.view(10, 64, 7, 7)[:, :, self.first_row:self.first_row + h.shape[2]]
        # The classifier's sum over all features, as the sum over the ranks of their rows' parts.
        logits = torchmn.functions.allreduce(self.comm, torch.einsum("nchw,kchw->nk", h, weight))
        return logits + self.classifier.bias


def main():
    parser = argparse.ArgumentParser(description="MNIST CNN, spatial parallel")
    parser.add_argument("--epochs", type=positive_int, default=6)
    parser.add_argument("--batch-size", type=positive_int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    add_data_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    check_data_arguments(parser, args)
    comm = torchmn.create_communicator()
    device = training_device(comm, args.device)
    torch.manual_seed(args.seed)  # the same initial model on every rank (the optimizer broadcasts it too)

    train, val = load_mnist(args.n_train, args.data_dir)
    bounds = torch.tensor_split(torch.arange(28), comm.size)[comm.rank]
    my_rows = slice(int(bounds[0]), int(bounds[-1]) + 1)

    def rows_of(data):
        images = torch.stack([x for x, _ in data]).view(-1, 1, 28, 28)[:, :, my_rows].contiguous()
        return images.to(device), torch.tensor([y for _, y in data]).to(device)

    images, labels = rows_of(train)
    val_images, val_labels = rows_of(val)

    model = SpatialCNN(comm).to(device)
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=args.lr), comm)
    order = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm = torch.randperm(len(images), generator=order)
        losses = []
        for i in range(0, len(perm), args.batch_size):
            batch = perm[i:i + args.batch_size].to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            correct = sum((model(val_images[i:i + 500]).argmax(1) == val_labels[i:i + 500]).sum().item()
                          for i in range(0, len(val_images), 500))
        if comm.rank == 0:
            print(f"epoch {epoch:3d}  train loss {sum(losses) / len(losses):.4f}  val accuracy "
                  f"{correct / len(val_images):.4f}  elapsed {time.perf_counter() - start:.1f} s", flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()
