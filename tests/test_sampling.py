"""Samplers on the pure controller: which ready rows a request gets, and nothing else."""

from __future__ import annotations

import pytest

from streamrl import sampling
from streamrl.config import QueueConfig
from streamrl.controller import END, Controller, Request
from streamrl.errors import InvalidArgument
from streamrl.sampling import (VERSION, BalancedSampler, FifoSampler, PrioritySampler, Sampler,
                               deal)


def put(c, values, part="p", version=None, uids=None, field="adv"):
    """Rows with ``x`` and a tag ``field`` (and ``uid``): returns their ids."""
    n = len(values)
    fields = ("x", field) + (("uid",) if uids else ())
    tok = c.allocate(part, n, fields, nbytes=4 * n, version=version)
    tags = {field: list(values)}
    if uids:
        tags["uid"] = list(uids)
    c.commit(tok, {f: [4] * n for f in fields}, tags)
    return tok.rows


def test_fifo_is_the_default_and_takes_ready_order():
    c = Controller(100)
    assert isinstance(c.sampler, FifoSampler)
    rows = put(c, [3, 1, 2])
    assert c.take(Request("t", ("x",), 2)).rows == rows[:2]


def test_priority_takes_the_highest_first_and_ties_in_ready_order():
    c = Controller(100, sampler={"sampler": "priority", "field": "adv"})
    rows = put(c, [0.5, 2.0, -1.0, 2.0, 1.0])
    d = c.take(Request("t", ("x",), 3))
    assert d.rows == [rows[1], rows[3], rows[4]]
    asc = Request("u", ("x",), 2, sampler=PrioritySampler("adv", order="asc"))  # per request
    assert c.take(asc).rows == [rows[2], rows[0]]
    assert c.take(Request("v", ("x",), 2, sampler="fifo")).rows == rows[:2]


def test_priority_rows_without_a_value_come_last():
    c = Controller(100, sampler=PrioritySampler("adv"))
    tok = c.allocate("p", 2, ("x",), nbytes=8)
    c.commit(tok, {"x": [4, 4]})  # no "adv" yet
    rows = put(c, [1.0, 5.0])
    assert c.take(Request("t", ("x",), 4)).rows == [rows[1], rows[0]] + tok.rows


def test_priority_by_version_newest_first_needs_no_tag():
    c = Controller(100, sampler=PrioritySampler(VERSION))
    c.set_version(3)
    old = put(c, [0, 0], version=1)
    new = put(c, [0, 0], version=3)
    req = Request("t", ("x",), 2)
    assert c.tags_needed(req) == []
    assert c.take(req).rows == new
    assert c.take(req).rows == old


def test_priority_keeps_groups_whole_and_ranks_them_by_their_reduced_value():
    c = Controller(100)
    #           group 1      group 2      group 3
    rows = put(c, [0, 9, 5, 5, 8, 7], uids=[1, 1, 2, 2, 3, 3])
    req = dict(group_by="uid", group_size=2)
    by_max = Request("t", ("x",), 2, sampler=PrioritySampler("adv"), **req)
    assert c.take(by_max).rows == rows[:2]  # max 9
    by_mean = Request("u", ("x",), 4, sampler=PrioritySampler("adv", reduce="mean"), **req)
    assert c.take(by_mean).rows == rows[4:6] + rows[2:4]  # means 7.5, 5, 4.5
    low = Request("v", ("x",), 2, sampler=PrioritySampler("adv", order="asc", reduce="min"), **req)
    assert c.take(low).rows == rows[:2]  # min 0


def test_the_controller_decides_tails_and_ends_not_the_sampler():
    c = Controller(100, sampler=PrioritySampler("adv"))
    rows = put(c, [1, 3, 2])
    req = Request("t", ("x",), 2, partition="p")
    assert c.take(req).rows == [rows[1], rows[2]]
    assert c.take(req) is None  # one row left, unsealed: wait
    c.seal("p")
    c.ack(list(c.leases))
    assert c.take(req).rows == [rows[0]]  # short tail
    c.ack(list(c.leases))
    assert c.take(req) is END
    c2 = Controller(100, sampler=PrioritySampler("adv"))
    put(c2, [1])
    c2.seal("p")
    assert c2.take(Request("t", ("x",), 2, partition="p", drop_last=True)) is END


def test_tags_needed_includes_the_samplers_fields():
    c = Controller(100, sampler={"sampler": "priority", "field": "adv"})
    req = Request("t", ("x",), 2, group_by="uid")
    assert c.request_tags(req) == ["uid", "adv"]
    assert c.tags_needed(req) == ["uid", "adv"]
    assert c.tags_needed(Request("t", ("x",), 2, sampler="fifo")) == []
    c.take(req)
    assert {"uid", "adv"} <= c.tag_fields


class Reverse(BalancedSampler):
    """Newest ready first."""

    def order(self, ready, size):
        return list(ready.units())[::-1]


class Broken(Sampler):
    def __init__(self, unit):
        self.unit = unit

    def order(self, ready, size):
        return [self.unit]


