"""The control-plane client of the Ray transport: the controller actor, seen as a
:class:`~streamrl.control.ControlPlane`.

:class:`RayControl`'s methods are generated from the protocol
(:func:`streamrl.control.forwarders`), so they have its signatures; each sends its call
through :meth:`RayControl._call`: over the actor's socket channel when there is one
(about 30x cheaper than a Ray actor call), else as a Ray actor call, with Ray's errors
turned into streamrl's. A cancellable call (:data:`~streamrl.control.CANCELLABLE`) goes
with a request id; if the caller is cancelled while it waits, the controller stops the
call or takes its effect back before the cancellation goes on (see
:meth:`.controller.ControllerActorImpl.cancel`).

Clients, and storage units for the puts they admit, use it alike.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ...control import CANCELLABLE, CONTROL_METHODS, ControlPlane, forwarders
from ...errors import TransportError
from ...messages import PutAnswer
from ..rpc import ConnectFailed, Endpoint, RpcClient
from .calls import request_id, undone, unwrap

__all__ = ["RayControl"]

#: calls whose answer the controller actor sends in a cheaper form (see
#: :data:`.controller.TO_WIRE`): call -> how to read it back
FROM_WIRE: dict[str, Callable[[Any], Any]] = {
    "put_rows": PutAnswer.from_wire, "put_rows_wait": PutAnswer.from_wire,
    "write_rows": PutAnswer.from_wire,
    "put_rows_many": lambda t: [PutAnswer.from_wire(a) for a in t]}

#: control calls with an argument that is pickled by value (a user's function, or a
#: dict of them, whose module the controller actor may not import): call -> parameter
_BY_VALUE = {"add_filter": "fn", "checkpoint_load": "filters"}

if TYPE_CHECKING:
    # for the type checker, RayControl is a ControlPlane: it has every method of the
    # protocol, with the protocol's signature (generated below, see forwarders)
    _Generated = ControlPlane
else:
    _Generated = object


class RayControl(_Generated):
    """The controller actor as a control plane (see the module docstring).

    Args:
        actor: the controller actor's handle, or ``None`` to call over the socket
            channel only (a storage unit; then a failed connection raises
            :class:`~streamrl.transport.rpc.ConnectFailed`: nothing was sent).
        endpoint: the actor's socket endpoint, or ``None`` to make Ray actor calls only.
    """

    def __init__(self, actor: Any, endpoint: Endpoint | None = None):
        self.actor = actor
        self.rpc = RpcClient(endpoint) if endpoint is not None else None
        #: called before each ``stats`` call: sends what this process has to report
        #: (bytes moved per path, which its data plane reports at most every
        #: ``REPORT_EVERY`` seconds), so its own stats see its own moves
        self.before_stats: Callable[[], None] | None = None

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call control method ``method``; Ray's errors become streamrl's. A call in
        :data:`~streamrl.control.CANCELLABLE` carries a request id: if this await is
        cancelled, the controller stops the call or takes its effect back, so nothing
        outlives a caller that gave up."""
        if method in _BY_VALUE:
            args, kwargs = _by_value(method, args, kwargs)
        elif method == "stats" and self.before_stats is not None:
            self.before_stats()
        rid = request_id() if method in CANCELLABLE else None
        send = (self._send(method, args, kwargs) if rid is None
                else self._send("cancellable", (rid, method, args, kwargs), {}))
        try:
            res = await send
            from_wire = FROM_WIRE.get(method)
            return res if from_wire is None else from_wire(res)
        except asyncio.CancelledError:
            # the cancel goes after the call on the same channel, so it cannot overtake
            # it; the cancellation goes on once the call's effect is taken back, so a
            # retry cannot race the undo
            if rid is not None:
                await undone(self._send("cancel", (rid,), {}), method)
            raise
        except ConnectFailed:
            raise  # only without an actor handle (a storage unit's client): nothing was sent
        except ConnectionError as e:
            raise TransportError(
                f"lost the connection to the queue's controller actor ({e}); it is gone or "
                "unreachable: the queue cannot be used any more; create a new one (or "
                "reconnect if it was restarted)") from None
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError,
                ray.exceptions.ObjectLostError) as e:
            raise unwrap(e, "controller actor") from None

    async def _send(self, method: str, args: tuple, kwargs: dict) -> Any:
        """``method(*args, **kwargs)`` on the actor: over the socket channel, or (without
        one, or when it cannot connect: nothing was sent) as a Ray actor call."""
        if self.rpc is not None:
            try:
                return await self.rpc.call(method, *args, **kwargs)
            except ConnectFailed:
                if self.actor is None:
                    raise
                # nothing was sent: Ray tells whether the actor is gone
        return await getattr(self.actor, method).remote(*args, **kwargs)


def _forward(self: RayControl, method: str, *args: Any, **kwargs: Any):
    return self._call(method, *args, **kwargs)


# every control call, with the protocol's signature, sent by RayControl._call
for _name, _method in forwarders(_forward).items():
    _method.__qualname__ = f"RayControl.{_name}"
    setattr(RayControl, _name, _method)
del _name, _method


def _by_value(method: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with the one named in :data:`_BY_VALUE` pickled by value."""
    bound = CONTROL_METHODS[method].bind(None, *args, **kwargs)
    param = _BY_VALUE[method]
    value = bound.arguments.get(param)
    if isinstance(value, dict):
        bound.arguments[param] = {k: _ByValue(fn) for k, fn in value.items()}
    elif value is not None:
        bound.arguments[param] = _ByValue(value)
    return bound.args[1:], bound.kwargs


class _ByValue:
    """A function that unpickles as itself where its module is not importable: it is
    pickled by value (see :func:`pickle_by_value`) and loads with plain :mod:`pickle`."""

    __slots__ = ("blob",)

    def __init__(self, fn: Callable):
        self.blob = pickle_by_value(fn)

    def __reduce__(self):
        return (pickle.loads, (self.blob,))


def pickle_by_value(fn: Callable) -> bytes:
    """Pickle a function so it loads in the controller actor even when its module (a
    script, a test file) is not importable there."""
    import ray.cloudpickle as cp

    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(mod, "__file__", None) or ""
    by_value = mod is not None and mod.__name__ != "__main__" and not (
        "site-packages" in path or "dist-packages" in path or mod.__name__.startswith("streamrl"))
    if by_value:
        cp.register_pickle_by_value(mod)
    try:
        return cp.dumps(fn)
    finally:
        if by_value:
            cp.unregister_pickle_by_value(mod)
