"""25 Horovod allreduces named ``step.<i>``, with ``hvd.start_timeline(WINDOW)`` before step 10 and
``hvd.stop_timeline()`` after step 14, in a job that may record a timeline of its own
(``torchmn run --timeline``): the two must not take each other's events.

Usage: python horovod_timeline_window.py WINDOW
"""
import sys

import torch

import torchmn.horovod as hvd

hvd.init()
for step in range(25):
    if step == 10:
        hvd.start_timeline(sys.argv[1])
    hvd.allreduce(torch.ones(4), name=f"step.{step}")
    if step == 14:
        hvd.stop_timeline()
hvd.shutdown()
