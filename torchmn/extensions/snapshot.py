"""Per-rank snapshots, written atomically, resumed from the newest iteration every rank has.

:func:`multi_node_snapshot` makes the extension that writes one file per rank and iteration;
:func:`resume_latest` loads, on every rank, the newest iteration all ranks have.
``docs/design/data-and-extensions.md`` explains the file names, the atomic write and how resuming
picks its iteration.
"""
from __future__ import annotations

import os
import re
import string
import warnings
from typing import Any, Callable, Optional

import torch
from pytorch_pfn_extras.training import extension

from torchmn.checkpoint.files import atomic_save, remove_temporaries
from torchmn.communicators.errors import RemoteRankError
from torchmn.errors import TorchmnTypeError, TorchmnValueError
from torchmn.extensions._triggers import agree_on_own_trigger

DEFAULT_FILENAME = "snapshot_iter_{iteration}_rank{rank}"


def _pattern(filename: str, rank: int) -> re.Pattern:
    """A regex matching ``filename`` for this rank, capturing the iteration."""
    if os.sep in filename or (os.altsep and os.altsep in filename):
        raise TorchmnValueError(f"snapshot filename {filename!r} must be a plain file name; choose the directory "
                                f"with the manager's out_dir (or out_dir=)")
    fields = set()
    parts = []
    for literal, field, spec, conversion in string.Formatter().parse(filename):
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field not in ("iteration", "rank") or conversion:
            raise TorchmnValueError(f"snapshot filename {filename!r}: only the fields {{iteration}} and {{rank}} "
                                    f"may appear, found {{{field}}}")
        fields.add(field)
        parts.append(r"(\d+)" if field == "iteration" else re.escape(format(rank, spec or "")))
    if fields != {"iteration", "rank"}:
        raise TorchmnValueError(f"snapshot filename {filename!r} must contain both {{iteration}} and {{rank}}, "
                                f"so that ranks do not overwrite each other and resuming can find iterations")
    return re.compile("".join(parts))


def snapshot_path(out_dir: str, filename: str, iteration: int, rank: int) -> str:
    """The path of ``rank``'s snapshot of ``iteration``.

    Args:
        out_dir: the snapshot directory.
        filename: the file name pattern, with the fields ``{iteration}`` and ``{rank}``.
        iteration: the iteration.
        rank: the rank.

    Returns:
        ``out_dir`` joined with ``filename`` filled in.

    Raises:
        ValueError: ``filename`` is not a plain file name holding both ``{iteration}`` and
            ``{rank}`` (and no other field).

    Example::

        >>> torchmn.extensions.snapshot.snapshot_path("result", DEFAULT_FILENAME, 300, 1)
        'result/snapshot_iter_300_rank1'
    """
    _pattern(filename, rank)
    return os.path.join(out_dir, filename.format(iteration=iteration, rank=rank))


def available_iterations(out_dir: str, rank: int, filename: str = DEFAULT_FILENAME) -> dict[int, str]:
    """``{iteration: path}`` of the snapshots ``rank`` has in ``out_dir`` (no communication).

    Args:
        out_dir: the snapshot directory; one that does not exist holds no snapshot.
        rank: the rank whose files are listed.
        filename: the file name pattern the snapshots were written with.

    Returns:
        The iteration of each of ``rank``'s snapshots, mapped to its path.

    Raises:
        ValueError: ``filename`` is not a valid pattern (see :func:`snapshot_path`).

    Example::

        >>> torchmn.extensions.available_iterations("result", comm.rank)
        {200: 'result/snapshot_iter_200_rank0', 300: 'result/snapshot_iter_300_rank0'}
    """
    pattern = _pattern(filename, rank)
    if not os.path.isdir(out_dir):
        return {}
    found = {}
    for name in os.listdir(out_dir):
        m = pattern.fullmatch(name)
        if m:
            found[int(m.group(1))] = os.path.join(out_dir, name)
    return found


