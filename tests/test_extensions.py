"""Multi-node ppe extensions: in one process, and across two real ranks."""
import copy
import os

import pytest
import pytorch_pfn_extras as ppe
import torch

from jobs import assert_check_passed
from workers.data_jobs import data_check_output
from torchmn.communicators import make_communicator
from torchmn.extensions import (AllreducePersistent, MultiNodeEarlyStoppingTrigger, ObservationAggregator,
                                available_iterations, multi_node_snapshot, resume_latest)
from torchmn.extensions.snapshot import atomic_save

CHECKS = ["early_stopping", "early_stopping_trigger_that_differs_between_ranks", "observation_aggregator", "observation_aggregator_weighs_each_observation",
          "allreduce_persistent", "snapshot",
          "snapshot_unreadable_on_one_rank"]


def solo():
    return make_communicator("naive", rank=0, size=1, group=None, obj_group=None, backend="gloo", node_key=0)


@pytest.mark.check_job("data", np=2)
@pytest.mark.parametrize("check", CHECKS)
def test_across_two_ranks(check, request):
    assert_check_passed(data_check_output(request, 2), check)


def manager_for(model, out, max_epochs=3, iters_per_epoch=1, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ppe.training.ExtensionsManager(model, opt, max_epochs, iters_per_epoch=iters_per_epoch,
                                          out_dir=str(out), **kwargs)


def test_early_stopping_single_rank_and_deepcopy(tmp_path):
    comm = solo()
    stop = MultiNodeEarlyStoppingTrigger(comm, monitor="val/loss", patience=1, max_trigger=(10, "epoch"))
    assert copy.deepcopy(stop).comm is comm
    manager = manager_for(torch.nn.Linear(1, 1), tmp_path, 10, stop_trigger=stop)
    losses = iter([3.0, 2.0, 2.5, 1.0, 1.0])
    while not manager.stop_trigger:
        with manager.run_iteration():
            ppe.reporting.report({"val/loss": next(losses)})
    assert manager.epoch == 3   # 2.5 is worse than 2.0, patience 1


def test_early_stopping_max_mode_for_accuracy(tmp_path):
    stop = MultiNodeEarlyStoppingTrigger(solo(), monitor="val/accuracy", patience=2, max_trigger=(10, "epoch"))
    manager = manager_for(torch.nn.Linear(1, 1), tmp_path, 10, stop_trigger=stop)
    while not manager.stop_trigger:
        with manager.run_iteration():
            ppe.reporting.report({"val/accuracy": 0.5 + 0.01 * manager.iteration})
    assert manager.epoch == 10   # always improving: only max_trigger stops it


def test_early_stopping_takes_chainermn_positional_arguments(tmp_path):
    """ChainerMN's order (comm, check_trigger, monitor, patience) and default monitor "main/loss";
    arguments in another order are refused, not left to never stop."""
    stop = MultiNodeEarlyStoppingTrigger(solo(), (1, "epoch"), "main/loss", 1)
    assert (stop.monitor, stop.patience) == ("main/loss", 1)
    assert MultiNodeEarlyStoppingTrigger(solo()).monitor == "main/loss"
    manager = manager_for(torch.nn.Linear(1, 1), tmp_path, 10, stop_trigger=stop)
    while not manager.stop_trigger:
        with manager.run_iteration():
            ppe.reporting.report({"main/loss": 1.0})
    assert manager.epoch == 2   # no improvement after the first check, patience 1
    with pytest.raises(TypeError, match="monitor must be an observation key"):
        MultiNodeEarlyStoppingTrigger(solo(), "main/loss", (1, "epoch"))


def test_early_stopping_max_trigger_other_than_an_interval_is_refused():
    """max_trigger is ppe's (period, unit), which is also the training length the manager reports:
    a trigger object is refused with one line, not ppe's TypeError from inside its constructor."""
    from pytorch_pfn_extras.training.triggers import IntervalTrigger

    with pytest.raises(TypeError, match=r"max_trigger must be \(period, unit\)"):
        MultiNodeEarlyStoppingTrigger(solo(), max_trigger=IntervalTrigger(5, "epoch"))
    assert MultiNodeEarlyStoppingTrigger(solo(), max_trigger=[5, "epoch"]).get_training_length() == (5, "epoch")


def test_observation_aggregator_single_rank(tmp_path):
    seen = []
    manager = manager_for(torch.nn.Linear(1, 1), tmp_path, 2, iters_per_epoch=2)
    manager.extend(ObservationAggregator(solo(), "loss", aggregator=lambda every: max(sum(every, []))))
    manager.extend(ObservationAggregator(solo(), "loss", "loss/epoch", comm_trigger=(1, "epoch")))
    manager.extend(lambda m: seen.append((m.observation.get("loss"), m.observation.get("loss/epoch"))),
                   trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            ppe.reporting.report({"loss": torch.tensor(float(manager.iteration))})
    # in place every iteration (ChainerMN's default); under a new key at the ends of epochs
    assert seen == [(0.0, None), (1.0, 0.5), (2.0, None), (3.0, 2.5)], seen


def test_observation_aggregator_refuses_to_mix_local_and_global_values():
    with pytest.raises(ValueError, match="in place needs comm_trigger"):
        ObservationAggregator(solo(), "loss", comm_trigger=(1, "epoch"))


def test_allreduce_persistent_single_rank_keeps_values():
    bn = torch.nn.BatchNorm1d(2)
    bn.running_mean.fill_(1.5)
    AllreducePersistent(bn, solo())()
    assert torch.equal(bn.running_mean, torch.full((2,), 1.5))


def test_atomic_save_leaves_only_final_file(tmp_path):
    path = str(tmp_path / "x.pt")
    atomic_save({"a": torch.ones(2)}, path)
    assert os.listdir(tmp_path) == ["x.pt"]
    assert torch.equal(torch.load(path)["a"], torch.ones(2))

    def broken(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save({}, path, savefun=broken)
    assert os.listdir(tmp_path) == ["x.pt"] and torch.equal(torch.load(path)["a"], torch.ones(2))


def test_atomic_save_takes_a_name_as_long_as_the_file_system_allows(tmp_path):
    """A final name of 253 characters (the limit is 255): its temporary keeps the name's end, and a
    failed write of it is cleaned up as any other."""
    name = "m" * 250 + ".pt"
    atomic_save({"a": 1}, str(tmp_path / name))
    assert os.listdir(tmp_path) == [name] and torch.load(tmp_path / name) == {"a": 1}

    def broken(obj, f):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_save({}, str(tmp_path / name), savefun=broken)
    assert os.listdir(tmp_path) == [name]


def test_atomic_save_returns_the_size_written_also_when_the_writer_seeks_back(tmp_path):
    """A writer that patches a header at the end (as zip or tar writers do) leaves the file's
    position short of its size: the size returned is the file's."""
    def patched(obj, f):
        f.write(b"\0" * 4 + b"x" * 1000)
        f.seek(0)
        f.write(b"HDR!")
    path = tmp_path / "x.bin"
    assert atomic_save({}, str(path), savefun=patched) == os.path.getsize(path) == 1004


def test_snapshots_are_readable_as_the_umask_says(tmp_path):
    """mkstemp's 0600 would keep the user's other jobs (an evaluation job, say) from reading them."""
    old = os.umask(0o022)
    try:
        atomic_save({}, str(tmp_path / "x.pt"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "x.pt").st_mode & 0o777 == 0o644


def test_snapshot_extension_removes_temporaries_a_killed_rank_left(tmp_path):
    left = tmp_path / ".snapshot_iter_9_rank0.g4qs10tb.tmp"
    left.write_bytes(b"half")
    other = tmp_path / ".snapshot_iter_9_rank1.abcdefgh.tmp"   # another rank's: not ours to remove
    other.write_bytes(b"half")
    # resume_latest alone leaves them: a job that only reads snapshots may call it while one is written
    assert resume_latest(torch.nn.Linear(1, 1), solo(), str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == sorted([left.name, other.name])
    manager = manager_for(torch.nn.Linear(2, 1), tmp_path, 1)
    manager.extend(multi_node_snapshot(solo(), autoload=True), trigger=(5, "iteration"))
    with manager.run_iteration():
        pass
    assert sorted(os.listdir(tmp_path)) == [other.name]


def test_snapshot_and_resume_single_rank(tmp_path):
    model = torch.nn.Linear(2, 1)
    manager = manager_for(model, tmp_path, 3)
    manager.extend(multi_node_snapshot(solo(), filename="s_{iteration:04d}_r{rank}.pt", n_retains=2),
                   trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            with torch.no_grad():
                model.bias.fill_(manager.iteration + 1)
    assert sorted(available_iterations(str(tmp_path), 0, "s_{iteration:04d}_r{rank}.pt")) == [2, 3]
    fresh = torch.nn.Linear(2, 1)

    class Models:   # resume into something other than a manager
        def load_state_dict(self, state):
            fresh.load_state_dict(state["models"]["main"])

    assert resume_latest(Models(), solo(), str(tmp_path), "s_{iteration:04d}_r{rank}.pt") == 3
    assert torch.equal(fresh.bias.detach(), torch.tensor([3.0]))


def test_early_stopping_resumed_to_train_longer_goes_on(tmp_path):
    """A run of 2 epochs snapshotted at its end, resumed with max_trigger 4 epochs: it trains on to
    epoch 4 (the snapshot's "max reached" belonged to the shorter run)."""
    def train(epochs):
        stop = MultiNodeEarlyStoppingTrigger(solo(), monitor="main/loss", patience=100, max_trigger=(epochs, "epoch"))
        manager = manager_for(torch.nn.Linear(1, 1), tmp_path, epochs, iters_per_epoch=3, stop_trigger=stop)
        manager.extend(multi_node_snapshot(solo(), autoload=True), trigger=(1, "epoch"))
        while not manager.stop_trigger:
            with manager.run_iteration():
                ppe.reporting.report({"main/loss": 1.0})
        return manager.iteration

    assert train(2) == 6
    assert train(4) == 12


def test_early_stopping_with_a_stateful_check_trigger_stops_alike_with_snapshots(tmp_path):
    """A check trigger with a state of its own (TimeTrigger: each firing answers True once) is asked
    once per iteration also where a snapshot records the check ahead of it, so snapshots do not
    change where training stops."""
    class EveryOtherCall(ppe.training.trigger.Trigger):
        def __init__(self):
            self.calls = 0

        def __call__(self, manager):
            self.calls += 1
            return self.calls % 2 == 0

    def train(snapshots, out):
        stop = MultiNodeEarlyStoppingTrigger(solo(), check_trigger=EveryOtherCall(), monitor="main/loss", patience=2,
                                             max_trigger=(30, "iteration"))
        manager = manager_for(torch.nn.Linear(1, 1), out, 30, iters_per_epoch=1, stop_trigger=stop)
        if snapshots:
            manager.extend(multi_node_snapshot(solo()), trigger=(1, "iteration"))
        while not manager.stop_trigger:
            with manager.run_iteration():
                ppe.reporting.report({"main/loss": float(manager.iteration)})  # worse every time: stops early
        return manager.iteration

    assert train(False, tmp_path / "plain") == train(True, tmp_path / "snapshots") < 30


@pytest.mark.parametrize("name", ["snap_{iteration}", "snap_{rank}", "d/snap_{iteration}_{rank}",
                                  "snap_{iteration}_{rank}_{epoch}"])
def test_snapshot_filename_must_name_iteration_and_rank(name):
    with pytest.raises(ValueError, match="snapshot filename"):
        multi_node_snapshot(solo(), filename=name)


def test_snapshot_refuses_chainermn_arguments_naming_the_change():
    """ChainerMN's multi_node_snapshot(comm, snapshot, replica_sets) wrapped a snapshot extension."""
    with pytest.raises(TypeError, match=r"ChainerMN's multi_node_snapshot\(comm, snapshot, replica_sets\)"):
        multi_node_snapshot(solo(), ppe.training.extensions.snapshot(), [[0]])
