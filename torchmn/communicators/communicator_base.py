"""The communicator's interface: what every communicator offers, and what each call means.

:class:`torchmn.communicators.Communicator` implements it over ``torch.distributed``; the
gradient-averaging algorithms (``naive``, ``flat``, ``hierarchical``) are its subclasses. Its last
section is what the algorithms give the optimizers and override: the gradient primitives (flat
buffers, no call check, handles with ``wait()``), shared node memory, and the hooks under the
collectives.
"""
from __future__ import annotations

import abc
from typing import Any, Optional, Sequence, Tuple

import torch

from torchmn.errors import TorchmnTypeError


class CommunicatorBase(abc.ABC):
    """A group of ranks and the collectives among them.

    Attributes:
        rank, size: this rank and the number of ranks.
        intra_rank, intra_size: this rank's index among the ranks of its node, and their number.
        inter_rank, inter_size: this node's index and the number of nodes.
        device: the ``torch.device`` this rank computes on (``cpu``, or under NCCL the GPU
            ``cuda:<intra_rank % visible GPUs>``).
        backend: ``"gloo"`` or ``"nccl"``.
        name: the gradient-averaging algorithm (``"naive"``, ``"flat"``, ``"hierarchical"``).
        process_group: the ``torch.distributed`` group its tensor collectives use (None in a world
            of one without ``torch.distributed``); its ranks are numbered by world rank, which
            after ``split(key=...)`` may differ from this communicator's order.
        object_group: the CPU (gloo) group of object collectives and control traffic; the same
            group as ``process_group`` unless the backend is NCCL.
        node_key: what identifies this rank's node (the launcher's node number, else the hostname).
        node_ranks: the ranks of each node, ``node_ranks[inter_rank]`` being this node's.
        compression: the ``compression`` (``None``, ``"fp16"``, ``"bf16"``) that optimizers and DDP
            hooks built on this communicator use when given none (``create_communicator``'s
            ``allreduce_grad_dtype``, ChainerMN's name for it).

    Tensor and object collectives check, on every rank, that all ranks made the same call, and
    raise :class:`~torchmn.CollectiveMismatchError` on every rank where they did not. A rank that
    never makes the call is named in the others' :class:`~torchmn.CollectiveTimeoutError`.

    Example::

        >>> comm = torchmn.create_communicator()
        >>> comm.rank, comm.size, comm.intra_rank, comm.inter_size
        (0, 1, 0, 1)
    """

    compression: Optional[str] = None

    def __deepcopy__(self, memo: dict) -> "CommunicatorBase":
        """The communicator itself: it is this process's connection to the other ranks, so a deep
        copy of what holds one (a model with multi-node BatchNorm copied for an EMA) shares it.

        Args:
            memo: ``copy.deepcopy``'s memo.

        Returns:
            ``self``.

        Example::

            >>> ema = copy.deepcopy(model)          # its MultiNodeBatchNorm layers use the same comm
            >>> ema.bn.comm is model.bn.comm
            True
        """
        return self

    def __reduce_ex__(self, protocol):
        """Refused: a communicator cannot be pickled (its process groups live in this process only).

        Args:
            protocol: the pickle protocol asked for.

        Raises:
            TypeError: always; save ``model.state_dict()`` (which holds no communicator) instead.

        Example::

            >>> torch.save(model.state_dict(), "model.pt")     # not torch.save(model, ...) with one inside
        """
        raise TorchmnTypeError(f"a {type(self).__name__} cannot be pickled: it is this process's connection to the "
                               f"other ranks. Save model.state_dict() (or optimizer.state_dict()) instead of an "
                               f"object that holds a communicator, such as a model with multi-node BatchNorm")

    @property
    @abc.abstractmethod
    def host(self) -> str:
        """This rank's hostname.

        Returns:
            ``socket.gethostname()`` of the process.
        """

    @abc.abstractmethod
    def world_rank(self, r: int) -> int:
        """The ``torch.distributed`` world rank of this communicator's rank ``r``.

        Equal to ``r`` on the world communicator; differs on the result of :meth:`split`.

        Args:
            r: a rank of this communicator.

        Returns:
            Its rank in ``torch.distributed``'s default group.

        Example::

            >>> half = comm.split(color=comm.rank % 2)
            >>> half.world_rank(1)                           # 2 on the even half, 3 on the odd
        """

    @abc.abstractmethod
    def node_of(self, r: int) -> int:
        """The node index (``inter_rank``) of rank ``r``.

        Args:
            r: a rank of this communicator.

        Returns:
            The index of its node, from 0 to ``inter_size - 1``.

        Example::

            >>> comm.node_of(comm.rank) == comm.inter_rank
            True
        """

    @abc.abstractmethod
    def check_rank(self, r: Any, what: str = "rank") -> None:
        """Check that ``r`` names a rank of this communicator, before a collective depends on it.

        Args:
            r: the value to check; ``what``: its name for the message (``"root"``, ``"dest"``).

        Raises:
            ValueError: ``r`` is not an integer in ``[0, size)``.

        Example::

            >>> comm.check_rank(root, "root")    # before a collective that every rank sends to root
        """

    @abc.abstractmethod
    def send(self, x: torch.Tensor, dest: int, tag: int = 0) -> None:
        """Send a tensor of any shape and dtype to rank ``dest``, which calls :meth:`recv`.

        Args:
            x: the tensor (contiguous or not).
            dest: the receiving rank.
            tag: tells apart several messages between the same ranks (0 to 2**28 - 1).

        Raises:
            ValueError: ``dest`` or ``tag`` is out of range.
            CollectiveTimeoutError: ``dest`` did not receive within the timeout.

        Example::

            >>> comm.send(torch.ones(3, 2), dest=1) if comm.rank == 0 else comm.recv(source=0)
        """

    @abc.abstractmethod
    def recv(self, source: int, tag: int = 0) -> torch.Tensor:
        """Receive the tensor rank ``source`` sent with :meth:`send`; shape and dtype come with it.

        Args:
            source: the sending rank; ``tag``: the sender's tag.

        Returns:
            A new tensor on this rank's data device.

        Raises:
            ValueError: ``source`` or ``tag`` is out of range.
            CollectiveTimeoutError: ``source`` did not send within the timeout.

        Example::

            >>> if comm.rank == 1:
            ...     x = comm.recv(source=0)       # rank 0 called comm.send(torch.ones(3, 2), dest=1)
        """

    @abc.abstractmethod
    def bcast(self, x: Optional[torch.Tensor], root: int = 0) -> torch.Tensor:
        """Root's tensor on every rank.

        Args:
            x: root's tensor; other ranks may pass ``None`` (shape and dtype come from root).
            root: the sending rank.

        Returns:
            Root's ``x`` itself on root, a copy elsewhere.

        Raises:
            TypeError: root passed no tensor (raised on root; the others get RemoteRankError).
            CollectiveMismatchError: the ranks passed different roots or made another call.

        Example::

            >>> w = comm.bcast(torch.randn(3, 3) if comm.rank == 0 else None)
        """

    @abc.abstractmethod
    def gather(self, x: torch.Tensor, root: int = 0) -> Optional[tuple[torch.Tensor, ...]]:
        """Every rank's tensor, in rank order, on ``root``. Shapes may differ between ranks.

        Args:
            x: this rank's tensor.
            root: the receiving rank.

        Returns:
            On root a tuple of ``size`` tensors; ``None`` elsewhere.

        Raises:
            CollectiveMismatchError: the ranks passed different roots or dtypes.

        Example::

            >>> parts = comm.gather(torch.arange(comm.rank + 1))   # root: (tensor([0]), tensor([0, 1]), ...)
        """

    @abc.abstractmethod
    def allgather(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every rank's tensor, in rank order, on every rank. Shapes may differ, dtypes may not.

        Args:
            x: this rank's tensor.

        Returns:
            A tuple of ``size`` tensors.

        Raises:
            CollectiveMismatchError: the ranks' dtypes differ, or a rank made another call.

        Example::

            >>> xs = comm.allgather(torch.full((comm.rank + 1, 2), comm.rank))
        """

    @abc.abstractmethod
    def scatter(self, xs: Optional[Sequence[torch.Tensor]], root: int = 0) -> torch.Tensor:
        """Rank ``i`` receives ``xs[i]`` from root. Shapes may differ.

        Args:
            xs: on root, ``size`` tensors of one dtype; ``None`` elsewhere.
            root: the sending rank.

        Returns:
            This rank's tensor.

        Raises:
            ValueError: root did not pass ``size`` tensors (the others get RemoteRankError).
            CollectiveMismatchError: the ranks passed different roots.

        Example::

            >>> mine = comm.scatter([torch.full((2,), i) for i in range(comm.size)] if comm.rank == 0 else None)
        """

    @abc.abstractmethod
    def alltoall(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Rank ``i`` sends ``xs[j]`` to rank ``j`` and receives, in rank order, what each sent it.

        Args:
            xs: ``size`` tensors, one per receiving rank, all of one dtype (shapes may differ).

        Returns:
            A tuple of ``size`` tensors: element ``j`` is what rank ``j`` sent to this rank.

        Raises:
            ValueError: ``xs`` is not ``size`` tensors.
            CollectiveMismatchError: the tensors' dtypes differ (between or within ranks).

        Example::

            >>> got = comm.alltoall([torch.tensor([comm.rank, j]) for j in range(comm.size)])
        """

    @abc.abstractmethod
    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The elementwise reduction of every rank's ``x``, as a new tensor (``x`` is unchanged).

        ``"mean"`` of an integer or bool tensor is a float64 tensor (summed in float64: exact for
        sums below 2**53, and never wrapping); float16 and bfloat16 means are summed in float64, so
        that a sum beyond their range does not overflow.

        Args:
            x: this rank's tensor; every rank's has the same shape and dtype.
            op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.

        Returns:
            The reduction, a new tensor on ``x``'s device.

        Raises:
            ValueError: an unknown ``op``, or one undefined for ``x``'s dtype (complex max, min, prod).
            TypeError: a dtype torch cannot reduce on CPU (uint16, float8, ...).
            CollectiveMismatchError: the ranks' shapes, dtypes or ops differ.

        A new tensor of tens of MB costs more than the reduction itself (the allocator maps its
        pages afresh from the OS on every call): for large tensors use :meth:`allreduce_`.

        Example::

            >>> comm.allreduce(torch.arange(4) + comm.rank)   # arange(4) * size + sum(ranks)
        """

    @abc.abstractmethod
    def allreduce_(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The elementwise reduction of every rank's ``x``, written into ``x``, checked as :meth:`allreduce`.

        The fast path for large tensors: the data moves in place (through shared memory on one
        node), with no new tensor.

        Args:
            x: this rank's tensor; every rank's has the same shape and dtype.
            op: ``"sum"``, ``"mean"`` (floating-point tensors only), ``"max"``, ``"min"`` or ``"prod"``.

        Returns:
            ``x``, holding the reduction.

        Raises:
            ValueError: an unknown ``op``, or one undefined for ``x``'s dtype.
            TypeError: ``"mean"`` of an integer tensor (its mean is float64: use :meth:`allreduce`), or
                a dtype torch cannot reduce on CPU.
            CollectiveMismatchError: the ranks' shapes, dtypes or ops differ.

        Example::

            >>> big = torch.rand(16 << 20)
            >>> comm.allreduce_(big, op="mean")
        """

    @abc.abstractmethod
    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send a picklable object to rank ``dest``, which calls :meth:`recv_obj`.

        The receiver unpickles it (see :meth:`recv_obj`): send only to processes that trust this one.

        Args:
            obj: the object (tensor views travel as what they show, not their whole storage).
            dest: the receiving rank.
            tag: tells apart several messages between the same ranks.

        Raises:
            ValueError: ``dest`` or ``tag`` is out of range.
            TypeError: ``obj`` cannot be pickled (the receiver gets RemoteRankError).

        Example::

            >>> if comm.rank == 0:
            ...     comm.send_obj({"epoch": 3, "best": 0.91}, dest=1)
        """

    @abc.abstractmethod
    def recv_obj(self, source: int, tag: int = 0) -> Any:
        """Receive the object rank ``source`` sent with :meth:`send_obj`.

        Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
        processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

        Args:
            source: the sending rank; ``tag``: the sender's tag.

        Returns:
            The object.

        Raises:
            RemoteRankError: the sender could not pickle it, or it cannot be unpickled here.

        Example::

            >>> if comm.rank == 1:
            ...     state = comm.recv_obj(source=0)   # {'epoch': 3, 'best': 0.91}
        """

    @abc.abstractmethod
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Root's picklable object on every rank. Sent in chunks, so objects over 2 GiB work.

        Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
        processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

        Args:
            obj: root's object; ignored elsewhere.
            root: the sending rank.

        Returns:
            Root's object (on root, ``obj`` itself).

        Raises:
            CollectiveMismatchError: the ranks passed different roots or made another call.

        Example::

            >>> config = comm.bcast_obj(load_config() if comm.rank == 0 else None)
        """

    @abc.abstractmethod
    def gather_obj(self, obj: Any, root: int = 0) -> Optional[list[Any]]:
        """Every rank's object, in rank order, on ``root``; ``None`` elsewhere.

        Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
        processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

        Args:
            obj: this rank's object; ``root``: the receiving rank.

        Returns:
            On root a list of ``size`` objects; ``None`` elsewhere.

        Raises:
            RemoteRankError: a rank could not pickle its object (raised on root once all are in).

        Example::

            >>> losses = comm.gather_obj(local_loss)    # rank 0: [loss of rank 0, loss of rank 1, ...]
        """

    @abc.abstractmethod
    def allgather_obj(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank.

        Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
        processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

        Args:
            obj: this rank's object.

        Returns:
            A list of ``size`` objects.

        Raises:
            TypeError: this rank's object cannot be pickled (the others get RemoteRankError).

        Example::

            >>> hosts = comm.allgather_obj(socket.gethostname())
        """

    @abc.abstractmethod
    def allgather_obj_as(self, obj: Any, kind: str, root: Optional[int] = None) -> list[Any]:
        """:meth:`allgather_obj`, checked as collective ``kind``: what a collective built on it
        (``allreduce_obj``, ``split``, ``check_same_layout``) calls, so that ranks making different
        ones, or passing different roots, get :class:`~torchmn.CollectiveMismatchError` instead of
        each other's objects.

        Args:
            obj: this rank's object.
            kind: the collective's name, one of the call check's kinds.
            root: the collective's root, which every rank must pass alike (None: it has none).

        Returns:
            A list of ``size`` objects.

        Raises:
            TypeError: this rank's object cannot be pickled (the others get RemoteRankError).
            CollectiveMismatchError: ranks made another collective, or passed other roots.

        Example::

            >>> layouts = comm.allgather_obj_as([tuple(p.shape) for p in params], "check_same_layout", root=0)
        """

    @abc.abstractmethod
    def scatter_obj(self, objs: Optional[Sequence[Any]], root: int = 0) -> Any:
        """Rank ``i`` receives ``objs[i]`` from root; other ranks pass ``None``.

        Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
        processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

        Args:
            objs: on root, ``size`` objects; ``None`` elsewhere. ``root``: the sending rank.

        Returns:
            This rank's object.

        Raises:
            ValueError: root did not pass ``size`` objects (the others get RemoteRankError).

        Example::

            >>> mine = comm.scatter_obj([files[i::comm.size] for i in range(comm.size)] if comm.rank == 0 else None)
        """

    @abc.abstractmethod
    def allreduce_obj(self, obj: Any) -> Any:
        """The sum (by ``+``) of every rank's object, on every rank.

        Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
        processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

        Args:
            obj: this rank's object (a number, a list, a Counter, ...).

        Returns:
            ``obj`` of rank 0 + ... + ``obj`` of the last rank.

        Example::

            >>> n_seen = comm.allreduce_obj(len(local_shard))
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of this communicator gets here.

        Example::

            >>> if comm.rank == 0:
            ...     download_dataset()
            >>> comm.barrier()       # the other ranks read the files only once rank 0 has written them
        """

    @abc.abstractmethod
    def split(self, color: int, key: int = 0) -> "CommunicatorBase":
        """A new communicator of the ranks that pass the same ``color``, ordered by ``(key, rank)``.

        Every rank must call it. The new communicator uses this one's algorithm, timeout and
        ``compression``.

        Args:
            color: ranks passing the same color end up in the same communicator.
            key: orders the ranks of the new communicator (ties by this communicator's rank).

        Returns:
            The communicator of this rank's color.

        Example::

            >>> half = comm.split(color=comm.rank % 2, key=comm.rank)
        """

    @abc.abstractmethod
    def finalize(self) -> None:
        """Tear down ``torch.distributed`` if this communicator set it up, else let go of the process
        groups made for it (``split``'s): their connections and file descriptors. Safe to call twice.

        Not a collective, but a rank should finalize only after its last collective on this
        communicator. A finalized communicator refuses further collectives.

        Example::

            >>> comm.finalize()      # at the end of the script, on every rank
        """

    @abc.abstractmethod
    def bcast_data(self, model: torch.nn.Module, root: int = 0) -> None:
        """Make every parameter and buffer of ``model`` root's, bit for bit.

        Args:
            model: the same model on every rank.
            root: the rank whose weights everyone gets.

        Raises:
            CollectiveMismatchError: the ranks' models differ in layout (count, shapes, dtypes).

        Example::

            >>> comm.bcast_data(model)   # all ranks now start from rank 0's weights
        """

    @abc.abstractmethod
    def bcast_tensors(self, tensors: list[torch.Tensor], root: int = 0) -> None:
        """Overwrite each tensor, in place, with root's, bit for bit (all ranks pass the same layout).

        There is no call check: over tensors of another layout than root's it would hang or mix
        data, so where the ranks' layouts may differ, check them first with :meth:`check_same_layout`.

        Args:
            tensors: this rank's tensors, in the same order, shapes and dtypes as root's.
            root: the rank whose values everyone gets.

        Example::

            >>> buffers = list(model.buffers())
            >>> comm.check_same_layout(buffers, "the model's buffers")
            >>> comm.bcast_tensors(buffers)      # every rank now holds rank 0's running statistics
        """

    @abc.abstractmethod
    def check_same_layout(self, tensors: list[torch.Tensor], what: str, root: int = 0,
                          advice: str = "build the same model on every rank") -> None:
        """Check that every rank passes tensors of root's count, shapes and dtypes (collective).

        A collective over tensors of different layouts would hang or mix data.

        Args:
            tensors: this rank's tensors.
            what: what they are, for the message.
            root: the rank whose layout is the reference.
            advice: what to do about a difference, for the message.

        Raises:
            CollectiveMismatchError: on every rank, naming the first difference.

        Example::

            >>> comm.check_same_layout(list(model.parameters()), "the model's parameters")
        """

    @abc.abstractmethod
    def multi_node_mean_grad(self, model: torch.nn.Module, zero_fill: bool = False) -> None:
        """Make every ``.grad`` of ``model`` its mean over ranks, with this communicator's algorithm.

        Args:
            model: the module whose trainable parameters' gradients are averaged.
            zero_fill: count a missing (``None``) gradient as zeros; its ``.grad`` becomes the mean.
                Without it, a gradient missing on every rank is skipped.

        Raises:
            CollectiveMismatchError: a gradient is missing on some ranks only (without
                ``zero_fill``), the ranks' models differ in layout, or they pass different ``zero_fill``.

        Example::

            >>> loss.backward(); comm.multi_node_mean_grad(model); optimizer.step()
        """

    # ----------------------------------------------------------------------------- for algorithms and optimizers
    @property
    @abc.abstractmethod
    def grad_bucket_cap_bytes(self) -> int:
        """How many bytes of gradients this algorithm fuses into one message.

        Returns:
            The bytes; 0 means one message a tensor (``naive``).

        Example::

            >>> comm.grad_bucket_cap_bytes         # flat and hierarchical: bucket_cap_bytes
            26214400
        """

    @abc.abstractmethod
    def mean_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor, in place, by its mean over ranks, in this algorithm's way.

        Args:
            tensors: dense tensors, in the same order, shapes and dtypes on every rank.

        Example::

            >>> comm.mean_tensors([p.grad for p in model.parameters()])
        """

    @abc.abstractmethod
    def allreduce_flat(self, flat: torch.Tensor, async_op: bool = False, op: str = "sum"):
        """Reduce one contiguous 1-D buffer over all ranks, in place.

        Args:
            flat: a contiguous 1-D tensor, of the same length and dtype on every rank.
            async_op: return at once.
            op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``.

        Returns:
            With ``async_op``, a handle with ``wait()``; without, the call has finished when it returns
            (and what it returns is not to be used).

        Example::

            >>> comm.allreduce_flat(bucket, async_op=True).wait()
        """

    @abc.abstractmethod
    def reduce_scatter_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Sum ``flat`` over ranks; rank ``r`` gets elements ``[r*k, (r+1)*k)`` of the sum in ``shard``.

        Args:
            flat: ``size * k`` contiguous elements.
            shard: ``k`` elements, overwritten.
            async_op: return at once.

        Returns:
            With ``async_op``, a handle with ``wait()``; without, the call has finished when it returns
            (and what it returns is not to be used).

        Example::

            >>> comm.reduce_scatter_flat(grads, my_shard)     # grads: size * k elements
        """

    @abc.abstractmethod
    def allgather_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """Every rank's ``shard`` (``k`` elements) into ``flat`` (``size * k``, overwritten), in rank order.

        Args:
            flat: ``size * k`` contiguous elements, overwritten.
            shard: this rank's ``k`` elements.
            async_op: return at once.

        Returns:
            With ``async_op``, a handle with ``wait()``; without, the call has finished when it returns
            (and what it returns is not to be used).

        Example::

            >>> comm.allgather_flat(params, my_shard)
        """

    @abc.abstractmethod
    def open_node_arena(self, shared_bytes: int, region_bytes: int, points: Sequence[str],
                        owned_shared: Sequence[Tuple[int, int]] = ()):
        """Memory all ranks share for good (the optimizers keep their buffers there). Collective.

        Args:
            shared_bytes: bytes of the region every rank reads and writes.
            region_bytes: bytes of each rank's own region, readable by the others.
            points: the names of the points where the ranks meet in the arena's ``barrier``.
            owned_shared: ``(offset, length)`` byte ranges of the shared region this rank writes
                most: their pages go on its NUMA domain, as its own region's do.

        Returns:
            A :class:`~torchmn.communicators.shm.NodeArena`, or None on every rank where they
            cannot share memory (several nodes, GPU, an algorithm without shared memory, a small
            ``/dev/shm``).

        Example::

            >>> arena = comm.open_node_arena(4096, 4096, points=("written", "summed"))
        """

    @abc.abstractmethod
    def may_share_node_memory(self) -> bool:
        """Whether :meth:`open_node_arena` can succeed at all (every rank on one node, an algorithm
        with shared memory); it may still return None where ``/dev/shm`` is too small. No
        communication, the same answer on every rank.

        Returns:
            False where :meth:`open_node_arena` is sure to return None.

        Example::

            >>> comm.may_share_node_memory()      # hierarchical, every rank on one CPU node
            True
        """

    @abc.abstractmethod
    def allreduce_copy(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """The reduction of contiguous ``x`` over ranks, as a new tensor: the step under
        :meth:`allreduce` once the ranks agreed on the call, which an algorithm may do faster.

        Args:
            x: a contiguous tensor on this rank's data device.
            op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``.

        Returns:
            A new tensor; ``x`` is left as it is.

        Example::

            >>> total = comm.allreduce_copy(x.contiguous(), "sum")   # no call check: use allreduce
        """

    @abc.abstractmethod
    def send_tensor(self, x: Optional[torch.Tensor], dest: int, wire_tag: int) -> None:
        """``send``'s message (an algorithm hook; ``hierarchical`` uses the node's mailboxes): a
        header on the CPU, saying what follows and which way (``wire_device``), then the data.

        Args:
            x: the tensor; None for the header of a send that failed here (``recv_tensor`` then raises).
            dest: a rank other than this one, checked.
            wire_tag: the tag in torch's tag space (``_wire.wire_tag``).

        Example::

            >>> comm.send_tensor(x, 1, _wire.wire_tag(0, "tensor"))     # what comm.send(x, 1) does
        """

    @abc.abstractmethod
    def recv_tensor(self, source: int, wire_tag: int) -> torch.Tensor:
        """``recv``'s message (an algorithm hook), as :meth:`send_tensor` sent it.

        Args:
            source: a rank other than this one, checked.
            wire_tag: the tag in torch's tag space.

        Returns:
            The tensor, on the CPU or, where it came through NCCL, on this rank's GPU.

        Example::

            >>> x = comm.recv_tensor(0, _wire.wire_tag(0, "tensor"))     # what comm.recv(0) does
        """

    @abc.abstractmethod
    def send_bytes(self, buf: Optional[torch.Tensor], dest: int, wire_tag: int) -> None:
        """A pickled object's bytes to ``dest`` (an algorithm hook): their length, then the bytes
        in chunks, through the CPU group.

        Args:
            buf: a ``uint8`` CPU tensor, or None to tell the receiver that the object could not
                be pickled.
            dest: a rank other than this one, checked.
            wire_tag: the tag in torch's tag space (``_wire.wire_tag``).

        Example::

            >>> comm.send_bytes(buf, 1, _wire.wire_tag(0, "object"))      # what comm.send_obj does
        """

    @abc.abstractmethod
    def recv_bytes(self, source: int, wire_tag: int) -> Optional[torch.Tensor]:
        """The bytes :meth:`send_bytes` sent (an algorithm hook).

        Args:
            source: a rank other than this one, checked.
            wire_tag: the tag in torch's tag space.

        Returns:
            A ``uint8`` CPU tensor, or None where the sender could not pickle its object.

        Example::

            >>> buf = comm.recv_bytes(0, _wire.wire_tag(0, "object"))
        """

    @abc.abstractmethod
    def wire_group(self, x: torch.Tensor) -> Optional["torch.distributed.ProcessGroup"]:
        """The process group a collective of ``x`` moves its data through, where it lies: the
        tensor group for CUDA tensors under NCCL, else the CPU (gloo) group (see :meth:`wire_device`).

        Args:
            x: a tensor on :meth:`wire_device` ``(x)``.

        Returns:
            A ``torch.distributed`` group; None in a world of one.

        Example::

            >>> dist.all_reduce(flat, group=comm.wire_group(flat))     # what allreduce_flat does
        """

    @abc.abstractmethod
    def wire_device(self, x: torch.Tensor | torch.device) -> torch.device:
        """The device a collective of ``x`` moves its data on: this rank's GPU (``device``) for
        CUDA tensors under NCCL, else the CPU (through gloo, and shared memory inside a node). A
        communicator on a machine with GPUs thus carries CPU tensors the CPU's way.

        Args:
            x: a tensor about to travel, or a device (``"cuda"``) to ask about its tensors.

        Returns:
            ``comm.device`` or ``torch.device("cpu")``.

        Raises:
            ValueError: ``x`` is a CUDA tensor under NCCL, but ranks of a node would share a GPU
                (NCCL refuses that); the message names them and the fixes.

        Example::

            >>> comm.wire_device(torch.ones(1))                  # on any machine
            device(type='cpu')
            >>> comm.wire_device(torch.ones(1, device="cuda"))   # NCCL, local rank 1
            device(type='cuda', index=1)
        """

    @abc.abstractmethod
    def exchange_headers(self, rows: list[list[int]]) -> torch.Tensor:
        """Every rank's call-check header rows (see ``torchmn/communicators/_call_check.py``): the
        small exchange before every collective, which an algorithm may route faster. Headers are
        CPU data, also under NCCL.

        Args:
            rows: this rank's rows, each ``_wire.HEADER_LEN`` integers.

        Returns:
            An int64 tensor ``[size, len(rows), HEADER_LEN]``, in rank order, on the CPU.

        Example::

            >>> comm.exchange_headers([[1] * 22]).shape       # 2 ranks
            torch.Size([2, 1, 22])
        """

    @abc.abstractmethod
    def drop_process_groups(self) -> None:
        """Finalize this communicator and let go of its process groups at once (a rank ending with
        an uncaught exception does this, see :mod:`torchmn.communicators.failure`).

        Example::

            >>> comm.drop_process_groups()
        """
