"""What an elastic job's ranks keep, commit and hand to each other: :class:`State`."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Iterable, List, Optional

import torch

from torchmn.elastic import membership
from torchmn.elastic.errors import HostsUpdatedInterrupt, StateLostError
from torchmn.errors import TorchmnRuntimeError, TorchmnTypeError, TorchmnValueError
from torchmn.optimizers import shard_state
from torchmn.optimizers.gradient_sync import GradientSyncOptimizer
from torchmn.optimizers.node_shared import NodeSharedOptimizer
from torchmn.optimizers.sharded import ShardedMultiNodeOptimizer

_BUDDY_TAG = 7301  # the point-to-point tag of the commit's part exchange


class State:
    """The training state of an elastic job: a model, an optimizer and any values (epoch, batch,
    ...), committed in memory and handed to the ranks of each new world.

    ``commit()`` keeps a copy of it in memory (on every rank) and asks whether ranks joined or left;
    when a rank dies, the survivors go back to their last commit, and a new rank gets rank 0's.
    Values are attributes (``state.epoch``), given when the state is built (one first set later is
    in no commit, which a warning says); a commit holds what they are at that moment.

    The committed optimizer state is whole on every rank, so any one survivor can hand it on; but
    a sharded one (``shard_state=True``) keeps each rank's part, and a copy of its neighbour's
    (rank r keeps rank r-1's), so that losing one rank loses nothing and a commit costs two parts,
    not the whole. Each rank also keeps its parts of the commit before, since a rank lost during a
    commit's exchange can leave some ranks with the new commit's parts and others without: the
    reset puts the state together from the newest commit whose every part is left, never from parts
    of two. Two neighbouring ranks lost at once lose a part: the reset then raises
    :class:`~torchmn.elastic.StateLostError` naming them (start again from a checkpoint).

    Args:
        model: a ``torch.nn.Module`` (its ``state_dict``: parameters and buffers), or None.
        optimizer: a multi-node optimizer (``create_multi_node_optimizer``'s), a plain torch
            optimizer, or None.
        **values: anything picklable; each becomes an attribute. A value with ``state_dict()`` and
            ``load_state_dict()`` (an :class:`~torchmn.elastic.ElasticSampler`, an LR scheduler) is
            kept through them, and stays the same object.

    Raises:
        TypeError: ``model`` is not a module, or ``optimizer`` not an optimizer.
        ValueError: a value is named as one of the State's own attributes (``commit``, ``sync``, ``comm``, ...).

    Example::

        >>> state = torchmn.elastic.State(model=model, optimizer=optimizer, epoch=0, batch=0)
        >>> @torchmn.elastic.run
        ... def train(state):
        ...     for state.epoch in range(state.epoch, epochs):
        ...         for state.batch in range(state.batch, steps):
        ...             step(...)
        ...             if state.batch % 10 == 0:
        ...                 state.commit()
        ...         state.batch = 0
        >>> train(state)
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **values: Any):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TorchmnTypeError(f"State(model=...) takes a torch.nn.Module, not {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TorchmnTypeError(f"State(optimizer=...) takes a torch optimizer, not {type(optimizer).__name__}")
        clash = sorted(name for name in values if name.startswith("_") or hasattr(type(self), name))
        if clash:
            raise TorchmnValueError(f"State: the value name(s) {', '.join(map(repr, clash))} are the State's own "
                                    f"(its methods, or private); name the value(s) otherwise, e.g. "
                                    f"{clash[0].strip('_')}_value=...")
        self.model = model
        self.optimizer = optimizer
        self._names = list(values)
        for name, value in values.items():
            setattr(self, name, value)
        self._saved: Optional[dict] = None
        self._previous: Optional[dict] = None  # a sharded optimizer's commit before the last
        self._callbacks: List[Callable[[], None]] = []

    def __setattr__(self, name: str, value: Any) -> None:
        names = self.__dict__.get("_names")
        if names is not None and name not in names and name not in self.__dict__ and not name.startswith("_"):
            # Commits keep the values the state was built with: this one a reset would not bring back.
            warnings.warn(f"torchmn.elastic.State: {name!r} was not among the values the state was built with, so no "
                          f"commit keeps it and a reset will not bring it back; give it when building the state: "
                          f"State(..., {name}=...)", UserWarning, stacklevel=2)
        object.__setattr__(self, name, value)

    # -- callbacks ---------------------------------------------------------------------------------

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions to call after each reset, once the new world is set up and the state synchronised
        (so what they set is not undone by the commit the sync goes back to): to scale the learning
        rate with ``comm.size``, say. Every rank of the new world calls them, ranks that joined it
        too, each on the same commit.

        Args:
            callbacks: functions of no arguments, called in order.

        Example::

            >>> state.register_reset_callbacks([lambda: set_lr(base_lr * comm.size)])
        """
        if callable(callbacks):
            raise TorchmnTypeError("register_reset_callbacks takes a list of functions, not one function: "
                                   "state.register_reset_callbacks([on_reset])")
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Call the reset callbacks (:func:`torchmn.elastic.run` does, after each reset).

        Example::

            >>> state.on_reset()
        """
        for callback in self._callbacks:
            callback()

    # -- the communicator and optimizers the state reaches -----------------------------------------

    @property
    def comm(self):
        """The communicator the state is synchronised over: its optimizer's, else the first one the
        script made (None in a world of one without a communicator)."""
        comm = getattr(_unwrapped(self.optimizer), "comm", None)
        if comm is None:
            made = membership.communicators()
            comm = made[0] if made else None
        return comm

    def _sharded(self) -> Optional[ShardedMultiNodeOptimizer]:
        """The ZeRO optimizer (``shard_state=True``) this state holds, whose ranks each keep a part."""
        inner = _unwrapped(self.optimizer)
        if isinstance(inner, ShardedMultiNodeOptimizer) and not isinstance(inner, NodeSharedOptimizer):
            return inner
        return None

    def multi_node_optimizers(self) -> List[GradientSyncOptimizer]:
        """The multi-node optimizers this state holds, which a reset rebuilds for the new world.

        Returns:
            The optimizers (the one ``torchmn.horovod``'s ``DistributedOptimizer`` wraps, for it).

        Example::

            >>> state.multi_node_optimizers()
            [NodeSharedOptimizer(Adam (...), <HierarchicalCommunicator rank 0/2 ...>)]
        """
        inner = [_unwrapped(value) for value in [self.optimizer] + [getattr(self, n) for n in self._names]]
        return [value for value in inner if isinstance(value, GradientSyncOptimizer)]

    # -- commit, restore, sync ---------------------------------------------------------------------

    def save(self) -> None:
        """Keep a copy of the state in memory (collective for a sharded optimizer, whose ranks each
        keep their part and their neighbour's). ``commit()`` does this, then looks for new or lost ranks.

        Example::

            >>> state.save()
        """
        # Commits are numbered alike on every rank (they commit together; a reset hands the number on).
        saved = {"number": (self._saved["number"] + 1) if self._saved is not None else 1,
                 "values": copy.deepcopy({n: _saved_value(getattr(self, n)) for n in self._names})}
        if self.model is not None:
            saved["model"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        sharded = self._sharded()
        if sharded is not None:
            saved["optimizer_parts"] = _own_and_buddy_parts(sharded)
            # Only now that this rank has its parts of the new commit: a rank lost during the
            # exchange may have left others without theirs, and then the reset needs this one.
            self._previous = self._saved
        elif self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        self._saved = saved

    def restore(self) -> None:
        """Go back to the last saved state (in place: the model and optimizer objects stay).

        Raises:
            RuntimeError: nothing was saved yet, or the state holds a sharded optimizer (whose commit
                only ``sync()``, on every rank, puts together).

        Example::

            >>> state.restore()
        """
        if self._saved is None:
            raise TorchmnRuntimeError("State.restore(): nothing was committed yet; call commit() (or sync()) first")
        saved = self._saved
        if "optimizer_parts" in saved:
            raise TorchmnRuntimeError("State.restore(): the sharded optimizer's commit is spread over the ranks (each "
                                      "holds its part and a neighbour's); call sync() on every rank instead, which "
                                      "puts it together")
        if self.model is not None:
            with torch.no_grad():
                self.model.load_state_dict(saved["model"])
        if "optimizer" in saved:
            self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        for name, value in copy.deepcopy(saved["values"]).items():
            current = getattr(self, name, None)
            if _has_state(current):
                current.load_state_dict(value)  # the object stays (a loader holds the sampler)
            else:
                setattr(self, name, value)

    def sync(self) -> None:
        """Give every rank rank 0's committed state (collective): at the start of
        :func:`torchmn.elastic.run` and after each reset, so that ranks that joined start where the
        others are.

        In the job's first world every rank first commits what it holds (rank 0's wins); a rank
        that joined later receives it from rank 0, over the network.

        Raises:
            StateLostError: no rank of the new world holds a commit (all that did were lost).

        Example::

            >>> state.sync()
        """
        comm = self.comm
        if self._saved is None and first_world():
            self.save()  # every rank is new here: each commits (collectively, where the optimizer needs it)
        sharded, whole = self._sharded(), None
        if sharded is not None:
            # Each rank held its own part and its neighbour's (one that joined holds none): together
            # they make the whole, which every rank then has, so the broadcast below leaves it out.
            # The commit is the newest one whose every part is left; a rank that does not hold it
            # takes it from one that does.
            commits = [c for c in (self._saved, self._previous) if c]
            number, whole = _whole_from_parts(sharded, comm, commits)
            chosen = next((c for c in commits if c["number"] == number), None)
            self._saved = {k: v for k, v in chosen.items() if k != "optimizer_parts"} if chosen else None
            self._previous = None
        if comm is not None and comm.size > 1:
            # The first rank that holds a commit hands it on: rank 0 unless every rank that held
            # one was lost while new ones waited.
            holders = comm.allreduce(torch.tensor([comm.rank if self._saved is not None else comm.size]), op="min")
            root = int(holders.item())
            if root == comm.size:
                raise StateLostError(f"rank {comm.rank}/{comm.size}: none of this world's ranks holds the committed "
                                     f"state (every rank that did was lost while these waited to join); start the "
                                     f"job again from the newest checkpoint")
            self._saved = comm.bcast_obj(self._saved if comm.rank == root else None, root=root)
        if whole is not None:
            self._saved["optimizer"] = whole
        self.restore()

    def commit(self) -> None:
        """Save the state in memory, then raise :class:`HostsUpdatedInterrupt` on every rank at once
        if ranks joined or left meanwhile (collective). Call it every few steps, on every rank at
        the same step: a rank that dies costs the steps since the last commit, and a new rank
        waits for the next one to join.

        Raises:
            HostsUpdatedInterrupt: the ranks are to move to a new world (``torchmn.elastic.run``
                does that, and goes on from this commit).

        Example::

            >>> if state.batch % 10 == 0:
            ...     state.commit()
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank at once if the launcher has announced a
        new world (ranks joined or left) (collective; one small allreduce). Outside an elastic job
        it does nothing.

        Raises:
            HostsUpdatedInterrupt: ranks joined or left.

        Example::

            >>> state.check_host_updates()
        """
        if not membership.enabled():
            return
        newer = membership.newer_generation()
        comm = self.comm
        if comm is not None and comm.size > 1:
            # Every rank leaves at the same commit: one that read the news sooner takes the others along.
            newer = bool(comm.allreduce(torch.tensor([int(newer)]), op="max").item())
        if comm is None or comm.rank == 0:
            membership.note_commit()  # every rank got here: this generation makes progress
        if newer:
            raise HostsUpdatedInterrupt("ranks joined or left the job: moving to the new world")


def first_world() -> bool:
    """Whether this rank's world is the job's first (every rank of it new), or the job is not elastic.

    Returns:
        True before any rank came or went.

    Example::

        >>> first_world()      # before any rank came or went
        True
    """
    return not membership.enabled() or membership.generation() in (None, 0)


def _unwrapped(value: Any) -> Any:
    """The multi-node optimizer ``value`` averages through (torchmn.horovod's wraps one), else ``value``."""
    return getattr(value, "multi_node_optimizer", value)


def _has_state(value: Any) -> bool:
    return (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
            and not isinstance(value, type))


def _saved_value(value: Any) -> Any:
    return value.state_dict() if _has_state(value) else value


def _own_and_buddy_parts(optimizer: ShardedMultiNodeOptimizer) -> dict:
    """This rank's part of a sharded optimizer's state and a copy of the part of the rank before it
    (collective: a ring of point-to-point messages, even ranks sending first)."""
    comm = optimizer.comm
    part = copy.deepcopy(optimizer.local_state_dict())
    parts = {comm.rank: part}
    if comm.size > 1:
        after, before = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        if comm.rank % 2 == 0:
            comm.send_obj(part, after, tag=_BUDDY_TAG)
            parts[before] = comm.recv_obj(before, tag=_BUDDY_TAG)
        else:
            parts[before] = comm.recv_obj(before, tag=_BUDDY_TAG)
            comm.send_obj(part, after, tag=_BUDDY_TAG)
    return {"size": comm.size, "parts": parts}


def _whole_from_parts(optimizer: ShardedMultiNodeOptimizer, comm, commits: list) -> tuple:
    """The newest commit whose every part of a sharded optimizer's state some rank holds, and that
    state put together (collective: every rank calls it with the commits it holds, its last and the
    one before; one that joined holds none).

    Returns:
        ``(number, whole state)``; the state is None where the commit is one a reset handed on, which
        its holders keep whole; ``(None, None)`` where no rank holds a commit.

    Raises:
        StateLostError: a part of every commit held is on no rank of this world (two neighbours lost).
    """
    # A commit a reset handed on is held whole (its "optimizer"), by every rank of that world: None here.
    held = {c["number"]: c.get("optimizer_parts") for c in commits}
    everyone = comm.allgather_obj(held) if comm is not None and comm.size > 1 else [held]
    found: dict = {}  # commit number -> (its world's size, {rank: part}), or None where held whole
    for h in everyone:
        for number, kept in h.items():
            if kept is None or found.get(number, ()) is None:
                found[number] = None
            else:
                found.setdefault(number, (kept["size"], {}))[1].update(kept["parts"])
    if not found:
        return None, None
    whole = [n for n, f in found.items() if f is None or all(r in f[1] for r in range(f[0]))]
    if whole:
        number = max(whole)
        if found[number] is None:  # the holders' own commit carries it
            return number, None
        size, parts = found[number]
        return number, shard_state.merge_parts([parts[r] for r in range(size)], optimizer.wrapped.param_groups)
    size, parts = found[max(found)]
    missing = [r for r in range(size) if r not in parts]
    raise StateLostError(
        f"rank {comm.rank if comm is not None else 0}: the sharded optimizer's state of the last commit is "
        f"lost: the part of rank(s) {', '.join(map(str, missing))} of the {size}-rank world, kept there and "
        f"on rank(s) {', '.join(str((r + 1) % size) for r in missing)} (the copies), is on no rank left (both "
        f"were lost together). Start the job again from the newest complete checkpoint.")
