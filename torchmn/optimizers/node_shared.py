"""The default multi-node optimizer where all ranks are on one node (CPU): the ranks share one copy
of the parameters and of the optimizer state, and split the update.

Data parallelism on one node can only beat one process if the update is split: every rank
updating the whole model with the same averaged gradients does the same work N times. So, as
with ``shard_state=True``, each rank updates one slice of every parameter (in memory the node's
ranks share, so nothing is gathered afterwards), but this optimizer keeps what a user of the
replicated one relies on:

- ``.grad`` holds the averaged gradient when ``backward()`` returns (each rank averages its slices
  and writes them into every rank's buffer), so ``torch.nn.utils.clip_grad_norm_``, unscaling and
  any other edit before ``step()`` reach the update;
- the optimizer state lives in shared memory too, so ``state_dict()`` is whole on any rank,
  called on that rank alone, and ``state[p]`` answers for every parameter.

How the slices, buffers and shared memory are laid out: :mod:`.shard_layout` and
:mod:`.node_memory`; the step: ``docs/design/sharded-optimizer.md``.
"""
from __future__ import annotations

import torch

from torchmn.communicators import Communicator
from torchmn.errors import TorchmnAttributeError, TorchmnError, TorchmnRuntimeError
from torchmn.monitor import recorder
from torchmn.optimizers import join as joining
from torchmn.optimizers import shard_state
from torchmn.optimizers.gradient_sync import GradientSyncOptimizer, describe_rank
from torchmn.optimizers.inner_optimizers import build_inner, step_function
from torchmn.optimizers.memory_order import shaped
from torchmn.optimizers.node_memory import ARENA_POINTS, arena_layout, place_buckets, region_view
from torchmn.optimizers.sharded import ShardedMultiNodeOptimizer


class NoNodeMemory(TorchmnError, RuntimeError):
    """The ranks cannot share memory here (several nodes, GPU, a small ``/dev/shm``): the caller
    takes the replicated optimizer instead."""


def elementwise_state(cls: type, group: dict, dtype: torch.dtype) -> dict:
    """The state entries ``cls`` keeps one value per element for, with the hyperparameters of
    ``group``: found by stepping a throwaway optimizer over a 2-element parameter.

    Args:
        cls: the optimizer class.
        group: a parameter group (its hyperparameters).
        dtype: the parameters' dtype.

    Returns:
        ``{name: dtype}``, e.g. ``{"exp_avg": torch.float32, "exp_avg_sq": torch.float32}`` for Adam.

    Example::

        >>> elementwise_state(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, torch.float32)
        {'momentum_buffer': torch.float32}
    """
    p = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    probe = build_inner(cls, [p], group)
    p.grad = torch.zeros_like(p)
    step_function(probe)()
    return {k: v.dtype for k, v in probe.state[p].items()
            if torch.is_tensor(v) and k not in shard_state.SCALAR_STATE and v.shape == p.shape}


