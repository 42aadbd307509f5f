"""One `torchmn run` per node, as the platforms that start one agent per node run it: two network
namespace "nodes" (tests/cluster/netns.py), each running its own launcher over ssh, with the
launcher's flags or with a platform's own variables (Kubeflow's PyTorchJob, SkyPilot, SageMaker:
faked as the platform sets them). Each job must come out as one job of 4 ranks on 2 nodes.
"""
import json
import re
import shlex
import subprocess
import sys

import pytest
from cluster.netns import NetnsCluster
from jobs import REPO, WORKERS, clean_env, communicate_all

from torchmn.run.store import auth

# Two launchers and their ranks on emulated hosts took up to 66 s beside the full suite on 2 cores.
TIMEOUT = 200
pytestmark = pytest.mark.timeout(TIMEOUT + 40)
CHECKS = str(WORKERS / "comm_checks.py")
# Each rank runs comm_checks.py's topology and collectives checks, then says where it is.
PROBE = f"""
import runpy, sys
from torchmn.environments import detect_environment
sys.argv = [{CHECKS!r}, "topology", "collectives"]
try:
    runpy.run_path({CHECKS!r}, run_name="__main__")
except SystemExit as stop:
    if stop.code:
        raise
place = detect_environment()
print(f"PLACE rank={{place.rank}} node={{place.node_rank}}", flush=True)
"""


@pytest.fixture(scope="module")
def cluster():
    hosts = NetnsCluster(["h1", "h2"])
    hosts.start()  # raises (fails the tests) with what to install when something is missing
    yield hosts
    hosts.stop()


