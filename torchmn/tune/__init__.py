"""Searching with Optuna: ``torchmn tune`` runs a command once per trial (:class:`Tuner`), over
torchmn's own settings and any others (:class:`Param`); inside a distributed job,
:class:`MultiNodeStudy` runs each trial with all ranks (:class:`DistributedTrial`).

Example::

    $ torchmn tune -np 2 --n-trials 20 -- python train.py
    $ torchmn tune -np 2 --param --lr=log:1e-4:1e-1 --log result/log -- python train.py
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_NAMES = {"DistributedTrial": "torchmn.tune.distributed", "MultiNodeStudy": "torchmn.tune.distributed",
          "Param": "torchmn.tune.space", "default_space": "torchmn.tune.space", "parse_param": "torchmn.tune.space",
          "TuneError": "torchmn.tune.study", "Tuner": "torchmn.tune.study"}
__all__ = sorted(_NAMES)


# Loaded when first used: ``torchmn run`` and ``torchmn tune`` load this package's command without
# torch, which only the trials inside a job need.
def __getattr__(name: str):
    """Import ``name``'s module the first time ``name`` is used, and keep ``name`` here from then on.

    Args:
        name: the attribute asked for (``torchmn.tune.Tuner``, ``from torchmn.tune import Param``).

    Returns:
        The class or function of that name from its module (listed in ``__all__``).

    Raises:
        AttributeError: ``name`` is not one of this package's names.

    Example::

        >>> import torchmn.tune
        >>> torchmn.tune.Tuner                 # imports torchmn.tune.study now
        <class 'torchmn.tune.study.Tuner'>
    """
    if name not in _NAMES:
        raise AttributeError(f"module 'torchmn.tune' has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    """The package's names, those not imported yet included (for ``dir()`` and completion).

    Returns:
        The sorted names of the module's globals and of ``__all__``.

    Example::

        >>> "MultiNodeStudy" in dir(torchmn.tune)
        True
    """
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from torchmn.tune.distributed import DistributedTrial, MultiNodeStudy
    from torchmn.tune.space import Param, default_space, parse_param
    from torchmn.tune.study import Tuner, TuneError
