"""A model whose parts live on different ranks (ChainerMN's ``MultiNodeChainList``)."""
from __future__ import annotations

import collections
from typing import Iterable, Optional, Union

import torch

from torchmn.communicators import CollectiveMismatchError, CommunicatorBase
from torchmn.errors import TorchmnRuntimeError, TorchmnTypeError, TorchmnValueError
from torchmn.functions import pseudo_connect, recv, send

Ranks = Union[int, Iterable[int], None]


def _as_list(ranks: Ranks, what: str) -> Optional[list]:
    if ranks is None:
        return None
    items = [ranks] if isinstance(ranks, int) else list(ranks)
    if not items or not all(isinstance(r, int) and not isinstance(r, bool) for r in items):
        raise TorchmnTypeError(f"add: {what} must be a rank, a list of ranks or None, not {ranks!r}")
    return items


class MultiNodeSequential(torch.nn.Module):
    """A model split over ranks: each rank adds its own parts, saying where each part's input comes
    from and where its output goes, and holds only its own parameters.

    ``model(x)`` runs this rank's parts in the order they were added: a part with ``rank_in=None``
    takes ``x`` (the first) or this rank's earlier data; otherwise it receives from each rank of
    ``rank_in`` (several: a merge, called with one argument per rank). Its output is returned
    (``rank_out=None``, at most one part per rank) or sent to each rank of ``rank_out`` (several: a
    branch). Chains, branches, merges, cycles (0 -> 1 -> 0) and tuples between parts work. Every
    rank of ``comm`` calls ``model(...)`` (``None`` where it has no input of its own).

    The result is this rank's output where it has a part with ``rank_out=None``, else the delegate
    of its last send; a backward from the loss on the output, or ``delegate.backward()`` elsewhere,
    trains every part on every rank. The first call checks, on every rank, that the ranks' sends
    and receives pair up.

    Args:
        comm: the communicator whose ranks hold the parts.

    Example::

        >>> model = torchmn.nn.MultiNodeSequential(comm)
        >>> if comm.rank == 0:
        ...     model.add(torch.nn.Linear(784, 100), rank_in=None, rank_out=1)
        ...     model(x).backward()                        # the delegate
        ... else:
        ...     model.add(torch.nn.Linear(100, 10), rank_in=0, rank_out=None)
        ...     loss_fn(model(None), y).backward()
    """

    def __init__(self, comm: CommunicatorBase):
        super().__init__()
        self.comm = comm
        self.parts = torch.nn.ModuleList()
        self.routes: list[tuple[Optional[list], Optional[list]]] = []
        self._checked = False

    def add(self, module: torch.nn.Module, rank_in: Ranks = None, rank_out: Ranks = None) -> "MultiNodeSequential":
        """Add a part of this rank.

        Args:
            module: the part.
            rank_in: where its input comes from: None (this rank's input), a rank, or a list of
                ranks (a merge: the part is called with one argument per rank, in that order).
            rank_out: where its output goes: None (returned by ``model(...)``), a rank, or a list
                of ranks (a branch). This rank itself may appear in both, to pass data between its
                own parts.

        Returns:
            The model, so that calls chain.

        Raises:
            TypeError: a rank that is not an integer.
            ValueError: a second part with ``rank_out=None`` on this rank.

        Example::

            >>> if comm.rank == 1:                # a middle stage: from rank 0, to rank 2
            ...     model.add(torch.nn.Linear(100, 100), rank_in=0, rank_out=2)
        """
        rank_in, rank_out = _as_list(rank_in, "rank_in"), _as_list(rank_out, "rank_out")
        if rank_out is None and any(out is None for _, out in self.routes):
            raise TorchmnValueError("add: this rank already has a part whose output is the model's (rank_out=None); "
                                    "a rank returns one output")
        self.parts.append(module)
        self.routes.append((rank_in, rank_out))
        self._checked = False
        return self

    def forward(self, *inputs):
        """Run this rank's parts; every rank of the communicator calls it.

        Args:
            *inputs: this rank's input (None, or nothing, where it has none).

        Returns:
            This rank's output (from its part with ``rank_out=None``), tied to its later sends; else
            the delegate of its last send; None where the rank has no part.

        Raises:
            CollectiveMismatchError: (first call) the ranks' sends and receives do not pair up.
            RuntimeError: data this rank sent to itself was never received by one of its parts.

        Example::

            >>> out = model(x if comm.rank == 0 else None)
            >>> (loss_fn(out, y) if comm.rank == comm.size - 1 else out).backward()   # out: a delegate elsewhere
        """
        if not self._checked:
            self._check_topology()
        comm = self.comm
        queue: collections.deque = collections.deque()  # data this rank passes between its own parts
        y = delegate = None
        for i, (part, (rank_in, rank_out)) in enumerate(zip(self.parts, self.routes)):
            if rank_in is None:
                args = inputs if i == 0 or delegate is None else _as_tuple(pseudo_connect(delegate, *inputs))
                x = part(*args)
            else:
                xs = []
                for source in rank_in:
                    if source == comm.rank:
                        item = queue.popleft()
                        got = item if delegate is None else _connect(delegate, item)
                    else:
                        got = recv(comm, source, delegate_variable=delegate)
                    xs.append(got)
                    # The next receive waits in backward for this one's gradient to be sent first.
                    delegate = _first_tensor(got)
                delegate = None  # each edge is backpropagated exactly once
                x = part(*xs)
            if rank_out is None:
                y, delegate = x, _first_tensor(x)
                continue
            for k, target in enumerate(rank_out):
                if target == comm.rank:
                    if delegate is not None:
                        x = _connect(delegate, x)
                    queue.append(x)
                    delegate = _first_tensor(x)
                else:
                    if k > 0 and delegate is not None:
                        # Several targets: their sends' backwards run in the reverse order.
                        x = _connect(delegate, x)
                    delegate = send(x, comm, target)
        if queue:
            raise TorchmnRuntimeError(f"rank {comm.rank}: {len(queue)} value(s) this rank sent to itself were never "
                                      f"received; give each rank_out={comm.rank} a later part with rank_in={comm.rank}")
        if y is None:
            return delegate
        if delegate is y or (not isinstance(y, torch.Tensor) and delegate is _first_tensor(y)):
            return y
        return _connect(delegate, y)

    def _check_topology(self) -> None:
        """Raise on every rank unless every rank's sends to another rank meet as many receives there."""
        comm = self.comm
        mine = [(type(part).__name__, rank_in, rank_out) for part, (rank_in, rank_out) in zip(self.parts, self.routes)]
        everyone = comm.allgather_obj(mine) if comm.size > 1 else [mine]
        problems = []
        for r, parts in enumerate(everyone):
            for i, (name, rank_in, rank_out) in enumerate(parts):
                for what, ranks in (("rank_in", rank_in), ("rank_out", rank_out)):
                    bad = [x for x in ranks or () if not 0 <= x < comm.size]
                    if bad:
                        problems.append(f"rank {r}'s part {i} ({name}) has {what}={bad[0]}, not a rank of the "
                                        f"communicator (size {comm.size})")
        if not problems:
            sends = collections.Counter((r, t) for r, parts in enumerate(everyone) for _, _, out in parts
                                        for t in out or ())
            recvs = collections.Counter((s, r) for r, parts in enumerate(everyone) for _, inp, _ in parts
                                        for s in inp or ())
            for (a, b) in sorted(set(sends) | set(recvs)):
                if sends[a, b] != recvs[a, b]:
                    part = next((f"part {i} ({name})" for i, (name, inp, out) in enumerate(everyone[a])
                                 if b in (out or ())), None)
                    where = f"rank {a}'s {part} sends" if part else f"rank {a} sends"
                    problems.append(f"{where} {sends[a, b]} time(s) to rank {b}, which receives from rank {a} "
                                    f"{recvs[a, b]} time(s)")
        if problems:
            raise CollectiveMismatchError(
                "MultiNodeSequential: the ranks' parts do not pair up: " + "; ".join(problems)
                + f". Every send needs a part on the target rank with that rank_in (raised on rank {comm.rank})")
        stuck = _waits_in_a_cycle(everyone)
        if stuck:
            raise CollectiveMismatchError(
                "MultiNodeSequential: the ranks' sends and receives would wait for each other for ever in the forward "
                "pass (a send waits until its target receives it): " + "; ".join(stuck) + ". Order each part's "
                f"rank_out as its targets receive (their rank_in order and part order) (raised on rank {comm.rank})")
        self._checked = True


