"""torchmn.join checks, run on every rank of a real job (see tests/test_join.py).

Each rank trains on its own number of batches (COUNTS) inside ``torchmn.join``; every rank also
computes the one-process reference itself: the same batches, step t averaging the gradients of the
ranks that still have a batch t (divided by their number), then two steps on every rank's batch
after the context. The job's parameters must equal it in float64, and be the same bits on every rank.
Usage: python join_checks.py [--name flat] CHECK [CHECK ...]   (or "all")
"""

import os
import sys

import torch

import torchmn
from torchmn.optimizers import NodeSharedOptimizer, ShardedMultiNodeOptimizer
from torchmn.optimizers.join import JoinError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import expect, run_checks  # noqa: E402
from optim_checks import OPTIMIZERS, loss_fn, make_model, wrapped_model  # noqa: E402

COUNTS = {1: [4], 2: [7, 10], 3: [6, 2, 4], 4: [3, 5, 5, 8]}          # batches per rank
WITH_AN_EMPTY_RANK = {1: [0], 2: [0, 3], 3: [4, 0, 6], 4: [2, 0, 5, 1]}  # one rank has none at all
AFTER = 2  # steps on every rank after the context: the ordinary average again
KINDS = {"replicated": {"shard_state": False}, "sharded": {"shard_state": True}, "default": {}}
def batch(rank, step):
    """Rank ``rank``'s batch ``step`` (4 samples; the steps after the context are numbered on)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)


def reference(counts, opt_name, steps_after=AFTER):
    """One process: at step t, the mean of the losses of the ranks with a batch t (so the mean of
    their gradients), then ``steps_after`` steps over every rank's batch."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    longest = max(counts)
    for t in range(longest + steps_after):
        ranks = [r for r, c in enumerate(counts) if c > t] if t < longest else range(len(counts))
        opt.zero_grad()
        (sum(loss_fn(model, *batch(r, t)) for r in ranks) / len(ranks)).backward()
        opt.step()
    return model


def train(comm, counts, opt_name, passes=1, **kwargs):
    """This rank's batches inside torchmn.join, then ``AFTER`` steps on every rank outside it."""
    model, opt = wrapped_model(comm, opt_name, passes, **kwargs)
    longest = max(counts)
    with torchmn.join(comm) as joined:
        for t in range(counts[comm.rank]):
            step(opt, model, *batch(comm.rank, t), passes)
    assert joined.steps_repeated == longest - counts[comm.rank], (joined.steps_repeated, counts, comm.rank)
    for t in range(longest, longest + AFTER):
        step(opt, model, *batch(comm.rank, t), passes)
    return model, opt


def step(opt, model, x, y, passes=1):
    opt.zero_grad()
    for xc, yc in zip(x.chunk(passes), y.chunk(passes)):  # the chunks' gradients add up to the batch's
        (loss_fn(model, xc, yc) / passes).backward()
    opt.step()


def assert_matches(comm, model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), \
            f"rank {comm.rank}, {what}: {name} differs from one process by {(p - q).abs().max().item():.3g}"
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for r, other in enumerate(comm.allgather(mine)):
        assert torch.equal(mine, other), f"{what}: rank {r}'s parameters differ from rank {comm.rank}'s"


def trained_and_compared(comm, kind, counts=None, variants=({},)):
    counts = counts or COUNTS[comm.size]
    for opt_name in OPTIMIZERS:
        ref = reference(counts, opt_name)
        for extra in variants:
            model, opt = train(comm, counts, opt_name, **KINDS[kind], **extra)
            assert_matches(comm, model, ref, f"{comm.name} {kind} {opt_name} {extra} counts {counts}")
            opt.remove_hooks()
            yield opt


def check_uneven_replicated(comm):
    """shard_state=False: the whole update on every rank; many small buckets, zero_fill=False,
    two backward passes per step and float16 wire compression alike."""
    variants = ({}, {"bucket_cap_mb": 0.0005}, {"zero_fill": False}, {"passes": 2})
    for opt in trained_and_compared(comm, "replicated", variants=variants):
        assert type(opt).__name__ == "MultiNodeOptimizer", type(opt)
    counts = COUNTS[comm.size]
    ref = reference(counts, "sgd")
    model, opt = train(comm, counts, "sgd", **KINDS["replicated"], compression="fp16")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-2, atol=1e-3), (p - q).abs().max()


