"""Multi-node optimizer checks, run on every rank of a real job (see tests/test_optimizer.py).

Every rank also computes the one-process reference on the whole batch itself, so each check
compares the N-rank result with one process, on every rank.
Usage: python optim_checks.py [--name flat] CHECK [CHECK ...]   (or "all")
"""

import contextlib
import copy
import gc
import os
import sys
import weakref

import torch

import torchmn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import expect, run_checks  # noqa: E402

BATCH = 24  # divisible by 1, 2, 3 and 4 ranks


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)


def local(x, comm):
    n = x.shape[0] // comm.size
    return x[comm.rank * n:(comm.rank + 1) * n]


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def reference(opt_name, steps=5, passes=1, clip=None, delayed=False):
    model = make_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    previous = None
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if delayed:  # double buffering: each update uses the previous step's gradients
            current = [p.grad.clone() for p in model.parameters()]
            if previous is not None:
                for p, g in zip(model.parameters(), previous):
                    p.grad = g
                opt.step()
            previous = current
        else:
            opt.step()
    return model


def wrapped_model(comm, opt_name, passes=1, **kwargs):
    """The model, with other starting weights off rank 0, and its multi-node optimizer."""
    model = make_model()
    if comm.rank != 0:  # different starting weights on purpose: the wrapper must broadcast them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = torchmn.create_multi_node_optimizer(OPTIMIZERS[opt_name](model.parameters()), comm,
                                              backward_passes_per_step=passes, **kwargs)
    return model, opt


def distributed(comm, opt_name, steps=5, passes=1, clip=None, no_sync=False, set_to_none=True,
                clip_with_optimizer=False, **kwargs):
    model, opt = wrapped_model(comm, opt_name, passes, **kwargs)
    for step in range(steps):
        x, y = data(step)
        x, y = local(x, comm), local(y, comm)
        opt.zero_grad(set_to_none=set_to_none)
        backward(opt, model, x, y, passes, no_sync)
        if clip and clip_with_optimizer:
            opt.clip_grad_norm_(clip)
        elif clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def backward(opt, model, x, y, passes=1, no_sync=False):
    """One step's backward: whole batch, or ``passes`` chunks (2 with ``no_sync``, all but the last
    inside ``opt.no_sync()``), each chunk's loss scaled so the gradients equal the whole batch's."""
    if passes == 1 and not no_sync:
        loss_fn(model, x, y).backward()
        return
    k = passes if passes > 1 else 2
    for i, (xc, yc) in enumerate(zip(x.chunk(k), y.chunk(k))):
        ctx = opt.no_sync() if no_sync and i < k - 1 else contextlib.nullcontext()
        with ctx:
            (loss_fn(model, xc, yc) / k).backward()


def assert_close(model, ref, rtol, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=rtol, atol=rtol * 1e-2), \
            f"{what}: {name} differs by {(p - q).abs().max().item():.3g}"


def check_equivalence(comm):
    for opt_name in OPTIMIZERS:
        ref = reference(opt_name)
        for kwargs in ({}, {"bucket_cap_mb": 0.0005}, {"bucket_cap_mb": 0}):
            assert_close(distributed(comm, opt_name, **kwargs), ref, 1e-5, f"{comm.name} {opt_name} {kwargs}")
        assert_close(distributed(comm, opt_name, passes=2), ref, 1e-5, f"{opt_name} backward_passes_per_step=2")
        assert_close(distributed(comm, opt_name, no_sync=True), ref, 1e-5, f"{opt_name} no_sync")


def check_compression(comm):
    for opt_name in OPTIMIZERS:
        ref = reference(opt_name)
        for c in ("fp16", "bf16"):
            assert_close(distributed(comm, opt_name, compression=c), ref, 1e-2 if c == "fp16" else 5e-2,
                         f"{opt_name} {c}")


def check_double_buffering(comm):
    for opt_name in OPTIMIZERS:
        ref = reference(opt_name, delayed=True)
        assert_close(distributed(comm, opt_name, double_buffering=True), ref, 1e-5, f"{opt_name} double buffering")


def check_clipping(comm):
    ref = reference("sgd", clip=0.05)
    assert_close(distributed(comm, "sgd", clip=0.05), ref, 1e-5, "clip_grad_norm_ between backward and step")
    assert_close(distributed(comm, "sgd", clip=0.05, clip_with_optimizer=True), ref, 1e-5,
                 "optimizer.clip_grad_norm_ between backward and step")


def check_unused_parameter(comm):
    """A parameter that gets a gradient on rank 0 only: no hang, and its mean counts others as zero."""
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    params = list(trunk.parameters()) + list(branch.parameters())
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(params, lr=0.0), comm)
    for _ in range(2):
        opt.zero_grad()
        out = trunk(torch.ones(1, 4))
        if comm.rank == 0:
            out = branch(out)
        out.sum().backward()
        opt.step()
    expect = torch.ones(4) / comm.size  # rank 0's bias gradient of ones, zeros elsewhere
    assert torch.allclose(branch.bias.grad, expect), branch.bias.grad
    # A step where no parameter gets any gradient on one rank still completes.
    opt.zero_grad()
    if comm.rank != 0:
        trunk(torch.ones(1, 4)).sum().backward()
    opt.step()


