"""One-row puts and what every later call sees of them (on every transport).

On the embedded transport one-row puts are write-combined (streamrl/combine.py): staged,
then admitted together when the stage fills, when any other call of the queue arrives,
or at the end of the event-loop iteration. None of that may be visible: each test here
states a rule of the contract for one-row puts, and checks on the embedded transport
that the rows it puts were staged when the rule was tested (so the rule held *because*
of the flush, not by luck)."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import torch
from tensordict import TensorDict

import streamrl

from streamrl.errors import InvalidArgument, QueueClosed, QueueFull, SchemaError, StreamTimeout

pytestmark = pytest.mark.timeout(60)


def one(i: int, width: int = 4) -> dict:
    return {"idx": torch.tensor([i]), "x": torch.full((1, width), float(i))}


def staged(q) -> int:
    """Rows staged and not yet admitted (0 on transports that do not combine)."""
    return getattr(q.session.transport.control, "staged", 0)


def combines(q) -> bool:
    return hasattr(q.session.transport.control, "staged")


async def first_use(q) -> None:
    """A first call of the queue (its event loop is known from then on; a one-row put
    as the first call is staged too, see test_the_first_put_of_a_queue_is_staged)."""
    await q.stats()


# ---------------------------------------------------------------- visibility


async def test_every_call_sees_the_one_row_puts_that_returned(make_queue):
    q = make_queue(capacity=64)
    await first_use(q)
    rows = [await q.put(one(i), partition="p") for i in range(5)]
    assert staged(q) == (5 if combines(q) else 0)
    st = await q.stats()  # counts them
    assert (st.rows, st.put) == (5, 5) and st.bytes == 5 * (8 + 16)
    assert staged(q) == 0
    rows.append(await q.put(one(5), partition="p"))
    mb = await q.get("t", ["idx", "x"], 6, partition="p", timeout=10)  # takes them
    td = await mb.materialize()
    assert td["idx"].tolist() == list(range(6))
    assert torch.equal(td["x"][:, 0], td["idx"].float())
    await mb.ack()
    assert await q.audit() == []


async def test_the_batch_a_put_returns_is_usable_at_once(make_queue):
    q = make_queue(capacity=64)
    await first_use(q)
    a = await q.put(one(1), partition="p")
    b = await q.put(one(2), partition="p")
    c = await q.put(one(3), partition="p")
    assert staged(q) == (3 if combines(q) else 0)
    assert (await a.materialize())["idx"].tolist() == [1]  # its cache: no read
    await b.write({"y": torch.tensor([20.0])})  # a write to a staged row
    assert (await b.materialize(["y"]))["y"].tolist() == [20.0]
    await c.drop()  # a drop of a staged row
    assert (await q.stats()).rows == 2
    mb = await q.get("t", ["idx", "y"], 1, partition="p", timeout=10)
    assert (await mb.materialize())["idx"].tolist() == [2]  # the row with y
    await q.seal("p")
    rest = [r async for r in q.stream("t2", ["idx"], 4, partition="p")]
    assert [len(r) for r in rest] == [2]


async def test_seal_clear_and_close_count_the_staged_rows(make_queue):
    q = make_queue(capacity=64, consumers=["t"])
    await first_use(q)
    for i in range(3):
        await q.put(one(i), partition="a")
    await q.seal("a")  # the rows put before the seal are in it
    got = [mb async for mb in q.stream("t", ["idx"], 8, partition="a")]
    assert [len(mb) for mb in got] == [3]
    for i in range(4):
        await q.put(one(i), partition="b")
    assert await q.clear("b") == 4
    await q.put(one(9), partition="c")
    assert staged(q) == (1 if combines(q) else 0)
    assert await q.close() == {"c": 1}
    with pytest.raises(QueueClosed):
        await q.put(one(10), partition="c")


async def test_a_batch_sent_elsewhere_reads_its_row_at_once(make_queue):
    """A put's batch pickled (as it is sent to another task or process: without its
    cache) reads its row from storage, with no other call of the queue first."""
    import pickle

    q = make_queue(capacity=64)
    await first_use(q)
    await q.put(one(0), partition="p")
    b = await q.put(one(1), partition="p")
    assert staged(q) == (2 if combines(q) else 0)
    again = pickle.loads(pickle.dumps(b))
    td = await again.materialize(["idx", "x"])
    assert td["idx"].tolist() == [1] and td["x"].tolist() == [[1.0] * 4]


async def test_a_checkpoint_holds_the_one_row_puts_that_returned(make_queue, tmp_path):
    import streamrl

    q = make_queue(capacity=64)
    await first_use(q)
    for i in range(5):
        await q.put(one(i), partition="p")
    assert staged(q) == (5 if combines(q) else 0)
    info = await q.checkpoint(tmp_path / "ck")
    assert info.rows == 5
    r = await streamrl.StreamQueue.restore(tmp_path / "ck", transport="embedded")
    try:
        await r.seal("p")
        got = [(await b.materialize())["idx"].tolist() async for b in
               r.stream("t", ["idx"], 8, partition="p")]
        assert got == [[0, 1, 2, 3, 4]]
    finally:
        await r.close()
        await r.shutdown()


async def test_a_waiting_consumer_gets_the_rows_without_any_other_call(make_queue):
    """A producer that puts and then only awaits something else still hands its rows
    over: the stage is flushed at the end of the event-loop iteration."""
    q = make_queue(capacity=64)
    await first_use(q)
    consumer = asyncio.ensure_future(q.get("t", ["idx"], 3, partition="p", timeout=30))
    await anyio.sleep(0)  # it waits
    for i in range(3):
        await q.put(one(i), partition="p")
    mb = await consumer  # nothing else touches the queue meanwhile
    assert sorted((await mb.materialize())["idx"].tolist()) == [0, 1, 2]
    await mb.ack()


async def test_rows_keep_the_order_of_their_puts_across_flushes(make_queue):
    """Stage boundaries (fill, another partition, other fields, a multi-row put, a
    big row) do not reorder rows."""
    q = make_queue(capacity=1024)
    await first_use(q)
    want = []
    i = 0
    for step in range(200):
        if step % 50 == 7:  # a multi-row put goes the usual way
            await q.put({"idx": torch.tensor([i, i + 1]), "x": torch.zeros(2, 4)},
                        partition="p")
            want += [i, i + 1]
            i += 2
        elif step % 30 == 11:  # a row over the stage's row size
            await q.put({"idx": torch.tensor([i]), "x": torch.zeros(1, 20_000)},
                        partition="p")
            want.append(i)
            i += 1
        else:
            await q.put(one(i), partition="p")
            want.append(i)
            i += 1
        if step % 40 == 3:
            await q.put(one(-1), partition="other")
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["idx"], 16, partition="p"):
        got += (await mb.materialize())["idx"].tolist()
    assert got == want


async def test_one_row_puts_of_other_shapes_and_objects_read_back_as_put(make_queue):
    q = make_queue(capacity=64)
    await first_use(q)
    for i in range(6):
        await q.put({"idx": torch.tensor([i]), "resp": [torch.arange(i + 1)],
                     "chat": [f"turn {i}"], "x": torch.full((1, 1 + i % 2), float(i))},
                    partition="p")
    mb = await q.get("t", ["idx", "resp", "chat", "x"], 6, partition="p", timeout=10)
    td = await mb.materialize()
    assert td["idx"].tolist() == list(range(6))
    assert td["chat"] == [f"turn {i}" for i in range(6)]
    assert [t.tolist() for t in td["resp"].unbind(0)] == [list(range(i + 1)) for i in range(6)]
    assert [t.tolist() for t in td["x"].unbind(0)] == [[float(i)] * (1 + i % 2)
                                                     for i in range(6)]


async def test_one_row_puts_unlike_the_staged_rows_read_back_as_put(make_queue, transport):
    """A one-row put like the rows staged (partition, version, each field's dtype and
    bytes) joins their block; one that differs in any of them (a wider field, a field
    more, another version or partition) is staged apart or with its own sizes. Every
    row reads back with its own values, version and partition, in the order put."""
    q = make_queue(capacity=256, num_shards=1)
    await first_use(q)
    want: dict[str, list] = {"p": [], "other": []}
    nbytes = 0
    for i in range(60):
        k = i % 6
        d = one(i, width=8 if k == 1 else 4)
        if k == 2:
            d["y"] = torch.ones(1)  # a field more
        part = "other" if k == 4 else "p"
        version = 3 if k == 3 else 0
        before = staged(q)
        await q.put(d, partition=part, version=version)
        if transport == "embedded" and k == 0 and i:  # (like the row of k == 5 before it)
            assert staged(q) == before + 1
        want[part].append((i, version, d["x"][0].tolist()))
        nbytes += sum(v.nbytes for v in d.values())
    assert (await q.stats()).bytes == nbytes  # (each row's own fields and bytes)
    for part, rows in want.items():
        await q.seal(part)
        got = []
        async for mb in q.stream("t", ["idx", "x"], 7, partition=part):
            td = await mb.materialize()
            got += list(zip(td["idx"].tolist(), mb.versions,
                            [x.tolist() for x in td["x"].unbind(0)]))
        assert got == rows


# ---------------------------------------------------------------- capacity


async def test_capacity_counts_staged_rows(make_queue):
    q = make_queue(capacity=4)
    await first_use(q)
    for i in range(4):
        await q.put(one(i), partition="p")
    assert staged(q) == (4 if combines(q) else 0)
    with pytest.raises(QueueFull):
        await q.put_nowait(one(4), partition="p")
    with pytest.raises(StreamTimeout):  # a put waits while the queue is full
        await q.put(one(4), partition="p", timeout=0.2)
    st = await q.stats()
    assert (st.rows, st.put) == (4, 4)
    mb = await q.get("t", ["idx"], 2, partition="p", timeout=10)
    await mb.drop()
    await q.put(one(4), partition="p")  # room again
    await q.put(one(5), partition="p")
    assert (await q.stats()).rows == 4


async def test_capacity_bytes_counts_staged_rows(make_queue):
    q = make_queue(capacity=64, capacity_bytes=3 * 24)  # three rows of 8 + 16 bytes
    await first_use(q)
    for i in range(3):
        await q.put(one(i), partition="p")
    with pytest.raises(QueueFull):
        await q.put_nowait(one(3), partition="p")
    assert (await q.stats()).bytes == 3 * 24


async def test_a_waiting_producer_is_served_before_later_one_row_puts(make_queue):
    q = make_queue(capacity=2)
    await first_use(q)
    await q.put(one(0), partition="p")
    await q.put(one(1), partition="p")
    first = asyncio.ensure_future(q.put(one(2), partition="p"))
    await anyio.sleep(0.05)  # it waits for room
    mb = await q.get("t", ["idx"], 1, partition="p", timeout=10)
    await mb.drop()  # one row of room: the waiting put's
    with pytest.raises(QueueFull):
        await q.put_nowait(one(3), partition="p")
    await first
    await q.seal("p")
    got = [(await b.materialize())["idx"].tolist() async for b in
           q.stream("t", ["idx"], 4, partition="p")]
    assert got == [[1, 2]]


async def test_a_one_row_put_that_fits_waits_behind_a_waiting_producer(make_queue):
    """First come, first served: room for a small row is not taken from a producer
    already waiting for room for a bigger one."""
    q = make_queue(capacity=64, capacity_bytes=100)
    await first_use(q)
    await q.put(one(0), partition="p")  # 24 bytes
    big = asyncio.ensure_future(q.put({"idx": torch.tensor([1]), "x": torch.zeros(1, 20)},
                                      partition="p"))  # 88 bytes: waits
    await anyio.sleep(0.05)
    assert not big.done()
    with pytest.raises(QueueFull, match="waiting"):
        await q.put_nowait(one(2), partition="p")  # would fit, but the big one is first
    mb = await q.get("t", ["idx"], 1, partition="p", timeout=10)
    await mb.drop()
    await big
    assert (await q.stats()).rows == 1


# ---------------------------------------------------------------- errors


async def test_bad_one_row_puts_raise_at_the_put_that_caused_them(make_queue):
    q = make_queue(capacity=64)
    await first_use(q)
    await q.put({"idx": torch.tensor([0]), "x": torch.zeros(1, 4)}, partition="p")
    with pytest.raises(SchemaError, match="one dtype"):  # staged int64 idx, now float
        await q.put({"idx": torch.tensor([1.0]), "x": torch.zeros(1, 4)}, partition="p")
    with pytest.raises(SchemaError, match="same number of rows"):
        await q.put({"idx": torch.tensor([1]), "x": torch.zeros(2, 4)}, partition="p")
    await q.put({"idx": torch.tensor([1]), "x": torch.zeros(1, 4)}, partition="p")
    await q.put(one(7), partition="sealed")
    await q.seal("sealed")
    await q.put(one(2), partition="p")
    with pytest.raises(InvalidArgument, match="sealed"):
        await q.put(one(8), partition="sealed")
    await q.put(one(3), partition="p")
    st = await q.stats()
    assert (st.rows, st.put) == (5, 5)  # every good put, no bad one
    mb = await q.get("t", ["idx"], 4, partition="p", timeout=10)
    assert (await mb.materialize())["idx"].tolist() == [0, 1, 2, 3]
    assert await q.audit() == []


def keyed(i: int, uid) -> dict:
    return {"uid": torch.tensor([uid]), "x": torch.full((1, 4), float(i))}


def grouped(q, fields: list, seen) -> tuple[asyncio.Future, list]:
    """A consumer streaming whole groups of 4 rows by ``uid`` from partition ``p`` (it
    starts waiting at the next await): its task, and what it got, a ``({uid},
    seen(batch))`` per batch."""
    got: list = []

    async def consume():
        async for mb in q.stream("t", fields, 4, partition="p", group_by="uid",
                                 group_size=4, timeout=30):
            td = await mb.materialize()
            got.append((set(td["uid"].tolist()), seen(td)))

    return asyncio.ensure_future(consume()), got


@pytest.mark.parametrize("declared", ["group_key", "stream"])
async def test_one_row_puts_with_a_group_key_are_staged_and_keep_their_groups(make_queue,
                                                                               declared):
    """The agentic GRPO pattern: each sample its own one-row put, its group key a field
    (known as such from ``group_key``, or from a grouped stream already waiting). The
    puts are staged like any others, the keys are read from the block at the flush,
    and the grouped stream gets whole groups of the right rows."""
    q = make_queue(capacity=64, consumers=["t"],
                   **({"group_key": "uid"} if declared == "group_key" else {}))
    await first_use(q)
    task, got = grouped(q, ["uid", "x"], lambda td: sorted(td["x"][:, 0].tolist()))
    await asyncio.sleep(0.05)  # (the stream waits: "uid" is a group key from here on)
    for i in range(12):
        await q.put(keyed(i, i % 3), partition="p")
    assert staged(q) == (12 if combines(q) else 0)
    await q.seal("p")
    await task
    assert sorted(got, key=lambda g: g[1]) == [
        ({u}, [float(i) for i in range(12) if i % 3 == u]) for u in range(3)]
    st = await q.stats()
    assert (st.rows, st.put) == (0, 12) and await q.audit() == []


async def test_one_row_puts_with_a_group_key_take_the_short_way(make_queue, monkeypatch):
    """The GRPO pattern's puts (each a one-row put with its group key, known as one) skip
    the usual way's column checks on every transport (on Ray they went it whenever a
    tag field was known); the keys still reach the controller, and a grouped stream
    gets whole groups."""
    import streamrl.queue as queue_mod

    q = make_queue(capacity=64, consumers=["t"], group_key="uid")
    await first_use(q)
    await q.put(keyed(0, 0), partition="p")

    def usual(*args, **kwargs):
        raise AssertionError("a one-row put went the usual way")

    monkeypatch.setattr(queue_mod, "to_columns", usual)
    for i in range(1, 12):
        await q.put(keyed(i, i % 3), partition="p")
    monkeypatch.undo()
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["uid", "x"], 4, partition="p", group_by="uid",
                             group_size=4, timeout=30):
        td = await mb.materialize()
        got.append((set(td["uid"].tolist()), sorted(td["x"][:, 0].tolist())))
    assert sorted(got, key=lambda g: g[1]) == [
        ({u}, [float(i) for i in range(12) if i % 3 == u]) for u in range(3)]
    assert await q.audit() == []


def rewarded(i: int, uid: int, reward: float) -> dict:
    return {"uid": torch.tensor([uid]), "r": torch.tensor([reward]),
            "x": torch.full((1, 4), float(i))}


async def _settled(q, done) -> object:
    """``q.stats()`` once ``done(stats)`` holds (filters run in the background)."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        st = await q.stats()
        if done(st) or asyncio.get_running_loop().time() > deadline:
            return st
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_one_row_puts_with_a_group_filter_are_staged_and_judged_by_group(make_queue,
                                                                              kind):
    """The GRPO pattern as it runs: each sample its own one-row put, a zero-variance
    filter on its group. The puts are staged (embedded) like puts without a filter; the
    filter judges each group once it is whole: the group whose rewards are all equal is
    dropped, the others reach the grouped stream whole, and nothing is left."""
    from streamrl.filters import zero_variance

    q = make_queue(capacity=64, consumers=["t"])
    zv = zero_variance("r", group_by="uid", group_size=4)
    if kind == "sync":
        await q.add_filter(zv)
    else:
        async def judged(td):
            await asyncio.sleep(0)
            return zv(td)

        await q.add_filter(judged, fields=["r"], group_by="uid", group_size=4,
                           name="zero_variance")
    got: list = []

    async def consume():
        # (asking for the filter's field: a filter holds back the rows it has not
        # judged from requests of the fields it reads)
        async for mb in q.stream("t", ["uid", "x", "r"], 4, partition="p", group_by="uid",
                                 group_size=4, timeout=30):
            td = await mb.materialize()
            got.append((set(td["uid"].tolist()), sorted(td["x"][:, 0].tolist())))

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    for i in range(12):  # group 1's rewards are all equal
        await q.put(rewarded(i, i % 3, 1.0 if i % 3 == 1 else float(i)), partition="p")
    assert staged(q) == (12 if combines(q) else 0)
    await q.seal("p")
    await task
    assert sorted(got, key=lambda g: g[1]) == [
        ({u}, [float(i) for i in range(12) if i % 3 == u]) for u in (0, 2)]
    st = await _settled(q, lambda st: st.rows == 0)
    assert (st.rows, st.bytes, st.put, st.filtered) == (0, 0, 12, 4)
    assert st.filtered_by == {"zero_variance": 4} and await q.audit() == []


