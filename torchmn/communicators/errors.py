"""Errors a collective raises on every rank that takes part, naming the ranks concerned, and how to
tell torch.distributed's own errors for a lost peer (:func:`lost_peer`)."""
import torch.distributed as dist

from torchmn.errors import TorchmnError

# What torch.distributed says when a peer never came or went away.
# ("pair closure": gloo on a rank whose peer gave up first, closing their connection.)
_LOST_PEER = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "caused pair closure")


class CollectiveMismatchError(TorchmnError, RuntimeError):
    """Ranks called a collective with different kinds, roots, ops, dtypes or shapes.

    Raised on every rank, with the same message, instead of letting the job hang.
    """


class RemoteRankError(TorchmnError, RuntimeError):
    """Another rank rejected its arguments to a collective; its own error says why."""


class CollectiveTimeoutError(TorchmnError, RuntimeError):
    """A collective did not complete within the timeout; the message names the ranks that did not
    take part (and what they were doing instead, where known)."""


class PeerLostError(CollectiveTimeoutError):
    """A rank of this node stopped taking part in a shared-memory collective (exited, or did not
    arrive within the timeout)."""


class RankFailedError(PeerLostError):
    """Another rank ended with an uncaught exception while this one waited for it in a collective.

    The message names that rank, its host and its error (its traceback is in its own output);
    ``failure`` holds the same as a :class:`torchmn.communicators.failure.Failure`. It replaces the
    :class:`PeerLostError` or :class:`CollectiveTimeoutError` the lost peer would have raised (and is
    both, so ``except`` clauses written for those still catch it). Uncaught, it ends this rank with
    one line instead of a traceback: the failed rank's traceback is the one that matters.
    """

    def __init__(self, message: str, failure=None):
        """The error with ``message``, holding the recorded ``failure``.

        :func:`torchmn.communicators.failure.stopped_by` makes it for a collective a failed rank stopped.

        Args:
            message: the whole message (the failed rank, its host and error, and the call stopped).
            failure: the :class:`~torchmn.communicators.failure.Failure` recorded, kept as
                ``self.failure``; None where it is not known.

        Example::

            >>> lost = Failure(rank=1, host="node1", pid=4242, error="ValueError: boom")
            >>> err = RankFailedError(f"allreduce stopped on rank 0 (node0): {lost}", failure=lost)
            >>> err.failure.rank
            1
        """
        super().__init__(message)
        self.failure = failure


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is torch.distributed saying that a peer never came or went away.

    Args:
        error: what a collective raised.

    Returns:
        True for torch's own timeout and connection errors (not torchmn's, which already say
        what went wrong).

    Example::

        >>> lost_peer(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
        True
        >>> lost_peer(CollectiveTimeoutError("allreduce ... failed on rank 0: rank 1 never called it"))
        False
    """
    # Exactly torch's: torchmn's own errors derive from RuntimeError too, and already say what went wrong.
    torchs = type(error) is RuntimeError or isinstance(error, (dist.DistBackendError, dist.DistNetworkError))
    return torchs and any(s in str(error) for s in _LOST_PEER)
