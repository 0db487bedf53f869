"""Unit tests of the pure controller: no event loop, no I/O, an injected clock."""

from __future__ import annotations

import pytest

from streamrl.controller import END, Controller, FilterSpec, Request, imbalance, _balanced_split
from streamrl.errors import (DispatchError, DuplicateField, InvalidArgument, LeaseExpired,
                             QueueClosed, QueueFull, RowsDropped, StreamTimeout)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def put(c, n, fields=("x",), part="p", version=None, nbytes=8, tags=None):
    tok = c.allocate(part, n, fields, nbytes=n * nbytes * len(fields), version=version)
    res = c.commit(tok, {f: [nbytes] * n for f in fields}, tags)
    return tok.rows, res


def req(task="t", fields=("x",), bs=4, **kw):
    return Request(task, tuple(fields), bs, **kw)


def test_each_put_goes_to_one_shard_and_puts_rotate():
    c = Controller(100, num_shards=3)
    assert c.allocate("p", 10, ("x",)).shards == [0] * 10
    assert c.allocate("p", 1, ("x",)).shards == [1]  # rotates
    assert c.allocate("p", 2, ("x",)).shards == [2, 2]
    c.dead_shards.add(0)
    assert {c.allocate("p", 1, ("x",)).shards[0] for _ in range(4)} == {1, 2}


def test_a_unit_names_its_rows_with_ids_leased_to_it():
    """Storage units admit small puts under ids the controller leased to them: each id
    once, only by its unit, never one the controller hands out itself."""
    c = Controller(100, num_shards=2)
    lo, hi = c.unit_ids(1, 4)
    tok = c.allocate("p", 2, ["x"], ids=[lo, lo + 1], shard=1)
    assert tok.rows == [lo, lo + 1] and tok.shards == [1, 1]
    c.commit(tok, {"x": [8, 8]})
    assert not c.owns_ids(1, [lo + 1])  # used
    assert not c.owns_ids(0, [lo + 2])  # another unit's
    assert not c.owns_ids(1, [hi])  # not leased
    assert not c.owns_ids(1, [lo + 2, lo + 3, lo + 4])  # runs past the lease
    with pytest.raises(InvalidArgument, match="leased"):
        c.allocate("p", 1, ["x"], ids=[lo], shard=1)
    other = c.allocate("p", 1, ["x"])  # the controller's own ids skip the lease
    assert other.rows[0] >= hi
    assert c.owns_ids(1, [lo + 3])  # ids may be skipped (a refused put used them)
    c.dead_shards.add(1)
    assert not c.owns_ids(1, [lo + 3])


def test_take_needs_every_field_and_is_fifo():
    c = Controller(100)
    rows, _ = put(c, 4, ("a",))
    assert c.take(req(fields=("a", "b"))) is None
    tok = c.begin_write(rows, ("b",))
    assert c.take(req(fields=("a", "b"))) is None  # written, not committed: not ready
    c.commit(tok, {"b": [1] * 4})
    d = c.take(req(fields=("a", "b")))
    assert d.rows == rows and d.fields == ("a", "b")
    assert c.take(req(fields=("a", "b"))) is None  # leased: not again


def test_subscription_index_is_updated_not_scanned():
    c = Controller(1000)
    put(c, 10)
    r = req(bs=3)
    c.take(r)
    sub = c.subs[r.sub_key()]
    assert len(sub.avail) == 7
    put(c, 5)
    assert len(sub.avail) == 12
    assert r.sub_key() in c.drain()[2]  # woken


def test_ack_is_idempotent_and_counts():
    c = Controller(100)
    put(c, 4)
    d = c.take(req())
    c.ack([d.lease])
    c.ack([d.lease])
    assert c.c_acked["t"] == 4 and not c.leases
    assert c.take(req()) is None


def test_release_and_expiry_redeliver():
    clock = Clock()
    c = Controller(100, lease_timeout=10, clock=clock)
    put(c, 4)
    d = c.take(req())
    c.release([d.lease])
    d2 = c.take(req())
    assert sorted(d2.rows) == sorted(d.rows)
    assert c.c_redelivered["t"] == 4
    assert c.next_deadline() == 10
    clock.t = 10.5
    assert c.expire() == 1
    with pytest.raises(LeaseExpired):
        c.ack([d2.lease])
    assert c.take(req()).rows == d.rows


def test_capacity_rows_and_bytes():
    c = Controller(4, capacity_bytes=100)
    with pytest.raises(QueueFull):
        c.allocate("p", 5, ("x",))  # never fits
    with pytest.raises(QueueFull):
        c.check_fits(1, 101)
    put(c, 3, nbytes=10)
    assert c.admission(1, 10, None) is None
    assert c.admission(2, 10, None) == "full"
    assert c.admission(1, 80, None) == "full"  # 30 held + 80 > 100
    with pytest.raises(QueueFull):
        c.allocate("p", 2, ("x",))


def test_duplicate_field_and_dropped_rows():
    c = Controller(100)
    rows, _ = put(c, 2)
    with pytest.raises(DuplicateField):
        c.begin_write(rows, ("x",))
    tok = c.begin_write(rows, ("y",))
    with pytest.raises(DuplicateField):  # a write in flight counts too
        c.begin_write(rows, ("y",))
    c.abort(tok)
    c.begin_write(rows, ("y",))
    c.drop(rows)
    with pytest.raises(RowsDropped) as e:
        c.begin_write(rows, ("z",))
    assert e.value.rows == rows


def test_rows_dropped_during_write_are_reported_for_storage_cleanup():
    c = Controller(100, num_shards=2)
    rows, _ = put(c, 2)
    tok = c.begin_write(rows, ("y",))
    c.drop([rows[0]])
    res = c.commit(tok, {"y": [4, 4]})
    assert res.dead == {0: [rows[0]]}
    assert c.rows[rows[1]].fields["y"] == 4


def test_drop_frees_bytes_and_queues_deletes():
    c = Controller(100, num_shards=2)
    rows, _ = put(c, 2, nbytes=10)
    more, _ = put(c, 2, nbytes=10)  # the next put goes to the other shard
    assert c.bytes_held == 40
    c.drop(rows + more[:1])
    deletes = c.drain()[0]
    assert deletes == {0: rows, 1: more[:1]}
    assert c.bytes_held == 10 and c.c_bytes_freed == 30


def test_seal_end_and_short_tail():
    c = Controller(100)
    put(c, 5)
    r = req(bs=4, partition="p")
    assert len(c.take(r).rows) == 4
    assert c.take(r) is None  # unsealed: wait for more
    c.seal("p")
    assert c.take(r) is None  # the 4 leased rows may come back: wait
    c.ack(list(c.leases))
    assert len(c.take(r).rows) == 1
    c.ack(list(c.leases))
    assert c.take(r) is END