class NodeSharedOptimizer(ShardedMultiNodeOptimizer):
    """What ``create_multi_node_optimizer(optimizer, comm)`` builds where every rank is on one node
    and the parameters are on the CPU: the update split over the ranks, with ``.grad`` averaged
    after backward and the whole state readable on any rank.

    It behaves like the replicated :class:`~torchmn.optimizers.MultiNodeOptimizer`, with these
    differences, which come from the parameters and the state living once per node, in shared memory:

    - the model's parameters are views into that memory: move or convert the model (``.to``,
      ``.double()``) before wrapping, and change parameters only through the optimizer or by
      loading the same values on every rank (``model.load_state_dict``); an in-place change that
      is not idempotent, made on every rank (``p.mul_(0.99)``), would be applied once per rank;
    - ``step()`` is collective on the node: every rank calls it the same number of times;
    - each rank updates its slice of every parameter from its own ``.grad``: edits between
      backward and ``step()`` must be the same on every rank (clipping and unscaling are);
    - ``state[p]`` is a fresh dict per access, whose per-element tensors are views into the shared
      state (scalars, like step counts, are this rank's);
    - ``state_dict()`` is taken between ``step()`` and the next backward (where scripts save);
      ``load_state_dict()`` on every rank.

    ``shard_state=False`` gives the replicated optimizer (every rank updates the whole model).

    Example::

        >>> opt = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
        >>> loss_fn(model(x), y).backward()
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # .grad holds the averages
        >>> opt.step()
        >>> if comm.rank == 0: torch.save(opt.state_dict(), "opt.pt")  # rank 0 alone
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, *, bucket_cap_mb=None,
                 backward_passes_per_step: int = 1):
        """Wrap ``optimizer``: broadcast the parameters from rank 0, put them, the per-element
        optimizer state and the gradient buffers in memory the node's ranks share, and hook the
        buckets to backward (collective; :func:`~torchmn.create_multi_node_optimizer` calls it
        where every rank is on one node with CPU parameters).

        Args:
            optimizer: an elementwise ``torch.optim.Optimizer`` to wrap (built on every rank).
            comm: the communicator.
            bucket_cap_mb: MB of gradients per bucket (None: the communicator's).
            backward_passes_per_step: backward passes accumulated locally per averaging.

        Raises:
            NoNodeMemory: the ranks cannot share memory (``/dev/shm`` too small, say); nothing
                is placed, and the caller builds the replicated optimizer instead.
            TypeError: ``optimizer`` is not a torch optimizer, or not an elementwise one.
            ValueError: ``backward_passes_per_step < 1``.
            CollectiveMismatchError: the ranks' models differ in layout.

        Example::

            >>> optimizer = NodeSharedOptimizer(torch.optim.Adam(model.parameters()), comm)
        """
        self._state_views = []  # per bucket: {name: (whole views, shard views)}, set in shared memory
        super().__init__(optimizer, comm, bucket_cap_mb=bucket_cap_mb,
                         backward_passes_per_step=backward_passes_per_step)
        self._home_state()  # optimizers that make state when built (Adagrad)

    def _place_in_shared_memory(self):
        """The parameters, then each bucket's per-element optimizer state, in the shared region;
        each rank's gradients in its own region.

        Raises:
            NoNodeMemory: the ranks cannot share memory.
        """
        buckets = self.buckets
        kinds = {}
        for b in buckets:
            key = (b.group, b.dtype)
            if key not in kinds:
                kinds[key] = elementwise_state(type(self.wrapped), self.wrapped.param_groups[b.group], b.dtype)
        states = [kinds[(b.group, b.dtype)] for b in buckets]
        itemsize = {d: torch.empty((), dtype=d).element_size() for s in states for d in s.values()}
        # The shared region: each bucket's parameters, then each bucket's state buffers, as
        # (bucket, element size) in the region's order.
        laid_out = [(b, b.itemsize) for b in buckets] + [(b, itemsize[d]) for b, s in zip(buckets, states)
                                                         for d in s.values()]
        shared_offsets, shared_total = arena_layout([b.padded * size for b, size in laid_out])
        region_offsets, region_total = arena_layout([b.region_numel * b.itemsize for b in buckets])
        # This rank's slices of the parameters and of the state, which its updates write: reserved
        # by this rank, so that their pages are on its NUMA domain.
        owned = [(at + (off + b.rank * k) * size, k * size)
                 for at, (b, size) in zip(shared_offsets, laid_out) for off, k in zip(b.offsets, b.ks)]
        arena = self.comm.open_node_arena(shared_bytes=shared_total, region_bytes=region_total,
                                          points=ARENA_POINTS, owned_shared=owned)
        if arena is None:  # before anything is placed: the caller builds the replicated optimizer
            raise NoNodeMemory("the ranks cannot share memory")
        place_buckets(arena, buckets, shared_offsets, region_offsets, self.comm.rank)
        at = iter(shared_offsets[len(buckets):])
        for b, state in zip(buckets, states):
            views = {}
            for name, dtype in state.items():
                flat = region_view(arena.shared, next(at), b.padded, dtype)
                whole = [shaped(flat[off:off + p.numel()], p) for p, off in zip(b.params, b.offsets)]
                mine = [flat[off + b.rank * k:off + (b.rank + 1) * k] for off, k in zip(b.offsets, b.ks)]
                views[name] = (whole, mine)
            self._state_views.append(views)
        arena.barrier("set-up")
        return arena

    def _home_state(self) -> None:
        """Move the shard optimizers' per-element state into shared memory, where it is not yet
        (torch's optimizers make it at their first step, and loading a state dict replaces it)."""
        for b, views in zip(self.buckets, self._state_views):
            state = b.optimizer.state
            for i, sp in enumerate(b.shard_params):
                s = state.get(sp)
                if not s:
                    continue
                for name, (_, mine) in views.items():
                    t = s.get(name)
                    if t is not None and t is not mine[i] and t.shape == mine[i].shape:
                        with torch.no_grad():
                            mine[i].copy_(t)
                        s[name] = mine[i]

    # ----------------------------------------------------------------------------- backward
    def _all_sent(self) -> None:
        # Every rank's gradients are in its buffer; each averages its slices into every buffer.
        self.arena.barrier("backward done (gradients in)")
        scale = 1.0 / self.contributors  # every rank, or inside torchmn.join those with data
        for i, b in enumerate(self.buckets):
            t0 = recorder.now() if recorder.timeline_on else None
            b.node.average_for_all(scale)
            if t0 is not None:  # this rank's slices of the bucket, averaged into every rank's buffer
                recorder.event(f"bucket {i}", "average", t0, recorder.now(), {"path": "shared memory"},
                               thread="averaging")
        self.arena.barrier("averaged gradients ready")
        for b in self.buckets:
            b.node.point_grads_at_averages()
            b.packed = None  # so that zero_grad() frees the gradients backward made

    # ----------------------------------------------------------------------------- public
    def step(self, closure=None):
        """Update this rank's slice of every parameter with its ``.grad``; every rank's model sees
        the whole update when it returns. Collective on the node.

        Args:
            closure: not supported (multi-node optimizers need backward before ``step()``).

        Returns:
            None, always (no closure, so no loss to return).

        Raises:
            ValueError: a closure was passed.
            RuntimeError: the last backward raised, or parameters were added or unfrozen since wrapping.
            CollectiveMismatchError: ranks are at different steps (one skipped ``step()``).

        Example::

            >>> loss_fn(model(x), y).backward(); optimizer.step()
        """
        self.check_step(closure, "each rank of the node updates its slice of the parameters")
        self.synchronize()
        joining.share_edited_gradients(self)
        return self.run_as_wrapped_step(self._update)

    def _update(self) -> None:
        t0 = recorder.now() if recorder.on else None
        self.sync_hyperparameters()
        for b in self.buckets:
            b.node.take_averages()
        for buckets in self.shard_groups.values():
            buckets[0].step_shard()
        self._home_state()
        if t0 is not None:
            recorder.event("update", "update", t0, recorder.now(), {"shard": "this rank's slices"})
        # Every slice is updated in the shared parameters, and nobody reads another rank's
        # gradient buffer any more, so backward may write them again.
        with recorder.waiting("wait for the node's update", "average"):
            self.arena.barrier("step done (shards updated)")
        self._sent = False
        self._sends = 0
        if t0 is not None:
            recorder.step_ended(recorder.now())

    # Its update runs as the wrapped optimizer's step (run_as_wrapped_step), whose hooks see the
    # whole model updated: registered there, as by the replicated optimizer.
    register_step_pre_hook = GradientSyncOptimizer.register_step_pre_hook
    register_step_post_hook = GradientSyncOptimizer.register_step_post_hook

    # Every rank holds the whole averaged gradient, as the replicated optimizer does: no communication.
    clip_grad_norm_ = GradientSyncOptimizer.clip_grad_norm_

    def _entries(self, copy: bool) -> dict:
        """``{parameter: its whole state}``: per-element entries from shared memory, the rest
        (step counts) from this rank's shard, which has the same."""
        entries = {}
        for b, views in zip(self.buckets, self._state_views):
            state = b.optimizer.state
            for i, (p, sp) in enumerate(zip(b.params, b.shard_params)):
                s = state.get(sp)
                if not s:
                    continue
                entry = {}
                for name, value in s.items():
                    if name in views and value is views[name][1][i]:
                        value = views[name][0][i]
                    elif torch.is_tensor(value) and name not in shard_state.SCALAR_STATE:
                        raise TorchmnRuntimeError(
                            f"{describe_rank(self.comm)}: the optimizer state {name!r} of a parameter of shape "
                            f"{tuple(p.shape)} is not in the memory the node's ranks share (a hyperparameter "
                            f"changed since wrapping, which made new state), so this rank cannot read the "
                            f"other ranks' parts of it. Set such hyperparameters before wrapping, or wrap "
                            f"with shard_state=False")
                    entry[name] = value.clone() if copy and torch.is_tensor(value) else value
                entries[p] = entry
        return entries

    def whole_state_dict(self) -> dict:
        """The whole optimizer state, in the wrapped optimizer's format, on any rank alone
        (``state_dict()`` gives it through the state-dict hooks).

        No communication: the state lives in memory the node's ranks share. Take it between
        ``step()`` and the next backward, as scripts do to save it.

        Returns:
            ``{"state": ..., "param_groups": ...}`` as ``torch.optim.Optimizer.state_dict()``;
            it loads into the plain torch optimizer, or with any rank count.

        Raises:
            RuntimeError: a per-element state entry is not in shared memory (a hyperparameter
                changed since wrapping made new state).

        Example::

            >>> if comm.rank == 0:
            ...     torch.save({"model": model.state_dict(), "opt": optimizer.state_dict()}, path)
        """
        groups = self.wrapped.param_groups
        index = shard_state.indices(groups)
        state = {index[p]: entry for p, entry in self._entries(copy=True).items()}
        return shard_state.torch_format(groups, state, index)

    def load_whole_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (from :meth:`state_dict`, any rank count, or a plain torch
        optimizer), on every rank: each writes its slice into the shared state, and waits for the
        node's other ranks to have written theirs (collective on the node).

        Args:
            state_dict: a whole state, from any rank count.

        Raises:
            ValueError: it does not fit the parameters (other groups, or entries of other sizes).

        Example::

            >>> optimizer.load_whole_state_dict(torch.load(path)["opt"])   # without the hooks
        """
        super().load_whole_state_dict(state_dict)
        self._home_state()
        # Each rank wrote its slices of the shared state: none reads the whole (state_dict(), the
        # next step) before every rank has.
        self.arena.barrier("state loaded")

    @property
    def state(self) -> dict:
        """The whole state of every parameter that has one.

        Returns:
            A fresh ``{parameter: {name: value}}``; per-element tensors are views into the shared
            state, so they show every rank's updates.
        """
        return self._entries(copy=False)

    @state.setter
    def state(self, value):
        raise TorchmnAttributeError("the optimizer state lives in memory the node's ranks share: use load_state_dict()")
