"""The root of torchmn's exceptions.

Every error torchmn raises on purpose (a collective called differently on two ranks, a rank that
never came, a job that cannot be launched, a hostfile that does not parse) is a
:class:`TorchmnError`, so ``except torchmn.TorchmnError`` catches them all. Each also keeps the
built-in base it always had (``RuntimeError``, ``ValueError``), so existing ``except`` clauses
still catch it.

This module imports nothing but the standard library: the launcher's helper processes load it
without torch.
"""


class TorchmnError(Exception):
    """Base class of the errors torchmn raises on purpose.

    Example::

        >>> try:
        ...     comm.bcast(x, root=comm.rank)        # every rank names itself as root
        ... except torchmn.TorchmnError as e:        # a CollectiveMismatchError
        ...     print(e)
    """
