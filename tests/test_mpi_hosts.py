"""`mpirun` across hosts without MASTER_ADDR: rank 0's address and port travel over MPI (mpi4py).

The hosts are network namespaces with their own address, hostname, /etc/hosts and sshd
(tests/cluster/netns.py), each with a default route through this machine, as a cluster node has.
Open MPI's mpirun and MPICH's mpiexec run on host h1, as a user logged in there would start them,
and start the ranks of h2 over ssh. Each job gets the mpi4py built against the MPI that launches
it, or none (tests/mpi4py_builds.py).

Needs root, `apt-get install -y openmpi-bin mpich libopenmpi-dev libmpich-dev openssh-server
openssh-client iproute2`, and the two mpi4py builds; whatever is missing fails the tests with the
command that installs it.
"""
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from cluster.netns import NetnsCluster
from jobs import REPO, WORKERS, assert_check_passed, check_job_output
from mpi4py_builds import mpi4py_dir
from torchmn.environments import mpi_rendezvous

TIMEOUT = 150
LAUNCHERS = {"openmpi": ("mpiexec.openmpi", "openmpi-bin"), "mpich": ("mpiexec.mpich", "mpich")}


# ---- the address rank 0 offers: no cluster needed ------------------------------------------------

def test_offered_address_follows_the_interface_variables():
    assert mpi_rendezvous.offered_address({"GLOO_SOCKET_IFNAME": "lo"}) == ("127.0.0.1", "lo, named by GLOO_SOCKET_IFNAME")
    # gloo's variable wins; NCCL's takes prefixes, "=" for an exact name, and "^" excludes (names none).
    assert mpi_rendezvous.offered_address({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "nosuch"})[0] == "127.0.0.1"
    assert mpi_rendezvous.offered_address({"NCCL_SOCKET_IFNAME": "l"}) == ("127.0.0.1", "lo, named by NCCL_SOCKET_IFNAME")
    assert mpi_rendezvous.offered_address({"NCCL_SOCKET_IFNAME": "=lo"})[0] == "127.0.0.1"
    assert mpi_rendezvous.offered_address({"NCCL_SOCKET_IFNAME": "^lo"}) == mpi_rendezvous.offered_address({})
    with pytest.raises(mpi_rendezvous.MPIRendezvousError, match=r"GLOO_SOCKET_IFNAME='nosuch0' names no interface .*it has .*lo"):
        mpi_rendezvous.offered_address({"GLOO_SOCKET_IFNAME": "nosuch0"})
    with pytest.raises(mpi_rendezvous.MPIRendezvousError, match="NCCL_SOCKET_IFNAME='=l' names no interface"):
        mpi_rendezvous.offered_address({"NCCL_SOCKET_IFNAME": "=l"})


def test_default_route_interface_is_the_one_ip_route_shows():
    shown = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True, timeout=20).stdout.split()
    expected = shown[shown.index("dev") + 1] if "dev" in shown else None
    assert mpi_rendezvous.default_route_interface() == expected


# ---- real hosts ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    hosts = NetnsCluster(["h1", "h2"])
    hosts.start()  # raises (fails the tests) with what to install when something is missing
    try:
        for namespace in hosts.namespaces:
            subprocess.run(["ip", "-n", namespace, "route", "add", "default", "via", hosts.gateway], check=True,
                           capture_output=True, timeout=20)
        # mpirun starts h2's ranks (and h1's, MPICH asks for one) over ssh, with the cluster's key.
        agent = os.path.join(hosts.tmp, "ssh-agent.sh")
        with open(agent, "w") as f:
            f.write(f"#!/bin/sh\nexec {hosts.ssh_command} -i {shlex.quote(hosts.key)} -p 2222 \"$@\"\n")
        os.chmod(agent, 0o755)
        hosts.agent = agent
        yield hosts
    finally:
        hosts.stop()


