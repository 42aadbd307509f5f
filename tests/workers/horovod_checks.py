"""Checks of torchmn.horovod, in the manner of Horovod's test/parallel/test_torch.py, run on every
rank of a real job (see tests/test_horovod.py).

Every rank builds every rank's input from that rank's seed, so it knows the exact expected result.
Usage: python horovod_checks.py CHECK [CHECK ...]   (or "all")
"""
import gc
import itertools
import glob
import json
import os
import sys
import tempfile
import threading
import time
import warnings

import torch

import torchmn
import torchmn.horovod as hvd

DTYPES = [torch.float16, torch.float32, torch.float64, torch.int32, torch.int64]
DIMS = [1, 2, 3]


def rank_tensor(r, dim, dtype, low=-100, high=100):
    """Rank r's input: the same on every rank that builds it."""
    g = torch.Generator().manual_seed(1000 + r)
    return torch.randint(low, high, [17] * dim, generator=g).to(dtype)


def expect(cond, what):
    assert cond, f"rank {hvd.rank()}: {what}"


def expect_raises(exc_type, fn, *words):
    try:
        fn()
    except exc_type as e:
        for w in words:
            assert w in str(e), f"rank {hvd.rank()}: {exc_type.__name__} without {w!r}: {e}"
        return e
    raise AssertionError(f"rank {hvd.rank()}: {exc_type.__name__} not raised")


# ----------------------------------------------------------------------------- allreduce
def check_allreduce_ops_and_dtypes():
    size, rank = hvd.size(), hvd.rank()
    for op, dtype, dim in itertools.product([hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product], DTYPES, DIMS):
        low, high = (-2, 3) if op == hvd.Product else (-100, 100)
        inputs = [rank_tensor(r, dim, dtype, low, high) for r in range(size)]
        wide = torch.stack([t.to(torch.float64) for t in inputs])
        if op == hvd.Sum:
            want = wide.sum(0)
        elif op == hvd.Average:
            want = wide.sum(0) / size if dtype.is_floating_point else torch.div(wide.sum(0), size, rounding_mode="trunc")
        elif op == hvd.Min:
            want = wide.min(0).values
        elif op == hvd.Max:
            want = wide.max(0).values
        else:
            want = wide.prod(0)
        got = hvd.allreduce(inputs[rank], op=op)
        expect(got.dtype == dtype and got.shape == inputs[rank].shape, f"{op} {dtype}: result {got.dtype} {got.shape}")
        tol = {torch.float16: 0.5, torch.float32: 1e-4, torch.float64: 1e-9}.get(dtype, 0.0)
        diff = (got.to(torch.float64) - want).abs().max().item()
        expect(diff <= tol, f"op {op} {dtype} dim {dim}: off by {diff}")
        expect(torch.equal(inputs[rank], rank_tensor(rank, dim, dtype, low, high)), "allreduce changed its input")


def check_allreduce_inplace():
    size, rank = hvd.size(), hvd.rank()
    for dtype, dim in itertools.product(DTYPES, DIMS):
        t = rank_tensor(rank, dim, dtype)
        want = sum(rank_tensor(r, dim, dtype).to(torch.float64) for r in range(size))
        out = hvd.allreduce_(t, op=hvd.Sum)
        expect(out is t, "allreduce_ returns its tensor")
        expect((t.to(torch.float64) - want).abs().max() <= (0.5 if dtype == torch.float16 else 0), f"{dtype} in place")
    t = torch.full((3,), float(rank))
    h = hvd.allreduce_async_(t, op=hvd.Max)
    expect(hvd.synchronize(h) is t and torch.equal(t, torch.full((3,), float(size - 1))), "allreduce_async_")


def check_allreduce_prescale_postscale():
    size, rank = hvd.size(), hvd.rank()
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        t = rank_tensor(rank, dim, dtype)
        want = sum(rank_tensor(r, dim, dtype).to(torch.float64) * 2.0 for r in range(size)) * 0.25
        got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
        expect((got.to(torch.float64) - want).abs().max() < 1e-4, f"{dtype} scaled sum")
    t = torch.tensor([7, -7, 3], dtype=torch.int64)
    got = hvd.allreduce(t, op=hvd.Sum, prescale_factor=1.5)  # 10.5 -> 10, -10.5 -> -10, 4.5 -> 4 on each rank
    expect(torch.equal(got, torch.tensor([10, -10, 4]) * size), f"integer prescale truncates: {got}")
    avg = hvd.allreduce(torch.ones(4) * (rank + 1), postscale_factor=2.0)
    expect(torch.allclose(avg, torch.full((4,), (size + 1) / 2 * 2.0)), "Average with postscale")


def check_allreduce_async_many():
    size, rank = hvd.size(), hvd.rank()
    handles = []
    for i in range(50):
        t = torch.full((i + 1, 3), float(rank + i))
        handles.append((i, hvd.allreduce_async(t, op=hvd.Sum, name=f"many.{i}")))
    for i, h in reversed(handles):
        got = hvd.synchronize(h)
        want = sum(r + i for r in range(size))
        expect(got.shape == (i + 1, 3) and torch.all(got == want), f"async allreduce {i}: {got.flatten()[:3]}")


def check_poll():
    size = hvd.size()
    h = hvd.allreduce_async(torch.ones(1 << 20), op=hvd.Sum)
    deadline = time.time() + 30
    while not hvd.poll(h):
        expect(time.time() < deadline, "poll never returned True")
        time.sleep(0.001)
    expect(torch.all(hvd.synchronize(h) == size), "polled result")
    expect_raises(ValueError, lambda: hvd.poll(h), "not a collective in flight")


def _every_async_op(rank, size, name=None):
    """Start one collective of each asynchronous kind; returns (kind, handle, check of its result)."""
    x = torch.full((size * 2, 3), float(rank))
    summed = sum(range(size))
    ops = [("allreduce", hvd.allreduce_async(x, op=hvd.Sum, name=name and f"{name}.allreduce"),
            lambda got: torch.all(got == summed)),
           ("allgather", hvd.allgather_async(x, name=name and f"{name}.allgather"),
            lambda got: got.shape == (size * size * 2, 3) and torch.all(got[::size * 2, 0] == torch.arange(size))),
           ("broadcast", hvd.broadcast_async(x, size - 1, name=name and f"{name}.broadcast"),
            lambda got: torch.all(got == size - 1)),
           ("alltoall", hvd.alltoall_async(x, name=name and f"{name}.alltoall"),
            lambda got: torch.equal(got[0][:, 0], torch.arange(size).repeat_interleave(2).float())),
           ("reducescatter", hvd.reducescatter_async(x, op=hvd.Sum, name=name and f"{name}.reducescatter"),
            lambda got: got.shape == (2, 3) and torch.all(got == summed))]
    return ops


