"""scatter_dataset, scatter_index, create_empty_dataset: in one process, and across real ranks."""
import collections
import dataclasses
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jobs import assert_check_passed
from workers.data_jobs import data_check_output
from torchmn.communicators import make_communicator
from torchmn.datasets import (DatasetPart, SharedDataset, create_empty_dataset, is_shared, scatter_dataset,
                              scatter_index)
from torchmn.datasets import index_range

CHECKS = ["scatter", "scatter_chunks", "scatter_object_array", "scatter_errors", "scatter_bad_seed_refused_at_once", "scatter_index",
          "scatter_disagreements_refused", "scatter_random_samples_warned"]


def solo():
    return make_communicator("naive", rank=0, size=1, group=None, obj_group=None, backend="gloo", node_key=0)


@pytest.mark.check_job("data")
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", CHECKS)
def test_across_ranks(np, check, request):
    assert_check_passed(data_check_output(request, np), check)


def ranges_of(n, size, **kw):
    """Every rank's scatter_index range, as the rule gives them (no ranks needed)."""
    return [index_range(n, size, r, **kw) for r in range(size)]


def test_scatter_index_uneven_three_ranks():
    assert ranges_of(10, 3, force_equal_length=False) == [(0, 4), (4, 7), (7, 10)]


def test_scatter_index_equal_length_overlaps_and_stays_in_range():
    assert ranges_of(10, 4, force_equal_length=True) == [(0, 3), (2, 5), (5, 8), (7, 10)]
    for n in range(0, 30):
        for size in range(1, 7):
            ranges = ranges_of(n, size, force_equal_length=True)
            assert all(e - b == -(-n // size) and e <= n for b, e in ranges), (n, size, ranges)
            assert set().union(*(range(b, e) for b, e in ranges)) == set(range(n))


def test_scatter_index_in_one_process():
    assert scatter_index(7, solo()) == (0, 7)
    assert scatter_index(np.int64(5), solo(), 0, force_equal_length=False) == (0, 5)
    with pytest.raises(ValueError, match="n_total"):
        scatter_index(-1, solo())
    with pytest.raises(ValueError, match="integer"):
        scatter_index(None, solo())
    with pytest.raises(TypeError):
        scatter_index(10, solo(), 0, False)  # force_equal_length is keyword-only, as in ChainerMN


def test_scatter_single_rank_is_whole_dataset():
    comm = solo()
    data = [("a", i) for i in range(7)]
    part = scatter_dataset(data, comm)
    assert len(part) == 7 and [part[i] for i in range(7)] == data and part[-1] == data[-1]
    shuffled = scatter_dataset(data, comm, shuffle=True, seed=3)
    assert sorted(shuffled.indices) == list(range(7)) and shuffled.indices != list(range(7))
    assert shuffled.indices == scatter_dataset(data, comm, shuffle=True, seed=3).indices
    assert [shuffled[i] for i in range(7)] == [data[i] for i in shuffled.indices]
    with pytest.raises(IndexError):
        part[7]


def test_scatter_empty_dataset():
    part = scatter_dataset([], solo(), shuffle=True, seed=0)
    assert len(part) == 0 and list(torch.utils.data.DataLoader(part)) == []


def test_scatter_root_must_pass_dataset():
    with pytest.raises(ValueError, match="root rank 0 passed None"):
        scatter_dataset(None, solo())
    with pytest.raises(ValueError, match="max_buf_len"):
        scatter_dataset([1], solo(), max_buf_len=0)


class Files(SharedDataset):
    def __init__(self, names):
        self.names = names

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        return self.names[i].upper()


def test_shared_protocol():
    assert is_shared(Files(["a"]))
    assert not is_shared([1, 2])
    assert is_shared(SimpleNamespace(__torchmn_shared__=True))
    part = scatter_dataset(Files(["a", "b"]), solo())
    assert isinstance(part.base, Files) and [part[0], part[1]] == ["A", "B"]


def test_dataset_part_pickles_and_loads():
    part = DatasetPart(["x", "y", "z"], [2, 0])
    again = pickle.loads(pickle.dumps(part))
    assert [again[0], again[1]] == ["z", "x"] and again.indices == [2, 0]


def test_create_empty_dataset():
    empty = create_empty_dataset(list(range(5)))
    assert len(empty) == 5 and empty[0] == () and empty[-1] == ()
    assert list(empty) == [()] * 5   # IndexError ends iteration
    with pytest.raises(IndexError, match="index 5 out of range"):
        empty[5]
    with pytest.raises(IndexError, match="index -6 out of range .* of length 5"):
        empty[-6]


def test_indices_may_be_numpy_integers_and_slices():
    part = DatasetPart(["x", "y", "z"], [2, 0, 1])
    assert part[np.int64(1)] == "x" and part[torch.tensor(2)] == "y"
    assert part[1:] == ["x", "y"] and part[::-1] == ["y", "x", "z"]
    empty = create_empty_dataset(range(6))
    assert empty[np.int64(-1)] == () and empty[2:5] == [(), (), ()]
    sampler = torch.utils.data.SubsetRandomSampler(np.arange(6))  # yields numpy integers
    assert [empty[i] for i in sampler] == [()] * 6 and len(list(torch.utils.data.DataLoader(empty, sampler=sampler))) == 6
    with pytest.raises(TypeError, match="integers or slices"):
        empty["a"]


Row = collections.namedtuple("Row", "x y")


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    y: int


class Batch(dict):
    pass


class Feature(torch.Tensor):
    """A dataset's own tensor type."""


def test_tensor_views_travel_without_their_whole_storage():
    from torchmn.communicators.pickling import dumps

    table = torch.randn(4000, 784)  # 12.5 MB; one row is 3 KB
    ds = torch.utils.data.TensorDataset(table, torch.arange(4000))
    for sample in (ds[7], Row(table[7], 7), Sample(table[7], 7), Batch(x=table[7], y=7), [[table[7]]],
                   table[7:8].t()):
        blob = dumps(sample)
        assert len(blob) < 10_000, type(sample)
        again = pickle.loads(blob)
        assert type(again) is type(sample)  # nothing is rebuilt as a plain tuple or dict
    assert torch.equal(pickle.loads(dumps(Row(table[7], 7))).x, table[7])
    row = table.as_subclass(Feature)[7]   # a subclass's view too (it carried its whole storage)
    assert len(dumps(row)) < 10_000 and type(pickle.loads(dumps(row))) is Feature
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.LazyBatchNorm1d()).state_dict()
    assert list(pickle.loads(dumps(lazy))) == list(lazy)   # uninitialized: no storage to look at
    assert torch.equal(pickle.loads(dumps(table[7:8].t())), table[7:8].t())
    shared = table[3]
    a, b = pickle.loads(dumps((shared, shared)))
    assert a is b  # one view sent once
    leaf = torch.zeros(3, requires_grad=True)
    assert pickle.loads(dumps(leaf)).requires_grad
    whole = table[:10].clone()  # pickled as pickle would: not copied again
    assert len(dumps(whole)) == len(pickle.dumps(whole, protocol=pickle.HIGHEST_PROTOCOL))


def test_transform_dataset_slice_transforms_each_item():
    """A slice is the list of the transformed items, also over a TensorDataset (whose own slice is
    its columns) and a dataset that takes integer indices only."""
    from torchmn.datasets import TransformDataset

    x, y = torch.arange(6.0).reshape(3, 2), torch.tensor([10, 11, 12])
    pairs = TransformDataset(torch.utils.data.TensorDataset(x, y), lambda s: (s[0] * 100, int(s[1])))
    got = pairs[0:2]
    assert len(got) == 2 and all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(got, [pairs[0], pairs[1]]))

    class IntegersOnly(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return [10, 11, 12][int(i)]

    assert TransformDataset(IntegersOnly(), str)[::-2] == ["12", "10"]
