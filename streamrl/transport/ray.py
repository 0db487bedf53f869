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

Calls: every actor also serves its methods over a socket (:mod:`.rpc`), about 30x
cheaper than a Ray actor call; ``direct_calls=False`` keeps them on Ray. A small put of
new rows is one call to a storage unit, which stores it under row ids the controller
leased to it and has the controller admit and commit it in one step
(:meth:`RayDataPlane.put_rows`): a waiting consumer hears of the rows three hops after
the producer's ``put`` began (producer -> unit -> controller -> consumer).

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
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import random
import sys
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import ray

from ..arena import Arena, ShmRef, map_segment
from ..config import QueueConfig
from ..controller import Controller, FilterSpec
from ..errors import RowsLost, TransportError, rows_preview
from ..messages import PutAnswer, PutStatus
from ..service import ControllerService
from ..wire import WireTensor
from .base import Column, DataCaps, DataPlane, Transport
from .rpc import ConnectFailed, Endpoint, RpcClient, RpcServer

#: the controller's socket endpoint and the storage units' (see :mod:`.rpc`)
Endpoints = tuple[Endpoint, list[Endpoint]]

__all__ = ["RayTransport", "ControllerActor", "StorageActor"]

log = logging.getLogger("streamrl")


# ---------------------------------------------------------------------- wire format
#
# The actors import neither torch nor tensordict (they start several times faster on a
# loaded machine): storage units keep WireTensors and encoded bytes. Converting to and
# from torch happens in the client, which has torch anyway.

#: Tensors of at least this many bytes go through the shared-memory arena when the
#: producer or reader is on the unit's node; smaller ones travel inline in the call.
SHM_MIN = 64 * 1024
FAST_MAX = 1 << 20  # puts up to this many bytes may be admitted by a unit (put_rows)
_BUSY_PAUSE = 0.02  # seconds without put_rows after a unit found the queue full
_ID_BLOCK = 4096  # row ids a unit leases at a time for the puts it admits


def _to_wire(cols: Mapping[str, Column]) -> dict[str, Any]:
    """Client side: tensors -> WireTensor (a view of their bytes, no copy when
    contiguous); per-row tensors of a list -> WireTensor each; other objects -> bytes."""
    import torch

    from .. import codec

    def wt(t):
        dtype, shape, buf = codec.tensor_to_raw(t)
        return WireTensor(dtype, t.element_size(), shape, buf)

    out: dict[str, Any] = {}
    for name, col in cols.items():
        if isinstance(col, torch.Tensor):
            out[name] = wt(col)
        else:
            out[name] = [wt(x) if isinstance(x, torch.Tensor)
                         else codec.pack(codec.encode(x, name=f"{name}[{i}]"))
                         for i, x in enumerate(col)]
    return out


def _tensors_in(pieces: Mapping[str, Any]) -> list[WireTensor]:
    """The WireTensors of the columns of a put, or of the pieces of a read."""
    out = []
    for col in pieces.values():
        for p in (col if isinstance(col, list) else (col,)):
            for x in (p if isinstance(p, list) else (p,)):
                if isinstance(x, WireTensor):
                    out.append(x)
    return out


def _refs_in(pieces: Mapping[str, Any]) -> list[ShmRef]:
    """The arena blocks the pieces of a read point at (each once, in a fixed order)."""
    return list({t.ref: None for t in _tensors_in(pieces) if t.ref is not None})


def _map_col(col: Any, fn: Callable) -> Any:
    """Apply ``fn`` to a column in wire form (a WireTensor, or a list of per-row
    WireTensors and encoded objects), or to one piece of a read."""
    if isinstance(col, WireTensor):
        return fn(col)
    return [fn(x) if isinstance(x, WireTensor) else x for x in col]


def _map_pieces(pieces: dict[str, list], fn: Callable) -> dict[str, list]:
    """Apply ``fn`` to every WireTensor of read pieces."""
    return {f: [_map_col(p, fn) for p in plist] for f, plist in pieces.items()}


def _from_wire(pieces: Mapping[str, list], arrays: dict) -> dict[str, list[Column]]:
    """Client side: storage pieces -> tensors (views of the arena blocks or of the inline
    bytes, no copy) / objects. ``arrays`` maps the pieces' block references to views."""
    from .. import codec

    def obj(x):
        if isinstance(x, WireTensor):
            return codec.tensor_from_raw(x.dtype, x.shape[1:], x.resolve(arrays))
        return codec.decode(codec.unpack(x))

    out: dict[str, list[Column]] = {}
    for f, plist in pieces.items():
        out[f] = [codec.tensor_from_raw(p.dtype, p.shape, p.resolve(arrays))
                  if isinstance(p, WireTensor) else [obj(x) for x in p] for p in plist]
    return out


