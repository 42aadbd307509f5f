"""The errors of elastic training."""
from __future__ import annotations

from torchmn.errors import TorchmnError, TorchmnRuntimeError


class HostsUpdatedInterrupt(TorchmnError, RuntimeError):
    """Raised by ``State.commit()`` / ``check_host_updates()`` on every rank at once when ranks joined
    or left: :func:`torchmn.elastic.run` then moves the ranks to the new world, with the state just
    committed (Horovod's exception of that name).

    Attributes:
        skip_sync: the new world's ranks all hold the committed state already, so nothing is
            broadcast (Horovod's attribute; torchmn always syncs, as joining ranks need it).

    Example::

        >>> try:
        ...     state.commit()
        ... except HostsUpdatedInterrupt:
        ...     ...     # torchmn.elastic.run handles it; scripts rarely catch it
    """

    def __init__(self, message: str, skip_sync: bool = False):
        """Args:
            message: what changed.
            skip_sync: Horovod's flag (see the class).

        Example::

            >>> raise HostsUpdatedInterrupt("ranks joined or left the job")
        """
        super().__init__(message)
        self.skip_sync = skip_sync


class ElasticJobEndedError(TorchmnRuntimeError):
    """The launcher ended the elastic job while this rank waited for a new world (too few ranks
    for longer than ``--elastic-timeout``); the message says which were lost.

    Example::

        >>> raise ElasticJobEndedError("torchmn run: only 1 worker(s) left, below --min-np 2 ...")
    """


class StateLostError(TorchmnRuntimeError):
    """The committed state cannot be rebuilt from the survivors: a sharded optimizer lost a shard
    and the rank that kept its copy at once (two neighbouring ranks). The message names them; the
    newest complete checkpoint is the way back.

    Example::

        >>> raise StateLostError("ranks 1 and 2 were lost together ...")
    """