def test_closed_queue_refuses_puts_and_drains():
    c = Controller(100)
    put(c, 2)
    c.close()
    with pytest.raises(QueueClosed):
        c.allocate("p", 1, ("x",))
    assert len(c.take(req(bs=4)).rows) == 2
    assert c.take(req(bs=4)) is END


def test_groups_complete_by_size_and_never_split():
    c = Controller(100)
    c.register_tag("uid")
    put(c, 3, ("x", "uid"), tags={"uid": [1, 1, 2]})
    r = req(bs=4, group_by="uid", group_size=2, partition="p")
    assert c.take(r) is None  # group 1 complete, but a batch is 2 groups
    put(c, 3, ("x", "uid"), tags={"uid": [2, 3, 3]})
    d = c.take(r)
    assert sorted(c.rows[i].tags["uid"] for i in d.rows) == [1, 1, 2, 2]


def test_filter_gates_delivery_and_drops_rejected():
    c = Controller(100)
    c.add_filter(FilterSpec("f", frozenset({"reward"})))
    rows, _ = put(c, 4, ("x", "reward"))
    jobs = c.drain()[1]
    assert len(jobs) == 1 and jobs[0].rows == rows
    assert c.take(req(fields=("reward",))) is None  # not judged yet
    early = c.take(req(task="other", fields=("x",)))  # needs none of the filter's fields
    assert len(early.rows) == 4
    c.filter_done(jobs[0].id, [True, False, True, False])
    d = c.take(req(fields=("reward",), bs=2))
    assert d.rows == [rows[0], rows[2]]
    assert c.c_filtered_by == {"f": 2} and len(c.rows) == 2
    assert c.leases[early.lease].rows == [rows[0], rows[2]]  # rejected rows left the lease


def test_grouped_filter_runs_per_group_size():
    c = Controller(100)
    c.add_filter(FilterSpec("g", frozenset({"r"}), "uid", 2))
    put(c, 3, ("r", "uid"), tags={"uid": [1, 2, 1]})
    jobs = c.drain()[1]
    assert len(jobs) == 1 and len(jobs[0].rows) == 2
    c.filter_done(jobs[0].id, None, error=True)
    assert c.c_filter_errors == {"g": 2} and len(c.rows) == 1


def test_staleness_drops_whole_groups():
    c = Controller(100, max_staleness=1)
    c.register_tag("uid")
    put(c, 2, ("x", "uid"), version=0, tags={"uid": [7, 7]})
    put(c, 2, ("x", "uid"), version=1, tags={"uid": [8, 8]})
    c.subs  # no grouped subscription needed: group tags are registered
    c._sub(req(group_by="uid", group_size=2))
    assert c.set_version(2) == 2
    assert sorted(r.tags["uid"] for r in c.rows.values()) == [8, 8]
    with pytest.raises(InvalidArgument):
        c.set_version(1)


def test_admission_pacer():
    c = Controller(100, max_lead=1)
    assert c.admission(1, 0, 1) is None
    assert c.admission(1, 0, 2) == "ahead"
    c.set_version(1)
    assert c.admission(1, 0, 2) is None


def test_consumer_set_cleanup():
    c = Controller(100, consumers=["a", "b"])
    put(c, 2)
    da = c.take(req(task="a", bs=2))
    c.ack([da.lease])
    assert len(c.rows) == 2
    db = c.take(req(task="b", bs=2))
    c.ack([db.lease])
    assert len(c.rows) == 0 and c.c_dropped == {"consumed": 2}


def test_dp_dispatch_equal_shares_and_remainder_policies():
    c = Controller(100)
    put(c, 10)
    shares = [c.take(req(bs=2, dp_rank=r, dp_size=2, partition="p")) for r in (0, 1)]
    assert [len(s.rows) for s in shares] == [2, 2] and not set(shares[0].rows) & set(shares[1].rows)
    c.seal("p")
    for s in shares:
        c.ack([s.lease])
    shares = [c.take(req(bs=2, dp_rank=r, dp_size=2, partition="p")) for r in (0, 1)]
    for s in shares:
        c.ack([s.lease])
    c.drop([max(c.rows)])  # one row left for two ranks
    with pytest.raises(DispatchError):
        c.take(req(bs=2, dp_rank=0, dp_size=2, partition="p"))
    d = c.take(req(bs=2, dp_rank=0, dp_size=2, partition="p", dp_remainder="pad"))
    d1 = c.take(req(bs=2, dp_rank=1, dp_size=2, partition="p", dp_remainder="pad"))
    assert len(d.rows) == len(d1.rows) == 1 and d.rows == d1.rows  # padded by repetition


def test_balanced_split_beats_round_robin():
    import random

    rng = random.Random(0)
    w = [rng.paretovariate(1.2) * 100 for _ in range(64)]
    units = [[i] for i in range(64)]
    shares, pads = _balanced_split(units, 8, w)
    assert all(len(s) == 8 for s in shares) and not any(pads)
    greedy = imbalance([sum(w[i] for i in s) for s in shares])
    rr = imbalance([sum(w[i] for i in range(r, 64, 8)) for r in range(8)])
    assert greedy < rr


@pytest.mark.parametrize("weights", [[10, 12, 16], [16, 12, 10], [1, 1, 1], [5, 9, 7]])
def test_balanced_split_pads_a_short_rank_with_units_of_other_ranks(weights):
    """Three units over two ranks: the short rank is padded with a unit of the other
    rank, never with a repeat of its own (it repeated its only unit when that unit was
    the heaviest: the model's grouped DP tail found it)."""
    units = [[0, 1], [2, 3], [4, 5]]
    shares, pads = _balanced_split(units, 2, weights)
    short = min(range(2), key=lambda r: len(shares[r]))
    assert len(shares[short]) == 2 and len(pads[short]) == 2 and not pads[1 - short]
    assert not set(pads[short]) & set(shares[short])
    assert set(pads[short]) <= set(shares[1 - short])
    assert sorted(r for s in shares for r in s) == list(range(6))


def test_request_validation():
    bad = [dict(bs=0), dict(bs=-1), dict(fields=()), dict(bs=6, group_by="u", group_size=4),
           dict(group_size=2), dict(dp_size=2, dp_rank=2), dict(max_staleness=-1),
           dict(dp_remainder="x"), dict(lease_timeout=float("nan")), dict(partition=""),
           dict(partition=1), dict(group_by=""), dict(lease_timeout=-1.0)]
    for kw in bad:  # a request is validated when it is made
        with pytest.raises(InvalidArgument):
            req(**kw)


def test_storage_unit_delete_fields_keeps_rows_and_other_fields():
    import torch

    from streamrl.errors import UnknownField
    from streamrl.storage import StorageUnit

    u = StorageUnit(0)
    u.put([1, 2], {"x": torch.zeros(2, 4), "y": torch.ones(2, 2)})
    assert u.delete_fields([1, 2], ["y"]) == 2 * 2 * 4
    assert u.stats() == (2, 2 * 4 * 4) and not u.segments.keys() - {1}
    assert u.get([2], ["x"])["x"][0].shape == (1, 4)
    with pytest.raises(UnknownField):
        u.get([1], ["y"])
    assert u.delete([1, 2]) == (2, 32) and u.stats() == (0, 0) and not u.segments


