"""What both multi-node optimizers share: wrapping an optimizer, and sending gradient buckets
from backward hooks.

Gradients are packed into buckets in the reverse order of the parameters (the order backward
produces them), the first one small so communication starts early. A bucket is sent as soon as
all its gradients are ready, and buckets are always sent in the same order on every rank, so a
parameter that gets no gradient on one rank cannot make the ranks disagree: at the end of
backward the remaining buckets go out, missing gradients as zeros. Subclasses say what a bucket
is, how it is sent (allreduce or reduce-scatter) and what ``step()`` does with the result.
"""
from __future__ import annotations

import abc
import collections
import contextlib
import socket
import weakref
from typing import Callable, Iterator, Optional

import torch
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from torchmn.communicators import Communicator
from torchmn.communicators.errors import CollectiveMismatchError
from torchmn.errors import TorchmnNotImplementedError, TorchmnRuntimeError, TorchmnTypeError, TorchmnValueError
from torchmn.monitor import recorder
from torchmn.optimizers import join as joining
from torchmn.optimizers.memory_order import own_order

FIRST_BUCKET_BYTES = 1024 * 1024  # small, so communication starts early in backward
# The dtype gradients travel in, by the name a ``compression`` argument gives ("powersgd": their
# own, as low-rank approximations; see torchmn.optimizers.powersgd).
COMPRESSION = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16, "powersgd": None}


def make_buckets(params: list[torch.nn.Parameter], cap: int, build: Callable[[list], object],
                 same_bucket: Callable[[torch.nn.Parameter, torch.nn.Parameter], bool]) -> list:
    """Runs of consecutive parameters, last parameter first (the order backward produces their
    gradients), each run made into a bucket.

    Args:
        params: the trainable parameters, in the optimizer's order.
        cap: the most bytes of a bucket after the first, which holds at most FIRST_BUCKET_BYTES so
            that communication starts early (0: one parameter a bucket).
        build: makes a bucket of a run of parameters.
        same_bucket: whether two parameters may share a bucket (same dtype and device, ...).

    Returns:
        The buckets, in the order they are sent.

    Example::

        >>> params = [torch.nn.Parameter(torch.zeros(1000)) for _ in range(4)]    # 4000 bytes each
        >>> [len(run) for run in make_buckets(params, 8000, list, lambda a, b: a.dtype == b.dtype)]
        [2, 2]
    """
    buckets, run, run_bytes = [], [], 0
    limit = min(cap, FIRST_BUCKET_BYTES) if cap else 0
    for p in reversed(params):
        n = p.numel() * p.element_size()
        if run and (not same_bucket(run[0], p) or run_bytes + n > limit):
            buckets.append(build(run))
            run, run_bytes, limit = [], 0, cap
        run.append(p)
        run_bytes += n
    if run:
        buckets.append(build(run))
    return buckets


def could_share_memory(comm: Communicator, params: list[torch.nn.Parameter], compression: Optional[str]) -> bool:
    """Whether gradient buffers could live in shared memory (if the communicator has some):
    uncompressed CPU gradients of several ranks. The same answer on every rank.

    Args:
        comm: the communicator.
        params: the trainable parameters.
        compression: the optimizer's ``compression`` (None: uncompressed).

    Returns:
        Whether an optimizer should try to open the node's shared memory for them.

    Example::

        >>> could_share_memory(comm, list(model.parameters()), None)   # 2 ranks, a CPU model
        True
    """
    return (comm.size > 1 and compression is None and bool(params)
            and all(p.device.type == "cpu" for p in params))


def describe_rank(comm: Communicator) -> str:
    """This rank and its host, as the optimizers' messages name them.

    Args:
        comm: the optimizer's communicator.

    Returns:
        ``"rank R on HOST"``.

    Example::

        >>> describe_rank(comm)
        'rank 0 on node1'
    """
    return f"rank {comm.rank} on {socket.gethostname()}"


