"""``naive``: one allreduce per gradient tensor. The baseline for tests and benchmarks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from torchmn.communicators.communicator import Communicator
from torchmn.communicators.ops import divide_before_sum


class NaiveCommunicator(Communicator):
    """Averages each tensor with its own allreduce over all ranks.

    Example::

        >>> comm = torchmn.create_communicator("naive")
    """

    name = "naive"
    grad_bucket_cap_bytes = 0

    def mean_tensors(self, tensors: list[torch.Tensor]) -> None:
        if self.size == 1:
            return
        first = [divide_before_sum(t.dtype) for t in tensors]
        for t, divide in zip(tensors, first):
            if divide:
                t.div_(self.size)
        works = [dist.all_reduce(t, group=self._group, async_op=True) for t in tensors]
        for t, w, divided in zip(tensors, works, first):
            w.wait()
            if not divided:
                t.div_(self.size)
