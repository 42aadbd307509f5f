"""pytorch-pfn-extras extensions and triggers for multi-node training.

- :class:`ObservationAggregator`: a reported value averaged over ranks.
- :class:`MultiNodeEarlyStoppingTrigger`: early stopping decided on the value averaged over ranks,
  so every rank stops at the same iteration.
- :class:`AllreducePersistent`: buffers (BatchNorm running statistics) averaged over ranks.
- :func:`multi_node_snapshot` / :func:`resume_latest`: per-rank snapshots written atomically, and
  resuming from the newest iteration that every rank has.
"""
try:
    import pytorch_pfn_extras  # noqa: F401
except ImportError as e:
    raise ImportError(f"torchmn.extensions are pytorch-pfn-extras extensions, which is not installed ({e}); "
                      f"install it with pip install -e '.[examples]' in torchmn's checkout (or pip install pytorch-pfn-extras)") from e

from torchmn.extensions.allreduce_persistent import AllreducePersistent
from torchmn.extensions.early_stopping import MultiNodeEarlyStoppingTrigger
from torchmn.extensions.observation_aggregator import ObservationAggregator
from torchmn.extensions.snapshot import (MultiNodeSnapshot, available_iterations, multi_node_snapshot,
                                         resume_latest)

__all__ = ["AllreducePersistent", "MultiNodeEarlyStoppingTrigger", "MultiNodeSnapshot", "ObservationAggregator",
           "available_iterations", "multi_node_snapshot", "resume_latest"]