def check_uneven_sharded(comm):
    """shard_state=True (ZeRO stage 1): each rank updates its shard, a joined rank's too."""
    for opt in trained_and_compared(comm, "sharded", variants=({}, {"bucket_cap_mb": 0.0005})):
        assert isinstance(opt, ShardedMultiNodeOptimizer), type(opt)


def check_uneven_default(comm):
    """The default: on one node the node-shared optimizer (every rank must take part in step())."""
    for opt in trained_and_compared(comm, "default"):
        if comm.name == "hierarchical" and comm.size > 1:
            assert isinstance(opt, NodeSharedOptimizer), type(opt)


def check_a_rank_without_data(comm):
    """A rank with no batch at all joins at once and still ends with the others' parameters."""
    for kind in KINDS:
        list(trained_and_compared(comm, kind, counts=WITH_AN_EMPTY_RANK[comm.size]))


def check_two_optimizers(comm):
    """Two models, each with its own optimizer, stepped in turn every iteration: a joined rank
    repeats both, in order."""
    counts = COUNTS[comm.size]
    longest = max(counts)

    def run(world):
        a, b = make_model(0), make_model(1)
        opts = [torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(b.parameters(), lr=0.01)]
        if world is None:
            for t in range(longest):
                ranks = [r for r, c in enumerate(counts) if c > t]
                for model, opt in zip((a, b), opts):
                    opt.zero_grad()
                    (sum(loss_fn(model, *batch(r, t)) for r in ranks) / len(ranks)).backward()
                    opt.step()
            return a, b
        opts = [torchmn.create_multi_node_optimizer(opts[0], world, shard_state=False),
                torchmn.create_multi_node_optimizer(opts[1], world)]
        with torchmn.join(world) as joined:
            for t in range(counts[world.rank]):
                for model, opt in zip((a, b), opts):
                    step(opt, model, *batch(world.rank, t))
        assert joined.steps_repeated == 2 * (longest - counts[world.rank]), joined.steps_repeated
        for opt in opts:
            opt.remove_hooks()
        return a, b

    for got, ref in zip(run(comm), run(None)):
        for p, q in zip(got.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-10, atol=1e-12), (p - q).abs().max()


def check_exchange_only_inside_join(comm):
    """The "who still has data" exchange happens inside torchmn.join only, once per step: a step
    outside it makes exactly the collectives it made before join existed."""
    exchanges = []
    gather = comm.allgather_obj

    def counting(obj):
        exchanges.append(obj)
        return gather(obj)
    for kind in KINDS:
        model = make_model()
        opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, **KINDS[kind])
        comm.allgather_obj = counting
        try:
            for _ in range(3):
                step(opt, model, *batch(comm.rank, 0))
            assert exchanges == [], f"{kind}: outside torchmn.join a step exchanged {exchanges}"
            with torchmn.join(comm):
                for _ in range(3):
                    step(opt, model, *batch(comm.rank, 0))
            expected = 3 + 1 if comm.size > 1 else 0  # one a step, and the last one saying all are done
            assert len(exchanges) == expected, f"{kind}: inside torchmn.join, {len(exchanges)} exchanges"
            exchanges.clear()
        finally:
            del comm.allgather_obj
        opt.remove_hooks()


def check_double_buffering_refused(comm):
    """double_buffering=True averages a step late: refused inside torchmn.join, on every rank,
    naming the fix."""
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, double_buffering=True)

    def loop():
        with torchmn.join(comm):
            step(opt, model, *batch(comm.rank, 0))
    e = expect(JoinError, loop)
    assert f"rank {comm.rank} on " in str(e) and "double_buffering=False" in str(e), e
    opt.remove_hooks()


def check_sharded_clip_refused(comm):
    """clip_grad_norm_ of a shard_state=True optimizer is a collective of its own: refused inside
    torchmn.join, naming the optimizers whose clipping needs none."""
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, shard_state=True)

    def loop():
        with torchmn.join(comm):
            opt.zero_grad()
            loss_fn(model, *batch(comm.rank, 0)).backward()
            opt.clip_grad_norm_(1.0)
    e = expect(JoinError, loop)
    assert "shard_state=False" in str(e) and f"rank {comm.rank} on " in str(e), e
    opt.step()  # outside the context, as before
    opt.remove_hooks()


