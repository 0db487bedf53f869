"""The storage unit as a Ray actor, with its shared-memory arena.

A :class:`StorageActorImpl` holds one :class:`~streamrl.storage.StorageUnit` (built by
:func:`streamrl.storage.create_unit`) whose tensors are :class:`~streamrl.wire.WireTensor`
views of an :class:`~streamrl.arena.Arena` block, or inline bytes. Producers on the node
reserve blocks (:meth:`~StorageActorImpl.reserve`), copy into them and ``put`` the
references; readers on the node get references pinned until their views are gone
(:meth:`~StorageActorImpl.read`, :meth:`~StorageActorImpl.unpin`); everyone else sends
and receives bytes inline. A small put of new rows is admitted by the unit itself
(:mod:`.admit`); its part of a checkpoint it writes and loads itself (:mod:`.checkpoint`).

The unit serves its methods as a threaded Ray actor and over a socket channel
(:mod:`streamrl.transport.rpc`) from an event loop on a thread of its own; every method
takes the unit's lock, so both kinds of calls see one consistent unit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from typing import Any

import ray

from ...arena import Arena, ShmRef
from ...errors import TransportError
from ...wire import WireTensor, joined
from ..rpc import Endpoint, RpcServer
from .admit import ID_BLOCK, UnitAdmission
from .calls import new_loop
from .checkpoint import UnitCheckpoint
from .control import RayControl
from .wire import map_col, map_pieces, refs_in, tensors_in

__all__ = ["StorageActorImpl", "StorageActor", "ID_BLOCK"]  # (ID_BLOCK: .admit's)

log = logging.getLogger("streamrl")

def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this node) still runs."""
    return os.path.exists(f"/proc/{pid}")


class _Block:
    """An arena block's users: the rows stored in it, readers' pins, and the producer
    that reserved it and has not stored it yet."""

    __slots__ = ("stored", "pins", "writer")

    def __init__(self, writer: int | None):
        self.stored = False
        self.pins = 0
        self.writer = writer  # pid of the producer writing it


