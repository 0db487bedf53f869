"""The Ray transport itself: starting a queue's actors, attaching to them from any
process, and shutting them down.

:class:`RayTransport` is built from parts that another data path can replace: the
data-plane client (:attr:`RayTransport.data_plane`, also what the controller actor
reaches the units with), the control-plane client (:attr:`RayTransport.control_plane`)
and the actor classes (:attr:`RayTransport.controller_actor`,
:attr:`RayTransport.storage_actor`). A subclass sets them; :meth:`RayTransport.create`
and the constructor also take the data-plane class as an argument. The data-plane class
travels with the queue's handle (and a named queue's controller tells it), so every
process attached to a queue uses the same one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Self

import ray

from ...config import QueueConfig
from ...errors import InvalidArgument, TransportError
from ..base import Transport
from .calls import Endpoints, post
from .control import RayControl
from .data import DataPlaneFactory, RayDataPlane

__all__ = ["RayTransport", "create", "RAY_OPTIONS"]

#: the Ray transport's options (``QueueConfig.options``; see :meth:`RayTransport.create`)
RAY_OPTIONS = ("namespace", "unit_options", "controller_options", "detached", "direct_calls",
               "arena_reserve", "arena_ahead")

#: This process's clients of each queue (by controller actor id and data-plane class),
#: shared by every handle of it that arrives here (a queue passed to an actor method is a
#: new handle per call): their connections and arena mappings are made once.
_clients: dict[tuple[str, DataPlaneFactory], tuple[RayControl, RayDataPlane]] = {}


class RayTransport(Transport):
    """Controller and storage units as Ray actors (see :mod:`streamrl.transport.ray`).

    Built by ``StreamQueue(transport="ray", ...)``; the queue object pickles into a handle
    that works in any Ray task or actor; :meth:`streamrl.StreamQueue.connect` attaches to
    a named queue from another driver.

    Args:
        controller: the controller actor.
        units: the storage-unit actors.

    Keyword Args:
        owner: this process started the actors (:meth:`shutdown` kills them).
        endpoints: the actors' socket endpoints (``None``: Ray actor calls only).
        data_plane: the data-plane client class, or a factory of one (default
            :attr:`data_plane`).
    """

    name = "ray"
    #: the data-plane client: the storage units through their arenas or inline bytes
    data_plane: type[RayDataPlane] = RayDataPlane
    #: the control-plane client (the controller actor as a ControlPlane)
    # (its methods are generated: the type checker sees the protocol's, abstract)
    control_plane: type[RayControl] = RayControl  # type: ignore[type-abstract]
    #: the actor classes :meth:`create` starts, or ``"module:name"`` of one (imported by
    #: :meth:`create`: a process that only uses a queue, such as a producer given its
    #: handle, never imports the controller's or the storage unit's modules)
    controller_actor: Any = "streamrl.transport.ray.controller:ControllerActor"
    storage_actor: Any = "streamrl.transport.ray.unit:StorageActor"

    def __init__(self, controller: Any, units: list, *, owner: bool,
                 endpoints: Endpoints | None = None,
                 data_plane: DataPlaneFactory | None = None):
        self._controller = controller
        self._units = units
        self._endpoints = endpoints
        self._key = controller._actor_id.hex()
        self._data_plane = data_plane or self.data_plane
        shared = _clients.get((self._key, self._data_plane))
        if shared is None:
            control = self.control_plane(controller, endpoints[0] if endpoints else None)
            data = self._data_plane(units, endpoints[1] if endpoints else None,
                                    on_lost=control.report_lost)
            rpc = control.rpc
            # bytes moved per path go to the controller without waiting (over this event
            # loop's connection to it, opened for them if need be; without an event loop,
            # as a Ray actor call), at most every REPORT_EVERY seconds, and before each
            # stats call of this process
            def report_moved(d: dict[str, int]) -> bool:
                post(rpc, controller, "path_bytes", d)
                return True

            data.report_moved = report_moved
            control.before_stats = data.report_now
            shared = _clients[(self._key, self._data_plane)] = (control, data)
        self._control, self._data = shared
        self._owner = owner
        #: where the controller serves the queue's Prometheus metrics (``metrics=``)
        self.metrics_url: str | None = None

    @classmethod
    def create(cls, config: QueueConfig, *, data_plane: DataPlaneFactory | None = None
               ) -> Self:
        """Start the actors of a queue configured by ``config`` (``data_plane``: the
        data-plane client class of the controller and of this client, default
        :attr:`data_plane`). Its ``options``:

        * ``unit_options`` (one dict for all units, or one per unit) and
          ``controller_options`` are passed to ``.options()`` (for example
          ``{"resources": {"node:10.0.0.2": 0.001}}`` to pin a unit to a node);
        * ``namespace``: the Ray namespace of the actors;
        * ``detached=True`` keeps the actors alive after this driver exits (named queues);
        * ``direct_calls`` (default ``True``): clients call the controller over a TCP
          connection to its node's IP address (see :mod:`streamrl.transport.rpc`), which
          is about 30x faster than a Ray actor call. ``False`` sends every call through
          Ray (for clusters whose nodes only reach each other on Ray's own ports);
        * ``arena_reserve`` (bytes per unit, or ``True`` for ``capacity_bytes /
          num_shards``; default 0) and ``arena_ahead`` (bytes; default 0): each unit makes
          that much shared memory at start, and keeps that much spare beyond what it
          uses, on a background thread, bounded by ``capacity_bytes / num_shards`` when
          set. A page's first write costs many times a later one on a VM, so this takes
          the cold start of a fresh queue off its first puts (see
          :class:`~streamrl.arena.Arena`)."""
        opts = dict(config.options)
        valid = RAY_OPTIONS
        unknown = sorted(set(opts) - set(valid))
        if unknown:
            gone = (" (`ownership` is gone: rows now always live in their storage unit's "
                    "shared memory, so they outlive their producer)" if "ownership" in unknown
                    else "")
            raise InvalidArgument(
                f"unknown options for the Ray transport: {unknown}{gone}; it takes "
                f"{', '.join(valid)}")
        namespace = opts.get("namespace")
        unit_options = opts.get("unit_options")
        controller_options = opts.get("controller_options")
        detached = opts.get("detached", False)
        direct_calls = opts.get("direct_calls", True)
        if not isinstance(direct_calls, bool):
            raise InvalidArgument(f"direct_calls must be True or False, got {direct_calls!r}")
        arena = _arena_options(opts.get("arena_reserve", 0), opts.get("arena_ahead", 0),
                               config.capacity_bytes, config.num_shards)
        if not ray.is_initialized():
            init_ray()
        name, num_shards = config.name, config.num_shards
        if isinstance(unit_options, Mapping) or unit_options is None:
            per_unit = [dict(unit_options or {}) for _ in range(num_shards)]
        else:
            per_unit = [dict(o) for o in unit_options]
            if len(per_unit) != num_shards:
                raise InvalidArgument(
                    f"unit_options has {len(per_unit)} entries for {num_shards} shards; give one "
                    "dict for all units or one per unit")
        common: dict[str, Any] = {}
        if namespace:
            common["namespace"] = namespace
        if detached:
            common["lifetime"] = "detached"
        units = []
        storage_actor = _actor_class(cls.storage_actor)
        for i, opts in enumerate(per_unit):
            o = {"scheduling_strategy": "SPREAD", **common, **opts}
            if name:
                o.setdefault("name", f"{name}.unit{i}")
            units.append(storage_actor.options(**o).remote(i, config.storage, arena))
        copts = {**common, **(controller_options or {})}
        if name:
            copts.setdefault("name", name)
        data_plane = data_plane or cls.data_plane
        controller = _actor_class(cls.controller_actor).options(**copts).remote(
            config.replace(options={}), units, data_plane)
        # either call also surfaces start-up errors here
        endpoints = None
        if direct_calls:
            endpoints = ray.get(controller.endpoints.remote())
        else:
            ray.get(controller.ping.remote())
        self = cls(controller, units, owner=True, endpoints=endpoints, data_plane=data_plane)
        from ...metrics import parse_spec

        addr = parse_spec(config.metrics)
        if addr is not None:  # the controller serves the queue-wide series on its node
            self.metrics_url = ray.get(controller.serve_metrics.remote(
                addr[0], addr[1], config.name or self.queue_id[:8]))
        return self

    @classmethod
    def connect(cls, name: str, namespace: str | None = None) -> Self:
        """The named queue ``name`` of this Ray cluster (not owned).

        Raises:
            TransportError: there is no such queue.
        """
        try:
            controller = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise TransportError(
                f"no streamrl queue named {name!r} in this Ray cluster"
                + (f" (namespace {namespace!r})" if namespace else "")
                + "; create it with StreamQueue(transport='ray', name=...) first") from None
        units: list
        endpoints: Endpoints | None
        data_plane: DataPlaneFactory
        units, endpoints, data_plane = ray.get(controller.handles.remote())
        return cls(controller, units, owner=False, endpoints=endpoints, data_plane=data_plane)

    @property
    def queue_id(self) -> str:
        """The controller actor's id: the same in every handle of the queue."""
        return self._key

    @property
    def handle(self) -> tuple:
        """What a pickled queue carries: the actor handles, their socket endpoints, the
        data-plane client class and where the queue's metrics are served."""
        return (self._controller, self._units, self._endpoints, self._data_plane,
                self.metrics_url)

    @classmethod
    def attach(cls, handle: tuple) -> Self:
        """The queue in this process, from :attr:`handle` (not owned)."""
        controller, units, endpoints, data_plane, *rest = handle
        self = cls(controller, units, owner=False, endpoints=endpoints, data_plane=data_plane)
        self.metrics_url = rest[0] if rest else None
        return self

    from_handle = attach

    @property
    def control(self) -> RayControl:
        """The controller actor, as a control plane."""
        return self._control

    @property
    def data(self) -> RayDataPlane:
        """The storage-unit actors, as a data plane."""
        return self._data

    def node_ids(self) -> list[str]:
        """The node each storage unit runs on (for placement checks)."""
        return ray.get([u.node_id.remote() for u in self._units])

    def release_nowait(self, lease_ids: Sequence[int]) -> None:
        """Release leases without waiting (a fire-and-forget actor call)."""
        self._controller.release.remote(list(lease_ids))

    async def shutdown(self) -> None:
        """Kill the actors and close this event loop's connections to them, if this
        process created them (handles and connected queues leave them running)."""
        if not self._owner:
            return
        _clients.pop((self._key, self._data_plane), None)
        for rpc in [self._control.rpc, *self._data.rpcs]:
            if rpc is not None:
                rpc.close()
        self._owner = False
        for a in [self._controller, *self._units]:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass


def init_ray(**kwargs: Any) -> None:
    """Join or start Ray as ``ray.init()`` would, for a queue made before it: the cluster
    named by ``RAY_ADDRESS``, or one started with ``ray start`` on this machine; with
    neither, the local Ray it starts listens on 127.0.0.1 only (a one-machine Ray needs no
    other address, and nothing outside the machine can reach it). No dashboard unless
    ``include_dashboard=True``; other ``kwargs`` go to ``ray.init`` (``log_to_driver``,
    ...). Call ``ray.init(...)`` yourself instead to choose anything else."""
    kwargs = {"ignore_reinit_error": True, "include_dashboard": False, **kwargs}
    try:  # where ray.init() would go: RAY_ADDRESS, then the last `ray start` (None: new)
        from ray._private.services import canonicalize_bootstrap_address

        join = canonicalize_bootstrap_address(None) is not None  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a Ray without it: let ray.init() decide
        join = True
    if join:
        ray.init(**kwargs)
    else:  # (not address="auto": that joins any Ray running here, another user's too)
        ray.init(address="local", _node_ip_address="127.0.0.1", **kwargs)


def create(config: QueueConfig) -> RayTransport:
    """The registered factory of ``transport="ray"``. With the option ``rdt_fields``
    (field names), those fields stay with their producers and move by Ray Direct
    Transport (see :mod:`streamrl.transport.rdt`); the others take this transport's path."""
    if "rdt_fields" in config.options or "rdt_hold_anywhere" in config.options:
        from ..rdt.transport import RdtTransport, rdt_options

        spec, rest = rdt_options(dict(config.options), all_fields=False)
        return RdtTransport.create(config.replace(options=rest), data_plane=spec)
    return RayTransport.create(config)


def _arena_options(reserve: Any, ahead: Any, capacity_bytes: int | None,
                   num_shards: int) -> dict[str, Any]:
    """The storage units' :class:`~streamrl.arena.Arena` keyword arguments of the
    ``arena_reserve`` / ``arena_ahead`` options."""
    limit = -(-capacity_bytes // num_shards) if capacity_bytes else None
    if reserve is True:
        if limit is None:
            raise InvalidArgument(
                "arena_reserve=True reserves capacity_bytes / num_shards per unit, but the "
                "queue has no capacity_bytes: set capacity_bytes, or give arena_reserve in "
                "bytes per unit")
        reserve = limit
    for name, v in (("arena_reserve", reserve), ("arena_ahead", ahead)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidArgument(
                f"{name} must be a number of bytes per storage unit (>= 0)"
                + (" or True" if name == "arena_reserve" else "") + f", got {v!r}")
    return {"reserve": reserve, "ahead": ahead, "limit": limit}


def _actor_class(spec: Any) -> Any:
    """An actor class of :class:`RayTransport` (see ``controller_actor``): ``spec`` itself,
    or the object a ``"module:name"`` string names."""
    if isinstance(spec, str):
        mod, _, name = spec.partition(":")
        return getattr(importlib.import_module(mod), name)
    return spec
