"""Names the first releases had elsewhere, still found where they were, with a warning.

A module that lost a public name gives `__getattr__ = moved(__name__, {old: "module.new"})`:
the old name is imported from its new home when asked for (so no import circle forms at import
time) and a DeprecationWarning says where it lives now. This module imports nothing of the
package, so any module may use it.
"""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `module` (its __name__): each name of `names` is found at its
    new home, "submodule.Name" under memra_cuda, with a DeprecationWarning."""
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new = names[name].rpartition(".")
        said = (f"{module}.{name} moved: import it from memra_cuda (or memra_cuda.{home})" if new == name else
                f"{module}.{name} is memra_cuda.{home}.{new} now")
        warnings.warn(said, DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"memra_cuda.{home}"), new)
    return __getattr__


__all__ = ["moved"]
