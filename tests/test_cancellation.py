"""Cancellation is an input: a put, write, get or materialize cancelled at any await leaves
the queue consistent (controller and storage units agree, no lease stranded), and a retry
never races the undo of the cancelled attempt. Run on every transport.

The rule these tests check (docs/reliability.md): **a put or write that raises (cancelled
included) leaves nothing behind**: new rows it admitted are gone, fields it was adding to
existing rows are not written. An ``overwrite=True`` write is the exception: it is
idempotent, so a cancelled one may leave each row with its old or its new value.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

import streamrl
from grpo_cancel import CountingReads, cancelled_grpo_puts
from streamrl import filters
from streamrl.errors import DuplicateField, LeaseExpired, RowsDropped

pytestmark = pytest.mark.timeout(120)


async def _settled(q, deadline=10.0):
    """Wait until the controller and the storage units agree (undo work of a cancelled
    call may still be on its way), and return the disagreements left (empty: agreed)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while True:
        problems = await q.audit()
        if not problems or loop.time() > end:
            return problems
        await asyncio.sleep(0.05)


def _slow_filter(tmp_path):
    """A filter that marks a file when it starts (it may run in another process: the
    Ray controller actor) and then takes a second; and a wait for that mark."""
    mark = tmp_path / "filter-started"

    async def slow_keep(td):
        mark.touch()
        await asyncio.sleep(1.0)
        return True

    async def started(deadline=30.0):
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        while not mark.exists():
            assert loop.time() < end, "the filter never ran"
            await asyncio.sleep(0.01)

    return slow_keep, started


async def _cancel_after(coro, delay):
    """Run ``coro``, cancelling it after ``delay`` seconds (0: after one loop turn).
    Returns (completed, result)."""
    task = asyncio.ensure_future(coro)
    if delay:
        await asyncio.sleep(delay)
    else:
        await asyncio.sleep(0)
    task.cancel()
    try:
        return True, await task
    except asyncio.CancelledError:
        return False, None


@pytest.mark.parametrize("width", [4096, 8], ids=["arena", "small"])
async def test_a_cancelled_write_of_a_new_field_then_retried_lands_whole(make_queue, transport,
                                                                          width):
    """A write of a new field to existing rows, cancelled at a random point and retried,
    leaves every row with the retried value, readable (the undo of the cancelled attempt
    never deletes the retry's data). On Ray the wide one goes through the arena (room
    asked of the controller, stored, committed), the small one to the unit that holds
    the rows, which stores it and has the controller admit it."""
    q = make_queue(capacity=4096, num_shards=2)
    rng = random.Random(7)
    rounds = 60 if transport == "embedded" else 120
    for i in range(rounds):
        rows = await q.put({"x": torch.full((4, 64), float(i))}, partition="p")
        val = torch.full((4, width), float(i))
        delay = rng.choice([0, 0, 0.0002, 0.0005, 0.001, 0.002, 0.004])
        done, _ = await _cancel_after(q.put({"f": val}, rows=rows), delay)
        # whatever happened, a retry succeeds: the cancelled write left nothing behind
        if done:
            continue
        await q.put({"f": val}, rows=rows)
        td = await rows.select("f").materialize()
        assert torch.equal(td["f"], val), f"round {i}: wrong data after retry"
    await q.seal("p")
    n = 0
    async for mb in q.stream("t", ["x", "f"], 16, partition="p", timeout=30):
        td = await mb.materialize()
        assert torch.equal(td["f"][:, 0], td["x"][:, 0])
        n += len(mb)
    assert n == 4 * rounds
    assert await _settled(q) == []