def check_unused_everywhere(comm):
    """A head no rank uses for two steps is left alone as in one process (AdamW would otherwise
    decay it and move it by its momentum), then trained like the rest once used."""
    def run(world):
        torch.manual_seed(0)
        trunk, head, spare = torch.nn.Linear(6, 4).double(), torch.nn.Linear(4, 3).double(), torch.nn.Linear(4, 3).double()
        params = list(trunk.parameters()) + list(spare.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
        if world is not None:
            opt = torchmn.create_multi_node_optimizer(opt, world)
        for step in range(4):
            x, y = data(step)
            x, y = (local(x, world), local(y, world)) if world is not None else (x, y)
            opt.zero_grad()
            out = head(torch.tanh(trunk(x))) if step != 1 else spare(torch.tanh(trunk(x)))
            torch.nn.functional.cross_entropy(out, y).backward()
            opt.step()
        return trunk, head, spare

    for got, ref in zip(run(comm), run(None)):
        for p, q in zip(got.parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-9, atol=1e-12), (p - q).abs().max()
    # a step with no backward at all changes nothing, as in one process
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1), comm)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    opt.remove_hooks()


def check_zero_fill_false(comm):
    """zero_fill=False with a gradient on some ranks only: every rank raises (updating on some ranks
    only would make the models differ); the same pattern everywhere trains as usual."""
    from torchmn.communicators.errors import CollectiveMismatchError
    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = torchmn.create_multi_node_optimizer(
        torch.optim.SGD(list(trunk.parameters()) + list(branch.parameters()), lr=0.1), comm, zero_fill=False)
    opt.zero_grad()
    trunk(torch.ones(1, 4)).sum().backward()  # branch unused everywhere: fine
    opt.step()
    assert branch.bias.grad is None
    if comm.size == 1:
        return
    opt.zero_grad()

    def uneven():
        out = trunk(torch.ones(1, 4))
        (branch(out) if comm.rank == 0 else out).sum().backward()
        opt.step()
    e = expect(CollectiveMismatchError, uneven)
    assert "a gradient on rank(s) [0] only" in str(e) and "zero_fill=True" in str(e), e


def check_zero_fill_false_goes_on_after_the_refused_step(comm):
    """A script that catches the refusal (every rank raises alike) and goes on with the next batch:
    the next steps average as usual, with every optimizer kind, and the ranks' models stay equal
    (the refused step left buckets marked ready, which the next backward sent before its gradients)."""
    from torchmn.communicators.errors import CollectiveMismatchError
    for shard_state in (None, False):
        torch.manual_seed(0)
        trunk, branch = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        opt = torchmn.create_multi_node_optimizer(
            torch.optim.SGD(list(trunk.parameters()) + list(branch.parameters()), lr=0.1), comm, zero_fill=False,
            shard_state=shard_state)
        for step in range(4):
            opt.zero_grad()
            out = trunk(torch.ones(1, 4) * (comm.rank + step))
            try:
                (out if step == 1 and comm.rank == 1 else branch(out)).sum().backward()
                opt.step()
            except CollectiveMismatchError:
                assert step == 1 and comm.size > 1, (shard_state, step)
        flat = torch.cat([p.detach().reshape(-1) for p in list(trunk.parameters()) + list(branch.parameters())])
        everyone = comm.allgather_obj(flat)
        assert all(torch.equal(everyone[0], f) for f in everyone), shard_state


def check_double_buffering_edge_cases(comm):
    """double_buffering=True: a parameter with no gradient in the step whose averages an update
    uses is left alone (not updated with this step's own gradient), and a second backward() before
    step() is refused instead of overwriting gradients in flight."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    opt = torchmn.create_multi_node_optimizer(
        torch.optim.SGD(list(trunk.parameters()) + list(head.parameters()), lr=0.1), comm, double_buffering=True)
    x = torch.full((1, 4), float(comm.rank + 1))  # a different batch on every rank
    before = head.weight.detach().clone()
    for step in range(2):
        opt.zero_grad()
        out = trunk(x)
        (head(out) if step == 1 else out).sum().backward()
        opt.step()
    # Step 1 updated with step 0's averages, where the head had none.
    assert torch.equal(head.weight, before), (head.weight - before).abs().max()
    weights = comm.allgather(trunk.weight.detach().clone())
    assert all(torch.equal(weights[0], w) for w in weights), "ranks differ"
    opt.zero_grad()
    trunk(x).sum().backward()
    e = expect(RuntimeError, lambda: trunk(x).sum().backward())
    assert "second backward() before step()" in str(e) and "no_sync" in str(e), e
    # Loading a state drops the averages in flight: the first step after it only sends, as the very
    # first step does (SGD, lr 1, gradient s at step s; the load before step 3).
    w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD([w], lr=1.0), comm, double_buffering=True)
    seen = []
    for s in range(1, 5):
        if s == 3:
            opt.load_state_dict(opt.state_dict())
        opt.zero_grad()
        (w * s).sum().backward()
        opt.step()
        seen.append(w.item())
    assert seen == [0.0, -1.0, -1.0, -4.0], seen


def check_half_precision_sums(comm):
    """float16 gradients are divided before they are summed: a mean of 36864 from every rank does
    not overflow float16 (65504) on the way, in the optimizer and in multi_node_mean_grad (36864 / 2,
    / 3 and / 4 are exact in float16)."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD([p], lr=1e-4), comm)
    (p * 36864).sum().backward()
    opt.step()
    assert torch.equal(p.grad, torch.full((4,), 36864.0, dtype=torch.float16)), p.grad
    opt.remove_hooks()
    model = torch.nn.Linear(2, 2).half()
    for q in model.parameters():
        q.grad = torch.full_like(q, 36864)
    comm.multi_node_mean_grad(model)
    assert all(torch.equal(q.grad, torch.full_like(q, 36864)) for q in model.parameters())


