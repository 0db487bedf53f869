"""Row lifecycle on every transport: filters, consumer-set cleanup, staleness, pacing,
DP dispatch and the stats that account for every row."""

from __future__ import annotations

import asyncio
import pickle
import random

import anyio
import pytest
import torch

import streamrl
from grpo_cancel import CountingReads, cancel_after_turns, drop_as_read
from streamrl import filters
from streamrl.controller import imbalance
from streamrl.errors import (DispatchError, FilterError, InvalidArgument, RowsDropped, RowsLost,
                             SchemaError, StreamTimeout)

pytestmark = pytest.mark.timeout(60)


async def eventually(fn, timeout=5.0):
    """Poll an async predicate until true (stats are eventually consistent with filters)."""
    with anyio.fail_after(timeout):
        while not await fn():
            await anyio.sleep(0.01)


def grpo_groups(n_groups, size, equal, start=0):
    """Rows of n_groups groups; groups listed in `equal` get identical rewards."""
    uid = torch.arange(start, start + n_groups).repeat_interleave(size)
    reward = torch.rand(n_groups * size, generator=torch.Generator().manual_seed(start))
    for g in equal:
        reward[(g - start) * size:(g - start + 1) * size] = 1.0
    return {"uid": uid, "prompt": torch.zeros(n_groups * size, 8)}, {"reward": reward}


async def test_grpo_zero_variance_filter_ends_with_nothing_held(make_queue):
    q = make_queue(consumers=["train"])
    await q.add_filter(filters.zero_variance("reward", group_by="uid", group_size=4))
    G, S = 10, 4
    equal = set(range(0, G, 2))  # half the groups carry no signal
    base, rewards = grpo_groups(G, S, equal)
    rows = await q.put(base, partition="step-0")
    # rewards arrive per group, in another order, as the reward role finishes them
    for g in reversed(range(G)):
        sl = slice(g * S, (g + 1) * S)
        await q.put({"reward": rewards["reward"][sl]}, rows=rows[sl])
    await q.seal("step-0")
    trained_groups = []
    async for mb in q.stream("train", ["prompt", "reward"], 8, partition="step-0",
                             group_by="uid", group_size=S):
        td = await mb.materialize(["uid", "reward"])
        for g in set(td["uid"].tolist()):
            r = td["reward"][td["uid"] == g]
            assert r.max() > r.min()  # never an unfiltered, signal-free group
            trained_groups.append(g)
    assert sorted(trained_groups) == sorted(set(range(G)) - equal)
    st = await q.stats()
    assert st.filtered == len(equal) * S and st.filtered_by == {"zero_variance": len(equal) * S}
    assert st.rows == 0 and st.bytes == 0 and sum(st.unit_rows) == 0 and st.leaked == 0
    assert st.consumed == (G - len(equal)) * S
    assert await q.leaked() == 0


async def test_filter_sees_fields_and_rows_leased_elsewhere_shrink(make_queue):
    q = make_queue()
    await q.add_filter(lambda td: td["score"] > 0, fields=["score"], name="positive")
    rows = await q.put({"x": torch.arange(4)}, partition="p")
    early = await q.get("logger", ["x"], 4, partition="p")  # needs no filter field
    await q.put({"score": torch.tensor([1.0, -1.0, 2.0, -2.0])}, rows=rows)
    mb = await q.get("train", ["x", "score"], 2, partition="p", timeout=5)
    assert (await mb.materialize(["x"]))["x"].tolist() == [0, 2]
    await eventually(lambda: _eq(q, "filtered", 2))
    await early.ack()  # the rejected rows left its lease; acking the rest works
    st = await q.stats()
    assert st.tasks["logger"].acked >= 2 and st.rows == 2


async def _eq(q, attr, v):
    return getattr(await q.stats(), attr) == v


async def test_async_filter_and_predicate_and_length_filters(make_queue):
    q = make_queue()

    async def keep_even(td):
        await anyio.sleep(0)
        return td["k"] % 2 == 0

    await q.add_filter(keep_even, fields=["k"])
    await q.add_filter(filters.max_length("resp", 3))
    await q.add_filter(filters.predicate("chat", lambda chats: [c != "spam" for c in chats]))
    await q.put({"k": torch.arange(6), "resp": [torch.ones(i) for i in range(6)],
                 "chat": ["hi", "spam", "ok", "ok", "spam", "x"]}, partition="p")
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["k", "resp", "chat"], 2, partition="p"):
        got.extend((await mb.materialize(["k"]))["k"].tolist())
    assert got == [0, 2]  # 4 has resp of length 4; 1,3,5 are odd
    st = await q.stats()
    assert st.filtered == 4 and set(st.filtered_by) <= {"keep_even", "max_length", "predicate:chat"}


async def test_filter_error_is_raised_to_producer_and_rows_dropped(make_queue):
    q = make_queue()

    def broken(td):
        raise ZeroDivisionError("oops")

    await q.add_filter(broken, fields=["r"])
    with pytest.raises(FilterError, match="oops"):
        await q.put({"r": torch.ones(3)}, partition="p")
    st = await q.stats()
    assert st.filter_errors == 3 and st.rows == 0 and "broken" in st.last_filter_errors[0]
    await q.add_filter(lambda td: [True], fields=["s"], name="short_mask")
    with pytest.raises(FilterError, match="mask of 1 entries for 2 rows"):
        await q.put({"s": torch.ones(2)}, partition="p")
    assert (await q.stats()).rows == 0


async def test_filter_over_unwritten_field_is_pending_and_close_reports(make_queue):
    q = make_queue()
    await q.add_filter(lambda td: True, fields=["never"], name="waits")
    await q.put({"x": torch.ones(3)}, partition="p")
    st = await q.stats()
    assert st.filter_pending == {"waits": 3}
    held = await q.close()
    assert held == {"p": 3}


async def test_stale_versions_are_dropped_per_group(make_queue):
    q = make_queue(max_staleness=1)
    for v in range(3):
        await q.put({"uid": torch.tensor([10 * v, 10 * v, 10 * v + 1, 10 * v + 1]),
                     "x": torch.full((4,), v)}, partition="p", version=v)
    await q.set_version(2)  # limit 1: version 0 is stale
    st = await q.stats()
    assert st.stale == 4 and st.rows == 8
    await q.set_version(3)  # limit 2: version 1 too
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["x"], 2, partition="p", group_by="uid", group_size=2):
        assert set(mb.versions) == {2}
        got.extend((await mb.materialize())["x"].tolist())
    assert got == [2, 2, 2, 2]
    st = await q.stats()
    assert st.stale == 8 and st.dropped_by["stale"] == 8
    with pytest.raises(InvalidArgument):
        await q.set_version(1)  # backwards


