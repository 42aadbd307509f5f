"""torchmn.checkpoint: real jobs that write checkpoints, get killed, and resume bit for bit."""
from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
import torch

from jobs import WORKERS, assert_check_passed, check_job_output, run_job, run_one_process, start_forked_job

TRAIN = WORKERS / "checkpoint_train.py"
CHECKS = WORKERS / "checkpoint_checks.py"
ALL = ("keep_prunes_old_steps", "torn_or_partial_steps_are_never_loaded", "another_model_is_named",
       "newer_step_of_another_run_is_not_overwritten", "unwritable_directory_is_named",
       "ranks_saving_different_steps_are_named", "ranks_saving_a_step_again_and_a_new_one_are_named",
       "a_load_refused_on_one_rank_fails_every_rank_at_once", "resumable_loader_continues_exactly",
       "multi_node_iterator_position", "damaged_manifest_is_named", "manifest_that_cannot_be_written_fails_every_rank",
       "a_step_saved_again_is_left_as_it_is", "multi_node_iterator_resume_leaves_the_rng_as_the_old_run",
       "a_directory_per_rank_is_refused", "a_step_that_is_no_whole_number_is_refused")


def same_parameters(a: str, b: str) -> bool:
    first, second = torch.load(a), torch.load(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.check_job("checkpoint")
@pytest.mark.parametrize("check", ALL)
def test_checkpoint(check, request, tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "checkpoint-checks"
    root.mkdir(exist_ok=True)
    proc = check_job_output(request, lambda checks: run_job(CHECKS, [str(root), *checks], np=2, timeout=180,
                                                            check=False))
    assert_check_passed(proc, check)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["replicated", "sharded", "default"])
def test_checkpoint_stop_and_resume_is_bit_exact(optimizer, tmp_path):
    """A run stopped after step 33 and resumed from its step-30 checkpoint ends with the parameters
    of an uninterrupted run, for each optimizer (model, optimizer, scheduler, data position and
    every rank's dropout RNG all come back)."""
    common = ["--steps", "60", "--every", "5", "--optimizer", optimizer]
    run_job(TRAIN, ["--dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt"), *common], timeout=120)
    short = [a if a != "60" else "33" for a in common]
    run_job(TRAIN, ["--dir", str(tmp_path / "ck"), "--out", str(tmp_path / "short.pt"), *short], timeout=120)
    resumed = run_job(TRAIN, ["--dir", str(tmp_path / "ck"), "--out", str(tmp_path / "out.pt"), *common], timeout=120)
    assert "starting at step 30" in resumed.stdout
    assert same_parameters(str(tmp_path / "ref.pt"), str(tmp_path / "out.pt"))


@pytest.mark.timeout(240)
def test_checkpoint_loads_on_another_rank_count(tmp_path):
    run_job(TRAIN, ["--dir", str(tmp_path / "two_ranks"), "--out", str(tmp_path / "x.pt"), "--steps", "10",
                    "--every", "10", "--optimizer", "sharded"], timeout=120)
    proc = run_one_process(CHECKS, [str(tmp_path), "loads_on_another_rank_count"], timeout=120)
    assert_check_passed(proc, "loads_on_another_rank_count")


PRUNE_FAILS = """
import sys, warnings, torch, torchmn
from torchmn.checkpoint import Checkpointer, files

def cannot_remove(directory, step):  # a step of another user's, a read-only mount
    raise PermissionError(13, "Permission denied", f"{directory}/step_{step:08d}/COMPLETE")

comm = torchmn.create_communicator()
ckpt = Checkpointer(sys.argv[1], comm, keep=1, model=torch.nn.Linear(4, 4))
ckpt.save(3)
files.remove_step = cannot_remove
for step in (6, 9):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.save(step)
    print(f"SAVED {step}", "WARNED" if any("could not be removed" in str(w.message) for w in caught) else "", flush=True)
print("LATEST", ckpt.complete_steps()[-1], flush=True)
"""


def test_checkpoint_old_step_that_cannot_be_removed_is_warned_of_not_raised(tmp_path):
    """keep=N removes old steps after a save is complete: one that cannot be removed is warned of
    on rank 0 (which prunes) and every rank's save() returns, instead of rank 0 alone raising."""
    script = tmp_path / "prune_fails.py"
    script.write_text(PRUNE_FAILS)
    proc = run_job(script, [str(tmp_path / "ckpt")], np=2, timeout=90)
    lines = sorted(line for line in proc.stdout.splitlines() if "SAVED" in line or "LATEST" in line)
    assert lines == ["[0] LATEST 9", "[0] SAVED 6 WARNED", "[0] SAVED 9 WARNED",
                     "[1] LATEST 9", "[1] SAVED 6 ", "[1] SAVED 9 "], proc.stdout + proc.stderr


