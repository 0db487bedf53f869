"""The controller's saved state: ``state_dict`` -> msgpack/JSON -> ``load_state_dict``.

The property: a controller loaded from a saved state continues exactly as the original
does once the original has settled what was in flight the way a load settles it (leases
released in id order, then writes aborted in id order). Both then get the same random
continuation and must give the same deliveries, the same answers and errors, and end in
the same state (counters included)."""

from __future__ import annotations

import json
import os

import msgpack
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from streamrl.controller import END, Controller, FilterSpec, Request
from streamrl.errors import CheckpointError, LeaseExpired, StreamRLError


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


PARTS = ("a", "b")
TASKS = ("t", "u")
FIELDS = (("x",), ("x", "r"), ("r",), ("uid", "x"))
CONSUMERS = (None, ("t",), ("t", "u"))


def make(clock: Clock) -> Controller:
    c = Controller(48, num_shards=2, lease_timeout=10.0, max_staleness=2, clock=clock)
    c.register_tag("uid")
    return c


def settle(c: Controller) -> None:
    """What load_state_dict does to what was in flight, done by the original."""
    c.release(sorted(c.leases))
    for tid in sorted(c._tokens):
        c.abort(tid)


def pick(c: Controller, idx: list[int]) -> list[int]:
    rows = sorted(c.rows)
    out = [rows[i % len(rows)] for i in idx] if rows else []
    return list(dict.fromkeys(out + [10_000]))  # and one id that never existed