class StorageActorImpl(UnitAdmission, UnitCheckpoint):
    """One storage unit as a (threaded) actor, with its shared-memory arena; small puts
    it admits are :class:`.admit.UnitAdmission`'s, checkpoints
    :class:`.checkpoint.UnitCheckpoint`'s."""

    def __init__(self, index: int, storage: Any = "memory", arena: dict | None = None):
        from ...storage import create_unit

        self.index = index
        self.arena = Arena(index, **(arena or {}))
        self.blocks: dict[ShmRef, _Block] = {}
        self.pins: dict[int, tuple[int, list[ShmRef]]] = {}  # pin -> (reader pid, blocks)
        self._pin_ids = itertools.count(1)
        self.unit = create_unit(storage, index, on_release=self._released)
        self.lock = threading.Lock()
        self._endpoint: Endpoint | None = None
        self._controller: RayControl | None = None  # for put_rows (socket thread)
        self._rpc_loop: asyncio.AbstractEventLoop | None = None  # its socket channel's loop
        self._init_admission()
        self._init_checkpoint()

    def endpoint(self, controller: Endpoint | None = None) -> Endpoint:
        """Start serving this unit's methods over a socket (see :mod:`streamrl.transport.rpc`), from an
        event loop on a thread of its own; where. ``controller``: the controller's
        endpoint, for :meth:`put_rows` (which calls the control plane over it)."""
        if controller is not None and self._controller is None:
            # (its methods are generated: the type checker sees the protocol's, abstract)
            self._controller = RayControl(None, controller)  # type: ignore[abstract]
        if self._endpoint is None:
            loop = self._rpc_loop = new_loop()
            threading.Thread(target=loop.run_forever, name="streamrl-unit-rpc",
                             daemon=True).start()
            server = RpcServer(self, ray.util.get_node_ip_address())
            self._endpoint = asyncio.run_coroutine_threadsafe(server.start(), loop).result()
        return self._endpoint

    def shm_info(self) -> tuple[str, int | None]:
        """(node id, pid): a client on the same node maps this unit's arena through
        ``/proc/<pid>/fd``; pid ``None`` where there is no ``memfd`` (not Linux)."""
        return (ray.get_runtime_context().get_node_id(),
                os.getpid() if hasattr(os, "memfd_create") else None)

    # -- blocks

    def _alloc(self, nbytes: int, writer: int) -> ShmRef:
        ref = self.arena.alloc(nbytes, grow=False)
        if ref is None:
            self._sweep()
            ref = self.arena.alloc(nbytes)
        self.blocks[ref] = _Block(writer)
        return ref

    def _sweep(self) -> None:
        """Release the pins and unfinished writes of processes that died."""
        dead: dict[int, bool] = {}

        def gone(pid):
            if pid not in dead:
                dead[pid] = not _alive(pid)
            return dead[pid]

        for pin, (pid, _) in list(self.pins.items()):
            if gone(pid):
                self._unpin(pin)
        for ref, b in list(self.blocks.items()):
            if b.writer is not None and gone(b.writer):
                self._give_back(ref)

    def _give_back(self, ref: ShmRef) -> None:
        """A block reserved for a write that will not store it: free unless stored."""
        b = self.blocks.get(ref)
        if b is not None and not b.stored:
            b.writer = None
            self._maybe_free(ref, b)

    def _maybe_free(self, ref: ShmRef, b: _Block) -> None:
        if not b.stored and not b.pins and b.writer is None:
            del self.blocks[ref]
            self.arena.free(ref)

    def _released(self, t: Any) -> None:
        """No row refers to ``t`` any more (called by the unit, under the lock)."""
        if isinstance(t, WireTensor) and isinstance(t.ref, ShmRef):
            b = self.blocks[t.ref]
            b.stored = False
            self._maybe_free(t.ref, b)

    def _unstored(self, t: Any) -> None:
        """``t`` came with a put whose rows were forgotten: it is not stored (its arena
        block is given back; a data path that keeps tensors elsewhere frees them here)."""
        if isinstance(t.ref, ShmRef):
            self._give_back(t.ref)

    def _unpin(self, pin: int) -> None:
        entry = self.pins.pop(pin, None)
        if entry is None:
            return
        for ref in entry[1]:
            b = self.blocks.get(ref)
            if b is not None:
                b.pins -= 1
                self._maybe_free(ref, b)

    def reserve(self, sizes: list[int], pid: int) -> tuple[list[ShmRef], dict] | None:
        """Blocks of ``sizes`` bytes for producer ``pid`` to write into, and where their
        segments are (see :meth:`Arena.where`). ``put`` stores them;
        ``unreserve`` gives back those it will not. ``None`` when the arena cannot grow
        (the node is out of shared memory): the producer then sends the bytes inline."""
        with self.lock:
            refs: list[ShmRef] = []
            try:
                for n in sizes:
                    refs.append(self._alloc(n, pid))
            except OSError as e:
                log.warning("streamrl: storage unit %d cannot grow its shared-memory arena "
                            "(%s); this put's bytes go inline", self.index, e)
                for ref in refs:
                    self._give_back(ref)
                return None
            return refs, self.arena.where(refs)

    def unreserve(self, refs: list[ShmRef]) -> None:
        with self.lock:
            for ref in refs:
                self._give_back(ref)

    def unpin(self, pins: list[int]) -> None:
        """Readers' views of these reads are gone: their blocks may be reused."""
        with self.lock:
            for pin in pins:
                self._unpin(pin)

    # -- rows

    def put(self, parts: list, write: int = 0, only_adds: bool = False) -> bool:
        """Store ``(rows, columns)`` parts of write ``write``. Tensors come inline, or as
        blocks of this unit's arena that the producer reserved and wrote. With
        ``only_adds`` (inline data only), nothing is stored unless every part only adds
        fields to rows held here (:meth:`StorageBackend.only_adds`): ``False`` then.
        Returns ``True`` otherwise."""
        with self.lock:
            if only_adds and not all(self.unit.only_adds(rows, list(cols))
                                     for rows, cols in parts):
                return False
            keep = []
            for p in parts:
                if not self.unit.forgotten(p[0], write):
                    keep.append(p)
                    continue
                for t in tensors_in(p[1]):  # aborted while its data was on its way
                    self._unstored(t)
            parts = keep
            refs = [t.ref for _, cols in parts for t in tensors_in(cols)
                    if isinstance(t.ref, ShmRef)]
            bad = [r for r in refs if r not in self.blocks or self.blocks[r].stored]
            if bad or len(set(refs)) != len(refs):
                raise TransportError(
                    f"storage unit {self.index} holds no reserved blocks {bad}: the write took "
                    "too long and its process was taken for dead. Put the rows again")
            for r in refs:
                b = self.blocks[r]
                b.stored, b.writer = True, None

            def stored(t):
                return t.pinned(self.arena.view(t.ref)) if isinstance(t.ref, ShmRef) else t

            for rows, cols in parts:
                self.unit.put(rows, {f: map_col(c, stored) for f, c in cols.items()}, write)
            self._stored(parts)
            return True

    def _stored(self, parts: list) -> None:
        """``parts`` were stored (called under the lock; a data path that keeps tensors
        elsewhere records their references here)."""

    def read(self, rows: list[int], fields: list[str], pid: int | None = None
             ) -> tuple[dict, int | None, dict | None]:
        """Pieces of ``fields`` of ``rows``, plus a pin and where their blocks' segments are.

        With ``pid`` (a reader on this node that maps the arena), arena tensors come as
        block references, pinned for that reader until it calls :meth:`unpin` (or dies);
        without, every tensor comes inline (the bytes are in the reply)."""
        with self.lock:
            pieces = self.unit.get(rows, fields)
            if pid is None:
                return _joined(map_pieces(pieces, WireTensor.inlined)), None, None
            pieces = _joined(map_pieces(pieces, WireTensor.stripped))
            refs = refs_in(pieces)
            if not refs:
                return pieces, None, None
            pin = next(self._pin_ids)
            for ref in refs:
                self.blocks[ref].pins += 1
            self.pins[pin] = (pid, refs)
            return pieces, pin, self.arena.where(refs)

    def delete(self, rows: list[int]) -> tuple[int, int]:
        with self.lock:
            return self.unit.delete(rows)

    def delete_fields(self, rows: list[int], fields: list[str], write: int = 0) -> int:
        with self.lock:
            return self.unit.delete_fields(rows, fields, write)

    def inventory(self) -> dict[int, list[str]]:
        with self.lock:
            return self.unit.inventory()

    def stats(self) -> tuple[int, int]:
        with self.lock:
            return self.unit.stats()

    def usage(self) -> dict[str, int]:
        """The backend's :meth:`~streamrl.storage.StorageBackend.usage`."""
        with self.lock:
            return self.unit.usage()

    def arena_stats(self) -> dict[str, int]:
        """Bytes of the arena: ``size`` (shared memory held), ``used`` (in blocks),
        ``pinned`` (blocks readers still view), ``pins`` (open reads)."""
        with self.lock:
            return {"size": self.arena.size, "used": self.arena.used,
                    "pinned": sum(r.size for r, b in self.blocks.items() if b.pins),
                    "pins": len(self.pins)}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def memory(self) -> dict[str, int]:
        """This process's memory (bytes): ``VmRSS``, ``VmHWM`` (peak RSS), ``RssAnon``
        (private) and ``RssShmem`` (mapped shared memory: the arena), from /proc (Linux)."""
        return _proc_memory()

    def ping(self) -> bool:
        return True


def _proc_memory() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:  # not Linux
        pass
    return out


def _joined(pieces: dict[str, list]) -> dict[str, list]:
    """A read's pieces with small inline ones joined (see :func:`streamrl.wire.joined`)."""
    return {f: joined(plist) for f, plist in pieces.items()}


#: the storage unit as a Ray actor class (threaded; its socket channel has its own loop)
# (Ray's annotations of ray.remote list task options only: max_concurrency is an actor's)
StorageActor = ray.remote(  # type: ignore[call-overload]
    num_cpus=0, max_concurrency=4)(StorageActorImpl)
