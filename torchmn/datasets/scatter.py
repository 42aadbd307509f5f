"""Splitting one dataset among ranks: :func:`scatter_dataset` and :func:`scatter_index`.

A rank's part is either copied from root, in bounded chunks of pickled samples, or, for a
:class:`SharedDataset` that every rank can open itself, read by the rank itself from the dataset
object root broadcasts. ``docs/design/data-and-extensions.md`` explains the two ways and how a
failure on one rank reaches the others.
"""
from __future__ import annotations

import operator
import pickle
import warnings
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from torchmn.communicators.errors import RemoteRankError
from torchmn.datasets.elastic_part import ElasticDatasetPart
from torchmn.datasets.part import DatasetPart, index_range
from torchmn.datasets.transfer import DEFAULT_MAX_BUF_LEN, TAG, receive_samples, send_samples
from torchmn.elastic import membership
from torchmn.errors import TorchmnValueError


class SharedDataset(Dataset):
    """Base class marking a dataset that every rank can open by itself.

    :func:`scatter_dataset` broadcasts such a dataset *object* (keep it cheap to pickle: store
    paths, open files lazily) and never copies its samples. A class that cannot inherit from this
    one can set ``__torchmn_shared__ = True`` instead.

    Example::

        >>> class Images(torchmn.datasets.SharedDataset):
        ...     def __init__(self, files): self.files = files
        ...     def __len__(self): return len(self.files)
        ...     def __getitem__(self, i): return load(self.files[i])
    """

    __torchmn_shared__ = True


def is_shared(dataset: Any) -> bool:
    """Whether ``dataset`` says every rank can open it (see :class:`SharedDataset`).

    Args:
        dataset: any object.

    Returns:
        True if ``dataset`` (or its class) sets ``__torchmn_shared__`` to a true value.

    Example::

        >>> torchmn.datasets.is_shared(Images(files)), torchmn.datasets.is_shared([1, 2])
        (True, False)
    """
    return bool(getattr(dataset, "__torchmn_shared__", False))


def scatter_index(n_total: Optional[int], comm, root: int = 0, *, force_equal_length: bool = True) -> tuple[int, int]:
    """This rank's ``(begin, end)`` range of ``range(n_total)``, ``n_total`` being root's.

    ChainerMN's signature and rule: every rank calls it together; only root's ``n_total`` counts,
    so the others may pass ``None`` (when only root knows the length) or anything else.
    ``force_equal_length=True``: every range has ``ceil(n_total / size)`` indices and starts at
    ``floor(n_total * rank / size)``, so neighbouring ranges overlap by a few indices when
    ``size`` does not divide ``n_total``; ``end`` never exceeds ``n_total``. ``False``: the
    ranges do not overlap and cover ``range(n_total)`` exactly; the first ``n_total % size``
    ranks get one more.

    Args:
        n_total: the number of indices to split; only root's counts.
        comm: the communicator whose ranks share the range.
        root: the rank whose ``n_total`` is used.
        force_equal_length: equal-length, possibly overlapping ranges (``True``) or disjoint
            ones (``False``), as described above.

    Returns:
        ``(begin, end)``: this rank's half-open range of indices.

    Raises:
        ValueError: ``root`` is not a rank of ``comm``, or root's ``n_total`` is not an integer
            ``>= 0`` (then every rank raises).

    Example::

        >>> torchmn.scatter_index(10, comm, force_equal_length=False)   # 3 ranks
        (0, 4) on rank 0, (4, 7) on rank 1, (7, 10) on rank 2
        >>> torchmn.scatter_index(10 if comm.rank == 0 else None, comm) # 3 ranks
        (0, 4) on rank 0, (3, 7) on rank 1, (6, 10) on rank 2
    """
    comm.check_rank(root, "root")
    problem = None
    if comm.rank == root:
        try:
            n_total = operator.index(n_total)
            if n_total < 0:
                problem = f"n_total must be >= 0, not {n_total}"
        except TypeError:
            problem = f"root rank {root}'s n_total must be an integer, not {type(n_total).__name__}"
    if comm.size > 1:
        problem, n_total = comm.bcast_obj((problem, n_total) if comm.rank == root else None, root=root)
    if problem:
        raise TorchmnValueError(f"scatter_index: {problem} (raised on rank {comm.rank})")
    return index_range(n_total, comm.size, comm.rank, force_equal_length)


