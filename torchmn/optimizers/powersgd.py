"""PowerSGD: gradients averaged as low-rank approximations, with error feedback, for slow links.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization"
(NeurIPS 2019), the algorithm torch's DDP hook ``powerSGD_hook`` implements, here on the
multi-node optimizer's buckets. Each gradient of two or more dimensions, seen as an n x m matrix
M (its first dimension by the rest), travels as two thin matrices, P (n x r) and Q (m x r),
in place of its n x m values, where that saves at least half of them; the other gradients
(biases, small layers) and the buckets' has-a-gradient flags travel whole. Per step and bucket:

1. M += this rank's error (what earlier steps' approximations left out of its gradient);
2. P = M Q (Q: the last step's, a warm start), summed over ranks with the whole gradients;
3. P made orthonormal (QR), the same on every rank; Q = M^T P, summed over ranks (one message
   for every bucket's Qs);
4. the average is P Q^T / ranks; this rank's error = M - that average.

Error feedback makes the accumulated updates follow the uncompressed ones: whatever an
approximation leaves out of a gradient is sent in later steps. The error and Q live on every
rank, one matrix of the gradient's size and one thin one per compressed gradient; they are not
part of ``state_dict()``, so a resumed run starts them afresh (zero error, Q drawn again).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from torchmn.communicators import Communicator
from torchmn.errors import TorchmnValueError

MIN_SAVING = 2  # compress a gradient only where P and Q hold at most half its values


@dataclasses.dataclass
class _Matrix:
    """One compressed gradient: where it lies in its bucket's buffer, as an n x m matrix."""
    offset: int
    n: int
    m: int
    q: torch.Tensor                     # m x r: the last step's average Q (a warm start)
    error: Optional[torch.Tensor] = None  # n x m: what the approximations left out so far


class _BucketPlan:
    """Which parts of one bucket travel whole and which as P and Q; the first message's buffer."""

    def __init__(self, bucket, rank: int, generator: torch.Generator):
        self.whole: list[tuple[int, int]] = []   # (offset, numel) in the bucket's buffer
        self.matrices: list[_Matrix] = []
        offset = 0
        for p in bucket.params:
            n = p.shape[0] if p.dim() >= 2 else 0
            m = p.numel() // n if n else 0
            r = min(rank, n, m)
            if n and (n + m) * r * MIN_SAVING <= n * m:
                q = torch.randn(m, r, generator=generator, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
                self.matrices.append(_Matrix(offset, n, m, q))
            else:
                self.whole.append((offset, p.numel()))
            offset += p.numel()
        self.whole.append((offset, bucket.numel - offset))  # the flags
        whole = sum(numel for _, numel in self.whole)
        ps = sum(x.n * x.q.shape[1] for x in self.matrices)
        self.message = torch.empty(whole + ps, dtype=bucket.wire_dtype, device=bucket.params[0].device)
        self.work = None


class LowRankAverager:
    """PowerSGD's state for one optimizer's buckets, and the two messages of each step.

    The multi-node optimizer calls :meth:`start` for each bucket as backward fills it, and
    :meth:`finish` once for all of them.

    Example::

        >>> averager = LowRankAverager(4, optimizer.buckets, comm)
        >>> for bucket in optimizer.buckets:
        ...     averager.start(bucket)        # P and the whole gradients go out
        >>> averager.finish(optimizer.buckets, comm.size)   # the average is in each bucket's buffer
    """

    def __init__(self, rank: int, buckets: list, comm: Communicator):
        """Plan each bucket and draw the first Qs (alike on every rank: one seed). No communication.

        Args:
            rank: the approximations' rank.
            buckets: the optimizer's buckets (``.params``, ``.numel``, ``.wire_dtype``; ``.buffer``
                once packed).
            comm: the communicator.

        Raises:
            ValueError: gradients neither float32 nor float64.

        Example::

            >>> averager = LowRankAverager(4, optimizer.buckets, comm)
        """
        generator = torch.Generator().manual_seed(0)
        for b in buckets:
            if b.wire_dtype not in (torch.float32, torch.float64):
                raise TorchmnValueError(
                    f"compression='powersgd' with {b.wire_dtype} parameters: it approximates float32 and float64 "
                    f"gradients only (train half precision with autocast over float32 parameters, or use "
                    f"compression=None or 'bf16')")
        self.comm = comm
        self.plans = {id(b): _BucketPlan(b, rank, generator) for b in buckets}

    def start(self, bucket) -> None:
        """Pack the bucket, add this rank's error to its matrices, compute their Ps, and start
        summing the Ps and the whole gradients over ranks (asynchronous).

        Args:
            bucket: a bucket whose gradients are ready; packed here (unscaled).

        Example::

            >>> averager.start(bucket)
        """
        plan = self.plans[id(bucket)]
        if plan.work is not None:  # sent by a backward that raised: done with the message first
            plan.work.wait()
        buffer, message = bucket.pack(None), plan.message
        at = 0
        for offset, numel in plan.whole:
            message[at:at + numel].copy_(buffer[offset:offset + numel])
            at += numel
        for x in plan.matrices:
            grad = buffer[x.offset:x.offset + x.n * x.m].view(x.n, x.m)
            if x.error is not None:
                grad.add_(x.error)
            r = x.q.shape[1]
            torch.matmul(grad, x.q, out=message[at:at + x.n * r].view(x.n, r))
            at += x.n * r
        plan.work = self.comm.allreduce_flat(message, async_op=True)

    def finish(self, buckets: list, ranks: int) -> None:
        """Wait for the Ps, send the Qs (one message for all buckets), and put each bucket's
        average in its buffer (the whole gradients and flags too); keep the new errors and Qs.

        Args:
            buckets: every bucket :meth:`start` was called for this step, in the same order on
                every rank.
            ranks: how many ranks' gradients the average is over.

        Example::

            >>> averager.finish(optimizer.buckets, optimizer.contributors)
        """
        plans = [self.plans[id(b)] for b in buckets]
        qs, ps = [], []
        for b, plan in zip(buckets, plans):
            plan.work.wait()
            plan.work = None
            message, buffer = plan.message, b.buffer
            at = 0
            for offset, numel in plan.whole:
                torch.div(message[at:at + numel], ranks, out=buffer[offset:offset + numel])
                at += numel
            for x in plan.matrices:
                r = x.q.shape[1]
                p = torch.linalg.qr(message[at:at + x.n * r].view(x.n, r)).Q  # the same on every rank
                at += x.n * r
                grad = buffer[x.offset:x.offset + x.n * x.m].view(x.n, x.m)
                ps.append(p)
                qs.append(grad.T @ p)
        if not qs:
            return
        sums = torch.cat([q.reshape(-1) for q in qs])
        self.comm.allreduce_flat(sums, async_op=False)
        sums.div_(ranks)
        at, k = 0, 0
        for b, plan in zip(buckets, plans):
            for x in plan.matrices:
                q = sums[at:at + x.q.numel()].view_as(x.q)
                at += x.q.numel()
                grad = b.buffer[x.offset:x.offset + x.n * x.m].view(x.n, x.m)
                average = ps[k] @ q.T
                k += 1
                if x.error is None:
                    x.error = torch.empty_like(grad)
                torch.sub(grad, average, out=x.error)
                grad.copy_(average)
                x.q.copy_(q)
