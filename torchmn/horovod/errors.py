"""The errors torchmn.horovod raises on purpose.

Each is a :class:`torchmn.errors.TorchmnError` and keeps the built-in base Horovod's error of the
same situation has (``ValueError``, ``NotImplementedError``, ...), so a Horovod script's ``except``
clauses catch it and ``except torchmn.TorchmnError`` catches all of them. A disagreement between
the ranks (shapes, ops, roots) is torchmn's own :class:`torchmn.CollectiveMismatchError`. A peer
lost, or a collective timed out, raises what torchmn raises for it made a
:class:`HorovodInternalError` too (:func:`raises_horovods_errors`), as Horovod raises that then.
"""
import functools
from typing import Callable, TypeVar

from torchmn.communicators.errors import CollectiveTimeoutError, PeerLostError, RankFailedError, lost_peer
from torchmn.errors import TorchmnError

F = TypeVar("F", bound=Callable)


class HorovodInternalError(TorchmnError, RuntimeError):
    """A collective cannot run: a rank that called ``hvd.join()`` cannot take part in it, a peer
    was lost, or the ranks did not meet within ``TORCHMN_TIMEOUT`` (Horovod's error of that name,
    which it raises in each case). For the last two it is also the error torchmn raises there
    (:class:`torchmn.communicators.PeerLostError`, :class:`torchmn.communicators.RankFailedError`,
    :class:`torchmn.CollectiveTimeoutError`), so ``hvd.elastic.run`` recovers from it.

    Example::

        >>> try:
        ...     hvd.allgather(x)            # while another rank has joined
        ... except hvd.HorovodInternalError as e:
        ...     print(e)
    """


class InvalidCallError(TorchmnError, ValueError):
    """A call Horovod refuses with ``ValueError``: made before ``hvd.init()``, with an argument it
    does not take (a root rank outside the process set, a handle not in flight, a name already in
    flight, a process set not registered), or asking about MPI, which torchmn.horovod does not run on.

    Example::

        >>> try:
        ...     hvd.rank()                  # before hvd.init()
        ... except ValueError as e:
        ...     print(e)                    # Horovod has not been initialized; use hvd.init().
    """


class UnsupportedError(TorchmnError, NotImplementedError):
    """A Horovod feature torchmn.horovod does not implement (``hvd.Adasum``, an ``mpi4py``
    communicator, a custom compressor, ``step(closure)``); the message says what to use instead.

    Example::

        >>> try:
        ...     hvd.allreduce(x, op=hvd.Adasum)
        ... except NotImplementedError as e:
        ...     print(e)
    """


class TooManyBackwardPassesError(TorchmnError, AssertionError):
    """More backward passes than ``backward_passes_per_step`` before ``optimizer.step()`` (an
    ``AssertionError``, as Horovod's).

    Example::

        >>> opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1)
        >>> loss.backward(); loss2.backward()       # raises in the second backward
    """


class NotPicklableError(TorchmnError, TypeError):
    """A ``DistributedOptimizer`` was copied or pickled (its ``state_dict()`` is what to save).

    Example::

        >>> torch.save(opt.state_dict(), "opt.pt")      # instead of torch.save(opt, ...)
    """


class ZeroGradBeforeStepError(TorchmnError, AssertionError):
    """``optimizer.zero_grad()`` between ``loss.backward()`` and ``optimizer.step()`` (or
    ``synchronize()``), which would throw away gradients being averaged (an ``AssertionError``, as
    Horovod's).

    Example::

        >>> loss.backward()
        >>> opt.zero_grad()                         # raises: step() first
    """


class HorovodTimeoutError(HorovodInternalError, CollectiveTimeoutError):
    """A collective did not complete within ``TORCHMN_TIMEOUT``: torchmn's
    :class:`~torchmn.CollectiveTimeoutError`, raised by ``torchmn.horovod`` as Horovod's
    :class:`HorovodInternalError`. The message names the ranks that did not take part."""


class HorovodPeerLostError(HorovodInternalError, PeerLostError):
    """A peer exited or its connection closed in the middle of a collective: torchmn's
    :class:`~torchmn.communicators.PeerLostError`, raised by ``torchmn.horovod`` as Horovod's
    :class:`HorovodInternalError`."""


class HorovodRankFailedError(HorovodInternalError, RankFailedError):
    """Another rank ended with an exception while this one waited for it: torchmn's
    :class:`~torchmn.communicators.RankFailedError` (``failure`` names the rank, its host and its error),
    raised by ``torchmn.horovod`` as Horovod's :class:`HorovodInternalError`."""


def as_horovods(error: BaseException) -> BaseException:
    """The error Horovod would raise for ``error``: a lost peer or a timeout made a
    :class:`HorovodInternalError` too, with the same message; any other error as it is.

    Args:
        error: what a collective raised.

    Returns:
        A :class:`HorovodRankFailedError`, :class:`HorovodPeerLostError` or
        :class:`HorovodTimeoutError`, or ``error`` itself.

    Example::

        >>> as_horovods(torchmn.communicators.PeerLostError("rank 1 (node1) exited")).__class__.__name__
        'HorovodPeerLostError'
        >>> as_horovods(ValueError("bad")).__class__.__name__
        'ValueError'
    """
    if isinstance(error, HorovodInternalError):
        return error
    if isinstance(error, RankFailedError):
        return HorovodRankFailedError(str(error), failure=error.failure)
    if isinstance(error, PeerLostError):
        return HorovodPeerLostError(str(error))
    if isinstance(error, CollectiveTimeoutError):
        return HorovodTimeoutError(str(error))
    if isinstance(error, Exception) and lost_peer(error):  # torch.distributed's own words for it
        return HorovodPeerLostError(f"a peer was lost: {error}")
    return error


def raises_horovods_errors(func: F) -> F:
    """Make ``func`` raise a lost peer or a timeout as Horovod does: as a
    :class:`HorovodInternalError` (see :func:`as_horovods`), chained to torchmn's error.

    Args:
        func: a ``torchmn.horovod`` call that may wait for other ranks.

    Returns:
        The wrapped function.

    Example::

        >>> @raises_horovods_errors
        ... def barrier(process_set=global_process_set):
        ...     ...
    """
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - translated where Horovod's error differs, else as it is
            translated = as_horovods(e)
            if translated is e:
                raise
            raise translated from e
    return wrapper  # type: ignore[return-value]