def copy_scaled(out: torch.Tensor, src: torch.Tensor, scale: Optional[float]) -> None:
    """``out`` = ``src`` times ``scale``, in one pass where the dtypes agree.

    Args:
        out: the destination.
        src: the source, of ``out``'s shape.
        scale: the factor; None for a plain copy.

    Example::

        >>> copy_scaled(bucket_view, p.grad, 1.0 / comm.size)    # the gradient, divided on the way in
    """
    if scale is None:
        out.copy_(src)
    elif src.dtype == out.dtype:
        torch.mul(src, scale, out=out)  # scaled on the way in: no extra pass
    else:
        out.copy_(src * scale)


def _hook_registration(kind: str, what: str) -> Callable:
    """One of torch's ``register_*state_dict*_hook`` methods, adding to ``state_dict_hooks[kind]``."""
    def register(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        hooks = self.state_dict_hooks[kind]
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        if prepend:  # run before the hooks of its kind registered so far
            hooks.move_to_end(handle.id, last=False)
        return handle
    register.__doc__ = (f"{what} As torch's; ``prepend`` runs it before the others of its kind; returns a "
                        f"handle whose ``remove()`` unregisters it.")
    return register


def hook_gradients(owner: object, params: list[torch.nn.Parameter], method: str) -> list[RemovableHandle]:
    """Call ``owner.<method>(p)`` once each parameter's gradient is accumulated, for as long as
    ``owner`` exists: the hooks hold it weakly, and go when it is collected.

    A parameter's hooks live as long as the parameter: hooks holding an optimizer the script has
    dropped (for a new one, in a new phase of training) would keep it averaging, and counting
    backward passes, for nobody.

    Args:
        owner: the object whose method the hooks call (an optimizer).
        params: the parameters to hook.
        method: the method's name.

    Returns:
        The hooks' handles (``remove()`` each to detach earlier).

    Example::

        >>> self._hooks.extend(hook_gradients(self, params, "_on_grad"))
    """
    ref = weakref.ref(owner)

    def hook(p: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            getattr(target, method)(p)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    weakref.finalize(owner, _remove_all, handles)
    return handles


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


class GradientSyncOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Base of the multi-node optimizers: shares the wrapped optimizer's ``param_groups`` and
    ``defaults``, and sends ``self.buckets`` as backward makes their gradients ready.

    Build one with :func:`torchmn.create_multi_node_optimizer`.

    Attributes:
        wrapped: the ``torch.optim.Optimizer`` this one wraps.
        comm: the communicator.
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        wire_dtype: the dtype gradients travel in under ``compression`` (None: their own).
        contributors: how many ranks' gradients this step's average is over (every rank, or
            inside :func:`torchmn.join` those that still have data).
        buckets: the gradient buckets, in the order they are sent (each with ``.params`` and a
            ``.ready`` set), which the subclass builds.

    A subclass builds its buckets from :meth:`trainable_params`, calls :meth:`attach_hooks`,
    implements ``_send(bucket)`` (start one bucket's communication) and ``_all_sent()`` (every
    bucket of the step is out), :meth:`whole_state_dict` and :meth:`load_whole_state_dict`, and
    starts its ``step()`` with :meth:`check_step`.
    """

    # Whether updates use the previous step's averages (ChainerMN's double buffering); only the
    # replicated optimizer offers it.
    double_buffering = False

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, *, compression: Optional[str],
                 backward_passes_per_step: int):
        """Check the options and share the wrapped optimizer's groups (for a subclass's
        ``__init__``, which then builds its buckets). No communication.

        The optimizer is numbered among those built on ``comm``, for :func:`torchmn.join`.

        Args:
            optimizer: the ``torch.optim.Optimizer`` to wrap.
            comm: the communicator.
            compression: ``None``, ``"none"``, ``"fp16"`` or ``"bf16"``: the dtype gradients travel in;
                ``"powersgd"``: as low-rank approximations (the replicated optimizer only).
            backward_passes_per_step: backward passes accumulated locally per averaging.

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
            ValueError: an unknown ``compression``, or ``backward_passes_per_step < 1``.

        Example::

            >>> super().__init__(optimizer, comm, compression=None, backward_passes_per_step=1)
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TorchmnTypeError(f"create_multi_node_optimizer wraps a torch.optim.Optimizer, not "
                                   f"{type(optimizer).__name__}")
        if compression not in COMPRESSION:
            raise TorchmnValueError(f"compression must be one of None, 'fp16', 'bf16', 'powersgd', not {compression!r}")
        if backward_passes_per_step < 1:
            raise TorchmnValueError(f"backward_passes_per_step must be >= 1, not {backward_passes_per_step}")
        # Deliberately no Optimizer.__init__: param_groups are the wrapped optimizer's own.
        self.wrapped = optimizer
        self.comm = comm
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.wire_dtype = COMPRESSION[compression]
        self._no_sync = False
        self._passes = 0            # backward passes since the gradients last went out
        self._in_pass = False
        self._pass_syncs = False
        self._sent = False          # this step's gradients have gone out
        self._sends = 0             # times gradients went out since the last step() (sharded checks it)
        self._next = 0              # next bucket to send, in order
        # Buckets go out while backward runs where there are other ranks to overlap with; a world
        # of one keeps only the hooks' checks (every option means the same there).
        self._overlap = comm.size > 1
        self._hooks = []
        self._where: dict = {}
        # Whose gradients this step's average is over: every rank, or inside torchmn.join the ranks
        # that still have data (the exchange at the start of each step's averaging tells).
        self.contributors = comm.size
        # Hooks around state_dict() and load_state_dict(), as a torch optimizer has them.
        self.state_dict_hooks = {kind: collections.OrderedDict() for kind in ("pre", "post", "load_pre", "load_post")}
        joining.register(self)

    def trainable_params(self) -> list[torch.nn.Parameter]:
        """The wrapped optimizer's trainable parameters, each once, after checking that every rank
        holds the same layout and broadcasting their values (and the frozen ones') from rank 0.
        Collective; for a subclass's ``__init__``.

        Returns:
            The parameters that require gradients, in the optimizer's order.

        Raises:
            ValueError: compression of complex parameters.
            CollectiveMismatchError: the ranks' models differ in layout.

        Example::

            >>> params = self.trainable_params()
        """
        everything = list(dict.fromkeys(p for g in self.wrapped.param_groups for p in g["params"]))
        params = [p for p in everything if p.requires_grad]
        # What step() checks, cheaply, to refuse changes the buckets cannot follow.
        self._frozen_at_wrap = [p for p in everything if not p.requires_grad]
        self._param_count = sum(len(g["params"]) for g in self.wrapped.param_groups)
        self.comm.check_same_layout(params, "create_multi_node_optimizer: the trainable parameters", 0,
                                     "build the same model, and freeze the same parameters, on every rank")
        self.comm.check_same_layout(self._frozen_at_wrap, "create_multi_node_optimizer: the frozen parameters",
                                     0, "build the same model, and freeze the same parameters, on every rank")
        self._check_same_memory_order(params)
        if self.wire_dtype is not None and any(p.is_complex() for p in params):
            raise TorchmnValueError(f"compression={self.compression!r} with complex parameters: their gradients would "
                                    f"lose the imaginary part on the wire; use compression=None")
        # Frozen ones too: a randomly initialised frozen layer would otherwise differ between ranks.
        self.comm.bcast_tensors([p.data for p in params + self._frozen_at_wrap], root=0)
        return params

    def _check_same_memory_order(self, params: list[torch.nn.Parameter]) -> None:
        """Raise on every rank where a parameter's memory format (channels_last or the default)
        differs between ranks: the gradient buffers hold each parameter's elements in its own
        memory order, so the ranks' sums would add elements of different places."""
        if self.comm.size == 1:
            return
        orders = self.comm.allgather_obj([own_order(p) for p in params])
        for i, p in enumerate(params):
            if any(o[i] != orders[0][i] for o in orders):
                by = [r for r, o in enumerate(orders) if o[i] != orders[0][i]]

                def layout(strides):
                    return f"strides {strides}" if strides else "the default (contiguous) layout"
                raise CollectiveMismatchError(
                    f"create_multi_node_optimizer: the parameter of shape {tuple(p.shape)} (number {i} of the "
                    f"trainable ones) has {layout(orders[by[0]][i])} on rank(s) {by} and {layout(orders[0][i])} on "
                    f"rank 0: convert the model to one memory format on every rank (model.to(memory_format="
                    f"torch.channels_last), or none) before wrapping (raised on rank {self.comm.rank})")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clip the averaged gradients by their norm over the whole model; returns that norm.

        ``torch.nn.utils.clip_grad_norm_`` over the wrapped optimizer's parameters, once this
        step's gradients are averaged into ``.grad`` (sent first if backward has not); the same
        call as with ``shard_state=True``, so a script can switch. With ``zero_fill=False`` a
        parameter left without a gradient on some ranks counts only where it has one, so ranks can
        clip by different factors: keep the default ``zero_fill=True``.

        Args:
            max_norm: the largest total norm the gradients may have.
            norm_type: the norm's order (``2.0``, ``float("inf")``, ...).
            error_if_nonfinite: raise where the total norm is NaN or infinite.
            foreach: as ``torch.nn.utils.clip_grad_norm_``'s.

        Returns:
            The total norm of the averaged gradients, before clipping.

        Raises:
            ValueError: with ``double_buffering=True`` (the update uses the previous step's averages).

        Example::

            >>> loss_fn(model(x), y).backward()
            >>> norm = optimizer.clip_grad_norm_(1.0)
            >>> optimizer.step()
        """
        if self.double_buffering:
            raise TorchmnValueError("clip_grad_norm_ with double_buffering=True: the update uses the previous "
                                    "step's averages, which step() swaps in after this call; use "
                                    "double_buffering=False to clip")
        self.synchronize()
        params = [p for g in self.wrapped.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    def attach_hooks(self, params: list[torch.nn.Parameter], buckets: list) -> None:
        """Hook every parameter's gradient: each bucket goes out once backward has made all its
        gradients (for subclasses, once they built their buckets).

        Args:
            params: the trainable parameters (:meth:`trainable_params`).
            buckets: this optimizer's buckets, in the order they are sent.

        Example::

            >>> self.attach_hooks(params, self.buckets)       # at the end of a subclass's __init__
        """
        self._where = {p: bi for bi, b in enumerate(buckets) for p in b.params}
        self._dtypes = {p: p.dtype for p in params}
        self._strides = {p: p.stride() for p in params}
        # Also in a world of one, so that every option means the same there.
        self._hooks.extend(hook_gradients(self, params, "_on_grad"))

    # ----------------------------------------------------------------------------- sending
    @abc.abstractmethod
    def _send(self, bucket) -> None:
        """Start the communication of one bucket whose gradients are ready."""

    @abc.abstractmethod
    def _all_sent(self) -> None:
        """Every bucket of this step has been sent (at the end of backward, or by synchronize)."""

    def _send_ready(self) -> None:
        buckets = self.buckets
        while self._next < len(buckets) and len(buckets[self._next].ready) == len(buckets[self._next].params):
            if self._next == 0:
                self.contributors = joining.contributors(self)
            self._send(buckets[self._next])
            self._next += 1

    def _send_rest(self) -> None:
        if recorder.on:  # every gradient of this step is in: backward has ended
            recorder.backward_ended(recorder.now())
        if self._next == 0:  # the step's first bucket: inside torchmn.join, learn who still has data
            self.contributors = joining.contributors(self)
        for bucket in self.buckets[self._next:]:
            self._send(bucket)
        self._next = 0
        self._passes = 0
        self._sent = True
        self._sends += 1
        with recorder.waiting("average", "average", {"buckets": len(self.buckets)}):
            self._all_sent()

    # ----------------------------------------------------------------------------- hooks
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad.layout is not torch.strided:
            raise TorchmnRuntimeError(
                f"{describe_rank(self.comm)}: the gradient of a parameter of shape "
                f"{tuple(p.shape)} is {p.grad.layout} (nn.Embedding(sparse=True) or EmbeddingBag(sparse=True)); "
                f"create_multi_node_optimizer averages dense gradients only: build the layer with sparse=False")
        if p.dtype is not self._dtypes[p]:
            raise TorchmnRuntimeError(
                f"{describe_rank(self.comm)}: a parameter of shape {tuple(p.shape)} is {p.dtype} now but was "
                f"{self._dtypes[p]} when create_multi_node_optimizer wrapped the optimizer (model.double(), "
                f".half() or .to(dtype) since?); its gradient buffers are of the old type. Convert the model "
                f"first, then create the torch optimizer and wrap it")
        if p.stride() != self._strides[p]:
            raise TorchmnRuntimeError(
                f"{describe_rank(self.comm)}: a parameter of shape {tuple(p.shape)} has strides {p.stride()} now but "
                f"had {self._strides[p]} when create_multi_node_optimizer wrapped the optimizer "
                f"(model.to(memory_format=...) since?); its gradient buffers follow the old layout, and the "
                f"conversion moved its .grad out of them. Convert the model first, then create the torch optimizer "
                f"and wrap it")
        if not self._in_pass:
            self._in_pass = True
            # A new backward adds gradients that have not gone out, even where the last ones did
            # and no step() took them (every rank skipped it): synchronize() must send again.
            self._sent = False
            self._pass_syncs = not self._no_sync and self._passes + 1 >= self.backward_passes_per_step
            Variable._execution_engine.queue_callback(self._on_backward_end)
        if self._pass_syncs and self._overlap:
            self.buckets[self._where[p]].ready.add(id(p))
            self._send_ready()

    def _on_backward_end(self) -> None:
        self._in_pass = False
        self._passes += 1
        if self._pass_syncs:
            self._send_rest()

    # ----------------------------------------------------------------------------- public
    def synchronize(self) -> None:
        """Send this step's gradients now, if backward has not already (Horovod's name).

        What happens to them once sent is the subclass's: the replicated optimizer waits for the
        averages and puts them in ``.grad``; the sharded one takes them at ``step()``. Where it
        sends, it is collective: every other rank must send too (at the end of its backward, or
        by its own ``synchronize()``).

        Example::

            >>> with optimizer.no_sync():
            ...     loss_fn(model(x), y).backward()     # nothing sent
            >>> optimizer.synchronize()                 # sent now, as after a backward outside no_sync
            >>> optimizer.step()
        """
        if not self._sent:
            self._send_rest()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside communicates.

        Returns:
            A context manager.

        Example::

            >>> with optimizer.no_sync():
            ...     loss_fn(model(x1)).backward()
            >>> loss_fn(model(x2)).backward()   # averaged over ranks here
            >>> optimizer.step()
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def check_step(self, closure, why_no_closure: Optional[str] = "") -> None:
        """What every ``step()`` checks first (for subclasses): no closure where it cannot take one,
        the last backward ended, and the parameters are those the gradient buckets were built for.

        Args:
            closure: what ``step()`` was given.
            why_no_closure: why this optimizer takes no closure, for the message; None where it
                takes one.

        Raises:
            ValueError: a closure this optimizer cannot take.
            RuntimeError: the last backward raised before it ended, or parameters were added or
                unfrozen since wrapping.

        Example::

            >>> self.check_step(closure, "shard_state=True updates shards")  # a subclass's step()
        """
        if closure is not None and why_no_closure is not None:
            raise TorchmnValueError(f"step(closure) (LBFGS): {why_no_closure or 'not supported here'}; it is supported "
                                    f"by create_multi_node_optimizer(..., shard_state=False, double_buffering=False, "
                                    f"backward_passes_per_step=1)")
        if not self._check_backward_ended():
            raise TorchmnRuntimeError(
                f"{describe_rank(self.comm)}: step() after a backward() that raised before it ended: its gradients "
                f"are partial and were only partly averaged over ranks. Call optimizer.zero_grad() and go "
                f"on with the next batch (on every rank), as when skipping a batch")
        count = sum(len(g["params"]) for g in self.wrapped.param_groups)
        if count != self._param_count:
            raise TorchmnRuntimeError(
                f"{describe_rank(self.comm)}: the wrapped optimizer has {count} parameters now but had {self._param_count} when "
                f"create_multi_node_optimizer wrapped it, so the new ones would not be averaged over ranks. "
                f"Add parameter groups before wrapping.")
        for p in self._frozen_at_wrap:
            if p.requires_grad and p.grad is not None:
                raise TorchmnRuntimeError(
                    f"{describe_rank(self.comm)}: a parameter of shape {tuple(p.shape)} has a gradient, but it was frozen "
                    f"(requires_grad=False) when create_multi_node_optimizer wrapped the optimizer, so its "
                    f"gradients are not averaged over ranks and the ranks' models would drift apart. Unfreeze "
                    f"parameters before wrapping; to unfreeze later (fine-tuning schedules), call "
                    f"optimizer.remove_hooks() and wrap the torch optimizer again.")

    def _check_backward_ended(self) -> bool:
        """Whether the last backward ended; if it raised instead (an exception caught by the
        script, the batch skipped), forget what it left half done: autograd never ran its
        end-of-backward callback, and its first buckets are out. Their results must not reach the
        next step, nor its state the next backward."""
        if not self._in_pass:
            return True
        self._in_pass = self._pass_syncs = False
        self._next = 0
        self._passes = 0
        for bucket in self.buckets:
            bucket.ready.clear()  # the buckets it sent wait for their collectives before being packed again
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the wrapped optimizer's parameters, as torch's ``zero_grad``.

        Also forgets a backward that raised before it ended (its half-sent buckets), and starts
        a new ``backward_passes_per_step`` window: the passes counted so far were discarded with
        their gradients.

        Args:
            set_to_none: set ``.grad`` to None (default) rather than to zeros.

        Example::

            >>> optimizer.zero_grad()
        """
        self._check_backward_ended()
        self._passes = 0
        if not set_to_none:
            self.wrapped.zero_grad(set_to_none=False)
            return
        # What torch's does for set_to_none, without its profiler range and dynamo guard, which
        # cost a measurable part of a small model's step, run cold between step() and forward.
        for group in self.wrapped.param_groups:
            for p in group["params"]:
                p.grad = None

    def add_param_group(self, param_group) -> None:
        """Not supported after wrapping: the gradient buckets are built for the parameters there were.

        Args:
            param_group: the group that would be added; not used.

        Raises:
            NotImplementedError: always; add groups to the torch optimizer before wrapping it.

        Example::

            >>> optimizer.add_param_group({"params": head.parameters()})
            Traceback (most recent call last):
            torchmn.errors.TorchmnNotImplementedError: add a parameter group to the wrapped optimizer before wrapping it
        """
        raise TorchmnNotImplementedError("add a parameter group to the wrapped optimizer before wrapping it")

    @property
    def param_groups(self):
        """The wrapped optimizer's parameter groups (LR schedulers change them there)."""
        return self.wrapped.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.wrapped.param_groups = value

    @property
    def defaults(self):
        """The wrapped optimizer's defaults."""
        return self.wrapped.defaults

    @defaults.setter
    def defaults(self, value):
        self.wrapped.defaults = value

    def __reduce_ex__(self, protocol):
        """Refuse to be pickled or copied (``pickle``, ``copy.copy`` and ``copy.deepcopy`` all ask here).

        Args:
            protocol: the pickle protocol asked for; not used.

        Raises:
            TypeError: always: the optimizer holds the communicator, backward hooks and shared
                buffers; save ``state_dict()`` and load it into a new one instead.

        Example::

            >>> copy.deepcopy(optimizer)
            Traceback (most recent call last):
            torchmn.errors.TorchmnTypeError: a MultiNodeOptimizer cannot be copied or pickled: ...
        """
        # Also what copy.copy and copy.deepcopy would use; torch's Optimizer.__setstate__ would then
        # patch this class's step() for hooks it never set up, breaking every other instance.
        raise TorchmnTypeError(f"a {type(self).__name__} cannot be copied or pickled: it holds the communicator, "
                               f"backward hooks and shared buffers. Save optimizer.state_dict() and load it into "
                               f"a new one (create_multi_node_optimizer(...).load_state_dict(state)) instead")

    # ----------------------------------------------------------------------------- state dicts
    @abc.abstractmethod
    def whole_state_dict(self) -> dict:
        """The optimizer state in torch's format, without the state-dict hooks (the subclass's).

        Returns:
            ``{"state": ..., "param_groups": ...}`` as ``torch.optim.Optimizer.state_dict()``.

        Example::

            >>> optimizer.whole_state_dict()["param_groups"][0]["lr"]
            0.01
        """

    @abc.abstractmethod
    def load_whole_state_dict(self, state_dict: dict) -> None:
        """Load a state in torch's format, without the state-dict hooks (the subclass's).

        Args:
            state_dict: the state.

        Example::

            >>> optimizer.load_whole_state_dict(torch.load(path)["opt"])
        """

    def state_dict(self) -> dict:
        """The whole optimizer state, in the wrapped optimizer's format: what
        :meth:`whole_state_dict` gives (a collective for the sharded optimizer), passed through the
        hooks registered with :meth:`register_state_dict_pre_hook` and
        :meth:`register_state_dict_post_hook`, as torch's ``Optimizer.state_dict()`` does.

        Returns:
            ``{"state": ..., "param_groups": ...}``; it loads with any rank count and into the plain
            torch optimizer.

        Example::

            >>> state = optimizer.state_dict()   # on every rank: a collective with shard_state=True
            >>> if comm.rank == 0:
            ...     torch.save({"model": model.state_dict(), "opt": state}, path)
        """
        for hook in list(self.state_dict_hooks["pre"].values()):
            hook(self)
        state = self.whole_state_dict()
        for hook in list(self.state_dict_hooks["post"].values()):
            changed = hook(self, state)
            state = state if changed is None else changed
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of this or a plain torch optimizer (on every rank), passed through
        the hooks registered with :meth:`register_load_state_dict_pre_hook` and
        :meth:`register_load_state_dict_post_hook`, as torch's ``Optimizer.load_state_dict()`` does.

        Args:
            state_dict: the state, in torch's optimizer format.

        Raises:
            ValueError: its groups or state entries do not fit this optimizer's parameters.

        Example::

            >>> optimizer.load_state_dict(torch.load(path)["opt"])
        """
        for hook in list(self.state_dict_hooks["load_pre"].values()):
            changed = hook(self, state_dict)
            state_dict = state_dict if changed is None else changed
        self.load_whole_state_dict(state_dict)
        for hook in list(self.state_dict_hooks["load_post"].values()):
            hook(self)

    # torch's four state-dict hooks: what state_dict() and load_state_dict() above call.
    register_state_dict_pre_hook = _hook_registration(
        "pre", "Call ``hook(optimizer)`` before :meth:`state_dict` builds the state.")
    register_state_dict_post_hook = _hook_registration(
        "post", "Call ``hook(optimizer, state_dict)`` on what :meth:`state_dict` built; a dict it returns replaces it.")
    register_load_state_dict_pre_hook = _hook_registration(
        "load_pre", "Call ``hook(optimizer, state_dict)`` before :meth:`load_state_dict`; a dict it returns is loaded.")
    register_load_state_dict_post_hook = _hook_registration(
        "load_post", "Call ``hook(optimizer)`` after :meth:`load_state_dict` has loaded.")

    def run_as_wrapped_step(self, update: Callable[[], None]) -> None:
        """Run ``update`` as the wrapped optimizer's ``step()`` (for subclasses that update with
        optimizers of their own): with the step hooks registered on it, before wrapping too, and
        torch's global ones, and counted as its step by the LR schedulers attached to it.

        Args:
            update: the subclass's update.

        Example::

            >>> return self.run_as_wrapped_step(self._update)     # the end of a subclass's step()
        """
        # What an LR scheduler's patch of the wrapped step() would set: without it, a scheduler
        # built on the torch optimizer before wrapping warns that it stepped before the optimizer.
        self.wrapped._opt_called = True
        torch.optim.Optimizer.profile_hook_step(lambda _optimizer: update())(self.wrapped)

    def register_step_pre_hook(self, hook):
        """Call ``hook(optimizer, args, kwargs)`` before each update, as torch's does.

        Args:
            hook: the function; its ``optimizer`` is the wrapped one.

        Returns:
            A handle whose ``remove()`` removes the hook.

        Example::

            >>> handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: print("stepping"))
            >>> handle.remove()
        """
        return self.wrapped.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        """Call ``hook(optimizer, args, kwargs)`` after each update, as torch's does.

        Args:
            hook: the function; its ``optimizer`` is the wrapped one.

        Returns:
            A handle whose ``remove()`` removes the hook.

        Example::

            >>> handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: scheduler.step())
        """
        return self.wrapped.register_step_post_hook(hook)

    def __repr__(self) -> str:
        """The class, the wrapped optimizer and the communicator.

        Returns:
            ``ClassName(<the wrapped optimizer's repr>, <the communicator's repr>)``.

        Example::

            >>> print(optimizer)
            MultiNodeOptimizer(SGD (
            Parameter Group 0
                ...
            ), <FlatCommunicator rank 0/2 intra 0/2 inter 0/1 gloo>)
        """
        return f"{type(self).__name__}({self.wrapped!r}, {self.comm!r})"

    def leave_world(self) -> None:
        """Let go of everything tied to this optimizer's world, which broke up (an elastic job's
        reset, :mod:`torchmn.elastic`).

        The parameters move out of the optimizer's buffers (shared memory there may be unmapped
        with the old world) into memory of their own, keeping their values; gradients and the
        multi-node state go. The wrapped torch optimizer, the options and ``comm`` stay, for
        :func:`~torchmn.optimizers.multi_node_optimizer.build_into` to build it again in the next.

        Example::

            >>> optimizer.leave_world()
            >>> build_into(optimizer, optimizer.wrapped, comm, optimizer.options)   # comm: the new world's
        """
        with torch.no_grad():
            for group in self.wrapped.param_groups:
                for p in group["params"]:
                    p.data = p.data.clone()
                    p.grad = None
        if "_hooks" in self.__dict__:  # also one whose building for the last world failed part-way
            for h in self._hooks:  # not remove_hooks(): the state goes with the old world
                h.remove()
        # The communicator stays too: the reset moves it to the new world (Communicator.take_over).
        kept = {"wrapped": self.wrapped, "options": self.options, "comm": self.comm}
        self.__dict__.clear()
        self.__dict__.update(kept)

    def remove_hooks(self) -> None:
        """Detach from the parameters' gradient hooks (the wrapped optimizer keeps working alone).

        Backward then no longer sends gradients through this optimizer. What to do before
        unfreezing parameters: remove the hooks, then wrap the torch optimizer again.

        Example::

            >>> optimizer.remove_hooks()
            >>> backbone.requires_grad_(True)                   # unfreeze
            >>> optimizer = torchmn.create_multi_node_optimizer(optimizer.wrapped, comm)
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
