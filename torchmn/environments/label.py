"""Words naming a launcher's job, for messages about it."""
from __future__ import annotations

from typing import Mapping, Optional

from torchmn.environments.mpich import MPICHEnvironment
from torchmn.environments.openmpi import OpenMPIEnvironment
from torchmn.environments.slurm import SlurmEnvironment

# The launchers whose job has an id that torchmn derives the rendezvous port from.
_LABELLED = (SlurmEnvironment, OpenMPIEnvironment, MPICHEnvironment)


def job_label(env: Mapping[str, str], source: str) -> Optional[str]:
    """Words naming this job of launcher ``source`` (the job id its ports derive from).

    Args:
        env: the environment.
        source: the launcher's name (``LaunchEnvironment.source``).

    Returns:
        The words, or None where the launcher gives no job id.

    Example::

        >>> job_label({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}, "slurm")
        'Slurm job 42 step 3'
    """
    kind = next((kind for kind in _LABELLED if kind.source == source), None)
    return kind.job_label(env) if kind is not None else None
