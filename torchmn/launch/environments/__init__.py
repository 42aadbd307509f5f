"""One class per launcher: which variables say that it started us, and what they say.

Each module holds one launcher's class, with its ``detect(env)`` and ``read(env)``; ``helpers``
holds the parsing they share. ``torchmn.launch.detect`` tries them in order.

Example::

    >>> from torchmn.launch.environments import SlurmEnvironment, slurm_port
    >>> SlurmEnvironment.detect({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}), slurm_port(1234, 0)
    (True, 31698)
"""
from torchmn.launch.environments.envvars import EnvEnvironment
from torchmn.launch.environments.helpers import DEFAULT_PORT, LOCALHOST, PORT_BASE, PORT_SPAN, text_port
from torchmn.launch.environments.label import job_label
from torchmn.launch.environments.mpi import MPIEnvironment
from torchmn.launch.environments.mpich import MPICHEnvironment, hydra_job
from torchmn.launch.environments.openmpi import OpenMPIEnvironment
from torchmn.launch.environments.single import SingleEnvironment
from torchmn.launch.environments.slurm import SlurmEnvironment, slurm_misuse_error, slurm_port, slurm_step_id
from torchmn.launch.environments.torchmn_run import TorchmnEnvironment
from torchmn.launch.environments.torchrun import TorchrunEnvironment

__all__ = [
    "DEFAULT_PORT", "EnvEnvironment", "LOCALHOST", "MPICHEnvironment", "MPIEnvironment", "OpenMPIEnvironment",
    "PORT_BASE", "PORT_SPAN", "SingleEnvironment", "SlurmEnvironment", "TorchmnEnvironment",
    "TorchrunEnvironment", "hydra_job", "job_label", "slurm_misuse_error", "slurm_port", "slurm_step_id",
    "text_port",
]