def _unwrap(e: BaseException, what: str) -> BaseException:
    """Turn Ray's wrappers into streamrl errors."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
        return TransportError(
            f"the queue's {what} is gone ({type(e).__name__}); the queue cannot be used any "
            "more: create a new one (or reconnect if it was restarted)")
    return e


def _send(rpc: RpcClient | None, actor: Any, method: str, *args: Any) -> None:
    """Call ``method`` without waiting for it: on the socket channel when this event loop
    has a connection to the actor (after the calls already sent on it), else through Ray."""
    if rpc is None or not rpc.notify(method, *args):
        getattr(actor, method).remote(*args)


#: seconds a cancelled call waits for its effect to be taken back before it gives up
UNDO_TIMEOUT = 10.0


async def _undone(aw: Any, what: str) -> None:
    """Wait (shielded from further cancellation, up to :data:`UNDO_TIMEOUT`) for the undo
    of a cancelled call; a failure is logged (the lease or write timeout cleans up)."""
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(aw)), UNDO_TIMEOUT)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the caller's cancellation goes on regardless
        log.warning("streamrl: could not take back a cancelled %s (%r); its lease or write "
                    "times out instead", what, e)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this node) still runs."""
    return os.path.exists(f"/proc/{pid}")


# ---------------------------------------------------------------------- actors


class _Block:
    """An arena block's users: the rows stored in it, readers' pins, and the producer
    that reserved it and has not stored it yet."""

    __slots__ = ("stored", "pins", "writer")

    def __init__(self, writer: int | None):
        self.stored = False
        self.pins = 0
        self.writer = writer  # pid of the producer writing it


