"""Checks run inside every rank of a real multi-process job (see tests/test_communicator.py).

Usage: python comm_checks.py [--name flat] CHECK [CHECK ...]   (or "all")
Each check asserts on every rank and prints "PASS <check>" on rank 0.
"""
import os
import sys

import time

import torch

import torchmn
from torchmn.communicators.errors import RemoteRankError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import expect, run_checks  # noqa: E402

DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


def check_failed_send_fails_the_receiver(comm):
    """A send that fails on the sender (a dtype that cannot travel, a tuple) makes the waiting
    receiver raise at once, not at the timeout; the pair then goes on."""
    if comm.size < 2 or comm.rank > 1:
        return
    for bad, words in ((torch.zeros(3, dtype=torch.complex32), "cannot send tensors of dtype torch.complex32"),
                       ((torch.ones(2), torch.ones(2)), "pass a tensor, not tuple")):
        start = time.monotonic()
        if comm.rank == 0:
            e = expect(TypeError, lambda: comm.send(bad, 1))
            assert words in str(e) and "rank 1's recv raises too" in str(e), e
        else:
            e = expect(RemoteRankError, lambda: comm.recv(0))
            assert "rank 0's send to rank 1 failed there" in str(e), e
            assert time.monotonic() - start < 5, time.monotonic() - start
    if comm.rank == 0:
        comm.send(torch.arange(4), 1)
    else:
        assert torch.equal(comm.recv(0), torch.arange(4))


def check_ring(comm):
    for shape in [(50,), (50, 20), (50, 20, 5)]:
        x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + comm.rank
        nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        if comm.rank == 0:
            comm.send(x, nxt)
            got = comm.recv(prv)
        else:
            got = comm.recv(prv)
            comm.send(x, nxt)
        expect = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + prv
        assert got.shape == torch.Size(shape) and torch.equal(got, expect), (shape, got)
    # A message to or from this rank itself would wait for itself: refused at once, naming why.
    for call in (lambda: comm.send(x, comm.rank), lambda: comm.recv(comm.rank), lambda: comm.send_obj(1, comm.rank),
                 lambda: comm.recv_obj(comm.rank)):
        try:
            call()
        except ValueError as e:
            assert f"={comm.rank} is this rank" in str(e), e
        else:
            raise AssertionError("a message to this rank itself was accepted")


def _inputs(dtype):
    """A 0-d tensor, a contiguous one and a non-contiguous (transposed) one, all depending on rank."""
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    return {
        "scalar": torch.tensor(7, dtype=dtype),
        "contiguous": base.to(dtype),
        "non_contiguous": base.to(dtype).t(),
    }


def check_collectives(comm):
    r, n = comm.rank, comm.size
    for dtype in DTYPES:
        for label, x0 in _inputs(dtype).items():
            x = x0 + r
            assert (label != "non_contiguous") or not x0.is_contiguous()
            where = f"{dtype} {label}"
            # allreduce: every op
            assert torch.equal(comm.allreduce(x), sum(x0 + k for k in range(n))), where
            assert torch.equal(comm.allreduce(x, op="max"), x0 + n - 1), where
            assert torch.equal(comm.allreduce(x, op="min"), x0), where
            prod = x0.clone()
            for k in range(1, n):
                prod = prod * (x0 + k)
            assert torch.equal(comm.allreduce(x, op="prod"), prod), where
            mean = comm.allreduce(x, op="mean")
            assert torch.allclose(mean.double(), x0.double() + (n - 1) / 2), where
            # allreduce_: the same results, written into the tensor passed (non-contiguous too)
            for op, want in (("sum", sum(x0 + k for k in range(n))), ("max", x0 + n - 1), ("min", x0)):
                y = x.clone()  # keeps the strides: the non-contiguous case stays non-contiguous
                assert comm.allreduce_(y, op=op) is y and torch.equal(y, want), (where, op)
            if dtype.is_floating_point:
                y = x.clone()
                comm.allreduce_(y, op="mean")
                assert torch.allclose(y.double(), x0.double() + (n - 1) / 2), where
            else:  # an integer mean is float64: it cannot be written back, so it is refused on every rank
                try:
                    comm.allreduce_(x.clone(), op="mean")
                    raise AssertionError(f"allreduce_ mean of {dtype} was accepted")
                except TypeError as e:
                    assert "use comm.allreduce(x, op='mean')" in str(e), e
            # bcast from every root
            for root in range(n):
                got = comm.bcast(x if r == root else None, root=root)
                assert got.dtype == dtype and torch.equal(got, x0 + root), where
            # gather / allgather
            for root in range(n):
                parts = comm.gather(x, root=root)
                if r == root:
                    assert len(parts) == n and all(torch.equal(p, x0 + k) for k, p in enumerate(parts)), where
                else:
                    assert parts is None
            parts = comm.allgather(x)
            assert all(p.dtype == dtype and torch.equal(p, x0 + k) for k, p in enumerate(parts)), where
            # scatter from every root
            for root in range(n):
                xs = [x0 + 10 * k + root for k in range(n)] if r == root else None
                got = comm.scatter(xs, root=root)
                assert torch.equal(got, x0 + 10 * r + root), where
            # alltoall: rank r sends x0 + 100 r + j to rank j
            got = comm.alltoall([x0 + 100 * r + j for j in range(n)])
            assert all(torch.equal(g, x0 + 100 * k + r) for k, g in enumerate(got)), where
            # point to point with the non-contiguous input
            if n > 1:
                if r == 0:
                    comm.send(x, 1)
                elif r == 1:
                    got = comm.recv(0)
                    assert got.dtype == dtype and torch.equal(got, x0), where