async def test_a_cancelled_put_of_new_rows_leaves_nothing(make_queue, transport):
    """New rows of a put cancelled at any point are either all delivered (the put
    completed) or all absent; retrying until success gives each sample exactly once."""
    q = make_queue(capacity=4096, num_shards=3)
    rng = random.Random(11)
    rounds = 60 if transport == "embedded" else 120
    want = []
    for i in range(rounds):
        # small (unit-admitted on Ray) and big (arena path) puts; one-row ones (staged
        # embedded, read in one pass on Ray) and two-row ones
        width = rng.choice([8, 8192])
        n = rng.choice([1, 2])
        data = {"idx": torch.full((n,), i), "x": torch.zeros(n, width)}
        done, _ = await _cancel_after(q.put(data, partition="p"),
                                      rng.choice([0, 0.0002, 0.0005, 0.001, 0.003]))
        if not done:
            await q.put(data, partition="p")
        want += [i] * n
    await q.seal("p")
    seen = []
    async for mb in q.stream("t", ["idx"], 8, partition="p", timeout=30):
        seen.extend((await mb.materialize())["idx"].tolist())
    assert sorted(seen) == want
    st = await q.stats()
    assert st.rows == len(want)  # nothing extra held
    assert st.put == st.rows + st.dropped  # every row put is held or dropped with a reason
    assert await _settled(q) == []


async def test_a_put_cancelled_while_its_async_filter_runs_leaves_nothing(make_queue, tmp_path):
    """The filter a put's commit triggers runs in the put; cancelling the put there
    takes the rows back, so a retry does not duplicate them."""
    q = make_queue(capacity=256)
    slow_keep, started = _slow_filter(tmp_path)

    await q.add_filter(slow_keep, fields=["x"], name="slow")
    task = asyncio.ensure_future(q.put({"idx": torch.arange(4), "x": torch.zeros(4, 2)},
                                       partition="p"))
    await started()  # the put's filter runs now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await q.put({"idx": torch.arange(4), "x": torch.zeros(4, 2)}, partition="p")
    await q.seal("p")
    seen = []
    async for mb in q.stream("t", ["idx", "x"], 8, partition="p", timeout=30):
        seen.extend((await mb.materialize())["idx"].tolist())
    assert sorted(seen) == [0, 1, 2, 3]
    st = await q.stats()
    assert st.dropped_by.get("cancelled", 0) == 4
    assert await _settled(q) == []


@pytest.mark.parametrize("n", [4, 1])  # (1: embedded, the one-row write's short way)
async def test_a_write_cancelled_while_its_filter_runs_can_be_retried(make_queue, tmp_path, n):
    q = make_queue(capacity=256)
    slow_keep, started = _slow_filter(tmp_path)

    rows = await q.put({"idx": torch.arange(n)}, partition="p")
    await q.add_filter(slow_keep, fields=["reward"], name="slow")
    task = asyncio.ensure_future(q.put({"reward": torch.ones(n)}, rows=rows))
    await started()  # the put's filter runs now
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await q.put({"reward": torch.ones(n) * 2}, rows=rows)  # no DuplicateField
    mb = await q.get("t", ["idx", "reward"], n, partition="p", timeout=30)
    assert (await mb.materialize())["reward"].tolist() == [2.0] * n
    await mb.ack()
    assert await _settled(q) == []


async def test_a_cancelled_overwrite_leaves_old_or_new_values(make_queue):
    """overwrite=True writes are idempotent: a cancelled one leaves each row with either
    value, and the field stays readable."""
    q = make_queue(capacity=256)
    rows = await q.put({"idx": torch.arange(4), "f": torch.zeros(4, 4096)}, partition="p")
    for delay in [0, 0.0002, 0.0005, 0.001, 0.002]:
        await _cancel_after(q.put({"f": torch.ones(4, 4096)}, rows=rows, overwrite=True), delay)
        td = await rows.select("f").materialize()  # the cache may hold either; read anew
        mb = await q.get(f"t{delay}", ["f"], 4, partition="p", timeout=10)
        got = (await mb.materialize())["f"]
        for r in got:
            assert torch.equal(r, torch.zeros(4096)) or torch.equal(r, torch.ones(4096))
        await mb.ack()
        assert td["f"].shape == (4, 4096)
    assert await _settled(q) == []