def check_refusals(comm):
    """Changes the gradient buckets cannot follow are refused with a message, never run wrongly."""
    # A parameter unfrozen after wrapping.
    model = make_model()
    model[0].weight.requires_grad_(False)
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    model[0].weight.requires_grad_(True)
    x, y = data(0)
    loss_fn(model, local(x, comm), local(y, comm)).backward()
    e = expect(RuntimeError, opt.step)
    assert f"rank {comm.rank} on " in str(e) and "frozen" in str(e) and "remove_hooks" in str(e), e
    opt.remove_hooks()
    # The same unfrozen parameter after wrapping again: averaged, and the ranks agree.
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    opt.zero_grad()
    loss_fn(model, local(x, comm), local(y, comm)).backward()
    opt.step()
    mine = model[0].weight.detach().clone()
    assert all(torch.equal(mine, other) for other in comm.allgather_obj(mine))
    # A parameter group added to the wrapped optimizer afterwards.
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt.wrapped.add_param_group({"params": [extra]})
    e = expect(RuntimeError, opt.step)
    assert "had 6 when" in str(e) and "before wrapping" in str(e), e
    opt.remove_hooks()
    # A different model on one rank: every rank is told which, before any gradient moves.
    if comm.size > 1:
        odd = torch.nn.Linear(4, 3 if comm.rank != comm.size - 1 else 2)
        e = expect(torchmn.CollectiveMismatchError,
                   lambda: torchmn.create_multi_node_optimizer(torch.optim.SGD(odd.parameters(), lr=0.1), comm))
        assert f"rank(s) [{comm.size - 1}]" in str(e) and "(2, 4) float32 there, (3, 4) float32 on rank 0" in str(e), e
    # Different settings on one rank (compression, sharded or not, accumulation): every rank is told
    # which, with each rank's value, before any gradient moves.
    if comm.size > 1:
        last = comm.rank == comm.size - 1
        for kwargs, told in (({"compression": "fp16" if last else "none"}, "compression: rank 0: None"),
                             ({"shard_state": last}, "shard_state: rank 0: False"),
                             ({"backward_passes_per_step": 2 if last else 1}, "backward_passes_per_step: rank 0: 1")):
            e = expect(torchmn.CollectiveMismatchError, lambda: torchmn.create_multi_node_optimizer(
                torch.optim.SGD(make_model().parameters(), lr=0.1), comm, **kwargs))
            assert "the ranks' options differ (" + told in str(e) and f"rank {comm.size - 1}: " in str(e), e
        # Another torch optimizer, other parameter groups or another switch on one rank: the
        # shared and sharded updates would give each rank's slice to a different update.
        for shard in (None, True):
            ps = list(make_model().parameters())
            for inner, told in ((torch.optim.Adam(ps) if last else torch.optim.SGD(ps, lr=0.1),
                                 "torch optimizer: rank 0: 'torch.optim.sgd.SGD'"),
                                (torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:]}] if last else ps, lr=0.1),
                                 "parameter groups: rank 0: 1"),
                                (torch.optim.SGD(ps, lr=0.1, nesterov=last, momentum=0.9),
                                 "parameter group 0's nesterov: rank 0: False")):
                e = expect(torchmn.CollectiveMismatchError,
                           lambda: torchmn.create_multi_node_optimizer(inner, comm, shard_state=shard))
                assert "the ranks' options differ (" + told in str(e), e
        # A learning-rate scheduler made before wrapping on one rank only (an elastic job's joining
        # rank makes its own afterwards): the initial_lr it adds to the groups is no hyperparameter.
        inner = torch.optim.SGD(make_model().parameters(), lr=0.1)
        if last:
            torch.optim.lr_scheduler.StepLR(inner, 1)
        torchmn.create_multi_node_optimizer(inner, comm).remove_hooks()
    # Sparse gradients: refused at backward, naming the layer's kind.
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(emb.parameters(), lr=0.1), comm)
    e = expect(RuntimeError, lambda: emb(torch.tensor([1, 2])).sum().backward())
    assert "sparse=False" in str(e), e
    opt.remove_hooks()
    # Copies: refused, without breaking the other wrappers of the class.
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    e = expect(TypeError, lambda: copy.deepcopy(opt))
    assert "state_dict()" in str(e), e
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.zero_grad()
    loss_fn(model, local(x, comm), local(y, comm)).backward()
    opt.step()
    assert calls == ["pre"], calls


def check_rewrap_keeps_state(comm):
    """The documented way to unfreeze (remove_hooks, then wrap the torch optimizer again) keeps
    Adam's moments and step counts with every optimizer kind, and so does wrapping a torch
    optimizer that has state already."""
    for shard_state in (None, True, False):
        torch.manual_seed(0)
        model = make_model()
        model[0].weight.requires_grad_(False)
        opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), comm,
                                                  shard_state=shard_state)
        for step in range(3):
            x, y = data(step)
            opt.zero_grad()
            loss_fn(model, local(x, comm), local(y, comm)).backward()
            opt.step()
        before = copy.deepcopy(opt.state_dict()["state"])  # the default's state_dict() views its shared state
        opt.remove_hooks()
        model[0].weight.requires_grad_(True)
        opt = torchmn.create_multi_node_optimizer(opt.wrapped, comm, shard_state=shard_state)
        after = opt.state_dict()["state"]
        assert before.keys() == after.keys() and before, (shard_state, before.keys(), after.keys())
        for i in before:
            assert int(after[i]["step"]) == 3 and torch.equal(after[i]["exp_avg"], before[i]["exp_avg"]), \
                (shard_state, i, (after[i]["exp_avg"] - before[i]["exp_avg"]).abs().max().item())
        opt.remove_hooks()


