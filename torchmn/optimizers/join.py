"""Uneven data without hangs: ``with torchmn.join(comm):`` (DDP's Join, for the multi-node optimizers).

Without it, a rank that runs out of batches first stops making the collectives that the others'
gradient averaging waits for, and the job fails (a timeout, or a peer that exited). Inside the
context a rank whose loop has ended keeps answering the others' averaging with zero gradients,
and applies the same update, until every rank's loop has ended.

The protocol (``docs/design/join.md`` has the whole of it):

- Each averaging of a multi-node optimizer's gradients (the first bucket a backward sends, or
  ``synchronize()``/``step()`` when backward sent none) begins with an exchange: every rank says
  which optimizer it is averaging (its number among the optimizers built on this communicator,
  in creation order), or that its loop has ended. One small ``allgather_obj``, call-checked.
- The ranks that still have data learn how many they are, ``n``, and average over them: each
  gradient is divided by ``n``, not by the communicator's size.
- A rank whose loop has ended waits in ``__exit__``, making that exchange. While some rank still
  has data, it repeats that optimizer's step: its gradients are None (zeros, and "this rank has no
  gradient" in the flags), the buckets go out in the same order, ``step()`` makes the same
  collectives and applies the same averaged update, so the replicas stay equal. When no rank has
  data, every rank leaves the context after that same exchange.

Outside the context nothing changes: the exchange happens only inside it.
"""
from __future__ import annotations

import socket
import weakref
from typing import Optional

from torchmn.communicators.errors import CollectiveMismatchError
from torchmn.errors import TorchmnError

ENDED = -1  # what a rank whose loop has ended says in the exchange (an optimizer's number otherwise)
# Where the ranks with data skipped a step() after an averaging that ranks out of data repeat.
SKIPPED_STEP = ("rank(s) {} with data did not call step() after an averaging inside torchmn.join, while the ranks "
                "whose data has run out repeat each averaging together with its step(). Inside the context call "
                "step() after every backward that averages; to leave a batch out (GradScaler's overflow, a "
                "non-finite norm), skip it before its backward, on every rank with data")

# Per communicator: its multi-node optimizers by number, and the join context open on it. Weak, so
# that neither keeps a communicator or an optimizer alive.
_numbers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # comm -> {optimizer: number}
_by_number: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # comm -> {number: weakref}
_open: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()       # comm -> Join


class JoinError(TorchmnError, RuntimeError):
    """Something ``torchmn.join`` cannot repeat on a rank whose data has run out; the message says
    what, and what to do instead."""


def register(optimizer) -> None:
    """Number a multi-node optimizer among those built on its communicator (called when it is built).

    Optimizers are built by every rank in the same order (building one is collective), so the
    numbers are the same on every rank, and a rank whose loop has ended finds the optimizer the
    others are stepping by its number.

    Args:
        optimizer: a multi-node optimizer (``optimizer.comm`` is its communicator).

    Example::

        >>> register(optimizer)      # GradientSyncOptimizer.__init__ does this
    """
    numbers = _numbers.setdefault(optimizer.comm, weakref.WeakKeyDictionary())
    by_number = _by_number.setdefault(optimizer.comm, {})
    number = len(by_number)
    numbers[optimizer] = number
    by_number[number] = weakref.ref(optimizer)


def forget(comm) -> None:
    """Forget the optimizers numbered on ``comm``: its world broke up, and those rebuilt for the new
    world (every rank building them in the same order again) are numbered from 0, as on a rank that
    joined the new world fresh.

    Args:
        comm: the communicator.

    Example::

        >>> forget(comm)         # torchmn.elastic does this at a reset
    """
    _numbers.pop(comm, None)
    _by_number.pop(comm, None)


def contributors(optimizer) -> int:
    """How many ranks' gradients this step's average of ``optimizer`` is over.

    Called where an averaging begins (before its first bucket goes out). Outside ``torchmn.join``
    it is the communicator's size, with no communication; inside, the ranks exchange who still has
    data, and it is their number.

    Args:
        optimizer: the multi-node optimizer whose averaging begins.

    Returns:
        The divisor of this step's average.

    Raises:
        CollectiveMismatchError: (inside ``torchmn.join``) the ranks with data began averaging
            different optimizers.
        JoinError: (inside ``torchmn.join``) the optimizer cannot be averaged there (double buffering).

    Example::

        >>> contributors(optimizer)        # 2 ranks, neither out of data
        2
    """
    join = _open.get(optimizer.comm) if _open else None
    return optimizer.comm.size if join is None else join.agree(optimizer)


