"""Checks of torchmn.checkpoint that run inside every rank of a job (rank 0 prints "PASS <check>").

    torchmn run -np 2 python checkpoint_checks.py DIR CHECK [CHECK ...]
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

import torchmn
from torchmn.checkpoint import CheckpointError, Checkpointer, ResumableLoader

warnings.filterwarnings("ignore", message=".*NodeShared.*")


def small_model(width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))


def expect_error(call, *words):
    try:
        call()
    except CheckpointError as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return str(e)
    raise AssertionError("no CheckpointError")


def listing(directory: str) -> dict:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f))
            for d, _, names in os.walk(directory) for f in names}


def check_keep_prunes_old_steps(comm, root):
    model = small_model()
    ckpt = Checkpointer(os.path.join(root, "keep"), comm, keep=2, model=model)
    for step in (5, 10, 15):
        ckpt.save(step)
    comm.allgather_obj(None)
    assert ckpt.complete_steps() == [10, 15], ckpt.complete_steps()


def check_torn_or_partial_steps_are_never_loaded(comm, root):
    directory = os.path.join(root, "torn")
    model = small_model()
    ckpt = Checkpointer(directory, comm, keep=5, model=model)
    ckpt.save(1)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ckpt.save(2)
    ckpt.save(3)
    comm.allgather_obj(None)
    if comm.rank == 0:
        # Step 3: a rank's file cut short (a copy that broke off). Step 4: no manifest (a kill).
        with open(os.path.join(directory, "step_00000003", "rank00001.pt" if comm.size > 1 else "rank00000.pt"),
                  "r+b") as f:
            f.truncate(10)
        os.makedirs(os.path.join(directory, "step_00000004"))
        with open(os.path.join(directory, "step_00000004", "shared.pt"), "wb") as f:
            f.write(b"partial")
    comm.allgather_obj(None)
    fresh = small_model()
    resumed = Checkpointer(directory, comm, model=fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resumed.load_latest() == 2
    said = [str(w.message) for w in caught if "damaged" in str(w.message)]
    if comm.rank == 0:  # rank 0 chooses the step, and says why it skipped one
        assert len(said) == 1 and "step 3" in said[0] and "bytes, the manifest says" in said[0] \
            and "resuming from step 2" in said[0], said
    assert torch.equal(fresh[0].weight, model[0].weight)
    # The run that skipped the damaged step 3 writes it again.
    resumed.save(3)
    comm.allgather_obj(None)
    assert resumed.complete_steps() == [1, 2, 3], resumed.complete_steps()
    # A file of the right size whose bytes are wrong: its path, and how to go back a step.
    if comm.rank == 0:
        path = os.path.join(directory, "step_00000003", "shared.pt")
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(bytes(size))
    comm.allgather_obj(None)
    expect_error(Checkpointer(directory, comm, model=small_model()).load_latest,
                 os.path.join("step_00000003", "shared.pt"), "cannot be read", "away to resume from the step before")


def check_damaged_manifest_is_named(comm, root):
    """A manifest cut short after the step was complete (it is written whole, so only damage does
    that), or valid JSON of another shape (overwritten by hand, another tool's file): the step is
    skipped with a warning that says so, on rank 0 as on the others, not silently."""
    directory = os.path.join(root, "manifest")
    ckpt = Checkpointer(directory, comm, model=small_model())
    ckpt.save(1)
    ckpt.save(2)
    manifest = os.path.join(directory, "step_00000002", "COMPLETE")
    for damage, words in ((lambda f: f.truncate(5), "its manifest COMPLETE cannot be read"),
                          (lambda f: (f.truncate(0), f.write(b"[1, 2]")), "is not a torchmn checkpoint's")):
        comm.allgather_obj(None)
        if comm.rank == 0:
            with open(manifest, "r+b") as f:
                damage(f)
        comm.allgather_obj(None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert Checkpointer(directory, comm, model=small_model()).load_latest() == 1
        said = [str(w.message) for w in caught if "damaged" in str(w.message)]
        if comm.rank == 0:
            assert len(said) == 1 and "step 2" in said[0] and words in said[0], said


def check_manifest_that_cannot_be_written_fails_every_rank(comm, root):
    """The disk fills as rank 0 marks the step complete: every rank gets the CheckpointError (the
    others had returned from save() and trained on, to be stopped by rank 0's OSError)."""
    from torchmn.checkpoint import files
    ckpt = Checkpointer(os.path.join(root, "full"), comm, model=small_model())
    ckpt.save(1)
    write = files.write_manifest
    if comm.rank == 0:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")
        files.write_manifest = full_disk
    try:
        expect_error(lambda: ckpt.save(2), "save(2) failed on rank 0", "writing its manifest COMPLETE",
                     "No space left on device", "older complete steps are kept")
    finally:
        files.write_manifest = write
    comm.allgather_obj(None)
    assert ckpt.complete_steps() == [1], ckpt.complete_steps()


def check_another_model_is_named(comm, root):
    directory = os.path.join(root, "other_model")
    Checkpointer(directory, comm, model=small_model(8)).save(1)
    comm.allgather_obj(None)
    before = listing(directory)
    comm.allgather_obj(None)  # every rank has listed before rank 0 puts its probe file there
    wider = small_model(16)
    kept = wider[0].weight.clone()
    expect_error(Checkpointer(directory, comm, model=wider).load_latest,
                 "another model", "0.weight is (8, 4) in the checkpoint, (16, 4) in the model", "on rank 0")
    renamed = torch.nn.Sequential(torch.nn.Linear(4, 8))
    renamed.add_module("head", torch.nn.Linear(8, 2))
    expect_error(Checkpointer(directory, comm, model=renamed).load_latest,
                 "missing from the checkpoint: head.weight, head.bias", "not in the model: 1.weight, 1.bias")
    assert torch.equal(wider[0].weight, kept), "a refused checkpoint changed the model"
    assert listing(directory) == before, "a refused load changed the files"


def check_newer_step_of_another_run_is_not_overwritten(comm, root):
    directory = os.path.join(root, "newer")
    Checkpointer(directory, comm, model=small_model()).save(50)
    comm.allgather_obj(None)
    before = listing(directory)
    comm.allgather_obj(None)  # every rank has listed before rank 0 puts its probe file there
    fresh = Checkpointer(directory, comm, model=small_model())
    expect_error(lambda: fresh.save(10), "complete checkpoint of step 50", "load_latest()", "nothing was overwritten")
    assert listing(directory) == before
    # A run that did resume from it, saving an older step, is told so, not to call load_latest().
    assert fresh.load_latest() == 50
    expect_error(lambda: fresh.save(10), "this run resumed from step 50 already", "must grow")
    assert listing(directory) == before


def check_a_step_saved_again_is_left_as_it_is(comm, root):
    """Saving every 5 steps and at each epoch's end of 5 steps meets: the second save of a step
    leaves it as it is; an older step than one saved is refused in words about this run."""
    directory = os.path.join(root, "twice")
    model = small_model()
    ckpt = Checkpointer(directory, comm, model=model)
    ckpt.save(5)
    ckpt.save(5)
    ckpt.save(10)
    comm.allgather_obj(None)
    assert ckpt.complete_steps() == [5, 10], ckpt.complete_steps()
    expect_error(lambda: ckpt.save(7), "this run saved step 10 already", "must grow")


def check_unwritable_directory_is_named(comm, root):
    blocker = os.path.join(root, "a_file")
    if comm.rank == 0:
        with open(blocker, "w") as f:
            f.write("not a directory")
    comm.allgather_obj(None)
    expect_error(lambda: Checkpointer(os.path.join(blocker, "ckpt"), comm, model=small_model()),
                 "failed on rank 0", "cannot create files in the checkpoint directory", "choose a directory")
    expect_error(lambda: Checkpointer(blocker, comm, model=small_model()),
                 "failed on rank 0", f"the checkpoint directory {blocker} is a file, not a directory")
    with open(blocker) as f:
        assert f.read() == "not a directory"


def check_a_directory_per_rank_is_refused(comm, root):
    """Ranks given different directories (a per-rank path by mistake) are refused at once on every
    rank, naming both directories: each would hold its own part, and no step could be loaded."""
    mine = os.path.join(root, f"per_rank_{comm.rank}")
    message = expect_error(lambda: Checkpointer(mine, comm, model=small_model()), "failed on rank 1",
                           "give every rank the same directory", os.path.join(root, "per_rank_0"))
    assert os.path.join(root, "per_rank_1") in message, message
    # One directory reached through another path (a link, as another node's mount point) is the same place.
    if comm.rank == 0:
        os.makedirs(os.path.join(root, "shared_ckpt"), exist_ok=True)
        if not os.path.lexists(os.path.join(root, "mounted_here")):
            os.symlink(os.path.join(root, "shared_ckpt"), os.path.join(root, "mounted_here"))
    comm.allgather_obj(None)
    ckpt = Checkpointer(os.path.join(root, "shared_ckpt" if comm.rank == 0 else "mounted_here"), comm,
                        model=small_model())
    ckpt.save(3)
    assert ckpt.complete_steps() == [3], ckpt.complete_steps()


def check_a_step_that_is_no_whole_number_is_refused(comm, root):
    """save() takes a non-negative whole number of steps; anything else is refused at once, as its
    docstring says (ValueError), writing nothing."""
    ckpt = Checkpointer(os.path.join(root, "bad_steps"), comm, model=small_model())
    for step in (None, "3", -1, 2.5, True):
        try:
            ckpt.save(step)
        except ValueError as e:
            assert "must be a non-negative integer" in str(e), (step, e)
        else:
            raise AssertionError(f"save({step!r}) was not refused")
    assert ckpt.complete_steps() == [], ckpt.complete_steps()


def check_ranks_saving_different_steps_are_named(comm, root):
    ckpt = Checkpointer(os.path.join(root, "steps"), comm, model=small_model())
    if comm.size > 1:
        expect_error(lambda: ckpt.save(10 + comm.rank), "rank 0: 10", "rank 1: 11")
    assert ckpt.complete_steps() == []


def check_ranks_saving_a_step_again_and_a_new_one_are_named(comm, root):
    """Rank 0 saves the step it saved last again (left as it is, alone), rank 1 a new one: both told."""
    ckpt = Checkpointer(os.path.join(root, "again_and_new"), comm, model=small_model())
    ckpt.save(10)
    if comm.size > 1:
        expect_error(lambda: ckpt.save(10 if comm.rank == 0 else 11), "rank 0: 10", "rank 1: 11")
    comm.allgather_obj(None)
    assert ckpt.complete_steps() == [10], ckpt.complete_steps()


def check_a_load_refused_on_one_rank_fails_every_rank_at_once(comm, root):
    """Rank 0's loader refuses the saved position (its data grew) while the default optimizer,
    listed after it, loads with a barrier: every rank is told what rank 0 refused, at once."""
    directory = os.path.join(root, "refused_on_one")

    def build(extra):
        model = small_model()
        optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
        loader = ResumableLoader(list(range(16 + extra)), batch_size=4, seed=comm.rank)
        return model, optimizer, Checkpointer(directory, comm, loader=loader, model=model, optimizer=optimizer)

    model, optimizer, ckpt = build(0)
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    ckpt.save(1)
    _, _, ckpt = build(1 if comm.rank == 0 else 0)
    if comm.size > 1:
        expect_error(ckpt.load_latest, "failed on rank 0", "loader: ")
        comm.allgather_obj(None)  # the ranks are still in step


def check_loads_on_another_rank_count(comm, root):
    """Run on 1 rank over a checkpoint a 2-rank job of checkpoint_train.py wrote with the sharded
    optimizer: model and optimizer load; the per-rank data position refuses, naming both counts."""
    directory = os.path.join(root, "two_ranks")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(64, 4)).double()
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm,
                                                    shard_state=True)
    loader = ResumableLoader(list(range(200)), batch_size=8, seed=10)
    expect_error(Checkpointer(directory, comm, model=model, optimizer=optimizer, loader=loader).load_latest,
                 "written by 2 ranks and this job has 1", "loader", "Resume with 2 ranks")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = Checkpointer(directory, comm, model=model, optimizer=optimizer).load_latest()
    assert step == 10, step
    assert any("written by 2 ranks and is loaded on 1" in str(w.message) for w in caught), caught
    state = optimizer.state_dict()["state"]
    assert len(state) == 4 and all(int(s["step"]) == 10 for s in state.values()), state
    saved = torch.load(os.path.join(directory, "step_00000010", "shared.pt"), weights_only=False)["model"]
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    # The two parts, merged, are the whole state: every element of exp_avg is set.
    assert all((s["exp_avg"] != 0).all() for s in state.values())
    # The per-rank values of save(**extra): rank 0's, where another number of ranks wrote them.
    loaded = Checkpointer(directory, comm, model=model, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded.load_latest()
    assert set(loaded.extra) == {"digest", "ballast"}, loaded.extra
    # An optimizer of another kind than the saving run's (alone, the replicated one; there, the
    # sharded one, which saves parts): the parts are merged into its whole state.
    replicated = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), comm,
                                                     shard_state=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Checkpointer(directory, comm, model=model, optimizer=replicated).load_latest() == 10
    again = replicated.state_dict()["state"]
    assert all(torch.equal(again[i]["exp_avg"], state[i]["exp_avg"]) for i in state), "merged state differs"


