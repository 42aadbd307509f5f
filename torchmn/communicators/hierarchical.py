"""``hierarchical``: reduce inside each node, allreduce across nodes (one rank per node), then
share the result inside the node.

On CPU the inside-node part goes through shared memory (:mod:`torchmn.communicators.shm`), never
TCP loopback; only the node's first rank talks to other nodes, through torch.distributed. The
sharded optimizer's reduce-scatter and all-gather go the same way: through shared memory inside
a node, and across nodes over "rails" (local rank i of every node), so every rank sends only its
part over the network. Point-to-point messages between ranks of one node (``send``/``recv``, their
object forms, the pipeline's activations) go through mailboxes in shared memory
(:class:`~torchmn.communicators.shm.Mailboxes`). On GPU, NCCL already does this inside and across
nodes, so the fused NCCL collectives are used as they are for CUDA tensors.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from torchmn.communicators import _call_check, _gloo_utility, _wire, shm, watch
from torchmn.communicators._async_utility import AndThen, Completed, finish
from torchmn.communicators._group_utility import group_for
from torchmn.communicators.cross_node import CrossNodeAllreduce
from torchmn.communicators.flat import FlatCommunicator
from torchmn.communicators.pickling import pickle_for_call, unpickle_from
from torchmn.communicators.errors import CollectiveMismatchError
from torchmn.communicators.world import collective_timeout_s


_UNSET = object()
_ROW_BYTES = _wire.HEADER_LEN * 8


def _first_row(part: torch.Tensor) -> torch.Tensor:
    """The call header a rank's shared-memory payload starts with (every one starts with one)."""
    if part.numel() < _ROW_BYTES:
        return torch.full((_wire.HEADER_LEN,), _wire.NONE, dtype=torch.int64)
    return part[:_ROW_BYTES].view(torch.int64)


def _new_inter_group(world_leaders: list[int], local: bool = False, reuse=None):
    """The group of the nodes' first ranks (None on one node). Every rank of the world must call
    this, or with ``local=True`` every rank of the communicator being split off. ``reuse``: idle
    groups to take first (``_group_utility.group_for``)."""
    if len(world_leaders) < 2:
        return None
    return group_for(world_leaders, reuse or {}, backend="gloo", use_local_synchronization=local)


def _new_rail_groups(nodes: list[list[int]], local: bool = False, reuse=None):
    """One gloo group per local index, joining that rank of every node ("rails"), for several nodes
    with the same rank count; None otherwise. ``nodes``: world ranks per node. Who calls: as
    :func:`_new_inter_group` (with ``local=True`` a rank gets None for the rails it is not on)."""
    if len(nodes) < 2 or len({len(n) for n in nodes}) != 1:
        return None
    return [group_for([n[i] for n in nodes], reuse or {}, backend="gloo", use_local_synchronization=local)
            for i in range(len(nodes[0]))]