def check_async_ops_are_in_flight():
    """Every *_async collective returns at once, its handle polling False until the others take
    part (the other ranks start theirs 0.3 s later), then synchronizes to the right result."""
    size, rank = hvd.size(), hvd.rank()
    if rank != 0:
        time.sleep(0.3)
    started = time.time()
    ops = _every_async_op(rank, size)
    if rank == 0:
        expect(time.time() - started < 0.2, f"the *_async calls returned after {time.time() - started:.2f} s")
        polled = {kind: hvd.poll(h) for kind, h, _ in ops}
        expect(not any(polled.values()), f"a handle polled True before the other ranks took part: {polled}")
    for kind, h, good in ops:
        expect(good(hvd.synchronize(h)), f"{kind}_async result")


def check_same_name_in_two_kinds_of_collective():
    """Horovod keys a name by its kind of collective: an allreduce and an allgather named "loss"
    in flight together are no clash (the other ranks come late, so the first is surely in flight)."""
    size = hvd.size()
    if hvd.rank() != 0:
        time.sleep(0.5)
    a = hvd.allreduce_async(torch.ones(2), name="loss", op=hvd.Sum)
    b = hvd.allgather_async(torch.ones(1), name="loss")
    expect(torch.all(hvd.synchronize(a) == size) and hvd.synchronize(b).shape == (size,), "both ran")


def check_named_collectives_in_another_order_refused():
    """Horovod pairs named collectives by name; torchmn.horovod runs them in each rank's order, so
    ranks starting different names at one point are refused on every rank, naming them, instead
    of reducing "a" with "b"."""
    name = "b" if hvd.rank() == 1 else "a"
    for start in (lambda: hvd.allreduce_async(torch.ones(3), name=name),
                  lambda: hvd.allgather_async(torch.ones(1), name=name)):
        expect_raises(torchmn.CollectiveMismatchError, lambda: hvd.synchronize(start()), "rank 0", "'a'", "rank 1",
                      "'b'", "same order")
    expect(torch.all(hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after") == hvd.size()), "collectives go on")


def check_duplicate_name_refused():
    """As Horovod's test: rank 0 alone starts named collectives, and starting another of the same
    name is refused (ValueError) instead of blocking; after a barrier, the others do the same."""
    size, rank = hvd.size(), hvd.rank()
    mine = []
    if rank == 0:
        mine = _every_async_op(rank, size, name="duplicate")
        for kind, _, _ in mine:
            start = {"allreduce": lambda: hvd.allreduce_async(torch.ones(1), name="duplicate.allreduce"),
                     "allgather": lambda: hvd.allgather_async(torch.ones(1), name="duplicate.allgather"),
                     "broadcast": lambda: hvd.broadcast_async(torch.ones(1), 0, name="duplicate.broadcast"),
                     "alltoall": lambda: hvd.alltoall_async(torch.ones(size), name="duplicate.alltoall"),
                     "reducescatter": lambda: hvd.reducescatter_async(torch.ones(size), name="duplicate.reducescatter")}
            expect_raises(ValueError, start[kind], "same name as another tensor that is currently being processed")
    hvd.barrier()
    later = None
    if rank != 0:
        mine = _every_async_op(rank, size, name="duplicate")
        # Rank 0 starts this one only after the next barrier: it is surely in flight here.
        later = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="duplicate.later")
        e = expect_raises(ValueError, lambda: hvd.allreduce_async(torch.ones(1), name="duplicate.later"),
                          "currently being processed")
        expect(isinstance(e, torchmn.TorchmnError), "the refusal is also a torchmn error")
    for kind, h, good in mine:
        expect(good(hvd.synchronize(h)), f"{kind}_async result after the refusals")
    hvd.barrier()
    if rank == 0:
        later = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="duplicate.later")
    expect(hvd.synchronize(later).item() == size, "the collective the others waited for")


def check_grouped_allreduce():
    size, rank = hvd.size(), hvd.rank()
    tensors = [rank_tensor(rank, d, dt) for d, dt in [(1, torch.float32), (2, torch.int64), (3, torch.float64),
                                                      (1, torch.float16), (2, torch.float32)]]
    want = [sum(rank_tensor(r, t.dim(), t.dtype).to(torch.float64) for r in range(size)) for t in tensors]
    for got, w, t in zip(hvd.grouped_allreduce(tensors, op=hvd.Sum), want, tensors):
        expect(got.dtype == t.dtype and (got.to(torch.float64) - w).abs().max() <= 0.5, f"grouped {t.dtype}")
    results = hvd.synchronize(hvd.grouped_allreduce_async(tensors, op=hvd.Sum))
    expect(all(torch.equal(a, b) for a, b in zip(results, hvd.grouped_allreduce(tensors, op=hvd.Sum))),
           "grouped async equals grouped")
    copies = [t.clone() for t in tensors]
    out = hvd.grouped_allreduce_(copies, op=hvd.Sum)
    expect(all(o is c for o, c in zip(out, copies)) and all(torch.equal(c, r) for c, r in zip(copies, results)),
           "grouped in place")
    # Horovod's handles hold tuple(outputs): the in-place and async forms give tuples.
    async_ = hvd.synchronize(hvd.grouped_allreduce_async_([t.clone() for t in tensors], op=hvd.Sum))
    expect(type(results) is tuple and type(out) is tuple and type(async_) is tuple,
           f"grouped forms give tuples: {type(results).__name__}, {type(out).__name__}, {type(async_).__name__}")


def check_allreduce_grad():
    size = hvd.size()
    for op, dim in itertools.product([hvd.Sum, hvd.Average], DIMS):
        x = torch.ones([5] * dim, dtype=torch.float64, requires_grad=True)
        hvd.allreduce(x, op=op).backward(torch.ones([5] * dim, dtype=torch.float64))
        want = size if op == hvd.Sum else 1
        expect(torch.all(x.grad == want), f"allreduce gradient ({op}): {x.grad.flatten()[0]}")


def check_mismatched_shapes_raise():
    rank = hvd.rank()
    e = expect_raises(torchmn.CollectiveMismatchError,
                      lambda: hvd.allreduce(torch.ones(17, 17 + rank)), "rank 0", "rank 1", "(17, 17)", "(17, 18)")
    expect(isinstance(e, RuntimeError), "a mismatch is a RuntimeError, as Horovod's")
    expect_raises(torchmn.CollectiveMismatchError,
                  lambda: hvd.allreduce(torch.ones(4, dtype=torch.float32 if rank else torch.float64)), "float64")
    expect_raises(torchmn.CollectiveMismatchError,
                  lambda: hvd.allreduce(torch.ones(4), op=hvd.Sum if rank else hvd.Max), "Sum", "Max")
    expect(torch.all(hvd.allreduce(torch.ones(2), op=hvd.Sum) == hvd.size()), "collectives go on afterwards")


def check_unsupported_refused():
    expect_raises(NotImplementedError, lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum), "Adasum")
    expect_raises(NotImplementedError, lambda: hvd.reducescatter(torch.ones(4), op=hvd.Max), "Max")
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum), "supersedes")
    expect_raises(AttributeError, lambda: hvd.elastic.ElasticSampler, "use torchmn.elastic.ElasticSampler")


