"""Multi-node iterator and evaluators: in one process, and across three real ranks (uneven shards)."""
import math

import pytest
import torch

from jobs import assert_check_passed
from workers.data_jobs import data_check_output
from torchmn.communicators import make_communicator
from torchmn.evaluators import GenericMultiNodeEvaluator, create_multi_node_evaluator
from torchmn.iterators import create_multi_node_iterator

CHECKS = ["evaluator", "evaluator_object", "evaluator_object_over_uneven_shards", "evaluator_object_weighted_reports", "evaluator_subclass_with_its_own_evaluate", "generic_evaluator", "iterator",
          "iterator_out_of_step_refused"]


def solo():
    return make_communicator("naive", rank=0, size=1, group=None, obj_group=None, backend="gloo", node_key=0)


@pytest.mark.check_job("data", np=3)
@pytest.mark.parametrize("check", CHECKS)
def test_across_three_ranks(check, request):
    assert_check_passed(data_check_output(request, 3), check)


def test_evaluator_single_rank():
    comm = solo()
    assert create_multi_node_evaluator(lambda: ({"loss": torch.tensor(2.5)}, 4), comm)() == {"loss": 2.5}
    assert create_multi_node_evaluator(lambda: {"acc": 0.75}, comm)() == {"acc": 0.75}
    assert create_multi_node_evaluator(lambda: ({}, 0), comm)() == {}
    assert math.isnan(create_multi_node_evaluator(lambda: ({"a": 1.0}, 0), comm)()["a"])
    # A rank without samples may say so with None (`loss_sum / n if n else None`).
    assert math.isnan(create_multi_node_evaluator(lambda: ({"a": None}, 0), comm)()["a"])


@pytest.mark.parametrize("bad, error", [((1.0, 2), TypeError), (({"a": 1.0}, -1), ValueError),
                                        (({"a": 1.0}, 2.5), ValueError), (({"a": "x"}, 1), TypeError),
                                        (({"a": torch.ones(2)}, 1), ValueError),
                                        (({1: 1.0, "1": 2.0}, 1), ValueError)])
def test_evaluator_rejects_bad_results(bad, error):
    with pytest.raises(error, match="rank 0"):
        create_multi_node_evaluator(lambda: bad, solo())()


class Count(GenericMultiNodeEvaluator):
    def evaluate_local(self, xs):
        return len(xs)

    def aggregate(self, results):
        return sum(results)


def test_generic_evaluator_single_rank():
    assert Count(solo())([1, 2, 3]) == 3
    assert Count(solo(), broadcast=True)([]) == 0


def test_iterator_single_rank_dict_batches_and_epochs():
    data = [{"x": torch.tensor([i, i]), "y": (torch.tensor(i), "tag")} for i in range(5)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    it = create_multi_node_iterator(loader, solo())
    assert len(it) == 3
    for _ in range(2):
        batches = list(it)
        assert len(batches) == 3
        assert torch.equal(batches[0]["x"], torch.tensor([[0, 0], [1, 1]]))
        assert batches[2]["y"][1] == ("tag",)
    assert it.epoch == 2


def test_iterator_master_needs_loader():
    with pytest.raises(ValueError, match="master rank 0 passed loader=None"):
        create_multi_node_iterator(None, solo())