def check_arange(comm):
    for n in (1, 10, 1000, 100_003):
        got = comm.allreduce(torch.arange(n) + comm.rank)
        assert torch.equal(got, torch.arange(n) * comm.size + sum(range(comm.size))), n
    # int16, which gloo cannot reduce, wrapping around as int16 does; complex "prod", which
    # torch.distributed refuses, is refused on every rank before anything is sent.
    x = torch.tensor([32000, -7, 3], dtype=torch.int16) + comm.rank
    every = torch.stack([torch.tensor([32000, -7, 3], dtype=torch.int16) + r for r in range(comm.size)])
    assert torch.equal(comm.allreduce(x), every.sum(0, dtype=torch.int16))
    assert torch.equal(comm.allreduce(x, op="max"), every.max(0).values)
    try:
        comm.allreduce(torch.ones(2, dtype=torch.complex64), op="prod")
    except ValueError as e:
        assert "no 'prod' of complex" in str(e), e
    else:
        raise AssertionError("complex prod was not refused")
    assert comm.allreduce_obj(1) == comm.size  # still in step


def check_allgather_uneven(comm):
    x = torch.full((comm.rank + 1, 3), float(comm.rank))
    parts = comm.allgather(x)
    for k, p in enumerate(parts):
        assert p.shape == (k + 1, 3) and torch.equal(p, torch.full((k + 1, 3), float(k)))
    parts = comm.gather(torch.arange(comm.rank * 2), root=0)
    if comm.rank == 0:
        assert [p.numel() for p in parts] == [2 * k for k in range(comm.size)]
    got = comm.scatter([torch.ones(k, 2) for k in range(comm.size)] if comm.rank == 0 else None)
    assert got.shape == (comm.rank, 2)
    # alltoall with sizes that differ by sender and by receiver, also on a communicator whose rank
    # order is the reverse of the process group's.
    for c in (comm, comm.split(color=0, key=-comm.rank)):
        got = c.alltoall([torch.full((c.rank + 1, j + 1), float(10 * c.rank + j)) for j in range(c.size)])
        for k, g in enumerate(got):
            assert torch.equal(g, torch.full((k + 1, c.rank + 1), float(10 * k + c.rank))), (k, g)


def _model():
    torch.manual_seed(int(os.environ.get("RANK", os.environ.get("TORCHMN_RANK", "0"))) + 1)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3))
    m[1].running_mean.normal_()
    return m


def check_bcast_data(comm):
    m = _model()
    comm.bcast_data(m)
    mine = [t.clone() for t in list(m.parameters()) + list(m.buffers())]
    roots = comm.bcast_obj(mine)
    for a, b in zip(mine, roots):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    # The same for a model whose parameters hold NaN and -0.0: bit for bit, not by value.
    m2 = _model()
    with torch.no_grad():
        m2[0].weight[0, 0] = float("nan") if comm.rank == 0 else 1.0
        m2[0].weight[0, 1] = -0.0 if comm.rank == 0 else 0.0
    comm.bcast_data(m2)
    assert torch.isnan(m2[0].weight[0, 0]) and str(m2[0].weight[0, 1].item()) == "-0.0"