def check_resumable_loader_continues_exactly(comm, root):
    data = list(range(45))
    reference = ResumableLoader(data, batch_size=4, seed=3, drop_last=False)
    expected = [b.tolist() for _ in range(3) for b in reference]
    for cut in (1, 11, 12, 13, 24, 30):
        first = ResumableLoader(data, batch_size=4, seed=3)
        got = []
        while len(got) < cut:
            for b in first:
                got.append(b.tolist())
                if len(got) == cut:
                    break
        second = ResumableLoader(data, batch_size=4, seed=3)
        second.load_state_dict(first.state_dict())
        while len(got) < len(expected):
            got.extend(b.tolist() for b in second)
        assert got == expected, cut
    try:
        ResumableLoader(data[:40], batch_size=4, seed=3).load_state_dict(reference.state_dict())
        raise AssertionError("a position over another dataset loaded")
    except ValueError as e:
        assert "45 samples" in str(e) and "40 samples" in str(e)


def check_multi_node_iterator_position(comm, root):
    """A multi-node iterator resumes mid-epoch: over a ResumableLoader from its state, over a
    plain unshuffled DataLoader by reading past the batches taken."""
    for stateful in (True, False):
        data = list(range(30))
        make = ((lambda: ResumableLoader(data, batch_size=4, seed=1)) if stateful
                else (lambda: torch.utils.data.DataLoader(data, batch_size=4)))
        it = torchmn.create_multi_node_iterator(make() if comm.rank == 0 else None, comm)
        expected = [b.tolist() for _ in range(2) for b in it]
        it = torchmn.create_multi_node_iterator(make() if comm.rank == 0 else None, comm)
        got = []
        for b in it:
            got.append(b.tolist())
            if len(got) == 3:
                break
        state = comm.bcast_obj(it.state_dict())
        it = torchmn.create_multi_node_iterator(make() if comm.rank == 0 else None, comm)
        it.load_state_dict(state)
        got.extend(b.tolist() for b in it)
        assert (it.epoch, it.batches) == (1, 0), (it.epoch, it.batches)
        got.extend(b.tolist() for b in it)
        assert got == expected and it.epoch == 2, (stateful, got, expected)


