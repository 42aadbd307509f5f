"""Which tests need a cluster, and which must run together when pytest-xdist spreads the suite.

``python -m pytest -m "not cluster and not soak"`` runs the tests that need no root, Slurm, MPI or ssh
(and leaves out the long failure soak). Cluster
tests are every test of the Slurm and MPI files, the tests that use the network-namespace hosts (the
``cluster`` fixture, tests/cluster/netns.py), and those marked ``@pytest.mark.cluster`` where they
need something else of the kind (mpi4py built against an MPI).

The suite runs on pytest-xdist workers (``-n auto --dist loadgroup`` in pyproject.toml; ``-n0`` runs
it in this process). ``auto`` is twice the usable cores, at most 8: most tests wait on processes they
started (their ranks, a launcher, a timeout) more than they compute. Tests that share one thing a
worker can hold only once run on one worker, in one ``xdist_group``:

- the Slurm cluster and the network-namespace hosts (one Slurm per machine: its daemons listen on
  fixed ports; the hosts' subnets are picked from what is free when they start);
- the checks of one check job (tests/jobs.py), which run in one real job on the worker that has them;
- the tests of a module that share a module-scoped job (test_security's probed job);
- the Ray tests: each starts a local Ray instance, a dozen processes that, several at once on a
  loaded 2-core machine, take minutes to come up.
"""
import os

import pytest

from jobs import job_key

# Files whose every test needs Slurm (and root), or MPI.
CLUSTER_FILES = {"test_slurm.py", "test_mpi.py", "test_mpi_hosts.py", "test_emulated_nodes.py"}
# Fixtures that bring up hosts in network namespaces with their own sshd (root).
CLUSTER_FIXTURES = {"cluster"}
# What only one worker at a time may hold: the Slurm cluster and the network-namespace hosts.
HOSTS_GROUP = "hosts"
HOSTS_FILES = {"test_slurm.py", "test_mpi_hosts.py", "test_emulated_nodes.py"}
# Module-scoped fixtures that start a job every test of the module probes: one worker starts it.
SHARED_JOB_FIXTURES = {"job", "data_job"}
# Files whose tests start heavy local instances of a framework: one worker runs them, one at a time.
SERIAL_FILES = {"test_ray.py": "ray"}
# The limit of a check test without its own: the first test of a check job runs the whole job
# (tests/jobs.py), which has a limit of its own (at most 300 s) that stops a hang first.
CHECK_JOB_TIMEOUT_S = 360


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto``: twice the cores this process may use, at most 8."""
    return min(8, 2 * len(os.sched_getaffinity(0)))


def xdist_group_of(item) -> str | None:
    """The group whose tests must share one worker, or None for a test that can go anywhere."""
    if item.path.name in HOSTS_FILES or CLUSTER_FIXTURES & set(item.fixturenames):
        return HOSTS_GROUP
    if item.path.name in SERIAL_FILES:
        return SERIAL_FILES[item.path.name]
    key = job_key(item)
    if key is not None:
        return "check-job:" + repr(key)
    shared = SHARED_JOB_FIXTURES & set(item.fixturenames)
    if shared:
        return f"{item.path.name}:{','.join(sorted(shared))}"
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in CLUSTER_FILES or CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.cluster)
        if job_key(item) is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(CHECK_JOB_TIMEOUT_S))
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(name=group))
