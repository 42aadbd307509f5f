"""Moving samples between ranks: a dataset's samples streamed as bounded chunks of pickled samples,
over point-to-point messages or a broadcast (:func:`send_samples`, :func:`receive_samples`).

Each sample is pickled on its own with torchmn's ``dumps``, so a row of a big tensor travels
without the big tensor, and the sender never holds more than one chunk of pickled samples.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Sequence

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
    samples: list[Any] = []
    failure = None
    while True:
        kind, payload = get()
        if kind == "end":
            break
        if kind == "error":
            raise RemoteRankError(f"{what}: {sender} failed while sending samples: {payload}; rank {rank} stops too")
        if failure is None:
            try:
                samples.extend(pickle.loads(b) for b in payload)
            except Exception as e:  # a sample's class missing here, say
                failure = e
    if failure is not None:
        raise TorchmnRuntimeError(f"{what}: rank {rank} could not unpickle a sample from {sender} "
                                  f"({type(failure).__name__}: {failure}); every rank must be able to import the "
                                  f"dataset's sample types") from failure
    if len(samples) != len(indices):
        raise TorchmnRuntimeError(f"{what}: rank {rank} received {len(samples)} samples from {sender} but expected "
                                  f"{len(indices)}")
    return indices, samples
