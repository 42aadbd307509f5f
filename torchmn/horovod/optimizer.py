"""``hvd.DistributedOptimizer``: Horovod's optimizer wrapper, on torchmn's multi-node optimizer.

The averaging is :func:`torchmn.create_multi_node_optimizer`'s (buckets sent while backward
runs, shared memory between the ranks of a node); this wrapper adds Horovod's interface: its
argument names, ``synchronize()`` / ``skip_synchronize()``, ``op=hvd.Sum``, its errors for misuse,
its part in ``hvd.join``, sparse gradients averaged as Horovod averages them (every rank's rows
gathered), and a rank outside the optimizer's process set updating alone. The object is an
instance of the wrapped optimizer's class, as Horovod's is, so ``isinstance(opt, torch.optim.SGD)``
still holds.
"""
from __future__ import annotations

import collections
import contextlib
import os
import time
import warnings
import weakref
from typing import Iterator

import torch
from torch.autograd import Variable

import torchmn
from torchmn.errors import TorchmnTypeError
from torchmn.horovod import coordination, timeline
from torchmn.horovod.compression import Compression, Compressor
from torchmn.horovod.errors import (HorovodInternalError, InvalidCallError, NotPicklableError,
                                    TooManyBackwardPassesError, UnsupportedError, ZeroGradBeforeStepError,
                                    raises_horovods_errors)
from torchmn.horovod.exchange_collectives import sparse_allreduce_async
from torchmn.horovod.handles import synchronize as synchronize_handle
from torchmn.horovod.process_sets import comm_of, global_process_set, require_comm
from torchmn.horovod.reduction_ops import OP_NAMES, Adasum, Average, Sum
from torchmn.optimizers.gradient_sync import hook_gradients

_optimizers: list = []   # weak references, in creation order (the same on every rank): join() mirrors them

TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")
STEP_AFTER_SYNCHRONIZE = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). torchmn does not average the gradients a second time, but a "
                          "Horovod script run on Horovod would; use: with optimizer.skip_synchronize(): "
                          "optimizer.step()")


def _wire_name(compression) -> str | None:
    if compression is None or compression is Compression.none:
        return None
    if isinstance(compression, type) and issubclass(compression, Compressor) and compression.wire_name:
        return compression.wire_name
    raise UnsupportedError(f"hvd.DistributedOptimizer: compression={compression!r} is not supported; torchmn "
                           f"sends gradients as they are (hvd.Compression.none) or as float16 "
                           f"(hvd.Compression.fp16)")


def _fusion_threshold_mb() -> float | None:
    """Horovod's fusion buffer size, as the gradient bucket size: ``HOROVOD_FUSION_THRESHOLD``
    (bytes) or horovodrun's ``--fusion-threshold-mb``; None: the communicator's default."""
    if os.environ.get("HOROVOD_FUSION_THRESHOLD_MB"):
        return float(os.environ["HOROVOD_FUSION_THRESHOLD_MB"])
    if os.environ.get("HOROVOD_FUSION_THRESHOLD"):
        return int(os.environ["HOROVOD_FUSION_THRESHOLD"]) / (1024 * 1024)
    return None


