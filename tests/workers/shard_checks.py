"""Sharded (ZeRO stage 1) optimizer checks, run on every rank of a real job (see tests/test_sharded.py).

Every rank computes the one-process reference on the whole batch itself and compares.
Usage: python shard_checks.py [--path CHECKPOINT] CHECK [CHECK ...]   ("all": every check but the checkpoint ones)
"""

import copy
import math
import os
import sys

import torch

import torchmn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import expect, run_checks  # noqa: E402
from optim_checks import assert_close, backward, data, local, loss_fn, make_model
from torchmn.optimizers.sharded import ShardedMultiNodeOptimizer


def _two_groups(model, cls, **kw):
    rest = [p for m in model[1:] for p in m.parameters()]
    return cls([{"params": model[0].parameters(), "lr": 0.03}, {"params": rest}], **kw)


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.01, amsgrad=True),
    "sgd_groups": lambda m: _two_groups(m, torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
    "adam_groups": lambda m: _two_groups(m, torch.optim.Adam, lr=0.01),
}
# With two groups, a StepLR halves both learning rates every two steps.
SCHEDULED = {"sgd_groups", "adam_groups"}


def train(opt_name, comm=None, steps=range(5), passes=1, no_sync=False, resume=None, clip=None, skip=(),
          **kwargs):
    """Train ``steps`` on the fixed data: one process on the whole batch if ``comm`` is None,
    else sharded over ``comm`` on each rank's part. ``resume``: a checkpoint dict to start from.
    ``clip``: (max_norm, norm_type) to clip by before each step; the norms land in ``opt.norms``.
    ``skip``: steps whose update is skipped after backward (and clipping), as on a non-finite loss."""
    model = make_model()
    if comm is not None and comm.rank != 0:  # on purpose: the wrapper must broadcast rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = OPTIMIZERS[opt_name](model)
    if comm is not None:
        opt = torchmn.create_multi_node_optimizer(opt, comm, shard_state=True,
                                                  backward_passes_per_step=passes, **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if opt_name in SCHEDULED else None
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        if sched is not None:
            sched.load_state_dict(resume["sched"])
    norms = []
    for step in steps:
        x, y = data(step)
        if comm is not None:
            x, y = local(x, comm), local(y, comm)
        opt.zero_grad()
        backward(opt, model, x, y, passes, no_sync)
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(*clip) if comm is not None
                               else torch.nn.utils.clip_grad_norm_(model.parameters(), *clip)))
        if step in skip:
            continue
        opt.step()
        if sched is not None:
            sched.step()
    opt.norms = norms
    return model, opt, sched


def check_equivalence(comm):
    for opt_name in OPTIMIZERS:
        ref, ref_opt, _ = train(opt_name)
        for kwargs in ({}, {"bucket_cap_mb": 0.0005}, {"bucket_cap_mb": 0}):
            model, opt, _ = train(opt_name, comm, **kwargs)
            assert_close(model, ref, 1e-5, f"sharded {opt_name} {kwargs}")
            if opt_name in SCHEDULED:
                assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups], \
                    "the scheduler's learning rates did not reach the wrapper's groups"


def check_accumulation(comm):
    for opt_name in ("sgd", "adam"):
        ref, _, _ = train(opt_name)
        assert_close(train(opt_name, comm, passes=2)[0], ref, 1e-5, f"{opt_name} backward_passes_per_step=2")
        assert_close(train(opt_name, comm, no_sync=True)[0], ref, 1e-5, f"{opt_name} no_sync")


def check_overlap(comm):
    """Buckets go out inside backward (hooks), not in step(); none under no_sync. Through shared
    memory "going out" is the copy into this rank's shared buffer; otherwise a reduce-scatter."""
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm, shard_state=True,
                                              bucket_cap_mb=0.0005)
    x, y = data(0)
    x, y = local(x, comm), local(y, comm)
    with opt.no_sync():
        loss_fn(model, x, y).backward()
    assert not any(b.sent for b in opt.buckets), "no_sync backward communicated"
    loss_fn(model, x, y).backward()
    assert len(opt.buckets) > 1 and all(b.sent for b in opt.buckets), \
        "backward returned without sending every bucket"
    if opt.arena is None and comm.size > 1:
        assert all(b.reduce_work is not None for b in opt.buckets), "a bucket's reduce-scatter was not launched"
    opt.step()
    assert not any(b.sent or b.reduce_work or b.gather_work for b in opt.buckets)