def check_wrapped_optimizer_alone_after_remove_hooks(comm):
    """After remove_hooks() the wrapped torch optimizer works alone on each rank, with every
    optimizer kind: its parameters and gradients are the rank's own (the default's and a sharded
    one's lived in memory the node's ranks share, where each rank's update landed once per rank)."""
    for shard_state in (None, True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).double()
        opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=1.0), comm,
                                                  shard_state=shard_state)
        model(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.remove_hooks()
        alone = opt.wrapped
        before = model.bias.detach().clone()
        alone.zero_grad()
        ((comm.rank + 1) * model(torch.ones(1, 4, dtype=torch.float64)).sum()).backward()
        alone.step()
        comm.barrier()  # every rank has stepped: an update landing in shared memory would show twice
        moved = (model.bias.detach() - before).tolist()
        assert moved == [-(comm.rank + 1.0)] * 2, (shard_state, comm.rank, moved)


def check_replacing_the_optimizer_drops_the_old_ones_hooks(comm):
    """A new phase of training with a new optimizer over the same parameters (the old one simply
    dropped, no remove_hooks()): the old one's hooks go with it, and the new one trains as one
    process does with its own new optimizer."""
    for shard_state in (None, True, False):
        model, opt = wrapped_model(comm, "adam", shard_state=shard_state)
        for step in range(2):
            x, y = data(step)
            opt.zero_grad()
            loss_fn(model, local(x, comm), local(y, comm)).backward()
            opt.step()
        old = weakref.ref(opt)
        ref = reference("adam", steps=2)
        opt = torchmn.create_multi_node_optimizer(OPTIMIZERS["sgd"](model.parameters()), comm, shard_state=shard_state)
        gc.collect()
        assert old() is None, "the dropped optimizer is kept alive (by its gradient hooks), averaging for nobody"
        ref_opt = OPTIMIZERS["sgd"](ref.parameters())
        for step in range(2, 5):
            x, y = data(step)
            opt.zero_grad()
            loss_fn(model, local(x, comm), local(y, comm)).backward()
            opt.step()
            ref_opt.zero_grad()
            loss_fn(ref, x, y).backward()
            ref_opt.step()
        assert_close(model, ref, 1e-9, f"after replacing the optimizer (shard_state={shard_state})")
        opt.remove_hooks()


def check_state_dict_hooks(comm):
    """torch's four state-dict hooks, with every optimizer kind: a post hook's dict is what
    state_dict() returns, a load pre hook's is what loads, pre and post hooks see the optimizer."""
    for shard_state in (None, True, False):
        torch.manual_seed(0)
        model = make_model()
        opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), comm,
                                                  shard_state=shard_state)
        x, y = data(0)
        opt.zero_grad()
        loss_fn(model, local(x, comm), local(y, comm)).backward()
        opt.step()
        seen = []
        opt.register_state_dict_pre_hook(lambda o: seen.append(("pre", o is opt)))
        handle = opt.register_state_dict_post_hook(lambda o, sd: {**sd, "epoch": 7})
        opt.register_state_dict_post_hook(lambda o, sd: seen.append(("first", "epoch" in sd)), prepend=True)
        saved = opt.state_dict()
        assert saved["epoch"] == 7 and seen == [("pre", True), ("first", False)], (shard_state, seen)
        handle.remove()
        assert "epoch" not in opt.state_dict(), shard_state

        def lr_half(o, sd):
            sd = copy.deepcopy(sd)
            sd["param_groups"][0]["lr"] = 0.005
            return sd
        opt.register_load_state_dict_pre_hook(lr_half)
        opt.register_load_state_dict_post_hook(lambda o: seen.append(("loaded", o.param_groups[0]["lr"])))
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.005 and seen[-1] == ("loaded", 0.005), (shard_state, seen)
        opt.remove_hooks()


def check_saved_model_is_its_own_size(comm):
    """torch.save(model.state_dict()) with the default optimizer (whose parameters live in the
    node's shared memory beside the optimizer state) writes the parameters, not the memory around
    them: about the model's bytes, as with the replicated optimizer, not three times that with Adam."""
    import io

    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 10)).double()
    opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
    model(torch.randn(4, 300, dtype=torch.float64)).sum().backward()
    opt.step()
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(saved.getvalue()) < 1.2 * params, (type(opt).__name__, len(saved.getvalue()), params)
    opt.remove_hooks()


def splits_update(comm):
    """Whether the default optimizer splits the update over the ranks (one node, shared memory)."""
    return comm.name == "hierarchical" and comm.inter_size == 1 and comm.size > 1


