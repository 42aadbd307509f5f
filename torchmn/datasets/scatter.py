"""Splitting one dataset among ranks: :func:`scatter_dataset` and :func:`scatter_index`.

A rank's part is either copied from root, in bounded chunks of pickled samples, or, for a
:class:`SharedDataset` that every rank can open itself, read by the rank itself from the dataset
object root broadcasts. ``docs/design/data-and-extensions.md`` explains the two ways and how a
failure on one rank reaches the others.
"""
from __future__ import annotations

import operator
import pickle
from typing import Any, Optional, Sequence

import torch
from torch.utils.data import Dataset

from torchmn.communicators.pickling import dumps
from torchmn.communicators.errors import RemoteRankError
from torchmn.errors import TorchmnRuntimeError, TorchmnValueError

DEFAULT_MAX_BUF_LEN = 256 * 1024 * 1024
_TAG = 7301  # keeps scatter traffic apart from a user's own send_obj/recv_obj with the default tag


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


class DatasetPart(Dataset):
    """One rank's part of a scattered dataset, as :func:`scatter_dataset` returns it.

    ``indices`` are the positions of its items in root's dataset (after shuffling), so
    ``part[i]`` is ``dataset[part.indices[i]]``. Indexing works as for a list: negative integers
    count from the end, and a slice gives a list of items.

    Args:
        base: the dataset the items are read from: root's dataset, or the samples this rank
            received.
        indices: the positions of the part's items in root's dataset.
        positions: where each item is in ``base``; ``None`` means ``indices`` (``base`` is then
            the whole dataset).

    Example::

        >>> part = torchmn.scatter_dataset(data if comm.rank == 0 else None, comm)
        >>> len(part), part.indices[:3]    # rank 0 of 3, 1000 samples
        (334, [0, 1, 2])
    """

    def __init__(self, base: Any, indices: Sequence[int], positions: Optional[Sequence[int]] = None):
        self.base = base
        self.indices = list(indices)
        self._positions = self.indices if positions is None else list(positions)

    def __len__(self) -> int:
        """The number of items in this rank's part.

        Returns:
            ``len(self.indices)``.

        Example::

            >>> len(DatasetPart(range(10, 20), indices=[3, 4, 5]))
            3
        """
        return len(self.indices)

    def __getitem__(self, i: Any) -> Any:
        """The part's item ``i``, or a list of the items in a slice, as for a list.

        Args:
            i: an integer (negative ones count from the end; numpy and 0-d tensor integers too), or
                a slice.

        Returns:
            The item, read from ``base``; for a slice, a list of items.

        Raises:
            TypeError: ``i`` is neither an integer nor a slice.
            IndexError: ``i`` is out of range (which also ends Python's iteration over the part).

        Example::

            >>> part = DatasetPart(range(10, 20), indices=[3, 4, 5])
            >>> part[-1], part[0:2]
            (15, [13, 14])
        """
        n = len(self.indices)
        if isinstance(i, slice):  # as for a list (and ChainerMN's SubDataset): a list of items
            return [self[j] for j in range(*i.indices(n))]
        i = operator.index(i)  # numpy and 0-d tensor integers too, as samplers may yield them
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"index {i} out of range for a dataset part of length {n}")
        return self.base[self._positions[j]]


def index_range(n_total: int, size: int, rank: int, force_equal_length: bool) -> tuple[int, int]:
    """Rank ``rank``'s share of ``range(n_total)`` among ``size`` ranks, by :func:`scatter_index`'s
    rule, computed locally (no communication).

    Args:
        n_total: the number of indices to split.
        size: the number of ranks.
        rank: the rank whose range is wanted.
        force_equal_length: equal-length, possibly overlapping ranges, or disjoint ones.

    Returns:
        ``(begin, end)``: the rank's half-open range of indices.

    Example::

        >>> [index_range(10, 3, r, False) for r in range(3)]
        [(0, 4), (4, 7), (7, 10)]
        >>> [index_range(10, 3, r, True) for r in range(3)]
        [(0, 4), (3, 7), (6, 10)]
    """
    if force_equal_length:
        n_sub = -(-n_total // size)  # ceil
        begin = n_total * rank // size
        return begin, begin + n_sub
    q, r = divmod(n_total, size)
    begin = rank * q + min(rank, r)
    return begin, begin + q + (1 if rank < r else 0)


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


def _claim(dataset: Any, comm, root: int) -> dict:
    """What this rank brings to the scatter, or what is wrong with it (told to every rank)."""
    if comm.rank != root:
        if dataset is not None:
            return {"problem": f"rank {comm.rank} passed a dataset ({type(dataset).__name__}) but only root "
                               f"rank {root}'s dataset is read; pass None on every other rank, e.g. "
                               f"scatter_dataset(data if comm.rank == {root} else None, comm)"}
        return {}
    if dataset is None:
        return {"problem": f"root rank {root} passed None; it must pass the dataset to scatter"}
    try:
        n = len(dataset)
    except TypeError as e:
        return {"problem": f"root rank {root}'s dataset ({type(dataset).__name__}) has no len(): {e}"}
    return {"n": int(n), "shared": is_shared(dataset)}


def _order(n: int, shuffle: bool, seed: Optional[int]) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n, dtype=torch.int64)
    g = torch.Generator()
    if seed is None:
        g.seed()  # a fresh random seed; only root draws, so all ranks still share the order
    else:
        g.manual_seed(int(seed))
    return torch.randperm(n, generator=g, dtype=torch.int64)


