"""Elastic jobs (`torchmn run --min-np/--max-np`): real ranks killed with SIGKILL while they train,
survivors going on in the same processes, new ranks joining through a discovery script, and the
result checked against a replay of the same membership schedule without failures."""
import datetime
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from jobs import REPO, clean_env
from torchmn.elastic import protocol
from torchmn.run.config import LaunchConfig, RunError
from torchmn.run.elastic import choose_leavers, parse_discovery, place_workers
from torchmn.run.plan import place_env

PY = sys.executable
TRAIN = str(REPO / "tests" / "workers" / "elastic_train.py")


# -- the pieces, without processes ---------------------------------------------------------------

def test_elastic_discovery_output_is_parsed():
    assert parse_discovery("node1:2\n# spare\nnode2\n\n", "d.sh") == {"node1": 2, "node2": 1}
    assert parse_discovery("node1:2\nnode3:0\nnode1:1\n", "d.sh") == {"node1": 1, "node3": 0}  # 0: drained
    for bad in ("node1:x", "node1:-1"):
        with pytest.raises(RunError, match=f"line 1 is '{bad}'"):
            parse_discovery(f"{bad}\n", "d.sh")


def test_elastic_discovery_script_may_be_a_command_line(tmp_path, capsys):
    """As Horovod takes it: --host-discovery-script "python3 discover.py"."""
    from torchmn.cli import main

    (tmp_path / "discover.py").write_text("print('localhost:2')\n")
    assert main(["run", "--dry-run", "-np", "2", "--min-np", "1", "--host-discovery-script",
                 f"{sys.executable} {tmp_path / 'discover.py'}", sys.executable, "-c", "pass"]) == 0, \
        capsys.readouterr().err


def test_elastic_places_count_local_ranks_per_host():
    slots = place_workers([(4, "a"), (1, "b"), (7, "a")])
    assert [(s.rank, s.size, s.local_rank, s.local_size, s.node_rank, s.node_count, s.host) for s in slots] == \
        [(0, 3, 0, 2, 0, 2, "a"), (1, 3, 0, 1, 1, 2, "b"), (2, 3, 1, 2, 0, 2, "a")]
    members = [(4, place_env(slots[0])), (1, place_env(slots[1]))]
    assert protocol.load_members(protocol.dump_members(members)) == members


@pytest.mark.parametrize("workers,offered,keep,holders,leavers", [
    ([(0, "a"), (1, "a"), (2, "a")], {"a": 1}, 1, {0, 1, 2}, [2, 1]),       # newest first, down to the offer
    ([(0, "a"), (3, "b"), (5, "b")], {"a": 1}, 1, {0, 3, 5}, [5, 3]),       # a host no longer offered: all of it
    ([(0, "a"), (1, "a"), (2, "a")], {"a": 0}, 2, {0, 1, 2}, [2]),          # never below --min-np
    ([(0, "a"), (1, "b"), (2, "b")], {"a": 1, "b": 0}, 1, {2}, [1]),        # the last that holds the state stays
    ([(0, "a"), (1, "a")], {"a": 2}, 1, {0, 1}, []),                       # within the offer: nobody
])
def test_elastic_fewer_slots_offered_choose_the_newest_workers_to_leave(workers, offered, keep, holders, leavers):
    assert choose_leavers(workers, offered, keep, holders) == leavers