async def test_stream_level_staleness_drops_group_together(make_queue):
    q = make_queue()
    await q.put({"uid": torch.tensor([1, 1, 2, 2]), "x": torch.ones(4)}, partition="p", version=0)
    await q.put({"uid": torch.tensor([3, 3]), "x": torch.ones(2)}, partition="p", version=5)
    await q.set_version(5)
    mb = await q.get("t", ["x"], 2, partition="p", group_by="uid", group_size=2, max_staleness=2,
                     timeout=5)
    assert mb.versions == [5, 5]
    st = await q.stats()
    assert st.stale == 4 and st.rows == 2


async def test_admission_pacer_holds_producers_until_trainer_catches_up(make_queue):
    q = make_queue(max_lead=1)
    await q.put({"x": torch.ones(1)}, version=1)  # one ahead: fine
    with pytest.raises(StreamTimeout):
        await q.put({"x": torch.ones(1)}, version=2, timeout=0.2)
    done = anyio.Event()

    async def producer():
        await q.put({"x": torch.ones(1)}, version=3)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(producer)
        await anyio.sleep(0.1)
        assert not done.is_set() and (await q.stats()).waiting_puts == 1
        await q.set_version(1)
        await anyio.sleep(0.1)
        assert not done.is_set()  # 3 > 1 + 1 still
        await q.set_version(2)
        with anyio.fail_after(5):
            await done.wait()


async def test_a_seal_ends_the_wait_of_puts_held_by_the_pacer(make_queue):
    """A put held back by ``max_lead`` into a partition sealed meanwhile can never be
    admitted: the seal ends its wait with the error, rather than the next set_version
    (which a trainer that has sealed everything may never call)."""
    q = make_queue(max_lead=1)
    outcomes: dict[str, object] = {}

    async def producer(tag, part, n):
        try:
            outcomes[tag] = len(await q.put(
                {"x": torch.ones(n)}, partition=part, version=3, timeout=60))
        except InvalidArgument as e:
            outcomes[tag] = e

    async def settled(*tags):
        with anyio.fail_after(10):
            while not all(t in outcomes for t in tags):
                await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        for tag, part, n in (("one", "p", 1), ("two", "p", 2), ("other", "o", 1)):
            tg.start_soon(producer, tag, part, n)
        with anyio.fail_after(30):
            while (await q.stats()).waiting_puts != 3:
                await anyio.sleep(0.01)
        await q.seal("p")
        await settled("one", "two")
        assert "other" not in outcomes  # its partition is open: it waits for the trainer
        await q.set_version(2)
        await settled("other")
    for tag in ("one", "two"):
        assert isinstance(outcomes[tag], InvalidArgument) and "sealed" in str(outcomes[tag])
    assert outcomes["other"] == 1
    st = await q.stats()
    assert st.rows == 1 and st.waiting_puts == 0


async def test_consumer_set_cleanup_frees_rows_when_last_task_acks(make_queue):
    q = make_queue()
    await q.declare("p", ["ref", "train"])
    await q.put({"x": torch.ones(6, 16)}, partition="p")
    a = await q.get("ref", ["x"], 6, partition="p")
    await a.ack()
    st = await q.stats()
    assert st.rows == 6 and st.partitions["p"]["consumed"] == 6
    b = await q.get("train", ["x"], 4, partition="p")
    await b.ack()
    st = await q.stats()
    assert st.rows == 2 and st.consumed == 4 and st.bytes == 2 * 16 * 4
    c = await q.get("train", ["x"], 2, partition="p")
    await c.ack()
    st = await q.stats()
    assert st.rows == 0 and st.bytes == 0 and sum(st.unit_bytes) == 0


async def test_dp_dispatch_equal_counts_and_balanced_tokens(make_queue):
    q = make_queue(capacity=4096)
    R, B = 4, 16
    rng = random.Random(0)  # skewed, like response lengths: lognormal, capped at 4096
    lengths = [min(4096, int(rng.lognormvariate(5.5, 1.0))) for _ in range(R * B * 4)]
    await q.put({"length": torch.tensor(lengths), "x": torch.ones(len(lengths))}, partition="s")
    await q.seal("s")
    per_rank: dict[int, list[list[int]]] = {r: [] for r in range(R)}

    async def rank(r):
        async for mb in q.stream("train", ["x", "length"], B, partition="s", dp_rank=r,
                                 dp_size=R, balance_by="length"):
            per_rank[r].append((await mb.materialize(["length"]))["length"].tolist())

    async with anyio.create_task_group() as tg:
        for r in range(R):
            tg.start_soon(rank, r)
    steps = len(per_rank[0])
    assert steps == 4 and all(len(v) == steps for v in per_rank.values())
    for k in range(steps):
        shares = [per_rank[r][k] for r in range(R)]
        assert all(len(s) == B for s in shares)  # equal counts, never empty
        ours = imbalance([sum(s) for s in shares])
        flat = [x for s in shares for x in s]
        rr = imbalance([sum(flat[i::R]) for i in range(R)])  # round-robin of the same rows
        assert ours < 0.05 and ours < rr


async def test_dp_remainder_policies(make_queue):
    q = make_queue()
    await q.put({"x": torch.arange(5)}, partition="e")
    await q.seal("e")
    with pytest.raises(DispatchError):
        await q.get("t", ["x"], 4, partition="e", dp_rank=0, dp_size=2)
    await q.put({"x": torch.arange(5)}, partition="d")
    await q.seal("d")
    a = await q.get("t", ["x"], 4, partition="d", dp_rank=0, dp_size=2, dp_remainder="drop")
    b = await q.get("t", ["x"], 4, partition="d", dp_rank=1, dp_size=2, dp_remainder="drop")
    assert len(a) == len(b) == 2
    assert (await q.stats()).dropped_by.get("dp_remainder") == 1
    await q.put({"x": torch.arange(3)}, partition="pad")
    await q.seal("pad")
    a = await q.get("t", ["x"], 4, partition="pad", dp_rank=0, dp_size=2, dp_remainder="pad")
    b = await q.get("t", ["x"], 4, partition="pad", dp_rank=1, dp_size=2, dp_remainder="pad")
    assert len(a) == len(b) == 2 and len(set(a.rows) | set(b.rows)) == 3