def _waits_in_a_cycle(everyone: list) -> list:
    """Where the forward pass of every rank's parts (``(name, rank_in, rank_out)`` each, in order)
    would stop for ever: each rank's receives and sends in its order, a send done only when its
    target is at the matching receive. Returns what each rank left waiting is at; empty where all
    finish."""
    ops = []
    for r, parts in enumerate(everyone):
        mine = []
        for i, (name, rank_in, rank_out) in enumerate(parts):
            mine += [("receives from", s, i, name) for s in rank_in or () if s != r]
            mine += [("sends to", t, i, name) for t in rank_out or () if t != r]
        ops.append(collections.deque(mine))
    moved = True
    while moved:
        moved = False
        for r, mine in enumerate(ops):
            if mine and mine[0][0] == "sends to":
                t = mine[0][1]
                if ops[t] and ops[t][0][0] == "receives from" and ops[t][0][1] == r:
                    mine.popleft()
                    ops[t].popleft()
                    moved = True
    return [f"rank {r}'s part {mine[0][2]} ({mine[0][3]}) {mine[0][0]} rank {mine[0][1]}"
            for r, mine in enumerate(ops) if mine]


def _first_tensor(x) -> Optional[torch.Tensor]:
    """The delegate ``x`` gives the next operation: its first tensor in the graph, where it has one
    (integer labels or a frozen branch's output cannot order backward passes)."""
    if isinstance(x, torch.Tensor):
        return x
    tensors = [t for t in x if isinstance(t, torch.Tensor)]
    return next((t for t in tensors if t.requires_grad), tensors[0] if tensors else None)


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _connect(delegate: torch.Tensor, x):
    """``x`` (a tensor or a tuple of them) tied to ``delegate`` (see :func:`pseudo_connect`)."""
    if isinstance(x, torch.Tensor):
        return pseudo_connect(delegate, x)
    return _as_tuple(pseudo_connect(delegate, *x))