def _on_node(cluster, host, env, argv):
    """``torchmn run ARGV`` on ``host`` over ssh, with ``env`` set on its command line."""
    assignments = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
    command = f"cd {shlex.quote(str(REPO))} && env {assignments} {shlex.quote(sys.executable)} -m torchmn run " \
              + " ".join(shlex.quote(a) for a in argv)
    return subprocess.Popen(cluster.ssh_argv(host) + [command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _run_nodes(cluster, envs, argvs):
    """Start one launcher per node at once; (returncode, stdout, stderr) of each."""
    return communicate_all([_on_node(cluster, host, env, argv) for host, env, argv in zip(("h1", "h2"), envs, argvs)],
                           TIMEOUT)


def _assert_one_job(results):
    for code, out, err in results:
        assert code == 0, out[-3000:] + err[-3000:]
    first = results[0][1]
    assert "TOPOLOGY size=4 inter_size=2 intra_size=2" in first, first
    assert "PASS topology" in first and "PASS collectives" in first, first
    # Each node's launcher prints its own ranks' output, with their global ranks.
    for node, (_, out, _) in enumerate(results):
        ranks = sorted(int(r) for r, n in re.findall(r"PLACE rank=(\d) node=(\d)", out) if int(n) == node)
        assert ranks == [2 * node, 2 * node + 1], out


def _platform_cases(cluster):
    h1, h2 = cluster.address("h1"), cluster.address("h2")
    token = auth.new_token()  # as a Kubernetes Secret would give every pod
    return {
        "kubeflow": [{"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": h1, "MASTER_PORT": "23456",
                      "WORLD_SIZE": "2", "RANK": str(r), auth.TOKEN_ENV: token} for r in range(2)],
        "kubeflow_elastic": [{"KUBERNETES_SERVICE_HOST": "10.96.0.1", "PET_NNODES": "2:2", "PET_NODE_RANK": str(r),
                              "PET_MASTER_ADDR": h1, "PET_MASTER_PORT": "23457", "PET_NPROC_PER_NODE": "2",
                              "MASTER_ADDR": h1, "WORLD_SIZE": "2", "RANK": str(r), auth.TOKEN_ENV: token}
                             for r in range(2)],
        "skypilot": [{"SKYPILOT_NODE_RANK": str(r), "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": f"{h1}\n{h2}\n",
                      "SKYPILOT_NUM_GPUS_PER_NODE": "0"} for r in range(2)],
        "sagemaker": [{"SM_HOSTS": json.dumps([h1, h2]), "SM_CURRENT_HOST": h, "SM_NUM_GPUS": "0",
                       "SM_NUM_CPUS": "2", "SM_NETWORK_INTERFACE_NAME": "eth0"} for h in (h1, h2)],
    }


def test_one_launcher_per_node_from_the_flags(cluster):
    h1 = cluster.address("h1")
    argvs = [["--nnodes", "2", "--node-rank", str(r), "--master-addr", h1, "--master-port", "23458", "-np", "2",
              sys.executable, "-c", PROBE] for r in range(2)]
    _assert_one_job(_run_nodes(cluster, [{}, {}], argvs))


@pytest.mark.parametrize("platform", ["kubeflow", "kubeflow_elastic", "skypilot", "sagemaker"])
def test_one_launcher_per_node_from_a_platforms_variables(cluster, platform):
    argv = ["-np", "2", sys.executable, "-c", PROBE]
    _assert_one_job(_run_nodes(cluster, _platform_cases(cluster)[platform], [argv, argv]))


def test_a_node_that_never_comes_is_named(cluster):
    """Node 1 of 2 never starts: node 0's launcher names it after --start-timeout, and starts no rank."""
    h1 = cluster.address("h1")
    proc = _on_node(cluster, "h1", {}, ["--nnodes", "2", "--node-rank", "0", "--master-addr", h1, "--master-port",
                                        "23459", "--start-timeout", "5", "-np", "1", sys.executable, "-c",
                                        "print('started')"])
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 2, out + err
    assert "node(s) 1 did not start torchmn run within 5 s (--start-timeout)" in err, err
    assert "started" not in out, out


@pytest.mark.parametrize("env, argv, words", [
    ({}, ["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"],
     "--nnodes: node rank 2 (--node-rank) is outside the 2 node(s) (--nnodes): it must be 0 to 1"),
    ({}, ["--nnodes", "2"], "--nnodes 2 needs --node-rank R (0 to 1)"),
    ({}, ["--nnodes", "2", "--node-rank", "1"], "node 1 does not know where node 0 hosts the rendezvous"),
    ({"SM_HOSTS": "algo-1,algo-2", "SM_CURRENT_HOST": "algo-1"}, [],
     "SageMaker: SM_HOSTS='algo-1,algo-2' is not a JSON list of host names"),
    ({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": ""}, [],
     "SkyPilot: SKYPILOT_NODE_IPS is empty"),
    ({"PET_NNODES": "1:4", "PET_NODE_RANK": "0"}, [], "PET_NNODES='1:4' is a range of nodes (an elastic policy)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
      "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "n[1-2]"},
     ["-H", "localhost:1"], "-H/--hostfile inside a Slurm step of 2 tasks: each task would start a job of its own"),
], ids=["rank_outside", "no_rank", "no_master_addr", "sagemaker_hosts_not_json", "skypilot_no_ips",
        "kubeflow_elastic_range", "hosts_inside_a_slurm_step"])
def test_bad_per_node_input_is_refused_before_any_rank(tmp_path, env, argv, words):
    marker = tmp_path / "started"
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", *argv, "-np", "1", sys.executable, "-c",
                           f"open({str(marker)!r}, 'w')"], cwd=REPO, env=clean_env(env),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr, proc.stderr
    assert not marker.exists()


@pytest.mark.parametrize("platform,run_var", [
    ("skypilot", "SKYPILOT_TASK_ID"),
    ("sagemaker", "TRAINING_JOB_NAME"),
    ("sagemaker_training_env", "SM_TRAINING_ENV"),
])
def test_a_platforms_run_id_keeps_its_runs_tokens_apart(platform, run_var):
    """Where the platform names each run (SkyPilot's task id, SageMaker's training job name), the
    token the nodes derive from the user's key is the same on every node of a run and differs
    between runs, so that a launcher left from a run before cannot join the next."""
    from torchmn.run.config import LaunchConfig
    from torchmn.run.nodes import per_node_step

    base = {"skypilot": {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2"},
            "sagemaker": {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2"}}[platform.split("_")[0]]

    def run_id(value):
        return json.dumps({"job_name": value, "hosts": ["algo-1", "algo-2"]}) if run_var == "SM_TRAINING_ENV" else value

    def label(**extra):
        return per_node_step(LaunchConfig(command=["python"], np=1), {**base, **extra}).token_label

    first, again, second = (label(**{run_var: run_id(v)}) for v in ("run-a", "run-a", "run-b"))
    assert first == again != second, (first, second)
    assert "run-a" in first and label() != first


def test_np_left_out_is_the_ranks_per_node_a_platform_asks_for():
    """As the SageMaker docs promise: one rank per GPU (SM_NUM_GPUS) where -np is left out; where
    the platform names no count, -np is required."""
    sagemaker = {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2"}
    argv = [sys.executable, "-m", "torchmn", "run", "--dry-run", sys.executable, "-c", "pass"]
    proc = subprocess.run(argv, cwd=REPO, env=clean_env({**sagemaker, "SM_NUM_GPUS": "4"}), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-np 4 (ranks per node) from SageMaker's variables" in proc.stderr, proc.stderr
    assert "4 of the 8 ranks (this node's)" in proc.stdout, proc.stdout
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(sagemaker), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "required: -np/--num-proc" in proc.stderr, proc.stderr


def test_two_launchers_claiming_one_node_rank_are_refused(cluster):
    """Two launchers say --node-rank 1: the second to reach the store is told another node holds it.

    Both start before node 0's launcher, and the job's rank outlives a slow start, so that the
    second reaches the store while the job still runs (on a loaded machine, a job that had
    already ended would only leave it unable to reach the store)."""
    h1 = cluster.address("h1")
    rank = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(3)"]
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", h1, "--master-port", "23460",
            "--start-timeout", "30", "-np", "1", *rank]
    first = ["--nnodes", "2", "--node-rank", "0", "--master-addr", h1, "--master-port", "23460",
             "--start-timeout", "30", "-np", "1", *rank]
    procs = [_on_node(cluster, "h2", {}, argv), _on_node(cluster, "h2", {}, argv), _on_node(cluster, "h1", {}, first)]
    results = communicate_all(procs, TIMEOUT)
    claimed = [err for code, out, err in results[:2] if "node 1 is already taken by another launcher" in err]
    assert len(claimed) == 1, results



def test_nodes_that_disagree_on_np_are_refused(cluster):
    h1 = cluster.address("h1")
    argvs = [["--nnodes", "2", "--node-rank", str(r), "--master-addr", h1, "--master-port", "23461",
              "-np", str(r + 1), sys.executable, "-c", "print('started')"] for r in range(2)]
    results = _run_nodes(cluster, [{}, {}], argvs)
    for code, out, err in results:
        assert code == 2 and "started" not in out, out + err
    assert "the nodes disagree on the number of ranks per node: node 0 (" in results[0][2], results[0][2]


def test_nodes_that_disagree_on_nnodes_are_refused_at_once(cluster):
    """Node 1 told --nnodes 3 would wait for a node 2 that never comes while node 0 started its
    rank: both stop at once, named, before any rank starts. (With a token shared as a Secret: one
    derived from the home directory's key differs with --nnodes, and is refused as such.)"""
    h1 = cluster.address("h1")
    argvs = [["--nnodes", str(2 + r), "--node-rank", str(r), "--master-addr", h1, "--master-port", "23463",
              "--start-timeout", "60", "-np", "1", sys.executable, "-c", "print('started')"] for r in range(2)]
    token = {auth.TOKEN_ENV: auth.new_token()}
    results = _run_nodes(cluster, [token, token], argvs)
    for code, out, err in results:
        assert code == 2 and "started" not in out, out + err
        assert "disagree on the number of nodes (node 0: 2, node 1: 3); give every node the same --nnodes" in err, err


FAILING = """
import os, sys, time
if os.environ["RANK"] == "3":
    sys.exit(3)
time.sleep(60)
"""


def test_a_failure_on_one_node_ends_every_nodes_ranks(cluster):
    """Rank 3, on node 1, exits with 3 while the others sleep: both launchers stop their ranks
    within seconds, and both name rank 3."""
    h1 = cluster.address("h1")
    argvs = [["--nnodes", "2", "--node-rank", str(r), "--master-addr", h1, "--master-port", "23462",
              "-np", "2", sys.executable, "-c", FAILING] for r in range(2)]
    results = _run_nodes(cluster, [{}, {}], argvs)
    for code, out, err in results:
        assert code != 0, out + err
        assert "rank 3 (host " in err and "exit code 3" in err, err