def apply(c: Controller, clock: Clock, op: tuple):
    """Apply one operation; return what it answered (or the error's type)."""
    kind, *a = op
    try:
        if kind == "put":
            part, n, with_r, lag = a
            fields = ("x", "uid", "r") if with_r else ("x", "uid")
            tok = c.allocate(PARTS[part], n, fields, nbytes=8 * n,
                             version=max(0, c.version - lag))
            uids = [(tok.rows[0] + i // 2) % 7 for i in range(n)]  # pairs share a key
            res = c.commit(tok, {f: [4] * n for f in fields}, {"uid": uids})
            return ("put", tok.rows, sorted(res.dead.items()))
        if kind == "unit_put":
            part, shard, n = a
            lo, _ = c.unit_ids(shard, n + 1)
            tok = c.allocate(PARTS[part], n, ("x", "uid"), nbytes=4 * n,
                             ids=list(range(lo, lo + n)), shard=shard)
            c.commit(tok, {"x": [4] * n, "uid": [4] * n}, {"uid": [lo % 5] * n})
            return ("unit_put", tok.rows)
        if kind == "alloc":
            part, n = a
            return ("alloc", c.allocate(PARTS[part], n, ("x", "uid"), nbytes=4 * n).rows)
        if kind == "write":
            idx, field = a
            rows = [r for r in pick(c, idx) if r in c.rows]
            return ("write", c.begin_write(rows, (field,)).id if rows else None)
        if kind in ("commit", "abort"):
            toks = sorted(c._tokens)
            if not toks:
                return None
            tok = c._tokens[toks[a[0] % len(toks)]]
            if kind == "abort":
                undo = c.abort(tok)
                return ("abort", tok.id, undo and undo.parts)
            n = len(tok.rows)
            tags = {"uid": [r % 7 for r in tok.rows]} if "uid" in tok.fields else None
            return ("commit", c.commit(tok, {f: [4] * n for f in tok.fields}, tags).dead)
        if kind == "take":
            task, fields, bs, part, grouped, stale, drop_last, sampler = a
            group = {"group_by": "uid", "group_size": 2 if grouped == 1 else None} if grouped else {}
            req = Request(TASKS[task], FIELDS[fields], bs * (2 if grouped == 1 else 1),
                          partition=None if part == 2 else PARTS[part],
                          max_staleness=stale, drop_last=drop_last, sampler=sampler, **group)
            d = c.take(req)
            if d is None or d is END:
                return ("take", repr(d))
            return ("take", d.lease, d.rows, d.shards, d.versions, d.partition, d.known, d.nbytes)
        if kind in ("ack", "release"):
            ids = sorted(c.leases) + [a[1]]  # and, maybe, a lease that ended
            lid = ids[a[0] % len(ids)]
            (c.ack if kind == "ack" else c.release)([lid])
            return (kind, lid)
        if kind == "drop":
            return ("drop", c.drop(pick(c, a[0])))
        if kind == "clear":
            return ("clear", c.clear(PARTS[a[0]]))
        if kind == "seal":
            c.seal(PARTS[a[0]])
            return ("seal",)
        if kind == "seal_all":
            c.seal_all()
            return ("seal_all",)
        if kind == "declare":
            part, cons = a
            c.declare(PARTS[part], CONSUMERS[cons])
            return ("declare",)
        if kind == "set_version":
            return ("set_version", c.set_version(c.version + a[0]))
        if kind == "filter":
            name, group_size = a
            if name == 0:
                c.add_filter(FilterSpec("f", frozenset({"r"})))
            else:
                c.add_filter(FilterSpec("g", frozenset({"x"}), "uid", group_size))
            return ("filter", name)
        if kind == "judge":
            jobs = sorted(c._jobs)
            if not jobs:
                return None
            job = c._jobs[jobs[a[0] % len(jobs)]]
            if a[1]:
                return ("judge", job.id, c.filter_done(job.id, None, error=True))
            return ("judge", job.id, c.filter_done(job.id, [r % 3 != 0 for r in job.rows]))
        if kind == "tick":
            clock.t += a[0]
            return ("tick", c.expire())
        if kind == "lost":
            return ("lost", c.mark_lost(a[0]))
        if kind == "close":
            c.close()
            return ("close",)
        raise AssertionError(kind)
    except LeaseExpired as e:
        return ("error", "LeaseExpired", str(e))
    except StreamRLError as e:
        return ("error", type(e).__name__)


rows_idx = st.lists(st.integers(0, 50), min_size=1, max_size=4)
PUT = st.tuples(st.just("put"), st.integers(0, 1), st.integers(1, 6), st.booleans(),
                st.sampled_from([0, 0, 0, 1, 3]))
TAKE = st.tuples(st.just("take"), st.integers(0, 1), st.integers(0, 3), st.integers(1, 4),
                 st.sampled_from([0, 0, 1, 2]), st.sampled_from([0, 0, 0, 1, 2]),
                 st.sampled_from([None, None, None, 1]), st.booleans(),
                 st.sampled_from([None, None, {"sampler": "priority", "field": "uid"},
                                  {"sampler": "priority", "field": "@version", "order": "asc"}]))
ACK = st.tuples(st.just("ack"), st.integers(0, 9), st.integers(1, 12))
OTHER = [
    (st.tuples(st.just("unit_put"), st.integers(0, 1), st.integers(0, 1), st.integers(1, 4)), 3),
    (st.tuples(st.just("alloc"), st.integers(0, 1), st.integers(1, 4)), 3),
    (st.tuples(st.just("write"), rows_idx, st.sampled_from(["r", "r", "y"])), 5),
    (st.tuples(st.just("commit"), st.integers(0, 9)), 5),
    (st.tuples(st.just("abort"), st.integers(0, 9)), 2),
    (st.tuples(st.just("release"), st.integers(0, 9), st.integers(1, 12)), 3),
    (st.tuples(st.just("drop"), rows_idx), 3),
    (st.tuples(st.just("set_version"), st.integers(0, 2)), 3),
    (st.tuples(st.just("filter"), st.integers(0, 1), st.sampled_from([None, 2])), 2),
    (st.tuples(st.just("judge"), st.integers(0, 9), st.sampled_from([False, False, True])), 5),
    (st.tuples(st.just("tick"), st.sampled_from([0.5, 3.0, 11.0])), 3),
    (st.tuples(st.just("seal"), st.integers(0, 1)), 2),
    (st.tuples(st.just("declare"), st.integers(0, 1), st.integers(0, 2)), 1),
    (st.tuples(st.just("clear"), st.integers(0, 1)), 1),
    (st.tuples(st.just("lost"), st.integers(0, 1)), 1),
    (st.tuples(st.just("seal_all")), 1),
    (st.tuples(st.just("close")), 1),
]
WEIGHTED = [(PUT, 16), (TAKE, 16), (ACK, 8)] + OTHER
CHOICES = [strategy for strategy, weight in WEIGHTED for _ in range(weight)]
OP = st.integers(0, len(CHOICES) - 1).flatmap(lambda i: CHOICES[i])  # weighted choice
SCRIPT = st.lists(OP, max_size=60)


def pack(state, codec):
    if codec == "msgpack":
        return msgpack.unpackb(msgpack.packb(state))
    return json.loads(json.dumps(state))


def observe(c: Controller) -> dict:
    return {"state": c.state_dict(), "pending": c.pending_filter_rows(),
            "parts": c.partition_states(), "leaked": c.leaked(), "held": c.held_by_partition(),
            "bytes": (c.bytes_held, c.reserved_bytes), "rows": len(c.rows)}


# STREAMRL_STATE_EXAMPLES=5000 for a longer hunt (with pytest --timeout 0)
@settings(max_examples=int(os.environ.get("STREAMRL_STATE_EXAMPLES", 300)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.lists(OP, min_size=8, max_size=60), rest=SCRIPT, codec=st.sampled_from(["msgpack", "json"]))
def test_a_loaded_controller_continues_as_the_original(prefix, rest, codec):
    clock = Clock()
    a = make(clock)
    for op in prefix:
        apply(a, clock, op)
    a.drain()
    saved = pack(a.state_dict(), codec)
    for what, n in (("leases", len(a.leases)), ("writes", len(a._tokens)),
                    ("filter jobs", len(a._jobs)), ("subscriptions", len(a.subs))):
        event(f"{what} at save: {'some' if n else 'none'}")

    clock_b = Clock(clock.t)
    b = make(clock_b)
    b.load_state_dict(saved)
    settle(a)
    assert observe(b) == observe(a)

    delivered = 0
    for op in rest:
        got = apply(b, clock_b, op)
        assert got == apply(a, clock, op), op
        delivered += bool(got and got[0] == "take" and len(got) > 2)
    event(f"deliveries after the load: {min(delivered, 3)}{'+' if delivered >= 3 else ''}")
    assert observe(b) == observe(a)


def test_state_dict_packs_as_msgpack_and_json():
    c = make(Clock())
    c.add_filter(FilterSpec("g", frozenset({"r"}), "uid", 2))
    tok = c.allocate("a", 4, ("x", "uid"), nbytes=16)
    c.commit(tok, {"x": [4] * 4, "uid": [4] * 4}, {"uid": [1, 1, (2, "k"), (2, "k")]})
    c.take(Request("t", ("x",), 2, partition="a"))
    c.take(Request("u", ("x", "uid"), 2, partition="a", group_by="uid", group_size=2))
    c.begin_write(tok.rows, ("r",))
    state = c.state_dict()
    assert msgpack.unpackb(msgpack.packb(state)) == json.loads(json.dumps(state))
    restored = make(Clock())
    restored.load_state_dict(msgpack.unpackb(msgpack.packb(state)))
    assert restored.rows[2].tags["uid"] == (2, "k")  # a tuple key stays a tuple


def test_a_streamed_state_file_holds_the_same_state(tmp_path):
    """A checkpoint packs the cut's rows as a stream (each row's dict made and let go
    while packing, so a big cut does not make the garbage collector stop every thread):
    the file reads back as the state_dict() of the same cut, rows in the same order."""
    from streamrl.checkpoint.files import read_msgpack, write_msgpack

    c = Controller(2048, num_shards=2, lease_timeout=10.0, clock=Clock())
    c.register_tag("uid")
    for i in range(3):  # more rows than one slice of the writer (512)
        tok = c.allocate("a" if i % 2 else "b", 400, ("x", "uid"), nbytes=1600)
        c.commit(tok, {"x": [4] * 400, "uid": [4] * 400}, {"uid": list(range(400))})
    c.take(Request("t", ("x",), 5, partition="a"))
    cut = c.state_cut()
    streamed = cut.stream_dict()
    assert not isinstance(streamed["rows"], list) and len(streamed["rows"]) == 1200
    entry = write_msgpack(str(tmp_path / "state.msgpack"), streamed)
    assert read_msgpack(str(tmp_path / "state.msgpack"), entry, "state") == cut.state_dict()


def test_a_stream_that_gives_fewer_items_than_it_said_is_not_written(tmp_path):
    from streamrl.checkpoint.files import write_msgpack

    class Liar:
        def __len__(self):
            return 3

        def __iter__(self):
            return iter([1, 2])

    with pytest.raises(ValueError, match="said it had 3 items and gave 2"):
        write_msgpack(str(tmp_path / "x.msgpack"), {"rows": Liar()})


def test_load_semantics_leases_released_writes_aborted_jobs_rejudged_ids_not_reused():
    c = make(Clock())
    c.add_filter(FilterSpec("f", frozenset({"r"})))
    tok = c.allocate("a", 4, ("x", "uid"), nbytes=16)
    c.commit(tok, {"x": [4] * 4, "uid": [4] * 4}, {"uid": [0, 1, 2, 3]})
    first = c.take(Request("t", ("x",), 2, partition="a"))
    c.ack([first.lease])  # acked: never again to "t"
    held = c.take(Request("t", ("x",), 2, partition="a"))  # leased at save time
    inflight = c.allocate("a", 2, ("x",), nbytes=8)  # new rows, never committed
    judged = c.begin_write(tok.rows, ("r",))
    c.commit(judged, {"r": [4] * 4})  # a filter job is in flight
    (job,) = c.drain()[1]
    writing = c.begin_write(tok.rows, ("y",))  # a write to existing rows in flight
    put_before = c.c_put

    r = make(Clock())
    r.load_state_dict(c.state_dict())
    assert set(r.rows) == set(tok.rows)  # the in-flight new rows were dropped...
    assert r.c_put == put_before - 2 and r.reserved_bytes == 0  # ...as by an abort
    deletes, jobs, *_ = r.drain()
    assert deletes == {inflight.shards[0]: inflight.rows}
    assert [(j.id, j.rows) for j in jobs] == [(job.id, job.rows)]  # judged again
    (undo,) = r.field_deletes
    assert undo.write == writing.id and undo.parts == [(("y",), {0: tok.rows})]
    with pytest.raises(LeaseExpired):
        r.ack([held.lease])  # released by the load
    again = r.take(Request("t", ("x",), 2, partition="a"))
    assert again.rows == held.rows and r.c_redelivered["t"] == 2
    assert again.lease > held.lease
    new = r.allocate("a", 1, ("x",))
    assert new.id > writing.id and new.rows[0] > max(inflight.rows)  # no id reused
    r.filter_done(job.id, [True] * 4)
    assert r.take(Request("v", ("r",), 4, partition="a")).rows == tok.rows


def test_dp_dispatch_starts_again_after_a_load():
    c = make(Clock())
    tok = c.allocate("a", 8, ("x",), nbytes=32)
    c.commit(tok, {"x": [4] * 8})
    reqs = [Request("t", ("x",), 2, partition="a", dp_size=2, dp_rank=k) for k in (0, 1)]
    c.take(reqs[0])  # dispatch 0 made; rank 1's share reserved
    r = make(Clock())
    r.load_state_dict(c.state_dict())
    shares = [r.take(q) for q in reqs]
    assert [s.dispatch for s in shares] == [0, 0]
    assert sorted(shares[0].rows + shares[1].rows) == sorted(set(shares[0].rows + shares[1].rows))


def test_a_state_of_another_format_version_is_refused():
    c = make(Clock())
    state = c.state_dict()
    for bad, match in [({**state, "version": 99}, "newer"), ({**state, "version": "1"}, "unknown"),
                       ({"rows": []}, "not a saved controller state"),
                       ({**state, "counters": {}}, "malformed")]:
        with pytest.raises(CheckpointError, match=match):
            make(Clock()).load_state_dict(bad)
    c.allocate("a", 1, ("x",))
    c.commit(c.allocate("b", 1, ("x",)), {"x": [1]})  # lands on unit 1
    with pytest.raises(CheckpointError, match="num_shards"):
        Controller(8, num_shards=1).load_state_dict(c.state_dict())