def test_write_not_committed_within_lease_timeout_is_aborted():
    """A writer that dies between admission and commit must not hold capacity (or keep
    a sealed partition from ending) for ever."""
    now = [0.0]
    c = Controller(4, lease_timeout=10.0, clock=lambda: now[0])
    tok = c.allocate("p", 4, ("x",), nbytes=16)
    assert c.next_deadline() == 10.0
    c.seal("p")
    now[0] = 10.5
    c.expire()
    assert not c.rows and c.reserved_bytes == 0 and c.c_writes_expired == 1 and c.c_put == 0
    assert c.take(Request("t", ("x",), 4, partition="p")) is END
    with pytest.raises(StreamTimeout, match="lease_timeout"):
        c.commit(tok, {"x": [4] * 4})
    c.allocate("q", 4, ("x",), nbytes=16)  # the whole capacity is free again


def test_storage_forgets_only_what_an_aborted_write_stored():
    """The undo of write 1 (cancelled) must not delete write 2's data (its retry), and
    write 1's data arriving late is dropped."""
    import torch

    from streamrl.storage import StorageUnit

    u = StorageUnit(0)
    u.put([1, 2], {"x": torch.zeros(2, 4)})
    u.put([1, 2], {"f": torch.full((2, 3), 2.0)}, write=2)  # the retry landed first
    u.delete_fields([1, 2], ["f"], write=1)  # then the undo of the cancelled write
    assert u.get([1, 2], ["f"])["f"][0].tolist() == [[2.0] * 3] * 2
    u.put([1, 2], {"f": torch.full((2, 3), 1.0)}, write=1)  # the cancelled data, late
    assert u.get([1, 2], ["f"])["f"][0].tolist() == [[2.0] * 3] * 2
    u.put([1], {"g": ["a"]}, write=3)
    u.delete_fields([1], ["g"], write=3)
    assert u.inventory() == {1: ["x", "f"], 2: ["x", "f"]}


def test_abort_names_only_fields_the_rows_do_not_hold():
    c = Controller(8, num_shards=2)
    rows, _ = put(c, 4, fields=("x", "f"))
    tok = c.begin_write(rows, ("f", "g"), overwrite=True)
    undo = c.abort(tok)
    assert undo.write == tok.id and undo.shards == frozenset(tok.shards)
    assert undo.parts == [(("g",), {tok.shards[0]: rows})]  # "f" keeps old or new value
    assert c.abort(tok) is None  # once


def test_retract_takes_a_committed_write_back():
    c = Controller(8)
    rows, _ = put(c, 4)
    c.add_filter(FilterSpec("f", frozenset({"r"})))
    tok = c.begin_write(rows, ("r",))
    c.commit(tok, {"r": [4] * 4})
    (job,) = c.drain()[1]
    held = c.bytes_held
    undo = c.retract(tok)
    assert undo.parts == [(("r",), {0: rows})]
    assert not c.job_live(job.id)  # its judgement is withdrawn...
    assert c.bytes_held == held - 16 and all("r" not in c.rows[r].fields for r in rows)
    assert c.take(req(fields=("r",))) is None  # ...and "r" is not ready any more
    tok2 = c.begin_write(rows, ("r",))  # no DuplicateField: the retry goes through
    c.commit(tok2, {"r": [4] * 4})
    (job2,) = c.drain()[1]
    assert sorted(job2.rows) == rows  # judged again
    c.filter_done(job2.id, [True] * 4)
    assert c.take(req(fields=("r",))).rows == rows
    new = c.allocate("p", 2, ("x",), nbytes=16)
    c.commit(new, {"x": [8, 8]})
    c.retract(new)  # new rows: dropped as cancelled
    assert c.c_dropped["cancelled"] == 2 and not set(new.rows) & set(c.rows)


@pytest.mark.parametrize("group_size", [None, 3])
def test_grouped_filter_judges_a_sealed_group_once_an_awaited_member_is_dropped(group_size):
    """A grouped filter over a sealed partition waits for every member of a group; a
    member dropped before it got the filter's fields must not keep the others waiting
    for ever (the stream over the partition would never end)."""
    c = Controller(100)
    c.add_filter(FilterSpec("g", frozenset({"r"}), "uid", group_size))
    rows, _ = put(c, 3, ("x", "uid"), tags={"uid": [1, 1, 1]})
    tok = c.begin_write(rows[:2], ("r",))
    c.commit(tok, {"r": [4, 4]})
    c.seal("p")
    assert not c.drain()[1]  # the third member has no "r" yet
    c.drop([rows[2]])
    (job,) = c.drain()[1]
    assert sorted(job.rows) == rows[:2]
    c.filter_done(job.id, [True, True])
    assert sorted(c.take(req(fields=("r",), partition="p")).rows) == rows[:2]


def test_a_grouped_stream_gets_a_sealed_group_once_an_unready_member_is_dropped():
    """In a sealed partition a group is whole once every member the task owes is ready;
    dropping the one member that is not makes it whole (the rest go out), and only the
    groups that lost members are looked at again (many groups held: see
    Controller._wake_groups) -- the other groups stay as they were."""
    c = Controller(100)
    c.register_tag("uid")
    rows, _ = put(c, 8, ("x", "uid"), tags={"uid": [1, 1, 1, 2, 2, 2, 3, 3]})
    tok = c.begin_write(rows[:2] + rows[3:5] + rows[6:], ("r",))  # rows 2, 5 lack "r"
    c.commit(tok, {"r": [4] * 6})
    c.seal("p")
    r = req(fields=("r",), bs=2, partition="p", group_by="uid")
    got = c.take(r)
    assert sorted(got.rows) == rows[6:]  # group 3: whole
    c.ack([got.lease])
    assert c.take(r) is None  # groups 1 and 2 wait for their third member
    c.drop([rows[2]])
    got = c.take(r)
    assert sorted(got.rows) == rows[:2]  # group 1 is whole without it
    c.ack([got.lease])
    assert c.take(r) is None  # group 2 still waits
    c.drop([rows[5]])
    got = c.take(r)
    assert sorted(got.rows) == rows[3:5]
    c.ack([got.lease])
    assert c.take(r) is END


