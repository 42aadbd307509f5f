"""Lightning on torchmn: a cluster environment that knows every launcher torchmn does, and a strategy
that trains with torchmn's averaging and collectives.

A Lightning script keeps its ``LightningModule`` and ``Trainer``; only the strategy changes, and the
job starts under ``torchmn run``, torchrun, ``srun`` or ``mpirun`` like any torchmn job::

    trainer = lightning.Trainer(strategy=torchmn.lightning.TorchmnStrategy(), accelerator="cpu", devices=2)
    trainer.fit(model, loader)                   # torchmn run -np 2 python train.py

``TorchmnStrategy`` is Lightning's DDP strategy with torchmn underneath: the world is set up by
``torchmn.create_communicator`` (which reads Slurm, Open MPI, MPICH, torchrun and ``torchmn run``),
DDP averages its buckets through ``torchmn.ddp_comm_hook`` (shared memory inside a node), and
Lightning's ``reduce``, ``all_gather``, ``barrier`` and ``broadcast`` go through the communicator.
Needs the ``lightning`` package (``pip install -e '.[lightning]'`` in torchmn's checkout).
"""
from __future__ import annotations

import atexit
from typing import Any, Optional, Union

import torch
from torch.distributed import ReduceOp

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import rank_zero_only
except ImportError as e:  # pragma: no cover - the dev install has it
    raise ImportError(f"torchmn.lightning needs the lightning package ({e}); install it with "
                      f"pip install -e '.[lightning]' in torchmn's checkout (or pip install lightning)") from e

import torchmn
from torchmn.ddp import check_compression, ddp_comm_hook
from torchmn.environments import detect_environment
from torchmn.errors import TorchmnValueError
from torchmn.nn import (MultiNodeBatchNorm, MultiNodeBatchNorm1d, MultiNodeBatchNorm2d, MultiNodeBatchNorm3d,
                        create_mnbn_model)
from torchmn.nn.batch_norm import rebuild_batch_norm

__all__ = ["MultiNodeBatchNormSync", "TorchmnEnvironment", "TorchmnStrategy"]


