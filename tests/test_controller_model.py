"""The controller against a model of it that keeps one record per row.

A hypothesis state machine drives :class:`streamrl.controller.Controller` and a plain
per-row model side by side: new rows (committed at once or later, or aborted), writes
of new fields to existing rows (committed, aborted or taken back), takes, acks,
releases, drops, seals and clears over two partitions and two declared consumers (a
consumer set changed mid-run, the whole queue sealed, the queue closed, a storage unit
lost, the state saved and loaded into a new controller), a
bound in rows and one in bytes, a clock that expires leases and writes, groups (a
third task takes whole groups of rows sharing a key, put at once or in pieces),
staleness (puts stamped with a policy version, some already too old; the version moves
on; a queue bound drawn per run and a request's own bound) and filters (one judging
rows one by one, one judging whole groups; the test plays the service that runs their
jobs and answers with a verdict per row, per group, or an error).
After every step the two must agree on which rows are held, which fields each has
ready, each row's version, the bytes held, the live leases and their rows, the rows
deleted from storage, the rows dropped as stale, filtered or by a failed filter, and
the rows each filter has still to judge; every take must hand out only rows the model
finds deliverable to that task (a filter that gates its fields has passed them), a full
batch whenever the model has one, and the end of a sealed partition only once nothing
of it is left for the task. A stale row leaves with every row of its group, and so does
a group a grouped filter rejects. Every filter job must be rows the filter has not
judged and that have its fields (for a grouped filter: all of one group, whole unless
its partition is sealed), and no filter may hold back a job it could queue.

Two DP tasks (one of single rows, one of whole groups, balanced on the group key or on
row counts) take in dispatches over two ranks: ranks out of step, in step, and at the end
of a step (its partition sealed, the last dispatches a tail that errors, drops or pads).
Each dispatch must be ``ranks * batch_size`` deliverable rows (whole groups), split into
disjoint shares of as many units each (every row in exactly one, padding only repeating
rows of the dispatch), balanced (with the loose byte bound of some runs, a rule makes
grouped dispatches of two groups a rank, enough for a bad split to show), the shares of the other ranks reserved (leased,
unclaimed) until their rank asks; a share that expired first raises ``DispatchError``
for its rank and its rows come again, as do those of a share given back; a share whose
rows were dropped before its rank asked gives what is left of it (``DispatchError`` if
nothing is); rows dropped as a remainder are counted. In some runs the task of single
rows asks for ``y`` too, and a write of ``y`` taken back takes its rows from the shares
that hold them or repeat them as padding (the ack names them). Writes with ``overwrite=True`` of fields rows have never raise
``DuplicateField``, keep the rows ready, and leave the new bytes held (an abort keeps the
old value, a retract changes nothing).

This is the reference a change of the controller's internals (rows kept as runs, see
docs/scaling.md) is checked against: the model is per row on purpose.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from streamrl.controller import END, Controller, Delivery, FilterSpec, Request
from streamrl.controller import state
from streamrl.errors import (DispatchError, DuplicateField, InvalidArgument, LeaseExpired,
                             QueueClosed, QueueFull, RowsDropped, StreamTimeout)

CAPACITY = 16
#: the byte bound, drawn per run: one that binds before the row bound (16 rows of x and
#: y are 192 bytes), and one loose enough for a grouped DP dispatch of four groups (with
#: the tight one it holds at most two, one a rank, too few for a bad split to show)
CAPACITY_BYTES = (120, 120, 400)
#: seconds a lease (or an admitted write) lives without an ack (a commit)
LEASE_TIMEOUT = 10.0
TASKS = ("a", "b")
PARTS = ("p", "p", "q")  # (p more often: rows there meet their takes)
#: bytes of each field in every row (rows of one shape, as most puts are)
SIZES = {"x": 8, "y": 4, "z": 2, "uid": 8}
#: rows per group of the grouped task, which is not a declared consumer: its acks drop
#: nothing, and it never takes ungrouped batches (a group it took row by row would be
#: neither whole nor split)
GROUP = 2
GROUPED = "g"
#: a rule that ends rows or leases acts in one draw of four, so that rows live long
#: enough to be taken and acknowledged by both tasks
RARELY = st.integers(0, 3).map(lambda i: i == 0)
#: most writes commit at once; the others stay in flight until a later step
MOSTLY = st.integers(0, 3).map(lambda i: i > 0)
#: the queue's staleness bound, drawn per run (``None``: no bound)
STALENESS = (None, 1, 2)
#: the policy version a run starts at (so that puts of older rows happen from the start)
VERSION = 3
#: how many versions older than the current one the rows of a put are (``None``: the
#: put names no version and gets the current one; -1: one ahead, which nothing holds
#: back); the rows of a group all have the version of its first put
AGES = st.sampled_from([None, None, 0, 0, 1, 2, 3, -1])
#: the filters the service may register, each once: one judges rows one by one on a
#: field written late; the other judges whole groups on their key, so that it gates
#: only the grouped task (rows of no group never get the key: such a filter would hold
#: them back from every task asking for its field for ever)
FILTERS = {
    "fy": FilterSpec("fy", frozenset({"y"})),
    "fg": FilterSpec("fg", frozenset({"uid"}), group_by="uid", group_size=GROUP),
}
#: how the service's run of a filter job ends: a verdict, the filter fails, or the run
#: is cancelled (the job is queued again)
JUDGE = st.sampled_from(["verdict"] * 6 + ["error", "retry"])
#: data-parallel (DP) dispatch: ``RANKS`` ranks of a task of rows one by one (``DP``,
#: fields ``x``) and of one of whole groups (``DPG``, fields ``uid`` and ``x``, balanced
#: on the group key or on row counts); each keeps to its own kind of request (as ``g``).
#: In some runs ``d`` asks for ``y`` too (``dp_fields``).
#: ``d`` alone is the declared consumer of partition q (see CONSUMERS), so that rows a
#: share repeats as padding are consumed while it is live
RANKS = 2
DP, DPG = "d", "dg"
DP_FIELDS = {DP: ("x",), DPG: ("uid", "x")}
#: the tasks that must ack a row of each partition before it is dropped as consumed
CONSUMERS = {"p": set(TASKS), "q": {DP}}
#: what a short last dispatch whose rows (groups) do not split evenly does
REMAINDER = st.sampled_from(["error", "drop", "pad"])
#: new bytes per row of a field written again with ``overwrite=True``
RESIZE = st.sampled_from([1, 3, 8, 16])


class _Disp:
    """The model of one task's DP dispatch in one partition."""

    def __init__(self):
        self.next = [0] * RANKS  # the next dispatch each rank takes
        self.made = 0  # dispatches made
        # (dispatch, rank) -> (lease id or 0, pad rows, units per rank, rows at the making)
        self.shares: dict[tuple[int, int], tuple[int, list[int], int, int]] = {}


class _Row:
    def __init__(self, part: str, version: int):
        self.part = part
        self.version = version
        self.key: int | None = None  # its group key (``uid``), once committed
        self.judged: set[str] = set()  # filters that passed it
        self.judging: dict[str, int] = {}  # filter -> the job judging it now
        self.ready: dict[str, int] = {}  # field -> bytes, committed
        self.writing: set[str] = set()  # fields with a write in flight
        self.acked: set[str] = set()
        self.leased: dict[str, int] = {}  # task -> lease id