async def test_a_dp_share_that_lost_rows_before_its_rank_asked(make_queue):
    """Rows of a share reserved for a rank can leave before that rank asks (stale on a
    version bump, dropped, cleared): the rank gets what is left of its share, or a
    clear DispatchError when nothing is (both gave a bare KeyError). The ranks stay in
    step: the next batch of each comes from the next dispatch."""
    q = make_queue(max_staleness=0)
    old = await q.put({"x": torch.arange(4)}, partition="p", version=0)
    a = await q.get("t", ["x"], 2, partition="p", dp_rank=0, dp_size=2)
    assert len(a) == 2 and set(a.rows) < set(old.rows)  # rank 1's two are reserved
    await q.set_version(1)  # every row of dispatch 0 goes stale before rank 1 asks
    with pytest.raises(DispatchError, match="dropped"):
        await q.get("t", ["x"], 2, partition="p", dp_rank=1, dp_size=2, timeout=30)
    await a.ack()
    new = await q.put({"x": torch.arange(4, 8)}, partition="p", version=1)
    a = await q.get("t", ["x"], 2, partition="p", dp_rank=0, dp_size=2, timeout=30)
    theirs = sorted(set(new.rows) - set(a.rows))  # rank 1's share of dispatch 1
    assert len(theirs) == 2
    await q.drop(theirs[:1])
    b = await q.get("t", ["x"], 2, partition="p", dp_rank=1, dp_size=2, timeout=30)
    assert list(b.rows) == theirs[1:]
    assert (await b.materialize())["x"].tolist() == [4 + new.rows.index(theirs[1])]
    await a.ack()
    await b.ack()
    st = await q.stats()
    assert st.rows == 3 and st.stale == 4


