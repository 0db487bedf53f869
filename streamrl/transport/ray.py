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

Data path (chosen by measurement, see ``docs/benchmarks.md``): tensors travel as raw
bytes (:class:`~streamrl.wire.WireTensor`: dtype name, shape, a numpy ``uint8`` view).
The producer writes each tensor of at least ``BY_REFERENCE_MIN`` bytes into Ray's
shared-memory object store once (``ray.put`` of the numpy view: one copy, no pickling)
and sends the storage unit the object reference. With the default ``ownership="unit"``
the reference is also passed as a top-level argument, so Ray maps the object into the
unit's process and the unit keeps that view: the bytes stay in the object store while
the unit holds the rows, even if the producer (the object's owner) dies. Reads return
the references, which a reader on the same node maps without copying (another node gets
them by Ray's object transfer); if the owner is gone and the object cannot be fetched,
the reader asks the unit for the bytes it kept (one copy). With
``ownership="producer"`` the unit keeps only the reference, and the rows die with their
producer. Small tensors and Python objects (codec bytes) travel inline. (Ray's default
torch path pickles tensors byte by byte, at a tenth of the speed.) Each micro-batch
costs one call per storage unit holding its rows, issued concurrently.

Failures: a storage unit that dies loses its rows: reads of them raise
:class:`~streamrl.errors.RowsLost` naming the rows and the unit, the controller drops them
(``stats().dropped_by["lost"]``) and places new rows on the living units. A dead
controller makes every call raise :class:`~streamrl.errors.TransportError` at once. A
client that dies holding a lease: its rows go back after ``lease_timeout``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import ray

from ..controller import Controller, DropReason, FilterSpec
from ..errors import RowsLost, TransportError, rows_preview
from ..service import ControllerService
from ..wire import WireTensor
from .base import Column, DataPlane, Transport
from .rpc import Endpoint, RpcClient, RpcServer

#: the controller's socket endpoint and the storage units' (see :mod:`.rpc`)
Endpoints = tuple[Endpoint, list[Endpoint]]

__all__ = ["RayTransport", "ControllerActor", "StorageActor"]

log = logging.getLogger("streamrl")


# ---------------------------------------------------------------------- wire format
#
# The actors import neither torch nor tensordict (they start several times faster on a
# loaded machine): storage units keep WireTensors and encoded bytes. Converting to and
# from torch happens in the client, which has torch anyway.


def _to_wire(cols: Mapping[str, Column]) -> dict[str, Any]:
    """Client side: tensors -> WireTensor (a view of their bytes, no copy when
    contiguous); per-row tensors of a list -> WireTensor each; other objects -> bytes.
    Big tensors are put in the object store here (owned by this process: the one copy
    of a put) and only their references travel."""
    import torch

    from .. import codec

    def wt(t):
        dtype, shape, buf = codec.tensor_to_raw(t)
        w = WireTensor(dtype, t.element_size(), shape, buf)
        if buf.nbytes >= BY_REFERENCE_MIN:
            w = w.by_reference(ray.put(buf))
        return w

    out: dict[str, Any] = {}
    for name, col in cols.items():
        if isinstance(col, torch.Tensor):
            out[name] = wt(col)
        else:
            out[name] = [wt(x) if isinstance(x, torch.Tensor)
                         else codec.pack(codec.encode(x, name=f"{name}[{i}]"))
                         for i, x in enumerate(col)]
    return out


class _Wired(dict):
    """Columns already in wire form (see :meth:`RayDataPlane.prepare`)."""


def _refs_in(pieces: Mapping[str, Any]) -> list:
    """Object references the columns of a put, or the pieces of a read, point at (each
    once, in a fixed order)."""
    refs = {}
    for col in pieces.values():
        for p in (col if isinstance(col, list) else (col,)):
            for x in (p if isinstance(p, list) else (p,)):
                if isinstance(x, WireTensor) and x.ref is not None:
                    refs[x.ref] = None
    return list(refs)


def _put_refs(parts: Sequence[tuple[list, dict]]) -> list:
    """Object references of the columns of ``(rows, columns)`` parts."""
    return list({r: None for _, cols in parts for r in _refs_in(cols)})


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
    """Client side: storage pieces -> tensors (views of the object-store buffers, no
    copy) / objects. ``arrays`` maps the pieces' object references to their arrays."""
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


#: Tensor data of at least this many bytes in one put is kept by the storage unit as a
#: Ray object it owns: reads hand out the reference, and a reader on the same node maps
#: the bytes without a copy. Smaller data travels inline.
BY_REFERENCE_MIN = 64 * 1024


#: Up to this many objects a read awaits them directly (measured: ~0.6 ms for one or two,
#: against ~1.3 ms for a hop to a worker thread); more go to one batched ``ray.get``.
_AWAIT_MAX = 4


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


# ---------------------------------------------------------------------- actors


class _StorageActorImpl:
    """One storage unit as a (threaded) actor."""

    def __init__(self, index: int):
        from ..storage import StorageUnit

        self.unit = StorageUnit(index)
        self.lock = threading.Lock()
        self._endpoint: Endpoint | None = None

    def endpoint(self) -> Endpoint:
        """Start serving this unit's methods over a socket (see :mod:`.rpc`), from an
        event loop on a thread of its own; where. Only calls that carry no object
        references use it (Ray must see those to count them)."""
        if self._endpoint is None:
            loop = _new_loop()
            threading.Thread(target=loop.run_forever, name="streamrl-unit-rpc",
                             daemon=True).start()
            server = RpcServer(self, ray.util.get_node_ip_address())
            self._endpoint = asyncio.run_coroutine_threadsafe(server.start(), loop).result()
        return self._endpoint

    def get_inline(self, rows: list[int], fields: list[str]) -> dict | None:
        """:meth:`get` for the socket channel: ``None`` when the pieces hold object
        references (ask again through Ray)."""
        out = self.get(rows, fields)
        return None if _refs_in(out) else out

    def put(self, parts: list, *pinned) -> None:
        """Store ``(rows, columns)`` parts. ``pinned``: the arrays of the parts' object
        references (in :func:`_put_refs` order), which Ray mapped into this process
        (no copy on a node): kept with the rows so their bytes outlive the producer."""
        if pinned:
            arrays = dict(zip(_put_refs(parts), pinned))

            def pin(t):
                return t.pinned(arrays[t.ref]) if t.ref in arrays else t

            parts = [(rows, {f: _map_col(c, pin) for f, c in cols.items()})
                     for rows, cols in parts]
        with self.lock:
            for rows, cols in parts:
                self.unit.put(rows, cols)

    def get(self, rows: list[int], fields: list[str], inline: bool = False) -> dict:
        """Pieces of ``fields`` of ``rows``: big tensors as object references, or with
        ``inline`` (the reader could not fetch those objects: their owner died) as the
        bytes this unit kept. Raises ``RowsLost`` when it kept none (``ownership="producer"``)."""
        with self.lock:
            pieces = self.unit.get(rows, fields)
        if not inline:
            return _map_pieces(pieces, WireTensor.stripped)

        def inl(t):
            out = t.inlined()
            if out is None:
                raise RowsLost(
                    f"the data of rows {rows_preview(rows)} is gone: the process that owned it "
                    "died (with ownership='producer', their producer). Drop these rows and "
                    "move on; use ownership='unit' for data that must outlive its producer",
                    rows)
            return out
        return _map_pieces(pieces, inl)

    def delete(self, rows: list[int]) -> tuple[int, int]:
        with self.lock:
            return self.unit.delete(rows)

    def delete_fields(self, rows: list[int], fields: list[str]) -> int:
        with self.lock:
            return self.unit.delete_fields(rows, fields)

    def stats(self) -> tuple[int, int]:
        with self.lock:
            return self.unit.stats()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def memory(self) -> dict[str, int]:
        """This process's memory (bytes): ``VmRSS``, ``VmHWM`` (peak RSS), ``RssAnon``
        (private) and ``RssShmem`` (mapped object-store pages), from /proc (Linux)."""
        return _proc_memory()

    def ping(self) -> bool:
        return True


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
    """Storage-unit actors, called concurrently, one call per unit per request."""

    def __init__(self, units: Sequence[Any], ownership: str = "unit",
                 endpoints: Sequence[Endpoint | None] | None = None):
        self.units = list(units)
        self.num_shards = len(self.units)
        self.ownership = ownership
        self.rpcs: list[RpcClient | None] = [None] * self.num_shards
        if endpoints is not None:
            self.use_endpoints(endpoints)
        self.on_lost: Callable[[int], None] | None = None  # a unit died
        self.on_rows_lost: Callable[[list[int]], None] | None = None  # their data died

    def use_endpoints(self, endpoints: Sequence[Endpoint | None]) -> None:
        """Call the units over their socket channels (see :mod:`.rpc`) from now on."""
        self.rpcs = [RpcClient(e) if e is not None else None for e in endpoints]

    async def _call(self, shard: int, method: str, *args, rows: Sequence[int] = (),
                    refs: Sequence = (), direct: bool = True):
        """``method(*args)`` on unit ``shard``: over its socket channel when ``direct``
        (the call carries no object references), else (or if the socket fails) as a Ray
        call with ``refs`` as extra top-level arguments. A dead unit: ``on_lost`` and
        :class:`RowsLost` naming ``rows``."""
        rpc = self.rpcs[shard]
        if direct and rpc is not None:
            try:
                return await rpc.call(method, *args)
            except ConnectionError:
                pass  # the unit died (Ray says so below) or its socket is unreachable
        try:
            return await getattr(self.units[shard], method).remote(*args, *refs)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            if self.on_lost is not None:
                self.on_lost(shard)
            raise RowsLost(
                f"storage unit {shard} is gone ({type(e).__name__}); rows "
                f"{rows_preview(rows)} it held are lost. The rest of the queue keeps working; "
                "drop these rows (or clear their partition) and move on", rows, shard) from None
        except ray.exceptions.RayTaskError as e:
            raise _unwrap(e, "storage unit") from None

    prepare_min_bytes = BY_REFERENCE_MIN  # smaller puts have nothing to copy early

    def prepare(self, columns: Mapping[str, Column]) -> "_Wired":
        """The columns in wire form: big tensors written into the object store now."""
        return _Wired(_to_wire(columns))

    async def put(self, parts: Sequence[tuple[int, Sequence[int], Mapping[str, Column]]]) -> None:
        by_shard: dict[int, list] = {}
        for shard, rows, cols in parts:
            by_shard.setdefault(shard, []).append(
                (list(rows), dict(cols) if isinstance(cols, _Wired) else _to_wire(cols)))
        # ownership="unit": the references also go as top-level arguments, so Ray maps
        # the objects into the unit (which keeps them: rows outlive this process)
        pin = self.ownership == "unit"

        def put(s, p):
            refs = _put_refs(p)
            return self._call(s, "put", p, refs=refs if pin else (), direct=not refs,
                              rows=[r for rows, _ in p for r in rows])

        await asyncio.gather(*[put(s, p) for s, p in by_shard.items()])

    async def get(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                  ) -> list[dict[str, list[Column]]]:
        outs = await asyncio.gather(*[self._get(s, list(rows), list(fields)) for s, rows, fields in parts])
        # fetch the referenced objects (mapped in place on this node, copied once
        # from another node), all at once
        arrays: dict = {}
        fetches = [(i, refs) for i, refs in enumerate(_refs_in(o) for o in outs) if refs]
        got = await asyncio.gather(*[self._fetch(refs) for _, refs in fetches])
        for (i, _), d in zip(fetches, got):
            if d is not None:
                arrays.update(d)
                continue
            # the objects' owner (the producer) is gone: read the bytes the unit kept
            s, rows, fields = parts[i]
            try:
                outs[i] = await self._call(s, "get", list(rows), list(fields), True, rows=rows)
            except RowsLost as e:
                if e.unit is None and self.on_rows_lost is not None:
                    self.on_rows_lost(list(rows))
                raise
        return [_from_wire(o, arrays) for o in outs]

    async def _get(self, shard: int, rows: list[int], fields: list[str]) -> dict:
        """The pieces of a read: over the socket when they hold no object references."""
        if self.rpcs[shard] is not None:
            out = await self._call(shard, "get_inline", rows, fields, rows=rows)
            if out is not None:
                return out
        return await self._call(shard, "get", rows, fields, rows=rows, direct=False)

    async def _fetch(self, refs: list) -> dict | None:
        """The arrays of ``refs`` (mapped in place on this node), or ``None`` when their
        owner died."""
        try:
            if len(refs) <= _AWAIT_MAX:
                vals = await asyncio.gather(*refs)
            else:
                # one batched ray.get (on a worker thread, so the loop keeps running) is
                # ~10x faster than awaiting many references one by one
                vals = await anyio.to_thread.run_sync(ray.get, refs)
        except (ray.exceptions.ObjectLostError, ray.exceptions.RayActorError):
            return None
        return dict(zip(refs, vals))

    async def delete(self, parts: Mapping[int, Sequence[int]]) -> None:
        await self._forget(parts, "delete")

    async def delete_fields(self, parts: Mapping[int, Sequence[int]], fields: Sequence[str]) -> None:
        await self._forget(parts, "delete_fields", list(fields))

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

    def __init__(self, config: dict, units: list, ownership: str = "unit"):
        self.ownership = ownership
        ctl = Controller(**config)
        self.data = RayDataPlane(units)
        self.svc = ControllerService(ctl, self.data)
        self.data.on_lost = self._lost
        self.data.on_rows_lost = self._rows_lost
        self.units = units
        self.dead: set[int] = set()
        self._inflight: dict[str, asyncio.Task] = {}  # calls a client may cancel
        self._recent: OrderedDict[str, tuple] = OrderedDict()  # (undo, result) of done ones
        self._rpc: RpcServer | None = None
        self._endpoints: Endpoints | None = None

    def _lost(self, shard: int) -> None:
        if shard in self.dead:
            return
        self.dead.add(shard)
        ctl = self.svc.ctl
        ctl.dead_shards.add(shard)
        lost = [r for r in ctl.rows.values() if r.shard == shard]
        ctl._drop_rows(lost, DropReason.LOST)
        ctl.deletes.pop(shard, None)  # nothing to delete on a dead unit
        log.error("streamrl: storage unit %d died; %d rows lost", shard, len(lost))
        asyncio.get_running_loop().create_task(self.svc._after())

    async def report_lost(self, shard: int) -> None:
        self._lost(shard)

    def _rows_lost(self, rows: list[int]) -> None:
        self.svc.ctl.drop(rows, DropReason.LOST)
        asyncio.get_running_loop().create_task(self.svc._after())

    async def report_lost_rows(self, rows: list[int]) -> None:
        """Rows whose data died with its owner (``ownership="producer"``)."""
        self.svc.ctl.drop(rows, DropReason.LOST)
        await self.svc._after()

    def handles(self) -> tuple[list, str, Endpoints | None]:
        return self.units, self.ownership, self._endpoints

    async def endpoints(self) -> Endpoints:
        """Start serving this actor's methods, and each storage unit's, over sockets
        (see :mod:`.rpc`); where (this actor's endpoint, the units')."""
        if self._endpoints is None:
            if self._rpc is None:
                self._rpc = RpcServer(self, ray.util.get_node_ip_address())
            mine = await self._rpc.start()
            units = list(await asyncio.gather(*[u.endpoint.remote() for u in self.units]))
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

    async def commit(self, *a, **kw):
        return await self.svc.commit(*a, **kw)

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
        return st

    async def leaked(self):
        return await self.svc.leaked()

    async def ensure_tags(self, fields):
        return await self.svc.ensure_tags(fields)

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
_CANCELLABLE = frozenset({"take", "allocate", "begin_write"})


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
                return await self.rpc.call(method, *args, **kwargs)
            return await getattr(self.actor, method).remote(*args, **kwargs)
        except asyncio.CancelledError:
            # the cancel goes after the call on the same channel, so it cannot overtake it
            if rid is not None and not (self.rpc is not None and self.rpc.notify("cancel", rid)):
                self.actor.cancel.remote(rid)
            raise
        except ConnectionError as e:
            raise TransportError(
                f"lost the connection to the queue's controller actor ({e}); it is gone or "
                "unreachable: the queue cannot be used any more; create a new one (or "
                "reconnect if it was restarted)") from None
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError,
                ray.exceptions.ObjectLostError) as e:
            raise _unwrap(e, "controller actor") from None

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


_name_ids = itertools.count()


class RayTransport(Transport):
    """Controller and storage units as Ray actors (see the module docstring).

    Built by ``StreamQueue(transport="ray", ...)``; the queue object pickles into a handle
    that works in any Ray task or actor; :meth:`streamrl.StreamQueue.connect` attaches to
    a named queue from another driver.
    """

    name = "ray"

    def __init__(self, controller, units: list, *, owner: bool, ownership: str = "unit",
                 endpoints: Endpoints | None = None):
        self._controller = controller
        self._units = units
        self._ownership = ownership
        self._endpoints = endpoints
        self._control = RayControl(controller, endpoints[0] if endpoints else None)
        self._data = RayDataPlane(units, ownership, endpoints[1] if endpoints else None)
        self._data.on_lost = self._report_lost
        self._data.on_rows_lost = self._report_lost_rows
        self._owner = owner

    def _report_lost(self, shard: int) -> None:
        self._controller.report_lost.remote(shard)

    def _report_lost_rows(self, rows: list[int]) -> None:
        self._controller.report_lost_rows.remote(rows)

    @classmethod
    def create(cls, *, capacity: int, capacity_bytes: int | None, num_shards: int,
               lease_timeout: float, max_staleness: int | None, max_lead: int | None,
               consumers: Sequence[str] | None, name: str | None = None,
               namespace: str | None = None, unit_options: dict | Sequence[dict] | None = None,
               controller_options: dict | None = None, detached: bool = False,
               ownership: str = "unit", direct_calls: bool = True) -> "RayTransport":
        """Start the actors. ``unit_options`` (one dict for all units, or one per unit) and
        ``controller_options`` are passed to ``.options()`` (for example
        ``{"resources": {"node:10.0.0.2": 0.001}}`` to pin a unit to a node).
        ``detached=True`` keeps the actors alive after this driver exits (named queues).

        ``ownership`` says who owns the object-store copy of big tensors:

        * ``"unit"`` (default): the storage unit maps the producer's objects and keeps
          them mapped, so rows outlive the producer that put them (one copy per put,
          none per read on a node);
        * ``"producer"``: the unit keeps only the references (one copy per put, none per
          read), and the rows are lost (:class:`~streamrl.errors.RowsLost`) if their
          producer's process dies before they are consumed. For producers that live as long as the queue.

        ``direct_calls`` (default ``True``): clients call the controller over a TCP
        connection to its node's IP address (see :mod:`streamrl.transport.rpc`), which is
        about 30x faster than a Ray actor call. ``False`` sends every call through Ray
        (for clusters whose nodes only reach each other on Ray's own ports)."""
        if ownership not in ("unit", "producer"):
            from ..errors import InvalidArgument

            raise InvalidArgument(f"ownership must be 'unit' or 'producer', got {ownership!r}")
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False,
                     address=os.environ.get("RAY_ADDRESS"))
        config = dict(capacity=capacity, capacity_bytes=capacity_bytes, num_shards=num_shards,
                      lease_timeout=lease_timeout, max_staleness=max_staleness,
                      max_lead=max_lead, consumers=consumers)
        Controller(**config)  # validate here, so errors are raised in the caller
        if isinstance(unit_options, Mapping) or unit_options is None:
            per_unit = [dict(unit_options or {}) for _ in range(num_shards)]
        else:
            per_unit = [dict(o) for o in unit_options]
            if len(per_unit) != num_shards:
                from ..errors import InvalidArgument

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
            units.append(StorageActor.options(**o).remote(i))
        copts = {**common, **(controller_options or {})}
        if name:
            copts.setdefault("name", name)
        controller = ControllerActor.options(**copts).remote(config, units, ownership)
        # either call also surfaces start-up errors here
        endpoints = None
        if direct_calls:
            endpoints = ray.get(controller.endpoints.remote())
        else:
            ray.get(controller.ping.remote())
        return cls(controller, units, owner=True, ownership=ownership, endpoints=endpoints)

    @classmethod
    def connect(cls, name: str, namespace: str | None = None) -> "RayTransport":
        try:
            controller = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise TransportError(
                f"no streamrl queue named {name!r} in this Ray cluster"
                + (f" (namespace {namespace!r})" if namespace else "")
                + "; create it with StreamQueue(transport='ray', name=...) first") from None
        units, ownership, endpoints = ray.get(controller.handles.remote())
        return cls(controller, units, owner=False, ownership=ownership, endpoints=endpoints)

    @property
    def handle(self) -> tuple:
        """What a pickled queue carries: the actor handles, the ownership mode and the
        actors' socket endpoints."""
        return (self._controller, self._units, self._ownership, self._endpoints)

    @classmethod
    def from_handle(cls, handle: tuple) -> "RayTransport":
        controller, units, ownership, endpoints = handle
        return cls(controller, units, owner=False, ownership=ownership, endpoints=endpoints)

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
        """Close this event loop's socket connections; kill the actors, if this process
        created them (handles and connected queues leave them running)."""
        for rpc in [self._control.rpc, *self._data.rpcs]:
            if rpc is not None:
                rpc.close()
        if not self._owner:
            return
        self._owner = False
        for a in [self._controller, *self._units]:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