def test_a_sealed_group_is_whole_once_the_task_acks_a_member_it_took_apart():
    """A task owes a sealed group the members it has not acknowledged: a member it took
    by another request shape (ungrouped) holds the group back until that batch is
    acknowledged; the ack makes the group whole for the task's grouped request (only
    the groups of the acknowledged rows are looked at again: Controller._wake_groups)."""
    c = Controller(100)  # no consumers: acknowledged rows stay
    c.register_tag("uid")
    rows, _ = put(c, 6, ("x", "uid"), tags={"uid": [1, 1, 1, 2, 2, 2]})
    c.seal("p")
    one = c.take(req(bs=1, partition="p"))  # a member of group 1, taken apart
    assert one.rows == [rows[0]]
    g = req(bs=2, partition="p", group_by="uid")
    got = c.take(g)
    assert sorted(got.rows) == rows[3:]  # group 2 (the batch holds one group)
    c.ack([got.lease])
    assert c.take(g) is None  # group 1 waits for the member leased apart
    c.ack([one.lease])
    got = c.take(g)
    assert sorted(got.rows) == rows[1:3]
    c.ack([got.lease])
    assert c.take(g) is END


def test_grouped_filter_judges_a_short_last_group_when_its_partition_is_sealed():
    """A group smaller than the filter's group_size is judged once its partition is
    sealed (no more rows can join it), also when the seal comes after its rows."""
    c = Controller(100)
    c.add_filter(FilterSpec("g", frozenset({"r"}), "uid", 2))
    rows, _ = put(c, 3, ("r", "uid"), tags={"uid": [1, 1, 2]})
    (full,) = c.drain()[1]
    assert sorted(full.rows) == rows[:2]
    c.seal("p")
    (short,) = c.drain()[1]
    assert short.rows == [rows[2]]
    c.filter_done(full.id, [True, True])
    c.filter_done(short.id, [True])
    r = req(fields=("r",), bs=4, partition="p")
    assert sorted(c.take(r).rows) == rows
    c.ack(list(c.leases))
    assert c.take(r) is END


def test_close_lets_short_groups_out_and_grouped_streams_end():
    """After close a grouped stream drains what is deliverable now, short last groups
    included, and ends (it must not wait for rows that can never come)."""
    c = Controller(100)
    c.register_tag("uid")
    rows, _ = put(c, 3, ("x", "uid"), tags={"uid": [1, 1, 2]})
    r = req(bs=2, group_by="uid", group_size=2, partition="p")
    c.ack([c.take(r).lease])
    c.close()
    assert c.take(r).rows == [rows[2]]
    c.ack(list(c.leases))
    assert c.take(r) is END


def test_a_late_ack_of_an_expired_lease_raises_after_many_newer_leases():
    """Acked leases take no memory, so the outcome of an expired lease is still known
    after 100k newer leases (it used to be forgotten after 65,536)."""
    clock = Clock()
    c = Controller(1 << 17, lease_timeout=10.0, clock=clock)
    put(c, 1, part="old")
    old = c.take(req(bs=1, partition="old"))
    clock.t = 11.0
    c.expire()  # expired: its rows go to someone else
    put(c, 100_000, part="new")
    r = req(bs=1, partition="new")
    for _ in range(100_000):
        c.ack([c.take(r).lease])
    with pytest.raises(LeaseExpired):
        c.ack([old.lease])
    assert len(c._lease_outcome) == 1


def test_a_lease_older_than_the_outcome_memory_is_not_acked_silently(monkeypatch):
    import streamrl.controller.state as state

    monkeypatch.setattr(state, "OUTCOME_MEMORY", 2)
    clock = Clock()
    c = Controller(64, lease_timeout=1.0, clock=clock)
    put(c, 4)
    held = c.take(req(bs=1))  # held by a consumer that is slow to ack
    for _ in range(3):  # three newer leases expire: the oldest outcomes are forgotten
        c.take(req(bs=1, task="u"))
    clock.t = 2.0
    c.expire()
    with pytest.raises(LeaseExpired):  # its outcome is forgotten: not taken as acked
        c.ack([held.lease])


def test_first_deliveries_are_observed_per_row_with_each_puts_latency():
    """A batch of rows of several puts and partitions, delivered and then redelivered:
    each row's first delivery is observed once, with the latency of its own put, in
    its own partition's histogram."""
    clock = Clock()
    c = Controller(100, clock=clock)
    put(c, 3)                     # born at 0
    clock.t = 0.001
    put(c, 2)                     # born at 1 ms
    clock.t = 0.002
    put(c, 1, part="q")           # another partition, born at 2 ms
    clock.t = 0.003
    put(c, 1)                     # p again, born at 3 ms
    clock.t = 0.010
    d = c.take(req(bs=7))
    assert len(d.rows) == 7
    hp = c.parts["p"].counts.delivery["t"]
    hq = c.parts["q"].counts.delivery["t"]
    assert (hp.count, hq.count) == (6, 1)
    assert hp.sum == pytest.approx(3 * 0.010 + 2 * 0.009 + 0.007)
    assert hq.sum == pytest.approx(0.008)
    assert sum(hp.counts) == 6 and sum(hq.counts) == 1
    assert c.parts["p"].counts.task("t")[:4] == [6, 48, 0, 0]
    c.release([d.lease])
    clock.t = 0.5
    d2 = c.take(req(bs=7))
    assert sorted(d2.rows) == sorted(d.rows)
    assert (hp.count, hq.count) == (6, 1)  # redeliveries are not first deliveries
    assert c.c_redelivered["t"] == 7 and c.c_delivered["t"] == 14
    assert c.parts["p"].counts.task("t")[:4] == [12, 96, 6, 48]
    assert c.parts["q"].counts.task("t")[:4] == [2, 16, 1, 8]


def test_commit_counts_each_rows_bytes_whether_rows_agree_or_not():
    c = Controller(100)
    tok = c.allocate("p", 3, ("x", "y"), nbytes=0)
    c.commit(tok, {"x": [8, 8, 8], "y": [4, 5, 6]})
    assert [c.rows[r].fields for r in tok.rows] == [{"x": 8, "y": 4}, {"x": 8, "y": 5},
                                                     {"x": 8, "y": 6}]
    tok2 = c.allocate("p", 2, ("x", "y"), nbytes=0)
    c.commit(tok2, {"x": [8, 8], "y": [4, 4]})
    assert [c.rows[r].nbytes for r in tok2.rows] == [12, 12]
    # rows of one shape share one dict of sizes (never changed in place: Row.fields)
    a, b = (c.rows[r] for r in tok2.rows)
    assert a.fields is b.fields
    assert c.bytes_held == 8 * 3 + 15 + 24
    # an overwrite of one of them, of other bytes: that row alone changes
    w = c.begin_write([a.id], ("x",), overwrite=True)
    c.commit(w, {"x": [100]})
    assert (a.fields, b.fields) == ({"x": 100, "y": 4}, {"x": 8, "y": 4})
    assert (a.nbytes, b.nbytes) == (104, 12) and c.bytes_held == 8 * 3 + 15 + 12 + 104
    d = c.take(req(fields=("x", "y"), bs=5))
    assert d.nbytes == 24 + 15 + 12 + 100 + 4
    c.ack([d.lease])
    # a write of a new field to both, of the same bytes: they share the new dict again
    w = c.begin_write([a.id, b.id], ("z",))
    c.commit(w, {"z": [2, 2]})
    assert (a.fields, b.fields) == ({"x": 100, "y": 4, "z": 2}, {"x": 8, "y": 4, "z": 2})
    assert a.fields is not b.fields  # (they differed before)
    c2 = [c.rows[r] for r in tok.rows]  # (rows of other shapes, a dict each)
    w = c.begin_write([r.id for r in c2], ("z",))
    c.commit(w, {"z": [1, 1, 1]})
    assert [r.fields for r in c2] == [{"x": 8, "y": 4, "z": 1}, {"x": 8, "y": 5, "z": 1},
                                      {"x": 8, "y": 6, "z": 1}]
    assert c.bytes_held == (12 + 13 + 14 + 3) + (104 + 2) + (12 + 2)


