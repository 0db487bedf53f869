"""The data-plane client of the Ray transport: the storage-unit actors, seen as a
:class:`~streamrl.transport.base.DataPlane`.

One call per storage unit per request, all units concurrently, over each unit's socket
channel when there is one (else as Ray actor calls). Tensor bytes go through a unit's
shared-memory arena when this process is on the unit's node and may map it (a put copies
once into a reserved block; a read views the blocks in place, pinned until its tensors
are gone); otherwise they travel inline in the calls. Conversion to and from torch is
:mod:`.wire`'s.

A storage unit found dead is reported to the controller through the control plane
(``on_lost``, :meth:`streamrl.control.ControlPlane.report_lost`), and the read or write
raises :class:`~streamrl.errors.RowsLost` naming the rows and the unit.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import functools
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import ray

from ...arena import ShmRef, map_private, map_segment
from ...errors import RowsLost, rows_preview
from ...wire import WireTensor
from ..base import Column, DataCaps, DataPlane, note_moved
from ..rpc import Endpoint, RpcClient
from .admit import FAST_MAX, PlaneAdmission
from .calls import send, unwrap
from .checkpoint import PlaneCheckpoint
from .wire import SHM_MIN, bytes_by_path, from_wire, map_col, refs_in, tensors_in, to_wire

__all__ = ["RayDataPlane", "DataPlaneFactory", "FAST_MAX"]  # (FAST_MAX: .admit's)

log = logging.getLogger("streamrl")

#: set while a read is for get_owned: arena blocks are mapped copy-on-write
_OWNED: contextvars.ContextVar[bool] = contextvars.ContextVar("streamrl_owned", default=False)


#: seconds between two reports of bytes moved (``stats().bytes_by_path``) by a process
REPORT_EVERY = 0.05


class DataPlaneFactory(Protocol):
    """What makes a queue's data-plane client: :class:`RayDataPlane` or a subclass, or a
    hashable, picklable factory that returns one (such as
    :class:`~streamrl.transport.rdt.RdtPlaneSpec`). It travels with the queue's handle."""

    def __call__(self, units: Sequence[Any], endpoints: Sequence[Endpoint | None] | None = None,
                 on_lost: Callable[[int], Awaitable[Any]] | None = None) -> RayDataPlane: ...