def remove_leftover_temporaries(out_dir: str, rank: int, filename: str = DEFAULT_FILENAME) -> None:
    """Delete ``rank``'s temporary snapshot files that a killed run left in ``out_dir``: repeated
    crashes would fill the disk. Only for the job that writes them, ahead of its first write.

    Args:
        out_dir: the snapshot directory; one that does not exist is left alone.
        rank: the rank whose temporaries are removed.
        filename: the file name pattern the snapshots are written with.

    Raises:
        ValueError: ``filename`` is not a valid pattern (see :func:`snapshot_path`).

    Example::

        >>> torchmn.extensions.snapshot.remove_leftover_temporaries("result", comm.rank)
    """
    pattern = _pattern(filename, rank)
    remove_temporaries(out_dir, pattern.fullmatch)


# The manager's state leaves out its stop triggers; an early-stopping trigger's goes in here.
STOP_TRIGGERS = "torchmn_stop_triggers"


def _stop_triggers(manager: Any) -> list:
    """The early-stopping triggers a ppe manager holds: the user's, and the copy it keeps for
    itself (both count observations)."""
    from torchmn.extensions.early_stopping import MultiNodeEarlyStoppingTrigger

    found = (getattr(manager, "_stop_trigger", None), getattr(manager, "_internal_stop_trigger", None))
    return [t for t in found if isinstance(t, MultiNodeEarlyStoppingTrigger)]


def _state_of(target: Any) -> Any:
    if type(target) is dict:
        return {k: v.state_dict() for k, v in target.items()}
    state = target.state_dict()
    triggers = _stop_triggers(target)
    if triggers:
        state[STOP_TRIGGERS] = [t.state_dict(target) for t in triggers]
    return state


def _load_into(target: Any, state: Any) -> None:
    if type(target) is dict:
        for k, v in target.items():
            v.load_state_dict(state[k])
        return
    target.load_state_dict(state)
    for trigger, trigger_state in zip(_stop_triggers(target), state.get(STOP_TRIGGERS, ())):
        trigger.load_state_dict(trigger_state)


def _default_load(path: str) -> Any:
    return torch.load(path, map_location="cpu")


def resume_latest(target: Any, comm, out_dir: str, filename: str = DEFAULT_FILENAME,
                  loadfun: Callable[[str], Any] = _default_load) -> Optional[int]:
    """Load, on every rank, that rank's snapshot of the newest iteration that every rank has.

    ``target`` is what was saved: an ``ExtensionsManager`` (the default of
    :func:`multi_node_snapshot`), any object with ``load_state_dict``, or a dict of them. Returns
    the iteration resumed from, or ``None`` on every rank when no iteration is common to all
    ranks (nothing is loaded then). If loading fails on any rank, every rank raises. Every rank
    must call it together. ``loadfun(path)`` defaults to ``torch.load(path, map_location="cpu")``.

    Args:
        target: what to load into: an ``ExtensionsManager``, an object with ``load_state_dict``,
            or a dict of them.
        comm: the communicator whose ranks resume together.
        out_dir: the snapshot directory.
        filename: the file name pattern the snapshots were written with.
        loadfun: reads a snapshot file into the saved state.

    Returns:
        The iteration resumed from, the same on every rank, or ``None`` if no iteration is common
        to all ranks.

    Raises:
        ValueError: ``filename`` is not a valid pattern (see :func:`snapshot_path`).
        RuntimeError: loading failed on this rank, and on no lower rank.
        RemoteRankError: loading failed on a lower rank, or on another rank while this one loaded
            its snapshot: when loading fails anywhere, every rank raises.

    Warns:
        RuntimeWarning: on rank 0, when some rank has snapshots but no iteration is common to all
            ranks (training then starts afresh and may overwrite them).

    Example::

        >>> it = torchmn.extensions.resume_latest(manager, comm, "result")
        >>> print("resumed from", it)      # e.g. 300, or None for a fresh start
    """
    mine = available_iterations(out_dir, comm.rank, filename)
    everyone = comm.allgather_obj(sorted(mine))
    common = set(everyone[0]).intersection(*everyone[1:])
    if not common:
        have = [r for r, its in enumerate(everyone) if its]
        if have and comm.rank == 0:
            lack = [r for r, its in enumerate(everyone) if not its]
            if lack:
                newest = max(max(everyone[r]) for r in have)
                found = (f"rank(s) {_ranks(have)} have some, up to iteration {newest}; rank(s) {_ranks(lack)} "
                         f"have none")
                why = ("If a rank crashed before its first snapshot, that is right. If the job now has more "
                       "ranks than when they were written, each new rank needs a file of its own: copy one "
                       "rank's snapshot to the new ranks' names (data-parallel ranks hold the same model) or "
                       "move the old ones away.")
            else:
                found = "; ".join(f"rank {r}'s newest: {', '.join(map(str, sorted(its)[-3:]))}"
                                  for r, its in enumerate(everyone))
                why = ("Every rank has snapshots, but of different iterations: they come from different runs "
                       "(move the old ones away), or the ranks' snapshot triggers fired at different iterations.")
            warnings.warn(
                f"resume_latest: no snapshot iteration in {out_dir} is common to all {comm.size} ranks "
                f"({found}), so training starts afresh and may overwrite them. {why}",
                RuntimeWarning, stacklevel=2)
        return None
    iteration = max(common)
    state = error = None
    try:
        state = loadfun(mine[iteration])
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    # Agreed before loading too: loading a multi-node optimizer's state may be collective, and a rank
    # whose file could not be read would leave the others waiting in it.
    _raise_if_any(comm, error, iteration, out_dir, filename)
    try:
        _load_into(target, state)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    _raise_if_any(comm, error, iteration, out_dir, filename)
    return iteration


