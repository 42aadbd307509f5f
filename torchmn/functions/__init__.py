"""Differentiable communication (ChainerMN's ``chainermn.functions``): autograd functions whose
backward sends the gradients back across ranks, for models split over several ranks.

Point to point: :func:`send` returns a *delegate* (a scalar that carries the dependency; on a rank
whose last operation is a send, ``delegate.backward()`` runs that rank's part of the backward),
:func:`recv` takes the previous delegate so that a rank's backward runs in the right order, and
:func:`pseudo_connect` ties a delegate to the next computation. Collectives: :func:`bcast`,
:func:`gather`, :func:`scatter`, :func:`allgather`, :func:`alltoall`.

Example::

    >>> if comm.rank == 0:
    ...     delegate = torchmn.functions.send(layer0(x), comm, rank=1)
    ...     delegate.backward()                  # receives the gradient from rank 1
    ... else:
    ...     h = torchmn.functions.recv(comm, rank=0)
    ...     loss_fn(layer1(h), y).backward()     # sends the gradient of h to rank 0
"""
from torchmn.functions.collectives import allgather, alltoall, bcast, gather, scatter
from torchmn.functions.point_to_point import recv, send
from torchmn.functions.pseudo_connect import pseudo_connect

__all__ = ["allgather", "alltoall", "bcast", "gather", "pseudo_connect", "recv", "scatter", "send"]
