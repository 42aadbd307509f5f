"""Files that survive kills: atomic writes, and the layout of a checkpoint directory.

A checkpoint directory holds one folder per step::

    ckpt/
      step_00000040/
        shared.pt        # what every rank holds alike (model, optimizer, scheduler): rank 0 writes it
        rank00000.pt     # what is each rank's own (RNG states, data position, a sharded optimizer's part)
        rank00001.pt
        COMPLETE         # written last, by rank 0, once every rank has written: a JSON manifest

Each file is written to a temporary name beside it, fsynced, renamed, and the directory fsynced,
so a file under its final name is always whole. A step is complete only with its manifest, and
only if every file the manifest names has the size it records.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from typing import Any, Callable, Optional

import torch

MANIFEST = "COMPLETE"
SHARED = "shared.pt"
_STEP = re.compile(r"step_(\d{8,})")


def step_dir(directory: str, step: int) -> str:
    """The folder of ``step`` in ``directory``.

    Args:
        directory: the checkpoint directory.
        step: the step (a non-negative integer).

    Returns:
        ``directory/step_NNNNNNNN``.

    Example::

        >>> step_dir("ckpt", 40)
        'ckpt/step_00000040'
    """
    return os.path.join(directory, f"step_{step:08d}")


def rank_file(rank: int) -> str:
    """The name of ``rank``'s own file in a step folder.

    Args:
        rank: the rank.

    Returns:
        ``rankNNNNN.pt``: the rank, zero-padded to five digits.

    Example::

        >>> rank_file(3)
        'rank00003.pt'
    """
    return f"rank{rank:05d}.pt"


def fsync_directory(directory: str) -> None:
    """Make renames and removals in ``directory`` durable (where the file system allows it).

    Args:
        directory: the directory; one that cannot be opened or fsynced is left as it is.

    Example::

        >>> os.replace("ckpt/.shared.pt.1a2b3c4d.tmp", "ckpt/shared.pt")
        >>> fsync_directory("ckpt")      # the rename survives a power cut
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every file system lets a directory be opened
    try:
        os.fsync(fd)
    except OSError:
        pass  # fsync of a directory is unsupported on some file systems; the files themselves are synced
    finally:
        os.close(fd)


def temporary_prefix(path: str) -> str:
    """The prefix of the temporary files :func:`atomic_save` writes for ``path``.

    Args:
        path: the final path.

    Returns:
        ``.NAME.`` for a final name ``NAME`` (the temporary files are ``.NAME.XXXXXXXX.tmp``).

    Example::

        >>> temporary_prefix("ckpt/step_00000040/shared.pt")
        '.shared.pt.'
    """
    return "." + os.path.basename(path) + "."