def check_default_keeps_replicated_semantics(comm):
    """The default optimizer (which on one node splits the update over the ranks): .grad holds the
    averaged gradient after backward, state[p] answers for every parameter, state_dict() taken on
    rank 0 alone is whole and loads into a plain torch.optim.Adam, and a run resumed from it on
    every rank continues exactly as the uninterrupted one."""
    expected = "NodeSharedOptimizer" if splits_update(comm) else "MultiNodeOptimizer"

    def start():
        model = make_model()
        return model, torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), comm)

    def train(model, opt, steps, ref=None, ref_opt=None):
        for step in steps:
            x, y = data(step)
            opt.zero_grad()
            loss_fn(model, local(x, comm), local(y, comm)).backward()
            if ref is not None:
                ref_opt.zero_grad()
                loss_fn(ref, x, y).backward()
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                    assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14), \
                        f"step {step}: .grad of {name} is not the averaged gradient: {(p.grad - q.grad).abs().max()}"
                ref_opt.step()
            opt.step()

    model, opt = start()
    assert type(opt).__name__ == expected, (comm.name, comm.inter_size, type(opt).__name__)
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train(model, opt, range(3), ref, ref_opt)
    assert_close(model, ref, 1e-6, "the default optimizer after 3 steps")
    assert set(opt.state) == set(model.parameters())
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].shape == p.shape and float(opt.state[p]["step"]) == 3.0
    saved = None
    if comm.rank == 0:  # alone: the other ranks make no call meanwhile
        # A copy, as torch.save makes: torch's own state_dict() holds the live state tensors.
        saved = copy.deepcopy(opt.state_dict())
        plain = torch.optim.Adam(make_model().parameters(), lr=0.01)
        plain.load_state_dict(saved)
        want = ref_opt.state_dict()
        assert saved["param_groups"] == want["param_groups"], (saved["param_groups"], want["param_groups"])
        assert saved["state"].keys() == want["state"].keys()
        for i, entry in want["state"].items():
            assert entry.keys() == saved["state"][i].keys(), (entry.keys(), saved["state"][i].keys())
            for key, value in entry.items():
                assert torch.allclose(value, saved["state"][i][key], rtol=1e-9, atol=1e-15), (i, key)
    comm.barrier()
    saved = comm.bcast_obj(saved)
    weights = comm.bcast_obj({k: v.clone() for k, v in model.state_dict().items()})
    train(model, opt, range(3, 6))
    resumed, resumed_opt = start()
    resumed.load_state_dict(weights)
    resumed_opt.load_state_dict(saved)
    train(resumed, resumed_opt, range(3, 6))
    for (name, p), q in zip(resumed.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"resumed run differs in {name} by {(p - q).abs().max()}"


def check_shared_memory_where_possible(comm):
    """On one node the hierarchical communicator averages through buffers the ranks share; kept
    gradients (zero_grad(set_to_none=False)) then accumulate in them, and the result still matches."""
    expected = comm.name == "hierarchical" and comm.inter_size == 1 and comm.size > 1
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(OPTIMIZERS["adam"](model.parameters()), comm)
    assert (opt.arena is not None) == expected, (comm.name, comm.inter_size, opt.arena)
    for opt_name in ("sgd", "adam"):
        assert_close(distributed(comm, opt_name, set_to_none=False), reference(opt_name), 1e-5,
                     f"{opt_name} with zero_grad(set_to_none=False)")
        assert_close(distributed(comm, opt_name, passes=2, set_to_none=False), reference(opt_name), 1e-5,
                     f"{opt_name} with backward_passes_per_step=2 and kept gradients")
    mine = torch.cat([p.detach().reshape(-1) for p in distributed(comm, "adam").parameters()])
    assert all(torch.equal(mine, other) for other in comm.allgather_obj(mine)), "ranks disagree bit for bit"


def check_transparency(comm):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = torchmn.create_multi_node_optimizer(inner, comm)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        x, y = data(step)
        opt.zero_grad()
        loss_fn(model, local(x, comm), local(y, comm)).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.125 and inner.param_groups[0]["lr"] == 0.125
    assert opt.param_groups is inner.param_groups
    if splits_update(comm):  # the state lives in shared memory; SGD without momentum keeps none
        assert opt.state == {} and inner.state == {}, opt.state
    else:
        assert opt.state is inner.state
    sd = opt.state_dict()
    assert sd == inner.state_dict() or sd.keys() == inner.state_dict().keys()
    model2 = make_model()
    opt2 = torchmn.create_multi_node_optimizer(torch.optim.SGD(model2.parameters(), lr=1.0), comm)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 0.125


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises when ``fail`` is set: a batch the script skips."""
    fail = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _FailingBackward.fail:
            raise FloatingPointError("bad gradient: skipping this batch")
        return g


def _train_skipping_a_batch(opt, model, comm, skip=1, steps=5):
    for step in range(steps):
        x, y = data(step)
        if comm is not None:
            x, y = local(x, comm), local(y, comm)
        opt.zero_grad()
        _FailingBackward.fail = step == skip
        try:
            # The first layer's gradients come last: the other buckets are out when it raises.
            h = _FailingBackward.apply(torch.tanh(model[0](x)))
            torch.nn.functional.cross_entropy(model[4](torch.tanh(model[2](h))), y).backward()
        except FloatingPointError:
            if comm is not None and step == skip:
                expect(RuntimeError, opt.step)   # partial gradients: refused, not used
            continue
        opt.step()
    _FailingBackward.fail = False
    return model


def check_failed_backward(comm):
    """A backward that raises, caught and its batch skipped (on every rank): the next steps are
    those of one process skipping it too (its half-sent buckets reached the next step's update)."""
    ref_model = make_model()
    ref = _train_skipping_a_batch(torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9), ref_model, None)
    for kwargs in ({}, {"shard_state": True}):
        model = make_model()
        opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm,
                                                  bucket_cap_mb=0, **kwargs)
        assert_close(_train_skipping_a_batch(opt, model, comm), ref, 1e-5, f"failed backward {kwargs}")