# ----------------------------------------------------------------------------- allgather / broadcast
def check_allgather_uneven():
    size, rank = hvd.size(), hvd.rank()
    sizes = [3, 2, 7, 4][:size]
    for dtype, dim in itertools.product(DTYPES + [torch.uint8, torch.bool], DIMS):
        t = torch.full([sizes[rank]] + [17] * (dim - 1), rank % 2 if dtype == torch.bool else rank).to(dtype)
        got = hvd.allgather(t)
        expect(got.shape[0] == sum(sizes) and got.dtype == dtype, f"allgather shape {tuple(got.shape)}")
        start = 0
        for r, n in enumerate(sizes):
            expect(torch.all(got[start:start + n] == (r % 2 if dtype == torch.bool else r)), f"rows of rank {r}")
            start += n
    expect(torch.equal(hvd.synchronize(hvd.allgather_async(torch.tensor([rank]))), torch.arange(size)),
           "allgather_async")
    expect_raises(torchmn.CollectiveMismatchError, lambda: hvd.allgather(torch.ones(2, 3 + rank)),
                  "beyond the first dimension")


def check_allgather_grad():
    size, rank = hvd.size(), hvd.rank()
    sizes = [3, 2, 7, 4][:size]
    for dim in DIMS:
        x = torch.full([sizes[rank]] + [17] * (dim - 1), float(rank), dtype=torch.float64, requires_grad=True)
        grad_ys = torch.cat([torch.ones([n] + [17] * (dim - 1), dtype=torch.float64) * r for r, n in enumerate(sizes)])
        hvd.allgather(x).backward(grad_ys)
        # Horovod 0.28 averages the ranks' output gradients (they are alike here), then slices.
        expect(torch.all(x.grad == rank), f"allgather gradient: {x.grad.flatten()[0]} (Horovod: the average, {rank})")
        y = x.detach().clone().requires_grad_()
        z = torch.full([2] + [17] * (dim - 1), float(rank), dtype=torch.float64, requires_grad=True)
        got_y, got_z = hvd.grouped_allgather([y, z])
        (got_y * grad_ys).sum().add_((got_z * 3.0).sum()).backward()
        expect(torch.all(y.grad == rank) and torch.all(z.grad == 3.0),
               f"grouped_allgather gradients: {y.grad.flatten()[0]}, {z.grad.flatten()[0]} (Horovod: {rank}, 3)")


def check_broadcast_every_root():
    size, rank = hvd.size(), hvd.rank()
    for dtype, dim, root in itertools.product(DTYPES + [torch.uint8, torch.int8, torch.bool], DIMS, range(size)):
        t = torch.full([17] * dim, rank % 2 if dtype == torch.bool else rank).to(dtype)
        root_value = root % 2 if dtype == torch.bool else root
        got = hvd.broadcast(t, root)
        expect(torch.all(got == root_value) and got.dtype == dtype, f"broadcast from {root} ({dtype})")
        if rank != root:
            expect(torch.all(t == (rank % 2 if dtype == torch.bool else rank)), "broadcast changed its input")
        expect(hvd.broadcast_(t, root) is t and torch.all(t == root_value), "broadcast_ in place")
    expect_raises(ValueError, lambda: hvd.broadcast(torch.ones(2), size + 3), "invalid root rank")
    expect_raises(torchmn.CollectiveMismatchError, lambda: hvd.broadcast(torch.ones(2), rank), "root")
    expect_raises(torchmn.CollectiveMismatchError, lambda: hvd.broadcast(torch.ones(2, 1 + rank), 0), "shape")


def check_broadcast_grad():
    size, rank = hvd.size(), hvd.rank()
    for dim, root in itertools.product(DIMS, range(size)):
        x = torch.full([17] * dim, float(rank), dtype=torch.float64, requires_grad=True)
        hvd.broadcast(x, root).backward(torch.ones([17] * dim, dtype=torch.float64))
        want = 1 if rank == root else 0  # Horovod 0.28: the ranks' average on the root, zero elsewhere
        expect(torch.all(x.grad == want), f"broadcast gradient from {root}: {x.grad.flatten()[0]}")


# ----------------------------------------------------------------------------- alltoall / reducescatter
def check_alltoall_uneven():
    size, rank = hvd.size(), hvd.rank()
    splits = [rank + j + 1 for j in range(size)]        # rank r sends r + j + 1 rows to rank j
    rows = torch.cat([torch.full((n, 2), float(100 * rank + j)) for j, n in enumerate(splits)])
    out, received = hvd.alltoall(rows, splits=torch.tensor(splits, dtype=torch.int32))
    expect(received.dtype == torch.int32 and received.tolist() == [r + rank + 1 for r in range(size)],
           f"received splits {received.tolist()}")
    start = 0
    for r, n in enumerate(received.tolist()):
        expect(torch.all(out[start:start + n] == 100 * r + rank), f"rows from rank {r}")
        start += n
    even = hvd.alltoall(torch.arange(2 * size, dtype=torch.float64) + 100 * rank)
    expect(isinstance(even, torch.Tensor) and even.tolist() == [100 * r + 2 * rank + k for r in range(size)
                                                                for k in range(2)], f"equal splits: {even}")
    x = rows.clone().requires_grad_()
    y, _ = hvd.alltoall(x, splits=splits)
    y.backward(torch.ones_like(y) * (rank + 1))
    want = torch.cat([torch.full((n, 2), float(j + 1)) for j, n in enumerate(splits)])
    expect(torch.equal(x.grad, want), "alltoall gradient goes back to its senders")
    expect_raises(ValueError, lambda: hvd.alltoall(torch.ones(1, 2), splits=[1] * size), "more than")


def check_alltoall_padded_buffer():
    """Splits that sum to fewer rows than the tensor holds (a send buffer allocated once, used in
    part): the first rows go, the rest stay (Horovod refuses only a larger sum); their gradient is 0."""
    size, rank = hvd.size(), hvd.rank()
    buffer = torch.full((size + 3, 2), -1.0)
    buffer[:size] = torch.arange(size, dtype=torch.float32).view(-1, 1) + 100 * rank
    x = buffer.clone().requires_grad_()
    out, received = hvd.alltoall(x, splits=[1] * size)
    expect(received.tolist() == [1] * size and out[:, 0].tolist() == [100 * r + rank for r in range(size)],
           f"padded buffer: {out.tolist()}")
    out.backward(torch.ones_like(out))
    expect(x.grad[:size].eq(1).all() and x.grad[size:].eq(0).all(), f"padded buffer's gradient: {x.grad.tolist()}")


