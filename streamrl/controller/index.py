"""The readiness index: derived from the rows, never saved.

Each distinct request shape (a *subscription*: task, fields, partition, grouping) keeps
an ordered set of its deliverable rows, updated when a write, lease, ack, filter verdict
or drop touches a row, so that taking a batch is O(batch) and never a scan. The order of
that set is the order rows became deliverable (commit order, a released row goes last):
it is queue order, the one thing about the index :meth:`Controller.state_dict` keeps.

This module also creates every other derived structure (:meth:`Index._init_index`), so
that what :meth:`Controller.load_state_dict` rebuilds is listed in one place.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, KeysView, Mapping, Sequence

from ..config import Request, validate_request
from ..errors import InvalidArgument
from .base import ControllerBase
from .state import _MISSING, Partition, Row


class _Sub:
    """One request shape and its index of deliverable rows."""

    __slots__ = ("key", "task", "fields", "partition", "group_by", "group_size", "avail",
                 "buckets", "complete", "gating", "tbit", "wake_at")

    def __init__(self, key: tuple, gating: int, tbit: int):
        self.key = key
        task, fields, partition, group_by, group_size = key  # see Request.sub_key
        self.task: str = task
        self.fields: frozenset[str] = fields
        self.partition: str | None = partition
        self.group_by: str | None = group_by
        self.group_size: int | None = group_size
        self.avail: dict[int, None] = {}  # deliverable rows, in the order they became so
        self.buckets: dict[tuple[str, Hashable], dict[int, None]] = {}  # (part, key) -> rows
        self.complete: dict[tuple[str, Hashable], None] = {}  # groups that may go out
        self.gating = gating  # bitmask of filters that must pass a row first
        self.tbit = tbit
        # deliverable rows at which a row that becomes deliverable wakes the
        # subscription's waiters (see Index.wake_at); 1: every such row wakes them
        self.wake_at = 1


class Index(ControllerBase):
    """Subscriptions and the readiness index (part of :class:`Controller`)."""

    def _init_index(self) -> None:
        """Every derived structure of the controller, empty (their types and what they
        hold: see :class:`.ControllerBase`)."""
        self.subs = {}
        self._subs_by_part = {}
        self._subs_by_task = {}
        self._cands = {}
        self._filter_ready = {}
        self._lease_heap = []
        self._token_heap = []
        self._dispatchers = {}
        self._wmasks = {}
        self._tag_reads = {}
        self._short_held = set()
        self._unsettled = {}
        self._unsettled_stamp = (-1, -1, -1)
        self._tag_epoch = 0
        self._pins = {}

    def validate_request(self, req: Request) -> None:
        """Raise :class:`InvalidArgument` for a request that can never be served."""
        validate_request(req)
        sampler = self._sampler_of(req)  # an unknown sampler name raises here
        if req.balance_by and req.dp_size > 1 and not sampler.balances:
            raise InvalidArgument(
                f"balance_by={req.balance_by!r} needs a sampler whose DP split balances "
                f"ranks, and {sampler!r} does not; derive it from "
                "streamrl.sampling.BalancedSampler, or drop balance_by")

    def request_tags(self, req: Request) -> list[str]:
        """Tag fields a request relies on (group key, balance key, its sampler's fields),
        registered yet or not."""
        out = [f for f in (req.group_by, req.balance_by) if f]
        for f in self._sampler_of(req).fields:
            if f not in out:
                out.append(f)
        return out

    def tags_needed(self, req: Request) -> list[str]:
        """Tag fields a request relies on (group key, balance key, its sampler's fields)
        not registered yet."""
        return [f for f in self.request_tags(req) if not self._tagged(f, req.partition)]

    def _sub(self, req: Request) -> _Sub:
        key = req.sub_key()
        sub = self.subs.get(key)
        if sub is None and req.partition in self.retired:
            # a finished partition: an empty, unregistered subscription (it has ended)
            return _Sub(key, 0, self._bit(self._tbits, req.task))
        if sub is None:
            for f in self.tags_needed(req):
                self._tag_scope(f, req.partition)
            sub = self._new_sub(key)
            rows = (self.parts[sub.partition].rows.values() if sub.partition in self.parts
                    else ()) if sub.partition is not None else self.rows.values()
            for row in rows:
                if self._eligible(row, sub):
                    self._add(sub, row)
        return sub

    def _new_sub(self, key: tuple) -> _Sub:
        """Register an empty subscription."""
        sub = _Sub(key, self._gating(key[1]), self._bit(self._tbits, key[0]))
        self.subs[key] = sub
        self._subs_by_part.setdefault(sub.partition, []).append(sub)
        self._subs_by_task.setdefault(sub.task, []).append(sub)
        self._cands.clear()
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
        if not sub.fields <= row.fields.keys():
            return False
        if sub.group_by is not None and sub.group_by not in row.tags:
            return False
        if (row.pending | row.judging) & sub.gating:
            return False
        return True

    def wake_at(self, key: tuple, n: int) -> None:
        """Wake the waiters of subscription ``key`` when rows become deliverable only once
        it holds ``n`` deliverable rows (the smallest batch one of them waits for), or
        when its partition (or the queue) is sealed or closed, where a short batch may
        go out. Ends, seals, acks and drops wake them as before (:meth:`_wake_part`).
        Only for ungrouped subscriptions, and only until the caller sets it back to 1
        (:meth:`Controller.load_state_dict` makes new subscriptions: 1 again)."""
        sub = self.subs.get(key)
        if sub is not None:
            sub.wake_at = n if sub.group_by is None else 1

    def rows_to_wake(self, keys: Iterable[tuple], partition: str) -> int:
        """The fewest new rows of ``partition`` that could wake a waiter of one of the
        subscriptions ``keys``: its deliverable rows reaching the batch it waits for
        (:meth:`wake_at`). 1 for a grouped subscription (one row may complete a group)
        or one not known here; ``1 << 62`` when none takes rows of ``partition``. It
        may say fewer than it takes, never more: rows that would not be deliverable to a
        subscription (other fields, held back by a filter) count as if they were."""
        best = 1 << 62
        subs = self.subs
        for key in keys:
            sub = subs.get(key)
            if sub is None or sub.group_by is not None:
                return 1
            if sub.partition is not None and sub.partition != partition:
                continue
            need = sub.wake_at - len(sub.avail)
            if need <= 1:
                return 1
            if need < best:
                best = need
        return best

    def _add(self, sub: _Sub, row: Row) -> None:
        if sub.group_by is None:
            avail = sub.avail
            avail[row.id] = None
            if (len(avail) >= sub.wake_at or row.part.sealed or self.closed
                    or self.sealed_all):
                self.woken.add(sub.key)
            return
        self._check_complete(sub, self._bucket(sub, row))
        self.woken.add(sub.key)

    @staticmethod
    def _bucket(sub: _Sub, row: Row) -> tuple:
        """Put ``row`` in its group's bucket of grouped ``sub`` (and in ``avail``);
        returns the group's key. Whether the group is whole is the caller's to check."""
        gk = (row.part.name, row.tags[sub.group_by])  # type: ignore[index]
        b = sub.buckets.get(gk)
        if b is None:  # (not setdefault: that makes a dict each call)
            b = sub.buckets[gk] = {}
        rid = row.id
        b[rid] = None
        sub.avail[rid] = None
        return gk

    def _remove(self, sub: _Sub, row: Row) -> None:
        """Take ``row`` (which ``sub`` holds) out of ``sub``."""
        if sub.group_by is None:
            del sub.avail[row.id]
        else:
            self._remove_many(sub, [row])

    def _remove_many(self, sub: _Sub, rows: list[Row]) -> None:
        """Take those of ``rows`` that grouped ``sub`` holds out of it, each group they
        leave checked once at the end (a take of whole groups empties their buckets:
        no check at all), not once a row."""
        avail = sub.avail
        gb = sub.group_by
        assert gb is not None  # (grouped only: see _remove)
        buckets = sub.buckets
        left: dict[tuple, None] = {}  # groups that lost members and still have some
        for row in rows:
            rid = row.id
            if rid not in avail:
                continue
            del avail[rid]
            gk = (row.part.name, row.tags.get(gb, _MISSING))
            b = buckets.get(gk)
            if b is not None:
                b.pop(rid, None)
                if b:
                    left[gk] = None
                else:
                    del buckets[gk]
                    sub.complete.pop(gk, None)
                    left.pop(gk, None)
        for gk in left:
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
        assert sub.group_by is not None  # (only grouped subscriptions have groups)
        # sealed: complete when every live row of the key that the task still owes is here
        members = p.groups.get(sub.group_by, {}).get(gk[1], {})
        owed = sum(1 for r in members if not self.rows[r].acked & sub.tbit)
        # ... and no write admitted before the seal can add a member
        return len(bucket) >= owed and self._none_coming(p, sub.group_by)

    def _reindex(self, rows: Iterable[Row], tasks: Iterable[str] | None = None) -> None:
        """Re-evaluate ``rows`` against subscriptions (of ``tasks`` only, if given)."""
        if not self.subs:
            return
        last = None
        cands: list[_Sub] = []
        # ungrouped subscriptions that gained rows: whether one of those rows' partitions
        # is sealed
        grew: dict[_Sub, bool] = {}
        # grouped subscriptions' groups that gained rows: looked at once each, after
        # (a group's rows come together: one check, not one a row)
        gained: dict[tuple[_Sub, tuple], None] = {}
        for row in rows:
            part = row.part
            if part is not last:  # (rows come in runs of one partition)
                last = part
                cands = self._candidates(part.name)
                if tasks is not None:
                    cands = [sub for sub in cands if sub.task in tasks]
            rid = row.id
            for sub in cands:  # (_eligible and _add, inlined: the hot loop of a commit)
                ok = (not row.acked & sub.tbit and sub.task not in row.leased
                      and sub.fields <= row.fields.keys()
                      and (sub.group_by is None or sub.group_by in row.tags)
                      and not (row.pending | row.judging) & sub.gating)
                if ok:
                    if rid not in sub.avail:
                        if sub.group_by is None:
                            sub.avail[rid] = None
                            grew[sub] = grew.get(sub, False) or part.sealed
                        else:  # (_add, its check of the group deferred)
                            gained[(sub, self._bucket(sub, row))] = None
                elif rid in sub.avail:
                    self._remove(sub, row)
        for sub, gk in gained:
            self._check_complete(sub, gk)
            self.woken.add(sub.key)
        for sub, sealed in grew.items():  # (whether to wake: as _add decides)
            if len(sub.avail) >= sub.wake_at or sealed or self.closed or self.sealed_all:
                self.woken.add(sub.key)

    def _index_new(self, p: Partition, ids: list[int], fields: KeysView[str],
                   tags: Mapping[str, Sequence[Hashable]] | None = None) -> None:
        """Index new rows ``ids`` of partition ``p`` that all hold ``fields``, whose tags
        are ``tags`` (per tag field, each row's value, in order; ``None``: no tag) and
        that have no filter to wait for (nobody leased or acknowledged them yet): what
        :meth:`_reindex` does for such rows, in one step per subscription (each
        ungrouped subscription whose fields they hold takes them all; a grouped one
        takes them into their groups' buckets if they have its group key, else none)."""
        for sub in self._candidates(p.name):
            if not sub.fields <= fields:
                continue
            avail = sub.avail
            if sub.group_by is None:
                avail.update(dict.fromkeys(ids))
                if (len(avail) >= sub.wake_at or p.sealed or self.closed
                        or self.sealed_all):
                    self.woken.add(sub.key)
                continue
            vals = tags.get(sub.group_by) if tags else None
            if vals is None:
                continue
            # (_bucket, inlined; each group gained checked once, after: as _reindex)
            buckets = sub.buckets
            name = p.name
            gained: dict[tuple, None] = {}
            for rid, v in zip(ids, vals):
                gk = (name, v)
                b = buckets.get(gk)
                if b is None:
                    b = buckets[gk] = {}
                b[rid] = None
                avail[rid] = None
                gained[gk] = None
            for gk in gained:
                self._check_complete(sub, gk)
            self.woken.add(sub.key)

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

    def _wake_groups(self, name: str, left: Collection[tuple[str, Hashable]]) -> None:
        """:meth:`_wake_part` after rows of sealed (or closed) partition ``name`` were
        dropped, acknowledged or given back, members of the groups ``left`` names
        (``(tag, value)``): only those groups are looked at again. A group of a sealed
        partition is whole once every member the task still owes is ready (see
        :meth:`_group_complete`), so a drop or an ack changes that for the groups of
        its rows alone; a drop that settles the partition's keys (the last write that
        could add a member) is :meth:`_recheck_short`'s. :meth:`_wake_part` looks at
        every group: with many groups held, a drain paid for all of them at every
        batch."""
        for sub in self._candidates(name):
            if sub.group_by is not None:
                for f, v in left:
                    if f == sub.group_by:
                        self._check_complete(sub, (name, v))
            self.woken.add(sub.key)
