"""The call check: before moving data, every rank learns what call each rank made.

Each tensor collective first exchanges one header row per tensor (see ``_wire.header``): which
collective, its root and op, the dtype and shape. :func:`check_headers` then raises the same
error on every rank where the calls disagree, instead of letting mismatched collectives hang or
mix data. A rank whose own arguments were bad sends an ``invalid`` row, so the others fail with
it rather than wait for it. A collective made by a backward pass (:func:`backward_pass`) carries
its kind with :data:`BACKWARD` added, so that it never pairs with a forward call of the same kind
and shape on a rank that skipped that backward.
"""
from __future__ import annotations

import contextlib
import numbers
import socket
import threading
import zlib
from typing import Optional

import torch

from torchmn.communicators import _wire
from torchmn.communicators.errors import CollectiveMismatchError, RemoteRankError
from torchmn.communicators.ops import OPS
from torchmn.errors import TorchmnTypeError, TorchmnValueError

# Collective kinds, as they travel in headers. Order is part of the wire format: append only.
KINDS = ("invalid", "bcast", "gather", "allgather", "scatter", "alltoall", "allreduce", "allgather_obj",
         "bcast_obj", "gather_obj", "scatter_obj", "multi_node_mean_grad", "allreduce_obj", "split",
         "check_same_layout", "barrier")
KIND = {name: i for i, name in enumerate(KINDS)}
BACKWARD = 1 << 8  # added to the kind of a call a backward pass makes (see backward_pass)
_pass = threading.local()
OP_CODES = {name: i for i, name in enumerate(OPS)}
# The last headers check_headers passed, by identity: a node's segment hands back one tensor per
# call signature where every rank made that call, and never changes it, so the same tensor agrees
# again without being read.
_agreed: Optional[torch.Tensor] = None


@contextlib.contextmanager
def backward_pass():
    """Mark the collectives made inside as a backward pass's (an autograd Function's backward),
    on this thread; also a decorator.

    A rank whose loss does not use a collective's output skips that collective's backward; its
    next forward collective of the same kind and shape would otherwise pair with another rank's
    backward one and mix their data without a word. Marked, the two differ in the call check,
    which raises a :class:`~torchmn.communicators.errors.CollectiveMismatchError` on every rank.

    Example::

        >>> @staticmethod
        ... @once_differentiable
        ... @backward_pass()
        ... def backward(ctx, gy):
        ...     return None, ctx.comm.allreduce(gy.contiguous())
    """
    outer = getattr(_pass, "backward", False)
    _pass.backward = True
    try:
        yield
    finally:
        _pass.backward = outer


def in_backward_pass() -> bool:
    """Whether this thread is inside :func:`backward_pass`."""
    return getattr(_pass, "backward", False)


def mark_backward(rows: list[list[int]]) -> list[list[int]]:
    """``rows`` with :data:`BACKWARD` added to each kind where this thread is inside
    :func:`backward_pass` (an ``invalid`` row stays one), else ``rows`` themselves."""
    if not in_backward_pass():
        return rows
    return [row if row[0] == KIND["invalid"] else [row[0] + BACKWARD, *row[1:]] for row in rows]


def kind_name(code: int) -> str:
    """The name of header kind ``code``, a backward pass's included."""
    if code >= BACKWARD:
        return f"{KINDS[code - BACKWARD]} (in a backward pass)"
    return KINDS[code]


def split_entries(entries: list, rank: int) -> list:
    """Every rank's ``(color, key, ...)`` of a ``split``, once each color and key is an int.

    Raises:
        TypeError: on every rank alike, naming the ranks whose color or key is not an int.
    """
    bad = [(r, e[0], e[1]) for r, e in enumerate(entries) if not all(isinstance(v, numbers.Integral) for v in e[:2])]
    if bad:
        raise TorchmnTypeError("split: color and key must be ints (ranks of one color form one communicator, "
                               "ordered by key); " + ", ".join(f"rank {r} passed color={c!r}, key={k!r}"
                                                               for r, c, k in bad) + f" (raised on rank {rank})")
    return entries


def op_code(op: Optional[str]) -> int:
    """The header code of reduction ``op`` (``NONE`` for calls without one)."""
    return OP_CODES[op] if op is not None else _wire.NONE


def invalid_rows(count: int, op: Optional[str] = None) -> list[list[int]]:
    """The rows a rank sends when its own arguments were bad (it raises once the others know)."""
    return [_wire.header(KIND["invalid"], _wire.NONE, op_code(op))] * max(1, count)


def summary_row(rows: list[list[int]]) -> list[int]:
    """What a call of several rows is, in one row: its kind, root and op, no tensor.

    A call of several rows (scatter, alltoall) first agrees on this, so that a rank making a
    one-row call meanwhile exchanges as many bytes as this one and the mismatch is named, instead
    of the exchange itself failing.
    """
    return rows[0][:3] + [_wire.NONE, _wire.NONE] + [0] * _wire.MAX_NDIM + [rows[0][_wire.DEVICE]]