class _StorageActorImpl:
    """One storage unit as a (threaded) actor, with its shared-memory arena."""

    def __init__(self, index: int, storage: Any = "memory"):
        from ..storage import create_unit

        self.index = index
        self.arena = Arena(index)
        self.blocks: dict[ShmRef, _Block] = {}
        self.pins: dict[int, tuple[int, list[ShmRef]]] = {}  # pin -> (reader pid, blocks)
        self._pin_ids = itertools.count(1)
        self.unit = create_unit(storage, index, on_release=self._released)
        self.lock = threading.Lock()
        self._endpoint: Endpoint | None = None
        self._controller: RpcClient | None = None  # for put_rows (from the socket thread)
        self._ids = [0, 0]  # [next, end) of the row ids leased for put_rows (socket thread)
        self._ids_lock: asyncio.Lock | None = None
        self._puts: OrderedDict[str, asyncio.Future] = OrderedDict()  # put_rows by request id

    def endpoint(self, controller: Endpoint | None = None) -> Endpoint:
        """Start serving this unit's methods over a socket (see :mod:`.rpc`), from an
        event loop on a thread of its own; where. ``controller``: the controller's
        endpoint, for :meth:`put_rows`."""
        if controller is not None and self._controller is None:
            self._controller = RpcClient(controller)
        if self._endpoint is None:
            loop = _new_loop()
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

    def put(self, parts: list, write: int = 0) -> None:
        """Store ``(rows, columns)`` parts of write ``write``. Tensors come inline, or as
        blocks of this unit's arena that the producer reserved and wrote."""
        with self.lock:
            keep = []
            for p in parts:
                if not self.unit.forgotten(p[0], write):
                    keep.append(p)
                    continue
                for t in _tensors_in(p[1]):  # aborted while its data was on its way
                    if isinstance(t.ref, ShmRef):
                        self._give_back(t.ref)
            parts = keep
            refs = [t.ref for _, cols in parts for t in _tensors_in(cols)
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
                self.unit.put(rows, {f: _map_col(c, stored) for f, c in cols.items()}, write)

    def put_rows(self, n: int, cols: dict, partition: str, fields: list[str], nbytes: dict,
                 tags: dict, version: int | None, rid: str | None = None,
                 dtypes: dict | None = None):
        """A small put of ``n`` new rows (inline data), admitted by this unit: it stores
        them under row ids the controller leased to it, then asks the controller to
        admit and commit them in one step, without waiting for room. Consumers waiting
        for them hear of them two hops sooner than if the producer asked for room first.
        Socket channel only (it returns a coroutine). Answers a :class:`PutAnswer`:
        ``OK`` (with rows and commit result); ``BUSY`` (nothing kept: the producer puts
        the usual way); ``REFUSED`` (nothing kept) or ``FAILED`` (committed, then a
        filter failed, or the controller is gone), with the error."""
        fut = asyncio.ensure_future(
            _put_rows(self, n, cols, partition, fields, nbytes, tags, version, dtypes))
        if rid is not None:  # the producer may give up: see cancel_put
            self._puts[rid] = fut
            while len(self._puts) > 4096:
                self._puts.popitem(last=False)
        return asyncio.shield(fut)

    async def cancel_put(self, rid: str) -> None:
        """The producer of put ``rid`` was cancelled while it waited for the answer:
        once the put is done, rows it committed are dropped (``"cancelled"``), so a
        cancelled put leaves nothing behind. Socket channel only."""
        fut = self._puts.pop(rid, None)
        if fut is None:
            return
        try:
            ans = await fut
        except Exception:  # noqa: BLE001 - nothing committed
            return
        if ans.status is PutStatus.OK and self._controller is not None:
            await self._controller.call("retract_rows", ans.rows)

    def read(self, rows: list[int], fields: list[str], pid: int | None = None
             ) -> tuple[dict, int | None, dict | None]:
        """Pieces of ``fields`` of ``rows``, plus a pin and where their blocks' segments are.

        With ``pid`` (a reader on this node that maps the arena), arena tensors come as
        block references, pinned for that reader until it calls :meth:`unpin` (or dies);
        without, every tensor comes inline (the bytes are in the reply)."""
        with self.lock:
            pieces = self.unit.get(rows, fields)
            if pid is None:
                return _map_pieces(pieces, WireTensor.inlined), None, None
            pieces = _map_pieces(pieces, WireTensor.stripped)
            refs = _refs_in(pieces)
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


async def _put_rows(unit: _StorageActorImpl, n: int, cols: dict, partition: str,
                    fields: list[str], nbytes: dict, tags: dict, version: int | None,
                    dtypes: dict | None = None) -> tuple[str, Any]:
    # shielded from the producer's cancellation (see put_rows): what it stores is either
    # committed or deleted here, never left behind
    ctl = unit._controller
    if ctl is None:
        return PutAnswer(PutStatus.BUSY)
    if unit._ids_lock is None:
        unit._ids_lock = asyncio.Lock()
    try:
        async with unit._ids_lock:  # blocks are leased one at a time, used in order
            if unit._ids[1] - unit._ids[0] < n:
                unit._ids = list(await ctl.call("unit_ids", unit.index, max(n, _ID_BLOCK)))
            start = unit._ids[0]
            unit._ids[0] += n
    except Exception:  # noqa: BLE001 - no ids (controller busy or gone): the usual path says why
        return PutAnswer(PutStatus.BUSY)
    ids = list(range(start, start + n))
    try:
        unit.put([(ids, cols)])
    except Exception as e:  # noqa: BLE001 - nothing stored
        return PutAnswer(PutStatus.REFUSED, error=e)
    try:
        ans = await ctl.call("put_rows", partition, fields, ids, unit.index, nbytes, tags,
                             version, dtypes)
    except ConnectFailed:
        ans = PutAnswer(PutStatus.BUSY)  # nothing sent
    except ConnectionError as e:
        return PutAnswer(PutStatus.FAILED, error=TransportError(
            f"storage unit {unit.index} lost the connection to the queue's controller ({e}); "
            "it is gone or unreachable: the queue cannot be used any more"))
    except Exception as e:  # noqa: BLE001 - committed; the controller dropped what it had to
        return PutAnswer(PutStatus.FAILED, error=e)
    if ans.status is not PutStatus.OK:
        unit.delete(ids)
    return ans


StorageActor = ray.remote(num_cpus=0, max_concurrency=4)(_StorageActorImpl)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


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


class RayDataPlane(DataPlane):
    """Storage-unit actors, called concurrently, one call per unit per request; tensor
    bytes through the units' shared-memory arenas when on the same node."""

    caps = DataCaps(unit_admitted_puts=True, zero_copy_reads=True, shared_memory=True,
                    cross_process=True)

    def __init__(self, units: Sequence[Any], endpoints: Sequence[Endpoint | None] | None = None):
        self.units = list(units)
        self.num_shards = len(self.units)
        self.rpcs: list[RpcClient | None] = [None] * self.num_shards
        # per unit: its pid when this process maps its arena, False when it does not
        self._local: list[int | bool | None] = [None] * self.num_shards
        self._maps: dict[tuple[int, int], Any] = {}  # (unit, segment) -> mmap
        self.on_lost: Callable[[int], None] | None = None  # a unit died
        self._unpins: collections.deque = collections.deque()  # (unit, pin) of dead views
        self._loop: asyncio.AbstractEventLoop | None = None
        # round robin of put_rows, from a random unit: processes that put a few rows each
        # do not all start on unit 0
        self._next_unit = random.randrange(max(self.num_shards, 1))
        self._busy_until = 0.0  # no put_rows before (the queue was full)
        self._unreachable: set[int] = set()  # units put_rows could not connect to
        if endpoints is not None:
            self.use_endpoints(endpoints)

    def use_endpoints(self, endpoints: Sequence[Endpoint | None]) -> None:
        """Call the units over their socket channels (see :mod:`.rpc`) from now on."""
        self.rpcs = [RpcClient(e, on_broken=lambda s=shard: self._unmap(s)) if e is not None
                     else None for shard, e in enumerate(endpoints)]

    def _unmap(self, shard: int) -> None:
        """Forget unit ``shard``'s arena (its connection broke: the unit may be gone).
        Tensors already read keep their own mappings; the next call maps it again."""
        self._local[shard] = None
        for key in [k for k in self._maps if k[0] == shard]:
            del self._maps[key]

    async def _call(self, shard: int, method: str, *args, rows: Sequence[int] = ()):
        """``method(*args)`` on unit ``shard``: over its socket channel (or, if that
        fails, as a Ray call). A dead unit: ``on_lost`` and :class:`RowsLost` naming
        ``rows``."""
        rpc = self.rpcs[shard]
        if rpc is not None:
            try:
                return await rpc.call(method, *args)
            except ConnectionError:
                pass  # the unit died (Ray says so below) or its socket is unreachable
        try:
            return await getattr(self.units[shard], method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            self._unmap(shard)
            if self.on_lost is not None:
                self.on_lost(shard)
            raise RowsLost(
                f"storage unit {shard} is gone ({type(e).__name__}); rows "
                f"{rows_preview(rows)} it held are lost. The rest of the queue keeps working; "
                "drop these rows (or clear their partition) and move on", rows, shard) from None
        except ray.exceptions.RayTaskError as e:
            raise _unwrap(e, "storage unit") from None

    # -- shared memory

    async def _pid(self, shard: int, rows: Sequence[int]) -> int | None:
        """The unit's pid if this process can map its arena (same node, socket calls)."""
        if self._local[shard] is None:
            local: int | bool = False
            if self.rpcs[shard] is not None:
                node, pid = await self._call(shard, "shm_info", rows=rows)
                if node == ray.get_runtime_context().get_node_id():
                    local = pid
            self._local[shard] = local
        return self._local[shard] or None

    def _segment(self, shard: int, pid: int, seg: int, where: dict) -> Any:
        """The mapping of segment ``seg`` of unit ``shard`` (mapped on first use)."""
        mm = self._maps.get((shard, seg))
        if mm is None:
            fd, size = where[seg]
            mm = self._maps[(shard, seg)] = map_segment(f"/proc/{pid}/fd/{fd}", size)
        return mm

    def _unpin_later(self, shard: int, pin: int) -> None:
        """A read's views are all gone (called from garbage collection, any thread)."""
        self._unpins.append((shard, pin))
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._flush_unpins)
            except RuntimeError:  # that loop is closed: the next call flushes
                pass

    def released(self) -> None:
        self._flush_unpins()

    def _flush_unpins(self) -> None:
        """Tell the units which reads' views are gone (without waiting)."""
        by_shard: dict[int, list[int]] = {}
        while self._unpins:
            shard, pin = self._unpins.popleft()
            by_shard.setdefault(shard, []).append(pin)
        for shard, pins in by_shard.items():
            rpc = self.rpcs[shard]
            if rpc is None or not rpc.notify("unpin", pins):
                for pin in pins:  # no connection on this loop yet: next time
                    self._unpins.append((shard, pin))

    # -- data plane

    async def put(self, parts: Sequence[tuple[int, Sequence[int], Mapping[str, Column]]],
                  write: int = 0) -> None:
        by_shard: dict[int, list] = {}
        for shard, rows, cols in parts:
            by_shard.setdefault(shard, []).append((list(rows), _to_wire(cols)))
        await asyncio.gather(*[self._put(s, p, write) for s, p in by_shard.items()])

    async def _put(self, shard: int, parts: list, write: int = 0) -> None:
        """Store wire-form ``parts`` on unit ``shard``: big tensors through its arena when
        this process maps it, everything else inline in the call."""
        rows = [r for rs, _ in parts for r in rs]
        big = [t for _, cols in parts for t in _tensors_in(cols) if t.nbytes >= SHM_MIN]
        pid = await self._pid(shard, rows) if big else None
        got = None
        if pid is not None:  # None back: no shared memory left on the unit's node
            got = await self._call(shard, "reserve", [t.nbytes for t in big], os.getpid(),
                                   rows=rows)
        if got is None:
            await self._call(shard, "put", parts, write, rows=rows)
            return
        refs, where = got
        by_id: dict[int, WireTensor] = {}  # id of a big tensor -> its block reference
        try:
            try:
                maps = {ref.seg: self._segment(shard, pid, ref.seg, where) for ref in refs}
            except OSError as e:  # this process may not map the unit's memory
                self._no_shm(shard, e)
            else:
                for t, ref in zip(big, refs):
                    dst = np.frombuffer(maps[ref.seg], dtype=np.uint8, count=t.nbytes,
                                        offset=ref.off)
                    np.copyto(dst, t.buf)  # the one copy of a put
                    by_id[id(t)] = t.by_reference(ref)
                parts = [(rs, {f: _map_col(c, lambda t: by_id.get(id(t), t))
                               for f, c in cols.items()}) for rs, cols in parts]
            await self._call(shard, "put", parts, write, rows=rows)
        except BaseException:
            self._unreserve(shard, refs)
            raise
        if not by_id:  # sent inline: the reserved blocks are not used
            self._unreserve(shard, refs)

    def _unreserve(self, shard: int, refs: list[ShmRef]) -> None:
        _send(self.rpcs[shard], self.units[shard], "unreserve", refs)

    def _no_shm(self, shard: int, e: OSError) -> None:
        """This process cannot map unit ``shard``'s arena: use inline bytes from now on."""
        log.warning("streamrl: cannot map the shared memory of storage unit %d (%s); its "
                    "bytes travel inline in the calls from now on (slower)", shard, e)
        self._local[shard] = False

    async def put_rows(self, partition: str, cols: Mapping[str, Column], n: int,
                       nbytes: dict, tags: dict, version: int | None,
                       dtypes: dict | None = None) -> tuple[list[int], list[int], Any] | None:
        """A small put of ``n`` new rows, admitted and committed by one storage unit
        (see :meth:`_StorageActorImpl.put_rows`): one call instead of asking the
        controller for room first. Returns ``(rows, shards, commit result)``, or ``None``
        when it does not apply (big tensors, no socket channel, no room right now): the
        caller puts the usual way. Raises what the put would raise."""
        live = [s for s in range(self.num_shards)
                if self.rpcs[s] is not None and s not in self._unreachable]
        sizes = [sum(v) for v in nbytes.values()]  # each field's bytes
        if (not live or n < 1 or time.monotonic() < self._busy_until or sum(sizes) > FAST_MAX
                or max(sizes, default=0) >= SHM_MIN):  # big tensors go through the arena
            return None
        wire = _to_wire(cols)
        self._next_unit = (self._next_unit + 1) % len(live)
        shard = live[self._next_unit]
        rid = uuid.uuid4().hex
        try:
            ans = await self.rpcs[shard].call("put_rows", n, wire, partition, list(cols),
                                              nbytes, tags, version, rid, dtypes)
        except asyncio.CancelledError:
            # the unit finishes the put (shielded) and then drops what it committed;
            # the cancellation goes on once that is done, so a retry cannot race it
            await _undone(self.rpcs[shard].call("cancel_put", rid), "put")
            raise
        except ConnectFailed:  # nothing sent: the usual path finds out why
            self._unreachable.add(shard)
            return None
        except ConnectionError as e:
            raise TransportError(
                f"lost the connection to storage unit {shard} during a put ({e}); the rows "
                "may or may not have been put") from None
        if ans.status is PutStatus.BUSY:  # no room now: wait the usual way (and for a while)
            self._busy_until = time.monotonic() + _BUSY_PAUSE
            return None
        if ans.status is not PutStatus.OK:
            raise ans.error
        rows, res = ans.rows, ans.result
        return rows, [shard] * n, res

    async def get(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                  ) -> list[dict[str, list[Column]]]:
        self._loop = asyncio.get_running_loop()
        self._flush_unpins()
        return list(await asyncio.gather(*[self._read(s, list(rows), list(fields))
                                           for s, rows, fields in parts]))

    async def _read(self, shard: int, rows: list[int], fields: list[str]) -> dict[str, list[Column]]:
        pid = await self._pid(shard, rows)
        pieces, pin, where = await self._call(shard, "read", rows, fields,
                                              os.getpid() if pid else None, rows=rows)
        arrays: dict = {}
        if pin is not None:
            # one fresh array per segment for this read: the views handed out keep it
            # alive, and when the last goes, the unit hears that the blocks are free
            bases = {}
            try:
                for ref in _refs_in(pieces):
                    base = bases.get(ref.seg)
                    if base is None:
                        base = bases[ref.seg] = np.frombuffer(
                            self._segment(shard, pid, ref.seg, where), dtype=np.uint8)
                    arrays[ref] = base[ref.off:ref.off + ref.size]
            except OSError as e:  # this process may not map the unit's memory
                self._no_shm(shard, e)
                self._unpin_later(shard, pin)
                return await self._read(shard, rows, fields)
            left = [len(bases)]

            def gone(shard=shard, pin=pin, left=left):
                left[0] -= 1
                if not left[0]:
                    self._unpin_later(shard, pin)

            for base in bases.values():
                weakref.finalize(base, gone)
        return _from_wire(pieces, arrays)

    async def delete(self, parts: Mapping[int, Sequence[int]]) -> None:
        await self._forget(parts, "delete")

    async def delete_fields(self, parts: Mapping[int, Sequence[int]], fields: Sequence[str],
                            write: int = 0) -> None:
        await self._forget(parts, "delete_fields", list(fields), write)

    async def inventory(self) -> list[dict[int, list[str]]]:
        res = await asyncio.gather(*[self._call(s, "inventory") for s in range(self.num_shards)],
                                   return_exceptions=True)
        return [{} if isinstance(r, BaseException) else r for r in res]

    async def _forget(self, parts: Mapping[int, Sequence[int]], method: str, *args) -> None:
        """``method(rows, *args)`` on the unit of each ``{shard: rows}`` part,
        concurrently; a dead unit is skipped (what it held is gone anyway)."""
        res = await asyncio.gather(*[
            self._call(s, method, list(rows), *args, rows=rows)
            for s, rows in parts.items()], return_exceptions=True)
        for r in res:
            if isinstance(r, BaseException) and not isinstance(r, RowsLost):
                raise r

    async def unit_stats(self) -> list[tuple[int, int]]:
        res = await asyncio.gather(*[self._call(s, "stats") for s in range(self.num_shards)],
                                   return_exceptions=True)
        return [(0, 0) if isinstance(r, BaseException) else r for r in res]


class _ControllerActorImpl:
    """The controller service as an async actor."""

    def __init__(self, config: QueueConfig, units: list):
        ctl = Controller.from_config(config)
        self.data = RayDataPlane(units)
        self.svc = ControllerService(ctl, self.data)
        self.data.on_lost = self._lost
        self.units = units
        self.dead: set[int] = set()
        self._inflight: dict[str, asyncio.Task] = {}  # calls a client may cancel
        self._recent: OrderedDict[str, tuple] = OrderedDict()  # (undo, result) of done ones
        self._rpc = RpcServer(self, ray.util.get_node_ip_address())
        self._endpoints: Endpoints | None = None

    def _lost(self, shard: int) -> None:
        if shard in self.dead:
            return
        self.dead.add(shard)
        n = self.svc.ctl.mark_lost(shard)
        log.error("streamrl: storage unit %d died; %d rows lost", shard, n)
        asyncio.get_running_loop().create_task(self.svc._after())

    async def report_lost(self, shard: int) -> None:
        self._lost(shard)

    async def retract_rows(self, rows: list[int]) -> int:
        """Drop the rows of a put whose producer was cancelled (see ``cancel_put``)."""
        return await self.svc.retract_rows(rows)

    def handles(self) -> tuple[list, Endpoints | None]:
        return self.units, self._endpoints

    async def endpoints(self) -> Endpoints:
        """Start serving this actor's methods, and each storage unit's, over sockets
        (see :mod:`.rpc`); where (this actor's endpoint, the units')."""
        if self._endpoints is None:
            mine = await self._rpc.start()
            units = list(await asyncio.gather(*[u.endpoint.remote(mine) for u in self.units]))
            self.data.use_endpoints(units)
            self._endpoints = (mine, units)
        return self._endpoints

    async def _tracked(self, rid: str | None, coro, undo: Callable, key: Callable):
        """Run a call a client may give up on (see :meth:`cancel`): while it runs it can
        be cancelled; once done, ``undo(key(result))`` takes its effect back (``key``
        keeps just the id needed, not the result)."""
        if rid is None:
            return await coro
        self._inflight[rid] = asyncio.current_task()
        try:
            res = await coro
        finally:
            self._inflight.pop(rid, None)
        self._recent[rid] = (undo, key(res))
        while len(self._recent) > 4096:
            self._recent.popitem(last=False)
        return res

    async def cancel(self, rid: str) -> None:
        """The client gave up on call ``rid`` (it was cancelled while waiting for the
        answer): stop the call, or take back what it did (give a lease back, forget an
        admitted write), so nothing is left behind for a caller that is gone."""
        task = self._inflight.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # it takes its own effect back (a retract) first
            return
        done = self._recent.pop(rid, None)
        if done is not None and done[1] is not None:
            undo, ident = done
            await undo(ident)

    async def allocate(self, *a, rid: str | None = None, **kw):
        return await self._tracked(rid, self.svc.allocate(*a, **kw), self.svc.abort,
                                   lambda tok: tok.id)

    async def begin_write(self, *a, rid: str | None = None, **kw):
        return await self._tracked(rid, self.svc.begin_write(*a, **kw), self.svc.abort,
                                   lambda tok: tok.id)

    async def commit(self, token, *a, rid: str | None = None, **kw):
        # a client that gives up while it waits has the write taken back
        return await self._tracked(rid, self.svc.commit(token, *a, **kw), self.svc.retract,
                                   lambda _res: token)

    async def audit(self):
        return await self.svc.audit()

    async def retract(self, token):
        return await self.svc.retract(token)

    async def put_rows(self, *a, **kw):
        res = await self.svc.put_rows(*a, **kw)
        await asyncio.sleep(0)  # the consumers it woke get their rows before this reply
        return res

    def unit_ids(self, shard: int, n: int) -> tuple[int, int]:
        return self.svc.ctl.unit_ids(shard, n)

    async def abort(self, token):
        return await self.svc.abort(token)

    async def take(self, req, timeout=None, rid: str | None = None):
        return await self._tracked(rid, self.svc.take(req, timeout),
                                   lambda lease: self.svc.release([lease]),
                                   lambda d: None if d is None else d.lease)

    async def ack(self, lease_ids):
        return await self.svc.ack(lease_ids)

    async def release(self, lease_ids):
        return await self.svc.release(lease_ids)

    async def lease_rows(self, lease_ids):
        return await self.svc.lease_rows(lease_ids)

    async def drop(self, rows):
        return await self.svc.drop(rows)

    async def clear(self, partition):
        return await self.svc.clear(partition)

    async def seal(self, partition):
        return await self.svc.seal(partition)

    async def declare(self, partition, consumers):
        return await self.svc.declare(partition, consumers)

    async def set_version(self, version):
        return await self.svc.set_version(version)

    async def wait_version(self, version, timeout=None):
        return await self.svc.wait_version(version, timeout)

    async def close(self):
        return await self.svc.close()

    async def add_filter(self, fn_blob: bytes, spec: FilterSpec):
        fn = ray.cloudpickle.loads(fn_blob)
        return await self.svc.add_filter(fn, spec)

    async def stats(self):
        units = await self.data.unit_stats()
        for i, u in enumerate(self.units):
            if i not in self.dead:
                try:
                    await u.ping.remote()
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                    self._lost(i)
        st = await self.svc.stats(with_units=False)
        st.unit_rows = [u[0] for u in units]
        st.unit_bytes = [u[1] for u in units]
        arenas = await asyncio.gather(*[self.data._call(i, "arena_stats")
                                        for i in range(len(self.units))], return_exceptions=True)
        arenas = [{} if isinstance(a, BaseException) else a for a in arenas]
        st.unit_shared_bytes = [a.get("size", 0) for a in arenas]
        st.unit_pinned_bytes = [a.get("pinned", 0) for a in arenas]
        return st

    async def leaked(self):
        return await self.svc.leaked()

    async def ensure_tags(self, fields, partition=None):
        return await self.svc.ensure_tags(fields, partition)

    async def event_loop(self) -> str:
        """The class of the event loop this actor runs on (Ray uses uvloop's when it is
        installed, unless ``RAY_USE_UVLOOP=0``)."""
        loop = asyncio.get_running_loop()
        return f"{type(loop).__module__}.{type(loop).__name__}"

    def ping(self) -> bool:
        return True


ControllerActor = ray.remote(num_cpus=0)(_ControllerActorImpl)


# ---------------------------------------------------------------------- client side


#: Controller calls whose effect is taken back if the caller gives up while waiting
#: (a take's lease, a write's admission): see ``_ControllerActorImpl.cancel``.
_CANCELLABLE = frozenset({"take", "allocate", "begin_write", "commit"})


class RayControl:
    """The controller actor, seen as a control plane (the service's async API).

    Calls go over the actor's socket channel (:mod:`.rpc`) when it has one (about 30x
    faster than a Ray actor call), else as Ray actor calls."""

    def __init__(self, actor, endpoint: Endpoint | None = None):
        self.actor = actor
        self.rpc = RpcClient(endpoint) if endpoint is not None else None

    async def _call(self, method: str, *args, **kwargs):
        """Call the controller; Ray's errors become streamrl's. A call in
        ``_CANCELLABLE`` carries a request id: if this await is cancelled, the controller
        stops the call or takes its effect back, so nothing outlives a caller that gave up."""
        rid = None
        if method in _CANCELLABLE:
            rid = kwargs["rid"] = uuid.uuid4().hex
        try:
            if self.rpc is not None:
                try:
                    return await self.rpc.call(method, *args, **kwargs)
                except ConnectFailed:
                    pass  # nothing was sent: Ray tells whether the actor is gone
            return await getattr(self.actor, method).remote(*args, **kwargs)
        except asyncio.CancelledError:
            # the cancel goes after the call on the same channel, so it cannot overtake
            # it; the cancellation goes on once the call's effect is taken back, so a
            # retry cannot race the undo
            if rid is not None:
                await _undone(self._cancel(rid), method)
            raise
        except ConnectionError as e:
            raise TransportError(
                f"lost the connection to the queue's controller actor ({e}); it is gone or "
                "unreachable: the queue cannot be used any more; create a new one (or "
                "reconnect if it was restarted)") from None
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError,
                ray.exceptions.ObjectLostError) as e:
            raise _unwrap(e, "controller actor") from None

    async def _cancel(self, rid: str) -> None:
        """Have the controller stop call ``rid`` or take its effect back (on the channel
        the call went by, after it)."""
        if self.rpc is not None:
            try:
                return await self.rpc.call("cancel", rid)
            except ConnectFailed:
                pass
        return await self.actor.cancel.remote(rid)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        async def call(*args, **kwargs):
            return await self._call(method, *args, **kwargs)

        call.__name__ = method
        return call

    async def add_filter(self, fn, spec):
        return await self._call("add_filter", _pickle_by_value(fn), spec)


