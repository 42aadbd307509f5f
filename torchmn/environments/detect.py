"""Which launcher started this process, and what it says about our place in the job."""
from __future__ import annotations

from typing import Mapping, Optional, Tuple, Type

from torchmn.environments.base import Environment, LaunchEnvironment, environ
from torchmn.environments.env_method import EnvMethodEnvironment
from torchmn.environments.mpich import MPICHEnvironment
from torchmn.environments.openmpi import OpenMPIEnvironment
from torchmn.environments.single import SingleEnvironment
from torchmn.environments.slurm import SlurmEnvironment, slurm_misuse_error
from torchmn.environments.torchmn_run import TorchmnEnvironment
from torchmn.environments.torchrun import TorchrunEnvironment
from torchmn.errors import TorchmnRuntimeError

# MPI comes before Slurm: mpirun inside an allocation inherits the batch step's SLURM_* variables,
# which would otherwise win (see OpenMPIEnvironment). A hand-written env:// launch comes last: its
# variables are the ones a batch script may export for its own use.
ENVIRONMENTS: Tuple[Type[Environment], ...] = (
    TorchmnEnvironment,
    TorchrunEnvironment,
    OpenMPIEnvironment,
    MPICHEnvironment,
    SlurmEnvironment,
    EnvMethodEnvironment,
)


def launcher_class(env: Optional[Mapping[str, str]] = None) -> Optional[Type[Environment]]:
    """The class of the launcher that started this process: the one ``detect_environment`` reads.

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        The first class of ``ENVIRONMENTS`` whose ``detect`` says yes, or None for no launcher.

    Example::

        >>> launcher_class({"OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}).source
        'openmpi'
    """
    env = environ(env)
    return next((kind for kind in ENVIRONMENTS if kind.detect(env)), None)


def detect_environment(env: Optional[Mapping[str, str]] = None) -> LaunchEnvironment:
    """Read this process's rank, size, node and rendezvous from its launcher's variables.

    Launchers are tried in order: ``torchmn run``, torchrun, Open MPI, MPICH / Intel MPI, Slurm
    (srun), torch's ``env://`` variables set by hand (source ``"env"``); with none, a world of one.
    Nothing is initialised.

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        This process's place in the job.

    Raises:
        ValueError: a launcher's variables are malformed or inconsistent.
        RuntimeError: the rendezvous address cannot be known, or a multi-task Slurm allocation
            runs the script without srun.

    Example::

        >>> detect_environment({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
        ...                     "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "0",
        ...                     "SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "n[1-2]"}).describe()
        'slurm: rank 1/2, local 1/2, node 0, rendezvous n1:24074'
    """
    env = environ(env)
    kind = launcher_class(env)
    if kind is not None:
        return kind.read(env)
    message = slurm_misuse_error(env)
    if message:
        raise TorchmnRuntimeError(message)
    return SingleEnvironment.read(env)