def _claim(dataset: Any, comm, root: int, shuffle: bool, seed: Optional[int]) -> tuple[dict, Optional[torch.Tensor]]:
    """What this rank brings to the scatter, or what is wrong with it (told to every rank), and on
    root the order of the samples: drawn before any rank waits for a part, so that a seed torch
    cannot take is refused on every rank at once."""
    if comm.rank != root:
        if dataset is not None:
            return {"problem": f"rank {comm.rank} passed a dataset ({type(dataset).__name__}) but only root "
                               f"rank {root}'s dataset is read; pass None on every other rank, e.g. "
                               f"scatter_dataset(data if comm.rank == {root} else None, comm)"}, None
        return {}, None
    if dataset is None:
        return {"problem": f"root rank {root} passed None; it must pass the dataset to scatter"}, None
    try:
        n = len(dataset)
    except TypeError as e:
        return {"problem": f"root rank {root}'s dataset ({type(dataset).__name__}) has no len(): {e}"}, None
    except Exception as e:  # a dataset that opens its files lazily, say: every rank must hear of it
        return {"problem": f"root rank {root}'s len(dataset) ({type(dataset).__name__}) raised "
                           f"{type(e).__name__}: {e}"}, None
    try:
        order = _order(int(n), shuffle, seed)
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        return {"problem": f"root rank {root}'s seed {seed!r} cannot seed torch's generator ({type(e).__name__}: "
                           f"{e}); pass an integer from 0 to 2**64 - 1, or None for a random order"}, None
    return {"n": int(n), "shared": is_shared(dataset)}, order


def _order(n: int, shuffle: bool, seed: Optional[int]) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    g = torch.Generator()
    if seed is None:
        g.seed()  # a fresh random seed; only root draws, so all ranks still share the order
    else:
        g.manual_seed(int(seed))
    return torch.randperm(n, generator=g, dtype=torch.int64)


def _recv_part(comm, root: int) -> DatasetPart:
    indices, samples = receive_samples(lambda: comm.recv_obj(root, tag=TAG), "scatter_dataset", f"root rank {root}",
                                       comm.rank)
    return DatasetPart(samples, indices, positions=range(len(samples)))


