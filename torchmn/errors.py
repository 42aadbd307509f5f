"""The root of torchmn's exceptions.

Every error torchmn raises on purpose (a collective called differently on two ranks, a rank that
never came, a job that cannot be launched, a hostfile that does not parse, an argument it cannot
use) is a :class:`TorchmnError`, so ``except torchmn.TorchmnError`` catches them all. Each also
keeps the built-in base Python code expects (``ValueError`` for a bad value, ``TypeError`` for a
bad type, ``RuntimeError`` for a call that cannot be made now, ...), so ``except ValueError``
still catches it. Where a package has errors of its own (``CollectiveMismatchError``,
``CheckpointError``, ``RunError``, ...) they are raised; elsewhere the ones below, one per
built-in base.

Python's own protocols keep their plain built-ins: ``AttributeError`` from a module's
``__getattr__``, ``IndexError`` from a dataset's ``__getitem__``.

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


class TorchmnValueError(TorchmnError, ValueError):
    """A value torchmn cannot use: an argument, a variable of the environment, a file's content.

    Example::

        >>> torchmn.create_communicator(timeout=-1)     # TorchmnValueError: timeout must be positive
    """


class TorchmnTypeError(TorchmnError, TypeError):
    """An argument of a type torchmn cannot use.

    Example::

        >>> comm.bcast([1, 2])                          # TorchmnTypeError: root must pass a tensor
    """


class TorchmnRuntimeError(TorchmnError, RuntimeError):
    """A call torchmn cannot make in the state things are in (the message says what to do first).

    Example::

        >>> optimizer.step()                            # after a backward() that raised halfway
    """


class TorchmnNotImplementedError(TorchmnError, NotImplementedError):
    """Something torchmn deliberately does not support, with what to do instead.

    Example::

        >>> optimizer.add_param_group({"params": extra})   # add groups before wrapping instead
    """


class TorchmnAttributeError(TorchmnError, AttributeError):
    """An attribute that cannot be set this way (the message names the way).

    Example::

        >>> sharded_optimizer.state = {}                # use load_state_dict() instead
    """


class TorchmnOSError(TorchmnError, OSError):
    """The operating system refused what torchmn needs (shared memory, a file), with the fix.

    Example::

        >>> torchmn.create_communicator()               # /dev/shm full: TorchmnOSError naming its room
    """


class TorchmnKeyError(TorchmnError, KeyError):
    """Something asked for by name is not there (a checkpoint without an entry the job needs).

    Example::

        >>> checkpointer.load_latest()                  # the checkpoint holds no "scheduler"
    """
