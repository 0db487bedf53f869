"""Defects found by trying to break the queue (issue 15): each test fails on the code
that had the defect. Run on every transport unless a test says otherwise."""

from __future__ import annotations

import asyncio
import gc
import math

import numpy as np
import pytest
import torch

from streamrl.errors import InvalidArgument, LeaseExpired, SchemaError, StreamTimeout

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")]


async def _eventually(check, deadline=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not await check():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- 6: refused before admission


@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized", "sparse_row"])
@pytest.mark.on_ray(kind="sparse_row")  # (the same client check on every transport)
async def test_a_column_that_cannot_be_stored_is_refused_before_admission(make_queue, kind):
    q = make_queue(capacity=8, num_shards=2)
    t = {
        "sparse": lambda: torch.eye(4).to_sparse(),
        "meta": lambda: torch.empty(4, 3, device="meta"),
        "quantized": lambda: torch.quantize_per_tensor(torch.rand(4, 2), 0.1, 0, torch.qint8),
        "sparse_row": lambda: [torch.eye(2).to_sparse()] * 4,
    }[kind]()
    with pytest.raises(SchemaError, match="field 'x"):
        await q.put({"idx": torch.arange(4), "x": t}, partition="p")
    st = await q.stats()
    assert st.rows == 0 and st.bytes == 0 and st.put == 0
    await q.put({"idx": torch.arange(8), "x": torch.zeros(8, 2)}, partition="p")  # room left
    assert await q.audit() == []


async def test_a_nested_tensor_put_is_split_over_units(make_queue):
    """A jagged nested tensor (what materialize gives for ragged rows) is put as rows."""
    q = make_queue(capacity=64, num_shards=3)
    nt = torch.nested.nested_tensor([torch.arange(n) for n in (1, 3, 2, 5)], layout=torch.jagged)
    for _ in range(3):  # puts rotate over the units
        await q.put({"r": nt}, partition="p")
    await q.seal("p")
    n = 0
    async for mb in q.stream("t", ["r"], 12, partition="p", timeout=10):
        n += len(mb)
        await mb.materialize()
    assert n == 12 and await q.audit() == []


async def test_a_put_that_fails_after_admission_is_undone(make_queue, monkeypatch):
    import streamrl.queue as queue_mod

    q = make_queue(capacity=4)

    def broken(*a, **kw):
        raise RuntimeError("cannot split")

    monkeypatch.setattr(queue_mod, "_split_by_shard", broken)
    with pytest.raises(RuntimeError):
        await q.put({"x": torch.zeros(4, 64 * 1024)}, partition="p")  # (not a small put)
    monkeypatch.undo()
    st = await q.stats()
    assert st.rows == 0 and st.bytes == 0
    await q.put({"x": torch.zeros(4, 8)}, partition="p", timeout=5)  # the room is back


# ---------------------------------------------------------------- 7: a cancelled take


def _slow_after(holder, delay: float) -> None:
    """Make the controller service's queued work after a call (``_after``: filter jobs,
    deletes) take ``delay`` seconds first, or (``delay=0``) undo that. ``holder`` is the
    controller actor (run by ``__ray_call__`` inside it) or, embedded, the queue."""
    svc = holder._svc if hasattr(holder, "_svc") else holder._control
    after = svc.__dict__.pop("_after", None)  # the patch, if any: back to the class's
    if delay <= 0:
        return
    after = svc._after

    async def slow_after(*a, **kw):  # queued work (a filter job) runs after the lease
        await asyncio.sleep(delay)
        return await after(*a, **kw)

    svc._after = slow_after


async def _slow_controller(q, transport: str, delay: float) -> None:
    if transport == "embedded":
        _slow_after(q, delay)
    else:  # inside the controller actor (Ray: the socket channel and actor calls alike)
        await q._transport._controller.__ray_call__.remote(_slow_after, delay)


@pytest.mark.parametrize("how", ["get", "stream"])
async def test_a_take_cancelled_after_its_lease_gives_it_back(transport, make_queue, how):
    """The controller leased a batch, then ran queued work before replying; the caller
    was cancelled meanwhile: the lease comes back at once (not after lease_timeout), on
    every transport (on Ray the cancellation reaches the controller actor as a cancel of
    the in-flight call)."""
    q = make_queue(capacity=16)
    await q.put({"x": torch.arange(4)}, partition="p")
    await _slow_controller(q, transport, 1.0)
    s = q.stream("t", ["x"], 4, partition="p")
    t = asyncio.ensure_future(q.get("t", ["x"], 4, partition="p") if how == "get"
                              else anext(s))
    await asyncio.sleep(0.3)  # (the take is in the controller's queued work now)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await _slow_controller(q, transport, 0)
    assert (await q.stats()).leases == 0
    mb = await asyncio.wait_for(q.get("t", ["x"], 4, partition="p"), 5)  # again, at once
    assert mb.rows and (await q.stats()).tasks["t"].redelivered == 4


async def test_takes_cancelled_at_every_point_give_their_leases_back(make_queue):
    """Gets cancelled at delays spread over a take's round trip (before the controller
    saw it, while it leased, while its reply travelled): none keeps a lease, and each
    row is still delivered exactly once to the acks."""
    q = make_queue(capacity=64, lease_timeout=600, consumers=["t"])
    await q.put({"x": torch.arange(40)}, partition="p")
    await q.seal("p")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first = await q.get("t", ["x"], 1, partition="p", timeout=10)
    rtt = loop.time() - t0
    acked = (await first.materialize())["x"].tolist()
    await first.ack()
    for i in range(30):
        t = asyncio.ensure_future(q.get("t", ["x"], 1, partition="p", timeout=10))
        await asyncio.sleep(rtt * (i % 10) / 8)
        t.cancel()
        try:
            mb = await t
        except asyncio.CancelledError:
            pass
        else:  # it came back before the cancel: ours to ack
            acked += (await mb.materialize())["x"].tolist()
            await mb.ack()
        assert (await q.stats()).leases == 0, f"a lease outlived its cancelled take ({i})"
    async for mb in q.stream("t", ["x"], 4, partition="p", timeout=10):
        acked += (await mb.materialize())["x"].tolist()
    assert sorted(acked) == list(range(40))
    assert (await q.stats()).rows == 0


# ---------------------------------------------------------------- 8: a stream in a variable


@pytest.mark.parametrize("how", ["raise", "cancel"])
async def test_a_stream_in_a_variable_gives_its_lease_back_when_its_task_ends(make_queue, how):
    """s = q.stream(...); async for mb in s: <raises> -- with the exception (and so the
    stream) kept alive by gather(return_exceptions=True), the lease still comes back."""
    q = make_queue(capacity=16)
    await q.put({"x": torch.arange(8)}, partition="p")
    s = q.stream("t", ["x"], 4, partition="p")
    started = asyncio.Event()

    async def consume():
        async for mb in s:
            started.set()
            if how == "raise":
                raise ValueError("bad batch")
            await asyncio.sleep(30)

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(started.wait(), 10)
    if how == "cancel":
        task.cancel()
    kept = await asyncio.gather(task, return_exceptions=True)  # noqa: F841 - kept alive
    gc.collect()

    async def released():
        return (await q.stats()).leases == 0

    await _eventually(released)
    mb = await q.get("t", ["x"], 8, partition="p", timeout=5)  # all 8 rows, at once
    assert len(mb) == 8


async def test_a_stream_iterated_across_calls_of_one_task_keeps_its_lease(make_queue):
    """The lease is released when the iterating *task* ends, not when a call returns."""
    q = make_queue(capacity=16)
    await q.put({"x": torch.arange(8)}, partition="p")
    s = q.stream("t", ["x"], 4, partition="p")

    async def one():
        return await s.__anext__()

    mb = await one()
    await asyncio.sleep(0.05)
    assert mb.leased and (await q.stats()).leases == 1
    await mb.ack()


@pytest.mark.parametrize("shape", ["wait_for", "prefetch"])
async def test_a_batch_fetched_in_a_short_task_is_acked_once_and_never_redelivered(
        make_queue, shape):
    """``asyncio.wait_for(anext(s), t)`` and a prefetching ``create_task(anext(s))``
    fetch each batch in a task of their own that ends at once; the caller acks the
    batch. It must count as acked (not given back when that short task ended), every
    row must come exactly once, and the stream must end."""
    q = make_queue(capacity=16)
    await q.put({"x": torch.arange(8)}, partition="p")
    await q.seal("p")
    s = q.stream("t", ["x"], 2, partition="p")
    seen = []

    async def fetch():
        if shape == "wait_for":
            return await asyncio.wait_for(anext(s), 10)
        return await asyncio.create_task(anext(s))

    while True:
        try:
            mb = await fetch()
        except StopAsyncIteration:
            break
        seen += (await mb.materialize())["x"].tolist()
        await asyncio.sleep(0.01)  # (the short task is long done by now)
        await mb.ack()
        assert len(seen) <= 8, f"rows delivered again: {seen}"
    st = await q.stats()
    assert sorted(seen) == list(range(8))
    assert st.tasks["t"].acked == 8 and st.tasks["t"].redelivered == 0


async def test_ack_of_a_batch_given_back_raises(make_queue):
    """A batch released (by release(), or by its stream when the iterating task
    failed) cannot be acknowledged after: its rows go out again, and the ack says so."""
    q = make_queue(capacity=16)
    await q.put({"x": torch.arange(4)}, partition="p")
    mb = await q.get("t", ["x"], 4, partition="p", timeout=5)
    await mb.release()
    await mb.release()  # idempotent
    with pytest.raises(LeaseExpired, match="given back"):
        await mb.ack()
    again = await q.get("t", ["x"], 4, partition="p", timeout=5)
    await again.ack()
    await again.ack()  # idempotent
    assert (await q.stats()).tasks["t"].acked == 4


# ---------------------------------------------------------------- 13: bad durations and input


@pytest.mark.parametrize("value", [math.nan, -1.0, "x"])
@pytest.mark.on_ray(value=-1.0)  # (the same client checks on every transport)
async def test_bad_timeouts_raise_naming_the_argument(make_queue, value):
    """(``timeout=inf`` is refused too, by the same check as nan.)"""
    q = make_queue(capacity=4)
    with pytest.raises(InvalidArgument, match="timeout"):
        await q.put({"x": torch.zeros(1)}, partition="p", timeout=value)
    with pytest.raises(InvalidArgument, match="timeout"):
        await q.get("t", ["x"], 1, partition="p", timeout=value)
    with pytest.raises(InvalidArgument, match="timeout"):
        await q.wait_version(1, timeout=value)
    with pytest.raises(InvalidArgument, match="lease_timeout"):
        await q.get("t", ["x"], 1, partition="p", lease_timeout=value)
    with pytest.raises(InvalidArgument, match="lease_timeout"):
        make_queue(lease_timeout=value)
    assert (await q.stats()).rows == 0


@pytest.mark.parametrize("kw", [{"partition": ""}, {"partition": 1}, {"group_by": ""}])
@pytest.mark.on_ray(kw={"group_by": ""})  # (the same client checks on every transport)
async def test_bad_request_names_raise_at_once(make_queue, kw):
    q = make_queue(capacity=4)
    with pytest.raises(InvalidArgument):  # not after waiting out a timeout
        await asyncio.wait_for(q.get("t", ["x"], 1, timeout=30, **kw), 5)
    with pytest.raises(InvalidArgument):
        await q.put({"x": torch.zeros(1)}, partition=kw.get("partition", 1))


async def test_numpy_arrays_of_any_layout_are_put_as_their_values(make_queue):
    q = make_queue(capacity=16, num_shards=2)
    a = np.arange(12, dtype=np.int64).reshape(4, 3)
    data = {
        "rev": a[::-1],  # negative strides
        "be": a.astype(">i8"),  # big-endian
        "s": np.array(["a", "bb", "c", "dd"]),  # numpy strings: objects per row
        "ro": np.frombuffer(a.tobytes(), dtype=np.int64).reshape(4, 3),  # read-only
    }
    rows = await q.put(data, partition="p")
    mb = await q.get("t", list(data), 4, partition="p", timeout=5)
    td = await mb.materialize()
    assert td["rev"].tolist() == a[::-1].tolist() and td["be"].tolist() == a.tolist()
    assert td["ro"].tolist() == a.tolist() and list(td["s"]) == ["a", "bb", "c", "dd"]
    assert rows.rows == mb.rows


# ---------------------------------------------------------------- 18: a timeout that says why


async def test_a_timeout_says_what_the_rows_lack_and_whether_sealed(make_queue):
    q = make_queue(capacity=16)
    rows = await q.put({"x": torch.arange(4)}, partition="p")
    await q.put({"y": torch.ones(2)}, rows=rows[:2])
    with pytest.raises(StreamTimeout, match=r"2 are ready.*lacking 'y': 2.*not sealed") as e:
        await q.get("t", ["x", "y"], 4, partition="p", timeout=0.2)
    assert "4 rows" in str(e.value)
    await q.seal("p")
    await q.get("t", ["x", "y"], 2, partition="p", timeout=5)  # the two ready ones
    with pytest.raises(StreamTimeout, match=r"lacking 'y': 2.*partition is sealed") as e:
        await q.get("t", ["x", "y"], 4, partition="p", timeout=0.2)
    assert "seal it" not in str(e.value)


# ---------------------------------------------------------------- 10: group keys per partition


async def test_a_group_key_of_one_partition_says_nothing_of_another(make_queue):
    """Grouping partition A by "uid" must not make B's "uid" (a [n, 3] field there) a
    group key: B's puts keep working and A's grouped stream works."""
    q = make_queue(capacity=64)
    await q.put({"uid": torch.zeros(4, 3, dtype=torch.long), "x": torch.ones(4)}, partition="B")
    await q.put({"uid": torch.tensor([0, 0, 1, 1]), "x": torch.ones(4)}, partition="A")
    await q.seal("A")
    got = []
    async for mb in q.stream("t", ["uid", "x"], 2, partition="A", group_by="uid",
                             group_size=2, timeout=10):
        got.append(sorted((await mb.materialize())["uid"].tolist()))
    assert sorted(got) == [[0, 0], [1, 1]]
    await q.put({"uid": torch.zeros(2, 3, dtype=torch.long), "x": torch.ones(2)}, partition="B")  # still fine
    rows = await q.put({"uid": torch.tensor([5, 5]), "x": torch.ones(2)}, partition="A2")
    assert len(rows) == 2
    # grouping B itself by its [n, 3] field is what fails, and only for that consumer
    with pytest.raises(SchemaError, match="uid"):
        await q.get("t", ["uid"], 2, partition="B", group_by="uid", timeout=5)
    assert (await q.stats()).rows == 12 and await q.audit() == []


# ---------------------------------------------------------------- 14: bytes of nested objects


async def test_bytes_of_deeply_nested_objects_are_counted(make_queue):
    """A 20 MiB string inside an agent trajectory (dict/list/dict/list/dict) counts 20
    MiB: a 10 MiB queue refuses it at once instead of admitting 100 MiB of them."""
    from streamrl.errors import QueueFull

    q = make_queue(capacity=64, capacity_bytes=10 << 20)
    traj = [{"turns": [{"msgs": [{"content": "x" * (20 << 20)}]}]}]
    with pytest.raises(QueueFull, match="can never fit"):
        await q.put({"traj": traj}, partition="p")
    small = [{"turns": [{"msgs": [{"content": "x" * (4 << 20)}]}]}]
    await q.put({"traj": small}, partition="p")
    await q.put({"traj": small}, partition="p")
    with pytest.raises(QueueFull):  # a third would pass 10 MiB
        await q.put_nowait({"traj": small}, partition="p")
    assert (await q.stats()).bytes >= 8 << 20


# ---------------------------------------------------------------- the guarantees page


def test_the_guarantees_page_names_tests_that_exist():
    """docs/reliability.md names the tests of each promise as ``file::function`` (a
    ``::function`` alone continues the last file): each must exist."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    page = (root / "docs" / "reliability.md").read_text()
    section = page[page.index("## How each promise is tested"):]
    named, current = [], None
    for path, func in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", section):
        if path:
            current = path
            assert (root / path).exists(), path
        if func:
            assert current is not None, func
            named.append((current, func))
    assert len(named) > 40
    for path, func in named:
        src = (root / path).read_text()
        assert re.search(rf"^(async )?def {func}\(", src, re.M), f"{path}::{func} is not a test"