def check_reducescatter():
    size, rank = hvd.size(), hvd.rank()
    for op, dtype, rows in itertools.product([hvd.Sum, hvd.Average], [torch.float32, torch.float64, torch.int32,
                                                                       torch.int64, torch.float16], [size * 4, size * 4 + 1]):
        inputs = [rank_tensor(r, 1, dtype)[:1].repeat(rows, 3) * 0 + torch.arange(rows).view(-1, 1).to(dtype) + r
                  for r in range(size)]
        total = sum(t.to(torch.float64) for t in inputs)
        counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        start = sum(counts[:rank])
        want = total[start:start + counts[rank]]
        if op == hvd.Average:
            want = want / size if dtype.is_floating_point else torch.div(want, size, rounding_mode="trunc")
        got = hvd.reducescatter(inputs[rank], op=op)
        expect(got.shape == (counts[rank], 3) and got.dtype == dtype, f"reducescatter shape {tuple(got.shape)}")
        expect((got.to(torch.float64) - want).abs().max() <= (0.5 if dtype == torch.float16 else 1e-9),
               f"reducescatter {op} {dtype} {rows} rows")
    for op, want in ((hvd.Sum, size), (hvd.Average, 1)):
        x = torch.ones(size * 4, 5, dtype=torch.float64, requires_grad=True)
        hvd.reducescatter(x, op=op).backward(torch.ones(4, 5, dtype=torch.float64))
        expect(torch.all(x.grad == want), f"reducescatter gradient ({op}): {x.grad[0, 0]}")
    # Horovod's gradient takes the factors too: times the rank count (Sum), prescale and postscale.
    x = torch.ones(size * 2, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5) * (rank + 1)).sum().backward()
    want = torch.tensor([(r + 1) * size * 1.5 for r in range(size) for _ in range(2)], dtype=torch.float64)
    expect(torch.equal(x.grad, want), f"reducescatter gradient with factors: {x.grad.tolist()}")
    # Horovod's argument order (tensor, name, compression, op, ...) and fp16 compression.
    got = hvd.reducescatter(torch.full((size * 2,), 0.5), "rs.positional", hvd.Compression.fp16, hvd.Sum)
    expect(got.dtype == torch.float32 and torch.all(got == 0.5 * size), f"reducescatter(t, name, fp16, Sum): {got}")
    got = hvd.synchronize(hvd.reducescatter_async(torch.ones(size), "rs.async", hvd.Sum))
    expect(torch.all(got == size), f"reducescatter_async(t, name, Sum): {got}")
    got = hvd.grouped_reducescatter([torch.ones(size)], "rs.grouped", hvd.Compression.fp16, hvd.Sum)
    expect(torch.all(got[0] == size), f"grouped_reducescatter(ts, name, fp16, Sum): {got}")


def check_grouped_ops():
    size, rank = hvd.size(), hvd.rank()
    gathered = hvd.grouped_allgather([torch.tensor([rank]), torch.full((2, 2), float(rank))])
    expect(gathered[0].tolist() == list(range(size)) and gathered[1].shape == (2 * size, 2), "grouped_allgather")
    scattered = hvd.grouped_reducescatter([torch.ones(size * 2), torch.ones(size, 3)], op=hvd.Sum)
    expect(torch.all(scattered[0] == size) and scattered[0].shape == (2,) and scattered[1].shape == (1, 3),
           "grouped_reducescatter")
    a, b = hvd.synchronize(hvd.grouped_reducescatter_async([torch.ones(size), torch.ones(size)], op=hvd.Sum))
    expect(torch.all(a == size) and torch.all(b == size), "grouped_reducescatter_async")
    g = hvd.synchronize(hvd.grouped_allgather_async([torch.tensor([rank])]))
    expect(g[0].tolist() == list(range(size)), "grouped_allgather_async")


def check_sparse_allreduce():
    size, rank = hvd.size(), hvd.rank()
    t = torch.sparse_coo_tensor([[rank, 0]], [1.0, 2.0], (size + 1,), check_invariants=True)
    got = hvd.synchronize(hvd.sparse_allreduce_async(t, name="sparse", op=hvd.Sum)).coalesce().to_dense()
    want = torch.zeros(size + 1)
    for r in range(size):
        want[r] += 1.0
        want[0] += 2.0
    expect(torch.equal(got, want), f"sparse allreduce {got} != {want}")


# ----------------------------------------------------------------------------- objects, sets, timeline, join
def check_objects_and_barrier():
    size, rank = hvd.size(), hvd.rank()
    expect(hvd.broadcast_object({"epoch": rank}, root_rank=size - 1) == {"epoch": size - 1}, "broadcast_object")
    mine = {"epoch": rank}
    expect((hvd.broadcast_object(mine, root_rank=0) is mine) == (rank == 0), "broadcast_object: root gets its own object")
    expect(hvd.allgather_object(("r", rank)) == [("r", r) for r in range(size)], "allgather_object")
    hvd.barrier()


def check_objects_travel_by_cloudpickle():
    """As Horovod's, the object collectives pickle with cloudpickle: lambdas and closures travel;
    what even cloudpickle cannot pickle raises on every rank, naming the rank."""
    size, rank = hvd.size(), hvd.rank()
    offset = 10 * rank
    add = hvd.broadcast_object(lambda x: x + offset, root_rank=size - 1)
    expect(add(1) == 10 * (size - 1) + 1, "a lambda broadcast")
    expect([f(0) for f in hvd.allgather_object(lambda x: x + offset)] == [10 * r for r in range(size)],
           "lambdas gathered")
    bad = threading.Lock() if rank == 1 else 0
    e = expect_raises(TypeError, lambda: hvd.allgather_object(bad), "rank 1 on")
    expect("cannot pickle" in str(e), str(e))
    hvd.barrier()


def check_topology_queries():
    size, rank = hvd.size(), hvd.rank()
    expect(hvd.is_initialized() and hvd.local_size() == size and hvd.local_rank() == rank, "one node: local = global")
    expect(hvd.cross_size() == 1 and hvd.cross_rank() == 0 and hvd.is_homogeneous(), "one node: cross")
    expect(hvd.gloo_enabled() and hvd.gloo_built() and not hvd.mpi_enabled() and not hvd.mpi_built(), "controllers")
    gpus = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    expect(bool(hvd.nccl_built()) == gpus and not hvd.ddl_built() and not hvd.ccl_built(), "NCCL where CUDA is")
    expect_raises(ValueError, hvd.mpi_threads_supported, "MPI is not enabled")


def check_submodules_import_as_horovods():
    """`from horovod.torch.mpi_ops import ...` ported: the same objects as hvd's, working."""
    from torchmn.horovod import mpi_ops
    from torchmn.horovod.mpi_ops import Sum, allreduce_async, synchronize
    total = synchronize(allreduce_async(torch.ones(2), op=Sum, name="through mpi_ops"))
    expect(total.tolist() == [float(hvd.size())] * 2, f"allreduce through mpi_ops: {total}")
    expect(all(getattr(mpi_ops, name) is getattr(hvd, name) for name in mpi_ops.__all__), "the same objects")


