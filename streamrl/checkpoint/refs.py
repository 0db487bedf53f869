"""Filters saved by name: a filter function is code, so a checkpoint records where to
import it from, not the function itself.

* an importable module-level function is saved as ``{"function": "module:qualname"}``;
* an instance of an importable class whose attributes are plain data (the ready-made
  filters of :mod:`streamrl.filters` such as ``zero_variance``) as ``{"object":
  "module:qualname", "state": {...}}``;
* anything else (a lambda, a closure, a bound method...) as ``None``: the restore needs
  it back through ``StreamQueue.restore(..., filters={name: fn})``.

Restoring imports the module a checkpoint names: restore only checkpoints you trust (as
with ``pickle`` or ``torch.load``).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CheckpointError

__all__ = ["filter_ref", "resolve_ref", "resolve_filters"]


def _qualname_ok(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    return (isinstance(mod, str) and isinstance(qual, str) and "<" not in qual
            and bool(mod) and bool(qual))


def _plain(v: Any, depth: int = 0) -> Any:
    """``v`` as msgpack-ready plain data (tuples tagged), or raise TypeError."""
    if depth > 16:
        raise TypeError("too deep")
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [_plain(x, depth + 1) for x in v]}
    if isinstance(v, list):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _plain(x, depth + 1) for k, x in v.items()}
    raise TypeError(type(v).__name__)


def _unplain(v: Any) -> Any:
    if isinstance(v, list):
        return [_unplain(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(_unplain(x) for x in v["__tuple__"])
        return {k: _unplain(x) for k, x in v.items()}
    return v


def filter_ref(fn: Callable) -> dict[str, Any] | None:
    """How ``fn`` is saved (see the module docstring), or ``None``."""
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
        if _qualname_ok(fn):
            return {"function": f"{fn.__module__}:{fn.__qualname__}"}
        return None
    cls = type(fn)
    if isinstance(fn, type) or not _qualname_ok(cls) or not hasattr(fn, "__dict__"):
        return None
    try:
        state = _plain(dict(vars(fn)))
    except TypeError:
        return None
    return {"object": f"{cls.__module__}:{cls.__qualname__}", "state": state}


def resolve_ref(ref: str) -> Any:
    """The object at ``"module:qualname"`` (imports the module).

    Raises:
        ImportError, AttributeError: it is not there.
    """
    mod_name, _, qual = ref.partition(":")
    mod = sys.modules.get(mod_name) if mod_name == "__main__" else None
    if mod is None:
        mod = importlib.import_module(mod_name)
    obj: Any = mod
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_filters(saved: Mapping[str, dict | None], given: Mapping[str, Callable] | None
                    ) -> dict[str, Callable]:
    """The function of every saved filter: from ``given`` first, else from its saved
    reference.

    Raises:
        CheckpointError: filters that could not be found, listed by name with why, and
            how to pass them; or a name in ``given`` that the checkpoint has no filter of.
        InvalidArgument: ``given`` is not a mapping of names to callables.
    """
    from ..errors import InvalidArgument

    given = dict(given or {})
    for name, fn in given.items():
        if not isinstance(name, str) or not callable(fn):
            raise InvalidArgument(
                f"filters must map filter names to functions, got {name!r}: {fn!r}")
    unknown = sorted(set(given) - set(saved))
    if unknown:
        raise CheckpointError(
            f"filters={unknown} name no filter of this checkpoint; its filters are "
            f"{sorted(saved) or 'none'}")
    out: dict[str, Callable] = {}
    missing: list[str] = []
    for name, ref in saved.items():
        if name in given:
            out[name] = given[name]
            continue
        if ref is None:
            missing.append(f"{name!r} (not an importable function: a lambda, closure or "
                           "method)")
            continue
        try:
            if "function" in ref:
                out[name] = resolve_ref(ref["function"])
            else:
                cls = resolve_ref(ref["object"])
                obj = cls.__new__(cls)
                obj.__dict__.update(_unplain(ref["state"]))
                out[name] = obj
        except Exception as e:  # noqa: BLE001 - import errors of any kind
            what = ref.get("function") or ref.get("object")
            missing.append(f"{name!r} ({what} cannot be imported here: "
                           f"{type(e).__name__}: {e})")
    if missing:
        raise CheckpointError(
            f"the checkpoint's filters {', '.join(missing)} cannot be restored by "
            "themselves; pass them: StreamQueue.restore(path, filters={name: fn, ...})")
    return out
