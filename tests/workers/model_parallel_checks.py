"""Model-parallel checks, run on every rank of a real job (see tests/test_model_parallel.py).

Every rank builds the whole model with the same seed, keeps its own part, and compares what the
split model computes with what the whole model computes in one process, in float64.
Usage: python model_parallel_checks.py CHECK [CHECK ...]   (or "all")
"""
import contextlib
import os
import sys

import torch

import torchmn
import torchmn.functions as F
from torchmn.nn import SCHEDULES, MultiNodeSequential, Pipeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import run_checks  # noqa: E402

TOL = dict(rtol=0, atol=1e-6)


def layers(n, width=5, seed=0, act=torch.nn.Sigmoid):
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(width, width), act()).double() for _ in range(n)]


def batch(rows=8, width=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g, dtype=torch.float64)


def close(a, b, what):
    assert torch.allclose(a, b, **TOL), f"{what}: max difference {(a - b).abs().max().item()}"


# ----------------------------------------------------------------------------- the functions
def check_ring(comm):
    """ChainerMN's ring: one Linear+sigmoid per rank, 0 -> 1 -> ... -> n-1 -> 0."""
    n, r = comm.size, comm.rank
    if n < 2:
        return
    parts = layers(n)
    ref = layers(n)
    x = batch()
    y_ref = torch.nn.Sequential(*ref)(x.clone())
    xr = x.clone().requires_grad_()
    torch.nn.Sequential(*ref)(xr).sum().backward()
    mine = parts[r]
    if r == 0:
        xi = x.clone().requires_grad_()
        d = F.send(mine(xi), comm, rank=1)
        y = F.recv(comm, rank=n - 1, delegate_variable=d)
        close(y, y_ref, "ring output on rank 0")
        y.sum().backward()
        close(xi.grad, xr.grad, "rank 0's input gradient")
    else:
        h = F.recv(comm, rank=r - 1)
        F.send(mine(h), comm, rank=(r + 1) % n).backward()
    for p, q in zip(mine.parameters(), ref[r].parameters()):
        close(p.grad, q.grad, f"rank {r}'s layer gradient")


def check_send_then_other_loss(comm):
    """A rank that sends, then computes a loss from other data: pseudo_connect ties the two, so one
    backward runs both (without it the peer would wait for ever for its gradient to be taken)."""
    if comm.size < 2 or comm.rank > 1:
        comm.barrier()
        return
    a, b, c = layers(3, act=torch.nn.Tanh)
    x, z = batch(seed=2), batch(seed=3)
    if comm.rank == 0:
        d = F.send(a(x), comm, rank=1)
        zz = F.pseudo_connect(d, z)
        c(zz).sum().backward()
    else:
        b(F.recv(comm, rank=0)).sum().backward()
    ra, rb, _ = layers(3, act=torch.nn.Tanh)
    rb(ra(x)).sum().backward()
    ref = ra if comm.rank == 0 else rb
    for p, q in zip((a if comm.rank == 0 else b).parameters(), ref.parameters()):
        close(p.grad, q.grad, f"rank {comm.rank}'s gradient across the send")
    comm.barrier()


def _weights(n):
    return torch.arange(1, n * n + 1, dtype=torch.float64).reshape(n, n)


def check_allgather_backward(comm):
    """Different first dimensions per rank; rank r's loss weighs ys[j] by w[r, j]."""
    n, r, w = comm.size, comm.rank, _weights(comm.size)
    x = torch.randn(r + 1, 3, dtype=torch.float64, requires_grad=True)
    ys = F.allgather(comm, x)
    assert [tuple(y.shape) for y in ys] == [(j + 1, 3) for j in range(n)]
    sum(w[r, j] * ys[j].sum() for j in range(n)).backward()
    close(x.grad, torch.full_like(x, w[:, r].sum().item()), "allgather's input gradient")


def check_alltoall_backward(comm):
    n, r, w = comm.size, comm.rank, _weights(comm.size)
    xs = [torch.randn(j + 2, dtype=torch.float64, requires_grad=True) for j in range(n)]
    ys = F.alltoall(comm, xs)
    assert [tuple(y.shape) for y in ys] == [(r + 2,)] * n
    sum(w[r, j] * ys[j].sum() for j in range(n)).backward()
    for j, x in enumerate(xs):
        close(x.grad, torch.full_like(x, w[j, r].item()), "alltoall's input gradient")


