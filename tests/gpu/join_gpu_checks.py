"""torchmn.join on the GPU (CI has none: run this by hand there). Rank 0 prints "PASS <check>".

Ranks with 7 and 10 batches (rank r has 7 + 3r) train a CUDA model under ``torchmn.join`` and must
end with the parameters of one process that, at step t, takes the batches of the ranks that still
have data together (float64).

    torchmn run -np 2 bash -c 'NCCL_HOSTID=h$RANK exec python tests/gpu/join_gpu_checks.py'
"""
import faulthandler

import torch

import torchmn


def batch(rank, step, device):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    return x.to(device), (x[:, 0] > 0).long().to(device)


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double().to(device)


def counts(size):
    return [7 + 3 * r for r in range(size)]


def reference(size, device):
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = counts(size)
    for step in range(max(n)):
        active = [r for r in range(size) if step < n[r]]
        xs, ys = zip(*(batch(r, step, device) for r in active))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_join(comm, shard_state):
    model = make_model(comm.device)
    opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                              shard_state=shard_state)
    with torchmn.join(comm):
        for step in range(counts(comm.size)[comm.rank]):
            x, y = batch(comm.rank, step, comm.device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    expected = reference(comm.size, comm.device)
    for p, e in zip(model.parameters(), expected):
        assert p.device.type == "cuda" and torch.allclose(p, e, rtol=0, atol=1e-10), (p - e).abs().max()


if __name__ == "__main__":
    # A hang prints every thread's stack into run_all.sh's log before its limit ends the check.
    faulthandler.dump_traceback_later(90)
    comm = torchmn.create_communicator(backend="nccl")
    for shard in (False, True):
        check_join(comm, shard)
        if comm.rank == 0:
            print(f"PASS join_on_gpu shard_state={shard}", flush=True)
    comm.finalize()
