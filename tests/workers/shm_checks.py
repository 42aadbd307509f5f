"""Shared-memory collectives checked against gloo, inside a real job (see tests/test_shm.py).

Usage: python shm_checks.py CHECK [--value V]
"""
import argparse
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import torchmn

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool)
SIZES = (1, 3, 7, 64, 1001, 65_537, 300_007)


def values(n, dtype, rank):
    """Small integers, so float sums are exact and the two paths must agree bit for bit."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    hi = 3 if dtype in (torch.int8, torch.uint8) else 50
    return torch.randint(0, hi, (n,), generator=g).to(dtype)


def check_same_as_gloo(comm):
    assert comm.name == "hierarchical" and comm.segment is not None
    world = comm.object_group  # the CPU group: on a GPU machine the world's own is NCCL's
    # With tiny slots (TORCHMN_SHM_SLOT_MB) every tensor goes in many pieces: fewer sizes suffice.
    sizes = SIZES if comm.segment.slot_bytes >= 1 << 20 else (7, 4099, 65_537)
    for dtype in DTYPES:
        for n in sizes:
            x = values(n, dtype, comm.rank)
            ours = x.clone()
            comm.allreduce_flat(ours).wait()
            theirs = x.clone()
            dist.all_reduce(theirs, group=world)
            assert torch.equal(ours, theirs), (dtype, n)
            for op in ("max", "min"):
                if dtype == torch.bool:
                    continue
                a = comm.allreduce(x, op=op)
                b = x.clone()
                dist.all_reduce(b, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=world)
                assert torch.equal(a, b), (dtype, n, op)
            if dtype == torch.bool:
                continue
            # reduce-scatter and all-gather, the sharded optimizer's primitives
            k = n
            flat = values(comm.size * k, dtype, comm.rank)
            shard = torch.empty(k, dtype=dtype)
            comm.reduce_scatter_flat(flat, shard).wait()
            expect = flat.clone()
            dist.all_reduce(expect, group=world)
            assert torch.equal(shard, expect[comm.rank * k:(comm.rank + 1) * k]), (dtype, n, "reduce_scatter")
            gathered = torch.empty(comm.size * k, dtype=dtype)
            comm.allgather_flat(gathered, shard).wait()
            assert torch.equal(gathered, expect), (dtype, n, "allgather")


def check_small_paths_same_bits(comm):
    """Tensors up to the segment's small buffers take one round (the checked allreduce with its call
    check, allreduce_flat without): their results equal, bit for bit, the sum in rank order that
    the general way computes, for random float64 values around the size limit, every op, and
    calls of every size mixed with barriers (the small buffers are used by turns)."""
    from torchmn.communicators.shm.collectives import SMALL_BYTES

    assert comm.name == "hierarchical" and comm.segment is not None
    limit = SMALL_BYTES // 8
    g = torch.Generator().manual_seed(comm.rank)
    for step, n in enumerate([1, 7, 1001, limit - 16, limit - 15, limit, limit + 1, 65_537] * 3):
        x = torch.rand(n, dtype=torch.float64, generator=g) * 3 - 1
        parts = comm.allgather(x)
        expect = {"sum": parts[0] + parts[1], "max": torch.maximum(parts[0], parts[1]),
                  "min": torch.minimum(parts[0], parts[1]), "prod": parts[0] * parts[1]}
        for part in parts[2:]:
            expect = {"sum": expect["sum"] + part, "max": torch.maximum(expect["max"], part),
                      "min": torch.minimum(expect["min"], part), "prod": expect["prod"] * part}
        expect["mean"] = expect["sum"] / comm.size
        for op, want in expect.items():
            got = comm.allreduce(x, op=op)
            assert torch.equal(got, want), (n, op, (got - want).abs().max())
        flat = x.clone()
        comm.allreduce_flat(flat).wait()
        assert torch.equal(flat, expect["sum"]), (n, "allreduce_flat")
        ints = comm.allreduce(torch.full((n,), comm.rank + step, dtype=torch.int64))
        assert torch.equal(ints, torch.full((n,), sum(range(comm.size)) + comm.size * step)), (n, "int64")
        if step % 3 == 0:
            comm.barrier()


def check_barrier_orders(comm):
    """What a rank did before the barrier, every rank sees after it (rank 0 writes a file late)."""
    path = os.path.join(comm.bcast_obj(tempfile.mkdtemp() if comm.rank == 0 else None), "written")
    for _ in range(3):
        if comm.rank == 0:
            time.sleep(0.2)
            with open(path, "w") as f:
                f.write("x")
        comm.barrier()
        assert os.path.exists(path), "the barrier returned before rank 0 reached it"
        comm.barrier()
        if comm.rank == 0:
            os.unlink(path)
        comm.barrier()


def check_messages(comm):
    """send/recv through the node's mailboxes: every dtype and size class (one byte, a box, many
    boxes), tags received out of order, objects and the object collectives built on them; every
    rank sends to every other, so each pair's boxes carry messages both ways at once."""
    assert comm.mailboxes is not None
    box = comm.mailboxes.box_bytes
    sizes = (0, 1, 1000, box // 8, box // 4 + 3, 3 * box // 2 + 5)  # elements of 8 bytes or fewer
    dtypes = DTYPES + (torch.complex64,)
    for dest in range(comm.size):
        for source in range(comm.size):
            if source == dest or comm.rank not in (source, dest):
                continue
            for dtype in dtypes:
                for n in sizes:
                    x = values(n, dtype, source).reshape(-1, 1) if n % 2 else values(n, dtype, source)
                    if comm.rank == source:
                        comm.send(x, dest, tag=1)
                        comm.send(x[:n // 2], dest, tag=2)
                    else:  # tag 2 first: the tag-1 message that arrives first waits for its recv
                        half = comm.recv(source, tag=2)
                        whole = comm.recv(source, tag=1)
                        assert whole.dtype == dtype and torch.equal(whole, x), (source, dtype, n)
                        assert torch.equal(half, x[:n // 2]), (source, dtype, n)
            if comm.rank == source:
                comm.send_obj({"from": source, "big": "x" * (2 * box + 1)}, dest, tag=3)
            else:
                got = comm.recv_obj(source, tag=3)
                assert got == {"from": source, "big": "x" * (2 * box + 1)}, got["from"]
    assert comm.gather_obj(comm.rank * 10, root=comm.size - 1) in (None, [r * 10 for r in range(comm.size)])
    assert comm.scatter_obj([f"to {r}" for r in range(comm.size)] if comm.rank == 0 else None) == f"to {comm.rank}"
    comm.barrier()


def check_small_messages_leave_before_their_receive(comm):
    """Every rank first sends a small tensor to every other, then receives theirs, and so again
    with objects (MPI's eager sends): a message that fits a box leaves at once, header and data in
    one (each pair's box holds one message at a time)."""
    assert comm.mailboxes is not None
    others = [r for r in range(comm.size) if r != comm.rank]
    for dest in others:
        comm.send(torch.full((4,), comm.rank, dtype=torch.float64), dest)
    for source in others:
        assert torch.equal(comm.recv(source), torch.full((4,), source, dtype=torch.float64)), source
    for dest in others:
        comm.send_obj({"from": comm.rank}, dest)
    for source in others:
        assert comm.recv_obj(source) == {"from": source}, source


def check_message_peer_lost(comm):
    """Rank 1 exits without a word while rank 0 waits for its message: the mailbox wait names it."""
    comm.barrier()
    if comm.rank == 1:
        os._exit(0)
    try:
        comm.recv(1)
    except torchmn.communicators.errors.PeerLostError as e:
        print(f"PEER LOST: {e}", flush=True)
        os._exit(3)


def check_die(comm):
    """Rank 1 is killed outright in the middle of the job."""
    comm.allreduce(torch.ones(10))
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.allreduce(torch.ones(10))


def check_peer_lost(comm):
    """Rank 1 exits without a word; rank 0's shared-memory wait must notice and name it."""
    comm.allreduce(torch.ones(10))
    if comm.rank == 1:
        os._exit(0)
    try:
        comm.allreduce_flat(torch.ones(10))
    except torchmn.communicators.errors.PeerLostError as e:
        print(f"PEER LOST: {e}", flush=True)
        os._exit(3)


def check_different_calls(comm):
    """Rank 0 alone makes a logging allreduce, then both average gradients: the shared-memory
    operations differ (a call check against a gradient sum), and every rank must say so at once
    instead of summing the other's call header as gradients."""
    model = torch.nn.Linear(4, 2)
    model(torch.ones(3, 4)).sum().backward()
    try:
        if comm.rank == 0:
            comm.allreduce(torch.tensor([0.5]))
        comm.multi_node_mean_grad(model, zero_fill=True)
    except torchmn.communicators.CollectiveMismatchError as e:
        assert "collective differs: rank 0: allreduce, rank 1: multi_node_mean_grad" in str(e), e
        print(f"MISMATCH rank {comm.rank}: {e}", flush=True)
        return
    raise AssertionError(f"rank {comm.rank}: no error; bias.grad {model.bias.grad.tolist()} (all 3.0 expected)")


def check_busy(comm, value):
    """Many allreduces with a job-specific value: two such jobs at once must not mix."""
    for i in range(300):
        x = torch.full((5000 + i,), float(value + comm.rank))
        got = comm.allreduce(x)
        assert torch.equal(got, torch.full_like(x, float(comm.size * value + sum(range(comm.size))))), (value, i)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("check")
    parser.add_argument("--value", type=int, default=0)
    args = parser.parse_args()
    comm = torchmn.create_communicator("hierarchical", timeout=30 if args.check == "different_calls" else None)
    if args.check == "busy":
        check_busy(comm, args.value)
    else:
        globals()[f"check_{args.check}"](comm)
    if comm.rank == 0:
        print(f"PASS {args.check}", flush=True)
    comm.finalize()



def check_small_dev_shm(comm):
    """A /dev/shm too small for the optimizers' shared buffers (Docker's default is 64 MB): both
    optimizers fall back to the ordinary collectives and still train identically on every rank; the
    default, which would share parameters and state there, is the replicated optimizer."""
    torch.manual_seed(0)
    for shard_state in (None, False, True):
        model = torch.nn.Linear(2000, 2000)  # 16 MB of parameters: the buffers would need 3x that
        opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                                  shard_state=shard_state)
        assert opt.arena is None, f"shard_state={shard_state}: shared buffers in a small /dev/shm"
        if shard_state is None:
            assert type(opt) is torchmn.MultiNodeOptimizer, type(opt)
        model(torch.full((2, 2000), float(comm.rank))).sum().backward()
        opt.step()
        mine = model.weight.detach()[:3, :3].clone()
        assert all(torch.equal(mine, other) for other in comm.allgather_obj(mine))


def check_segment_fits_dev_shm(comm):
    """/dev/shm too small for the default 16 MB slots: smaller slots (still the same sums as gloo),
    or, when even those do not fit, no shared memory at all and the same results over TCP."""
    expect = os.environ["EXPECT_SEGMENT"]
    if expect == "smaller":
        assert comm.segment is not None and comm.segment.slot_bytes < 16 << 20, comm.segment
        check_same_as_gloo(comm)
    else:
        assert comm.segment is None
        assert torch.equal(comm.allreduce(torch.arange(5.0)), torch.arange(5.0) * comm.size)

if __name__ == "__main__":
    sys.exit(main())