def check_scatter_gather_bcast_backward(comm):
    """From a root that is not rank 0."""
    n, r, root = comm.size, comm.rank, comm.size - 1
    xs = [torch.randn(2, j + 1, dtype=torch.float64, requires_grad=True) for j in range(n)] if r == root else None
    y = F.scatter(comm, xs, root=root)
    assert y.shape == (2, r + 1)
    ((r + 1) * y.sum()).backward()
    if r == root:
        for j, x in enumerate(xs):
            close(x.grad, torch.full_like(x, j + 1.0), "scatter's input gradient")
    x = torch.randn(r + 1, dtype=torch.float64, requires_grad=True)
    ys = F.gather(comm, x, root=root)
    if r == root:
        sum((j + 1) * t.sum() for j, t in enumerate(ys)).backward()
    else:
        ys.backward()  # the delegate
    close(x.grad, torch.full_like(x, r + 1.0), "gather's input gradient")
    x = torch.randn(4, dtype=torch.float64, requires_grad=True) if r == root else None
    y = F.bcast(comm, x, root=root)
    ((r + 1) * y.sum()).backward()
    if r == root:
        close(x.grad, torch.full_like(x, n * (n + 1) / 2), "bcast's input gradient")


def check_double_backward_refused(comm):
    """A second derivative through a communicating backward is refused on every rank, at the same
    point: that backward's own collective is not part of the graph, so its result would be wrong."""
    def refused(what, y, x):
        (g,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
        try:
            g.sum().backward()
        except RuntimeError as e:
            assert "twice" in str(e), f"{what}: {e}"
        else:
            raise AssertionError(f"{what}: double backward was not refused")

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    refused("allreduce", F.allreduce(comm, x), x)
    refused("allgather", torch.cat(F.allgather(comm, x)), x)
    refused("MultiNodeBatchNorm1d", torchmn.nn.MultiNodeBatchNorm1d(3, comm=comm).double()(x), x)
    layer = torchmn.nn.ColumnParallelLinear(3, 4, comm=comm, dtype=torch.float64, gather_output=False)
    refused("ColumnParallelLinear", layer(x), x)
    row = torchmn.nn.RowParallelLinear(2 * comm.size, 3, comm=comm, dtype=torch.float64, input_is_parallel=True)
    part = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    refused("RowParallelLinear", row(part), part)
    column = torchmn.nn.ColumnParallelLinear(3, 2 * comm.size, comm=comm, dtype=torch.float64, gather_output=True)
    refused("ColumnParallelLinear gathered", column(x), x)


def check_backward_skipped_on_one_rank_is_named(comm):
    """A rank that skips the backward of a collective (its forward ran under no_grad): the others'
    backward allreduce meets its next forward allreduce of the same shape, and every rank is told,
    instead of the two mixing their data."""
    if comm.size < 2:
        return
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    skips = comm.rank == 1
    with torch.no_grad() if skips else contextlib.nullcontext():
        y = F.allreduce(comm, x * (comm.rank + 1))
    try:
        if not skips:
            y.sum().backward()
        F.allreduce(comm, torch.full((3,), 10.0, dtype=torch.float64))
    except torchmn.CollectiveMismatchError as e:
        assert "allreduce (in a backward pass)" in str(e) and "skipped a backward pass" in str(e), e
    else:
        raise AssertionError("no error")

def check_mismatched_functions_raise(comm):
    """Ranks that call different collectives get the communicator's error, not a hang."""
    if comm.size < 2:
        return
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    try:
        if comm.rank == 0:
            F.allgather(comm, x)
        else:
            F.bcast(comm, x if comm.rank == 0 else None)
    except torchmn.CollectiveMismatchError as e:
        assert "allgather" in str(e) and "bcast" in str(e), e
    else:
        raise AssertionError("no error")


def check_send_recv_arguments_refused(comm):
    """Arguments in another order than ChainerMN's send(x, comm, rank) / recv(comm, rank), and this
    rank as the peer, are refused on the calling rank before any message, naming the fix."""
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    peer = (comm.rank + 1) % comm.size
    for call, words in ((lambda: F.send(comm, x, peer), "send(x, comm, rank)"),
                        (lambda: F.recv(peer, comm), "recv(comm, rank)"),
                        (lambda: F.send(x, comm, comm.rank), "is this rank"),
                        (lambda: F.recv(comm, comm.rank), "is this rank"),
                        (lambda: F.send((x, (x, x)), comm, peer), "element 1 is a tuple (tuples do not nest")):
        try:
            call()
        except (TypeError, ValueError) as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"accepted: {words}")


