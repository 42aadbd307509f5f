"""torchmn.ddp_comm_hook checks, run on every rank of a real job (see tests/test_ddp_hook.py).

Each check trains two DistributedDataParallel copies of one float64 model on the same per-rank
batches, one with DDP's own averaging and one with torchmn's hook, and compares their parameters
after every step. Small buckets (``bucket_cap_mb``) make several buckets of uneven sizes.

Usage: python ddp_checks.py [--name flat] CHECK [CHECK ...]   (or "all")
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchmn
from torchmn.errors import TorchmnValueError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import expect, run_checks  # noqa: E402

BUCKET_MB = 0.002  # about 2 KB: the model below falls into several buckets of different sizes
STEPS = 4


class Net(torch.nn.Module):
    """Two layers, and a third used only when asked (for find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 40)
        self.b = torch.nn.Linear(40, 3)
        self.extra = torch.nn.Linear(40, 3)

    def forward(self, x, use_extra=True):
        h = torch.tanh(self.a(x))
        return self.b(h) + (self.extra(h) if use_extra else 0)


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 12, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)


def pair(comm, compression=None, **ddp_kwargs):
    """The same model twice (rank 0's initial weights): DDP's averaging, and torchmn's hook."""
    torch.manual_seed(0)
    net = Net().double()
    plain = DDP(net, bucket_cap_mb=BUCKET_MB, **ddp_kwargs)
    hooked_net = Net().double()
    hooked_net.load_state_dict(net.state_dict())
    hooked = DDP(hooked_net, bucket_cap_mb=BUCKET_MB, **ddp_kwargs)
    hooked.register_comm_hook(None, torchmn.ddp_comm_hook(comm, compression=compression))
    return plain, hooked


def step(model, opt, x, y, **forward_kwargs):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x, **forward_kwargs), y).backward()
    opt.step()


def assert_same(plain, hooked, what, tol=1e-12):
    for (name, p), q in zip(plain.module.named_parameters(), hooked.module.parameters()):
        assert torch.allclose(p, q, rtol=tol, atol=tol), (what, name, (p - q).abs().max().item())


def train_both(comm, compression=None, tol=1e-12, use_extra=lambda t: True, **ddp_kwargs):
    plain, hooked = pair(comm, compression, **ddp_kwargs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, hooked)]
    for t in range(STEPS):
        x, y = batch(comm.rank, t)
        for model, opt in zip((plain, hooked), opts):
            step(model, opt, x, y, use_extra=use_extra(t))
        assert_same(plain, hooked, f"step {t}", tol)
    return hooked


def check_equals_ddps_own_averaging(comm):
    hooked = train_both(comm)
    # The same bits on every rank.
    flat = torch.cat([p.detach().view(-1) for p in hooked.module.parameters()])
    for other in comm.allgather_obj(flat):
        assert torch.equal(other, flat)


def check_find_unused_parameters(comm):
    """``extra`` gets no gradient on odd steps; on rank 1 never (DDP marks it ready as zeros)."""
    train_both(comm, use_extra=lambda t: t % 2 == 0 and comm.rank != 1, find_unused_parameters=True)


def check_no_sync(comm):
    """Two micro-batches accumulated under no_sync (no hook call), the third averages the sum."""
    plain, hooked = pair(comm)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, hooked)]
    for t in range(2):
        for model, opt in zip((plain, hooked), opts):
            opt.zero_grad()
            for micro in range(3):
                x, y = batch(comm.rank, 10 * t + micro)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if micro < 2:
                    with model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
        assert_same(plain, hooked, f"accumulated step {t}")


def check_fp16_and_bf16_compression(comm):
    """Buckets travel in half precision: the result is within its rounding of DDP's."""
    for compression, tol in (("fp16", 2e-3), ("bf16", 2e-2)):
        train_both(comm, compression=compression, tol=tol)


def check_bad_compression_refused(comm):
    e = expect(ValueError, lambda: torchmn.ddp_comm_hook(comm, compression="int8"))
    assert "'fp16', 'bf16'" in str(e), e