def _parameter_names(optimizer: torch.optim.Optimizer, named_parameters) -> dict:
    """Each parameter's name, as Horovod keeps it in ``_parameter_names``: from
    ``named_parameters`` (checked as Horovod checks it), else ``allreduce.noname.<group>.<index>``."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    _check_names(optimizer, named)
    return {p: name for name, p in sorted(named, key=lambda item: item[0])}


def _check_names(optimizer: torch.optim.Optimizer, named: list) -> None:
    """Horovod's checks of ``named_parameters``."""
    if named and not (isinstance(named[0], tuple) and len(named[0]) == 2 and isinstance(named[0][1], torch.Tensor)):
        raise InvalidCallError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                               "model.named_parameters().")
    duplicates = sorted(k for k, count in collections.Counter(k for k, _ in named).items() if count > 1)
    if duplicates:
        raise InvalidCallError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                               f"{', '.join(duplicates)}")
    named_ids = {id(v) for _, v in named}
    unnamed = [id(p) for g in optimizer.param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise InvalidCallError(f"named_parameters was specified, but one or more model parameters were not named. "
                               f"Python object ids: {', '.join(str(i) for i in unnamed)}")


def _on_inner(name: str):
    """torch's optimizer method ``name``, called on the optimizer a ``DistributedOptimizer`` wraps."""
    def call(self, hook, prepend: bool = False):
        return getattr(self._inner, name)(hook, prepend)
    call.__doc__ = (f"torch's ``{name}(hook, prepend=False)``, on the optimizer that averages for this one "
                    f"(the hook gets that one); returns a handle whose ``remove()`` unregisters it.")
    return call


class _DistributedOptimizer(torch.optim.Optimizer):
    """The behaviour of :func:`DistributedOptimizer` (its class also derives from the wrapped one's)."""

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set):
        # Deliberately no Optimizer.__init__: param_groups and state are the wrapped optimizer's.
        # Horovod's own attribute name: scripts and Horovod's tests read it.
        self._parameter_names = _parameter_names(optimizer, named_parameters)
        if op == Adasum:
            raise UnsupportedError("hvd.DistributedOptimizer: op=hvd.Adasum is not implemented in torchmn.horovod; "
                                   "use op=hvd.Average (the default) or hvd.Sum")
        if op not in (Average, Sum):
            raise UnsupportedError(f"hvd.DistributedOptimizer: op={OP_NAMES.get(op, op)} is not supported; use "
                                   f"hvd.Average (the default) or hvd.Sum")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise InvalidCallError("gradient_predivide_factor not supported with op != Average")
        if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise InvalidCallError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if not isinstance(num_groups, int) or num_groups < 0:
            raise InvalidCallError(f"num_groups must be a non-negative integer, not {num_groups!r}")
        self.process_set = global_process_set if process_set is None else process_set
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        self.sparse_as_dense = sparse_as_dense
        self._params = [p for p in dict.fromkeys(p for g in optimizer.param_groups for p in g["params"])
                        if p.requires_grad]
        self._in_pass = self._pass_syncs = False
        self._passes_since_step = self._passes_since_sync = 0
        self._sent_by_backward = False     # this step's gradients went out at the end of a backward
        self._synchronized = False         # ... and are averaged, in .grad
        self._user_synchronized = False    # the script called synchronize() itself
        self._skip_synchronize = False
        self._sync_started = None
        self._sparse_grads: dict = {}      # parameter -> this step's sparse gradient, averaged apart
        self._sparse_dims: dict = {}       # parameter -> sparse_dim, for every parameter ever seen sparse here
        self._densified: dict = {}         # with sparse_as_dense: parameter -> its sparse gradient's sparse_dim
        _wire_name(compression)            # an unsupported compressor is refused on every rank
        require_comm()  # before hvd.init(), Horovod's message first
        if process_set is not None and process_set.size() is None:
            raise InvalidCallError("hvd.DistributedOptimizer: Process set provided does not exist, or has not been "
                                   "registered (hvd.add_process_set on every rank first).")
        if process_set is not None and not process_set.included():
            # As Horovod's: a rank outside the set neither averages nor waits; it updates alone.
            self._comm, self._hooks, self._inner = None, [], optimizer
        else:
            self._comm = comm_of(process_set, "hvd.DistributedOptimizer")
            # Before the multi-node optimizer's hooks, so that they run first for each gradient.
            # Dropped for a new DistributedOptimizer (a new phase of training), its hooks go with it,
            # as Horovod's (held by the optimizer alone) do.
            self._hooks = hook_gradients(self, self._params, "_on_grad")
            self._inner = torchmn.create_multi_node_optimizer(
                optimizer, self._comm, compression=_wire_name(compression),
                backward_passes_per_step=backward_passes_per_step, bucket_cap_mb=_fusion_threshold_mb(),
                # Horovod's: every rank updates the whole model (join() ranks sit out steps).
                shard_state=False)
        self._index = len(_optimizers)
        _optimizers.append(weakref.ref(self))

    # ----------------------------------------------------------------------------- backward
    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None and (p.grad.layout is not torch.strided or p in self._sparse_grads):
            self._set_aside_sparse(p)
        if self._in_pass:
            return
        if self._synchronized:
            # synchronize() with no step() after it (GradScaler skipped an overflowed step, a
            # non-finite norm was skipped): as Horovod's synchronize(), it closed the window, and
            # this backward opens a new one.
            self._passes_since_step = 0
            self._sent_by_backward = self._synchronized = self._user_synchronized = False
            self._sync_started = None
        if self._passes_since_step >= self.backward_passes_per_step:
            raise TooManyBackwardPassesError(TOO_MANY_PASSES)
        self._in_pass = True
        self._pass_syncs = self._passes_since_sync + 1 >= self.backward_passes_per_step
        Variable._execution_engine.queue_callback(self._on_backward_end)
        if self._pass_syncs:
            self._start_sync()

    def _set_aside_sparse(self, p: torch.Tensor) -> None:
        """A sparse gradient (``nn.Embedding(sparse=True)``): dense with ``sparse_as_dense``; else kept
        apart for Horovod's sparse averaging at synchronize, the buckets (dense) getting zeros for it.
        Passes accumulated locally add up here: autograd adds each new sparse gradient to those zeros."""
        if self.sparse_as_dense:
            # Averaged dense, and sparse again at synchronize: the wrapped optimizer (SparseAdam)
            # takes what autograd gave it, as with Horovod.
            self._densified[p] = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()
            return
        kept = self._sparse_grads.get(p)
        grad = p.grad if p.grad.layout is not torch.strided else p.grad.to_sparse(kept.sparse_dim())
        self._sparse_grads[p] = grad if kept is None else (kept + grad).coalesce()
        self._sparse_dims[p] = grad.sparse_dim()
        p.grad = torch.zeros_like(p)

    def _on_backward_end(self) -> None:
        self._in_pass = False
        self._passes_since_step += 1
        self._passes_since_sync += 1
        if self._pass_syncs:
            self._passes_since_sync = 0
            self._sent_by_backward = True

    @raises_horovods_errors  # in backward: the first collective of a step
    def _start_sync(self) -> None:
        """Before this rank's gradients go out: tell a rank in ``hvd.join()`` to take part."""
        self._sync_started = time.time()
        coordination.agree(self._comm, coordination.describe_call("optimizer", self._index), need_descriptions=False)

    def mirror(self) -> None:
        """This rank's part, while it is in ``hvd.join()``, in the others' averaging (they have
        agreed with it already): zeros for its gradients, and no update.

        Example::

            >>> optimizer.mirror()          # on a joined rank, while the others run step()
        """
        if self._comm is not None:
            self._inner.average_without_gradients()

    def step_without_averaging(self):
        """Update with this rank's gradients as they are, averaging nothing (what
        ``hvd.broadcast_optimizer_state`` uses to create a new optimizer's state, as Horovod does).

        Returns:
            What the wrapped optimizer's ``step()`` returns.

        Example::

            >>> for p in model.parameters():
            ...     p.grad = torch.zeros_like(p)
            >>> optimizer.step_without_averaging()
        """
        return self._inner.wrapped.step() if self._comm is not None else self._inner.step()

    # ----------------------------------------------------------------------------- Horovod's interface
    @raises_horovods_errors
    def synchronize(self) -> None:
        """Finish averaging this step's gradients into ``.grad`` (sending them now if backward has not).

        Between ``synchronize()`` and ``step()`` the averaged gradients can be changed (clipped);
        then call ``step()`` inside :meth:`skip_synchronize`.

        Example::

            >>> loss.backward()
            >>> optimizer.synchronize()
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            >>> with optimizer.skip_synchronize():
            ...     optimizer.step()
        """
        self._user_synchronized = True
        self._synchronize()

    def _synchronize(self) -> None:
        if self._synchronized:
            return
        if self._comm is None:  # outside the optimizer's process set: nothing to average
            self._synchronized = True
            return
        if not self._sent_by_backward:
            self._start_sync()
        self._inner.synchronize()
        # Sparse gradients, in parameter order: every rank's rows gathered. A parameter once seen
        # sparse here takes part with no rows in a step that left it without a gradient here, so
        # that the ranks gather the same parameters.
        for p in [p for p in self._params if p in self._sparse_dims]:
            grad = self._sparse_grads.pop(p, None)
            if grad is None:
                dims = self._sparse_dims[p]
                grad = torch.sparse_coo_tensor(torch.empty((dims, 0), dtype=torch.int64),
                                               torch.empty((0,) + tuple(p.shape[dims:]), dtype=p.dtype), p.shape)
            handle = sparse_allreduce_async(grad, name=self._parameter_names.get(p), op=Average,
                                            process_set=self.process_set)
            p.grad = synchronize_handle(handle)
        # As Horovod's: every trainable parameter gets a gradient, zeros where no rank computed one
        # (a branch no rank took this step), so momentum and weight decay move it as they would.
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.op == Sum and self._comm.size > 1:
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(self._comm.size)
        for p, sparse_dim in self._densified.items():
            if p.grad is not None and p.grad.layout is torch.strided:
                p.grad = p.grad.to_sparse(sparse_dim)
        if self._sync_started is not None:
            nbytes = sum(p.numel() * p.element_size() for p in self._params)
            timeline.record("allreduce", "DistributedOptimizer.gradients", nbytes, self._sync_started, time.time(),
                            0 if self._comm is global_process_set.comm else -1)
        self._synchronized = True
        self._passes_since_sync = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside uses the gradients :meth:`synchronize` averaged, without a warning.

        Returns:
            A context manager.

        Example::

            >>> optimizer.synchronize()
            >>> with optimizer.skip_synchronize():
            ...     optimizer.step()
        """
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    @raises_horovods_errors
    def step(self, closure=None):
        """Update with the averaged gradients (averaging them first if needed).

        Args:
            closure: not supported (call backward, then ``step()``).

        Returns:
            What the wrapped optimizer's ``step()`` returns.

        Raises:
            UnsupportedError: a closure was passed.

        Example::

            >>> loss.backward()
            >>> optimizer.step()
        """
        if closure is not None:
            raise UnsupportedError("hvd.DistributedOptimizer.step(closure): closures are not supported by "
                                   "torchmn.horovod; call loss.backward(), then optimizer.step()")
        if self._user_synchronized and not self._skip_synchronize:
            warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        self._synchronize()
        result = self._inner.step(closure)
        self._passes_since_step = 0
        self._sent_by_backward = self._synchronized = self._user_synchronized = False
        self._sync_started = None
        return result

    @property
    def multi_node_optimizer(self):
        """The torchmn multi-node optimizer that averages for this one (None on a rank outside its
        process set): an elastic job's reset rebuilds it for the new world (:mod:`torchmn.elastic`).

        Example::

            >>> optimizer.multi_node_optimizer
            MultiNodeOptimizer(SGD (...), <FlatCommunicator rank 0/2 ...>)
        """
        return self._inner if self._comm is not None else None

    def forget_step(self) -> None:
        """Forget what the current step has done so far (its backward passes, its averaging): an
        elastic job's reset calls it, after a failure in the middle of a step.

        Example::

            >>> optimizer.forget_step()
        """
        self._in_pass = self._pass_syncs = False
        self._passes_since_step = self._passes_since_sync = 0
        self._sent_by_backward = self._synchronized = self._user_synchronized = False
        self._sync_started = None
        self._sparse_grads.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch's ``zero_grad``.

        Args:
            set_to_none: set ``.grad`` to None rather than zeroing it.

        Raises:
            ZeroGradBeforeStepError: (an ``AssertionError``, as Horovod's) a backward pass ran since the
                last ``step()`` or ``synchronize()``: its gradients are being averaged, and would be lost.

        Example::

            >>> optimizer.zero_grad()
        """
        if self._comm is not None and self._comm.size > 1 and self._passes_since_step and not self._synchronized:
            raise ZeroGradBeforeStepError(
                f"optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                f"optimizer.synchronize() (rank {self._comm.rank}): the gradients of "
                f"{self._passes_since_step} backward pass(es) are being averaged and would be thrown away. Call "
                f"zero_grad() before backward, or after step()")
        self._in_pass = False  # a backward that raised never ran its end-of-backward callback
        self._inner.zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally per averaging (Horovod's).

        Call it on every rank, between steps.

        Args:
            passes: backward passes per ``step()``, ``>= 1``.

        Raises:
            InvalidCallError: ``passes`` is not a positive integer (a ``ValueError``).

        Example::

            >>> optimizer.set_backward_passes_per_step(4)     # accumulate 4 micro-batches from now on
        """
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise InvalidCallError(f"set_backward_passes_per_step: passes must be a positive integer, not {passes!r}")
        self.backward_passes_per_step = passes
        if self._comm is not None:
            self._inner.backward_passes_per_step = passes

    @property
    def param_groups(self):
        """The wrapped optimizer's parameter groups (LR schedulers change them there).

        Returns:
            The list of groups, each a dict with ``"params"`` and the hyper-parameters.

        Example::

            >>> optimizer.param_groups[0]["lr"] = 0.01
        """
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._inner.param_groups = value

    @property
    def defaults(self):
        """The wrapped optimizer's defaults.

        Returns:
            The dict of hyper-parameters new groups start from.

        Example::

            >>> optimizer.defaults["lr"]
        """
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value):
        self._inner.defaults = value

    @property
    def state(self):
        """The wrapped optimizer's state.

        Returns:
            The dict from parameter to its state (momentum buffers, ...).

        Example::

            >>> optimizer.state[model.weight]
        """
        return self._inner.state

    @state.setter
    def state(self, value):
        self._inner.state = value

    def state_dict(self):
        """The wrapped optimizer's ``state_dict()`` (loads into a plain torch optimizer).

        Returns:
            The state dict.

        Example::

            >>> torch.save(optimizer.state_dict(), "optimizer.pt")
        """
        return self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load a ``state_dict()`` of this or a plain torch optimizer. As Horovod's, it ends the step
        under way: ``zero_grad()`` may follow a backward pass without ``step()``.

        Args:
            state_dict: what ``state_dict()`` returned.

        Example::

            >>> optimizer.load_state_dict(torch.load("optimizer.pt"))
        """
        if self._sent_by_backward and not self._synchronized:
            self._synchronize()  # the averaging every rank started at its backward: finished, not left in flight
        self.forget_step()
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        """Refused: the averaging is set up for the groups the optimizer had when it was wrapped.

        Args:
            param_group: the group.

        Raises:
            NotImplementedError: always (add groups to the torch optimizer before wrapping it).

        Example::

            >>> torch_opt.add_param_group({"params": head.parameters()})     # before hvd.DistributedOptimizer
        """
        self._inner.add_param_group(param_group)

    # torch's four state-dict hooks, on the optimizer that averages for this one (its state_dict() runs them).
    register_state_dict_pre_hook = _on_inner("register_state_dict_pre_hook")
    register_state_dict_post_hook = _on_inner("register_state_dict_post_hook")
    register_load_state_dict_pre_hook = _on_inner("register_load_state_dict_pre_hook")
    register_load_state_dict_post_hook = _on_inner("register_load_state_dict_post_hook")

    def register_step_pre_hook(self, hook):
        """Call ``hook(optimizer, args, kwargs)`` before each update.

        Args:
            hook: the function.

        Returns:
            A handle whose ``remove()`` unregisters it.

        Example::

            >>> handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: print("step"))
        """
        return self._inner.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        """Call ``hook(optimizer, args, kwargs)`` after each update.

        Args:
            hook: the function.

        Returns:
            A handle whose ``remove()`` unregisters it.

        Example::

            >>> handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: print("stepped"))
        """
        return self._inner.register_step_post_hook(hook)

    def __reduce_ex__(self, protocol):
        raise NotPicklableError("a hvd.DistributedOptimizer cannot be copied or pickled; save optimizer.state_dict()")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._inner!r})"