def obj_header(n: int, kind: str = "allgather_obj", root: int = _wire.NONE) -> list[int]:
    """The call header of object collective ``kind`` from ``root``, with ``n`` pickled bytes (this
    rank's, or root's in bcast_obj) where the shape goes."""
    row = _wire.header(KIND[kind], root)
    row[_wire.SHAPE] = n
    return row


def layout_difference(layouts: list, root: int) -> Optional[tuple[list[int], str]]:
    """Where every rank's tensor layout (a list of ``(shape, dtype)``) differs from root's.

    Args:
        layouts: every rank's layout, in rank order.
        root: the rank whose layout is the reference.

    Returns:
        ``(the ranks that differ, the first difference in words)``; None where every rank agrees.

    Example::

        >>> layout_difference([[((2,), "float32")], [((3,), "float32")]], 0)
        ([1], 'tensor 0 is (3,) float32 there, (2,) float32 on rank 0')
    """
    bad = [r for r, lay in enumerate(layouts) if lay != layouts[root]]
    if not bad:
        return None
    theirs, ours = layouts[bad[0]], layouts[root]
    diff = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), None)
    if diff is None:
        return bad, f"{len(theirs)} tensors there, {len(ours)} on rank {root}"
    return bad, f"tensor {diff} is {theirs[diff][0]} {theirs[diff][1]} there, {ours[diff][0]} {ours[diff][1]} on rank {root}"