def check_mean_grad(comm):
    for name in ("naive", "flat", "hierarchical"):
        c = torchmn.communicators.make_communicator(name, rank=comm.rank, size=comm.size,
                                                    group=comm.process_group, obj_group=comm.object_group,
                                                    backend=comm.backend, node_key=comm.node_key,
                                                    bucket_cap_bytes=200)
        m = _model()
        for k, p in enumerate(m.parameters()):
            p.grad = torch.full_like(p, float(comm.rank + k))
        c.multi_node_mean_grad(m)
        for k, p in enumerate(m.parameters()):
            assert torch.allclose(p.grad, torch.full_like(p, (comm.size - 1) / 2 + k)), (name, k)
        # A gradient set by hand as a view into a larger buffer: averaged alone, the rest untouched
        lin = torch.nn.Linear(4, 3, bias=False)
        big = torch.full((3, 8), 100.0 * (comm.rank + 1))
        big[:, :4] = comm.rank + 1.0
        lin.weight.grad = big[:, :4]
        c.multi_node_mean_grad(lin)
        assert torch.equal(lin.weight.grad, torch.full((3, 4), (comm.size + 1) / 2)), (name, lin.weight.grad)
        assert torch.equal(big[:, 4:], torch.full((3, 4), 100.0 * (comm.rank + 1))), (name, big)
        # Parameters of several dtypes in one model (on one node: one shared-memory mean for all)
        mixed = torch.nn.ModuleList([torch.nn.Linear(3, 2).double(), torch.nn.Linear(2, 2).half(), torch.nn.Linear(5, 4)])
        for k, p in enumerate(mixed.parameters()):
            p.grad = torch.full_like(p, float(2 * comm.rank + k))
        for _ in range(2):  # the second call takes the plan made by the first
            c.multi_node_mean_grad(mixed)
            for k, p in enumerate(mixed.parameters()):
                # float16 is divided before it is summed (no overflow), so it is rounded on 3 ranks
                tol = 1e-3 if p.dtype == torch.float16 else 0
                assert p.grad.dtype == p.dtype and torch.allclose(p.grad, torch.full_like(p, comm.size - 1.0 + k),
                                                                  rtol=tol, atol=0), (name, k, p.dtype, p.grad)
        # zero_fill: a grad that is None everywhere becomes zeros; one skipped stays None
        for p in m.parameters():
            p.grad = None
        m[2].bias.grad = torch.full((3,), float(comm.rank))
        c.multi_node_mean_grad(m, zero_fill=True)
        assert torch.equal(m[0].weight.grad, torch.zeros(7, 5))
        assert torch.allclose(m[2].bias.grad, torch.full((3,), (comm.size - 1) / 2))
        for p in m.parameters():
            p.grad = None
        m[2].bias.grad = torch.ones(3)
        c.multi_node_mean_grad(m)
        assert m[0].weight.grad is None and torch.equal(m[2].bias.grad, torch.ones(3))
        # zero_fill=False with a gradient missing on one rank only: every rank is told, none mixes
        if comm.size > 1:
            m[2].bias.grad = None if comm.rank == 1 else torch.ones(3)
            try:
                c.multi_node_mean_grad(m)
                raise AssertionError("a gradient missing on rank 1 only was accepted")
            except torchmn.CollectiveMismatchError as e:
                assert "rank(s) [1] only" in str(e) and "zero_fill=True" in str(e), e
            # A model of another layout on one rank: named on every rank, never mixed (shared memory
            # summed it silently, gloo aborted the process).
            other = torch.nn.Linear(4, 4 if comm.rank == 1 else 3)
            for p in other.parameters():
                p.grad = torch.ones_like(p)
            for zero_fill in (False, True):
                try:
                    c.multi_node_mean_grad(other, zero_fill=zero_fill)
                    raise AssertionError(f"{name}: a model of another shape on rank 1 was accepted")
                except torchmn.CollectiveMismatchError as e:
                    assert "tensor 0 is (4, 4) float32 there, (3, 4) float32 on rank 0" in str(e), e
        # Sparse gradients (nn.Embedding(sparse=True)) are averaged too, each on its own.
        torch.manual_seed(0)
        emb = torch.nn.Embedding(6, 2, sparse=True)
        lin = torch.nn.Linear(2, 1)
        both = torch.nn.ModuleList([emb, lin])
        lin(emb(torch.tensor([comm.rank % 6, 5]))).sum().mul(comm.rank + 1).backward()
        dense = emb.weight.grad.to_dense()
        c.multi_node_mean_grad(both)
        expect = torch.zeros(6, 2)
        for r in range(comm.size):
            expect[[r % 6, 5]] += lin.weight.detach()[0] * (r + 1) / comm.size
        assert dense.abs().sum() > 0 and torch.allclose(emb.weight.grad.to_dense(), expect), (name, emb.weight.grad)
        # zero_fill with no gradient on rank 1: its zeros are sparse too (a dense fill waited for ever).
        both.zero_grad()
        if comm.rank != 1:
            lin(emb(torch.tensor([comm.rank % 6, 5]))).sum().mul(comm.rank + 1).backward()
        c.multi_node_mean_grad(both, zero_fill=True)
        expect = torch.zeros(6, 2)
        for r in range(comm.size):
            if r != 1:
                expect[[r % 6, 5]] += lin.weight.detach()[0] * (r + 1) / comm.size
        assert emb.weight.grad.is_sparse and torch.allclose(emb.weight.grad.to_dense(), expect), name
    # A mean beyond float16's / bfloat16's range does not overflow; an int64 mean is exact in float64.
    assert comm.allreduce(torch.full((3,), 40000.0, dtype=torch.float16), op="mean").tolist() == [40000.0] * 3
    big = comm.allreduce(torch.full((2,), 3e38, dtype=torch.bfloat16), op="mean")
    assert big.dtype == torch.bfloat16 and torch.isfinite(big).all(), big
    mean = comm.allreduce(torch.tensor([2 ** 40 + 1 + comm.rank]), op="mean")
    assert mean.dtype == torch.float64 and mean.item() == 2 ** 40 + 1 + (comm.size - 1) / 2, mean
    # bool mean counts the True values; complex max is refused on every rank; conjugate views travel
    mean = comm.allreduce(torch.tensor([True, comm.rank == 0]), op="mean")
    assert torch.allclose(mean, torch.tensor([1.0, 1.0 / comm.size], dtype=torch.float64)), mean
    try:
        comm.allreduce(torch.ones(2, dtype=torch.complex64), op="max")
        raise AssertionError("complex max was accepted")
    except (ValueError, torchmn.communicators.RemoteRankError) as e:
        assert "complex" in str(e), e
    # uint16-64 and float8 travel as bytes, bit for bit, but are not reduced (no CPU arithmetic)
    for dtype in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2):
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype) if dtype.is_floating_point \
            else torch.arange(6, dtype=torch.int64).reshape(2, 3).to(dtype)
        got = comm.bcast(x if comm.rank == 0 else None)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), x.view(torch.uint8)), dtype
        assert all(torch.equal(p.view(torch.uint8), x.view(torch.uint8)) for p in comm.allgather(x))
        try:
            comm.allreduce(x)
            raise AssertionError(f"allreduce of {dtype} was accepted")
        except TypeError as e:
            assert "no arithmetic" in str(e), e
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert torch.equal(comm.bcast(z.conj() if comm.rank == 0 else None), z.conj())


