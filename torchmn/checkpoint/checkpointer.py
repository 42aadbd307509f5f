"""``Checkpointer``: save and resume a plain training loop on every rank, surviving kills.

What each rank writes, and how the ranks agree on what is complete, is in ``files.py``; which
object is written by whom is decided here (:func:`kind_of`).
"""
from __future__ import annotations

import numbers
import os
import secrets
import time
import warnings
from typing import Any, Optional

import torch

from torchmn.checkpoint import files
from torchmn.checkpoint.rng import rng_state, set_rng_state
from torchmn.elastic import membership
from torchmn.errors import TorchmnError, TorchmnKeyError, TorchmnOSError, TorchmnValueError
from torchmn.optimizers.shard_state import merge_parts

SHARED, PARTS, RANK = "shared", "parts", "rank"


class CheckpointError(TorchmnError, RuntimeError):
    """A checkpoint could not be written or loaded; the message says on which rank and host, and
    what to do. Raised on every rank together."""


def kind_of(obj: Any) -> str:
    """Who writes ``obj``'s state.

    Args:
        obj: an object with ``state_dict()`` and ``load_state_dict()``.

    Returns:
        ``"parts"`` for an optimizer that shards its state (every rank writes its own part:
        it has ``local_state_dict()``); ``"shared"`` for what every rank holds alike (a module,
        an optimizer, a learning-rate scheduler, a gradient scaler, a multi-node iterator): rank 0
        writes it, every rank loads it; ``"rank"`` for anything else, such as a data loader over
        this rank's part of the data: each rank writes and loads its own.

    Example::

        >>> kind_of(torch.nn.Linear(2, 2)), kind_of(loader)
        ('shared', 'rank')
    """
    from torchmn.iterators import MultiNodeIterator

    if callable(getattr(obj, "local_state_dict", None)) and callable(getattr(obj, "load_local_state_dicts", None)):
        return PARTS
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", ())
    if isinstance(obj, (torch.nn.Module, torch.optim.lr_scheduler.LRScheduler, MultiNodeIterator, scaler)) \
            or hasattr(obj, "param_groups"):
        return SHARED
    return RANK


