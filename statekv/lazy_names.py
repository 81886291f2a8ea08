"""A package's public names loaded on first use (PEP 562), so importing the package loads none of their modules."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def names_on_first_use(package: dict[str, Any], homes: dict[str, tuple[str, ...]]
                       ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for the package whose globals are ``package``, each name of
    ``homes`` (module, absolute or relative to the package: its names) imported from its module when first asked
    for and kept in the package's globals."""
    home_of = {name: module for module, names in homes.items() for name in names}
    public = sorted(home_of)

    def getattr_(name: str) -> Any:
        module = home_of.get(name)
        if module is None:
            raise AttributeError(f"module {package['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package["__name__"]), name)
        package[name] = value  # later lookups find it without this function
        return value

    def dir_() -> list[str]:
        return sorted(set(package) | set(public))

    return public, getattr_, dir_
