"""Write-combining of small puts: one-row puts of one process, admitted as one batch.

:class:`CombiningService` is the controller service of the embedded transport. A one-row
put of new rows that could be admitted now (room, no one waiting for room or pacing, an
open partition, the fields' dtypes, one scalar in each field that is a group
key) is not admitted on its own: it is *staged*. Its row id and storage unit are fixed
at once (ids leased from the controller ahead, as a storage unit leases ids for the puts
it admits itself), so the put returns its :class:`~streamrl.RowRemoteBatch` at once, and
the rows staged are admitted, stored and committed together -- one controller allocate
and commit, one storage put of one block per field, one readiness update -- when the
stage is *flushed*:

* when it is full (:attr:`CombiningService.max_rows` rows or
  :attr:`~CombiningService.max_bytes` bytes) and the next one-row put arrives;
* when any other call reaches the queue: every control-plane call of this service
  (take, ack, drop, clear, seal, stats, begin_write for ``write``, checkpoint, close...)
  and every read of the storage units flushes first, so each ``put`` that returned is
  seen by every later call, exactly as if it had been admitted on its own;
* when a put arrives that the stage cannot take (another partition, other fields or
  dtypes, another version, no room): it is flushed, then that put goes the usual way;
* at the end of the event-loop iteration in which it came to hold rows enough for a
  consumer waiting (``loop.call_soon``): its deliverable rows and the stage's reach the
  batch it waits for, or one row for a grouped request, since one row may complete a
  group (:meth:`Controller.rows_to_wake`), so that consumer sees the rows within one
  iteration of the put that completed its batch, however the producer goes on;
* otherwise :attr:`~CombiningService.linger` seconds after the stage was opened (5 ms,
  :data:`LINGER`; the embedded transport's ``put_linger`` option):
  nobody waits for these rows yet, and any call that could see them flushes first, so
  the one-row puts of a producer that awaits something between them (an env step, a
  generation) are still combined, where a flush each iteration admitted them one by
  one at several times the cost.

What a staged put promises is what an admitted one does: its rows count against
``capacity`` and ``capacity_bytes`` at once (a put that finds the queue full with staged
rows flushes them, then waits for room in turn with every waiting producer, and is
staged once it is let in: :meth:`CombiningService.stage_when_room`), it raises the same
errors at the same put (every
check the controller would make is made before staging; a put that would fail is not
staged and fails the usual way), and it never awaits: nothing can cancel a staged put
half-way, and a put that returned is never lost. A one-row put's tensors are copied into
the stage's block (one ``torch.cat`` per field at the flush), so that a batch of
consecutive rows reads back as one view. The block is stored on its unit first, then the
rows are admitted and committed in one step (:meth:`Controller.admit_stored`), under ids
leased to that unit ahead.

Filters judge staged rows once they are flushed, as they judge any others (a row is held
back from requests of a filter's fields until it is judged); their work runs in a task
after the flush, and the puts that come meanwhile are staged as usual (the task runs
once the producer yields). One promise differs: a filter that fails on staged rows is
logged and counted (``stats().filter_errors``), not raised, as for the runs ``seal`` triggers: the
puts that made those rows have returned (the GRPO pattern, one-row puts judged by a
zero-variance filter per group, takes 0.32x the time it took when such puts went the
usual way: docs/benchmarks.md).

A *write* of new fields to a row still in the stage (an env worker puts a sample's
prompt, then writes its response and reward to the row the put returned) is kept with
that row's put and admitted with it (:meth:`CombiningService.stage_write`): the flush
admits the row whole, and no call sees it without the fields, since every call flushes
first. The flush admits its rows in runs of rows with the same fields (most often one
run). Only a write the usual way would accept is kept so: one row, no ``overwrite``, no
field the row holds, each field's dtype the one it has in the queue and in the stage,
no field that is a group key; anything else flushes the stage and goes the usual way,
raising what it raises there.

Nothing else changes: rows are delivered in the order their puts returned, counted in
``stats()`` as put, and every call sees them. Rows larger than
:attr:`~CombiningService.max_row_bytes` are put the usual way (combining saves
nothing on them and the copy would cost).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

import torch

from .control import CONTROL_METHODS
from .controller import Controller
from .columns import tag_values
from .errors import SchemaError, StreamRLError
from .messages import WriteToken
from .service import ControllerService
from .transport.base import Column, DataPlane

log = logging.getLogger("streamrl")

__all__ = ["CombiningService"]

_NOTHING: Mapping[str, Any] = {}  # (read only)
_FAR = 1 << 62  # (rows no stage holds)


#: seconds a stage waits for more one-row puts by default while no consumer waiting can
#: use its rows yet (the embedded transport's ``put_linger`` option sets it per queue)
LINGER = 0.005


class CombiningService(ControllerService):
    """The controller service with a write-combining stage for one-row puts (see the
    module docstring). Every control-plane call flushes the stage before it runs.

    Args:
        controller: the metadata state machine.
        data: the in-process storage units (a data plane with ``units``).

    Keyword Args:
        max_rows: rows staged at most (a full stage is flushed by the next put).
        max_bytes: bytes staged at most.
        max_row_bytes: larger one-row puts are not staged.
        linger: seconds a stage may wait for more rows while no consumer waiting can
            use them yet (``0``: flushed at the end of the event-loop iteration always).
    """

    def __init__(self, controller: Controller, data: DataPlane, *, max_rows: int = 64,
                 max_bytes: int = 1 << 20, max_row_bytes: int = 64 << 10,
                 linger: float = LINGER):
        super().__init__(controller, data)
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.max_row_bytes = max_row_bytes
        self.linger = linger
        self._units = data.units  # type: ignore[attr-defined]
        self.staged = 0  # rows in the stage
        self._bytes = 0
        self._part = ""
        self._version: int | None = None
        self._dtypes: dict[str, str] = {}
        self._tagf: tuple[str, ...] = ()  # the stage's fields that are tags (group keys)
        self._rows: list[Mapping[str, Column]] = []  # the staged rows' columns
        self._rsizes: list[Mapping[str, int]] = []  # their bytes per field
        # fields written to staged rows (see stage_write): row's place in the stage ->
        # (its written columns, their bytes), and the dtypes of the fields so written
        self._extra: dict[int, tuple[dict[str, Column], dict[str, int]]] = {}
        self._xdtypes: dict[str, str] = {}
        # the stage's first row: its bytes per field and in all, and what the caller
        # said a row like it looks like (see stage_like)
        self._sizes: Mapping[str, int] = {}
        self._row_bytes = 0
        self.like: Mapping[str, Any] = {}
        self._first = 0  # the stage's first row id (ids leased from the controller)
        self._limit = 0  # rows the stage takes (ids leased)
        self._shard = 0
        self._turn = 0  # the next stage's storage unit, round robin
        self._tick: asyncio.Handle | None = None  # the end-of-iteration flush
        self._later: asyncio.TimerHandle | None = None  # the flush after linger
        self._need = _FAR  # rows the stage holds once a consumer waiting may use them
        self._tasks: set[asyncio.Task] = set()  # async leftovers of flushes
        self.flushes = 0  # stages flushed (for tests and benchmarks)

    # ------------------------------------------------------------------ staging

    def stage_put(self, partition: str, cols: Mapping[str, Column], sizes: Mapping[str, int],
                  dtypes: dict[str, str], version: int | None, *, head: object = None,
                  like: Mapping[str, Any] | None = None) -> tuple[int, int] | None:
        """Stage a put of one new row (``sizes``: its bytes per field): ``(row id,
        storage unit)``, or ``None`` when it must be put the usual way (the stage is
        flushed then, so that rows keep the order of their puts). Never awaits; raises
        nothing. A staged row keeps ``cols`` and ``sizes`` (not copied) until the
        flush: pass dicts that nothing changes afterwards. ``like``: kept as
        :attr:`like` when this row opens a stage (the caller's description of rows
        like it; see :meth:`stage_like`)."""
        b = 0
        for v in sizes.values():
            b += v
        n = self.staged
        if n and (partition != self._part or version != self._version or n >= self._limit
                  or dtypes != self._dtypes or self._bytes + b > self.max_bytes
                  or asyncio.get_running_loop() is not self._loop):
            self.flush()
            n = 0
        if not self._room(n, b):
            if n:
                self.flush()
            return None
        if not n:
            if not self._open(partition, dtypes, version, b, head, cols):
                return None
            self._sizes = sizes
            self._row_bytes = b
            self.like = like or {}
        elif b > self.max_row_bytes or (self._tagf and not _keys_ok(self._tagf, cols)):
            self.flush()
            return None
        return self._append(cols, sizes, b)

    def like_now(self, partition: str, version: int | None) -> Mapping[str, Any]:
        """:attr:`like` when rows of ``partition`` and ``version`` are staged now (a row
        that matches it may be staged with :meth:`stage_like`), else an empty mapping."""
        if self.staged and partition == self._part and version == self._version:
            return self.like
        return _NOTHING

    def stage_like(self, cols: Mapping[str, Column]) -> tuple[int, int] | None:
        """Stage a put of one new row that the caller found like the rows staged now:
        the same partition and version, and fields of the same dtypes and shapes (so
        bytes) as the row that opened the stage (as :attr:`like` describes it). Cheaper
        than :meth:`stage_put`, which it equals for such a row; ``None`` when the stage
        is empty, or when it has no room for the row (put it with :meth:`stage_put`
        then, which flushes or refuses as it must)."""
        n = self.staged
        b = self._row_bytes
        total = self._bytes + b
        if (not n or n >= self._limit or total > self.max_bytes
                or asyncio.get_running_loop() is not self._loop):
            # (another loop: the stage's ended with rows staged; see stage_put)
            return None
        ctl = self.ctl  # (_room, inlined: every such put runs it, and n >= 1 here)
        cap_bytes = ctl.capacity_bytes
        if len(ctl.rows) + n >= ctl.capacity or (
                cap_bytes is not None and ctl.bytes_held + ctl.reserved_bytes + total > cap_bytes):
            return None
        return self._append(cols, self._sizes, b)

    def stage_write(self, row: int, cols: Mapping[str, Column],
                    nbytes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str]
                    ) -> int | None:
        """Write new fields to a row still in the stage: they are kept with the row's
        put and admitted with it at the flush, as if the put had held them (an env worker
        that puts a prompt, then writes its response and reward, makes a row a flush
        admits whole). ``cols``: the fields, one row each (``nbytes``, ``dtypes``: as
        the write's). Returns the row's storage unit, or ``None`` when the write must
        go the usual way (which flushes the stage first): the row is not staged; a field
        the row holds already (the usual way raises DuplicateField); a dtype unlike the
        field's, in the queue or in another staged row (SchemaError); a field that is a
        tag (a group key) anywhere; too many bytes for the stage. Never awaits, raises
        nothing: a write staged has done all the usual way would have (a later call
        that sees the row sees the fields)."""
        i = row - self._first
        if not 0 <= i < self.staged:
            return None
        b = 0
        for v in nbytes.values():
            b += v[0]
        if self._bytes + b > self.max_bytes or b > self.max_row_bytes:
            return None
        ctl = self.ctl
        have, xd, base = ctl.dtypes, self._xdtypes, self._rows[i]
        extra = self._extra.get(i)
        tagged = ctl.tag_fields or ctl.part_tags
        for f, d in dtypes.items():
            if (f in base or (extra is not None and f in extra[0])
                    or have.get(f, d) != d or xd.get(f, d) != d
                    or (tagged and (f in ctl.tag_fields
                                    or any(f in t for t in ctl.part_tags.values())))):
                return None
        sizes = {f: v[0] for f, v in nbytes.items()}
        if extra is None:
            self._extra[i] = (dict(cols), sizes)
        else:
            self._extra[i] = ({**extra[0], **cols}, {**extra[1], **sizes})
        xd.update(dtypes)
        self._bytes += b
        return self._shard

    def _room(self, n: int, b: int) -> bool:
        """Room for one more row of ``b`` bytes with ``n`` staged: the rows held and
        staged, as ``ctl.admission`` counts them."""
        ctl = self.ctl
        held = len(ctl.rows) + n
        cap_bytes = ctl.capacity_bytes
        return not ((held and held >= ctl.capacity) or (cap_bytes is not None and (
            b > cap_bytes or (held and ctl.bytes_held + ctl.reserved_bytes + self._bytes
                              + b > cap_bytes))))

    def _append(self, cols: Mapping[str, Column], sizes: Mapping[str, int], b: int
                ) -> tuple[int, int]:
        n = self.staged
        rid = self._first + n
        self._rows.append(cols)
        self._rsizes.append(sizes)
        self._bytes += b
        # (a full stage is flushed by the next put, not now: a write to its last row
        # may still be kept with that row's put)
        self.staged = n = n + 1
        if n >= self._need and self._tick is None:  # (enough for a consumer waiting)
            self._tick = self._loop.call_soon(self._on_tick)  # type: ignore[union-attr]
        return rid, self._shard

    def _open(self, partition: str, dtypes: dict[str, str], version: int | None,
              b: int, head: object = None, cols: Mapping[str, Column] = _NOTHING) -> bool:
        """Open a stage for rows like this one (``cols``), if such a put could be
        admitted now and nothing else is pending (``head``: the caller is the first
        producer waiting for room, whose turn it is); ``False``: put it the usual way.
        Fields that are tags (group keys) must hold one scalar (their values are read
        from the block at the flush)."""
        ctl = self.ctl
        q = self._space_q
        if (b > self.max_row_bytes or (q and next(iter(q)) is not head)
                or self._pace_waiters or self._hold is not None
                or not ctl.open_for_rows(partition)):
            return False
        have = ctl.dtypes
        for f, d in dtypes.items():
            if have.get(f, d) != d:
                return False
        if version is not None and (
                (ctl.max_lead is not None and version > ctl.version + ctl.max_lead)
                or (ctl.max_staleness is not None
                    and version < ctl.version - ctl.max_staleness)):
            return False
        tagf: tuple[str, ...] = ()
        if ctl.tag_fields or ctl.part_tags:
            # (the fields a commit wants tag values of: tags here or in any partition)
            tagf = tuple(f for f in dtypes if f in ctl.tag_fields
                         or any(f in t for t in ctl.part_tags.values()))
            if tagf and not _keys_ok(tagf, cols):
                return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if self._loop is None:  # the queue's first call: its event loop is this one
            self._loop = loop
        elif loop is not self._loop:
            return False
        # storage I/O or filter work pending: the usual way (which does it), except for
        # filter jobs that a flush's task will run (see _jobs_in_hand)
        if not self._done_now(jobs_ok=self._jobs_in_hand()):
            return False
        dead = ctl.dead_shards
        shard = self._turn % ctl.num_shards
        if dead:
            live = [s for s in range(ctl.num_shards) if s not in dead]
            if not live:
                return False
            shard = live[self._turn % len(live)]
        self._turn += 1
        limit = max(1, min(self.max_rows, self.max_bytes // max(b, 1)))
        self._first, _ = ctl.unit_ids(shard, limit)
        self._limit = limit
        self._shard = shard
        self._part = partition
        self._version = version
        self._dtypes = dtypes
        self._tagf = tagf
        self._bytes = 0
        self._rows = []
        self._rsizes = []
        self._extra = {}
        self._xdtypes = {}
        # the rows this stage may gather before a consumer waiting could use them: it
        # is flushed at the end of the iteration in which it holds them (_append),
        # else after linger at most
        self._need = need = (1 if self.linger <= 0 else ctl.rows_to_wake(
            self._sub_waiters, partition) if self._sub_waiters else _FAR)
        if need <= 1:
            if self._tick is None:  # (a consumer waits: it sees the rows this iteration)
                self._tick = self._loop.call_soon(self._on_tick)
        elif self._later is None:  # (more rows may come first: see linger)
            self._later = self._loop.call_later(self.linger, self._on_later)
        return True

    async def stage_when_room(self, partition: str, cols: Mapping[str, Column],
                              sizes: Mapping[str, int], dtypes: dict[str, str],
                              version: int | None, timeout: float | None
                              ) -> tuple[int, int] | None:
        """A one-row put that :meth:`stage_put` refused for want of room: wait for room
        in turn (first come, first served with every producer waiting, as
        :meth:`allocate` waits, up to ``timeout``), then stage it. A producer that
        keeps the queue full so still has its rows combined into blocks, which a
        consumer reads back as views. ``None``: refused for another reason, before or
        after the wait (nothing staged); the caller puts it the usual way.

        Raises :class:`~streamrl.errors.StreamTimeout` after ``timeout``, and what
        :meth:`Controller.check_open` raises when the partition or the queue is sealed
        or closed while it waits; cancelled while waiting, nothing is staged."""
        ctl = self.ctl
        b = 0
        for v in sizes.values():
            b += v
        try:
            if ctl.admission(1, b, version) != "full":
                return None
            ctl.check_open(partition)
        except StreamRLError:  # (closed, sealed, never fits: the usual way raises it)
            return None
        deadline = None if timeout is None else ctl.clock() + timeout
        return await self._in_turn(partition, 1, b, deadline, timeout, lambda me: self.stage_put(
            partition, cols, sizes, dtypes, version, head=me))

    def _on_tick(self) -> None:
        self._tick = None
        if self.staged:
            self.flush()

    def _on_later(self) -> None:
        self._later = None
        if self.staged:
            self.flush()

    def flush(self) -> None:
        """Admit, store and commit the staged rows as one put, and wake whoever they
        help. Synchronous (storage deletes or filter work it causes run in a task)."""
        n = self.staged
        if not n:
            return
        self.staged = 0
        if self._later is not None:  # (the next stage lingers from its own opening)
            self._later.cancel()
            self._later = None
        ctl = self.ctl
        ids = list(range(self._first, self._first + n))
        rows, rsizes, extra = self._rows, self._rsizes, self._extra
        self._rows, self._rsizes = [], []
        unit = self._units[self._shard]
        jobs = len(ctl.filter_jobs)  # (filter jobs queued before these rows' commit)
        # rows with the same fields written to them since their put (see stage_write;
        # most often all or none) are stored and admitted together, in order
        xd = self._xdtypes
        runs: list[tuple[int, int, tuple[str, ...]]] = [(0, n, ())]
        if extra:
            self._extra, self._xdtypes = {}, {}
            runs = []
            key: tuple[str, ...] | None = tuple(extra[0][0]) if 0 in extra else ()
            a = 0
            for i in range(1, n + 1):
                k = (tuple(extra[i][0]) if i in extra else ()) if i < n else None
                if k != key:
                    runs.append((a, i, key or ()))
                    a, key = i, k
        a = 0
        try:  # stored under the ids leased to the unit, then admitted and committed
            for a, z, more in runs:
                run = rows if z - a == n else rows[a:z]
                cols = {f: _join([r[f] for r in run]) for f in self._dtypes}
                first = self._sizes
                psizes = rsizes if z - a == n else rsizes[a:z]
                if psizes.count(first) == z - a:  # (rows like the first, the common case)
                    sizes = {f: [b] * (z - a) for f, b in first.items()}
                else:
                    sizes = {f: [r[f] for r in psizes] for f in self._dtypes}
                dtypes = self._dtypes
                if more:
                    dtypes = {**dtypes, **{f: xd[f] for f in more}}
                    for f in more:
                        cols[f] = _join([extra[i][0][f] for i in range(a, z)])
                        sizes[f] = [extra[i][1][f] for i in range(a, z)]
                # (each checked to hold one scalar a row when staged: see _keys_ok)
                tags = ({f: tag_values(f, cols[f]) for f in self._tagf} if self._tagf
                        else None)
                rids = ids if z - a == n else ids[a:z]
                unit.put(rids, cols)
                ctl.admit_stored(self._part, rids, self._shard, sizes, version=self._version,
                                 dtypes=dtypes, admitted=True, tags=tags)
        except BaseException:
            try:  # (the runs before this one are admitted and stay)
                unit.delete(ids[a:])
            finally:
                log.error("streamrl: storing %d combined one-row puts (rows %d..%d) on "
                          "unit %d failed; those rows are lost", n - a, ids[a], ids[-1],
                          self._shard)
            raise
        self.flushes += 1
        if not self._done_now():
            self._settle()
            # the filters these rows' commit set to work judge rows whose puts returned:
            # a failure is logged (and counted), as for the runs seal causes, never raised
            # to a later writer that happens to run them
            self._quiet_jobs.update(j.id for j in ctl.filter_jobs[jobs:])
            # (a task a flush, even with one still running: that one may be awaiting a
            # slow async filter, and this one runs the new jobs meanwhile)
            loop = self._loop
            if loop is None or loop.is_closed():
                # the queue's event loop ended with rows staged (a stage lingers: a
                # program closed its loop soon after a put, then called the queue from
                # another): the call that flushed runs the jobs left in the outbox
                return
            task = loop.create_task(self._after())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _jobs_in_hand(self) -> bool:
        """Whether a task started by a flush is still to run (or running) the filter
        jobs queued now: a stage may open meanwhile. Such a task drains the controller's
        outbox again after each of its awaits, so a job queued before it ends is run by
        it; a put that went the usual way instead would run the jobs itself (the filter
        work of a round landing on one put of ~64)."""
        for t in self._tasks:
            if not t.done():
                return True
        return False

    def _sync_ok(self) -> bool:
        try:
            return self._loop is not None and asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _delete_sync(self, deletes: dict[int, list[int]]) -> bool:
        """The units are in this process: rows are deleted from them at once."""
        units = self._units
        for shard, rows in deletes.items():
            try:
                units[shard].delete(rows)
            except Exception:  # (as ControllerService._delete: logged, the rest goes on)
                log.exception("streamrl: deleting rows from storage unit %d failed", shard)
        return True

    def ack_now(self, lease_ids: Sequence[int]) -> Awaitable[None] | None:
        if self.staged:
            self.flush()
        return super().ack_now(lease_ids)

    def begin_write_now(self, rows: Sequence[int], fields: Sequence[str], *,
                        overwrite: bool = False, dtypes: dict[str, str] | None = None
                        ) -> WriteToken:
        if self.staged:  # (as before every control call: the rows may be staged still)
            self.flush()
        return super().begin_write_now(rows, fields, overwrite=overwrite, dtypes=dtypes)


def _join(pieces: list[Column]) -> Column:
    """One column of the rows of ``pieces`` (one-row columns): one tensor when they are
    tensors of one shape (a copy), else a list of the rows (stored row by row)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    if type(first) is torch.Tensor:
        try:
            return torch.cat(pieces)
        except (RuntimeError, TypeError):  # other shapes or devices, lists: row by row
            pass
    out: list[Any] = []
    for p in pieces:
        out.append(p[0])
    return out


def _flushing(name: str):
    impl = getattr(ControllerService, name)

    @functools.wraps(impl)
    async def call(self: CombiningService, *args: Any, **kwargs: Any) -> Any:
        if self.staged:
            self.flush()
        return await impl(self, *args, **kwargs)

    return call


for _name in CONTROL_METHODS:
    setattr(CombiningService, _name, _flushing(_name))
del _name


def _keys_ok(fields: Sequence[str], cols: Mapping[str, Column]) -> bool:
    """Each of ``fields`` of the one-row put ``cols`` holds one scalar a tag can take
    (what :func:`~streamrl.columns.tag_values` accepts); otherwise the put goes the usual
    way, which raises or skips the value as it must."""
    for f in fields:
        try:
            if len(tag_values(f, cols[f])) != 1:
                return False
        except (SchemaError, TypeError, KeyError):
            return False
    return True
