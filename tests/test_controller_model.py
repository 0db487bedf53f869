"""The controller against a model of it that keeps one record per row.

A hypothesis state machine drives :class:`streamrl.controller.Controller` and a plain
per-row model side by side: new rows (committed at once or later, or aborted), writes
of new fields to existing rows (committed, aborted or taken back), takes, acks,
releases, drops, seals and clears over two partitions and two declared consumers, a
bound in rows and one in bytes, a clock that expires leases and writes, and groups (a
third task takes whole groups of rows sharing a key, put at once or in pieces).
After every step the two must agree on which rows are held, which fields each has
ready, the bytes held, the live leases and their rows, and the rows deleted from
storage; every take must hand out only rows the model finds deliverable to that task,
a full batch whenever the model has one, and the end of a sealed partition only once
nothing of it is left for the task.

This is the reference a change of the controller's internals (rows kept as runs, see
docs/scaling.md) is checked against: the model is per row on purpose.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from streamrl.controller import END, Controller, Delivery, Request
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


class _Row:
    def __init__(self, part: str):
        self.part = part
        self.key: int | None = None  # its group key (``uid``), once committed
        self.ready: dict[str, int] = {}  # field -> bytes, committed
        self.writing: set[str] = set()  # fields with a write in flight
        self.acked: set[str] = set()
        self.leased: dict[str, int] = {}  # task -> lease id


class ControllerModel(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.now = 0.0  # the controller's clock, moved by ``advance``
        self.c = Controller(CAPACITY, capacity_bytes=CAPACITY_BYTES, num_shards=2,
                            consumers=list(TASKS), lease_timeout=LEASE_TIMEOUT,
                            clock=lambda: self.now)
        # ("l", lease id) or ("w", write token id) -> its deadline
        self.deadline: dict[tuple[str, int], float] = {}
        self.c.register_tag("uid")
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

    def _deliverable(self, task: str, fields: tuple[str, ...], part: str) -> list[int]:
        return [rid for rid, r in self.rows.items()
                if r.part == part and task not in r.acked and task not in r.leased
                and all(f in r.ready for f in fields)]

    def _settle(self) -> None:
        deletes, *_ = self.c.drain()
        for rows in deletes.values():
            self.deleted.update(rows)

    # ------------------------------------------------------------------ new rows

    @rule(part=st.sampled_from(PARTS), n=st.integers(1, 4),
          fields=st.sets(st.sampled_from(("x", "y")), min_size=1), now=MOSTLY)
    def put(self, part, n, fields, now):
        self._put(part, n, tuple(sorted(fields)), now, None)

    @rule(part=st.sampled_from(PARTS), half=RARELY, now=MOSTLY)
    def put_group(self, part, half, now):
        self._put_group(part, half, now)

    @rule(part=st.sampled_from(PARTS), half=RARELY, now=MOSTLY)
    def put_another_group(self, part, half, now):  # (groups need a few puts)
        self._put_group(part, half, now)

    def _put_group(self, part: str, half: bool, now: bool) -> None:
        """A group of ``GROUP`` rows sharing a key, put at once or one row now and the
        others later (``finish_group``), as a GRPO group's samples arrive."""
        self.keys += 1
        if self._put(part, 1 if half else GROUP, ("uid", "x"), now, self.keys) and half:
            self.open_groups.append((part, self.keys))

    @precondition(lambda self: self.open_groups)
    @rule(i=st.integers(0, 1000), now=MOSTLY)
    def finish_group(self, i, now):
        part, key = self.open_groups.pop(i % len(self.open_groups))
        self._put(part, GROUP - 1, ("uid", "x"), now, key)

    def _put(self, part: str, n: int, fields: tuple[str, ...], now: bool,
             key: int | None) -> bool:
        nbytes = n * sum(SIZES[f] for f in fields)
        if part in self.sealed:
            with pytest.raises(InvalidArgument):
                self.c.allocate(part, n, fields, nbytes=nbytes)
            return False
        held = sum(sum(r.ready.values()) for r in self.rows.values())
        reserved = sum(b for _, new, b in self.pending if new)
        if len(self.rows) + n > CAPACITY or (
                self.rows and held + reserved + nbytes > CAPACITY_BYTES):
            with pytest.raises(QueueFull):
                self.c.allocate(part, n, fields, nbytes=nbytes)
            return False
        tok = self.c.allocate(part, n, fields, nbytes=nbytes)
        self.deadline[("w", tok.id)] = self.now + LEASE_TIMEOUT
        if key is not None:
            self.token_key[tok.id] = key
        assert len(tok.rows) == n and not set(tok.rows) & (set(self.rows) | self.dropped)
        for rid in tok.rows:
            row = self.rows[rid] = _Row(part)
            row.writing = set(fields)
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
        if not go:
            return
        tok, new = self.committed.pop(i % len(self.committed))
        self.c.retract(tok)
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
          batch=st.integers(1, 3))
    def take(self, task, part, fields, batch):
        self._take(task, part, fields, batch)
        self._settle()

    @rule(task=st.sampled_from(TASKS), part=st.sampled_from(PARTS), batch=st.integers(1, 3))
    def consume(self, task, part, batch):
        """A consumer's step: take a batch of ``x`` and acknowledge it."""
        lid = self._take(task, part, ("x",), batch)
        if lid is not None:
            self._ack(lid)
        self._settle()

    def _take(self, task: str, part: str, fields: tuple[str, ...], batch: int) -> int | None:
        can = self._deliverable(task, fields, part)
        d = self.c.take(Request(task, fields, batch, partition=part))
        left = [r for r in self.rows.values() if r.part == part and task not in r.acked]
        if d is END:
            assert part in self.sealed and not left, (part, len(left))
            return None
        if d is None:
            assert len(can) < batch, (can, batch)
            if part in self.sealed and can and all(
                    task not in r.leased and all(f in r.ready for f in fields)
                    for r in left):
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
                all(f in r.ready for f in fields) for r in left)
            assert part not in self.sealed or not final or not (full or short), (full, short)
        else:
            got = list(d.rows)
            assert len(set(got)) == len(got) and set(got) <= set(can), (got, can)
            assert len(got) <= batch
            keys = {self.rows[r].key for r in got}
            for k in keys:  # whole: every deliverable row of each key it has
                assert sorted(by_key[k]) == sorted(r for r in got if self.rows[r].key == k)
                assert len(by_key[k]) == GROUP or part in self.sealed, (k, by_key[k])
            if len(full) >= groups and part not in self.sealed:
                # (sealed, a short group ahead may leave a batch short: groups are whole)
                assert len(got) == batch, (got, full, groups)
            self.c.ack([d.lease])
            self.outcome[d.lease] = "acked"
            for rid in got:
                self.rows[rid].acked.add(task)
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
        assert c.bytes_held == sum(sum(r.ready.values()) for r in self.rows.values())
        assert c.reserved_bytes == sum(b for _, new, b in self.pending if new)
        assert {lid: sorted(rows) for lid, (_, rows) in self.leases.items()} == \
            {lid: sorted(lease.rows) for lid, lease in c.leases.items()}
        assert len(c.rows) <= CAPACITY
        # every row dropped was deleted from storage, and no row held was
        assert self.deleted == self.dropped


ControllerModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("STREAMRL_MODEL_EXAMPLES", "150")),
    stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestControllerModel = ControllerModel.TestCase
