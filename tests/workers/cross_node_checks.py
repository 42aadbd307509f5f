"""Checks of the allreduce across nodes (torchmn/communicators/cross_node.py), run on every rank:

    python cross_node_checks.py CHECK [CHECK ...]      # under a launcher, any rank count

Nodes are emulated on one machine by giving the hierarchical communicator a node key per pair of
ranks (ranks 0-1 node 0, ranks 2-3 node 1, ...) or per rank. Rank 0 prints "PASS <check>".
torch calls go through the communicator's CPU group (``comm.object_group``): on a machine with GPUs
the world's own group is NCCL's, which moves CUDA tensors only.
"""
import os
import sys

import torch
import torch.distributed as dist

import torchmn
from torchmn.communicators import cross_node
from torchmn.communicators import ops as torchmn_ops
from torchmn.communicators.registry import make_communicator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comm_checks import check_finalized_split_lets_go_of_its_groups, nan_max_min_inputs  # noqa: E402

OPS = ("sum", "max", "min", "prod")


def integers(rank, n, dtype, op):
    """Rank ``rank``'s values: integers, so that every order of summing gives the same bits."""
    g = torch.Generator().manual_seed(1000 + rank)
    high = 3 if op == "prod" else 1000
    return torch.randint(1, high, (n,), generator=g).to(dtype)


def check_doubling_matches_gloo(comm):
    """Recursive doubling on the world group equals gloo's allreduce for every op and a few dtypes
    and sizes (one element, odd, a few thousand), and every rank holds the same bits for random
    floats (the power-of-two fold included where the rank count is not one)."""
    ranks = list(range(comm.size))
    for op in OPS:
        for dtype in (torch.float32, torch.float64, torch.int64):
            for n in (1, 7, 3000):
                mine = integers(comm.rank, n, dtype, op)
                expected = mine.clone()
                dist.all_reduce(expected, op=torchmn_ops.OPS[op], group=comm.object_group)
                got = cross_node.doubling_allreduce(mine.clone(), op, comm.object_group, ranks, comm.rank)
                assert torch.equal(got, expected), (op, dtype, n, got[:5], expected[:5])
    x = torch.randn(1001, dtype=torch.float32, generator=torch.Generator().manual_seed(comm.rank))
    got = cross_node.doubling_allreduce(x.clone(), "sum", comm.object_group, ranks, comm.rank)
    everyone = comm.allgather(got)
    assert all(torch.equal(everyone[0], other) for other in everyone), "ranks differ in bits"
    assert torch.allclose(got, comm.allreduce(x), rtol=1e-5, atol=1e-5)


def check_auto_measures_alike_on_every_rank(comm):
    """Set-up measures both algorithms and every rank keeps the same threshold and description."""
    os.environ.pop(cross_node.VARIABLE, None)
    cross_node._measured.clear()
    cross = cross_node.CrossNodeAllreduce.set_up(comm.object_group, list(range(comm.size)), comm.rank)
    assert cross.measured and min(cross.measured) == cross_node.PROBE_BYTES[0], cross.measured
    seen = comm.allgather_obj((cross.threshold, cross.describe()))
    assert all(s == seen[0] for s in seen), seen
    assert "measured at set-up" in cross.describe()
    assert cross.algorithm_for(cross.threshold + 1) == "ring"


def check_a_new_rank_takes_the_first_ranks_measurement(comm):
    """Where the group's first rank measured before and the others did not (ranks that joined an
    elastic job later), set-up measures nothing again and every rank takes the first rank's
    threshold; the first rank's variable decides for every rank too."""
    os.environ.pop(cross_node.VARIABLE, None)
    group, ranks = comm.object_group, list(range(comm.size))
    if comm.rank != 0:
        cross_node._measured.clear()
    else:
        cross_node._measured[comm.size] = (8192, {1024: (3e-4, 1e-4), 8192: (4e-4, 2e-4), 65536: (5e-4, 9e-4)})
    cross = cross_node.CrossNodeAllreduce.set_up(group, ranks, comm.rank)
    assert cross.threshold == 8192 and sorted(cross.measured) == [1024, 8192, 65536], cross.measured
    if comm.rank == 0:
        os.environ[cross_node.VARIABLE] = "doubling"
    cross = cross_node.CrossNodeAllreduce.set_up(group, ranks, comm.rank)
    assert cross.algorithm_for(1 << 40) == "doubling", cross.describe()
    os.environ.pop(cross_node.VARIABLE, None)
    cross_node._measured.clear()


