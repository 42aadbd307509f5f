"""`torchmn doctor` on real jobs: oversubscribed, budgeted and under-used, read from its JSON output.

The jobs run on 2 CPUs (the first two this machine has), so the verdicts mean the same on any machine.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from jobs import REPO, clean_env


BUSY = REPO / "tests" / "scripts" / "busy.py"
TWO_CPUS = sorted(os.sched_getaffinity(0))[:2]
# After the warm-up the doctor waits for every rank's second optimizer step (busy.py --steps), or,
# where the job reports none (busy.py alone: the oversubscription case), until the job has used
# torchmn.doctor.command.STEP_WAIT_CPU_S (10 CPU-seconds) per rank; then it samples.
WARMUP_S = 3


def doctor(args, env=None, timeout=90):
    proc = subprocess.run([sys.executable, "-m", "torchmn", "doctor", *args], env=clean_env(env), capture_output=True,
                          text=True, timeout=timeout, preexec_fn=lambda: os.sched_setaffinity(0, TWO_CPUS))
    return proc


def diagnosis(args, env=None):
    # The job computes from the end of the warm-up on (busy.py's BUSY_FROM), not through it, so the
    # CPU a spinning warm-up would take goes to the other tests meanwhile.
    env = {**(env or {}), "BUSY_FROM": str(time.time() + WARMUP_S)}
    proc = doctor(["--json", "--warmup", str(WARMUP_S), "--seconds", "3", *args], env)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


pytestmark = pytest.mark.skipif(len(TWO_CPUS) < 2, reason="needs 2 CPUs")


@pytest.mark.timeout(120)
def test_doctor_finds_oversubscription():
    """2 ranks x OMP_NUM_THREADS=2 and 4 DataLoader workers each, on 2 CPUs: the seed case."""
    rc, d = diagnosis(["-np", "2", "--", sys.executable, str(BUSY), "60", "4"], {"OMP_NUM_THREADS": "2"})
    assert d["verdict"] == "oversubscribed" and rc == 1, json.dumps(d, indent=1)
    assert len(d["ranks"]) == 2 and [r["rank"] for r in d["ranks"]] == [0, 1], d["ranks"]
    assert all(r["workers"] == 4 and r["settings"]["OMP_NUM_THREADS"] == "2" for r in d["ranks"]), d["ranks"]
    assert "OMP_NUM_THREADS=1" in d["fix"] and "dataloader_workers_budget" in d["fix"], d["fix"]


@pytest.mark.timeout(120)
def test_doctor_calls_torchmns_budget_fine():
    rc, d = diagnosis(["-np", "2", "--", sys.executable, str(BUSY), "60", "0", "--steps"])
    assert d["verdict"] == "fine" and rc == 0, d
    assert all(r["steps"]["steps"] >= 2 for r in d["ranks"]), d["ranks"]
    assert all(r["settings"]["OMP_NUM_THREADS"] == "1" and r["budget_threads"] == 1 for r in d["ranks"]), d["ranks"]


@pytest.mark.timeout(120)
def test_doctor_finds_an_under_used_machine():
    """One process with one thread on 2 CPUs."""
    rc, d = diagnosis(["--", sys.executable, str(BUSY), "60", "0", "--steps"], {"OMP_NUM_THREADS": "1"})
    assert d["verdict"] == "under-used" and rc == 0, d
    assert d["ranks"][0]["rank"] is None and "-np 2" in d["fix"], d
    assert d["ranks"][0]["steps"]["steps"] >= 2, d["ranks"]


@pytest.mark.timeout(120)
def test_doctor_under_used_by_a_straggler_names_it():
    """2 ranks of torchmn's budget (1 thread each on 2 CPUs) leave the CPUs idle because rank 1 sleeps
    before each step: the fix names the straggler, not the settings the job already has."""
    rc, d = diagnosis(["-np", "2", "--", sys.executable, str(BUSY), "60", "0", "--steps", "--straggle", "80"])
    assert d["verdict"] == "under-used" and rc == 0, d
    assert d["steps"]["stragglers"] == [1] and "wait for rank(s) 1" in d["fix"], d
    assert "TORCHMN_NUM_THREADS" not in d["fix"] and "-np" not in d["fix"], d["fix"]


@pytest.mark.timeout(120)
def test_doctor_stops_sampling_when_the_command_ends():
    """A command that ends 20 s into a 60 s window: the sampling stops there, and the report says
    the figures cover the time it ran."""
    started = time.monotonic()
    proc = doctor(["--json", "--warmup", "1", "--seconds", "60", "--", sys.executable, str(BUSY), "20", "0", "--steps"])
    took = time.monotonic() - started
    d = json.loads(proc.stdout)
    assert took < 55 and d["seconds"] < 30 and d["ended"] == [d["ranks"][0]["pid"]], (took, d)
    # Its CPU share is over the time it ran, not the 60 s asked for; how much CPU it got depends on the load.
    assert d["ranks"][0]["cpu_percent"] > 0, d["ranks"]


@pytest.mark.timeout(60)
def test_doctor_attaches_to_a_job_by_its_id():
    job = subprocess.Popen([sys.executable, str(BUSY), "60"], env=clean_env({"SLURM_JOB_ID": "doctor-test-42",
                                                                              "OMP_NUM_THREADS": "1"}))
    try:
        proc = doctor(["--job", "doctor-test-42", "--seconds", "1"])
        assert proc.returncode == 0 and f"(pid {job.pid})" in proc.stdout and "verdict: " in proc.stdout, \
            proc.stdout + proc.stderr
    finally:
        job.kill()
        job.wait()


@pytest.mark.timeout(60)
def test_doctor_adds_up_the_cpus_of_srun_tasks_bound_apart():
    """Two srun tasks with --cpus-per-task=1, each bound to a CPU of its own: the job has 2 CPUs, and
    one busy thread per task is fine (the first task's one CPU was taken for the whole job's)."""
    tasks = [subprocess.Popen([sys.executable, str(BUSY), "60"], env=clean_env({
        "SLURM_JOB_ID": "doctor-test-srun", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
        "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1", "SLURM_CPUS_ON_NODE": "2", "OMP_NUM_THREADS": "1"}),
        preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, [cpu])) for r, cpu in enumerate(TWO_CPUS)]
    try:
        proc = doctor(["--job", "doctor-test-srun", "--seconds", "1", "--json"])
        d = json.loads(proc.stdout)
        assert d["cpus"] == 2 and d["limits"]["affinity"] == 2 and d["limits"]["slurm"] == 2, d
        assert d["verdict"] != "oversubscribed" and proc.returncode == 0, d
    finally:
        for task in tasks:
            task.kill()
            task.wait()


def test_doctor_says_a_process_has_ended():
    job = subprocess.Popen([sys.executable, "-c", "pass"])
    job.wait()
    proc = doctor(["--pid", str(job.pid)])
    assert proc.returncode == 2 and f"process {job.pid} has ended" in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_doctor_says_the_command_failed():
    """A command that fails before it is sampled is named as failed, not as one that needs more work."""
    proc = doctor(["--", sys.executable, "-c", "raise SystemExit(3)"])
    assert proc.returncode == 2, proc.stderr
    assert "the command failed (exit code 3) before it could be sampled" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args,words", [([], "nothing to inspect"),
                                        (["--pid", "1", "--", "true"], "not both"),
                                        (["--seconds", "0", "--", "true"], "--seconds must be a positive number"),
                                        (["--seconds", "nan", "--", "true"], "got --seconds nan"),
                                        (["--seconds", "inf", "--", "true"], "got --seconds inf"),
                                        (["--pid", "-5"], "--pid -5 is no process id")])
def test_doctor_refuses_bad_input(args, words):
    proc = doctor(args)
    assert proc.returncode == 2 and words in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.timeout(60)
def test_doctor_says_an_environment_it_may_not_read_is_unknown_not_unset():
    """Another user's process (psutil's AccessDenied, as a user without root gets it): its thread
    settings are unknown, which the report says, with the fix; not "no thread variables set"."""
    import psutil

    from torchmn.doctor import processes, sampling, verdict

    class OtherUsers(psutil.Process):
        def environ(self):
            raise psutil.AccessDenied(self.pid)
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=clean_env({"OMP_NUM_THREADS": "1"}))
    try:
        ranks = processes.ranks_in_trees([OtherUsers(job.pid)])
        assert [(r.pid, r.environment_read) for r in ranks] == [(job.pid, False)], ranks
        d = verdict.diagnose(ranks, sampling.sample([job.pid], 0.2), processes.job_cpu_limits(ranks), 0.2)
        text = verdict.report(d)
        assert "no thread variables set" not in text and "environment is not readable" in text, text
        assert d.to_json()["ranks"][0]["environment_read"] is False
    finally:
        job.kill()
        job.wait()


@pytest.mark.timeout(60)
def test_doctor_takes_a_launcher_that_inherited_slurm_procid_for_no_rank():
    """In an sbatch script every process has SLURM_PROCID=0: torchmn run (or torchrun's agent)
    under it is no rank; its children, numbered by TORCHMN_RANK, are the ranks."""
    import psutil

    from torchmn.doctor.processes import ranks_in_trees

    # Each child says it runs before the launcher names them: right after exec() returns to Popen,
    # /proc/PID/environ can still read empty for a moment.
    code = ("import os, subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; print(1, flush=True); time.sleep(60)'],\n"
            "                         env={**os.environ, 'TORCHMN_RANK': str(r)}, stdout=subprocess.PIPE)\n"
            "        for r in range(2)]\n"
            "[k.stdout.readline() for k in kids]\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "time.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], env=clean_env({"SLURM_PROCID": "0"}),
                                stdout=subprocess.PIPE, text=True)
    try:
        kids = [int(pid) for pid in launcher.stdout.readline().split()]
        ranks = ranks_in_trees([psutil.Process(launcher.pid)])
        assert [(r.rank, r.pid) for r in ranks] == [(0, kids[0]), (1, kids[1])], ranks
    finally:
        for child in psutil.Process(launcher.pid).children():
            child.kill()
        launcher.kill()
        launcher.wait()


@pytest.mark.timeout(90)
def test_doctor_leaves_out_figures_an_earlier_job_left_in_the_folder(tmp_path):
    """A TORCHMN_MONITOR_DIR given to every job keeps earlier jobs' files (here a slow rank 2 of a
    3-rank job): they are not this job's and are not compared."""
    stale = {"rank": 2, "host": "vm", "pid": 2 ** 22 + 7, "steps": 700, "busy_ms": 41.4, "step_ms": 42.0,
             "wait_share": 0.0, "final": True, "time": time.time() - 3600}
    (tmp_path / "rank-2.json").write_text(json.dumps(stale))
    job = subprocess.Popen([sys.executable, str(BUSY), "60", "0", "--steps"],
                           env=clean_env({"TORCHMN_MONITOR_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "rank-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc = doctor(["--pid", str(job.pid), "--seconds", "1", "--json"])
        d = json.loads(proc.stdout)
        assert "rank 2" not in json.dumps(d["steps"]), d["steps"]
    finally:
        job.kill()
        job.wait()