@pytest.mark.parametrize("n", [1, 3])
async def test_a_padded_rank_reads_its_padding_after_the_other_rank_acked_it(make_queue, n):
    """dp_remainder="pad": the padding row of rank 1's batch is a row of rank 0's share.
    Rank 0 acks it (the last task to need it) before rank 1 asks: rank 1 still gets a
    full batch and reads it; the row is dropped once rank 1 acks, and nothing leaks."""
    q = make_queue(consumers=["t"])
    await q.put({"x": torch.arange(10, 10 + n)}, partition="p")
    await q.seal("p")
    kw = dict(partition="p", dp_size=2, dp_remainder="pad", timeout=30)
    a = await q.get("t", ["x"], (n + 1) // 2, dp_rank=0, **kw)
    mine = (await a.materialize())["x"].tolist()
    await a.ack()
    b = await q.get("t", ["x"], (n + 1) // 2, dp_rank=1, **kw)
    assert len(b) == len(a)
    theirs = (await b.materialize())["x"].tolist()  # (read after rank 0's ack)
    assert sorted(set(mine) | set(theirs)) == list(range(10, 10 + n))
    assert set(mine) & set(theirs)  # the padding: a value of rank 0's batch
    await b.ack()
    st = await q.stats()
    assert st.rows == 0 and st.bytes == 0 and st.consumed == n


async def test_a_row_kept_by_a_task_that_is_no_consumer_goes_when_it_gives_it_back(make_queue):
    """The declared consumer acks a row while another task holds it: the row stays for
    that task's batch. Given back unacknowledged, nothing needs the row any more: it is
    dropped as consumed, and nothing is left held (it leaked before)."""
    q = make_queue(consumers=["a"])
    await q.put({"x": torch.arange(2)}, partition="p")
    await q.seal("p")
    other = await q.get("o", ["x"], 2, partition="p", timeout=30)
    mb = await q.get("a", ["x"], 2, partition="p", timeout=30)
    await mb.ack()
    assert (await q.stats()).rows == 2  # (kept for "o")
    await other.release()
    st = await q.stats()
    assert st.rows == 0 and st.bytes == 0 and st.consumed == 2 and st.leases == 0
    assert await q.leaked() == 0


async def test_closing_the_queue_lets_a_grouped_filter_judge_a_short_group(make_queue):
    """A grouped filter judges a short last group once no row can join it: after a seal
    of its partition, and after close() too. Its row was never judged, so never delivered
    while the consumer drained the closed queue."""
    q = make_queue(consumers=["t"])
    await q.add_filter(lambda td: td["r"] >= 0, fields=["r"], group_by="uid", group_size=2,
                       name="g")
    await q.put({"r": torch.tensor([1.0, 2.0, 3.0]), "uid": torch.tensor([1, 2, 1])},
                partition="p")
    mb = await q.get("t", ["r"], 2, partition="p", timeout=30)  # group 1, judged
    await mb.ack()
    await q.close()
    got = [mb.rows async for mb in q.stream("t", ["r"], 2, partition="p", timeout=30)]
    assert len(got) == 1 and len(got[0]) == 1  # group 2's row, judged at close
    st = await q.stats()
    assert st.rows == 0 and st.consumed == 3


async def test_after_seal_of_the_whole_queue_a_stream_over_an_empty_partition_ends(make_queue):
    """seal() without a partition: no new rows anywhere, so a stream over a partition
    that never got a row ends at once (it waited for its timeout), DP ranks included."""
    q = make_queue()
    await q.put({"x": torch.arange(2)}, partition="p")
    await q.seal()
    assert [mb async for mb in q.stream("t", ["x"], 1, partition="never", timeout=5)] == []
    assert [mb async for mb in q.stream("t", ["x"], 1, partition="never", dp_rank=1,
                                        dp_size=2, timeout=5)] == []
    assert len([mb async for mb in q.stream("t", ["x"], 1, partition="p", timeout=5)]) == 2


async def _padded_shares(make_queue, rows: int, batch: int, q=None, partition: str = "p"):
    """A queue (``q``, or a new one) holding ``rows`` rows of ``x`` in ``partition``
    (sealed), and the batches of its two DP ranks of ``batch`` rows each, the short one
    padded."""
    if q is None:
        q = make_queue(consumers=["t"])
    await q.put({"x": torch.arange(rows)}, partition=partition)
    await q.seal(partition)
    kw = dict(partition=partition, dp_size=2, dp_remainder="pad", timeout=30)
    a = await q.get("t", ["x"], batch, dp_rank=0, **kw)
    b = await q.get("t", ["x"], batch, dp_rank=1, **kw)
    return q, a, b


async def test_dropping_a_padded_batch_ends_its_lease(make_queue):
    """A batch of padding only (one row, two DP ranks) repeats rank 0's row. Dropped
    (here through a pickled copy), it ends its lease (it stayed open until its lease
    timeout) and leaves the row to rank 0, whose share it is: rank 0 still reads it,
    and its ack consumes it."""
    q, a, b = await _padded_shares(make_queue, 1, 1)
    assert b.rows == a.rows and (await q.stats()).leases == 2
    await pickle.loads(pickle.dumps(b)).drop()  # (a copy sent elsewhere drops the same)
    st = await q.stats()
    assert st.leases == 1 and st.rows == 1
    assert (await a.materialize())["x"].tolist() == [0]
    await a.ack()
    st = await q.stats()
    assert st.leases == 0 and st.rows == 0 and st.bytes == 0 and st.dropped == st.consumed == 1


@pytest.mark.parametrize("rows,batch", [(3, 2), (1, 1)])
async def test_a_cancelled_drop_of_a_padded_batch_still_runs_to_its_end(make_queue, rows,
                                                                        batch):
    """``drop()`` runs to its end once started, even when the task awaiting it is
    cancelled (cancelled before it starts, it does nothing): for a padded batch, which
    drops its own row (3 rows, batches of 2), or, holding padding only (1 row), drops
    nothing and acknowledges its lease. The queue then holds rank 0's share alone, whose
    ack leaves nothing. The cancellation comes after 0 to 5 steps of the event loop (the
    drop is done by then on some transports). One queue, a partition for each number of
    steps (each ends with nothing held)."""
    q = make_queue(consumers=["t"])
    for steps in range(6):
        dropped = (await q.stats()).dropped
        q, a, b = await _padded_shares(make_queue, rows, batch, q, f"p{steps}")
        task = asyncio.ensure_future(b.drop())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        st = await q.stats()
        if steps == 0:  # (never started)
            assert (st.rows, st.leases, st.dropped - dropped) == (rows, 2, 0)
            await b.drop()
            st = await q.stats()
        own = rows - len(a)  # (b's own rows)
        assert (st.rows, st.leases, st.dropped - dropped) == (rows - own, 1, own), steps
        await a.ack()
        st = await q.stats()
        assert (st.rows, st.leases, st.bytes) == (0, 0, 0) and await q.audit() == []


async def test_a_padded_batch_marks_its_padding(make_queue):
    """``padding`` is True exactly where a DP batch repeats a row of another rank's
    share: on the batch, its views (slice, index list, int, bool mask), a concat, a
    pickled copy (which another process would get); all False for rank 0's full share
    and for the batch a put returns."""
    q, a, b = await _padded_shares(make_queue, 3, 2)
    assert a.padding.tolist() == [False, False]
    assert b.padding.tolist() == [r in a.rows for r in b.rows] == [False, True]
    assert b[1:].padding.tolist() == [True]
    assert b.padded and b[1:].padded and not b[:1].padded and not a.padded  # (any padding)
    assert b[[1, 0, 1]].padding.tolist() == [True, False, True]
    assert b[1].padding.shape == torch.Size([]) and bool(b[1].padding)
    assert b[torch.tensor([False, True])].padding.tolist() == [True]
    assert pickle.loads(pickle.dumps(b)).padding.tolist() == [False, True]
    # (rank 0's own row is not padding in its own place, whatever another batch repeats)
    assert streamrl.RowRemoteBatch.concat([a, b]).padding.tolist() == [False, False, False, True]
    x = (await b.materialize())["x"]
    assert x[~b.padding].tolist() == [x[0].item()]
    put = await q.put({"x": torch.arange(2)}, partition="o")
    assert put.padding.tolist() == [False, False] and put.padding.dtype == torch.bool
    await a.ack()
    await b.ack()
    assert (await q.stats()).rows == 2


async def test_one_row_names_the_row_of_a_one_row_view(make_queue):
    """``one_row``: the row id of a view of one row (the batch of a one-row put, before
    and after it is used; a slice or index list of one row; a delivered batch of one),
    ``None`` for more rows, a scalar view (an int index, which cannot be written
    through) and a place of a DP share that is padding."""
    q = make_queue(capacity=16, consumers=["t"])
    one = await q.put({"x": torch.tensor([7])}, partition="p")
    assert one.one_row is not None
    rid = one.one_row
    assert one.rows == [rid] and one.one_row == rid  # (its state built: the same)
    two = await q.put({"x": torch.arange(2)}, partition="p")
    assert two.one_row is None and two[1:].one_row == two.rows[1]
    assert two[[0]].one_row == two.rows[0] and two[0].one_row is None
    mb = await q.get("t", ["x"], 1, partition="p", timeout=5)
    assert mb.one_row == mb.rows[0] == rid
    await mb.ack()
    _, a, b = await _padded_shares(make_queue, 3, 2)
    assert b[1:].one_row is None and a[:1].one_row == a.rows[0]  # (padding: not its own)


@pytest.mark.parametrize("rows", [3, 1])
async def test_a_write_through_a_padded_batch_writes_its_own_rows_only(make_queue, rows):
    """Every DP rank writes a result for each place of its batch (as a trainer writes
    back log-probs); a padded rank's values at its padding places are left out, so the
    rank whose share the row is writes it (it got DuplicateField before, or, with
    overwrite, lost its value to the padded rank's). Through ``write`` (3 rows: one
    own row, one repeat) and through ``put(rows=...)`` (1 row: padding only, nothing
    is written), whichever rank writes first."""
    q, a, b = await _padded_shares(make_queue, rows, 2 if rows == 3 else 1)
    xb = (await b.materialize())["x"]
    if rows == 3:
        assert (await b.write({"y": -xb.float()})) is b
    else:
        assert len(await q.put({"y": -xb.float()}, rows=b)) == 0
    xa = (await a.materialize())["x"]
    await a.write({"y": xa.float() * 10})
    assert (await a.materialize(["y"]))["y"].tolist() == (xa * 10).tolist()
    own = b[~b.padding]
    assert (await own.materialize(["y"]))["y"].tolist() == (-xb[~b.padding]).tolist()
    await b.write({"z": torch.ones(len(b))})  # (a second field: no DuplicateField)
    await a.ack()
    await b.ack()
    st = await q.stats()
    assert (st.rows, st.leases, st.bytes) == (0, 0, 0) and await q.audit() == []


async def test_dropping_a_padded_batch_drops_its_own_rows_only(make_queue):
    """Three rows over two DP ranks of two: rank 1's share is one row of its own and a
    repeat of one of rank 0's. Its ``drop()`` deletes its own row and leaves the repeat
    to rank 0, which reads its whole share afterwards (it lost rows to another rank's
    drop before); a view of the batch drops as the batch does, and nothing leaks."""
    q, a, b = await _padded_shares(make_queue, 3, 2)
    own_b = set(b.rows) - set(a.rows)
    assert len(own_b) == 1 and len(set(b.rows) & set(a.rows)) == 1
    xb = dict(zip(b.rows, (await b.materialize())["x"].tolist()))
    await b[:].drop()  # (a view of the whole batch)
    st = await q.stats()
    assert st.rows == 2 and st.leases == 1 and st.dropped == 1
    assert sorted((await a.materialize())["x"].tolist()) == sorted(
        set(range(3)) - {xb[r] for r in own_b})
    await a.ack()
    st = await q.stats()
    assert st.rows == 0 and st.leases == 0 and st.bytes == 0
    assert await q.audit() == []


@pytest.mark.parametrize("declared", [True, False])
async def test_a_declared_group_key_makes_a_streams_own_staleness_drop_whole_groups(
        make_queue, declared):
    """With ``group_key="uid"`` on the queue, a stream with its own ``max_staleness``
    that finds stale rows drops their whole groups, although no grouped stream or filter
    ever named the key: the group mates it could not be handed (they lack a field it
    asks for) go too. Without the option the key is unknown and the mates stay (the
    groups are split: what the docs warn of)."""
    q = make_queue(group_key="uid" if declared else None)
    rows = await q.put({"uid": torch.tensor([7, 7, 8, 8]), "x": torch.zeros(4, 2)},
                       partition="p", version=0)
    await q.put({"y": torch.ones(2)}, rows=rows[[0, 2]])
    assert await q.set_version(2) == 0  # (no queue-wide bound)
    with pytest.raises(StreamTimeout):
        await q.get("t", ["x", "y"], 2, partition="p", max_staleness=1, timeout=0.5)
    st = await q.stats()
    assert (st.stale, st.rows, st.bytes == 0) == ((4, 0, True) if declared else (2, 2, False))
    assert await q.audit() == []


@pytest.mark.parametrize("rows", [1, 2])
async def test_a_put_whose_group_key_is_no_scalar_leaves_nothing(make_queue, rows):
    """With ``group_key`` the key is a tag of every partition, so a put whose key is not
    one scalar a row raises SchemaError, and leaves nothing, even as the first put of a
    partition, before the client has heard which fields are tags there (the value is
    then read back from storage after the commit: the row stayed, without a key, and a
    grouped take of the partition raised). The grouped stream then reads the good rows
    as usual."""
    q = make_queue(consumers=["t"], group_key="uid")
    bad = {"uid": torch.zeros(rows, 2, dtype=torch.int64), "x": torch.ones(rows, 4)}
    with pytest.raises(SchemaError, match="one scalar per row"):
        await q.put(bad, partition="p")
    st = await q.stats()
    assert (st.rows, st.bytes, st.put - st.dropped) == (0, 0, 0) and await q.audit() == []
    for i in range(4):
        await q.put({"uid": torch.tensor([i % 2]), "x": torch.full((1, 4), float(i))},
                    partition="p")
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["uid", "x"], 2, partition="p", group_by="uid",
                             group_size=2, timeout=30):
        td = await mb.materialize()
        got.append(sorted(td["x"][:, 0].tolist()))
    assert sorted(got) == [[0.0, 2.0], [1.0, 3.0]]
    st = await q.stats()
    assert (st.rows, st.bytes) == (0, 0) and await q.audit() == []


def test_a_group_key_is_a_field_name():
    for bad in ("", 3, ["uid"]):
        with pytest.raises(InvalidArgument, match="group_key"):
            streamrl.StreamQueue(group_key=bad)


async def test_stats_account_for_every_row(make_queue):
    q = make_queue(consumers=["t"])
    await q.add_filter(lambda td: td["r"] > 0, fields=["r"], name="pos")
    await q.put({"r": torch.tensor([1.0, -1.0, 1.0, 1.0])}, partition="p", version=0)
    await q.seal("p")
    async for mb in q.stream("t", ["r"], 2, partition="p"):
        pass
    st = await q.stats()
    assert st.put == 4 and st.filtered == 1 and st.consumed == 3 and st.rows == 0
    assert st.tasks["t"].delivered == 3 and st.tasks["t"].acked == 3
    assert st.wait_p50 is not None and st.wait_p99 >= st.wait_p50
    assert st.bytes_freed == st.bytes_put
    assert "leaked=0" in st.summary()


async def test_lifecycle_bad_input(make_queue):
    with pytest.raises(InvalidArgument):
        make_queue(max_staleness=-1)
    q = make_queue()
    with pytest.raises(InvalidArgument):
        await q.get("t", ["x"], 2, max_staleness=-2)
    with pytest.raises(InvalidArgument):
        await q.add_filter("not callable", fields=["x"])
    with pytest.raises(InvalidArgument):
        await q.add_filter(lambda td: True, fields=[])
    await q.add_filter(lambda td: True, fields=["x"], name="dup")
    with pytest.raises(InvalidArgument):
        await q.add_filter(lambda td: True, fields=["x"], name="dup")
    with pytest.raises(InvalidArgument):
        await q.get("t", ["x"], 2, dp_size=2, dp_rank=5)


async def test_finished_partitions_are_forgotten(make_queue):
    q = make_queue(consumers=["t"])
    for k in range(20):
        await q.put({"x": torch.ones(2)}, partition=f"step-{k}")
        await q.seal(f"step-{k}")
        async for mb in q.stream("t", ["x"], 2, partition=f"step-{k}"):
            assert mb.partition == f"step-{k}"
    st = await q.stats()
    assert st.partitions == {} and st.rows == 0
    # a finished partition stays finished: streams end, puts are refused
    assert [mb async for mb in q.stream("t", ["x"], 2, partition="step-3")] == []
    with pytest.raises(InvalidArgument):
        await q.put({"x": torch.ones(1)}, partition="step-3")
    mb = await q.put({"x": torch.ones(1)}, partition="live")
    got = await q.get("t", ["x"], 1, timeout=5)  # partition=None: the batch still names it
    assert got.partition == "live"


async def test_wait_version_paces_workers(make_queue):
    q = make_queue()
    assert await q.wait_version(0, timeout=1) == 0
    with pytest.raises(StreamTimeout):
        await q.wait_version(2, timeout=0.1)
    async with anyio.create_task_group() as tg:
        got = []

        async def worker():
            got.append(await q.wait_version(2, timeout=10))

        tg.start_soon(worker)
        await anyio.sleep(0.05)
        await q.set_version(1)
        await anyio.sleep(0.05)
        assert got == []
        await q.set_version(3)
    assert got == [3]


def _seen_filter(log):
    """A grouped filter that records what it judged (the group keys and rewards of each
    call) and drops the groups whose rewards are all equal."""
    def judge(td):
        log.append((td["uid"].tolist(), td["reward"].tolist()))
        return [td["reward"].max().item() > td["reward"].min().item()] * len(td)

    return judge


async def test_the_groups_of_one_put_are_judged_each_on_its_own_rows(make_queue):
    """A put that completes many groups at once: their filter jobs are read together
    (one storage read per unit and set of fields, see
    ControllerService._read_for_filters); each job must still see exactly its own
    group's values, here with the groups' rows interleaved, and a second grouped filter
    over another field judges the same groups alongside."""
    q = make_queue(consumers=["train"])
    judged: list = []
    await q.add_filter(_seen_filter(judged), fields=["uid", "reward"], group_by="uid",
                       group_size=4, name="signal")
    await q.add_filter(lambda td: [td["score"].sum().item() >= 0] * len(td),
                       fields=["score"], group_by="uid", group_size=4, name="nonneg")
    G, S = 6, 4
    uid = torch.arange(G).repeat(S)  # 0, 1, ..., 5, 0, 1, ...: every group interleaved
    reward = torch.arange(G * S, dtype=torch.float32)
    for g in (1, 4):  # no signal
        reward[uid == g] = 7.0
    score = torch.ones(G * S)
    score[uid == 5] = -1.0  # group 5 goes by the other filter
    await q.put({"uid": uid, "reward": reward, "score": score}, partition="p")
    await q.seal("p")
    trained: dict[int, list[float]] = {}
    async for mb in q.stream("train", ["uid", "reward", "score"], 8, partition="p",
                             group_by="uid", group_size=S, timeout=30):
        td = await mb.materialize()
        for u, r in zip(td["uid"].tolist(), td["reward"].tolist()):
            trained.setdefault(u, []).append(r)
    want = {g: sorted(reward[uid == g].tolist()) for g in range(G)}
    for uids, rewards in judged:  # (the Ray controller's calls are not seen here)
        assert len(set(uids)) == 1 and sorted(rewards) == want[uids[0]]
    assert {g: sorted(r) for g, r in trained.items()} == {g: want[g] for g in (0, 2, 3)}
    st = await q.stats()
    assert st.filtered_by == {"signal": 2 * S, "nonneg": S}
    assert st.filtered == 3 * S and st.rows == 0 and st.bytes == 0


@pytest.mark.parametrize("fail", [0, 1])
async def test_a_put_that_completes_many_groups_reads_them_once_per_unit(fail):
    """Embedded, seen from the storage side: the filter jobs of the groups one put
    completes are read in one call, one read per unit (not one per group). Rows found
    dropped in that read (``fail``): each job reads its own rows, as a lone job does, and
    the verdicts are the same."""
    async with streamrl.StreamQueue(capacity=256, num_shards=2, consumers=["t"]) as q:
        judged: list = []
        await q.add_filter(_seen_filter(judged), fields=["uid", "reward"], group_by="uid",
                           group_size=4, name="signal")
        reads = CountingReads(q, fail)
        G, S = 8, 4
        uid = torch.arange(G).repeat_interleave(S)
        reward = torch.rand(G * S)
        reward[uid == 3] = 0.5
        await q.put({"uid": uid, "reward": reward}, partition="p")
        units = reads.calls[0]
        assert 1 <= units <= 2  # (the rows' units)
        assert reads.calls == [units] + [1] * G * fail
        assert sorted(u[0] for u, _ in judged) == list(range(G))
        for uids, rewards in judged:
            assert set(uids) == {uids[0]} and rewards == reward[uid == uids[0]].tolist()
        st = await q.stats()
        assert (st.rows, st.filtered) == ((G - 1) * S, S)


async def test_a_seal_cancelled_while_it_reads_for_its_filters_leaves_them_to_run():
    """Embedded, storage reads taking a few turns of the event loop: sealing a partition
    lets a grouped filter without ``group_size`` judge its groups (in the seal's call).
    Cancelled after k turns for every k -- also while those jobs are read together --
    the seal may have happened, and then the jobs it queued run in the next call: every
    group is judged, none is stranded unjudged."""
    async with streamrl.StreamQueue(capacity=1024, num_shards=2, consumers=["t"]) as q:
        await q.add_filter(filters.zero_variance("reward", group_by="uid"))
        CountingReads(q, turns=3)
        G, S = 4, 4
        for k in range(12):
            part = f"p{k}"
            uid = torch.arange(G).repeat(S)  # interleaved groups
            reward = torch.tensor([0., 1., 2., 3.]).repeat_interleave(G)
            reward[uid == 0] = 1.0  # group 0 carries no signal
            await q.put({"uid": uid, "reward": reward}, partition=part)
            if not await cancel_after_turns(q.seal(part), k):
                await q.seal(part)  # (it may not have begun; once sealed, it does nothing)
            n = 0
            async for mb in q.stream("t", ["uid", "reward"], 4, partition=part,
                                     group_by="uid", timeout=10):
                assert len(set((await mb.materialize())["uid"].tolist())) == 1
                n += len(mb)
                await mb.ack()
            assert n == (G - 1) * S, k
        st = await q.stats()
        assert (st.rows, st.bytes, st.filtered) == (0, 0, 12 * S)


def test_zero_variance_gives_the_torch_verdict_on_every_reward_it_judges_in_python():
    """zero_variance judges a small group's scalar rewards in Python (float32, float16,
    bfloat16, atol 0): the verdict must be the one of its torch expression, whatever
    the values (ties, neighbouring floats, infinities, NaNs) and shapes."""
    from tensordict import TensorDict

    def by_torch(r, atol=0.0):
        r = r.reshape(r.shape[0], -1).float()
        return bool((r.max(0).values - r.min(0).values).abs().max() > atol) if len(r) else False

    f = filters.zero_variance("reward")
    rng = random.Random(7)
    inf, nan = float("inf"), float("nan")
    pool = [0.0, -0.0, 1.0, 1.0 + 2 ** -23, 1.0 - 2 ** -24, 1e-45, -1e-45, 3e38, -3e38, inf,
            -inf, nan, 0.5, 7.0]
    cases = [[v] for v in pool] + [[v, w] for v in pool for w in pool]
    cases += [[rng.choice(pool) for _ in range(rng.randint(1, 9))] for _ in range(400)]
    checked = 0
    for vals in cases:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64):
            if dtype is torch.int64 and any(v != v or abs(v) in (inf,) for v in vals):
                continue
            for shape in ((len(vals),), (len(vals), 1)):
                r = torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(shape)
                td = TensorDict({"reward": r}, batch_size=[len(vals)])
                assert f(td) is by_torch(r), (vals, dtype, shape)
                checked += 1
    assert checked > 4000