def test_a_custom_sampler_orders_units_and_is_checked():
    c = Controller(100)
    rows = put(c, [0, 0, 0, 0], uids=[1, 1, 2, 2])
    assert c.take(Request("t", ("x",), 2, sampler=Reverse())).rows == [rows[3], rows[2]]
    grouped = Request("u", ("x",), 2, group_by="uid", group_size=2, sampler=Reverse())
    assert c.take(grouped).rows == rows[2:]
    for bad in ([999], [rows[0], rows[0]], [rows[0], rows[2]]):
        with pytest.raises(InvalidArgument, match="not a whole complete group"):
            c.take(Request("v", ("x",), 2, group_by="uid", group_size=2, sampler=Broken(bad)))
    with pytest.raises(InvalidArgument, match="not a single ready row"):
        c.take(Request("w", ("x",), 1, sampler=Broken([rows[0], rows[1]])))
    assert not c.leases.keys() - {1, 2}  # the bad takes leased nothing


def test_dp_split_is_the_samplers():
    c = Controller(100)
    rows = put(c, [4, 3, 2, 1, 0])
    reqs = [Request("t", ("x",), 2, dp_size=2, dp_rank=r, dp_remainder="pad",
                    sampler=PrioritySampler("adv")) for r in (0, 1)]
    shares = [c.take(r) for r in reqs]
    assert sorted(shares[0].rows + shares[1].rows) == sorted(rows[:4])  # the 4 best
    dealt = [Request("u", ("x",), 2, dp_size=2, dp_rank=r, sampler=Reverse()) for r in (0, 1)]
    assert [len(c.take(r).rows) for r in dealt] == [2, 2]


class Split(Sampler):
    """Dispatch order as it is; its DP split is ``how(units, ranks)``."""

    def __init__(self, how):
        self.how = how

    def order(self, ready, size):
        return ready.units()

    def split(self, units, ranks, weights):
        return self.how(units, ranks)


def test_a_custom_dp_split_is_checked():
    """A sampler's split that leaves a unit out, deals one twice, or pads a share with
    rows not of the dispatch is refused (InvalidArgument saying what split() must do)
    and leases nothing; the rows go to the next request whole."""
    c = Controller(100)
    rows = put(c, [0, 0, 0])
    c.seal("p")  # (the last dispatch: three rows for two ranks of two)
    bad = {
        "a unit left out": lambda u, r: ([u[0], u[1]], [[], []]),
        "a unit twice": lambda u, r: ([u[0] + u[1], u[1] + u[2]], [[], []]),
        "padding from elsewhere": lambda u, r: ([u[0] + u[1], u[2]], [[], [999]]),
    }
    for why, how in bad.items():
        req = Request("t", ("x",), 2, partition="p", dp_size=2, dp_remainder="pad",
                      sampler=Split(how))
        with pytest.raises(InvalidArgument, match="every unit in exactly one share"):
            c.take(req)
        assert not c.leases, why
    good = [Request("t", ("x",), 2, partition="p", dp_size=2, dp_rank=r, dp_remainder="pad",
                    sampler=Split(deal)) for r in (0, 1)]
    a, b = (c.take(r) for r in good)
    assert (a.rows, b.rows, b.pads) == (rows[0::2], [rows[1], rows[0]], (rows[0],))


def test_balance_by_needs_a_balancing_sampler():
    class Dealer(Sampler):
        def order(self, ready, size):
            return ready.units()

    c = Controller(100)
    put(c, [1, 2, 3, 4])
    req = Request("t", ("x",), 2, dp_size=2, balance_by="adv", sampler=Dealer())
    with pytest.raises(InvalidArgument, match="BalancedSampler"):
        c.validate_request(req)
    with pytest.raises(InvalidArgument, match="BalancedSampler"):
        c.take(req)
    assert deal([[1], [2], [3]], 2) == ([[1, 3], [2]], [[], [1]])


def test_specs_resolve_and_bad_ones_say_what_there_is():
    assert sampling.resolve(None) is sampling.resolve("fifo")
    p = sampling.resolve({"sampler": "priority", "field": "adv", "order": "asc"})
    assert (p.field, p.direction) == ("adv", "asc")
    for bad, match in [("nope", "registered samplers: fifo, priority"),
                       ({"field": "adv"}, "needs 'sampler'"), (3, "registered name"),
                       ({"sampler": "priority", "feild": "adv"}, "does not take"),
                       ({"sampler": "priority", "field": "adv", "order": "up"}, "'desc' or 'asc'")]:
        with pytest.raises(InvalidArgument, match=match):
            sampling.resolve(bad)
    with pytest.raises(InvalidArgument, match="unknown sampler"):
        Request("t", ("x",), 2, sampler="nope")  # validated when the request is made
    with pytest.raises(InvalidArgument, match="unknown sampler"):
        QueueConfig(sampler="nope")


def test_register_a_sampler_by_name():
    sampling.register("reverse", Reverse)
    try:
        with pytest.raises(InvalidArgument, match="registered already"):
            sampling.register("reverse", FifoSampler)
        c = Controller(100, sampler="reverse")
        rows = put(c, [0, 0, 0])
        assert c.take(Request("t", ("x",), 3)).rows == rows[::-1]
        assert "reverse" in sampling.available()
    finally:
        sampling.unregister("reverse")
    with pytest.raises(InvalidArgument):
        sampling.resolve("reverse")