def _summary(c, take=True):
    """What a put leaves in the controller, compared between two ways of making it
    (``take``: and the rows a take of both fields then gets)."""
    rows = {r: (row.shard, row.version, dict(row.fields), row.nbytes, row.writing,
                row.pending) for r, row in c.rows.items()}
    return (rows, c.bytes_held, c.c_put, c.c_bytes_put, c.reserved_bytes,
            {n: (p.put, p.bytes_put, list(p.rows)) for n, p in c.parts.items()},
            sorted(c.take(req(fields=("x", "y"), bs=3)).rows) if take else None)


@pytest.mark.parametrize("sizes", [{"x": [8, 8, 8], "y": [4, 4, 4]},
                                   {"x": [8, 8, 8], "y": [4, 5, 6]}])
def test_admit_stored_is_allocate_then_commit(sizes):
    """admit_stored admits and commits rows a unit stored under leased ids in one step,
    leaving what allocate + commit leave (rows of one shape take a shortcut, others
    do not)."""
    a, b = Controller(100, num_shards=2), Controller(100, num_shards=2)
    waiting = [req(fields=("x",), bs=2, partition="p"),  # consumers waiting already
               req(task="u", fields=("x", "y"), bs=8, partition="p"),  # wakes at 8 rows
               req(task="v", fields=("x", "z"), bs=1, partition="p"),  # a field not put
               req(task="w", fields=("y",), bs=1),  # every partition
               req(task="o", fields=("x",), bs=1, partition="other")]
    for c in (a, b):
        c.unit_ids(0, 4)
        for r in waiting:
            assert c.take(r) is None
        c.wake_at(waiting[1].sub_key(), 8)
        c.woken.clear()
    a.admit_stored("p", [0, 1, 2], 0, sizes, version=0)
    tok = b.allocate("p", 3, ("x", "y"), nbytes=sum(map(sum, sizes.values())), ids=[0, 1, 2],
                     shard=0, version=0)
    b.commit(tok, sizes)
    indexed = [({k: list(s.avail) for k, s in c.subs.items()}, set(c.woken)) for c in (a, b)]
    assert indexed[0] == indexed[1]
    for c in (a, b):  # each row checked against each subscription, as a take would
        for s in c.subs.values():
            assert list(s.avail) == [r for r, row in c.rows.items() if c._eligible(row, s)
                                     and s.partition in (None, row.part.name)]
    assert sorted(len(s.avail) for s in a.subs.values()) == [0, 0, 3, 3, 3]
    assert len(indexed[0][1]) == 2  # the subscriptions of ("x",) and ("y",): not u's
    assert _summary(a) == _summary(b)


def test_admit_stored_with_group_keys_is_allocate_then_commit():
    """Rows whose group key comes with them (GRPO's one-row puts, combined) take
    admit_stored's shortcut too: each row in its group, grouped subscriptions' buckets
    and whole groups as a commit leaves them; a tag field not given goes the usual way
    (its values read back: the commit's missing tags), or nowhere with at_once_only."""
    a, b = Controller(100, num_shards=2), Controller(100, num_shards=2)
    waiting = [req(task="g", fields=("x",), bs=2, partition="p", group_by="uid",
                   group_size=2),  # whole groups of 2
               req(task="h", fields=("x", "y"), bs=3, partition="p", group_by="uid",
                   group_size=3),
               req(task="k", fields=("x",), bs=1, group_by="k"),  # a key not given
               req(task="u", fields=("x",), bs=2, partition="p")]  # ungrouped
    for c in (a, b):
        c.unit_ids(0, 16)
        for r in waiting:
            assert c.take(r) is None
        c.woken.clear()

    def state(c):
        subs = {k: (list(s.avail), {g: list(m) for g, m in s.buckets.items()},
                    list(s.complete)) for k, s in c.subs.items()}
        groups = {n: {f: {v: list(m) for v, m in byv.items()} for f, byv in p.groups.items()}
                  for n, p in c.parts.items()}
        return (subs, groups, {r: dict(row.tags) for r, row in c.rows.items()},
                set(c.woken), _summary(c, take=False))

    puts = [([0, 1, 2], {"uid": [7, 7, 8]}), ([3, 4, 5], {"uid": [8, 8, 9]})]
    for ids, tags in puts:
        n = len(ids)
        sizes = {"x": [8] * n, "y": [4] * n}
        got = a.admit_stored("p", ids, 0, sizes, version=0, tags=tags, at_once_only=True)
        assert got is not None  # (at once: no write token)
        tok = b.allocate("p", n, ("x", "y"), nbytes=12 * n, ids=ids, shard=0, version=0)
        want = b.commit(tok, sizes, tags)
        assert (got.dead, got.tag_fields, got.missing_tags) == (
            want.dead, want.tag_fields, want.missing_tags)
        assert state(a) == state(b)
        for c in (a, b):
            c.woken.clear()
    s = a.subs[waiting[0].sub_key()]
    assert list(s.complete) == [("p", 7), ("p", 8)] and len(s.buckets[("p", 8)]) == 3
    assert list(a.subs[waiting[1].sub_key()].complete) == [("p", 8)]
    assert not a.subs[waiting[2].sub_key()].avail  # (no value of "k": not its rows)
    for r in waiting:
        ta, tb = a.take(r), b.take(r)
        assert (ta and sorted(ta.rows)) == (tb and sorted(tb.rows))

    # a tag field of the partition without its values: the usual way, tags read back
    sizes = {"x": [8], "k": [8]}
    assert a.admit_stored("p", [6], 0, sizes, tags={"uid": [9]}, at_once_only=True) is None
    got = a.admit_stored("p", [6], 0, sizes, version=0, tags={"uid": [9]})
    tok = b.allocate("p", 1, ("x", "k"), nbytes=16, ids=[6], shard=0, version=0)
    want = b.commit(tok, sizes, {"uid": [9]})
    assert got.missing_tags == want.missing_tags == {"k": [6]}
    assert state(a) == state(b)


