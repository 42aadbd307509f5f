"""The NCCL and CUDA paths, checked on a machine with GPUs (CI has none: run this by hand there).

Every rank runs every check on the GPU it computes on and compares with what one process computes
from the same data; rank 0 prints "PASS <check>" after each, then a timing table of tensor
allreduce through torchmn against raw ``torch.distributed`` in the same run.

    torchmn run -np 2 python tests/gpu/nccl_checks.py          # one GPU per rank
    python tests/gpu/nccl_checks.py --init tcp://127.0.0.1:29400  # a world of one, over NCCL

With one GPU, NCCL refuses two ranks on the same device unless they look like two hosts:
``torchmn run -np 2 bash -c 'NCCL_HOSTID=h$RANK exec python tests/gpu/nccl_checks.py'`` (each
rank then talks to the other through NCCL's socket transport, as across nodes).
"""
import argparse
import faulthandler
import statistics
import time

import torch
import torch.distributed as dist

import torchmn

BATCH = 24


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).double().to(device)


def data(step, device):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH,), generator=g)
    return x.to(device), y.to(device)


def local(t, comm):
    n = t.shape[0] // comm.size
    return t[comm.rank * n:(comm.rank + 1) * n]


def reference(device, steps, opt_cls):
    model = make_model(device)
    opt = opt_cls(model.parameters())
    for step in range(steps):
        x, y = data(step, device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_topology(comm):
    assert comm.backend == "nccl", comm.backend
    assert comm.device.type == "cuda" and comm.device.index == torch.cuda.current_device(), \
        (comm.device, torch.cuda.current_device())


def check_collectives(comm):
    r, n, dev = comm.rank, comm.size, comm.device
    x = torch.arange(6, device=dev, dtype=torch.float32) + r
    assert torch.equal(comm.allreduce(x).cpu(), torch.arange(6.0) * n + sum(range(n)))
    assert comm.allreduce(x).device == dev
    assert torch.equal(comm.allreduce(x, op="max").cpu(), torch.arange(6.0) + n - 1)
    half = torch.full((3,), 40000.0, dtype=torch.float16, device=dev)
    assert torch.equal(comm.allreduce(half, op="mean").cpu(), torch.full((3,), 40000.0, dtype=torch.float16))
    b = comm.bcast(torch.randn(4, 5, device=dev) if r == 0 else None)
    assert b.shape == (4, 5)
    assert torch.equal(torch.stack(comm.allgather(b)).cpu(), b.cpu().expand(n, 4, 5))
    parts = comm.allgather(torch.full((r + 1, 2), r, device=dev, dtype=torch.int64))
    assert [tuple(p.shape) for p in parts] == [(k + 1, 2) for k in range(n)]
    g = comm.gather(torch.full((r + 1,), r, device=dev), root=n - 1)
    assert (g is None) == (r != n - 1)
    mine = comm.scatter([torch.full((k + 1,), k, device=dev) for k in range(n)] if r == 0 else None)
    assert mine.tolist() == [r] * (r + 1)
    got = comm.alltoall([torch.tensor([r, k], device=dev) for k in range(n)])
    assert [t.tolist() for t in got] == [[k, r] for k in range(n)]
    if n > 1:
        if r == 0:
            comm.send(torch.ones(3, 2, device=dev, dtype=torch.bfloat16), dest=1)
        elif r == 1:
            assert comm.recv(source=0).tolist() == [[1.0, 1.0]] * 3
    assert comm.bcast_obj({"root": r} if r == 0 else None) == {"root": 0}
    assert comm.allgather_obj(r) == list(range(n))
    comm.barrier()


def check_cpu_and_cuda(comm):
    """CPU and CUDA tensors on one NCCL communicator: each call goes its tensors' way and returns
    where they lie; a call whose ranks pass both kinds is refused on every rank."""
    r, n, dev = comm.rank, comm.size, comm.device
    cpu = torch.device("cpu")
    for _ in range(3):  # interleaved, so that the two groups' calls stay in order
        c = comm.allreduce(torch.arange(4, dtype=torch.float64) + r)
        g = comm.allreduce(torch.arange(4, dtype=torch.float64, device=dev) + r)
        assert c.device == cpu and g.device == dev, (c.device, g.device)
        assert torch.equal(c, g.cpu()) and torch.equal(c, torch.arange(4.0, dtype=torch.float64) * n + sum(range(n)))
    b = comm.bcast(torch.ones(3) if r == 0 else None)
    assert b.device == cpu and b.tolist() == [1.0] * 3
    assert comm.wire_device(torch.ones(1)) == cpu and comm.wire_device(torch.ones(1, device=dev)) == dev
    if n > 1:
        try:
            comm.allreduce(torch.ones(2, device=dev if r == 0 else cpu))
        except torchmn.CollectiveMismatchError as e:
            assert "device differs: rank 0: cuda, rank 1: cpu" in str(e), e
        else:
            raise AssertionError("a call of CUDA and CPU tensors was not refused")


def check_mean_grad(comm):
    model = make_model(comm.device)
    comm.bcast_data(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(comm.rank))
    comm.multi_node_mean_grad(model)
    for p in model.parameters():
        assert torch.allclose(p.grad, torch.full_like(p, (comm.size - 1) / 2)), p.grad


def _train(comm, steps, opt_cls, **kw):
    model = make_model(comm.device)
    opt = torchmn.create_multi_node_optimizer(opt_cls(model.parameters()), comm, **kw)
    for step in range(steps):
        x, y = data(step, comm.device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(local(x, comm)), local(y, comm)).backward()
        opt.step()
    return model, opt


def check_optimizer(comm):
    def adam(ps):
        return torch.optim.Adam(ps, lr=0.01)
    ref = reference(comm.device, 5, adam)
    for kw in ({}, {"compression": "fp16"}, {"shard_state": True}):
        model, opt = _train(comm, 5, adam, **kw)
        tol = 1e-3 if kw.get("compression") else 1e-6
        for p, q in zip(model.parameters(), ref):
            assert torch.allclose(p, q, atol=tol), (kw, (p - q).abs().max().item())
        sd = opt.state_dict()
        assert len(sd["state"]) == len(ref), kw


def time_allreduce(comm, mb_sizes=(0.1, 7.2, 64), rounds=20):
    """Median seconds of an allreduce through torchmn and through raw torch.distributed, same run."""
    rows = []
    for mb in mb_sizes:
        n = int(mb * 1024 * 1024 / 4)
        x = torch.ones(n, device=comm.device)
        out = {}
        for name, fn in (("torchmn allreduce", lambda: comm.allreduce(x)),
                         ("torchmn allreduce_flat", lambda: comm.allreduce_flat(x)),
                         ("torch.distributed all_reduce", lambda: dist.all_reduce(x))):
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(rounds):
                comm.barrier()
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            out[name] = statistics.median(times)
        rows.append((mb, out))
    return rows


def check_functions(comm):
    """torchmn.functions on the GPU: a send/recv round trip and allgather's backward."""
    import torchmn.functions as F
    n, r, dev = comm.size, comm.rank, comm.device
    x = torch.randn(r + 1, 3, device=dev, dtype=torch.float64, requires_grad=True)
    ys = F.allgather(comm, x)
    sum((j + 1) * y.sum() for j, y in enumerate(ys)).backward()
    assert torch.allclose(x.grad, torch.full_like(x, n * (r + 1.0))), x.grad
    if n > 1:
        layer = torch.nn.Linear(3, 3).double().to(dev)
        if r == 0:
            h = torch.randn(4, 3, device=dev, dtype=torch.float64, requires_grad=True)
            d = F.send(layer(h), comm, rank=1)
            out = F.recv(comm, rank=1, delegate_variable=d)
            out.sum().backward()
            assert h.grad is not None and h.grad.device == dev
        elif r == 1:
            F.send(layer(F.recv(comm, rank=0)), comm, rank=0).backward()


def check_pipeline(comm):
    """A pipeline of one CUDA stage per rank: the gradients of the unsplit batch (float64)."""
    from torchmn.nn import Pipeline
    p, r, dev = comm.size, comm.rank, comm.device
    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()).double().to(dev) for _ in range(p)]
    torch.manual_seed(0)
    ref = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()).double().to(dev) for _ in range(p)]
    x, y = data(0, dev)[0][:, :6].contiguous(), torch.randn(BATCH, 6, dtype=torch.float64, device=dev)
    y = comm.bcast(y)
    for schedule in ("gpipe", "1f1b"):
        for s in stages + ref:
            s.zero_grad()
        pipe = Pipeline(stages[r], comm, micro_batches=4, schedule=schedule, loss_fn=torch.nn.functional.mse_loss)
        pipe.train_step(x if r == 0 else None, target=y if r == p - 1 else None)
        torch.nn.functional.mse_loss(torch.nn.Sequential(*ref)(x), y).backward()
        for a, b in zip(stages[r].parameters(), ref[r].parameters()):
            assert torch.allclose(a.grad, b.grad, atol=1e-9), (schedule, (a.grad - b.grad).abs().max())


