"""Global metric means from per-rank means, weighted by how many samples each rank saw."""
from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable

import torch

from torchmn.errors import TorchmnRuntimeError, TorchmnTypeError, TorchmnValueError


def _as_float(value: Any, key: str, rank: int) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TorchmnValueError(f"multi-node evaluator: metric {key!r} on rank {rank} is a tensor of shape "
                                    f"{tuple(value.shape)}; return one number per metric")
        return float(value.detach().cpu().double().item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise TorchmnTypeError(f"multi-node evaluator: metric {key!r} on rank {rank} is a {type(value).__name__}; "
                           f"return numbers (or one-element tensors)")


def _local(result: Any, rank: int) -> tuple[dict[str, float], int]:
    if isinstance(result, dict):
        # A plain dict is one sample's worth; an empty one (ppe's Evaluator on a rank without
        # batches) is none, not a sample without metrics.
        metrics, n = result, 1 if result else 0
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], dict):
        metrics, n = result
    else:
        raise TorchmnTypeError(f"multi-node evaluator: fn() on rank {rank} returned {type(result).__name__}; "
                               f"return (dict_of_means, n_samples) or a dict")
    if len({str(k) for k in metrics}) != len(metrics):
        raise TorchmnValueError(f"multi-node evaluator: fn() on rank {rank} returned metrics {list(metrics)}, some "
                                f"of one name as text (the results name metrics by str); give each a name of its own")
    if isinstance(n, torch.Tensor):
        n = n.item()
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise TorchmnValueError(f"multi-node evaluator: fn() on rank {rank} returned n_samples={n!r}; "
                                f"it must be an integer >= 0")
    if n == 0:  # no samples: the values are not used (None, as `total / n if n else None` gives, is fine)
        return {str(k): math.nan for k in metrics}, 0
    return {str(k): _as_float(v, k, rank) for k, v in metrics.items()}, int(n)


def _raise_where_one_failed(everyone: list, what: str, rank: int) -> None:
    """Raise, on every rank alike, where a rank's entry of ``everyone`` is ``("error", why)``: the
    exchange a rank whose ``what`` failed still took part in."""
    failed = [(r, x[1]) for r, x in enumerate(everyone) if x[0] == "error"]
    if failed:
        r, why = failed[0]
        raise TorchmnRuntimeError(f"multi-node evaluator: {what} failed on rank {r} ({why}); raised on rank {rank} too")


