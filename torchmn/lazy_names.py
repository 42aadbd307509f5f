"""Names a package loads the first time they are used (PEP 562's module ``__getattr__``).

``import torchmn`` must not import torch: the launcher and its helper processes (``torchmn.run``)
are part of the package and run where torch would only cost seconds and memory. So the package
root, ``torchmn.run`` and ``torchmn.tune`` list their public names with the module each lives in,
and import that module on first use.

Example::

    >>> # in a package's __init__.py
    >>> __getattr__, __dir__, __all__ = attach(__name__, {"Tuner": "torchmn.tune.study"})
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping, Sequence, Tuple


def attach(package: str, names: Mapping[str, str],
           subpackages: Sequence[str] = ()) -> Tuple[Callable[[str], object], Callable[[], list], list]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of a package whose names load on first use.

    The first ``package.X`` imports the module that defines ``X`` and keeps ``X`` in the package,
    so later lookups are plain attributes; ``from package import X`` works the same way.

    Args:
        package: the package's ``__name__``.
        names: each public name, and the module that defines it.
        subpackages: subpackages reachable as attributes without importing them first.

    Returns:
        ``(__getattr__, __dir__, __all__)``, to assign at the package's top level.

    Example::

        >>> __getattr__, __dir__, __all__ = attach("torchmn.run", {"run": "torchmn.run.job"})
        >>> __all__
        ['run']
    """
    public = sorted([*names, *subpackages])

    def __getattr__(name: str):
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
        elif name in subpackages:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__, list(public)