def check_process_set_of_two():
    size, rank = hvd.size(), hvd.rank()
    pair = hvd.add_process_set([0, 1])
    expect(pair.included() == (rank < 2) and pair.size() == 2, "membership")
    if rank < 2:
        expect(pair.rank() == rank, "rank within the set")
        got = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, process_set=pair)
        expect(got.item() == 3.0, f"allreduce within the set: {got}")
        expect(hvd.broadcast(torch.tensor([rank]), 1, process_set=pair).item() == 1, "broadcast within the set")
        expect(hvd.allgather(torch.tensor([rank]), process_set=pair).tolist() == [0, 1], "allgather within the set")
    else:
        expect(pair.rank() == -1, "an outsider's rank in the set")
        expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=pair),
                      f"Rank {rank} is not a member of the provided process set.")
    expect(hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size, "the global set afterwards")
    expect(hvd.remove_process_set(pair) and not hvd.remove_process_set(pair), "remove_process_set")
    expect_raises(ValueError, lambda: hvd.allreduce(torch.ones(1), process_set=pair), "has not been registered")
    # As Horovod's: a set not registered has no size nor rank, and knows its members.
    expect(pair.size() is None and pair.rank() is None and pair.included() == (rank < 2),
           f"an unregistered set: {pair.size()}, {pair.rank()}, {pair.included()}")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(torch.optim.SGD(_mlp().parameters(), lr=0.1),
                                                              process_set=pair), "has not been registered")


def check_process_sets_added_and_removed_keep_files_level():
    """Process sets added and removed in a loop, each used (also by an async op still queued at
    removal): removing one lets go of its communicators after their work, so the rank's open
    files stay put and a later set of the same ranks takes its groups."""
    rank = hvd.rank()

    def open_files():
        return len(os.listdir("/proc/self/fd"))
    for cycle in range(4):
        if cycle == 1:  # after one cycle, which may open what stays open
            before = open_files()
        pair = hvd.add_process_set([0, 1])
        if rank < 2:
            handle = hvd.allreduce_async(torch.tensor([float(rank + 1)]), op=hvd.Sum, process_set=pair)
        expect(hvd.remove_process_set(pair), "remove_process_set")
        if rank < 2:
            got = hvd.synchronize(handle)
            expect(got.item() == 3.0, f"the async allreduce queued before the removal: {got}")
    grown = open_files() - before
    expect(grown <= 2, f"{grown} files more after 3 cycles of a process set added and removed")
    expect(hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size(), "the global set afterwards")


def check_optimizer_outside_its_process_set():
    """A DistributedOptimizer of a set this rank is not in: the members average among themselves,
    the others update alone (Horovod's behaviour), and neither waits for the other."""
    size, rank = hvd.size(), hvd.rank()
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=evens)
    reference = _mlp()
    members = [r for r in range(size) if r % 2 == 0] if rank % 2 == 0 else [rank]
    grads = [sum(gs) / len(members) for gs in zip(*[_grads(reference, r, 0) for r in members])]
    with torch.no_grad():
        for p, g in zip(reference.parameters(), grads):
            p -= 0.1 * g
    opt.zero_grad()
    x, y = _batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        expect(torch.allclose(p, q, atol=1e-12), f"rank {rank} ({'member' if rank % 2 == 0 else 'outside'}): step")
    hvd.barrier()
    expect(hvd.remove_process_set(evens), "remove_process_set")


def check_join_refuses_what_it_cannot_mirror():
    """With a rank joined, the others' allgather and broadcast raise on them (Horovod: "not
    supported with Join"); the joined rank goes on waiting, and every rank's join() returns alike."""
    size, rank = hvd.size(), hvd.rank()
    if rank == 0:
        last = hvd.join()
    else:
        expect_raises(RuntimeError, lambda: hvd.allgather(torch.ones(2, 3)), "join")
        expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), 1), "join")
        s = hvd.allreduce(torch.ones(2), op=hvd.Sum)
        expect(torch.all(s == size - 1), f"an allreduce still counts the joined rank as zeros: {s}")
        last = hvd.join()
    every = hvd.allgather_object(last)
    expect(len(set(every)) == 1 and every[0] != 0, f"join() returns one rank, not the first to join: {every}")


def check_timeline():
    rank = hvd.rank()
    path = os.path.join(hvd.broadcast_object(tempfile.mkdtemp() if rank == 0 else None, 0), "timeline.json")
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(1000), name="tl.allreduce")
    hvd.allgather(torch.ones(3, 2), name="tl.allgather")
    hvd.broadcast(torch.ones(4), 0, name="tl.broadcast")
    hvd.synchronize(hvd.allreduce_async(torch.ones(10), name="tl.async"))
    hvd.stop_timeline()
    hvd.barrier()
    if rank == 0:
        with open(path) as f:
            trace = json.load(f)
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        for name, kind in (("tl.allreduce", "ALLREDUCE"), ("tl.allgather", "ALLGATHER"),
                           ("tl.broadcast", "BROADCAST"), ("tl.async", "ALLREDUCE")):
            mine = [e for e in events if e["args"].get("tensor") == name]
            expect(sorted(e["pid"] for e in mine) == list(range(hvd.size())), f"{name}: one event per rank")
            expect(all(e["name"] == kind and e["dur"] >= 0 and e["ts"] >= 0 for e in mine), f"{name}: {mine}")
        allreduce = [e for e in events if e["args"].get("tensor") == "tl.allreduce"][0]
        expect(allreduce["args"]["bytes"] == 4000, "bytes recorded")


def check_timeline_of_rank_0_alone():
    """As Horovod's, start_timeline and stop_timeline are calls of one rank: rank 0 alone records,
    every rank calls stop_timeline (as hvd.shutdown does), and nothing waits for the others."""
    rank = hvd.rank()
    path = os.path.join(hvd.broadcast_object(tempfile.mkdtemp() if rank == 0 else None, 0), "rank0.json")
    if rank == 0:
        hvd.start_timeline(path)
    hvd.allreduce(torch.ones(3), name="tl0.allreduce")
    t0 = time.monotonic()
    written = hvd.stop_timeline()
    expect(time.monotonic() - t0 < 5, f"stop_timeline took {time.monotonic() - t0:.1f} s")
    hvd.barrier()
    if rank == 0:
        expect(written == path, f"rank 0 wrote {written}")
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X" and "tensor" in e["args"]]
        expect([(e["pid"], e["args"]["tensor"]) for e in events] == [(0, "tl0.allreduce")], f"{events}")
        expect(not glob.glob(path + ".rank*"), "rank 0's part is joined and removed")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _batch(r, step, n=4):
    g = torch.Generator().manual_seed(100 * r + step)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def _grads(model, r, step):
    model.zero_grad()
    x, y = _batch(r, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def check_join_one_rank_early():
    size, rank = hvd.size(), hvd.rank()
    early = size - 1
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    reference = _mlp()
    if rank == early:
        last = hvd.join()
    else:
        for step in range(2):
            s = hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"join.sum.{step}")
            expect(torch.all(s == size - 1), f"a joined rank counts as zero: {s}")
            a = hvd.allreduce(torch.ones(3), name=f"join.avg.{step}")
            expect(torch.allclose(a, torch.full((3,), (size - 1) / size)), f"Average divides by the job's size: {a}")
            g = hvd.grouped_allreduce([torch.ones(2), torch.ones(1, dtype=torch.int64)], op=hvd.Sum)
            expect(g[0][0] == size - 1 and g[1][0] == size - 1, "grouped allreduce with a joined rank")
            grads = [sum(gs) / size for gs in zip(*[_grads(reference, r, step) for r in range(size - 1)])]
            with torch.no_grad():
                for p, gr in zip(reference.parameters(), grads):
                    p -= 0.1 * gr
            opt.zero_grad()
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            for p, q in zip(model.parameters(), reference.parameters()):
                expect(torch.allclose(p, q, atol=1e-12), "DistributedOptimizer step with a joined rank")
        if rank == 0:   # the last to join: the others have joined by the end of this allreduce
            alone = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="join.alone")
            expect(torch.all(alone == 1), f"only rank 0 left: {alone}")
        last = hvd.join()
    expect(last == 0, f"join() returns the last rank to join (0), not {last}")
    expect(torch.all(hvd.allreduce(torch.ones(1), op=hvd.Sum) == size), "after join, all ranks count again")


