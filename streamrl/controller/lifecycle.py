"""How rows and partitions end: consumer sets, seal and close, drop and clear, staleness,
and storage units that died. Every removal of a row goes through :meth:`_drop_rows`."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidArgument
from ..messages import DropReason
from .base import ControllerBase
from .state import _MISSING, Partition, Row, _consumers
from .leases import _ended

if TYPE_CHECKING:
    from .index import _Sub
    from .leases import _Lease


class Lifecycle(ControllerBase):
    """Partitions' ends and rows' removal (part of :class:`Controller`)."""

    def declare(self, partition: str, consumers: Sequence[str] | None) -> None:
        """Set the tasks that must acknowledge each row of ``partition`` before it is
        dropped automatically (``None`` turns automatic cleanup off for it). Rows already
        acknowledged by all of them are dropped now. A finished partition (sealed,
        drained and forgotten) has nothing to clean up: declaring it does nothing."""
        tasks = _consumers(consumers)
        if isinstance(partition, str) and partition in self.retired:
            return
        p = self._part(partition)
        p.consumers = tasks
        p.cmask = self._mask(p.consumers)
        if p.cmask:
            self._drop_rows([r for r in p.rows.values() if self._consumed(r)],
                            DropReason.CONSUMED)
        self._maybe_retire(p)  # (first named after the whole queue was sealed: finished)

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

    def seal(self, partition: str) -> None:
        """No new rows will be added to ``partition``; streams over it end once drained."""
        if partition in self.retired:
            return
        p = self._part(partition)
        if not p.sealed:
            p.sealed = True
            self.changed.add(p.name)
            self._wake_part(p.name)
            self._judge_short_groups(p.name)
        self._maybe_retire(p)  # (also one first named after the whole queue was sealed)

    def _judge_short_groups(self, partition: str | None) -> None:
        """No row can join a group of ``partition`` (``None``: of any) any more: grouped
        filters judge groups without a group_size, and short last groups of one, once
        every member is ready."""
        for spec in self.filters.values():
            if spec.group_by:
                for (pname, key) in list(self._filter_ready.get(spec.name, {})):
                    p = self.parts.get(pname)
                    if p is not None and partition in (None, pname):
                        self._maybe_filter_job(spec, p, key)

    def _maybe_retire(self, p: Partition) -> None:
        """Forget a sealed partition once its last row has left, so that a long run with
        a partition per step keeps no state per finished step."""
        if not p.sealed or p.rows or self.parts.get(p.name) is not p:
            return
        del self.parts[p.name]
        for task, h in p.counts.delivery.items():  # kept in the task's histogram
            self.h_delivery[task] = h.merge(self.h_delivery[task]) if task in self.h_delivery \
                else h
        self.part_tags.pop(p.name, None)
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
            for name in list(self.parts):  # short last groups are complete now
                self._wake_part(name)
            self._judge_short_groups(None)

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
        # the groups members left, per partition: (tag, value) (see _wake_groups)
        left: dict[Partition, set[tuple[str, Hashable]]] = {}
        # grouped filters to look at again: (filter, partition, the row's tags)
        regroup: list[tuple[str, Partition, dict[str, Hashable]]] = []
        ended: list[_Lease] = []  # leases that ended here and repeat rows as padding
        last = None
        deletes = self.deletes
        names: dict[int, list[str]] = {}  # acked mask -> its tasks
        # the run of rows of one partition (``last``): rows and bytes dropped, acked mask
        # -> rows dropped with it; counted when the run ends (see _end_run)
        k = kb = 0
        packed: dict[int, int] = {}
        pa = pn = 0  # the run of rows of one acked mask (``pa``), counted into packed
        plain: list[dict[int, None]] = []  # the partition's ungrouped subscriptions' rows
        grouped: list = []
        dshard = -1  # the storage unit of the last row and its list of deletes
        dlist: list[int] = []
        pop = self.rows.pop
        for row in objs:
            rid = row.id
            if pop(rid, None) is None:
                continue
            p = row.part
            if p is not last:  # (rows come in runs of one partition)
                if last is not None:
                    freed += kb
                    gone += k
                    self._end_run(last, reason, k, kb, packed, names, pa, pn)
                last, k, kb, packed, pn = p, 0, 0, {}, 0
                cands = self._candidates(p.name)
                plain = [s.avail for s in cands if s.group_by is None]
                grouped = [s for s in cands if s.group_by is not None]
                parts.add(p)
            del p.rows[rid]
            acked = row.acked
            if acked:  # (rows acked by the same tasks come in runs: counted per run)
                if acked == pa:
                    pn += 1
                else:
                    if pn:
                        packed[pa] = packed.get(pa, 0) + pn
                    pa, pn = acked, 1
            if row.tags:
                for f, v in row.tags.items():
                    byv = p.groups.get(f)  # (not .get(f, {}): that makes a dict a row)
                    if byv is not None:
                        grp = byv.get(v)
                        if grp is not None:
                            grp.pop(rid, None)
                            if not grp:
                                del byv[v]
                    if p.sealed or self.closed:  # (see _wake_groups)
                        lp = left.get(p)
                        if lp is None:
                            lp = left[p] = set()
                        lp.add((f, v))
            for avail in plain:  # (_unindex, inlined)
                if rid in avail:
                    del avail[rid]
            for sub in grouped:
                if rid in sub.avail:
                    self._remove(sub, row)
            if row.leased:
                for task, lid in row.leased.items():
                    lease = self.leases.get(lid)
                    if lease is not None:
                        lease.rows.remove(rid)
                        if not lease.rows:
                            del self.leases[lid]
                            # (its ack still names rows a retract took from it)
                            self._remember(lid, _ended(lease))
                            if lease.pads:
                                ended.append(lease)
            if row.pending or row.judging:
                for name in self._names(self._fbits, row.pending | row.judging):
                    buckets = self._filter_ready.get(name)
                    if buckets:
                        _unbucket(buckets, (rid,))
                    if row.pending & self._fbits[name] and p.sealed:
                        regroup.append((name, p, row.tags))
            k += 1
            kb += row.nbytes
            if row.shard != dshard:
                dshard = row.shard
                dlist = deletes.get(dshard)  # type: ignore[assignment]
                if dlist is None:
                    dlist = deletes[dshard] = []
            dlist.append(rid)
        if last is not None:
            freed += kb
            gone += k
            self._end_run(last, reason, k, kb, packed, names, pa, pn)
        self.bytes_held -= freed
        self.c_bytes_freed += freed
        if reason is not None:
            self.c_dropped[reason] = self.c_dropped.get(reason, 0) + gone
            self.c_bytes_dropped[reason] = self.c_bytes_dropped.get(reason, 0) + freed
        self.space_freed = True
        for name, p, tags in regroup:
            # a member the filter still awaited left: the rest of its group may go now
            spec = self.filters[name]
            key = tags.get(spec.group_by, _MISSING) if spec.group_by else _MISSING
            if key is not _MISSING and self.parts.get(p.name) is p:
                self._maybe_filter_job(spec, p, key)
        for lease in ended:  # (after the loop: this may drop rows)
            self._unpin(lease)
        if self._pins:  # rows DP shares repeat as padding leave those shares too
            self._unpad([r.id for r in objs if r.id in self._pins])
        # a row gone is no member to wait for any more (see Groups._key_unsettled)
        self._tag_epoch += 1
        if self._short_held:
            self._recheck_short()
        for p in parts:
            self.changed.add(p.name)
            if p.sealed or self.closed:  # end and group-completeness conditions moved
                self._wake_groups(p.name, left.get(p, ()))
            self._maybe_retire(p)

    def _end_run(self, p: Partition, reason: str | None, k: int, kb: int,
                 packed: dict[int, int], names: dict[int, list[str]], pa: int = 0,
                 pn: int = 0) -> None:
        """``k`` rows (``kb`` bytes) of partition ``p`` were dropped (``packed``: their
        acked masks -> rows, and ``pn`` more of mask ``pa``, the run counted last):
        count them in the partition."""
        if reason is not None and k:
            p.counts.drop(reason, k, kb)
        if pn:
            packed[pa] = packed.get(pa, 0) + pn
        if packed:
            self._unack(p, packed, names)

    def _unack(self, p: Partition, packed: dict[int, int], names: dict[int, list[str]]
               ) -> None:
        """Rows of ``p`` that tasks had acked left (``packed``: acked mask -> rows): the
        partition's counts of live rows each task acked go down by as many."""
        for acked, k in packed.items():
            tasks = names.get(acked)
            if tasks is None:
                tasks = names[acked] = self._names(self._tbits, acked)
            for task in tasks:
                p.acked[task] -= k

    def _with_groups(self, objs: list[Row]) -> list[Row]:
        """``objs`` plus every row sharing a group key (any registered group tag) with
        one of them, so groups leave together."""
        keys = {s.group_by for s in self.subs.values() if s.group_by}
        keys |= {s.group_by for s in self.filters.values() if s.group_by}
        if self.group_key is not None:
            keys.add(self.group_key)
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


def _unbucket(buckets: dict[tuple, dict[int, None]], rids) -> None:
    """Take ``rids`` out of a filter's buckets of rows waiting to be judged; a bucket
    left empty goes (it would come back at the end when a row arrives)."""
    empty = []
    for key, b in buckets.items():
        for r in rids:
            b.pop(r, None)
        if not b:
            empty.append(key)
    for key in empty:
        del buckets[key]