class RayDataPlane(PlaneAdmission, PlaneCheckpoint, DataPlane):
    """Storage-unit actors, called concurrently, one call per unit per request; tensor
    bytes through the units' shared-memory arenas when on the same node. Small puts
    admitted by a unit are :class:`.admit.PlaneAdmission`'s, checkpoints
    :class:`.checkpoint.PlaneCheckpoint`'s."""

    caps = DataCaps(unit_admitted_puts=True, zero_copy_reads=True, shared_memory=True,
                    cross_process=True, owned_reads=True)

    def __init__(self, units: Sequence[Any], endpoints: Sequence[Endpoint | None] | None = None,
                 on_lost: Callable[[int], Awaitable[Any]] | None = None):
        self.units = list(units)
        self.num_shards = len(self.units)
        self.rpcs: list[RpcClient | None] = [None] * self.num_shards
        # per unit: its pid when this process maps its arena, False when it does not
        self._local: list[int | bool | None] = [None] * self.num_shards
        self._maps: dict[tuple[int, int], Any] = {}  # (unit, segment) -> mmap
        #: awaited with the index of a unit found dead (the control plane's ``report_lost``)
        self.on_lost = on_lost
        self._unpins: collections.deque = collections.deque()  # (unit, pin) of dead views
        self._loop: asyncio.AbstractEventLoop | None = None
        # small puts: round robin from a random unit, so that processes that put a few
        # rows each do not all start on unit 0
        self._init_admission(random.randrange(max(self.num_shards, 1)))
        #: bytes this process moved, per path (``"shm"``, ``"inline"``; subclasses add theirs)
        self.moved: collections.Counter = collections.Counter()
        self._unreported: collections.Counter = collections.Counter()
        # the two counters are shared by every thread of the process that uses this
        # plane (a sync twin's loop thread, an RDT reader...): updated under this lock
        self._moved_lock = threading.Lock()
        #: called with ``{path: bytes}`` moved since the last call (the transport sends it
        #: to the controller, which sums it into ``stats().bytes_by_path``); returns whether
        #: it was taken (else it is offered again with the next move)
        self.report_moved: Callable[[dict[str, int]], bool] | None = None
        self._next_report = 0.0  # (time.monotonic) when the next report may go
        self._report_timer: asyncio.TimerHandle | None = None
        self._report_loop: asyncio.AbstractEventLoop | None = None
        if endpoints is not None:
            self.use_endpoints(endpoints)
        if type(self).get is not RayDataPlane.get:  # a data path that reads its own way:
            # its get_owned copies, unless it declares owned reads itself
            self.caps = dataclasses.replace(self.caps, owned_reads=False)

    def use_endpoints(self, endpoints: Sequence[Endpoint | None]) -> None:
        """Call the units over their socket channels (see :mod:`streamrl.transport.rpc`) from now on."""
        self.rpcs = [RpcClient(e, on_broken=functools.partial(self._unmap, shard)) if e is not None
                     else None for shard, e in enumerate(endpoints)]

    def _unmap(self, shard: int) -> None:
        """Forget unit ``shard``'s arena (its connection broke: the unit may be gone).
        Tensors already read keep their own mappings; the next call maps it again."""
        self._local[shard] = None
        for key in [k for k in self._maps if k[0] == shard]:
            del self._maps[key]

    async def _call(self, shard: int, method: str, *args, rows: Sequence[int] = ()):
        """``method(*args)`` on unit ``shard``: over its socket channel (or, if that
        fails, as a Ray call). A dead unit: ``on_lost`` is awaited, then
        :class:`RowsLost` naming ``rows`` is raised."""
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
            await self._lost(shard)
            raise RowsLost(
                f"storage unit {shard} is gone ({type(e).__name__}); rows "
                f"{rows_preview(rows)} it held are lost. The rest of the queue keeps working; "
                "drop these rows (or clear their partition) and move on", rows, shard) from None
        except ray.exceptions.RayTaskError as e:
            raise unwrap(e, "storage unit") from None

    async def _lost(self, shard: int) -> None:
        """Tell ``on_lost`` that unit ``shard`` is gone (a failure to tell is logged: the
        controller finds out itself the next time it calls the unit)."""
        if self.on_lost is None:
            return
        try:
            await self.on_lost(shard)
        except Exception as e:  # noqa: BLE001 - the caller hears of the loss regardless
            log.warning("streamrl: could not report the loss of storage unit %d (%r)", shard, e)

    # -- bytes by path

    def count_moved(self, by_path: Mapping[str, int]) -> None:
        """Record bytes moved per path, and report them (without waiting); a read in
        progress in this task counts them too (``materialize`` per path)."""
        note_moved(by_path)
        with self._moved_lock:
            for path, n in by_path.items():
                if n:
                    self.moved[path] += n
                    self._unreported[path] += n
            pending = bool(self._unreported)
        if pending and self.report_moved is not None:
            self._report_soon()

    def _report_soon(self) -> None:
        """Report the bytes not reported yet: now when the last report is
        :data:`REPORT_EVERY` seconds old (or there is no event loop here), else once that
        long has passed (a timer of this thread's event loop). Sent with every put and
        read, reports were 54 of the 141 messages per 1,000 rows the controller served
        under concurrent small puts (docs/benchmarks.md), each a round trip."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.report_now()
            return
        timer = self._report_timer
        if timer is not None:
            done = self._report_loop is None or self._report_loop.is_closed()
            if not timer.cancelled() and not done:
                return  # (one is due)
            self._report_timer = None  # (its event loop ended before it was due)
        now = time.monotonic()
        if now >= self._next_report:
            self.report_now()
            self._next_report = now + REPORT_EVERY
        else:
            self._report_timer = loop.call_later(self._next_report - now, self._report_due)
            self._report_loop = loop

    def _report_due(self) -> None:
        self._report_timer = None
        self.report_now()
        self._next_report = time.monotonic() + REPORT_EVERY

    def report_now(self) -> None:
        """Report the bytes moved and not reported yet (without waiting)."""
        if not self._unreported or self.report_moved is None:
            return
        with self._moved_lock:  # (taken out whole: a move counted meanwhile waits)
            held = dict(self._unreported)
            self._unreported.clear()
        try:
            taken = self.report_moved(held)
        except Exception:  # noqa: BLE001 - statistics never fail a put or a read
            taken = False
        if not taken:  # offered again with the next move or report
            with self._moved_lock:
                self._unreported.update(held)

    def _wire(self, cols: Mapping[str, Column]) -> dict[str, Any]:
        """A put's columns in wire form (:func:`.wire.to_wire`); a data path that keeps
        some tensors elsewhere replaces them by references here."""
        return to_wire(cols)

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
            by_shard.setdefault(shard, []).append((list(rows), self._wire(cols)))
        await asyncio.gather(*[self._put(s, p, write) for s, p in by_shard.items()])

    async def _put(self, shard: int, parts: list, write: int = 0) -> None:
        """Store wire-form ``parts`` on unit ``shard``: big tensors through its arena when
        this process maps it, everything else inline in the call."""
        rows = [r for rs, _ in parts for r in rs]
        big = [t for _, cols in parts for t in tensors_in(cols)
               if t.nbytes >= SHM_MIN and t.ref is None]  # (a reference stays one)
        pid = await self._pid(shard, rows) if big else None
        got = None
        if pid is not None:  # None back: no shared memory left on the unit's node
            got = await self._reserve(shard, [t.nbytes for t in big], rows)
        if got is None:
            await self._call(shard, "put", parts, write, rows=rows)
            self.count_moved(_sum_paths(cols for _, cols in parts))
            return
        assert pid is not None  # (blocks are reserved only for a process that maps them)
        refs, where = got
        by_id: dict[int, WireTensor] = {}  # id of a big tensor -> its block reference
        try:
            try:
                maps = {ref.seg: self._segment(shard, pid, ref.seg, where) for ref in refs}
            except OSError as e:  # this process may not map the unit's memory
                self._no_shm(shard, e)
            else:
                for t, ref in zip(big, refs):
                    assert t.buf is not None  # (to_wire's tensors are inline)
                    dst = np.frombuffer(maps[ref.seg], dtype=np.uint8, count=t.nbytes,
                                        offset=ref.off)
                    np.copyto(dst, t.buf)  # the one copy of a put
                    by_id[id(t)] = t.by_reference(ref)
                parts = [(rs, {f: map_col(c, lambda t: by_id.get(id(t), t))
                               for f, c in cols.items()}) for rs, cols in parts]
            await self._call(shard, "put", parts, write, rows=rows)
        except BaseException:
            self._unreserve(shard, refs)
            raise
        self.count_moved(_sum_paths(cols for _, cols in parts))
        if not by_id:  # sent inline: the reserved blocks are not used
            self._unreserve(shard, refs)

    async def _reserve(self, shard: int, sizes: list[int], rows: list[int]) -> Any:
        """Reserve blocks of ``sizes`` bytes in unit ``shard``'s arena: ``(refs, where)``,
        or ``None`` when its node has no shared memory left. Cancelled while the call is
        on its way, the blocks the unit reserves are given back when its answer comes
        (nothing else would: this process lives on, so they would stay reserved)."""
        task = asyncio.ensure_future(self._call(shard, "reserve", sizes, os.getpid(),
                                                rows=rows))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def give_back(t: asyncio.Future) -> None:
                if not t.cancelled() and t.exception() is None and t.result() is not None:
                    self._unreserve(shard, t.result()[0])

            task.add_done_callback(give_back)
            raise

    def _unreserve(self, shard: int, refs: list[ShmRef]) -> None:
        send(self.rpcs[shard], self.units[shard], "unreserve", refs)

    def _no_shm(self, shard: int, e: OSError) -> None:
        """This process cannot map unit ``shard``'s arena: use inline bytes from now on."""
        log.warning("streamrl: cannot map the shared memory of storage unit %d (%s); its "
                    "bytes travel inline in the calls from now on (slower)", shard, e)
        self._local[shard] = False

    async def get(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                  ) -> list[dict[str, list[Column]]]:
        self._loop = asyncio.get_running_loop()
        self._flush_unpins()
        return list(await asyncio.gather(*[self._read(s, list(rows), list(fields))
                                           for s, rows, fields in parts]))

    async def get_owned(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                        ) -> list[dict[str, list[Column]]]:
        """As :meth:`get`, with data the caller owns, without copying the big tensors:
        arena blocks are mapped copy-on-write for this read (a write into them makes a
        private page; the blocks stay pinned, so the unit never changes them meanwhile);
        inline bytes (small tensors, other nodes) are copied."""
        if not self.caps.owned_reads:
            return await super().get_owned(parts)
        token = _OWNED.set(True)
        try:
            return await self.get(parts)
        finally:
            _OWNED.reset(token)

    async def _read(self, shard: int, rows: list[int], fields: list[str]) -> dict[str, list[Column]]:
        pieces, arrays = await self._read_raw(shard, rows, fields)
        out = from_wire(pieces, arrays)
        if _OWNED.get():
            _own_inline(out, pieces, arrays)
        return out

    async def _read_raw(self, shard: int, rows: list[int], fields: list[str]
                        ) -> tuple[dict[str, list], dict]:
        """Read ``fields`` of ``rows`` from unit ``shard`` in wire form: the pieces, and
        the local views of the arena blocks they refer to (see :func:`.wire.from_wire`)."""
        pid = await self._pid(shard, rows)
        pieces, pin, where = await self._call(shard, "read", rows, fields,
                                              os.getpid() if pid else None, rows=rows)
        arrays: dict = {}
        if pin is not None:
            # one fresh array per segment for this read: the views handed out keep it
            # alive, and when the last goes, the unit hears that the blocks are free
            assert pid is not None  # (a pin comes only with a pid asked for)
            bases: dict[int, np.ndarray] = {}
            try:
                private = _OWNED.get()
                for ref in refs_in(pieces):
                    base = bases.get(ref.seg)
                    if base is None:
                        mm = (map_private(f"/proc/{pid}/fd/{where[ref.seg][0]}",
                                          where[ref.seg][1]) if private
                              else self._segment(shard, pid, ref.seg, where))
                        base = bases[ref.seg] = np.frombuffer(mm, dtype=np.uint8)
                    arrays[ref] = base[ref.off:ref.off + ref.size]
            except OSError as e:  # this process may not map the unit's memory
                self._no_shm(shard, e)
                self._unpin_later(shard, pin)
                return await self._read_raw(shard, rows, fields)
            left = [len(bases)]

            def gone(shard=shard, pin=pin, left=left):
                left[0] -= 1
                if not left[0]:
                    self._unpin_later(shard, pin)

            for base in bases.values():
                weakref.finalize(base, gone)
        self.count_moved(bytes_by_path(pieces))
        return pieces, arrays

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

    async def unit_usage(self) -> list[dict[str, int]]:
        """Each unit's backend usage (``{}`` for a unit that does not answer)."""
        res = await asyncio.gather(*[self._call(s, "usage") for s in range(self.num_shards)],
                                   return_exceptions=True)
        return [{} if isinstance(r, BaseException) else r for r in res]

    async def arena_stats(self) -> list[dict[str, int]]:
        """Each unit's arena (see :meth:`.unit.StorageActorImpl.arena_stats`); ``{}`` for
        a unit that does not answer."""
        res = await asyncio.gather(*[self._call(s, "arena_stats") for s in range(self.num_shards)],
                                   return_exceptions=True)
        return [{} if isinstance(r, BaseException) else r for r in res]


def _sum_paths(cols_list) -> dict[str, int]:
    """:func:`.wire.bytes_by_path` of several wire-form column sets, summed."""
    out: collections.Counter = collections.Counter()
    for cols in cols_list:
        out.update(bytes_by_path(cols))
    return dict(out)


def _own_inline(out: dict[str, list[Column]], pieces: Mapping[str, list], arrays: dict) -> None:
    """Copy, in ``out`` (:func:`.wire.from_wire` of ``pieces``), the tensors whose bytes
    are not in ``arrays`` (the copy-on-write views of this read): inline bytes may be
    read-only memory (a Ray object) or shared with others."""
    def own(t: Any, p: Any) -> Any:
        if isinstance(p, WireTensor) and not (p.ref is not None and p.ref in arrays):
            return t.clone()
        return t

    for f, plist in pieces.items():
        cols = out[f]
        for i, p in enumerate(plist):
            if isinstance(p, WireTensor):
                cols[i] = own(cols[i], p)
            else:  # a list of per-row values: tensors among them are inline
                cols[i] = [own(t, x) for t, x in zip(cols[i], p)]