def _raise_if_any(comm, error: Optional[str], iteration: int, out_dir: str, filename: str) -> None:
    """Every rank raises if loading failed on any rank, naming the first such rank and its file."""
    errors = [(r, why) for r, why in enumerate(comm.allgather_obj(error)) if why is not None]
    if errors:
        r, why = errors[0]
        message = (f"resume_latest: loading iteration {iteration} failed on rank {r} "
                   f"({snapshot_path(out_dir, filename, iteration, r)}): {why}; raised on rank {comm.rank}")
        raise (RuntimeError if r == comm.rank else RemoteRankError)(message)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


class MultiNodeSnapshot(extension.Extension):
    """Extension made by :func:`multi_node_snapshot`, which describes it.

    Args:
        comm, filename, savefun, target, n_retains, autoload, out_dir, loadfun: as for
            :func:`multi_node_snapshot`.

    Attributes:
        resumed_from: the iteration ``autoload`` resumed from, or ``None``.

    Raises:
        ValueError: ``filename`` is not a valid pattern (see :func:`snapshot_path`).

    Example::

        >>> snap = torchmn.extensions.MultiNodeSnapshot(comm, autoload=True)
        >>> manager.extend(snap, trigger=(1000, "iteration"))
    """

    trigger = 1, "epoch"
    priority = extension.PRIORITY_SNAPSHOT
    needs_model_state = True

    def __init__(self, comm, filename: str = DEFAULT_FILENAME, savefun: Callable[[Any, Any], None] = torch.save,
                 target: Any = None, n_retains: int = -1, autoload: bool = False, out_dir: Optional[str] = None,
                 loadfun: Callable[[str], Any] = _default_load):
        _pattern(filename, comm.rank)  # a bad name fails now, not at the first snapshot
        self.comm = comm
        self.filename = filename
        self.savefun = savefun
        self.target = target
        self.n_retains = n_retains
        self.autoload = autoload
        self.out_dir = out_dir
        self.loadfun = loadfun
        self.resumed_from: Optional[int] = None

    def _dir(self, manager) -> str:
        return self.out_dir if self.out_dir is not None else manager.out

    def initialize(self, manager) -> None:
        """Agree on the trigger, remove leftover temporaries and, with ``autoload``, resume.

        Collective: with ``autoload`` the ranks agree on the iteration to resume from
        (:func:`resume_latest`), and ``resumed_from`` holds it afterwards.

        Args:
            manager: the ``ExtensionsManager`` running this extension.

        Raises:
            RuntimeError, RemoteRankError: with ``autoload``, loading the snapshot failed on some
                rank, as :func:`resume_latest` raises them (every rank raises).

        Example::

            >>> manager.extend(snap)       # the manager calls snap.initialize(manager) as training starts
            >>> snap.resumed_from           # after it, with autoload=True
            3000
        """
        agree_on_own_trigger(self, manager, self.comm)
        # Here, not in resume_latest, which a job that only reads the snapshots may call while
        # this one writes them.
        remove_leftover_temporaries(self._dir(manager), self.comm.rank, self.filename)
        if self.autoload:
            target = manager if self.target is None else self.target
            self.resumed_from = resume_latest(target, self.comm, self._dir(manager), self.filename, self.loadfun)

    def __call__(self, manager) -> None:
        """Save this rank's state of the current iteration, atomically, then drop older snapshots.

        The file is ``filename`` with this iteration and rank, in ``out_dir``; with
        ``n_retains > 0``, only the ``n_retains - 1`` newest older iterations of this rank are kept
        beside it. Every rank writes its own file; saving a target whose state is collective (a
        sharded optimizer's) takes every rank, which the trigger, firing alike on all, provides.

        Args:
            manager: the ``ExtensionsManager`` running this extension.

        Example::

            >>> snap(manager)              # the manager does this whenever the snapshot's trigger fires
        """
        target = manager if self.target is None else self.target
        out_dir = self._dir(manager)
        atomic_save(_state_of(target), snapshot_path(out_dir, self.filename, manager.iteration, self.comm.rank),
                    self.savefun)
        if self.n_retains > 0:
            # Only older iterations than this one go: newer ones are another run's (this one started
            # afresh beside them), and removing by number would remove what was just written.
            found = available_iterations(out_dir, self.comm.rank, self.filename)
            older = sorted(it for it in found if it < manager.iteration)
            for it in older[:max(0, len(older) - (self.n_retains - 1))]:
                os.remove(found[it])