def scatter_dataset(dataset: Any, comm, root: int = 0, shuffle: bool = False, seed: Optional[int] = None,
                    max_buf_len: int = DEFAULT_MAX_BUF_LEN, force_equal_length: bool = True) -> DatasetPart:
    """Split root's ``dataset`` among the ranks; every rank must call it and gets its own part.

    Only root's ``dataset`` is read; every other rank passes ``None`` (a rank that passes a
    dataset makes every rank raise :class:`ValueError`). Parts follow :func:`scatter_index` over
    the (shuffled) order: with ``force_equal_length=True`` every part has ``ceil(N / size)``
    samples and neighbouring parts may share a few; with ``False`` parts are disjoint and their
    lengths differ by at most one. Either way the parts together hold the whole dataset, and an
    empty dataset gives every rank an empty part.

    ``shuffle=True`` permutes the samples before splitting; root draws the permutation from a
    ``torch.Generator`` of its own seeded with ``seed`` (a random seed when ``None``) and sends
    it, so every rank uses the same order and the global random state is left alone.

    Samples are copied to their rank in chunks of at most ``max_buf_len`` pickled bytes, unless
    the dataset is a :class:`SharedDataset` (or sets ``__torchmn_shared__ = True``): then only
    the dataset object and the order are broadcast and each rank reads its own samples.

    In an elastic job (``torchmn run --min-np ...``) it returns an
    :class:`~torchmn.datasets.ElasticDatasetPart`: every rank then keeps the whole dataset (root
    sends every rank every sample once; a shared dataset's object as above), the part follows the
    world after each reset, and a rank that joins the running job gets the dataset from a peer
    when its ``@torchmn.elastic.run`` function starts (its call here does not communicate).

    Unpickles what the other ranks send, as torch's ``*_object`` collectives do: use it only among
    processes you trust (under ``torchmn run`` only the job's own reach its store; see ``docs/security.md``).

    Args:
        dataset: the dataset to split, on root (anything with ``len()`` and integer indexing);
            ``None`` on every other rank.
        comm: the communicator whose ranks get the parts.
        root: the rank that holds ``dataset``.
        shuffle: permute the samples before splitting.
        seed: the seed of root's permutation; ``None`` for a random one.
        max_buf_len: the most pickled bytes root sends in one chunk (a single larger sample
            travels alone).
        force_equal_length: equal-length, possibly overlapping parts (``True``) or disjoint ones
            (``False``), as for :func:`scatter_index`.

    Returns:
        This rank's :class:`DatasetPart` (an :class:`~torchmn.datasets.ElasticDatasetPart` in an
        elastic job).

    Raises:
        ValueError: ``root`` is not a rank or ``max_buf_len`` is not positive; or, on every rank,
            root passed ``None`` or a dataset without ``len()``, another rank passed a dataset,
            or root could not pickle its shared dataset.
        RuntimeError: this rank could not unpickle a sample of its part, or received fewer
            samples than its part holds.
        RemoteRankError: the scatter failed on another rank (root reading or sending a part,
            another rank unpickling its own); the rank where it failed raises its own error.

    Example::

        >>> train = torchmn.scatter_dataset(train if comm.rank == 0 else None, comm,
        ...                                 shuffle=True, seed=0)
        >>> loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True)
    """
    comm.check_rank(root, "root")
    if max_buf_len <= 0:
        raise TorchmnValueError(f"scatter_dataset: max_buf_len must be positive, not {max_buf_len}")
    elastic = membership.enabled()
    if elastic and membership.awaiting_state():
        # A rank that joined a running job: the others are in a reset, not here; the dataset comes
        # from them when the run function starts (ElasticDatasetPart.follow_world).
        return ElasticDatasetPart(None, None, comm, force_equal_length, shared=False, max_buf_len=max_buf_len)
    claim, order = _claim(dataset, comm, root, shuffle, seed)
    # The arguments every rank must agree on travel with the claims: ranks that each took
    # themselves for root would otherwise all send, and wait out the timeout.
    claims = comm.allgather_obj({**claim, "root": root, "force_equal_length": bool(force_equal_length)})
    for name in ("root", "force_equal_length"):
        if len({c[name] for c in claims}) > 1:
            said = ", ".join(f"rank {r}: {c[name]}" for r, c in enumerate(claims))
            raise TorchmnValueError(f"scatter_dataset: the ranks passed different {name} ({said}); every rank must "
                                    f"pass the same (raised on rank {comm.rank})")
    problems = [c["problem"] for c in claims if "problem" in c]
    if problems:
        raise TorchmnValueError("scatter_dataset: " + "; ".join(problems) + f" (raised on rank {comm.rank})")
    n, shared = claims[root]["n"], claims[root]["shared"]

    if shared:
        message = None
        if comm.rank == root:
            try:
                message = (None, pickle.dumps((dataset, order), protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as e:
                message = (f"{type(e).__name__}: {e}", None)
        problem, blob = comm.bcast_obj(message, root=root)
        if problem:
            raise TorchmnValueError(f"scatter_dataset: root rank {root} could not pickle its shared dataset "
                                    f"({problem}); a SharedDataset must be picklable, e.g. hold paths and open "
                                    f"files lazily (raised on rank {comm.rank})")
        if comm.rank != root:
            dataset, order = pickle.loads(blob)
        if elastic:
            return ElasticDatasetPart(dataset, order.tolist(), comm, force_equal_length, shared=True,
                                      max_buf_len=max_buf_len)
        b, e = index_range(n, comm.size, comm.rank, force_equal_length)
        return DatasetPart(dataset, order[b:e].tolist())

    part, error = None, None
    try:
        if elastic:
            part = _copy_whole(comm, dataset, n, order, force_equal_length, root, max_buf_len)
        elif comm.rank == root:
            part = _send_parts(comm, dataset, n, order, force_equal_length, root, max_buf_len)
        else:
            part = _recv_part(comm, root)
    except Exception as e:
        error = e
    # Ranks served before a failure already have their part; this makes them raise too.
    outcomes = comm.allgather_obj(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, why) for r, why in enumerate(outcomes) if why is not None]
    if failed:
        raise RemoteRankError(f"scatter_dataset failed on rank {failed[0][0]} ({failed[0][1]}); "
                              f"raised on rank {comm.rank} too")
    return part


def _warn_if_random(dataset: Any, i: int, root: int) -> None:
    """Warn, on root, when ``dataset[i]`` differs between two reads (a random transform in
    ``__getitem__``): the other ranks receive each sample once and would see that one draw in
    every epoch."""
    try:
        same = _equal(dataset[i], dataset[i])
    except Exception:  # noqa: BLE001 (reading it fails: sending it reports that on every rank)
        return
    if not same:
        warnings.warn(f"scatter_dataset: root rank {root}'s dataset[{i}] differs between two reads (a random "
                      f"transform in __getitem__?). The other ranks receive each sample once, as root read it, and "
                      f"would see that one draw in every epoch. Scatter the dataset without its random transform and "
                      f"wrap each rank's part: torchmn.datasets.TransformDataset(part, transform); or make it a "
                      f"torchmn.datasets.SharedDataset, which every rank reads itself.",
                      stacklevel=4)  # the user's scatter_dataset call: here, _send_parts or _copy_whole, scatter_dataset


def _equal(a: Any, b: Any) -> bool:
    """Whether two reads of a sample are the same (NaN equal to NaN; True where it cannot tell)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        try:
            return bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:  # no NaN in this dtype
            return bool(np.array_equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if type(a) is type(b) and type(a).__eq__ is object.__eq__:
        return True  # no == of its own: two reads are two objects, equal or not
    try:
        return bool(a == b) or (a != a and b != b)  # a float NaN
    except Exception:  # noqa: BLE001 (a type whose == says nothing useful)
        return True


def _send_parts(comm, dataset: Any, n: int, order: torch.Tensor, force_equal_length: bool,
                root: int, max_buf_len: int) -> DatasetPart:
    """Root: stream every other rank its part, in rank order; return root's own part."""
    parts = [order[slice(*index_range(n, comm.size, r, force_equal_length))].tolist() for r in range(comm.size)]
    pending = [r for r in range(comm.size) if r != root]
    first = next((parts[r][0] for r in pending if parts[r]), None)
    if first is not None:
        _warn_if_random(dataset, first, root)
    for k, r in enumerate(pending):
        try:
            send_samples(lambda m: comm.send_obj(m, r, tag=TAG), dataset, parts[r], max_buf_len)
        except Exception as e:
            # The rank being served was told; so is every rank still waiting, so none of them hangs.
            for waiting in pending[k + 1:]:
                comm.send_obj(("error", f"rank {r}'s part: {type(e).__name__}: {e}"), waiting, tag=TAG)
            raise
    return DatasetPart(dataset, parts[root])


def _copy_whole(comm, dataset: Any, n: int, order: Optional[torch.Tensor], force_equal_length: bool,
                root: int, max_buf_len: int) -> ElasticDatasetPart:
    """An elastic job's scatter: root broadcasts the order and every sample, so that any rank can
    take any part of a later world, and hand the samples to a rank that joins."""
    if comm.rank == root:
        order = comm.bcast_obj(order.tolist(), root=root)
        if n > 0 and comm.size > 1:
            _warn_if_random(dataset, 0, root)
        send_samples(lambda m: comm.bcast_obj(m, root=root), dataset, range(n), max_buf_len)
        whole = dataset
    else:
        order = comm.bcast_obj(None, root=root)
        _, whole = receive_samples(lambda: comm.bcast_obj(None, root=root), "scatter_dataset", f"root rank {root}",
                                   comm.rank)
    return ElasticDatasetPart(whole, order, comm, force_equal_length, shared=False, max_buf_len=max_buf_len)
