"""``flat``: gradients fused into buckets, one allreduce per bucket over all ranks."""
from __future__ import annotations

import torch

from torchmn.communicators import _wire
from torchmn.communicators.communicator import Communicator
from torchmn.communicators.ops import divide_before_sum


class FlatCommunicator(Communicator):
    """Packs tensors into buckets of at most ``bucket_cap_bytes`` (one dtype each) and allreduces
    each bucket once: a few large messages instead of hundreds of small ones.

    Example::

        >>> comm = torchmn.create_communicator("flat")
    """

    name = "flat"

    def mean_tensors(self, tensors: list[torch.Tensor]) -> None:
        if self.size == 1 or not tensors:
            return
        pending = []
        for bucket in _wire.buckets(tensors, self.bucket_cap_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
            first = divide_before_sum(flat.dtype)
            if first:  # half precision: a sum of several ranks' values could overflow
                flat.div_(self.size)
            pending.append((bucket, flat, first, self.allreduce_flat(flat, async_op=True)))
        for bucket, flat, first, work in pending:
            work.wait()
            if not first:
                flat.div_(self.size)
            _wire.unpack_into(bucket, flat)