def check_shared_memory_where_possible(comm):
    """On one node the hierarchical communicator puts the parameters in memory the ranks share
    (one copy per node): a write on rank 0 is seen by the others; elsewhere each rank has its own."""
    expected = comm.name == "hierarchical" and comm.inter_size == 1 and comm.size > 1
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, shard_state=True)
    assert (opt.arena is not None) == expected, (comm.name, comm.inter_size, opt.arena)
    if comm.name == "hierarchical" and comm.inter_size > 1 and len(set(map(len, comm.node_ranks))) == 1:
        assert comm.rail_group is not None, "several equal nodes: reduce-scatter should go over rails"
    comm.barrier()
    if comm.rank == 0:
        with torch.no_grad():
            model[0].weight[0, 0] = 123.0
    comm.barrier()
    seen = float(model[0].weight[0, 0])
    assert (seen == 123.0) == (expected or comm.rank == 0), (comm.rank, seen)
    comm.barrier()  # nobody may still be reading when rank 0's optimizer goes away


def check_kernel_choice(comm):
    """Shards take torch's fused kernel where the user left the choice to torch, keep the user's
    explicit choice otherwise, and keep it through load_state_dict."""
    def inner_flags(**kw):
        model = make_model()
        opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), **kw), comm, shard_state=True)
        loss_fn(model, *data(0)).backward()
        opt.step()
        opt.load_state_dict(opt.state_dict())
        opt.step()
        groups = [b.optimizer.param_groups[0] for b in opt.buckets]
        assert all(g["fused"] == kw.get("fused") for g in opt.param_groups)  # the user's groups are left alone
        return {(g["fused"], g["foreach"]) for g in groups}
    assert inner_flags() == {(True, None)}
    assert inner_flags(foreach=True) == {(None, True)}
    assert inner_flags(fused=False) == {(False, None)}
    # Not SGD's: its fused kernel cannot mix parameters with and without momentum buffers.
    sgd = torchmn.create_multi_node_optimizer(torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9),
                                              comm, shard_state=True)
    assert {b.optimizer.param_groups[0]["fused"] for b in sgd.buckets} == {None}
    sgd.remove_hooks()
    # On one node the fused kernel's shards are summed and updated piece by piece.
    for cls, kw, piecewise in ((torch.optim.AdamW, {}, True), (torch.optim.Adam, {"foreach": True}, False),
                               (torch.optim.SGD, {"lr": 0.1}, False)):
        opt = torchmn.create_multi_node_optimizer(cls(make_model().parameters(), **kw), comm, shard_state=True)
        assert bool(opt.fused_sum_and_step) == (piecewise and opt.arena is not None), (cls, kw, opt.fused_sum_and_step)
        opt.remove_hooks()


