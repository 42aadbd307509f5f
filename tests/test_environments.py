"""detect_environment for each launcher, as a pure function and in a fresh interpreter."""
import dataclasses
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from torchmn.environments import LaunchEnvironment, detect_environment
from jobs import communicate_all
from mpi4py_builds import mpi4py_dir
from torchmn.environments import slurm_misuse_error, slurm_port, text_port
from torchmn.environments.mpi import MPI_RENDEZVOUS

REPO = pathlib.Path(__file__).resolve().parents[1]

LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHMN_", "TORCHELASTIC_",
                     "HYDRA_", "I_MPI_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "GROUP_RANK",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}

TORCHMN = {"TORCHMN_RANK": "5", "TORCHMN_SIZE": "8", "TORCHMN_LOCAL_RANK": "1", "TORCHMN_LOCAL_SIZE": "4",
           "TORCHMN_NODE_RANK": "1", "TORCHMN_NODE_COUNT": "2", "MASTER_ADDR": "node1",
           "MASTER_PORT": "41234",
           # torchmn run also sets torchrun's names; torchmn's own must win.
           "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "abc"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_NODE_RANK": "2",
           "OMPI_MCA_ess_base_jobid": "2089418753", "PMIX_NAMESPACE": "2089418753"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "8"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_JOB_ID": "1234", "SLURM_JOBID": "1234",
         "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
         "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]"}
# What a batch script (sbatch -n 4) sees: the allocation, but no step of its own.
SLURM_BATCH = {"SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
               "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2(x2)",
               "SLURM_JOB_NODELIST": "n[1-2]"}

EXPECTED = {
    "torchmn": LaunchEnvironment(5, 8, 1, 4, 1, "node1", 41234, "torchmn"),
    "torchrun": LaunchEnvironment(3, 4, 1, 2, 1, "10.0.0.1", 29400, "torchrun"),
    "openmpi": LaunchEnvironment(2, 3, 2, 3, None, "127.0.0.1", text_port("2089418753"), "openmpi"),
    "mpich": LaunchEnvironment(1, 2, 1, 2, None, "127.0.0.1", 29500, "mpich"),
    "slurm": LaunchEnvironment(3, 4, 1, 2, 1, "n1", slurm_port(1234, 0), "slurm"),
    "single": LaunchEnvironment(0, 1, 0, 1, 0, "127.0.0.1", None, "single"),
}
ENVS = {"torchmn": TORCHMN, "torchrun": TORCHRUN, "openmpi": OPENMPI, "mpich": MPICH, "slurm": SLURM,
        "single": {}}


