"""Model parallelism: layers and models whose parts or computation are split across ranks.

:class:`MultiNodeSequential` places a model's parts on different ranks (ChainerMN's
``MultiNodeChainList``); :class:`Pipeline` runs one stage per rank with micro-batches (GPipe, 1F1B).
Layers: :class:`MultiNodeBatchNorm2d` (and 1d, 3d; :func:`create_mnbn_model`) normalizes over every
rank's batch; :class:`SpatialParallelConv2d` splits the image, :class:`ChannelParallelConv2d` the
output channels, :class:`ColumnParallelLinear` and :class:`RowParallelLinear` the weight
(``docs/parallelism.md`` says which to use when).
"""
from torchmn.nn.batch_norm import (MultiNodeBatchNorm, MultiNodeBatchNorm1d, MultiNodeBatchNorm2d, MultiNodeBatchNorm3d,
                                   create_mnbn_model)
from torchmn.nn.channel_parallel import ChannelParallelConv2d
from torchmn.nn.multi_node_sequential import MultiNodeSequential
from torchmn.nn.pipeline import SCHEDULES, Pipeline
from torchmn.nn.spatial_parallel import SpatialParallelConv2d
from torchmn.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["ChannelParallelConv2d", "ColumnParallelLinear", "MultiNodeBatchNorm", "MultiNodeBatchNorm1d",
           "MultiNodeBatchNorm2d", "MultiNodeBatchNorm3d", "MultiNodeSequential", "Pipeline", "RowParallelLinear",
           "SCHEDULES", "SpatialParallelConv2d", "create_mnbn_model"]
