"""Differentiable communication (ChainerMN's ``chainermn.functions``): autograd functions whose
backward sends the gradients back across ranks, for models split over several ranks.

:func:`send` returns a *delegate*, whose ``backward()`` runs a sending rank's part of the backward;
:func:`recv` and :func:`pseudo_connect` take it, so that one backward runs every part in order.
Collectives: :func:`allreduce`, :func:`bcast`, :func:`gather`, :func:`scatter`, :func:`allgather`,
:func:`alltoall`. How they keep every rank's backward paired: ``docs/design/model-parallelism.md``.
"""
from torchmn.functions.collectives import allgather, allreduce, alltoall, bcast, gather, scatter
from torchmn.functions.point_to_point import recv, send
from torchmn.functions.pseudo_connect import pseudo_connect

__all__ = ["allgather", "allreduce", "alltoall", "bcast", "gather", "pseudo_connect", "recv", "scatter", "send"]