def clean_environ(extra):
    """os.environ without any launcher's variables (the test may itself run under one), plus extra."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(LAUNCHER_PREFIXES) and name not in LAUNCHER_NAMES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def detect_in_subprocess(extra):
    code = ("from torchmn.environments import detect_environment; import json, dataclasses; "
            "print(json.dumps(dataclasses.asdict(detect_environment())))")
    result = subprocess.run([sys.executable, "-c", code], env=clean_environ(extra), cwd=str(REPO),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("source", sorted(EXPECTED))
def test_each_launcher_every_field(source):
    assert detect_environment(ENVS[source]) == EXPECTED[source]


@pytest.mark.parametrize("source", sorted(EXPECTED))
def test_each_launcher_in_a_fresh_interpreter(source):
    assert detect_in_subprocess(ENVS[source]) == dataclasses.asdict(EXPECTED[source])


def test_default_reads_os_environ(monkeypatch):
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    for name, value in MPICH.items():
        monkeypatch.setenv(name, value)
    assert detect_environment() == EXPECTED["mpich"]


def test_import_does_not_import_torch():
    """Neither ``import torchmn`` nor reading the launcher's variables imports torch: the launcher's
    helper processes use both."""
    code = ("import sys, torchmn; from torchmn.environments import detect_environment; detect_environment(); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], env=clean_environ({}), cwd=str(REPO),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_deepspeed_launcher_local_size_and_node():
    """The DeepSpeed launcher names the local size LOCAL_SIZE and the node CROSS_RANK."""
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert detect_environment(env) == LaunchEnvironment(3, 4, 1, 2, 1, "10.0.0.1", 29500, "env")
    with pytest.raises(ValueError, match="LOCAL_RANK='2'.*LOCAL_SIZE='2'"):
        detect_environment({**env, "LOCAL_RANK": "2"})


def test_launch_module_detects_as_the_specification_names_it(monkeypatch):
    """``torchmn.launch.detect_environment()`` and ``expand_hostlist`` are the environments' own,
    reading os.environ by default."""
    import torchmn.launch

    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    for name, value in MPICH.items():
        monkeypatch.setenv(name, value)
    assert torchmn.launch.detect_environment() == EXPECTED["mpich"]
    assert torchmn.launch.expand_hostlist("n[08-10],gpu[1,1]") == ["n08", "n09", "n10", "gpu1", "gpu1"]


# ---- torchmn and torchrun ----

def test_torchmn_without_node_rank_and_master_port():
    env = {k: v for k, v in TORCHMN.items() if k not in ("TORCHMN_NODE_RANK", "MASTER_PORT")}
    assert detect_environment(env) == LaunchEnvironment(5, 8, 1, 4, None, "node1", None, "torchmn")


def test_env_launch_by_hand():
    """torch's env:// variables without torchrun (a script, a scheduler such as Kubeflow's
    PyTorchJob) are a job of their own, never a silent world of one per process."""
    env = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}
    assert detect_environment(env) == LaunchEnvironment(3, 4, 1, 2, None, "10.0.0.1", 29400, "env")
    # Without LOCAL_*: a loopback rendezvous means every rank is on this host...
    bare = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
    assert detect_environment(bare) == LaunchEnvironment(1, 3, 1, 3, None, "127.0.0.1", 29611, "env")
    assert detect_environment({**bare, "MASTER_ADDR": "localhost"}).local_size == 3
    # ... any other means one process per host, as Kubeflow starts them.
    assert detect_environment({**bare, "MASTER_ADDR": "master-0"}) == \
        LaunchEnvironment(1, 3, 0, 1, None, "master-0", 29611, "env")
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set and the 4 ranks"):
        detect_environment({k: v for k, v in env.items() if k != "MASTER_ADDR"})
    # LOCAL_RANK alone: on a loopback rendezvous every rank is still here; elsewhere the size is needed.
    assert detect_environment({**bare, "LOCAL_RANK": "1"}) == LaunchEnvironment(1, 3, 1, 3, None, "127.0.0.1", 29611,
                                                                                "env")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE is not set"):
        detect_environment({**bare, "MASTER_ADDR": "master-0", "LOCAL_RANK": "0"})
    # Slurm and MPI win over variables a batch script exported for its own use.
    assert detect_environment({**SLURM, **bare}).source == "slurm"
    assert detect_environment({**OPENMPI, **bare}).source == "openmpi"


def test_torchrun_single_node_without_master_addr():
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    assert detect_environment(env) == LaunchEnvironment(1, 2, 1, 2, None, "127.0.0.1", None, "torchrun")


# ---- precedence ----

def test_torchrun_wins_over_slurm():
    # torchrun started by srun: one srun task per node, torchrun's workers carry both sets.
    assert detect_environment({**SLURM, **TORCHRUN}) == EXPECTED["torchrun"]


def test_torchmn_wins_over_the_launchers_around_it():
    # srun's (one torchmn run per node, also with --mpi=pmi2's PMI_*) and torchrun's names it overrides.
    env = {**SLURM, **TORCHRUN, **TORCHMN, "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "5"}
    assert detect_environment(env) == EXPECTED["torchmn"]


@pytest.mark.parametrize("inner", ["torchrun", "openmpi", "mpich"])
def test_a_launcher_a_torchmn_rank_started_wins(inner):
    """`torchmn run -np 1 torchrun --nproc-per-node 2 ...` or `... mpirun -np 2 ...`: each process
    inherits the rank's TORCHMN_* variables, but its place is its own launcher's (else each would
    be a world of one and train alone)."""
    env = {**TORCHMN, **{"torchrun": TORCHRUN, "openmpi": OPENMPI, "mpich": MPICH}[inner]}
    place, expected = detect_environment(env), EXPECTED[inner]
    assert (place.source, place.rank, place.size, place.local_rank, place.local_size) == \
        (expected.source, expected.rank, expected.size, expected.local_rank, expected.local_size)


def test_openmpi_wins_over_slurm():
    # mpirun inside an allocation: the SLURM_* variables describe the batch step, not this rank.
    assert detect_environment({**SLURM_BATCH, **OPENMPI}) == EXPECTED["openmpi"]
    assert detect_environment({**SLURM, **OPENMPI}) == EXPECTED["openmpi"]


def test_openmpi_wins_over_slurm_in_a_fresh_interpreter():
    assert detect_in_subprocess({**SLURM, **OPENMPI}) == dataclasses.asdict(EXPECTED["openmpi"])


def test_mpich_wins_over_slurm():
    assert detect_environment({**SLURM, **MPICH}) == EXPECTED["mpich"]


def test_srun_pmi2_is_read_as_slurm():
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but not MPI_LOCALRANKID: Slurm knows more.
    env = {**SLURM, "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "5", "PMI_JOBID": "1234.0"}
    assert detect_environment(env) == EXPECTED["slurm"]


# ---- MPI ----

def test_mpi_multi_node_without_mpi4py_needs_master_addr(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # Python's marker for a module that cannot be imported
    env = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR is not set.*install mpi4py.*"
                                           r"mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500"):
        detect_environment(env)


@pytest.mark.cluster  # mpi4py built against each MPI (.ci/run builds both)
@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_mpi_multi_node_with_mpi4py_leaves_the_address_to_mpi(mpi, monkeypatch):
    """Detection only finds mpi4py (importing mpi4py.MPI would initialise MPI): rank 0 sends its
    address over MPI at set-up, on MASTER_PORT if set, else on a port it picks."""
    monkeypatch.syspath_prepend(mpi4py_dir(mpi))
    one_per_node = {"openmpi": {"OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
                    "mpich": {"MPI_LOCALNRANKS": "1", "MPI_LOCALRANKID": "0"}}
    env = {**(OPENMPI if mpi == "openmpi" else MPICH), **one_per_node[mpi]}
    place = detect_environment(env)
    assert (place.master_addr, place.master_port, place.source) == (MPI_RENDEZVOUS, None, mpi)
    assert detect_environment({**env, "MASTER_PORT": "23456"}).master_port == 23456
    assert detect_environment({**env, "MASTER_ADDR": "head"}).master_addr == "head"
    assert "mpi4py" not in sys.modules and "mpi4py.MPI" not in sys.modules
    # Every rank on this node: nothing to send.
    assert detect_environment(OPENMPI if mpi == "openmpi" else MPICH) == EXPECTED[mpi]


def test_mpi_master_addr_and_port_from_environment_win():
    env = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "MASTER_ADDR": "head", "MASTER_PORT": "23456"}
    assert detect_environment(env) == LaunchEnvironment(2, 3, 0, 2, None, "head", 23456, "openmpi")


def test_openmpi_port_falls_back_to_other_job_ids_then_default():
    env = {k: v for k, v in OPENMPI.items() if k != "OMPI_MCA_ess_base_jobid"}
    assert detect_environment(env).master_port == text_port("2089418753")
    env = {k: v for k, v in env.items() if k != "PMIX_NAMESPACE"}
    assert detect_environment(env).master_port == 29500
    env["OMPI_MCA_orte_ess_jobid"] = "99"
    assert detect_environment(env).master_port == text_port("99")


def test_derived_ports_are_in_range():
    assert all(20000 <= slurm_port(job, step) < 32000 for job in (0, 1, 99999, 2**32) for step in (0, 5))
    assert 20000 <= text_port("anything") < 32000
    assert slurm_port(1234, 0) != slurm_port(1234, 1) != slurm_port(1235, 0)


# ---- Slurm ----

def slurm_with(**changes):
    env = dict(SLURM)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@pytest.mark.parametrize("nodelist, first", [
    ("rack[1-2]-node[01-02]", "rack1-node01"),
    ("node[1-3]-ib[1-2]", "node1-ib1"),
    ("gpu[007-9],cpu1", "gpu007"),
    ("b,a", "b"),
])
def test_slurm_master_is_first_host_of_step_nodelist(nodelist, first):
    assert detect_environment(slurm_with(SLURM_STEP_NODELIST=nodelist)).master_addr == first


def test_slurm_step_nodelist_preferred_over_job_nodelist():
    env = slurm_with(SLURM_STEP_NODELIST="step[3-4]", SLURM_JOB_NODELIST="job[1-4]", SLURM_NODELIST="old1")
    assert detect_environment(env).master_addr == "step3"
    env = slurm_with(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST="job[1-4]", SLURM_NODELIST="old1")
    assert detect_environment(env).master_addr == "job1"
    env = slurm_with(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None, SLURM_NODELIST="old1")
    assert detect_environment(env).master_addr == "old1"


def test_slurm_master_from_nodelist_in_a_fresh_interpreter():
    env = slurm_with(SLURM_STEP_NODELIST="rack[1-2]-node[01-02]", SLURM_JOB_NODELIST="other1")
    assert detect_in_subprocess(env)["master_addr"] == "rack1-node01"


def test_slurm_master_env_wins():
    env = slurm_with(MASTER_ADDR="given", MASTER_PORT="30001")
    found = detect_environment(env)
    assert (found.master_addr, found.master_port) == ("given", 30001)


def test_slurm_port_from_job_and_step():
    assert detect_environment(slurm_with(SLURM_STEP_ID="3", SLURM_STEPID="3")).master_port == slurm_port(1234, 3)
    # Older Slurm names only.
    env = slurm_with(SLURM_STEP_ID=None, SLURM_STEPID="2", SLURM_JOB_ID=None, SLURM_JOBID="99")
    assert detect_environment(env).master_port == slurm_port(99, 2)


@pytest.mark.parametrize("tasks_per_node, node, local_size", [
    ("2(x2),1", 0, 2), ("2(x2),1", 1, 2), ("2(x2),1", 2, 1), ("3,1", 1, 1), ("4", 0, 4),
])
def test_slurm_local_size_from_tasks_per_node(tasks_per_node, node, local_size):
    env = slurm_with(SLURM_NTASKS="5", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID=str(node),
                     SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=tasks_per_node)
    assert detect_environment(env).local_size == local_size


def test_slurm_step_tasks_per_node_preferred_and_ntasks_per_node_fallback():
    env = slurm_with(SLURM_STEP_TASKS_PER_NODE="2,2", SLURM_TASKS_PER_NODE="9(x2)")
    assert detect_environment(env).local_size == 2
    env = slurm_with(SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None, SLURM_NTASKS_PER_NODE="2")
    assert detect_environment(env).local_size == 2


def test_slurm_needs_a_step():
    env = slurm_with(SLURM_STEP_ID=None, SLURM_STEPID=None, SLURM_NTASKS="1")
    assert detect_environment(env).source == "single"


@pytest.mark.parametrize("step", ["batch", "4294967291", "4294967294", "4294967290", "-2"])
def test_batch_script_with_several_tasks_is_refused(step):
    env = {**SLURM_BATCH, "SLURM_STEP_ID": step}
    with pytest.raises(RuntimeError) as info:
        detect_environment(env)
    assert str(info.value) == ("this script runs in a Slurm allocation of 4 tasks but was not started "
                               "by srun; launch it with `srun python ...` (one task per rank), or with one "
                               "`torchmn run` per node: `srun --ntasks-per-node 1 torchmn run -np "
                               "RANKS_PER_NODE python ...`")


def test_batch_script_error_in_a_fresh_interpreter():
    code = "from torchmn.environments import detect_environment; detect_environment()"
    result = subprocess.run([sys.executable, "-c", code], env=clean_environ(SLURM_BATCH), cwd=str(REPO),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "RuntimeError: this script runs in a Slurm allocation of 4 tasks but was not started by srun" \
        in result.stderr


def test_slurm_misuse_error_cases():
    assert "allocation of 4 tasks" in slurm_misuse_error(SLURM_BATCH)
    assert slurm_misuse_error({**SLURM_BATCH, "SLURM_NTASKS": "1"}) is None
    # `sbatch -N 2` or `salloc -N 2` without -n: no SLURM_NTASKS; SLURM_TASKS_PER_NODE then holds
    # one entry per node, and CPUs rather than tasks where the job has whole nodes (--exclusive).
    no_n = {k: v for k, v in SLURM_BATCH.items() if k != "SLURM_NTASKS"}
    assert "allocation of 2 nodes" in slurm_misuse_error(no_n)
    assert "allocation of 2 nodes" in slurm_misuse_error({**no_n, "SLURM_TASKS_PER_NODE": "1(x2)"})
    assert slurm_misuse_error({**no_n, "SLURM_TASKS_PER_NODE": "1"}) is None
    assert slurm_misuse_error({**no_n, "SLURM_TASKS_PER_NODE": "4"}) is None  # sbatch -N 1 --exclusive
    assert slurm_misuse_error({k: v for k, v in no_n.items() if k != "SLURM_TASKS_PER_NODE"}) is None
    # What to do instead: srun, or one torchmn run per node (in a batch script, torchmn run alone
    # would use the first node only).
    assert "srun --ntasks-per-node 1 torchmn run" in slurm_misuse_error(SLURM_BATCH)
    assert slurm_misuse_error({k: v for k, v in SLURM_BATCH.items()
                               if k not in ("SLURM_JOB_ID", "SLURM_JOBID")}) is None
    assert slurm_misuse_error(SLURM) is None  # started by srun
    assert slurm_misuse_error({}) is None


def test_batch_script_with_one_task_is_single():
    env = {**SLURM_BATCH, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}
    assert detect_environment(env) == EXPECTED["single"]


def test_batch_script_under_another_launcher_is_fine():
    assert detect_environment({**SLURM_BATCH, **TORCHMN}) == EXPECTED["torchmn"]


# ---- bad values ----

@pytest.mark.parametrize("env, fragments", [
    ({**TORCHMN, "TORCHMN_RANK": "x"}, ["TORCHMN_RANK='x'", "not an integer"]),
    ({**TORCHMN, "TORCHMN_RANK": "8"}, ["TORCHMN_RANK='8'", "TORCHMN_SIZE='8'"]),
    ({**TORCHMN, "TORCHMN_LOCAL_RANK": "4"}, ["TORCHMN_LOCAL_RANK='4'", "TORCHMN_LOCAL_SIZE='4'"]),
    ({k: v for k, v in TORCHMN.items() if k != "TORCHMN_SIZE"}, ["TORCHMN_SIZE is not set"]),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, ["WORLD_SIZE='0'", "at least 1"]),
    ({**TORCHRUN, "RANK": "-1"}, ["RANK='-1'"]),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "8"}, ["LOCAL_WORLD_SIZE='8'", "larger than"]),
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}, ["LOCAL_WORLD_SIZE is not set"]),
    ({**TORCHRUN, "MASTER_PORT": "http"}, ["MASTER_PORT='http'", "1-65535"]),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, ["MASTER_PORT='70000'"]),
    ({**OPENMPI, "OMPI_COMM_WORLD_SIZE": "2.5"}, ["OMPI_COMM_WORLD_SIZE='2.5'", "not an integer"]),
    ({**MPICH, "PMI_RANK": "2"}, ["PMI_RANK='2'", "PMI_SIZE='2'"]),
    ({k: v for k, v in MPICH.items() if k not in ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")},
     ["MPI_LOCALRANKID is not set"]),
    (slurm_with(SLURM_PROCID="4"), ["SLURM_PROCID='4'", "SLURM_NTASKS='4'"]),
    (slurm_with(SLURM_LOCALID="2"), ["SLURM_LOCALID='2'", "SLURM_STEP_TASKS_PER_NODE='2(x2)'"]),
    (slurm_with(SLURM_NODEID="2"), ["SLURM_NODEID='2'", "no entry"]),
    (slurm_with(SLURM_STEP_TASKS_PER_NODE="two"), ["SLURM_STEP_TASKS_PER_NODE='two'"]),
    (slurm_with(SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None), ["SLURM_TASKS_PER_NODE is not set"]),
    (slurm_with(SLURM_STEP_NODELIST="n[2-1]"), ["SLURM_STEP_NODELIST='n[2-1]'", "MASTER_ADDR"]),
    (slurm_with(SLURM_JOB_ID="abc"), ["SLURM_JOB_ID='abc'"]),
])
def test_bad_values_raise_value_error_naming_variable_and_value(env, fragments):
    with pytest.raises(ValueError) as info:
        detect_environment(env)
    for fragment in fragments:
        assert fragment in str(info.value)


# `srun -n1 -w n2 CMD : -n2 -w n1 CMD` (Slurm 22.05.8): the node list and the tasks per node are in
# sorted node order, SLURM_NODEID in component order; task 0 runs on n2.
HET = {"SLURM_HET_SIZE": "2", "SLURM_JOB_ID": "6", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3",
       "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_NODELIST_PACK_GROUP_0": "n2",
       "SLURM_JOB_NODELIST_PACK_GROUP_1": "n1", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_TASKS_PER_NODE": "2,1"}


@pytest.mark.parametrize("rank, node_id, local_rank, node, local_size", [(0, 0, 0, "n2", 1), (1, 1, 0, "n1", 2),
                                                                         (2, 1, 1, "n1", 2)])
def test_heterogeneous_step(rank, node_id, local_rank, node, local_size):
    env = {**HET, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(node_id), "SLURM_LOCALID": str(local_rank),
           "SLURMD_NODENAME": node}
    seen = detect_environment(env)
    assert (seen.rank, seen.size, seen.local_rank, seen.local_size, seen.master_addr) == \
        (rank, 3, local_rank, local_size, "n2")


def test_heterogeneous_job_step_of_a_later_component_alone():
    """`srun --het-group=1`: the step runs on component 1's nodes only, so its task 0 is there."""
    env = {**HET, "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "2",
           "SLURM_TASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_LOCALID": "1",
           "SLURMD_NODENAME": "n1"}
    assert detect_environment(env).master_addr == "n1"


