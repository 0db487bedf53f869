"""The transport registry: how ``StreamQueue(transport="name")`` finds a deployment.

A transport is registered under a name with a factory that builds it from a
:class:`~streamrl.config.QueueConfig`::

    import streamrl.transport

    def make(config):               # -> a streamrl.transport.Transport
        return MyTransport(config)

    streamrl.transport.register("mine", make)
    q = streamrl.StreamQueue(transport="mine", options={"endpoint": "..."})

Packages can also register transports without being imported first, through the entry
point group ``streamrl.transports`` (in ``pyproject.toml``)::

    [project.entry-points."streamrl.transports"]
    mine = "my_package.transport:make"

The built-in ``"embedded"`` and ``"ray"`` transports are registered this way by name
too, so that Ray is imported only by queues that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from ..errors import InvalidArgument

if TYPE_CHECKING:
    from ..config import QueueConfig
    from .base import Transport

__all__ = ["register", "unregister", "resolve", "available", "ENTRY_POINT_GROUP"]

#: The entry-point group third-party transports register under.
ENTRY_POINT_GROUP = "streamrl.transports"

Factory = Callable[["QueueConfig"], "Transport"]

_BUILTIN = {
    "embedded": "streamrl.transport.embedded:create",
    "ray": "streamrl.transport.ray:create",
    "rdt": "streamrl.transport.rdt:create",
}
_registry: dict[str, Factory | str] = dict(_BUILTIN)
_scanned = False


def register(name: str, factory: Factory | str, *, replace: bool = False) -> None:
    """Make ``StreamQueue(transport=name)`` build its deployment with ``factory(config)``.

    Args:
        name: the transport's name.
        factory: a callable taking a :class:`~streamrl.config.QueueConfig` and returning
            a :class:`~streamrl.transport.Transport`, or ``"module:attribute"`` naming
            one (imported on first use).

    Keyword Args:
        replace: allow replacing a registered transport of that name.

    Raises:
        InvalidArgument: a bad name or factory, or the name is taken (without ``replace``).

    Examples:
        >>> import streamrl
        >>> from streamrl.transport import embedded, register, unregister
        >>> register("in-process", embedded.create)   # the built-in one, under a new name
        >>> q = streamrl.StreamQueue(capacity=16, transport="in-process")
        >>> q.transport                               # the transport's own name
        'embedded'
        >>> unregister("in-process")
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a transport name must be a non-empty str, got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise InvalidArgument(
            f"factory must be callable (config -> Transport) or 'module:attribute', got "
            f"{factory!r}")
    _scan()
    if name in _registry and not replace and _registry[name] is not factory:
        raise InvalidArgument(
            f"a transport named {name!r} is registered already; pass replace=True to "
            "replace it, or pick another name")
    _registry[name] = factory


def unregister(name: str) -> None:
    """Forget a registered transport (built-ins come back with their default)."""
    _registry.pop(name, None)
    if name in _BUILTIN:
        _registry[name] = _BUILTIN[name]


def available() -> list[str]:
    """The names of the registered transports (entry points included)."""
    _scan()
    return sorted(_registry)


def resolve(name: str) -> Factory:
    """The factory of transport ``name``.

    Raises:
        InvalidArgument: no transport of that name (the message lists those there are).
    """
    _scan()
    f = _registry.get(name)
    if f is None:
        raise InvalidArgument(
            f"unknown transport {name!r}; registered transports: {', '.join(available())}. "
            "Register yours with streamrl.transport.register(name, factory) or the "
            f"{ENTRY_POINT_GROUP!r} entry-point group")
    if isinstance(f, str):
        f = _registry[name] = _load(f, name)
    return f


def _load(spec: str, name: str) -> Factory:
    mod, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise InvalidArgument(
            f"transport {name!r} cannot be loaded from {spec!r} ({type(e).__name__}: {e}); "
            "install what it needs (for 'ray': pip install 'streamrl[ray]')") from e
    if not callable(obj):
        raise InvalidArgument(f"transport {name!r}: {spec!r} is not callable")
    return obj


def _scan() -> None:
    """Register the transports of the entry-point group (once)."""
    global _scanned
    if _scanned:
        return
    _scanned = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(ep.name, ep.value)