def check_skipped_step_and_abandoned_window(comm):
    """Every rank skips step 1 (a non-finite norm, GradScaler's inf): after gradients sent by
    synchronize() outside backward, or after one backward of a window of two, zero_grad() and the
    next steps are those of one process skipping that step (the next step sent nothing, or after
    its first backward, and updated with unaveraged gradients)."""
    ref_model = make_model()
    ref_opt = OPTIMIZERS["sgd"](ref_model.parameters())
    for step in range(5):
        x, y = data(step)
        ref_opt.zero_grad()
        loss_fn(ref_model, x, y).backward()
        if step != 1:
            ref_opt.step()
    for kwargs in ({}, {"shard_state": False}, {"shard_state": True}):
        for how in ("synchronized", "window"):
            model, opt = wrapped_model(comm, "sgd", passes=2 if how == "window" else 1, **kwargs)
            for step in range(5):
                x, y = data(step)
                x, y = local(x, comm), local(y, comm)
                opt.zero_grad()
                if how == "synchronized":
                    with opt.no_sync():
                        loss_fn(model, x, y).backward()
                    opt.synchronize()
                elif step == 1:
                    (loss_fn(model, x[:1], y[:1]) / 2).backward()  # the window's first pass, then given up
                else:
                    backward(opt, model, x, y, passes=2)
                if step != 1:
                    opt.step()
            assert_close(model, ref_model, 1e-5, f"{comm.name} step skipped after a {how} backward {kwargs}")


def check_step_skipped_on_one_rank_is_named(comm):
    """One rank skips a step() the others take (a decision on its own loss): at the next averaging
    every rank raises CollectiveMismatchError naming the ranks and their step counts, with the
    replicated optimizer (compressed too) as with the default, instead of the replicas drifting
    apart. A step every rank skips alike, and a rank out of data in torchmn.join, raise nothing."""
    skipper = comm.size - 1
    for kwargs in ({}, {"shard_state": False}, {"shard_state": False, "compression": "fp16"}):
        model, opt = wrapped_model(comm, "sgd", **kwargs)
        errors = []
        for step in range(4):
            x, y = data(step)
            opt.zero_grad()
            try:
                loss_fn(model, local(x, comm), local(y, comm)).backward()
                if step == 0 or (comm.rank == skipper and step == 2):
                    continue  # step 0: every rank skips it alike
                opt.step()
            except torchmn.CollectiveMismatchError as e:
                errors.append((step, str(e)))
                break
        # A world of one has no other rank to be out of step with. The node-shared update (the
        # default on one node) meets at every step(), so the others raise there, in step 2.
        steps = [step for step, _ in errors]
        assert steps == [] if comm.size == 1 else steps in ([2], [3]), (kwargs, errors)
        if kwargs.get("shard_state") is False and comm.size > 1:
            assert steps == [3], errors
            others = [r for r in range(comm.size) if r != skipper]
            assert f"rank(s) [{skipper}] 1; rank(s) {others} 2" in errors[0][1], errors
        opt.remove_hooks()
    # Uneven data in torchmn.join: the rank out of data repeats the others' steps, in step with them.
    model, opt = wrapped_model(comm, "sgd", shard_state=False)

    def train(steps):
        for step in steps:
            x, y = data(step)
            opt.zero_grad()
            loss_fn(model, local(x, comm), local(y, comm)).backward()
            opt.step()
    with torchmn.join(comm):
        train(range(2 if comm.rank == 0 else 4))
    train(range(4, 6))
    opt.remove_hooks()


def check_channels_last_parameters_keep_their_layout(comm):
    """A convolution converted to channels_last keeps that layout through wrapping and training with
    every optimizer (the default, whose parameters live in shared memory on one node, the sharded
    and the replicated one, Adam and fused Adam): its parameters, its averaged gradients and the
    state in state_dict() have the layout one process gives them, and the values one process's. The
    sharded optimizer's per-rank parts load into a model of the default layout as the same state,
    and a model converted on some ranks only is refused on every rank."""
    cl = torch.channels_last

    def convnet():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Tanh(), torch.nn.Conv2d(8, 4, 3)).double() \
            .to(memory_format=cl)

    def batch(step, r):
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(2, 3, 7, 7, generator=g, dtype=torch.float64).to(memory_format=cl)

    def layouts(tensors):
        return [t.is_contiguous(memory_format=cl) for t in tensors if t.dim() == 4]

    for fused in (False, True):
        ref = convnet()
        ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=fused)
        for step in range(3):
            ref_opt.zero_grad()
            (sum(ref(batch(step, r)).square().mean() for r in range(comm.size)) / comm.size).backward()
            ref_opt.step()
        for kwargs in ({}, {"shard_state": True}, {"shard_state": False}):
            what = f"{kwargs} fused={fused}"
            model = convnet()
            opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=0.01, fused=fused),
                                                      comm, **kwargs)
            assert layouts(model.parameters()) == [True, True], (what, "after wrapping")
            for step in range(3):
                opt.zero_grad()
                model(batch(step, comm.rank)).square().mean().backward()
                assert layouts(p.grad for p in model.parameters()) == [True, True], (what, "the averaged .grad")
                opt.step()
            assert layouts(model.parameters()) == [True, True], (what, "after training")
            assert_close(model, ref, 1e-9, what)
            state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
            for i, entry in ref_state.items():
                for key, value in entry.items():
                    got = state[i][key]
                    assert torch.allclose(got, value, rtol=1e-9, atol=1e-12), (what, i, key)
                    if value.dim() == 4:
                        assert got.stride() == value.stride(), (what, i, key, got.stride(), value.stride())
            if kwargs.get("shard_state"):
                # Each rank's part of the state, loaded into a model of the default layout: the same state.
                parts = comm.allgather_obj(opt.local_state_dict())
                plain = convnet().to(memory_format=torch.contiguous_format)
                other = torchmn.create_multi_node_optimizer(torch.optim.Adam(plain.parameters(), lr=0.01, fused=fused),
                                                            comm, shard_state=True)
                other.load_local_state_dicts(parts)
                for i, entry in other.state_dict()["state"].items():
                    for key, value in entry.items():
                        assert torch.equal(value, state[i][key]), (what, "parts across layouts", i, key)
                other.remove_hooks()
            opt.remove_hooks()
    if comm.size > 1:
        # One memory format on some ranks only: their sums would add elements of different places.
        model = convnet() if comm.rank == 0 else convnet().to(memory_format=torch.contiguous_format)
        try:
            torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
        except torchmn.CollectiveMismatchError as e:
            assert "strides (27, 1, 9, 3) on rank 0" in str(e), e
        else:
            raise AssertionError("different memory formats on the ranks were not refused")


