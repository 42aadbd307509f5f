"""Iterators shared among ranks: :func:`create_multi_node_iterator`."""
from torchmn.iterators.multi_node_iterator import MultiNodeIterator, create_multi_node_iterator

__all__ = ["MultiNodeIterator", "create_multi_node_iterator"]