@pytest.mark.parametrize("script,words", [
    ("missing.sh", "could not run: [Errno 2]"),
    ("fails.sh", "exited with 3: no hosts here"),
    ("garbage.sh", "line 1 is 'node1:x'"),
])
def test_elastic_discovery_script_is_checked_before_any_rank_starts(tmp_path, capsys, script, words):
    from torchmn.cli import main

    (tmp_path / "fails.sh").write_text("#!/bin/sh\necho 'no hosts here' >&2\nexit 3\n")
    (tmp_path / "garbage.sh").write_text("#!/bin/sh\necho node1:x\n")
    for path in tmp_path.glob("*.sh"):
        path.chmod(0o755)
    started = tmp_path / "started"
    argv = ["-np", "2", "--min-np", "1", "--host-discovery-script", str(tmp_path / script),
            sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    for dry in ([], ["--dry-run"]):
        assert main(["run", *dry, *argv]) == 2
        err = capsys.readouterr().err
        assert f"--host-discovery-script {tmp_path / script}" in err and words in err, err
    assert not started.exists()


def test_elastic_config_checks_the_bounds():
    config = LaunchConfig(["python", "x.py"], np=4, min_np=2)
    assert config.elastic and (config.min_np, config.max_np) == (2, 4)
    assert not LaunchConfig(["python", "x.py"], np=4).elastic
    with pytest.raises(RunError, match="1 <= --min-np <= -np <= --max-np"):
        LaunchConfig(["python", "x.py"], np=4, min_np=5)
    with pytest.raises(RunError, match="--max-restarts and --min-np"):
        LaunchConfig(["python", "x.py"], np=4, min_np=2, max_restarts=1)
    with pytest.raises(RunError, match="--monitor and --timeline do not follow"):
        LaunchConfig(["python", "x.py"], np=4, min_np=2, monitor=True)


def test_elastic_options_without_min_np_are_noted(capsys):
    from torchmn.cli import main
    assert main(["run", "--dry-run", "-np", "1", "--elastic-timeout", "5", "true"]) == 0
    assert "--elastic-timeout and --reset-limit do nothing without --min-np N" in capsys.readouterr().err


# -- real jobs -----------------------------------------------------------------------------------

class ElasticRun:
    """A ``torchmn run`` elastic job of ``elastic_train.py`` in the background, with the means to
    kill its workers and end it."""

    def __init__(self, out: Path, np: int, launcher_args: list, train_args: list, timeout: float,
                 script: str = TRAIN):
        self.out, self.timeout, self.script = out, timeout, script
        self.started = time.monotonic()
        self.log = open(out / "launcher.log", "w")
        self.proc = subprocess.Popen([PY, "-m", "torchmn", "run", "-np", str(np), *launcher_args, PY, script,
                                      str(out), *train_args], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=clean_env(), cwd=REPO, start_new_session=True)

    def progress(self) -> list:
        """(time, step, world size) per step so far, from rank 0."""
        path = self.out / "progress"
        if not path.exists():
            return []
        # Only whole lines: the reader may see rank 0's last write half done (or cut by a SIGKILL).
        lines = path.read_text().split("\n")[:-1]
        rows = [line.split() for line in lines]
        return [(float(row[0]), int(row[1]), int(row[2])) for row in rows if len(row) == 3]

    def wait_for(self, condition, what: str) -> None:
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended while waiting for {what}:\n{self.output()[-4000:]}")
            if time.monotonic() - self.started > self.timeout:
                raise AssertionError(f"timed out waiting for {what}:\n{self.stacks()[-12000:]}")
            time.sleep(0.05)

    def steps_at(self, size: int, after: int = 0) -> int:
        return sum(1 for _, s, n in self.progress() if n == size and s > after)

    def worker_pids(self) -> dict:
        pids = {}
        for path in (self.out / "pids").glob("*"):
            pid = int(path.read_text() or 0)
            if pid and _alive(pid):
                pids[int(path.name)] = pid
        return pids

    def kill(self, *workers: int) -> int:
        """SIGKILL these workers at once; the last step done before (rank 0's progress)."""
        step = self.progress()[-1][1]
        pids = self.worker_pids()
        for worker in workers:
            os.kill(pids[worker], signal.SIGKILL)
        return step

    def ended(self, timeout: float) -> str:
        """The output, once the job ended by itself (within ``timeout`` seconds)."""
        self.proc.wait(timeout=timeout)
        return self.output()

    def finish(self) -> subprocess.CompletedProcess:
        (self.out / "stop").write_text("")
        try:
            self.proc.wait(timeout=max(1.0, self.timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"the job did not end:\n{self.output()[-4000:]}")
        finally:
            self.log.close()
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.output(), "")

    def stacks(self) -> str:
        """The output, after every live worker printed its threads' stacks where its script does so
        on SIGUSR1 (elastic_train.py; the signal would end the others)."""
        if self.script != TRAIN:
            return self.output()
        for pid in self.worker_pids().values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
        return self.output()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.out / "launcher.log").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def replay(sizes: list, reverse: bool = False, lr_per_rank: float | None = None) -> list:
    """The parameters after training with the world sizes ``sizes``, one step each, in one process:
    each step's gradient the mean of every rank's, in the job's arithmetic (each rank's gradient of
    its own loss, summed, then divided by the world size). ``reverse`` sums the ranks' gradients in
    the other order: the job's reduction order is gloo's, so only the order of the sum's terms may
    differ from the job's. ``lr_per_rank``: each step's learning rate is it times that step's world
    size (elastic_train.py's --lr-per-rank), instead of 0.05."""
    sys.path.insert(0, str(REPO / "tests" / "workers"))
    try:
        import importlib
        train = importlib.import_module("elastic_train_model")
    finally:
        sys.path.pop(0)
    model = train.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, size in enumerate(sizes):
        grads = []
        for r in range(size):
            optimizer.zero_grad()
            train.loss_of(model, step, r, size).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *each in zip(model.parameters(), *(grads[::-1] if reverse else grads)):
            total = each[0].clone()
            for g in each[1:]:
                total += g
            p.grad = total.div_(size)
        if lr_per_rank is not None:
            optimizer.param_groups[0]["lr"] = lr_per_rank * size
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def check_against_replay(out: Path, lr_per_rank: float | None = None) -> dict:
    """The job's result equals the replay of its world sizes within float64 rounding: 1e-10, or ten
    times the gap between the replay's two summation orders where a long run (thousands of steps,
    when new ranks start slowly on a loaded machine) has grown that gap past 1e-11."""
    result = torch.load(out / "result.pt")
    expected = replay(result["sizes"], lr_per_rank=lr_per_rank)
    reordered = replay(result["sizes"], reverse=True, lr_per_rank=lr_per_rank)
    order_gap = max((a - b).abs().max().item() for a, b in zip(expected, reordered))
    atol = max(1e-10, 10 * order_gap)
    for got, want in zip(result["params"], expected):
        assert got.dtype == torch.float64
        assert torch.allclose(got, want, rtol=0, atol=atol), ((got - want).abs().max(), atol, len(result["sizes"]))
    return result


def discovery_script(tmp_path: Path, slots: int) -> str:
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho localhost:{slots}\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_elastic_twenty_kills_match_a_replay_of_the_membership(tmp_path):
    """A 4-rank job (--min-np 2) loses a random rank to SIGKILL 20 times; each time the survivors go
    on, and the discovery script offers the slot back, so a new rank joins. After every step all
    ranks hold the same parameters, and the end result equals a one-process replay of the same
    world sizes and batches (float64, within rounding: see check_against_replay)."""
    random.seed(1)
    job = ElasticRun(tmp_path, 4, ["--min-np", "2", "--max-np", "4", "--host-discovery-script",
                                   discovery_script(tmp_path, 4)], ["--steps", "100000", "--step-sleep", "0.05"],
                     timeout=860)  # about 150 s alone; a new worker's start-up takes four times as long beside the full suite
    try:
        job.wait_for(lambda: job.steps_at(4) >= 3, "the first steps")
        for kill in range(20):
            step = job.progress()[-1][1]
            job.wait_for(lambda: job.steps_at(4, after=step) >= 2, f"4 ranks again before kill {kill + 1}")
            step = job.kill(random.choice(sorted(job.worker_pids())))
            job.wait_for(lambda: job.steps_at(3, after=step) >= 1, f"the survivors' next step after kill {kill + 1}")
        done = job.finish()
    finally:
        job.stop()
    assert done.returncode == 0, done.stdout[-4000:]
    assert "MISMATCH" not in done.stdout
    assert len(re.findall(r"^torchmn run: worker \d+ \(host .*\) was killed by signal SIGKILL", done.stdout, re.M)) == 20
    result = check_against_replay(tmp_path)
    assert 3 in result["sizes"] and result["sizes"][-1] in (3, 4)


