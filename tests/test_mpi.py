"""Jobs started by Open MPI's and MPICH's own launchers on this one machine: rank, size and local
rank come from the environment they set (no mpi4py needed), and the communicator works under each.
Across hosts, where mpi4py carries rank 0's address: tests/test_mpi_hosts.py.

Needs `apt-get install -y openmpi-bin mpich`; a missing launcher fails the test with that message.
Each MPI is called by its full Debian name, since `mpirun`/`mpiexec` point at only one of them.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from failure_jobs import assert_failure_shown_once, failing_argv, run_failing
from jobs import REPO, WORKERS, assert_check_passed, check_job_output, clean_env
from mpi4py_builds import mpi4py_dir
from ports import free_port

TIMEOUT = 150
MPIS = {
    # name: (launcher, Debian package, extra options)
    "openmpi": ("mpiexec.openmpi", "openmpi-bin",
                # as root Open MPI needs --allow-run-as-root; more ranks than cores need --oversubscribe;
                # --bind-to none as docs/launching/mpi.md advises.
                (["--allow-run-as-root"] if os.geteuid() == 0 else []) + ["--oversubscribe", "--bind-to", "none"]),
    "mpich": ("mpiexec.mpich", "mpich", []),
}


def mpi_argv(mpi, np):
    launcher, package, options = MPIS[mpi]
    path = shutil.which(launcher)
    if path is None:
        pytest.fail(f"{launcher} not found: install it with `apt-get install -y {package}`")
    return [path, *options, "-np", str(np)]


def run_mpi(mpi, np, argv, port=True, check=True, extra_env=None):
    # MPICH gives its ranks no shared job id to derive a port from (29500 is used): a free one here,
    # so that tests running at the same time do not meet on it.
    env = clean_env({**({"MASTER_PORT": str(free_port())} if port else {}), **(extra_env or {})})
    proc = subprocess.run(mpi_argv(mpi, np) + argv, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0 or not check, f"{mpi} -np {np} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


MPI_CHECKS = ("ring", "collectives", "topology", "objects")


@pytest.mark.check_job("mpi")
@pytest.mark.parametrize("check", MPI_CHECKS)
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_collectives_under_mpi(mpi, np, check, request):
    proc = check_job_output(request, lambda checks: run_mpi(
        mpi, np, [sys.executable, str(WORKERS / "comm_checks.py"), *checks], port=(mpi == "mpich"), check=False))
    assert_check_passed(proc, check)
    if check == "topology":
        assert f"TOPOLOGY size={np} inter_size=1 intra_size={np}" in proc.stdout, proc.stdout


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_rank_and_local_rank_come_from_the_mpi_environment(mpi, tmp_path):
    # Each rank writes its own file: the launchers forward the ranks' stdout without keeping lines
    # whole, so two ranks' rows can arrive spliced into one line.
    code = ("import json, sys, torchmn; from torchmn.environments import detect_environment; e = detect_environment(); "
            "c = torchmn.create_communicator(); "
            "row = [e.source, e.rank, e.size, e.local_rank, e.local_size, e.master_addr, c.rank, c.intra_rank, "
            "c.intra_size]; "
            "open(f'{sys.argv[1]}/rank{e.rank}.json', 'w').write(json.dumps(row)); c.finalize()")
    out = run_mpi(mpi, 3, [sys.executable, "-c", code, str(tmp_path)]).stdout
    rows = sorted(json.loads(path.read_text()) for path in tmp_path.glob("rank*.json"))
    assert rows == [[mpi, r, 3, r, 3, "127.0.0.1", r, r, 3] for r in range(3)], out


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_one_host_with_mpi4py_does_not_initialise_mpi(mpi, tmp_path):
    """mpi4py only carries rank 0's address between nodes: with every rank on this one, the
    rendezvous is 127.0.0.1 as without it, and MPI is never initialised."""
    code = ("import json, sys, torch, torchmn; from torchmn.environments import detect_environment; "
            "e = detect_environment(); c = torchmn.create_communicator(); total = c.allreduce(torch.ones(1)).item(); "
            "row = [e.master_addr, total, 'mpi4py.MPI' in sys.modules]; "
            "open(f'{sys.argv[1]}/rank{e.rank}.json', 'w').write(json.dumps(row)); c.finalize()")
    pythonpath = os.pathsep.join([mpi4py_dir(mpi), str(REPO)])
    out = run_mpi(mpi, 2, [sys.executable, "-c", code, str(tmp_path)], port=(mpi == "mpich"),
                  extra_env={"PYTHONPATH": pythonpath}).stdout
    rows = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert rows == [["127.0.0.1", 2.0, False]] * 2, out


def test_ipv6_and_unresolvable_rendezvous_hosts():
    """MASTER_ADDR=::1 works (the tcp:// URL needs brackets); a host that does not resolve is named
    at once instead of after the timeout."""
    code = ("import sys, torch, torchmn; c = torchmn.create_communicator(timeout=60); "
            "sys.stdout.write(f'SUM {int(c.allreduce(torch.ones(1)).item())}\\n'); c.finalize()")
    argv = mpi_argv("openmpi", 2) + ["-x", "MASTER_ADDR", "-x", "MASTER_PORT", sys.executable, "-c", code]
    env = clean_env({"MASTER_ADDR": "::1", "MASTER_PORT": str(free_port())})
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0 and proc.stdout.count("SUM 2") == 2, proc.stdout + proc.stderr
    env["MASTER_ADDR"] = "no-such-host.invalid"
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=40)
    assert proc.returncode != 0
    assert "rendezvous host 'no-such-host.invalid' (openmpi launch) does not resolve here" in proc.stderr, proc.stderr


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_torchmn_run_under_mpirun_is_refused(mpi):
    """mpirun -np 2 torchmn run ... would start two separate jobs that train apart silently."""
    argv = mpi_argv(mpi, 2) + [sys.executable, "-m", "torchmn", "run", "-np", "1", sys.executable, "-c", "print('RAN')"]
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "RAN" not in proc.stdout, proc.stdout + proc.stderr
    assert f"torchmn run was started as one of 2 {mpi} processes" in proc.stderr, proc.stderr


def test_a_rank_that_never_joins_is_named_at_set_up(tmp_path):
    """Rank 1 exits 0 before create_communicator (mpirun then lets the others run): rank 0's set-up
    timeout says which rank never came, not just torch's store key."""
    script = tmp_path / "absent.py"
    script.write_text("import os, sys, torchmn\n"
                      "if os.environ['OMPI_COMM_WORLD_RANK'] == '1':\n"
                      "    sys.exit(0)\n"
                      "try:\n"
                      "    torchmn.create_communicator(timeout=6)\n"
                      "except RuntimeError as e:\n"
                      "    sys.stdout.write(f'RAISED {e}\\n')\n")
    argv = mpi_argv("openmpi", 2) + [sys.executable, str(script)]
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert "Rank(s) 1 never reached create_communicator" in proc.stdout, proc.stdout + proc.stderr


def test_two_mpich_jobs_at_once_stay_apart(tmp_path):
    """Hydra puts no job id in its ranks' environment; torchmn takes mpiexec's control port from the
    proxy above each rank. Before, both jobs met on port 29500: the second's rank 1 joined the first
    job, and both computed wrong sums."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time, torch, torchmn\n"
                      "job, rank = sys.argv[1], int(os.environ['PMI_RANK'])\n"
                      "if job == 'A' and rank == 1:\n"
                      "    time.sleep(8)  # job B starts while job A's store waits for this rank\n"
                      "comm = torchmn.create_communicator(timeout=40)\n"
                      "value = comm.allreduce(torch.tensor([100.0 if job == 'A' else 1.0])).item()\n"
                      "print(f'JOB {job} RANK {rank} SUM {value}', flush=True)\n"
                      "comm.finalize()\n")
    argv = mpi_argv("mpich", 2) + ["timeout", "60", sys.executable, str(script)]  # behind a wrapper too
    first = subprocess.Popen(argv + ["A"], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(4)
        second = subprocess.run(argv + ["B"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
        out_a = first.communicate(timeout=60)[0]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    out_b = second.stdout + second.stderr
    assert second.returncode == 0 and first.returncode == 0, out_a + out_b
    # Hydra may splice the two ranks' lines into one.
    assert sorted(re.findall(r"JOB A RANK \d SUM [\d.]+", out_a)) == \
        ["JOB A RANK 0 SUM 200.0", "JOB A RANK 1 SUM 200.0"], out_a
    assert sorted(re.findall(r"JOB B RANK \d SUM [\d.]+", out_b)) == \
        ["JOB B RANK 0 SUM 2.0", "JOB B RANK 1 SUM 2.0"], out_b


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_exception_in_a_collective_ends_the_mpi_job(mpi, tmp_path):
    """Rank 1 raises while the others wait for it in an allreduce: every rank ends within seconds,
    rank 1's traceback is shown once, the others say in one line that rank 1 failed. Open MPI
    stops the job when rank 1 exits and names it as the first to fail (the others waited for that);
    MPICH's mpiexec stops nobody, so the others end on their own."""
    env = clean_env({"MASTER_PORT": str(free_port())} if mpi == "mpich" else None)
    output, code, seconds = run_failing(mpi_argv(mpi, 4) + failing_argv("raise", tmp_path), tmp_path, env=env,
                                        timeout=TIMEOUT)
    assert code != 0, output
    if mpi == "openmpi":
        assert re.search(r"The first process to do so was:\s+Process name: \[\[\d+,\d+\],1\]", output), output
        assert_failure_shown_once(output, seconds)
    else:
        assert_failure_shown_once(output, seconds, others_named={0, 2, 3})


@pytest.mark.parametrize("mpi", list(MPIS))
def test_a_one_machine_job_listens_on_loopback_only(mpi):
    """Every rank on this machine: the store and gloo listen on loopback alone, where nothing on the
    network reaches them (gloo's pair set-up has no authentication)."""
    out = run_mpi(mpi, 2, [sys.executable, str(REPO / "tests" / "scripts" / "listening_ports.py")]).stdout
    listening = dict(re.findall(r"LISTENING (\d) (\[[^]]*\])", out))
    assert listening == {"0": "['127.0.0.1']", "1": "['127.0.0.1']"}, out


THREAD_BUDGET = """
import os, torch, torchmn
comm = torchmn.create_communicator()
os.write(1, f"BUDGET rank={comm.rank} threads={torch.get_num_threads()} cores={len(os.sched_getaffinity(0))}\\n".encode())
"""


def test_sagemakers_mpirun_line_keeps_each_ranks_thread_budget():
    """SageMaker's `mpi` distribution runs `mpirun --host algo-1:N -bind-to socket -map-by slot ... python
    -m mpi4py train.py`: each rank, bound to its socket with the others there, gets its share of the
    socket's cores, not one thread per core."""
    launcher, _, _ = MPIS["openmpi"]
    argv = [shutil.which(launcher), *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
            "--host", "localhost:2", "-np", "2", "-bind-to", "socket", "-map-by", "slot",
            "-x", "MASTER_PORT", "-x", "PYTHONPATH", sys.executable, "-m", "mpi4py", "-c", THREAD_BUDGET]
    env = clean_env({"MASTER_PORT": str(free_port()),
                     "PYTHONPATH": os.pathsep.join([mpi4py_dir("openmpi"), str(REPO)])})
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"BUDGET rank=(\d) threads=(\d+) cores=(\d+)", proc.stdout)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], proc.stdout
    for _, threads, cores in rows:
        assert int(threads) == max(1, int(cores) // 2), proc.stdout


def test_monitor_and_timeline_under_mpirun(tmp_path):
    """TORCHMN_MONITOR=1 and TORCHMN_TIMELINE under Open MPI's mpirun: rank 0 shows the summary
    naming rank 1 (50 ms of sleep per step) the straggler, and joins the ranks' timeline parts."""
    path = tmp_path / "trace.json"
    proc = run_mpi("openmpi", 2, [sys.executable, str(WORKERS / "straggler.py"), "40"],
                   extra_env={"TORCHMN_MONITOR": "1", "TORCHMN_TIMELINE": str(path)})
    assert re.search(r"torchmn monitor: slowest: rank 1 \(\S+\), busy", proc.stderr), proc.stderr
    pids = {e["pid"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
