"""Amazon SageMaker training jobs: ``SM_HOSTS`` (a JSON list of ``algo-N``) and ``SM_CURRENT_HOST``."""
from __future__ import annotations

import json
from typing import Mapping, Optional

from torchmn.environments.platforms.base import NodePlace, Platform, PlatformError, integer


class SageMakerPlatform(Platform):
    """A host of a SageMaker training job that runs the entry point once per host.

    The hosts are ``SM_HOSTS`` in order, the first hosts the rendezvous (on ``MASTER_PORT``, else
    the default port); this one is ``SM_CURRENT_HOST``. With GPUs (``SM_NUM_GPUS``) the ranks
    per host default to their number.

    Example::

        >>> place = SageMakerPlatform.read({"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2"})
        >>> place.nnodes, place.node_rank, place.master_addr
        (2, 1, 'algo-1')
    """

    name = "SageMaker"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether SageMaker started this host's entry point; see ``Platform.detect``.

        Args:
            env: the environment.

        Returns:
            True with ``SM_HOSTS`` and ``SM_CURRENT_HOST``.

        Example::

            >>> SageMakerPlatform.detect({"SM_HOSTS": "[]", "SM_CURRENT_HOST": "algo-1"})
            True
        """
        return "SM_HOSTS" in env and "SM_CURRENT_HOST" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> NodePlace:
        """This host's place; see ``Platform.read``.

        Args:
            env: the environment.

        Returns:
            The place.

        Raises:
            PlatformError: ``SM_HOSTS`` is not a JSON list of names, or does not hold
                ``SM_CURRENT_HOST``.

        Example::

            >>> SageMakerPlatform.read({"SM_HOSTS": "algo-1,algo-2", "SM_CURRENT_HOST": "algo-1"})
            Traceback (most recent call last):
            torchmn.environments.platforms.base.PlatformError: SageMaker: SM_HOSTS='algo-1,algo-2' is not a JSON list of host names (SageMaker sets it as ["algo-1", "algo-2"]); pass it on unchanged
        """
        text = env["SM_HOSTS"]
        try:
            hosts = json.loads(text)
        except ValueError:
            hosts = None
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise PlatformError(f"{cls.name}: SM_HOSTS={text!r} is not a JSON list of host names (SageMaker sets "
                                f"it as [\"algo-1\", \"algo-2\"]); pass it on unchanged")
        current = env["SM_CURRENT_HOST"]
        if current not in hosts:
            raise PlatformError(f"{cls.name}: SM_CURRENT_HOST={current!r} is not one of SM_HOSTS={text}")
        port = integer(env, "MASTER_PORT", cls.name, 1) if env.get("MASTER_PORT") else None
        gpus = env.get("SM_NUM_GPUS", "")
        return NodePlace(len(hosts), hosts.index(current), hosts[0], port,
                         int(gpus) if gpus.isdigit() and int(gpus) > 0 else None, cls.name,
                         {"nnodes": "SM_HOSTS", "node_rank": "SM_CURRENT_HOST", "master_addr": "SM_HOSTS",
                          "master_port": "MASTER_PORT"}, _job_name(env))


def _job_name(env: Mapping[str, str]) -> Optional[str]:
    """The training job's name (unique in the account and region), from SM_TRAINING_ENV's
    ``job_name``, or TRAINING_JOB_NAME; None where neither says."""
    try:
        training = json.loads(env.get("SM_TRAINING_ENV", "") or "{}")
    except ValueError:
        training = {}
    name = training.get("job_name") if isinstance(training, dict) else None
    return (name if isinstance(name, str) and name else None) or env.get("TRAINING_JOB_NAME") or None
