"""CPU thread budget arithmetic (fake environments) and its application inside a process."""
import json
import os
import subprocess
import sys

import pytest

from torchmn import resources


@pytest.fixture
def cpus(monkeypatch):
    """Pretend the machine gives this process N CPUs and has no cgroup quota."""
    def set_cpus(n, quota=None):
        monkeypatch.setattr(resources, "affinity_cpu_count", lambda: n)
        monkeypatch.setattr(resources, "cgroup_cpu_limit", lambda: quota)
    return set_cpus


def test_available_is_the_tightest_limit(cpus):
    cpus(16)
    task = {"SLURM_STEP_ID": "0"}
    assert resources.cpu_count_available({}) == 16
    assert resources.cpu_count_available({**task, "SLURM_CPUS_PER_TASK": "6"}) == 6
    assert resources.cpu_count_available({**task, "SLURM_CPUS_PER_TASK": "junk"}) == 16
    cpus(16, quota=3)
    assert resources.cpu_count_available({**task, "SLURM_CPUS_PER_TASK": "6"}) == 3


@pytest.mark.parametrize("n, local_size, expected", [(16, 1, 16), (16, 4, 4), (16, 3, 5), (2, 4, 1), (1, 1, 1)])
def test_budget_divides_and_never_reaches_zero(cpus, n, local_size, expected):
    cpus(n)
    assert resources.thread_budget(local_size, {}) == expected


def test_bound_ranks_share_a_quota_smaller_than_the_host(cpus):
    """16 CPUs in 2 domains of 8, a container quota of 8: two ranks bound to a domain each get 4
    threads each (their share of the quota), not 8 each; without a quota, 8 each."""
    cpus(16, quota=8)
    assert [resources.launcher_thread_env(2, {}, bound=(8, 1))["OMP_NUM_THREADS"] for _ in range(2)] == ["4", "4"]
    cpus(16)
    assert resources.launcher_thread_env(2, {}, bound=(8, 1))["OMP_NUM_THREADS"] == "8"


def test_workers_budget_follows_the_users_omp_num_threads_first(cpus):
    cpus(8)
    assert resources.dataloader_workers_budget(1, {"OMP_NUM_THREADS": "1", "TORCHMN_NUM_THREADS": "4"}) == 0
    assert resources.dataloader_workers_budget(1, {"TORCHMN_NUM_THREADS": "4"}) == 3


def test_budget_rejects_nonsense_local_size(cpus):
    cpus(4)
    with pytest.raises(ValueError, match="local_size"):
        resources.thread_budget(0, {})


def test_launcher_env_sets_every_pool(cpus):
    cpus(8)
    env = resources.launcher_thread_env(2, {})
    assert env == {**{name: "4" for name in resources.THREAD_VARIABLES + ("TORCHMN_NUM_THREADS",)},
                   "TORCHMN_THREAD_VARIABLES": ",".join(resources.THREAD_VARIABLES + ("TORCHMN_NUM_THREADS",))}


def test_launcher_started_where_a_budget_was_applied_budgets_its_own_ranks(cpus):
    """A torchmn run started from a rank, or from a script after create_communicator: the values
    torchmn set there are not the user's, and its ranks get their own budget."""
    cpus(8)
    applied = {**resources.launcher_thread_env(1, {}), "MKL_NUM_THREADS": "1"}
    applied["TORCHMN_THREAD_VARIABLES"] = applied["TORCHMN_THREAD_VARIABLES"].replace("MKL_NUM_THREADS,", "")
    env = resources.launcher_thread_env(4, applied)
    assert env["OMP_NUM_THREADS"] == env["TORCHMN_NUM_THREADS"] == "2" and "MKL_NUM_THREADS" not in env, env
    # A value the user put in since is theirs: {**os.environ, "OMP_NUM_THREADS": "3"} for a subprocess.
    assert resources.launcher_thread_env(4, {**applied, "OMP_NUM_THREADS": "3"}) == {}


def test_launcher_env_leaves_user_settings_alone(cpus):
    cpus(8)
    assert resources.launcher_thread_env(2, {"OMP_NUM_THREADS": "3"}) == {}
    env = resources.launcher_thread_env(2, {"MKL_NUM_THREADS": "1"})
    assert "MKL_NUM_THREADS" not in env and env["OMP_NUM_THREADS"] == "4"
    env = resources.launcher_thread_env(2, {"TORCHMN_NUM_THREADS": "7"})
    assert env["OMP_NUM_THREADS"] == env["TORCHMN_NUM_THREADS"] == "7"