def check_every_parameter_frozen_steps(comm):
    """A model frozen whole (a phase that trains nothing of this optimizer's): step() averages
    nothing and changes nothing, with every optimizer."""
    for kwargs in ({}, {"shard_state": False}, {"shard_state": True}):
        model = make_model()
        model.requires_grad_(False)
        before = [p.clone() for p in model.parameters()]
        opt = torchmn.create_multi_node_optimizer(OPTIMIZERS["sgd"](model.parameters()), comm, **kwargs)
        for _ in range(2):
            opt.zero_grad()
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), kwargs
        opt.remove_hooks()


def check_scheduler_and_hooks_of_the_torch_optimizer(comm):
    """An LR scheduler and step hooks set on the torch optimizer before wrapping work as without
    torchmn (the shared update on one node included): no warning that the scheduler stepped
    before the optimizer, the hooks and torch's global ones called at every step()."""
    import warnings

    from torch.optim.optimizer import register_optimizer_step_post_hook
    for kwargs in ({}, {"shard_state": False}, {"shard_state": True}):
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
        calls = []
        if not kwargs.get("shard_state"):
            inner.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
            inner.register_step_post_hook(lambda o, a, k: calls.append("post"))
        handle = register_optimizer_step_post_hook(
            lambda o, a, k: calls.append("global") if o is inner else None)
        opt = torchmn.create_multi_node_optimizer(inner, comm, **kwargs)
        x, y = data(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            for _ in range(2):
                opt.zero_grad()
                loss_fn(model, local(x, comm), local(y, comm)).backward()
                opt.step()
                scheduler.step()
        handle.remove()
        assert opt.param_groups[0]["lr"] == 0.025, (kwargs, opt.param_groups[0]["lr"])
        if not kwargs.get("shard_state"):
            assert calls == ["pre", "post", "global"] * 2, (type(opt).__name__, calls)
        opt.remove_hooks()


def check_closure_lbfgs(comm):
    """LBFGS (step with a closure) takes the course of one process on the whole batch: each
    evaluation's gradients and loss are averaged over the ranks; where a closure cannot work, it is
    refused naming the option."""
    x, y = data(0)

    def train(model, opt, xs, ys):
        def closure():
            opt.zero_grad()
            loss = loss_fn(model, xs, ys)
            loss.backward()
            return loss
        return [float(opt.step(closure).detach()) for _ in range(3)]
    ref_model = make_model()
    ref_losses = train(ref_model, torch.optim.LBFGS(ref_model.parameters(), lr=0.5, max_iter=5), x, y)
    model = make_model()
    opt = torchmn.create_multi_node_optimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), comm)
    losses = train(model, opt, local(x, comm), local(y, comm))
    assert_close(model, ref_model, 1e-6, f"{comm.name} LBFGS")
    assert all(abs(a - b) < 1e-9 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for kwargs, told in (({"shard_state": True}, "updates its shards"),
                         ({"shard_state": False, "backward_passes_per_step": 2}, "> 1")):
        model = make_model()
        opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, **kwargs)
        e = expect(ValueError, lambda: opt.step(lambda: loss_fn(model, x, y)))
        assert "step(closure) (LBFGS)" in str(e) and told in str(e), e
        opt.remove_hooks()


def check_frozen_parameters_start_equal(comm):
    """A frozen layer handed to the optimizer is broadcast too: initialised at random on each rank,
    it would otherwise make the ranks' models differ for good."""
    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert all(torch.equal(mine, other) for other in comm.allgather_obj(mine)), "frozen layer differs"


def check_dtype_changed_after_wrapping(comm):
    """model.double() after wrapping: a clear error naming the cause, not torch's about grad_dtype
    (nor, sharded, an update of buffers the parameters no longer view)."""
    for kwargs in ({}, {"shard_state": True}):
        model = torch.nn.Linear(3, 2)
        opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, **kwargs)
        model.double()
        e = expect(RuntimeError, lambda: model(torch.ones(1, 3, dtype=torch.float64)).sum().backward())
        assert "was torch.float32 when create_multi_node_optimizer wrapped" in str(e), str(e)
        opt.zero_grad()


