"""Short import paths for the names users write in YAML, resolved on first use.

A package's ``__init__`` lists ``name -> defining module``; the defining module is imported only when the name is
first used, so ``import lightning_swarm`` stays cheap (no torch, lightning or hivemind until needed).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def lazy_exports(package: str, exports: Dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that imports ``exports[name]`` and returns its ``name``.

    Args:
        package: the package's ``__name__`` (for the error message).
        exports: exported name -> dotted path of the module that defines it.
    """

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
