"""What ``torchmn tune`` searches: parameters, how each reaches the command, and the default space.

A parameter whose name starts with ``--`` reaches the command as an argument (``--lr 0.01``);
any other name is an environment variable of every rank (``TORCHMN_NUM_THREADS=2``). The default
space is torchmn's own settings, which every script honours without a change:
``TORCHMN_NUM_THREADS`` (threads per rank), ``TORCHMN_INTEROP_THREADS`` (torch's inter-op pool),
``TORCHMN_NUM_WORKERS`` (``torchmn.resources.dataloader_workers_budget``'s answer) and
``TORCHMN_BUCKET_CAP_MB`` (the gradient bucket size).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from torchmn.errors import TorchmnValueError
from torchmn.resources import THREAD_VARIABLES, TORCHMN_NUM_THREADS

KINDS = ("int", "float", "log", "cat")


@dataclasses.dataclass(frozen=True)
class Param:
    """One searched setting.

    Attributes:
        name: an environment variable, or ``--option`` for an argument.
        kind: ``"int"``, ``"float"``, ``"log"`` (a float searched on a log scale) or ``"cat"``.
        low, high: the range (``int``, ``float``, ``log``).
        choices: the values (``cat``).
    """

    name: str
    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    choices: tuple = ()

    def suggest(self, trial):
        """Ask ``trial`` for this parameter's value, under the parameter's name.

        Args:
            trial: an ``optuna.Trial`` (or a :class:`~torchmn.tune.DistributedTrial`).

        Returns:
            An int in ``[low, high]`` for ``"int"``, a float in ``[low, high]`` for ``"float"``
            and ``"log"`` (searched on a log scale for ``"log"``), one of ``choices`` for
            ``"cat"`` (strings, from :func:`parse_param`).

        Example::

            >>> parse_param("X=int:1:4").suggest(trial)
            3
        """
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high))
        if self.kind in ("float", "log"):
            return trial.suggest_float(self.name, self.low, self.high, log=self.kind == "log")
        return trial.suggest_categorical(self.name, list(self.choices))

    @property
    def is_argument(self) -> bool:
        """Whether it reaches the command as an argument (its name starts with ``--``), else as an
        environment variable."""
        return self.name.startswith("--")


def parse_param(spec: str) -> Param:
    """Parse ``NAME=KIND:...``: ``int:LOW:HIGH``, ``float:LOW:HIGH``, ``log:LOW:HIGH`` or
    ``cat:A,B,C``.

    Args:
        spec: the text given to ``--param``.

    Returns:
        The :class:`Param`.

    Raises:
        ValueError: the text does not have that form (the message shows what does).

    Example::

        >>> parse_param("OMP_NUM_THREADS=int:1:4")
        Param(name='OMP_NUM_THREADS', kind='int', low=1, high=4, choices=())
        >>> parse_param("--lr=log:1e-4:1e-1").is_argument
        True
    """
    usage = ("expected NAME=int:LOW:HIGH, NAME=float:LOW:HIGH, NAME=log:LOW:HIGH or NAME=cat:A,B,... "
             "(NAME an environment variable, or --option for an argument), e.g. OMP_NUM_THREADS=int:1:4")
    name, sep, rest = spec.partition("=")
    kind, _, values = rest.partition(":")
    if not sep or not name or kind not in KINDS or not values:
        raise TorchmnValueError(f"--param {spec!r}: {usage}")
    if kind == "cat":
        choices = tuple(v for v in values.split(",") if v)
        if not choices:
            raise TorchmnValueError(f"--param {spec!r}: no choices; {usage}")
        return Param(name, kind, choices=choices)
    parts = values.split(":")
    try:
        low, high = (int(p) for p in parts) if kind == "int" else (float(p) for p in parts)
    except ValueError:
        raise TorchmnValueError(f"--param {spec!r}: LOW and HIGH must be {'whole ' if kind == 'int' else ''}numbers; "
                                f"{usage}") from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise TorchmnValueError(f"--param {spec!r}: LOW and HIGH must be finite numbers; {usage}")
    if low > high or (kind == "log" and low <= 0):
        raise TorchmnValueError(
            f"--param {spec!r}: need LOW <= HIGH{' and LOW > 0 on a log scale' if kind == 'log' else ''}")
    return Param(name, kind, low, high)


def default_space(cpus: int, ranks: int) -> list:
    """torchmn's own settings, sized for ``ranks`` ranks sharing ``cpus`` CPUs.

    Args:
        cpus: the CPUs of the machine the trials run on.
        ranks: the ranks each trial starts on it.

    Returns:
        The parameters.

    Example::

        >>> [p.name for p in default_space(8, 2)]
        ['TORCHMN_NUM_THREADS', 'TORCHMN_INTEROP_THREADS', 'TORCHMN_NUM_WORKERS', 'TORCHMN_BUCKET_CAP_MB']
    """
    top = max(1, cpus // max(1, ranks))
    return [Param("TORCHMN_NUM_THREADS", "int", 1, max(top, min(cpus, 2 * top))),
            Param("TORCHMN_INTEROP_THREADS", "int", 1, max(1, top)),
            Param("TORCHMN_NUM_WORKERS", "int", 0, max(1, top)),
            Param("TORCHMN_BUCKET_CAP_MB", "cat", choices=("1", "4", "25", "100"))]


def trial_command(params: list, values: dict, command: list, env: dict) -> tuple:
    """The command line and environment of a trial.

    Args:
        params: the searched parameters.
        values: the trial's value of each (by name).
        command: the command.
        env: the environment to start from.

    Returns:
        ``(argv, env)``: the command with argument parameters appended, and the environment with
        the others set.

    Example::

        >>> trial_command([parse_param("X=int:1:4")], {"X": 2}, ["python", "t.py"], {})
        (['python', 't.py'], {'X': '2'})
    """
    argv, env = list(command), dict(env)
    for p in params:
        if p.is_argument:
            argv += [p.name, str(values[p.name])]
        else:
            env[p.name] = str(values[p.name])
    return argv, env


def overriding_thread_variables(params: list, env) -> list:
    """The thread variables of ``env`` that would override a searched thread setting in every trial.

    A user's ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``, ...) wins over ``TORCHMN_NUM_THREADS``
    (see :mod:`torchmn.resources`), so a search of it would change nothing; the trials leave these
    out of their environment instead.

    Args:
        params: the searched parameters.
        env: the environment the trials start from.

    Returns:
        The names, in ``torchmn.resources.THREAD_VARIABLES`` order: those set in ``env`` and not
        searched themselves, where ``TORCHMN_NUM_THREADS`` or one of them is searched; else none.

    Example::

        >>> overriding_thread_variables(default_space(8, 2), {"OMP_NUM_THREADS": "2"})
        ['OMP_NUM_THREADS']
    """
    searched = {p.name for p in params}
    if not searched & {TORCHMN_NUM_THREADS, *THREAD_VARIABLES}:
        return []
    return [name for name in THREAD_VARIABLES if name in env and name not in searched]
