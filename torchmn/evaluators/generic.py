"""Evaluation whose result is not a mean: gather local results to root, aggregate there."""
from __future__ import annotations

import abc
from typing import Any, Optional

from torchmn.communicators.pickling import dumps
from torchmn.communicators.errors import CollectiveMismatchError, RemoteRankError

_OK, _FAILED = "ok", "failed"


class GenericMultiNodeEvaluator(abc.ABC):
    """Gather each rank's :meth:`evaluate_local` result to root and :meth:`aggregate` it there.

    For metrics that are not means (AUC, F1 over all samples, a confusion matrix, ...).
    Calling the evaluator returns the aggregate on ``root`` and ``None`` on the other ranks, or
    the aggregate on every rank with ``broadcast=True``. Every rank must call it together. If
    ``evaluate_local`` fails on some rank, root raises too (and, with ``broadcast=True``, so does
    every rank).

    Subclasses implement :meth:`evaluate_local` and :meth:`aggregate`.

    Args:
        comm: the communicator whose ranks evaluate.
        root: the rank that aggregates.
        broadcast: return the aggregate on every rank, not only on ``root``.

    Raises:
        ValueError: ``root`` is not a rank of ``comm``.

    Example::

        >>> class AUC(torchmn.GenericMultiNodeEvaluator):
        ...     def evaluate_local(self, model):
        ...         return [(model(x).sigmoid(), y) for x, y in local_loader]
        ...     def aggregate(self, results):
        ...         pairs = [p for rank_pairs in results for p in rank_pairs]
        ...         return roc_auc(torch.cat([s for s, _ in pairs]), torch.cat([y for _, y in pairs]))
        >>> auc = AUC(comm)(model)    # a number on rank 0, None elsewhere
    """

    def __init__(self, comm, root: int = 0, broadcast: bool = False):
        comm.check_rank(root, "root")
        self.comm = comm
        self.root = root
        self.broadcast = broadcast
        self._agreed = False  # the ranks compared root and broadcast (at the first call)

    @abc.abstractmethod
    def evaluate_local(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's result over its shard; anything picklable.

        Args:
            *args, **kwargs: what the evaluator was called with.

        Returns:
            This rank's local result, gathered to root for :meth:`aggregate`.

        Example::

            >>> def evaluate_local(self, model):                 # in a subclass
            ...     with torch.no_grad():
            ...         return [(model(x).sigmoid(), y) for x, y in local_loader]
        """

    @abc.abstractmethod
    def aggregate(self, results: list) -> Any:
        """Combine every rank's local result (``results[r]`` is rank ``r``'s); runs on root only.

        Args:
            results: the :meth:`evaluate_local` result of every rank, in rank order.

        Returns:
            The aggregate, which calling the evaluator returns on root (on every rank with
            ``broadcast=True``).

        Example::

            >>> def aggregate(self, results):                    # in a subclass
            ...     pairs = [p for rank_pairs in results for p in rank_pairs]
            ...     return roc_auc(torch.cat([s for s, _ in pairs]), torch.cat([y for _, y in pairs]))
        """

    def __call__(self, *args: Any, **kwargs: Any) -> Optional[Any]:
        """Evaluate on every rank and aggregate on root. Every rank must call it together.

        Args:
            *args, **kwargs: passed to :meth:`evaluate_local`.

        Returns:
            The aggregate on root, and on every rank with ``broadcast=True``; ``None`` on the
            other ranks otherwise.

        Raises:
            RemoteRankError: on root (on every rank with ``broadcast=True``), when
                ``evaluate_local`` failed on another rank; with ``broadcast=True``, also on the
                other ranks when ``evaluate_local`` or ``aggregate`` failed on root. The rank where
                either failed raises that error itself, also when its result cannot be pickled.

        Example::

            >>> auc = AUC(comm)(model)        # a number on rank 0, None elsewhere
        """
        comm, root = self.comm, self.root
        if not self._agreed and comm.size > 1:
            # Ranks of another broadcast would part ways after the gather (some waiting for a
            # broadcast the others never join): compared once, on every rank.
            settings = comm.allgather_obj((root, bool(self.broadcast)))
            if len(set(settings)) > 1:
                raise CollectiveMismatchError(
                    f"{type(self).__name__}: the ranks built it differently ("
                    + ", ".join(f"rank {r}: root={s[0]}, broadcast={s[1]}" for r, s in enumerate(settings))
                    + f"); every rank must pass the same root and broadcast (raised on rank {comm.rank})")
            self._agreed = True
        try:
            local = (_OK, self.evaluate_local(*args, **kwargs))
            # A result that cannot travel fails here, on this rank, like evaluate_local itself:
            # inside gather_obj it would fail only on some ranks, leaving the others waiting.
            if comm.rank != root:
                dumps(local)
        except Exception as e:
            local = (_FAILED, f"{type(e).__name__}: {e}")
            comm.gather_obj(local, root=root)
            if self.broadcast:
                comm.bcast_obj((_FAILED, f"evaluate_local failed on root rank {root}: {local[1]}")
                               if comm.rank == root else None, root=root)
            raise
        gathered = comm.gather_obj(local, root=root)
        outcome = None
        if comm.rank == root:
            failed = [(r, why) for r, (status, why) in enumerate(gathered) if status == _FAILED]
            if failed:
                outcome = (_FAILED, f"evaluate_local failed on rank {failed[0][0]}: {failed[0][1]}")
            else:
                try:
                    outcome = (_OK, self.aggregate([value for _, value in gathered]))
                except Exception as e:
                    if self.broadcast:
                        comm.bcast_obj((_FAILED, f"aggregate failed on root rank {root}: "
                                                 f"{type(e).__name__}: {e}"), root=root)
                    raise
        if self.broadcast:
            outcome = comm.bcast_obj(outcome, root=root)
        elif comm.rank != root:
            return None
        status, value = outcome
        if status == _FAILED:
            raise RemoteRankError(f"{type(self).__name__}: {value} (raised on rank {comm.rank})")
        return value