def check_piecewise_update_is_exact(comm):
    """On one node, fused Adam/AdamW shards are summed and updated piece by piece: bit for bit what
    summing every shard first and updating them in one kernel call gives (sizes that leave some
    ranks padding, a shard longer than a piece, float32 and float64)."""
    def run(piecewise, cls, dtype, **kw):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*shape, dtype=dtype)) for shape in ((31,), (5, 7), (300_001,))]
        opt = torchmn.create_multi_node_optimizer(cls(params, lr=0.01, **kw), comm, shard_state=True)
        used = bool(opt.fused_sum_and_step)
        if not piecewise:
            opt.fused_sum_and_step.clear()
        for step in range(4):
            opt.zero_grad()
            g = torch.Generator().manual_seed(100 * step + comm.rank)
            sum((p * torch.randn(p.shape, generator=g, dtype=dtype)).sum() ** 2 for p in params).backward()
            opt.step()
        out = [p.detach().clone() for p in params], opt.state_dict()
        opt.remove_hooks()
        return out, used
    for cls, dtype, kw in ((torch.optim.Adam, torch.float32, {"amsgrad": True, "weight_decay": 0.1}),
                           (torch.optim.AdamW, torch.float32, {"weight_decay": 0.1}),
                           (torch.optim.Adam, torch.float64, {"maximize": True})):
        (pieces, state), used = run(True, cls, dtype, **kw)
        (whole, whole_state), _ = run(False, cls, dtype, **kw)
        assert used == (comm.name == "hierarchical" and comm.inter_size == 1 and comm.size > 1), used
        for a, b in zip(pieces, whole):
            assert torch.equal(a, b), (cls.__name__, dtype, (a - b).abs().max())
        for i, entry in whole_state["state"].items():
            for key, value in entry.items():
                assert torch.equal(state["state"][i][key], value), (cls.__name__, dtype, i, key)


def check_state_replaced_mid_run(comm):
    """load_state_dict after some steps replaces the shards' state tensors: the next steps update
    the loaded ones (and continue as one process from that checkpoint), not the ones they replaced."""
    ref_model, ref_opt, _ = train("adam_amsgrad", steps=range(2))
    ckpt = {k: v.clone() for k, v in ref_model.state_dict().items()}, ref_opt.state_dict()
    model, opt, _ = train("adam_amsgrad", comm, steps=range(3))  # past the checkpoint, on purpose
    model.load_state_dict(ckpt[0])
    opt.load_state_dict(ckpt[1])
    for step in range(2, 5):
        x, y = data(step)
        opt.zero_grad()
        backward(opt, model, local(x, comm), local(y, comm))
        opt.step()
    ref, ref_opt, _ = train("adam_amsgrad")
    assert_close(model, ref, 1e-5, "continued after load_state_dict mid-run")
    _compare_state(opt.state_dict(), ref_opt.state_dict(), "continued after load_state_dict mid-run")
    opt.remove_hooks()


def check_compression(comm):
    ref, _, _ = train("adam")
    for c, rtol in (("fp16", 1e-2), ("bf16", 5e-2)):
        assert_close(train("adam", comm, compression=c)[0], ref, rtol, f"sharded adam {c}")


def _elements(states):
    """Elements of per-element state tensors (0-dim step counters excluded)."""
    return sum(v.numel() for s in states for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def check_state_is_sharded(comm):
    _, ref_opt, _ = train("adam", steps=range(2))
    whole = _elements(ref_opt.state.values())
    n_params = sum(p.numel() for p in make_model().parameters())
    assert whole == 2 * n_params
    n_tensors = len(list(make_model().parameters()))
    for kwargs in ({}, {"bucket_cap_mb": 0}):
        _, opt, _ = train("adam", comm, steps=range(2), **kwargs)
        mine = _elements(opt.state.values())
        # Each parameter is padded to a multiple of size: at most size - 1 extra elements per state
        # tensor (none of these parameters is empty).
        assert mine <= -(-whole // comm.size) + 2 * n_tensors, (mine, whole, comm.size)
        assert whole <= comm.allreduce_obj(mine) <= whole + 2 * n_tensors * (comm.size - 1), (mine, whole)
        assert opt.state_bytes() >= mine * 8


def check_refusals(comm):
    model = make_model()
    for inner, kind, word in ((torch.optim.LBFGS(model.parameters()), TypeError, "LBFGS"),
                              (torch.optim.Adafactor(model.parameters()), TypeError, "Adafactor")):
        try:
            torchmn.create_multi_node_optimizer(inner, comm, shard_state=True)
        except kind as e:
            assert word in str(e), e
        else:
            raise AssertionError(f"shard_state=True accepted {word}")
    for option, word in (({"double_buffering": True}, "double_buffering"), ({"zero_fill": False}, "zero_fill=True")):
        try:
            ShardedMultiNodeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, **option)
        except ValueError as e:
            assert word in str(e), e
        else:
            raise AssertionError(f"shard_state with {option} was accepted")
    # Step hooks would see shard optimizers, not the model: refused, with what to do instead.
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, shard_state=True)
    try:
        opt.register_step_pre_hook(lambda *a: None)
    except NotImplementedError as e:
        assert "around optimizer.step()" in str(e), e
    else:
        raise AssertionError("a step hook was accepted under shard_state=True")
    opt.remove_hooks()