def share_edited_gradients(optimizer) -> None:
    """Inside ``torchmn.join``, while ranks out of data repeat a step: give them the gradients the
    ranks with data hold at ``step()``, so that clipping or other edits made between backward and
    ``step()`` (which a repeating rank cannot know to make) reach its update too, and the replicas
    stay equal. Collective, at the start of ``step()`` on every rank alike; outside the context, or
    while every rank has data, nothing happens.

    Args:
        optimizer: the multi-node optimizer whose ``step()`` begins (its gradients are averaged).

    Example::

        >>> share_edited_gradients(self)     # the replicated and node-shared optimizers' step() do this
    """
    join = _open.get(optimizer.comm) if _open else None
    if join is None or optimizer.contributors == optimizer.comm.size:
        return
    grads = [p.grad for group in optimizer.wrapped.param_groups for p in group["params"]
             if p.requires_grad and p.grad is not None]
    # The ranks with data hold bit-identical averages, edited alike: a sum and a sum of squares tell
    # whether a repeating rank's differ, without moving them where nothing was edited.
    mine = sum(float(g.double().sum()) + float(g.double().pow(2).sum()) for g in grads)
    said = optimizer.comm.allgather_obj((join._repeating is not None, mine))
    skipped = [r for r, word in enumerate(said) if not isinstance(word, tuple)]
    if skipped:  # they went on to their next exchange (the next averaging, or the context's end)
        raise JoinError(f"rank {optimizer.comm.rank} on {socket.gethostname()}: {SKIPPED_STEP.format(skipped)}")
    source = next(r for r, (repeating, _) in enumerate(said) if not repeating)
    if any(total != said[source][1] for _, total in said):
        optimizer.comm.bcast_tensors(grads, root=source)


def refuse_inside(optimizer, what: str, fix: str) -> None:
    """Raise where ``optimizer`` is inside ``torchmn.join`` and is asked for a collective that a
    rank whose data has run out cannot know to repeat.

    Args:
        optimizer: the multi-node optimizer.
        what: the call refused, for the message.
        fix: what to do instead.

    Raises:
        JoinError: a ``torchmn.join`` context is open on the optimizer's communicator.

    Example::

        >>> refuse_inside(optimizer, "optimizer.clip_grad_norm_ with shard_state=True", "use shard_state=False")
    """
    if _open and optimizer.comm in _open:
        raise JoinError(f"rank {optimizer.comm.rank} on {socket.gethostname()}: {what} inside torchmn.join: it is a "
                        f"collective of its own, which a rank whose data has run out cannot know to repeat. {fix}")


