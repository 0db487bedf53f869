"""The RDT data plane: the Ray transport's data plane, with tensor fields that stay in the
process that put them.

A put keeps each chosen tensor field in this process's holder (:mod:`.runtime`) and
stores only a reference entry in the storage unit (a :class:`~streamrl.wire.WireTensor`
whose ``ref`` is a :class:`~.runtime.HeldRef`: dtype, shape and "held by"). Everything
else (other fields, Python objects, and every field when this process does not hold)
takes the Ray transport's path.

A read gets the pieces from the storage units as usual, then fetches the held ones
from their holders, **one transfer per holder per read** whatever the number of rows,
fields and storage units: the ranges wanted from one holder are packed into one buffer
at the holder, received as one buffer, and handed out as views of it. Per holder:

* the holder is this process: views of the held tensors (``"local"``);
* this process is in the holder's RDT group: a transfer ordered by the group's
  coordinator, run on both transfer threads (``"rdt"``);
* otherwise (the driver, a task, an actor of no group or of another group): the holder's
  server sends the bytes over its socket (``"socket"``, the fallback path).

The fallback path also serves a group member whenever the group's path cannot: the
group's coordinator is gone (the group was destroyed), the coordinator says the holder
is gone, or the collective transfer failed. Only when the holder's socket fails too is
the holder gone: the read raises :class:`~streamrl.errors.RowsLost` naming the rows and
the holder (``.holder``), after telling the controller, which drops those rows as
``"lost"`` (an ack does not count them as consumed; ``stats().dropped_by["lost"]``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import RowsDropped, RowsLost, TransportError, rows_preview
from ...wire import WireTensor
from ..base import Column
from ..ray.calls import send
from ..ray.data import RayDataPlane
from ..ray.wire import tensors_in, to_wire
from ..rpc import Endpoint, RpcClient
from .runtime import CoordinatorGone, HeldRef, HolderGone, _bypassed, current, layout, runtime

__all__ = ["RdtDataPlane", "RdtPlaneSpec"]

log = logging.getLogger("streamrl")

#: the references a put made in this task (freed if the put fails)
_made: contextvars.ContextVar[list | None] = contextvars.ContextVar("streamrl_rdt_made",
                                                                     default=None)


class RdtPlaneSpec(NamedTuple):
    """Which data plane a queue's clients build (hashable and picklable: it travels with
    the queue's handle, so every process of the queue holds the same fields).

    Attributes:
        fields: the fields that stay with their producer (``None``: every tensor field).
        hold_anywhere: every process holds, not only members of an RDT group (readers
            outside the holder's group use the fallback path).
    """

    fields: tuple[str, ...] | None = None
    hold_anywhere: bool = False

    def __call__(self, units: Sequence[Any], endpoints: Sequence[Endpoint | None] | None = None,
                 on_lost: Callable | None = None) -> RdtDataPlane:
        plane = RdtDataPlane(units, endpoints, on_lost, spec=self)
        # ``on_lost`` is the ``report_lost`` of a control plane (a client's RayControl, or
        # the controller actor itself): rows lost with a holder go to the same one
        plane.on_rows_lost = getattr(getattr(on_lost, "__self__", None), "report_lost_rows",
                                     None)
        return plane


class RdtDataPlane(RayDataPlane):
    """The Ray transport's data plane, with held tensor fields (see the module docstring)."""

    # a small put's wire form registers the tensors it holds with the put's call (_made):
    # each put is its own call
    coalesce_puts = False

    def __init__(self, units: Sequence[Any], endpoints: Sequence[Endpoint | None] | None = None,
                 on_lost: Callable | None = None, *, spec: RdtPlaneSpec = RdtPlaneSpec()):
        super().__init__(units, endpoints, on_lost)
        self.spec = spec
        self._holders: dict[Endpoint, RpcClient] = {}
        #: awaited with ``(rows, holder)`` when a read finds the holder of their tensors
        #: gone (the control plane's ``report_lost_rows``; set by the transport)
        self.on_rows_lost: Callable[[list[int], str], Awaitable[Any]] | None = None

    # -- puts

    def _holds(self) -> bool:
        rt = current()
        return (rt is not None and rt.group is not None) or self.spec.hold_anywhere

    def _chosen(self, name: str) -> bool:
        return self.spec.fields is None or name in self.spec.fields

    def _wire(self, cols: Mapping[str, Column]) -> dict[str, Any]:
        if not self._holds():
            return to_wire(cols)
        import torch

        from ... import codec

        rt = runtime()
        made = _made.get()

        def held(t):
            ref, _ = rt.hold(t)
            if made is not None:
                made.append(ref.key)
            return WireTensor(codec.dtype_name(t.dtype), t.element_size(), tuple(t.shape), None,
                              ref)

        out: dict[str, Any] = {}
        rest = {}
        for name, col in cols.items():
            if not self._chosen(name):
                rest[name] = col
            elif isinstance(col, torch.Tensor):
                out[name] = held(col)
            elif isinstance(col, list) and col and all(isinstance(x, torch.Tensor) for x in col):
                out[name] = [held(x) for x in col]  # ragged: one held tensor per row
            else:
                rest[name] = col
        wired = to_wire(rest)
        return {name: out[name] if name in out else wired[name] for name in cols}

    async def put(self, parts, write: int = 0) -> None:
        by_shard: dict[int, list] = {}
        made: list[int] = []
        token = _made.set(made)
        try:
            for shard, rows, cols in parts:
                by_shard.setdefault(shard, []).append((list(rows), self._wire(cols)))
        except BaseException:
            # a value that cannot be encoded, after tensors of the put were held: nobody
            # refers to those yet
            if made:
                runtime().free(made)
            raise
        finally:
            _made.reset(token)
        try:
            await asyncio.gather(*[self._put(s, p, write) for s, p in by_shard.items()])
        except BaseException:
            # Whether a unit stored this write's tensors is the unit's to say (a cancelled
            # overwrite may have landed): each one is told, after the put on the same
            # channel, to have the holder free those no row of it refers to
            rt = current()
            if rt is not None and rt.endpoint is not None:
                for shard, ps in by_shard.items():
                    keys = [t.ref.key for _, cols in ps for t in tensors_in(cols)
                            if isinstance(t.ref, HeldRef) and t.ref.holder == rt.id]
                    if keys:
                        send(self.rpcs[shard], self.units[shard], "unreserve_held",
                             rt.endpoint, keys)
            raise

    async def put_rows(self, partition, cols, n, nbytes, tags, version, dtypes=None, *,
                       usual=None, shapes=None):
        # (puts are not combined here: ``usual`` is not used, the caller puts the usual way)
        return await self._freeing(lambda: super(RdtDataPlane, self).put_rows(
            partition, cols, n, nbytes, tags, version, dtypes))

    async def write_rows(self, rows, shards, cols, nbytes, tags, dtypes):
        return await self._freeing(lambda: super(RdtDataPlane, self).write_rows(
            rows, shards, cols, nbytes, tags, dtypes))

    @staticmethod
    async def _freeing(call: Callable[[], Awaitable[Any]]) -> Any:
        """``await call()``, a small put or write a unit admits: the tensors its wire form
        held are freed if it raised or was not stored (``None``: the caller puts or
        writes the usual way, which holds them again)."""
        made: list[int] = []
        token = _made.set(made)
        try:
            res = await call()
        except BaseException:
            if made:
                runtime().free(made)
            raise
        finally:
            _made.reset(token)
        if res is None and made:
            runtime().free(made)
        return res

    # -- reads

    async def get(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                  ) -> list[dict[str, list[Column]]]:
        self._loop = asyncio.get_running_loop()
        self._flush_unpins()
        raws = await asyncio.gather(*[self._read_raw(s, list(rows), list(fields))
                                      for s, rows, fields in parts])
        # every held range of the read, per holder (one transfer each)
        wanted: dict[str, list] = {}  # holder -> [(ref, offset, nbytes, rows)]
        for (_s, rows, _f), (pieces, _) in zip(parts, raws):
            _collect(pieces, list(rows), wanted)
        fetched: dict[tuple[int, int, int, str], Any] = {}
        if wanted:
            got = await asyncio.gather(*[self._fetch(items) for items in wanted.values()])
            for items, bufs in zip(wanted.values(), got):
                for (ref, off, n, _rows), b in zip(items, bufs):
                    fetched[(ref.key, off, n, ref.holder)] = b
        return [_from_wire(pieces, arrays, fetched) for pieces, arrays in raws]

    async def _fetch(self, items: list) -> list[Any]:
        """The bytes of ``items`` (ranges of one holder): flat uint8 tensors (or numpy
        arrays, from the socket)."""
        ref0: HeldRef = items[0][0]
        ranges, where = coalesce([(ref.key, off, n) for ref, off, n, _ in items])
        bufs = await self._fetch_ranges(ref0, ranges, items)
        return [bufs[m][at:at + n] for (m, at), (_, _, n, _) in zip(where, items)]

    async def _fetch_ranges(self, ref0: HeldRef, ranges: list, items: list) -> list[Any]:
        """The bytes of ``ranges`` (disjoint) of holder ``ref0.holder``, one buffer each,
        by the first path that serves them (see the module docstring).

        Raises:
            RowsDropped: the holder no longer has some of the tensors (their rows were
                dropped meanwhile).
            RowsLost: the holder is gone (reported to the controller first).
        """
        rows = sorted({r for *_, rs in items for r in rs})
        rt = current()
        try:
            if rt is not None and ref0.holder == rt.id:
                views = rt.views(ranges)
                if views is None:
                    raise KeyError("gone")
                self.count_moved({"local": sum(n for _, _, n in ranges)})
                return views
            group = rt.group if rt is not None and rt.coordinator_gone is None else None
            backend = group.backend if group is not None and ref0.group == group.name else None
            if rt is not None and backend in ("gloo", "nccl") and ref0.rank >= 0:
                try:
                    bufs = await rt.pull(ref0.rank, ranges, self._bypass_client(ref0))
                except (KeyError, TransportError):
                    raise
                except (CoordinatorGone, HolderGone) as e:
                    log.debug("streamrl: RDT read from %s takes the fallback path (%s)",
                              ref0.holder, e)
                except Exception as e:  # noqa: BLE001 - a failed collective transfer
                    log.warning("streamrl: an RDT transfer from %s failed (%s: %s); reading "
                                "over its socket instead", ref0.holder, type(e).__name__, e)
                else:
                    self.count_moved({"rdt": sum(n for _, _, n in ranges)})
                    return bufs
            elif backend == "nixl":
                try:
                    bufs = await _nixl_pull(rt, ref0, ranges)
                except KeyError:
                    raise
                except Exception as e:  # noqa: BLE001 - the one-sided read failed
                    log.warning("streamrl: an RDT (nixl) read from %s failed (%s: %s); reading "
                                "over its socket instead", ref0.holder, type(e).__name__, e)
                else:
                    self.count_moved({"rdt": sum(n for _, _, n in ranges)})
                    return bufs
            return await self._fetch_socket(ref0, ranges)
        except KeyError:
            gone = await self._gone(ref0, items) if len({i[0].key for i in items}) > 1 else rows
            raise RowsDropped(
                f"rows {rows_preview(gone)} were dropped while they were read (their "
                f"holder {ref0.holder} no longer has their tensors)", gone) from None
        except ConnectionError as e:  # the holder's socket: the holder is gone
            await self._rows_lost(rows, ref0.holder)
            raise RowsLost(
                f"the process holding tensor fields of rows {rows_preview(rows)} "
                f"({ref0.holder}) is gone ({e}); their held fields are lost, and the queue "
                "dropped these rows (stats().dropped_by['lost']). Move on without them",
                rows, holder=ref0.holder) from None

    async def _gone(self, ref0: HeldRef, items: list) -> list[int]:
        """The rows of ``items`` (ranges of one holder, of several held tensors) whose
        tensors the holder no longer has, read tensor by tensor: a read that missed one
        of them must not report the rows of the others as dropped (a consumer skips
        the rows a RowsDropped names, and its ack would then consume rows it never
        read). A holder frees a tensor once no row refers to it, so the rows of a
        missing tensor are the rows that left. All of them if none is missing now."""
        by_key: dict[int, list] = {}
        for item in items:
            by_key.setdefault(item[0].key, []).append(item)
        gone: set[int] = set()
        for its in by_key.values():
            ranges, _ = coalesce([(ref.key, off, n) for ref, off, n, _ in its])
            try:
                await self._fetch_ranges(ref0, ranges, its)
            except RowsDropped:
                gone.update(r for *_, rs in its for r in rs)
        return sorted(gone) or sorted({r for *_, rs in items for r in rs})

    async def _rows_lost(self, rows: list[int], holder: str) -> None:
        """Tell the controller (``on_rows_lost``) that ``rows`` are lost with ``holder``
        (a failure to tell is logged: the caller hears of the loss regardless)."""
        if self.on_rows_lost is None:
            return
        try:
            await self.on_rows_lost(rows, holder)
        except Exception as e:  # noqa: BLE001
            log.warning("streamrl: could not report rows lost with holder %s (%r)", holder, e)

    def _bypass_client(self, ref0: HeldRef) -> RpcClient | None:
        return self._client(ref0) if _bypassed() else None

    def _client(self, ref0: HeldRef) -> RpcClient:
        client = self._holders.get(ref0.endpoint)
        if client is None:
            client = self._holders[ref0.endpoint] = RpcClient(ref0.endpoint)
        return client

    async def _fetch_socket(self, ref0: HeldRef, ranges: list) -> list[Any]:
        """The fallback path: the holder's server sends the bytes over its socket."""
        arrays = await self._client(ref0).call("read", ranges)
        if arrays is None:
            raise KeyError("gone")
        self.count_moved({"socket": sum(a.nbytes for a in arrays)})
        return arrays  # numpy views of the bytes received


def coalesce(ranges: Sequence[tuple[int, int, int]]
             ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Merge ``(key, offset, nbytes)`` ranges that touch or overlap (the rows of one put
    read through two storage units are two ranges of one held tensor: one range, so a
    large tensor moves without being packed). Returns the merged ranges and, for each
    input range, ``(index of its merged range, its offset inside it)``."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], ranges[i][1]))
    merged: list[tuple[int, int, int]] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(ranges)
    for i in order:
        key, off, n = ranges[i]
        if merged and merged[-1][0] == key and off <= merged[-1][1] + merged[-1][2]:
            k, o, m = merged[-1]
            merged[-1] = (k, o, max(m, off + n - o))
        else:
            merged.append((key, off, n))
        where[i] = (len(merged) - 1, off - merged[-1][1])
    return merged, where


def _collect(pieces: dict[str, list], rows: list[int], wanted: dict[str, list]) -> None:
    """Add the held ranges of a read's pieces (and the rows each covers) to ``wanted``."""
    for plist in pieces.values():
        at = 0
        for p in plist:
            if isinstance(p, WireTensor):
                n = p.shape[0] if p.shape else 1
                if isinstance(p.ref, HeldRef):
                    wanted.setdefault(p.ref.holder, []).append(
                        (p.ref, p.offset, p.nbytes, rows[at:at + n]))
                at += n
            else:  # a list piece: one entry per row
                for x in p:
                    if isinstance(x, WireTensor) and isinstance(x.ref, HeldRef):
                        wanted.setdefault(x.ref.holder, []).append(
                            (x.ref, x.offset, x.nbytes, rows[at:at + 1]))
                    at += 1


def _from_wire(pieces: Mapping[str, list], arrays: dict, fetched: dict) -> dict[str, list[Column]]:
    """:func:`..ray.wire.from_wire`, with held entries taken from ``fetched``."""
    from ... import codec
    from ..ray.wire import from_wire

    if not fetched:
        return from_wire(pieces, arrays)

    def tensor(t: WireTensor, shape):
        buf = fetched[(t.ref.key, t.offset, t.nbytes, t.ref.holder)]
        if isinstance(buf, np.ndarray):
            return codec.tensor_from_raw(t.dtype, shape, buf)
        dt = codec.torch_dtype(t.dtype)
        if not buf.numel():
            return buf.new_empty(tuple(shape), dtype=dt)
        try:  # a view of the received buffer (same storage: adjacent pieces join for free)
            return buf.view(dt).view(tuple(shape))
        except RuntimeError:  # misaligned for the dtype
            if buf.device.type != "cpu":
                raise
            return codec.tensor_from_raw(t.dtype, shape, buf.numpy())

    def held(x):
        return isinstance(x, WireTensor) and isinstance(x.ref, HeldRef)

    out: dict[str, list[Column]] = {}
    for f, plist in pieces.items():
        col = []
        for p in plist:
            if held(p):
                col.append(tensor(p, p.shape))
            elif isinstance(p, list) and any(held(x) for x in p):
                col.append([tensor(x, x.shape[1:]) if held(x) else from_wire({f: [[x]]}, arrays)[f][0][0]
                            for x in p])
            else:
                col.extend(from_wire({f: [p]}, arrays)[f])
        out[f] = col
    return out


async def _nixl_pull(rt: Any, ref0: HeldRef, ranges: list) -> list[Any]:
    """The nixl path (one-sided, no ordering needed): the holder puts the ranges as one
    RDT object (``ray.put(..., _tensor_transport="nixl")``), and this process's transfer
    thread reads it with ``ray.get``. Not run on this project's CPU-only machines."""
    import ray

    actor = await rt.member_actor(ref0.rank)
    outer = actor.__ray_call__.options(concurrency_group="_ray_system").remote(
        _nixl_export, ranges)

    def read():
        inner = ray.get(outer)[0]
        t = ray.get(inner)
        return t

    buf = await asyncio.wrap_future(rt.thread.call(read))
    offs, _ = layout([n for _, _, n in ranges])
    return [buf[o:o + n] for o, (_, _, n) in zip(offs, ranges)]




def _nixl_export(_self: Any, ranges: list) -> list:
    """In the holder (``__ray_call__``): the ranges packed as one nixl RDT object."""
    import ray
    import torch

    from .runtime import runtime as _rt

    views = _rt().views(ranges)
    if views is None:
        raise KeyError("gone")
    offs, total = layout([v.numel() for v in views])
    if len(views) == 1:
        buf = views[0]
    else:
        buf = torch.empty(total, dtype=torch.uint8, device=views[0].device)
        for v, o in zip(views, offs):
            buf[o:o + v.numel()].copy_(v)
    return [ray.put(buf, _tensor_transport="nixl")]