@pytest.mark.parametrize("grouped", [False, True])
def test_admit_stored_with_filters_is_allocate_then_commit(grouped):
    """With filters, admit_stored still takes its one-step path, and leaves what
    allocate + commit leave: rows pending every filter, held back from requests of a
    filter's fields (not from others), and the same filter jobs queued."""
    a, b = Controller(100, num_shards=2), Controller(100, num_shards=2)
    for c in (a, b):
        c.add_filter(FilterSpec("f", frozenset({"y"}), "uid" if grouped else None,
                                2 if grouped else None))
        c.unit_ids(0, 16)
        for r in (req(task="g", fields=("x", "y"), bs=2, partition="p"),  # gated by f
                  req(task="h", fields=("x",), bs=1, partition="p")):  # not gated
            assert c.take(r) is None
        c.drain()
    tags = {"uid": [1, 1, 2]} if grouped else None
    sizes = {"x": [8] * 3, "y": [4] * 3}
    got = a.admit_stored("p", [0, 1, 2], 0, sizes, version=0, tags=tags, at_once_only=True)
    assert got is not None  # (at once: no write token)
    tok = b.allocate("p", 3, ("x", "y"), nbytes=36, ids=[0, 1, 2], shard=0, version=0)
    want = b.commit(tok, sizes, tags)
    assert (got.dead, got.tag_fields, got.missing_tags) == (
        want.dead, want.tag_fields, want.missing_tags)

    def state(c):
        _, jobs, woken, *_ = c.drain()
        return ({k: list(s.avail) for k, s in c.subs.items()}, set(woken),
                [(j.filter, j.rows, j.fields) for j in jobs],
                {r: (row.pending, row.judging, dict(row.tags)) for r, row in c.rows.items()},
                _summary(c, take=False))

    sa, sb = state(a), state(b)
    assert sa == sb
    assert sa[2] == ([("f", [0, 1], ("y",))] if grouped else [("f", [0, 1, 2], ("y",))])
    assert sorted(len(v) for v in sa[0].values()) == [0, 3]  # (only h's request has them)


def test_admit_stored_refuses_what_allocate_refuses():
    c = Controller(4, num_shards=2)
    start, _ = c.unit_ids(1, 8)
    nb = {"x": [8, 8]}
    with pytest.raises(InvalidArgument, match="not unused ids leased"):
        c.admit_stored("p", [start + 7, start + 8], 1, nb)  # past the unit's block
    with pytest.raises(InvalidArgument, match="not unused ids leased"):
        c.admit_stored("p", [start, start + 1], 0, nb)  # leased to another unit
    c.admit_stored("p", [start, start + 1], 1, nb)
    with pytest.raises(QueueFull):
        c.admit_stored("p", [start + 2, start + 3, start + 4], 1, {"x": [8] * 3})
    c.seal("p")
    with pytest.raises(InvalidArgument, match="sealed"):
        c.admit_stored("p", [start + 2], 1, {"x": [8]})
    assert c.c_put == 2 and len(c.rows) == 2


@pytest.mark.parametrize("group_size", [None, 2])
@pytest.mark.parametrize("end", ["commit", "abort", "expire", "drop"])
def test_a_sealed_short_group_waits_for_a_member_whose_put_is_in_flight(group_size, end):
    """A row admitted before its partition was sealed may still bring a member of a
    group when its put commits: a grouped filter judges no short group of that
    partition, and a grouped stream sends none, until that put has committed (its row
    joins its group), aborted or lost its row. A rejection then drops the whole group."""
    clock = Clock()
    c = Controller(16, num_shards=1, lease_timeout=10.0, clock=clock)
    c.register_tag("uid")
    c.add_filter(FilterSpec("fg", frozenset({"uid"}), group_by="uid", group_size=group_size))
    (r0,), _ = put(c, 1, ("uid",), tags={"uid": [1]})
    late = c.allocate("p", 1, ("uid",), nbytes=8)
    c.seal("p")
    assert not c.drain()[1]  # the late put may join group 1
    r = req(fields=("uid",), bs=4, partition="p", group_by="uid", group_size=group_size)
    if end == "commit":
        c.commit(late, {"uid": [8]}, {"uid": [1]})
        (job,) = c.drain()[1]
        assert sorted(job.rows) == [r0, late.rows[0]]  # judged whole
        c.filter_done(job.id, [False, False])
        assert not c.rows and c.c_filtered_by == {"fg": 2}
        assert c.take(r) is END
        return
    if end == "abort":
        c.abort(late)
    elif end == "expire":
        clock.t = 11.0
        c.expire()
    else:  # its row is dropped while its put is in flight: no member to wait for
        c.drop(late.rows)
    (job,) = c.drain()[1]  # the group is whole now: judged
    assert job.rows == [r0]
    c.filter_done(job.id, [True])
    assert c.take(r).rows == [r0]


@pytest.mark.parametrize("group_size", [None, 2])
def test_a_grouped_stream_sends_no_short_group_while_a_member_may_come(group_size):
    """As for filters: a sealed partition's short group goes to a grouped stream only
    once no put admitted before the seal can still add a member to it."""
    c = Controller(16, num_shards=1)
    c.register_tag("uid")
    (r0, r1), _ = put(c, 2, ("uid",), tags={"uid": [1, 2]})
    late = c.allocate("p", 1, ("uid",), nbytes=8)
    c.seal("p")
    r = req(fields=("uid",), bs=2, partition="p", group_by="uid", group_size=group_size)
    assert c.take(r) is None  # not [r0, r1]: group 1 may still grow
    c.commit(late, {"uid": [8]}, {"uid": [1]})
    assert r.sub_key() in c.woken  # its waiters are woken
    for want in ([r0, late.rows[0]], [r1]):
        d = c.take(r)
        assert sorted(d.rows) == want
        c.ack([d.lease])
    assert c.take(r) is END


def test_a_sealed_short_group_waits_for_tags_being_read():
    """A row whose group key was committed without its value (the writer did not know
    the field is a tag: the service reads it from storage) counts as a possible member
    until the value is set; a seal in between does not judge its group in two parts."""
    c = Controller(16, num_shards=1)
    c.register_tag("uid")
    c.add_filter(FilterSpec("fg", frozenset({"uid"}), group_by="uid", group_size=2))
    (r0,), _ = put(c, 1, ("uid",), tags={"uid": [1]})
    (r1,), res = put(c, 1, ("uid",))  # no tags given
    assert res.missing_tags == {"uid": [r1]}
    c.seal("p")
    assert not c.drain()[1]
    c.set_tags("uid", [r1], [1])
    (job,) = c.drain()[1]
    assert sorted(job.rows) == [r0, r1]