# ----------------------------------------------------------------------------- MultiNodeSequential
class Pair(torch.nn.Module):
    """Returns a tuple: tuple data between parts."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        h = self.inner(x)
        return h, 2 * h


class Add(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *xs):
        if len(xs) == 1 and isinstance(xs[0], tuple):
            xs = xs[0]
        return self.inner(sum(xs))


def _topology(name, comm, ls):
    """(this rank's model, a function computing the same output in one process from all layers)."""
    model = MultiNodeSequential(comm)
    r, n = comm.rank, comm.size
    if name == "chain":
        model.add(ls[r], rank_in=None if r == 0 else r - 1, rank_out=None if r == n - 1 else r + 1)
        return model, lambda x, ls: torch.nn.Sequential(*ls[:n])(x), n - 1
    if name == "cycle":  # 0 -> 1 -> 0 (and through the others on more ranks)
        if r == 0:
            model.add(ls[0], rank_in=None, rank_out=1)
            model.add(ls[n], rank_in=n - 1, rank_out=None)
        else:
            model.add(ls[r], rank_in=r - 1, rank_out=(r + 1) % n)
        return model, lambda x, ls: ls[n](torch.nn.Sequential(*ls[:n])(x)), 0
    if name == "branch_merge":  # 0 sends to every other rank, which send back; 0 adds them up
        if r == 0:
            model.add(ls[0], rank_in=None, rank_out=list(range(1, n)))
            model.add(Add(ls[n]), rank_in=list(range(1, n)), rank_out=None)
        else:
            model.add(ls[r], rank_in=0, rank_out=0)
        return model, lambda x, ls: ls[n](sum(ls[k](ls[0](x)) for k in range(1, n))), 0
    if name == "tuple":  # 0's part returns (h, 2h); the last rank adds them up
        if r == 0:
            model.add(Pair(ls[0]), rank_in=None, rank_out=1 if n > 1 else None)
        elif r < n - 1:
            model.add(Pair(Add(ls[r])), rank_in=r - 1, rank_out=r + 1)
        else:
            model.add(Add(ls[r]), rank_in=r - 1, rank_out=None)
        return model, lambda x, ls: _tuple_reference(x, ls, n), n - 1
    raise ValueError(name)


def _tuple_reference(x, ls, n):
    h = ls[0](x)
    for k in range(1, n):
        h = ls[k](h + 2 * h)
    return h


def _train_topology(comm, name, steps=5):
    n, r = comm.size, comm.rank
    ls, ref = layers(n + 1), layers(n + 1)
    model, reference, out_rank = _topology(name, comm, ls)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for layer in ref for p in layer.parameters()], lr=0.1)
    for step in range(steps):
        x = batch(seed=10 + step)
        opt.zero_grad()
        y = model(x if r == 0 else None)
        if r == out_rank:
            (y * y).sum().backward()
        else:
            y.backward()
        opt.step()
        ref_opt.zero_grad()
        y_ref = reference(x, ref)
        (y_ref * y_ref).sum().backward()
        ref_opt.step()
        if r == out_rank:
            close(y.detach(), y_ref.detach(), f"{name}: output at step {step}")
    for k, layer in enumerate(ls):
        if any(p is q for p in layer.parameters() for q in model.parameters()):
            for p, q in zip(layer.parameters(), ref[k].parameters()):
                close(p, q, f"{name}: rank {r}'s layer {k} after {steps} SGD steps")


def check_chain(comm):
    _train_topology(comm, "chain")


def check_cycle(comm):
    _train_topology(comm, "cycle")


def check_branch_merge(comm):
    if comm.size > 1:
        _train_topology(comm, "branch_merge")


def check_tuple_data(comm):
    _train_topology(comm, "tuple")


def check_recv_after_a_delegate_outside_the_graph(comm):
    """A receive given integer labels as its delegate still joins the graph: its gradient goes
    back to the sender, whose backward would otherwise wait for it until the timeout."""
    if comm.size < 2 or comm.rank > 1:
        return
    x = batch(3, 2).requires_grad_()
    labels = torch.tensor([[1, 2], [3, 4], [5, 6]])
    if comm.rank == 0:
        d = F.send(labels, comm, 1)
        F.send(F.pseudo_connect(d, x * 3), comm, 1).backward()
        close(x.grad, 3 * labels.double(), "the sender's gradient")
    else:
        got = F.recv(comm, 0)
        h = F.recv(comm, 0, delegate_variable=got)
        assert h.requires_grad, "the received tensor is outside the graph"
        (h * got).sum().backward()


