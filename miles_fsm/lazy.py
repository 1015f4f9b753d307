"""Package facades whose names resolve on first use (PEP 562).

``import miles_fsm`` (or ``.states``, ``.drivers``) then costs nothing: a
tool that reads traces never imports torch, and the facade holds no import
statement of a layer above the engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]) -> tuple[
        Callable[[str], object], Callable[[], list[str]]]:  # fmt: skip
    """``__getattr__`` and ``__dir__`` for ``package``: name -> the module that defines it."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # resolved once; later lookups never come back here
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