def check_objects(comm):
    r, n = comm.rank, comm.size
    assert comm.bcast_obj({"root": r} if r == 0 else None) == {"root": 0}
    assert comm.allgather_obj(("r", r)) == [("r", k) for k in range(n)]
    # One rank's object larger than a shared-memory slot: every rank takes the large-object path.
    segment = getattr(comm, "segment", None)
    big = b"x" * ((segment.slot_bytes if segment is not None else 1 << 20) + 1)
    assert comm.allgather_obj(big if r == n - 1 else r) == [*range(n - 1), big]
    g = comm.gather_obj([r] * r, root=n - 1)
    assert (g == [[k] * k for k in range(n)]) if r == n - 1 else g is None
    assert comm.scatter_obj([f"to {k}" for k in range(n)] if r == 0 else None) == f"to {r}"
    # Root passing the wrong number of objects: every rank raises at once, not at the timeout.
    try:
        comm.scatter_obj([1] * (n + 1) if r == 0 else None)
        raise AssertionError("scatter_obj took n + 1 objects")
    except (ValueError, RemoteRankError) as e:
        assert isinstance(e, ValueError if r == 0 else RemoteRankError) and "objects (one per rank)" in str(e), e
    if n > 1:  # an object root cannot pickle, for the last rank: that rank hears it, the others are served
        try:
            got = comm.scatter_obj(list(range(n - 1)) + [lambda: 0] if r == 0 else None)
        except Exception as e:
            assert r in (0, n - 1) and isinstance(e, RemoteRankError) == (r == n - 1), e
        else:
            assert r not in (0, n - 1) and got == r, (r, got)
    assert comm.allreduce_obj(r) == sum(range(n))
    assert comm.allreduce_obj([r]) == list(range(n))
    if n > 1:
        if r == 0:
            comm.send_obj({"x": torch.ones(2)}, 1)
        elif r == 1:
            assert torch.equal(comm.recv_obj(0)["x"], torch.ones(2))
    comm.barrier()


def check_big_obj(comm):
    size_mb = int(os.environ.get("BIG_OBJ_MB", "300"))
    obj = None
    if comm.rank == 0:
        payload = bytes(range(256)) * (size_mb * 1024 * 1024 // 256)
        obj = {"payload": payload, "tail": "end"}
    got = comm.bcast_obj(obj)
    assert len(got["payload"]) == size_mb * 1024 * 1024 and got["tail"] == "end"
    assert got["payload"][:512] == bytes(range(256)) * 2 and got["payload"][-1] == 255


def check_topology(comm):
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")))
    if local is not None:
        assert comm.intra_rank == int(local), (comm.intra_rank, local)
    rows = comm.allgather_obj((comm.inter_rank, comm.intra_rank, comm.intra_size, comm.inter_size))
    for node in range(comm.inter_size):
        intra = sorted(i for nd, i, _, _ in rows if nd == node)
        assert intra == list(range(len(intra))), rows
        assert all(s == len(intra) for nd, _, s, _ in rows if nd == node), rows
    assert all(inter == comm.inter_size for *_, inter in rows)
    # On a machine with GPUs (tests/gpu/run_all.sh runs these checks there too) the default is
    # NCCL, and every check here moves CPU tensors through it.
    if torch.cuda.is_available():
        assert comm.device.type == "cuda" and comm.backend == "nccl", (comm.device, comm.backend)
    else:
        assert comm.device == torch.device("cpu") and comm.backend == "gloo", (comm.device, comm.backend)
    if rank0(comm):
        print(f"TOPOLOGY size={comm.size} inter_size={comm.inter_size} intra_size={comm.intra_size}", flush=True)


def check_split(comm):
    comm.compression = "bf16"  # as allreduce_grad_dtype=torch.bfloat16 sets it: the split keeps it
    sub = comm.split(color=comm.rank % 2, key=-comm.rank)
    comm.compression = None
    assert sub.compression == "bf16", sub.compression
    members = [k for k in range(comm.size) if k % 2 == comm.rank % 2]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, reverse=True).index(comm.rank)  # key=-rank reverses the order
    total = sub.allreduce(torch.tensor([comm.rank]))
    assert total.item() == sum(members)
    assert sub.allgather_obj(comm.rank) == sorted(members, reverse=True)
    if sub.size > 1:
        if sub.rank == 0:
            sub.send(torch.tensor([comm.rank]), 1)
        elif sub.rank == 1:
            assert sub.recv(0).item() == sorted(members, reverse=True)[0]
    # A color that is not an int on one rank: refused on every rank, naming it; the communicator goes on.
    try:
        comm.split(color=[1] if comm.rank == 0 else 0)
    except TypeError as e:
        assert "split: color and key must be ints" in str(e) and "rank 0 passed color=[1], key=0" in str(e), e
    else:
        raise AssertionError("no error")
    assert comm.allgather_obj(comm.rank) == list(range(comm.size))