def check_join_returns_the_last_to_join_without_collectives_between():
    """Rank 0 joins a second after the others, with no collective in between: every rank's join()
    returns 0, the rank that joined last (as Horovod's coordinator, which processes its join last)."""
    if hvd.rank() == 0:
        time.sleep(1.0)
    last = hvd.join()
    every = hvd.allgather_object(last)
    expect(every == [0] * hvd.size(), f"join() returns the rank that joined last (0) on every rank: {every}")


def check_join_after_a_step_the_ranks_with_data_skipped():
    """The ranks with data skip a step after synchronize() (a non-finite norm, GradScaler's
    overflow: decided on averaged gradients, so alike) while one rank sits in join(): no rank
    skipped on its own, so after join() all train on together without a step-count error."""
    rank = hvd.rank()
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def train(step, skip=False):
        opt.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        if not skip:
            with opt.skip_synchronize():
                opt.step()
    for step in range(2 if rank == hvd.size() - 1 else 3):
        train(step, skip=step == 2)
    hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(3, 5):
        train(step)


# ----------------------------------------------------------------------------- DistributedOptimizer
def _train(opt_kwargs, steps, passes=1, clip=None, dtype_tol=1e-12):
    """Train a DistributedOptimizer and a local reference on every rank's batches; compare."""
    size, rank = hvd.size(), hvd.rank()
    model, reference = _mlp(), _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), **opt_kwargs)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scale = size if opt_kwargs.get("op") == hvd.Sum else 1
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(rank, step * passes + k)
            torch.nn.functional.mse_loss(model(x), y).backward()
        per_rank = []
        for r in range(size):
            acc = [torch.zeros_like(p) for p in reference.parameters()]
            for k in range(passes):
                acc = [a + g for a, g in zip(acc, _grads(reference, r, step * passes + k))]
            per_rank.append(acc)
        for p, gs in zip(reference.parameters(), zip(*per_rank)):
            p.grad = sum(gs) / size * scale
        if clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            diff = (p - q).abs().max().item()
            expect(diff <= dtype_tol, f"step {step}: parameters off by {diff}")
    return model, opt


def check_optimizer_step_skipped_after_synchronize():
    """GradScaler's recipe with Horovod: synchronize(), then no step() where the gradients are not
    finite; the next iteration trains as Horovod's does (synchronize() starts a new window)."""
    size, rank = hvd.size(), hvd.rank()
    model, reference = _mlp(), _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        if step == 0:
            continue  # as GradScaler skips a step whose gradients overflowed
        with opt.skip_synchronize():
            opt.step()
        for q, gs in zip(reference.parameters(), zip(*[_grads(reference, r, step) for r in range(size)])):
            q.grad = sum(gs) / size
        ref_opt.step()
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
        expect(diff <= 1e-12, f"step {step}: parameters off by {diff}")


def check_optimizer_averages():
    _train({}, steps=3)
    model, opt = _train({"op": hvd.Sum}, steps=2)
    expect(isinstance(opt, torch.optim.SGD), "the DistributedOptimizer is an instance of the wrapped class")


def check_optimizer_replaced_for_a_new_phase():
    """A second DistributedOptimizer over the same model (a new phase of training) replaces the
    first, which the script dropped: the old one's hooks go with it, as Horovod's do."""
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x = torch.ones(2, 3) * (rank + 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    gc.collect()
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        mean = sum(r + 1 for r in range(hvd.size())) / hvd.size() * 2
        expect(torch.allclose(model.weight.grad, torch.full((1, 3), mean)), f"averaged gradient {model.weight.grad}")


def check_optimizer_backward_passes_per_step():
    model, opt = _train({"backward_passes_per_step": 2}, steps=2, passes=2)
    opt.zero_grad()
    for k in range(2):
        x, y = _batch(hvd.rank(), 50 + k)
        torch.nn.functional.mse_loss(model(x), y).backward()
    x, y = _batch(hvd.rank(), 60)
    expect_raises(AssertionError, lambda: torch.nn.functional.mse_loss(model(x), y).backward(),
                  "more than backward_passes_per_step times")


def check_optimizer_fp16_compression():
    _train({"compression": hvd.Compression.fp16}, steps=3, dtype_tol=2e-3)


def check_optimizer_synchronize_clip():
    model, opt = _train({}, steps=3, clip=0.05)
    opt.zero_grad()
    x, y = _batch(hvd.rank(), 99)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    expect(any("skip_synchronize" in str(w.message) for w in caught), "step() after synchronize() warns")


def check_optimizer_sparse_as_dense():
    size, rank = hvd.size(), hvd.rank()

    def run(sparse):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=sparse).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters(), sparse_as_dense=sparse)
        emb(torch.tensor([rank, rank + 1])).sum().backward()
        opt.step()
        return emb.weight.detach()
    dense, densified = run(False), run(True)
    expect(torch.equal(dense, densified), "sparse_as_dense=True averages as the dense layer does")
    counts = torch.zeros(10, dtype=torch.float64)
    for r in range(size):
        counts[r] += 1
        counts[r + 1] += 1
    torch.manual_seed(0)
    start = torch.nn.Embedding(10, 3).double().weight.detach()
    expect(torch.allclose(dense, start - 0.5 * (counts / size).view(-1, 1)), "the averaged update")

    def sparse_adam(densify):
        # SparseAdam takes sparse gradients only: averaged dense, the gradient is sparse again for it.
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True).double()
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                       named_parameters=emb.named_parameters(), sparse_as_dense=densify)
        for _ in range(2):
            opt.zero_grad()
            emb(torch.tensor([rank, rank + 1])).sum().backward()
            opt.step()
            expect(emb.weight.grad.is_sparse, f"sparse_as_dense={densify}: the gradient SparseAdam got is sparse")
        return emb.weight.detach()
    expect(torch.allclose(sparse_adam(True), sparse_adam(False)), "SparseAdam: sparse_as_dense as the sparse average")