def kill_one_and_refill(tmp_path: Path, train_args: list, np: int = 3, steps: int = 2) -> subprocess.CompletedProcess:
    """An ``np``-rank elastic job (--min-np np-1) of elastic_train.py with ``train_args``: worker 1 is
    killed after a few steps, the survivors take ``steps`` steps, a new rank refills the slot and
    all take ``steps`` more; the finished job."""
    job = ElasticRun(tmp_path, np, ["--min-np", str(np - 1), "--max-np", str(np)],
                     ["--steps", "100000", "--step-sleep", "0.05", *train_args], timeout=240)
    try:
        job.wait_for(lambda: job.steps_at(np) >= 5, "the first steps")
        step = job.kill(1)
        job.wait_for(lambda: job.steps_at(np - 1, after=step) >= steps, "the survivors' steps")
        job.wait_for(lambda: job.steps_at(np, after=step) >= steps, "the refilled slot's steps")
        done = job.finish()
    finally:
        job.stop()
    assert done.returncode == 0, done.stdout[-4000:]
    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shard_state", ["true", "false"])
def test_elastic_kill_with_each_optimizer_matches_a_replay(tmp_path, shard_state):
    """The sharded (each rank's part of the state, gathered at commit) and the replicated optimizer
    lose a rank and go on; the result equals the replay."""
    kill_one_and_refill(tmp_path, ["--shard-state", shard_state])
    check_against_replay(tmp_path)


@pytest.mark.timeout(300)
def test_elastic_default_optimizer_shrinks_to_one_rank_and_grows_back_with_checkpoints(tmp_path):
    """-np 2 --min-np 1, the default optimizer (node-shared on 2 ranks, replicated alone): a kill
    leaves one rank, which goes on; a new rank joins and both go on at 2. A Checkpointer built
    before the run function, as scripts do, saves across both kinds, in the rank that joined too.
    The result equals the replay."""
    kill_one_and_refill(tmp_path, ["--checkpoint-every", "2"], np=2, steps=4)
    check_against_replay(tmp_path)
    from torchmn.checkpoint import files
    steps = files.steps_on_disk(str(tmp_path / "ckpt"))
    assert steps and all(files.read_manifest(str(tmp_path / "ckpt"), s) for s in steps), steps


@pytest.fixture(scope="module")
def refilled(tmp_path_factory):
    """The folder of a 2-rank job (elastic_train.py) that lost worker 1 and took in worker 2."""
    out = tmp_path_factory.mktemp("refilled")
    kill_one_and_refill(out, [], np=2, steps=2)
    return out


@pytest.mark.timeout(300)
def test_elastic_new_worker_starts_in_the_place_it_refills(refilled):
    """A worker started after the first generation starts, before it joins, with the place it
    would take among the workers alive: a rank below the size, the local rank of the slot it
    refills, and the thread budget of its host's ranks (not the whole machine)."""
    places = {int(p.name): p.read_text().split() for p in (refilled / "places").iterdir()}
    assert sorted(places) == [0, 1, 2], places
    assert places[2][:4] == ["1", "2", "1", "2"] and places[2][4] == places[0][4], places


@pytest.mark.timeout(300)
def test_elastic_second_run_function_in_the_same_world_calls_no_reset_callback(refilled):
    """After the training run function (whose world came of a reset), a second one in the same
    world (to evaluate) is no reset: the callbacks are not called again."""
    result = torch.load(refilled / "result.pt")
    assert result["resets"] and result["resets_after_evaluate"] == result["resets"], result


@pytest.mark.timeout(300)
def test_elastic_second_run_function_starts_from_what_the_ranks_hold_not_the_last_commit(refilled):
    """Values and parameters changed after the training function's last commit reach the second
    run function unchanged (Horovod's sync hands on the current state too), and so does a State
    made after the reset that no rank has committed yet."""
    result = torch.load(refilled / "result.pt")
    assert result["evaluate_saw"] == (100, True), result
    assert result["fresh_state_saw"] == 101, result


