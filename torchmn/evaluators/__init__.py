"""Evaluation over sharded data: exact global means, or any aggregate computed on root."""
from torchmn.evaluators.generic import GenericMultiNodeEvaluator
from torchmn.evaluators.mean import MultiNodeEvaluator, create_multi_node_evaluator

__all__ = ["GenericMultiNodeEvaluator", "MultiNodeEvaluator", "create_multi_node_evaluator"]
