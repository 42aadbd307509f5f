"""torchmn.lightning checks, run on every rank of a real job (see tests/test_lightning.py).

A float64 LightningModule is trained twice in the same processes, by Lightning's own DDPStrategy
and by TorchmnStrategy, from the same initial weights on the same batches: the losses of every
step and the final parameters must agree.

Usage: python lightning_checks.py CHECK [CHECK ...]
"""
import argparse
import os
import pickle
import warnings

import lightning
import torch

from torchmn.lightning import TorchmnEnvironment, TorchmnStrategy
from torchmn.nn import MultiNodeBatchNorm

warnings.filterwarnings("ignore")  # Lightning's advice about workers and logging is not under test
RANK = int(os.environ.get("RANK", 0))  # none under a plain `python lightning_checks.py`: a world of one
SIZE = int(os.environ.get("WORLD_SIZE", 1))
LOCAL = int(os.environ.get("LOCAL_WORLD_SIZE", SIZE))  # ranks per node, as the launcher started them
NODES = SIZE // LOCAL


class Net(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
        self.losses = []
        self.seen = {}

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # Lightning's reduce: the mean over the ranks
        return loss

    def on_train_batch_end(self, outputs, batch, index):
        self.losses.append(outputs["loss"].detach().clone())

    def on_train_start(self):
        strategy = self.trainer.strategy
        mine = torch.tensor([float(RANK)], dtype=torch.float64)
        calls = strategy.comm.call_log.calls if isinstance(strategy, TorchmnStrategy) else 0
        # The module's own all_gather passes group=WORLD: the world, through the communicator too.
        self.module_gathered = self.all_gather(mine).view(-1).tolist()
        self.module_gather_calls = strategy.comm.call_log.calls - calls if isinstance(strategy, TorchmnStrategy) else 0
        self.seen = {"sum": strategy.reduce(mine, reduce_op="sum").item(),
                     "mean": strategy.reduce(mine, reduce_op="mean").item(),
                     "max": strategy.reduce(mine, reduce_op="max").item(),
                     "gathered": strategy.all_gather(mine).view(-1).tolist(),
                     "broadcast": strategy.broadcast(f"from {RANK}", src=SIZE - 1)}
        strategy.barrier()
        self.seen["comm_hook"] = strategy.model._get_ddp_logging_data().get("comm_hook", "")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


def loader():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (48,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(strategy):
    model = Net()
    trainer = lightning.Trainer(strategy=strategy, accelerator="cpu", devices=LOCAL, num_nodes=NODES, max_epochs=2,
                                logger=False,
                                enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, loader())
    return model, trainer


def check_matches_lightnings_ddp():
    # Lightning's DDP strategy, told the ranks' places as TorchmnStrategy is (Lightning's own
    # environment for plain env:// variables removes WORLD_SIZE from os.environ at its teardown).
    reference, _ = fit(lightning.pytorch.strategies.DDPStrategy(cluster_environment=TorchmnEnvironment()))
    model, trainer = fit(TorchmnStrategy())
    assert isinstance(trainer.strategy.cluster_environment, TorchmnEnvironment)
    assert len(model.losses) == len(reference.losses) == 2 * 48 // 4 // SIZE
    for step, (a, b) in enumerate(zip(reference.losses, model.losses)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (step, a.item(), b.item())
    for p, q in zip(reference.parameters(), model.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-12), (p - q).abs().max()
    # The logged loss was reduced through the communicator: the mean of the ranks' last losses.
    last = torch.stack(gathered_from_every_rank(model.losses[-1])).mean()
    assert torch.allclose(trainer.callback_metrics["loss"].double(), last, rtol=1e-12), trainer.callback_metrics


def gathered_from_every_rank(t):
    out = [torch.zeros_like(t) for _ in range(SIZE)]
    torch.distributed.all_gather(out, t)
    return out


def check_collectives_go_through_the_communicator():
    model, trainer = fit(TorchmnStrategy())
    expected = {"sum": float(sum(range(SIZE))), "mean": sum(range(SIZE)) / SIZE, "max": float(SIZE - 1),
                "gathered": [float(r) for r in range(SIZE)], "broadcast": f"from {SIZE - 1}"}
    assert "torchmn_hook" in model.seen.pop("comm_hook"), "DDP does not average through torchmn's hook"
    assert model.seen == expected, model.seen
    assert model.module_gathered == expected["gathered"] and model.module_gather_calls == 1, \
        (model.module_gathered, model.module_gather_calls)
    # After fit the communicator stays, as Lightning's DDP process group does: a broadcast of the
    # best checkpoint's path, a reduction and a barrier reach every rank.
    strategy = trainer.strategy
    assert trainer.node_rank == strategy.comm.inter_rank, (trainer.node_rank, strategy.comm.inter_rank)
    assert strategy.broadcast(f"path of rank {RANK}", src=0) == "path of rank 0"
    assert strategy.reduce(torch.tensor(float(RANK)), reduce_op="sum").item() == sum(range(SIZE))
    # A loss reduced in training_step stays in the graph (Lightning's in-place reduction keeps it):
    # the value is the world's, the gradient the local one (over the world's size for a mean).
    w = torch.tensor([float(RANK + 1)], requires_grad=True)
    for op, value, grad in (("mean", sum(range(1, SIZE + 1)) / SIZE * 2, 2.0 / SIZE),
                            ("sum", sum(range(1, SIZE + 1)) * 2, 2.0)):
        w.grad = None
        loss = strategy.reduce(w * 2, reduce_op=op)
        loss.sum().backward()
        assert loss.item() == value and w.grad.item() == grad, (op, loss, w.grad)
    strategy.barrier()
    # A sweep's next Trainer and strategy train over the same communicator (each new one held its
    # shared memory until the garbage collector came).
    _, again = fit(TorchmnStrategy())
    assert again.strategy.comm is strategy.comm


class NormNet(lightning.LightningModule):
    """A BatchNorm that only learns its running statistics (lr 0): after one step its running_mean
    is 0.1 x the mean of the batch it normalized over."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(6).double()
        self.sync = torch.nn.SyncBatchNorm(6).double()  # as a script written for GPUs has it
        self.head = torch.nn.Linear(6, 1).double()

    def training_step(self, batch, index):
        return self.head(self.sync(self.bn(batch[0]))).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def check_sync_batchnorm_on_the_cpu():
    """Trainer(sync_batchnorm=True): torchmn's multi-node BatchNorm during fit (torch's SyncBatchNorm
    refuses CPU modules), plain BatchNorm again afterwards, with the global batch's statistics."""
    xs = torch.randn(4 * SIZE, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + torch.arange(6)
    mine = xs[4 * RANK:4 * RANK + 4]
    model = NormNet()
    trainer = lightning.Trainer(strategy=TorchmnStrategy(), accelerator="cpu", devices=LOCAL, num_nodes=NODES,
                                sync_batchnorm=True, max_steps=1, use_distributed_sampler=False, logger=False,
                                enable_progress_bar=False,
                                enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(mine), batch_size=4))
    assert type(model.bn) is torch.nn.BatchNorm1d, type(model.bn)
    assert torch.allclose(model.bn.running_mean, 0.1 * xs.mean(0), rtol=0, atol=1e-12), \
        (model.bn.running_mean, 0.1 * xs.mean(0))
    # The SyncBatchNorm too is a plain BatchNorm again: it trains on this rank alone, and the model
    # pickles (no communicator left in it).
    assert not isinstance(model.sync, MultiNodeBatchNorm), type(model.sync)
    model.sync.train()(torch.randn(3, 6, dtype=torch.float64))
    pickle.dumps(model)


def check_world_of_one():
    """One process (a plain `python script.py`, or -np 1): DDP, which Lightning wraps the model in,
    gets a process group over an in-process store, and training matches Lightning's DDP alone."""
    assert SIZE == 1
    model, trainer = fit(TorchmnStrategy())
    assert trainer.strategy.comm.size == 1 and len(model.losses) == 2 * 48 // 4, len(model.losses)
    assert trainer.strategy.broadcast("x") == "x" and model.seen["gathered"] == [0.0], model.seen


def check_bad_compression_refused_at_once():
    try:
        TorchmnStrategy(compression="float16")
    except ValueError as e:
        assert "'fp16', 'bf16'" in str(e), e
    else:
        raise AssertionError("expected ValueError")


def check_devices_that_differ_from_the_launcher_are_refused():
    trainer = lightning.Trainer(strategy=TorchmnStrategy(), accelerator="cpu", devices=LOCAL + 1, num_nodes=NODES,
                                logger=False, enable_progress_bar=False, enable_checkpointing=False)
    try:
        trainer.fit(Net(), loader())  # checked before any rank connects: every rank raises on its own
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("expected ValueError")
    assert f"Trainer(devices={LOCAL + 1}, num_nodes={NODES}) on rank {RANK}" in message, message
    assert f"started {LOCAL} rank(s) on this node" in message and f"Pass devices={LOCAL}" in message, message


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checks", nargs="+")
    for name in parser.parse_args().checks:
        globals()[f"check_{name}"]()
        if RANK == 0:
            print(f"PASS {name}", flush=True)