def test_slurm_node_without_tasks_names_where_its_index_came_from():
    env = slurm_with(SLURM_STEP_NODELIST="n[1-3]", SLURM_STEP_TASKS_PER_NODE="1,1", SLURM_NODEID="0",
                     SLURMD_NODENAME="n3")
    with pytest.raises(ValueError, match=r"SLURMD_NODENAME='n3', node 2 of the node list, has no entry in "
                                         r"SLURM_STEP_TASKS_PER_NODE='1,1' \(2 nodes\)"):
        detect_environment(env)


def test_arbitrary_distribution_needs_master_addr():
    env = {**SLURM, "SLURM_DISTRIBUTION": "arbitrary"}
    with pytest.raises(RuntimeError, match="arbitrary .* export MASTER_ADDR"):
        detect_environment(env)
    assert detect_environment({**env, "MASTER_ADDR": "n7"}).master_addr == "n7"


def test_torchmn_run_per_node_refuses_a_task_on_another_node():
    from torchmn.run.config import RunError
    from torchmn.run.slurm_step import slurm_step

    env = {**HET, "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1,1", "SLURM_TASKS_PER_NODE": "1,1",
           "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "n2"}
    with pytest.raises(RunError, match="task 0 runs on n2, node 0 of the step is n1"):
        slurm_step(env)


def test_a_rank_whose_rank_0_never_came_says_so():
    """Under Slurm (or MPI) rank 0 hosts the store: a rank that cannot reach it says that rank 0 never
    opened it and what to check, not just torch's socket time-out."""
    port = str(slurm_port(77, 0))
    code = "import torchmn; torchmn.create_communicator(timeout=3)"
    env = clean_environ({**SLURM, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                         "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
                         "SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "SLURM_STEP_NODELIST": "localhost",
                         "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost"})
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    assert (f"rank 1 of Slurm job 77 step 0 on {os.uname().nodename}: rank 0 never opened the rendezvous "
            f"store at 127.0.0.1:{port} within 3 s. Check rank 0's output") in result.stderr, result.stderr


def _by_hand(code, envs, timeout=90):
    """Start one process per entry of ``envs`` (extra variables) running ``code``; their outputs."""
    # Without thread counts: the budget is what is tested (an in-process communicator of an
    # earlier test writes OMP_NUM_THREADS into this process's environment).
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=str(REPO),
                              env={k: v for k, v in clean_environ(extra).items() if not k.endswith("_NUM_THREADS")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for extra in envs]
    results = communicate_all(procs, timeout)
    for code, out, err in results:
        assert code == 0, out + err
    return [out for _, out, _ in results]


def _host_address():
    import psutil

    return next(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family == socket.AF_INET and not a.address.startswith("127."))


def test_env_launch_by_hand_on_one_host_divides_the_cpus():
    """Two ranks started by hand with a non-loopback MASTER_ADDR and no LOCAL_*: the communicator
    finds them on one host, and the thread budget waits for that instead of giving each the machine."""
    code = ("import torch, torchmn; c = torchmn.create_communicator(timeout=30); "
            "print(c.rank, c.intra_size, torch.get_num_threads(), c.allreduce(torch.ones(1)).item())")
    base = {"MASTER_ADDR": _host_address(), "MASTER_PORT": str(slurm_port(4242, os.getpid() % 90)), "WORLD_SIZE": "2"}
    outs = _by_hand(code, [{**base, "RANK": "0"}, {**base, "RANK": "1"}])
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert sorted(o.split() for o in outs) == [["0", "2", str(threads), "2.0"], ["1", "2", str(threads), "2.0"]], outs


def test_a_world_the_script_set_up_is_adopted_whatever_the_variables():
    """A script that calls init_process_group itself may carry variables torchmn cannot read (RANK
    and LOCAL_RANK without LOCAL_WORLD_SIZE): the communicator adopts the world anyway."""
    port = slurm_port(4343, os.getpid() % 90)
    code = ("import os, torch, torch.distributed as dist, torchmn; "
            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', "
            "rank=int(os.environ['RANK']), world_size=2); c = torchmn.create_communicator(); "
            "print(c.rank, c.size, c.allreduce(torch.ones(1)).item())")
    outs = _by_hand(code, [{"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
                           {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}])
    assert sorted(o.split() for o in outs) == [["0", "2", "2.0"], ["1", "2", "2.0"]], outs
