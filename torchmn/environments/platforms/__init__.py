"""The platforms that start one agent per node and hand it its node's place in variables:
Kubeflow's PyTorchJob, SkyPilot and SageMaker. ``torchmn run`` run there as that agent (without
``--nnodes``) starts its node's ranks as one job with the other nodes' (see ``torchmn.run.nodes``).

One class per platform, each in its own module with ``detect(env)`` and ``read(env)``, which
read variables and set nothing up; ``detect_platform`` tries them in order.

Example::

    >>> detect_platform({"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
    ...                  "SKYPILOT_NODE_IPS": "10.0.0.1\\n10.0.0.2"}).master_addr
    '10.0.0.1'
"""
from __future__ import annotations

from typing import Mapping, Optional

from torchmn.environments.platforms.base import NodePlace, Platform, PlatformError
from torchmn.environments.platforms.kubeflow import KubeflowPlatform
from torchmn.environments.platforms.sagemaker import SageMakerPlatform
from torchmn.environments.platforms.skypilot import SkyPilotPlatform

PLATFORMS = (KubeflowPlatform, SkyPilotPlatform, SageMakerPlatform)


def detect_platform(env: Mapping[str, str]) -> Optional[NodePlace]:
    """This node's place, from the first platform whose variables are set.

    Args:
        env: the launcher's environment.

    Returns:
        The place, or None on none of the platforms.

    Raises:
        PlatformError: the platform's variables are set but malformed; the message names the
            variable and the fix.

    Example::

        >>> detect_platform({}) is None
        True
    """
    for platform in PLATFORMS:
        if platform.detect(env):
            return platform.read(env)
    return None


__all__ = ["NodePlace", "PLATFORMS", "Platform", "PlatformError", "detect_platform"]
