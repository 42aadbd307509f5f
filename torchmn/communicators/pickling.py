"""Pickling for object collectives: a tensor travels as its own elements, not its whole storage.

Plain pickle writes a tensor's entire storage, so a row of a big tensor (a ``TensorDataset``
item, a batch cut with ``torch.split``) would carry the big tensor with it, once per row. Here
such views are cloned on the way out, wherever they sit in the object (tuples, namedtuples,
dataclasses, dict and list subclasses keep their types, since nothing else is rebuilt).
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import torch
from torch.nn.parameter import UninitializedTensorMixin

from torchmn.communicators.errors import RemoteRankError
from torchmn.errors import TorchmnTypeError


class _Pickler(pickle.Pickler):
    def __init__(self, file, to_cpu: bool):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._to_cpu = to_cpu
        self._copies: list[torch.Tensor] = []  # alive until the dump ends, so no id is reused

    def reducer_override(self, obj: Any) -> Any:
        # Subclasses too (a dataset's own tensor type): clone() keeps their type. Not parameters,
        # which pickle as parameters.
        if not isinstance(obj, torch.Tensor) or isinstance(obj, (torch.nn.Parameter, UninitializedTensorMixin)) \
                or obj.layout is not torch.strided:
            return NotImplemented
        moved = self._to_cpu and obj.device.type != "cpu"
        try:
            oversized = obj.untyped_storage().nbytes() > obj.numel() * obj.element_size()
        except (RuntimeError, TypeError, ValueError):  # a subclass without a storage of its own
            return NotImplemented
        if not (moved or oversized):
            return NotImplemented
        # detach: a copy made with autograd on would be a non-leaf, which pickle refuses
        copy = obj.detach().to("cpu" if moved else obj.device, copy=True).requires_grad_(obj.requires_grad)
        self._copies.append(copy)
        return copy.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def dumps(obj: Any, to_cpu: bool = False) -> bytes:
    """``pickle.dumps(obj)``, but tensor views are sent as copies of what they show.

    Args:
        obj: any picklable object; tensors may sit anywhere in it.
        to_cpu: also move every tensor to CPU (a GPU tensor would otherwise unpickle onto the
            sender's GPU index on the receiver).

    Returns:
        The pickled bytes.

    Example::

        >>> big = torch.zeros(1000, 1000)
        >>> len(dumps(big[0])) < 10_000          # pickle.dumps(big[0]) is 4 MB
        True
    """
    buf = io.BytesIO()
    _Pickler(buf, to_cpu).dump(obj)
    return buf.getvalue()


def pickle_for_call(obj: Any, kind: str, rank: int, host: str) -> tuple[Optional[torch.Tensor], Optional[Exception]]:
    """``obj`` pickled (:func:`dumps`) into a byte tensor for object collective ``kind``, or the error
    to raise once the other ranks have been told that this rank has nothing to send.

    Args:
        obj: the object.
        kind: the collective, for the message (``"bcast_obj"``).
        rank, host: this rank and its host, for the message.

    Returns:
        ``(bytes, None)``, or ``(None, TypeError)`` naming the rank, its host and why pickle failed.

    Example::

        >>> buf, err = pickle_for_call({"loss": 0.5}, "bcast_obj", 0, "node0")
        >>> err is None and buf.dtype == torch.uint8
        True
    """
    try:
        return torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8), None
    except Exception as e:  # pickle fails in many ways (PicklingError, TypeError, AttributeError)
        err = TorchmnTypeError(f"{kind}: rank {rank} on {host} cannot pickle its object ({type(obj).__name__}): {e}")
        err.__cause__ = e
        return None, err


def unpickle_from(buf: torch.Tensor, kind: str, source: int, rank: int, host: str) -> Any:
    """The object rank ``source`` sent in object collective ``kind``.

    Args:
        buf: the pickled bytes, a uint8 tensor.
        kind: the collective, for the message.
        source: the rank that pickled it.
        rank, host: this rank and its host, for the message.

    Returns:
        The object.

    Raises:
        RemoteRankError: it cannot be unpickled here (its class is not importable, or differs).

    Example::

        >>> buf, _ = pickle_for_call([1, 2], "bcast_obj", 0, "node0")
        >>> unpickle_from(buf, "bcast_obj", 0, 1, "node1")
        [1, 2]
    """
    try:
        return pickle.loads(buf.cpu().numpy().tobytes())
    except Exception as e:  # unpickling runs the sender's classes' code: any error can come out
        raise RemoteRankError(f"{kind}: rank {source}'s object was pickled but cannot be unpickled on rank "
                              f"{rank} ({host}): {type(e).__name__}: {e}; is its class importable, "
                              f"with the same code, on every rank?") from e


def as_if_sent(obj: Any, kind: str, rank: int, host: str, keep: bool = False) -> Any:
    """What a world of one hands back for its own ``obj`` in object collective ``kind``: what a larger
    world would, pickling included, so that an object no other rank could receive (a lambda, an open
    file) fails in a single-process run too, not first at scale.

    Args:
        obj: the object.
        kind: the collective, for the message.
        rank, host: this rank and its host, for the message.
        keep: hand back ``obj`` itself (as ``bcast_obj``'s root and ``gather_obj``'s keep theirs);
            else the unpickled copy (as ``allgather_obj`` gives for a rank's own small object).

    Returns:
        ``obj``, or its copy.

    Raises:
        TypeError: ``obj`` cannot be pickled (the message names the rank, its host and why).

    Example::

        >>> as_if_sent({"loss": 0.5}, "allgather_obj", 0, "node0")
        {'loss': 0.5}
    """
    buf, err = pickle_for_call(obj, kind, rank, host)
    if err is not None:
        raise err
    return obj if keep else unpickle_from(buf, kind, rank, rank, host)
