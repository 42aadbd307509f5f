"""Train the MNIST MLP with torchmn inside Ray Train: `TorchTrainer` starts the workers and sets up
torch.distributed; `torchmn.create_communicator()` adopts that process group (and leaves it to
Ray), and each epoch reports through `ray.train`, with a checkpoint Ray keeps.

    python examples/ray/train_mnist_ray.py --workers 2 --epochs 2 --storage /tmp/ray_results

Ray handles the workers' failures (its `FailureConfig`, `--max-failures`): the run Ray restarts
after a worker failed resumes from the newest checkpoint it kept. A run started again by hand is a
new run (each has its own name), starting from epoch 0. Needs `pip install -e ".[ray]"` in the repository.
"""
import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import ray.train
import torchmn
import torchmn.datasets
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

MNIST_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mnist")


def make_model(n_units=1000, n_out=10):
    return nn.Sequential(nn.Linear(784, n_units), nn.ReLU(),
                         nn.Linear(n_units, n_units), nn.ReLU(),
                         nn.Linear(n_units, n_out))


def train_loop(config):
    sys.path.insert(0, config["mnist_dir"])  # Ray's workers start elsewhere
    from data import load_mnist

    comm = torchmn.create_communicator()  # Ray's process group, adopted
    train, _ = load_mnist(n_train=config["n_train"])
    train = torchmn.datasets.scatter_dataset(train if comm.rank == 0 else None, comm, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(train, batch_size=config["batch_size"], shuffle=True)
    model = make_model()
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), comm)
    start = 0
    resumed = ray.train.get_checkpoint()
    if resumed is not None:
        with resumed.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "model.pt"))
        model.load_state_dict(saved["model"])
        start = saved["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        total, count = 0.0, 0
        for x, t in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), t)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item() * len(t), count + len(t)
        mean_loss = comm.allreduce(torch.tensor([total, float(count)]))
        metrics = {"epoch": epoch, "loss": (mean_loss[0] / mean_loss[1]).item(), "ranks": comm.size,
                   "threads": torch.get_num_threads()}
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if comm.rank == 0:  # every rank holds the same model
                torch.save({"model": model.state_dict(), "epoch": epoch}, os.path.join(folder, "model.pt"))
                checkpoint = Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=checkpoint)


def main():
    parser = argparse.ArgumentParser(description="MNIST MLP, data parallel in Ray Train with torchmn")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--n-train", type=int, default=None, help="training images (default: all 4,000)")
    parser.add_argument("--storage", default=os.path.join(tempfile.gettempdir(), "ray_results"))
    parser.add_argument("--max-failures", type=int, default=0, help="Ray restarts the workers this often")
    args = parser.parse_args()
    ray.init(num_cpus=args.workers, include_dashboard=False)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"mnist_dir": MNIST_DIR, "epochs": args.epochs, "batch_size": args.batch_size,
                           "n_train": args.n_train},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        # A name of its own per run: Ray resumes a run it finds under the same name in the storage
        # folder, and a finished one would then "train" nothing and report its old result.
        run_config=RunConfig(storage_path=os.path.abspath(args.storage), name=f"mnist-{time.strftime('%Y%m%d-%H%M%S')}",
                             failure_config=FailureConfig(max_failures=args.max_failures)))
    result = trainer.fit()
    print(f"final: {result.metrics}", flush=True)
    print(f"checkpoint: {result.checkpoint.path if result.checkpoint else None}", flush=True)


if __name__ == "__main__":
    main()
