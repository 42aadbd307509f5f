"""``@torchmn.elastic.run``: a training function that goes on when ranks die or join, and the reset
that moves a rank's communicators and optimizers to the new world in the same process."""
from __future__ import annotations

import functools
import logging
import socket
import time
import weakref
from typing import Callable, List, TypeVar

import torch.distributed as dist

from torchmn.communicators import create_communicator, failure
from torchmn.communicators.errors import CollectiveTimeoutError, lost_peer
from torchmn.elastic import membership
from torchmn.elastic.errors import HostsUpdatedInterrupt
from torchmn.elastic.state import State, first_world
from torchmn.errors import TorchmnTypeError
from torchmn.optimizers import join as joining
from torchmn.optimizers.multi_node_optimizer import build_into

# Each state's generation its reset callbacks last ran in (weak: a state is the script's to drop).
_callbacks_ran: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

log = logging.getLogger("torchmn.elastic")
F = TypeVar("F", bound=Callable)
_world_hooks: List[Callable[[], None]] = []


def add_world_hook(hook: Callable[[], None]) -> None:
    """Call ``hook()`` at every reset, once the communicators describe the new world and before the
    optimizers are rebuilt there: for a library that keeps communicators of its own made from them
    (``torchmn.horovod``'s process sets). Collective where ``hook`` is: every rank calls it, in the
    same order.

    Args:
        hook: a function of no arguments.

    Example::

        >>> add_world_hook(lambda: register_global(job.comm))
    """
    _world_hooks.append(hook)


def recoverable(error: BaseException) -> bool:
    """Whether ``error`` means the world broke (a peer died or left), which a reset mends, rather
    than a fault of the training code, which ends this rank.

    Args:
        error: what the training function raised.

    Returns:
        True for torchmn's lost-peer and timeout errors (shared memory included, and what
        ``torchmn.horovod`` raises when a peer is lost) and torch's lost connections; not for
        ``hvd.HorovodInternalError``, which torchmn.horovod raises for a call a joined rank cannot
        make (a fault of the script).

    Example::

        >>> recoverable(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
        True
        >>> recoverable(ValueError("bad batch"))
        False
    """
    return isinstance(error, CollectiveTimeoutError) or lost_peer(error)


def run(func: F) -> F:
    """Make ``func(state, ...)`` an elastic training function: when ranks die it goes on in the
    survivors' new world from the last commit, and when ranks join it takes them in at the next.

    Each call first commits what the ranks hold (a second run function, to evaluate, starts from
    the state the first left, not from its last commit), hands the scattered dataset and the
    multi-node iterators' masters to the ranks that joined, synchronises ``state`` (rank 0's to
    all), then runs ``func``. When a collective
    fails because a peer was lost, every survivor goes back to its last commit, leaves the old
    world, waits for the launcher's new one, rebuilds in place the communicators the script made
    and the multi-node optimizers ``state`` holds (``comm.rank`` and ``comm.size`` then describe the
    new world), synchronises, calls the reset callbacks and calls ``func`` again. A
    :class:`HostsUpdatedInterrupt` from ``commit()`` does the same without going back. Other
    exceptions end this rank as usual (the others then go on without it).

    Outside an elastic job (no ``torchmn run --min-np``), ``func`` runs once, after the sync.

    Args:
        func: the training function; its first argument is a :class:`State`.

    Returns:
        The wrapped function, returning what ``func`` returns.

    Raises:
        TypeError: the first argument is not a ``State``.
        ElasticJobEndedError: the job ended while this rank waited for a new world.

    Example::

        >>> @torchmn.elastic.run
        ... def train(state):
        ...     ...
        >>> train(torchmn.elastic.State(model=model, optimizer=optimizer, epoch=0))
    """
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TorchmnTypeError(f"@torchmn.elastic.run: the function's first argument must be a "
                                   f"torchmn.elastic.State, not {type(state).__name__}")
        # A rank that joined a running job: its world comes of a reset. A second run function in the
        # same world (train, then evaluate) is no reset: its callbacks ran already.
        after_reset = not first_world() and _callbacks_ran.get(state) != membership.generation()
        if not membership.awaiting_state():
            # What the ranks hold now, changed since the last commit or never committed (a State
            # made after a reset), is what this call starts from, as Horovod's sync hands on the
            # current state; only a rank that joined holds nothing yet, and receives it in the sync.
            state.save()
        while True:
            try:
                for follower in membership.followers():  # a rank that joined receives the data here
                    follower.follow_world()
                state.sync()
                if after_reset:
                    # After the sync, which goes back to the commit: what the callbacks set (the
                    # learning rate for comm.size) stays, and every rank of the new world, the ones
                    # that joined too, applies them to the same commit.
                    state.on_reset()
                    _callbacks_ran[state] = membership.generation()
                membership.say_it_holds_the_state()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                broke = e
            except Exception as e:  # noqa: BLE001 (told apart just below)
                if not (membership.enabled() and recoverable(e)):
                    raise
                broke = e
            since = time.monotonic()
            while True:  # a rank lost during the reset itself: another reset
                try:
                    _reset(state, broke, since)
                    after_reset = True
                    break
                except Exception as e:  # noqa: BLE001 (told apart just below)
                    # A member lost while the new world was set up: its set-up gave up when the
                    # launcher announced the next (torchmn.elastic.setup_store).
                    if not (recoverable(e) or membership.left_behind()):
                        raise
                    broke = e
    return wrapper


def _reset(state: State, error: BaseException, started: float) -> None:
    """Move this rank to the new world: leave the old one, wait for the launcher's next
    generation, rebuild the communicators and optimizers there (``started``: when the world broke,
    for the time the log line gives)."""
    comms = membership.communicators()
    optimizers = [(o, o.comm) for o in state.multi_node_optimizers()]
    old = f"rank {comms[0].rank}/{comms[0].size}" if comms else "a rank"
    for optimizer, _ in optimizers:
        optimizer.leave_world()
    for comm in comms:
        joining.forget(comm)
    failure.leave_world(error)
    generation = membership.wait_for_place()
    for comm in comms:
        comm.take_over(create_communicator(**comm.creation))
    for hook in _world_hooks:
        hook()
    for optimizer, comm in optimizers:
        # Built without state: the state's sync() puts the commit back next, and a rank that
        # joined holds none, so a survivor's (a replicated optimizer alone in the last world) would
        # make it alone load a state inside the new world's collective construction.
        optimizer.wrapped.state.clear()
        build_into(optimizer, optimizer.wrapped, comm, optimizer.options)
    forget_step = getattr(state.optimizer, "forget_step", None)  # a wrapper around one (torchmn.horovod's)
    if forget_step is not None:
        forget_step()
    size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    log.warning("torchmn.elastic: %s on %s moved to generation %d as rank %d/%d in %.2f s (%s: %s)", old,
                socket.gethostname(), generation, rank, size, time.monotonic() - started, type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "")
