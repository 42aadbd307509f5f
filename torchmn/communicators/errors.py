"""Errors raised identically on every rank of a collective."""


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with different kinds, roots, ops, dtypes or shapes.

    Raised on every rank, with the same message, instead of letting the job hang.
    """


class RemoteRankError(RuntimeError):
    """Another rank rejected its arguments to a collective; its own error says why."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the timeout; the message names the ranks that did not
    take part (and what they were doing instead, where known)."""
