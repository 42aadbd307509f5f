"""Launch support: find out how this process was started, and ``torchmn run``.

``detect_environment`` only reads variables (and, under MPICH, /proc; under MPI across nodes, whether
mpi4py is installed, without importing it): it sets nothing up.

Example::

    >>> from torchmn.launch import detect_environment, expand_hostlist
    >>> expand_hostlist("node[1-2]")
    ['node1', 'node2']
"""
from torchmn.launch.base import LaunchEnvironment
from torchmn.launch.detect import detect_environment
from torchmn.launch.hostlist import expand_hostlist

__all__ = ["LaunchEnvironment", "detect_environment", "expand_hostlist"]
