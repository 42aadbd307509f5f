"""Moving samples between ranks: a dataset's samples streamed as bounded chunks of pickled samples,
over point-to-point messages or a broadcast (:func:`send_samples`, :func:`receive_samples`).

Each sample is pickled on its own with torchmn's ``dumps``, so a row of a big tensor travels
without the big tensor, and the sender never holds more than one chunk of pickled samples. A
dataset that is only rows (a tensor, a NumPy array, a ``TensorDataset``) travels as blocks of rows
instead, taken with one indexing call per block: some thirty times faster than row by row.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import TensorDataset

from torchmn.communicators.errors import RemoteRankError
from torchmn.communicators.pickling import dumps
from torchmn.errors import TorchmnRuntimeError

DEFAULT_MAX_BUF_LEN = 256 * 1024 * 1024
TAG = 7301  # keeps dataset traffic apart from a user's own send_obj/recv_obj with the default tag

Put = Callable[[Any], None]
Get = Callable[[], Any]


def send_samples(put: Put, dataset: Any, indices: Sequence[int], max_buf_len: int) -> None:
    """Stream ``dataset[i]`` for each of ``indices`` through ``put``: the indices, then chunks of at
    most ``max_buf_len`` pickled bytes (a single larger sample travels alone), then an end mark.
    If reading or pickling a sample fails, the receiver is told before the error is raised here.

    Args:
        put: sends one picklable message to the receiver(s), e.g.
            ``lambda m: comm.send_obj(m, dest, tag=TAG)`` or ``lambda m: comm.bcast_obj(m, root)``.
        dataset: what the samples are read from.
        indices: the samples to send, in order.
        max_buf_len: the most pickled bytes in one chunk.

    Raises:
        Exception: what reading or pickling a sample raised (the receiver raises
            :class:`RemoteRankError`).

    Example::

        >>> send_samples(lambda m: comm.send_obj(m, 1, tag=TAG), data, range(len(data)), 1 << 20)
    """
    put(("part", list(indices)))
    arrays = _rows(dataset)
    if arrays is not None:
        _send_rows(put, dataset, arrays, list(indices), max_buf_len)
        return
    i = None
    try:
        chunk: list[bytes] = []
        nbytes = 0
        for i in indices:
            blob = dumps(dataset[i])
            if chunk and nbytes + len(blob) > max_buf_len:
                put(("chunk", chunk))
                chunk, nbytes = [], 0
            chunk.append(blob)
            nbytes += len(blob)
    except Exception as e:
        put(("error", f"sample {i}: {type(e).__name__}: {e}"))
        raise
    if chunk:
        put(("chunk", chunk))
    put(("end", None))


def _rows(dataset: Any) -> Optional[tuple]:
    """The arrays whose rows are ``dataset``'s samples, where it is nothing more (a tensor, a NumPy
    array of numbers, a ``TensorDataset``; not a subclass, whose items may be more than rows); else None."""
    if type(dataset) is torch.Tensor and dataset.ndim > 0:
        return (dataset,)
    # An array of Python objects (strings from pandas' .values, dicts) holds references, not rows of
    # bytes: its samples travel pickled one by one.
    if type(dataset) is np.ndarray and dataset.ndim > 0 and not dataset.dtype.hasobject:
        return (dataset,)
    if type(dataset) is TensorDataset and all(type(t) is torch.Tensor for t in dataset.tensors):
        return tuple(dataset.tensors)
    return None


def _send_rows(put: Put, dataset: Any, arrays: tuple, indices: list, max_buf_len: int) -> None:
    """Stream the rows ``indices`` of ``arrays`` in blocks of at most ``max_buf_len`` bytes (one row
    at least), each block taken with one indexing call."""
    single = type(dataset) is not TensorDataset
    chosen = indices[:1]
    try:  # whatever fails here, the receivers are told: they wait for the next message
        row_bytes = sum(a[0].nbytes for a in arrays) if indices else 1
        per_block = max(1, max_buf_len // max(1, row_bytes))
        for start in range(0, len(indices), per_block):
            chosen = indices[start:start + per_block]
            block = tuple(a[np.asarray(chosen)] if isinstance(a, np.ndarray) else a[torch.as_tensor(chosen)]
                          for a in arrays)
            put(("rows", (single, block)))
    except Exception as e:
        put(("error", f"samples {chosen[0]}-{chosen[-1]}: {type(e).__name__}: {e}" if chosen else
             f"{type(e).__name__}: {e}"))
        raise
    put(("end", None))


def _joined(blocks: list) -> Any:
    """The samples the blocks of rows make: one tensor or array, or a ``TensorDataset``."""
    single = blocks[0][0]
    columns = zip(*(block for _, block in blocks))
    joined = [np.concatenate(c) if isinstance(c[0], np.ndarray) else torch.cat(c) for c in columns]
    return joined[0] if single else TensorDataset(*joined)


def receive_samples(get: Get, what: str, sender: str, rank: int) -> tuple[list[int], list[Any]]:
    """Receive what :func:`send_samples` streams: the indices and the unpickled samples.

    Unpickles what the sender sends, as torch's ``*_object`` collectives do: use it only among
    processes you trust (see ``docs/security.md``).

    Args:
        get: receives one message, e.g. ``lambda: comm.recv_obj(src, tag=TAG)``.
        what: the call it serves, for messages (``"scatter_dataset"``).
        sender: who sends, for messages (``"root rank 0"``).
        rank: this rank, for messages.

    Returns:
        ``(indices, samples)``.

    Raises:
        RemoteRankError: the sender failed to read or pickle a sample.
        RuntimeError: a sample could not be unpickled here (the rest of the stream is read first,
            so the sender is not left waiting), or fewer samples came than announced.

    Example::

        >>> indices, samples = receive_samples(lambda: comm.recv_obj(0, tag=TAG), "scatter_dataset",
        ...                                     "root rank 0", comm.rank)
    """
    kind, indices = get()
    if kind == "error":
        raise RemoteRankError(f"{what}: {sender} failed while sending samples: {indices}; rank {rank} stops too")
    samples: Any = []
    blocks: list = []
    failure = None
    while True:
        kind, payload = get()
        if kind == "end":
            break
        if kind == "error":
            raise RemoteRankError(f"{what}: {sender} failed while sending samples: {payload}; rank {rank} stops too")
        if kind == "rows":
            blocks.append(payload)
        elif failure is None:
            try:
                samples.extend(pickle.loads(b) for b in payload)
            except Exception as e:  # a sample's class missing here, say
                failure = e
    if failure is not None:
        raise TorchmnRuntimeError(f"{what}: rank {rank} could not unpickle a sample from {sender} "
                                  f"({type(failure).__name__}: {failure}); every rank must be able to import the "
                                  f"dataset's sample types") from failure
    if blocks:
        samples = _joined(blocks)
    if len(samples) != len(indices):
        raise TorchmnRuntimeError(f"{what}: rank {rank} received {len(samples)} samples from {sender} but expected "
                                  f"{len(indices)}")
    return indices, samples