def test_a_sealed_short_group_stops_waiting_for_tags_that_cannot_be_read():
    """Tag values that could not be read (:meth:`Controller.tags_unread`) are not waited
    for: the other groups of the sealed partition are judged."""
    c = Controller(16, num_shards=1)
    c.register_tag("uid")
    c.add_filter(FilterSpec("fg", frozenset({"uid"}), group_by="uid", group_size=2))
    (r0,), _ = put(c, 1, ("uid",), tags={"uid": [1]})
    (r1,), _ = put(c, 1, ("uid",))
    c.seal("p")
    assert not c.drain()[1]
    c.tags_unread("uid", [r1])
    (job,) = c.drain()[1]
    assert job.rows == [r0]


def test_a_share_of_padding_only_whose_rows_were_dropped_raises_dispatch_error():
    """With dp_remainder="pad" a rank can get a share of repeats only (fewer rows than
    ranks in the last dispatch). Its rows belong to another rank's share; dropped before
    the padded rank asks, that rank gets DispatchError (it got an empty batch), then the
    end of the partition, and the share's lease is given back."""
    c = Controller(16, num_shards=1, consumers=["d", "e"])
    (r0, r1, r2), _ = put(c, 3)
    c.seal("p")
    r = [req("d", bs=1, partition="p", dp_rank=i, dp_size=2, dp_remainder="pad")
         for i in range(2)]
    for i, want in ((0, [r0]), (1, [r1]), (0, [r2])):  # dispatch 1: rank 1 pads with r2
        d = c.take(r[i])
        assert d.rows == want
        c.ack([d.lease])
    c.drop([r2])
    with pytest.raises(DispatchError, match="every row of the share"):
        c.take(r[1])
    assert c.take(r[1]) is END and sorted(c.rows) == [r0, r1]  # (kept for task "e")
    assert not c.leases and not c._pins


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("acked_first", [True, False])
@pytest.mark.parametrize("reserved", [False, True])
def test_a_retracted_write_takes_its_row_back_from_a_share_that_repeats_it(
        rows, acked_first, reserved):
    """A retract un-writes a field on rows; a batch leased for that field loses those
    rows, and its ack names them. A DP share that repeats such a row as padding loses it
    the same way (it kept a row id whose field was gone): its ack raises LeaseExpired
    naming the row, the row is no longer pinned, and once consumed it is dropped. A share
    still reserved (its rank has not asked) does not deliver the row; one that had
    nothing else gives DispatchError (or the end, once the row was consumed)."""
    c = Controller(16, num_shards=1, consumers=["d"])
    ids, _ = put(c, rows)
    toks = {}
    for rid in ids:  # y written row by row: one write's retract touches one row
        toks[rid] = c.begin_write([rid], ("y",))
        c.commit(toks[rid], {"y": [4]})
    c.seal("p")
    r = [req("d", ("x", "y"), bs=(rows + 1) // 2, partition="p", dp_rank=i, dp_size=2,
             dp_remainder="pad") for i in range(2)]
    d0 = c.take(r[0])
    if acked_first:
        c.ack([d0.lease])
    if not reserved:
        d1 = c.take(r[1])
        (pad,) = [x for x in d1.rows if x in d0.rows]
    (pad,) = c._pins
    assert c._pins == {pad: 1} and pad in d0.rows
    if not reserved:  # (rows still held under it: what materialize checks)
        assert sorted(c.lease_rows(d1.lease)) == sorted(d1.rows)
    c.retract(toks[pad])
    assert not c._pins
    if not reserved and rows == 3:
        assert c.lease_rows(d1.lease) == [x for x in d1.rows if x != pad]
    if reserved and rows == 1 and acked_first:
        assert c.take(r[1]) is END  # (its row was consumed and dropped: p is done)
    elif reserved and rows == 1:
        with pytest.raises(DispatchError, match="taken back"):
            c.take(r[1])
    else:
        if reserved:
            d1 = c.take(r[1])
            assert pad not in d1.rows and len(d1.rows) == 1
        with pytest.raises(LeaseExpired) as e:
            c.ack([d1.lease])
        assert e.value.rows == [pad]
    if not acked_first:
        with pytest.raises(LeaseExpired):
            c.ack([d0.lease])  # (its own copy of the row was withdrawn too)
        assert sorted(c.rows) == [pad]  # not consumed: delivered again once y is back
        tok = c.begin_write([pad], ("y",))
        c.commit(tok, {"y": [4]})
        d = c.take(req("d", ("x", "y"), bs=1, partition="p"))
        assert d.rows == [pad]
        c.ack([d.lease])
    assert not c.rows and not c.leases and not c._pins  # consumed: nothing left


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("end", ["ack", "release", "expire"])
def test_a_padding_row_stays_readable_until_the_padded_share_ends(rows, end):
    """A padding row belongs to another rank's share. Once that rank acks it, it is
    consumed, but it is not dropped while a share that repeats it is live (reserved or
    handed out): the padded rank gets a full batch and can read it. It is dropped as
    consumed when that share ends (ack, release or expiry)."""
    clock = Clock()
    c = Controller(16, num_shards=1, consumers=["d"], lease_timeout=10.0, clock=clock)
    ids, _ = put(c, rows)
    c.seal("p")
    r = [req("d", bs=(rows + 1) // 2, partition="p", dp_rank=i, dp_size=2,
             dp_remainder="pad") for i in range(2)]
    d0 = c.take(r[0])
    c.ack([d0.lease])  # rank 0 done with its rows before rank 1 asks
    kept = set(d0.rows) & set(c.rows)  # rank 1's share repeats one of them
    assert len(kept) == 1
    d1 = c.take(r[1])
    assert len(d1.rows) == len(d0.rows) and set(d1.rows) | set(d0.rows) == set(ids)
    assert kept <= set(d1.rows) <= set(c.rows)  # a full batch it can read
    if end == "ack":
        c.ack([d1.lease])
    elif end == "release":
        c.release([d1.lease])
    else:
        clock.t = 11.0
        c.expire()
    if end == "ack":
        assert not c.rows and c.c_dropped == {"consumed": rows}
        assert c.take(r[0]) is END
    else:  # rank 1's own rows come again; the padding row went
        own = [x for x in d1.rows if x not in d0.rows]
        assert sorted(c.rows) == own and not c._pins


async def test_reading_group_keys_skips_rows_dropped_meanwhile():
    """A grouped stream opened after rows were put reads their group keys from storage.
    A row dropped while that read is on its way fails the read (RowsDropped); the keys
    of the other rows are read again and their groups go out whole."""
    import torch

    from streamrl import StreamQueue
    from streamrl.errors import RowsDropped

    async with StreamQueue(capacity=64, num_shards=1, consumers=["t"]) as q:
        put = await q.put({"uid": torch.tensor([0, 0, 1, 1, 2]), "x": torch.arange(5)},
                          partition="p")
        svc = q._transport.control
        real = svc.data.get
        calls = []

        async def get(req):
            calls.append(req)
            if len(calls) == 1:  # the first read: row 4 is dropped meanwhile
                await q.drop(put.rows[4:])
                raise RowsDropped("gone", [put.rows[4]])
            return await real(req)

        svc.data.get = get
        await q.seal("p")
        got = [sorted(mb.rows) async for mb in q.stream(
            "t", ["x"], 2, partition="p", group_by="uid", group_size=2, timeout=10)]
        svc.data.get = real
        assert sorted(got) == [sorted(put.rows[:2]), sorted(put.rows[2:4])]
        assert len(calls) == 2 and put.rows[4] not in calls[1][0][1]
        assert not svc.ctl._tag_reads.get("uid")


