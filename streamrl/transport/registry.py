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

from collections.abc import Callable
from typing import TYPE_CHECKING

from .._registry import Registry
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
_REG: Registry[Factory] = Registry(
    "transport", ENTRY_POINT_GROUP, _BUILTIN, "config -> Transport",
    load_hint="install what it needs (for 'ray': pip install 'streamrl[ray]')")


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
    _REG.register(name, factory, replace=replace)


def unregister(name: str) -> None:
    """Forget a registered transport (built-ins come back with their default)."""
    _REG.unregister(name)


def available() -> list[str]:
    """The names of the registered transports (entry points included)."""
    return _REG.available()


def resolve(name: str) -> Factory:
    """The factory of transport ``name``.

    Raises:
        InvalidArgument: no transport of that name (the message lists those there are).
    """
    f = _REG.get(name)
    if f is None:
        raise InvalidArgument(
            f"unknown transport {name!r}; registered transports: {', '.join(available())}. "
            "Register yours with streamrl.transport.register(name, factory) or the "
            f"{ENTRY_POINT_GROUP!r} entry-point group")
    return f
