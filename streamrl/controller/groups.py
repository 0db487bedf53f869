"""Tags, groups and filters.

A *tag* is the scalar value of a registered field per row (a group key, a length, a
sampler's priority); rows sharing a tag value are a *group* of their partition. A
*filter* must pass a row before it is delivered to a task asking for any of the filter's
fields; the controller queues *filter jobs* (row sets to judge, whole groups for grouped
filters) and records their verdicts.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence

from ..errors import InvalidArgument
from ..messages import DropReason, FilterJob, FilterSpec
from .base import ControllerBase
from .lifecycle import _unbucket
from .state import _MISSING, Partition, Row


class Groups(ControllerBase):
    """Tags, groups and filters (part of :class:`Controller`)."""

    # ------------------------------------------------------------------ tags

    def register_tag(self, field: str, partition: str | None = None) -> dict[int, list[int]]:
        """Keep the scalar value of ``field`` per row (for grouping or balancing) of
        ``partition`` (``None``: of every partition). Returns rows (per shard) in that
        scope that already have the field but no tag: the caller reads their values from
        storage and passes them to :meth:`set_tags`."""
        self._tag_scope(field, partition)
        rows: Iterable[Row]
        if partition is None:
            rows = self.rows.values()
        else:
            p = self.parts.get(partition)
            rows = p.rows.values() if p is not None else ()
        out: dict[int, list[int]] = {}
        for r in rows:
            if field in r.fields and field not in r.tags:
                out.setdefault(r.shard, []).append(r.id)
        for rids in out.values():
            self._reading_tags(field, rids)
        return out

    def set_tags(self, field: str, rows: Sequence[int], values: Sequence[Hashable]) -> None:
        """Record the tag ``field`` of ``rows`` (rows gone meanwhile are skipped)."""
        touched = []
        for rid, v in zip(rows, values):
            row = self.rows.get(rid)
            if row is not None:
                self._set_tag(row, field, v)
                touched.append(row)
        reads = self._tag_reads.get(field)
        if reads:
            reads.difference_update(rows)
            self._tag_epoch += 1
        if touched:
            self._reindex(touched)
            self._filter_check(touched)
        if self._short_held:
            self._recheck_short()

    def _set_tag(self, row: Row, f: str, v: Hashable) -> None:
        old = row.tags.get(f, _MISSING)
        if old is not _MISSING:
            if old == v:
                return
            self._ungroup(row, f, old)
        if row.tags:
            row.tags[f] = v
        else:  # (not the empty dict every row starts with: see Row.tags)
            row.tags = {f: v}
        byv = row.part.groups.get(f)  # (not setdefault(f, {}): a dict made each call)
        if byv is None:
            byv = row.part.groups[f] = {}
        grp = byv.get(v)
        if grp is None:
            grp = byv[v] = {}
        grp[row.id] = None

    @staticmethod
    def _ungroup(row: Row, f: str, v: Hashable) -> None:
        """Take ``row`` out of its partition's group ``v`` of tag ``f``."""
        grp = row.part.groups.get(f, {}).get(v)
        if grp is not None:
            grp.pop(row.id, None)
            if not grp:
                del row.part.groups[f][v]

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
        live = self.rows
        for spec in specs:
            buckets = self._filter_ready[spec.name]
            fbit = self._fbits[spec.name]
            new_keys: dict[tuple, Partition] = {}
            fields, gb = spec.fields, spec.group_by
            have: dict | None = None  # (rows of one shape share their fields' dict)
            ok = False
            for row in rows:
                if not row.pending & fbit or row.id not in live:
                    continue
                if row.fields is not have:
                    have = row.fields
                    ok = fields <= have.keys()
                if not ok:
                    continue
                if gb:
                    v = row.tags.get(gb, _MISSING)
                    if v is _MISSING:
                        continue
                    key = (row.part.name, v)
                else:
                    key = (row.part.name, None)
                b = buckets.get(key)  # (not setdefault(key, {}): a dict made a row)
                if b is None:
                    b = buckets[key] = {}
                b[row.id] = None
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
            elif (p.sealed or self.closed) and self._whole(spec, p, gkey, b):
                self._emit_job(spec, list(b))
                del self._filter_ready[spec.name][key]
        elif (p.sealed or self.closed) and self._whole(spec, p, gkey, b):
            self._emit_job(spec, list(b))
            del self._filter_ready[spec.name][key]

    def _whole(self, spec: FilterSpec, p: Partition, gkey: Hashable, b: dict[int, None]) -> bool:
        """Whether the rows ``b`` of group ``gkey`` of sealed partition ``p`` that have a
        grouped filter's fields are all of the group it will ever judge: every member
        waiting for the filter is among them, and no write admitted before the seal may
        still add a member."""
        assert spec.group_by is not None
        fbit = self._fbits[spec.name]
        members = p.groups.get(spec.group_by, {}).get(gkey, {})
        waiting = sum(1 for r in members if self.rows[r].pending & fbit)
        return len(b) >= waiting and self._none_coming(p, spec.group_by)

    def _none_coming(self, p: Partition, f: str) -> bool:
        """Whether no write admitted before ``p``'s seal can still add a member to a
        group of tag ``f`` there (see :meth:`_key_unsettled`); if one can, ``p``'s short
        groups are looked at again when it ends (:meth:`_recheck_short`)."""
        if self._key_unsettled(p, f):
            self._short_held.add(p.name)
            return False
        return True

    def _key_unsettled(self, p: Partition, f: str) -> bool:
        """Whether a row of ``p`` may still get a value of tag ``f`` from a write that is
        already admitted: a write of ``f`` to one of its rows is in flight (admitted, not
        committed nor aborted), or one was committed without the value, which is being
        read from storage (:meth:`commit`'s ``missing_tags``, :meth:`register_tag`).

        Sealing a partition stops new rows, not writes admitted before it: a short group
        of a sealed partition is whole (judged by a grouped filter, sent by a grouped
        stream) only once this is false, so that a put that lands after the seal is not
        judged or delivered apart from its group. Cached until a write is admitted or
        ends or a tag read changes (none of that happens between the checks of one
        call)."""
        stamp = (self._next_token, len(self._tokens), self._tag_epoch)
        if stamp != self._unsettled_stamp:
            self._unsettled_stamp = stamp
            self._unsettled.clear()
        hit = self._unsettled.get((p.name, f))
        if hit is not None:
            return hit
        rows = self.rows
        out = False
        for tok in self._tokens.values():
            if f not in tok.fields:
                continue
            for rid in tok.rows:
                r = rows.get(rid)
                if r is not None:
                    if r.part is p:
                        out = True
                        break
                    if tok.new_rows:  # (new rows of one write share one partition)
                        break
            if out:
                break
        if not out:
            reads = self._tag_reads.get(f)
            if reads:
                for rid in list(reads):
                    r = rows.get(rid)
                    if r is None or f in r.tags:
                        reads.discard(rid)  # (gone, or its value came)
                    elif r.part is p:
                        out = True
                        break
        self._unsettled[(p.name, f)] = out
        return out

    def _reading_tags(self, f: str, rows: Iterable[int]) -> None:
        """Rows whose value of tag ``f`` the service is about to read (and set)."""
        self._tag_reads.setdefault(f, set()).update(rows)
        self._tag_epoch += 1

    def tags_unread(self, field: str, rows: Sequence[int]) -> None:
        """The values of tag ``field`` of ``rows`` could not be read (:meth:`set_tags`
        will not come for them): stop holding back short groups of their partitions
        for them."""
        reads = self._tag_reads.get(field)
        if reads:
            reads.difference_update(rows)
            self._tag_epoch += 1
            if self._short_held:
                self._recheck_short()

    def _recheck_short(self) -> None:
        """Look again at the short groups of sealed partitions held back while a member
        could still come (a write or a tag read ended): grouped subscriptions whose
        group is whole now wake, grouped filters queue their jobs."""
        names = list(self._short_held)
        self._short_held.clear()
        for name in names:
            p = self.parts.get(name)
            if p is None:
                continue
            for sub in self._candidates(name):
                if sub.group_by is None:
                    continue
                for gk in [gk for gk in sub.buckets if gk[0] == name]:
                    was = gk in sub.complete
                    self._check_complete(sub, gk)
                    if not was and gk in sub.complete:
                        self.woken.add(sub.key)
            for spec in self.filters.values():
                if spec.group_by:
                    for key in [k for k in self._filter_ready.get(spec.name, {})
                                if k[0] == name]:
                        self._maybe_filter_job(spec, p, key[1], key)

    def _emit_job(self, spec: FilterSpec, rids: list[int]) -> None:
        fbit = self._fbits[spec.name]
        rows = self.rows
        shards = []
        for r in rids:
            row = rows[r]
            row.pending &= ~fbit
            row.judging |= fbit
            shards.append(row.shard)
        job = FilterJob(self._next_job, spec.name, rids, shards, tuple(sorted(spec.fields)))
        self._next_job += 1
        self._jobs[job.id] = job
        self.filter_jobs.append(job)

    def filter_done(self, job_id: int, keep: Sequence[bool] | None, *, error: bool = False) -> int:
        """Record a filter verdict: ``keep[i]`` for the job's i-th row. Rejected rows (all
        of them when ``error``) are dropped. Returns how many were dropped."""
        if keep is None and not error:  # (before any change: the job stays pending)
            raise InvalidArgument("filter_done needs keep, a verdict per row, unless error=True")
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
            assert keep is not None  # (checked above)
            verdict = dict(zip(job.rows, keep))
            rejected = [r for r in live if not verdict[r.id]]
            self.c_filtered_by[job.filter] = self.c_filtered_by.get(job.filter, 0) + len(rejected)
            self.c_bytes_filtered_by[job.filter] = (self.c_bytes_filtered_by.get(job.filter, 0)
                                                    + sum(r.nbytes for r in rejected))
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

    def job_live(self, job_id: int) -> bool:
        """Whether a filter job still waits for its verdict (not withdrawn)."""
        return job_id in self._jobs

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
        for name in self.filters:
            if self._fbits[name] & fmask:
                _unbucket(self._filter_ready[name], rids)
        if again:
            self._filter_check(again)