class HierarchicalCommunicator(FlatCommunicator):
    """Shared memory inside a node, one rank per node across nodes.

    Attributes:
        segment: the node's shared-memory segment (:class:`~torchmn.communicators.shm.NodeSegment`),
            None where there is none (one rank, or ``/dev/shm`` too small); it carries CPU tensors,
            also under NCCL, whose CUDA tensors take the flat way.
        rail_group: the gloo group joining this local rank of every node; None unless there are
            several nodes of equal rank counts.
        cross_node: the allreduce among nodes (:class:`~torchmn.communicators.cross_node.CrossNodeAllreduce`:
            recursive doubling for small messages, gloo's ring for large ones) on the ranks that
            talk across nodes (each node's first rank, or every rank where each node has one);
            None elsewhere.

    Example::

        >>> comm = torchmn.create_communicator("hierarchical")
        >>> comm.allreduce(torch.ones(1_000_000))     # no byte of it crosses TCP on one node
    """

    name = "hierarchical"
    segment = None  # until set-up has made one (set-up's own collectives run without it)

    def __init__(self, inter_group=_UNSET, rail_groups=_UNSET, **kwargs):
        """Set up the communicator, then its groups across nodes and its node's shared memory (collective).

        With one rank, or one rank on every node, it is a flat communicator and sets up nothing
        more. Otherwise
        a world communicator creates the group of the nodes' first ranks and the rails (local rank
        ``i`` of every node) itself; a communicator made by ``split`` gets them from
        :meth:`split_groups`. Then local rank 0 of each node creates a shared-memory segment that
        the node's ranks map; where ``/dev/shm`` is too small for it, rank 0 warns
        (``RuntimeWarning``) and the ranks of a node talk over TCP instead.

        Args:
            inter_group: the gloo group of the nodes' first ranks (None on one node); left out,
                it is created here, which every rank of the world must then do together.
            rail_groups: one gloo group per local rank, joining that local rank of every node
                (None unless there are several nodes of equal rank counts); left out, as
                ``inter_group``.
            **kwargs: the arguments of :class:`~torchmn.communicators.communicator.Communicator`.

        Raises:
            OSError: ``/dev/shm`` could not hold the segment after all (on the rank that failed;
                the others get RemoteRankError).

        Example::

            >>> comm = torchmn.create_communicator("hierarchical")    # builds it on every rank
            >>> comm.may_share_node_memory()                           # one CPU node
            True
        """
        super().__init__(**kwargs)
        self.segment = None
        self.mailboxes = None
        self._inter_group = None
        self.rail_group = None
        self._node_mean = None          # the arena mean_tensors keeps between calls
        self._node_mean_refused = 0     # bytes for which no arena could be had (not asked again)
        self.cross_node = None
        if self.size == 1 or all(len(node) == 1 for node in self.node_ranks):
            # One rank a node: nothing to share inside a node, and staging through shared memory
            # would only copy (1.5x gloo's time at 64 MB on a 10 Gbit link): the flat way is all,
            # with the algorithm across nodes chosen by size.
            if self.size > 1:
                self.cross_node = CrossNodeAllreduce.set_up(
                    self.object_group, [self.world_rank(r) for r in range(self.size)], self.rank)
            return
        if inter_group is _UNSET:  # a world communicator: all its ranks are here to create it
            leaders = [self.world_rank(node[0]) for node in self.node_ranks]
            inter_group = _new_inter_group(leaders)
            rail_groups = _new_rail_groups([[self.world_rank(r) for r in node] for node in self.node_ranks])
            self.made_groups += [inter_group, *(rail_groups or [])]
        self._inter_group = inter_group
        if inter_group is not None and self.intra_rank == 0:
            self.cross_node = CrossNodeAllreduce.set_up(
                inter_group, [self.world_rank(node[0]) for node in self.node_ranks], self.inter_rank)
        if rail_groups is not None:
            # Rail i holds local rank i of every node, in the group's own order (by world rank).
            rails = [sorted((node[i] for node in self.node_ranks), key=self.world_rank)
                     for i in range(self.intra_size)]
            self.rail_group = rail_groups[self.intra_rank]
            self._rail_order = torch.tensor([r for rail in rails for r in rail])
        # One exchange for what setting up shared memory needs: rank 0's segment tag, every rank's
        # pid (to tell a dead peer) and the space free in its /dev/shm.
        tags, pids, frees = zip(*self.allgather_obj((shm.new_job_tag(), os.getpid(), shm.free_bytes())))
        tag = tags[0]
        my_node = self.node_ranks[self.inter_rank]
        self._shm_args = dict(
            node=self.inter_rank, local_rank=self.intra_rank, local_size=self.intra_size,
            pids=[pids[r] for r in my_node], agree=self.allgather_obj,
            timeout=collective_timeout_s(),
            describe=lambda i: watch.name_rank(self, my_node[i], node=self.inter_rank))
        # A small /dev/shm (Docker's default is 64 MB) means smaller slots, or TCP inside the node.
        # Sized for the largest node, so that every rank decides alike: opening a segment or the
        # mailboxes is a collective of every rank, also where nodes hold different rank counts.
        free = min(frees)
        most = max(len(node) for node in self.node_ranks)
        slot = shm.fitting_slot_bytes(most, free)
        if slot == 0:
            if self.rank == 0:
                warnings.warn(f"torchmn: /dev/shm has {free >> 20} MiB free, too little for shared-memory "
                              f"collectives; ranks of a node talk over TCP instead (slower). Give it more "
                              f"room (docker run --shm-size=1g, or a larger tmpfs).", RuntimeWarning, stacklevel=3)
            return
        self.segment = shm.NodeSegment.open(tag, slot_bytes=slot, **self._shm_args)
        # Mailboxes for messages between the node's ranks, where /dev/shm has room beside the segment.
        box = shm.Mailboxes.box_bytes_for(most, free - shm.NodeSegment.size_for(most, slot))
        if box:
            self.mailboxes = shm.Mailboxes.open(tag, box_bytes=box, **self._shm_args)

    @classmethod
    def split_groups(cls, parent, members: list[int], local: bool = False, reuse=None) -> dict:
        if len(members) == 1:
            return {"inter_group": None, "rail_groups": None}
        nodes: dict = {}
        for r in members:  # nodes in order of first appearance, as the new communicator sees them
            nodes.setdefault(parent.node_of(r), []).append(parent.world_rank(r))
        nodes = list(nodes.values())
        return {"inter_group": _new_inter_group([n[0] for n in nodes], local=local, reuse=reuse),
                "rail_groups": _new_rail_groups(nodes, local=local, reuse=reuse)}

    @property
    def _single_node(self) -> bool:
        return self.inter_size == 1

    def _local_index(self, r: int) -> Optional[int]:
        """Rank ``r``'s local rank where its messages go through this node's mailboxes, else None."""
        if self.mailboxes is None or self.node_of(r) != self.inter_rank:
            return None
        return self.node_ranks[self.inter_rank].index(r)

    # ----------------------------------------------------------------------------- point to point
    def send_tensor(self, x: torch.Tensor, dest: int, wire_tag: int) -> None:
        local = self._local_index(dest)
        if local is None:
            return super().send_tensor(x, dest, wire_tag)
        # The header through the mailbox, saying what follows and which way; CPU data in the same
        # message where both fit one box (it leaves at once, so two ranks may each send before they
        # receive), else after it, so that the receiver's copy of the header overlaps the data's
        # send; CUDA data through NCCL. None: the header of a send that failed here.
        row = _call_check.invalid_rows(1)[0] if x is None else _wire.header(_call_check.KIND["bcast"], x=x)
        header = torch.tensor(row, dtype=torch.int64).view(torch.uint8)
        device = None if x is None else self.wire_device(x)
        if device is None or device.type != "cpu":
            self.mailboxes.send(local, header, wire_tag)
            if device is not None:
                dist.send(_wire.as_bytes(x.to(device)), self.world_rank(dest), group=self.process_group, tag=wire_tag)
            return
        self._send_after(local, header, _wire.as_bytes(x.detach().cpu()), wire_tag)

    def recv_tensor(self, source: int, wire_tag: int) -> torch.Tensor:
        local = self._local_index(source)
        if local is None:
            return super().recv_tensor(source, wire_tag)
        message = self.mailboxes.recv(local, wire_tag)
        row = message[:_ROW_BYTES].view(torch.int64).tolist()
        _call_check.refuse_failed_send(row, source, self.rank)
        dtype, shape = _wire.meta(row)
        device = self.wire_device(torch.device(_wire.device_type(row)))
        if _wire.nbytes(dtype, shape) == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        if device.type == "cpu":
            return _wire.from_bytes(self._data_of(local, message, _ROW_BYTES, _wire.nbytes(dtype, shape), wire_tag),
                                    dtype, shape)
        buf = torch.empty(_wire.nbytes(dtype, shape), dtype=torch.uint8, device=device)  # through NCCL
        dist.recv(buf, self.world_rank(source), group=self.process_group, tag=wire_tag)
        return _wire.from_bytes(buf, dtype, shape)

    def send_bytes(self, buf: Optional[torch.Tensor], dest: int, wire_tag: int) -> None:
        local = self._local_index(dest)
        if local is None:
            return super().send_bytes(buf, dest, wire_tag)
        length = torch.tensor([buf.numel() if buf is not None else -1], dtype=torch.int64).view(torch.uint8)
        if buf is None:
            self.mailboxes.send(local, length, wire_tag)
        else:
            self._send_after(local, length, buf, wire_tag)

    def recv_bytes(self, source: int, wire_tag: int) -> Optional[torch.Tensor]:
        local = self._local_index(source)
        if local is None:
            return super().recv_bytes(source, wire_tag)
        message = self.mailboxes.recv(local, wire_tag)
        length = int(message[:8].view(torch.int64))
        if length < 0:
            return None
        return self._data_of(local, message, 8, length, wire_tag)

    def _send_after(self, local: int, head: torch.Tensor, data: torch.Tensor, wire_tag: int) -> None:
        """``head`` (a header or a length), then ``data``, to local rank ``local``: one message
        where both fit one box, else two (see :meth:`_data_of`)."""
        if head.numel() + data.numel() <= self.mailboxes.box_bytes:
            self.mailboxes.send(local, torch.cat([head, data]), wire_tag)
        else:
            self.mailboxes.send(local, head, wire_tag)
            self.mailboxes.send(local, data, wire_tag)

    def _data_of(self, local: int, message: torch.Tensor, head_bytes: int, nbytes: int,
                 wire_tag: int) -> torch.Tensor:
        """The ``nbytes`` of data :meth:`_send_after` sent after ``message``'s ``head_bytes``: in
        ``message`` where both fit one box, else the next message."""
        if head_bytes + nbytes <= self.mailboxes.box_bytes:
            return message[head_bytes:]
        return self.mailboxes.recv(local, wire_tag)

    def _shm_ok(self, t: torch.Tensor) -> bool:
        return self.segment is not None and t.device.type == "cpu" and t.is_contiguous()

    @watch.collective
    def allreduce_flat(self, flat: torch.Tensor, async_op: bool = False, op: str = "sum"):
        if not self._shm_ok(flat):
            if self.cross_node is not None and self._inter_group is None and flat.device.type == "cpu":
                return self.cross_node.allreduce(flat.view(-1), op, async_op=async_op)  # one rank a node
            return super().allreduce_flat(flat, async_op=async_op, op=op)
        self.segment.allreduce_(flat, op)
        if self._single_node:
            return Completed()
        # The node sum is ready now; the network allreduce of the nodes' first ranks runs in the
        # background (backward goes on), and wait() shares its result inside the node.
        work = self.cross_node.allreduce(flat, op, async_op=True) if self.intra_rank == 0 else None
        return finish(AndThen(work, lambda: self.segment.broadcast_(flat, root=0)), async_op)

    def _across_nodes(self, flat: torch.Tensor, op: str) -> None:
        """Node sums to the global result: the nodes' first ranks allreduce, then share it locally."""
        if self._single_node:
            return
        if self.intra_rank == 0:
            self.cross_node.allreduce(flat, op)
        self.segment.broadcast_(flat, root=0)

    def allreduce_copy(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if not self._shm_ok(x):
            return super().allreduce_copy(x, op)
        # Straight from x into shared memory and from there into the result: no staging copy.
        out = shm.empty_like_fast(x)
        self.segment.allreduce_(x.view(-1), op, out=out.view(-1))
        self._across_nodes(out.view(-1), op)
        return out

    @watch.collective
    def reduce_scatter_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if self._shm_ok(flat) and self._single_node:
            self.segment.reduce_scatter(flat, shard)
            return Completed()
        if not (self._shm_ok(flat) and self.rail_group is not None):
            return super().reduce_scatter_flat(flat, shard, async_op=async_op)
        # Several nodes: local rank i first sums, through shared memory, the shards of every rank
        # on its rail (local rank i of each node); the rail then reduce-scatters those node sums
        # over the network, so each rank ends with its own shard summed over all nodes.
        k = shard.numel()
        by_rail = flat.view(self.size, k).index_select(0, self._rail_order).view(-1)
        node_sums = torch.empty(self.inter_size * k, dtype=flat.dtype)
        self.segment.reduce_scatter(by_rail, node_sums)
        work = _gloo_utility.reduce_scatter_single(shard, node_sums, self.rail_group, async_op=True, across_nodes=True)
        return finish(AndThen(work, keep=(node_sums,)), async_op)

    @watch.collective
    def allgather_flat(self, flat: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        if self._shm_ok(flat) and self._single_node:
            self.segment.allgather(flat, shard)
            return Completed()
        if not (self._shm_ok(flat) and self.rail_group is not None):
            return super().allgather_flat(flat, shard, async_op=async_op)
        # The mirror image: the rail gathers its shards over the network, then the node's ranks
        # gather their rails' results through shared memory.
        k = shard.numel()
        rail = torch.empty(self.inter_size * k, dtype=flat.dtype)
        sent = shard.contiguous()
        work = _gloo_utility.all_gather_single(rail, sent, self.rail_group, async_op=True, across_nodes=True)

        def inside_the_node():
            by_rail = torch.empty(self.size * k, dtype=flat.dtype)
            self.segment.allgather(by_rail, rail)
            flat.view(self.size, k).index_copy_(0, self._rail_order, by_rail.view(self.size, k))
        return finish(AndThen(work, inside_the_node, keep=(sent,)), async_op)

    @watch.collective
    def barrier(self) -> None:
        if self.segment is None:
            return super().barrier()
        # Flags in shared memory inside a node (microseconds, not a TCP round trip); across
        # nodes, the nodes' first ranks meet over the network in between.
        try:
            self.segment.barrier()
            if not self._single_node:
                if self.intra_rank == 0:
                    dist.barrier(group=self._inter_group)
                self.segment.barrier()
        except CollectiveMismatchError:  # another rank of the node is in a collective's call check
            raise self._calls_differ("barrier") from None

    def _calls_differ(self, mine: str) -> CollectiveMismatchError:
        """The error for a barrier met by another collective's call check in the segment, in the
        call check's words, naming what every rank of the node is at."""
        node = self.node_ranks[self.inter_rank]
        calls = self.segment.calls_now()
        named = ", ".join(f"rank {node[r]}: " + (_call_check.kind_name(c) if isinstance(c, int) else c)
                          for r, c in sorted(calls.items()))
        return CollectiveMismatchError(f"ranks called {mine} inconsistently (collective differs: {named}); "
                                       f"every rank must make the same call")

    def may_share_node_memory(self) -> bool:
        return self.segment is not None and self._single_node

    def open_node_arena(self, shared_bytes: int, region_bytes: int, points: Sequence[str],
                        owned_shared: Sequence[Tuple[int, int]] = ()):
        if not self.may_share_node_memory():
            return None
        # A small /dev/shm (Docker's default is 64 MB) means the ordinary path, not a failure.
        need = shm.NodeArena.size_for(self.intra_size, shared_bytes, region_bytes)
        fits, tags = zip(*self.allgather_obj((need <= shm.fits_in(shm.free_bytes()), shm.new_job_tag())))
        if not all(fits):
            return None
        return shm.NodeArena.open(tags[0], shared_bytes=shared_bytes, region_bytes=region_bytes, points=points,
                                   owned_shared=owned_shared, **self._shm_args)

    def exchange_headers(self, rows: list[list[int]]) -> torch.Tensor:
        # The call check of every collective: through shared memory too, so small collectives
        # do not pay a TCP round trip before their data moves.
        if not self._checks_in_segment():
            return super().exchange_headers(rows)
        got = self._exchange_rows(rows, None)  # one round through the small buffers
        if got is not None:
            return got[0]  # on one node, local rank order is this communicator's rank order
        mine = torch.tensor(rows, dtype=torch.int64)
        parts = self.segment.allgather_bytes(mine.reshape(-1).view(torch.uint8))
        if parts is None:  # a call of thousands of tensors: more rows than a slot holds
            return super().exchange_headers(rows)
        if any(p.numel() != mine.numel() * 8 for p in parts):
            # Some rank is making another call (an object collective, or one of another row
            # count): compare what each call is, from its first row, and let the check name it.
            return torch.stack([_first_row(p) for p in parts]).unsqueeze(1)
        # On one node, local rank order is this communicator's rank order.
        return torch.stack([p.view(torch.int64).reshape(mine.shape) for p in parts])

    def exchange_headers_with_data(self, rows: list[list[int]], data: torch.Tensor):
        # One round through the segment's small buffers, the data beside the headers where it fits.
        got = self._exchange_rows(rows, data) if self._checks_in_segment() else None
        return got if got is not None else super().exchange_headers_with_data(rows, data)

    def _checks_in_segment(self) -> bool:
        """Whether call checks go through the segment: one node (headers are CPU data, also for
        calls whose data goes through NCCL)."""
        return self.segment is not None and self._single_node

    def _exchange_rows(self, rows: list[list[int]], data):
        """``segment.exchange_rows``, a barrier met there named in the call check's words."""
        try:
            return self.segment.exchange_rows(rows, data)
        except CollectiveMismatchError:  # another rank is in a barrier: name both calls
            raise self._calls_differ(_call_check.kind_name(rows[0][0])) from None

    @watch.collective
    def allgather_obj_as(self, obj, kind, root=None):
        """Every rank's object, in rank order, on every rank (through shared memory on one node),
        checked as collective ``kind``.

        On one node, an object whose pickle fits a slot takes one round through the segment; a
        larger one, or several nodes, take the ordinary way over ``torch.distributed``.

        Args:
            obj: this rank's picklable object.
            kind: the collective's name (``"allgather_obj"``, or one built on it).
            root: the collective's root (None: it has none).

        Returns:
            A list of ``size`` objects, copies (this rank's own included).

        Raises:
            TypeError: this rank's object cannot be pickled (the others get RemoteRankError).
            CollectiveMismatchError: ranks made another collective, or passed other roots.

        Example::

            >>> hosts = comm.allgather_obj_as(socket.gethostname(), "allgather_obj")
        """
        if self.segment is None or not self._single_node:
            return super().allgather_obj_as(obj, kind, root)
        # Small objects (metrics, losses, flags) through the segment, not two TCP collectives;
        # larger ones, on every rank alike, the ordinary way. The call check goes first, as for
        # tensors, so that a rank making another collective, or one that could not pickle, is named.
        buf, err = pickle_for_call(obj, kind, self.rank, self.host)
        wire_root = _wire.NONE if root is None else root
        rows = [_call_check.obj_header(buf.numel(), kind, wire_root)] if err is None else _call_check.invalid_rows(1)
        _call_check.check_headers(kind, self.exchange_headers(rows), err, same_shape=False,
                                  same_dtype=False, rank=self.rank, hosts=self.call_log.hosts)
        parts = self.segment.allgather_bytes(buf)
        if parts is None:
            return super().allgather_obj_as(obj, kind, root)
        # Copies, own one included, as over TCP.
        return [unpickle_from(p, kind, r, self.rank, self.host) for r, p in enumerate(parts)]

    def mean_tensors(self, tensors: list[torch.Tensor]) -> None:
        if self.size > 1 and tensors and self.segment is not None and self._single_node and \
                all(t.device.type == "cpu" and t.is_contiguous() and t.is_floating_point() for t in tensors):
            nbytes = shm.NodeMean.nbytes(tensors)
            if self._node_mean is None or self._node_mean.capacity < nbytes:
                # Collective, decided alike on every rank: the caller has checked that every rank
                # passes tensors of one layout.
                if self._node_mean_refused and nbytes >= self._node_mean_refused:
                    return super().mean_tensors(tensors)
                if self._node_mean is not None:
                    self._node_mean.close()
                self._node_mean = shm.NodeMean.open(self, nbytes)
                if self._node_mean is None:
                    self._node_mean_refused = nbytes
                    return super().mean_tensors(tensors)
            self._node_mean.mean_(tensors)
            return
        super().mean_tensors(tensors)

    def finalize(self) -> None:
        if self._node_mean is not None:
            self._node_mean.close()
            self._node_mean = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self.mailboxes is not None:
            self.mailboxes.close()
            self.mailboxes = None
        super().finalize()

    def drop_process_groups(self) -> None:
        # The shared-memory segment stays: peers marked failed in it (failure.py) still read it.
        super().drop_process_groups()
        self._inter_group = self.rail_group = self.cross_node = None
