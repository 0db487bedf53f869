"""The controller: a pure state machine over row metadata.

It holds no data and does no I/O and no waiting. It knows, for every row: its partition,
its storage unit (shard), its policy version, which fields are written (and their sizes),
the scalar *tags* of registered fields (group keys, lengths), which tasks hold it leased or
have acknowledged it, and which filters still have to judge it. From that it answers the
two questions everything else is built on:

* can ``n`` more rows be admitted now (capacity in rows and bytes, version pacing)?
* which rows make the next micro-batch for a request (task, fields, partition, groups)?

Every method runs to completion synchronously. Side effects that need I/O or waking are
left in outboxes that the caller (:mod:`streamrl.service`) drains after each call:

* :attr:`Controller.deletes` -- rows to delete from each storage unit;
* :attr:`Controller.filter_jobs` -- row sets a filter function must judge;
* :attr:`Controller.woken` -- subscriptions that gained deliverable rows;
* :attr:`Controller.changed` -- partitions (``None``: all) whose end-of-stream condition
  may have changed, and :attr:`Controller.space_freed` -- capacity was released.

Readiness is indexed, not scanned: each distinct request shape (a *subscription*: task,
fields, partition, grouping) keeps an ordered set of its deliverable rows, updated when a
write, lease, ack, filter verdict or drop touches a row. Taking a batch is O(batch).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

from .config import QueueConfig, Request, validate_request
from .messages import (END, CommitResult, Delivery, DropReason, FilterJob, FilterSpec, Undo,
                       WriteToken, _End)
from .errors import (
    DispatchError,
    DuplicateField,
    InvalidArgument,
    LeaseExpired,
    QueueClosed,
    QueueFull,
    RowsDropped,
    SchemaError,
    StreamTimeout,
    rows_preview,
)

__all__ = ["Controller", "validate_request", "Request", "Delivery", "END", "FilterSpec", "FilterJob", "DropReason", "Undo"]


class Row:
    """Metadata of one row. Internal."""

    __slots__ = (
        "id", "part", "shard", "version", "fields", "nbytes", "tags", "leased", "acked",
        "pending", "judging", "writing", "delivered",
    )

    def __init__(self, rid: int, part: "Partition", shard: int, version: int):
        self.id = rid
        self.part = part
        self.shard = shard
        self.version = version
        self.fields: dict[str, int] = {}  # ready field -> bytes
        self.nbytes = 0  # committed bytes
        self.tags: dict[str, Hashable] = {}
        # Sets of tasks, filters and fields are int bitmasks (bits from the controller's
        # registries): ints and str->int dicts are not tracked by the cyclic GC, which
        # otherwise costs as much as the bookkeeping itself with many rows held.
        self.leased: dict[str, int] = {}  # task -> lease id
        self.acked = 0  # tasks that acknowledged it
        self.pending = 0  # filters that have not judged it yet
        self.judging = 0  # filters judging it right now
        self.writing = 0  # fields with a write in flight
        self.delivered = 0  # tasks it was ever handed to


class Partition:
    """A named set of rows with one lifetime. Internal."""

    __slots__ = ("name", "rows", "sealed", "consumers", "cmask", "acked", "groups", "tasks")

    def __init__(self, name: str, consumers: frozenset[str] | None, cmask: int = 0):
        self.name = name
        self.rows: dict[int, Row] = {}
        self.sealed = False
        self.consumers = consumers
        self.cmask = cmask  # bitmask of the consumers
        self.acked: dict[str, int] = {}  # task -> live rows of this partition it acked
        self.groups: dict[str, dict[Hashable, dict[int, None]]] = {}  # tag -> key -> rows
        self.tasks: set[str] = set()  # tasks that took rows from here

    def remaining(self, task: str) -> int:
        return len(self.rows) - self.acked.get(task, 0)


class _Sub:
    """One request shape and its index of deliverable rows."""

    __slots__ = ("key", "task", "fields", "partition", "group_by", "group_size", "avail",
                 "buckets", "complete", "gating", "tbit")

    def __init__(self, key: tuple, gating: int, tbit: int):
        self.key = key
        self.task, fields, self.partition, self.group_by, self.group_size = key
        self.fields: frozenset[str] = fields
        self.avail: dict[int, None] = {}
        self.buckets: dict[tuple[str, Hashable], dict[int, None]] = {}
        self.complete: dict[tuple[str, Hashable], None] = {}
        self.gating = gating  # bitmask of filters that must pass a row first
        self.tbit = tbit


class _Lease:
    __slots__ = ("id", "task", "rows", "deadline", "timeout", "claimed", "dispatch", "rank",
                 "fields", "withdrawn")

    def __init__(self, lid: int, task: str, rows: list[int], deadline: float, timeout: float,
                 fields: frozenset[str] = frozenset()):
        self.id = lid
        self.task = task
        self.fields = fields  # the fields the batch was asked for
        self.withdrawn: list[int] = []  # rows taken back by a retracted write (see retract)
        self.rows = rows
        self.deadline = deadline
        self.timeout = timeout
        self.claimed = True
        self.dispatch: tuple | None = None
        self.rank = 0


class _Dispatcher:
    """DP dispatch state of one (subscription, dp_size): shares waiting for their rank."""

    __slots__ = ("next", "shares", "made")

    def __init__(self, dp_size: int):
        self.next = [0] * dp_size  # next dispatch index per rank
        self.made = 0  # dispatches made so far
        # (dispatch, rank) -> (lease id or 0, rows, padding rows)
        self.shares: dict[tuple[int, int], tuple[int, list[int], list[int]]] = {}


_LEASE_MEMORY = 65536  # outcomes of finished leases kept for idempotent ack / clear errors


class Controller:
    """Metadata state machine of one queue.

    Args:
        capacity: most rows held at once (admitted and not yet dropped).

    Keyword Args:
        capacity_bytes: most bytes held at once, or ``None`` for no byte bound. Bytes are
            reserved when new rows are admitted; fields written later to admitted rows are
            always accepted (blocking them could deadlock a pipeline) and counted.
        num_shards: number of storage units rows are spread over.
        lease_timeout: seconds a delivered batch stays leased without ``ack``; also how
            long an admitted write may take to commit before it is aborted (its writer
            is presumed dead: new rows it admitted are dropped).
        max_staleness: rows whose version is older than ``version - max_staleness`` are
            dropped as stale (``None``: no bound).
        max_lead: admission pacer: new rows stamped with version ``v`` are admitted only
            while ``v <= version + max_lead`` (``None``: no pacing).
        consumers: tasks that must acknowledge a row before it is dropped automatically
            (default for partitions that do not declare their own).
        clock: monotonic clock, injectable for tests.

    Examples:
        >>> c = Controller(capacity=8)
        >>> tok = c.allocate("p", 4, ("x",), nbytes=64)
        >>> _ = c.commit(tok, {"x": [16] * 4})
        >>> d = c.take(Request("t", ("x",), batch_size=4, partition="p"))
        >>> d.rows
        [0, 1, 2, 3]
    """

    def __init__(
        self,
        capacity: int,
        *,
        capacity_bytes: int | None = None,
        num_shards: int = 1,
        lease_timeout: float = 600.0,
        max_staleness: int | None = None,
        max_lead: int | None = None,
        consumers: Sequence[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = QueueConfig(
            capacity=capacity, capacity_bytes=capacity_bytes, num_shards=num_shards,
            lease_timeout=lease_timeout, max_staleness=max_staleness, max_lead=max_lead,
            consumers=consumers)  # validates
        lease_timeout = self.config.lease_timeout
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.num_shards = num_shards
        self.lease_timeout = float(lease_timeout)
        self.max_staleness = max_staleness
        self.max_lead = max_lead
        self.default_consumers = _consumers(consumers)
        self.clock = clock

        self.version = 0
        self.closed = False
        self.sealed_all = False  # seal() of the whole queue: no new rows anywhere
        self.rows: dict[int, Row] = {}
        self.parts: dict[str, Partition] = {}
        # sealed partitions whose last row left: forgotten (streams over them end at once)
        self.retired: set[str] = set()
        self.bytes_held = 0
        self.reserved_bytes = 0
        self._ids = itertools.count()
        self._unit_ids: dict[int, list[list[int]]] = {}  # shard -> [next, end) id blocks
        self._lease_ids = itertools.count(1)
        self._token_ids = itertools.count(1)
        self._job_ids = itertools.count(1)
        self._next_shard = 0
        self.dead_shards: set[int] = set()  # storage units known to be gone

        self.subs: dict[tuple, _Sub] = {}
        self._subs_by_part: dict[str | None, list[_Sub]] = {}
        self._subs_by_task: dict[str, list[_Sub]] = {}
        self._cands: dict[str, list[_Sub]] = {}  # partition -> subscriptions that see it
        self.leases: dict[int, _Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self._lease_outcome: OrderedDict[int, str | tuple] = OrderedDict()
        self._tokens: dict[int, WriteToken] = {}
        self._token_heap: list[tuple[float, int]] = []  # (deadline, token id)
        self._expired_tokens: OrderedDict[int, None] = OrderedDict()
        self._retracted: OrderedDict[int, None] = OrderedDict()  # write tokens taken back
        self.c_writes_expired = 0
        self._dispatchers: dict[tuple, _Dispatcher] = {}

        self.dtypes: dict[str, str] = {}  # field -> its one dtype ("torch.int64", "object")
        self.tag_fields: set[str] = set()
        self._tbits: dict[str, int] = {}  # task -> bit
        self._fbits: dict[str, int] = {}  # filter -> bit
        self._field_bits: dict[str, int] = {}  # field -> bit (writes in flight)
        self.filters: dict[str, FilterSpec] = {}
        # filter name -> (partition, key) -> rows that have the filter's fields, unjudged
        self._filter_ready: dict[str, dict[tuple, dict[int, None]]] = {}
        self._jobs: dict[int, FilterJob] = {}

        # outboxes
        self.deletes: dict[int, list[int]] = {}
        # ({shard: rows}, fields) a write to existing rows may have stored before it was
        # aborted for taking too long: the caller deletes those fields from storage
        self.field_deletes: list[Undo] = []
        self.filter_jobs: list[FilterJob] = []
        self.woken: set[tuple] = set()
        self.changed: set[str | None] = set()
        self.space_freed = False

        # counters
        self.c_put = 0
        self.c_bytes_put = 0
        self.c_bytes_freed = 0
        self.c_dropped: dict[str, int] = {}
        self.c_filtered_by: dict[str, int] = {}
        self.c_filter_errors: dict[str, int] = {}
        self.c_delivered: dict[str, int] = {}
        self.c_acked: dict[str, int] = {}
        self.c_redelivered: dict[str, int] = {}
        self.c_expired: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: QueueConfig, *,
                    clock: Callable[[], float] = time.monotonic) -> "Controller":
        """The controller of a queue configured by ``config``."""
        return cls(config.capacity, capacity_bytes=config.capacity_bytes,
                   num_shards=config.num_shards, lease_timeout=config.lease_timeout,
                   max_staleness=config.max_staleness, max_lead=config.max_lead,
                   consumers=config.consumers, clock=clock)

    def mark_lost(self, shard: int) -> int:
        """Storage unit ``shard`` is gone: its rows are dropped as ``"lost"`` (nothing is
        deleted from it), and new rows are placed on the living units. Idempotent;
        returns the rows lost now."""
        if shard in self.dead_shards:
            return 0
        self.dead_shards.add(shard)
        lost = [r for r in self.rows.values() if r.shard == shard]
        self._drop_rows(lost, DropReason.LOST)
        self.deletes.pop(shard, None)  # nothing to delete on a dead unit
        return len(lost)

    # ------------------------------------------------------------------ partitions

    def _part(self, name: str, create: bool = True) -> Partition | None:
        p = self.parts.get(name)
        if p is None and create:
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"partition must be a non-empty str, got {name!r}")
            p = self.parts[name] = Partition(name, self.default_consumers,
                                             self._mask(self.default_consumers))
        return p

    def _bit(self, table: dict[str, int], name: str) -> int:
        b = table.get(name)
        if b is None:
            b = table[name] = 1 << len(table)
        return b

    def _mask(self, tasks) -> int:
        m = 0
        for t in tasks or ():
            m |= self._bit(self._tbits, t)
        return m

    @staticmethod
    def _names(table: dict[str, int], mask: int) -> list[str]:
        return [n for n, b in table.items() if mask & b] if mask else []

    def declare(self, partition: str, consumers: Sequence[str] | None) -> None:
        """Set the tasks that must acknowledge each row of ``partition`` before it is
        dropped automatically (``None`` turns automatic cleanup off for it). Rows already
        acknowledged by all of them are dropped now."""
        p = self._part(partition)
        p.consumers = _consumers(consumers)
        p.cmask = self._mask(p.consumers)
        if p.cmask:
            done = [r for r in p.rows.values() if r.acked & p.cmask == p.cmask and not r.leased]
            self._drop_rows(done, DropReason.CONSUMED)

    def seal_all(self) -> None:
        """No new rows anywhere (new fields of existing rows are still accepted): every
        partition is sealed, and streams over all partitions end once drained."""
        if self.sealed_all:
            return
        self.sealed_all = True
        for name in list(self.parts):
            self.seal(name)
        self.changed.add(None)
        self.woken.update(self.subs)

    def _remaining_all(self, task: str) -> int:
        return len(self.rows) - sum(p.acked.get(task, 0) for p in self.parts.values())

    def seal(self, partition: str) -> None:
        """No new rows will be added to ``partition``; streams over it end once drained."""
        if partition in self.retired:
            return
        p = self._part(partition)
        if not p.sealed:
            p.sealed = True
            self.changed.add(p.name)
            self._wake_part(p.name)
            # groups without a group_size become complete at seal time
            for spec in self.filters.values():
                if spec.group_by and spec.group_size is None:
                    for (pname, key) in list(self._filter_ready.get(spec.name, {})):
                        if pname == p.name:
                            self._maybe_filter_job(spec, p, key)
            self._maybe_retire(p)

    def _maybe_retire(self, p: Partition) -> None:
        """Forget a sealed partition once its last row has left, so that a long run with
        a partition per step keeps no state per finished step."""
        if not p.sealed or p.rows or self.parts.get(p.name) is not p:
            return
        del self.parts[p.name]
        self.retired.add(p.name)
        self.changed.add(p.name)
        self.woken.update(k for k, sub in self.subs.items() if sub.partition == p.name)
        for key in [k for k, sub in self.subs.items() if sub.partition == p.name]:
            sub = self.subs.pop(key)
            self._subs_by_task[sub.task].remove(sub)
            self._dispatchers = {k: d for k, d in self._dispatchers.items() if k[:5] != key}
        self._subs_by_part.pop(p.name, None)
        self._cands.clear()
        for buckets in self._filter_ready.values():
            for k in [k for k in buckets if k[0] == p.name]:
                del buckets[k]

    def close(self) -> None:
        """Refuse new rows; every stream drains what is deliverable now and ends."""
        if not self.closed:
            self.closed = True
            self.changed.add(None)
            self.woken.update(self.subs)
            self.space_freed = True

    # ------------------------------------------------------------------ admission

    def check_fits(self, n: int, nbytes: int) -> None:
        """Raise :class:`QueueFull` if ``n`` rows of ``nbytes`` could never be admitted."""
        if n > self.capacity:
            raise QueueFull(
                f"a single put of {n} rows can never fit a queue whose capacity is "
                f"{self.capacity} rows; split the put or raise capacity")
        if self.capacity_bytes is not None and nbytes > self.capacity_bytes:
            raise QueueFull(
                f"a single put of {nbytes} bytes can never fit a queue whose capacity_bytes "
                f"is {self.capacity_bytes}; split the put or raise capacity_bytes")

    def admission(self, n: int, nbytes: int, version: int | None) -> str | None:
        """Why ``n`` new rows cannot be admitted now: ``"full"``, ``"ahead"`` (version
        pacing) or ``None`` when they can. Raises if they never could."""
        if self.closed:
            raise QueueClosed("the queue is closed; no rows can be put any more")
        self.check_fits(n, nbytes)
        if version is not None and self.max_lead is not None and version > self.version + self.max_lead:
            return "ahead"
        if self.rows and len(self.rows) + n > self.capacity:
            return "full"
        if (self.capacity_bytes is not None and self.rows
                and self.bytes_held + self.reserved_bytes + nbytes > self.capacity_bytes):
            return "full"
        return None

    def unit_ids(self, shard: int, n: int) -> tuple[int, int]:
        """Lease ``n`` fresh row ids ``[start, end)`` to storage unit ``shard``: it names
        the rows of puts it admits itself (:meth:`allocate` with ``ids=``) before asking
        here. Ids are never reused, whether or not they are ever used."""
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"lease at least one id, got {n!r}")
        start = next(self._ids)
        self._ids = itertools.count(start + n)
        blocks = self._unit_ids.setdefault(shard, [])
        blocks.append([start, start + n])
        del blocks[:-2]  # the unit uses its blocks in order: two cover the change-over
        return start, start + n

    def _id_block(self, shard: int, ids: Sequence[int]) -> list[int] | None:
        """The block leased to ``shard`` whose next unused ids are ``ids``, if any."""
        if not ids or list(ids) != list(range(ids[0], ids[0] + len(ids))):
            return None
        for b in self._unit_ids.get(shard, ()):
            if b[0] <= ids[0] and ids[-1] < b[1]:
                return b
        return None

    def owns_ids(self, shard: int, ids: Sequence[int]) -> bool:
        """Whether storage unit ``shard`` may name new rows ``ids`` (see :meth:`unit_ids`)."""
        return shard not in self.dead_shards and self._id_block(shard, ids) is not None

    def allocate(self, partition: str, n: int, fields: Sequence[str], *, nbytes: int = 0,
                 version: int | None = None, ids: Sequence[int] | None = None,
                 shard: int | None = None, dtypes: Mapping[str, str] | None = None
                 ) -> WriteToken:
        """Admit ``n`` new rows in ``partition`` whose ``fields`` are about to be written.

        With ``ids`` and ``shard``, the rows are the ones storage unit ``shard`` already
        stored under ids leased to it by :meth:`unit_ids`. ``dtypes`` (field -> dtype
        name) are checked against the dtypes the fields already have (see
        :meth:`check_dtypes`).

        Raises :class:`QueueFull` when they do not fit now (callers wait and retry),
        :class:`QueueClosed` after close, :class:`InvalidArgument` for a sealed partition
        (or for ``ids`` that are not the unit's next unused ones) and
        :class:`SchemaError` for a field given another dtype than it has.
        """
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"a put needs at least one row, got {n!r}")
        why = self.admission(n, nbytes, version)
        if why == "full":
            raise QueueFull(
                f"no room for {n} rows ({nbytes} bytes): {len(self.rows)}/{self.capacity} rows"
                + (f", {self.bytes_held + self.reserved_bytes}/{self.capacity_bytes} bytes"
                   if self.capacity_bytes is not None else "")
                + " held; wait (use put) or consume/drop rows")
        if why == "ahead":
            raise QueueFull(
                f"rows of version {version} are more than max_lead={self.max_lead} versions "
                f"ahead of the trainer (version {self.version}); wait (use put) or set_version")
        if self.sealed_all:
            raise InvalidArgument(
                "the queue is sealed (seal() without a partition): no new rows; new fields of "
                "existing rows are still accepted")
        p = None if partition in self.retired else self._part(partition)
        if p is None or p.sealed:
            raise InvalidArgument(
                f"partition {partition!r} is sealed; put new rows into another partition "
                "(a sealed partition only takes new fields of its existing rows)")
        if version is None:
            version = self.version
        elif not isinstance(version, int):
            raise InvalidArgument(f"version must be an int, got {version!r}")
        self.check_dtypes(dtypes)
        if ids is None:
            ids = [next(self._ids) for _ in range(n)]
            shards = self._place(n)
        else:
            block = (self._id_block(shard, ids)
                     if len(ids) == n and shard not in self.dead_shards else None)
            if block is None:
                raise InvalidArgument(
                    f"rows {rows_preview(ids)} are not unused ids leased to storage unit "
                    f"{shard}; admit them without ids")
            block[0] = ids[-1] + 1  # used
            ids, shards = list(ids), [shard] * n
        self._learn_dtypes(dtypes)
        pending = 0
        for name in self.filters:
            pending |= self._fbits[name]
        wmask = self._wmask(fields)
        for rid, s in zip(ids, shards):
            row = Row(rid, p, s, version)
            row.pending = pending
            row.writing = wmask
            self.rows[rid] = row
            p.rows[rid] = row
        self.reserved_bytes += nbytes
        self.c_put += n
        tok = WriteToken(next(self._token_ids), ids, shards, tuple(fields), nbytes, True)
        self._track(tok)
        if self.max_staleness is not None and version < self.version - self.max_staleness:
            # admitted and immediately stale: it will never be delivered
            self._drop_rows([self.rows[r] for r in ids], DropReason.STALE, group=True)
        return tok

    def check_dtypes(self, dtypes: Mapping[str, str] | None) -> None:
        """Raise :class:`SchemaError` if a field would get another dtype than the one it
        has in this queue: a field has one dtype, so that rows of different puts read in
        one batch are never converted (an int64 ``2**40 + 1`` read as float32 changes)."""
        if not dtypes:
            return
        for f, d in dtypes.items():
            have = self.dtypes.get(f)
            if have is not None and have != d:
                raise SchemaError(
                    f"field {f!r} holds {_dtype_name(have)} in this queue and this write gives "
                    f"{_dtype_name(d)}; a field has one dtype (rows of different puts are read "
                    "together, never converted): convert the data before the put, or use "
                    "another field name")

    def _learn_dtypes(self, dtypes: Mapping[str, str] | None) -> None:
        if dtypes:
            for f, d in dtypes.items():
                self.dtypes.setdefault(f, d)

    def _wmask(self, fields: Iterable[str]) -> int:
        m = 0
        for f in fields:
            m |= self._bit(self._field_bits, f)
        return m

    def _place(self, n: int) -> list[int]:
        """The storage unit of each of ``n`` new rows: all rows of one put go to one
        living unit, the next put to the next unit. A put's rows then stay one segment,
        so a batch that is a run of one put is read as one piece (no join copy); load
        spreads over units across puts (producers put many small batches)."""
        live = [s for s in range(self.num_shards) if s not in self.dead_shards]
        if not live:
            from .errors import TransportError

            raise TransportError("every storage unit of this queue is gone; create a new queue")
        shard = live[self._next_shard % len(live)]
        self._next_shard = (self._next_shard + 1) % len(live)
        return [shard] * n

    # ------------------------------------------------------------------ writes

    def begin_write(self, rows: Sequence[int], fields: Sequence[str], *,
                    overwrite: bool = False, dtypes: Mapping[str, str] | None = None
                    ) -> WriteToken:
        """Admit a write of ``fields`` to existing ``rows``.

        Raises :class:`RowsDropped` if any row is gone, :class:`DuplicateField` if a
        field is already written (or being written) and ``overwrite`` is false, and
        :class:`SchemaError` for a field given another dtype than it has. Nothing
        changes when it raises.
        """
        self.check_dtypes(dtypes)
        dead = [r for r in rows if r not in self.rows]
        if dead:
            raise RowsDropped(
                f"cannot write {list(fields)} to rows {rows_preview(dead)}: they were dropped "
                "(by drop, clear, a filter, staleness or consumer-set cleanup); skip them",
                dead)
        objs = [self.rows[r] for r in rows]
        wmask = self._wmask(fields)
        if not overwrite:
            for f in fields:
                fb = self._field_bits[f]
                dup = [r.id for r in objs if f in r.fields or r.writing & fb]
                if dup:
                    raise DuplicateField(
                        f"field {f!r} is already written to rows {rows_preview(dup)}; pass "
                        "overwrite=True to replace it, or write it under another name")
        self._learn_dtypes(dtypes)
        for r in objs:
            r.writing |= wmask
        tok = WriteToken(next(self._token_ids), list(rows), [r.shard for r in objs],
                         tuple(fields), overwrite=overwrite)
        self._track(tok)
        return tok

    def abort(self, token: int | WriteToken) -> Undo | None:
        """Forget a write that failed before it was committed; new rows it admitted are
        dropped (and deleted from storage through :attr:`deletes`). Returns what storage
        must forget of a write to existing rows (see :class:`Undo`), or ``None``."""
        tok = self._tokens.pop(token.id if isinstance(token, WriteToken) else token, None)
        if tok is None:
            return None
        self.reserved_bytes -= tok.reserved_bytes
        live = [self.rows[r] for r in tok.rows if r in self.rows]
        wmask = self._wmask(tok.fields)
        for r in live:
            r.writing &= ~wmask
        if tok.new_rows:  # never put: neither counted as put nor as dropped (rows
            # that left meanwhile, e.g. lost with their unit, were counted as dropped)
            self._drop_rows(live, None)
            self.c_put -= len(live)
            return None
        return self._undo(tok, live)

    def _undo(self, tok: WriteToken, live: list[Row]) -> Undo:
        """What storage must forget of ``tok``'s write to existing rows ``live``: the
        fields those rows do not hold committed (an overwrite keeps the others, whose old
        or new value is as good)."""
        buckets: dict[tuple[str, ...], dict[int, list[int]]] = {}
        for row in live:
            fs = tuple(f for f in tok.fields if f not in row.fields)
            if fs:
                buckets.setdefault(fs, {}).setdefault(row.shard, []).append(row.id)
        return Undo(tok.id, frozenset(tok.shards), list(buckets.items()))

    def retract(self, token: WriteToken) -> Undo | None:
        """Take back a committed write whose writer was cancelled before it heard of the
        commit (so it will retry): new rows are dropped (``"cancelled"``); fields written
        to existing rows are un-written (filters that judged them judge again when they
        come back), and batches leased for those fields meanwhile lose those rows, as if
        they had been dropped (the rows are delivered again once the fields are written
        again; the batch's ``ack`` raises :class:`LeaseExpired` naming them, as for an
        expired lease). An ``overwrite`` write is idempotent and stays. Rows already gone are
        skipped. Returns what storage must forget (see :class:`Undo`), or ``None``."""
        if token.id in self._tokens:  # not committed after all: an abort
            return self.abort(token.id)
        if token.id in self._retracted:  # once
            return None
        self._retracted[token.id] = None
        if len(self._retracted) > _LEASE_MEMORY:
            self._retracted.popitem(last=False)
        live = [self.rows[r] for r in token.rows if r in self.rows]
        if token.new_rows:
            self._drop_rows(live, DropReason.CANCELLED)
            return None
        if token.overwrite or not live:
            return None
        fields = set(token.fields)
        fmask = 0
        for spec in self.filters.values():
            if spec.fields & fields:
                fmask |= self._fbits[spec.name]
        self._unjudge({r.id for r in live}, fmask)
        freed = 0
        for row in live:
            # batches leased for these fields lose these rows (as if dropped); the rows
            # come again once the fields are written again
            for task, lid in list(row.leased.items()):
                lease = self.leases.get(lid)
                if lease is not None and lease.fields & fields:
                    del row.leased[task]
                    lease.rows.remove(row.id)
                    lease.withdrawn.append(row.id)  # its ack says so
                    if not lease.rows:
                        del self.leases[lid]
                        self._remember(lid, ("withdrawn", lease.withdrawn))
            for f in token.fields:
                b = row.fields.pop(f, None)
                if b is None:
                    continue
                row.nbytes -= b
                freed += b
                v = row.tags.pop(f, _MISSING)
                if v is not _MISSING:
                    grp = row.part.groups.get(f, {}).get(v)
                    if grp is not None:
                        grp.pop(row.id, None)
                        if not grp:
                            del row.part.groups[f][v]
            row.pending |= fmask
        self.bytes_held -= freed
        self.c_bytes_freed += freed
        self.space_freed = True
        self._reindex(live)
        for p in {r.part for r in live}:
            self._wake_part(p.name)
        return Undo(token.id, frozenset(token.shards),
                    [(tuple(token.fields), _by_shard_of(live))])

    def _unjudge(self, rids: set[int], fmask: int) -> None:
        """Filters of ``fmask`` forget their pending judgement of ``rids``: jobs that
        hold any of them are withdrawn, and their other rows wait to be judged again."""
        if not fmask:
            return
        again: list[Row] = []
        for jid, job in list(self._jobs.items()):
            fbit = self._fbits[job.filter]
            if not fbit & fmask or rids.isdisjoint(job.rows):
                continue
            del self._jobs[jid]
            for r in job.rows:
                row = self.rows.get(r)
                if row is not None:
                    row.judging &= ~fbit
                    row.pending |= fbit
                    if r not in rids:
                        again.append(row)
        self.filter_jobs = [j for j in self.filter_jobs if j.id in self._jobs]
        for name, spec in self.filters.items():
            if self._fbits[name] & fmask:
                for b in self._filter_ready[name].values():
                    for r in rids:
                        b.pop(r, None)
        if again:
            self._filter_check(again)

    def job_live(self, job_id: int) -> bool:
        """Whether a filter job still waits for its verdict (not withdrawn)."""
        return job_id in self._jobs

    def commit(self, token: int | WriteToken, nbytes: dict[str, Sequence[int]],
               tags: dict[str, Sequence[Hashable]] | None = None) -> CommitResult:
        """The write's bytes are in storage: mark its fields ready on its rows.

        Args:
            token: from :meth:`allocate` or :meth:`begin_write`.
            nbytes: per field, the bytes of each row (in the token's row order).
            tags: per registered tag field written here, the scalar value of each row.
        """
        tid = token.id if isinstance(token, WriteToken) else token
        tok = self._tokens.pop(tid, None)
        if tok is None:
            if tid in self._expired_tokens:
                raise StreamTimeout(
                    f"this write was admitted more than lease_timeout={self.lease_timeout}s "
                    "ago without being committed, so it was aborted (its writer was presumed "
                    "dead; new rows it admitted were dropped). Raise lease_timeout for writes "
                    "that take that long")
            raise InvalidArgument("unknown or already finished write token")
        self.reserved_bytes -= tok.reserved_bytes
        tags = tags or {}
        dead: dict[int, list[int]] = {}
        touched: list[Row] = []
        added = 0
        keep = ~self._wmask(tok.fields)
        zeros = [0] * len(tok.rows)
        sizes = [(f, [int(b) for b in nbytes[f]] if f in nbytes else zeros) for f in tok.fields]
        rows = self.rows
        for i, (rid, s) in enumerate(zip(tok.rows, tok.shards)):
            row = rows.get(rid)
            if row is None:
                dead.setdefault(s, []).append(rid)
                continue
            row.writing &= keep
            have = row.fields
            delta = 0
            for f, col in sizes:  # (the hot loop of a put: kept flat)
                b = col[i]
                delta += b - have.get(f, 0)
                have[f] = b
            row.nbytes += delta
            added += delta
            for f, vals in tags.items():
                self._set_tag(row, f, vals[i])
            touched.append(row)
        self.bytes_held += added
        self.c_bytes_put += max(added, 0)
        if tok.reserved_bytes:
            self.space_freed = True
        missing: dict[str, list[int]] = {}
        for f in self.tag_fields.intersection(tok.fields):
            if f not in tags:
                missing[f] = [r.id for r in touched]
        if touched:
            self._reindex(touched)
            self._filter_check(touched)
        return CommitResult(dead, frozenset(self.tag_fields), missing)

    # ------------------------------------------------------------------ tags

    def register_tag(self, field: str) -> dict[int, list[int]]:
        """Keep the scalar value of ``field`` per row (for grouping or balancing). Returns
        rows (per shard) that already have the field but no tag: the caller reads their
        values from storage and passes them to :meth:`set_tags`."""
        self.tag_fields.add(field)
        out: dict[int, list[int]] = {}
        for r in self.rows.values():
            if field in r.fields and field not in r.tags:
                out.setdefault(r.shard, []).append(r.id)
        return out

    def set_tags(self, field: str, rows: Sequence[int], values: Sequence[Hashable]) -> None:
        """Record the tag ``field`` of ``rows`` (rows gone meanwhile are skipped)."""
        touched = []
        for rid, v in zip(rows, values):
            row = self.rows.get(rid)
            if row is not None:
                self._set_tag(row, field, v)
                touched.append(row)
        if touched:
            self._reindex(touched)
            self._filter_check(touched)

    def _set_tag(self, row: Row, f: str, v: Hashable) -> None:
        old = row.tags.get(f, _MISSING)
        if old is not _MISSING:
            if old == v:
                return
            grp = row.part.groups.get(f, {}).get(old)
            if grp is not None:
                grp.pop(row.id, None)
                if not grp:
                    del row.part.groups[f][old]
        row.tags[f] = v
        row.part.groups.setdefault(f, {}).setdefault(v, {})[row.id] = None

    # ------------------------------------------------------------------ subscriptions

    def validate_request(self, req: Request) -> None:
        """Raise :class:`InvalidArgument` for a request that can never be served."""
        validate_request(req)

    def tags_needed(self, req: Request) -> list[str]:
        """Tag fields a request relies on (group key, balance key) not registered yet."""
        return [f for f in (req.group_by, req.balance_by) if f and f not in self.tag_fields]

    def _sub(self, req: Request) -> _Sub:
        key = req.sub_key()
        sub = self.subs.get(key)
        if sub is None and req.partition in self.retired:
            # a finished partition: an empty, unregistered subscription (it has ended)
            return _Sub(key, 0, self._bit(self._tbits, req.task))
        if sub is None:
            for f in self.tags_needed(req):
                self.tag_fields.add(f)
            sub = _Sub(key, self._gating(key[1]), self._bit(self._tbits, req.task))
            self.subs[key] = sub
            self._subs_by_part.setdefault(sub.partition, []).append(sub)
            self._subs_by_task.setdefault(sub.task, []).append(sub)
            self._cands.clear()
            rows = (self.parts[sub.partition].rows.values() if sub.partition in self.parts
                    else ()) if sub.partition is not None else self.rows.values()
            for row in rows:
                if self._eligible(row, sub):
                    self._add(sub, row)
        return sub

    def _gating(self, fields: frozenset[str]) -> int:
        m = 0
        for s in self.filters.values():
            if s.fields & fields:
                m |= self._fbits[s.name]
        return m

    def _eligible(self, row: Row, sub: _Sub) -> bool:
        if row.acked & sub.tbit or sub.task in row.leased:
            return False
        if not sub.fields.issubset(row.fields):
            return False
        if sub.group_by is not None and sub.group_by not in row.tags:
            return False
        if (row.pending | row.judging) & sub.gating:
            return False
        return True

    def _add(self, sub: _Sub, row: Row) -> None:
        if sub.group_by is None:
            sub.avail[row.id] = None
        else:
            gk = (row.part.name, row.tags[sub.group_by])
            sub.buckets.setdefault(gk, {})[row.id] = None
            sub.avail[row.id] = None
            self._check_complete(sub, gk)
        self.woken.add(sub.key)

    def _remove(self, sub: _Sub, row: Row) -> None:
        del sub.avail[row.id]
        if sub.group_by is not None:
            gk = (row.part.name, row.tags.get(sub.group_by, _MISSING))
            b = sub.buckets.get(gk)
            if b is not None:
                b.pop(row.id, None)
                if not b:
                    del sub.buckets[gk]
                    sub.complete.pop(gk, None)
                else:
                    self._check_complete(sub, gk)

    def _check_complete(self, sub: _Sub, gk: tuple) -> None:
        b = sub.buckets.get(gk)
        if b and self._group_complete(sub, gk, b):
            sub.complete[gk] = None
        else:
            sub.complete.pop(gk, None)

    def _group_complete(self, sub: _Sub, gk: tuple, bucket: dict[int, None]) -> bool:
        if sub.group_size is not None and len(bucket) >= sub.group_size:
            return True
        p = self.parts.get(gk[0])
        if p is None or not (p.sealed or self.closed):
            return False
        # sealed: complete when every live row of the key that the task still owes is here
        members = p.groups.get(sub.group_by, {}).get(gk[1], {})
        owed = sum(1 for r in members if not self.rows[r].acked & sub.tbit)
        return len(bucket) >= owed

    def _reindex(self, rows: Iterable[Row], tasks: Iterable[str] | None = None) -> None:
        """Re-evaluate ``rows`` against subscriptions (of ``tasks`` only, if given)."""
        if not self.subs:
            return
        for row in rows:
            for sub in self._candidates(row.part.name):
                if tasks is not None and sub.task not in tasks:
                    continue
                ok = self._eligible(row, sub)
                if ok and row.id not in sub.avail:
                    self._add(sub, row)
                elif not ok and row.id in sub.avail:
                    self._remove(sub, row)

    def _candidates(self, name: str) -> list[_Sub]:
        c = self._cands.get(name)
        if c is None:
            c = self._cands[name] = self._subs_by_part.get(name, []) + self._subs_by_part.get(None, [])
        return c

    def _unindex(self, row: Row, tasks: Iterable[str] | None = None) -> None:
        for sub in self._candidates(row.part.name):
            if (tasks is None or sub.task in tasks) and row.id in sub.avail:
                self._remove(sub, row)

    def _wake_part(self, name: str) -> None:
        for sub in self._candidates(name):
            if sub.group_by is not None:
                for gk in list(sub.buckets):
                    if gk[0] == name:
                        self._check_complete(sub, gk)
            self.woken.add(sub.key)

    # ------------------------------------------------------------------ taking

    def take(self, req: Request) -> Delivery | _End | None:
        """Lease the next micro-batch for ``req``.

        Returns a :class:`Delivery`, ``None`` when the caller must wait (nothing changes),
        or :data:`END` when nothing more will ever come (the partition is sealed and the
        task consumed all its rows, or the queue is closed and drained).
        """
        self.expire()
        sub = self._sub(req)
        if req.max_staleness is not None:
            self._drop_stale(sub, req.max_staleness)
        if req.dp_size > 1:
            return self._take_dp(sub, req)
        rows = self._select(sub, req, req.batch_size)
        if rows is None or rows is END:
            return rows
        return self._lease(sub, req, rows)

    def _owed(self, sub: _Sub) -> int | None:
        """Rows the task still owes in the subscription's scope once no new rows can come
        (its partition, or the whole queue, is sealed); ``None`` while more may come."""
        if sub.partition is None:
            return self._remaining_all(sub.task) if self.sealed_all else None
        if sub.partition in self.retired:
            return 0
        p = self.parts.get(sub.partition)
        return p.remaining(sub.task) if p is not None and p.sealed else None

    def _tail(self, sub: _Sub) -> bool:
        """True when every row the task still owes is deliverable now (nothing to wait
        for), so a short final batch may go out."""
        return self.closed or self._owed(sub) == len(sub.avail)

    def _ended(self, sub: _Sub) -> bool:
        return (self.closed and not sub.avail) or self._owed(sub) == 0

    def _select(self, sub: _Sub, req: Request, size: int) -> list[int] | _End | None:
        """Pick (without leasing) up to ``size`` rows, or None/END."""
        if sub.group_by is None:
            if len(sub.avail) >= size:
                return list(itertools.islice(sub.avail, size))
            tail = self._tail(sub)
            if sub.avail and tail and not req.drop_last:
                return list(sub.avail)
            if self._ended(sub) or (tail and req.drop_last):
                return END
            return None
        # grouped: whole groups only
        chosen: list[int] = []
        complete_rows = 0
        for gk in sub.complete:
            b = sub.buckets[gk]
            n = min(len(b), sub.group_size) if sub.group_size else len(b)
            complete_rows += n
            if len(chosen) + n <= size or not chosen:
                chosen.extend(itertools.islice(b, n))
            if len(chosen) >= size:
                break
        if chosen and (len(chosen) >= size or complete_rows > len(chosen)):
            return chosen  # a full batch, or the next whole group would not fit
        tail = self._tail(sub)
        if chosen and tail and not req.drop_last:
            return chosen
        if self._ended(sub) or (tail and req.drop_last):
            return END
        return None

    def _lease(self, sub: _Sub, req: Request, rids: list[int], *, claimed: bool = True,
               rank: int = 0, dispatch: int | None = None) -> Delivery:
        task = req.task
        timeout = req.lease_timeout or self.lease_timeout
        lid = next(self._lease_ids)
        lease = _Lease(lid, task, rids, self.clock() + timeout, timeout, frozenset(req.fields))
        lease.rank = rank
        self.leases[lid] = lease
        heapq.heappush(self._lease_heap, (lease.deadline, lid))
        for rid in rids:
            row = self.rows[rid]
            row.leased[task] = lid
            row.part.tasks.add(task)
            self._unindex(row, (task,))
        lease.claimed = False
        if claimed:
            self._claim(lease)
        return self._delivery(lid, req, sub, rids, rank, dispatch)

    def _claim(self, lease: _Lease) -> None:
        """The consumer has the batch now: count it (and redeliveries)."""
        lease.claimed = True
        task = lease.task
        bit = self._bit(self._tbits, task)
        redelivered = 0
        for rid in lease.rows:
            row = self.rows[rid]
            if row.delivered & bit:
                redelivered += 1
            row.delivered |= bit
        self.c_delivered[task] = self.c_delivered.get(task, 0) + len(lease.rows)
        if redelivered:
            self.c_redelivered[task] = self.c_redelivered.get(task, 0) + redelivered

    def _delivery(self, lid: int, req: Request, sub: _Sub, rids: list[int], rank: int = 0,
                  dispatch: int | None = None) -> Delivery:
        objs = [self.rows[r] for r in rids]
        common = set(objs[0].fields) if objs else set()
        for row in objs[1:]:
            common.intersection_update(row.fields)
        part = sub.partition
        if part is None and objs:
            names = {r.part.name for r in objs}
            part = names.pop() if len(names) == 1 else None
        nbytes = sum(r.fields.get(f, 0) for r in objs for f in req.fields)
        return Delivery(lid, req.task, list(rids), [r.shard for r in objs],
                        [r.version for r in objs], req.fields, part, rank, dispatch,
                        tuple(sorted(common)), nbytes)

    # ------------------------------------------------------------------ DP dispatch

    def _take_dp(self, sub: _Sub, req: Request) -> Delivery | _End | None:
        """Rank ``r`` takes share ``r`` of dispatch ``k`` (its k-th batch). The first rank
        to ask for dispatch ``k`` makes it: ``dp_size * batch_size`` rows (whole groups)
        split into equal-count, weight-balanced shares; the other shares are reserved
        (leased, unclaimed) until their rank asks."""
        R, rank = req.dp_size, req.dp_rank
        disp = self._dispatchers.setdefault(sub.key + (R,), _Dispatcher(R))
        k = disp.next[rank]
        if (k, rank) not in disp.shares:
            if k < disp.made:
                disp.next[rank] = k + 1
                raise DispatchError(
                    f"the share of dp_rank={rank} in dispatch {k} of task {req.task!r} expired "
                    "before this rank asked for it (its rows went back to the queue); raise "
                    "lease_timeout or keep the ranks in step")
            made = self._make_dispatch(sub, req, disp, k)
            if made is None or made is END:
                return made
        lid, rids, pads = disp.shares.pop((k, rank))
        disp.next[rank] = k + 1
        if lid:
            lease = self.leases[lid]
            lease.deadline = self.clock() + lease.timeout
            heapq.heappush(self._lease_heap, (lease.deadline, lid))
            self._claim(lease)
        return self._delivery(lid, req, sub, list(rids) + list(pads), rank, k)

    def _make_dispatch(self, sub: _Sub, req: Request, disp: _Dispatcher, k: int):
        R = req.dp_size
        rows = self._select(sub, req, R * req.batch_size)
        if rows is None or rows is END:
            return rows
        units = self._units(sub, rows)  # whole groups (or single rows)
        extra = len(units) % R
        if extra:  # only a short last dispatch can be uneven
            kind = "groups" if sub.group_by else "rows"
            if req.dp_remainder == "error":
                raise DispatchError(
                    f"the last {len(rows)} rows ({len(units)} {kind}) of task {req.task!r} "
                    f"cannot be split evenly over dp_size={R} ranks; pass dp_remainder='drop' "
                    f"(drop the last {extra} {kind}, counted in stats) or 'pad' (repeat "
                    "rows), or put a multiple of dp_size")
            if req.dp_remainder == "drop":
                left = units[len(units) - extra:]
                units = units[:len(units) - extra]
                self._drop_rows([self.rows[r] for u in left for r in u], DropReason.DP_REMAINDER)
                if not units:
                    return None  # all dropped: the next take sees the end
        shares, pads = _balanced_split(units, R, self._weights(units, req.balance_by))
        for r in range(R):
            lid = self._lease(sub, req, shares[r], claimed=False, rank=r, dispatch=k).lease \
                if shares[r] else 0
            if lid:
                self.leases[lid].dispatch = (sub.key + (R,), k)
            disp.shares[(k, r)] = (lid, shares[r], pads[r])
        disp.made = k + 1
        return True

    def _units(self, sub: _Sub, rows: list[int]) -> list[list[int]]:
        if sub.group_by is None:
            return [[r] for r in rows]
        by: dict[Hashable, list[int]] = {}
        for r in rows:
            by.setdefault(self.rows[r].tags[sub.group_by], []).append(r)
        return list(by.values())

    def _weights(self, units: list[list[int]], balance_by: str | None) -> list[float]:
        if balance_by is None:
            return [float(len(u)) for u in units]
        out = []
        for u in units:
            w = 0.0
            for r in u:
                v = self.rows[r].tags.get(balance_by)
                if v is None:
                    raise InvalidArgument(
                        f"balance_by={balance_by!r}: row {r} has no value for it yet; write the "
                        "length field before the row becomes ready, or list it in fields")
                w += float(v)
            out.append(w)
        return out

    # ------------------------------------------------------------------ leases

    def ack(self, lease_ids: Iterable[int]) -> None:
        """The consumer is done with these leases: their rows count as consumed by the
        task. Idempotent. Raises :class:`LeaseExpired` for a lease that expired or was
        released (its rows go, or went, to another consumer)."""
        self.expire()
        expired = []
        withdrawn: list[int] = []
        for lid in lease_ids:
            lease = self.leases.pop(lid, None)
            if lease is None:
                outcome = self._lease_outcome.get(lid)
                if outcome in ("expired", "released"):
                    expired.append(lid)
                elif isinstance(outcome, tuple):  # every row was withdrawn
                    withdrawn.extend(outcome[1])
                continue
            self._remember(lid, "acked")
            withdrawn.extend(lease.withdrawn)
            task = lease.task
            bit = self._bit(self._tbits, task)
            done = []
            for rid in lease.rows:
                row = self.rows.get(rid)
                if row is None or row.leased.get(task) != lid:
                    continue
                del row.leased[task]
                row.acked |= bit
                p = row.part
                p.acked[task] = p.acked.get(task, 0) + 1
                if p.cmask and row.acked & p.cmask == p.cmask and not row.leased:
                    done.append(row)
            self.c_acked[task] = self.c_acked.get(task, 0) + len(lease.rows)
            self._drop_rows(done, DropReason.CONSUMED)
            self._lease_changed(lease)
        if expired:
            raise LeaseExpired(
                f"lease(s) {expired} expired or were released before ack; their rows were "
                "handed out again. Ack sooner, or raise lease_timeout on the queue or stream")
        if withdrawn:
            raise LeaseExpired(
                f"rows {rows_preview(withdrawn)} were taken back from this batch before its "
                "ack (a write of a field it asked for was undone: its writer was "
                "cancelled); the rest is acknowledged, and those rows are delivered again "
                "once the field is written again. Do not count work done on them",
                withdrawn)

    def release(self, lease_ids: Iterable[int], *, expired: bool = False) -> None:
        """Give the rows of these leases back: they are delivered again to the task."""
        for lid in lease_ids:
            lease = self.leases.pop(lid, None)
            if lease is None:
                continue
            self._remember(lid, "expired" if expired else "released")
            task = lease.task
            back = []
            for rid in lease.rows:
                row = self.rows.get(rid)
                if row is not None and row.leased.get(task) == lid:
                    del row.leased[task]
                    back.append(row)
            if expired:
                self.c_expired[task] = self.c_expired.get(task, 0) + len(back)
            self._reindex(back, (task,))
            self._lease_changed(lease)

    def _lease_changed(self, lease: _Lease) -> None:
        for p in {self.rows[r].part for r in lease.rows if r in self.rows}:
            if p.sealed or self.closed:  # remaining() moved: tails and ends may follow
                self.changed.add(p.name)
                self._wake_part(p.name)
        if lease.dispatch is not None:
            disp = self._dispatchers.get(lease.dispatch[0])
            if disp is not None and not lease.claimed:
                disp.shares.pop((lease.dispatch[1], lease.rank), None)

    def _remember(self, lid: int, outcome: str) -> None:
        self._lease_outcome[lid] = outcome
        if len(self._lease_outcome) > _LEASE_MEMORY:
            self._lease_outcome.popitem(last=False)

    def _track(self, tok: WriteToken) -> None:
        self._tokens[tok.id] = tok
        heapq.heappush(self._token_heap, (self.clock() + self.lease_timeout, tok.id))

    def next_deadline(self) -> float | None:
        """The earliest lease or write deadline (monotonic seconds), for the caller's timer."""
        while self._lease_heap:
            d, lid = self._lease_heap[0]
            lease = self.leases.get(lid)
            if lease is None or lease.deadline != d:
                heapq.heappop(self._lease_heap)
                continue
            break
        while self._token_heap and self._token_heap[0][1] not in self._tokens:
            heapq.heappop(self._token_heap)
        ends = [h[0][0] for h in (self._lease_heap, self._token_heap) if h]
        return min(ends) if ends else None

    def expire(self, now: float | None = None) -> int:
        """Release every lease past its deadline (returns how many), and abort every write
        admitted more than ``lease_timeout`` ago and not committed (its writer is
        presumed dead: new rows it admitted are dropped)."""
        now = self.clock() if now is None else now
        while self._token_heap and self._token_heap[0][0] <= now:
            _, tid = heapq.heappop(self._token_heap)
            if tid in self._tokens:
                undo = self.abort(tid)  # new rows: dropped (and deleted) here
                if undo is not None:
                    self.field_deletes.append(undo)
                self.c_writes_expired += 1
                self._expired_tokens[tid] = None
                if len(self._expired_tokens) > _LEASE_MEMORY:
                    self._expired_tokens.popitem(last=False)
        n = 0
        while self._lease_heap and self._lease_heap[0][0] <= now:
            d, lid = heapq.heappop(self._lease_heap)
            lease = self.leases.get(lid)
            if lease is not None and lease.deadline == d:
                self.release([lid], expired=True)
                n += 1
        return n

    def lease_rows(self, lease_id: int) -> list[int] | None:
        """Rows still held under a lease, or ``None`` once it ended."""
        lease = self.leases.get(lease_id)
        return None if lease is None else list(lease.rows)

    # ------------------------------------------------------------------ dropping

    def drop(self, rows: Iterable[int], reason: str = DropReason.DROPPED) -> int:
        """Delete rows for good (idempotent: rows already gone are skipped). Returns how
        many were dropped."""
        objs = [self.rows[r] for r in dict.fromkeys(rows) if r in self.rows]
        self._drop_rows(objs, reason)
        return len(objs)

    def clear(self, partition: str) -> int:
        """Drop every row of ``partition``. An unsealed partition stays open for new
        rows; a sealed one is forgotten (as it is when its last row leaves)."""
        p = self.parts.get(partition)
        if p is None:
            return 0
        n = len(p.rows)
        self._drop_rows(list(p.rows.values()), DropReason.CLEARED)
        return n

    def _drop_rows(self, objs: list[Row], reason: str | None, *, group: bool = False) -> None:
        if group:
            objs = self._with_groups(objs)
        if not objs:
            return
        freed = 0
        gone = 0
        parts: set[Partition] = set()
        for row in objs:
            if self.rows.pop(row.id, None) is None:
                continue
            gone += 1
            p = row.part
            del p.rows[row.id]
            for task in self._names(self._tbits, row.acked):
                p.acked[task] -= 1
            for f, v in row.tags.items():
                grp = p.groups.get(f, {}).get(v)
                if grp is not None:
                    grp.pop(row.id, None)
                    if not grp:
                        del p.groups[f][v]
            self._unindex(row)
            for task, lid in row.leased.items():
                lease = self.leases.get(lid)
                if lease is not None:
                    lease.rows.remove(row.id)
                    if not lease.rows:
                        del self.leases[lid]
                        self._remember(lid, "acked")
            for name in self._names(self._fbits, row.pending | row.judging):
                buckets = self._filter_ready.get(name)
                if buckets:
                    for b in buckets.values():
                        b.pop(row.id, None)
            freed += row.nbytes
            self.deletes.setdefault(row.shard, []).append(row.id)
            parts.add(p)
        self.bytes_held -= freed
        self.c_bytes_freed += freed
        if reason is not None:
            self.c_dropped[reason] = self.c_dropped.get(reason, 0) + gone
        self.space_freed = True
        for p in parts:
            self.changed.add(p.name)
            if p.sealed or self.closed:  # end and group-completeness conditions moved
                self._wake_part(p.name)
            self._maybe_retire(p)

    def _with_groups(self, objs: list[Row]) -> list[Row]:
        """``objs`` plus every row sharing a group key (any registered group tag) with
        one of them, so groups leave together."""
        keys = {s.group_by for s in self.subs.values() if s.group_by}
        keys |= {s.group_by for s in self.filters.values() if s.group_by}
        if not keys:
            return objs
        out = {r.id: r for r in objs}
        for r in objs:
            for f in keys:
                v = r.tags.get(f, _MISSING)
                if v is not _MISSING:
                    for rid in r.part.groups.get(f, {}).get(v, ()):
                        out.setdefault(rid, self.rows[rid])
        return list(out.values())

    # ------------------------------------------------------------------ staleness

    def set_version(self, version: int) -> int:
        """Advance the current policy version. Returns rows dropped as stale."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidArgument(f"version must be an int, got {version!r}")
        if version < self.version:
            raise InvalidArgument(
                f"versions only go forward: current is {self.version}, got {version}; "
                "pass the trainer's new policy version")
        self.version = version
        self.space_freed = True  # paced producers may go on
        if self.max_staleness is None:
            return 0
        limit = version - self.max_staleness
        stale = [r for r in self.rows.values() if r.version < limit]
        before = self.c_dropped.get(DropReason.STALE, 0)
        self._drop_rows(stale, DropReason.STALE, group=True)
        return self.c_dropped.get(DropReason.STALE, 0) - before

    def _drop_stale(self, sub: _Sub, k: int) -> None:
        limit = self.version - k
        stale = [self.rows[r] for r in sub.avail if self.rows[r].version < limit]
        if stale:
            self._drop_rows(stale, DropReason.STALE, group=True)

    # ------------------------------------------------------------------ filters

    def add_filter(self, spec: FilterSpec) -> None:
        """Register a filter: every live row must pass it before it is delivered to a
        task that asks for any of ``spec.fields``."""
        if spec.name in self.filters:
            raise InvalidArgument(f"a filter named {spec.name!r} exists already; pass another name")
        self.filters[spec.name] = spec
        self._filter_ready[spec.name] = {}
        fbit = self._bit(self._fbits, spec.name)
        if spec.group_by:
            self.tag_fields.add(spec.group_by)
        for sub in self.subs.values():
            sub.gating = self._gating(sub.fields)
        for row in self.rows.values():
            row.pending |= fbit
        self._reindex(list(self.rows.values()))
        self._filter_check(list(self.rows.values()), only=spec)

    def _filter_check(self, rows: list[Row], only: FilterSpec | None = None) -> None:
        """Queue filter jobs for rows that now have every field a filter needs."""
        if not self.filters:
            return
        specs = [only] if only else list(self.filters.values())
        for spec in specs:
            buckets = self._filter_ready[spec.name]
            fbit = self._fbits[spec.name]
            new_keys: dict[tuple, Partition] = {}
            for row in rows:
                if not row.pending & fbit or row.id not in self.rows:
                    continue
                if not spec.fields.issubset(row.fields):
                    continue
                if spec.group_by:
                    if spec.group_by not in row.tags:
                        continue
                    key = (row.part.name, row.tags[spec.group_by])
                else:
                    key = (row.part.name, None)
                buckets.setdefault(key, {})[row.id] = None
                new_keys[key] = row.part
            for key, p in new_keys.items():
                self._maybe_filter_job(spec, p, key[1] if spec.group_by else None, key)

    def _maybe_filter_job(self, spec: FilterSpec, p: Partition, gkey, key: tuple | None = None) -> None:
        key = key or (p.name, gkey)
        fbit = self._fbits[spec.name]
        b = self._filter_ready[spec.name].get(key)
        if not b:
            return
        if spec.group_by is None:
            self._emit_job(spec, list(b))
            del self._filter_ready[spec.name][key]
        elif spec.group_size is not None:
            while len(b) >= spec.group_size:
                take = list(itertools.islice(b, spec.group_size))
                for r in take:
                    del b[r]
                self._emit_job(spec, take)
            if not b:
                del self._filter_ready[spec.name][key]
            elif p.sealed:
                members = p.groups.get(spec.group_by, {}).get(gkey, {})
                waiting = [r for r in members if self.rows[r].pending & fbit]
                if len(b) >= len(waiting):
                    self._emit_job(spec, list(b))
                    del self._filter_ready[spec.name][key]
        else:
            if not p.sealed:
                return
            members = p.groups.get(spec.group_by, {}).get(gkey, {})
            waiting = [r for r in members if self.rows[r].pending & fbit]
            if len(b) >= len(waiting):
                self._emit_job(spec, list(b))
                del self._filter_ready[spec.name][key]

    def _emit_job(self, spec: FilterSpec, rids: list[int]) -> None:
        fbit = self._fbits[spec.name]
        for r in rids:
            row = self.rows[r]
            row.pending &= ~fbit
            row.judging |= fbit
        job = FilterJob(next(self._job_ids), spec.name, rids,
                        [self.rows[r].shard for r in rids], tuple(sorted(spec.fields)))
        self._jobs[job.id] = job
        self.filter_jobs.append(job)

    def filter_done(self, job_id: int, keep: Sequence[bool] | None, *, error: bool = False) -> int:
        """Record a filter verdict: ``keep[i]`` for the job's i-th row. Rejected rows (all
        of them when ``error``) are dropped. Returns how many were dropped."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return 0
        live = [self.rows[r] for r in job.rows if r in self.rows]
        fbit = self._fbits[job.filter]
        for row in live:
            row.judging &= ~fbit
        if error:
            rejected = live
            self.c_filter_errors[job.filter] = self.c_filter_errors.get(job.filter, 0) + len(live)
            reason = DropReason.FILTER_ERROR
        else:
            verdict = dict(zip(job.rows, keep))
            rejected = [r for r in live if not verdict[r.id]]
            self.c_filtered_by[job.filter] = self.c_filtered_by.get(job.filter, 0) + len(rejected)
            reason = DropReason.FILTERED
        self._drop_rows(rejected, reason)
        rej = {r.id for r in rejected}
        self._reindex([r for r in live if r.id not in rej])
        return len(rejected)

    def filter_retry(self, job_id: int) -> None:
        """A job could not run to the end (cancelled): queue it again."""
        job = self._jobs.get(job_id)
        if job is not None:
            self.filter_jobs.append(job)

    # ------------------------------------------------------------------ outboxes

    def drain(self) -> tuple[dict[int, list[int]], list[FilterJob], set[tuple], set, bool]:
        """Take and reset the outboxes: (deletes, filter_jobs, woken, changed, space_freed)."""
        out = (self.deletes, self.filter_jobs, self.woken, self.changed, self.space_freed)
        self.deletes, self.filter_jobs, self.woken, self.changed = {}, [], set(), set()
        self.space_freed = False
        return out

    # ------------------------------------------------------------------ introspection

    def pending_filter_rows(self) -> dict[str, int]:
        """Per filter, live rows it has not judged yet."""
        out = {name: 0 for name in self.filters}
        for row in self.rows.values():
            for name in self._names(self._fbits, row.pending | row.judging):
                out[name] += 1
        return out

    def partition_states(self) -> dict[str, dict[str, int]]:
        """Rows held per partition and per state: ``waiting`` (no subscription can take
        them yet), ``ready`` (deliverable to some task), ``leased``, ``consumed``
        (acknowledged by some task, not leased, still held)."""
        ready: set[int] = set()
        for sub in self.subs.values():
            ready.update(sub.avail)
        out: dict[str, dict[str, int]] = {}
        for p in self.parts.values():
            st = {"rows": len(p.rows), "waiting": 0, "ready": 0, "leased": 0, "consumed": 0,
                  "sealed": int(p.sealed)}
            for row in p.rows.values():
                if row.leased:
                    st["leased"] += 1
                elif row.id in ready:
                    st["ready"] += 1
                elif row.acked:
                    st["consumed"] += 1
                else:
                    st["waiting"] += 1
            out[p.name] = st
        return out

    def leaked(self) -> dict[str, int]:
        """Rows still held in sealed partitions that no task will ever take: not leased,
        and acknowledged by every declared consumer (or, with none declared, by every
        task that has read from the partition)."""
        out: dict[str, int] = {}
        for p in self.parts.values():
            if not p.sealed or not p.rows:
                continue
            mask = p.cmask or self._mask(p.tasks)
            if not mask:
                continue
            n = sum(1 for r in p.rows.values() if not r.leased and r.acked & mask == mask)
            if n:
                out[p.name] = n
        return out

    def held_by_partition(self) -> dict[str, int]:
        """Rows held per partition (partitions holding none are left out)."""
        return {p.name: len(p.rows) for p in self.parts.values() if p.rows}


_MISSING = object()


def _dtype_name(d: str) -> str:
    return "Python objects" if d == "object" else d.replace("torch.", "")


def _by_shard_of(rows: Iterable[Row]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in rows:
        out.setdefault(r.shard, []).append(r.id)
    return out


def _consumers(consumers: Sequence[str] | None) -> frozenset[str] | None:
    if consumers is None:
        return None
    if isinstance(consumers, str):
        consumers = [consumers]
    out = frozenset(consumers)
    if not out or not all(isinstance(c, str) and c for c in out):
        raise InvalidArgument(
            f"consumers must be a non-empty list of task names (or None), got {consumers!r}")
    return out


def _check_staleness(name: str, v: int | None) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise InvalidArgument(f"{name} must be an int >= 0 (or None for no bound), got {v!r}")


def _balanced_split(units: list[list[int]], R: int, weights: list[float]
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """Split ``units`` (groups of rows) over ``R`` ranks, every rank the same number of
    units, balancing the total weight.

    Greedy longest-processing-time first with a cardinality bound (each unit goes,
    heaviest first, to the lightest rank that still has room), then pairwise swaps between
    the heaviest and the lightest rank while a swap narrows their gap. When ``len(units)``
    is not a multiple of ``R``, short ranks are padded by repeating units of other ranks
    (returned separately, since those rows are leased by their own share).
    """
    per = math.ceil(len(units) / R) if units else 0
    order = sorted(range(len(units)), key=lambda i: -weights[i])
    load = [0.0] * R
    members: list[list[int]] = [[] for _ in range(R)]
    for i in order:
        r = min((r for r in range(R) if len(members[r]) < per), key=lambda r: (load[r], len(members[r])))
        members[r].append(i)
        load[r] += weights[i]
    for _ in range(4 * len(units)):
        h = max(range(R), key=load.__getitem__)
        lo = min(range(R), key=load.__getitem__)
        gap = load[h] - load[lo]
        best, pick = gap, None
        for a in members[h]:
            for b in members[lo]:
                d = weights[a] - weights[b]
                if 0 < d < gap and abs(gap - 2 * d) < best:
                    best, pick = abs(gap - 2 * d), (a, b)
        if pick is None:
            break
        a, b = pick
        members[h].remove(a)
        members[lo].remove(b)
        members[h].append(b)
        members[lo].append(a)
        d = weights[a] - weights[b]
        load[h] -= d
        load[lo] += d
    shares = [[r for i in m for r in units[i]] for m in members]
    pads: list[list[int]] = [[] for _ in range(R)]
    donors = deque(order)
    for r in range(R):
        need = per - len(members[r])
        while need > 0:
            i = donors.popleft()
            donors.append(i)
            pads[r].extend(units[i])
            need -= 1
    return shares, pads


def imbalance(loads: Sequence[float]) -> float:
    """(max - min) / mean of per-rank loads: 0 is perfect balance."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return (max(loads) - min(loads)) / mean if mean else 0.0