async def test_a_filter_that_raises_on_staged_one_row_puts_is_logged(make_queue, caplog):
    """A filter that raises on a group of one-row puts: its rows are dropped and counted
    either way. Embedded, where the puts were staged and have returned, the error is
    logged (as for a run that ``seal`` triggers); where each put is admitted on its own
    (Ray), the put that completed the group raises it."""
    from streamrl.errors import FilterError

    q = make_queue(capacity=64, consumers=["t"])

    def picky(td):
        if (td["uid"] == 1).any():
            raise ValueError("no group 1 here")
        return torch.ones(len(td["uid"]), dtype=torch.bool)

    await q.add_filter(picky, fields=["uid"], group_by="uid", group_size=4, name="picky")
    await first_use(q)
    raised = []
    for i in range(12):
        try:
            await q.put(rewarded(i, i % 3, float(i)), partition="p")
        except FilterError:
            raised.append(i)
    assert raised == ([] if combines(q) else [10])  # (10: the last of group 1)
    # a put of other rows right after (embedded: it admits the staged rows first, then
    # runs the filters waiting, theirs included): the failure is not its to raise
    await q.put({"uid": torch.tensor([7, 7]), "r": torch.zeros(2), "x": torch.zeros(2, 4)},
                partition="other")
    await q.clear("other")
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["uid"], 4, partition="p", group_by="uid", group_size=4,
                             timeout=30):
        got.append(set((await mb.materialize())["uid"].tolist()))
    assert sorted(got, key=min) == [{0}, {2}]
    st = await _settled(q, lambda st: st.filter_errors == 4)
    assert (st.rows, st.bytes, st.filter_errors, st.dropped_by.get("filter_error")) == (
        0, 0, 4, 4)
    assert any("no group 1 here" in m for m in st.last_filter_errors)
    if combines(q):
        assert "no group 1 here" in caplog.text
    assert await q.audit() == []