class TorchmnEnvironment(ClusterEnvironment):
    """Lightning's view of the job as torchmn detects it (``torchmn run``, torchrun, Slurm, Open MPI,
    MPICH): the launcher started every process, and says each one's place.

    Raises:
        ValueError: (``validate_settings``) the ``Trainer``'s ``devices`` or ``num_nodes`` differ from
            what the launcher started.

    Example::

        >>> trainer = lightning.Trainer(plugins=[TorchmnEnvironment()], strategy="ddp", devices=2)
    """

    def __init__(self) -> None:
        """Read the launcher's variables now (nothing is connected or changed).

        Example::

            >>> TorchmnEnvironment().world_size()      # under torchmn run -np 2
            2
        """
        super().__init__()
        self._env = detect_environment()
        self._node_of_communicator: Optional[int] = None

    @property
    def creates_processes_externally(self) -> bool:
        """True: the launcher started every rank; Lightning starts none."""
        return True

    @property
    def main_address(self) -> str:
        """The rendezvous address the launcher gave."""
        return self._env.master_addr

    @property
    def main_port(self) -> int:
        """The rendezvous port the launcher gave (0 under MPI, where torchmn derives it)."""
        return self._env.master_port or 0

    @staticmethod
    def detect() -> bool:
        """Whether a launcher torchmn knows started this process.

        Returns:
            True under ``torchmn run``, torchrun, Slurm, Open MPI or MPICH; False for a plain
            ``python script.py``.

        Example::

            >>> TorchmnEnvironment.detect()       # python script.py
            False
        """
        try:
            return detect_environment().source != "single"
        except (ValueError, RuntimeError):
            return False

    def world_size(self) -> int:
        """The number of ranks.

        Returns:
            The launcher's world size.

        Example::

            >>> env.world_size()
            4
        """
        return self._env.size

    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher's number stands (``validate_settings`` compared the Trainer's with it).

        Args:
            size: what Lightning computed from ``devices`` and ``num_nodes``.

        Example::

            >>> env.set_world_size(4)
        """

    def global_rank(self) -> int:
        """This rank.

        Returns:
            The launcher's rank of this process.

        Example::

            >>> env.global_rank()
            0
        """
        return self._env.rank

    def set_global_rank(self, rank: int) -> None:
        """Keep the launcher's rank (Lightning's own computation is ignored) for ``rank_zero_only``.

        Args:
            rank: what Lightning computed.

        Example::

            >>> env.set_global_rank(0)
        """
        rank_zero_only.rank = self._env.rank

    def local_rank(self) -> int:
        """This rank's index on its node.

        Returns:
            The launcher's local rank.

        Example::

            >>> env.local_rank()
            1
        """
        return self._env.local_rank

    def node_rank(self) -> int:
        """This rank's node.

        Returns:
            The launcher's node index. Under MPI, which names no nodes: the communicator's node
            (``inter_rank``, ranks grouped by host) once :meth:`learn_nodes` was given it, as
            ``TorchmnStrategy`` does when it sets up; before that ``rank // local size`` (right where
            ranks fill the nodes in order, not for ``mpirun --map-by node``).

        Example::

            >>> env.node_rank()
            0
        """
        if self._env.node_rank is not None:
            return self._env.node_rank
        if self._node_of_communicator is not None:
            return self._node_of_communicator
        return self._env.rank // max(1, self._env.local_size)

    def learn_nodes(self, comm: Any) -> None:
        """Take this rank's node from ``comm``, which grouped the ranks by host, where the launcher
        names no node.

        Args:
            comm: the job's world communicator.

        Example::

            >>> env.learn_nodes(torchmn.create_communicator()); env.node_rank()
            1
        """
        self._node_of_communicator = comm.inter_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Refuse a ``Trainer`` whose ``devices`` and ``num_nodes`` are not what the launcher started.

        Args:
            num_devices: the ``Trainer``'s ``devices`` (ranks per node).
            num_nodes: the ``Trainer``'s ``num_nodes``.

        Raises:
            ValueError: on every rank, with the numbers to pass or the launcher to use.

        Example::

            >>> env.validate_settings(num_devices=2, num_nodes=1)      # under torchmn run -np 2
        """
        env = self._env
        if env.source == "single":
            if num_devices * num_nodes > 1:
                raise TorchmnValueError(
                    f"Trainer(devices={num_devices}, num_nodes={num_nodes}) in torchmn's cluster environment, but this "
                    f"process was started alone (python script.py). Start the ranks with a launcher: torchmn run -np "
                    f"{num_devices * num_nodes} python script.py (or torchrun, srun, mpirun).")
            return
        if num_devices != env.local_size or num_nodes * num_devices != env.size:
            raise TorchmnValueError(
                f"Trainer(devices={num_devices}, num_nodes={num_nodes}) on rank {env.rank}, but the launcher "
                f"({env.source}) started {env.local_size} rank(s) on this node and {env.size} in all. Pass "
                f"devices={env.local_size} and num_nodes={max(1, env.size // max(1, env.local_size))}, or start "
                f"{num_devices} rank(s) on each of {num_nodes} node(s).")


