"""``torchmn doctor``: why is a job slow? Threads against CPUs, per rank, in plain words.

The parts: finding a job's ranks and workers (:mod:`.processes`), sampling them
(:mod:`.sampling`), the verdict and the report (:mod:`.verdict`), and the command (:mod:`.command`).

Example::

    $ torchmn doctor -np 2 -- python train.py
    $ torchmn doctor --pid 12345 --json
"""
from torchmn.doctor.verdict import FINE, OVERSUBSCRIBED, UNDER_USED, Diagnosis, diagnose

__all__ = ["FINE", "OVERSUBSCRIBED", "UNDER_USED", "Diagnosis", "diagnose"]
