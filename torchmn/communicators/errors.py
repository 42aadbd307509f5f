"""Errors a collective raises on every rank that takes part, naming the ranks concerned."""
from torchmn.errors import TorchmnError


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
        super().__init__(message)
        self.failure = failure