def _send_part(comm, dataset: Any, indices: list[int], dest: int, max_buf_len: int) -> None:
    """Stream ``dataset[indices]`` to ``dest``: pickled once per sample, packed into bounded chunks."""
    comm.send_obj(("part", indices), dest, tag=_TAG)
    chunk: list[bytes] = []
    nbytes = 0
    for i in indices:
        blob = dumps(dataset[i])  # a row of a big tensor travels without the big tensor
        if chunk and nbytes + len(blob) > max_buf_len:
            comm.send_obj(("chunk", chunk), dest, tag=_TAG)
            chunk, nbytes = [], 0
        chunk.append(blob)  # a single sample over max_buf_len travels alone (send_obj chunks it)
        nbytes += len(blob)
    if chunk:
        comm.send_obj(("chunk", chunk), dest, tag=_TAG)
    comm.send_obj(("end", None), dest, tag=_TAG)


def _recv_part(comm, root: int) -> DatasetPart:
    kind, indices = comm.recv_obj(root, tag=_TAG)
    if kind == "error":
        raise RemoteRankError(f"scatter_dataset: root rank {root} failed while sending rank {comm.rank}'s "
                              f"part: {indices}")
    samples: list[Any] = []
    failure = None
    while True:
        kind, payload = comm.recv_obj(root, tag=_TAG)
        if kind == "end":
            break
        if kind == "error":
            raise RemoteRankError(f"scatter_dataset: root rank {root} failed while sending rank "
                                  f"{comm.rank}'s part: {payload}")
        if failure is None:
            try:
                samples.extend(pickle.loads(b) for b in payload)
            except Exception as e:  # a sample's class missing here, say
                # Read the rest of the part anyway: root is still sending it, and would wait in its
                # send until the timeout instead of reaching the check that tells every rank.
                failure = e
    if failure is not None:
        raise TorchmnRuntimeError(f"scatter_dataset: rank {comm.rank} could not unpickle a sample of its part "
                                  f"({type(failure).__name__}: {failure}); every rank must be able to import the "
                                  f"dataset's sample types") from failure
    if len(samples) != len(indices):
        raise TorchmnRuntimeError(f"scatter_dataset: rank {comm.rank} received {len(samples)} samples from root "
                                  f"rank {root} but expected {len(indices)}")
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
        This rank's :class:`DatasetPart`.

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
    claims = comm.allgather_obj(_claim(dataset, comm, root))
    problems = [c["problem"] for c in claims if "problem" in c]
    if problems:
        raise TorchmnValueError("scatter_dataset: " + "; ".join(problems) + f" (raised on rank {comm.rank})")
    n, shared = claims[root]["n"], claims[root]["shared"]

    if shared:
        message = order = None
        if comm.rank == root:
            try:
                order = _order(n, shuffle, seed)
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
        b, e = index_range(n, comm.size, comm.rank, force_equal_length)
        return DatasetPart(dataset, order[b:e].tolist())

    part, error = None, None
    try:
        part = _recv_part(comm, root) if comm.rank != root else _send_parts(comm, dataset, n, shuffle, seed,
                                                                            force_equal_length, root, max_buf_len)
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


def _send_parts(comm, dataset: Any, n: int, shuffle: bool, seed: Optional[int], force_equal_length: bool,
                root: int, max_buf_len: int) -> DatasetPart:
    """Root: stream every other rank its part, in rank order; return root's own part."""
    order = _order(n, shuffle, seed)
    parts = [order[slice(*index_range(n, comm.size, r, force_equal_length))].tolist() for r in range(comm.size)]
    pending = [r for r in range(comm.size) if r != root]
    for k, r in enumerate(pending):
        try:
            _send_part(comm, dataset, parts[r], r, max_buf_len)
        except Exception as e:
            # Tell the rank being served and every rank still waiting, so none of them hangs.
            for waiting in pending[k:]:
                comm.send_obj(("error", f"{type(e).__name__}: {e}"), waiting, tag=_TAG)
            raise
    return DatasetPart(dataset, parts[root])
