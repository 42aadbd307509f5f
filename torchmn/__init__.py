"""torchmn: multi-node distributed training for PyTorch.

ChainerMN's and Horovod's way of turning a single-process script into a multi-process job,
built on ``torch.distributed``::

    import torchmn
    comm = torchmn.create_communicator()
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
    train = torchmn.scatter_dataset(train if comm.rank == 0 else None, comm, shuffle=True)

Model parallelism is in ``torchmn.functions`` (differentiable communication) and ``torchmn.nn``
(parallel layers, pipelines). ``torchmn.extensions`` (pytorch-pfn-extras extensions) is imported
on its own, so that the core does not need pytorch-pfn-extras.
"""
from torchmn.communicators import CollectiveMismatchError, CollectiveTimeoutError, Communicator, create_communicator
from torchmn.datasets import SharedDataset, create_empty_dataset, scatter_dataset, scatter_index
from torchmn.errors import TorchmnError
from torchmn.evaluators import GenericMultiNodeEvaluator, create_multi_node_evaluator
from torchmn.iterators import create_multi_node_iterator
from torchmn.optimizers import MultiNodeOptimizer, ShardedMultiNodeOptimizer, create_multi_node_optimizer
from torchmn.optimizers.join import join  # uneven data: with torchmn.join(comm): ...
from torchmn import functions, nn  # model parallelism: torchmn.functions.send, torchmn.nn.Pipeline, ...
from torchmn import tune  # torchmn.tune.MultiNodeStudy (Optuna itself is imported when used)
from torchmn import checkpoint  # torchmn.checkpoint.Checkpointer: save and resume plain loops

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError", "CollectiveTimeoutError", "Communicator", "GenericMultiNodeEvaluator", "MultiNodeOptimizer",
    "ShardedMultiNodeOptimizer", "SharedDataset", "create_communicator", "create_empty_dataset",
    "create_multi_node_evaluator", "create_multi_node_iterator", "create_multi_node_optimizer", "join",
    "scatter_dataset", "scatter_index", "TorchmnError", "checkpoint", "functions", "nn", "tune", "__version__",
]