def check_multi_node_iterator_resume_leaves_the_rng_as_the_old_run(comm, root):
    """Resumed mid-epoch over a plain DataLoader, the iterator reads past the batches taken; the
    random draws that makes (the loader's seed at iter(), drawn by the old run before its
    checkpoint) are not drawn twice: dropout masks after the resume are the old run's."""
    directory = os.path.join(root, "iterator_rng")
    make = lambda: torch.utils.data.DataLoader(list(range(40)), batch_size=4)  # noqa: E731
    torch.manual_seed(comm.rank)
    it = torchmn.create_multi_node_iterator(make() if comm.rank == 0 else None, comm)
    ckpt = Checkpointer(directory, comm, iterator=it)
    batches = iter(it)
    next(batches), next(batches)
    ckpt.save(2)
    old = [next(batches).tolist(), torch.rand(3).tolist()]
    it = torchmn.create_multi_node_iterator(make() if comm.rank == 0 else None, comm)
    resumed = Checkpointer(directory, comm, iterator=it)
    assert resumed.load_latest() == 2
    batches = iter(it)
    new = [next(batches).tolist(), torch.rand(3).tolist()]
    assert new == old, (new, old)


if __name__ == "__main__":
    comm = torchmn.create_communicator()
    for name in sys.argv[2:]:
        globals()[f"check_{name}"](comm, sys.argv[1])
        if comm.rank == 0:
            print(f"PASS {name}", flush=True)
    comm.finalize()