class TorchmnStrategy(DDPStrategy):
    """Lightning's DDP strategy with torchmn underneath: the world set up by
    ``torchmn.create_communicator``, DDP's buckets averaged by ``torchmn.ddp_comm_hook`` and
    Lightning's collectives through the communicator (``self.comm``). The communicator outlives
    ``fit``, as the process group of Lightning's DDP strategy does: collectives after it
    (broadcasting ``best_model_path``, a barrier before rank 0 saves) still reach every rank, and a
    later ``validate`` or ``test`` uses it again; it ends with the process.

    Args:
        communicator: the algorithm's name for ``torchmn.create_communicator`` (default ``"auto"``).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the dtype DDP's buckets travel in.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``find_unused_parameters``, ``timeout``,
            ``process_group_backend``, ...), except ``ddp_comm_hook``, ``ddp_comm_wrapper`` and
            ``ddp_comm_state``: the hook is torchmn's.

    Raises:
        ValueError: one of those among ``kwargs``; an unknown ``compression``.

    Example::

        >>> trainer = lightning.Trainer(strategy=TorchmnStrategy(), accelerator="cpu", devices=2)
        >>> trainer.fit(model, loader)          # under torchmn run -np 2, torchrun, srun or mpirun
    """

    strategy_name = "torchmn"

    def __init__(self, communicator: str = "auto", compression: Optional[str] = None, **kwargs: Any) -> None:
        hooked = [name for name in ("ddp_comm_hook", "ddp_comm_wrapper", "ddp_comm_state") if name in kwargs]
        if hooked:
            # The strategy registers torchmn's hook: another one, its wrapper or its state would be dropped.
            raise TorchmnValueError(f"TorchmnStrategy averages with torchmn's own DDP hook; pass compression= "
                                    f"(fp16, bf16, powersgd) instead of {'=, '.join(hooked)}=, or use Lightning's "
                                    f"DDPStrategy for another hook")
        if compression is not None:
            check_compression(compression)  # now, not once fit has set up the world
        kwargs.setdefault("cluster_environment", TorchmnEnvironment())
        self._collective_timeout = kwargs.get("timeout")  # None: torchmn's (TORCHMN_TIMEOUT, else 600 s)
        super().__init__(**kwargs)
        self._communicator = communicator
        self._compression = compression
        self.comm = None

    def setup_distributed(self) -> None:
        """Set up the world through torchmn (any launcher it knows), and keep its communicator.

        Example::

            >>> strategy.setup_distributed(); strategy.comm.size      # Lightning calls it
            2
        """
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        if self.comm is None:  # a later fit, validate or test keeps the world of the first
            self.comm = _communicator(self._communicator, self._process_group_backend, self._collective_timeout)
            if isinstance(self.cluster_environment, TorchmnEnvironment):
                self.cluster_environment.learn_nodes(self.comm)
        if not torch.distributed.is_initialized():
            # A world of one has no process group, and DDP, which wraps the model, needs one even
            # alone: one over an in-process store, which opens no port.
            torch.distributed.init_process_group(self._process_group_backend, store=torch.distributed.HashStore(),
                                                 rank=0, world_size=1)
            atexit.register(_destroy_group_of_one)

    def setup(self, trainer: Any) -> None:
        """Lightning's setup; ``Trainer(sync_batchnorm=True)`` gets torchmn's multi-node BatchNorm,
        which works on the CPU too (torch's ``SyncBatchNorm`` needs GPUs).

        Args:
            trainer: the ``Trainer``.

        Example::

            >>> trainer = lightning.Trainer(strategy=TorchmnStrategy(), sync_batchnorm=True, devices=2)
        """
        if isinstance(self._layer_sync, TorchSyncBatchNorm):
            self._layer_sync = MultiNodeBatchNormSync(self.comm)
        super().setup(trainer)

    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(None, ddp_comm_hook(self.comm, compression=self._compression))

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Wait for every rank, through the communicator.

        Args:
            *args, **kwargs: Lightning's (a name), unused.

        Example::

            >>> trainer.strategy.barrier()
        """
        if self.comm is not None:
            self.comm.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank, through the communicator.

        Args:
            obj: any picklable object (only ``src``'s is used).
            src: the rank it comes from.

        Returns:
            ``src``'s object.

        Example::

            >>> trainer.strategy.broadcast(path, src=0)
        """
        return obj if self.comm is None else self.comm.bcast_obj(obj, root=src)

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        """Lightning's reduction (``self.log(..., sync_dist=True)``, ...) through the communicator.

        Args:
            tensor: the value; anything but a tensor is returned as it is.
            group: a process group other than the world (None, ``WORLD``) goes through Lightning's own path.
            reduce_op: ``"mean"`` (``"avg"``, None), ``"sum"``, ``"max"`` or ``"min"`` (or ``ReduceOp``).

        Returns:
            The reduced tensor, the same on every rank (a new one: ``tensor`` is left as it was). A
            ``tensor`` in an autograd graph gives one in that graph, whose gradient is the local
            one, divided by the world's size for a mean, as Lightning's in-place reduction gives;
            the mean of integers is a float64 (Lightning's DDP truncates it).

        Example::

            >>> trainer.strategy.reduce(torch.tensor(float(rank)), reduce_op="sum")
        """
        op = _op_name(reduce_op)
        if not isinstance(tensor, torch.Tensor) or self.comm is None or not _is_world(group) or op is None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        values = tensor.detach()
        if op == "mean":
            reduced = self.comm.allreduce(values if values.is_floating_point() else values.double(), "sum")
            reduced, local = reduced / self.comm.size, tensor / self.comm.size
        else:
            reduced, local = self.comm.allreduce(values, op), tensor
        if not tensor.requires_grad:
            return reduced
        return local + (reduced - local).detach()  # the reduced value, through the local graph

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order, through the communicator.

        Args:
            tensor: this rank's tensor (the same shape on every rank).
            group: a process group other than the world (None, ``WORLD``) goes through Lightning's own path.
            sync_grads: whether gradients flow back (Lightning's own path).

        Returns:
            A tensor of shape ``(world_size, *tensor.shape)``.

        Example::

            >>> trainer.strategy.all_gather(torch.tensor([1.0])).shape     # 2 ranks
            torch.Size([2, 1])
        """
        if self.comm is None or not _is_world(group) or sync_grads:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        return torch.stack(self.comm.allgather(tensor.contiguous()))


class MultiNodeBatchNormSync(LayerSync):
    """Lightning's layer sync with torchmn's multi-node BatchNorm: during ``fit`` every ``BatchNorm``
    normalizes with the statistics of every rank's batch (``torchmn.nn.create_mnbn_model``), on the
    CPU as on GPUs; afterwards the layers are plain ``BatchNorm`` again, with what they learned.
    ``TorchmnStrategy`` uses it for ``Trainer(sync_batchnorm=True)``.

    Args:
        comm: the ranks whose batches make the global one.

    Example::

        >>> model = MultiNodeBatchNormSync(strategy.comm).apply(model)
    """

    def __init__(self, comm) -> None:
        self.comm = comm

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Replace every BatchNorm of ``model`` by its multi-node one (in place).

        Args:
            model: the LightningModule.

        Returns:
            The model.

        Example::

            >>> MultiNodeBatchNormSync(comm).apply(model)
        """
        return create_mnbn_model(model, self.comm)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make every multi-node BatchNorm of ``model`` a plain ``BatchNorm1d/2d/3d`` again (one
        that was a ``torch.nn.SyncBatchNorm``, a plain BatchNorm of any dimension), with its
        parameters, running statistics and mode.

        Args:
            model: the LightningModule.

        Returns:
            The model.

        Example::

            >>> MultiNodeBatchNormSync(comm).revert(model)
        """
        plain = _PLAIN.get(type(model))
        if plain is not None:
            return rebuild_batch_norm(model, plain)
        for name, child in model.named_children():
            reverted = self.revert(child)
            if reverted is not child:
                setattr(model, name, reverted)
        return model


# The communicators strategies made, by (algorithm, backend, timeout): a sweep that makes a new
# Trainer and strategy for every fit shares one, instead of each holding its shared memory until
# the garbage collector finds it (a communicator lives in reference cycles).
_communicators: dict = {}


def _communicator(name: str, backend: Optional[str], timeout: Optional[Any]):
    """The communicator a strategy uses: one made earlier in this process with the same settings,
    while its world lasts, else a new one."""
    key = (name, backend, timeout)
    comm = _communicators.get(key)
    if comm is None or comm.call_log.closed or (comm.size > 1 and not torch.distributed.is_initialized()):
        comm = _communicators[key] = torchmn.create_communicator(name, backend=backend, timeout=timeout)
    return comm


class _BatchNormOfAnyDimension(torch.nn.modules.batchnorm._BatchNorm):
    """A plain BatchNorm over inputs of any number of dimensions: what a ``torch.nn.SyncBatchNorm``
    (which has none of its own) becomes after ``fit``, as Lightning's own revert makes it."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise TorchmnValueError(f"expected an input of at least 2 dimensions (N, C, ...), got {x.dim()}")


_PLAIN = {MultiNodeBatchNorm1d: torch.nn.BatchNorm1d, MultiNodeBatchNorm2d: torch.nn.BatchNorm2d,
          MultiNodeBatchNorm3d: torch.nn.BatchNorm3d, MultiNodeBatchNorm: _BatchNormOfAnyDimension}


def _destroy_group_of_one() -> None:
    if torch.distributed.is_initialized():  # unless the script destroyed it itself
        torch.distributed.destroy_process_group()


def _is_world(group: Optional[Any]) -> bool:
    """Whether Lightning means the whole world (``LightningModule.all_gather`` passes ``WORLD``)."""
    return group is None or group is torch.distributed.group.WORLD


def _op_name(reduce_op: Optional[Union[ReduceOp, str]]) -> Optional[str]:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"``; None for what only torch's path does (product, ...)."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        return {"avg": "mean", "mean": "mean", "sum": "sum", "max": "max", "min": "min"}.get(name)
    return {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min", ReduceOp.AVG: "mean"}.get(reduce_op)
