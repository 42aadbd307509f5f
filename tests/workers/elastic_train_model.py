"""The model and batches of elastic_train.py, also for the tests' one-process replay."""
import torch


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def batch(step, rank, size):
    g = torch.Generator().manual_seed(step * 1_000_003 + rank * 7919 + size)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def loss_of(model, step, rank, size):
    x, y = batch(step, rank, size)
    return torch.nn.functional.mse_loss(model(x), y)
