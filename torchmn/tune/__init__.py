"""Searching with Optuna: ``torchmn tune`` runs a command once per trial (:class:`Tuner`), over
torchmn's own settings and any others (:class:`Param`); inside a distributed job,
:class:`MultiNodeStudy` runs each trial with all ranks (:class:`DistributedTrial`).

Example::

    $ torchmn tune -np 2 --n-trials 20 -- python train.py
    $ torchmn tune -np 2 --param --lr=log:1e-4:1e-1 --log result/log -- python train.py
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torchmn import lazy_names

_NAMES = {"DistributedTrial": "torchmn.tune.distributed", "MultiNodeStudy": "torchmn.tune.distributed",
          "Param": "torchmn.tune.space", "default_space": "torchmn.tune.space", "parse_param": "torchmn.tune.space",
          "TuneError": "torchmn.tune.study", "Tuner": "torchmn.tune.study"}
# Loaded when first used: ``torchmn run`` and ``torchmn tune`` load this package's command without
# torch, which only the trials inside a job need.
__getattr__, __dir__, __all__ = lazy_names.attach(__name__, _NAMES)


if TYPE_CHECKING:
    from torchmn.tune.distributed import DistributedTrial, MultiNodeStudy
    from torchmn.tune.space import Param, default_space, parse_param
    from torchmn.tune.study import Tuner, TuneError