def newest_step(directory) -> int:
    """The newest step with a folder in a checkpoint directory (written completely or not), or -1."""
    steps = [int(p.name[5:]) for p in directory.glob("step_*") if p.name[5:].isdigit()]
    return max(steps, default=-1)


@pytest.mark.timeout(600)
def test_checkpoint_survives_20_kills_of_a_random_rank(tmp_path):
    """20 times, a random rank is SIGKILLed at a random moment, 1 to 6 steps after the job
    (re)started, of a loop that checkpoints every step (each rank's file carries 16 MB of ballast,
    so writing takes most of a step and most kills land in a write). Every resume loads a complete
    checkpoint (the script checks the parameters against the digest saved with them), the steps
    resumed from never go back, and the final parameters equal an uninterrupted run's bit for bit."""
    args = ["--steps", "200", "--every", "1", "--ballast", "16", "--keep", "2"]
    # Neither the ballast nor how often a run saves changes a number, so the uninterrupted run and
    # the last one (which resumes from the newest checkpoint the kills left) go without them, fast.
    quiet = ["--steps", "200", "--every", "200"]
    run_job(TRAIN, ["--dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt"), *quiet], timeout=180)
    chance = random.Random(int(os.environ.get("TORCHMN_TEST_SEED", "0")))
    resumed_from, kills, torn = [], 0, 0
    while kills < 20:
        job = start_forked_job(TRAIN, ["--dir", str(tmp_path / "ck"), "--out", str(tmp_path / "out.pt"), *args],
                               np=2, timeout=120)
        try:
            deadline = time.monotonic() + 60
            while len(starts := re.findall(r"starting at step (\d+)", job.output())) < 2:
                assert time.monotonic() < deadline, job.output("err")
                time.sleep(0.01)
            resumed_from.append(int(starts[0]))
            # A random number of checkpoints later (so that the kills keep pace with the training
            # on a machine of any speed), at a random moment within a step.
            target = resumed_from[-1] + chance.randint(1, 6)
            deadline = time.monotonic() + 60
            while newest_step(tmp_path / "ck") < target and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(chance.uniform(0.0, 0.03))
            try:
                os.kill(chance.choice(job.pids), signal.SIGKILL)
            except ProcessLookupError:
                pytest.fail("the job ended before it was killed: give it more steps")
            kills += 1
        finally:
            ended = job.wait()
        assert "differ from those saved" not in ended.stdout + ended.stderr, ended.stdout + ended.stderr
        assert ended.returncode != 0, "the job ended before it was killed: give it more steps"
        steps = sorted((tmp_path / "ck").glob("step_*"))
        torn += bool(steps) and not (steps[-1] / "COMPLETE").exists()
    assert resumed_from == sorted(resumed_from), resumed_from
    assert torn >= 3, f"only {torn} of the 20 kills interrupted a checkpoint being written"
    final = run_job(TRAIN, ["--dir", str(tmp_path / "ck"), "--out", str(tmp_path / "out.pt"), *quiet], timeout=180)
    assert "done at step 200" in final.stdout
    assert resumed_from[-1] > 0, resumed_from
    assert same_parameters(str(tmp_path / "ref.pt"), str(tmp_path / "out.pt"))


@pytest.mark.parametrize("other", [{"batch_size": 3}, {"shuffle": False}])
def test_resumable_loader_refuses_a_position_taken_with_other_batches(other):
    """A position taken mid-epoch with another batch size or order would skip other samples than
    those taken (repeating some, losing others): refused, naming both; at an epoch's start it is
    taken."""
    from torchmn.checkpoint import ResumableLoader
    data = list(range(12))
    first = ResumableLoader(data, batch_size=4, shuffle=True, seed=0)
    next(iter(first))
    resumed = ResumableLoader(data, **{"batch_size": 4, "shuffle": True, "seed": 0, **other})
    with pytest.raises(ValueError, match=f"taken with {next(iter(other))}=.*; this loader has {next(iter(other))}="):
        resumed.load_state_dict(first.state_dict())
    resumed.load_state_dict({**first.state_dict(), "batches": 0, "epoch": 1})
    assert resumed.epoch == 1 and resumed.batches == 0


@pytest.mark.parametrize("seed", [2**63 - 1, 2**70, -5])
def test_resumable_loader_takes_any_int_seed(seed):
    """A seed torch's generator takes, and a larger or negative one, shuffles (the epoch is mixed in
    modulo 2^64); seeds that fitted before keep their orders."""
    from torchmn.checkpoint import ResumableLoader
    loader = ResumableLoader(list(range(8)), batch_size=4, shuffle=True, seed=seed)
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(8))
    small = ResumableLoader(list(range(8)), batch_size=8, shuffle=True, seed=3)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(3 * 1_000_003)).tolist()
    assert next(iter(small)).tolist() == order
