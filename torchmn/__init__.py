"""torchmn: multi-node distributed training for PyTorch.

ChainerMN's and Horovod's way of turning a single-process script into a multi-process job,
built on ``torch.distributed``::

    import torchmn
    comm = torchmn.create_communicator()
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
    train = torchmn.scatter_dataset(train if comm.rank == 0 else None, comm, shuffle=True)

Model parallelism is in ``torchmn.functions`` (differentiable communication) and ``torchmn.nn``
(parallel layers, pipelines). ``torchmn.extensions`` (pytorch-pfn-extras extensions) and
``torchmn.horovod`` are imported on their own.

The names below are loaded when first used (PEP 562), so that ``import torchmn`` does not import
torch: the launcher and its helper processes (``torchmn.run``) are part of this package and run
where torch would only cost seconds and memory. Once torch is loaded (now, or when its import
finishes), ``import torchmn`` notes torch's thread count, so that a ``torch.set_num_threads`` the
script calls afterwards wins over the per-rank thread budget, and moves torch's import-time objects
out of the garbage collector's way (``torchmn.torch_loaded``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchmn import lazy_names, torch_loaded
from torchmn.errors import TorchmnError

__version__ = "0.1.0"

# Each public name, and the module it lives in.
_NAMES = {
    "CollectiveMismatchError": "torchmn.communicators",
    "CollectiveTimeoutError": "torchmn.communicators",
    "Communicator": "torchmn.communicators",
    "create_communicator": "torchmn.communicators",
    "SharedDataset": "torchmn.datasets",
    "create_empty_dataset": "torchmn.datasets",
    "scatter_dataset": "torchmn.datasets",
    "scatter_index": "torchmn.datasets",
    "GenericMultiNodeEvaluator": "torchmn.evaluators",
    "create_multi_node_evaluator": "torchmn.evaluators",
    "create_multi_node_iterator": "torchmn.iterators",
    "MultiNodeOptimizer": "torchmn.optimizers",
    "ShardedMultiNodeOptimizer": "torchmn.optimizers",
    "create_multi_node_optimizer": "torchmn.optimizers",
    "join": "torchmn.optimizers.join",  # uneven data: with torchmn.join(comm): ...
    "ddp_comm_hook": "torchmn.ddp",  # DistributedDataParallel averaging through torchmn
    "select_device": "torchmn.devices",  # --device auto|cpu|cuda
}
# Subpackages reachable as attributes after a bare ``import torchmn``: ``torchmn.lightning`` too,
# as the docs write it, though not in ``__all__`` (``from torchmn import *`` needs no Lightning).
_SUBPACKAGES = ("checkpoint", "communicators", "datasets", "environments", "evaluators", "functions",
                "iterators", "launch", "lightning", "nn", "optimizers", "tune")

__getattr__, __dir__, __all__ = lazy_names.attach(__name__, _NAMES, _SUBPACKAGES)
__all__ = [name for name in __all__ if name != "lightning"] + ["TorchmnError", "__version__"]

torch_loaded.when_torch_loads()


if TYPE_CHECKING:  # what type checkers and IDEs see
    from torchmn import (checkpoint, communicators, datasets, environments, evaluators, functions, iterators,
                         lightning, nn, optimizers, tune)
    from torchmn.communicators import (CollectiveMismatchError, CollectiveTimeoutError, Communicator,
                                       create_communicator)
    from torchmn.datasets import SharedDataset, create_empty_dataset, scatter_dataset, scatter_index
    from torchmn.evaluators import GenericMultiNodeEvaluator, create_multi_node_evaluator
    from torchmn.iterators import create_multi_node_iterator
    from torchmn.optimizers import MultiNodeOptimizer, ShardedMultiNodeOptimizer, create_multi_node_optimizer
    from torchmn.ddp import ddp_comm_hook
    from torchmn.devices import select_device
    from torchmn.optimizers.join import join