async def _staged_group_of_a_failing_filter(q, size: int):
    """A group filter "picky" (groups of ``size`` by ``uid``) that always raises, and one
    group's one-row puts, staged (embedded); returns the queue's controller service."""
    def picky(td):
        raise ValueError("never")

    await q.add_filter(picky, fields=["uid"], group_by="uid", group_size=size, name="picky")
    await first_use(q)
    for i in range(size):
        await q.put(rewarded(i, 5, float(i)), partition="p")
    return q.session.transport.control


async def test_a_writer_never_gets_the_filter_failure_of_staged_rows(caplog):
    """Embedded: the filter jobs of staged rows run in the background after their flush;
    a writer whose commit drains them first (before that task ran) must not raise their
    failure as its own: it is logged and counted."""
    import streamrl

    async with streamrl.StreamQueue(capacity=64, consumers=["t"]) as q:
        svc = await _staged_group_of_a_failing_filter(q, 2)
        assert svc.staged == 2
        svc.flush()  # (the group's filter job is queued; its task has not run yet)
        assert svc.ctl.filter_jobs
        await svc._after(raise_filter_errors=True)  # as a later writer's commit does
        st = await q.stats()
        assert (st.rows, st.filter_errors) == (0, 2) and "never" in caplog.text


async def test_a_staged_rows_filter_job_run_again_still_fails_quietly(caplog):
    """Embedded: the filter job of staged rows is read again when one of its rows was
    dropped as it was read; its failure on the rows left is still logged, not raised
    to the writer whose commit ran it (the job stays one of the staged rows' until it
    is done)."""
    import streamrl
    from grpo_cancel import drop_as_read

    async with streamrl.StreamQueue(capacity=64, consumers=["t"]) as q:
        svc = await _staged_group_of_a_failing_filter(q, 3)
        raced = drop_as_read(svc)
        svc.flush()
        await svc._after(raise_filter_errors=True)  # as a later writer's commit does
        st = await q.stats()
        assert raced and (st.rows, st.filter_errors) == (0, 2) and "never" in caplog.text


