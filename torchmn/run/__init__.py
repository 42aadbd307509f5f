"""``torchmn run``: the program that starts a job's ranks, watches them and tears the job down.

The command line builds one ``LaunchConfig`` and calls ``run(config)``, which runs one ``Job``
per start (``job.py``, ``restarts.py``). Inside: ``plan.py`` puts ranks onto slots and gives each
its variables; ``processes/`` starts, watches and ends processes (supervisor, output, guardian);
``remote/`` reaches other hosts (hostfiles, ssh, the watcher that runs each remote rank);
``store/`` hosts the rendezvous store behind its gate; ``slurm_step.py`` makes one job of a Slurm
step's tasks; ``dry_run.py`` prints a job's plan without starting anything (``--dry-run``). None
of it imports torch. How it works: ``docs/design/launcher.md``.

Example::

    >>> from torchmn.run import LaunchConfig, run
    >>> run(LaunchConfig(["python", "-c", "print('hi')"], np=2))
    0
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_NAMES = {"LaunchConfig": "torchmn.run.config", "RunError": "torchmn.run.config", "run": "torchmn.run.job"}
__all__ = sorted(_NAMES)


# Loaded when first used: the remote watcher and the guardian run modules of this package, and
# need none of the launcher's.
def __getattr__(name: str):
    """Load ``LaunchConfig``, ``RunError`` or ``run`` when it is first used (PEP 562).

    The value is kept in this module, so that later lookups are plain attributes.

    Args:
        name: the attribute asked for.

    Returns:
        The object of that name, from ``torchmn.run.config`` or ``torchmn.run.job``.

    Raises:
        AttributeError: ``name`` is not one of the three.

    Example::

        >>> import torchmn.run
        >>> torchmn.run.LaunchConfig(["python", "train.py"], np=2).np
        2
    """
    if name not in _NAMES:
        raise AttributeError(f"module 'torchmn.run' has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    """The module's names for ``dir(torchmn.run)``, the three loaded on first use included.

    Returns:
        The sorted names of the module's globals and of ``__all__``.

    Example::

        >>> import torchmn.run
        >>> "run" in dir(torchmn.run)
        True
    """
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from torchmn.run.config import LaunchConfig, RunError
    from torchmn.run.job import run