def check_state_per_parameter(comm):
    """Parameters of one bucket keep their own state and step counts, as in one process: a plain
    Adam checkpoint in which one parameter has no state and another fewer steps loads, gathers
    back unchanged, and continues as plain Adam does, also through a step in which a parameter
    has no gradient on any rank (left alone, its step count too)."""
    model = make_model()
    plain = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    for step, unused in enumerate((model[-1].bias, model[0].weight)):
        for p in model.parameters():
            missing = p is unused or (step == 1 and p is model[-1].bias)
            p.grad = None if missing else torch.full_like(p, 0.1 * step + 0.1)
        plain.step()
    assert model[-1].bias not in plain.state and int(plain.state[model[0].weight]["step"]) == 1
    saved = {k: v.clone() for k, v in model.state_dict().items()}, plain.state_dict()
    sharded_model = make_model()
    sharded_model.load_state_dict(saved[0])
    opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(sharded_model.parameters(), lr=0.01, weight_decay=0.1),
                                              comm, shard_state=True, bucket_cap_mb=100)
    assert len(opt.buckets) == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(saved[1])
    _compare_state(opt.state_dict(), saved[1], "loaded and gathered back")
    for step in range(3):  # the last layer's bias takes no part in step 1
        x, y = data(step)
        for m, o, xs, ys in ((model, plain, x, y), (sharded_model, opt, local(x, comm), local(y, comm))):
            o.zero_grad()
            m[-1].bias.requires_grad_(step != 1)
            loss_fn(m, xs, ys).backward()
            m[-1].bias.requires_grad_(True)
            o.step()
        if step == 1:
            assert torch.equal(sharded_model[-1].bias, model[-1].bias), "a parameter without gradients moved"
    assert_close(sharded_model, model, 1e-5, "continued from a plain checkpoint with uneven state")
    _compare_state(opt.state_dict(), plain.state_dict(), "after continuing")
    opt.remove_hooks()


def check_unused_parameter(comm):
    """A parameter with a gradient on rank 0 only: no hang, and the others count as zeros."""
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 4).double()
    params = list(trunk.parameters()) + list(branch.parameters())
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(params, lr=1.0), comm, shard_state=True,
                                              bucket_cap_mb=0)
    before = branch.bias.detach().clone()
    opt.zero_grad()
    out = trunk(torch.ones(1, 4, dtype=torch.float64))
    if comm.rank == 0:
        out = branch(out)
    out.sum().backward()
    opt.step()
    assert torch.allclose(branch.bias, before - 1.0 / comm.size), (branch.bias, before)
    # A step where one rank has no gradient at all still completes, and the ranks stay equal.
    opt.zero_grad()
    if comm.rank != 0:
        trunk(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    for other in comm.allgather_obj(mine):
        assert torch.equal(other, mine), "ranks disagree after a step with a missing gradient"


def check_odd_sizes(comm):
    """Parameters smaller than the rank count, of sizes no rank count divides, and an empty one (so
    some ranks' slices are all padding), with SGD-momentum and Adam, against one process; one
    step's update is skipped on every rank after its backward."""
    def run(c, make_opt):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64))
                  for shape in ((1,), (2,), (0,), (5, 6), (7,))]
        a, b, empty, w, v = params
        opt = make_opt(params)
        if c is not None:
            opt = torchmn.create_multi_node_optimizer(opt, c, shard_state=True)
        for step in range(4):
            x, _ = data(step)
            x = x if c is None else local(x, c)
            opt.zero_grad()
            out = torch.tanh(x @ w.T) @ v[:5] * a + b.sum() + empty.sum()
            out.pow(2).mean().backward()
            if step != 2:
                opt.step()
        return torch.cat([p.detach().reshape(-1) for p in params])
    for name, make_opt in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                           ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1))):
        ref, got = run(None, make_opt), run(comm, make_opt)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-9), (name, (got - ref).abs().max())


