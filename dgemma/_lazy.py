"""Lazy re-exports for package `__init__` modules (PEP 562), so importing a package does not import jax & co.

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"trainer": ("train", "train_loop"), ...})

A name is imported from its submodule on first access and then cached in the package's namespace.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """`(__getattr__, __dir__, __all__)` for `package` re-exporting `exports` (submodule -> names)."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:  # noqa: N807 - the module-level hook PEP 562 looks up
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