async def test_duplicate_field_still_refused_after_a_completed_write(make_queue):
    q = make_queue(capacity=64)
    rows = await q.put({"idx": torch.arange(2)}, partition="p")
    await q.put({"f": torch.ones(2)}, rows=rows)
    with pytest.raises(DuplicateField):
        await q.put({"f": torch.ones(2)}, rows=rows)
    assert await _settled(q) == []


async def test_cancelled_filtered_put_with_ready_made_filter(make_queue):
    """A put whose commit completes a GRPO group (judged by zero_variance), cancelled,
    then retried: each group is judged once, nothing is left over."""
    q = make_queue(capacity=256)
    await q.add_filter(filters.zero_variance("reward", group_by="uid", group_size=4))
    for g in range(10):
        data = {"uid": torch.full((4,), g), "reward": torch.tensor([0., 1., 0., 1.])}
        done, _ = await _cancel_after(q.put(data, partition="p"), 0)
        if not done:
            await q.put(data, partition="p")
    await q.seal("p")
    n = 0
    async for mb in q.stream("t", ["uid", "reward"], 8, partition="p", group_by="uid",
                             group_size=4, timeout=30):
        n += len(mb)
    assert n == 40
    assert await _settled(q) == []


async def test_a_put_completing_many_groups_cancelled_at_any_await(make_queue, transport):
    """A put that completes several GRPO groups at once (their filter jobs read together,
    one storage read per unit), cancelled after k turns of the event loop for every k:
    retried when it did not complete, each group is judged once, the signal-free ones go,
    and controller and storage agree."""
    q = make_queue(capacity=1024)
    await q.add_filter(filters.zero_variance("reward", group_by="uid", group_size=4))
    G, S = 6, 4
    steps = 14 if transport == "embedded" else 8
    n = await cancelled_grpo_puts(q, steps, G, S, 0 if transport == "embedded" else 0.0005)
    assert n == steps * (G - 1) * S
    st = await q.stats()
    # (a cancelled put whose groups were judged before the cancellation landed counts
    # its signal-free group as filtered, and its other rows as cancelled)
    assert st.filtered_by.get("zero_variance", 0) >= steps * S
    assert st.put == st.rows + st.filtered + st.dropped_by.get("cancelled", 0)
    assert await _settled(q) == []


async def test_a_put_cancelled_while_its_groups_are_read_for_filters_can_be_retried():
    """Embedded, with storage reads that take a few turns of the event loop: a put that
    completes several groups, cancelled after k turns for every k (so also while the
    groups' filter jobs are read together, and while each is judged), then retried when
    it did not complete: every group is judged once in the end, the signal-free ones
    go, controller and storage agree."""
    async with streamrl.StreamQueue(capacity=1024, num_shards=2, consumers=["t"]) as q:
        await q.add_filter(filters.zero_variance("reward", group_by="uid", group_size=4))
        reads = CountingReads(q, turns=3)
        G, S, steps = 4, 4, 16
        assert await cancelled_grpo_puts(q, steps, G, S) == steps * (G - 1) * S
        assert len(reads.calls) < steps * G / 2  # (jobs were read together)
        st = await q.stats()
        assert st.filtered_by["zero_variance"] >= steps * S
        assert st.put == st.consumed + st.filtered + st.dropped_by.get("cancelled", 0)
        assert (st.rows, st.bytes) == (0, 0)
        assert await q.audit() == []