def check_clip_grad_norm(comm):
    """optimizer.clip_grad_norm_ on the sharded averaged gradients: one process's clipping."""
    for opt_name, clip in (("sgd", (0.05, 2.0)), ("adam", (0.05, 2.0)), ("sgd_groups", (0.02, float("inf")))):
        ref, ref_opt, _ = train(opt_name, clip=clip)
        # A skipped step (clipped, then no update, as on a non-finite norm) leaves nothing stale.
        for kwargs in ({}, {"bucket_cap_mb": 0}, {"skip": (1,)}):
            if "skip" in kwargs:
                ref, ref_opt, _ = train(opt_name, clip=clip, skip=kwargs["skip"])
            model, opt, _ = train(opt_name, comm, clip=clip, **kwargs)
            assert_close(model, ref, 1e-5, f"clipped {opt_name} {clip} {kwargs}")
            for got, want in zip(opt.norms, ref_opt.norms):
                assert abs(got - want) <= 1e-6 * want, (opt_name, clip, kwargs, opt.norms, ref_opt.norms)
        assert max(ref_opt.norms) > clip[0], "the test must clip"


def check_clip_after_non_finite_step(comm):
    """A bad batch (non-finite loss) whose update is skipped after clipping leaves nothing behind:
    the next norms and updates are one process's. A parameter of 7 elements has padding in its
    shards on 2, 3 and 4 ranks, which a non-finite clipping factor must not reach."""
    def run(c):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
        opt = torch.optim.Adam([p], lr=0.01)
        if c is not None:
            opt = torchmn.create_multi_node_optimizer(opt, c, shard_state=True)
        norms = []
        for step in range(4):
            x, _ = data(step)
            x = x[:, :1].repeat(1, 7) if c is None else local(x[:, :1].repeat(1, 7), c)
            opt.zero_grad()
            loss = (x @ p).tanh().mean() + (p * p).sum()
            (loss * float("nan") if step == 1 else loss).backward()
            norm = opt.clip_grad_norm_(1.0) if c is not None else torch.nn.utils.clip_grad_norm_([p], 1.0)
            norms.append(float(norm))
            if math.isfinite(norms[-1]):
                opt.step()
        return p.detach().clone(), norms
    (ref, ref_norms), (got, norms) = run(None), run(comm)
    assert math.isnan(norms[1]) and all(math.isfinite(n) for n in norms[2:]), norms
    assert all(abs(a - b) <= 1e-6 * a for a, b in zip(norms[2:], ref_norms[2:])), (norms, ref_norms)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-9), (got - ref).abs().max()
    # The infinity norm with a NaN in one rank's shard only: NaN on every rank (gloo's max passes a
    # NaN over or not by the ranks' order), so error_if_nonfinite raises everywhere, as torch does.
    w = torch.nn.Parameter(torch.ones(4 * comm.size, dtype=torch.float64))
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD([w], lr=0.1), comm, shard_state=True)
    scale = torch.arange(1.0, 4 * comm.size + 1, dtype=torch.float64)
    scale[-1] = float("nan")
    (w * scale).sum().backward()
    e = expect(RuntimeError, lambda: opt.clip_grad_norm_(1.0, norm_type=float("inf"), error_if_nonfinite=True))
    assert "not finite" in str(e), e
    opt.zero_grad()
    opt.remove_hooks()