async def test_a_one_row_put_whose_group_key_is_no_scalar_raises_and_leaves_nothing(make_queue):
    """Staged rows with a key, then a one-row put whose key is not one scalar: it is not
    staged, raises SchemaError and leaves nothing; the staged rows and the puts after it
    are grouped as usual."""
    q = make_queue(capacity=64, consumers=["t"], group_key="uid")
    await first_use(q)
    await q.put(keyed(0, 7), partition="p")
    assert staged(q) == (1 if combines(q) else 0)
    with pytest.raises(SchemaError, match="one scalar per row"):
        await q.put({"uid": torch.tensor([[7, 8]]), "x": torch.zeros(1, 4)}, partition="p")
    await q.put(keyed(1, 7), partition="p")
    await q.seal("p")
    mb = await q.get("t", ["uid", "x"], 2, partition="p", group_by="uid", group_size=2,
                     timeout=10)
    assert (await mb.materialize())["x"][:, 0].tolist() == [0.0, 1.0]
    await mb.ack()
    st = await q.stats()
    assert st.rows == 0 and st.put - st.dropped == 0 and await q.audit() == []


async def test_staleness_drops_whole_groups_of_staged_one_row_puts(make_queue):
    """With ``group_key`` and ``max_staleness``, a group whose members were put one at
    a time (staged) goes stale whole, and a fresh group stays whole."""
    q = make_queue(capacity=64, consumers=["t"], group_key="uid", max_staleness=0)
    await first_use(q)
    for i in range(3):
        await q.put(keyed(i, 1), partition="p", version=0)
    assert staged(q) == (3 if combines(q) else 0)
    await q.set_version(1)  # (group 1 is stale now, staged members too)
    for i in range(3, 6):
        await q.put(keyed(i, 2), partition="p", version=1)
    await q.seal("p")
    mb = await q.get("t", ["uid", "x"], 3, partition="p", group_by="uid", timeout=10)
    assert (await mb.materialize())["x"][:, 0].tolist() == [3.0, 4.0, 5.0]
    await mb.ack()
    st = await q.stats()
    assert (st.rows, st.stale) == (0, 3) and await q.audit() == []


async def test_a_put_cancelled_while_waiting_keeps_the_puts_that_returned(make_queue):
    q = make_queue(capacity=3)
    await first_use(q)
    for i in range(3):
        await q.put(one(i), partition="p")
    waiting = asyncio.ensure_future(q.put(one(3), partition="p"))
    await anyio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    st = await q.stats()
    assert (st.rows, st.put) == (3, 3)
    await q.seal("p")
    got = [(await b.materialize())["idx"].tolist() async for b in
           q.stream("t", ["idx"], 8, partition="p")]
    assert got == [[0, 1, 2]]


# ---------------------------------------------------------------- the stage itself


async def test_the_stage_flushes_when_full_and_at_the_end_of_the_iteration(make_queue, transport):
    if transport != "embedded":
        pytest.skip("write-combining is the embedded transport's")
    q = make_queue(capacity=1024, consumers=["w"])
    await first_use(q)
    svc = q.session.transport.control
    waiting = asyncio.ensure_future(q.get("w", ["nothing"], 1, partition="p", timeout=30))
    await asyncio.sleep(0.01)  # (a consumer waits: a stage is flushed each iteration)
    before = svc.flushes
    for i in range(svc.max_rows):  # without yielding: full, and kept until the next put
        await q.put(one(i), partition="p")
    assert svc.flushes == before and svc.staged == svc.max_rows
    await q.put(one(-1), partition="p")  # flushes the full stage, then is staged
    assert svc.flushes == before + 1 and svc.staged == 1
    await anyio.sleep(0)  # the end of this iteration
    await anyio.sleep(0)
    assert svc.flushes == before + 2 and svc.staged == 0
    # the rows of one flush are one block: batches of them are views of it
    half = svc.max_rows // 2
    a = await q.get("t", ["x"], half, partition="p", timeout=10)
    b = await q.get("t", ["x"], half, partition="p", timeout=10)
    xa, xb = (await a.materialize())["x"], (await b.materialize())["x"]
    assert torch.cat([xa, xb])[:, 0].tolist() == [float(i) for i in range(svc.max_rows)]
    assert xa.untyped_storage().data_ptr() == xb.untyped_storage().data_ptr()
    waiting.cancel()


async def test_with_nobody_waiting_the_stage_lingers_for_more_puts(make_queue, transport):
    """With no consumer waiting, a stage waits ``linger`` seconds for more rows: the
    one-row puts of a producer that awaits between them are still one flush. Any call
    sees them all the same (it flushes first); a stage that holds enough rows for a
    waiting consumer's batch (one row, for a grouped consumer) is flushed at the end of
    that iteration; ``linger=0`` flushes each iteration."""
    if transport != "embedded":
        pytest.skip("write-combining is the embedded transport's")
    q = make_queue(capacity=1024, consumers=["t"])
    await first_use(q)
    svc = q.session.transport.control
    linger, svc.linger = svc.linger, 60.0  # (however slow this machine is today)
    before = svc.flushes
    for i in range(10):
        await q.put(one(i), partition="p")
        await anyio.sleep(0)
    assert svc.staged == 10 and svc.flushes == before
    assert (await q.stats()).rows == 10 and svc.flushes == before + 1  # (flushed first)
    svc.linger = linger
    await q.put(one(10), partition="p")
    await anyio.sleep(4 * linger)  # (after the flush's timer, set for linger)
    assert svc.staged == 0 and svc.flushes == before + 2
    svc.linger = 60.0
    for i in range(11, 13):
        await q.put(one(i), partition="p")
        await anyio.sleep(0)
    assert svc.staged == 2
    mb = await q.get("t", ["idx"], 13, partition="p", timeout=5)  # (flushed first)
    assert (await mb.materialize())["idx"].tolist() == list(range(13))
    await mb.ack()
    # a consumer waits for 3 rows and 1 is there: the stage is flushed at the end of
    # the iteration in which it holds the other 2, not before
    await q.put({"idx": torch.tensor([13, 14]), "x": torch.ones(2, 4)}, partition="p")
    first = await q.get("t", ["idx"], 1, partition="p", timeout=5)
    waiting = asyncio.ensure_future(q.get("t", ["idx"], 3, partition="p", timeout=5))
    await asyncio.sleep(0.01)
    before = svc.flushes
    await q.put(one(15), partition="p")
    await anyio.sleep(0)
    await anyio.sleep(0)
    assert svc.staged == 1 and svc.flushes == before  # (not enough for the consumer)
    await q.put(one(16), partition="p")
    await anyio.sleep(0)
    await anyio.sleep(0)
    assert svc.staged == 0 and svc.flushes == before + 1  # (enough: at once)
    mb = await waiting
    assert (await mb.materialize())["idx"].tolist() == [14, 15, 16]
    await mb.ack()
    await first.ack()
    # one row may complete a group: a grouped consumer waiting has each stage flushed
    waiting = asyncio.ensure_future(q.get("t", ["x", "uid"], 2, partition="p",
                                          group_by="uid", group_size=2, timeout=5))
    await asyncio.sleep(0.01)
    for i in (17, 18):
        await q.put(keyed(i, 0), partition="p")
        await anyio.sleep(0)
        await anyio.sleep(0)
        assert svc.staged == 0 and svc.flushes == before + i - 15
    mb = await waiting
    assert (await mb.materialize())["x"][:, 0].tolist() == [17.0, 18.0]
    await mb.ack()
    svc.linger = 0  # (no lingering: each stage flushed at the end of its iteration)
    await q.put(one(19), partition="p")
    await anyio.sleep(0)
    await anyio.sleep(0)
    assert svc.staged == 0 and svc.flushes == before + 4
    assert await q.audit() == []



