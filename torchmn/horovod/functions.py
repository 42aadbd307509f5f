"""Whole-model and Python-object collectives: ``broadcast_parameters``,
``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object`` and ``barrier``."""
from __future__ import annotations

import pickle
import socket
from typing import Any, Optional

import cloudpickle
import torch

from torchmn.communicators.pickling import dumps
from torchmn.errors import TorchmnTypeError
from torchmn.horovod import coordination
from torchmn.horovod.errors import InvalidCallError, raises_horovods_errors
from torchmn.horovod.process_sets import comm_of, global_process_set
from torchmn.optimizers.gradient_sync import GradientSyncOptimizer


def _start(what: str, process_set) -> Any:
    """The communicator of a blocking collective, after the join check. The tensor collectives in
    flight run on a communicator of their own (:mod:`~torchmn.horovod.background`), so this one
    need not wait for them."""
    comm = comm_of(process_set, what)
    coordination.agree(comm, coordination.describe_call(what.replace("hvd.", "")), need_descriptions=False)
    return comm


def _root_index(root_rank: int, process_set, what: str) -> int:
    comm_of(process_set, what)  # before hvd.init(), Horovod's message first
    ranks = (global_process_set if process_set is None else process_set).ranks
    if root_rank not in ranks:
        raise InvalidCallError(f"{what} received invalid root rank {root_rank} for provided process set "
                               f"(ranks {ranks})")
    return ranks.index(root_rank)


