"""One named-factory registry, shared by transports, storage backends and samplers.

Each registers factories by name (a callable, or ``"module:attribute"`` imported on
first use), scans an entry-point group once, and lets built-ins come back after they
were replaced and unregistered. The modules keep their own public functions and their
own messages; this holds the mechanism.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from .errors import InvalidArgument

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["Registry"]


class Registry(Generic[F]):
    """Factories of one kind of thing, by name.

    Args:
        kind: what is registered, for messages (``"transport"``, ``"storage backend"``).
        group: the entry-point group scanned (once) for third-party factories.
        builtin: name -> factory (or ``"module:attribute"``) present from the start.
        signature: how a factory is called, for messages (``"config -> Transport"``).

    Keyword Args:
        colon_names: whether a name may contain ``":"`` (not where ``"module:attribute"``
            is accepted in place of a name).
        load_hint: what a message adds when a factory cannot be imported.
        on_change: called after every register/unregister (to drop caches).
    """

    def __init__(self, kind: str, group: str, builtin: Mapping[str, F | str], signature: str,
                 *, colon_names: bool = True, load_hint: str = "",
                 on_change: Callable[[], None] | None = None):
        self.kind, self.group, self.signature = kind, group, signature
        self._builtin = dict(builtin)
        self._entries: dict[str, F | str] = dict(builtin)
        self._colon_names, self._load_hint, self._on_change = colon_names, load_hint, on_change
        self._scanned = False

    def register(self, name: str, factory: F | str, *, replace: bool = False) -> None:
        if not isinstance(name, str) or not name or (":" in name and not self._colon_names):
            raise InvalidArgument(
                f"a {self.kind} name must be a non-empty str"
                + ("" if self._colon_names else " without ':'") + f", got {name!r}")
        if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
            raise InvalidArgument(
                f"factory must be callable ({self.signature}) or 'module:attribute', got "
                f"{factory!r}")
        self._scan()
        if name in self._entries and not replace and self._entries[name] is not factory:
            raise InvalidArgument(
                f"a {self.kind} named {name!r} is registered already; pass replace=True to "
                "replace it, or pick another name")
        self._entries[name] = factory
        if self._on_change is not None:
            self._on_change()

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)
        if name in self._builtin:
            self._entries[name] = self._builtin[name]
        if self._on_change is not None:
            self._on_change()

    def available(self) -> list[str]:
        self._scan()
        return sorted(self._entries)

    def get(self, name: str) -> F | None:
        """The factory of ``name`` (imported now if it was registered as a string), or
        ``None`` when nothing has that name."""
        self._scan()
        f = self._entries.get(name)
        if isinstance(f, str):
            f = self._entries[name] = self.load(f, name)
        return f

    def load(self, spec: str, name: str) -> F:
        """The callable ``"module:attribute"`` names."""
        mod, _, attr = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise InvalidArgument(
                f"{self.kind} {name!r} cannot be loaded from {spec!r} ({type(e).__name__}: "
                f"{e})" + (f"; {self._load_hint}" if self._load_hint else "")) from e
        if not callable(obj):
            raise InvalidArgument(f"{self.kind} {name!r}: {spec!r} is not callable")
        return obj

    def _scan(self) -> None:
        if self._scanned:
            return
        self._scanned = True
        for ep in entry_points(group=self.group):
            self._entries.setdefault(ep.name, ep.value)