class ControllerModel(RuleBasedStateMachine):
    @initialize(max_staleness=st.sampled_from(STALENESS),
                filters=st.sets(st.sampled_from(sorted(FILTERS))),
                capacity_bytes=st.sampled_from(CAPACITY_BYTES),
                dp_y=st.sampled_from([False, False, True]))
    def start(self, max_staleness, filters, capacity_bytes, dp_y):
        self.now = 0.0  # the controller's clock, moved by ``advance``
        # the fields each DP task asks for: in some runs the task of single rows asks for
        # ``y`` too, a field a retract can take back from its shares (a reserved share
        # that loses every row so ends; its rank is told so when it asks)
        self.dp_fields = {**DP_FIELDS, DP: ("x", "y")} if dp_y else DP_FIELDS
        self.capacity_bytes = capacity_bytes
        self.max_staleness = max_staleness
        self.version = VERSION
        self.c = Controller(CAPACITY, capacity_bytes=capacity_bytes, num_shards=2,
                            consumers=list(TASKS), lease_timeout=LEASE_TIMEOUT,
                            max_staleness=max_staleness, clock=lambda: self.now)
        # partition q's rows are consumed once the DP task of single rows acks them (so
        # that its padding rows are consumed while other shares repeat them)
        self.c.declare("q", [DP])
        # partition -> its declared consumers (None: no automatic cleanup); see ``declare``
        self.consumers: dict[str, set[str] | None] = {k: set(v) for k, v in CONSUMERS.items()}
        assert self.c.set_version(VERSION) == 0
        # ("l", lease id) or ("w", write token id) -> its deadline
        self.deadline: dict[tuple[str, int], float] = {}
        self.c.register_tag("uid")
        # the grouped task asks (over every partition) before any row is put, so that the
        # controller knows ``uid`` is a group key and a row dropped as stale takes its
        # group with it. Left out: until something groups by a key, a request's staleness
        # bound drops the stale rows it sees and leaves the rest of their groups, against
        # DESIGN.md's "dropped together".
        assert self.c.take(Request(GROUPED, ("uid", "x"), GROUP, group_by="uid",
                                   group_size=GROUP)) is None
        self.key_version: dict[int, int] = {}  # group key -> the version of its rows
        self.stale = 0  # rows dropped as stale
        self.gone_keys: set[int] = set()  # groups that left in this step (stale, rejected)
        self.filters: dict[str, FilterSpec] = {}  # registered
        self.jobs: dict[int, tuple[str, list[int]]] = {}  # queued jobs: id -> (filter, rows)
        self.withdrawn: set[int] = set()  # jobs whose judgement a retract undid
        self.filtered_by: dict[str, int] = {}  # rows rejected, per filter
        self.bytes_filtered_by: dict[str, int] = {}
        self.filter_errors: dict[str, int] = {}  # rows dropped by a failed filter
        for name in sorted(filters):  # (registered now, or later by ``add_filter``)
            self.c.add_filter(FILTERS[name])
            self.filters[name] = FILTERS[name]
        self.keys = 0  # group keys given out
        self.token_key: dict[int, int] = {}  # write token -> the group key it writes
        self.open_groups: list[tuple[str, int]] = []  # (partition, key) of half-put groups
        self.expired_tokens: list = []  # writes aborted by expiry (their commit raises)
        self.rows: dict[int, _Row] = {}
        self.sealed: set[str] = set()
        self.closed = False
        self.retired: set[str] = set()  # sealed partitions whose last row left
        self.leases: dict[int, tuple[str, list[int]]] = {}  # live: lid -> (task, rows)
        self.outcome: dict[int, str] = {}  # ended leases: "acked" or "released"
        self.pending: list = []  # (token, new rows?, bytes reserved) admitted, not committed
        self.committed: list = []  # (token, new rows?) committed writes, for retract
        self.dropped: set[int] = set()  # rows the model dropped
        self.deleted: set[int] = set()  # rows the controller asked storage to delete
        self.lost: int | None = None  # the storage unit lost (see ``lose_unit``)
        # lease id -> the fields it asked for (a retract takes rows only from leases of them)
        self._lease_fields: dict[int, tuple[str, ...]] = {}
        self.disp: dict[tuple[str, str], _Disp] = {}  # (DP task, partition) -> dispatches
        # leases of DP shares reserved for a rank that has not asked for them yet:
        # lid -> (task, partition, dispatch, rank); no consumer has them to ack or release
        self.unclaimed: dict[int, tuple[str, str, int, int]] = {}
        self.dp_dropped = 0  # rows dropped as the remainder of a DP dispatch
        # padding: lease of a DP share -> the rows of other shares it repeats; row -> how
        # many live shares repeat it (such a row is not dropped as consumed meanwhile)
        self.lease_pads: dict[int, list[int]] = {}
        self.pins: dict[int, int] = {}
        # live lease -> rows a retract took from it (its ack names them)
        self.lease_withdrawn: dict[int, list[int]] = {}
        self.token_sizes: dict[int, dict[str, list[int]]] = {}  # overwrite -> its bytes

    # ------------------------------------------------------------------ model helpers

    def _drop(self, rid: int) -> None:
        row = self.rows.pop(rid)
        self.dropped.add(rid)
        for lid in row.leased.values():
            task, rows = self.leases[lid]
            rows.remove(rid)
            if not rows:  # (an emptied lease counts as acked, unless a retract took
                # rows from it before: its ack names them)
                del self.leases[lid]
                self.outcome[lid] = "withdrawn" if self.lease_withdrawn.pop(lid, None) \
                    else "acked"
                # (a reserved share that lost every row of its own: its rank is told
                # so when it asks, see _claim_share)
                self.unclaimed.pop(lid, None)
                self._unpin(lid)
        if rid in self.pins:  # DP shares that repeat it as padding lose it too
            del self.pins[rid]
            for lid, pads in list(self.lease_pads.items()):
                if rid in pads:
                    pads[:] = [r for r in pads if r != rid]
                    if lid in self.leases and not self.leases[lid][1] and not pads:
                        event("dp: a share of padding only ended: its rows were dropped")
                        del self.leases[lid]  # (as a lease whose last row is dropped)
                        self.outcome[lid] = ("withdrawn" if self.lease_withdrawn.pop(lid, None)
                                             else "acked")
                        self.lease_pads.pop(lid)
                        self.unclaimed.pop(lid, None)
        self._retire(row.part)

    def _consumed(self, rid: int) -> bool:
        """Every declared consumer acked the row, no lease holds it, and no live DP share
        repeats it as padding: it is dropped as consumed."""
        row = self.rows[rid]
        cons = self.consumers[row.part]
        return bool(cons) and cons <= row.acked and not row.leased and not self.pins.get(rid)

    def _unpin(self, lid: int) -> None:
        """A DP share that repeated rows as padding ended: those every consumer acked
        (and no lease or other share holds) are dropped as consumed."""
        for rid in self.lease_pads.pop(lid, []):
            self.pins[rid] -= 1
            if not self.pins[rid]:
                del self.pins[rid]
                if rid in self.rows and self._consumed(rid):
                    event("dp: a padding row dropped as consumed once its share ended")
                    self._drop(rid)

    def _retire(self, part: str) -> None:
        if part in self.sealed and not any(r.part == part for r in self.rows.values()):
            self.retired.add(part)

    def _passed(self, row: _Row, fields: tuple[str, ...]) -> bool:
        """Whether every filter of any of ``fields`` has judged ``row`` and kept it."""
        return all(name in row.judged for name, spec in self.filters.items()
                   if spec.fields & set(fields))

    def _deliverable(self, task: str, fields: tuple[str, ...], part: str) -> list[int]:
        return [rid for rid, r in self.rows.items()
                if r.part == part and task not in r.acked and task not in r.leased
                and all(f in r.ready for f in fields) and self._passed(r, fields)]

    def _stale(self, rids: list[int]) -> int:
        """Drop ``rids`` as stale, each with every row of its group (rows whose key is
        written); returns how many left."""
        keys = {self.rows[r].key for r in rids} - {None}
        out = set(rids) | {rid for rid, r in self.rows.items() if r.key in keys}
        for rid in out:
            self._drop(rid)
        self.stale += len(out)
        self.gone_keys |= keys  # type: ignore[arg-type]
        return len(out)

    def _settle(self) -> None:
        deletes, jobs, *_ = self.c.drain()
        for rows in deletes.values():
            self.deleted.update(rows)
        for job in jobs:
            self._queued(job)

    def _queued(self, job) -> None:
        """A filter job the controller queued: rows that have the filter's fields, that
        it has not judged and that no other job of it holds; for a grouped filter, every
        such row of one group, ``GROUP`` of them unless the partition is sealed and no
        write in flight may add a member."""
        if job.id in self.jobs:  # queued again (filter_retry)
            assert self.jobs[job.id] == (job.filter, list(job.rows)), job
            assert job.id not in self.withdrawn, job
            return
        spec = self.filters[job.filter]
        assert job.fields == tuple(sorted(spec.fields)), job
        assert job.rows and len(set(job.rows)) == len(job.rows), job
        live = [r for r in job.rows if r in self.rows]
        assert set(job.rows) - set(live) <= self.dropped, job
        for rid in live:
            row = self.rows[rid]
            assert spec.fields <= row.ready.keys(), (job, rid, row.ready)
            assert job.filter not in row.judged and job.filter not in row.judging, (job, rid)
        if spec.group_by and live:
            keys = {self.rows[r].key for r in live}
            assert len(keys) == 1 and None not in keys, (job, keys)
            key = keys.pop()
            # short: sealed, and no put admitted before the seal can add a member
            part = self.rows[live[0]].part
            assert len(job.rows) == GROUP or (
                (part in self.sealed or self.closed) and not self._key_may_come(part)), job
            rest = [rid for rid, r in self.rows.items() if r.key == key
                    and job.filter not in r.judged and job.filter not in r.judging]
            assert set(rest) <= set(job.rows), (job, rest)
        for rid in live:
            self.rows[rid].judging[job.filter] = job.id
        self.jobs[job.id] = (job.filter, list(job.rows))

    # ------------------------------------------------------------------ new rows

    @rule(part=st.sampled_from(PARTS), n=st.integers(1, 4),
          fields=st.sets(st.sampled_from(("x", "y")), min_size=1), now=MOSTLY, age=AGES,
          stored=st.booleans())
    def put(self, part, n, fields, now, age, stored):
        self._put(part, n, tuple(sorted(fields)), now, None, self._version(age), stored)

    @rule(part=st.sampled_from(PARTS), half=RARELY, now=MOSTLY, age=AGES,
          stored=st.booleans())
    def put_group(self, part, half, now, age, stored):
        self._put_group(part, half, now, age, stored)

    @rule(part=st.sampled_from(PARTS), half=RARELY, now=MOSTLY, age=AGES,
          stored=st.booleans())
    def put_another_group(self, part, half, now, age, stored):  # (groups need a few puts)
        self._put_group(part, half, now, age, stored)

    def _version(self, age: int | None) -> int | None:
        return None if age is None else max(0, self.version - age)

    def _put_group(self, part: str, half: bool, now: bool, age: int | None,
                   stored: bool = False) -> None:
        """A group of ``GROUP`` rows sharing a key, put at once or one row now and the
        others later (``finish_group``), as a GRPO group's samples arrive; every row of
        the group has the version of its first put."""
        self.keys += 1
        version = self._version(age)
        self.key_version[self.keys] = self.version if version is None else version
        if self._put(part, 1 if half else GROUP, ("uid", "x"), now, self.keys,
                     version, stored) and half:
            self.open_groups.append((part, self.keys))

    @precondition(lambda self: self.capacity_bytes > 200)
    @rule(part=st.sampled_from(PARTS), first=st.integers(0, RANKS - 1))
    def balanced_step(self, part, first):
        """Four whole groups are put, and the ranks of the grouped DP task take two
        groups each, balanced on the key: with two units a share, a split that a swap
        would narrow shows (the byte bound of this run leaves room for it)."""
        for _ in range(4):
            self._put_group(part, False, True, None)
        self.dp_step(True, part, first, 2, "error", "uid", True)

    @precondition(lambda self: self.open_groups)
    @rule(i=st.integers(0, 1000), now=MOSTLY, stored=st.booleans())
    def finish_group(self, i, now, stored):
        part, key = self.open_groups.pop(i % len(self.open_groups))
        self._put(part, GROUP - 1, ("uid", "x"), now, key, self.key_version[key], stored)

    def _put(self, part: str, n: int, fields: tuple[str, ...], now: bool,
             key: int | None, version: int | None, stored: bool = False) -> bool:
        """New rows of ``version`` (``None``: the current one); rows already older than
        ``version - max_staleness`` are admitted and dropped as stale at once. With
        ``stored`` and ``now``: the rows were stored by a unit under ids leased to it,
        and are admitted and committed in one step (``admit_stored``, as the unit's own
        puts and the embedded transport's combined one-row puts are), their group key
        given with them."""
        nbytes = n * sum(SIZES[f] for f in fields)
        if self.closed:
            with pytest.raises(QueueClosed):
                self.c.allocate(part, n, fields, nbytes=nbytes, version=version)
            return False
        if part in self.sealed:
            with pytest.raises(InvalidArgument):
                self.c.allocate(part, n, fields, nbytes=nbytes, version=version)
            return False
        held = sum(sum(r.ready.values()) for r in self.rows.values())
        reserved = sum(b for _, new, b in self.pending if new)
        if len(self.rows) + n > CAPACITY or (
                self.rows and held + reserved + nbytes > self.capacity_bytes):
            with pytest.raises(QueueFull):
                self.c.allocate(part, n, fields, nbytes=nbytes, version=version)
            return False
        if stored and now:
            self._put_stored(part, n, fields, key, version)
            self._settle()
            return True
        tok = self.c.allocate(part, n, fields, nbytes=nbytes, version=version)
        assert self.lost is None or self.lost not in tok.shards, (self.lost, tok.shards)
        self.deadline[("w", tok.id)] = self.now + LEASE_TIMEOUT
        if key is not None:
            self.token_key[tok.id] = key
        assert len(tok.rows) == n and not set(tok.rows) & (set(self.rows) | self.dropped)
        v = self.version if version is None else version
        for rid in tok.rows:
            row = self.rows[rid] = _Row(part, v)
            row.writing = set(fields)
        if self.max_staleness is not None and v < self.version - self.max_staleness:
            self._stale(list(tok.rows))
        if now:
            self._commit(tok, True)
        else:
            self.pending.append((tok, True, nbytes))
        self._settle()
        return True

    def _put_stored(self, part: str, n: int, fields: tuple[str, ...], key: int | None,
                    version: int | None) -> None:
        """``_put``'s rows stored by a unit first, then admitted and committed at once."""
        shard = 1 if self.lost == 0 else 0
        start, _ = self.c.unit_ids(shard, n)
        ids = list(range(start, start + n))
        assert not set(ids) & (set(self.rows) | self.dropped)
        sizes = {f: [SIZES[f]] * n for f in fields}
        res = self.c.admit_stored(part, ids, shard, sizes, version=version,
                                  tags=None if key is None else {"uid": [key] * n})
        assert res is not None
        v = self.version if version is None else version
        for rid in ids:
            self.rows[rid] = _Row(part, v)
        if self.max_staleness is not None and v < self.version - self.max_staleness:
            self._stale(ids)  # (dropped at admission, before their fields and key land)
        for rid in ids:
            row = self.rows.get(rid)
            if row is not None:
                row.ready = {f: SIZES[f] for f in fields}
                row.key = key

    def _commit(self, tok, new: bool) -> None:
        key = self.token_key.get(tok.id)
        sizes = self.token_sizes.pop(
            tok.id, {f: [SIZES[f]] * len(tok.rows) for f in tok.fields})
        res = self.c.commit(tok, sizes, None if key is None else {"uid": [key] * len(tok.rows)})
        dead = sorted(r for rows in res.dead.values() for r in rows)
        assert dead == sorted(r for r in tok.rows if r not in self.rows)
        for rid in tok.rows:
            row = self.rows.get(rid)
            if row is not None:
                for f in tok.fields:
                    row.writing.discard(f)
                    row.ready[f] = sizes[f][tok.rows.index(rid)]
                if key is not None:
                    row.key = key
        self.committed.append((tok, new))

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 1000), commit=st.booleans())
    def finish_write(self, i, commit):
        tok, new, _ = self.pending.pop(i % len(self.pending))
        if commit:
            self._commit(tok, new)
        else:
            undo = self.c.abort(tok)
            assert (undo is None) == new
            self._aborted(tok, new)
        self._settle()

    def _aborted(self, tok, new: bool) -> None:
        """A write ended without a commit: its new rows are dropped, or the fields it
        was writing to existing rows stay unwritten."""
        for rid in tok.rows:
            row = self.rows.get(rid)
            if row is None:
                continue
            if new:
                self._drop(rid)
            else:
                row.writing.difference_update(tok.fields)

    # ------------------------------------------------------------------ writes to rows

    @precondition(lambda self: self.rows or self.dropped)
    @rule(data=st.data(), field=st.sampled_from(("y", "z")), now=MOSTLY)
    def write(self, data, field, now):
        pool = sorted(set(self.rows) | self.dropped)
        rows = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4, unique=True))
        if any(r not in self.rows for r in rows):
            with pytest.raises(RowsDropped):
                self.c.begin_write(rows, [field])
            return
        if any(field in self.rows[r].ready or field in self.rows[r].writing for r in rows):
            with pytest.raises(DuplicateField):
                self.c.begin_write(rows, [field])
            return
        self._write(rows, field, now)
        self._settle()

    def _write(self, rows: list[int], field: str, now: bool):
        """A write of ``field`` to live ``rows`` that have neither it nor a write of it in
        flight (committed at once with ``now``); returns its token."""
        tok = self.c.begin_write(rows, [field])
        self.deadline[("w", tok.id)] = self.now + LEASE_TIMEOUT
        for rid in rows:
            self.rows[rid].writing.add(field)
        if now:
            self._commit(tok, False)
        else:
            self.pending.append((tok, False, 0))
        return tok

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), now=MOSTLY)
    def overwrite(self, data, now):
        """A field written again with ``overwrite=True``, mostly one the rows have: it
        never raises :class:`DuplicateField` (without ``overwrite`` the ``write`` rule
        expects it), the rows keep the field ready (they stay deliverable to the tasks
        that have not had them, and no task that acked them gets them again), and once
        committed each row has it at its new size: the bytes held follow. Aborted or
        expired, the old value stays; taken back, nothing changes."""
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, max_size=4,
                                  unique=True))
        have = sorted({f for r in rows for f in self.rows[r].ready} & {"x", "y", "z"})
        # (``x`` too: rows put with ``y`` alone get it only so)
        field = data.draw(st.sampled_from(have + ["x"]))
        sizes = data.draw(st.lists(RESIZE, min_size=len(rows), max_size=len(rows)))
        tok = self.c.begin_write(rows, [field], overwrite=True)
        assert tok.overwrite
        self.deadline[("w", tok.id)] = self.now + LEASE_TIMEOUT
        self.token_sizes[tok.id] = {field: sizes}
        for rid in rows:
            self.rows[rid].writing.add(field)
        event("overwrite of a field the rows have" if have else "overwrite of a new field")
        if now:
            self._commit(tok, False)
            for rid, b in zip(rows, sizes):
                if rid in self.rows:
                    assert self.c.rows[rid].fields[field] == b, (rid, self.c.rows[rid].fields)
        else:
            self.pending.append((tok, False, 0))
        self._settle()

    @precondition(lambda self: self.committed)
    @rule(i=st.integers(0, 1000), go=RARELY)
    def retract(self, i, go):
        """A committed write whose writer was cancelled is taken back (once)."""
        if go:
            self._retract(self.committed.pop(i % len(self.committed)))

    @precondition(lambda self: any(not new for _, new in self.committed))
    @rule(i=st.integers(0, 1000))
    def retract_field(self, i):
        """A committed write of a field to existing rows is taken back (such writes are
        fewer than puts, and taking one back drops no row)."""
        writes = [w for w in self.committed if not w[1]]
        w = writes[i % len(writes)]
        self.committed.remove(w)
        self._retract(w)

    def _retract(self, write: tuple) -> None:
        tok, new = write
        undo = self.c.retract(tok)
        if tok.overwrite:  # an overwrite is idempotent: taking it back changes nothing
            assert undo is None
            return
        live = {rid for rid in tok.rows if rid in self.rows}
        # filters of a field taken back judge its rows again once it is written again:
        # their jobs that hold any of the rows are withdrawn (and their other rows queued
        # again), and what they passed is forgotten
        again = {name for name, spec in self.filters.items() if spec.fields & set(tok.fields)}
        if again and not new:
            for jid, (name, jrows) in self.jobs.items():
                if name in again and jid not in self.withdrawn and live & set(jrows):
                    self.withdrawn.add(jid)
                    for rid in jrows:
                        if rid in self.rows:
                            del self.rows[rid].judging[name]
            for rid in live:
                self.rows[rid].judged -= again
        ended: list[int] = []
        for rid in tok.rows:
            row = self.rows.get(rid)
            if row is None:
                continue
            if new:
                self._drop(rid)
                continue
            for f in tok.fields:
                row.ready.pop(f, None)
            # leases of the rows for a field taken back lose them (the ack says so)
            for task, lid in list(row.leased.items()):
                ltask, lrows = self.leases[lid]
                if set(tok.fields) & set(self._lease_fields[lid]):
                    del row.leased[task]
                    lrows.remove(rid)
                    self.lease_withdrawn.setdefault(lid, []).append(rid)
                    if not lrows:
                        del self.leases[lid]
                        self.outcome[lid] = "withdrawn"
                        self.lease_withdrawn.pop(lid)
                        self.unclaimed.pop(lid, None)  # (its rank is told so when it asks)
                        ended.append(lid)
        for lid in ended:  # (after the loop: this may drop rows)
            self._unpin(lid)
        if not new:
            for rid in sorted(live):  # (consumed rows a lease taken back alone kept)
                if rid in self.rows and self._consumed(rid):
                    self._drop(rid)
            self._withdraw_pads(live, set(tok.fields))
        self._settle()

    @rule(task=st.sampled_from(TASKS), drop_rest=MOSTLY)
    def take_back_part_of_a_batch(self, task, drop_rest):
        """A batch holds rows of two writes of a field it asked for; one write is taken
        back (its rows leave the batch, to come again once rewritten), then, mostly, the
        batch's other rows are dropped. The ack still names the rows taken back, however
        the batch ended (built here on purpose: rules drawn at random rarely line this
        up). Rows of ``p`` with ``x``, then ``z`` written to each by a write of its own."""
        if not self._put("p", 2, ("x",), True, None, None):
            return
        tok, _ = self.committed[-1]
        first, second = tok.rows
        mine = self._write([first], "z", True)
        self._write([second], "z", True)
        self._settle()
        lid = self._take(task, "p", ("x", "z"), 2)
        self._settle()
        if lid is None or {first, second} - set(self.leases[lid][1]):
            event("take back part of a batch: the batch did not hold both rows")
            return
        self.committed.remove((mine, False))
        self._retract((mine, False))
        if drop_rest:
            rest = list(self.leases[lid][1]) if lid in self.leases else []
            if rest:
                assert self.c.drop(rest) == len(rest)
                for rid in rest:
                    self._drop(rid)
                self._settle()
            assert lid not in self.leases and self.outcome[lid] == "withdrawn", lid
            event("take back part of a batch, drop the rest, then ack")
        if lid in self.leases:
            self._ack(lid)
        else:
            with pytest.raises(LeaseExpired) as e:
                self.c.ack([lid])
            assert first in (e.value.rows or ()), (e.value.rows, first)
        self._settle()

    def _withdraw_pads(self, live: set[int], fields: set[str]) -> None:
        """DP shares that repeat a row whose field was taken back, and asked for it, lose
        it as padding (a reserved share does not deliver it; the ack names it); a share
        left with nothing ends, and the row, no longer pinned, is dropped if consumed."""
        out_rows: set[int] = set()
        for lid, pads in list(self.lease_pads.items()):
            if lid not in self.leases or not fields & set(self._lease_fields[lid]):
                continue
            out = [r for r in pads if r in live]
            if not out:
                continue
            event("dp: a retract took a padding row back from a share")
            pads[:] = [r for r in pads if r not in live]
            for rid in out:
                self.pins[rid] -= 1
                if not self.pins[rid]:
                    del self.pins[rid]
            out_rows.update(out)
            w = self.lease_withdrawn.setdefault(lid, [])
            w.extend(r for r in dict.fromkeys(out) if r not in w)
            if not self.leases[lid][1] and not pads:
                del self.leases[lid]
                self.outcome[lid] = "withdrawn"
                self.lease_withdrawn.pop(lid)
                self.lease_pads.pop(lid)
                self.unclaimed.pop(lid, None)  # (its rank is told so when it asks)
        for rid in sorted(out_rows):
            if rid in self.rows and not self.pins.get(rid) and self._consumed(rid):
                self._drop(rid)

    # ------------------------------------------------------------------ consumers

    @rule(task=st.sampled_from(TASKS), part=st.sampled_from(PARTS),
          fields=st.sampled_from([("x",), ("x",), ("y",), ("x", "y"), ("z",), ("x", "z")]),
          batch=st.integers(1, 3), stale=st.sampled_from([None, None, 0, 1]))
    def take(self, task, part, fields, batch, stale):
        """A take, some with a staleness bound of their own: the rows it could be handed
        that are older than ``version - stale`` are dropped first (with their groups)."""
        self._take(task, part, fields, batch, stale)
        self._settle()

    @rule(task=st.sampled_from(TASKS), part=st.sampled_from(PARTS), batch=st.integers(1, 3),
          stale=st.sampled_from([None, None, 0, 1]))
    def consume(self, task, part, batch, stale):
        """A consumer's step: take a batch of ``x`` and acknowledge it."""
        lid = self._take(task, part, ("x",), batch, stale)
        if lid is not None:
            self._ack(lid)
        self._settle()

    def _take(self, task: str, part: str, fields: tuple[str, ...], batch: int,
              stale: int | None = None) -> int | None:
        if stale is not None:
            self._stale([rid for rid in self._deliverable(task, fields, part)
                         if self.rows[rid].version < self.version - stale])
        can = self._deliverable(task, fields, part)
        d = self.c.take(Request(task, fields, batch, partition=part, max_staleness=stale))
        left = [r for r in self.rows.values() if r.part == part and task not in r.acked]
        if self.closed:
            event("closed: take " + ("END" if d is END else "None" if d is None else "batch"))
        if d is END:
            assert (part in self.sealed and not left) or (self.closed and not can), \
                (part, len(left), can)
            return None
        if d is None:
            assert not self.closed, ("closed: a take must deliver or end", can)
            assert len(can) < batch, (can, batch)
            if part in self.sealed and can and all(
                    task not in r.leased and all(f in r.ready for f in fields)
                    and self._passed(r, fields) for r in left):
                raise AssertionError(f"a sealed partition's tail {can} was held back")
            return None
        assert isinstance(d, Delivery)
        got = list(d.rows)
        assert len(set(got)) == len(got) and set(got) <= set(can), (got, can)
        if len(can) >= batch:
            assert len(got) == batch, (got, batch)
        else:
            assert (part in self.sealed or self.closed) and got, (got, can, batch)
        for rid in got:
            self.rows[rid].leased[task] = d.lease
        self.leases[d.lease] = (task, got)
        self.deadline[("l", d.lease)] = self.now + LEASE_TIMEOUT
        self._lease_fields[d.lease] = fields
        return d.lease

    @precondition(lambda self: set(self.leases) - set(self.unclaimed) or self.outcome)
    @rule(data=st.data())
    def ack(self, data):
        lid = data.draw(st.sampled_from(sorted(
            (set(self.leases) - set(self.unclaimed)) | set(self.outcome))))
        self._ack(lid)
        self._settle()

    def _ack(self, lid: int) -> None:
        if lid in self.leases:
            withdrawn = self.lease_withdrawn.pop(lid, None)
            if withdrawn:  # the rest is acknowledged; the ack names what was taken back
                with pytest.raises(LeaseExpired) as e:
                    self.c.ack([lid])
                assert sorted(e.value.rows or ()) == sorted(withdrawn), (e.value.rows, withdrawn)
                event("ack of a batch a retract took rows from")
            else:
                self.c.ack([lid])
            task, rows = self.leases.pop(lid)
            self.outcome[lid] = "acked"
            for rid in rows:
                row = self.rows[rid]
                del row.leased[task]
                row.acked.add(task)
                if self._consumed(rid):
                    self._drop(rid)
                elif self.consumers[row.part] and self.consumers[row.part] <= row.acked \
                        and not row.leased:
                    event("dp: a consumed row kept as another share's padding")
            self._unpin(lid)
        elif self.outcome[lid] in ("released", "withdrawn"):
            with pytest.raises(LeaseExpired):
                self.c.ack([lid])
        else:
            self.c.ack([lid])  # (idempotent)

    @precondition(lambda self: set(self.leases) - set(self.unclaimed))
    @rule(data=st.data(), go=RARELY)
    def release(self, data, go):
        if not go:
            return
        lid = data.draw(st.sampled_from(sorted(set(self.leases) - set(self.unclaimed))))
        self.c.release([lid])
        self._released(lid)
        self._settle()

    def _released(self, lid: int) -> None:
        """A lease was given back (or expired): its rows go to the task again; a late
        ack of it raises."""
        task, rows = self.leases.pop(lid)
        self.lease_withdrawn.pop(lid, None)
        self.outcome[lid] = "released"
        for rid in rows:
            del self.rows[rid].leased[task]
            if self._consumed(rid):  # every consumer acked it; this lease alone kept it
                event("a consumed row dropped when a lease that kept it ended unacked")
                self._drop(rid)
        if lid in self.unclaimed:  # a reserved DP share expired: its rank is told so
            task, part, k, rank = self.unclaimed.pop(lid)
            self.disp[(task, part)].shares.pop((k, rank), None)
        self._unpin(lid)

    def _key_may_come(self, part: str) -> bool:
        """Whether a write of a group key to a row of ``part`` is in flight (it may add
        a member to any group of the partition)."""
        return any(r.part == part and "uid" in r.writing for r in self.rows.values())

    @rule(part=st.sampled_from(PARTS), groups=st.sampled_from([1, 1, 2]))
    def take_groups(self, part, groups):
        self._take_groups(part, groups)

    @rule(part=st.sampled_from(PARTS), groups=st.sampled_from([1, 1, 2]))
    def take_more_groups(self, part, groups):  # (as often as groups are put)
        self._take_groups(part, groups)

    def _take_groups(self, part: str, groups: int) -> None:
        """The grouped task takes whole groups (and acknowledges them): a group goes
        when ``GROUP`` of its rows are ready, or, in a sealed partition, a short one
        once all its rows are; never split, never mixed with rows of no group."""
        task, fields, batch = GROUPED, ("uid", "x"), GROUP * groups
        can = self._deliverable(task, fields, part)
        by_key: dict[int, list[int]] = {}
        for rid in can:
            by_key.setdefault(self.rows[rid].key, []).append(rid)  # type: ignore[arg-type]
        full = [k for k, rows in by_key.items() if len(rows) == GROUP]
        # a short group goes once its partition is sealed and all its rows are ready
        members: dict[int, int] = {}
        for r in self.rows.values():
            if r.part == part and r.key is not None and task not in r.acked:
                members[r.key] = members.get(r.key, 0) + 1
        short = [k for k, rows in by_key.items()
                 if (part in self.sealed or self.closed) and len(rows) < GROUP
                 and members[k] == len(rows)]
        d = self.c.take(Request(task, fields, batch, partition=part, group_by="uid",
                                group_size=GROUP))
        left = [r for r in self.rows.values() if r.part == part and task not in r.acked]
        if d is END:
            assert (part in self.sealed and not left) or (self.closed and not can), \
                (part, len(left), can)
        elif d is None:
            assert len(full) < groups, (full, groups)
            assert not self.closed or not can or self._key_may_come(part) or not (
                full or short), ("closed: a whole group held back", can, full, short)
            # a sealed partition's short batch goes once nothing can join it any more:
            # no write in flight there, and every row the task has not acked is ready
            # (a row without a key may still get one)
            final = not any(r.writing for r in self.rows.values() if r.part == part) and all(
                all(f in r.ready for f in fields) and self._passed(r, fields) for r in left)
            assert part not in self.sealed or not final or not (full or short), (full, short)
        else:
            got = list(d.rows)
            assert len(set(got)) == len(got) and set(got) <= set(can), (got, can)
            assert len(got) <= batch
            keys = {self.rows[r].key for r in got}
            for k in keys:  # whole: every deliverable row of each key it has
                assert sorted(by_key[k]) == sorted(r for r in got if self.rows[r].key == k)
                # short: sealed, and no put admitted before the seal can add a member
                assert len(by_key[k]) == GROUP or ((part in self.sealed or self.closed)
                                                   and not self._key_may_come(part)), \
                    (k, by_key[k])
            if len(full) >= groups and part not in self.sealed and not self.closed:
                # (sealed, a short group ahead may leave a batch short: groups are whole)
                assert len(got) == batch, (got, full, groups)
            self.c.ack([d.lease])
            self.outcome[d.lease] = "acked"
            for rid in got:
                self.rows[rid].acked.add(task)
                if self._consumed(rid):  # (any ack drops a row nothing needs any more)
                    self._drop(rid)
        self._settle()

    # ------------------------------------------------------------------ DP dispatch

    @rule(part=st.sampled_from(PARTS), rank=st.integers(0, RANKS - 1),
          batch=st.sampled_from([1, 1, 2]), remainder=REMAINDER, ack=MOSTLY)
    def dp_take(self, part, rank, batch, remainder, ack):
        """A rank of the DP task of single rows takes its next share, and mostly acks it."""
        lid = self._take_dp(DP, part, rank, batch, remainder, None)
        if lid is not None and ack:
            self._ack(lid)
        self._settle()

    @rule(part=st.sampled_from(PARTS), rank=st.integers(0, RANKS - 1),
          groups=st.sampled_from([1, 1, 2]), remainder=REMAINDER,
          balance=st.sampled_from([None, "uid"]), ack=MOSTLY)
    def dp_take_groups(self, part, rank, groups, remainder, balance, ack):
        """A rank of the DP task of whole groups takes its next share (balanced on the
        group key, or on row counts), and mostly acks it."""
        lid = self._take_dp(DPG, part, rank, GROUP * groups, remainder, balance)
        if lid is not None and ack:
            self._ack(lid)
        self._settle()

    @rule(grouped=st.booleans(), part=st.sampled_from(PARTS), first=st.integers(0, RANKS - 1),
          size=st.sampled_from([1, 1, 2]), remainder=REMAINDER,
          balance=st.sampled_from([None, "uid"]), ack=MOSTLY,
          lag=st.sampled_from([0.0, 0.0, 0.0, 3.0, 6.0, 11.0]))
    def dp_step(self, grouped, part, first, size, remainder, balance, ack, lag=0.0):
        """A training step: every rank asks in turn, from ``first`` on, for its next
        share (``size`` rows or groups), and mostly acks it; ``lag`` seconds pass
        between ranks (a share reserved that long may expire before its rank asks)."""
        task = DPG if grouped else DP
        for i in range(RANKS):
            if i and lag:
                self.advance(lag)
            lid = self._take_dp(task, part, (first + i) % RANKS,
                                GROUP * size if grouped else size, remainder,
                                balance if grouped else None)
            if lid is not None and ack:
                self._ack(lid)
            self._settle()

    def _take_dp(self, task: str, part: str, rank: int, batch: int, remainder: str,
                 balance: str | None) -> int | None:
        """Rank ``rank`` asks for its next dispatch ``k``: the share reserved for it if
        another rank made ``k``; ``DispatchError`` if that share expired (its rows went
        back); else it makes ``k`` itself (``_make_dispatch``). A finished partition
        ends every rank."""
        grouped = task == DPG
        req = Request(task, self.dp_fields[task], batch, partition=part, dp_rank=rank,
                      dp_size=RANKS, dp_remainder=remainder, balance_by=balance,
                      group_by="uid" if grouped else None,
                      group_size=GROUP if grouped else None)
        if part in self.retired:
            assert self.c.take(req) is END
            self.disp.pop((task, part), None)
            return None
        disp = self.disp.setdefault((task, part), _Disp())
        k = disp.next[rank]
        if (k, rank) in disp.shares:
            return self._claim_share(req, disp, k)
        if k < disp.made:
            with pytest.raises(DispatchError):
                self.c.take(req)
            event("dp: a share expired before its rank asked")
            disp.next[rank] = k + 1
            return None
        return self._make_dispatch(req, disp, k)

    def _units(self, task: str, rows: list[int]) -> int:
        """How many units (rows, or groups for the grouped task) ``rows`` are."""
        return len({self.rows[r].key for r in rows}) if task == DPG else len(rows)

    def _claim_share(self, req: Request, disp: _Disp, k: int) -> int | None:
        """The rank gets the share reserved for it: the rows still in it (a row that
        left meanwhile leaves the share), plus its padding, under the lease made with
        the dispatch, whose deadline starts now; as many units as every rank of the
        dispatch unless rows left it."""
        task, rank = req.task, req.dp_rank
        lid, pads, per, made_rows = disp.shares.pop((k, rank))
        disp.next[rank] = k + 1
        own = list(self.leases[lid][1]) if lid in self.leases else []
        left = [r for r in pads if r in self.rows]  # padding rows dropped leave it too
        if (lid and lid not in self.leases) or not (own or left):
            # every row of its own was dropped (or, for a share of padding only, every
            # row it repeats): the rank is told so, and asks again
            with pytest.raises(DispatchError):
                self.c.take(req)
            event("dp: a reserved share lost every row")
            if lid in self.leases:  # (padding only: given back)
                self._released(lid)
            return None
        d = self.c.take(req)
        assert isinstance(d, Delivery), d
        assert (d.lease, d.dispatch, d.dp_rank) == (lid, k, rank), (d, lid, k, rank)
        assert sorted(d.rows) == sorted(own + left), (d.rows, own, left)
        if len(own) == made_rows and left == pads:
            assert self._units(task, list(d.rows)) == per, (d.rows, per)
        else:
            event("dp: a reserved share lost rows")
        event(f"dp: {task} share claimed" + (" (padded)" if pads else ""))
        if not lid:
            return None
        del self.unclaimed[lid]
        self.deadline[("l", lid)] = self.now + LEASE_TIMEOUT
        assert self.c.leases[lid].deadline == self.now + LEASE_TIMEOUT, "lease not renewed"
        return lid

    def _make_dispatch(self, req: Request, disp: _Disp, k: int) -> int | None:
        """The rank makes dispatch ``k``: ``RANKS * batch`` deliverable rows (whole
        groups for the grouped task), split into one share per rank, disjoint, every row
        of the dispatch in exactly one, each the same number of units (``batch`` rows
        without groups) and, with two ranks, balanced (no swap of a unit of the heavier
        share for a lighter one of the other narrows their gap). Its own share is
        handed out, the others reserved: leased to the task, unclaimed. Only the tail
        of a sealed partition (every row the task still owes is deliverable) may be
        short; if it does not split evenly, ``dp_remainder`` raises, drops the surplus
        (counted) or pads short shares with repeats of rows of the dispatch."""
        task, part, rank, R = req.task, req.partition, req.dp_rank, RANKS
        assert part is not None
        grouped = task == DPG
        size = R * req.batch_size
        sealed = part in self.sealed or self.closed
        can = self._deliverable(task, req.fields, part)
        left = [rid for rid, r in self.rows.items() if r.part == part and task not in r.acked]
        # (closed: whatever is deliverable now is the tail)
        tail = (sealed and set(left) == set(can)) or self.closed
        final = tail and not any(r.writing for r in self.rows.values() if r.part == part)
        by_key: dict[int | None, list[int]] = {}
        for rid in can:
            by_key.setdefault(self.rows[rid].key, []).append(rid)
        full = [key for key, rows in by_key.items() if len(rows) == GROUP]
        before = set(self.c.leases)
        gone = self.c.c_dropped.get("dp_remainder", 0)
        try:
            d = self.c.take(req)
        except DispatchError:
            event(f"dp: {task} uneven tail refused")
            assert req.dp_remainder == "error" and sealed, (req, can)
            if not grouped:
                assert tail and len(can) < size and len(can) % R, (can, size)
            return None
        rem = [rid for rid in can if rid not in self.c.rows]  # the surplus dropped
        assert len(rem) == self.c.c_dropped.get("dp_remainder", 0) - gone, rem
        if rem:
            assert req.dp_remainder == "drop" and sealed, (req, rem)
            assert self._units(task, rem) < R, rem
            if not grouped:
                assert tail and len(rem) == len(can) % R, (rem, can)
        for rid in rem:
            self._drop(rid)
        self.dp_dropped += len(rem)
        if rem:
            event(f"dp: {task} remainder dropped")
        if d is END:
            assert (part in self.sealed and not left) or (self.closed and not can), (part, left)
            return None
        if d is None:
            if not grouped:
                assert len(can) < size, (can, size)
                assert not (tail and set(can) - set(rem)), ("a tail held back", can, rem)
            else:
                assert sealed or len(full) * GROUP < size, (full, size)
                assert not (final and set(can) - set(rem)), ("a tail held back", can, rem)
            return None
        assert isinstance(d, Delivery) and d.dispatch == k and d.dp_rank == rank, d
        # the shares: the rank's own lease, and the leases reserved for the others
        mine = list(self.c.leases[d.lease].rows) if d.lease else []
        assert d.lease == 0 or d.lease not in before, d
        assert list(d.rows[:len(mine)]) == mine, (d.rows, mine)
        shares, lids, pads = {rank: mine}, {rank: d.lease}, {rank: list(d.rows[len(mine):])}
        held = self.c._dispatchers[req.sub_key() + (R,)].shares
        for lid in set(self.c.leases) - before - {d.lease}:
            lease = self.c.leases[lid]
            assert lease.task == task and not lease.claimed, lid
            assert lease.rank != rank and lease.rank not in shares, (lid, lease.rank)
            shares[lease.rank], lids[lease.rank] = list(lease.rows), lid
        for r in range(R):
            if r != rank:
                lid, rows_, pad = held[(k, r)]
                assert lid == lids.setdefault(r, 0) and list(rows_) == shares.setdefault(r, [])
                pads[r] = list(pad)
        dealt = [rid for r in range(R) for rid in shares[r]]
        assert len(dealt) == len(set(dealt)), ("a row in two shares", shares)
        assert set(dealt) <= set(can) - set(rem), (shares, can, rem)
        assert all(set(p) <= set(dealt) for p in pads.values()), (pads, dealt)
        assert all(bool(lids[r]) == bool(shares[r] or pads[r]) for r in range(R)), \
            (lids, shares, pads)
        per = self._units(task, shares[rank] + pads[rank])
        assert per and all(self._units(task, shares[r] + pads[r]) == per for r in range(R)), \
            ("unequal shares", shares, pads)
        if req.dp_remainder != "pad" or not any(pads.values()):
            assert not any(pads.values()) and per * R == self._units(task, dealt), (shares, pads)
        else:
            assert tail or (grouped and sealed), ("padded before the tail", shares, pads)
        if not grouped:
            if len(can) >= size:
                assert len(dealt) == size and all(len(s) == req.batch_size
                                                   for s in shares.values()), (shares, size)
            else:
                assert tail and set(dealt) == set(can) - set(rem), (dealt, can, rem)
        else:
            keys = {self.rows[rid].key for rid in dealt}
            for key in keys:  # whole, in one share
                owners = [r for r in range(R) if set(by_key[key]) & set(shares[r])]
                assert len(owners) == 1 and set(by_key[key]) <= set(shares[owners[0]]), \
                    (key, by_key[key], shares)
                assert len(by_key[key]) == GROUP or sealed, (key, by_key[key])
            assert len(dealt) <= size, (dealt, size)
            if not sealed:
                assert len(dealt) == size, (dealt, size)
        if R == 2 and not any(pads.values()):
            self._balanced(task, shares, req.balance_by)
        event(f"dp: {task} dispatch made" + (" (tail)" if tail else "")
              + (" (padded)" if any(pads.values()) else ""))
        pads = {r: list(pads[r]) for r in range(R)}  # (a share's list, shared with its lease)
        for r in range(R):
            lid = lids[r]
            if lid:
                self.leases[lid] = (task, list(shares[r]))
                self._lease_fields[lid] = req.fields
                self.deadline[("l", lid)] = self.now + LEASE_TIMEOUT
                for rid in shares[r]:
                    self.rows[rid].leased[task] = lid
                if pads[r]:  # kept from being dropped as consumed while it is live
                    self.lease_pads[lid] = pads[r]
                    for rid in pads[r]:
                        self.pins[rid] = self.pins.get(rid, 0) + 1
            if r != rank:
                disp.shares[(k, r)] = (lid, pads[r], per, len(shares[r]))
                if lid:
                    self.unclaimed[lid] = (task, part, k, r)
        disp.made = k + 1
        disp.next[rank] = k + 1
        return d.lease or None

    def _balanced(self, task: str, shares: dict[int, list[int]], by: str | None) -> None:
        """Two shares are balanced: no unit of the heavier one, swapped for a lighter
        unit of the other, narrows their gap (a unit weighs its rows' ``by`` values,
        here the group key, or its row count)."""
        def units(rows: list[int]) -> list[float]:
            if task != DPG:
                return [1.0] * len(rows)
            by_key: dict[int | None, list[int]] = {}
            for rid in rows:
                by_key.setdefault(self.rows[rid].key, []).append(rid)
            return [float(sum(self.rows[r].key for r in u)) if by else float(len(u))
                    for u in by_key.values()]
        w = [units(shares[0]), units(shares[1])]
        if by and min(map(len, w)) >= 2:
            event("dp: a balanced dispatch of two units or more a rank")
        heavy, light = (0, 1) if sum(w[0]) >= sum(w[1]) else (1, 0)
        gap = sum(w[heavy]) - sum(w[light])
        better = [(a, b) for a in w[heavy] for b in w[light] if 0 < a - b < gap]
        assert not better, ("unbalanced", shares, w, better)

    # ------------------------------------------------------------------ versions

    @rule(step=st.sampled_from([0, 1, 1, 2, -1]))
    def set_version(self, step):
        """The policy moves on: rows older than ``version - max_staleness`` are dropped
        as stale, each with every row of its group; a version never goes back."""
        if step < 0:
            with pytest.raises(InvalidArgument):
                self.c.set_version(self.version + step)
            return
        self.version += step
        n = self.c.set_version(self.version)
        old = [] if self.max_staleness is None else [
            rid for rid, r in self.rows.items() if r.version < self.version - self.max_staleness]
        assert n == self._stale(old), (n, old)
        if self.max_staleness is not None:
            limit = self.version - self.max_staleness
            assert all(r.version >= limit for r in self.c.rows.values())
        self._settle()

    # ------------------------------------------------------------------ filters

    @precondition(lambda self: len(self.filters) < len(FILTERS))
    @rule(data=st.data())
    def add_filter(self, data):
        """A filter is registered (once: a second one of its name is refused): every row
        held must pass it before it goes to a task asking for any of its fields."""
        name = data.draw(st.sampled_from(sorted(set(FILTERS) - set(self.filters))))
        self.c.add_filter(FILTERS[name])
        self.filters[name] = FILTERS[name]
        with pytest.raises(InvalidArgument):
            self.c.add_filter(FILTERS[name])
        self._settle()

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), how=JUDGE)
    def judge(self, data, how):
        self._judge(data, how)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), how=JUDGE)
    def judge_another(self, data, how):  # (as often as rows are written)
        self._judge(data, how)

    def _judge(self, data, how: str) -> None:
        """The service runs a queued filter job: a verdict per row (one per group for a
        grouped filter, as its function gives), or the filter fails (every row of the
        job is dropped), or the run is cancelled and the job queued again. Rejected
        rows are dropped and counted; kept rows may go to tasks the filter gates. A
        job withdrawn meanwhile is skipped."""
        jid = data.draw(st.sampled_from(sorted(self.jobs)))
        name, rows = self.jobs[jid]
        assert self.c.job_live(jid) == (jid not in self.withdrawn), jid
        if jid in self.withdrawn:
            del self.jobs[jid]
            self.withdrawn.discard(jid)
            return
        if how == "retry":
            self.c.filter_retry(jid)
            self._settle()
            return
        keep: list[bool] | None = None  # (None: the filter failed)
        if how == "verdict" and self.filters[name].group_by:
            keep = [data.draw(st.booleans())] * len(rows)
        elif how == "verdict":
            keep = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
        n = self.c.filter_done(jid, keep, error=keep is None)
        del self.jobs[jid]
        live = [r for r in rows if r in self.rows]
        out = live if keep is None else [r for r, k in zip(rows, keep) if not k and r in self.rows]
        assert n == len(out), (n, out)
        for rid in live:
            row = self.rows[rid]
            del row.judging[name]
            row.judged.add(name)
        if keep is None:
            self.filter_errors[name] = self.filter_errors.get(name, 0) + len(out)
        else:
            self.filtered_by[name] = self.filtered_by.get(name, 0) + len(out)
            self.bytes_filtered_by[name] = self.bytes_filtered_by.get(name, 0) + sum(
                sum(self.rows[r].ready.values()) for r in out)
        if self.filters[name].group_by:
            self.gone_keys |= {self.rows[r].key for r in out}  # type: ignore[misc]
        for rid in out:
            self._drop(rid)
        self._settle()

    # ------------------------------------------------------------------ the clock

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0, 11.0]))
    def advance(self, dt):
        """Time passes: leases past their deadline are released (their rows delivered
        again; a late ack raises), writes admitted longer than the lease timeout ago and
        not committed are aborted (their new rows dropped)."""
        self.now += dt
        self.c.expire()
        for tok, new, b in list(self.pending):
            if self.deadline[("w", tok.id)] <= self.now:
                self.pending.remove((tok, new, b))
                self.expired_tokens.append(tok)
                self._aborted(tok, new)
        for lid in list(self.leases):
            if self.deadline[("l", lid)] <= self.now:
                self._released(lid)
        self._settle()

    @precondition(lambda self: self.expired_tokens)
    @rule()
    def commit_expired(self):
        """The writer of an expired write comes back: its commit raises, nothing changes."""
        tok = self.expired_tokens[0]
        with pytest.raises(StreamTimeout):
            self.c.commit(tok, {f: [SIZES[f]] * len(tok.rows) for f in tok.fields})

    # ------------------------------------------------------------------ lifecycle

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), go=RARELY)
    def drop(self, data, go):
        if not go:
            return
        rows = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, max_size=4,
                                  unique=True))
        assert self.c.drop(rows) == len(rows)
        for rid in rows:
            self._drop(rid)
        self._settle()

    @rule(part=st.sampled_from(PARTS), go=RARELY)
    def seal(self, part, go):
        if not go:
            return
        self.c.seal(part)
        self.sealed.add(part)
        self._retire(part)
        self._settle()

    @rule(go=st.integers(0, 7).map(lambda i: i == 0))
    def close(self, go):
        """The queue is closed (seldom): puts of new rows raise QueueClosed, writes to
        existing rows go on; a take delivers what is deliverable now, short or not, and
        ends once nothing is; a short group is whole as in a sealed partition (grouped
        streams send it, grouped filters judge it) once no write may add a member; DP
        ranks take what is deliverable as a tail (its remainder errs, drops or pads)."""
        if not go:
            return
        self.c.close()
        self.c.close()
        self.closed = True
        self._settle()

    @rule(go=st.integers(0, 15).map(lambda i: i == 0))
    def seal_all(self, go):
        """The whole queue is sealed (seldom: nothing can be put after it): every
        partition, known to the controller or not, refuses new rows, and each ends once
        drained."""
        if not go:
            return
        self.c.seal_all()
        self.c.seal_all()  # (idempotent)
        for part in ("p", "q"):
            self.sealed.add(part)
            self._retire(part)
        self._settle()

    @rule(part=st.sampled_from(PARTS), grouped=st.booleans(), size=st.sampled_from([1, 1, 2]),
          remainder=REMAINDER, balance=st.sampled_from([None, "uid"]), go=st.booleans())
    def finish_step(self, part, grouped, size, remainder, balance, go, ack=True):
        """A step ends: its partition is sealed and tidied for a DP task (its rows that
        task can never take, those that lack a field it asks for with no write of it in
        flight, or for the grouped task those of no group, are dropped), and the ranks
        take what is left in step (acking it, or with ``ack`` false keeping it), so
        that the last dispatches are a tail."""
        if not go:
            return
        self.c.seal(part)
        self.sealed.add(part)
        never = [rid for rid, r in self.rows.items() if r.part == part and (
            (r.key is None and "uid" not in r.writing) if grouped
            else any(f not in r.ready and f not in r.writing for f in self.dp_fields[DP]))]
        if never:
            assert self.c.drop(never) == len(never)
        for rid in never:
            self._drop(rid)
        self._retire(part)
        self._settle()
        for _ in range(3):
            self.dp_step(grouped, part, 0, size, remainder, balance, ack)

    @rule(size=st.sampled_from([1, 2]), ack=st.sampled_from([True, True, False]))
    def finish_padded_step(self, size, ack):
        """A step of partition q, whose rows the DP task of single rows consumes, ends
        with a padded tail: a share's padding rows are rows of the other rank's share,
        which that rank acks (and so consumes) first, or (``ack`` false) the shares are
        kept, live, for later rules (acks, releases, expiry, drops)."""
        self.finish_step("q", False, size, "pad", None, True, ack)

    @precondition(lambda self: self.dp_fields[DP] != DP_FIELDS[DP] and not self.closed
                  and "q" not in self.sealed)
    @rule(size=st.sampled_from([1, 2]), go=RARELY)
    def padded_step_loses_a_field(self, size, go):
        """With the DP task of single rows asking for ``y``: rows of partition q get ``x``
        at their put and ``y`` from a later write, the step ends with an uneven tail
        whose shares (one repeating a row of the other as padding) stay unacked, and
        then that write of ``y`` is taken back (its writer was cancelled): each share
        loses the rows it holds or repeats (a share left with nothing ends)."""
        if not go:
            return
        before = set(self.rows)
        if not self._put("q", 2 * size - 1, ("x",), True, None, None):
            return
        lack = [r for r, row in self.rows.items() if r not in before and row.part == "q"
                and "y" not in row.ready and "y" not in row.writing]
        if not lack:
            return
        tok = self.c.begin_write(lack, ["y"])
        self.deadline[("w", tok.id)] = self.now + LEASE_TIMEOUT
        for rid in lack:
            self.rows[rid].writing.add("y")
        self._commit(tok, False)
        self._settle()
        self.finish_step("q", False, size, "pad", None, True, False)
        w = next((w for w in self.committed if w[0] is tok), None)
        if w is not None:
            self.committed.remove(w)
            self._retract(w)

    @rule(part=st.sampled_from(["p", "q"]), who=st.sampled_from(["same", "one", "none"]),
          go=RARELY)
    def declare(self, part, who, go):
        """A partition's consumer set changes mid-run: back to its first one, one task of
        it, or none (no automatic cleanup). Rows every task of the new set acked, that no
        lease or DP share holds, are dropped at once; with none, acks drop nothing."""
        if not go or part in self.retired:
            return
        first = sorted(CONSUMERS[part])
        tasks = {"same": first, "one": first[:1], "none": None}[who]
        self.c.declare(part, tasks)
        self.consumers[part] = None if tasks is None else set(tasks)
        for rid in [r for r, row in self.rows.items() if row.part == part]:
            if rid in self.rows and self._consumed(rid):
                event("declare dropped rows consumed by the new set")
                self._drop(rid)
        self._settle()

    @rule(json_round_trip=st.booleans(), go=RARELY)
    def restart(self, json_round_trip, go):
        """The controller's state is saved and loaded into a new controller (a
        checkpoint restored), also through JSON. What was in flight is settled as if its
        owner had gone: leases come back released (in id order), writes in flight are
        aborted, filter jobs are queued again (same ids, same rows), and DP dispatch
        starts over; everything else goes on as it was."""
        if not go:
            return
        self._settle()
        state = self.c.state_dict()
        if json_round_trip:
            state = json.loads(json.dumps(state))
        c = Controller(CAPACITY, capacity_bytes=self.capacity_bytes, num_shards=2,
                       consumers=list(TASKS), lease_timeout=LEASE_TIMEOUT,
                       max_staleness=self.max_staleness, clock=lambda: self.now)
        c.load_state_dict(state)
        self.c = c
        if self.leases or self.pending:
            event("a restart with leases or writes in flight")
        for lid in sorted(self.leases):
            self._released(lid)
        for tok, new, b in sorted(self.pending, key=lambda w: w[0].id):
            self._aborted(tok, new)
        self.pending = []
        self.disp = {}
        self._settle()

    @precondition(lambda self: self.lost is None)
    @rule(shard=st.integers(0, 1), go=RARELY)
    def lose_unit(self, shard, go):
        """A storage unit dies: its rows are dropped as lost (nothing is deleted from
        it; writes in flight to them find them gone), wherever they are (leased, in a
        group, in a filter job, repeated as padding), and new rows go to the other
        unit."""
        if not go:
            return
        self.lost = shard
        gone = sorted(rid for rid in self.rows if self.c.rows[rid].shard == shard)
        assert self.c.mark_lost(shard) == len(gone)
        assert self.c.mark_lost(shard) == 0  # (idempotent)
        if gone:
            event("a storage unit with rows was lost")
        for rid in gone:
            if rid in self.rows:
                self._drop(rid)
                self.deleted.add(rid)  # (no delete is asked of a dead unit)
        self._settle()

    @rule(part=st.sampled_from(PARTS), go=RARELY)
    def clear(self, part, go):
        if not go:
            return
        rows = [rid for rid, r in self.rows.items() if r.part == part]
        assert self.c.clear(part) == len(rows)
        for rid in rows:
            self._drop(rid)
        self._settle()

    # ------------------------------------------------------------------ agreement

    @invariant()
    def agree(self):
        c = self.c
        assert set(c.rows) == set(self.rows)
        for rid, row in self.rows.items():
            # (bytes per field too: rows of one shape share one dict of them, which no
            # change may alter in place; see Row.fields)
            assert c.rows[rid].fields == row.ready, (rid, c.rows[rid].fields, row.ready)
            assert c.rows[rid].nbytes == sum(row.ready.values()), rid
            assert c.rows[rid].part.name == row.part
            assert c.rows[rid].version == row.version, (rid, c.rows[rid].version)
        assert c.bytes_held == sum(sum(r.ready.values()) for r in self.rows.values())
        assert c.reserved_bytes == sum(b for _, new, b in self.pending if new)
        assert {lid: sorted(rows) for lid, (_, rows) in self.leases.items()} == \
            {lid: sorted(lease.rows) for lid, lease in c.leases.items()}
        assert len(c.rows) <= CAPACITY
        assert state._NO_FIELDS == {} and state._NO_TAGS_D == {}  # (shared, never changed)
        # every row dropped was deleted from storage, and no row held was
        assert self.deleted == self.dropped
        # rows dropped as stale, rejected, or dropped by a failed filter, counted so
        assert c.c_dropped.get("stale", 0) == self.stale
        assert c.c_dropped.get("filtered", 0) == sum(self.filtered_by.values())
        assert c.c_dropped.get("filter_error", 0) == sum(self.filter_errors.values())
        assert c.c_dropped.get("dp_remainder", 0) == self.dp_dropped
        assert {k: v for k, v in c.c_filtered_by.items() if v} == \
            {k: v for k, v in self.filtered_by.items() if v}
        assert {k: v for k, v in c.c_bytes_filtered_by.items() if v} == \
            {k: v for k, v in self.bytes_filtered_by.items() if v}
        assert {k: v for k, v in c.c_filter_errors.items() if v} == \
            {k: v for k, v in self.filter_errors.items() if v}

    @invariant()
    def dp_shares_reserved(self):
        """The shares the model holds for ranks that have not asked are reserved in the
        controller (leased to their task, unclaimed, for that rank); every other live
        lease has been handed out; the rows live shares repeat as padding are pinned."""
        for lid, (task, _, _, r) in self.unclaimed.items():
            lease = self.c.leases[lid]
            assert lease.task == task and lease.rank == r and not lease.claimed, lid
        for lid in set(self.leases) - set(self.unclaimed):
            assert self.c.leases[lid].claimed, lid
        # rows repeated as padding by live shares (kept from being dropped as consumed)
        assert self.c._pins == self.pins, (self.c._pins, self.pins)
        assert all(lid in self.leases for lid in self.lease_pads), self.lease_pads

    @invariant()
    def groups_leave_whole(self):
        """A group that left in this step (a row of it went stale, or a grouped filter
        rejected it) left whole: no row held has its key."""
        assert not {r.tags.get("uid") for r in self.c.rows.values()} & self.gone_keys, \
            self.gone_keys
        self.gone_keys = set()

    @invariant()
    def filters_keep_up(self):
        """The controller has every row a filter has not judged yet as such, each queued
        job is live unless withdrawn, and no filter holds back a job it could queue: a
        row that has the fields of a filter judging rows one by one is queued at once; a
        grouped filter waits for ``GROUP`` rows of a group, and in a sealed partition
        for none."""
        c = self.c
        assert c.pending_filter_rows() == {
            name: sum(1 for r in self.rows.values() if name not in r.judged)
            for name in self.filters}
        for jid in self.jobs:
            assert c.job_live(jid) == (jid not in self.withdrawn), jid
        for name, spec in self.filters.items():
            waiting: dict[int | None, int] = {}
            for rid, r in self.rows.items():
                if name in r.judged or name in r.judging or not spec.fields <= r.ready.keys():
                    continue
                # (sealed: only while a put admitted before the seal may add a member)
                assert spec.group_by and ((r.part not in self.sealed and not self.closed)
                                          or self._key_may_come(r.part)), (name, rid)
                waiting[r.key] = waiting.get(r.key, 0) + 1
            assert all(n < GROUP for n in waiting.values()), (name, waiting)


ControllerModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("STREAMRL_MODEL_EXAMPLES", "150")),
    stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestControllerModel = ControllerModel.TestCase
