"""Searching with Optuna: ``torchmn tune`` runs a command once per trial (:class:`Tuner`), over
torchmn's own settings and any others (:class:`Param`); inside a distributed job,
:class:`MultiNodeStudy` runs each trial with all ranks (:class:`DistributedTrial`).

Example::

    $ torchmn tune -np 2 --n-trials 20 -- python train.py
    $ torchmn tune -np 2 --param --lr=log:1e-4:1e-1 --log result/log -- python train.py
"""
from torchmn.tune.distributed import DistributedTrial, MultiNodeStudy
from torchmn.tune.space import Param, default_space, parse_param
from torchmn.tune.study import Tuner, TuneError

__all__ = ["DistributedTrial", "MultiNodeStudy", "Param", "TuneError", "Tuner", "default_space", "parse_param"]