def on_h1(cluster, argv, env, timeout=TIMEOUT):
    """Run ``argv`` on host h1 in the repository, with only ``env`` besides what sshd sets."""
    line = f"cd {shlex.quote(str(REPO))} && exec env " + " ".join(
        shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + " ".join(map(shlex.quote, argv))
    return subprocess.run(cluster.ssh_argv("h1") + [line], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def mpirun(cluster, mpi, command, mpi4py=None, extra_env=None):
    """``command`` on 2 ranks on each of h1 and h2 under ``mpi``'s own launcher started on h1, no
    MASTER_ADDR or MASTER_PORT anywhere. ``mpi4py``: the MPI whose mpi4py build the ranks import
    (default: ``mpi``'s)."""
    launcher, package = LAUNCHERS[mpi]
    if shutil.which(launcher) is None:
        pytest.fail(f"{launcher} not found: install it with `apt-get install -y {package}`")
    if mpi == "openmpi":
        argv = [launcher, *(["--allow-run-as-root"] if os.geteuid() == 0 else []), "--bind-to", "none",
                "-H", "h1:2,h2:2", "-np", "4", "--mca", "plm_rsh_agent", cluster.agent, "-x", "PATH", "-x", "PYTHONPATH"]
    else:  # Hydra forwards the whole environment by itself
        argv = [launcher, "-hosts", "h1:2,h2:2", "-np", "4", "-launcher", "ssh", "-launcher-exec", cluster.agent]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
           "PYTHONPATH": os.pathsep.join([mpi4py_dir(mpi4py or mpi), str(REPO)]), **(extra_env or {})}
    return on_h1(cluster, argv + [sys.executable, *command], env)


MPI_HOST_CHECKS = ("collectives", "mpi_left_finalized", "world_again")  # world_again last: it ends the first world


@pytest.mark.check_job("mpi-hosts")
@pytest.mark.parametrize("check", MPI_HOST_CHECKS)
@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_mpirun_across_hosts_without_master_addr(cluster, mpi, check, request):
    proc = check_job_output(request, lambda checks: mpirun(cluster, mpi, [str(WORKERS / "mpi_checks.py"), *checks]))
    assert_check_passed(proc, check)
    if check == "collectives":
        assert "TOPOLOGY size=4 inter_size=2 intra_size=2" in proc.stdout, proc.stdout


@pytest.mark.parametrize("mpi", ["openmpi", "mpich"])
def test_without_mpi4py_the_error_names_both_fixes(cluster, mpi, tmp_path):
    script = tmp_path / "no_mpi4py.py"
    # As if mpi4py were not installed: Python's own marker for a module that cannot be imported.
    script.write_text("import sys\nsys.modules['mpi4py'] = None\nimport torchmn\ntorchmn.create_communicator()\n"
                      "print('CREATED', flush=True)\n")
    proc = mpirun(cluster, mpi, [str(script)])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CREATED" not in proc.stdout, out
    assert "MASTER_ADDR is not set and the 4 ranks" in out and "span several nodes" in out, out
    assert "install mpi4py" in out, out
    assert "mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500" in out, out
    assert "mpiexec -genv MASTER_ADDR <first host> -genv MASTER_PORT 29500" in out, out


def test_mpi4py_built_for_another_mpi_is_named(cluster):
    """MPICH's mpiexec, Open MPI's mpi4py: each rank's MPI is a world of its own. Every rank says
    so instead of waiting for a store nobody else joins."""
    proc = mpirun(cluster, "mpich", [str(WORKERS / "mpi_checks.py"), "collectives"], mpi4py="openmpi")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "PASS" not in proc.stdout, out
    # Hydra stops the other ranks once one fails: at least one has said it.
    assert re.search(r"rank [0-3] of 4 \(mpich\) on host h[12]: mpi4py's MPI \(Open MPI", out), out
    assert "sees this process as rank 0 of 1, so mpi4py was built against another MPI" in out, out


def test_rank_0_offers_its_default_route_else_its_host_name(cluster):
    code = "from torchmn.environments.mpi_rendezvous import offered_address; print(repr(offered_address()))"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)}

    def offered():
        proc = on_h1(cluster, [sys.executable, "-c", code], env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return ast.literal_eval(proc.stdout.strip().splitlines()[-1])

    h1 = cluster.address("h1")
    assert offered() == (h1, "eth0, the interface of the default route")
    namespace = cluster.namespaces[0]
    subprocess.run(["ip", "-n", namespace, "route", "del", "default"], check=True, capture_output=True, timeout=20)
    try:
        assert offered() == (h1, "what the host name 'h1' resolves to")
    finally:
        subprocess.run(["ip", "-n", namespace, "route", "add", "default", "via", cluster.gateway], check=True,
                       capture_output=True, timeout=20)