def _mirror_optimizer(description: tuple, comm) -> None:
    ref = _optimizers[description[2]] if description[2] < len(_optimizers) else None
    optimizer = ref() if ref is not None else None
    if optimizer is None:
        raise HorovodInternalError(f"rank {comm.rank} has joined and cannot take part in DistributedOptimizer "
                                   f"number {description[2]}'s averaging: this rank has no such optimizer (create "
                                   f"the same optimizers on every rank)")
    optimizer.mirror()


def _restart_step_counts() -> None:
    # After join(): the ranks that sat out the others' last steps took fewer; from here all train
    # alike again, and the check that every rank takes as many steps starts afresh.
    for ref in _optimizers:
        optimizer = ref()
        if optimizer is not None and optimizer._comm is not None:
            optimizer._inner.restart_step_count()


coordination.register_mirror("optimizer", _mirror_optimizer)
coordination.register_after_join(_restart_step_counts)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None,
                         sparse_as_dense=False, process_set=global_process_set):
    """Wrap a torch optimizer so that ``step()`` uses gradients averaged over the ranks (Horovod's).

    Gradients are averaged by :func:`torchmn.create_multi_node_optimizer` while backward runs.
    Parameters are broadcast from rank 0 here (Horovod scripts also call
    ``broadcast_parameters``; it does no harm). ``num_groups`` and ``groups`` are accepted:
    torchmn fuses gradients into buckets by size instead. ``gradient_predivide_factor`` gives
    the same average (torchmn divides once).

    Args:
        optimizer: any torch optimizer over the model's parameters.
        named_parameters: ``model.named_parameters()``, checked as Horovod checks it.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally per averaging.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: accepted with ``op=hvd.Average`` only.
        num_groups, groups: accepted (see above).
        sparse_as_dense: turn sparse gradients (``nn.Embedding(sparse=True)``) dense and average them
            with the others; without it they are averaged as Horovod does, by gathering every
            rank's rows (the parameter's gradient stays sparse for the update).
        process_set: the ranks that average together; a rank outside it updates alone.

    Returns:
        The wrapped optimizer, an instance of ``optimizer``'s class.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer (the parameters themselves, say).
        InvalidCallError: duplicate or missing ``named_parameters``; ``gradient_predivide_factor`` with
            ``op=hvd.Sum``; ``process_set`` not registered; before ``hvd.init()``.
        UnsupportedError: ``op=hvd.Adasum`` or another op; a custom compressor.
        TooManyBackwardPassesError: (in backward) more backward passes than ``backward_passes_per_step``
            before ``step()``.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
        >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TorchmnTypeError(f"hvd.DistributedOptimizer wraps a torch optimizer, not {type(optimizer).__name__}: "
                               f"build it first, e.g. hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), "
                               f"named_parameters=model.named_parameters())")
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(optimizer, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
               num_groups, groups, sparse_as_dense, process_set)