def check_half_precision_sums(comm):
    """float16 gradients are divided before they are summed: a mean of 36864 from every rank does
    not overflow float16 (65504) on the way (36864 / 2, / 3 and / 4 are exact in float16)."""
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD([p], lr=1.0), comm, shard_state=True)
    (p * 36864).sum().backward()
    opt.step()
    assert torch.equal(p.detach(), torch.full((6,), -36864.0, dtype=torch.float16)), p
    opt.remove_hooks()


def check_late_parameter(comm):
    """A parameter whose first gradient comes after the others already have state (a head unused
    in step 0), with SGD-momentum and Adam, against one process; and a plain torch SGD checkpoint
    in which only some parameters have a momentum buffer, loaded and continued."""
    def run(c, make_opt, steps=range(3), resume=None):
        torch.manual_seed(0)
        a, b = (torch.nn.Parameter(torch.randn(5, dtype=torch.float64)) for _ in range(2))
        opt = make_opt([a, b])
        if c is not None:
            opt = torchmn.create_multi_node_optimizer(opt, c, shard_state=True)
        if resume is not None:
            with torch.no_grad():
                a.copy_(resume[0])
                b.copy_(resume[1])
            opt.load_state_dict(copy.deepcopy(resume[2]))  # torch's SGD would step the buffers in place
        for step in steps:
            x, _ = data(step)
            x = x[:, :5] if c is None else local(x[:, :5], c)
            opt.zero_grad()
            loss = (x @ a).pow(2).mean() + ((x @ b).pow(2).mean() if step > 0 else 0)
            loss.backward()
            opt.step()
        return a, b, opt
    for name, make_opt in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                           ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01))):
        ref, got = run(None, make_opt)[:2], run(comm, make_opt)[:2]
        assert all(torch.allclose(g, r, rtol=1e-5) for g, r in zip(got, ref)), name
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    a, b, opt = run(None, sgd, steps=range(1))
    assert len(opt.state_dict()["state"]) == 1, "the checkpoint must hold one momentum buffer of two"
    checkpoint = (a.detach().clone(), b.detach().clone(), opt.state_dict())
    ref, got = run(None, sgd, range(1, 3), checkpoint)[:2], run(comm, sgd, range(1, 3), checkpoint)[:2]
    assert all(torch.allclose(g, r, rtol=1e-5) for g, r in zip(got, ref)), "resumed SGD checkpoint"


def check_parameters_used_through_cat(comm):
    """Two parameters used through torch.cat get their gradients as views of one tensor, which share
    a version counter: accumulating into one must not look like an edit of the other."""
    def run(c):
        torch.manual_seed(0)
        q, k = torch.nn.Parameter(torch.randn(4, 8, dtype=torch.float64)), \
            torch.nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
        opt = torch.optim.SGD([q, k], lr=0.1, momentum=0.9)
        if c is not None:
            opt = torchmn.create_multi_node_optimizer(opt, c, shard_state=True, bucket_cap_mb=0,
                                                      backward_passes_per_step=2)
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            for half in range(2):
                x, _ = data(10 * step + half)
                x = x[:, :2].repeat(1, 4) if c is None else local(x, c)[:, :2].repeat(1, 4)
                (torch.cat([k, q]) @ x.T).pow(2).mean().div(2).backward()
            opt.step()
        return torch.cat([q.detach().reshape(-1), k.detach().reshape(-1)])
    ref, got = run(None), run(comm)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-7), (got - ref).abs().max()


def check_edited_gradients_refused(comm):
    """Clipping .grad between backward and step() would reach only part of the model: refused."""
    for edit in ("clip", "replace", "after clip_grad_norm_"):
        model = make_model()
        opt = torchmn.create_multi_node_optimizer(OPTIMIZERS["sgd"](model), comm, shard_state=True)
        x, y = data(0)
        opt.zero_grad()
        backward(opt, model, local(x, comm), local(y, comm))
        if edit == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        elif edit == "replace":
            model[0].weight.grad = model[0].weight.grad * 2
        else:
            opt.clip_grad_norm_(1.0)
            model[0].weight.grad.mul_(2)
        try:
            opt.step()
        except RuntimeError as e:
            assert f"rank {comm.rank} on " in str(e) and "changed between backward and step()" in str(e), e
        else:
            raise AssertionError(f"{edit}: a step after editing .grad was accepted")
    # Untouched gradients (and a model whose .grad nobody reads) still step.
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(OPTIMIZERS["sgd"](model), comm, shard_state=True)
    x, y = data(0)
    backward(opt, model, local(x, comm), local(y, comm))
    opt.step()


