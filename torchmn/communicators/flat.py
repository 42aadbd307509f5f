"""``flat``: gradients fused into buckets, one allreduce per bucket over all ranks."""
from __future__ import annotations

import torch

from torchmn.communicators import _wire
from torchmn.communicators.communicator import Communicator
from torchmn.communicators.ops import mean_divisors


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
            before, after = mean_divisors(flat.dtype, self.size)
            if before > 1:  # half precision: a sum of several ranks' values could overflow
                flat.div_(before)
            pending.append((bucket, flat, after, self.allreduce_flat(flat, async_op=True)))
        for bucket, flat, after, work in pending:
            work.wait()
            if after > 1:
                flat.div_(after)
            _wire.unpack_into(bucket, flat)
