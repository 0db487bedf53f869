"""The Ray transport: the controller and the storage units as Ray actors.

Layout:

* one **controller actor** (async, ``num_cpus=0``) runs the same
  :class:`~streamrl.service.ControllerService` as the embedded transport. It sees only
  metadata, plus the small fields filters read;
* ``num_shards`` **storage-unit actors** (threaded, ``num_cpus=0``), spread over the
  cluster's nodes (``SPREAD`` by default; pin them with ``unit_options``);
* clients (the driver, any task or actor that got the queue) talk to both directly. Bytes
  go client -> storage unit on ``put`` and storage unit -> client on ``materialize``,
  never through the controller.

Calls: every actor also serves its methods over a socket (:mod:`streamrl.transport.rpc`),
about 30x cheaper than a Ray actor call; ``direct_calls=False`` keeps them on Ray. The
control plane is :class:`streamrl.control.ControlPlane` on both sides: the client proxy
(:class:`RayControl`) and the controller actor's methods are generated from it, so they
cannot drift apart. A small put of new rows is one call to a storage unit, which stores
it under row ids the controller leased to it and has the controller admit and commit it
in one step (:meth:`RayDataPlane.put_rows`): a waiting consumer hears of the rows three
hops after the producer's ``put`` began (producer -> unit -> controller -> consumer).

Data path (chosen by measurement, see ``docs/benchmarks.md``): each storage unit keeps
tensor bytes in a shared-memory arena (:mod:`streamrl.arena`). A producer on the unit's
node asks the unit for blocks, copies each tensor of at least ``SHM_MIN`` bytes into its
block (the one copy of a put) and sends the unit the block references; a reader on the
node gets the references and views the blocks in place (no copy), each read pinning its
blocks until the reader's tensors are gone. Clients on other nodes (or without the
socket channel) send and receive the bytes inline in the calls. Small tensors and Python
objects (codec bytes) always travel inline. Each micro-batch costs one call per storage
unit holding its rows, issued concurrently.

Failures: a storage unit that dies loses its rows: reads of them raise
:class:`~streamrl.errors.RowsLost` naming the rows and the unit, the controller drops them
(``stats().dropped_by["lost"]``) and places new rows on the living units; tensors already
read stay valid (their shared memory lives while it is mapped). A dead controller makes
every call raise :class:`~streamrl.errors.TransportError` at once. A client that dies
holding a lease: its rows go back after ``lease_timeout``; its pins and unfinished
writes are released the next time the unit needs room.

Modules (each reusable by another data path, such as one that moves tensors by Ray
Direct Transport):

* :mod:`.wire` -- torch columns <-> wire form (WireTensors, encoded objects);
* :mod:`.calls` -- how the pieces call each other (errors, undo waits, background tasks);
* :mod:`.unit` -- the storage-unit actor and its arena;
* :mod:`.data` -- :class:`RayDataPlane`, the data-plane client;
* :mod:`.admit` -- small puts admitted by a unit: the unit's half and the client's;
* :mod:`.checkpoint` -- checkpoints: each unit writes and loads its own files, the
  client fans the calls out;
* :mod:`.controller` -- the controller actor, serving the control plane;
* :mod:`.actor_service` -- the service it runs (imported in the actor only: Ray imports
  :mod:`.controller` in every process that deserializes the actor's handle);
* :mod:`.control` -- :class:`RayControl`, the control-plane client;
* :mod:`.transport` -- :class:`RayTransport` and the registered factory :func:`create`.

The package imports none of them itself (its names load on first use): a process
imports what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ... import _lazy

if TYPE_CHECKING:
    from .calls import UNDO_TIMEOUT, Endpoints
    from .control import RayControl, pickle_by_value
    from .actor_service import ActorService
    from .controller import ControllerActor, ControllerActorImpl
    from .data import FAST_MAX, RayDataPlane
    from .transport import RAY_OPTIONS, RayTransport, _clients, create, init_ray
    from .unit import ID_BLOCK, StorageActor, StorageActorImpl
    from .wire import SHM_MIN

#: where each public name lives (imported on first use: a producer given a queue's
#: handle loads the clients, never the controller's state machine; docs/benchmarks.md,
#: "A producer process loads neither the controller nor the embedded transport")
_WHERE = {
    "UNDO_TIMEOUT": "calls", "Endpoints": "calls",
    "RayControl": "control", "pickle_by_value": "control",
    "ActorService": "actor_service", "ControllerActor": "controller",
    "ControllerActorImpl": "controller",
    "FAST_MAX": "data", "RayDataPlane": "data",
    "RAY_OPTIONS": "transport", "RayTransport": "transport", "_clients": "transport",
    "create": "transport", "init_ray": "transport",
    "ID_BLOCK": "unit", "StorageActor": "unit", "StorageActorImpl": "unit",
    "SHM_MIN": "wire",
}

__all__ = [name for name in _WHERE if not name.startswith("_")]


__getattr__, __dir__ = _lazy.exports(__name__, _WHERE, globals())