async def test_the_embedded_transport_options_set_how_puts_are_combined():
    """``put_linger`` is how long a stage waits for more puts with nobody waiting for its
    rows (``0``: flushed at the end of the iteration that staged them), ``combine_puts=
    False`` admits each put on its own; bad values and unknown names raise
    InvalidArgument naming what to pass."""
    async def after_a_put(q) -> int:
        await first_use(q)
        await q.put(one(0), partition="p")
        await anyio.sleep(0)
        await anyio.sleep(0)  # (the flush of the iteration's end has run)
        return staged(q)

    async with streamrl.StreamQueue(capacity=64, put_linger=0) as q:
        assert q.session.transport.control.linger == 0
        assert await after_a_put(q) == 0 and (await q.stats()).rows == 1
    async with streamrl.StreamQueue(capacity=64, put_linger=60) as q:
        assert await after_a_put(q) == 1  # (lingers: nobody waits for the row)
        assert (await q.stats()).rows == 1 and staged(q) == 0  # (any call flushes first)
    q = streamrl.StreamQueue.from_config({"capacity": 64, "options": {"put_linger": 0.25}})
    async with q:
        assert q.session.transport.control.linger == 0.25
        assert q.config.options == {"put_linger": 0.25}
    async with streamrl.StreamQueue(capacity=64, combine_puts=False) as q:
        assert not combines(q)
        await q.put(one(7), partition="p")
        mb = await q.get("t", ["idx"], 1, partition="p", timeout=5)
        assert (await mb.materialize())["idx"].tolist() == [7]
    for bad, match in [({"put_linger": -1}, "put_linger must be"),
                       ({"put_linger": float("inf")}, "put_linger must be"),
                       ({"put_linger": "5ms"}, "put_linger must be"),
                       ({"put_linger": True}, "put_linger must be"),
                       ({"combine_puts": 1}, "combine_puts must be True or False"),
                       ({"linger": 0.01}, r"\['linger'\].*combine_puts, put_linger")]:
        with pytest.raises(InvalidArgument, match=match):
            streamrl.StreamQueue(capacity=8, **bad)


