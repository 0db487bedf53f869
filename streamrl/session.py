"""The client session: what batch views need from the queue they came from.

A :class:`Session` is the small object every :class:`~streamrl.RowRemoteBatch` talks to
(one per queue handle): fetch columns, acknowledge, release or drop leases, write fields.
Views never reach into the queue, its transport or the storage units themselves.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._aio import shielded
from .columns import Column, assemble
from .stats import Histogram
from .transport.base import _moving, note_moved

if TYPE_CHECKING:
    from .batch import RowRemoteBatch
    from .config import Request
    from .control import ControlPlane
    from .messages import Delivery
    from .queue import StreamQueue
    from .transport.base import DataPlane, Transport

__all__ = ["Session", "note_moved"]

class Session:
    """The calls batch views make, on behalf of one queue handle.

    Args:
        queue: the queue (kept for :attr:`queue` and for writes).
        transport: its deployment.
    """

    def __init__(self, queue: "StreamQueue", transport: "Transport"):
        self.queue = queue
        self._transport = transport
        #: what this process read through the queue, per task (``"-"``: batches not
        #: from a task) and path: ``{(task, path): [rows, bytes, Histogram of seconds
        #: per read]}``. The bytes are split by the path that moved them; each read's
        #: rows and seconds count under the path that moved most of its bytes. Paths:
        #: those of ``stats().bytes_by_path``, and ``"local"`` for a read that moved
        #: nothing between processes (the embedded transport: its tensor bytes).
        self.reads: dict[tuple[str, str], list] = {}
        #: called after each read with ``(task, path, rows, {path: bytes}, seconds)``
        #: (Ray metrics)
        self.on_read: Any = None

    @property
    def transport(self) -> "Transport":
        """The queue's deployment (what :attr:`control` and :attr:`data` come from)."""
        return self._transport

    @property
    def control(self) -> "ControlPlane":
        return self._transport.control

    @property
    def data(self) -> "DataPlane":
        return self._transport.data

    @property
    def queue_id(self) -> str:
        """The queue's identity (equal in every handle of it)."""
        return self._transport.queue_id

    @property
    def owned_reads(self) -> bool:
        """Whether ``fetch(..., owned=True)`` costs no copy (``DataCaps.owned_reads``)."""
        return self._transport.data.caps.owned_reads

    async def fetch(self, rows: np.ndarray, shards: np.ndarray, fields: list[str], *,
                    task: str | None = None, owned: bool = False) -> dict[str, Column]:
        """Read ``fields`` of ``rows`` from their storage units: one request per unit, all
        units concurrently; columns come back in ``rows`` order (views where the rows
        are one run of one unit's piece, one copy otherwise). With ``owned``, columns the
        caller owns (:meth:`streamrl.transport.DataPlane.get_owned`). Counted in
        :attr:`reads` under ``task`` and the paths the bytes took."""
        t0 = time.perf_counter()
        moved: dict[str, int] = {}
        token = _moving.set(moved)
        try:
            out = await self._fetch(rows, shards, fields, owned)
        finally:
            _moving.reset(token)
        dt = time.perf_counter() - t0
        by_path = {p: n for p, n in moved.items() if n}
        if not by_path:  # nothing crossed a process boundary: the tensors read here
            by_path = {"local": sum(_tensor_bytes(c) for c in out.values())}
        path = max(by_path, key=lambda p: by_path[p])
        name = task or "-"
        for p, n in by_path.items():
            entry = self.reads.get((name, p))
            if entry is None:
                entry = self.reads[(name, p)] = [0, 0, Histogram()]
            entry[1] += n
            if p == path:
                entry[0] += len(rows)
                entry[2].observe(dt)
        if self.on_read is not None:
            self.on_read(name, path, len(rows), by_path, dt)
        return out

    async def _fetch(self, rows: np.ndarray, shards: np.ndarray, fields: list[str],
                     owned: bool = False) -> dict[str, Column]:
        if len(shards) and bool((shards == shards[0]).all()):  # one unit (a run of one put)
            parts = [(int(shards[0]), rows.tolist(), fields)]
            got = await (self.data.get_owned(parts) if owned else self.data.get(parts))
            return {f: assemble(got[0][f]) for f in fields}
        order = np.argsort(shards, kind="stable")
        s_sorted = shards[order]
        bounds = np.flatnonzero(np.diff(s_sorted)) + 1
        groups = np.split(order, bounds)
        parts = [(int(shards[g[0]]), rows[g].tolist(), fields) for g in groups if len(g)]
        got = await (self.data.get_owned(parts) if owned else self.data.get(parts))
        if len(groups) == 1:
            return {f: assemble(got[0][f]) for f in fields}
        out: dict[str, Column] = {}
        contiguous = all(np.array_equal(g, np.arange(g[0], g[0] + len(g))) for g in groups)
        for f in fields:
            if contiguous:  # each unit holds one run of the batch: join in batch order
                seq = sorted(zip((int(g[0]) for g in groups), got), key=lambda x: x[0])
                out[f] = assemble([p for _, res in seq for p in res[f]])
                continue
            cols = [assemble(res[f]) for res in got]
            out[f] = _scatter(cols, groups, len(rows))
        return out

    async def write(self, batch: "RowRemoteBatch", data: Mapping[str, Any], *,
                    overwrite: bool = False) -> None:
        """Write fields to the batch's rows (``StreamQueue.put(data, rows=batch)``)."""
        await self.queue.put(data, rows=batch, overwrite=overwrite)

    async def ack(self, lease_ids: Sequence[int]) -> None:
        """Acknowledge leases."""
        await self.control.ack(list(lease_ids))

    def ack_now(self, lease_ids: Sequence[int]) -> Awaitable[None] | None:
        """Acknowledge leases without a coroutine where the control plane can (in this
        process, nothing to wait for): ``None`` once done; otherwise an awaitable that
        does the rest (await it shielded)."""
        now = getattr(self.control, "ack_now", None)
        if now is None:
            return self.control.ack(list(lease_ids))
        return now(list(lease_ids))

    @property
    def acks_in_place(self) -> bool:
        """Whether an ack costs no message (the control plane is in this process, see
        :meth:`ack_now`); a stream then acks its batch before it asks for the next, and
        otherwise does both in one call (:meth:`ack_take`)."""
        return getattr(self.control, "ack_now", None) is not None

    async def ack_take(self, lease_ids: Sequence[int], req: Request,
                       timeout: float | None) -> tuple[Delivery | None, str | None]:
        """Acknowledge leases and lease the next batch in one control call
        (:meth:`ControlPlane.ack_take`). Should the call fail or be cancelled, the ack
        is made again on its own (shielded; a second ack of a lease is a no-op), so a
        call that never reached the controller leaves no lease behind; then the error
        goes on."""
        ids = list(lease_ids)
        try:
            return await self.control.ack_take(ids, req, timeout)
        except BaseException:
            try:
                await shielded(self.control.ack(ids))
            except Exception:  # noqa: BLE001 - (expired meanwhile, or the queue is gone:
                pass  # the error that got here says more)
            raise

    async def release(self, lease_ids: Sequence[int]) -> None:
        """Give leases back unacknowledged."""
        await self.control.release(list(lease_ids))

    async def drop(self, rows: Sequence[int]) -> int:
        """Drop rows for good; first tell the units which read views are gone (they may
        reuse that memory), since the batch let go of its cache of these rows."""
        self.data.released()
        return await self.control.drop(list(rows))

    async def lease_rows(self, lease_ids: Sequence[int]) -> list[int]:
        """Rows still held under these leases."""
        return await self.control.lease_rows(list(lease_ids))

    def release_nowait(self, lease_ids: Sequence[int]) -> None:
        """Give leases back without awaiting (from finalizers); best effort."""
        self._transport.release_nowait(list(lease_ids))


def _tensor_bytes(col: Column) -> int:
    if isinstance(col, torch.Tensor):
        return (col.values() if col.is_nested else col).nbytes
    return sum(x.nbytes for x in col if isinstance(x, torch.Tensor))


def _scatter(cols: list[Column], groups: list[np.ndarray], n: int) -> Column:
    """Place per-unit columns at their batch positions (one copy: the units' pieces are
    joined, then gathered into batch order; an index-put per unit costs 10-100x more on
    CPU for rows of more than one element)."""
    if all(isinstance(c, torch.Tensor) and not c.is_nested for c in cols) and \
            len({(c.dtype, c.shape[1:]) for c in cols}) == 1:
        order = np.concatenate(groups)  # batch position of each joined row
        inv = np.empty(n, dtype=np.int64)
        inv[order] = np.arange(len(order))
        return torch.cat(cols).index_select(0, torch.from_numpy(inv))
    flat: list = [None] * n
    for c, g in zip(cols, groups):
        items = c.unbind(0) if isinstance(c, torch.Tensor) else c
        for i, v in zip(g.tolist(), items):
            flat[i] = v
    return assemble([flat])