def check_optimizer_sparse_gradients():
    """Without sparse_as_dense, a sparse gradient is averaged as Horovod averages it (every rank's
    rows gathered) and stays sparse for the update; accumulated passes add up; op=Sum sums."""
    rank = hvd.rank()

    def run(sparse, passes=1, op=hvd.Average):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=sparse).double()
        lin = torch.nn.Linear(3, 1).double()
        params = list(emb.parameters()) + list(lin.parameters())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.5), backward_passes_per_step=passes, op=op)
        seen = []
        for k in range(passes):
            lin(emb(torch.tensor([rank, rank + 1 + k]))).sum().backward()
        opt.synchronize()
        seen.append(emb.weight.grad.is_sparse)
        with opt.skip_synchronize():
            opt.step()
        return emb.weight.detach(), lin.weight.detach(), seen
    for passes, op in ((1, hvd.Average), (2, hvd.Average), (1, hvd.Sum)):
        sparse_w, sparse_lin, seen = run(True, passes, op)
        dense_w, dense_lin, _ = run(False, passes, op)
        expect(seen == [True], f"the averaged gradient stays sparse ({passes} passes, {op})")
        expect(torch.allclose(sparse_w, dense_w, atol=1e-12) and torch.allclose(sparse_lin, dense_lin, atol=1e-12),
               f"sparse gradients averaged as the dense layer's ({passes} passes, {op}): {sparse_w - dense_w}")


def check_optimizer_parameter_names():
    """Horovod's own attribute: _parameter_names, each parameter's name, the same on every rank."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = opt._parameter_names
    expect(sorted(names.values()) == ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
                                      "allreduce.noname.1.1"], f"default names: {names}")
    expect(all(names[p] == f"allreduce.noname.{i}.{j}" for i, g in enumerate(opt.param_groups)
               for j, p in enumerate(g["params"])), "a name per parameter, by group and place")
    every = hvd.allgather_object(sorted(names.values()))
    expect(all(n == every[0] for n in every), "the same names on every rank")
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    expect(named._parameter_names == {p: n for n, p in model.named_parameters()}, "names from named_parameters")


def check_broadcast_optimizer_state_without_gradients():
    """A new optimizer's state is made as Horovod makes it (a zero gradient for each trainable
    parameter, none for a frozen one), so a script may broadcast those gradients next."""
    class Indexing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(4))

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x
    model = Indexing()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    expect(opt.param_groups[0]["params"][0].grad is None, "a frozen parameter gets no gradient")
    expect(grad is not None and torch.equal(hvd.broadcast(grad, root_rank=0), grad), "a zero gradient to broadcast")
    expect("momentum_buffer" in opt.state[model.b], f"SGD's state made: {opt.state[model.b]}")
    model(torch.ones(2)).sum().backward()
    opt.step()
    every = hvd.allgather(model.b.detach().view(1, -1))
    expect(all(torch.equal(row, every[0]) for row in every), "the ranks train on alike afterwards")


def check_optimizer_misuse_refused():
    model = _mlp()
    named = list(model.named_parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(sgd, named_parameters=named + named[:1]),
                  "must be unique. Found duplicates: 0.weight")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(sgd, named_parameters=named[1:]),
                  "one or more model parameters were not named")
    expect_raises(NotImplementedError, lambda: hvd.DistributedOptimizer(sgd, op=hvd.Adasum), "Adasum")
    expect_raises(TypeError, lambda: hvd.DistributedOptimizer(model.parameters()),
                  "wraps a torch optimizer, not generator")
    expect_raises(ValueError, lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0),
                  "gradient_predivide_factor not supported with op != Average")
    opt = hvd.DistributedOptimizer(sgd, named_parameters=named)
    expect_raises(NotImplementedError, lambda: opt.step(lambda: 0.0), "closure")
    expect_raises(NotImplementedError, lambda: hvd.ProcessSet(object()), "mpi4py")


def check_optimizer_load_state_dict_ends_the_step():
    """As Horovod's: load_state_dict() after a backward pass ends that step, so zero_grad() may
    follow; training then goes on as if the abandoned pass had not run (with its gradients sent
    at backward, and with them still accumulating locally)."""
    rank = hvd.rank()

    def train(passes, abandon):
        model = _mlp()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=passes)

        def pass_(step):
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.zero_grad()
        for k in range(passes):
            pass_(k)
        opt.step()
        saved = opt.state_dict()
        if abandon:
            opt.zero_grad()
            pass_(10)  # abandoned: the state is loaded again instead of a step
            opt.load_state_dict(saved)
        opt.zero_grad()
        for k in range(passes):
            pass_(20 + k)
        opt.step()
        return [p.detach().clone() for p in model.parameters()]
    for passes in (1, 2):
        expect(all(torch.equal(a, b) for a, b in zip(train(passes, True), train(passes, False))),
               f"backward_passes_per_step={passes}: training after the abandoned pass")


def check_broadcast_optimizer_state_after_reload():
    rank = hvd.rank()
    path = os.path.join(hvd.broadcast_object(tempfile.mkdtemp() if rank == 0 else None, 0), "ckpt.pt")

    def create(lr):
        model = _mlp()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.9)),
                                       named_parameters=model.named_parameters())
        return model, opt
    model, opt = create(0.01)
    for step in range(2):
        opt.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    hvd.barrier()
    model, opt = create(0.5 + rank)          # a fresh optimizer, other hyper-parameters on each rank
    hvd.broadcast_optimizer_state(opt, root_rank=0)   # before any step: root's state, made as Horovod makes it
    fresh = opt.state_dict()["state"]
    expect(opt.param_groups[0]["lr"] == 0.5 and len(fresh) == 4 and all(int(st["step"]) == 1 for st in fresh.values()),
           f"before the first step: root's hyper-parameters and a state made by one zero-gradient step: {fresh}")
    if rank == 0:
        saved = torch.load(path)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    mine = opt.state_dict()
    everyone = hvd.allgather_object(mine)
    for other in everyone:
        expect(other["param_groups"][0]["lr"] == 0.01 and other["param_groups"][0]["betas"] == (0.8, 0.9),
               "hyper-parameters are root's")
        expect(len(other["state"]) == 4, "Adam state for the four parameters")
        for k, st in other["state"].items():
            for name, v in st.items():
                same = torch.equal(v, mine["state"][k][name]) if torch.is_tensor(v) else v == mine["state"][k][name]
                expect(same, f"state {k}.{name} differs between ranks")
    params = hvd.allgather_object([p.detach().clone() for p in model.parameters()])
    expect(all(torch.equal(a, b) for ps in params for a, b in zip(ps, params[0])), "parameters equal")


def check_broadcast_optimizer_state_every_optimizer():
    """As Horovod's test_broadcast_state: every torch.optim optimizer (but LBFGS and SparseAdam),
    its state and hyper-parameters root's on every rank after one step with other settings."""
    rank = hvd.rank()
    classes = sorted((c for c in torch.optim.Optimizer.__subclasses__()
                      if c.__module__.startswith("torch.optim") and c not in (torch.optim.LBFGS, torch.optim.SparseAdam)),
                     key=lambda c: c.__name__)
    expect(len(classes) >= 10, f"only {len(classes)} optimizers found")
    for cls in classes:
        model = _mlp()
        # Muon takes matrices only (its own rule): give it the weights.
        named = [(n, p) for n, p in model.named_parameters() if cls.__name__ != "Muon" or p.dim() == 2]
        opt = hvd.DistributedOptimizer(cls([p for _, p in named], lr=0.01 * (rank + 1)), named_parameters=named)
        x, y = _batch(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        mine = opt.state_dict()
        expect(mine["param_groups"][0]["lr"] == 0.01, f"{cls.__name__}: lr {mine['param_groups'][0]['lr']}")
        root = hvd.broadcast_object(mine, root_rank=0)
        for k, st in root["state"].items():
            for name, v in st.items():
                same = torch.equal(v, mine["state"][k][name]) if torch.is_tensor(v) else v == mine["state"][k][name]
                expect(same, f"{cls.__name__}: state {k}.{name} differs from root's")


def check_topology_queries_are_local():
    rank = hvd.rank()
    if rank == 0:  # Horovod's are local lookups: one rank asking alone must not start a collective
        expect([hvd.cross_size(), hvd.cross_rank(), hvd.local_size(), hvd.is_homogeneous()] == [1, 0, hvd.size(), True],
               "rank 0 alone")
    expect(hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum).item() == sum(range(hvd.size())),
           "the next collective after rank 0's queries")


