"""Which tests need a cluster: ``python -m pytest -m "not cluster"`` runs the others.

Cluster tests need root, Slurm, MPI or ssh: every test of the Slurm and MPI files, the tests that
use the network-namespace hosts (the ``cluster`` fixture, tests/cluster/netns.py), and those marked
``@pytest.mark.cluster`` where they need something else of the kind (mpi4py built against an MPI).
"""
import pytest

# Files whose every test needs Slurm (and root), or MPI.
CLUSTER_FILES = {"test_slurm.py", "test_mpi.py", "test_mpi_hosts.py"}
# Fixtures that bring up hosts in network namespaces with their own sshd (root).
CLUSTER_FIXTURES = {"cluster"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in CLUSTER_FILES or CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.cluster)
