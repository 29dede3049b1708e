"""A package face that loads its modules on first use (PEP 562): for packages whose modules are heavy to import
(``planner.inspect``: pandas and matplotlib; ``planner.export``: the search), so that a command that needs one light
name does not pay for the rest at start-up."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``where`` maps each public name to the submodule defining it."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        importlib.import_module(package).__dict__[name] = value
        return value

    return __getattr__
