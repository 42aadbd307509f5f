"""Pickling for object collectives: a tensor travels as its own elements, not its whole storage.

Plain pickle writes a tensor's entire storage, so a row of a big tensor (a ``TensorDataset``
item, a batch cut with ``torch.split``) would carry the big tensor with it, once per row. Here
such views are cloned on the way out, wherever they sit in the object (tuples, namedtuples,
dataclasses, dict and list subclasses keep their types, since nothing else is rebuilt).
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin


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