def check_alltoall_async_returns_received_splits():
    size, rank = hvd.size(), hvd.rank()
    out = hvd.synchronize(hvd.alltoall_async(torch.arange(2.0 * size) + 100 * rank))
    expect(isinstance(out, tuple) and len(out) == 2, f"synchronize gives Horovod's pair: {out}")
    rows, received = out
    expect(rows.tolist() == [100.0 * r + 2 * rank + k for r in range(size) for k in range(2)] and
           received.tolist() == [2] * size, f"{rows} {received}")


def check_synchronize_twice():
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
    expect(torch.all(hvd.synchronize(h) == hvd.size()), "first synchronize")
    expect(hvd.synchronize(h) is None, "a handle synchronized already gives None, as Horovod's")
    expect_raises(ValueError, lambda: hvd.synchronize(10 ** 9), "is not a handle")


def check_broadcast_parameters_of_parameters():
    rank = hvd.rank()
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(rank + 1)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=hvd.size() - 1)
    expect(all(torch.all(p == hvd.size()) for p in model.parameters()), "every rank has root's parameters")


def check_optimizer_unused_parameter_gets_zero_gradient():
    torch.manual_seed(0)
    used, spare = torch.nn.Linear(6, 2).double(), torch.nn.Linear(6, 2).double()
    params = list(used.parameters()) + list(spare.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    x, y = _batch(hvd.rank(), 0)
    torch.nn.functional.mse_loss(used(x) + spare(x), y).backward()   # step 0: every rank uses spare
    opt.step()
    opt.zero_grad()
    before = spare.weight.detach().clone()
    buf = opt.state[spare.weight]["momentum_buffer"].clone()
    torch.nn.functional.mse_loss(used(x), y).backward()              # step 1: no rank does
    opt.step()
    expect(spare.weight.grad is not None and torch.all(spare.weight.grad == 0), f"zero gradient: {spare.weight.grad}")
    expect(torch.allclose(spare.weight, before - 0.1 * 0.9 * buf), "momentum moves it, as in Horovod")


def check_optimizer_zero_grad_before_step_refused():
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2)
    x, y = _batch(hvd.rank(), 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    expect_raises(AssertionError, opt.zero_grad, "before optimizer.step() or optimizer.synchronize()",
                  f"rank {hvd.rank()}")
    expect(all(p.grad is not None for p in model.parameters()), "the gradients are kept")
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    opt.zero_grad()                                                  # allowed once averaged, as Horovod's
    with opt.skip_synchronize():
        opt.step()


def check_optimizer_set_backward_passes_per_step():
    rank, size = hvd.rank(), hvd.size()
    model, ref = _mlp(), _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.set_backward_passes_per_step(2)
    expect(opt.backward_passes_per_step == 2, "attribute")
    for step in range(2):
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    want = [torch.zeros_like(p) for p in ref.parameters()]
    for r in range(size):
        for step in range(2):
            _grads(ref, r, step)
            want = [w + p.grad / size for w, p in zip(want, ref.parameters())]
    got = [p.grad for p in model.parameters()]
    expect(all(torch.allclose(g, w) for g, w in zip(got, want)), "two passes summed, averaged over ranks")
    expect_raises(ValueError, lambda: opt.set_backward_passes_per_step(0), "positive integer")


def check_optimizer_state_dict_hooks():
    model = _mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "epoch": 2})
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load_post"))
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    expect(saved["epoch"] == 2 and seen == ["pre", "load_pre", "load_post"], f"hooks: {seen}")


def check_sync_batch_norm_copies_and_pickles():
    import copy
    import io
    hvd.shutdown()
    early = hvd.SyncBatchNorm(4)                                      # before hvd.init(), as Horovod allows
    hvd.init()
    expect(isinstance(early, torch.nn.modules.batchnorm._BatchNorm), "a _BatchNorm, as Horovod's")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), early)
    twin = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(3 + hvd.rank(), 3, generator=torch.Generator().manual_seed(hvd.rank()))
    y = model(x)
    expect(torch.allclose(twin(x), y) and torch.allclose(loaded(x), y), "the copies normalize over the job as well")


def check_sync_batch_norm():
    size, rank = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(7)
    sizes = [3, 5, 2, 4][:size]
    full = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
    grad_out = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
    start = sum(sizes[:rank])
    bn = hvd.SyncBatchNorm(4).double()
    dense = torch.nn.BatchNorm1d(4).double()
    x = full[start:start + sizes[rank]].clone().requires_grad_()
    xd = full.clone().requires_grad_()
    y = bn(x)
    yd = dense(xd)
    expect(torch.allclose(y, yd[start:start + sizes[rank]], atol=1e-10), "forward")
    y.backward(grad_out[start:start + sizes[rank]])
    yd.backward(grad_out)
    expect(torch.allclose(x.grad, xd.grad[start:start + sizes[rank]], atol=1e-10), "input gradient")
    wg = hvd.allreduce(bn.weight.grad, op=hvd.Sum)
    expect(torch.allclose(wg, dense.weight.grad, atol=1e-10), "weight gradient (summed over ranks)")
    expect(torch.allclose(bn.running_mean, dense.running_mean) and torch.allclose(bn.running_var, dense.running_var),
           "running statistics")


def main():
    checks = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}
    names = list(checks) if sys.argv[1:] == ["all"] else sys.argv[1:]
    hvd.init()
    for name in names:
        checks[name]()
        if hvd.rank() == 0:
            print(f"PASS {name}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