async def test_a_flush_that_queues_filter_jobs_leaves_them_to_its_task(make_queue, transport):
    """A full stage is flushed inside the next put, and its rows' commit queues filter
    jobs (a group filter: groups of 8 whole): the flush starts a task that runs them.
    That put is staged like any other, not sent the usual way to run those jobs itself
    (which made one put in ~64 carry a whole round of filter work); the task judges
    every group once the producer yields, and nothing is left behind."""
    if transport != "embedded":
        pytest.skip("write-combining is the embedded transport's")
    judged: list = []

    def keep_odd_groups(td):
        judged.append(td["uid"][0].item())
        return td["uid"][0].item() % 2 == 1

    q = make_queue(capacity=1024, consumers=["t"])
    await q.add_filter(keep_odd_groups, fields=["uid", "r"], group_by="uid", group_size=8,
                       name="odd")
    svc = q.session.transport.control
    n = svc.max_rows
    for i in range(n):  # without yielding: the last put fills the stage
        await q.put(rewarded(i, i // 8, float(i)), partition="p")
    assert svc.staged == n and judged == [] and not svc.ctl.filter_jobs
    await q.put(rewarded(n, n // 8, float(n)), partition="p")  # flushes them
    assert svc.ctl.filter_jobs
    assert svc.staged == 1, "the put that flushed the stage was not staged"
    assert judged == [], "the put that flushed the stage ran the filter jobs itself"
    for i in range(n + 1, n + 8):
        await q.put(rewarded(i, i // 8, float(i)), partition="p")
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["uid", "r"], 8, partition="p", group_by="uid",
                             group_size=8, timeout=10):
        got += set((await mb.materialize())["uid"].tolist())
    got.sort()
    groups = (n + 8) // 8
    assert sorted(judged) == list(range(groups))
    assert got == [u for u in range(groups) if u % 2 == 1]
    st = await _settled(q, lambda st: st.rows == 0)
    rejected = 8 * sum(1 for u in range(groups) if u % 2 == 0)
    assert (st.rows, st.filtered_by, st.filter_errors) == (0, {"odd": rejected}, 0)



async def test_a_slow_async_filter_holds_up_neither_the_producer_nor_later_groups(
        make_queue, transport):
    """An async filter blocked on one group (a remote reward model that hangs): the
    one-row puts that follow are still staged and return at once, and the groups of
    later flushes are judged meanwhile (each flush's task runs the jobs it finds)."""
    if transport != "embedded":
        pytest.skip("write-combining is the embedded transport's")
    gate = asyncio.Event()
    judged: list = []

    async def slow_on_group_0(td):
        uid = td["uid"][0].item()
        if uid == 0:
            await gate.wait()
        judged.append(uid)
        return True

    q = make_queue(capacity=1024, consumers=["t"])
    await q.add_filter(slow_on_group_0, fields=["uid", "r"], group_by="uid", group_size=8,
                       name="slow")
    svc = q.session.transport.control
    svc.linger = 0  # (each stage flushed at the end of its iteration: no consumer waits
    # here, and whether a 5 ms linger ran out within these iterations is up to the load)
    n = svc.max_rows
    for i in range(n):  # 8 groups, flushed at the end of the iteration: their task starts
        await q.put(rewarded(i, i // 8, float(i)), partition="p")
    for _ in range(5):
        await asyncio.sleep(0)
    assert judged == []  # (the task is stuck on group 0; the rest of its round waits)
    with anyio.fail_after(5):  # (the producer is not held up by the stuck filter)
        for i in range(n, 2 * n):
            await q.put(rewarded(i, i // 8, float(i)), partition="p")
    assert svc.staged == n  # (all staged, flushed at the end of this iteration)
    for _ in range(20):
        await asyncio.sleep(0)
    assert sorted(judged) == list(range(n // 8, 2 * n // 8)), judged
    gate.set()
    st = await _settled(q, lambda st: st.rows == 2 * n and len(judged) == 2 * n // 8)
    assert sorted(judged) == list(range(2 * n // 8)) and st.filter_errors == 0


# ---------------------------------------------------------------- backends that write files


async def test_a_put_into_a_file_backed_store_fails_at_the_put_not_later(tmp_path, monkeypatch):
    """One-row puts are combined only into the in-memory units: with a backend that writes
    files (spill), a write that fails raises at the put it belongs to, and the queue is
    consistent afterwards (combined, it would fail at a later flush, after the put had
    returned)."""
    import streamrl
    from streamrl.storage import spill

    async with streamrl.StreamQueue(capacity=8, storage={"backend": "spill", "memory_bytes": 0,
                                                         "dir": str(tmp_path)}) as q:
        assert not combines(q)
        await q.put(one(0))

        def broken(self, *a, **k):
            raise OSError(28, "No space left on device")

        unit_cls = type(q.session.transport.data.units[0])
        assert unit_cls.__module__ == spill.__name__
        monkeypatch.setattr(unit_cls, "put", broken)
        with pytest.raises(OSError):
            await q.put(one(1))
        monkeypatch.undo()
        assert await q.audit() == []
        st = await q.stats()
        assert st.rows == 1
        mb = await q.get("t", ["idx"], 1, timeout=5)
        assert (await mb.materialize())["idx"].tolist() == [0]


# ---------------------------------------------------------------- writes to staged rows


def flushes(q) -> int:
    return getattr(q.session.transport.control, "flushes", 0)


def test_rows_staged_when_their_event_loop_ended_reach_a_call_from_another():
    """A program puts a row and its event loop ends at once (``asyncio.run`` returns):
    the row is still staged (nobody waited for it, so the stage lingered). A call of
    the queue from a later event loop (a one-row put, then others) flushes it (with a
    filter to run: its jobs are run by that call, not by a task of the closed loop) and
    reads it back; nothing is left behind."""
    import streamrl

    q = streamrl.StreamQueue(capacity=16, consumers=["t"])

    async def first():
        await q.add_filter(lambda td: td["idx"] >= 0, fields=["idx"], name="nonneg")
        # (a consumer waits for 2 rows: the stage lingers with 1; the loop's end cancels it)
        asyncio.ensure_future(q.get("t", ["idx", "x"], 2, partition="p", timeout=30))
        await asyncio.sleep(0.01)
        await q.put(one(1), partition="p")
        assert staged(q) == 1

    async def second():
        try:  # (a put first: it does not join the stage of the loop that ended)
            await q.put(one(2), partition="p")
            st = await q.stats()
            assert (st.rows, st.put) == (2, 2)
            mb = await q.get("t", ["idx", "x"], 2, partition="p", timeout=5)
            assert (await mb.materialize())["idx"].tolist() == [1, 2]
            await mb.ack()
            assert await q.audit() == []
        finally:
            await q.close()
            await q.shutdown()

    asyncio.run(first())
    asyncio.run(second())


async def test_a_sample_put_in_parts_is_admitted_whole_with_the_puts_around_it(make_queue):
    """An env worker puts a sample's tokens, then writes its reward to the row the put
    returned. Embedded, the write to a row still staged is kept with its put: a stage
    of such samples is flushed once (not once a write), every row admitted with both
    fields; on every transport the rows read back as written, counted once each."""
    q = make_queue(capacity=256, consumers=["t"])
    await first_use(q)
    n = 40  # (fewer than a stage holds)
    if combines(q):  # (no flush for lingering, however slow this machine is today)
        q.session.transport.control.linger = 60.0
    before = flushes(q)
    for i in range(n):
        b = await q.put(one(i), partition="p")
        await anyio.sleep(0)  # (the worker awaits something between the put and the write)
        assert await b.write({"r": torch.tensor([i / 2])}) is b
        assert b.fields == ("idx", "x", "r") and b.one_row is not None
        assert (await b.materialize(["r"]))["r"].tolist() == [i / 2]  # its cache
    if combines(q):
        assert staged(q) == n and flushes(q) == before
    st = await q.stats()
    assert staged(q) == 0 and flushes(q) == before + (1 if combines(q) else 0)
    assert (st.rows, st.put, st.bytes) == (n, n, n * (8 + 16 + 4))
    if combines(q):  # a field too big to combine: the usual way (the stage flushed)
        before = flushes(q)
        b = await q.put(one(n), partition="p")
        await b.write({"big": torch.zeros(1, 1 << 15)})
        assert staged(q) == 0 and flushes(q) == before + 1
        await b.drop()
    mb = await q.get("t", ["idx", "x", "r"], n, partition="p", timeout=10)
    td = await mb.materialize()
    assert td["idx"].tolist() == list(range(n))
    assert td["r"].tolist() == [i / 2 for i in range(n)]
    assert torch.equal(td["x"][:, 0], td["idx"].float())
    await mb.ack()
    assert await q.audit() == []


async def test_a_write_through_the_batch_of_an_admitted_row_is_a_write(make_queue):
    """The batch of a one-row put whose row is admitted already (the producer awaited
    longer than a stage lingers): a write through it (embedded: in one go, without the
    usual checks it cannot fail) adds the field to the batch, reads back, and refuses
    what any write refuses: the field again, another dtype, a row dropped."""
    from streamrl.errors import DuplicateField, RowsDropped

    q = make_queue(capacity=16, consumers=["t"])
    await first_use(q)
    a = await q.put(one(1), partition="p")
    b = await q.put(one(2), partition="p")
    c = await q.put(one(3), partition="p")
    await q.stats()  # (admitted)
    assert await a.write({"r": torch.tensor([1.5])}) is a
    assert a.fields == ("idx", "x", "r") and staged(q) == 0
    with pytest.raises(DuplicateField):
        await a.write({"r": torch.tensor([2.5])})
    with pytest.raises(SchemaError):
        await b.write({"r": torch.tensor([2.5], dtype=torch.float64)})
    await c.drop()
    with pytest.raises(RowsDropped):
        await q.put({"r": torch.tensor([3.5])}, rows=c)
    await b.write({"r": torch.tensor([2.5])})
    st = await q.stats()
    assert (st.rows, st.bytes) == (2, 2 * (24 + 4))
    mb = await q.get("t", ["idx", "r"], 2, partition="p", timeout=10)
    td = await mb.materialize()
    assert td["idx"].tolist() == [1, 2] and td["r"].tolist() == [1.5, 2.5]
    await mb.ack()
    assert await q.audit() == []


async def test_staged_rows_written_differently_read_back_as_written(make_queue):
    """Rows of one stage with other fields written to them (some none, one two writes,
    one fields in another order) are admitted in runs of rows alike, in the order of
    their puts: each request gets exactly the rows that hold its fields, and a field
    written later to a row that had none lands the usual way."""
    q = make_queue(capacity=64, consumers=["a", "b", "c"])
    await first_use(q)
    b = [await q.put(one(i), partition="p") for i in range(7)]
    for i in (0, 1, 3, 4):
        await b[i].write({"r": torch.tensor([float(i)])})
    await b[4].write({"s": torch.tensor([[4, 40]])})
    await b[6].write({"s": torch.tensor([[6, 60]])})
    # (by row id, and as a TensorDict: kept with the put all the same)
    await q.put({"r": torch.tensor([6.0])}, rows=b[6].rows)
    await b[5].write(TensorDict({"r": torch.tensor([5.0]), "s": torch.tensor([[5, 50]])},
                                batch_size=[1]))
    assert staged(q) == (7 if combines(q) else 0)
    st = await q.stats()
    assert (st.rows, st.put, st.bytes) == (7, 7, 7 * 24 + 6 * 4 + 3 * 16)
    await b[2].write({"r": torch.tensor([2.0])})  # (a row flushed already: the usual way)
    ma = await q.get("a", ["idx", "r"], 7, partition="p", timeout=10)
    ta = await ma.materialize()
    assert ta["idx"].tolist() == list(range(7)) and ta["r"].tolist() == [float(i) for i in range(7)]
    mb = await q.get("b", ["idx", "r", "s"], 3, partition="p", timeout=10)
    tb = await mb.materialize()
    assert tb["idx"].tolist() == [4, 5, 6]
    assert tb["s"].tolist() == [[4, 40], [5, 50], [6, 60]] and tb["r"].tolist() == [4.0, 5.0, 6.0]
    with pytest.raises(StreamTimeout):  # no other row has s
        await q.get("c", ["s"], 4, partition="p", timeout=0.2)
    for m in (ma, mb):
        await m.ack()
    assert await q.audit() == []


async def test_a_write_to_a_staged_row_raises_what_any_write_raises(make_queue):
    """A write to a staged row is kept with its put only when the usual way would
    accept it: a field the put holds, a field written already, or another dtype than
    a staged row's write of that field raises at the write, as ever, and leaves the
    rows as they were."""
    from streamrl.errors import DuplicateField

    q = make_queue(capacity=64, consumers=["t"])
    await first_use(q)
    a = await q.put(one(1), partition="p")
    b = await q.put(one(2), partition="p")
    await a.write({"r": torch.tensor([1.0])})
    with pytest.raises(DuplicateField):
        await b.write({"x": torch.ones(1, 4)})  # (put with b)
    b = await q.put(one(3), partition="p")
    await b.write({"r": torch.tensor([3.0])})
    with pytest.raises(DuplicateField):
        await b.write({"r": torch.tensor([4.0])})
    await q.stats()  # (a new stage: r is float32 in the rows of this one only)
    a = await q.put(one(5), partition="p")
    await a.write({"y": torch.tensor([5.0])})
    c = await q.put(one(4), partition="p")
    with pytest.raises(SchemaError):  # y is float32 (a's write, staged)
        await c.write({"y": torch.tensor([4.0], dtype=torch.float64)})
    with pytest.raises(SchemaError):  # r is float32 (admitted)
        await c.write({"r": torch.tensor([4.0], dtype=torch.float64)})
    with pytest.raises(SchemaError):  # the length
        await c.write({"r": torch.tensor([4.0, 5.0])})
    await c.write({"r": torch.tensor([4.0])})
    mb = await q.get("t", ["idx", "r"], 3, partition="p", timeout=10)
    td = await mb.materialize()
    assert td["idx"].tolist() == [1, 3, 4] and td["r"].tolist() == [1.0, 3.0, 4.0]
    await mb.ack()
    mb = await q.get("t", ["idx", "y"], 1, partition="p", timeout=10)
    assert (await mb.materialize())["y"].tolist() == [5.0]
    await mb.ack()
    st = await q.stats()
    assert (st.rows, st.put) == (1, 5) and await q.audit() == []


@pytest.mark.parametrize("declared", ["group_key", "stream"])
async def test_a_group_key_written_to_staged_rows_still_groups_them(make_queue, declared):
    """A field that is a group key (declared with ``group_key``, or by a grouped stream
    already waiting, which the writer has not heard of) is not kept with a staged put
    (its values are read when rows are admitted): such a write goes the usual way and
    the grouped stream gets whole groups."""
    q = make_queue(capacity=64, consumers=["t"],
                   **({"group_key": "uid"} if declared == "group_key" else {}))
    await first_use(q)
    task, got = grouped(q, ["uid", "idx"], lambda td: td["idx"].tolist())
    await asyncio.sleep(0.05)
    for i in range(8):
        b = await q.put(one(i), partition="p")
        await b.write({"uid": torch.tensor([i % 2])})
    await q.seal("p")
    await task
    assert sorted(got) == [({0}, [0, 2, 4, 6]), ({1}, [1, 3, 5, 7])]
    assert await q.audit() == []


async def test_a_reward_written_to_staged_rows_is_judged_by_the_group_filter(make_queue):
    """The GRPO pattern in parts: each sample's tokens and group key put, its reward
    written after. The zero-variance filter judges each group with the rewards written
    (staged with their puts, embedded): the group whose rewards are all equal is
    dropped, the others are delivered whole."""
    from streamrl.filters import zero_variance

    q = make_queue(capacity=64, consumers=["t"])
    await q.add_filter(zero_variance("r", group_by="uid", group_size=4))
    got: list = []

    async def consume():
        async for mb in q.stream("t", ["uid", "x", "r"], 4, partition="p", group_by="uid",
                                 group_size=4, timeout=30):
            td = await mb.materialize()
            got.append((set(td["uid"].tolist()), sorted(td["r"].tolist())))

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.05)
    for i in range(12):
        b = await q.put({"uid": torch.tensor([i % 3]), "x": torch.full((1, 4), float(i))},
                        partition="p")
        await b.write({"r": torch.tensor([1.0 if i % 3 == 1 else float(i)])})
    await q.seal("p")
    await task
    assert sorted(got, key=lambda g: min(g[0])) == [
        ({u}, [float(i) for i in range(12) if i % 3 == u]) for u in (0, 2)]
    st = await _settled(q, lambda st: st.rows == 0)
    assert (st.rows, st.put, st.filtered) == (0, 12, 4) and await q.audit() == []


async def test_a_write_whose_store_fails_leaves_nothing_and_can_be_retried(tmp_path,
                                                                            monkeypatch):
    """An embedded write of new fields is admitted, stored and committed in one go (no
    coroutine where nothing has to wait): a store that fails (a backend that writes
    files, the disk full) raises at the write and takes the write back, so the field
    is not written, nothing of it is held, and a retry lands; a later write of the same
    field raises DuplicateField as before."""
    import streamrl
    from streamrl.errors import DuplicateField

    async with streamrl.StreamQueue(capacity=8, consumers=["t"], storage={
            "backend": "spill", "memory_bytes": 0, "dir": str(tmp_path)}) as q:
        rows = await q.put({"idx": torch.arange(2)}, partition="p")

        def broken(self, *a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(type(q.session.transport.data.units[0]), "put", broken)
        with pytest.raises(OSError):
            await rows.write({"y": torch.ones(2)})
        monkeypatch.undo()
        assert await q.audit() == []
        await rows.write({"y": torch.ones(2) * 3})  # (the failed write holds nothing)
        with pytest.raises(DuplicateField):
            await rows.write({"y": torch.ones(2)})
        mb = await q.get("t", ["idx", "y"], 2, partition="p", timeout=5)
        assert (await mb.materialize())["y"].tolist() == [3.0, 3.0]
        await mb.ack()
        assert (await q.stats()).rows == 0 and await q.audit() == []


def _unlike(case: str) -> dict:
    """A one-row put like ``one(1)`` but for field ``x`` (see the test below)."""
    x = {
        "grad": lambda: torch.ones(1, 4, requires_grad=True),
        "meta": lambda: torch.ones(1, 4, device="meta"),
        "sparse": lambda: torch.ones(1, 4).to_sparse(),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(4)]),
        "jagged": lambda: torch.nested.nested_tensor([torch.ones(4)], layout=torch.jagged),
        "reshaped": lambda: torch.ones(1, 2, 2),  # the same bytes, another shape
        "wider": lambda: torch.ones(1, 8),
        "two rows": lambda: torch.ones(2, 4),
        "no row dim": lambda: torch.tensor(1.0),
        "float64": lambda: torch.ones(1, 4, dtype=torch.float64),
        "uint16": lambda: torch.ones(1, 4, dtype=torch.uint16),
        "list": lambda: [[1.0] * 4],
    }[case]()
    return {"idx": torch.tensor([1]), "x": x}


async def _outcome(q, data: dict, usual: bool) -> tuple:
    """Put ``one(0)`` then ``data`` (inside a ``timed`` block if ``usual``: the put
    then takes the usual way, never the shortcut), and read everything back."""
    await first_use(q)
    await q.put(one(0), partition="p")
    if combines(q):
        assert staged(q) == 1  # (the row ``data`` is compared against is staged)
    err = None
    try:
        if usual:
            with q.timed("producer"):
                await q.put(data, partition="p")
        else:
            await q.put(data, partition="p")
    except Exception as e:  # noqa: BLE001 (the outcome compared)
        err = (type(e).__name__, str(e))
    await q.seal("p")
    got = []
    async for mb in q.stream("t", ["idx", "x"], 1, partition="p"):  # (rows of other
        td = await mb.materialize()                                  # shapes read apart)
        xs = td["x"].unbind(0) if isinstance(td["x"], torch.Tensor) else td["x"]
        got += [(i, x.tolist() if isinstance(x, torch.Tensor) else x,
                 isinstance(x, torch.Tensor) and x.requires_grad)
                for i, x in zip(td["idx"].tolist(), xs)]
    st = await q.stats()
    return err, got, st.put, st.rows, st.bytes, await q.audit()


@pytest.mark.parametrize("case", ["grad", "meta", "sparse", "nested", "jagged", "reshaped",
                                  "wider", "two rows", "no row dim", "float64", "uint16",
                                  "list"])
async def test_a_one_row_put_unlike_the_staged_rows_fares_as_the_usual_way(make_queue, transport,
                                                                          case):
    """A one-row put whose field differs from the rows staged before it in one respect
    (it needs grad, is meta, sparse or nested, another shape or dtype, not one row) is
    stored or refused exactly as the usual way of a put stores or refuses it: the same
    error, or the same rows read back (a grad tensor detached), the same counts. (The
    shortcut that stages such puts is the embedded transport's; Ray's one-row check is
    test_columns.py's.)"""
    if transport != "embedded":
        pytest.skip("one-row puts are staged on the embedded transport only")
    if case == "uint16" and not hasattr(torch, "uint16"):
        pytest.skip("no torch.uint16 here")
    if case in ("nested", "jagged"):
        import warnings
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
    fast = await _outcome(make_queue(capacity=16), _unlike(case), usual=False)
    usual = await _outcome(make_queue(capacity=16), _unlike(case), usual=True)
    assert fast == usual
    assert fast[0] is not None or fast[1][-1][0] == 1  # (refused, or read back)


async def test_one_row_put_arguments_are_checked_as_any_put_checks_them(make_queue):
    """A one-row put of new rows takes a shortcut on the embedded transport; each bad
    argument still raises what it raises for a put of two rows, nothing is staged for it,
    and odd but valid values (a grad tensor, a numpy row, int timeouts) are stored."""
    q = make_queue(capacity=64)
    await first_use(q)
    import numpy as np

    two = {"idx": torch.tensor([0, 1]), "x": torch.zeros(2, 4)}
    bad = [
        (dict(version=True), InvalidArgument, "version must be an int"),
        (dict(version=1.5), InvalidArgument, "version must be an int"),
        (dict(partition=""), InvalidArgument, "partition must be a non-empty str"),
        (dict(partition=3), InvalidArgument, "partition must be a non-empty str"),
        (dict(timeout=-1), InvalidArgument, "timeout"),
        (dict(timeout=float("nan")), InvalidArgument, "timeout"),
        (dict(timeout=float("inf")), InvalidArgument, "timeout"),
        (dict(timeout=True), InvalidArgument, "timeout"),
        (dict(overwrite="yes"), InvalidArgument, "overwrite"),
    ]
    for kw, exc, match in bad:
        kw.setdefault("partition", "p")
        for data in (one(9), two):
            with pytest.raises(exc, match=match):
                await q.put(data, **kw)
            assert staged(q) == 0
    for data in ({"": torch.zeros(1)}, {"idx": torch.tensor(5)}, {}):
        with pytest.raises((InvalidArgument, SchemaError)):
            await q.put(data, partition="p")
    assert (await q.stats()).put == 0
    # valid: a tensor that requires grad is stored detached; numpy rows; timeouts of
    # either number type
    g = torch.ones(1, 4, requires_grad=True)
    await q.put({"idx": torch.tensor([0]), "x": g}, partition="p", timeout=5)
    await q.put({"idx": np.array([1]), "x": np.ones((1, 4), dtype=np.float32)},
                partition="p", timeout=2.5)
    await q.put({"idx": torch.tensor([2]), "x": torch.ones(1, 4)}, partition="p", version=0)
    mb = await q.get("t", ["idx", "x"], 3, partition="p", timeout=10)
    td = await mb.materialize()
    assert td["idx"].tolist() == [0, 1, 2] and not td["x"].requires_grad
    assert td["x"].tolist() == [[1.0] * 4] * 3
    assert await q.audit() == []


async def test_the_dict_a_one_row_put_returns_is_not_the_callers(make_queue):
    """A put's batch caches what was put, and the queue stores it: changing the caller's
    dict afterwards (a new key, another tensor, the dict reused for the next put) changes
    neither what the batch reads nor what was stored."""
    q = make_queue(capacity=64)
    await first_use(q)
    data = one(3)
    mb = await q.put(data, partition="p")
    data["x"] = torch.full((1, 4), -1.0)
    data["extra"] = torch.zeros(1)
    assert set(mb.fields) == {"idx", "x"}
    assert (await mb.materialize())["x"].tolist() == [[3.0] * 4]
    # the dict reused for the next put, as a producer loop may: each row keeps its own
    data = one(4)
    await q.put(data, partition="p")
    data["idx"], data["x"] = torch.tensor([5]), torch.full((1, 4), 5.0)
    await q.put(data, partition="p")
    got = await q.get("t", ["idx", "x"], 3, partition="p", timeout=10)
    td = await got.materialize()
    assert td["idx"].tolist() == [3, 4, 5]
    assert td["x"][:, 0].tolist() == [3.0, 4.0, 5.0]


async def test_a_producer_held_back_by_a_full_queue_still_has_its_rows_combined(make_queue,
                                                                               transport):
    """A one-row put that finds the queue full waits for room in turn, then is staged
    with the puts after it: the rows of a producer that keeps the queue full are still
    stored as one block per field (read back as views), and in order."""
    q = make_queue(capacity=8, consumers=["t"])  # (an ack frees the rows)
    await first_use(q)
    for i in range(8):
        await q.put(one(i), partition="p")

    async def producer():
        for i in range(8, 16):
            await q.put(one(i), partition="p", timeout=10)

    task = asyncio.ensure_future(producer())
    await asyncio.sleep(0.1)  # it waits for room
    assert not task.done()
    mb = await q.get("t", ["idx"], 8, partition="p", timeout=10)
    assert (await mb.materialize())["idx"].tolist() == list(range(8))
    await mb.ack()
    await asyncio.wait_for(task, 10)
    mb = await q.get("t", ["idx", "x"], 8, partition="p", timeout=10)
    td = await mb.materialize()
    assert td["idx"].tolist() == list(range(8, 16))
    assert td["x"][:, 0].tolist() == [float(i) for i in range(8, 16)]
    if transport == "embedded":  # one block per field: idx and x
        assert sum(len(u.segments) for u in q._data.units) == 2
    await mb.ack()
    assert (await q.stats()).rows == 0 and await q.audit() == []


async def test_the_first_put_of_a_queue_is_staged(make_queue, transport):
    """The first call of a queue may be a one-row put: it is staged like the puts after
    it, so a queue filled before anyone reads it still holds its rows in blocks."""
    q = make_queue(capacity=64, num_shards=1)
    for i in range(5):
        await q.put(one(i), partition="p")
        if transport == "embedded":
            assert staged(q) == i + 1
    mb = await q.get("t", ["idx", "x"], 5, partition="p", timeout=10)
    assert (await mb.materialize())["idx"].tolist() == list(range(5))
    if transport == "embedded":  # one block per field
        assert sum(len(u.segments) for u in q._data.units) == 2
