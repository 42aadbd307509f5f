"""Train the MNIST MLP as a 2-stage pipeline (one stage per rank), with micro-batches.

    torchmn run -np 2 python examples/model_parallel/pipeline_mnist.py          # 2 stages
    torchmn run -np 4 python examples/model_parallel/pipeline_mnist.py          # 2 stages x 2 replicas

Stage 0 holds the first layer and reads the images; stage 1 holds the other two layers, reads the
labels and computes the loss. Each batch of --batch-size images is cut into --micro-batches pieces
that flow through the stages so that both work at once (--schedule 1f1b or gpipe). With 4 ranks,
two pipelines each train on half of the data and each stage's two replicas average their gradients
(data parallelism over ``comm.split``). The last stage of the first pipeline prints the validation
accuracy after every epoch; it reaches that of one process on the same data (about 0.95).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import torchmn
from torchmn.nn import Pipeline

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mnist"))
from data import add_data_arguments, check_data_arguments, load_mnist, positive_int  # noqa: E402
from device_choice import add_device_argument, training_device  # noqa: E402


def make_stages(n_units=1000, n_out=10):
    """The MLP of examples/mnist, cut in two: the same layers and initial weights as one process."""
    model = nn.Sequential(nn.Linear(784, n_units), nn.ReLU(),
                          nn.Linear(n_units, n_units), nn.ReLU(),
                          nn.Linear(n_units, n_out))
    return [model[:2], model[2:]]


def main():
    parser = argparse.ArgumentParser(description="MNIST MLP, pipeline parallel")
    parser.add_argument("--epochs", type=positive_int, default=20)
    parser.add_argument("--batch-size", type=positive_int, default=100, help="images per step and pipeline")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--seed", type=int, default=0)
    add_data_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    check_data_arguments(parser, args)
    torch.manual_seed(args.seed)
    comm = torchmn.create_communicator()
    device = training_device(comm, args.device)
    stages = 2
    if comm.size % stages:
        raise SystemExit(f"pipeline_mnist.py runs on a multiple of {stages} ranks (2 stages x replicas), "
                         f"not {comm.size}")
    replica, stage = divmod(comm.rank, stages)
    replicas = comm.size // stages
    pipe_comm = comm.split(color=replica, key=stage)    # this pipeline's stages
    dp_comm = comm.split(color=stage, key=replica)      # this stage's replicas

    train, val = load_mnist(args.n_train, args.data_dir)
    begin, end = torchmn.scatter_index(len(train), dp_comm)   # this pipeline's share of the data
    train = train[begin:end]
    images = torch.stack([x for x, _ in train]).to(device)
    labels = torch.tensor([y for _, y in train]).to(device)

    model = make_stages()[stage].to(device)
    pipe = Pipeline(model, pipe_comm, micro_batches=args.micro_batches, schedule=args.schedule,
                    loss_fn=F.cross_entropy)
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), dp_comm,
                                                    backward_passes_per_step=args.micro_batches)
    order = torch.Generator().manual_seed(args.seed + replica)  # both stages of a pipeline see one order
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(images), generator=order)
        losses = []
        for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            rows = perm[i:i + args.batch_size].to(device)
            optimizer.zero_grad()
            loss = pipe.train_step(images[rows] if pipe.is_first else None,
                                   target=labels[rows] if pipe.is_last else None)
            optimizer.step()
            if loss is not None:
                losses.append(loss.item())
        if replica == 0:
            val_images = torch.stack([x for x, _ in val]).to(device)
            out = pipe(val_images if pipe.is_first else None)
            if pipe.is_last:
                val_labels = torch.tensor([y for _, y in val]).to(device)
                accuracy = (out.argmax(dim=1) == val_labels).float().mean().item()
                print(f"epoch {epoch:3d}  train loss {sum(losses) / len(losses):.4f}  "
                      f"val accuracy {accuracy:.4f}  elapsed {time.perf_counter() - start:.1f} s", flush=True)
    if pipe.is_last and replica == 0:
        print(f"peak activation memory of stage {stage}: {pipe.peak_activation_bytes / 1e6:.2f} MB "
              f"({args.schedule}, {args.micro_batches} micro-batches, {replicas} replica(s))", flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()