def check_merge_after_a_frozen_branch(comm):
    """A merge whose first input is the rank's own frozen branch still sends the gradient of its
    second input back to that input's rank (ranks past 1 have no part, but take part in the
    first call's topology check)."""
    if comm.size < 2:
        return
    enc, frozen, head = layers(3, width=4)
    frozen.requires_grad_(False)
    x = batch(5, 4)

    class Merge(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, own, other):
            return self.head(own + other)
    model = MultiNodeSequential(comm)
    if comm.rank == 0:
        model.add(enc, rank_in=None, rank_out=1)
    elif comm.rank == 1:
        model.add(frozen, rank_in=None, rank_out=1)       # its own branch, passed to itself
        model.add(Merge(), rank_in=[1, 0], rank_out=None)  # that branch first, then rank 0's
    out = model(x)
    if comm.rank > 1:
        assert out is None, out
    elif comm.rank == 0:
        out.backward()
        reference = [p.detach().clone().requires_grad_() for p in enc.parameters()]
        y = head(frozen(x) + torch.nn.functional.linear(x, *reference).sigmoid())
        y.pow(2).sum().backward()
        for p, ref in zip(enc.parameters(), reference):
            close(p.grad, ref.grad, "the encoder's gradient")
    else:
        out.pow(2).sum().backward()


def check_hundred_passes(comm):
    """100 forward/backward passes through a cycle and a branch/merge: no deadlock."""
    for name in ("cycle", "branch_merge") if comm.size > 1 else ("cycle",):
        model, _, out_rank = _topology(name, comm, layers(comm.size + 1))
        for _ in range(100):
            y = model(batch() if comm.rank == 0 else None)
            (y.sum() if comm.rank == out_rank else y).backward()


def check_topology_refused(comm):
    """A send that no rank receives is refused on every rank, naming the part."""
    model = MultiNodeSequential(comm)
    if comm.rank == 0:
        model.add(torch.nn.Identity(), rank_in=None, rank_out=comm.size)  # not a rank
    try:
        model(batch())
    except torchmn.CollectiveMismatchError as e:
        assert f"rank 0's part 0 (Identity) has rank_out={comm.size}" in str(e), e
    else:
        raise AssertionError("no error")
    model = MultiNodeSequential(comm)
    if comm.rank == 0 and comm.size > 1:
        model.add(torch.nn.Identity(), rank_in=None, rank_out=1)  # rank 1 has no part receiving it
    try:
        model(batch())
        assert comm.size == 1
    except torchmn.CollectiveMismatchError as e:
        assert "rank 0's part 0 (Identity) sends 1 time(s) to rank 1, which receives from rank 0 0 time(s)" \
            in str(e), e


def check_topology_waiting_in_a_cycle_refused(comm):
    """Sends and receives that pair up but would wait for each other for ever (rank 0 sends to rank
    2 first, which receives from rank 1 first, which waits for rank 0): refused on every rank at the
    first call, naming where each rank would wait, instead of every rank waiting out the timeout."""
    if comm.size < 3:
        return

    class Merge(torch.nn.Module):
        def forward(self, a, b):
            return a + b
    model = MultiNodeSequential(comm)
    if comm.rank == 0:
        model.add(torch.nn.Linear(4, 4).double(), rank_in=None, rank_out=[2, 1])
    elif comm.rank == 1:
        model.add(torch.nn.Linear(4, 4).double(), rank_in=0, rank_out=2)
    elif comm.rank == 2:
        model.add(Merge(), rank_in=[1, 0], rank_out=None)
    try:
        model(batch(width=4) if comm.rank == 0 else None)
    except torchmn.CollectiveMismatchError as e:
        assert "would wait for each other" in str(e) and "rank 0's part 0 (Linear) sends to rank 2" in str(e) \
            and "rank 2's part 0 (Merge) receives from rank 1" in str(e), e
    else:
        raise AssertionError("no error")


# ----------------------------------------------------------------------------- pipelines
def _stages(p, width=6, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()).double() for _ in range(p)]


