"""The controller against a model of it that keeps one record per row.

A hypothesis state machine drives :class:`streamrl.controller.Controller` and a plain
per-row model side by side: new rows (committed at once or later, or aborted), writes
of new fields to existing rows (committed, aborted or taken back), takes, acks,
releases, drops, seals and clears over two partitions and two declared consumers, a
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

This is the reference a change of the controller's internals (rows kept as runs, see
docs/scaling.md) is checked against: the model is per row on purpose.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from streamrl.controller import END, Controller, Delivery, FilterSpec, Request
from streamrl.errors import (DuplicateField, InvalidArgument, LeaseExpired, QueueFull,
                             RowsDropped, StreamTimeout)

CAPACITY = 16
#: a byte bound that binds before the row bound (16 rows of x and y are 192 bytes)
CAPACITY_BYTES = 120
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
                filters=st.sets(st.sampled_from(sorted(FILTERS))))
    def start(self, max_staleness, filters):
        self.now = 0.0  # the controller's clock, moved by ``advance``
        self.max_staleness = max_staleness
        self.version = VERSION
        self.c = Controller(CAPACITY, capacity_bytes=CAPACITY_BYTES, num_shards=2,
                            consumers=list(TASKS), lease_timeout=LEASE_TIMEOUT,
                            max_staleness=max_staleness, clock=lambda: self.now)
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
        self.retired: set[str] = set()  # sealed partitions whose last row left
        self.leases: dict[int, tuple[str, list[int]]] = {}  # live: lid -> (task, rows)
        self.outcome: dict[int, str] = {}  # ended leases: "acked" or "released"
        self.pending: list = []  # (token, new rows?, bytes reserved) admitted, not committed
        self.committed: list = []  # (token, new rows?) committed writes, for retract
        self.dropped: set[int] = set()  # rows the model dropped
        self.deleted: set[int] = set()  # rows the controller asked storage to delete
        # lease id -> the fields it asked for (a retract takes rows only from leases of them)
        self._lease_fields: dict[int, tuple[str, ...]] = {}

    # ------------------------------------------------------------------ model helpers

    def _drop(self, rid: int) -> None:
        row = self.rows.pop(rid)
        self.dropped.add(rid)
        for lid in row.leased.values():
            task, rows = self.leases[lid]
            rows.remove(rid)
            if not rows:  # (an emptied lease counts as acked)
                del self.leases[lid]
                self.outcome[lid] = "acked"
        self._retire(row.part)

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
                part in self.sealed and not self._key_may_come(part)), job
            rest = [rid for rid, r in self.rows.items() if r.key == key
                    and job.filter not in r.judged and job.filter not in r.judging]
            assert set(rest) <= set(job.rows), (job, rest)
        for rid in live:
            self.rows[rid].judging[job.filter] = job.id
        self.jobs[job.id] = (job.filter, list(job.rows))

    # ------------------------------------------------------------------ new rows

    @rule(part=st.sampled_from(PARTS), n=st.integers(1, 4),
          fields=st.sets(st.sampled_from(("x", "y")), min_size=1), now=MOSTLY, age=AGES)
    def put(self, part, n, fields, now, age):
        self._put(part, n, tuple(sorted(fields)), now, None, self._version(age))

    @rule(part=st.sampled_from(PARTS), half=RARELY, now=MOSTLY, age=AGES)
    def put_group(self, part, half, now, age):
        self._put_group(part, half, now, age)

    @rule(part=st.sampled_from(PARTS), half=RARELY, now=MOSTLY, age=AGES)
    def put_another_group(self, part, half, now, age):  # (groups need a few puts)
        self._put_group(part, half, now, age)

    def _version(self, age: int | None) -> int | None:
        return None if age is None else max(0, self.version - age)

    def _put_group(self, part: str, half: bool, now: bool, age: int | None) -> None:
        """A group of ``GROUP`` rows sharing a key, put at once or one row now and the
        others later (``finish_group``), as a GRPO group's samples arrive; every row of
        the group has the version of its first put."""
        self.keys += 1
        version = self._version(age)
        self.key_version[self.keys] = self.version if version is None else version
        if self._put(part, 1 if half else GROUP, ("uid", "x"), now, self.keys,
                     version) and half:
            self.open_groups.append((part, self.keys))

    @precondition(lambda self: self.open_groups)
    @rule(i=st.integers(0, 1000), now=MOSTLY)
    def finish_group(self, i, now):
        part, key = self.open_groups.pop(i % len(self.open_groups))
        self._put(part, GROUP - 1, ("uid", "x"), now, key, self.key_version[key])

    def _put(self, part: str, n: int, fields: tuple[str, ...], now: bool,
             key: int | None, version: int | None) -> bool:
        """New rows of ``version`` (``None``: the current one); rows already older than
        ``version - max_staleness`` are admitted and dropped as stale at once."""
        nbytes = n * sum(SIZES[f] for f in fields)
        if part in self.sealed:
            with pytest.raises(InvalidArgument):
                self.c.allocate(part, n, fields, nbytes=nbytes, version=version)
            return False
        held = sum(sum(r.ready.values()) for r in self.rows.values())
        reserved = sum(b for _, new, b in self.pending if new)
        if len(self.rows) + n > CAPACITY or (
                self.rows and held + reserved + nbytes > CAPACITY_BYTES):
            with pytest.raises(QueueFull):
                self.c.allocate(part, n, fields, nbytes=nbytes, version=version)
            return False
        tok = self.c.allocate(part, n, fields, nbytes=nbytes, version=version)
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

    def _commit(self, tok, new: bool) -> None:
        key = self.token_key.get(tok.id)
        res = self.c.commit(tok, {f: [SIZES[f]] * len(tok.rows) for f in tok.fields},
                            None if key is None else {"uid": [key] * len(tok.rows)})
        dead = sorted(r for rows in res.dead.values() for r in rows)
        assert dead == sorted(r for r in tok.rows if r not in self.rows)
        for rid in tok.rows:
            row = self.rows.get(rid)
            if row is not None:
                for f in tok.fields:
                    row.writing.discard(f)
                    row.ready[f] = SIZES[f]
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
        tok = self.c.begin_write(rows, [field])
        self.deadline[("w", tok.id)] = self.now + LEASE_TIMEOUT
        for rid in rows:
            self.rows[rid].writing.add(field)
        if now:
            self._commit(tok, False)
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
        self.c.retract(tok)
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
                    if not lrows:
                        del self.leases[lid]
                        self.outcome[lid] = "withdrawn"
        self._settle()

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
        if d is END:
            assert part in self.sealed and not left, (part, len(left))
            return None
        if d is None:
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
            assert part in self.sealed and got, (got, can, batch)
        for rid in got:
            self.rows[rid].leased[task] = d.lease
        self.leases[d.lease] = (task, got)
        self.deadline[("l", d.lease)] = self.now + LEASE_TIMEOUT
        self._lease_fields[d.lease] = fields
        return d.lease

    @precondition(lambda self: self.leases or self.outcome)
    @rule(data=st.data())
    def ack(self, data):
        lid = data.draw(st.sampled_from(sorted(set(self.leases) | set(self.outcome))))
        self._ack(lid)
        self._settle()

    def _ack(self, lid: int) -> None:
        if lid in self.leases:
            self.c.ack([lid])
            task, rows = self.leases.pop(lid)
            self.outcome[lid] = "acked"
            for rid in rows:
                row = self.rows[rid]
                del row.leased[task]
                row.acked.add(task)
                if set(TASKS) <= row.acked and not row.leased:
                    self._drop(rid)
        elif self.outcome[lid] in ("released", "withdrawn"):
            with pytest.raises(LeaseExpired):
                self.c.ack([lid])
        else:
            self.c.ack([lid])  # (idempotent)

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), go=RARELY)
    def release(self, data, go):
        if not go:
            return
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        self.c.release([lid])
        self._released(lid)
        self._settle()

    def _released(self, lid: int) -> None:
        """A lease was given back (or expired): its rows go to the task again; a late
        ack of it raises."""
        task, rows = self.leases.pop(lid)
        self.outcome[lid] = "released"
        for rid in rows:
            del self.rows[rid].leased[task]

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
                 if part in self.sealed and len(rows) < GROUP and members[k] == len(rows)]
        d = self.c.take(Request(task, fields, batch, partition=part, group_by="uid",
                                group_size=GROUP))
        left = [r for r in self.rows.values() if r.part == part and task not in r.acked]
        if d is END:
            assert part in self.sealed and not left, (part, len(left))
        elif d is None:
            assert len(full) < groups, (full, groups)
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
                assert len(by_key[k]) == GROUP or (
                    part in self.sealed and not self._key_may_come(part)), (k, by_key[k])
            if len(full) >= groups and part not in self.sealed:
                # (sealed, a short group ahead may leave a batch short: groups are whole)
                assert len(got) == batch, (got, full, groups)
            self.c.ack([d.lease])
            self.outcome[d.lease] = "acked"
            for rid in got:
                self.rows[rid].acked.add(task)
        self._settle()

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
            assert set(c.rows[rid].fields) == set(row.ready), (rid, c.rows[rid].fields)
            assert c.rows[rid].part.name == row.part
            assert c.rows[rid].version == row.version, (rid, c.rows[rid].version)
        assert c.bytes_held == sum(sum(r.ready.values()) for r in self.rows.values())
        assert c.reserved_bytes == sum(b for _, new, b in self.pending if new)
        assert {lid: sorted(rows) for lid, (_, rows) in self.leases.items()} == \
            {lid: sorted(lease.rows) for lid, lease in c.leases.items()}
        assert len(c.rows) <= CAPACITY
        # every row dropped was deleted from storage, and no row held was
        assert self.deleted == self.dropped
        # rows dropped as stale, rejected, or dropped by a failed filter, counted so
        assert c.c_dropped.get("stale", 0) == self.stale
        assert c.c_dropped.get("filtered", 0) == sum(self.filtered_by.values())
        assert c.c_dropped.get("filter_error", 0) == sum(self.filter_errors.values())
        assert {k: v for k, v in c.c_filtered_by.items() if v} == \
            {k: v for k, v in self.filtered_by.items() if v}
        assert {k: v for k, v in c.c_bytes_filtered_by.items() if v} == \
            {k: v for k, v in self.bytes_filtered_by.items() if v}
        assert {k: v for k, v in c.c_filter_errors.items() if v} == \
            {k: v for k, v in self.filter_errors.items() if v}

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
                assert spec.group_by and (r.part not in self.sealed
                                          or self._key_may_come(r.part)), (name, rid)
                waiting[r.key] = waiting.get(r.key, 0) + 1
            assert all(n < GROUP for n in waiting.values()), (name, waiting)


ControllerModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("STREAMRL_MODEL_EXAMPLES", "150")),
    stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestControllerModel = ControllerModel.TestCase