class Join:
    """The context :func:`join` returns; see there.

    Attributes:
        comm: the communicator.
        steps_repeated: how many optimizer steps this rank repeated with zero gradients after its
            loop ended (0 on the ranks with the most data), once the context is left.

    Example::

        >>> with torchmn.join(comm) as joined:
        ...     train(my_batches)
        >>> joined.steps_repeated                # rank 0 had 7 batches, rank 1 had 10
        3
    """

    def __init__(self, comm):
        """A context for ``comm``, not yet entered (:func:`join` makes it; no communication).

        Args:
            comm: the communicator the multi-node optimizers were built on.

        Example::

            >>> joined = Join(comm)          # what torchmn.join(comm) returns
        """
        self.comm = comm
        self.steps_repeated = 0
        self._repeating: Optional[tuple] = None  # (optimizer, ranks with data) while this rank repeats a step

    def __enter__(self) -> "Join":
        """Open the context on its communicator: from now on each averaging begins with the exchange.

        Returns:
            This context, for ``with torchmn.join(comm) as joined:``.

        Raises:
            JoinError: a context is open on this communicator already (one covers the whole loop).

        Example::

            >>> with torchmn.join(comm) as joined:
            ...     train(my_batches)
        """
        if self.comm in _open:
            raise JoinError(f"rank {self.comm.rank} on {socket.gethostname()}: torchmn.join is already open on "
                            f"this communicator; one context covers the whole loop")
        _open[self.comm] = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Where the loop ended normally, repeat the other ranks' steps with zero gradients until
        every rank's loop has ended (collective); then close the context.

        :attr:`steps_repeated` counts the steps repeated. Where the loop raised, nothing is
        repeated: the context closes and the exception goes on.

        Args:
            exc_type: the type of the exception the loop raised, or None.
            exc: the exception, or None.
            tb: its traceback, or None.

        Returns:
            False: an exception from the loop is never swallowed (the other ranks then fail on
            their own).

        Raises:
            CollectiveMismatchError: the ranks with data average different optimizers at one
                step, or another rank made another collective where the exchange was.
            JoinError: an optimizer the others average cannot be repeated (double buffering, or
                this rank no longer has it).

        Example::

            >>> with torchmn.join(comm) as joined:     # __exit__ runs at the end of the block
            ...     train(my_batches)
            >>> joined.steps_repeated
            3
        """
        try:
            if exc_type is None:
                self._repeat_until_all_ended()
        finally:
            _open.pop(self.comm, None)
        return False  # an exception from the loop goes on (the other ranks then fail on their own)

    # ----------------------------------------------------------------------------- ranks with data
    def agree(self, optimizer) -> int:
        """The exchange at the start of an averaging: how many ranks still have data.

        Args:
            optimizer: the optimizer whose averaging begins.

        Returns:
            The ranks with data (this one included).

        Raises:
            CollectiveMismatchError: the ranks with data average different optimizers, or another
                rank made another collective here.
            JoinError: the optimizer cannot be averaged inside torchmn.join (double buffering).

        Example::

            >>> joined.agree(optimizer)      # 3 of 4 ranks still have data
            3
        """
        if self._repeating is not None:  # this rank is repeating the others' step: exchanged already
            repeated, count = self._repeating
            if optimizer is not repeated:
                raise JoinError(f"rank {self.comm.rank} on {socket.gethostname()}: a second optimizer began "
                                f"averaging while this rank repeated another's step inside torchmn.join; step "
                                f"one optimizer at a time")
            return count
        if self.comm.size == 1:
            self._check_can_average(optimizer)  # refused alike in a world of one
            return 1
        count, _ = self._decide(self._exchange(_numbers[self.comm][optimizer]))
        return count

    # ----------------------------------------------------------------------------- ranks without
    def _repeat_until_all_ended(self) -> None:
        """This rank's loop has ended: answer the others' averaging until every rank's has."""
        if self.comm.size == 1:
            return
        while True:
            count, optimizer = self._decide(self._exchange(ENDED))
            if count == 0:
                return
            self._repeat_step(optimizer, count)
            self.steps_repeated += 1

    def _repeat_step(self, optimizer, count: int) -> None:
        """One step of ``optimizer`` with no gradients of this rank's: the same collectives as the
        ranks with data make, and the same update."""
        optimizer.zero_grad()
        # zero_fill=False checks that the ranks with data have the same gradients; this rank has
        # none on purpose, and must still take the average (as zero_fill=True does).
        zero_fill = getattr(optimizer, "zero_fill", True)
        self._repeating = (optimizer, count)
        try:
            if not zero_fill:
                optimizer.zero_fill = True
            optimizer.step()
        finally:
            self._repeating = None
            if not zero_fill:
                optimizer.zero_fill = False

    # ----------------------------------------------------------------------------- both
    def _exchange(self, mine: int) -> list:
        """Every rank's word: the number of the optimizer it averages, or ENDED."""
        try:
            said = self.comm.allgather_obj(mine)
        except CollectiveMismatchError as e:
            where = "its loop has ended" if mine == ENDED else f"it begins averaging optimizer #{mine}"
            raise CollectiveMismatchError(
                f"{e}. (rank {self.comm.rank} on {socket.gethostname()}: {where}; its allgather_obj is "
                f"torchmn.join's exchange, made where each averaging begins. Inside the context only the "
                f"optimizers' averaging and step() are repeated for the ranks whose loops have ended: make other "
                f"collectives after it)") from e
        waiting = [r for r, word in enumerate(said) if isinstance(word, tuple)]  # in a repeated step()
        if waiting:
            raise JoinError(f"rank {self.comm.rank} on {socket.gethostname()}: "
                            f"{SKIPPED_STEP.format([r for r in range(self.comm.size) if r not in waiting])}")
        return said

    def _decide(self, said: list) -> tuple:
        """What every rank concludes alike from the exchange: how many ranks have data, and the
        optimizer they are averaging (None where none has data).

        Raises:
            CollectiveMismatchError: the ranks with data are averaging different optimizers.
            JoinError: the optimizer cannot be averaged inside torchmn.join, or this rank has no such one.
        """
        with_data = [(r, n) for r, n in enumerate(said) if n != ENDED]
        if not with_data:
            return 0, None
        numbers = {n for _, n in with_data}
        if len(numbers) > 1:
            listing = ", ".join(f"rank {r}: optimizer #{n}" for r, n in with_data)
            raise CollectiveMismatchError(
                f"rank {self.comm.rank} on {socket.gethostname()}: inside torchmn.join the ranks with data began "
                f"averaging the gradients of different optimizers ({listing}; numbered in the order they were "
                f"built on this communicator). Every rank must step its optimizers in the same order")
        number = numbers.pop()
        ref = _by_number.get(self.comm, {}).get(number)
        optimizer = ref() if ref is not None else None
        if optimizer is None:
            raise JoinError(f"rank {self.comm.rank} on {socket.gethostname()}: rank(s) {[r for r, _ in with_data]} "
                            f"average optimizer #{number} (in the order built on this communicator), which this rank "
                            f"no longer has; keep every multi-node optimizer alive until torchmn.join ends")
        self._check_can_average(optimizer)
        return len(with_data), optimizer

    def _check_can_average(self, optimizer) -> None:
        # Raised after the exchange, where every rank knows which optimizer it is: alike everywhere.
        if getattr(optimizer, "double_buffering", False):
            raise JoinError(f"rank {self.comm.rank} on {socket.gethostname()}: torchmn.join cannot average an optimizer "
                            f"built with double_buffering=True: its update uses the previous step's average, so the "
                            f"weighting by the ranks with data would land a step late. Build it with "
                            f"double_buffering=False")


