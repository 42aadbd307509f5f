"""``torchmn run``: the program that starts a job's ranks, watches them and tears the job down.

The command line builds one ``LaunchConfig`` and calls ``run(config)``, which runs one ``Job``
per start (``launch.py``, ``job.py``, ``restarts.py``; ``elastic.py`` for ``--min-np``). Inside: ``plan.py`` puts ranks onto slots and gives each
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

from typing import TYPE_CHECKING

from torchmn import lazy_names

_NAMES = {"LaunchConfig": "torchmn.run.config", "RunError": "torchmn.run.config", "run": "torchmn.run.launch"}
# Loaded when first used: the remote watcher and the guardian run modules of this package, and
# need none of the launcher's.
__getattr__, __dir__, __all__ = lazy_names.attach(__name__, _NAMES)


if TYPE_CHECKING:
    from torchmn.run.config import LaunchConfig, RunError
    from torchmn.run.launch import run
