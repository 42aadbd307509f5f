"""Optimizers that average gradients over ranks (and, with ``shard_state``, split the update)."""
from torchmn.optimizers.multi_node_optimizer import MultiNodeOptimizer, create_multi_node_optimizer
from torchmn.optimizers.sharded import ShardedMultiNodeOptimizer

__all__ = ["MultiNodeOptimizer", "ShardedMultiNodeOptimizer", "create_multi_node_optimizer"]