def check_emulated_nodes_average_with_each_algorithm(comm):
    """A hierarchical communicator over emulated nodes (two ranks a node, and one a node) averages
    exactly with gloo's ring, with recursive doubling, and with what set-up measured: the checked
    allreduce, allreduce_ and the gradient mean, small and large."""
    for per_node in (2, 1):
        for choice in ("ring", "doubling", "auto"):
            os.environ[cross_node.VARIABLE] = choice
            cross_node._measured.clear()
            sub = make_communicator("hierarchical", rank=comm.rank, size=comm.size, group=comm.object_group,
                                    obj_group=comm.object_group, backend="gloo", node_key=comm.rank // per_node)
            assert sub.inter_size == -(-comm.size // per_node), (sub.inter_size, per_node)
            leads = sub.cross_node is not None
            assert leads == (sub.intra_rank == 0), (leads, sub.intra_rank)
            if choice != "auto" and leads:
                assert sub.cross_node.algorithm_for(64) == ("doubling" if choice == "doubling" else "ring")
            for n in (5, 300_000):
                x = integers(comm.rank, n, torch.float64, "sum")
                expected = sum(integers(r, n, torch.float64, "sum") for r in range(comm.size))
                assert torch.equal(sub.allreduce(x), expected), (choice, per_node, n)
                y = x.clone()
                sub.allreduce_(y, op="mean")
                assert torch.allclose(y, expected / comm.size), (choice, per_node, n)
                grads = [x[: n // 2].clone(), x[n // 2:].clone()]
                sub.mean_tensors(grads)
                assert torch.allclose(torch.cat(grads), expected / comm.size), (choice, per_node, n)
                x, most, _ = nan_max_min_inputs(comm.rank, comm.size, max(n, 8), torch.float32)
                assert torch.equal(sub.allreduce(x, op="max").isnan(), most.isnan()), (choice, per_node, n)
            sub.finalize()
    os.environ.pop(cross_node.VARIABLE, None)


def check_emulated_nodes_shard_in_pieces(comm):
    """The sharded optimizer's reduce-scatter and all-gather across emulated nodes, through the
    hierarchical communicator (its rails between nodes) and the flat one: small chunks in one gloo
    call, large ones (over 512 KB) in pieces, the last shorter; float64 and float32; several in
    flight at once, waited in order, as the optimizer launches them during backward."""
    for name, per_node in (("hierarchical", 2), ("hierarchical", 1), ("flat", 1)):
        sub = make_communicator(name, rank=comm.rank, size=comm.size, group=comm.object_group,
                                obj_group=comm.object_group, backend="gloo", node_key=comm.rank // per_node)
        assert sub.inter_size > 1, (name, per_node, sub.inter_size)
        pending = []
        for dtype, k in ((torch.float64, 37), (torch.float64, 150_037), (torch.float32, 150_037)):
            parts = [integers(r, sub.size * k, dtype, "sum") for r in range(sub.size)]
            shard = torch.empty(k, dtype=dtype)
            pending.append((shard, sum(parts)[sub.rank * k:(sub.rank + 1) * k],
                            sub.reduce_scatter_flat(parts[sub.rank], shard, async_op=True)))
            gathered = torch.empty(sub.size * k, dtype=dtype)
            mine = integers(sub.rank, k, dtype, "sum")
            pending.append((gathered, torch.cat([integers(r, k, dtype, "sum") for r in range(sub.size)]),
                            sub.allgather_flat(gathered, mine, async_op=True)))
        for i, (got, expected, work) in enumerate(pending):
            work.wait()
            assert torch.equal(got, expected), (name, per_node, i, got[:3], expected[:3])
        sub.finalize()


def check_emulated_nodes_split_and_finalize_keep_files_level(comm):
    """Splits of a hierarchical communicator over emulated nodes (two ranks a node) make groups
    across nodes and rails too: finalized, a later split of the same ranks takes them again."""
    sub = make_communicator("hierarchical", rank=comm.rank, size=comm.size, group=comm.object_group,
                            obj_group=comm.object_group, backend="gloo", node_key=comm.rank // 2)
    assert sub.inter_size == -(-comm.size // 2), sub.inter_size
    check_finalized_split_lets_go_of_its_groups(sub)
    sub.finalize()


def check_bad_choice_is_refused(comm):
    """A value of the variable that names no algorithm: a ValueError naming the choices."""
    os.environ[cross_node.VARIABLE] = "tree"
    try:
        cross_node.CrossNodeAllreduce.set_up(comm.object_group, list(range(comm.size)), comm.rank)
        raise AssertionError("TORCHMN_CROSS_NODE_ALGORITHM=tree was taken")
    except ValueError as e:
        assert "auto, ring, doubling" in str(e), e
    finally:
        os.environ.pop(cross_node.VARIABLE, None)


if __name__ == "__main__":
    comm = torchmn.create_communicator("flat")
    for name in sys.argv[1:]:
        globals()[f"check_{name}"](comm)
        comm.barrier()
        if comm.rank == 0:
            print(f"PASS {name}", flush=True)
    comm.finalize()
