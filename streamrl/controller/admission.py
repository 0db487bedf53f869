"""Admission and writes: capacity and version pacing, row ids (the controller's own and
those leased to storage units), placement on units, and the life of a write token
(allocate or begin_write -> commit, abort or retract)."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping, Sequence

from ..errors import (
    DuplicateField,
    InvalidArgument,
    QueueClosed,
    QueueFull,
    RowsDropped,
    SchemaError,
    StreamTimeout,
    rows_preview,
)
from ..messages import CommitResult, DropReason, Undo, WriteToken
from .base import ControllerBase
from .state import _MISSING, LEASE_MEMORY, Partition, Row, _by_shard_of, _dtype_name


class Admission(ControllerBase):
    """Capacity, ids, placement and write tokens (part of :class:`Controller`)."""

    # ------------------------------------------------------------------ capacity

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

    def check_open(self, partition: str) -> None:
        """Raise what a put of new rows into ``partition`` raises whatever the room:
        :class:`QueueClosed` after close, :class:`InvalidArgument` when the queue or the
        partition is sealed. Callers check it before they wait for room: such a put
        never fits, however long it waits."""
        if self.closed:
            raise QueueClosed("the queue is closed; no rows can be put any more")
        if self.sealed_all:
            raise InvalidArgument(
                "the queue is sealed (seal() without a partition): no new rows; new fields of "
                "existing rows are still accepted")
        p = self.parts.get(partition)
        if partition in self.retired or (p is not None and p.sealed):
            raise InvalidArgument(
                f"partition {partition!r} is sealed; put new rows into another partition "
                "(a sealed partition only takes new fields of its existing rows)")

    def open_for_rows(self, partition: str) -> bool:
        """Whether new rows may still be put into ``partition`` (see :meth:`check_open`)."""
        if self.closed or self.sealed_all or partition in self.retired:
            return False
        p = self.parts.get(partition)
        return p is None or not p.sealed

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

    # ------------------------------------------------------------------ ids

    def unit_ids(self, shard: int, n: int) -> tuple[int, int]:
        """Lease ``n`` fresh row ids ``[start, end)`` to storage unit ``shard``: it names
        the rows of puts it admits itself (:meth:`allocate` with ``ids=``) before asking
        here. Ids are never reused, whether or not they are ever used."""
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"lease at least one id, got {n!r}")
        start = self._next_id
        self._next_id = start + n
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

    # ------------------------------------------------------------------ new rows

    def allocate(self, partition: str, n: int, fields: Sequence[str], *, nbytes: int = 0,
                 version: int | None = None, ids: Sequence[int] | None = None,
                 shard: int | None = None, dtypes: Mapping[str, str] | None = None,
                 admitted: bool = False) -> WriteToken:
        """Admit ``n`` new rows in ``partition`` whose ``fields`` are about to be written.

        With ``ids`` and ``shard``, the rows are the ones storage unit ``shard`` already
        stored under ids leased to it by :meth:`unit_ids`. ``dtypes`` (field -> dtype
        name) are checked against the dtypes the fields already have (see
        :meth:`check_dtypes`).

        Raises :class:`QueueFull` when they do not fit now (callers wait and retry),
        :class:`QueueClosed` after close, :class:`InvalidArgument` for a sealed partition
        (or for ``ids`` that are not the unit's next unused ones) and
        :class:`SchemaError` for a field given another dtype than it has.

        ``admitted``: the caller has just seen :meth:`admission` return ``None`` for these
        ``n`` rows, ``nbytes`` and ``version`` with no other call in between (the service's
        fast path), so it is not asked again.
        """
        p, version, ids, shards = self._admit(partition, n, nbytes, version, ids, shard,
                                              dtypes, admitted)
        pending = 0
        if self.filters:
            for name in self.filters:
                pending |= self._fbits[name]
        wmask = self._wmask(fields)
        born = self.clock()
        rows, prows = self.rows, p.rows
        if n == 1:  # (every one-row put)
            rid = ids[0]
            rows[rid] = prows[rid] = Row(rid, p, shards[0], version, born, None, 0, pending,
                                         wmask)
        else:
            for rid, s in zip(ids, shards):
                rows[rid] = prows[rid] = Row(rid, p, s, version, born, None, 0, pending, wmask)
        self.reserved_bytes += nbytes
        self.c_put += n
        p.put += n
        tid = self._next_token
        self._next_token = tid + 1
        tok = WriteToken(tid, ids, shards, fields if type(fields) is tuple else tuple(fields),
                         nbytes, True)
        self._tokens[tid] = tok
        heapq.heappush(self._token_heap, (born + self.lease_timeout, tid))
        if self.max_staleness is not None and version < self.version - self.max_staleness:
            # admitted and immediately stale: it will never be delivered
            self._drop_rows([self.rows[r] for r in ids], DropReason.STALE, group=True)
        return tok

    def admit_stored(self, partition: str, ids: Sequence[int], shard: int,
                     nbytes: Mapping[str, Sequence[int]], *, version: int | None = None,
                     dtypes: Mapping[str, str] | None = None, admitted: bool = False,
                     at_once_only: bool = False,
                     tags: Mapping[str, Sequence[Hashable]] | None = None
                     ) -> CommitResult | None:
        """Admit and commit, in one step, new rows that storage unit ``shard`` stored
        already under ``ids`` leased to it (:meth:`unit_ids`); ``nbytes``: per field,
        the bytes of each row; ``tags``: as :meth:`commit` takes them. The same as
        :meth:`allocate` (``ids``, ``shard``, ``admitted``) then :meth:`commit` at
        once, raising what :meth:`allocate` raises, without a write token between them
        where nothing needs one: rows of one shape (each field the same bytes in every
        row), no staleness bound, and a value in ``tags`` for each field
        that is a tag (a group key) of ``partition``'s rows; otherwise it does
        just that, or, with ``at_once_only``, nothing (``None``: the caller admits them
        with a write token, whose commit result it has to act on)."""
        n = len(ids)
        fields = tuple(nbytes)
        tmpl = (_uniform([(f, nbytes[f]) for f in fields])
                if self.max_staleness is None and (not (self.tag_fields or self.part_tags) or (
                    tags and not any(f not in tags and self._tagged(f, partition)
                                     for f in fields)))
                else None)
        if tmpl is None:
            if at_once_only:
                return None
            total = sum(sum(v) for v in nbytes.values())
            tok = self.allocate(partition, n, fields, nbytes=total, version=version,
                                ids=ids, shard=shard, dtypes=dtypes, admitted=admitted)
            return self.commit(tok, nbytes, tags)
        tsum = sum(tmpl.values())
        p, version, ids, shards = self._admit(partition, n, tsum * n, version, ids, shard,
                                              dtypes, admitted)
        born = self.clock()
        rows, prows = self.rows, p.rows
        pending = 0  # (every filter judges new rows: as allocate)
        if self.filters:
            for name in self.filters:
                pending |= self._fbits[name]
        if not tags:
            for rid in ids:
                rows[rid] = prows[rid] = Row(rid, p, shard, version, born, tmpl, tsum, pending)
        else:  # (commit's tags of new rows, inlined: each row in its groups)
            groups = p.groups
            given = []
            for f, vals in tags.items():
                byv = groups.get(f)
                if byv is None:
                    byv = groups[f] = {}
                given.append((f, vals, byv))
            for i, rid in enumerate(ids):
                rows[rid] = prows[rid] = row = Row(rid, p, shard, version, born, tmpl, tsum,
                                                   pending)
                mine = {}
                for f, vals, byv in given:
                    mine[f] = v = vals[i]
                    grp = byv.get(v)
                    if grp is None:
                        grp = byv[v] = {}
                    grp[rid] = None
                row.tags = mine
        added = tsum * n
        self.c_put += n
        p.put += n
        self.bytes_held += added
        self.c_bytes_put += added
        p.bytes_put += added
        if not pending:
            self._index_new(p, ids, tmpl.keys(), tags)  # (as _reindex would)
        else:  # (as commit: held back from requests of filters' fields until judged)
            objs = [rows[r] for r in ids]
            self._reindex(objs)
            self._filter_check(objs)
        if (tags or pending) and self._short_held:  # (as commit: a short group may be whole)
            self._recheck_short()
        return CommitResult({}, self.tags_of(p.name), {})

    def _admit(self, partition: str, n: int, nbytes: int, version: int | None,
               ids: Sequence[int] | None, shard: int | None,
               dtypes: Mapping[str, str] | None, admitted: bool
               ) -> tuple[Partition, int, list[int], list[int]]:
        """The checks of :meth:`allocate` (it says what raises) and the rows' ids and
        units: ``(partition, version, ids, shards)``."""
        if not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"a put needs at least one row, got {n!r}")
        self.check_open(partition)  # (before room: a sealed partition's put never fits)
        why = None if admitted else self.admission(n, nbytes, version)
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
        p = self._part(partition)  # (open: check_open above)
        if version is None:
            version = self.version
        elif not isinstance(version, int):
            raise InvalidArgument(f"version must be an int, got {version!r}")
        if dtypes:
            have = self.dtypes
            for f, d in dtypes.items():
                if have.get(f, d) != d:
                    self.check_dtypes(dtypes)  # raises, saying what to do
        if ids is None:
            start = self._next_id
            self._next_id = start + n
            ids = list(range(start, start + n))
            shards = self._place(n)
        else:
            block = (self._id_block(shard, ids) if shard is not None and len(ids) == n
                     and shard not in self.dead_shards else None)
            if block is None or shard is None:
                raise InvalidArgument(
                    f"rows {rows_preview(ids)} are not unused ids leased to storage unit "
                    f"{shard}; admit them without ids")
            block[0] = ids[-1] + 1  # used
            ids, shards = list(ids), [shard] * n
        if dtypes:
            self._learn_dtypes(dtypes)
        return p, version, ids, shards

    @staticmethod
    def _count_part_bytes(touched: list[Row], added: int, before: dict[int, int] | None
                          ) -> None:
        """Count the bytes a commit added in the partitions of its rows (``before``: the
        rows' bytes before a write to existing rows; ``None``: new rows, of one
        partition, that held nothing)."""
        if not touched:
            return
        if before is None:
            if added > 0:
                touched[0].part.bytes_put += added
            return
        by_part: dict[Partition, int] = {}
        for r in touched:
            by_part[r.part] = by_part.get(r.part, 0) + r.nbytes - before.get(r.id, 0)
        for p, n in by_part.items():
            if n > 0:
                p.bytes_put += n

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
        key = fields if type(fields) is tuple else tuple(fields)
        m = self._wmasks.get(key)
        if m is None:
            m = 0
            for f in key:
                m |= self._bit(self._field_bits, f)
            if len(self._wmasks) < 4096:  # (a cache of the field sets seen)
                self._wmasks[key] = m
        return m

    def _place(self, n: int) -> list[int]:
        """The storage unit of each of ``n`` new rows: all rows of one put go to one
        living unit, the next put to the next unit. A put's rows then stay one segment,
        so a batch that is a run of one put is read as one piece (no join copy); load
        spreads over units across puts (producers put many small batches)."""
        if not self.dead_shards:  # (every unit alive: the common case)
            shard = self._next_shard % self.num_shards
            self._next_shard = (shard + 1) % self.num_shards
            return [shard] * n
        live = [s for s in range(self.num_shards) if s not in self.dead_shards]
        if not live:
            from ..errors import TransportError

            raise TransportError("every storage unit of this queue is gone; create a new queue")
        shard = live[self._next_shard % len(live)]
        self._next_shard = (self._next_shard + 1) % len(live)
        return [shard] * n

    # ------------------------------------------------------------------ writes

    def begin_write(self, rows: Sequence[int], fields: Sequence[str], *,
                    overwrite: bool = False, dtypes: Mapping[str, str] | None = None,
                    write: int | None = None) -> WriteToken:
        """Admit a write of ``fields`` to existing ``rows``. ``write``: the token's id,
        chosen by the storage unit that stored the data already under it (a negative
        id, unique to that unit: see :meth:`streamrl.service.ControllerService.write_rows`);
        else the controller's next.

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
        tok = WriteToken(self._new_token_id() if write is None else write, list(rows),
                         [r.shard for r in objs], tuple(fields), overwrite=overwrite)
        self._track(tok)
        return tok

    def _new_token_id(self) -> int:
        tid = self._next_token
        self._next_token = tid + 1
        return tid

    def _track(self, tok: WriteToken) -> None:
        self._tokens[tok.id] = tok
        heapq.heappush(self._token_heap, (self.clock() + self.lease_timeout, tok.id))

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
        if self._short_held:  # a short group may be whole now
            self._recheck_short()
        if tok.new_rows:  # never put: neither counted as put nor as dropped
            self._drop_rows(live, None)
            self.c_put -= len(live)  # (rows that left meanwhile were counted as dropped)
            for r in live:
                r.part.put -= 1
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
        expired lease). An ``overwrite`` write is idempotent and stays. Rows already gone
        are skipped; a second retract of the same write does nothing. Returns what
        storage must forget (see :class:`Undo`), or ``None``."""
        if token.id in self._tokens:  # not committed after all: an abort
            return self.abort(token.id)
        if token.id in self._retracted:  # once
            return None
        self._retracted[token.id] = None
        if len(self._retracted) > LEASE_MEMORY:
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
        ended = []  # leases that ended here and repeat rows as padding
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
                        self._remember(lid, ["withdrawn", lease.withdrawn])
                        if lease.pads:
                            ended.append(lease)
            have = row.fields
            if not have.keys().isdisjoint(token.fields):
                row.fields = have = dict(have)  # (shared with other rows: see Row.fields)
            for f in token.fields:
                b = have.pop(f, None)
                if b is None:
                    continue
                row.nbytes -= b
                freed += b
                v = row.tags.pop(f, _MISSING)
                if v is not _MISSING:
                    self._ungroup(row, f, v)
            row.pending |= fmask
        self.bytes_held -= freed
        self.c_bytes_freed += freed
        self.space_freed = True
        self._reindex(live)
        # rows every consumer acked that only a lease they left kept are not needed
        self._drop_rows([r for r in live if self._consumed(r)], DropReason.CONSUMED)
        for p in {r.part for r in live}:
            self._wake_part(p.name)
        for lease in ended:  # (after the loop: this may drop rows)
            self._unpin(lease)
        if self._pins:  # DP shares that repeat these rows as padding lose them too
            self._withdraw_pads([r.id for r in live], fields)
        return Undo(token.id, frozenset(token.shards),
                    [(tuple(token.fields), _by_shard_of(live))])

    def commit(self, token: int | WriteToken, nbytes: Mapping[str, Sequence[int]],
               tags: Mapping[str, Sequence[Hashable]] | None = None) -> CommitResult:
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
        # a write to existing rows: their bytes before, for the bytes put per partition
        before = None if tok.new_rows else {r: self.rows[r].nbytes for r in tok.rows
                                            if r in self.rows}
        dead: dict[int, list[int]] = {}
        touched: list[Row] = []
        added = 0
        keep = ~self._wmask(tok.fields)
        sizes = [(f, nbytes[f]) for f in tok.fields if f in nbytes]
        nosize = [f for f in tok.fields if f not in nbytes]  # written with 0 bytes
        rows = self.rows
        # fields of the same bytes in every row (rows of one shape): new rows share one
        # dict of them, and so do rows that shared one before (see Row.fields)
        uni = _uniform(sizes)
        tmpl = uni if tok.new_rows and not nosize and not tags else None
        tsum = sum(tmpl.values()) if tmpl else 0
        src = new = None  # (with uni: the last row's dict before and after)
        dsum = 0
        fresh = list(tags.items()) if tags and tok.new_rows else None  # (tags of new rows)
        for i, rid in enumerate(tok.rows):
            row = rows.get(rid)
            if row is None:
                dead.setdefault(tok.shards[i], []).append(rid)
                continue
            row.writing &= keep
            have = row.fields
            if tmpl is not None and not have:
                row.fields = tmpl  # (one dict for the rows of one shape: see Row.fields)
                row.nbytes += tsum
                added += tsum
                touched.append(row)
                continue
            if have is src:  # (as the row before: the same new dict)
                row.fields = new  # type: ignore[assignment]
                row.nbytes += dsum
                added += dsum
            else:
                row.fields = mine = dict(have)  # (never changed in place: see Row.fields)
                delta = 0
                for f, col in sizes:  # (the hot loop of a put: kept flat)
                    b = int(col[i])
                    delta += b - have.get(f, 0)
                    mine[f] = b
                for f in nosize:
                    delta -= have.get(f, 0)
                    mine[f] = 0
                row.nbytes += delta
                added += delta
                if uni is not None:
                    src, new, dsum = have, mine, delta
            if tags:
                if fresh is not None and not row.tags:  # (_set_tag of a new row, inlined)
                    mine_t = {}
                    pg = row.part.groups
                    for f, vals in fresh:
                        v = vals[i]
                        mine_t[f] = v
                        byv = pg.get(f)
                        if byv is None:
                            byv = pg[f] = {}
                        grp = byv.get(v)
                        if grp is None:
                            grp = byv[v] = {}
                        grp[rid] = None
                    row.tags = mine_t
                else:
                    for f, vals in tags.items():
                        self._set_tag(row, f, vals[i])
            touched.append(row)
        self.bytes_held += added
        self.c_bytes_put += max(added, 0)
        if tok.reserved_bytes:
            self.space_freed = True
        self._count_part_bytes(touched, added, before)
        missing: dict[str, list[int]] = {}
        if self.tag_fields or self.part_tags:
            tagged = [f for f in tok.fields if f not in tags and (
                f in self.tag_fields or any(f in s for s in self.part_tags.values()))]
            for f in tagged:  # tags the writer did not give: the service reads them
                rows_ = [r.id for r in touched if self._tagged(f, r.part.name)]
                if rows_:
                    missing[f] = rows_
                    self._reading_tags(f, rows_)
        if not touched:
            scope = frozenset(self.tag_fields)
        else:
            first = touched[0].part
            if tok.new_rows or all(r.part is first for r in touched):
                scope = self.tags_of(first.name)
            else:
                scope = frozenset(self.tag_fields)
            if tmpl is not None and not dead and not self.filters:
                # new rows of one shape, no tag given, no filter: as admit_stored
                self._index_new(first, tok.rows, tmpl.keys())
            else:
                self._reindex(touched)
                if self.filters:
                    self._filter_check(touched)
        if self._short_held:  # a short group may be whole now
            self._recheck_short()
        return CommitResult(dead, scope, missing)


def _uniform(sizes: list[tuple[str, Sequence[int]]]) -> dict[str, int] | None:
    """``{field: bytes}`` when every row has the same bytes of each field (lists of
    ints, as the put paths send them), else ``None``."""
    out = {}
    for f, col in sizes:
        if type(col) is not list or not col:
            return None
        b = col[0]
        if type(b) is not int or col.count(b) != len(col):
            return None
        out[f] = b
    return out
