"""Checks for datasets, iterators, evaluators and extensions, run inside every rank of a real job.

Usage: python data_checks.py --tmp DIR CHECK [CHECK ...]   (or "all")
DIR is a scratch directory every rank can write (snapshots, manager output). Each check asserts on
every rank and prints "PASS <check> <seconds>s" on rank 0 once every rank has passed it.
"""
import argparse
import collections
import contextlib
import io
import math
import os
import time
import warnings

import numpy as np
import pytorch_pfn_extras as ppe
import torch
from torch.utils.data import DataLoader

import torchmn
from torchmn.communicators.errors import RemoteRankError
from torchmn.datasets import SharedDataset, TransformDataset, scatter_dataset, scatter_index
from torchmn.evaluators import GenericMultiNodeEvaluator, create_multi_node_evaluator
from torchmn.extensions import (AllreducePersistent, MultiNodeEarlyStoppingTrigger, ObservationAggregator,
                                available_iterations, multi_node_snapshot, resume_latest)
from torchmn.extensions.snapshot import DEFAULT_FILENAME, snapshot_path
from torchmn.iterators import create_multi_node_iterator


class RangeData(SharedDataset):
    """A dataset every rank can build: item i is (i, "s<i>")."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (i, f"s{i}")


class Failing:
    """A dataset whose item ``bad`` (by default the last) cannot be read."""

    def __init__(self, n, bad=None):
        self.n = n
        self.bad = n - 1 if bad is None else bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"item {i} is unreadable")
        return i


class Unpicklable:
    """A sample the last rank cannot unpickle (its class missing there, say)."""

    def __init__(self, v):
        self.v = v

    def __setstate__(self, state):
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            raise ImportError("no module named 'samples' on this rank")
        self.__dict__.update(state)


def expect_raise(fn, *types):
    try:
        fn()
    except types as e:
        return e
    raise AssertionError(f"expected one of {types} to be raised")


# ----------------------------------------------------------------------------- datasets
def _scatter_case(comm, n, root, shuffle, force, shared, max_buf_len=1 << 20):
    if comm.rank != root:
        data = None
    elif shared:
        data = RangeData(n)
    else:
        data = [(i, f"s{i}") for i in range(n)]
    part = scatter_dataset(data, comm, root=root, shuffle=shuffle, seed=5, force_equal_length=force,
                           max_buf_len=max_buf_len)
    assert isinstance(part, torch.utils.data.Dataset)
    items = [part[k] for k in range(len(part))]
    # Every item is the sample its global index names, whether copied or read locally.
    assert items == [(i, f"s{i}") for i in part.indices], (items, part.indices)
    return part.indices


def check_scatter(comm):
    size = comm.size
    for n in (0, 1, size, 5 * size - 1):
        for root in range(size):
            for shuffle in (False, True):
                for force in (True, False):
                    where = f"n={n} root={root} shuffle={shuffle} force={force}"
                    parts = comm.allgather_obj(_scatter_case(comm, n, root, shuffle, force, shared=False))
                    shared = comm.allgather_obj(_scatter_case(comm, n, root, shuffle, force, shared=True))
                    assert parts == shared, (where, parts, shared)
                    lengths = [len(p) for p in parts]
                    assert set().union(*map(set, parts)) == set(range(n)), (where, parts)
                    if force:
                        assert set(lengths) == {-(-n // size)}, (where, lengths)
                        if n > 0:
                            assert n <= lengths[0] * size < n + size, (where, lengths)
                    else:
                        assert sum(lengths) == n and max(lengths) - min(lengths) <= 1, (where, lengths)
                        flat = [i for p in parts for i in p]
                        assert len(flat) == len(set(flat)) == n, (where, parts)
                        if shuffle and n >= 9:
                            assert flat != sorted(flat), (where, flat)   # permuted, not in order
                        if not shuffle:
                            assert flat == list(range(n)), (where, flat)
    # The same seed gives the same split twice; another seed another order.
    n = 5 * size - 1
    again = comm.allgather_obj(_scatter_case(comm, n, 0, True, False, shared=False))
    assert again == comm.allgather_obj(_scatter_case(comm, n, 0, True, False, shared=False))
    data = list(range(n)) if comm.rank == 0 else None
    other = comm.allgather_obj(scatter_dataset(data, comm, shuffle=True, seed=6, force_equal_length=False).indices)
    assert other != again and sorted(i for p in other for i in p) == list(range(n))


def check_scatter_chunks(comm):
    # 1 KiB samples with a 3 KiB buffer: each part travels in several chunks.
    n = 7 * comm.size
    data = [torch.full((256,), float(i)) for i in range(n)] if comm.rank == 0 else None
    part = scatter_dataset(data, comm, max_buf_len=3 * 1024, force_equal_length=False)
    for k, i in enumerate(part.indices):
        assert torch.equal(part[k], torch.full((256,), float(i))), (k, i)
    assert len(part) == 7
    # Samples holding rows of one big tensor, in a namedtuple: each arrives as its row alone,
    # still a namedtuple.
    table = torch.arange(n * 1000.0).reshape(n, 1000)
    data = [Row(table[i], i) for i in range(n)] if comm.rank == 0 else None
    part = scatter_dataset(data, comm, force_equal_length=False)
    for k, i in enumerate(part.indices):
        assert type(part[k]) is Row and torch.equal(part[k].x, table[i]) and part[k].y == i
        if comm.rank != 0:
            assert part[k].x.untyped_storage().nbytes() == 4000
    # Datasets that are only rows travel as blocks of rows (3 rows of 4 KB per 12 KiB block here);
    # each item is what root's dataset[i] gives, of the same type; a subclass goes sample by sample.
    table = torch.randn(n, 1000, generator=torch.Generator().manual_seed(0))  # alike on every rank
    labels = torch.arange(n)
    for data in (table, table.numpy(), torch.utils.data.TensorDataset(table, labels), Labelled(table, labels)):
        part = scatter_dataset(data if comm.rank == 0 else None, comm, shuffle=True, seed=3, max_buf_len=12 * 1024)
        assert len(part) == 7
        for k, i in enumerate(part.indices):
            want, got = data[i], part[k]
            assert type(got) is type(want), (type(got), type(want))
            for a, b in (zip(want, got) if isinstance(want, tuple) else [(want, got)]):
                assert a == b if isinstance(a, (int, str)) else torch.equal(torch.as_tensor(a), torch.as_tensor(b)), \
                    (type(data).__name__, k, i)


def check_scatter_object_array(comm):
    """A NumPy array of Python objects (strings from pandas' .values, dicts) is scattered sample by
    sample, each rank's part holding root's objects, at once (its elements are references, not rows
    of bytes to send in blocks)."""
    n = 3 * comm.size + 1
    data = np.empty(n, dtype=object)
    for i in range(n):
        data[i] = {"id": i, "text": f"sample {i}"} if i % 2 else f"sample {i}"
    start = time.monotonic()
    part = scatter_dataset(data if comm.rank == 0 else None, comm, shuffle=True, seed=4, force_equal_length=False)
    assert time.monotonic() - start < 20, time.monotonic() - start
    assert [part[k] for k in range(len(part))] == [data[i] for i in part.indices], (part.indices, list(part))
    assert sorted(i for p in comm.allgather_obj(part.indices) for i in p) == list(range(n))


class Labelled(torch.utils.data.TensorDataset):
    """A TensorDataset whose items are more than its rows."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, int(y), "labelled"


Row = collections.namedtuple("Row", "x y")


def check_scatter_errors(comm):
    last = comm.size - 1
    # A non-root rank passing a dataset: every rank raises, naming the culprit.
    data = [1, 2, 3] if comm.rank in (0, last) else None
    e = expect_raise(lambda: scatter_dataset(data, comm), ValueError)
    assert f"rank {last} passed a dataset" in str(e), e
    # Root passing None.
    data = [1, 2, 3] if comm.rank == 1 else None
    e = expect_raise(lambda: scatter_dataset(data, comm), ValueError)
    assert "root rank 0 passed None" in str(e), e
    # Reading a sample fails on root midway: every rank raises, including ranks already served.
    data = Failing(4 * comm.size) if comm.rank == 0 else None
    e = expect_raise(lambda: scatter_dataset(data, comm, force_equal_length=False), KeyError, RemoteRankError)
    assert "unreadable" in str(e), e
    assert isinstance(e, KeyError) == (comm.rank == 0), (comm.rank, type(e))
    # Item 4 is in rank 1's part: rank 1 hears which sample failed, the ranks after it whose part it was.
    data = Failing(4 * comm.size, bad=4) if comm.rank == 0 else None
    e = expect_raise(lambda: scatter_dataset(data, comm), KeyError, RemoteRankError)
    if comm.rank == 1:
        assert "failed while sending samples: sample 4: KeyError" in str(e), e
    elif comm.rank > 1:
        assert "failed while sending samples: rank 1's part: KeyError" in str(e), e
    # A non-root rank cannot unpickle its samples: every rank raises at once, not at the timeout
    # (root must not be left waiting in a send of that rank's later chunks).
    start = time.monotonic()
    data = [Unpicklable(i) for i in range(40 * comm.size)] if comm.rank == 0 else None
    e = expect_raise(lambda: scatter_dataset(data, comm, max_buf_len=64), RuntimeError, RemoteRankError)
    assert time.monotonic() - start < 10 and "could not unpickle" in str(e), e
    assert isinstance(e, RemoteRankError) == (comm.rank != comm.size - 1), (comm.rank, e)
    # The communicator is still usable afterwards.
    assert comm.allreduce_obj(1) == comm.size


def check_scatter_bad_seed_refused_at_once(comm):
    """A seed torch's generator cannot take is refused on every rank before any waits for a part
    (root drew the order after the others were already waiting for theirs)."""
    for seed, shared in ((2 ** 64, False), ("abc", False), (2 ** 64, True)):
        data = (RangeData(10) if shared else list(range(10))) if comm.rank == 0 else None
        start = time.monotonic()
        e = expect_raise(lambda: scatter_dataset(data, comm, shuffle=True, seed=seed), ValueError)
        assert time.monotonic() - start < 10, (seed, time.monotonic() - start)
        assert f"seed {seed!r} cannot seed" in str(e) and "2**64 - 1" in str(e), e
    assert comm.allreduce_obj(1) == comm.size


class LazyFiles(torch.utils.data.Dataset):
    """A dataset whose len() opens a file that is not there."""

    def __len__(self):
        with open("/nonexistent/train.idx") as f:
            return len(f.read())

    def __getitem__(self, i):
        return i


class Record:
    """A sample of a type with no == of its own: two reads are two objects."""

    def __init__(self, x):
        self.x = x


class Records(torch.utils.data.Dataset):
    """Deterministic samples of a plain class."""

    def __len__(self):
        return 2 * torch.distributed.get_world_size()

    def __getitem__(self, i):
        return Record(i)


class Augmented(torch.utils.data.Dataset):
    """A random transform in __getitem__."""

    def __len__(self):
        return 4 * torch.distributed.get_world_size()

    def __getitem__(self, i):
        return torch.tensor([float(i)]) + torch.rand(1)


def check_scatter_disagreements_refused(comm):
    """Every rank raises at once, in the same call, naming what is wrong: ranks that each passed
    themselves as root, ranks that passed different force_equal_length, root's len() raising
    something other than TypeError (the next scatter then pairs up as it should)."""
    start = time.monotonic()
    e = expect_raise(lambda: scatter_dataset(list(range(6)), comm, root=comm.rank), ValueError)
    assert "different root (rank 0: 0, rank 1: 1" in str(e), e
    e = expect_raise(lambda: scatter_dataset(list(range(6)) if comm.rank == 0 else None, comm,
                                             force_equal_length=comm.rank == 0), ValueError)
    assert "different force_equal_length (rank 0: True, rank 1: False" in str(e), e
    e = expect_raise(lambda: scatter_dataset(LazyFiles() if comm.rank == 0 else None, comm), ValueError)
    assert "root rank 0's len(dataset) (LazyFiles) raised FileNotFoundError" in str(e), e
    assert time.monotonic() - start < 10
    part = scatter_dataset([f"v{i}" for i in range(2 * comm.size)] if comm.rank == 0 else None, comm)
    assert part[:] == [f"v{2 * comm.rank}", f"v{2 * comm.rank + 1}"], part[:]


def check_scatter_random_samples_warned(comm):
    """A dataset whose samples differ between reads (a random transform) makes root warn, saying
    how to augment on every rank; TransformDataset over a part draws anew at every read."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        part = scatter_dataset(Augmented() if comm.rank == 0 else None, comm)
    said = [str(w.message) for w in caught if "differs between two reads" in str(w.message)]
    assert len(said) == (1 if comm.rank == 0 else 0), said
    if said:
        assert "TransformDataset(part, transform)" in said[0] and "SharedDataset" in said[0], said[0]
        where = [w.filename for w in caught if "differs between two reads" in str(w.message)]
        assert where == [__file__], f"warned at {where}, not at the scatter_dataset call"
    plain = scatter_dataset(list(range(4 * comm.size)) if comm.rank == 0 else None, comm)
    augmented = TransformDataset(plain, lambda i: torch.tensor([float(i)]) + torch.rand(1))
    first, second = augmented[:], augmented[:]
    assert all(torch.floor(x) == i for x, i in zip(first, plain[:]))
    assert all(not torch.equal(a, b) for a, b in zip(first, second)), (first, second)
    assert len(part) == 4 and len(augmented) == 4
    # Deterministic samples, NaN included, are not warned about.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scatter_dataset([(torch.tensor([float("nan"), i]), {"y": i}) for i in range(2 * comm.size)]
                        if comm.rank == 0 else None, comm)
    assert not [w for w in caught if "differs between two reads" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        part = scatter_dataset(Records() if comm.rank == 0 else None, comm)
    assert not [w for w in caught if "differs between two reads" in str(w.message)], [str(w.message) for w in caught]
    assert [r.x for r in part] == [2 * comm.rank, 2 * comm.rank + 1]


def check_scatter_index(comm):
    if comm.size == 3:
        expected = [(0, 4), (4, 7), (7, 10)]
        assert scatter_index(10, comm, force_equal_length=False) == expected[comm.rank]
    # ChainerMN's way: only root's count matters, the third argument is root
    last = comm.size - 1
    assert scatter_index(10 if comm.rank == last else None, comm, last) == scatter_index(10, comm)
    try:
        scatter_index(-3 if comm.rank == last else 10, comm, root=last)
        raise AssertionError("a negative count on root must raise")
    except ValueError as e:
        assert "n_total must be >= 0" in str(e) and f"rank {comm.rank}" in str(e), e
    for n in range(0, 4 * comm.size + 2):
        ranges = comm.allgather_obj(scatter_index(n, comm))
        n_sub = -(-n // comm.size)
        assert all(e - b == n_sub and 0 <= b and e <= n for b, e in ranges), (n, ranges)
        assert set().union(*(range(b, e) for b, e in ranges)) == set(range(n)), (n, ranges)
        ranges = comm.allgather_obj(scatter_index(n, comm, force_equal_length=False))
        assert [b for b, _ in ranges[1:]] == [e for _, e in ranges[:-1]] and ranges[0][0] == 0
        assert ranges[-1][1] == n


# ----------------------------------------------------------------------------- evaluators
def check_evaluator(comm):
    shard = list(range(comm.rank, 97, comm.size))

    def evaluate(offset=0.0):
        sq = torch.tensor(sum(x * x for x in shard) / len(shard), dtype=torch.float64)
        return {"mean": sum(shard) / len(shard) + offset, "sq": sq}, len(shard)

    result = create_multi_node_evaluator(evaluate, comm)()
    assert result["mean"] == 48.0, result
    assert math.isclose(result["sq"], sum(x * x for x in range(97)) / 97, rel_tol=1e-12), result
    assert comm.allgather_obj(result) == [result] * comm.size
    assert create_multi_node_evaluator(evaluate, comm)(offset=1.0)["mean"] == 49.0
    # A rank that saw nothing contributes nothing.
    def some_empty():
        return ({}, 0) if comm.rank == 1 else evaluate()
    kept = [v for r in range(comm.size) if r != 1 for v in range(r, 97, comm.size)]
    assert math.isclose(create_multi_node_evaluator(some_empty, comm)()["mean"], sum(kept) / len(kept), rel_tol=1e-12)
    # ... its metric names included (an empty rank's NaN placeholders for a metric nobody else has).
    def empty_with_extra():
        return ({"mean": math.nan, "top5": math.nan}, 0) if comm.rank == 1 else evaluate()
    out = create_multi_node_evaluator(empty_with_extra, comm)()
    assert sorted(out) == ["mean", "sq"] and math.isclose(out["mean"], sum(kept) / len(kept), rel_tol=1e-12), out
    # Nobody saw anything: NaN for every named metric.
    out = create_multi_node_evaluator(lambda: ({"loss": 1.0}, 0), comm)()
    assert list(out) == ["loss"] and math.isnan(out["loss"]), out
    # A plain dict counts once per rank.
    out = create_multi_node_evaluator(lambda: {"r": float(comm.rank)}, comm)()
    assert out == {"r": (comm.size - 1) / 2}, out
    # fn failing on one rank: every rank raises.
    def broken():
        if comm.rank == 1:
            raise ZeroDivisionError("no data")
        return evaluate()
    e = expect_raise(create_multi_node_evaluator(broken, comm), ZeroDivisionError, RuntimeError)
    assert "no data" in str(e) and isinstance(e, ZeroDivisionError) == (comm.rank == 1), e
    # Ranks reporting different metrics: every rank raises.
    e = expect_raise(create_multi_node_evaluator(lambda: ({f"m{comm.rank}": 1.0}, 1), comm), ValueError)
    assert "same metrics" in str(e), e


def check_evaluator_object(comm):
    """An evaluator object, as ChainerMN's create_multi_node_evaluator took: pytorch-pfn-extras'
    Evaluator extension, whose evaluate() and __call__ then give the mean over the ranks."""
    import pytorch_pfn_extras as ppe
    from pytorch_pfn_extras.training.extensions import Evaluator

    data = torch.arange(8.0, dtype=torch.float64).view(8, 1) + 100 * comm.rank  # rank r: mean 3.5 + 100 r

    def eval_func(x):
        ppe.reporting.report({"val/x": x.mean().item()})

    evaluator = Evaluator(torch.utils.data.DataLoader(data, batch_size=4), torch.nn.Linear(1, 1),
                          eval_func=eval_func, progress_bar=False)
    assert create_multi_node_evaluator(evaluator, comm) is evaluator
    expected = 3.5 + 100 * (comm.size - 1) / 2
    observed = {}
    with ppe.reporting.Reporter().scope(observed):
        assert evaluator.evaluate() == {"val/x": expected}
        evaluator()  # as the manager calls it: reports the mean over the ranks
    assert observed == {"val/x": expected}, observed
    # A rank without validation batches (a small set scattered with force_equal_length=False)
    # reports nothing, and the others' mean stands.
    few = Evaluator(torch.utils.data.DataLoader(data[:4] if comm.rank == 0 else data[:0], batch_size=4),
                    torch.nn.Linear(1, 1), eval_func=eval_func, progress_bar=False)
    with ppe.reporting.Reporter().scope({}):
        assert create_multi_node_evaluator(few, comm).evaluate() == {"val/x": 1.5}


def check_evaluator_object_over_uneven_shards(comm):
    """Rank r holds r + 1 batches: the ranks' means weighted by their batches equal what one
    process's Evaluator gives over the whole set."""
    import pytorch_pfn_extras as ppe
    from pytorch_pfn_extras.training.extensions import Evaluator

    def eval_func(x):
        ppe.reporting.report({"val/x": x.mean().item()})

    def evaluator(data):
        return Evaluator(torch.utils.data.DataLoader(data, batch_size=4), torch.nn.Linear(1, 1), eval_func=eval_func,
                         progress_bar=False)

    shards = [torch.arange(4.0 * (r + 1), dtype=torch.float64).view(-1, 1) + 100 * r for r in range(comm.size)]
    with ppe.reporting.Reporter().scope({}):
        whole = evaluator(torch.cat(shards)).evaluate()
        assert create_multi_node_evaluator(evaluator(shards[comm.rank]), comm).evaluate() == whole, whole


def check_evaluator_subclass_with_its_own_evaluate(comm):
    """A pytorch-pfn-extras Evaluator subclass whose evaluate() is its own (ppe's way to write a
    custom evaluation loop) never reaches the hook ppe's evaluate() calls: its means are averaged
    over the ranks all the same, weighted by their batches, the same on every rank."""
    import pytorch_pfn_extras as ppe
    from pytorch_pfn_extras.training.extensions import Evaluator

    class OwnLoop(Evaluator):
        def evaluate(self):
            total, n = 0.0, 0
            for x in self.get_iterator("main"):
                total, n = total + x.sum().item(), n + len(x)
            return {"val/mean": total / n}

    # Rank r holds r + 1 batches of 2 values, all 10 r.
    data = torch.full((2 * (comm.rank + 1), 1), 10.0 * comm.rank, dtype=torch.float64)
    evaluator = create_multi_node_evaluator(OwnLoop(torch.utils.data.DataLoader(data, batch_size=2),
                                                    torch.nn.Linear(1, 1), progress_bar=False), comm)
    with ppe.reporting.Reporter().scope({}):
        got = evaluator.evaluate()
    expected = sum(10.0 * r * (r + 1) for r in range(comm.size)) / sum(r + 1 for r in range(comm.size))
    assert got == {"val/mean": expected}, (got, expected)
    assert comm.allgather_obj(got) == [got] * comm.size


def check_evaluator_object_weighted_reports(comm):
    """Reports with their own weights (``(value, n)``) and a metric some batches do not report:
    the result equals one process's Evaluator over the whole set (the same batches), as ppe's
    DistributedEvaluator gives."""
    import pytorch_pfn_extras as ppe
    from pytorch_pfn_extras.training.extensions import Evaluator

    def eval_func(x):
        report = {"val/x": (x.mean(), len(x))}
        if int(x[0, 0].item()) % 2 == 0:
            report["val/even"] = x.sum().item()
        ppe.reporting.report(report)

    def evaluator(data):
        return Evaluator(torch.utils.data.DataLoader(data, batch_size=3), torch.nn.Linear(1, 1), eval_func=eval_func,
                         progress_bar=False)

    # Whole batches on every rank but the last, whose last batch has one sample.
    sizes = [3 * (r + 1) + (1 if r == comm.size - 1 else 0) for r in range(comm.size)]
    shards = [torch.arange(float(n), dtype=torch.float64).view(-1, 1) + 100 * r for r, n in enumerate(sizes)]
    with ppe.reporting.Reporter().scope({}):
        whole = {k: float(v) for k, v in evaluator(torch.cat(shards)).evaluate().items()}
        got = {k: float(v) for k, v in create_multi_node_evaluator(evaluator(shards[comm.rank]), comm).evaluate().items()}
    assert got.keys() == whole.keys() and all(abs(got[k] - whole[k]) < 1e-12 for k in whole), (got, whole)
    # An evaluation that fails on one rank fails on every rank, instead of leaving the others waiting.
    def broken(x):
        if comm.rank == 1:
            raise ValueError("bad batch")
        eval_func(x)
    failing = create_multi_node_evaluator(Evaluator(torch.utils.data.DataLoader(shards[comm.rank], batch_size=3),
                                                    torch.nn.Linear(1, 1), eval_func=broken, progress_bar=False), comm)
    with ppe.reporting.Reporter().scope({}):
        try:
            failing.evaluate()
        except ValueError as e:
            assert comm.rank == 1 and "bad batch" in str(e), e
        except RuntimeError as e:
            assert comm.rank != 1 and "failed on rank 1 (ValueError: bad batch)" in str(e), e
        else:
            raise AssertionError("the evaluation went on")


class Gather(GenericMultiNodeEvaluator):
    def __init__(self, comm, fail_rank=None, **kwargs):
        super().__init__(comm, **kwargs)
        self.fail_rank = fail_rank

    def evaluate_local(self, step):
        if self.comm.rank == self.fail_rank:
            raise ValueError("local evaluation broke")
        return list(range(self.comm.rank, 97, step))

    def aggregate(self, results):
        return sorted(x for r in results for x in r)


def check_generic_evaluator(comm):
    root = comm.size - 1
    out = Gather(comm, root=root)(comm.size)
    assert out == (list(range(97)) if comm.rank == root else None), out
    assert Gather(comm, broadcast=True)(comm.size) == list(range(97))
    for fail in (0, 1):
        e = expect_raise(lambda: Gather(comm, fail_rank=fail, broadcast=True)(comm.size), ValueError, RemoteRankError)
        assert "local evaluation broke" in str(e), e
    # A result rank 1 cannot pickle fails like evaluate_local itself: on every rank, at once (a third
    # rank must not wait in gather_obj for the timeout).
    class Unpicklable(Gather):
        def evaluate_local(self, step):
            return (lambda: 0) if self.comm.rank == 1 else super().evaluate_local(step)

    start = time.monotonic()
    e = expect_raise(lambda: Unpicklable(comm, broadcast=True)(comm.size), Exception, RemoteRankError)
    assert "pickle" in str(e) and time.monotonic() - start < 10, (e, time.monotonic() - start)
    # broadcast on one rank only: every rank is told, and all stay in step for what follows.
    try:
        Gather(comm, broadcast=comm.rank == 0)(comm.size)
    except torchmn.CollectiveMismatchError as e:
        assert "rank 0: root=0, broadcast=True" in str(e) and "rank 1: root=0, broadcast=False" in str(e), e
    else:
        raise AssertionError("no error")
    assert comm.allgather_obj(comm.rank) == list(range(comm.size))


# ----------------------------------------------------------------------------- iterators
class DictData(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "pair": (torch.tensor(i), [torch.tensor(-i)])}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_iterator(comm):
    master = comm.size - 1
    torch.manual_seed(comm.rank)  # only the master's shuffling may matter
    loader = DataLoader(DictData(), batch_size=4, shuffle=True) if comm.rank == master else None
    it = create_multi_node_iterator(loader, comm, rank_master=master)
    assert len(it) == 3
    epochs = [list(it) for _ in range(2)]
    assert [len(e) for e in epochs] == [3, 3]
    assert it.epoch == 2
    everyone = comm.allgather_obj(epochs)
    assert all(_same(everyone[0], other) for other in everyone), "ranks saw different batches"
    seen = sorted(int(i) for batch in epochs[0] for i in batch["pair"][0])
    assert seen == list(range(10)), seen
    assert sorted(epochs[0][0]) == ["pair", "x"]
    # A source without len(): iteration still works, len() says why it cannot.
    it = create_multi_node_iterator((torch.tensor(k) for k in range(5)) if comm.rank == 0 else None, comm)
    expect_raise(lambda: len(it), TypeError)
    assert [int(t) for t in it] == list(range(5))
    # The master's loader failing mid-epoch: every rank raises after the same batch.

    def broken_source():
        yield torch.tensor(0)
        raise OSError("disk gone")

    it = create_multi_node_iterator(broken_source() if comm.rank == 0 else None, comm)
    got = []
    e = expect_raise(lambda: got.extend(it), OSError, RemoteRankError)
    assert "disk gone" in str(e) and isinstance(e, OSError) == (comm.rank == 0), e
    assert [int(t) for t in got] == [0]
    # The master's loader failing to start (iter() raises), or to tell its length: the same.

    class NoStart:
        def __len__(self):
            return 3

        def __iter__(self):
            raise OSError("workers cannot start")

    start = time.monotonic()
    e = expect_raise(lambda: list(create_multi_node_iterator(NoStart() if comm.rank == 0 else None, comm)),
                     OSError, RemoteRankError)
    assert time.monotonic() - start < 10 and "workers cannot start" in str(e), e
    assert isinstance(e, OSError) == (comm.rank == 0), e

    class NoLength(NoStart):
        def __len__(self):
            raise RuntimeError("length unknown yet")

    e = expect_raise(lambda: create_multi_node_iterator(NoLength() if comm.rank == 0 else None, comm), ValueError)
    assert "length unknown yet" in str(e), e
    # Batch types survive (a dict subclass stays one); a view travels without its whole storage.
    table = torch.arange(200_000.0).reshape(1000, 200)  # 800 KB; a batch of 2 rows is 1.6 KB
    typed = [Batch(x=rows, n=i) for i, rows in enumerate(torch.split(table, 2))][:3]
    it = create_multi_node_iterator(iter(typed) if comm.rank == 0 else None, comm)
    got = list(it)
    assert [type(b) for b in got] == [Batch] * 3 and all(_same(b, t) for b, t in zip(got, typed)), got
    if comm.rank != 0:
        assert all(b["x"].untyped_storage().nbytes() == 1600 for b in got)
    # A batch that cannot be pickled fails on every rank at once, not at the timeout.

    def unpicklable():
        yield torch.tensor(0)
        yield lambda: None

    start = time.monotonic()
    got = []
    e = expect_raise(lambda: got.extend(create_multi_node_iterator(unpicklable() if comm.rank == 0 else None, comm)),
                     Exception)
    assert time.monotonic() - start < 10 and "pickle" in str(e).lower() and len(got) == 1, (e, got)
    assert isinstance(e, RemoteRankError) == (comm.rank != 0), e


class Batch(dict):
    pass


def check_iterator_out_of_step_refused(comm):
    """A rank that leaves an epoch early (break) and starts the next is told so at its next batch,
    instead of silently getting the rest of the master's epoch as its next one."""
    master, late = 0, comm.size - 1
    if comm.size < 2:
        return
    it = create_multi_node_iterator([torch.tensor(k) for k in range(3)] if comm.rank == master else None, comm)
    if comm.rank != late:
        assert [int(t) for t in it] == [0, 1, 2]
        return
    for _ in it:
        break  # leaves after batch 0 of epoch 0, while the master goes on
    e = expect_raise(lambda: next(iter(it)), RuntimeError)
    assert f"rank {late} is at batch 0 of epoch 0, but master rank 0 sent batch 1 of epoch 0" in str(e) \
        and "break" in str(e), e
    for _ in range(2):  # the master's batch 2 and end of epoch, so that the job's later calls meet
        comm.bcast_obj(None, root=master)




# ----------------------------------------------------------------------------- extensions
def _manager(model, iters_per_epoch, max_epochs, out, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ppe.training.ExtensionsManager(model, opt, max_epochs, iters_per_epoch=iters_per_epoch,
                                          out_dir=out, **kwargs)


def check_early_stopping(comm, tmp):
    # verbose=True: ppe's constructor speaks on rank 0 only.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        MultiNodeEarlyStoppingTrigger(comm, monitor="val/loss", verbose=True)
    assert ("early stopping: operator" in printed.getvalue()) == (comm.rank == 0), printed.getvalue()
    # Rank 0's loss grows fast, the others' shrink slowly: the global mean grows, so every rank
    # must stop after epoch 1 + patience although only rank 0's own values say so.
    stop = MultiNodeEarlyStoppingTrigger(comm, monitor="val/loss", patience=2, max_trigger=(20, "epoch"))
    manager = _manager(torch.nn.Linear(2, 2), 2, 20, os.path.join(tmp, f"es{comm.rank}"), stop_trigger=stop)
    while not manager.stop_trigger:
        with manager.run_iteration():
            if manager.iteration % 2 == 1:
                epoch = manager.iteration // 2 + 1
                ppe.reporting.report({"val/loss": 10.0 * epoch if comm.rank == 0 else 1.0 - 0.01 * epoch})
    assert comm.allgather_obj(manager.epoch) == [3] * comm.size, manager.epoch
    # Killed right after epoch 3's snapshot (its best value) and resumed: the run stops where an
    # uninterrupted one does (epoch 5), and so does running the finished job again.
    out = os.path.join(tmp, "es_resume")
    losses = {1: 9.0, 2: 8.0, 3: 5.0, 4: 6.0, 5: 7.0, 6: 6.5, 7: 6.8}

    def train(crash_after=None):
        stop = MultiNodeEarlyStoppingTrigger(comm, monitor="val/loss", patience=2, max_trigger=(20, "epoch"))
        manager = _manager(torch.nn.Linear(2, 2), 2, 20, out, stop_trigger=stop)
        snap = multi_node_snapshot(comm, autoload=True)
        manager.extend(snap, trigger=(1, "epoch"))
        while not manager.stop_trigger:
            with manager.run_iteration():
                if manager.iteration % 2 == 1:  # each rank its own value; their mean is losses[epoch]
                    epoch = manager.iteration // 2 + 1
                    ppe.reporting.report({"val/loss": losses[epoch] + 0.1 * (2 * comm.rank - comm.size + 1)})
            if manager.iteration == crash_after:
                break
        return snap.resumed_from, manager.epoch, stop.best
    assert train(crash_after=6) == (None, 3, 8.0)
    resumed, epoch, best = train()
    assert (resumed, epoch) == (6, 5) and abs(best - 5.0) < 1e-9, (resumed, epoch, best)
    resumed, epoch, best = train()
    assert (resumed, epoch) == (10, 5) and abs(best - 5.0) < 1e-9, (resumed, epoch, best)


def check_observation_aggregator(comm, tmp):
    seen = []
    manager = _manager(torch.nn.Linear(2, 2), 2, 2, os.path.join(tmp, f"oa{comm.rank}"))
    manager.extend(ObservationAggregator(comm, "loss", "loss/global", comm_trigger=(1, "epoch")))
    manager.extend(ObservationAggregator(comm, "loss"))  # in place, every iteration
    manager.extend(lambda m: seen.append((m.observation.get("loss"), m.observation.get("loss/global"))),
                   trigger=(1, "iteration"))
    log = ppe.training.extensions.LogReport(trigger=(1, "epoch"), filename=None)
    manager.extend(log)
    while not manager.stop_trigger:
        with manager.run_iteration():
            ppe.reporting.report({"loss": float(comm.rank + manager.iteration)})
    # Iteration i reports rank + i on each rank; epoch e (0-based) holds iterations 2e and 2e + 1.
    r = (comm.size - 1) / 2
    assert seen == [(r, None), (r + 1, r + 0.5), (r + 2, None), (r + 3, r + 2.5)], seen
    assert [entry["loss"] for entry in log.log] == [r + 0.5, r + 2.5], log.log  # global means, not mixed
    # Stopped after the first iteration of epoch 1 and resumed from a snapshot taken there: the
    # epoch's global value is the same as without the stop.
    out = os.path.join(tmp, f"oa_resume{comm.rank}")

    def train(stop_at):
        reported = []
        manager = _manager(torch.nn.Linear(2, 2), 2, 2, out)
        manager.extend(ObservationAggregator(comm, "loss", "loss/global", comm_trigger=(1, "epoch")))
        manager.extend(lambda m: reported.append(m.observation.get("loss/global")), trigger=(1, "epoch"))
        manager.extend(multi_node_snapshot(comm, autoload=True), trigger=(1, "iteration"))
        while not manager.stop_trigger and manager.iteration != stop_at:
            with manager.run_iteration():
                ppe.reporting.report({"loss": float(comm.rank + manager.iteration)})
        return reported
    assert train(stop_at=3) == [r + 0.5]
    assert train(stop_at=None) == [r + 2.5]


def check_observation_aggregator_weighs_each_observation(comm, tmp):
    """As ChainerMN's: the mean of every observation of the interval, whichever rank made it, and
    an aggregator given every rank's list of observations."""
    seen = []
    manager = _manager(torch.nn.Linear(2, 2), 3, 1, os.path.join(tmp, f"oaw{comm.rank}"))
    manager.extend(ObservationAggregator(comm, "acc", "acc/global", comm_trigger=(1, "epoch")))
    manager.extend(ObservationAggregator(comm, "acc", "acc/max", comm_trigger=(1, "epoch"),
                                         aggregator=lambda every: max(sum(every, []))))
    manager.extend(lambda m: seen.append((m.observation.get("acc/global"), m.observation.get("acc/max"))),
                   trigger=(1, "epoch"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            if comm.rank == 0 or manager.iteration == 0:  # rank 0 observes 3 times, the others once
                ppe.reporting.report({"acc": float(manager.iteration if comm.rank == 0 else 100 + comm.rank)})
    others = [100.0 + r for r in range(1, comm.size)]
    assert seen == [((0 + 1 + 2 + sum(others)) / (3 + len(others)), max([2.0] + others))], seen


def check_allreduce_persistent(comm, tmp):
    bn = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(2).double())
    with torch.no_grad():
        bn[0].running_mean.fill_(comm.rank)
        bn[0].running_var.fill_(comm.rank * 2.0 + 1)
        bn[1].running_mean.fill_(comm.rank * 3.0)
        bn[0].num_batches_tracked.fill_(7)
    AllreducePersistent(bn, comm)()
    r = (comm.size - 1) / 2
    assert torch.equal(bn[0].running_mean, torch.full((3,), r)), bn[0].running_mean
    assert torch.equal(bn[0].running_var, torch.full((3,), 2 * r + 1))
    assert torch.equal(bn[1].running_mean, torch.full((2,), 3 * r, dtype=torch.float64))
    assert bn[1].running_mean.dtype == torch.float64 and int(bn[0].num_batches_tracked) == 7
    # float16 statistics whose sum over ranks passes 65504; a buffer equal on every rank comes back
    # bit for bit; a non-persistent buffer (not state) is left as it is.
    model = torch.nn.BatchNorm1d(2).half()
    values = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    model.register_buffer("same", values.clone())
    model.register_buffer("mask", torch.full((2,), float(comm.rank)), persistent=False)
    with torch.no_grad():
        model.running_var.fill_(40000.0)
    AllreducePersistent(model, comm)()
    assert model.running_var.tolist() == [40000.0, 40000.0], model.running_var
    assert torch.equal(model.same, values) and model.mask.tolist() == [comm.rank] * 2


def check_snapshot(comm, tmp):
    out = os.path.join(tmp, "snap")
    model = torch.nn.Linear(2, 1)
    manager = _manager(model, 1, 4, out)
    manager.extend(multi_node_snapshot(comm, n_retains=3), trigger=(1, "iteration"))
    while not manager.stop_trigger:
        with manager.run_iteration():
            with torch.no_grad():
                model.weight.fill_(manager.iteration + 1 + 10 * comm.rank)
    assert sorted(available_iterations(out, comm.rank)) == [2, 3, 4]
    comm.barrier()
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")], os.listdir(out)   # all renamed
    # The last rank "crashed" before writing iteration 4; rank 0 lost iteration 2.
    if comm.rank == comm.size - 1:
        os.remove(available_iterations(out, comm.rank)[4])
    if comm.rank == 0:
        os.remove(available_iterations(out, comm.rank)[2])
    comm.barrier()
    model = torch.nn.Linear(2, 1)
    manager = _manager(model, 1, 6, out)
    ext = multi_node_snapshot(comm, autoload=True)
    manager.extend(ext, trigger=(1, "iteration"))
    assert manager.iteration == 3, manager.iteration   # starting the extensions resumes
    assert ext.resumed_from == 3
    assert torch.equal(model.weight, torch.full((1, 2), 3.0 + 10 * comm.rank)), model.weight
    # resume_latest on a plain object; no common snapshot gives None everywhere.
    other = torch.nn.Linear(2, 1)
    assert resume_latest(other, comm, os.path.join(tmp, "nothing")) is None
    # Only some ranks have snapshots (as after the job grew): a fresh start, and rank 0 says why.
    partial = os.path.join(tmp, "partial")
    if comm.rank == 0:
        os.makedirs(partial)
        torch.save(other.state_dict(), snapshot_path(partial, DEFAULT_FILENAME, 5, 0))
    comm.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resume_latest(other, comm, partial) is None
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == (comm.rank == 0), said
    assert not said or ("rank(s) 0 have some, up to iteration 5" in said[0] and "more ranks" in said[0]), said
    e = expect_raise(lambda: multi_node_snapshot(comm, filename="snap_{iteration}"), ValueError)
    assert "{rank}" in str(e)
    _check_snapshot_beside_another_runs(comm, tmp)
    _check_snapshot_trigger_that_differs_between_ranks(comm, tmp)


def check_snapshot_unreadable_on_one_rank(comm, tmp):
    """Rank 1's snapshot is damaged; the manager holds the default multi-node optimizer, whose
    loading meets the other ranks: every rank is told at once, naming rank 1's file."""
    if comm.size < 2:
        return
    out = os.path.join(tmp, "damaged")

    def manager():
        model = torch.nn.Linear(2, 1)
        optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
        return ppe.training.ExtensionsManager(model, optimizer, 2, iters_per_epoch=1, out_dir=out)

    first = manager()
    first.extend(multi_node_snapshot(comm), trigger=(1, "iteration"))
    while not first.stop_trigger:
        with first.run_iteration():
            pass
    comm.barrier()
    if comm.rank == 1:
        with open(available_iterations(out, 1)[2], "wb") as f:
            f.write(b"not a snapshot")
    comm.barrier()
    started = time.monotonic()
    e = expect_raise(lambda: resume_latest(manager(), comm, out), RuntimeError)
    assert isinstance(e, RemoteRankError) == (comm.rank != 1), type(e)
    assert "loading iteration 2 failed on rank 1" in str(e) and "snapshot_iter_2_rank1" in str(e), e
    assert time.monotonic() - started < 10, "the ranks waited for each other"
    comm.barrier()


def _check_snapshot_beside_another_runs(comm, tmp):
    """A fresh run in a directory where rank 0 still has an older run's later snapshots (as after the
    job grew): n_retains keeps what this run writes, so a restart resumes from it."""
    out = os.path.join(tmp, "beside")
    if comm.rank == 0:
        os.makedirs(out)
        for it in (15, 18):
            torch.save({}, snapshot_path(out, DEFAULT_FILENAME, it, 0))
    comm.barrier()

    def train(iterations):
        manager = _manager(torch.nn.Linear(2, 1), 1, 100, out)
        snap = multi_node_snapshot(comm, n_retains=2, autoload=True)
        manager.extend(snap, trigger=(3, "iteration"))
        while manager.iteration < iterations:
            with manager.run_iteration():
                pass
        return snap.resumed_from
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # rank 0's note that it starts afresh
        assert train(9) is None
    assert sorted(available_iterations(out, comm.rank)) == ([6, 9, 15, 18] if comm.rank == 0 else [6, 9])
    assert train(12) == 9


class _SkewedTrigger(ppe.training.trigger.Trigger):
    """Fires at iterations that differ between ranks, as a clock-based trigger does."""

    def __init__(self, rank):
        self.rank = rank

    def __call__(self, manager):
        return manager.iteration % 3 == self.rank % 3


def _check_snapshot_trigger_that_differs_between_ranks(comm, tmp):
    """Every rank snapshots when rank 0's trigger fires, also where the snapshot is collective (a
    sharded optimizer's state_dict), so that no rank waits for ranks that never come."""
    out = os.path.join(tmp, "skewed")
    model = torch.nn.Linear(2, 1)
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm, shard_state=True)
    manager = ppe.training.ExtensionsManager(model, optimizer, 100, iters_per_epoch=1, out_dir=out)
    manager.extend(multi_node_snapshot(comm), trigger=_SkewedTrigger(comm.rank))
    while manager.iteration < 7:
        with manager.run_iteration():
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
    assert sorted(available_iterations(out, comm.rank)) == [3, 6], sorted(available_iterations(out, comm.rank))


def check_early_stopping_trigger_that_differs_between_ranks(comm, tmp):
    """A check_trigger that fires at different iterations on different ranks (a clock's): every
    rank checks when rank 0's fires, so the allreduce of the check meets on all of them."""
    stop = MultiNodeEarlyStoppingTrigger(comm, check_trigger=_SkewedTrigger(comm.rank), monitor="val/loss",
                                         patience=1000, max_trigger=(12, "iteration"))
    manager = _manager(torch.nn.Linear(2, 2), 1, 100, os.path.join(tmp, f"es_skewed{comm.rank}"), stop_trigger=stop)
    while not manager.stop_trigger:
        with manager.run_iteration():
            ppe.reporting.report({"val/loss": 1.0})
    assert comm.allgather_obj(manager.iteration) == [12] * comm.size, manager.iteration


CHECKS = {
    "scatter": check_scatter,
    "scatter_chunks": check_scatter_chunks,
    "scatter_object_array": check_scatter_object_array,
    "scatter_errors": check_scatter_errors,
    "scatter_bad_seed_refused_at_once": check_scatter_bad_seed_refused_at_once,
    "scatter_index": check_scatter_index,
    "scatter_disagreements_refused": check_scatter_disagreements_refused,
    "scatter_random_samples_warned": check_scatter_random_samples_warned,
    "evaluator": check_evaluator,
    "evaluator_object": check_evaluator_object,
    "evaluator_object_over_uneven_shards": check_evaluator_object_over_uneven_shards,
    "evaluator_object_weighted_reports": check_evaluator_object_weighted_reports,
    "evaluator_subclass_with_its_own_evaluate": check_evaluator_subclass_with_its_own_evaluate,
    "generic_evaluator": check_generic_evaluator,
    "iterator": check_iterator,
    "iterator_out_of_step_refused": check_iterator_out_of_step_refused,
    "early_stopping": check_early_stopping,
    "early_stopping_trigger_that_differs_between_ranks": check_early_stopping_trigger_that_differs_between_ranks,
    "observation_aggregator": check_observation_aggregator,
    "observation_aggregator_weighs_each_observation": check_observation_aggregator_weighs_each_observation,
    "allreduce_persistent": check_allreduce_persistent,
    "snapshot": check_snapshot,
    "snapshot_unreadable_on_one_rank": check_snapshot_unreadable_on_one_rank,
}
NEEDS_TMP = {"early_stopping", "early_stopping_trigger_that_differs_between_ranks", "observation_aggregator", "observation_aggregator_weighs_each_observation",
             "allreduce_persistent", "snapshot", "snapshot_unreadable_on_one_rank"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tmp", required=True)
    parser.add_argument("checks", nargs="+")
    args = parser.parse_args()
    names = list(CHECKS) if args.checks == ["all"] else args.checks
    comm = torchmn.create_communicator()
    for name in names:
        start = time.perf_counter()
        if name in NEEDS_TMP:
            CHECKS[name](comm, args.tmp)
        else:
            CHECKS[name](comm)
        # Every rank got here: the check passed everywhere.
        comm.barrier()
        if comm.rank == 0:
            print(f"PASS {name} {time.perf_counter() - start:.1f}s", flush=True)
    comm.finalize()


if __name__ == "__main__":
    main()