def _pickle_by_value(fn) -> bytes:
    """Pickle a filter so it loads in the controller actor even when its module (a
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


#: This process's clients of each queue (by controller actor id), shared by every handle
#: of it that arrives here (a queue passed to an actor method is a new handle per call):
#: their connections and arena mappings are made once.
_clients: dict[str, tuple[RayControl, RayDataPlane]] = {}


class RayTransport(Transport):
    """Controller and storage units as Ray actors (see the module docstring).

    Built by ``StreamQueue(transport="ray", ...)``; the queue object pickles into a handle
    that works in any Ray task or actor; :meth:`streamrl.StreamQueue.connect` attaches to
    a named queue from another driver.
    """

    name = "ray"

    def __init__(self, controller, units: list, *, owner: bool,
                 endpoints: Endpoints | None = None):
        self._controller = controller
        self._units = units
        self._endpoints = endpoints
        self._key = controller._actor_id.hex()
        shared = _clients.get(self._key)
        if shared is None:
            data = RayDataPlane(units, endpoints[1] if endpoints else None)
            data.on_lost = lambda shard: controller.report_lost.remote(shard)
            shared = _clients[self._key] = (RayControl(controller, endpoints[0] if endpoints else None), data)
        self._control, self._data = shared
        self._owner = owner

    @classmethod
    def create(cls, config: QueueConfig) -> "RayTransport":
        """Start the actors of a queue configured by ``config``. Its ``options``:

        * ``unit_options`` (one dict for all units, or one per unit) and
          ``controller_options`` are passed to ``.options()`` (for example
          ``{"resources": {"node:10.0.0.2": 0.001}}`` to pin a unit to a node);
        * ``namespace``: the Ray namespace of the actors;
        * ``detached=True`` keeps the actors alive after this driver exits (named queues);
        * ``direct_calls`` (default ``True``): clients call the controller over a TCP
          connection to its node's IP address (see :mod:`streamrl.transport.rpc`), which
          is about 30x faster than a Ray actor call. ``False`` sends every call through
          Ray (for clusters whose nodes only reach each other on Ray's own ports)."""
        from ..errors import InvalidArgument

        opts = dict(config.options)
        valid = ("namespace", "unit_options", "controller_options", "detached", "direct_calls")
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
        if not ray.is_initialized():  # as Ray itself would (it reads RAY_ADDRESS)
            ray.init(ignore_reinit_error=True, include_dashboard=False)
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
        for i, opts in enumerate(per_unit):
            o = {"scheduling_strategy": "SPREAD", **common, **opts}
            if name:
                o.setdefault("name", f"{name}.unit{i}")
            units.append(StorageActor.options(**o).remote(i, config.storage))
        copts = {**common, **(controller_options or {})}
        if name:
            copts.setdefault("name", name)
        controller = ControllerActor.options(**copts).remote(config.replace(options={}), units)
        # either call also surfaces start-up errors here
        endpoints = None
        if direct_calls:
            endpoints = ray.get(controller.endpoints.remote())
        else:
            ray.get(controller.ping.remote())
        return cls(controller, units, owner=True, endpoints=endpoints)

    @classmethod
    def connect(cls, name: str, namespace: str | None = None) -> "RayTransport":
        try:
            controller = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise TransportError(
                f"no streamrl queue named {name!r} in this Ray cluster"
                + (f" (namespace {namespace!r})" if namespace else "")
                + "; create it with StreamQueue(transport='ray', name=...) first") from None
        units, endpoints = ray.get(controller.handles.remote())
        return cls(controller, units, owner=False, endpoints=endpoints)

    @property
    def queue_id(self) -> str:
        """The controller actor's id: the same in every handle of the queue."""
        return self._key

    @property
    def handle(self) -> tuple:
        """What a pickled queue carries: the actor handles and their socket endpoints."""
        return (self._controller, self._units, self._endpoints)

    @classmethod
    def attach(cls, handle: tuple) -> "RayTransport":
        """The queue in this process, from :attr:`handle` (not owned)."""
        controller, units, endpoints = handle
        return cls(controller, units, owner=False, endpoints=endpoints)

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
        _clients.pop(self._key, None)
        for rpc in [self._control.rpc, *self._data.rpcs]:
            if rpc is not None:
                rpc.close()
        self._owner = False
        for a in [self._controller, *self._units]:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass


def create(config: QueueConfig) -> RayTransport:
    """The registered factory of ``transport="ray"``."""
    return RayTransport.create(config)