async def _reject_groups_of_4(q, field: str) -> list:
    """Add a filter "reject" that rejects every group of 4 rows (by ``uid``, reading
    ``uid`` and ``reward``); returns the list of the ``field`` values of each group it
    judged."""
    judged: list = []

    def reject_all(td):
        judged.append(td[field].tolist())
        return False

    await q.add_filter(reject_all, fields=["uid", "reward"], group_by="uid", group_size=4,
                       name="reject")
    return judged


async def test_a_group_whose_member_is_dropped_while_it_is_read_is_still_judged():
    """A row of a group is dropped while the group's filter job reads it (the storage
    read raises RowsDropped): the rest of the group is judged all the same -- by the
    filter, on the rows left -- never let through unjudged. Embedded, the race made
    with a storage read that drops the row first."""
    async with streamrl.StreamQueue(capacity=64, num_shards=1, consumers=["t"]) as q:
        judged = await _reject_groups_of_4(q, "uid")
        drop_as_read(q.session.transport.control)
        await q.put({"uid": torch.full((4,), 7), "reward": torch.arange(4.0)}, partition="p")
        await q.seal("p")
        with pytest.raises(streamrl.errors.EndOfStream):  # (nothing let through)
            await q.get("t", ["uid", "reward"], 1, partition="p", timeout=5)
        assert judged == [[7, 7, 7]]  # the three rows left, judged (and rejected)
        st = await q.stats()
        assert (st.rows, st.filtered_by) == (0, {"reject": 3})