def module_mismatch(module: torch.nn.Module, state: dict, limit: int = 3) -> Optional[str]:
    """How a saved ``state_dict`` differs from ``module``'s own, or None where it fits.

    Args:
        module: the module to load into.
        state: the saved state.
        limit: how many names of each kind of difference to show.

    Returns:
        The missing and unexpected keys and the differing shapes, the first ``limit`` of each,
        in one line; None where the keys and the shapes of the tensors all match.

    Example::

        >>> module_mismatch(torch.nn.Linear(2, 2), {"weight": torch.zeros(2, 2)})
        'missing from the checkpoint: bias'
    """
    own = module.state_dict()

    def names(keys: list) -> str:
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        return ", ".join(keys[:limit]) + more

    problems = []
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} is {tuple(state[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
              for k, v in own.items() if k in state and torch.is_tensor(v) and torch.is_tensor(state[k])
              and state[k].shape != v.shape]
    if missing:
        problems.append(f"missing from the checkpoint: {names(missing)}")
    if unexpected:
        problems.append(f"not in the model: {names(unexpected)}")
    if shapes:
        problems.append(f"shapes differ: {names(shapes)}")
    return "; ".join(problems) or None


class Checkpointer:
    """Checkpoints of a plain training loop, written by every rank together and resumed bit for bit.

    Give it the objects to save by name. Every rank constructs it, and calls :meth:`save` and
    :meth:`load_latest`, together (they are collective). Who writes what (:func:`kind_of`):
    rank 0 writes what every rank holds alike (model, optimizer, scheduler, scaler, a multi-node
    iterator); each rank writes its own RNG states (torch, CUDA, numpy, ``random``), the state of
    its other objects (a :class:`~torchmn.checkpoint.ResumableLoader` over its part of the data), and
    its part of a sharded optimizer's state. Every file is written atomically, and a step counts
    only once rank 0 has marked it complete after every rank wrote its files, so a kill at any
    moment leaves the previous complete step to resume from. The directory must be one that all
    ranks see (a shared file system on several nodes); the constructor checks that.

    A checkpoint loads on another number of ranks where its state allows it: what rank 0 wrote,
    and a sharded optimizer's parts, load on any rank count; RNG states are then left as they are
    (the resume is not bit for bit, and rank 0 warns); per-rank objects refuse.

    Args:
        directory: the checkpoint directory; created if needed.
        comm: the communicator whose ranks checkpoint together.
        keep: how many complete steps to keep (the newest); at least 1.
        **objects: what to save and load, by name: objects with ``state_dict()`` and
            ``load_state_dict()``.

    Attributes:
        resumed_from: the step :meth:`load_latest` loaded, or None.
        extra: this rank's keyword values given to :meth:`save` of the step loaded (rank 0's, where
            another number of ranks wrote it).

    Raises:
        ValueError: ``keep < 1``, or an object without ``state_dict``/``load_state_dict``.
        CheckpointError: on every rank, when the directory cannot be created or written on some
            rank, or some rank does not see rank 0's files in it.

    Example::

        >>> ckpt = torchmn.checkpoint.Checkpointer("ckpt", comm, keep=3, model=model,
        ...                                        optimizer=optimizer, scheduler=scheduler, loader=loader)
        >>> step = ckpt.load_latest() or 0      # on a restart: the newest complete step
        >>> while step < 1000:
        ...     train_one_step(next_batch())
        ...     step += 1
        ...     if step % 100 == 0:
        ...         ckpt.save(step)
    """

    def __init__(self, directory: str, comm, *, keep: int = 3, **objects: Any):
        if int(keep) != keep or keep < 1:
            raise TorchmnValueError(f"Checkpointer: keep={keep!r}; keep at least 1 complete step (2 or more lets "
                                    f"a bad checkpoint be skipped by hand)")
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TorchmnValueError(
                    f"Checkpointer: {name}={type(obj).__name__} has no state_dict()/load_state_dict(); "
                    f"pass objects that do (a plain DataLoader has none: use "
                    f"torchmn.checkpoint.ResumableLoader), or save plain values with save(step, {name}=...)")
        self.directory = os.path.abspath(directory)
        self.comm = comm
        self.keep = int(keep)
        self.objects = dict(objects)
        self.resumed_from: Optional[int] = None
        self.extra: dict = {}
        self._saved: Optional[int] = None  # the last step this Checkpointer saved
        self._written: set = set()  # the steps this run wrote (an elastic job's may be written again)
        if membership.enabled():
            membership.follow(self)
        if membership.awaiting_state():
            # A rank that joined an elastic job: the others are in a reset and make no collective
            # of this; the job's ranks checked the directory when they built theirs.
            self._check_directory_here()
        else:
            self._check_directory()

    def follow_world(self) -> None:
        """Take part in a new world of an elastic job (collective: ``@torchmn.elastic.run`` calls
        it on every rank at each start, before the state's sync). The state goes back to the last
        commit there, so the training repeats the steps since, and saves them again: the steps
        this run wrote since may be written again, and "the steps saved must grow" counts from
        here. A rank that joined learns what the others resumed from and wrote.

        Example::

            >>> ckpt.follow_world()
        """
        views = self.comm.allgather_obj((self.resumed_from, sorted(self._written)))
        self.resumed_from = next((resumed for resumed, _ in views if resumed is not None), None)
        self._written = {step for _, written in views for step in written}
        self._saved = None

    @property
    def kinds(self) -> dict:
        """Who writes each object's state (:func:`kind_of`), as the objects are now: an elastic
        reset changes an optimizer's kind with the rank count (node-shared on several ranks,
        replicated alone).

        Returns:
            ``{name: kind}``.

        Example::

            >>> ckpt.kinds
            {'model': 'shared', 'optimizer': 'parts'}
        """
        return {name: kind_of(obj) for name, obj in self.objects.items()}

    # --- set-up -------------------------------------------------------------------------------

    def _raise_if_any(self, problem: Optional[str], what: str) -> None:
        """Every rank raises if any rank has a problem, naming the first such rank and its host."""
        problems = self.comm.allgather_obj((problem, self.comm.host))
        failed = [(r, p, host) for r, (p, host) in enumerate(problems) if p is not None]
        if failed:
            r, p, host = failed[0]
            others = f" (and on rank(s) {', '.join(str(f[0]) for f in failed[1:])})" if len(failed) > 1 else ""
            raise CheckpointError(f"{what} failed on rank {r} ({host}){others}: {p} [raised on rank {self.comm.rank}]")

    def _write_probe(self) -> tuple[str, Optional[str]]:
        """Make the directory and an empty probe file in it: ``(the probe's path, what went wrong
        or None)``."""
        probe = os.path.join(self.directory, f".probe-{secrets.token_hex(6)}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(probe, "wb"):
                pass
        except OSError as e:
            if os.path.exists(self.directory) and not os.path.isdir(self.directory):
                return probe, (f"the checkpoint directory {self.directory} is a file, not a directory; choose "
                               f"another path (nothing was written)")
            return probe, (f"cannot create files in the checkpoint directory {self.directory}: "
                           f"{e.strerror or e}; choose a directory this user can write")
        return probe, None

    def _check_directory_here(self) -> None:
        """This rank alone can create files in the directory (a rank that joined an elastic job)."""
        probe, problem = self._write_probe()
        if problem is not None:
            raise CheckpointError(f"Checkpointer, on rank {self.comm.rank} ({self.comm.host}), which joined the job: "
                                  f"{problem}; the directory must be on a file system every node mounts")
        os.remove(probe)

    def _check_directory(self) -> None:
        """Every rank can write the directory, and sees there what rank 0 writes in its own: the
        same place, also where nodes mount it under other paths."""
        probe, problem = None, None
        if self.comm.rank == 0:
            probe, problem = self._write_probe()
        probe, problem = self.comm.bcast_obj((probe, problem), root=0)
        if problem is None and self.comm.rank != 0:
            # Looked for in this rank's directory: a directory per rank, or a relative path from
            # another working directory, would see nothing and lose every checkpoint.
            mine = os.path.join(self.directory, os.path.basename(probe))
            if not os.path.exists(mine):
                problem = (f"this rank does not see in its checkpoint directory {self.directory} the file rank 0 "
                           f"wrote in {os.path.dirname(probe)}: give every rank the same directory, on a file "
                           f"system every node mounts (NFS, Lustre, GPFS)")
            else:
                try:
                    with open(mine + f".rank{self.comm.rank}", "wb"):
                        pass
                    os.remove(mine + f".rank{self.comm.rank}")
                except OSError as e:
                    problem = f"cannot create files in the checkpoint directory {self.directory}: {e.strerror or e}"
        try:
            self._raise_if_any(problem, "Checkpointer: checking the directory")
        finally:
            if self.comm.rank == 0 and probe and os.path.exists(probe):
                os.remove(probe)

    # --- saving -------------------------------------------------------------------------------

    def save(self, step: int, **extra: Any) -> None:
        """Write a checkpoint of ``step`` on every rank; older complete steps beyond ``keep`` go.

        Collective: every rank calls it with the same step, between steps (after
        ``optimizer.step()``). It returns once every rank has written its files.

        Args:
            step: the step number (a non-negative integer, larger than any complete step saved
                before, except the one this run resumed from or saved last, which is then left as
                it is: saving every N steps and at each epoch's end may meet).
            **extra: plain picklable values of this rank to keep with the step
                (:attr:`extra` after :meth:`load_latest`).

        Raises:
            ValueError: ``step`` is not a non-negative integer.
            CheckpointError: on every rank, when the ranks disagree on the step, a newer complete
                step of another run is in the directory, or writing failed on some rank (a full
                disk, say): older complete steps are left as they are.

        Example::

            >>> if step % 100 == 0:
            ...     ckpt.save(step, epoch=epoch)
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Real) or int(step) != step or step < 0:
            raise TorchmnValueError(f"Checkpointer.save: step={step!r} must be a non-negative integer")
        step = int(step)
        # The state is the one just loaded, or this step was saved already (every N steps and at
        # each epoch's end can meet): the complete step on disk holds it.
        kept = step in (self.resumed_from, self._saved)
        refusal = None
        if self.comm.rank == 0 and not kept:
            try:
                last = max((s for s in (self._saved, self.resumed_from) if s is not None), default=None)
                refusal = (f"this run {'saved' if last == self._saved else 'resumed from'} step {last} already; the "
                           f"steps it saves must grow" if last is not None and step < last else self._prepare_step(step))
            except OSError as e:  # told to every rank below, rather than leaving them waiting
                refusal = f"preparing {files.step_dir(self.directory, step)} on rank 0 ({self.comm.host}): {e}"
        agreed = self.comm.allgather_obj((step, kept, refusal))
        if len({s for s, _, _ in agreed}) > 1:
            raise CheckpointError(f"Checkpointer.save: the ranks save different steps ("
                                  f"{', '.join(f'rank {r}: {s}' for r, (s, _, _) in enumerate(agreed))}); every "
                                  f"rank must save the same step together [raised on rank {self.comm.rank}]")
        if all(k for _, k, _ in agreed):
            return
        if any(k for _, k, _ in agreed):
            kept_on = ", ".join(str(r) for r, (_, k, _) in enumerate(agreed) if k)
            raise CheckpointError(f"Checkpointer.save({step}): rank(s) {kept_on} saved or resumed from this step already "
                                  f"and the others did not; every rank must load and save the same steps [raised on "
                                  f"rank {self.comm.rank}]")
        refusal = agreed[0][2]
        if refusal:
            raise CheckpointError(f"Checkpointer.save({step}): {refusal} [raised on rank {self.comm.rank}]")
        folder = files.step_dir(self.directory, step)
        written, problem = {}, None
        kinds = self.kinds
        try:
            states = {name: obj.state_dict() for name, obj in self.objects.items() if kinds[name] == RANK}
            parts = {name: obj.local_state_dict() for name, obj in self.objects.items() if kinds[name] == PARTS}
            mine = {"rank": self.comm.rank, "size": self.comm.size, "rng": rng_state(), "objects": states,
                    "parts": parts, "extra": extra}
            written[files.rank_file(self.comm.rank)] = files.atomic_save(
                mine, os.path.join(folder, files.rank_file(self.comm.rank)))
            if self.comm.rank == 0:
                shared = {name: obj.state_dict() for name, obj in self.objects.items() if kinds[name] == SHARED}
                written[files.SHARED] = files.atomic_save(shared, os.path.join(folder, files.SHARED))
        except Exception as e:
            problem = f"writing {folder}: {type(e).__name__}: {e}"
        everyone = self.comm.allgather_obj((problem, self.comm.host, written))
        failed = [(r, p, host) for r, (p, host, _) in enumerate(everyone) if p is not None]
        if failed:
            r, p, host = failed[0]
            raise CheckpointError(f"Checkpointer.save({step}) failed on rank {r} ({host}): {p}. The step is not "
                                  f"marked complete; the older complete steps are kept [raised on rank "
                                  f"{self.comm.rank}]")
        marked = None
        if self.comm.rank == 0:
            sizes = {name: size for _, _, w in everyone for name, size in w.items()}
            try:
                files.write_manifest(self.directory, step, {
                    "step": step, "size": self.comm.size, "files": sizes, "kinds": kinds,
                    "hosts": [host for _, host, _ in everyone], "time": time.time()})
            except OSError as e:
                marked = f"writing its manifest {files.MANIFEST} in {folder}: {e}"
        # Written by this run, complete now or not: a reset before every rank hears of it replays the step.
        self._written.add(step)
        # Every rank learns whether the step is complete: a full disk here is every rank's error.
        marked = self.comm.bcast_obj(marked, root=0)
        if marked is not None:
            raise CheckpointError(f"Checkpointer.save({step}) failed on rank 0 ({everyone[0][1]}): {marked}. The "
                                  f"step is not marked complete; the older complete steps are kept [raised on rank "
                                  f"{self.comm.rank}]")
        self._saved = step
        if self.comm.rank == 0:
            self._prune(step)

    def _prepare_step(self, step: int) -> Optional[str]:
        """On rank 0, before any rank writes: refuse to overwrite another run's newer complete
        step; clear this run's own earlier writing of this step (an elastic job's replay), or an
        incomplete folder of it that a killed run left."""
        # A damaged step (a file cut short or missing since) is no checkpoint: load_latest skipped it.
        # Steps this run wrote itself are no other run's: an elastic job replaying the steps since
        # its last commit writes them again.
        newer = [s for s in self.complete_steps() if s >= step and s not in self._written]
        if newer:
            return (f"{self.directory} already holds a complete checkpoint of step {newer[-1]}, which this run did "
                    f"not resume from; call load_latest() first to continue that run, or use another directory "
                    f"(nothing was overwritten)")
        if step in self._written:
            files.remove_step(self.directory, step)  # manifest first: never complete with a file missing
        if os.path.isdir(files.step_dir(self.directory, step)):
            files.remove_folder(self.directory, step)
        return None

    def _prune(self, step: int) -> None:
        """On rank 0: remove complete steps beyond the newest ``keep``, and incomplete ones older
        than ``step`` (left by kills). The save is complete by now: a step that cannot be removed
        (a file of another user's, a read-only mount) is warned of and left, not raised on rank 0
        alone."""
        complete = []
        try:
            for s in files.steps_on_disk(self.directory):
                if s < step and files.read_manifest(self.directory, s) is None:
                    files.remove_folder(self.directory, s)
                elif s <= step:
                    complete.append(s)
            for s in complete[:-self.keep]:
                files.remove_step(self.directory, s)
        except OSError as e:
            warnings.warn(f"Checkpointer.save({step}) is complete, but an older step in {self.directory} could not be "
                          f"removed (keep={self.keep}): {e}; remove it by hand, or give this run a directory it owns",
                          stacklevel=3)

    # --- loading ------------------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """The complete steps in the directory, oldest first (no communication).

        Returns:
            The steps whose manifest is there and whose files all have the sizes it records.

        Example::

            >>> ckpt.complete_steps()
            [80, 90, 100]
        """
        return [s for s, _, damage in self._marked_complete() if damage is None]

    def _marked_complete(self) -> list[tuple[int, dict, Optional[str]]]:
        """``(step, manifest, what is wrong with its files or None)`` for every step with a manifest,
        oldest first."""
        found = []
        for s in files.steps_on_disk(self.directory):
            manifest, problem = files.manifest_and_problem(self.directory, s)
            if manifest is not None:
                found.append((s, manifest, files.whole_files(self.directory, s, manifest, list(manifest["files"]))))
            elif problem is not None:
                found.append((s, {}, problem))  # marked complete once, damaged since
        return found

    def load_latest(self) -> Optional[int]:
        """Load, on every rank, the newest step that every rank wrote completely.

        Collective. Restores every object given to the constructor, this rank's RNG states and
        :attr:`extra`. A step whose writing a kill interrupted is never loaded.

        Returns:
            The step loaded, the same on every rank, or None when there is none (nothing is
            loaded, and training starts afresh).

        Raises:
            CheckpointError: on every rank, when the checkpoint does not fit (another model: the
                first differing keys and shapes are named; per-rank state written by another
                number of ranks) or cannot be read on some rank; nothing is changed on disk.

        Example::

            >>> start = ckpt.load_latest()
            >>> print("resuming from", start)      # e.g. 300, or None for a fresh start
        """
        choice, problem = None, None
        if self.comm.rank == 0:
            try:
                marked = self._marked_complete()
            except OSError as e:  # told to every rank below, rather than leaving them waiting
                marked, problem = [], f"reading {self.directory} on rank 0 ({self.comm.host}): {e}"
            whole = [(s, manifest) for s, manifest, damage in marked if damage is None]
            steps = [s for s, _ in whole]
            if whole:
                choice = whole[-1]
            for s, _, damage in marked:
                if damage is not None and (not steps or s > steps[-1]):
                    warnings.warn(f"Checkpointer: step {s} in {self.directory} is damaged ({damage}) and is "
                                  f"skipped; " + (f"resuming from step {steps[-1]}" if steps else "starting afresh")
                                  + "; the next save of that step replaces it", RuntimeWarning, stacklevel=2)
        choice, problem = self.comm.bcast_obj((choice, problem), root=0)
        if problem is not None:
            raise CheckpointError(f"Checkpointer.load_latest: {problem} [raised on rank {self.comm.rank}]")
        if choice is None:
            return None
        step, manifest = choice
        saved_size = manifest["size"]
        problem = self._fit_rank_count(saved_size)
        self._raise_if_any(problem, f"Checkpointer.load_latest (step {step})")
        what = (f"Checkpointer.load_latest: loading step {step} from {self.directory} (move "
                f"{files.step_dir(self.directory, step)} away to resume from the step before)")
        problem = saved = None
        try:
            saved = self._read(step, manifest)
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        self._raise_if_any(problem, what)
        # One object at a time, agreed after each: an optimizer's loading may be collective (a
        # barrier in shared memory), which a rank that failed on an earlier object would never reach.
        for name, obj in self.objects.items():
            problem = None
            try:
                self._load_object(name, obj, saved)
            except Exception as e:
                problem = f"{name}: {type(e).__name__}: {e}"
            self._raise_if_any(problem, what)
        mine = saved["mine"]
        if mine is not None:
            set_rng_state(mine["rng"])
        self.extra = dict((mine if mine is not None else saved["rank0"]).get("extra", {}))
        if saved_size != self.comm.size and self.comm.rank == 0:
            warnings.warn(f"Checkpointer: step {step} was written by {saved_size} ranks and is loaded on "
                          f"{self.comm.size}: the model and optimizer are restored, the random number "
                          f"generators are not, so the run does not repeat the old one bit for bit",
                          RuntimeWarning, stacklevel=2)
        self.resumed_from = step
        return step

    def _fit_rank_count(self, saved_size: int) -> Optional[str]:
        if saved_size == self.comm.size:
            return None
        per_rank = [name for name, kind in self.kinds.items() if kind == RANK]
        if not per_rank:
            return None
        return (f"the checkpoint was written by {saved_size} ranks and this job has {self.comm.size}: the per-rank "
                f"state of {', '.join(per_rank)} (each rank's own, such as its data position) cannot be moved "
                f"between rank counts. Resume with {saved_size} ranks, or leave {', '.join(per_rank)} out of the "
                f"Checkpointer to start its epoch afresh")

    def _read(self, step: int, manifest: dict) -> dict:
        """What this rank loads from ``step``'s files, checked against the objects (nothing is loaded)."""
        folder = files.step_dir(self.directory, step)
        saved_size = manifest["size"]
        same_size = saved_size == self.comm.size
        # Each object's state is where the run that saved it put it: an optimizer may have changed
        # kind with the rank count (the node-shared one on several ranks, the replicated one alone).
        kinds = self.kinds
        saved_kinds = {name: manifest.get("kinds", {}).get(name, kind) for name, kind in kinds.items()}
        in_parts = [name for name, kind in saved_kinds.items() if kind == PARTS]
        need = [files.SHARED] if files.SHARED in manifest["files"] else []
        # Another rank count: the per-rank values of save(**extra) come from rank 0's file.
        need.append(files.rank_file(self.comm.rank if same_size else 0))
        if in_parts:
            need.extend(files.rank_file(r) for r in range(saved_size))
        wrong = files.whole_files(self.directory, step, manifest, sorted(set(need)))
        if wrong:
            raise TorchmnOSError(wrong)

        loaded: dict = {}

        def read(name: str) -> Any:  # each file once
            if name not in loaded:
                path = os.path.join(folder, name)
                try:
                    loaded[name] = torch.load(path, map_location="cpu", weights_only=False)
                except Exception as e:  # noqa: BLE001 - any unreadable file: say which
                    raise TorchmnOSError(f"{path} cannot be read ({type(e).__name__}: {e})") from e
            return loaded[name]

        shared = read(files.SHARED) if files.SHARED in need else {}
        mine = read(files.rank_file(self.comm.rank)) if same_size else None
        parts_of = {}
        if in_parts:
            everyone = [read(files.rank_file(r)) for r in range(saved_size)]
            parts_of = {name: [rank["parts"].get(name) for rank in everyone] for name in in_parts}
        saved_names = {**shared, **(mine["objects"] if mine else {}), **parts_of}
        missing = [name for name in kinds
                   if name not in saved_names or (name in parts_of and None in parts_of[name])]
        if missing:
            raise TorchmnKeyError(f"the checkpoint has no state for {', '.join(missing)} (it holds "
                                  f"{', '.join(sorted(manifest.get('kinds', {}))) or 'nothing'}); give the Checkpointer "
                                  f"the same names as the run that wrote it")
        for name, obj in self.objects.items():
            if isinstance(obj, torch.nn.Module):
                mismatch = module_mismatch(obj, shared[name])
                if mismatch:
                    raise TorchmnValueError(f"{name}: the checkpoint is of another model: {mismatch}")
        return {"kinds": saved_kinds, "shared": shared, "mine": mine, "parts": parts_of,
                "rank0": None if same_size else read(files.rank_file(0))}

    def _load_object(self, name: str, obj: Any, saved: dict) -> None:
        """Load one object's state from what :meth:`_read` found."""
        kind, saved_kind = self.kinds[name], saved["kinds"][name]
        if saved_kind == SHARED:  # a whole state: a sharding optimizer takes it too
            obj.load_state_dict(saved["shared"][name])
        elif saved_kind == PARTS and kind == PARTS:
            obj.load_local_state_dicts(saved["parts"][name])
        elif saved_kind == PARTS:  # parts of a sharding optimizer, into one that is not
            obj.load_state_dict(merge_parts(saved["parts"][name], obj.param_groups))
        else:
            obj.load_state_dict(saved["mine"]["objects"][name])