@pytest.mark.parametrize("end", ["release", "expire", "withdrawn"])
def test_a_consumed_row_goes_when_a_task_that_is_no_consumer_gives_it_back(end):
    """Every declared consumer acked a row while another task (not a consumer) held it:
    the lease keeps it readable. When that lease ends unacknowledged (released, expired,
    or its rows taken back by a retract), nothing needs the row any more: it is dropped
    as consumed (it stayed held, leaked, until some other ack happened to touch it)."""
    clock = Clock()
    c = Controller(16, num_shards=1, consumers=["a"], lease_timeout=10.0, clock=clock)
    (r0, r1), _ = put(c, 2)
    tok = c.begin_write([r0, r1], ("y",))
    c.commit(tok, {"y": [4, 4]})
    other = c.take(req("o", ("x", "y"), bs=2, partition="p"))  # "o" is no consumer
    a = c.take(req("a", bs=2, partition="p"))
    c.ack([a.lease])
    assert sorted(c.rows) == [r0, r1]  # (held: "o" still reads them)
    if end == "release":
        c.release([other.lease])
    elif end == "expire":
        clock.t = 11.0
        c.expire()
    else:
        c.retract(tok)
    assert not c.rows and c.c_dropped == {"consumed": 2} and not c.leases
    c.seal("p")
    assert c.take(req("o", ("x", "y"), bs=2, partition="p")) is END


def test_a_restored_state_drops_padding_rows_consumed_while_a_share_kept_them():
    """A padding row whose own rank acked it is kept while the padded share is live. A
    checkpoint taken then comes back with the share released: nothing keeps the row, and
    it is dropped as consumed (it must not stay held for ever)."""
    c = Controller(16, num_shards=1, consumers=["d"])
    ids, _ = put(c, 3)
    c.seal("p")
    r = [req("d", bs=2, partition="p", dp_rank=i, dp_size=2, dp_remainder="pad")
         for i in range(2)]
    d0 = c.take(r[0])
    c.ack([d0.lease])
    d1 = c.take(r[1])
    (pad,) = c._pins
    c2 = Controller(16, num_shards=1, consumers=["d"])
    c2.load_state_dict(c.state_dict())
    assert pad not in c2.rows  # consumed, and kept by nothing now
    own = [x for x in d1.rows if x not in d0.rows]
    assert sorted(c2.rows) == own and not c2._pins and not c2.leases
    d = c2.take(req("d", bs=2, partition="p", dp_rank=0, dp_size=2, dp_remainder="pad"))
    assert own[0] in d.rows


@pytest.mark.parametrize("dp", [False, True])
def test_after_the_whole_queue_is_sealed_a_partition_without_rows_ends(dp):
    """seal() of the whole queue: no new rows anywhere, so a take over a partition that
    never had a row ends at once (it waited for rows that cannot come), as does one over
    a partition the queue knew of only by a declaration."""
    c = Controller(16, num_shards=1, consumers=["t"])
    put(c, 1, part="p")
    c.declare("q", ["t"])
    c.seal_all()
    kw = dict(dp_rank=0, dp_size=2) if dp else {}
    for part in ("never", "q"):
        assert c.take(req("t", bs=1, partition=part, **kw)) is END
    with pytest.raises(InvalidArgument):
        c.allocate("never", 1, ("x",), nbytes=8)


def test_a_finished_partition_named_again_keeps_no_record():
    """A partition first named after the whole queue was sealed (by a declaration or a
    seal) is finished at once, as is one declared again after it finished: no record is
    kept for it (a record per such name stayed before, for good)."""
    c = Controller(16, num_shards=1, consumers=["t"])
    (r,), _ = put(c, 1, part="p")
    c.seal("p")
    d = c.take(req("t", bs=1, partition="p"))
    c.ack([d.lease])
    assert "p" in c.retired and "p" not in c.parts
    c.declare("p", ["t"])  # (finished: nothing to clean up)
    assert "p" not in c.parts
    c.seal_all()
    c.declare("late", ["t"])
    c.seal("later")
    assert set(c.parts) == set() and {"late", "later"} <= c.retired
    for part in ("late", "later", "p"):
        assert c.take(req("t", bs=1, partition=part)) is END


@pytest.mark.parametrize("group_size", [None, 2])
def test_closing_the_queue_lets_a_grouped_filter_judge_short_groups(group_size):
    """close(): no row can join a group any more, as after a seal. A grouped filter
    judges the short groups then (a grouped stream already sends them): their rows were
    left unjudged, so never delivered while the consumers drained the closed queue."""
    c = Controller(100)
    c.add_filter(FilterSpec("g", frozenset({"r"}), "uid", group_size))
    (a, b, d), _ = put(c, 3, ("r", "uid"), tags={"uid": [1, 2, 1]})
    jobs = c.drain()[1]
    assert [j.rows for j in jobs] == ([[a, d]] if group_size else [])
    c.close()
    jobs += c.drain()[1]
    assert sorted(sorted(j.rows) for j in jobs) == [[a, d], [b]]


def test_a_late_ack_of_a_batch_that_lost_rows_to_a_retract_then_the_rest_names_them():
    """A batch loses rows to a retracted write of a field it asked for (they come again
    once the field is written again), then its other rows are dropped (a clear, say):
    its late ack still names the rows taken back (LeaseExpired), as it would had they
    been the last rows to go; it must not pass for a batch whose rows all left. (Until
    stop 43 the lease ended as if acknowledged: the consumer counted work on rows that
    came again; seen in the Ray chaos run.)"""
    c = Controller(16)
    a, _ = put(c, 2)
    b, _ = put(c, 2)
    toks = [c.begin_write(rows, ("r",)) for rows in (a, b)]
    for tok in toks:
        c.commit(tok, {"r": [4, 4]})
    d = c.take(req(fields=("x", "r"), bs=4))
    assert sorted(d.rows) == sorted(a + b)
    c.retract(toks[0])  # a's "r" taken back: a leaves the batch
    c.drop(b)  # then the rest of it
    with pytest.raises(LeaseExpired) as e:
        c.ack([d.lease])
    assert sorted(e.value.rows) == sorted(a)
    tok = c.begin_write(a, ("r",))  # written again: a comes again
    c.commit(tok, {"r": [4, 4]})
    assert sorted(c.take(req(fields=("x", "r"), bs=2)).rows) == sorted(a)
