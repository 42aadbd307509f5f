"""Optimizers that average gradients over ranks, and split the update where they can."""
from torchmn.optimizers.multi_node_optimizer import MultiNodeOptimizer, create_multi_node_optimizer
from torchmn.optimizers.node_shared import NodeSharedOptimizer
from torchmn.optimizers.sharded import ShardedMultiNodeOptimizer

__all__ = ["MultiNodeOptimizer", "NodeSharedOptimizer", "ShardedMultiNodeOptimizer", "create_multi_node_optimizer"]