def _losing_read(svc, shard: int, *, at_call: int = 0):
    """Make the controller's storage reads lose unit ``shard`` at its ``at_call``-th read
    that touches it: as the Ray data plane does, the controller learns the unit is gone
    (``mark_lost``) and the read raises RowsLost naming the rows asked of it. Returns the
    list of reads made (each a list of (shard, rows))."""
    inner = svc.data.get
    reads: list = []

    async def get(parts):
        reads.append([(s, list(r)) for s, r, _ in parts])
        mine = [r for s, rows, _ in parts if s == shard for r in rows]
        if mine and sum(1 for rd in reads if any(s == shard for s, _ in rd)) == at_call + 1:
            svc.ctl.mark_lost(shard)
            raise RowsLost(f"(a test: unit {shard} died during the read)", mine, shard)
        return await inner(parts)

    svc.data.get = get
    return reads


async def test_a_group_whose_unit_dies_while_it_is_read_is_judged_on_the_rows_left():
    """A storage unit dies while a group's filter job reads it (RowsLost): its rows count
    as lost, and the group's rows on the living units are judged by the filter all the
    same, not dropped as if the filter had failed."""
    async with streamrl.StreamQueue(capacity=64, num_shards=2, consumers=["t"]) as q:
        judged = await _reject_groups_of_4(q, "reward")
        await q.put({"uid": torch.full((2,), 7), "reward": torch.tensor([0.0, 1.0])},
                    partition="p")
        await q.put({"uid": torch.full((2,), 7), "reward": torch.tensor([2.0, 3.0])},
                    partition="p")
        await q.seal("p")
        with pytest.raises(streamrl.errors.EndOfStream):
            await q.get("t", ["uid", "reward"], 1, partition="p", timeout=5)
        assert judged == [[0.0, 1.0, 2.0, 3.0]]  # (all units up: the whole group)
        # again, the second put's unit dying as the job reads it
    async with streamrl.StreamQueue(capacity=64, num_shards=2, consumers=["t"]) as q:
        judged = await _reject_groups_of_4(q, "reward")
        svc = q.session.transport.control
        a = await q.put({"uid": torch.full((2,), 7), "reward": torch.tensor([0.0, 1.0])},
                        partition="p")
        lost_shard = 1 - a.shards[0]
        _losing_read(svc, lost_shard)
        # the put completing the group is not told of a unit that died under the filter
        await q.put({"uid": torch.full((2,), 7), "reward": torch.tensor([2.0, 3.0])},
                    partition="p")
        await q.seal("p")
        with pytest.raises(streamrl.errors.EndOfStream):  # (nothing let through)
            await q.get("t", ["uid", "reward"], 1, partition="p", timeout=5)
        assert judged == [[0.0, 1.0]]  # the rows left, judged (and rejected)
        st = await q.stats()
        assert st.rows == 0 and st.filter_errors == 0
        assert st.dropped_by.get("lost") == 2 and st.filtered_by == {"reject": 2}


