"""Tune the MNIST MLP's learning rate and hidden width with Optuna, each trial trained by all ranks.

    torchmn run -np 2 python examples/tune/tune_mnist.py                     # 8 trials of 3 epochs
    torchmn run -np 2 python examples/tune/tune_mnist.py --n-trials 20 --storage sqlite:///mnist.db

ChainerMN's ``create_multi_node_study`` idiom: rank 0 holds the study (in an Optuna storage, so a
stopped search resumes), every rank calls ``optimize``; each trial's suggestions come from rank 0,
every rank trains on its part of the data, and the validation accuracy over all ranks is the
objective. Epochs report to the pruner, which stops clearly worse trials early.
"""
import argparse
import sys
from pathlib import Path

import optuna
import torch
import torch.nn.functional as F

import torchmn
import torchmn.tune

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mnist"))
from data import add_data_arguments, check_data_arguments, load_mnist, positive_int  # noqa: E402
from device_choice import add_device_argument, training_device  # noqa: E402
from train_mnist import make_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description="Tune the MNIST MLP with Optuna, all ranks per trial")
    parser.add_argument("--n-trials", type=int, default=8)
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=50, help="per rank")
    parser.add_argument("--storage", default=None, help="an Optuna storage URL (default: in memory)")
    parser.add_argument("--study-name", default="tune-mnist")
    add_data_arguments(parser)
    add_device_argument(parser)
    args = parser.parse_args()
    check_data_arguments(parser, args)
    comm = torchmn.create_communicator()
    device = training_device(comm, args.device)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    train, val = load_mnist(args.n_train, args.data_dir) if comm.rank == 0 else (None, None)
    train = torchmn.datasets.scatter_dataset(train, comm, shuffle=True, seed=0)
    val = torchmn.datasets.scatter_dataset(val, comm, shuffle=True, seed=0, force_equal_length=False)

    def objective(trial):  # a torchmn.tune.DistributedTrial on every rank
        lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
        width = trial.suggest_categorical("width", [100, 300, 1000])
        torch.manual_seed(0)
        model = make_model(width).to(device)
        optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=lr), comm)
        loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)

        @torch.no_grad()
        def evaluate_local():
            model.eval()
            correct = sum((model(x.to(device)).argmax(1) == y.to(device)).sum().item()
                          for x, y in torch.utils.data.DataLoader(val, batch_size=500))
            model.train()
            return {"accuracy": correct / max(1, len(val))}, len(val)

        evaluate = torchmn.evaluators.create_multi_node_evaluator(evaluate_local, comm)
        for epoch in range(args.epochs):
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            accuracy = evaluate()["accuracy"]
            trial.report(accuracy, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return accuracy

    study = optuna.create_study(storage=args.storage, study_name=args.study_name, direction="maximize",
                                load_if_exists=True) if comm.rank == 0 else None
    torchmn.tune.MultiNodeStudy(study, comm).optimize(objective, n_trials=args.n_trials)
    if comm.rank == 0:
        for t in study.trials:
            value = f"{t.value:.4f}" if t.value is not None else "-"
            print(f"trial {t.number}: {t.state.name.lower():8s} accuracy {value}  {t.params}")
        print(f"best: accuracy {study.best_value:.4f} with {study.best_params}")
    comm.finalize()


if __name__ == "__main__":
    main()