def check_hook_without_a_communicator_refused(comm):
    for wrong in (None, dist.group.WORLD):
        e = expect(TypeError, lambda: torchmn.ddp_comm_hook(wrong))
        assert "must be a torchmn communicator" in str(e), e


def check_ranks_compressing_differently_refused(comm):
    """One rank's hook compresses to fp16, the others' not: the first backward raises on every rank,
    naming each rank's dtype (the sum of float16 and float32 bytes was garbage, silently)."""
    torch.manual_seed(0)
    model = DDP(Net().double(), bucket_cap_mb=BUCKET_MB)
    model.register_comm_hook(None, torchmn.ddp_comm_hook(comm, compression="fp16" if comm.rank == 0 else None))
    x, y = batch(comm.rank, 0)
    e = expect(TorchmnValueError, lambda: torch.nn.functional.cross_entropy(model(x), y).backward())
    others = ", ".join(f"rank {r}: none" for r in range(1, comm.size))
    assert f"compress differently (rank 0: float16, {others})" in str(e) and "compression=" in str(e), e
    dist.barrier()


def check_communicator_of_another_size_refused(comm):
    """A communicator over a subgroup (one rank each) while DDP averages over the whole world: the
    first backward raises on every rank, naming both sets of ranks and the fix."""
    alone = comm.split(color=comm.rank)
    e = first_backward_refused(comm, alone, process_group=None)
    everyone = list(range(comm.size))
    assert f"averages over ranks {everyone} (its process_group), but the communicator spans ranks [{comm.rank}]" \
        in str(e), e
    assert f"on rank {comm.rank} ({comm.host})" in str(e), e
    alone.finalize()
    dist.barrier()


def first_backward_refused(comm, hook_comm, process_group):
    """DDP over ``process_group`` with the hook over ``hook_comm``: the error of its first backward."""
    torch.manual_seed(0)
    model = DDP(Net().double(), bucket_cap_mb=BUCKET_MB, process_group=process_group)
    model.register_comm_hook(None, torchmn.ddp_comm_hook(hook_comm))
    x, y = batch(comm.rank, 0)
    return expect(TorchmnValueError, lambda: torch.nn.functional.cross_entropy(model(x), y).backward())


def check_ddp_over_other_ranks_refused(comm):
    """DDP over a group of one rank each (its process_group), the hook given the whole world: the
    first backward raises on every rank, naming both sets of ranks and the fix."""
    singles = [dist.new_group([r]) for r in range(comm.size)]  # every rank takes part in creating each
    e = first_backward_refused(comm, comm, process_group=singles[comm.rank])
    everyone = list(range(comm.size))
    assert f"averages over ranks [{comm.rank}] (its process_group), but the communicator spans ranks {everyone}" \
        in str(e), e
    assert "comm.split" in str(e), e
    dist.barrier()


def check_wrapped_hook_over_a_split_trains(comm):
    """The hook inside torch's fp16_compress_wrapper (where it cannot find DDP's group), given a
    communicator split to DDP's own group: it trains as torch's fp16 hook does over that group."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook, fp16_compress_wrapper

    colors = [r % 2 for r in range(comm.size)]
    groups = {c: dist.new_group([r for r in range(comm.size) if colors[r] == c]) for c in sorted(set(colors))}
    mine, sub = groups[colors[comm.rank]], comm.split(color=colors[comm.rank])
    torch.manual_seed(0)
    net = Net().double()
    plain = DDP(net, bucket_cap_mb=BUCKET_MB, process_group=mine)
    plain.register_comm_hook(mine, fp16_compress_hook)
    hooked_net = Net().double()
    hooked_net.load_state_dict(net.state_dict())
    hooked = DDP(hooked_net, bucket_cap_mb=BUCKET_MB, process_group=mine)
    hooked.register_comm_hook(None, fp16_compress_wrapper(torchmn.ddp_comm_hook(sub)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, hooked)]
    for t in range(STEPS):
        x, y = batch(comm.rank, t)
        for model, opt in zip((plain, hooked), opts):
            step(model, opt, x, y)
        assert_same(plain, hooked, f"step {t}", tol=2e-3)
    sub.finalize()
    dist.barrier()


if __name__ == "__main__":
    run_checks(globals())