def _pipeline_grads(comm, schedule, m, rows=12):
    p, r = comm.size, comm.rank
    stages, ref = _stages(p), _stages(p)
    x, y = batch(rows=rows, width=6, seed=5), batch(rows=rows, width=6, seed=6)
    loss_fn = torch.nn.functional.mse_loss
    pipe = Pipeline(stages[r], comm, micro_batches=m, schedule=schedule, loss_fn=loss_fn)
    loss = pipe.train_step(x if r == 0 else None, target=y if r == p - 1 else None)
    ref_loss = loss_fn(torch.nn.Sequential(*ref)(x), y)
    ref_loss.backward()
    if r == p - 1:
        close(loss, ref_loss.detach(), f"{schedule}: the batch's loss")
    for a, b in zip(stages[r].parameters(), ref[r].parameters()):
        close(a.grad, b.grad, f"{schedule} m={m}: stage {r}'s gradient against the unsplit batch")
    return pipe.peak_activation_bytes


def check_pipeline_gpipe(comm):
    _pipeline_grads(comm, "gpipe", 4)


def check_pipeline_1f1b(comm):
    for m in (1, 3, 4, 5):
        _pipeline_grads(comm, "1f1b", m)


def check_pipeline_micro_batches_mismatch_refused(comm):
    """Stages built with different micro_batches: every stage is told at the first step, naming each
    stage's, instead of waiting for messages that never come."""
    if comm.size < 2:
        return
    stages = _stages(comm.size)
    m = 4 if comm.rank == 1 else 2
    pipe = Pipeline(stages[comm.rank], comm, micro_batches=m, loss_fn=torch.nn.functional.mse_loss)
    x, y = batch(rows=8, width=6, seed=5), batch(rows=8, width=6, seed=6)
    try:
        pipe.train_step(x if pipe.is_first else None, target=y if pipe.is_last else None)
    except torchmn.CollectiveMismatchError as e:
        assert "rank 0: {'micro_batches': 2, 'schedule': '1f1b'}; rank 1: {'micro_batches': 4, 'schedule': '1f1b'}" \
            in str(e), e
    else:
        raise AssertionError("no error")


def check_pipeline_schedule_mismatch_refused(comm):
    """Stages built with different schedules would each wait for what the other sends later."""
    if comm.size < 2:
        return
    schedule = "gpipe" if comm.rank == 1 else "1f1b"
    pipe = Pipeline(_stages(comm.size)[comm.rank], comm, micro_batches=4, schedule=schedule,
                    loss_fn=torch.nn.functional.mse_loss)
    x, y = batch(rows=8, width=6, seed=5), batch(rows=8, width=6, seed=6)
    try:
        pipe.train_step(x if pipe.is_first else None, target=y if pipe.is_last else None)
    except torchmn.CollectiveMismatchError as e:
        assert "rank 1: {'micro_batches': 4, 'schedule': 'gpipe'}" in str(e), e
    else:
        raise AssertionError("no error")


class _TwoWay(torch.nn.Module):
    """A stage taking and returning two tensors, the latter as a list (a first stage takes one)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(6, 6).double(), torch.nn.Linear(6, 6).double()

    def forward(self, x, y=None):
        return [torch.tanh(self.a(x)), torch.sigmoid(self.b(x if y is None else y))]


def check_pipeline_stage_returning_a_list(comm):
    """A stage may return a list of tensors, as a tuple: the next stage takes them as its arguments."""
    p, r = comm.size, comm.rank
    parts, ref = [_TwoWay(k) for k in range(p)], [_TwoWay(k) for k in range(p)]
    x, y = batch(rows=8, width=6, seed=5), batch(rows=8, width=6, seed=6)

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out[0] * out[1], target)

    for schedule in SCHEDULES:
        for part in parts:
            part.zero_grad()
        pipe = Pipeline(parts[r], comm, micro_batches=4, schedule=schedule, loss_fn=loss_fn)
        pipe.train_step(x if r == 0 else None, target=y if r == p - 1 else None)
        if schedule == SCHEDULES[0]:
            h = ref[0](x)
            for part in ref[1:]:
                h = part(*h)
            loss_fn(h, y).backward()
        for a, b in zip(parts[r].parameters(), ref[r].parameters()):
            close(a.grad, b.grad, f"{schedule}: stage {r}'s gradient, stages returning lists")
        evaluated = pipe(x if r == 0 else None)
        if r == p - 1:
            close(evaluated[0] * evaluated[1], h[0] * h[1], "forward through stages returning lists")


def check_pipeline_memory(comm):
    """1F1B holds at most p - i micro-batches on stage i, GPipe all of them."""
    m, p, r = 8, comm.size, comm.rank
    gpipe, one = _pipeline_grads(comm, "gpipe", m, rows=16), _pipeline_grads(comm, "1f1b", m, rows=16)
    if p > 1 and r < p - 1:
        assert one * m <= gpipe * (p - r) * 1.01, (r, one, gpipe)
    print(f"MEMORY rank={r} gpipe={gpipe} 1f1b={one}", flush=True)


class TransposedLinear(torch.nn.Module):
    """``tanh(x @ w.T)``, as hand-written layers do: autograd saves the view ``w.T`` for backward."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width, dtype=torch.float64) / width)

    def forward(self, x):
        return torch.tanh(x @ self.weight.T)


