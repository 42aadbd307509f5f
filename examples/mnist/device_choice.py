"""The examples' ``--device auto|cpu|cuda``: torchmn.select_device, its refusals as one line.

    >>> device = training_device(comm, args.device)    # exits with status 2 on a bad choice
"""
from __future__ import annotations

import argparse
import sys

import torch

from torchmn.devices import DEVICE_CHOICES, select_device
from torchmn.errors import TorchmnValueError


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="where to train: auto (a GPU per rank where each rank can have its own, "
                             "else the CPU), cpu or cuda")


def training_device(comm, choice: str) -> torch.device:
    """The device to train on; a choice that cannot be had ends the process with one line and
    status 2 (on every rank: each says why)."""
    try:
        return select_device(comm, choice)
    except TorchmnValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