def check_nested_split(comm):
    """Sub-communicators split by their own ranks alone: both halves at the same time, then one
    half only (so the ranks' histories differ), then the whole world and the halves again: every
    group gets its own members, and nobody waits for ranks that are not splitting."""
    half = comm.split(color=comm.rank % 2, key=-comm.rank)
    members = sorted((r for r in range(comm.size) if r % 2 == comm.rank % 2), reverse=True)
    for _ in range(2):
        quarter = half.split(color=half.rank % 2, key=half.rank)
        mine = [m for i, m in enumerate(members) if i % 2 == members.index(comm.rank) % 2]
        assert quarter.allgather_obj(comm.rank) == mine, (comm.rank, mine)
        assert quarter.allreduce(torch.tensor([comm.rank])).item() == sum(mine)
        if comm.rank % 2 == 0:
            assert half.split(color=0, key=-half.rank).allgather_obj(comm.rank) == members[::-1]
        again = comm.split(color=0, key=-comm.rank)
        assert again.allgather_obj(comm.rank) == sorted(range(comm.size), reverse=True)
        assert again.allreduce(torch.tensor([1])).item() == comm.size
    assert half.allreduce(torch.tensor([comm.rank])).item() == sum(members)
    # Across nodes, a node's first rank belongs to one group more than the others (the group
    # between nodes): a split of the ranks of one node mixes the two histories.
    node = comm.split(color=comm.inter_rank)
    twice = node.split(color=0, key=-node.rank)
    assert twice.allreduce(torch.tensor([comm.rank])).item() == sum(r for r in range(comm.size)
                                                                     if comm.node_of(r) == comm.inter_rank)


def check_finalized_split_lets_go_of_its_groups(comm):
    """split and finalize over and over (as per-layer groups or process sets do): each finalize
    releases the process groups split made for it, so the rank's open files stay put, and the
    parent and a sibling split off before go on."""
    def open_files():
        return len(os.listdir("/proc/self/fd"))
    sibling = comm.split(color=0, key=comm.rank)
    for cycle in range(4):
        if cycle == 1:  # after one cycle, which may open what stays open (gloo's device)
            before = open_files()
        half = comm.split(color=comm.rank % 2, key=comm.rank)  # every rank of comm makes every group
        inner = half.split(color=0, key=-half.rank)  # its members alone make it
        assert inner.allreduce(torch.tensor([1])).item() == half.size
        inner.finalize()
        half.finalize()
        half.finalize()  # twice is harmless
    grown = open_files() - before
    assert grown <= 2, f"{grown} files more after 3 split-finalize cycles"  # a leak is 4 or more a cycle
    assert "finalized" in str(expect(RuntimeError, lambda: half.allreduce(torch.tensor([1]))))
    assert sibling.allreduce(torch.tensor([1])).item() == comm.size
    assert comm.allreduce(torch.tensor([1])).item() == comm.size


def check_shard_primitives(comm):
    """reduce_scatter_flat / allgather_flat (the sharded optimizer's) against their definition, on
    the communicator and on one whose rank order is reversed (across nodes: rails in another order)."""
    # 37: not a multiple of anything; between nodes 150,037 float64 (1.2 MB a chunk) go through gloo
    # in pieces, the last one shorter than the others.
    sizes = (37, 150_037)
    for c, k in [(c, k) for c in (comm, comm.split(color=0, key=-comm.rank)) for k in sizes]:
        flat = torch.arange(c.size * k, dtype=torch.float64) + 1000 * c.rank
        shard = torch.empty(k, dtype=torch.float64)
        c.reduce_scatter_flat(flat, shard, async_op=True).wait()
        expect = torch.arange(c.rank * k, (c.rank + 1) * k, dtype=torch.float64) * c.size + 1000 * sum(range(c.size))
        assert torch.equal(shard, expect), (c.rank, shard[:3], expect[:3])
        gathered = torch.empty(c.size * k, dtype=torch.float64)
        c.allgather_flat(gathered, torch.full((k,), float(c.rank), dtype=torch.float64), async_op=True).wait()
        assert torch.equal(gathered, torch.arange(c.size, dtype=torch.float64).repeat_interleave(k)), gathered


def check_flat_in_flight(comm):
    """Several gradient-path collectives in flight at once, as the optimizers launch them during
    backward (across nodes the network part runs in the background), then waited in order."""
    f64 = torch.float64
    pending = []
    for i, k in enumerate((37, 37, 150_037)):  # the last, between nodes, in pieces through gloo
        base = torch.arange(comm.size * k, dtype=f64)
        flat = base + 1000 * comm.rank + i
        pending.append(("allreduce", i, flat, None, base, comm.allreduce_flat(flat, async_op=True)))
        shard = torch.empty(k, dtype=f64)
        pending.append(("reduce_scatter", i, None, shard, base,
                        comm.reduce_scatter_flat(base + 1000 * comm.rank + i, shard, async_op=True)))
        gathered = torch.empty(comm.size * k, dtype=f64)
        pending.append(("allgather", i, gathered, None, base,
                        comm.allgather_flat(gathered, torch.full((k,), float(comm.rank + i), dtype=f64),
                                            async_op=True)))
    ranks_sum = 1000 * sum(range(comm.size))
    for kind, i, flat, shard, base, work in pending:
        work.wait()
        k = base.numel() // comm.size
        if kind == "allreduce":
            expect = base * comm.size + ranks_sum + comm.size * i
            assert torch.equal(flat, expect), (kind, i, flat[:3], expect[:3])
        elif kind == "reduce_scatter":
            expect = base[comm.rank * k:(comm.rank + 1) * k] * comm.size + ranks_sum + comm.size * i
            assert torch.equal(shard, expect), (kind, i, shard[:3], expect[:3])
        else:
            expect = (torch.arange(comm.size, dtype=f64) + i).repeat_interleave(k)
            assert torch.equal(flat, expect), (kind, i, flat[:3], expect[:3])