def check_pipeline_memory_leaves_out_the_weights(comm):
    """A layer that multiplies by its weight's transpose saves that view of the weight for backward:
    not an activation, so it does not count once per micro-batch."""
    m, width, rows = 8, 64, 32
    torch.manual_seed(0)
    stage = TransposedLinear(width)
    pipe = Pipeline(stage, comm, micro_batches=m, schedule="gpipe", loss_fn=torch.nn.functional.mse_loss)
    x, y = batch(rows=rows, width=width, seed=5), batch(rows=rows, width=width, seed=6)
    pipe.train_step(x if pipe.is_first else None, target=y if pipe.is_last else None)
    activation = rows // m * width * 8  # one micro-batch's activation tensor, in bytes
    weight = width * width * 8
    # Per micro-batch: its input, the product, tanh's output, and the loss's inputs on the last
    # stage: a few activations, far below one weight each.
    assert 0 < pipe.peak_activation_bytes <= m * 6 * activation < m * weight, \
        (pipe.peak_activation_bytes, m * 6 * activation, m * weight)


def check_pipeline_with_data_parallel(comm):
    """2 stages x (size/2) replicas; each replica's batch is its share of the global batch; the
    parameters after 3 Adam steps equal one process on the whole batch."""
    if comm.size % 2:
        comm.barrier()
        return
    p, m = 2, 2
    replicas = comm.size // p
    replica, stage = comm.rank // p, comm.rank % p
    pipe_comm = comm.split(color=replica, key=stage)
    dp_comm = comm.split(color=stage, key=replica)
    stages, ref = _stages(p, seed=3), _stages(p, seed=3)
    pipe = Pipeline(stages[stage], pipe_comm, micro_batches=m, schedule="1f1b",
                    loss_fn=torch.nn.functional.mse_loss)
    opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(stages[stage].parameters(), lr=0.01), dp_comm,
                                              backward_passes_per_step=m)
    ref_opt = torch.optim.Adam([q for s in ref for q in s.parameters()], lr=0.01)
    rows = 4 * replicas
    for step in range(3):
        x, y = batch(rows=rows, width=6, seed=20 + step), batch(rows=rows, width=6, seed=40 + step)
        mine = slice(replica * 4, (replica + 1) * 4)
        opt.zero_grad()
        pipe.train_step(x[mine] if stage == 0 else None, target=y[mine] if stage == p - 1 else None)
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(torch.nn.Sequential(*ref)(x), y).backward()
        ref_opt.step()
    for a, b in zip(stages[stage].parameters(), ref[stage].parameters()):
        close(a, b, f"pipeline x data parallel: rank {comm.rank}'s stage {stage} after 3 steps")


def check_wrong_shape_is_named(comm):
    """Rank 1's part gets another shape than it takes: its own error there, and rank 0, waiting
    for the gradient, gets the communicator's error naming rank 1 instead of hanging."""
    if comm.size != 2:
        return
    if comm.rank == 0:
        d = F.send(torch.nn.Linear(4, 4).double()(batch(width=4)), comm, rank=1)
        try:
            d.backward()
        except torchmn.CollectiveTimeoutError as e:
            assert "rank 1" in str(e), e
            print(f"NAMED {e}", flush=True)
        else:
            raise AssertionError("no error")
    else:
        try:
            torch.nn.Linear(5, 4).double()(F.recv(comm, rank=0))
        except RuntimeError as e:
            print(f"OWN_ERROR {e}", flush=True)
        # Rank 1 leaves without sending the gradient: rank 0 must learn so, not wait for ever.


if __name__ == "__main__":
    run_checks(globals(), not_in_all=("wrong_shape_is_named",))
