"""The controller actor: a :class:`~streamrl.service.ControllerService` in an async Ray
actor, serving the control plane.

Every call of :class:`streamrl.control.ControlPlane` is a method of the actor with the
protocol's own signature, generated from it (:func:`streamrl.control.forwarders`); each
goes to the service through one dispatch (:meth:`ControllerActorImpl._serve`). Nothing
here is written per call, except what :data:`_UNDO` says about the cancellable ones.

A call its caller may give up on (:data:`~streamrl.control.CANCELLABLE`: ``take``,
``ack_take``, ``allocate``, ``begin_write``, ``commit``, ``put_rows_wait``,
``checkpoint_begin``) comes wrapped with a request id
(:meth:`ControllerActorImpl.cancellable`); :meth:`ControllerActorImpl.cancel` then stops
it, or takes back what it did (a take's lease is released, an admitted write aborted, a
commit retracted, a waiting small put's rows dropped, a checkpoint's hold on deletes
ended), so nothing outlives a caller that is gone.

The actor's own methods, which are not controller calls: :meth:`~ControllerActorImpl.endpoints`,
:meth:`~ControllerActorImpl.handles`, :meth:`~ControllerActorImpl.cancellable`,
:meth:`~ControllerActorImpl.cancel`, :meth:`~ControllerActorImpl.ping`,
:meth:`~ControllerActorImpl.event_loop` and :meth:`~ControllerActorImpl.serve_metrics`. Its service adds each storage unit's arena bytes to
``stats`` (:class:`.actor_service.ActorService`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from ...config import QueueConfig
from ...control import CANCELLABLE, CONTROL_METHODS, forwarders
from ...errors import InvalidArgument
from ...messages import PutAnswer, PutStatus
from ..rpc import RpcServer
from .calls import Endpoints, spawn
from .data import DataPlaneFactory, RayDataPlane

if TYPE_CHECKING:
    from ...metrics import MetricsServer
    from .actor_service import ActorService

log = logging.getLogger("streamrl")

__all__ = ["ControllerActorImpl", "ControllerActor", "serve_control_plane"]

#: calls a client may cancel, kept for their undo once done (oldest forgotten first)
_RECENT = 4096


def _token(args: tuple, kwargs: dict) -> Any:
    """The ``token`` argument of a ``commit`` call (its first: by position or by name;
    binding the signature, the general way, cost 3% of the controller's time under
    small puts into a full queue)."""
    if args:
        return args[0]
    if "token" in kwargs:
        return kwargs["token"]
    return CONTROL_METHODS["commit"].bind(None, *args, **kwargs).arguments["token"]


#: How each cancellable call's effect is taken back once it is done: from the call's
#: ``(args, kwargs, result)``, the control call that undoes it and its arguments, or
#: ``None`` when there is nothing to undo. Only ids are kept, not results.
_UNDO: dict[str, Callable[[tuple, dict, Any], tuple[str, tuple] | None]] = {
    "take": lambda a, kw, d: None if d is None else ("release", ([d.lease],)),
    "ack_take": lambda a, kw, r: None if r[0] is None else ("release", ([r[0].lease],)),
    "allocate": lambda a, kw, tok: ("abort", (tok.id,)),
    "begin_write": lambda a, kw, tok: ("abort", (tok.id,)),
    "commit": lambda a, kw, _res: ("retract", (_token(a, kw),)),
    "put_rows_wait": lambda a, kw, ans: (("retract_rows", (ans.rows,))
                                         if ans.status is PutStatus.OK else None),
    "checkpoint_begin": lambda a, kw, cut: ("checkpoint_end", (cut.token,)),
}
assert _UNDO.keys() == CANCELLABLE, "every cancellable control call needs its undo"

#: calls after which the actor lets the consumers they woke run before it replies (a
#: small put's consumers hear of its rows no later than its producer)
_YIELD_AFTER = frozenset({"put_rows", "put_rows_many", "put_rows_wait", "write_rows"})

#: calls whose answer goes out in a cheaper form than itself (see
#: :data:`.control.FROM_WIRE`, which reads it back): call -> how
TO_WIRE: dict[str, Callable[[Any], Any]] = {
    "put_rows": PutAnswer.to_wire, "put_rows_wait": PutAnswer.to_wire,
    "write_rows": PutAnswer.to_wire,
    "put_rows_many": lambda answers: [a.to_wire() for a in answers]}


class ControllerActorImpl:
    """The controller service as an async actor (see the module docstring).

    Args:
        config: the queue's configuration (without transport options).
        units: the storage-unit actors.
        data_plane: the data-plane class the service reaches the units with (deletes,
            the fields filters read, inventories): :class:`RayDataPlane` or a subclass
            with another tensor path, or a factory of one.
    """

    def __init__(self, config: QueueConfig, units: list,
                 data_plane: DataPlaneFactory = RayDataPlane):
        # (imported here, not by the module: a process that only holds this actor's handle
        # loads the module, as Ray does to deserialize one, and needs neither)
        from ...controller import Controller
        from .actor_service import ActorService

        self._units = units
        self._data = data_plane(units, on_lost=self._lost)
        self._svc: ActorService = ActorService(Controller.from_config(config), self._data)
        self._data.report_moved = self._svc.add_moved  # what the filters' reads move
        self._inflight: dict[str, asyncio.Task] = {}  # calls a client may cancel, running
        self._recent: OrderedDict[str, tuple | None] = OrderedDict()  # their undo, once done
        self._rpc = RpcServer(self, ray.util.get_node_ip_address())
        self._endpoints: Endpoints | None = None
        self._metrics: MetricsServer | None = None  # serve_metrics's, once asked

    # -- the control plane

    async def _serve(self, method: str, args: tuple, kwargs: dict, rid: str | None = None):
        """Run control call ``method`` on the service; with ``rid``, as a call its client
        may give up on (see :meth:`cancel`)."""
        call = getattr(self._svc, method)(*args, **kwargs)
        if rid is None:
            res = await call
        else:
            task = asyncio.current_task()
            assert task is not None  # (a coroutine of the actor's loop)
            self._inflight[rid] = task
            try:
                res = await call
            finally:
                self._inflight.pop(rid, None)
            self._recent[rid] = _UNDO[method](args, kwargs, res)
            while len(self._recent) > _RECENT:
                self._recent.popitem(last=False)
        if method in _YIELD_AFTER:
            await asyncio.sleep(0)
        to_wire = TO_WIRE.get(method)
        return res if to_wire is None else to_wire(res)

    async def cancellable(self, rid: str, method: str, args: tuple, kwargs: dict) -> Any:
        """Control call ``method(*args, **kwargs)`` (one of
        :data:`~streamrl.control.CANCELLABLE`), which :meth:`cancel` with ``rid`` stops
        or takes back."""
        if method not in CANCELLABLE:
            raise InvalidArgument(f"{method!r} is not a cancellable control call; those are "
                                  f"{sorted(CANCELLABLE)}")
        return await ControllerActorImpl._serve(self, method, args, kwargs, rid)

    async def cancel(self, rid: str) -> None:
        """The client gave up on call ``rid`` (it was cancelled while waiting for the
        answer): stop the call, or take back what it did (give a lease back, forget an
        admitted write, retract a commit), so nothing is left behind for a caller that is
        gone. Returns once that is done."""
        task = self._inflight.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # it takes its own effect back (a retract) first
            return
        undo = self._recent.pop(rid, None)
        if undo is not None:
            method, args = undo
            await getattr(self._svc, method)(*args)

    def path_bytes(self, by_path: dict[str, int]) -> None:
        """A client moved these bytes, per path (summed into ``stats().bytes_by_path``;
        sent without waiting for an answer)."""
        self._svc.add_moved(by_path)

    async def _lost(self, shard: int) -> None:
        """This actor found storage unit ``shard`` dead (see :class:`RayDataPlane`)."""
        await self._svc.report_lost(shard)

    # -- the actor's own

    def handles(self) -> tuple[list, Endpoints | None, DataPlaneFactory]:
        """What a client needs to attach: the storage-unit actors, the socket endpoints
        (see :meth:`endpoints`) and the data-plane class."""
        return self._units, self._endpoints, getattr(self._data, "spec", type(self._data))

    async def endpoints(self) -> Endpoints:
        """Start serving this actor's methods, and each storage unit's, over sockets
        (see :mod:`streamrl.transport.rpc`); where (this actor's endpoint, the units')."""
        if self._endpoints is None:
            mine = await self._rpc.start()
            units = list(await asyncio.gather(*[u.endpoint.remote(mine) for u in self._units]))
            self._data.use_endpoints(units)
            self._endpoints = (mine, units)
        return self._endpoints

    async def serve_metrics(self, host: str, port: int, queue: str,
                            interval: float = 5.0) -> str:
        """Serve the queue's Prometheus series on ``host:port`` of this node (port 0: a
        free one), and record them as Ray metrics every ``interval`` seconds; the URL."""
        from ...metrics import MetricsServer, RayMirror

        if self._metrics is None:
            loop = asyncio.get_running_loop()
            self._metrics = MetricsServer(self._svc.stats, loop, queue, (host, port))
            mirror = RayMirror()

            async def mirror_loop() -> None:
                while True:
                    try:
                        mirror.update(await self._svc.stats(), queue)
                    except Exception as e:  # noqa: BLE001 - metrics never break the queue
                        log.warning("streamrl: Ray metrics update failed: %r", e)
                    await asyncio.sleep(interval)

            self._mirror = spawn(mirror_loop(), "Ray metrics of the queue")
        return self._metrics.url

    async def event_loop(self) -> str:
        """The class of the event loop this actor runs on (Ray uses uvloop's when it is
        installed, unless ``RAY_USE_UVLOOP=0``)."""
        loop = asyncio.get_running_loop()
        return f"{type(loop).__module__}.{type(loop).__name__}"

    def ping(self) -> bool:
        return True


def _dispatch(self: ControllerActorImpl, method: str, *args: Any, **kwargs: Any):
    # (not self._serve: Ray wraps every method of the actor's class, this one too, for
    # its tracing, and the wrapper is one more coroutine per call that does nothing
    # when the call carries no trace context)
    return ControllerActorImpl._serve(self, method, args, kwargs)


def serve_control_plane(cls: type) -> type:
    """Give ``cls`` every control call as a method with the protocol's signature, each
    served by the one dispatch (:meth:`ControllerActorImpl._serve`)."""
    for name, method in forwarders(_dispatch).items():
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, method)
    return cls


serve_control_plane(ControllerActorImpl)


@serve_control_plane
class _ControllerActor(ControllerActorImpl):
    """What :data:`ControllerActor` is made from: the same class, with copies of the
    generated methods, because ``ray.remote`` adds its tracing parameter
    (``_ray_trace_ctx``) to the signatures of the functions it is given, in place."""


#: the controller as a Ray actor class (async, no CPU reserved)
ControllerActor = ray.remote(num_cpus=0)(_ControllerActor)
