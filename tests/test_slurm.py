"""torchmn under a real Slurm cluster: two nodes (n1, n2) on this machine, see tests/cluster/slurm.py.

Covers srun with one task per rank (one node and two; split communicators across nodes),
``torchmn run`` inside an srun task (one node; one task per node on two, a failing rank there, and
the error for several tasks on one node), an sbatch job running the MNIST example, the error for a
batch script that forgot srun, preemption: signal -> checkpoint -> requeue -> resume, and a rank's
uncaught exception ending the whole step within seconds.

The cluster needs ``slurmd slurmctld slurm-client munge`` and root. Without them these tests fail
(they do not skip): CI installs them, and a skip would hide that Slurm support went untested.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster.slurm import INSTALL_HINT, SlurmCluster, missing_programs
from failure_jobs import assert_failure_shown_once, failing_argv, seconds_since_raise
from jobs import REPO, WORKERS
from torchmn import resources
from torchmn.environments import slurm_port

PY = sys.executable
CHECKS = str(WORKERS / "comm_checks.py")

# Run inside each rank: print what detect_environment() saw, then run comm_checks.py's checks in
# the same process (a torch import per rank is most of a job's cost on a small machine).
PROBE = f"""
import os, runpy, sys, torch
from torchmn.environments import detect_environment
e = detect_environment()
sys.argv = [{CHECKS!r}] + sys.argv[1:]
try:
    runpy.run_path({CHECKS!r}, run_name="__main__")
except SystemExit as stop:
    if stop.code:
        raise
print(f"PROBE rank={{e.rank}} node={{e.node_rank}} source={{e.source}} addr={{e.master_addr}} "
      f"port={{e.master_port}} threads={{torch.get_num_threads()}} "
      f"job={{os.environ.get('SLURM_JOB_ID')}} step={{os.environ.get('SLURM_STEP_ID')}}", flush=True)
"""


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running two-node cluster for the whole session; its daemons are stopped at the end."""
    missing = missing_programs()
    if missing:
        pytest.fail(f"Slurm is needed for these tests but these programs are missing: {', '.join(missing)}; "
                    f"{INSTALL_HINT}",
                    pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the test Slurm cluster runs its daemons as root (SlurmUser=root); run the tests "
                    "as root, as CI does", pytrace=False)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start(timeout=60)
    yield cluster
    cluster.stop()


