"""``naive``: one allreduce per gradient tensor. The baseline for tests and benchmarks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from torchmn.communicators.communicator import Communicator
from torchmn.communicators.ops import mean_divisors


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
        divisors = [mean_divisors(t.dtype, self.size) for t in tensors]
        # gloo reads and writes a tensor as one block from its first element: a gradient that is a
        # view (a column block of a larger buffer, an expanded tensor) travels as a dense copy.
        wires = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        for t, (before, _) in zip(wires, divisors):
            if before > 1:
                t.div_(before)
        works = [dist.all_reduce(t, group=self.wire_group(t), async_op=True) for t in wires]
        for t, wire, w, (_, after) in zip(tensors, wires, works, divisors):
            w.wait()
            if after > 1:
                wire.div_(after)
            if wire is not t:
                t.copy_(wire)