def check_clipping_reaches_repeating_ranks(comm):
    """Rank 0 runs out of data while the others clip their averaged gradients (the optimizer's
    clip_grad_norm_ or torch's) before step(): the step rank 0 repeats is the clipped one too, so
    every rank's parameters stay equal and equal the clipped update (replicated and default)."""
    for shard_state in (False, None):
        for clip in ("optimizer", "torch"):
            w = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
            opt = torchmn.create_multi_node_optimizer(torch.optim.SGD([w], lr=1.0), comm, shard_state=shard_state)
            with torchmn.join(comm):
                for _ in range(1 if comm.rank == 0 else 2):
                    opt.zero_grad()
                    (w * 10.0).sum().backward()
                    opt.clip_grad_norm_(1.0) if clip == "optimizer" else torch.nn.utils.clip_grad_norm_([w], 1.0)
                    opt.step()
            # Step 1 on every rank: 1 - 0.5 (unit norm); step 2, from the ranks with data: minus 0.5 again.
            expected = torch.full((4,), 0.0 if comm.size > 1 else 0.5, dtype=torch.float64)
            assert torch.allclose(w.detach(), expected, atol=1e-6), (shard_state, clip, w.tolist())
            assert all(torch.equal(w.detach(), other) for other in comm.allgather_obj(w.detach())), (shard_state, clip)
            opt.remove_hooks()


def check_different_optimizers_named(comm):
    """Ranks with data stepping different optimizers at one step: every rank raises, naming them."""
    if comm.size == 1:
        return
    a, b = make_model(0), make_model(1)
    opts = [torchmn.create_multi_node_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), comm, shard_state=False)
            for m in (a, b)]
    mine = 0 if comm.rank == 0 else 1

    def loop():
        with torchmn.join(comm):
            step(opts[mine], (a, b)[mine], *batch(comm.rank, 0))
    e = expect(torchmn.CollectiveMismatchError, loop)
    assert "different optimizers" in str(e) and "rank 0: optimizer #" in str(e) and "rank 1: optimizer #" in str(e), e
    for opt in opts:
        opt.remove_hooks()


def check_skipped_step_inside_named(comm):
    """The ranks with data skip step() after a backward (a decision on the averaged gradients, alike)
    while a rank out of data repeats that averaging and its step(): every rank raises JoinError
    naming the ranks that skipped, instead of a TypeError from mismatched exchanges."""
    if comm.size == 1:
        return
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, shard_state=False)

    def loop():
        with torchmn.join(comm):
            for t in range(1 if comm.rank == 0 else 2):
                opt.zero_grad()
                loss_fn(model, *batch(comm.rank, t)).backward()
                if t == 0:
                    opt.step()
    e = expect(JoinError, loop)
    skippers = list(range(1, comm.size))
    assert f"rank(s) {skippers} with data did not call step()" in str(e), e
    opt.remove_hooks()


def check_nested_refused(comm):
    """One context per communicator: a second one inside is refused (before any collective)."""
    with torchmn.join(comm):
        e = expect(JoinError, lambda: torchmn.join(comm).__enter__())
    assert "already open" in str(e), e
    with torchmn.join(comm) as joined:  # the first one closed cleanly: a new one opens
        pass
    assert joined.steps_repeated == 0


def check_other_collective_inside_named(comm):
    """A metric's comm.allreduce inside the loop while a rank waits at the end of the context
    meets that rank's exchange: every rank raises CollectiveMismatchError instead of hanging."""
    if comm.size == 1:
        return
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)

    def loop():
        with torchmn.join(comm):
            for t in range(1 if comm.rank == 0 else 2):
                step(opt, model, *batch(comm.rank, t))
                comm.allreduce(torch.ones(1))  # the ranks with data meet the waiting one's exchange at t = 1
    e = expect(torchmn.CollectiveMismatchError, loop)
    assert "allgather_obj" in str(e) and "allreduce" in str(e), e
    if comm.rank == 0:  # the rank waiting in the context says what its call was
        assert "torchmn.join's exchange" in str(e) and "after it" in str(e), e
    opt.remove_hooks()


if __name__ == "__main__":
    run_checks(globals())