def multi_node_snapshot(comm, filename: str = DEFAULT_FILENAME, savefun: Callable[[Any, Any], None] = torch.save,
                        *, target: Any = None, n_retains: int = -1, autoload: bool = False,
                        out_dir: Optional[str] = None,
                        loadfun: Callable[[str], Any] = _default_load) -> MultiNodeSnapshot:
    """A snapshot extension where every rank saves its own state, atomically.

    ``filename`` must contain ``{iteration}`` and ``{rank}``. ``target`` defaults to the
    manager (models, optimizers, extension states, iteration, and the state of a
    :class:`~torchmn.extensions.MultiNodeEarlyStoppingTrigger` it stops on, which ppe's own state
    leaves out: a resumed run stops where an uninterrupted one would). Files go to ``out_dir``, by
    default the manager's output directory (ranks on different nodes may use local disks).
    ``savefun(obj, file)`` writes to an open binary file. ``n_retains > 0`` keeps only this
    rank's newest ``n_retains`` snapshots; keep at least 2, so that a crash while writing still
    leaves an iteration every rank has. ``autoload=True`` resumes, when training starts, from
    the newest iteration every rank has (see :func:`resume_latest`); ``resumed_from`` then
    holds it, or ``None``. A trigger that is not a function of the iteration alone (ppe's
    ``TimeTrigger``, a value trigger) fires as rank 0 decides, on every rank, so that the ranks
    snapshot the same iterations. ``n_retains`` removes only iterations older than the one just
    written: higher iterations another run left in the same directory are left alone.

    Args:
        comm: the communicator whose ranks snapshot together.
        filename: the file name pattern, with the fields ``{iteration}`` and ``{rank}``.
        savefun: writes the state to an open binary file.
        target: what to save; ``None`` for the manager.
        n_retains: how many of this rank's newest snapshots to keep; ``<= 0`` keeps all.
        autoload: resume from the newest common iteration when training starts.
        out_dir: the snapshot directory; ``None`` for the manager's output directory.
        loadfun: reads a snapshot file, for ``autoload``.

    Returns:
        A :class:`MultiNodeSnapshot` to pass to ``manager.extend``.

    Raises:
        ValueError: ``filename`` is not a valid pattern (see :func:`snapshot_path`).
        TypeError: ``filename`` is not a str (ChainerMN's arguments: a snapshot extension).

    Example::

        >>> manager.extend(torchmn.extensions.multi_node_snapshot(comm, n_retains=2, autoload=True),
        ...                trigger=(1, "epoch"))
    """
    if not isinstance(filename, str):
        raise TorchmnTypeError(
            f"multi_node_snapshot: filename must be a str pattern, not a {type(filename).__name__}. ChainerMN's "
            f"multi_node_snapshot(comm, snapshot, replica_sets) wrapped a snapshot extension; here every rank saves "
            f"its own file: multi_node_snapshot(comm, filename={DEFAULT_FILENAME!r}, n_retains=..., autoload=...)")
    return MultiNodeSnapshot(comm, filename, savefun, target, n_retains, autoload, out_dir, loadfun)
