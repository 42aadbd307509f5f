"""scatter_dataset, scatter_index, create_empty_dataset: in one process, and across real ranks."""
import pickle
from types import SimpleNamespace

import pytest
import torch

from workers.data_jobs import all_checks_output
from torchmn.communicators import make_communicator
from torchmn.datasets import (DatasetPart, SharedDataset, create_empty_dataset, is_shared, scatter_dataset,
                              scatter_index)

CHECKS = ["scatter", "scatter_chunks", "scatter_errors", "scatter_index"]


def solo():
    return make_communicator("naive", rank=0, size=1, group=None, obj_group=None, backend="gloo", node_key=0)


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("check", CHECKS)
def test_across_ranks(np, check):
    assert f"PASS {check} " in all_checks_output(np)


def test_scatter_index_uneven_three_ranks():
    ranges = [scatter_index(10, SimpleNamespace(rank=r, size=3), force_equal_length=False) for r in range(3)]
    assert ranges == [(0, 4), (4, 7), (7, 10)]


def test_scatter_index_equal_length_overlaps_and_stays_in_range():
    ranges = [scatter_index(10, SimpleNamespace(rank=r, size=4)) for r in range(4)]
    assert ranges == [(0, 3), (2, 5), (5, 8), (7, 10)]
    for n in range(0, 30):
        for size in range(1, 7):
            ranges = [scatter_index(n, SimpleNamespace(rank=r, size=size)) for r in range(size)]
            assert all(e - b == -(-n // size) and e <= n for b, e in ranges), (n, size, ranges)
            assert set().union(*(range(b, e) for b, e in ranges)) == set(range(n))


def test_scatter_index_rejects_negative():
    with pytest.raises(ValueError, match="n_total"):
        scatter_index(-1, SimpleNamespace(rank=0, size=2))


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
    with pytest.raises(IndexError):
        empty[5]


def test_tensor_dataset_rows_travel_without_their_whole_storage():
    import pickle

    import torch

    from torchmn.datasets.scatter import _compact
    ds = torch.utils.data.TensorDataset(torch.randn(4000, 784), torch.arange(4000))
    sample = _compact(ds[7])
    assert len(pickle.dumps(sample)) < 10_000  # one row (3 KB), not the 12.5 MB table
    assert torch.equal(sample[0], ds[7][0]) and sample[1] == 7
