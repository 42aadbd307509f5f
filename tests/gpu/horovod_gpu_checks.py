"""torchmn.horovod over NCCL, with CUDA tensors: run by hand on a machine with a GPU.

    torchmn run -np 2 python tests/gpu/horovod_gpu_checks.py
    # two ranks sharing one GPU, as two NCCL hosts:
    torchmn run -np 2 bash -c 'NCCL_HOSTID=h$RANK NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
        exec python tests/gpu/horovod_gpu_checks.py'

Prints "PASS <check>" on rank 0 after each check.
"""
import faulthandler

import torch

import torchmn.horovod as hvd


def check_allreduce(dev):
    size, rank = hvd.size(), hvd.rank()
    for dtype in (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64):
        t = torch.full((17, 3), rank + 1, dtype=dtype, device=dev)
        s = hvd.allreduce(t, op=hvd.Sum)
        assert s.device == t.device and s.dtype == dtype and torch.all(s == size * (size + 1) // 2), (dtype, s)
        m = hvd.allreduce(t, op=hvd.Max)
        assert torch.all(m == size), (dtype, m)
        hvd.allreduce_(t, op=hvd.Min)
        assert torch.all(t == 1), (dtype, t)
    handles = [hvd.allreduce_async(torch.full((i + 1,), float(rank), device=dev), op=hvd.Sum) for i in range(20)]
    for i, h in reversed(list(enumerate(handles))):
        assert torch.all(hvd.synchronize(h) == sum(range(size))), i
    a, b = hvd.grouped_allreduce([torch.ones(3, device=dev), torch.ones(2, dtype=torch.int64, device=dev)], op=hvd.Sum)
    assert torch.all(a == size) and torch.all(b == size)


def check_allgather_broadcast_alltoall_reducescatter(dev):
    size, rank = hvd.size(), hvd.rank()
    g = hvd.allgather(torch.full((rank + 1, 2), float(rank), device=dev))
    assert g.device == dev and g.shape == (size * (size + 1) // 2, 2)
    b = hvd.broadcast(torch.full((4,), float(rank), device=dev), size - 1)
    assert torch.all(b == size - 1)
    splits = [rank + j + 1 for j in range(size)]
    rows = torch.cat([torch.full((n,), float(10 * rank + j), device=dev) for j, n in enumerate(splits)])
    out, received = hvd.alltoall(rows, splits=splits)
    assert received.tolist() == [r + rank + 1 for r in range(size)] and out.shape[0] == sum(received.tolist())
    rs = hvd.reducescatter(torch.ones(size * 2 + 1, 3, device=dev), op=hvd.Sum)
    assert torch.all(rs == size) and rs.shape[0] == (3 if rank == 0 else 2), rs.shape
    x = torch.ones(3, device=dev, dtype=torch.float64, requires_grad=True)
    hvd.allgather(x).backward(torch.ones(3 * size, device=dev, dtype=torch.float64))
    assert torch.all(x.grad == 1), x.grad  # as Horovod 0.28: the ranks' output gradients averaged


def check_optimizer(dev):
    size, rank = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).double().to(dev)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).double().to(dev)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * r + step), dtype=torch.float64)
                for r in range(size)]
        opt.zero_grad()
        model(data[rank].to(dev)).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        for r in range(size):
            (reference(data[r].to(dev)).square().mean() / size).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-10), (step, (p - q).abs().max())


def check_sync_batch_norm(dev):
    size, rank = hvd.size(), hvd.rank()
    x = torch.randn(3 * size, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dev)
    bn = hvd.SyncBatchNorm(4).double().to(dev)
    dense = torch.nn.BatchNorm1d(4).double().to(dev)
    assert torch.allclose(bn(x[3 * rank:3 * rank + 3]), dense(x)[3 * rank:3 * rank + 3], atol=1e-10)


def check_join(dev):
    size, rank = hvd.size(), hvd.rank()
    if rank == size - 1:
        last = hvd.join()
    else:
        s = hvd.allreduce(torch.ones(3, device=dev), op=hvd.Sum)
        assert torch.all(s == size - 1), s
        last = hvd.join()
    assert last == (size - 2 if size > 1 else 0), last


def main():
    hvd.init()
    if torch.cuda.is_available():
        dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")  # a smoke run of the same checks over gloo
    for name, check in [("allreduce", check_allreduce),
                        ("allgather_broadcast_alltoall_reducescatter", check_allgather_broadcast_alltoall_reducescatter),
                        ("optimizer", check_optimizer), ("sync_batch_norm", check_sync_batch_norm),
                        ("join", check_join)]:
        check(dev)
        hvd.barrier()
        if hvd.rank() == 0:
            print(f"PASS {name}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    # A hang prints every thread's stack into run_all.sh's log before its limit ends the check.
    faulthandler.dump_traceback_later(90)
    main()