async def test_a_batch_loses_rows_whose_write_was_taken_back(make_queue):
    """A consumer that took rows for a field whose write was then taken back (its writer
    was cancelled after the commit) finds those rows gone from its batch (RowsDropped on
    materialize, as for a drop), and gets them again once the field is written again."""
    from streamrl.queue import _split_by_shard

    q = make_queue(capacity=64)
    rows = await q.put({"idx": torch.arange(4)}, partition="p")
    ctl = q._control
    tok = await ctl.begin_write(rows.rows, ("r",))
    await q._data.put(_split_by_shard(tok.rows, tok.shards, {"r": torch.ones(4)}), tok.id)
    await ctl.commit(tok, {"r": [4] * 4})
    mb = await q.get("t", ["idx", "r"], 4, partition="p", timeout=10)
    await ctl.retract(tok)  # what a cancelled writer's commit gets
    with pytest.raises(RowsDropped) as e:
        await mb.materialize()
    assert sorted(e.value.rows) == sorted(rows.rows)
    with pytest.raises(LeaseExpired, match="taken back"):  # the ack says so too
        await mb.ack()
    await q.put({"r": torch.full((4,), 2.0)}, rows=rows)  # the retry
    again = await q.get("t", ["idx", "r"], 4, partition="p", timeout=10)
    assert (await again.materialize())["r"].tolist() == [2.0] * 4
    await again.ack()
    assert await _settled(q) == []


async def test_a_put_cancelled_at_any_await_holds_no_room(make_queue, transport):
    """A put cancelled at any await -- here one admitted and dropped as stale at once, so
    its admission has storage deletes to run before it returns -- leaves no write in
    flight: no bytes reserved, no rows held, nothing for a later write timeout to clean
    (a write token stranded by the cancellation held its room until lease_timeout)."""
    q = make_queue(capacity=64, capacity_bytes=1 << 16, max_staleness=0, lease_timeout=300)
    await q.set_version(5)
    data = {"idx": torch.arange(2), "x": torch.zeros(2, 16)}
    steps = 12 if transport == "embedded" else 6
    for k in range(steps):
        task = asyncio.ensure_future(q.put(data, partition="p", version=0))
        for _ in range(k):  # cancel after k turns of the event loop: every await in turn
            await asyncio.sleep(0 if transport == "embedded" else 0.0005)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while True:
            st = await q.stats()
            if (st.bytes_in_flight, st.rows, st.bytes) == (0, 0, 0) or loop.time() > end:
                break
            await asyncio.sleep(0.05)
        assert (st.bytes_in_flight, st.rows, st.bytes) == (0, 0, 0), (k, st)
    assert await _settled(q) == []


@pytest.mark.parametrize("deletes", ["at once", "awaited"])
async def test_an_ack_whose_rows_are_deleted_behind_it_is_whole(make_queue, transport,
                                                                deletes):
    """An ack whose storage deletes must be awaited (every data plane but the embedded
    one's in-process units) answers while they run, so cancelling it then cancels
    nothing: the deletes run to their end, stats() waits for them, and the rows are
    acked (never delivered again) and gone from the units. Embedded, the same ack needs
    no await at all."""
    if transport != "embedded":
        pytest.skip("slows the storage units' delete in this process (the embedded units)")
    q = make_queue(capacity=16, consumers=["t"])
    await q.put({"idx": torch.arange(4)}, partition="p")
    mb = await q.get("t", ["idx"], 4, partition="p", timeout=10)
    started = asyncio.Event()
    if deletes == "awaited":
        q.session.control._delete_sync = lambda d: False  # as a data plane elsewhere
        delete = q._data.delete

        async def slow_delete(parts):
            started.set()
            await asyncio.sleep(0.3)
            await delete(parts)

        q._data.delete = slow_delete
    task = asyncio.ensure_future(mb.ack())
    if deletes == "awaited":
        await asyncio.wait_for(started.wait(), 10)
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.done() and task.exception() is None  # answered while they run
        task.cancel()  # (nothing left to cancel)
        assert q.session.control._behind  # the deletes still run
    else:
        await task  # (done without suspending: nothing to cancel)
    st = await q.stats()
    assert st.rows == 0 and sum(st.unit_rows) == 0 and st.tasks["t"].acked == 4
    await q.seal("p")
    assert [b async for b in q.stream("t", ["idx"], 4, partition="p")] == []