class MultiNodeEvaluator:
    """Callable made by :func:`create_multi_node_evaluator`: ``fn``'s metrics, averaged over ranks.

    Args:
        fn: the per-rank evaluation, returning ``(means, n)`` or a dict of means.
        comm: the communicator whose ranks evaluate.

    Example::

        >>> evaluator = torchmn.evaluators.MultiNodeEvaluator(evaluate, comm)
        >>> evaluator()["loss"]
    """

    def __init__(self, fn: Callable[..., Any], comm):
        self.fn = fn
        self.comm = comm

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Run ``fn`` on this rank and average its metrics over all ranks' samples.

        Args:
            *args, **kwargs: passed to ``fn``.

        Returns:
            ``{metric: global mean}``, the same on every rank.

        Raises:
            TypeError, ValueError: ``fn`` returned something other than ``(dict, n)`` or a dict of
                numbers, or ``n`` is not an integer ``>= 0`` (on the rank that returned it).
            RuntimeError: ``fn`` failed, or returned such a result, on another rank; the rank where
                it failed raises its own error.
            ValueError: the ranks that saw samples reported different metric names (every rank).

        Example::

            >>> evaluator = torchmn.create_multi_node_evaluator(evaluate, comm)
            >>> evaluator(model)["accuracy"]      # evaluate(model) -> ({"accuracy": ...}, n); same on every rank
        """
        comm = self.comm
        try:
            mine: Any = _local(self.fn(*args, **kwargs), comm.rank)
        except Exception as e:
            # Take part in the exchange anyway, so the other ranks raise instead of waiting.
            comm.allgather_obj(("error", f"{type(e).__name__}: {e}"))
            raise
        everyone = comm.allgather_obj(mine)
        _raise_where_one_failed(everyone, "fn()", comm.rank)
        counted = [(r, metrics, n) for r, (metrics, n) in enumerate(everyone) if n > 0]
        # A rank that saw no sample contributes nothing, its metric names included.
        keys = sorted({k for _, metrics, _ in counted for k in metrics} if counted else
                      {k for metrics, _ in everyone for k in metrics})
        for r, metrics, _ in counted:
            if sorted(metrics) != keys:
                raise TorchmnValueError(f"multi-node evaluator: rank {r} reported metrics {sorted(metrics)} but the "
                                        f"ranks together reported {keys}; every rank that saw samples must report "
                                        f"the same metrics (raised on rank {comm.rank})")
        total = sum(n for _, _, n in counted)
        if total == 0:
            return {k: math.nan for k in keys}
        # Python floats are float64; summing in rank order gives the same bits on every rank.
        return {k: sum(metrics[k] * n for _, metrics, n in counted) / total for k in keys}


def create_multi_node_evaluator(fn: Any, comm) -> Any:
    """Wrap ``fn`` so that it returns, on every rank, the exact global means of its metrics.

    ``fn`` may also be an evaluator object with an ``evaluate()`` method, as ChainerMN's took
    (pytorch-pfn-extras' ``Evaluator`` extension, say): its ``evaluate`` is replaced, on this
    object, by one that returns the means over the ranks, and the object itself is returned, so
    that it goes to ``manager.extend(...)`` as before. Its ``evaluate()`` returns a dict of means:
    for ppe's ``Evaluator``, the ranks' report summaries summed, each report with its weight (as
    ppe's ``DistributedEvaluator``: what one process over the whole set would give); for other
    objects (and an ``Evaluator`` subclass with an ``evaluate()`` of its own), each rank's means
    weighted by its batch count where its ``get_iterator("main")`` has
    a length, else the plain mean over ranks, as ChainerMN's gave.

    ``fn(*args, **kwargs)`` runs on each rank over that rank's shard and returns
    ``(means, n)``: a dict of metric means over the ``n`` samples it saw. The wrapper returns,
    on every rank, each metric's mean over all samples of all ranks (each rank weighted by its
    ``n``, summed in float64), so uneven shards give the right answer. A rank with ``n == 0``
    contributes nothing (its dict may be empty, its values ``None``). If no rank saw a sample, every metric named by
    any rank is ``nan`` (and the result is ``{}`` if none was named). ``fn`` may also return a
    plain dict: it counts as ``n = 1`` (an empty one as ``n = 0``), so the result is the plain mean
    over ranks. Values may be numbers or one-element tensors. Every rank must call the wrapper together.

    Args:
        fn: the per-rank evaluation, returning ``(means, n)`` or a dict of means; or an
            evaluator object with an ``evaluate()`` method.
        comm: the communicator whose ranks evaluate.

    Returns:
        A :class:`MultiNodeEvaluator`; calling it with ``fn``'s arguments returns
        ``{metric: global mean}`` on every rank. For an evaluator object, the object.

    Example::

        >>> def evaluate():
        ...     total, n = 0.0, 0
        ...     for x, y in local_loader:
        ...         total, n = total + loss_fn(model(x), y, reduction="sum").item(), n + len(y)
        ...     return {"loss": total / n if n else None}, n
        >>> metrics = torchmn.create_multi_node_evaluator(evaluate, comm)()
        >>> metrics["loss"]    # the same number on every rank
        >>> evaluator = ppe.training.extensions.Evaluator(val_loader, model)
        >>> manager.extend(torchmn.create_multi_node_evaluator(evaluator, comm))   # means over all batches
    """
    evaluate = getattr(fn, "evaluate", None)
    if callable(evaluate) and not isinstance(fn, MultiNodeEvaluator):
        if callable(getattr(fn, "_gather_summaries", None)):
            fn.evaluate = _SummedSummaries(fn, comm)
        else:
            fn.evaluate = MultiNodeEvaluator(functools.partial(_weighted_by_batches, evaluate, fn), comm)
        return fn
    return MultiNodeEvaluator(fn, comm)


class _SummedSummaries:
    """A pytorch-pfn-extras ``Evaluator``'s ``evaluate``, with the ranks' summaries summed before
    the means are taken, as ppe's own ``DistributedEvaluator`` does through the same hook
    (``_gather_summaries``, which ppe's Evaluator calls with its summary of this rank's batches):
    each report keeps its weight (``report({"loss": (value, n)})``) and a metric some batches do
    not report is averaged over those that do, exactly as one process over the whole set. A rank
    whose evaluation fails before the exchange still takes part in it, so that every rank raises.

    An ``evaluate()`` of the evaluator's own (a subclass's, as ppe documents for custom evaluation
    loops) may never reach that hook: its means are then averaged over the ranks as other evaluator
    objects' are, weighted by their batch counts."""

    def __init__(self, evaluator: Any, comm):
        self.evaluator = evaluator
        self.evaluate, self.comm = evaluator.evaluate, comm
        self.exchanged = False
        evaluator._gather_summaries = self.gather

    def gather(self, summary: Any) -> Any:
        """The sum, in rank order (the same bits on every rank), of every rank's ``summary``."""
        self.exchanged = True
        everyone = self.comm.allgather_obj(("summary", summary))
        _raise_where_one_failed(everyone, "the evaluation", self.comm.rank)
        total = type(summary)()
        for _, part in everyone:
            total = total + part
        return total

    def __call__(self) -> dict:
        self.exchanged = False
        try:
            means = self.evaluate()
        except Exception as e:
            if not self.exchanged:  # take part in the exchange anyway, so the other ranks raise instead of waiting
                self.comm.allgather_obj(("error", f"{type(e).__name__}: {e}"))
            raise
        if self.exchanged:
            return means
        # Every rank runs the same evaluate(), so every rank comes here alike.
        return MultiNodeEvaluator(functools.partial(_weighted_by_batches, lambda: means, self.evaluator), self.comm)()


def _weighted_by_batches(evaluate: Callable[[], Any], evaluator: Any) -> tuple:
    """An evaluator object's means, weighted by its batch count where its main iterator has a length:
    pytorch-pfn-extras' ``Evaluator`` averages one report per batch, so the ranks' means weighted so
    are the mean over all their batches, as one process over the whole set gives. Else 1 (the plain
    mean over ranks, as ChainerMN's)."""
    means = evaluate()
    try:
        batches = len(evaluator.get_iterator("main"))
    except (AttributeError, KeyError, TypeError):  # no such iterator, or no length
        batches = 1
    return means, batches if means else 0
