"""Which launcher started this process, and what it says about our place in the job.

This is the part of launching that every rank uses at run time: ``create_communicator`` asks
``detect_environment`` for the rank, size, node and rendezvous. One class per launcher, each in its
own module with its ``detect(env)`` and ``read(env)``, over the base class in ``base.py``;
``variables.py`` holds the parsing they share, ``detect.py`` tries them in order. Reading the
variables sets nothing up (under MPICH it also reads /proc; under MPI across nodes it only asks
whether mpi4py is installed). ``mpi_rendezvous.py`` is the one exception, used by
``create_communicator`` only: it sends rank 0's address over MPI.

Example::

    >>> from torchmn.environments import detect_environment, expand_hostlist
    >>> expand_hostlist("node[1-2]")
    ['node1', 'node2']
    >>> detect_environment({}).source
    'single'
"""
from torchmn.environments.base import Environment, LaunchEnvironment
from torchmn.environments.detect import ENVIRONMENTS, detect_environment, launcher_class
from torchmn.environments.env_method import EnvMethodEnvironment
from torchmn.environments.hostlist import expand_hostlist
from torchmn.environments.label import job_label
from torchmn.environments.mpi import MPIEnvironment
from torchmn.environments.mpich import MPICHEnvironment, hydra_job
from torchmn.environments.openmpi import OpenMPIEnvironment
from torchmn.environments.single import SingleEnvironment
from torchmn.environments.slurm import SlurmEnvironment, slurm_misuse_error, slurm_port, slurm_step_id
from torchmn.environments.torchmn_run import TorchmnEnvironment
from torchmn.environments.torchrun import TorchrunEnvironment
from torchmn.environments.variables import DEFAULT_PORT, LOCALHOST, PORT_BASE, PORT_SPAN, text_port

__all__ = [
    "DEFAULT_PORT", "ENVIRONMENTS", "EnvMethodEnvironment", "Environment", "LOCALHOST", "LaunchEnvironment",
    "MPICHEnvironment", "MPIEnvironment", "OpenMPIEnvironment", "PORT_BASE", "PORT_SPAN", "SingleEnvironment",
    "SlurmEnvironment", "TorchmnEnvironment", "TorchrunEnvironment", "detect_environment", "expand_hostlist",
    "hydra_job", "job_label", "launcher_class", "slurm_misuse_error", "slurm_port", "slurm_step_id", "text_port",
]