def check_skipped_step_is_named(comm):
    """On one node, a rank that skips a step() (a decision on its own loss) meets the others' next
    step: every rank raises, naming the difference, instead of mixing steps' gradients."""
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, shard_state=True)
    if opt.arena is None:  # elsewhere the collectives' own checks name it (reduce-scatter vs all-gather)
        return
    errors = []
    for step in range(3):
        x, y = data(step)
        opt.zero_grad()
        loss_fn(model, local(x, comm), local(y, comm)).backward()
        if comm.rank == comm.size - 1 and step == 1:
            continue
        try:
            opt.step()
        except torchmn.CollectiveMismatchError as e:
            errors.append(str(e))
            break
    assert len(errors) == 1 and "after 2 backward passes" in errors[0] and "after 1 backward pass " in errors[0], errors
    opt.remove_hooks()


def check_state_dict_format(comm):
    """The gathered state equals the one-process optimizer's state_dict after the same steps."""
    for opt_name in ("adam_groups", "sgd"):
        _, ref_opt, _ = train(opt_name, steps=range(3))
        _, opt, _ = train(opt_name, comm, steps=range(3), bucket_cap_mb=0.0005)
        _compare_state(opt.state_dict(), ref_opt.state_dict(), opt_name)


def _compare_state(sd, ref, what):
    assert sd["param_groups"] == ref["param_groups"], (sd["param_groups"], ref["param_groups"])
    assert sd["state"].keys() == ref["state"].keys(), (sd["state"].keys(), ref["state"].keys())
    for i, ref_state in ref["state"].items():
        assert list(sd["state"][i]) == list(ref_state), (what, i, list(sd["state"][i]), list(ref_state))
        for key, value in ref_state.items():
            got = sd["state"][i][key]
            assert got.shape == value.shape and torch.allclose(got, value, rtol=1e-5, atol=1e-9), \
                f"{what}: state {i} {key} differs"


def _checkpoint(model, opt, sched):
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def check_save(comm, path):
    """Train 3 steps sharded and write a checkpoint (state_dict is called on every rank)."""
    model, opt, sched = train("adam_groups", comm, steps=range(3))
    ckpt = _checkpoint(model, opt, sched)
    _, ref_opt, _ = train("adam_groups", steps=range(3))
    _compare_state(ckpt["opt"], ref_opt.state_dict(), "checkpoint")
    if comm.rank == 0:
        torch.save(ckpt, path)
    comm.barrier()


def check_resume(comm, path):
    """Resume the checkpoint for steps 3 and 4: same as an uninterrupted run on this rank count."""
    ckpt = torch.load(path, weights_only=False)
    resumed, _, _ = train("adam_groups", comm, steps=range(3, 5), resume=ckpt)
    straight, _, _ = train("adam_groups", comm, steps=range(5))
    assert_close(resumed, straight, 1e-5, f"resumed on {comm.size} ranks vs uninterrupted")
    assert_close(resumed, train("adam_groups")[0], 1e-5, f"resumed on {comm.size} ranks vs one process")


def check_plain_resume(comm, path):
    """The checkpoint loads into the plain torch optimizer, which continues to the same result."""
    ckpt = torch.load(path, weights_only=False)
    resumed, _, _ = train("adam_groups", steps=range(3, 5), resume=ckpt)
    assert_close(resumed, train("adam_groups")[0], 1e-5, "sharded checkpoint resumed by plain torch Adam")


if __name__ == "__main__":
    run_checks(globals(), not_in_all=("save", "resume", "plain_resume"), with_path=True)