def two_ranks_with_discovery(tmp_path: Path, lines: str, train_args: list) -> ElasticRun:
    """2 ranks of elastic_train.py on -H localhost:2, --max-np 3 (room for a worker the script may
    offer a slot for, so the launcher keeps asking it), with a discovery script of shell ``lines``."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + lines)
    script.chmod(0o755)
    return ElasticRun(tmp_path, 2, ["-H", "localhost:2", "--min-np", "1", "--max-np", "3", "--host-discovery-script",
                                    str(script)], train_args, timeout=180)


@pytest.mark.timeout(200)
def test_elastic_discovery_of_this_machine_by_another_name_adds_no_worker(tmp_path):
    """-H localhost:2 and a discovery script offering localhost:2 (or this machine's hostname):
    the two running ranks fill those slots, so no third worker starts."""
    job = two_ranks_with_discovery(tmp_path, f"echo {socket.gethostname()}:2\necho localhost:2\n",
                                   ["--steps", "40", "--step-sleep", "0.1"])
    try:
        done = job.ended(170)
    finally:
        job.stop()
    assert job.proc.returncode == 0, done[-4000:]
    assert "started worker" not in done, done[-4000:]
    assert set(torch.load(tmp_path / "result.pt")["sizes"]) == {2}


@pytest.mark.timeout(200)
def test_elastic_a_slow_discovery_script_does_not_hold_up_a_reset(tmp_path):
    """A discovery script that takes 8 s per run (a cloud API): it runs on a thread of its own, so
    the survivors of a kill go on at once, not after the run under way ends."""
    slow = tmp_path / "slow"
    job = two_ranks_with_discovery(tmp_path, f"[ -e {slow} ] && sleep 8\necho localhost:2\n",
                                   ["--steps", "100000", "--step-sleep", "0.05"])
    try:
        job.wait_for(lambda: job.steps_at(2) >= 5, "the first steps")
        slow.write_text("")
        time.sleep(2.5)   # a slow run of the script is under way
        killed_at = time.time()
        step = job.kill(1)
        job.wait_for(lambda: job.steps_at(1, after=step) >= 1, "the survivor's steps")
        first = next(t for t, s, n in job.progress() if n == 1 and s > step)
        done = job.finish()
    finally:
        job.stop()
    assert done.returncode == 0, done.stdout[-4000:]
    assert first - killed_at < 4.0, f"the survivor's first step came {first - killed_at:.1f} s after the kill"


@pytest.mark.timeout(300)
def test_elastic_checkpoints_saved_between_commits_are_saved_again_after_a_reset(tmp_path):
    """A Checkpointer saving every step, the state committed every 5: a kill sends the survivors
    back to the last commit, and they save the steps since again (this run's own, not another
    run's), as does the rank that joins; the job ends well and every step kept is complete."""
    kill_one_and_refill(tmp_path, ["--checkpoint-every", "1", "--commit-every", "5", "--save-between-commits"])
    check_against_replay(tmp_path)
    from torchmn.checkpoint import files
    steps = files.steps_on_disk(str(tmp_path / "ckpt"))
    assert steps and all(files.read_manifest(str(tmp_path / "ckpt"), s) for s in steps), steps


@pytest.mark.timeout(300)
def test_elastic_reset_callback_learning_rate_holds(tmp_path):
    """The reset callback sets the learning rate for the new world's size (as docs/elastic.md
    says to): the survivors of a kill train at 2 ranks' rate, and after a rank joins, every rank,
    the new one too, at 3 ranks' rate; the sync after a reset does not put the commit's rate back.
    The result equals the replay with each step's rate from its world size."""
    kill_one_and_refill(tmp_path, ["--lr-per-rank", "0.02"])
    result = check_against_replay(tmp_path, lr_per_rank=0.02)
    assert 2 in result["sizes"] and result["sizes"][-1] == 3, result["sizes"]


@pytest.mark.timeout(300)
def test_elastic_sharded_commit_cut_short_by_a_kill_falls_back_to_the_last_whole_one(tmp_path):
    """Rank 1 dies inside a commit, having received rank 0's part and before sending its own on: rank 0
    completes that commit, rank 2 (waiting for rank 1's part) cannot. Then worker 2 dies the same way
    in the first commit after the reset, when the commit before is the one the reset handed on. Each
    reset puts the state together from one commit, the newest that every part of is left of (here
    the one before), never from parts of two."""
    # A fixed number of steps: the replay's float64 rounding differs from the job's in the last bits, which
    # hundreds of steps of a lone survivor (while new ranks start on a loaded machine) would grow past 1e-10.
    job = ElasticRun(tmp_path, 3, ["--min-np", "1", "--max-np", "3"],
                     ["--steps", "30", "--step-sleep", "0.05", "--shard-state", "true", "--die-in-commit", "5",
                      "--die-in-commit-after-reset", "2"], timeout=240)
    try:
        out = job.ended(timeout=230)
    finally:
        job.stop()
    assert job.proc.returncode == 0, out[-4000:]
    result = check_against_replay(tmp_path)
    assert result["sizes"][:5] == [3, 3, 3, 3, 1], result["sizes"]  # both commits of step 5 were given up


@pytest.mark.timeout(120)
def test_elastic_below_min_np_ends_naming_the_lost(tmp_path):
    """With no room for a new rank (the discovery script offers 1 slot, which the survivor holds;
    --min-np 2), the job ends after --elastic-timeout, naming the worker lost and its host."""
    job = ElasticRun(tmp_path, 2, ["--min-np", "2", "--host-discovery-script", discovery_script(tmp_path, 1),
                                   "--elastic-timeout", "3"], ["--steps", "100000", "--step-sleep", "0.05"],
                     timeout=100)
    try:
        job.wait_for(lambda: job.steps_at(2) >= 3, "the first steps")
        job.kill(1)
        killed = time.monotonic()
        out = job.ended(60)
        took = time.monotonic() - killed
    finally:
        job.stop()
    assert job.proc.returncode == 1, out[-3000:]
    assert took < 30
    assert "below --min-np 2" in out and "worker 1 (host " in out and "killed by signal SIGKILL" in out


@pytest.mark.timeout(60)
def test_elastic_failures_of_every_worker_are_told_in_their_order(tmp_path):
    """Every worker of a script fails, worker 0 first: the job goes on without it, and ends with
    worker 1's failure, which the report names as the one that ended it, saying worker 0 had
    failed before (not "later")."""
    script = tmp_path / "fails.py"
    script.write_text("import os, time\n"
                      f"time.sleep(0.2 if os.environ['{protocol.WORKER_VARIABLE}'] == '0' else 3)\n"
                      "raise SystemExit(3)\n")
    proc = subprocess.run([PY, "-m", "torchmn", "run", "-np", "2", "--min-np", "1", "--max-np", "2", PY, str(script)],
                          capture_output=True, text=True, env=clean_env(), cwd=REPO, timeout=50)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert re.search(r"^torchmn run: rank 1 \(host .*\) failed with exit code 3\.$", out, re.M), out[-3000:]
    assert "rank(s) 0 had failed before it, and the job had gone on without them." in out, out[-3000:]
    assert "later" not in out, out[-3000:]


def _example_across_a_kill(out: Path, example: list, ready) -> str:
    """Run an example under ``torchmn run -np 3 --min-np 2 --max-np 3``, SIGKILL worker 1 once
    ``ready(output)`` holds, and return the output once the job ended."""
    log = open(out / "log", "w")
    proc = subprocess.Popen([PY, "-m", "torchmn", "run", "-np", "3", "--min-np", "2", "--max-np", "3", PY, *example],
                            stdout=log, stderr=subprocess.STDOUT, env=clean_env(), cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not ready((out / "log").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, (out / "log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(_workers_of(proc.pid)[1], signal.SIGKILL)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    output = (out / "log").read_text()
    assert proc.returncode == 0, output[-4000:]
    assert "worker 1 (host" in output and "moved to generation" in output, output[-3000:]
    return output


def _workers_of(launcher_pid: int) -> dict:
    """Worker number -> pid of the processes an elastic launcher started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().split(")")[-1].split()[1]) != launcher_pid:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
        except (OSError, ValueError):
            continue
        if protocol.WORKER_VARIABLE in env and _alive(int(entry.name)):
            found[int(env[protocol.WORKER_VARIABLE])] = int(entry.name)
    return found


@pytest.mark.timeout(240)
def test_horovod_elastic_example_completes_across_a_kill(tmp_path):
    """The Horovod elastic MNIST example, under horovodrun's flags: a rank killed in its second epoch;
    the other two go on from their last commit, a new rank joins, the test set is scored at the end."""
    out = _example_across_a_kill(tmp_path, [str(REPO / "examples" / "horovod" / "pytorch_mnist_elastic.py"),
                                            "--epochs", "6", "--log-interval", "5"],
                                 lambda output: "Train Epoch: 2" in output)
    assert re.search(r"^\[0\] Test set: Average loss: [\d.]+, Accuracy: [\d.]+%", out, re.M), out[-3000:]


@pytest.mark.timeout(240)
def test_elastic_sharded_state_lost_with_two_neighbours_names_them(tmp_path):
    """shard_state=True keeps each rank's part on its neighbour too: killing ranks 1 and 2 of 4 at once
    loses rank 1's part (kept on 1 and 2), and the survivors end naming it instead of going on wrong."""
    job = ElasticRun(tmp_path, 4, ["--min-np", "2", "--max-np", "4"],
                     ["--steps", "100000", "--step-sleep", "0.05", "--shard-state", "true"], timeout=200)
    try:
        job.wait_for(lambda: job.steps_at(4) >= 5, "the first steps")
        job.kill(1, 2)
        out = job.ended(120)
    finally:
        job.stop()
    assert job.proc.returncode != 0
    assert "StateLostError" in out and "the part of rank(s) 1 of the 4-rank world" in out, out[-3000:]
    assert re.search(r"^torchmn run: every worker that held the training state is gone .*StateLostError: ", out, re.M)


@pytest.mark.timeout(240)
def test_elastic_rank_lost_while_another_joins_leads_to_another_reset(tmp_path):
    """Rank 0 is killed while the rank replacing a first victim is still joining: the survivor and the
    joiners form yet another world instead of hanging, the last survivor hands the state on, and
    the result equals the replay."""
    job = ElasticRun(tmp_path, 3, ["--min-np", "2", "--max-np", "3", "--host-discovery-script",
                                   discovery_script(tmp_path, 3)], ["--steps", "100000", "--step-sleep", "0.05"],
                     timeout=200)
    try:
        job.wait_for(lambda: job.steps_at(3) >= 5, "the first steps")
        job.kill(1)
        job.wait_for(lambda: "started worker 3 " in job.output(), "the new worker's start")
        time.sleep(1.0)
        job.kill(0)
        step = job.progress()[-1][1]
        job.wait_for(lambda: job.steps_at(3, after=step) >= 3, "three ranks again")
        done = job.finish()
    finally:
        job.stop()
    assert done.returncode == 0, done.stdout[-4000:]
    check_against_replay(tmp_path)


def assert_completed_without_worker_0(done, tmp_path) -> None:
    """The job ended well, worker 0 was killed on the way, and the result equals the replay."""
    assert done.returncode == 0, done.stdout[-4000:]
    assert "worker 0 (host" in done.stdout and "killed by signal SIGKILL" in done.stdout, done.stdout[-4000:]
    check_against_replay(tmp_path)


@pytest.mark.timeout(300)
def test_elastic_member_lost_while_the_new_world_is_set_up_leads_to_another_reset(tmp_path):
    """After a first kill, worker 0 dies inside torch.distributed's set-up of the survivors' world,
    having arrived there: worker 2 waits inside that set-up for it. The worker started in the freed
    slot makes the launcher announce a newer world, and worker 2 leaves the set-up it waits in for
    that one (instead of waiting out the timeout), hands the state on, and the result equals the
    replay."""
    job = ElasticRun(tmp_path, 3, ["--min-np", "2", "--max-np", "3"],
                     ["--steps", "100000", "--step-sleep", "0.05", "--die-in-setup-after-reset", "0"], timeout=240)
    try:
        job.wait_for(lambda: job.steps_at(3) >= 5, "the first steps")
        step = job.kill(1)
        job.wait_for(lambda: job.steps_at(3, after=step) >= 3, "three ranks again")
        done = job.finish()
    finally:
        job.stop()
    assert_completed_without_worker_0(done, tmp_path)


@pytest.mark.timeout(300)
def test_elastic_member_lost_after_giving_its_address_leads_to_another_reset(tmp_path):
    """The discovery script offers 1 of the 3 slots: worker 2 leaves (worker 1 stays for --min-np
    2), and worker 0 dies inside the new world's set-up once its address is in the store: worker
    1's gloo retries that address inside C++, where the launcher cannot reach it. The set-up's
    bound (5 s here) ends that wait; with no slot free for a new worker yet, worker 1 waits for
    the next generation instead of failing; once the slots come back, it moves there with the new
    workers, and the result equals the replay."""
    job = ElasticRun(tmp_path, 3, ["--min-np", "2", "--max-np", "3", "--host-discovery-script",
                                   discovery_script(tmp_path, 3)],
                     ["--steps", "100000", "--step-sleep", "0.05", "--die-after-address-after-reset", "0"],
                     timeout=240)
    try:
        job.wait_for(lambda: job.steps_at(3) >= 5, "the first steps")
        step = job.progress()[-1][1]
        discovery_script(tmp_path, 1)
        job.wait_for(lambda: "worker 0 (host" in job.output(), "worker 0's death in the set-up")
        # gloo's own line when it gives up connecting (at the set-up's bound)
        job.wait_for(lambda: re.search(r"^\[1\] .*(Connect timeout|timed out connecting)", job.output(), re.M),
                     "worker 1's set-up to give up")
        time.sleep(3.0)
        assert set(job.worker_pids()) == {1} and "started worker" not in job.output(), job.output()[-4000:]
        discovery_script(tmp_path, 3)
        job.wait_for(lambda: job.steps_at(3, after=step) >= 3, "three ranks again")
        done = job.finish()
    finally:
        job.stop()
    assert "worker(s) 2 leave the job at its next commit" in done.stdout, done.stdout[-4000:]
    assert_completed_without_worker_0(done, tmp_path)


@pytest.mark.timeout(300)
def test_elastic_fewer_slots_offered_take_the_newest_workers_out(tmp_path):
    """3 workers on this machine, then the discovery script offers 1 slot: workers 2 and 1 leave the
    job at the next commit (with status 0, not counted as lost), worker 0 goes on alone; offered 2
    slots again, a new worker joins it. The result equals the replay."""
    job = ElasticRun(tmp_path, 3, ["--min-np", "1", "--max-np", "3", "--host-discovery-script",
                                   discovery_script(tmp_path, 3)], ["--steps", "100000", "--step-sleep", "0.05"],
                     timeout=240)
    try:
        job.wait_for(lambda: job.steps_at(3) >= 5, "the first steps")
        discovery_script(tmp_path, 1)
        job.wait_for(lambda: job.steps_at(1) >= 3, "worker 0 alone")
        job.wait_for(lambda: set(job.worker_pids()) == {0}, "workers 1 and 2 to end")
        discovery_script(tmp_path, 2)
        job.wait_for(lambda: job.steps_at(2) >= 3, "two ranks again")
        done = job.finish()
    finally:
        job.stop()
    out = done.stdout
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"now offers \S+:1; worker\(s\) 2, 1 leave the job at its next commit", out), out[-4000:]
    assert re.search(r"^\[2\] torchmn.elastic: worker 2 on \S+ left the job", out, re.M), out[-4000:]
    assert "workers lost: none; workers added: worker 3; workers taken out: " in out, out[-4000:]
    sizes = check_against_replay(tmp_path)["sizes"]
    assert sizes[:5] == [3] * 5 and 1 in sizes and sizes[-1] == 2, sizes


@pytest.mark.parametrize("name", ["commit", "sync", "comm", "_names"])
def test_elastic_state_refuses_a_value_named_as_its_own_attribute(name):
    """A value named commit, sync, comm (the State's own) or private is refused when the state is built
    (it broke the state's own calls later); a single function given as the reset callbacks too."""
    from torchmn.elastic import State
    with pytest.raises(ValueError, match=f"the value name\\(s\\) '{name}' are the State's own"):
        State(**{name: 1})
    with pytest.raises(TypeError, match="takes a list of functions"):
        State(epoch=0).register_reset_callbacks(print)


def test_elastic_state_warns_of_a_value_set_after_it_was_built():
    """A value first set after the state was built is in no commit, so a reset would not bring it
    back: said once, with the fix; the values it was built with, the model and the optimizer, not."""
    import warnings

    from torchmn.elastic import State
    state = State(model=None, epoch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.epoch, state.model = 1, torch.nn.Linear(1, 1)
    with pytest.warns(UserWarning, match=r"State\(\.\.\., best=\.\.\.\)"):
        state.best = 0.5
    state.save()
    state.best, state.epoch = 0.9, 2
    state.restore()
    assert (state.epoch, state.best) == (1, 0.9)


def test_elastic_nnodes_range_says_what_to_run_instead():
    proc = subprocess.run([PY, "-m", "torchmn", "run", "--nnodes", "1:4", "-np", "2", PY, "-c", "pass"],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert proc.returncode == 2
    assert "'1:4' is a range of nodes" in proc.stderr and "--min-np" in proc.stderr


def test_elastic_dry_run_shows_the_bounds_and_worker_variables():
    proc = subprocess.run([PY, "-m", "torchmn", "run", "--dry-run", "-np", "2", "--min-np", "1", "--max-np", "3",
                           PY, "-c", "pass"], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "elastic: goes on while at least 1 ranks live" in proc.stdout and "grows to 3" in proc.stdout
    assert "TORCHMN_ELASTIC_WORKER=1" in proc.stdout


def test_elastic_sampler_splits_the_rest_of_the_epoch_over_a_new_world():
    """Two steps of 3 ranks, then the rest of the epoch over 2: each sample once."""
    from torchmn.elastic import ElasticSampler

    class World:
        rank, size = 0, 3
    world = World()
    sampler = ElasticSampler(21, world, batch_size=2, shuffle=True, seed=1)

    def step(size):
        start, taken = sampler.consumed, []
        for r in range(size):
            world.rank, world.size, sampler.consumed = r, size, start
            taken += next(iter(sampler))
        return taken
    seen = step(3) + step(3)
    world.size = 2
    assert len(sampler) == 2  # 9 left: a step of 4, then 5 (a tail of 1 cannot go to 2 ranks)
    while sampler.consumed < 21:
        seen += step(2)
    assert sorted(seen) == list(range(21))
    sampler.consumed = 20  # a reset grew the world to 3 with one sample left: every rank gets one
    assert step(3) == [sampler.order()[20]] * 3
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "consumed": 0} and sampler.order() != list(range(21))


def test_elastic_sampler_iterated_again_without_set_epoch_starts_the_next_epoch():
    """A script that forgets set_epoch() (as many do with DistributedSampler) gets the next epoch's
    batches with a warning, not empty epochs; an epoch a reset went back to the end of stays ended."""
    from torchmn.elastic import ElasticSampler

    class World:
        rank, size = 0, 2
    sampler = ElasticSampler(10, World(), batch_size=2, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(list(range(10)), batch_sampler=sampler)
    first = sorted(int(x) for batch in loader for x in batch)
    with pytest.warns(UserWarning, match="set_epoch"):
        second = [int(x) for batch in loader for x in batch]
    assert len(first) == len(second) == 5 and sampler.state_dict() == {"epoch": 1, "consumed": 10}
    sampler.load_state_dict({"epoch": 1, "consumed": 10})  # a reset to a commit at the epoch's end
    assert list(loader) == []
    sampler.set_epoch(1)
    assert list(loader) == []


def test_elastic_resumable_loader_splits_the_rest_of_the_epoch_over_a_new_world():
    """ResumableLoaders over an elastic job's scattered parts: 3 ranks take two batches each, the
    world shrinks to 2 and then grows to 4 within the epoch: each sample once. Until the change
    they take what plain loaders over plain parts take; the next epoch splits over 4."""
    from torchmn.checkpoint import ResumableLoader
    from torchmn.datasets import DatasetPart, ElasticDatasetPart, index_range

    class World:
        def __init__(self, rank, size):
            self.rank, self.size = rank, size
    data = list(range(1000, 1060))
    order = torch.randperm(60, generator=torch.Generator().manual_seed(3)).tolist()

    def loaders(size, state=None):
        made = [ResumableLoader(ElasticDatasetPart(data, order, World(r, size), True, shared=False, max_buf_len=1 << 20),
                                batch_size=4, seed=7) for r in range(size)]
        for loader in made:
            if state is not None:
                loader.load_state_dict(state)
        return made

    def take(made, steps):
        iters = [iter(loader) for loader in made]
        return [[int(x) for x in next(it)] for _ in range(steps) for it in iters]

    three = loaders(3)
    seen = take(three, 2)
    plain = [ResumableLoader(DatasetPart(data, order[slice(*index_range(60, 3, r, True))]), batch_size=4, seed=7)
             for r in range(3)]
    assert seen == take(plain, 2)
    two = loaders(2, three[0].state_dict())
    seen += take(two, 2)
    four = loaders(4, two[0].state_dict())
    assert len(four[0]) == 4  # a whole epoch's batches over 4 ranks' parts of 15
    rest = [[int(x) for x in batch] for loader in four for batch in loader]
    assert sorted(x for batch in seen + rest for x in batch) == data
    assert [loader.state_dict()["epoch"] for loader in four] == [1] * 4
    assert sorted(int(x) for loader in four for batch in loader for x in batch) == data


@pytest.mark.timeout(240)
def test_elastic_sampler_sees_each_sample_once_per_epoch_across_a_kill(tmp_path):
    """A 3-rank job reading through ElasticSampler loses a rank mid-epoch: the samples committed in
    every epoch are each sample exactly once (none twice, none skipped)."""
    job = ElasticRun(tmp_path, 3, ["--min-np", "2", "--max-np", "3"], ["3"], timeout=200,
                     script=str(REPO / "tests" / "workers" / "elastic_sampler_train.py"))
    try:
        job.wait_for(lambda: job.steps_at(3) >= 4, "the first steps")
        job.kill(1)
        out = job.ended(150)
    finally:
        job.stop()
    assert job.proc.returncode == 0, out[-3000:]
    assert "moved to generation" in out
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert [sorted(epoch) for epoch in seen] == [list(range(97))] * 3


@pytest.fixture(scope="module")
def data_job(tmp_path_factory):
    """A 3-rank job reading its data three ways in turn (tests/workers/elastic_data_train.py) loses
    rank 0 (the scatter's root) while it reads the scattered data, goes on with 2, and takes in the
    rank the launcher starts in the freed slot, which receives the data from a peer; later it loses
    rank 0 again, then the multi-node iterator's reader, in the middle of a later epoch of the
    iterator: the samples committed per way and epoch."""
    out = tmp_path_factory.mktemp("elastic_data")
    job = ElasticRun(out, 3, ["--min-np", "2", "--max-np", "3"], ["6"], timeout=200,
                     script=str(REPO / "tests" / "workers" / "elastic_data_train.py"))

    def phase():
        path = out / "phase"
        fields = path.read_text().split() if path.exists() else []
        return (int(fields[0]), fields[1], int(fields[2]), int(fields[3])) if len(fields) == 4 else (-1, "", 0, -1)
    try:
        job.wait_for(lambda: job.steps_at(3) >= 4 and phase()[1] == "scatter", "the first steps")
        step = job.kill(0)
        job.wait_for(lambda: job.steps_at(3, after=step + 1) >= 1, "the new rank's first step")
        first = {}  # the iterator's reader's own position matters from the second epoch on (another order)
        job.wait_for(lambda: phase()[:2] >= (1, "iterator") and phase()[1] == "iterator"
                     and phase()[2] >= first.setdefault("step", phase()[2]) + 2, "two steps of a later iterator epoch")
        job.kill(phase()[3])
        output = job.ended(150)
    finally:
        job.stop()
    assert job.proc.returncode == 0, output[-3000:]
    killed = re.findall(r"^torchmn run: worker \d+ \(host \S+\) was killed by signal SIGKILL", output, re.M)
    assert len(killed) == 2 and job.steps_at(2) >= 1, output[-3000:]
    return json.loads((out / "seen.json").read_text())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["scatter", "shared", "iterator"])
def test_elastic_data_sees_each_sample_once_per_epoch_across_a_kill_and_a_join(data_job, mode):
    """Each way of reading data (scatter_dataset + ResumableLoader, copied or shared, and the
    multi-node iterator) commits every sample exactly once in every epoch, across two losses of
    rank 0 (one of them the iterator's reader mid-epoch) and a rank joining."""
    assert [sorted(epoch) for epoch in data_job[mode]] == [list(range(96))] * 6


@pytest.mark.timeout(240)
def test_elastic_batch_norm_keeps_the_whole_batchs_statistics_across_a_kill_and_a_join(data_job):
    """The job's MultiNodeBatchNorm1d normalizes with the statistics of the whole global batch at
    every step (each rank checks), in the first world, the shrunk one and the one a rank joined,
    whose layer agrees with the others' anew."""
    assert all(data_job["batch_norm"][world] > 0 for world in ("first", "shrunk", "grown")), data_job["batch_norm"]


@pytest.mark.timeout(240)
def test_elastic_mnist_example_completes_across_a_kill(tmp_path):
    """examples/mnist/train_mnist_elastic.py: a rank killed after the first epoch; the others go on
    with the rest of their epoch from the last commit, every epoch is logged once, in order, and
    the model learns as without the kill."""
    log = tmp_path / "log.json"
    out = _example_across_a_kill(tmp_path, [str(REPO / "examples" / "mnist" / "train_mnist_elastic.py"), "--epochs",
                                            "6", "--commit-every", "5", "--log", str(log)],
                                 lambda output: log.exists())
    assert "now 2 ranks" in out, out[-3000:]
    entries = json.loads(log.read_text())
    assert [e["epoch"] for e in entries] == list(range(1, 7))
    assert 2 in {e["ranks"] for e in entries} and entries[-1]["validation/main/accuracy"] > 0.9, entries


@pytest.mark.timeout(120)
def test_elastic_reset_limit_ends_the_job_instead_of_another_reset(tmp_path):
    """--reset-limit 1: the reset after a kill is the one allowed; the refilled rank's arrival would
    be a second, so the job ends there, saying why and naming the worker lost."""
    job = ElasticRun(tmp_path, 2, ["--min-np", "1", "--reset-limit", "1"],
                     ["--steps", "100000", "--step-sleep", "0.05"], timeout=100)
    try:
        job.wait_for(lambda: job.steps_at(2) >= 3, "the first steps")
        job.kill(1)
        out = job.ended(80)
    finally:
        job.stop()
    assert job.proc.returncode == 1, out[-3000:]
    assert "the job reset 1 time(s), --reset-limit 1" in out and "worker 1 (host " in out, out[-3000:]
    assert job.steps_at(1) >= 1  # the survivor went on alone in between


def test_elastic_timeouts_with_every_worker_alive_end_the_job_instead_of_endless_resets(tmp_path):
    """Rank 1 works alone for longer than TORCHMN_TIMEOUT before the same step, each time it comes
    there: the other's timeout loses no worker, and a reset back to the commit before it cannot mend
    that. After three generations in a row broke with every worker alive before any commit, the
    launcher ends the job, saying why and what to raise."""
    job = ElasticRun(tmp_path, 2, ["--min-np", "1", "-x", "TORCHMN_TIMEOUT=1"],
                     ["--steps", "6", "--alone-before-step", "3", "--alone-s", "2.5"], timeout=100)
    try:
        out = job.ended(90)
    finally:
        job.stop()
    assert job.proc.returncode == 1, out[-3000:]
    assert "3 generations in a row broke before any commit with every worker alive" in out, out[-3000:]
    assert "raise TORCHMN_TIMEOUT" in out, out[-3000:]
    assert max(s for _, s, _ in job.progress()) == 3  # the steps before the lone work were done once


def test_a_generation_passed_over_stays_passed_for_a_late_member():
    """Worker 1 arrives at generation 4, sees generation 5 announced before worker 2 arrives, and
    leaves 4; worker 2 then arrives and finds every arrival key of 4 set: it must leave 4 too (it
    would set up a world alone and wait there for ranks already in 5), as the first to settle 4 said.
    Workers that all arrive before a newer generation settle it formed, also when one looks late."""
    from torchmn.elastic import membership

    store = torch.distributed.HashStore()
    deadline = time.monotonic() + 10
    store.set(protocol.arrived_key(4, 1), "")
    store.set(protocol.GENERATION_KEY, "5")
    assert not membership._all_arrived(store, 4, [1, 2], deadline)  # worker 1 leaves 4
    store.set(protocol.arrived_key(4, 2), "")
    assert not membership._all_arrived(store, 4, [1, 2], deadline)  # worker 2, late: every key set, still left
    for worker in (1, 2):
        store.set(protocol.arrived_key(6, worker), "")
    assert membership._all_arrived(store, 6, [1, 2], deadline)      # all arrived at 6: formed
    store.set(protocol.GENERATION_KEY, "7")
    assert membership._all_arrived(store, 6, [1, 2], deadline)      # a member looking after 7 came: still formed


def test_a_set_up_goes_on_through_a_generation_that_only_adds_workers():
    """A member setting up generation 4 keeps waiting for the others' keys when the launcher
    announces 5 for a newcomer (every member of 4 is alive and setting it up), and gives up at once
    when 4 or a later one is marked broken (a member lost)."""
    from torchmn.elastic import setup_store

    store = torch.distributed.HashStore()
    store.set(protocol.GENERATION_KEY, "5")
    setup = setup_store.watched(store, 4)
    assert setup.moved_on() is None
    threading.Timer(0.3, lambda: store.set("peer-address", "x")).start()
    setup.wait(["peer-address"], datetime.timedelta(seconds=10))  # not given up for 5
    store.set(protocol.GENERATION_KEY, "6")
    store.set(protocol.broken_key(5), "")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="lost a member of generation 5 and announced generation 6"):
        setup.wait(["never-written"], datetime.timedelta(seconds=10))
    assert time.monotonic() - started < 2