# What cpu_count_available sees in a task of `srun -c 2`.
SRUN_TASK_WITH_2_CPUS = {"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "2"}


def job_env(**extra):
    """Jobs find this interpreter as `python` (the sbatch templates call `python`)."""
    path = os.path.dirname(PY) + os.pathsep + os.environ.get("PATH", "")
    return {"PATH": path, **extra}


def probes(output):
    """{rank: {field: value}} from the PROBE lines of every rank."""
    rows = {}
    # non-greedy up to the next PROBE: two ranks' lines can arrive spliced together
    for match in re.finditer(r"PROBE (.*?)(?=PROBE |$)", output, re.M):
        fields = dict(item.split("=", 1) for item in match.group(1).split())
        rows[int(fields["rank"])] = fields
    return rows


def topology(output):
    match = re.search(r"TOPOLOGY size=(\d+) inter_size=(\d+) intra_size=(\d+)", output)
    assert match, f"no TOPOLOGY line in:\n{output}"
    return tuple(int(n) for n in match.groups())


def read(path):
    return Path(path).read_text() if Path(path).exists() else "(no output file yet)"


def submit(slurm, argv, cwd):
    """sbatch ARGV; returns the job id. (Not `sbatch --wait`: it polls every 2, 8, then 32 s.)"""
    proc = slurm.run(["sbatch", "--parsable", *argv], env=job_env(), cwd=cwd, timeout=30)
    return proc.stdout.strip().split(";")[0]


def job_field(slurm, job, name):
    """One field of `scontrol show job` (jobs stay listed for MinJobAge=600 s after they end)."""
    proc = slurm.run(["scontrol", "show", "job", "-o", job], timeout=10, check=False)
    match = re.search(rf"\b{name}=(\S*)", proc.stdout)
    return match.group(1) if match else None


def job_details(slurm, job, out_file):
    state = slurm.run(["scontrol", "show", "job", job], timeout=10, check=False).stdout
    return f"--- job output ---\n{read(out_file)}\n--- scontrol show job ---\n{state}\n{slurm.logs(15)}"


def wait_for(what, condition, timeout, details):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{details()}")


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def wait_done(slurm, job, out_file, timeout):
    """Wait until the job has ended; returns (JobState, ExitCode such as "0:0")."""
    wait_for(f"job {job} to end", lambda: job_field(slurm, job, "JobState") in FINAL_STATES, timeout,
             lambda: job_details(slurm, job, out_file))
    return job_field(slurm, job, "JobState"), job_field(slurm, job, "ExitCode")


def test_srun_one_node_task_per_rank(slurm):
    """`srun -n 2 python ...`: ranks from SLURM_*, MASTER_PORT wins, threads from --cpus-per-task."""
    port = 20000 + os.getpid() % 10000
    proc = slurm.run(["srun", "-N", "1", "-n", "2", "-c", "2", PY, "-c", PROBE, "topology", "objects", "ring"],
                     env=job_env(MASTER_PORT=str(port)), timeout=90)
    out = proc.stdout
    assert topology(out) == (2, 1, 2)
    assert all(f"PASS {name}" in out for name in ("topology", "objects", "ring")), out
    rows = probes(out)
    assert sorted(rows) == [0, 1], out
    # Each task owns its --cpus-per-task CPUs: the budget is not divided again by the ranks.
    threads = resources.cpu_count_available(SRUN_TASK_WITH_2_CPUS)
    for row in rows.values():
        assert (row["source"], row["addr"], row["port"], row["node"]) == ("slurm", "n1", str(port), "0"), row
        assert int(row["threads"]) == threads, (row, threads)


def test_srun_one_node_job_listens_on_loopback_only(slurm):
    """`srun -N 1 -n 2`: every rank on one node, so rank 0's store and gloo listen on loopback alone
    (the node's host name resolves to its network address, where gloo would otherwise listen)."""
    script = str(REPO / "tests" / "scripts" / "listening_ports.py")
    proc = slurm.run(["srun", "-N", "1", "-n", "2", PY, script],
                     env=job_env(MASTER_PORT=str(21000 + os.getpid() % 10000)), timeout=90)
    listening = dict(re.findall(r"LISTENING (\d) (\[[^]]*\])", proc.stdout))
    assert listening == {"0": "['127.0.0.1']", "1": "['127.0.0.1']"}, proc.stdout + proc.stderr


def test_srun_two_nodes(slurm):
    """`srun -N 2 --ntasks-per-node 2`: 2 nodes x 2 ranks, rendezvous on n1, port from the ids."""
    proc = slurm.run(["srun", "-N", "2", "--ntasks-per-node", "2", PY, "-c", PROBE, "topology", "mean_grad", "arange"],
                     env=job_env(), timeout=90)
    out = proc.stdout
    assert topology(out) == (4, 2, 2)
    assert all(f"PASS {name}" in out for name in ("topology", "mean_grad", "arange")), out
    rows = probes(out)
    assert sorted(rows) == [0, 1, 2, 3], out
    assert [rows[r]["node"] for r in range(4)] == ["0", "0", "1", "1"], rows
    job, step = int(rows[0]["job"]), int(rows[0]["step"])
    # No --cpus-per-task: the 2 ranks of a node share this machine's CPUs.
    threads = max(1, resources.cpu_count_available({}) // 2)
    for row in rows.values():
        assert (row["source"], row["addr"]) == ("slurm", "n1"), row
        assert int(row["port"]) == slurm_port(job, step), row
        assert int(row["threads"]) == threads, (row, threads)


def test_split_across_nodes(slurm):
    """Sub-communicators whose members sit on different nodes (even and odd ranks of 2 x 2)."""
    proc = slurm.run(["srun", "-N", "2", "--ntasks-per-node", "2", PY, CHECKS, "split"], env=job_env(), timeout=120)
    assert "PASS split" in proc.stdout, proc.stdout


def test_torchmn_run_inside_srun(slurm):
    """One srun task running `torchmn run -np 2`: the launcher's own variables win in its ranks."""
    proc = slurm.run(["srun", "-N", "1", "-n", "1", "-c", "2", PY, "-m", "torchmn", "run", "-np", "2",
                      PY, "-c", PROBE, "topology", "ring"], env=job_env(), timeout=90)
    out = proc.stdout
    assert topology(out) == (2, 1, 2)
    rows = probes(out)
    assert sorted(rows) == [0, 1], out
    # torchmn run splits the task's 2 CPUs between its 2 ranks.
    threads = max(1, resources.cpu_count_available(SRUN_TASK_WITH_2_CPUS) // 2)
    for row in rows.values():
        assert (row["source"], row["addr"]) == ("torchmn", "127.0.0.1"), row
        assert int(row["threads"]) == threads, (row, threads)


def test_torchmn_run_one_task_per_node(slurm):
    """`srun -N 2 --ntasks-per-node 1 torchmn run -np 2`: one job of 4 ranks, 2 per node, with
    global ranks, rendezvous on n1 at the step's port (the second node's ranks reach it through
    their node's relay on loopback), and each node's 2 CPUs split between its ranks."""
    start = time.monotonic()
    proc = slurm.run(["srun", "-N", "2", "--ntasks-per-node", "1", "-c", "2", PY, "-m", "torchmn", "run",
                      "-np", "2", PY, "-c", PROBE, "topology", "collectives", "objects"],
                     env=job_env(), timeout=90)
    out = proc.stdout
    assert topology(out) == (4, 2, 2), out
    assert all(f"PASS {name}" in out for name in ("topology", "collectives", "objects")), out
    rows = probes(out)
    assert sorted(rows) == [0, 1, 2, 3], out
    assert [rows[r]["node"] for r in range(4)] == ["0", "0", "1", "1"], rows
    # Output lines carry the global rank, whichever node printed them (srun may splice two nodes' lines).
    assert all(re.search(rf"\[{r}\] PROBE rank={r} ", out) for r in range(4)), out
    job, step = int(rows[0]["job"]), int(rows[0]["step"])
    threads = max(1, resources.cpu_count_available(SRUN_TASK_WITH_2_CPUS) // 2)
    for rank, row in rows.items():
        if row["node"] == "0":
            assert (row["source"], row["addr"], int(row["port"])) == ("torchmn", "n1", slurm_port(job, step)), row
        else:
            assert (row["source"], row["addr"]) == ("torchmn", "127.0.0.1"), row
            assert int(row["port"]) != slurm_port(job, step), row
        assert int(row["threads"]) == threads, (row, threads)
    print(f"one task per node: {time.monotonic() - start:.1f} s")


@pytest.mark.timeout(240)
def test_torchmn_run_failure_on_one_node_ends_the_step(slurm):
    """A rank failing on n2 stops n1's ranks too (the launchers tell each other), and srun fails."""
    crash = ("import os, time, torchmn\n"
             "comm = torchmn.create_communicator()\n"
             "if comm.rank == 3:\n"
             "    raise SystemExit('rank 3 gives up')\n"
             "time.sleep(600)\n")
    start = time.monotonic()
    proc = slurm.run(["srun", "-N", "2", "--ntasks-per-node", "1", PY, "-m", "torchmn", "run", "-np", "2",
                      PY, "-c", crash], env=job_env(), timeout=200, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "rank 3 (host n2) failed with exit code 1" in output, output
    assert "stopped the 2 rank(s) on this node" in output, output
    # Not the 600 s the other ranks sleep; four ranks' start-up beside the full suite takes up to a minute.
    assert time.monotonic() - start < 150, output


def test_torchmn_run_several_tasks_per_node_is_a_clear_error(slurm):
    """`srun -N 1 -n 2 torchmn run`: two launchers on one node would double-book its ranks."""
    proc = slurm.run(["srun", "-N", "1", "-n", "2", PY, "-m", "torchmn", "run", "-np", "2", PY, CHECKS,
                      "topology"], env=job_env(), timeout=60, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "torchmn run was started as 2 Slurm tasks on 1 node(s)" in output, output
    assert "--ntasks-per-node 1" in output and "srun -n 2 python train.py" in output, output
    assert "PASS" not in output, output


# Command-line options override the templates' #SBATCH lines, to keep the test light on a 2-core
# machine: train.sbatch with 1 rank per node and 1 CPU each; train_torchmn_run.sbatch (one task per
# node, `torchmn run -np 2` in it) with 2 CPUs per node, 1 thread per rank, and twice the data for
# its 4 ranks, so that each rank takes as many steps as with 2.
SBATCH_TEMPLATES = {
    "train.sbatch": (["--ntasks-per-node", "1", "--cpus-per-task", "1"], "400"),
    "train_torchmn_run.sbatch": (["--cpus-per-task", "2"], "800"),
}


@pytest.mark.timeout(200)  # the job's own limit is 120 s, after sbatch
@pytest.mark.parametrize("template", sorted(SBATCH_TEMPLATES))
def test_sbatch_mnist(slurm, tmp_path, template):
    """examples/slurm/*.sbatch train the MNIST example on 2 nodes (a small subset)."""
    out_file, log = tmp_path / "mnist.out", tmp_path / "log.json"
    options, n_train = SBATCH_TEMPLATES[template]
    job = submit(slurm, [*options, "-o", str(out_file), f"examples/slurm/{template}",
                         "--n-train", n_train, "--epochs", "2", "--log", str(log)],
                 cwd=REPO)
    state, exit_code = wait_done(slurm, job, out_file, timeout=120)
    output = read(out_file)
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"{state} {exit_code}\n--- job output ---\n{output}"
    entries = json.loads(log.read_text())
    assert [e["epoch"] for e in entries] == [1, 2], entries
    assert entries[-1]["validation/main/accuracy"] > 0.5, entries  # chance is 0.1
    assert "epoch   2" in output, output


def test_torchmn_run_in_a_batch_script_shares_the_nodes_cpus(slurm, tmp_path):
    """`sbatch -n 2 -c 1` running `torchmn run -np 1`: the batch script may use the job's CPUs on
    the node (2), not one task's --cpus-per-task (1)."""
    script, out_file = tmp_path / "batch.sbatch", tmp_path / "batch.out"
    script.write_text("#!/bin/bash\n"
                      f"{PY} -m torchmn run -np 1 {PY} -c 'import torch; print(\"THREADS\", torch.get_num_threads())'\n")
    job = submit(slurm, ["-N", "1", "-n", "2", "-c", "1", "-o", str(out_file), str(script)], cwd=tmp_path)
    state, exit_code = wait_done(slurm, job, out_file, timeout=60)
    output = read(out_file)
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"{state} {exit_code}\n{output}"
    expected = resources.cpu_count_available({"SLURM_JOB_ID": job, "SLURM_CPUS_ON_NODE": "2"})
    assert f"THREADS {expected}" in output, (expected, output)


def test_sbatch_of_one_whole_node_without_srun_is_a_world_of_one(slurm, tmp_path):
    """`sbatch -N 1 --exclusive` without -n: Slurm fills SLURM_TASKS_PER_NODE with the node's CPUs,
    but one process on one node is a world of one, not a misuse."""
    script, out_file = tmp_path / "whole.sbatch", tmp_path / "whole.out"
    script.write_text("#!/bin/bash\n"
                      f"{PY} -c 'import os, torchmn; c = torchmn.create_communicator(); "
                      f"print(\"SIZE\", c.size, \"TASKS_PER_NODE\", os.environ.get(\"SLURM_TASKS_PER_NODE\"))'\n")
    job = submit(slurm, ["-N", "1", "--exclusive", "-o", str(out_file), str(script)], cwd=tmp_path)
    state, exit_code = wait_done(slurm, job, out_file, timeout=60)
    output = read(out_file)
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"{state} {exit_code}\n{output}"
    assert "SIZE 1 TASKS_PER_NODE" in output, output


def test_sbatch_without_srun_is_a_clear_error(slurm, tmp_path):
    """A batch script for 2 tasks that runs python directly gets told to use srun."""
    script, out_file = tmp_path / "misuse.sbatch", tmp_path / "misuse.out"
    script.write_text("#!/bin/bash\n"
                      f"{PY} -c 'import torchmn; torchmn.create_communicator()'\n")
    job = submit(slurm, ["-n", "2", "-o", str(out_file), str(script)], cwd=tmp_path)
    state, exit_code = wait_done(slurm, job, out_file, timeout=60)
    output = read(out_file)
    assert state == "FAILED" and exit_code == "1:0", f"{state} {exit_code}\n{output}"
    assert "allocation of 2 tasks but was not started by srun" in output, output
    assert "srun python" in output, output




# Preemption and failure: checkpoint, requeue, resume (examples/slurm/train_preemptible.py). Every
# run trains the same 30 steps; a resumed run must end with the weights of an uninterrupted one.
PREEMPTIBLE_ARGS = ["--steps", "30", "--checkpoint-every", "10", "--print-every", "5"]


@pytest.fixture(scope="module")
def uninterrupted_weights(slurm, tmp_path_factory):
    """The weights of the 30 steps trained without interruption, on 2 nodes x 1 rank."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    slurm.run(["srun", "-N", "2", "--ntasks-per-node", "1", PY, "examples/slurm/train_preemptible.py",
               *PREEMPTIBLE_ARGS, "--checkpoint", str(folder / "ck"), "--out", str(folder / "model.pt")],
              env=job_env(), cwd=REPO, timeout=90)
    return torch.load(folder / "model.pt")


def assert_same_weights(path, expected):
    got = torch.load(path)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), (name, got[name], value)


def preempt_and_resume(slurm, tmp_path, template, *options):
    """Submit ``template``, send its tasks SIGUSR1 once training runs, and wait for the requeued
    job to finish; returns its output, the step the checkpoint was saved at, and the weights file."""
    out_file, checkpoint, weights = tmp_path / "job.out", tmp_path / "ck", tmp_path / "model.pt"
    job = submit(slurm, [*options, "-o", str(out_file), f"examples/slurm/{template}", *PREEMPTIBLE_ARGS,
                         "--checkpoint", str(checkpoint), "--out", str(weights), "--sleep", "0.15"], cwd=REPO)

    def details():
        return job_details(slurm, job, out_file)

    # Signal only once training runs: before its handler is installed SIGUSR1 would kill a rank.
    wait_for("step 5", lambda: "step 5 " in read(out_file), 60, details)
    slurm.run(["scancel", "--signal=USR1", job], timeout=10)
    state, exit_code = wait_done(slurm, job, out_file, timeout=100)
    text = read(out_file)
    saved = re.search(r"checkpoint saved at step (\d+)", text)
    assert saved, details()
    assert f"requeueing job {job}" in text and f"scontrol requeue {job} failed" not in text, details()
    assert f"resumed from step {saved.group(1)} (restart 1)" in text, details()
    assert "done: 30 steps" in text, details()
    assert (state, exit_code, job_field(slurm, job, "Restarts")) == ("COMPLETED", "0:0", "1"), details()
    return text, weights


@pytest.mark.timeout(200)
def test_preemption_checkpoint_requeue_resume(slurm, tmp_path, uninterrupted_weights):
    """preemptible.sbatch (one srun task per rank): SIGUSR1 to the job's tasks -> all ranks stop
    at one step, save a checkpoint, rank 0 requeues the job -> the job runs again, resumes from
    the checkpoint and finishes with the weights of a run that was never interrupted."""
    text, weights = preempt_and_resume(slurm, tmp_path, "preemptible.sbatch")
    assert_same_weights(weights, uninterrupted_weights)


@pytest.mark.timeout(200)
def test_preemption_with_torchmn_run_per_node_requeues_and_resumes(slurm, tmp_path, uninterrupted_weights):
    """preemptible_torchmn_run.sbatch (one torchmn run per node, 1 rank each): the launchers pass
    SIGUSR1 on, the ranks checkpoint, the job is requeued once (not again by the batch script for
    the step the requeue stopped) and resumes to the same weights."""
    text, weights = preempt_and_resume(slurm, tmp_path, "preemptible_torchmn_run.sbatch",
                                       "--export=ALL,RANKS_PER_NODE=1")
    assert "passed it on to 1 running rank(s)" in text, text
    assert "requeueing the job" not in text, text
    assert_same_weights(weights, uninterrupted_weights)


@pytest.mark.timeout(200)
def test_failed_torchmn_run_step_is_requeued_and_resumes(slurm, tmp_path, uninterrupted_weights):
    """preemptible_torchmn_run.sbatch --fail-at 17: rank 1 fails once, every launcher stops, the
    batch script requeues the job, which resumes from the checkpoint of step 10 and finishes with
    the weights of a run that never failed: Slurm's way to restart a multi-node torchmn run."""
    out_file, weights = tmp_path / "job.out", tmp_path / "model.pt"
    job = submit(slurm, ["--export=ALL,RANKS_PER_NODE=1", "-o", str(out_file),
                         "examples/slurm/preemptible_torchmn_run.sbatch", *PREEMPTIBLE_ARGS, "--fail-at", "17",
                         "--checkpoint", str(tmp_path / "ck"), "--out", str(weights)], cwd=REPO)
    state, exit_code = wait_done(slurm, job, out_file, timeout=150)
    text = read(out_file)
    details = job_details(slurm, job, out_file)
    assert "RuntimeError: failing at step 17 on purpose (--fail-at)" in text, details
    # srun's exit code: 1, or 128+N when Slurm (--kill-on-bad-exit) killed the other node's launcher.
    assert re.search(r"the step failed with exit code \d+: requeueing the job \(restart 1 of 3\)", text), details
    assert text.count("requeueing the job") == 1, details
    assert "resumed from step 10 (restart 1)" in text, details
    assert "done: 30 steps" in text, details
    assert (state, exit_code, job_field(slurm, job, "Restarts")) == ("COMPLETED", "0:0", "1"), details
    assert_same_weights(weights, uninterrupted_weights)


def test_torchmn_run_max_restarts_in_a_multi_node_step_is_refused(slurm):
    """One launcher per node cannot restart alone: --max-restarts is refused, naming Slurm's requeue."""
    proc = slurm.run(["srun", "-N", "2", "--ntasks-per-node", "1", PY, "-m", "torchmn", "run", "-np", "1",
                      "--max-restarts", "2", PY, "-c", "print('started')"], env=job_env(), timeout=60, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "--max-restarts does not work with one torchmn run per node (2 Slurm tasks)" in output, output
    assert "#SBATCH --requeue" in output and "scontrol requeue $SLURM_JOB_ID" in output, output
    assert "started" not in output, output


def test_torchmn_run_restarts_inside_a_one_task_step(slurm):
    """A single launcher in a Slurm step (one node) restarts its ranks as it does anywhere."""
    code = ("import os, sys\n"
            "count = int(os.environ['TORCHMN_RESTART_COUNT'])\n"
            "print('start', count, flush=True)\n"
            "sys.exit(3 if count == 0 and os.environ['RANK'] == '1' else 0)\n")
    proc = slurm.run(["srun", "-N", "1", "-n", "1", PY, "-m", "torchmn", "run", "-np", "2", "--max-restarts", "1",
                      "--restart-delay", "0", PY, "-c", code], env=job_env(), timeout=60)
    assert re.findall(r"^\[1\] start (\d)", proc.stdout, re.M) == ["0", "1"], proc.stdout
    assert "the job completed after 1 restart" in proc.stderr, proc.stderr


def test_scancel_ends_a_torchmn_run_with_max_restarts(slurm):
    """scancel sends SIGTERM to every process of the step, the ranks as well as the launcher: the
    ranks dying of it must not be restarted, however the signals race (the restart delay lets
    the launcher's own SIGTERM arrive)."""
    code = ("import os, time\n"
            "print('start', os.environ['TORCHMN_RESTART_COUNT'], 'job', os.environ['SLURM_JOB_ID'], flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen(["srun", "-N", "1", "-n", "1", PY, "-m", "torchmn", "run", "-np", "2", "--max-restarts",
                             "3", PY, "-c", code], env=slurm.env(job_env()), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        job = re.search(r"start 0 job (\d+)", first)
        assert job, first
        slurm.run(["scancel", job.group(1)], timeout=10)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "start 1" not in out, out
    assert "restarting the job" not in err, err
    assert "received SIGTERM" in err, err
    # The cancelled job holds its node while it completes: the next test must find it free.
    wait_for("the nodes to be idle", lambda: set(slurm.run(["sinfo", "-h", "-N", "-o", "%t"], timeout=10).stdout.split())
             == {"idle"}, 30, lambda: slurm.run(["sinfo", "-N"], timeout=10).stdout)


@pytest.mark.timeout(240)
def test_two_jobs_on_one_rendezvous_port_stop_at_once(slurm, tmp_path):
    """Two steps that end up on the same port (derived ports can collide; here MASTER_PORT forces
    it): the second job's rank 0 cannot listen, and its other rank, which reaches the first job's
    store, sees whose it is and stops too, instead of waiting there for the whole timeout."""
    port = str(20000 + (os.getpid() + 7) % 10000)
    script = tmp_path / "hold.py"
    script.write_text("import sys, time, torchmn\n"
                      "comm = torchmn.create_communicator()\n"
                      "sys.stdout.write(f'READY {comm.rank}\\n'); sys.stdout.flush()\n"
                      "time.sleep(float(sys.argv[1]))\n"
                      "comm.finalize()\n")
    env = job_env(MASTER_PORT=port, TORCHMN_TIMEOUT="60")
    first = subprocess.Popen(["srun", "-N", "1", "-n", "2", "-w", "n1", PY, str(script), "300"],
                             env=slurm.env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready = [first.stdout.readline() for _ in range(2)]
        assert all("READY" in line for line in ready), ready
        start = time.monotonic()
        # The first job holds the port until it is killed below, however long the second takes to start.
        second = slurm.run(["srun", "-N", "1", "-n", "2", "-w", "n2", PY, str(script), "0"], env=env,
                           timeout=120, check=False)
        took = time.monotonic() - start
    finally:
        first.kill()
        first.wait(timeout=30)
    out = second.stdout + second.stderr
    assert second.returncode != 0 and "READY" not in second.stdout, out
    assert f"the rendezvous port {port} is in use" in out, out
    assert "belongs to Slurm job" in out, out
    assert took < 45, (took, out)  # its ranks' start-up on a loaded machine, not TORCHMN_TIMEOUT's 60 s


@pytest.mark.parametrize("mode", ["raise", "optimizer"])
def test_exception_in_a_collective_ends_the_srun_step(slurm, mode, tmp_path):
    """2 nodes x 2 ranks, no --kill-on-bad-exit: Slurm stops nobody when rank 1 raises while the
    others wait for it (in an allreduce, or the optimizer's gradient averaging across the nodes).
    Every rank still ends within seconds, rank 1's traceback is shown once, and the three others
    each say in one line that rank 1 failed (the news crosses to n2 through the closed connections)."""
    proc = slurm.run(["srun", "-N", "2", "--ntasks-per-node", "2", *failing_argv(mode, tmp_path)], env=job_env(),
                     timeout=120, check=False)
    output = proc.stdout + proc.stderr
    seconds = seconds_since_raise(tmp_path, output)
    assert proc.returncode != 0, output
    assert_failure_shown_once(output, seconds, others_named={0, 2, 3})


def test_monitor_and_timeline_under_srun_across_nodes(slurm, tmp_path):
    """TORCHMN_MONITOR=1 and TORCHMN_TIMELINE under `srun -N 2`: rank 0 reads both ranks' figures from
    the job's store and names rank 1, which sleeps 50 ms per step, the straggler; each node writes its
    part of the timeline into the shared folder, and rank 0 joins them."""
    path = tmp_path / "trace.json"
    proc = slurm.run(["srun", "-N", "2", "--ntasks-per-node", "1", PY, str(WORKERS / "straggler.py"), "40"],
                     env=job_env(TORCHMN_MONITOR="1", TORCHMN_TIMELINE=str(path)), timeout=90)
    assert re.search(r"torchmn monitor: slowest: rank 1 \(\S+\), busy", proc.stderr), proc.stderr
    assert "torchmn monitor: straggler: rank(s) 1 " in proc.stderr, proc.stderr
    pids = {e["pid"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