def check_headers(kind: str, hdrs: torch.Tensor, error: Optional[Exception], same_shape: bool,
                  same_dtype: bool, rank: int, hosts: Optional[list[str]]) -> None:
    """Raise on every rank alike unless all ranks made the same call.

    Args:
        kind: the collective this rank called.
        hdrs: every rank's header rows, ``[size, rows, HEADER_LEN]``.
        error: this rank's own bad arguments, raised first.
        same_shape: whether every rank's tensor must have one shape (allreduce).
        same_dtype: whether every rank's tensor must have one dtype.
        rank: this rank, and ``hosts`` every rank's host (None before the communicator knows
            them), for the message.

    Raises:
        CollectiveMismatchError: the ranks' calls differ in collective, root, op, dtype or shape.
        RemoteRankError: another rank rejected its own arguments.
    """
    global _agreed
    if error is not None:
        raise error
    if hdrs is _agreed:  # the very headers that agreed last time (a node's segment hands them back)
        return
    # The common case first, in plain Python: every rank sent the same rows (tensor indexing
    # below costs about 20 us, more than a small collective's data takes through shared memory).
    rows = hdrs.tolist()
    if rows[0][0][0] != KIND["invalid"] and all(r == rows[0] for r in rows[1:]):
        _agreed = hdrs
        return
    size = hdrs.shape[0]
    bad = [r for r in range(size) if hdrs[r, 0, 0] == KIND["invalid"]]
    if bad:
        host = hosts[rank] if hosts else socket.gethostname()
        raise RemoteRankError(f"{kind}: rank {bad[0]}{_on(hosts, bad[0])} rejected its arguments (see its error); "
                              f"rank {rank} on {host} stops too")
    first = hdrs[:, 0, :]
    problems = []
    for field, col, names in (("collective", 0, kind_name), ("root", 1, None), ("op", 2, tuple(OPS).__getitem__)):
        vals = first[:, col].tolist()
        if len(set(vals)) > 1:
            shown = [names(v) if names and v >= 0 else "none" if v == _wire.NONE else v for v in vals]
            problems.append(f"{field} differs: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
            if col == 0:  # other collectives take other roots and ops: those follow, and would only blur it
                if any(v >= BACKWARD for v in vals) and not all(v >= BACKWARD for v in vals):
                    problems.append("a rank skipped a backward pass through a collective's output: every rank "
                                    "must backpropagate through it, its loss using the output")
                break
    if not problems and hdrs.shape[1] == 1:
        metas = [_wire.meta(first[r].tolist()) for r in range(size)]
        present = [(r, m) for r, m in enumerate(metas) if m is not None]
        if same_dtype and len({m[0] for _, m in present}) > 1:
            problems.append("dtype differs: " + ", ".join(f"rank {r}: {m[0]}" for r, m in present))
        if same_shape and len({m[1] for _, m in present}) > 1:
            problems.append("shape differs: " + ", ".join(f"rank {r}: {tuple(m[1])}" for r, m in present))
    if not problems:
        # Every tensor of one call on one kind of device: CUDA tensors travel through NCCL, CPU
        # tensors through gloo, and the two cannot meet.
        codes = [(r, int(c)) for r, c in enumerate(first[:, _wire.DEVICE].tolist()) if c != _wire.NONE]
        if len({c for _, c in codes}) > 1:
            problems.append("device differs: " + ", ".join(f"rank {r}: {_wire.DEVICE_TYPES[c]}" for r, c in codes) +
                            " (move the tensors to comm.device on every rank, or keep them on the CPU on every rank)")
    if problems:
        raise CollectiveMismatchError(f"ranks called {kind} inconsistently ({'; '.join(problems)}){_where(hosts)}; "
                                      f"every rank must make the same call")


def _on(hosts: Optional[list[str]], r: int) -> str:
    return f" (on {hosts[r]})" if hosts else ""


def _where(hosts: Optional[list[str]]) -> str:
    """Where the ranks run, for a mismatch message: runs of consecutive ranks on one host."""
    if not hosts:
        return ""
    if len(set(hosts)) == 1:
        return f", all on {hosts[0]}"
    runs: list[list] = []
    for r, h in enumerate(hosts):
        if runs and runs[-1][2] == h:
            runs[-1][1] = r
        else:
            runs.append([r, r, h])
    return ", " + ", ".join(f"rank {a} on {h}" if a == b else f"ranks {a}-{b} on {h}" for a, b, h in runs)


def unsendable(x) -> Optional[str]:
    """Why ``send`` cannot send ``x``, or None.

    Args:
        x: what the script passed.

    Returns:
        The reason, for a message; None for a tensor that can travel.

    Example::

        >>> unsendable((a, b))
        'pass a tensor, not tuple (send each tensor of a tuple on its own, or send_obj)'
    """
    if not isinstance(x, torch.Tensor):
        return f"pass a tensor, not {type(x).__name__} (send each tensor of a tuple on its own, or send_obj)"
    try:
        _wire.header(KIND["bcast"], x=x)  # what the header refuses: a dtype or a rank that cannot travel
    except (TorchmnTypeError, TorchmnValueError) as e:
        return str(e)
    return None


def refuse_failed_send(row: list, source: int, rank: int) -> None:
    """Raise, in ``recv``, where the header ``row`` says that ``source``'s send failed there.

    Args:
        row: the header received.
        source: the sending rank.
        rank: this rank.

    Raises:
        RemoteRankError: the header is the one a failed send sends.

    Example::

        >>> refuse_failed_send(hdr.tolist(), 0, comm.rank)
    """
    if _wire.meta(row) is None:
        raise RemoteRankError(f"recv from rank {source}: rank {source}'s send to rank {rank} failed there (see its "
                              f"error); rank {rank} raises too")


def mean_grad_row(layout: int, params: list, zero_fill: bool) -> list[int]:
    """``multi_node_mean_grad``'s call-check row: a checksum of the parameters' layout, how many
    gradients are sparse, how many are None and a checksum of which, and ``zero_fill``.

    Args:
        layout: the checksum of the trainable parameters' shapes and dtypes.
        params: the trainable parameters.
        zero_fill: the call's argument.

    Returns:
        The header row.

    Example::

        >>> row = mean_grad_row(checksum, params, zero_fill=False)
    """
    missing = bytes(p.grad is None for p in params)
    row = _wire.header(KIND["multi_node_mean_grad"])
    row[_wire.SHAPE:_wire.SHAPE + 5] = [layout, sum(1 for p in params if p.grad is not None and p.grad.is_sparse),
                                        missing.count(1), zlib.crc32(missing), int(zero_fill)]
    return row


def check_zero_fill(fills: list[int], rank: int) -> None:
    """Refuse ranks that pass different ``zero_fill``: they would pair other tensors.

    Args:
        fills: every rank's ``zero_fill`` (from :func:`mean_grad_row`).
        rank: this rank.

    Raises:
        CollectiveMismatchError: they differ.

    Example::

        >>> check_zero_fill([1, 1, 0], comm.rank)   # CollectiveMismatchError naming each rank's
    """
    if len(set(fills)) > 1:
        said = ", ".join(f"rank {r}: {bool(f)}" for r, f in enumerate(fills))
        raise CollectiveMismatchError(f"multi_node_mean_grad: zero_fill differs between ranks ({said}); pass the same "
                                      f"on every rank (raised on rank {rank})")


def missing_grads_error(masks: list[list[bool]], params: list, rank: int) -> CollectiveMismatchError:
    """The error for gradients that are None on some ranks only (without ``zero_fill``).

    Args:
        masks: every rank's list of which parameters have a gradient.
        params: the trainable parameters.
        rank: this rank.

    Returns:
        The error, naming the first such parameter and the ranks without its gradient.

    Example::

        >>> raise missing_grads_error(comm.allgather_obj(mask), params, comm.rank)
    """
    mixed = [i for i in range(len(params)) if len({m[i] for m in masks}) > 1]
    without = [r for r, m in enumerate(masks) if not m[mixed[0]]]
    return CollectiveMismatchError(
        f"multi_node_mean_grad: the gradient of parameter {mixed[0]} (shape {tuple(params[mixed[0]].shape)}) is None "
        f"on rank(s) {without} only ({len(mixed)} such parameters); pass zero_fill=True to count a missing gradient as "
        f"zeros (raised on rank {rank})")
