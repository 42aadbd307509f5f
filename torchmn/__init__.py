"""torchmn: multi-node distributed training for PyTorch.

ChainerMN's and Horovod's way of turning a single-process script into a multi-process job,
built on ``torch.distributed``::

    import torchmn
    comm = torchmn.create_communicator()
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
    train = torchmn.scatter_dataset(train if comm.rank == 0 else None, comm, shuffle=True)
"""
from torchmn.communicators import CollectiveMismatchError, Communicator, create_communicator
from torchmn.optimizers import MultiNodeOptimizer, create_multi_node_optimizer

__version__ = "0.1.0"

__all__ = ["Communicator", "CollectiveMismatchError", "create_communicator", "__version__"]