def _create_temporary(path: str) -> tuple:
    """A new file beside ``path``, open for writing: ``(fd, its path)``. Created with mode 0666 so
    that the kernel applies the umask, as for any file the user writes (mkstemp's 0600 would hide
    checkpoints from the user's other jobs)."""
    directory = os.path.dirname(path) or "."
    prefix = temporary_prefix(path)
    # The temporary name is 13 characters longer than the final one: where that passes the file
    # system's limit on a name (255 on Linux), it keeps the end of the final name (its suffix).
    try:
        longest = os.pathconf(directory, "PC_NAME_MAX")
    except OSError:
        longest = 255
    room = longest - len(secrets.token_hex(4) + ".tmp")
    if len(prefix) > room:
        prefix = "." + prefix[len(prefix) - room + 1:]
    while True:
        tmp = os.path.join(directory, prefix + secrets.token_hex(4) + ".tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def atomic_save(obj: Any, path: str, savefun: Callable[[Any, Any], None] = torch.save) -> int:
    """``savefun(obj, file)`` into a temporary file beside ``path``, fsync it, rename it to ``path``,
    fsync the directory.

    A crash therefore never leaves a half-written file under ``path``. The directory is created
    if needed.

    Args:
        obj: what to save.
        path: the final path.
        savefun: writes ``obj`` to an open binary file.

    Returns:
        The size of the file written, in bytes.

    Raises:
        Exception: whatever ``savefun`` or the file system raised, once the temporary file is
            removed.

    Example::

        >>> torchmn.checkpoint.atomic_save(model.state_dict(), "result/model.pt")
        1234
    """
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            savefun(obj, f)
            f.flush()
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size  # not tell(): a writer may seek back to patch a header
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_directory(directory)
    return size


def remove_temporaries(directory: str, matches: Callable[[str], bool]) -> None:
    """Delete the temporary files a killed writer left in ``directory`` for final names that
    ``matches`` accepts: repeated crashes would fill the disk.

    Args:
        directory: where to look; one that does not exist is left alone.
        matches: takes a final file name, says whether its temporaries are to go.

    Example::

        >>> remove_temporaries(step_dir("ckpt", 40), lambda name: name.endswith(".pt"))
    """
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        if matches(name[1:].rsplit(".", 2)[0]):
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def write_manifest(directory: str, step: int, manifest: dict) -> None:
    """Mark ``step`` complete: write its manifest, atomically, last.

    Args:
        directory: the checkpoint directory.
        step: the step.
        manifest: what the step holds (JSON-serialisable): at least ``files``, ``{name: size}``.

    Example::

        >>> write_manifest("ckpt", 40, {"step": 40, "size": 2, "files": {"shared.pt": 1261}})
    """
    atomic_save(manifest, os.path.join(step_dir(directory, step), MANIFEST),
                lambda m, f: f.write(json.dumps(m, indent=1, sort_keys=True).encode()))


def read_manifest(directory: str, step: int) -> Optional[dict]:
    """The manifest of ``step``, or None when the step is not complete.

    Args:
        directory: the checkpoint directory.
        step: the step.

    Returns:
        The manifest, or None where it is missing or unreadable.

    Example::

        >>> read_manifest("ckpt", 40)["files"]
        {'shared.pt': 1261}
    """
    return manifest_and_problem(directory, step)[0]


def manifest_and_problem(directory: str, step: int) -> tuple[Optional[dict], Optional[str]]:
    """The manifest of ``step``, and what is wrong with it where it is there but cannot be read
    (it is written whole, so only damage since makes it so).

    Args:
        directory: the checkpoint directory.
        step: the step.

    Returns:
        ``(manifest, None)``; ``(None, None)`` where there is none (the step is incomplete);
        ``(None, the problem in words)`` where it cannot be read.

    Example::

        >>> manifest_and_problem("ckpt", 40)
        (None, "its manifest COMPLETE cannot be read (Expecting ',' delimiter: line 3 column 1 (char 20))")
    """
    try:
        with open(os.path.join(step_dir(directory, step), MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"its manifest {MANIFEST} cannot be read ({e})"
    if not (isinstance(manifest, dict) and isinstance(manifest.get("size"), int)
            and isinstance(manifest.get("files"), dict)):
        return None, f"its manifest {MANIFEST} is not a torchmn checkpoint's (no size and files in it)"
    return manifest, None


def steps_on_disk(directory: str) -> list[int]:
    """The steps that have a folder in ``directory``, complete or not, in increasing order.

    Args:
        directory: the checkpoint directory; one that does not exist has none.

    Returns:
        The steps, read from the ``step_NNNNNNNN`` folder names.

    Example::

        >>> steps_on_disk("ckpt")
        [40, 50]
    """
    if not os.path.isdir(directory):
        return []
    found = (_STEP.fullmatch(name) for name in os.listdir(directory))
    return sorted(int(m.group(1)) for m in found if m)


def whole_files(directory: str, step: int, manifest: dict, names: list[str]) -> Optional[str]:
    """Check that ``names`` are in ``step``'s folder with the sizes the manifest records.

    Args:
        directory: the checkpoint directory.
        step: the step.
        manifest: its manifest.
        names: the files this rank will read.

    Returns:
        None if all are whole, else what is wrong with the first file that is not (for the
        message): not in the manifest, missing, or of another size.

    Example::

        >>> whole_files("ckpt", 40, read_manifest("ckpt", 40), ["shared.pt"])
        'ckpt/step_00000040/shared.pt has 1024 bytes, the manifest says 1261'
    """
    sizes = manifest.get("files", {})
    for name in names:
        path = os.path.join(step_dir(directory, step), name)
        if name not in sizes:
            return f"{path} is not in the step's manifest"
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{path} is missing"
        if size != sizes[name]:
            return f"{path} has {size} bytes, the manifest says {sizes[name]}"
    return None


def remove_step(directory: str, step: int) -> None:
    """Remove ``step``: its manifest first, so that the step is never complete with a file missing,
    then its folder.

    Args:
        directory: the checkpoint directory.
        step: the step.

    Example::

        >>> remove_step("ckpt", 40)
        >>> read_manifest("ckpt", 40) is None
        True
    """
    folder = step_dir(directory, step)
    try:
        os.remove(os.path.join(folder, MANIFEST))
    except FileNotFoundError:
        pass
    fsync_directory(folder)
    remove_folder(directory, step)


def remove_folder(directory: str, step: int) -> None:
    """Remove ``step``'s folder and everything in it (an incomplete step that a new save replaces).

    Errors are ignored: a folder already gone is no error, and a file that cannot be removed stays.

    Args:
        directory: the checkpoint directory.
        step: the step.

    Example::

        >>> remove_folder("ckpt", 50)
    """
    shutil.rmtree(step_dir(directory, step), ignore_errors=True)