async def test_a_unit_dying_during_a_shared_filter_read_does_not_fail_the_put():
    """The filter jobs of one round are read together: a unit dying during that read
    (RowsLost) does not reach the put that completed the groups (its rows are stored
    and committed; a retry would duplicate them), and every group is still judged on
    the rows it has left."""
    async with streamrl.StreamQueue(capacity=64, num_shards=2, consumers=["t"]) as q:
        judged: list = []

        def keep_all(td):
            judged.append(sorted(td["uid"].tolist()))
            return True

        await q.add_filter(keep_all, fields=["uid"], group_by="uid", group_size=2,
                           name="keep")
        svc = q.session.transport.control
        # the first member of each of 3 groups on one unit, the second on the other
        first = await q.put({"uid": torch.tensor([1, 2, 3])}, partition="p")
        unit0 = first.shards[0]
        reads = _losing_read(svc, 1 - unit0)
        second = await q.put({"uid": torch.tensor([1, 2, 3])}, partition="p")
        assert second.rows[0] not in svc.ctl.rows  # (lost)
        assert len(reads[0]) == 2, "the jobs were read together, from both units"
        await q.seal("p")
        got = []
        async for mb in q.stream("t", ["uid"], 1, partition="p", timeout=5):
            got += (await mb.materialize())["uid"].tolist()
        assert sorted(got) == [1, 2, 3] and sorted(judged) == [[1], [2], [3]]
        st = await q.stats()
        assert st.filter_errors == 0 and st.dropped_by.get("lost") == 3