def check_cpu_under_nccl(comm):
    """A communicator whose tensor backend is NCCL (a GPU machine's default) carries CPU tensors
    the CPU's way, through its CPU group and the node's shared memory, with the results of a
    gloo communicator bit for bit; on a machine without GPUs its groups are gloo's, on one with
    GPUs (tests/gpu/run_all.sh) real NCCL and gloo."""
    from torchmn.communicators import make_communicator
    c = make_communicator("auto", rank=comm.rank, size=comm.size, group=comm.process_group,
                          obj_group=comm.object_group, backend="nccl", node_key=comm.node_key)
    assert c.name == "hierarchical" and c.may_share_node_memory() == (comm.inter_size == 1), c
    cpu = torch.device("cpu")
    f64 = torch.arange(300, dtype=torch.float64) * (comm.rank + 1) / 7
    assert c.wire_device(f64) == cpu and c.wire_device(cpu) == cpu
    for op in ("sum", "max", "mean"):
        assert torch.equal(c.allreduce(f64, op=op), comm.allreduce(f64, op=op)), op
    big = torch.rand(1 << 16, dtype=torch.float64, generator=torch.Generator().manual_seed(comm.rank))
    assert torch.equal(c.allreduce(big), comm.allreduce(big))
    root = comm.size - 1
    got = c.bcast(f64 if comm.rank == root else None, root=root)
    assert got.device == cpu and torch.equal(got, comm.bcast(f64 if comm.rank == root else None, root=root))
    assert all(torch.equal(a, b) for a, b in zip(c.allgather(f64[:comm.rank + 1]), comm.allgather(f64[:comm.rank + 1])))
    parts = [f64[:r + 2] + r for r in range(comm.size)]
    assert torch.equal(c.scatter(parts if comm.rank == 0 else None), comm.scatter(parts if comm.rank == 0 else None))
    assert all(torch.equal(a, b) for a, b in zip(c.alltoall(parts), comm.alltoall(parts)))
    gathered = c.gather(f64, root=0)
    if comm.rank == 0:
        assert all(torch.equal(g, torch.arange(300, dtype=torch.float64) * (r + 1) / 7) for r, g in enumerate(gathered))
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if comm.size > 1:
        if comm.rank % 2 == 0:
            c.send(f64, nxt)
            got = c.recv(prv)
        else:
            got = c.recv(prv)
            c.send(f64, nxt)
        assert got.device == cpu and torch.equal(got, torch.arange(300, dtype=torch.float64) * (prv + 1) / 7)
    assert c.allgather_obj({"rank": comm.rank}) == [{"rank": r} for r in range(comm.size)]
    c.barrier()
    # A CPU model trains on it as on the gloo communicator: the default optimizer, replicated and sharded.
    for kwargs in ({}, {"shard_state": False}, {"shard_state": True}):
        ends = []
        for on in (c, comm):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()
            opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters(), lr=0.01), on, **kwargs)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + comm.rank)
                x, y = torch.randn(5, 6, dtype=torch.float64, generator=g), torch.randn(5, 2, dtype=torch.float64, generator=g)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            if on is c and not kwargs and comm.inter_size == 1:
                assert type(opt).__name__ == "NodeSharedOptimizer", type(opt)  # the node's shared memory
            ends.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        assert torch.equal(ends[0], ends[1]), kwargs
    c.finalize()


def check_integer_mean_does_not_wrap(comm):
    """The float64 mean of integers whose sum leaves their dtype (int8's 127, int32's 2**31, int64's 2**63)."""
    for dtype, value in [(torch.int8, 100), (torch.uint8, 200), (torch.int16, 30000), (torch.int32, 2 ** 30 + 5),
                         (torch.bool, True), (torch.int64, 2 ** 40), (torch.int64, 2 ** 62)]:
        out = comm.allreduce(torch.full((5,), value, dtype=dtype), op="mean")
        assert out.dtype == torch.float64 and torch.all(out == float(value)), (dtype, out)


