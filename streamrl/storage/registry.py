"""The storage registry: how ``StreamQueue(storage=...)`` finds a backend.

A backend is registered under a name with a factory that builds one storage unit::

    import streamrl.storage

    def make(index, *, on_release=None, **options):     # -> a StorageBackend
        return MyUnit(index, on_release=on_release, **options)

    streamrl.storage.register("mine", make)
    q = streamrl.StreamQueue(storage={"backend": "mine", "path": "/data"})

``storage=`` is a name (``"memory"``) or a mapping ``{"backend": name, **options}``; the
options are passed to the factory as keyword arguments. A factory whose signature names
its options (no ``**options``) gets unknown options refused with a message naming them. A
factory may also carry a ``check_options(**options)`` attribute that raises
:class:`~streamrl.errors.InvalidArgument` for bad values: it runs where the queue is made
(on Ray: in the driver), before any unit is built.

Every transport builds its units with :func:`create_unit`, in the process that hosts
them: on Ray, a storage-unit actor. A backend registered by calling :func:`register` in
the driver is not registered in those actors; for Ray, register it through the entry
point group ``streamrl.storage`` (in ``pyproject.toml``)::

    [project.entry-points."streamrl.storage"]
    mine = "my_package.storage:make"

or give its factory as ``"module:attribute"`` (importable on every node) in place of the
name: ``storage={"backend": "my_package.storage:make"}``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .._registry import Registry
from ..errors import InvalidArgument
from .base import StorageBackend

__all__ = ["register", "unregister", "available", "resolve", "create_unit", "check_spec",
           "ENTRY_POINT_GROUP"]

#: The entry-point group third-party storage backends register under.
ENTRY_POINT_GROUP = "streamrl.storage"

#: ``factory(index, *, on_release=None, **options) -> StorageBackend``
Factory = Callable[..., StorageBackend]

_BUILTIN = {
    "memory": "streamrl.storage.memory:create",
    "spill": "streamrl.storage.spill:create",
}
_REG: Registry[Factory] = Registry(
    "storage backend", ENTRY_POINT_GROUP, _BUILTIN,
    "(index, *, on_release=None, **options) -> StorageBackend", colon_names=False,
    load_hint="install the package that provides it")


def register(name: str, factory: Factory | str, *, replace: bool = False) -> None:
    """Make ``StreamQueue(storage=name)`` (or ``{"backend": name, **options}``) build its
    storage units with ``factory(index, on_release=..., **options)``.

    Args:
        name: the backend's name.
        factory: a callable ``(index, *, on_release=None, **options) ->``
            :class:`~streamrl.storage.StorageBackend`, or ``"module:attribute"`` naming one
            (imported on first use). ``on_release``, when not ``None``, must be called
            with each tensor that was put once the unit no longer refers to it.

    Keyword Args:
        replace: allow replacing a registered backend of that name.

    Raises:
        InvalidArgument: a bad name or factory, or the name is taken (without ``replace``).

    Examples:
        >>> import streamrl.storage as storage
        >>> storage.register("memory2", storage.StorageUnit)
        >>> storage.create_unit("memory2", 0).stats()
        (0, 0)
        >>> storage.unregister("memory2")
    """
    _REG.register(name, factory, replace=replace)


def unregister(name: str) -> None:
    """Forget a registered backend (built-ins come back with their default)."""
    _REG.unregister(name)


def available() -> list[str]:
    """The names of the registered backends (entry points included)."""
    return _REG.available()


def resolve(name: str) -> Factory:
    """The factory of backend ``name`` (or of ``"module:attribute"``).

    Raises:
        InvalidArgument: no backend of that name (the message lists those there are).
    """
    f = _REG.get(name)
    if f is None:
        if isinstance(name, str) and ":" in name:
            return _REG.load(name, name)
        raise InvalidArgument(
            f"unknown storage backend {name!r}; registered backends: {', '.join(available())}. "
            "Register yours with streamrl.storage.register(name, factory) or the "
            f"{ENTRY_POINT_GROUP!r} entry-point group")
    return f


def check_spec(spec: Any) -> tuple[str, dict[str, Any], Factory]:
    """``(name, options, factory)`` of a ``storage=`` value; the options are checked
    against the factory's signature when it names them, and by the factory's
    ``check_options(**options)`` when it has one.

    Raises:
        InvalidArgument: not a name or ``{"backend": name, ...}`` mapping, an unknown
            backend, or options the backend does not take (named, with those it takes).
    """
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("backend", None)
        if name is None:
            raise InvalidArgument(
                f"storage={spec!r} names no backend: pass {{'backend': name, **options}} "
                f"(backends: {', '.join(available())})")
    else:
        name, options = spec, {}
    if not isinstance(name, str) or not name:
        raise InvalidArgument(
            f"storage must be a backend name ({', '.join(available())}) or a mapping "
            f"{{'backend': name, **options}}, got {spec!r}")
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise InvalidArgument(f"storage options must be named by str, got {bad!r}")
    factory = resolve(name)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or an odd callable: the call checks
        return name, options, factory
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = [n for n, p in params.items()
                 if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                 and n not in ("index", "on_release", "self")]
        unknown = sorted(set(options) - set(takes))
        if unknown:
            close = difflib.get_close_matches(unknown[0], takes, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidArgument(
                f"storage backend {name!r} has no option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}{hint}; its options: "
                f"{', '.join(takes) if takes else '(none)'}")
    check = getattr(factory, "check_options", None)
    if check is not None:
        check(**options)
    return name, options, factory


def create_unit(spec: Any, index: int, *, on_release: Callable[[Any], None] | None = None
                ) -> StorageBackend:
    """The storage unit ``index`` of a queue whose ``storage`` option is ``spec`` (a
    backend name, or a mapping ``{"backend": name, **options}``). Every transport builds
    its units through this function.

    Raises:
        InvalidArgument: an unknown backend or bad options (see :func:`check_spec`), or
            a factory that did not return a :class:`~streamrl.storage.StorageBackend`.
    """
    name, options, factory = check_spec(spec)
    try:
        unit = factory(index, on_release=on_release, **options)
    except TypeError as e:
        if isinstance(e, InvalidArgument):
            raise
        raise InvalidArgument(f"storage backend {name!r} refused options {options!r}: {e}") from e
    if not isinstance(unit, StorageBackend):
        raise InvalidArgument(
            f"storage backend {name!r}'s factory returned {type(unit).__name__}, not a "
            "streamrl.storage.StorageBackend")
    return unit
