"""The ``torchmn`` command's basics: ``--version``, ``--help`` and ``torchmn info``, in real processes."""
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

import torchmn
from torchmn import resources
from torchmn.cli import main
from torchmn.run.processes import binding

TIMEOUT = 120
# Variables of every launcher torchmn reads: a plain process has none of them.
_LAUNCHER_PREFIXES = ("TORCHMN_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "MPI_LOCAL")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "GROUP_RANK", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def plain_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env.update(extra)
    return env


def torchmn_command(*args, env=None):
    return subprocess.run([sys.executable, "-m", "torchmn", *args], capture_output=True, text=True,
                          env=plain_env() if env is None else env, timeout=TIMEOUT)


def imported_modules(stderr):
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if "|" in line}


def test_version_names_torchmn_torch_and_python_without_importing_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "torchmn", "--version"], capture_output=True,
                          text=True, env=plain_env(), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == (f"torchmn {torchmn.__version__} (torch {importlib.metadata.version('torch')}, "
                           f"Python {platform.python_version()})\n")
    assert "torch" not in imported_modules(proc.stderr)


def test_help_lists_the_subcommands_and_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert all(word in out for word in ("run", "info", "doctor", "tune", "--version"))
    with pytest.raises(SystemExit):
        main(["info", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--json" in out and "torchmn run -np 2 torchmn info" in out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--dry-run" in capsys.readouterr().out


@pytest.mark.parametrize("argv,prog,unknown", [(["run", "-np", "2", "--foo", "python", "x.py"], "torchmn run", "--foo"),
                                               (["info", "--bogus"], "torchmn info", "--bogus"),
                                               (["--bogus"], "torchmn", "--bogus")])
def test_unknown_option_is_named_by_its_subcommand(capsys, argv, prog, unknown):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"usage: {prog} "), err
    assert f"{prog}: error: unrecognized arguments: {unknown}\n" in err, err


def test_info_in_a_plain_process():
    import torch
    import torch.distributed as dist

    proc = torchmn_command("info")
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if line[:1].strip())
    lines = {key: value.strip() for key, value in lines.items()}
    assert lines["torchmn"].startswith(f"{torchmn.__version__} (torch {importlib.metadata.version('torch')}")
    assert lines["launcher"] == "none (a world of one process)"
    assert lines["place"] == "rank 0 of 1, local rank 0 of 1, node 0"
    budget = resources.cpu_count_available()
    assert lines["threads"] == f"{budget} per rank ({budget} CPU(s) available, shared by the 1 rank(s) on this node)"
    yes = {True: "yes", False: "no"}
    assert lines["backends"] == (f"gloo {yes[dist.is_gloo_available()]}, nccl {yes[dist.is_nccl_available()]}, "
                                 f"mpi {yes[dist.is_mpi_available()]}")
    if not torch.cuda.is_available():
        assert lines["GPUs"].startswith("none")
    assert lines["/dev/shm"].endswith(" free")
    assert lines["mpi4py"] == (importlib.metadata.version("mpi4py") if importlib.util.find_spec("mpi4py")
                               else "not installed")
    domains = binding.numa_domains(sorted(os.sched_getaffinity(0)))
    assert lines["NUMA"].startswith(f"{len(domains)} domain") and binding.format_cpu_list(domains[0]) in lines["NUMA"]


def test_info_json_in_a_plain_process():
    import torch
    import torch.distributed as dist

    proc = torchmn_command("info", "--json", env=plain_env(OMP_NUM_THREADS="3"))
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 1
    info = json.loads(proc.stdout)
    assert info["versions"] == {"torchmn": torchmn.__version__, "torch": importlib.metadata.version("torch"),
                                "python": platform.python_version()}
    assert info["launcher"]["source"] == "single"
    assert (info["launcher"]["rank"], info["launcher"]["size"], info["launcher"]["local_size"]) == (0, 1, 1)
    assert info["threads"]["budget"] == 3 and "OMP_NUM_THREADS=3, which you set" in info["threads"]["basis"]
    assert info["threads"]["cpus_available"] == resources.cpu_count_available()
    assert info["backends"] == {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                                "mpi": dist.is_mpi_available()}
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert info["gpus"]["count"] == count and len(info["gpus"]["names"]) == count
    assert info["gpus"]["cuda"] == torch.version.cuda
    if os.path.isdir("/dev/shm"):
        assert info["shm"]["total"] == shutil.disk_usage("/dev/shm").total
        assert info["shm"]["slot_bytes"] == 16 << 20
    assert info["mpi4py"]["installed"] == (importlib.util.find_spec("mpi4py") is not None)
    assert sorted(c for domain in info["numa"] for c in domain) == sorted(os.sched_getaffinity(0))