def check_allgather_obj_gives_copies_whatever_the_size(comm):
    """Every entry of allgather_obj's list is a copy, this rank's own too, for small objects (one
    message) and for large ones (over 256 MiB in all: each rank's sent in turn)."""
    for size in (1024, (256 << 20) // comm.size + 1):
        mine = bytearray(size)
        mine[0] = comm.rank
        got = comm.allgather_obj(mine)
        assert got[comm.rank] is not mine and [g[0] for g in got] == list(range(comm.size)), size
        del got


def nan_max_min_inputs(rank, size, n, dtype):
    """Rank ``rank``'s tensor of ``n`` values: NaN at ``rank`` (so every rank's NaN is somewhere of
    its own), +inf and -inf beside finite values, and what max and min over ``size`` ranks must give
    (NaN wherever any rank has one, as torch.maximum has it)."""
    def values(r):
        x = torch.arange(n, dtype=dtype) * (r + 1) - n
        x[r] = float("nan")
        x[size], x[size + 1] = float("inf"), float("-inf")
        return x
    stacked = torch.stack([values(r) for r in range(size)])
    return values(rank), stacked.max(0).values, stacked.min(0).values


def check_max_and_min_keep_nan(comm):
    """A NaN on any rank wins a max or a min, on every path (small tensors that travel with the call
    check, gloo's, shared memory's) and in place, as in torch.maximum: gloo alone keeps a NaN only
    where it comes first."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for n in (8, 70_000):
            x, most, least = nan_max_min_inputs(comm.rank, comm.size, n, dtype)
            for op, expected in (("max", most), ("min", least)):
                out = comm.allreduce(x, op=op)
                assert torch.equal(out.isnan(), expected.isnan()), (dtype, n, op, out[:8])
                assert torch.equal(out.nan_to_num(), expected.nan_to_num()), (dtype, n, op)
                y = x.clone()
                comm.allreduce_(y, op=op)
                assert torch.equal(y.isnan(), expected.isnan()), (dtype, n, op, "in place", y[:8])
                assert torch.equal(y.nan_to_num(), expected.nan_to_num()), (dtype, n, op, "in place")


def _expect_mismatch(call, *words):
    try:
        call()
    except torchmn.CollectiveMismatchError as e:
        assert all(w in str(e) for w in words), (words, str(e))
    else:
        raise AssertionError(f"no CollectiveMismatchError naming {words}")


def check_calls_built_on_allgather_obj_are_told_apart(comm):
    """allreduce_obj, split and bcast_data's layout check are collectives of their own: ranks making
    one of them against an allgather_obj, or bcast_data with other roots, raise on every rank
    (they took each other's objects, or waited out the timeout)."""
    if comm.size == 1:
        return
    _expect_mismatch(lambda: comm.allreduce_obj(5) if comm.rank == 0 else comm.allgather_obj(5),
                     "allreduce_obj", "allgather_obj")
    _expect_mismatch(lambda: comm.split(0) if comm.rank == 0 else comm.allgather_obj("x"), "split")
    _expect_mismatch(lambda: comm.bcast_data(torch.nn.Linear(2, 2), root=comm.rank), "root differs")
    assert comm.allreduce_obj(comm.rank) == sum(range(comm.size))  # the communicator goes on


def check_zero_fill_must_agree(comm):
    """Ranks passing different zero_fill to multi_node_mean_grad would pair other tensors (mixed
    gradients over shared memory, a gloo abort): refused on every rank."""
    if comm.size == 1:
        return
    model = torch.nn.Linear(200, 200)
    model.bias.grad = torch.full((200,), float(comm.rank + 1))
    _expect_mismatch(lambda: comm.multi_node_mean_grad(model, zero_fill=comm.rank == 0), "zero_fill differs",
                     "rank 0: True", "rank 1: False")
    comm.multi_node_mean_grad(model, zero_fill=False)  # agreed: the communicator goes on
    assert torch.allclose(model.bias.grad, torch.full((200,), (comm.size + 1) / 2)), model.bias.grad[:3]


def check_root_must_be_an_int(comm):
    import numpy
    for root in (True, numpy.int64(0)):
        try:
            comm.bcast(torch.ones(2), root=root)
        except ValueError as e:
            assert "a rank is a Python int" in str(e), e
        else:
            raise AssertionError(f"root={root!r} taken")


def check_bad_root_of_an_object_collective_raises_on_every_rank(comm):
    """The last rank passes a root that is no rank to bcast_obj, gather_obj, scatter_obj or
    bcast_data: it raises ValueError, and the others raise at once, naming it (they waited out the
    timeout, then blamed a rank that never came)."""
    last = comm.size - 1
    calls = {"bcast_obj": lambda root: comm.bcast_obj(1, root=root),
             "gather_obj": lambda root: comm.gather_obj(1, root=root),
             "scatter_obj": lambda root: comm.scatter_obj([1] * comm.size if comm.rank == 0 else None, root=root),
             "bcast_data": lambda root: comm.bcast_data(torch.nn.Linear(2, 2), root=root)}
    for kind, call in calls.items():
        start = time.monotonic()
        e = expect(ValueError if comm.rank == last else RemoteRankError, lambda: call(comm.size if comm.rank == last else 0))
        assert time.monotonic() - start < 5, (kind, time.monotonic() - start)
        assert f"rank {last}" in str(e) or comm.rank == last, (kind, e)
    assert comm.allreduce_obj(1) == comm.size  # and the communicator goes on


def check_allreduce_in_place_of_a_conjugate_view(comm):
    """allreduce_ of a complex conjugate view (x.conj()) writes the conjugated sum, as allreduce
    returns it (the in-place path handed the unresolved view to gloo, which refused it)."""
    x = torch.tensor([1 + 2j * (comm.rank + 1)], dtype=torch.complex64).conj()
    comm.allreduce_(x)
    assert x.item() == complex(comm.size, -sum(2 * (r + 1) for r in range(comm.size))), x


def check_mismatch(comm):
    if comm.size == 1:
        return
    # Different shapes: every rank raises the same, naming the ranks.
    for allreduce in (comm.allreduce, comm.allreduce_):
        try:
            allreduce(torch.zeros(comm.rank + 1))
        except torchmn.CollectiveMismatchError as e:
            assert "shape differs" in str(e) and "rank 1: (2,)" in str(e), e
        else:
            raise AssertionError(f"no error for mismatched shapes in {allreduce.__name__}")
    try:
        comm.bcast(torch.ones(1), root=comm.rank % 2)
    except torchmn.CollectiveMismatchError as e:
        assert "root differs" in str(e), e
    else:
        raise AssertionError("no error for mismatched roots")
    try:
        comm.allreduce(torch.ones(2), op="sum" if comm.rank else "max")
    except torchmn.CollectiveMismatchError as e:
        assert "op differs" in str(e), e
    else:
        raise AssertionError("no error for mismatched ops")
    # One rank passes garbage: it gets its own error, the others hear of it; nobody hangs.
    try:
        comm.allreduce("not a tensor" if comm.rank == 1 else torch.ones(2))
    except TypeError as e:
        assert comm.rank == 1, e
    except torchmn.communicators.RemoteRankError as e:
        assert comm.rank != 1 and "rank 1" in str(e), e
    else:
        raise AssertionError("no error for a bad argument")
    # Arguments only one rank gets wrong, which must not leave the others waiting for the timeout:
    # a root that is no rank, a tensor the wire cannot describe, an object that cannot be pickled.
    bad_calls = [
        ("bad root", lambda bad: comm.bcast(torch.ones(1), root=comm.size if bad else 0)),
        ("17 dimensions", lambda bad: comm.allreduce(torch.ones([1] * (17 if bad else 1)))),
        ("scatter of 17 dimensions", lambda bad: comm.scatter(
            [torch.ones([1] * (17 if bad else 1))] * comm.size if comm.rank == 0 else None)),
        ("unpicklable object", lambda bad: comm.allgather_obj((lambda: 0) if bad else 1)),
        ("unpicklable bcast_obj", lambda bad: comm.bcast_obj((lambda: 0) if bad else 1)),
    ]
    for what, call in bad_calls:
        culprit = 0 if what in ("scatter of 17 dimensions", "unpicklable bcast_obj") else 1
        try:
            call(comm.rank == culprit)
        except (TypeError, ValueError) as e:
            assert comm.rank == culprit, (what, e)
        except torchmn.communicators.RemoteRankError as e:
            assert comm.rank != culprit and f"rank {culprit}" in str(e), (what, e)
        else:
            raise AssertionError(f"no error for {what} on rank {culprit}")
    # alltoall of different dtypes names each rank's.
    try:
        comm.alltoall([torch.ones(1, dtype=torch.int32 if comm.rank == 0 else torch.float32)] * comm.size)
    except torchmn.CollectiveMismatchError as e:
        assert "different dtypes (rank 0: int32, rank 1: float32" in str(e), e
    else:
        raise AssertionError("no error for alltoall of different dtypes")
    # Object collectives check their calls too: different roots are named at once on every rank.
    for what, call in [("bcast_obj", lambda: comm.bcast_obj(comm.rank, root=comm.rank)),
                       ("gather_obj", lambda: comm.gather_obj(comm.rank, root=comm.rank)),
                       ("scatter_obj", lambda: comm.scatter_obj([0] * comm.size, root=comm.rank))]:
        try:
            call()
        except torchmn.CollectiveMismatchError as e:
            assert f"ranks called {what} inconsistently (root differs" in str(e), e
        else:
            raise AssertionError(f"no error for {what} with different roots")
    # gather_obj with an object rank 1 cannot pickle: root receives every rank's message before it
    # raises, so that a third rank's send is not left waiting for the timeout.
    start = time.monotonic()
    try:
        got = comm.gather_obj((lambda: 0) if comm.rank == 1 else comm.rank)
    except TypeError as e:
        assert comm.rank == 1 and "cannot pickle" in str(e), e
    except torchmn.communicators.RemoteRankError as e:
        assert comm.rank == 0 and "rank 1 could not pickle" in str(e), e
    else:
        assert comm.rank > 1 and got is None, got
    comm.barrier()
    assert time.monotonic() - start < 10, time.monotonic() - start
    # Different collectives whose headers differ in size: one row against several, a tensor
    # collective against an object collective. Every rank raises, naming both calls.
    for what, call in [("scatter", lambda: comm.scatter([torch.ones(1)] * comm.size)),
                       ("allgather_obj", lambda: comm.allgather_obj({"rank": comm.rank}))]:
        try:
            call() if comm.rank == 0 else comm.allreduce(torch.ones(1))
        except torchmn.CollectiveMismatchError as e:
            assert "collective differs" in str(e) and what in str(e) and "allreduce" in str(e), e
        else:
            raise AssertionError(f"no error for {what} against allreduce")
    # And the communicator still works afterwards.
    assert comm.allreduce(torch.ones(1)).item() == comm.size
    assert comm.allgather_obj(comm.rank) == list(range(comm.size))


def rank0(comm):
    return comm.rank == 0


if __name__ == "__main__":
    run_checks(globals(), not_in_all=("big_obj",))
