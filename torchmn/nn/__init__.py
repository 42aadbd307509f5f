"""Model parallelism: layers and models whose parts or computation are split across ranks.

:class:`MultiNodeSequential` places a model's parts on different ranks (ChainerMN's
``MultiNodeChainList``); :class:`Pipeline` runs one stage per rank with micro-batches (GPipe, 1F1B).
"""
from torchmn.nn.multi_node_sequential import MultiNodeSequential
from torchmn.nn.pipeline import SCHEDULES, Pipeline

__all__ = ["MultiNodeSequential", "Pipeline", "SCHEDULES"]