def check_parallel_layers(comm):
    """MultiNodeBatchNorm2d and SpatialParallelConv2d on the GPU against the dense layers (float64)."""
    from torchmn.nn import MultiNodeBatchNorm2d, SpatialParallelConv2d
    p, r, dev = comm.size, comm.rank, comm.device
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2 * p, 3, 9, 8, generator=g, dtype=torch.float64).to(dev)
    mine = x[2 * r:2 * r + 2]
    bn = MultiNodeBatchNorm2d(3, comm=comm).double().to(dev)
    dense_bn = torch.nn.BatchNorm2d(3).double().to(dev)
    assert torch.allclose(bn(mine), dense_bn(x)[2 * r:2 * r + 2], atol=1e-10)
    assert torch.allclose(bn.running_var, dense_bn.running_var, atol=1e-12)
    torch.manual_seed(3)
    conv = SpatialParallelConv2d(3, 4, 3, padding=1, comm=comm).double().to(dev)
    torch.manual_seed(3)
    dense = torch.nn.Conv2d(3, 4, 3, padding=1).double().to(dev)
    rows = x.tensor_split(p, dim=2)[r]
    start = sum(t.shape[2] for t in x.tensor_split(p, dim=2)[:r])
    assert torch.allclose(conv(rows), dense(x)[:, :, start:start + rows.shape[2]], atol=1e-10)


CHECKS = {"topology": check_topology, "collectives": check_collectives, "cpu_and_cuda": check_cpu_and_cuda,
          "mean_grad": check_mean_grad,
          "optimizer": check_optimizer, "functions": check_functions, "pipeline": check_pipeline,
          "parallel_layers": check_parallel_layers}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", default=None, help="init_method for a world of one over NCCL")
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()
    comm = torchmn.create_communicator(backend="nccl", init_method=args.init)
    for name, check in CHECKS.items():
        check(comm)
        comm.barrier()
        if comm.rank == 0:
            print(f"PASS {name}", flush=True)
    if not args.no_timing and dist.is_initialized():
        rows = time_allreduce(comm)
        if comm.rank == 0:
            print(f"{comm.size} rank(s), {torch.cuda.get_device_name()}, NCCL {torch.cuda.nccl.version()}")
            for mb, out in rows:
                print(f"  {mb:>5} MB: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in out.items()))
    comm.finalize()


if __name__ == "__main__":
    # A hang prints every thread's stack into run_all.sh's log before its limit ends the check.
    faulthandler.dump_traceback_later(90)
    main()
