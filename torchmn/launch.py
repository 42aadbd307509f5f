"""What a process's launcher says, without setting anything up: the specification's names for it.

:func:`detect_environment` reads the rank, size, node and rendezvous from the launcher's variables
(``torchmn run``, torchrun, Open MPI, MPICH / Intel MPI, Slurm, else a world of one), and
:func:`expand_hostlist` expands a Slurm hostlist as ``scontrol show hostnames`` does. Both live in
:mod:`torchmn.environments`, with one class per launcher.

Example::

    >>> import torchmn.launch
    >>> torchmn.launch.expand_hostlist("node[01-02],gpu7")
    ['node01', 'node02', 'gpu7']
    >>> torchmn.launch.detect_environment({}).source
    'single'
"""
from torchmn.environments import LaunchEnvironment, detect_environment, expand_hostlist

__all__ = ["LaunchEnvironment", "detect_environment", "expand_hostlist"]
