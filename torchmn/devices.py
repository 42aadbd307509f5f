"""Which device a rank trains on: what the examples' ``--device auto|cpu|cuda`` means.

A machine with GPUs runs CPU models too: the communicator carries CPU tensors through gloo and
shared memory whatever its tensor backend (see ``Communicator.wire_device``), so ``--device cpu``
is always a choice, and ``auto`` falls back to it, with one line saying why, where NCCL could not
give each rank a GPU of its own.
"""
from __future__ import annotations

import sys

import torch

from torchmn.communicators.communicator_base import CommunicatorBase
from torchmn.errors import TorchmnValueError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
_CPU = torch.device("cpu")


def select_device(comm: CommunicatorBase, choice: str = "auto") -> torch.device:
    """The device this rank trains on, for ``choice``; with ``"auto"``, a GPU per rank where every
    local rank can have its own (``comm.device``), else the CPU, with a one-line note on rank 0.

    Args:
        comm: the job's communicator (it knows which GPU each rank drives and whether ranks of a
            node would share one).
        choice: ``"auto"``, ``"cpu"`` or ``"cuda"``.

    Returns:
        ``comm.device`` or another CUDA device for ``"cuda"``; ``torch.device("cpu")`` for ``"cpu"``
        and where ``"auto"`` finds no GPU of its own for every rank.

    Raises:
        ValueError: an unknown ``choice``; ``"cuda"`` where torch sees no CUDA GPU, or where ranks
            of a node would share a GPU through NCCL (naming them and the fixes), on every rank.

    Example::

        >>> comm = torchmn.create_communicator()
        >>> device = torchmn.select_device(comm, "auto")   # cuda:<local rank> on a GPU per rank
        >>> model = make_model().to(device)
    """
    if choice not in DEVICE_CHOICES:
        raise TorchmnValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, not {choice!r}")
    if choice == "cpu":
        return _CPU
    if not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None else
               "torch sees no CUDA GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)")
        if choice == "cuda":
            raise TorchmnValueError(f"--device cuda: {why}; train with --device cpu (or auto)")
        _note(comm, why)
        return _CPU
    if comm.backend != "nccl":
        # The user chose gloo on a GPU machine: CUDA tensors would travel through the CPU.
        if choice == "cuda":
            return torch.device("cuda", comm.intra_rank % torch.cuda.device_count())
        _note(comm, f"the communicator's backend is {comm.backend}, not NCCL")
        return _CPU
    try:
        return comm.wire_device(torch.device("cuda"))  # raises where ranks would share a GPU
    except TorchmnValueError:
        if choice == "cuda":
            raise
        _note(comm, f"{comm.intra_size} ranks on this node would share its {torch.cuda.device_count()} GPU(s), "
                    f"and NCCL needs one per rank (start fewer ranks per node for the GPUs)")
        return _CPU


def _note(comm: CommunicatorBase, why: str) -> None:
    if comm.rank == 0:
        print(f"torchmn: --device auto: training on the CPU: {why}", file=sys.stderr, flush=True)