def test_srun_tasks_keep_their_own_cpus(cpus):
    cpus(4)
    srun = {"SLURM_STEP_ID": "0", "SLURM_LOCALID": "1", "SLURM_CPUS_PER_TASK": "4"}
    assert resources.ranks_sharing_cpus(4, srun) == 1
    # torchmn run inside a batch script: its ranks share the script's CPUs.
    assert resources.ranks_sharing_cpus(4, {**srun, "TORCHMN_RANK": "1"}) == 4
    assert resources.ranks_sharing_cpus(4, {"SLURM_CPUS_PER_TASK": "4"}) == 4
    assert resources.ranks_sharing_cpus(4, {**srun, "SLURM_STEP_ID": "batch"}) == 4


def test_srun_pmi2_tasks_keep_their_own_cpus(cpus):
    """srun --mpi=pmi2 (or MpiDefault=pmi2) gives every task PMI_RANK too: still srun's task, with
    its own CPUs, as detection says; mpiexec (Hydra, MPI_LOCALRANKID) inside an allocation is not."""
    cpus(4)
    srun = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "41", "SLURM_LOCALID": "1",
            "SLURM_CPUS_PER_TASK": "4", "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_JOBID": "41.0", "PMI_FD": "5"}
    assert resources.ranks_sharing_cpus(4, srun) == 1
    assert resources.ranks_sharing_cpus(4, {**srun, "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}) == 4


def test_dataloader_workers_leave_one_cpu_for_the_rank(cpus):
    cpus(8)
    assert resources.dataloader_workers_budget(2, {}) == 3
    assert resources.dataloader_workers_budget(8, {}) == 0
    assert resources.dataloader_workers_budget(2, {"OMP_NUM_THREADS": "2"}) == 1


def cgroup_limit(root, proc_cgroup_lines):
    """cgroup_cpu_limit for a fake cgroup tree under ``root`` and a fake /proc/self/cgroup."""
    proc = root / "proc-self-cgroup"
    proc.write_text(proc_cgroup_lines)
    return resources.cgroup_cpu_limit(root=str(root), proc_cgroup=str(proc))


def write_v1_quotas(quotas):
    for directory, quota in quotas:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (directory / "cpu.cfs_period_us").write_text("100000\n")


def test_cgroup_v2_quota_of_own_cgroup_and_parents(tmp_path):
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")
    assert cgroup_limit(tmp_path, "0::/job/step\n") == 3
    (tmp_path / "job" / "cpu.max").write_text("max 100000\n")
    assert cgroup_limit(tmp_path, "0::/job/step\n") is None


def test_cgroup_v1_quota(tmp_path):
    write_v1_quotas([(tmp_path / "cpu", 150000)])
    assert cgroup_limit(tmp_path, "5:memory:/\n4:cpu,cpuacct:/\n") == 2


def test_cgroup_v1_quota_of_own_cgroup_and_parents(tmp_path):
    """A quota on the process's own v1 cgroup (docker, systemd slices), not only on the root."""
    mount = tmp_path / "cpu,cpuacct"
    write_v1_quotas([(mount, -1), (mount / "job", 100000), (mount / "job" / "step", -1)])
    assert cgroup_limit(tmp_path, "7:pids:/job/step\n4:cpu,cpuacct:/job/step\n") == 1
    write_v1_quotas([(mount / "job", -1)])
    assert cgroup_limit(tmp_path, "7:pids:/job/step\n4:cpu,cpuacct:/job/step\n") is None


def test_slurm_cpus_per_task_counts_per_task(cpus):
    """--cpus-per-task is what each srun task has; a batch script, and the ranks a launcher starts
    inside it, share the job's CPUs on the node."""
    cpus(8)
    batch = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_CPUS_PER_TASK": "2", "SLURM_CPUS_ON_NODE": "8"}
    # `sbatch --ntasks-per-node 4 -c 2` running `torchmn run -np 4`: 8 CPUs for 4 ranks.
    assert resources.cpu_count_available(batch) == 8
    assert resources.launcher_thread_env(4, batch)["OMP_NUM_THREADS"] == "2"
    assert resources.cpu_count_available({**batch, "SLURM_STEP_ID": "4294967291"}) == 8  # the batch step's id
    # The same, run by mpirun (whose ranks may carry the step id of its srun-started daemons).
    mpi = {**batch, "SLURM_STEP_ID": "0", "OMPI_COMM_WORLD_RANK": "1"}
    assert resources.thread_budget(resources.ranks_sharing_cpus(4, mpi), mpi) == 2
    # `srun -n 4 -c 2 python train.py`: each task its own 2 CPUs.
    task = {**batch, "SLURM_STEP_ID": "0"}
    assert resources.cpu_count_available(task) == 2 and resources.ranks_sharing_cpus(4, task) == 1
    cpus(8, quota=3)
    assert resources.cpu_count_available(batch) == 3


APPLY = """
import json, os, numpy, torch
from threadpoolctl import threadpool_info
from torchmn import resources
first = resources.apply_thread_budget(2)
second = resources.apply_thread_budget(2)
print(json.dumps({"first": first, "second": second, "torch": torch.get_num_threads(),
                  "omp": os.environ.get("OMP_NUM_THREADS"), "mkl": os.environ.get("MKL_NUM_THREADS"),
                  "pools": {i["internal_api"]: i["num_threads"] for i in threadpool_info()}}))
"""


def apply_in_subprocess(**extra):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env.update(extra)
    result = subprocess.run([sys.executable, "-c", APPLY], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_apply_thread_budget_in_a_rank():
    expected = max(1, resources.cpu_count_available() // 2)
    got = apply_in_subprocess()
    pools = got.pop("pools")
    assert got == {"first": expected, "second": expected, "torch": expected,
                   "omp": str(expected), "mkl": str(expected)}
    assert pools and set(pools.values()) == {expected}, pools


def test_apply_thread_budget_honours_the_user():
    got = apply_in_subprocess(OMP_NUM_THREADS="3")
    # torch reads OMP_NUM_THREADS itself (and may cap it at the core count); torchmn changes nothing.
    assert got["first"] is got["second"] is None and got["omp"] == "3" and got["mkl"] is None
    got = apply_in_subprocess(TORCHMN_NUM_THREADS="1")
    assert got["first"] == got["second"] == got["torch"] == 1 and got["omp"] == "1"


def test_apply_thread_budget_user_omp_wins_over_torchmn_num_threads():
    """OMP_NUM_THREADS set by the user wins, as documented and as `torchmn run -v` reports."""
    got = apply_in_subprocess(OMP_NUM_THREADS="2", TORCHMN_NUM_THREADS="1")
    assert got["first"] is None and got["omp"] == "2" and got["torch"] == min(2, os.cpu_count()), got
    # What torchmn run puts in a rank's environment: both the same, applied.
    got = apply_in_subprocess(OMP_NUM_THREADS="1", TORCHMN_NUM_THREADS="1")
    assert got["first"] == got["torch"] == 1, got


INTEROP = """
import warnings, torch
from torchmn import resources


@torch.jit.script
def forked(x):
    return torch.jit.wait(torch.jit._fork(torch.mm, x, x))


forked(torch.ones(4, 4))  # the inter-op pool runs work first (an eager fork runs inline)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    resources.apply_thread_budget(1)
print([str(w.message) for w in caught])
"""


def test_interop_threads_blank_is_unset_and_too_late_is_warned(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    script = tmp_path / "interop.py"  # a file: torch.jit.script reads the function's source
    script.write_text(INTEROP)
    blank = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                           env={**env, "TORCHMN_INTEROP_THREADS": " "})
    assert blank.returncode == 0 and blank.stdout.strip() == "[]", blank.stderr
    late = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**env, "TORCHMN_INTEROP_THREADS": "3"})
    assert late.returncode == 0 and "TORCHMN_INTEROP_THREADS=3 was not applied" in late.stdout, late


def test_apply_thread_budget_leaves_a_users_blas_threads():
    """A pool whose variable the user set keeps that count; the others get the budget."""
    if os.cpu_count() < 2:
        pytest.skip("needs 2 CPUs to tell 2 threads from the budget of 1")
    got = apply_in_subprocess(OPENBLAS_NUM_THREADS="2", TORCHMN_NUM_THREADS="1")
    assert got["pools"].get("openblas") == 2 and got["pools"].get("openmp") == 1, got


@pytest.mark.parametrize("imports", ["import torch, torchmn", "import torchmn, torch"],
                         ids=["torch_first", "torchmn_first"])
def test_a_scripts_torch_threads_equal_to_torchs_default_win(imports):
    """torch.set_num_threads(n) after `import torchmn` wins also where n is torch's default count
    (which a comparison with the count at import cannot tell from no call)."""
    script = (imports + "\nfrom torchmn import resources\ndefault = torch.get_num_threads()\n"
              "torch.set_num_threads(default)\nprint(default, resources.apply_thread_budget(2), torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    default, applied, now = out.stdout.split()
    if int(default) < 2:
        pytest.skip("torch's default here is 1 thread, the budget of 2 ranks too: nothing to tell apart")
    assert applied == default and now == default, out.stdout


@pytest.mark.parametrize("imports", ["import torch, torchmn", "import torchmn, torch"],
                         ids=["torch_first", "torchmn_first"])
def test_a_scripts_own_torch_threads_win(imports):
    """torch.set_num_threads called after `import torchmn` is the script's choice: it becomes the budget,
    whether torch was imported before torchmn or after (``import torchmn`` does not import torch)."""
    script = (imports + "\nfrom threadpoolctl import threadpool_info\nfrom torchmn import resources\n"
              "torch.set_num_threads({n})\nprint(resources.apply_thread_budget(2), torch.get_num_threads())\n"
              "assert {{i['num_threads'] for i in threadpool_info()}} == {{{n}}}, threadpool_info()")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    for n in (1, 3):
        out = subprocess.run([sys.executable, "-c", script.format(n=n)], capture_output=True, text=True,
                             env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(n), str(n)], out.stdout
    # Under torchmn run (the variables it set at the budget of 2), the script's 1 replaces them, for the
    # pools and for child processes; a variable the user set stays, even at the budget's value.
    launched = {**env, **resources.launcher_thread_env(1, {"TORCHMN_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"})}
    assert "OPENBLAS_NUM_THREADS" not in launched[resources.TORCHMN_THREAD_VARIABLES]
    launched["OPENBLAS_NUM_THREADS"] = "2"
    code = (script.format(n=1).rsplit("\n", 1)[0] + "\nimport os; print(os.environ['OMP_NUM_THREADS'], "
            "os.environ['TORCHMN_NUM_THREADS'], os.environ['OPENBLAS_NUM_THREADS'])\n"
            "print({i['internal_api']: i['num_threads'] for i in threadpool_info()})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=launched, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["1", "1"] and lines[1].split() == ["1", "1", "2"], out.stdout
    assert eval(lines[2]) == {"openmp": 1, "openblas": 2}, out.stdout


FROZEN = """
{imports}
import gc
class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it

    def __del__(self):
        print("collected", flush=True)

Node()
gc.collect()
print(gc.get_freeze_count(), any(o is torch.nn.Module for o in gc.get_objects()))
"""


@pytest.mark.parametrize("imports", ["import torch, torchmn", "import torchmn, torch"],
                         ids=["torch_first", "torchmn_first"])
def test_torchs_import_time_objects_are_frozen_and_the_scripts_still_collected(imports):
    """Once torch is loaded, its import-time objects leave the collections (gc.freeze: full
    collections and the exit no longer walk them); what the script makes afterwards is collected
    as before, cycles and finalizers included."""
    out = subprocess.run([sys.executable, "-c", FROZEN.format(imports=imports)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    collected, counts = out.stdout.splitlines()
    frozen, listed = counts.split()
    assert collected == "collected" and int(frozen) > 100_000 and listed == "False", out.stdout


def test_a_bad_torchmn_num_threads_is_refused():
    for value in ("abc", "0", "-2", "2,1"):
        with pytest.raises(ValueError, match=f"TORCHMN_NUM_THREADS='{value}' is not a positive integer"):
            resources.launcher_thread_env(2, {"TORCHMN_NUM_THREADS": value})
    assert resources.launcher_thread_env(2, {"TORCHMN_NUM_THREADS": ""})["OMP_NUM_THREADS"] == str(
        max(1, resources.cpu_count_available({}) // 2))