def test_info_under_torchmn_run_reports_each_ranks_place():
    proc = torchmn_command("run", "-np", "2", sys.executable, "-m", "torchmn", "info", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = {}
    for line in proc.stdout.splitlines():
        prefix, _, text = line.partition(" ")
        seen[int(prefix.strip("[]"))] = json.loads(text)
    assert sorted(seen) == [0, 1]
    budget = max(1, resources.cpu_count_available() // 2)
    for rank, info in seen.items():
        place = info["launcher"]
        assert (place["source"], place["rank"], place["size"]) == ("torchmn", rank, 2)
        assert (place["local_rank"], place["local_size"], place["node_rank"]) == (rank, 2, 0)
        assert place["master_addr"] == "127.0.0.1" and place["master_port"] == seen[0]["launcher"]["master_port"]
        assert info["threads"]["budget"] == budget
        assert info["threads"]["basis"] == \
            f"TORCHMN_NUM_THREADS={budget}, set by torchmn run for its 2 rank(s) on this node"
        if os.path.isdir("/dev/shm"):
            assert info["shm"]["segment_bytes"] >= 3 * (16 << 20)


def test_info_says_a_users_thread_count_is_theirs_under_torchmn_run():
    """TORCHMN_NUM_THREADS=1 of the user's own, passed on by torchmn run: "which you set"."""
    proc = torchmn_command("run", "-np", "2", sys.executable, "-m", "torchmn", "info", "--json",
                           env=plain_env(TORCHMN_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        assert json.loads(line.partition(" ")[2])["threads"]["basis"] == "TORCHMN_NUM_THREADS=1, which you set", line


def test_info_text_under_torchmn_run():
    proc = torchmn_command("run", "-np", "2", "--output-ranks", "1", sys.executable, "-m", "torchmn", "info")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1] launcher:   torchmn run (source 'torchmn')" in proc.stdout
    assert "[1] place:      rank 1 of 2, local rank 1 of 2, node 0" in proc.stdout
    assert "[1] rendezvous: 127.0.0.1:" in proc.stdout


def test_info_says_the_rendezvous_port_is_missing():
    proc = torchmn_command("info", env=plain_env(RANK="1", WORLD_SIZE="2"))
    assert proc.returncode == 0 and "rendezvous: 127.0.0.1, no port: set MASTER_PORT" in proc.stdout, proc.stdout


@pytest.mark.parametrize("extra, message", [
    ({"TORCHMN_RANK": "1"}, "the launcher's variables cannot be read: TORCHMN_SIZE is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "the launcher's variables cannot be read"),
    ({"TORCHMN_NUM_THREADS": "many"}, "TORCHMN_NUM_THREADS='many' is not a positive integer"),
    ({"TORCHMN_SHM_SLOT_MB": "big"}, "TORCHMN_SHM_SLOT_MB='big' is not a number of MB"),
    ({"TORCHMN_SHM_SLOT_MB": "nan"}, "TORCHMN_SHM_SLOT_MB='nan' is not a number of MB of at least 0.004"),
    ({"TORCHMN_SHM_SLOT_MB": "inf"}, "TORCHMN_SHM_SLOT_MB='inf' is not a number of MB of at least 0.004"),
    ({"TORCHMN_SHM_SLOT_MB": "0"}, "TORCHMN_SHM_SLOT_MB='0' is not a number of MB of at least 0.004"),
    ({"TORCHMN_BUCKET_CAP_MB": "inf"}, "TORCHMN_BUCKET_CAP_MB must be a number of MB >= 0, not 'inf'"),
    ({"TORCHMN_CROSS_NODE_ALGORITHM": "tree"}, "TORCHMN_CROSS_NODE_ALGORITHM='tree': choose one of auto, ring, doubling"),
    ({"TORCHMN_INTEROP_THREADS": "abc", "OMP_NUM_THREADS": "2"}, "TORCHMN_INTEROP_THREADS must be a positive integer"),
])
def test_info_says_what_is_wrong_without_a_traceback(extra, message):
    for args in (["info"], ["info", "--json"]):
        proc = torchmn_command(*args, env=plain_env(**extra))
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith(f"torchmn info: error: {message}"), proc.stderr
        assert "Traceback" not in proc.stderr


def test_info_says_an_srun_task_has_its_cpus_alone():
    """srun -n 4 -c 1: each task has its one CPU to itself, which info says (the same budget as
    1 CPU shared by 4 ranks would give)."""
    env = dict(SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="4", SLURM_TASKS_PER_NODE="4",
               SLURM_STEP_NODELIST="vm", SLURM_NODELIST="vm", SLURM_CPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="1")
    threads = torchmn.info.collect(env)["threads"]
    assert threads["budget"] == 1 and "to this task alone (srun --cpus-per-task)" in threads["basis"], threads