def join(comm) -> Join:
    """A context in which ranks may run out of data at different steps without a hang.

    Put the whole training loop inside it, on every rank. While some ranks still train, a rank
    whose loop has ended waits at the end of the context, answering their gradient averaging with
    zero gradients and applying the same update, so that every rank leaves the context at the
    same time with the same parameters. Every multi-node optimizer built on ``comm``
    (:func:`torchmn.create_multi_node_optimizer`, any kind) takes part.

    The weighting: at each step, the averaged gradient is the mean over the ranks that still have
    data, ``g = (1/n) * sum of g_r over those ranks`` (``n`` of them; a rank that lacks a gradient
    for some parameter counts as zeros there, as ``zero_fill=True`` says). With ranks 0 and 1
    holding 7 and 10 batches, steps 1-7 average over both, steps 8-10 take rank 1's gradient alone.

    Inside the context the ranks exchange, before each averaging, whether they still have data (one
    small collective per step; outside it there is none). A rank whose loop has ended repeats the
    optimizers' averaging and ``step()`` only: the loop's other collectives (a metric's
    ``comm.allreduce``, a sharded ``state_dict()``) go after the context, and what the loop does
    besides (an LR scheduler's ``step()``) does not run on it, so step schedulers per epoch, after
    the context. Each averaging is followed by that optimizer's ``step()``, as in a training loop.

    Args:
        comm: the communicator the optimizers were built on.

    Returns:
        The context (a :class:`Join`); its ``steps_repeated`` says, once left, how many steps this
        rank repeated without data.

    Raises:
        JoinError: a context is open on ``comm`` already; an optimizer built with
            ``double_buffering=True`` averages inside it; ``clip_grad_norm_`` of a
            ``shard_state=True`` optimizer is called inside it.
        CollectiveMismatchError: the ranks with data average different optimizers at one step.

    Example::

        >>> with torchmn.join(comm):
        ...     for x, y in loader:                  # a different number of batches on each rank
        ...         optimizer.zero_grad()
        ...         loss_fn(model(x), y).backward()
        ...         optimizer.step()
    """
    return Join(comm)