def check_memory_format_changed_after_wrapping(comm):
    """model.to(memory_format=torch.channels_last) after wrapping, with every optimizer: a clear error
    naming the cause at the next backward, not gradients averaged from buffers the conversion moved
    them out of (wrong numbers, without a word)."""
    for kwargs in ({}, {"shard_state": True}, {"shard_state": False}):
        model = torch.nn.Conv2d(3, 4, 3)
        opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, **kwargs)
        model(torch.ones(1, 3, 5, 5)).sum().backward()
        opt.step()
        model.to(memory_format=torch.channels_last)
        e = expect(RuntimeError, lambda: model(torch.ones(1, 3, 5, 5)).sum().backward())
        assert "has strides (27, 1, 9, 3) now but had (27, 9, 3, 1) when create_multi_node_optimizer" in str(e), \
            (kwargs, str(e))
        opt.zero_grad()
        opt.remove_hooks()


def check_complex_parameters(comm):
    """Complex gradients average like real ones (zero_fill=False read complex flags and crashed);
    compression, which would drop their imaginary part, is refused."""
    w = torch.nn.Parameter(torch.tensor([1 + 2j, -1j], dtype=torch.complex64))
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD([w], lr=0.0), comm, zero_fill=False)
    x = torch.tensor([comm.rank + 1j, 2.0], dtype=torch.complex64)
    (w * x).real.sum().backward()
    opt.step()
    expected = torch.stack([torch.tensor([r + 1j, 2.0], dtype=torch.complex64) for r in range(comm.size)]).mean(0)
    assert torch.allclose(w.grad.conj(), expected), (w.grad, expected)
    if comm.size > 1:
        v = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
        expect(ValueError, lambda: torchmn.create_multi_node_optimizer(torch.optim.SGD([v], lr=0.1), comm,
                                                                       compression="fp16"))


def fixed_gradients(comm, layer, steps, **kwargs):
    """SGD (lr 1) on a loss linear in the weights, so each rank's gradient is the same every step
    (its own random matrix): the parameters' total change is minus the sum of the averaged
    gradients the optimizer used, to compare with ``steps`` times the true average."""
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * r + i), dtype=p.dtype)
              for i, p in enumerate(layer.parameters())] for r in range(comm.size)]
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(layer.parameters(), lr=1.0), comm, **kwargs)
    start = [p.detach().clone() for p in layer.parameters()]  # rank 0's, broadcast by the wrapper
    averages = []
    for _ in range(steps):
        opt.zero_grad()
        sum((p * g).sum() for p, g in zip(layer.parameters(), grads[comm.rank])).backward()
        averages.append([p.grad.clone() for p in layer.parameters()])
        opt.step()
    truth = [torch.stack([g[i] for g in grads]).mean(0) for i in range(len(start))]
    used = [s - p.detach() for s, p in zip(start, layer.parameters())]
    opt.remove_hooks()
    return truth, used, averages


def check_powersgd(comm):
    """compression="powersgd": a single step's rank-1 average misses much of the true one, but
    error feedback sends what it missed later: the gap between the updates' sum and the true
    average's stays bounded, so relative to the sum it shrinks as 1/steps; the biases travel whole
    (exact); every rank holds the same parameters."""
    gaps = {}
    for steps in (50, 200):
        layer = torch.nn.Linear(12, 10).double()
        truth, used, averages = fixed_gradients(comm, layer, steps, compression="powersgd", powersgd_rank=1)
        weight, bias = truth
        gaps[steps] = ((used[0] - steps * weight).norm() / (steps * weight).norm()).item()
        assert torch.allclose(used[1], steps * bias, rtol=1e-10), "the bias travels whole: exact"
        for p in layer.parameters():
            assert all(torch.equal(p, other) for other in comm.allgather_obj(p.detach())), "ranks differ"
    first = ((averages[0][0] - weight).norm() / weight.norm()).item()
    assert first > 0.3, f"a rank-1 average of a 10 x 12 matrix should miss much of it, missed {first:.3g}"
    assert gaps[200] < gaps[50] / 2.5 and gaps[200] < 0.05, f"the updates' sum off the true one's: {gaps}"


def check_powersgd_refusals(comm):
    """What PowerSGD cannot do is refused with the reason and the fix."""
    def wrap(model, **kwargs):
        return torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, **kwargs)
    e = expect(ValueError, lambda: wrap(make_model(), compression="powersgd", shard_state=True))
    assert "shard_state=False" in str(e), e
    e = expect(ValueError, lambda: wrap(make_model(), compression="powersgd", double_buffering=True))
    assert "double_buffering=False" in str(e), e
    e = expect(ValueError, lambda: wrap(make_model(), compression="powersgd", powersgd_rank=0))
    assert "positive integer, not 0" in str(e), e
    e = expect(ValueError, lambda: wrap(torch.nn.Linear(4, 4).bfloat16(), compression="powersgd"))
    assert "torch.bfloat16 parameters" in str(e) and "autocast" in str(e), e
    e = expect(ValueError, lambda: torchmn.ddp_comm_hook(comm, compression="powersgd"))
    assert "powerSGD_hook" in str(e), e


if __name__ == "__main__":
    run_checks(globals())