@raises_horovods_errors
def broadcast_parameters(params, root_rank: int, prefix: Optional[str] = None,
                         process_set=global_process_set) -> None:
    """Overwrite every rank's parameters and buffers with root's, in place.

    Args:
        params: ``model.state_dict()`` (a dict of tensors), ``model.named_parameters()`` (pairs
            of name and tensor) or ``model.parameters()`` (tensors, in the same order on every rank).
        root_rank: the rank whose values everyone gets.
        prefix: accepted for Horovod's signature (names do not travel).
        process_set: the ranks taking part.

    Raises:
        InvalidCallError: ``params`` is of another type, or ``root_rank`` is not in the set; before
            ``hvd.init()``.
        CollectiveMismatchError: the ranks' tensors differ in count, shape or dtype.

    Example::

        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list) or hasattr(params, "__iter__"):
        items = [(None, p) if isinstance(p, torch.Tensor) else p for p in params]
        if items and not (isinstance(items[0], tuple) and len(items[0]) == 2):
            raise InvalidCallError("broadcast_parameters takes model.state_dict(), model.named_parameters() (pairs "
                                   f"of name and tensor) or model.parameters(), not a sequence of "
                                   f"{type(items[0]).__name__}")
    else:
        raise InvalidCallError(f"invalid params of type: {type(params)}")
    root = _root_index(root_rank, process_set, "broadcast_parameters")
    comm = _start("hvd.broadcast_parameters", process_set)
    tensors = [p.data if isinstance(p, torch.nn.Parameter) else p for _, p in items if p is not None]
    with torch.no_grad():
        comm.bcast_tensors(tensors, root=root)


@raises_horovods_errors
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model=None,
                              process_set=global_process_set) -> None:
    """Make every rank's optimizer state and hyper-parameters root's.

    Works for any torch optimizer (and a :class:`DistributedOptimizer`), with tensor state, scalar
    state and hyper-parameters such as ``lr`` and ``betas``. A new optimizer's empty state is first
    created as Horovod creates it: each trainable parameter gets a zero gradient (sparse for
    ``torch.optim.SparseAdam``, and for SGD on ``model``'s sparse embeddings) and one update is
    made with them on every rank, without averaging; the zero gradients stay in ``.grad``.

    Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
    processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

    Args:
        optimizer: this rank's optimizer, over the same parameters as root's.
        root_rank: the rank whose state everyone gets.
        model: the model, to find its sparse embeddings (as Horovod's).
        process_set: the ranks taking part.

    Raises:
        InvalidCallError: ``root_rank`` is not in the set; an LBFGS optimizer (as Horovod); before
            ``hvd.init()``.

    Example::

        >>> if hvd.rank() == 0:
        ...     optimizer.load_state_dict(torch.load("ckpt.pt")["optimizer"])
        >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InvalidCallError("cannot broadcast torch.optim.LBFGS state")
    root = _root_index(root_rank, process_set, "broadcast_optimizer_state")
    comm = _start("hvd.broadcast_optimizer_state", process_set)
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer, model)
    state = comm.bcast_obj(optimizer.state_dict() if comm.rank == root else None, root=root)
    if comm.rank != root:
        optimizer.load_state_dict(state)


def _create_state(optimizer: torch.optim.Optimizer, model) -> None:
    """Give a new optimizer its state, as Horovod does: one update with zero gradients, on this rank alone."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (isinstance(optimizer, torch.optim.SGD)
                                                                    and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    if hasattr(optimizer, "step_without_averaging"):      # hvd.DistributedOptimizer
        optimizer.step_without_averaging()
    elif isinstance(optimizer, GradientSyncOptimizer):    # torchmn's own multi-node optimizers
        optimizer.wrapped.step()
    else:
        optimizer.step()


@raises_horovods_errors
def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Root's ``obj`` on every rank, pickled by cloudpickle as Horovod's is (lambdas and functions
    defined in the script travel too).

    Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
    processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

    Args:
        obj: root's object (ignored elsewhere).
        root_rank: the rank whose object everyone gets.
        name: accepted for Horovod's signature.
        process_set: the ranks taking part.

    Returns:
        Root's object: on root, ``obj`` itself; elsewhere, a copy.

    Raises:
        InvalidCallError: ``root_rank`` is not in the set; before ``hvd.init()``.
        TypeError: root's object cannot be pickled (on every rank).

    Example::

        >>> epoch = hvd.broadcast_object(epoch, root_rank=0)
    """
    root = _root_index(root_rank, process_set, "broadcast_object")
    comm = _start("hvd.broadcast_object", process_set)
    sent = comm.bcast_obj(_dumps(obj, comm.rank, "broadcast_object") if comm.rank == root else None, root=root)
    if comm.rank == root and sent[0]:  # the object itself, as Horovod's root gets back (not a copy)
        return obj
    return _loads([sent], "broadcast_object")[0]


@raises_horovods_errors
def allgather_object(obj: Any, name: Optional[str] = None, process_set=global_process_set) -> list:
    """Every rank's ``obj``, in rank order, pickled by cloudpickle as Horovod's is.

    Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
    processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

    Args:
        obj: this rank's object.
        name: accepted for Horovod's signature.
        process_set: the ranks taking part.

    Returns:
        A list of the objects.

    Raises:
        InvalidCallError: before ``hvd.init()``; a rank outside ``process_set``.
        TypeError: a rank's object cannot be pickled (on every rank, naming it).

    Example::

        >>> counts = hvd.allgather_object(len(my_shard))
    """
    comm = _start("hvd.allgather_object", process_set)
    return _loads(comm.allgather_obj(_dumps(obj, comm.rank, "allgather_object")), "allgather_object")


def _dumps(obj: Any, rank: int, what: str) -> tuple:
    """``obj`` pickled by cloudpickle, as Horovod's object collectives do (lambdas, functions and
    classes defined in the script travel too), or why not: sent either way, so that every rank
    raises the same error instead of the others waiting."""
    try:
        # torchmn's pickling first: a tensor view travels as what it shows, not its whole storage.
        return True, dumps(obj)
    except Exception:  # noqa: BLE001 - a lambda, a local class: cloudpickle's by-value pickling
        pass
    try:
        return True, cloudpickle.dumps(obj)
    except Exception as e:  # pickle raises TypeError, PicklingError, AttributeError, ...
        return False, f"hvd.{what}: rank {rank} on {socket.gethostname()} cannot pickle its object ({e})"


def _loads(sent: list, what: str) -> list:
    failed = [message for ok, message in sent if not ok]
    if failed:
        raise TorchmnTypeError("; ".join(failed) + "; send objects cloudpickle can pickle")
    return [pickle.loads(payload) for _, payload in sent]


@raises_horovods_errors
def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the set gets here.

    Args:
        process_set: the ranks taking part.

    Raises:
        InvalidCallError: before ``hvd.init()``; a rank outside ``process_set``.
        HorovodInternalError: a rank has joined.

    Example::

        >>> hvd.barrier()
    """
    _start("hvd.barrier", process_set).barrier()
