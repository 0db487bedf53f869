"""A package's public names loaded on first use (PEP 562), so that a process imports
only the modules whose names it uses: Ray's storage-unit and controller actors import
``streamrl`` without torch, and a producer given a Ray queue's handle loads neither the
controller's state machine nor its service."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["exports"]


def exports(package: str, where: Mapping[str, str | None], namespace: dict[str, Any]
            ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of package ``package`` (its ``namespace``:
    ``globals()``) whose name ``n`` lives in its submodule ``where[n]``, or is that
    submodule itself where ``where[n]`` is ``None``. A name is imported once, then kept
    in the namespace; ``dir()`` lists the package's ``__all__`` and these names."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod = where[name]
        value = (importlib.import_module(f".{name}", package) if mod is None
                 else getattr(importlib.import_module(f".{mod}", package), name))
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace.get("__all__", ())) | set(where))

    return __getattr__, __dir__
