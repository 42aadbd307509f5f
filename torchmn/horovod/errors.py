"""The errors torchmn.horovod raises on purpose.

Each is a :class:`torchmn.errors.TorchmnError` and keeps the built-in base Horovod's error of the
same situation has (``ValueError``, ``NotImplementedError``, ...), so a Horovod script's ``except``
clauses catch it and ``except torchmn.TorchmnError`` catches all of them. A disagreement between
the ranks (shapes, ops, roots) is torchmn's own :class:`torchmn.CollectiveMismatchError`.
"""
from torchmn.errors import TorchmnError


class HorovodInternalError(TorchmnError, RuntimeError):
    """A collective cannot run: a rank that called ``hvd.join()`` cannot take part in it (Horovod's
    error of that name; Horovod also raises it when a peer leaves).

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
