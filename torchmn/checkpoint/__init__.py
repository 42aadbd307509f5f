"""Checkpoints for plain training loops: written atomically by every rank, resumed from the newest
step every rank completed.

``Checkpointer(directory, comm, keep=3, model=..., optimizer=..., ...)`` with ``save(step)`` and
``load_latest()``; ``ResumableLoader``, a DataLoader whose position comes back exactly; ``atomic_save`` writes one file that a kill never leaves half-written. The
pytorch-pfn-extras extension ``torchmn.extensions.multi_node_snapshot`` writes its files the same way.
``docs/checkpoints.md`` is the guide.
"""
from torchmn.checkpoint.checkpointer import CheckpointError, Checkpointer, kind_of
from torchmn.checkpoint.files import atomic_save
from torchmn.checkpoint.loader import ResumableLoader
from torchmn.checkpoint.rng import rng_state, set_rng_state

__all__ = ["CheckpointError", "Checkpointer", "ResumableLoader", "atomic_save", "kind_of", "rng_state", "set_rng_state"]