async def test_a_write_taken_back_while_its_filter_job_reads_it_loses_no_row():
    """A write of a filter's field is taken back (its writer was cancelled) while the
    filter job it made reads it: the read finds the field gone (RowsDropped naming the
    rows). The rows themselves are alive: they stay, unjudged, and are judged once the
    field is written again. (Until stop 43 the controller dropped them, as rows storage
    no longer had: samples lost, seen under load in the rdt chaos run.)"""
    async with streamrl.StreamQueue(capacity=64, num_shards=1, consumers=["t"]) as q:
        judged: list = []

        def keep_all(td):
            judged.append(td["reward"].tolist())
            return True

        await q.add_filter(keep_all, fields=["uid", "reward"], group_by="uid", group_size=2,
                           name="keep")
        svc = q.session.transport.control
        rows = await q.put({"uid": torch.full((2,), 7)}, partition="p")
        tokens: list = []
        commit = svc.ctl.commit

        def recording_commit(tok, *a, **kw):
            tokens.append(tok)
            return commit(tok, *a, **kw)

        svc.ctl.commit = recording_commit
        inner = svc.data.get
        raced: list = []

        async def racing_get(parts):
            if not raced:  # (the writer's retract lands as the job reads the field)
                raced.append(svc.ctl.retract(tokens[-1]))
                raise RowsDropped("(a test: the field was taken back as it was read)",
                                  [r for _, rs, _ in parts for r in rs])
            return await inner(parts)

        svc.data.get = racing_get
        await q.put({"reward": torch.tensor([1.0, 2.0])}, rows=rows)
        assert raced and judged == []
        st = await q.stats()
        assert (st.rows, st.dropped_by, st.filter_errors) == (2, {}, 0)
        await q.put({"reward": torch.tensor([3.0, 4.0])}, rows=rows)  # written again
        mb = await q.get("t", ["uid", "reward"], 2, partition="p", timeout=5)
        assert (await mb.materialize())["reward"].tolist() == [3.0, 4.0]
        assert judged == [[3.0, 4.0]]


@pytest.mark.parametrize("mode", ["together", "declines", "raises", "miscounts"])
async def test_groups_ready_at_once_are_judged_together_each_as_alone(make_queue, mode):
    """Filter work for several groups ready at once (one put completing six groups) is
    given to the filter's ``judge_many`` in one call (here its ``__call__`` would fail:
    no group is judged alone), and each group gets that verdict. A filter whose
    ``judge_many`` declines (``None``), raises
    or gives the wrong number of verdicts has its groups judged one by one, so a group
    its ``__call__`` fails on is the only one dropped as a filter error."""

    class Picky(filters.Filter):
        """Keeps a group whose rewards differ; fails on a group holding reward 13."""

        fields = ("reward",)
        group_by = "uid"
        group_size = 4
        name = "picky"

        def __init__(self, mode):
            self.mode = mode

        def __call__(self, td):
            r = td["reward"].tolist()
            if 13.0 in r:
                raise ValueError("13 is no reward")
            if self.mode == "together":  # (so the test sees that no group was alone)
                raise ValueError("judged alone")
            return max(r) > min(r)

        def judge_many(self, td, sizes):
            if self.mode == "declines":
                return None
            if self.mode == "raises":
                raise RuntimeError("not today")
            r, out, a = td["reward"].tolist(), [], 0
            for n in sizes:
                out.append(max(r[a:a + n]) > min(r[a:a + n]))
                a += n
            return out[:-1] if self.mode == "miscounts" else out

    q = make_queue(capacity=64, consumers=["t"])
    picky = Picky(mode)
    await q.add_filter(picky)
    G, S = 6, 4
    reward = torch.arange(G * S, dtype=torch.float32)
    reward[1 * S:2 * S] = 5.0  # group 1: no signal
    failing = mode != "together"  # (judge_many never fails a group where it judges)
    if failing:
        reward[3 * S] = 13.0  # group 3: __call__ raises on it
    put = q.put({"uid": torch.arange(G).repeat_interleave(S), "reward": reward}, partition="p")
    if failing:
        with pytest.raises(FilterError, match="13 is no reward"):
            await put
    else:
        await put
    await q.seal("p")
    kept = set()
    async for mb in q.stream("t", ["uid", "reward"], S, partition="p", group_by="uid",
                             group_size=S, timeout=30):
        td = await mb.materialize()
        kept |= set(td["uid"].tolist())
    assert kept == {0, 2, 4, 5} | (set() if failing else {3})
    st = await q.stats()
    assert st.filtered_by == {"picky": S}
    assert st.filter_errors == (S if failing else 0)
    assert st.rows == 0 and await q.audit() == []


def test_zero_variance_judges_many_groups_as_it_judges_each():
    """``zero_variance.judge_many`` gives each group the verdict ``__call__`` gives it
    (ties, NaNs, one-row groups), and declines what ``__call__`` judges with torch (a
    tolerance, float64 rewards, several values a row)."""
    from hypothesis import given, settings, strategies as st
    from tensordict import TensorDict

    zv = filters.zero_variance("r", group_by="uid")
    value = st.sampled_from([0.0, 1.0, -1.0, 0.5, float("nan"), float("inf"), 1e-8])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.lists(value, min_size=1, max_size=9), min_size=1, max_size=8),
           st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
           st.booleans())
    def check(groups, dtype, column):
        flat = torch.tensor([v for g in groups for v in g], dtype=dtype)
        if column:
            flat = flat.reshape(-1, 1)
        td = TensorDict({"r": flat}, batch_size=[len(flat)])
        sizes = [len(g) for g in groups]
        want, a = [], 0
        for n in sizes:
            want.append(zv(td[a:a + n]))
            a += n
        assert zv.judge_many(td, sizes) == want

    check()
    td = TensorDict({"r": torch.tensor([0.0, 1.0])}, batch_size=[2])
    assert filters.zero_variance("r", atol=0.1).judge_many(td, [2]) is None
    assert zv.judge_many(td.apply(lambda t: t.double()), [2]) is None
    assert zv.judge_many(TensorDict({"r": torch.zeros(2, 2)}, batch_size=[2]), [2]) is None
    assert zv.judge_many(td, [1]) is None  # (sizes that do not add up to the rows)
