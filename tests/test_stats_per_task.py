"""stats() per task and per partition: latencies of a known delay, rows by state, bytes
acked and redelivered, the counters per partition, and Stats.summary()'s lines."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from streamrl.controller import Controller, Request

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["embedded"], indirect=True)
async def test_per_task_latencies_rows_by_state_and_summary(make_queue):
    q = make_queue(capacity=64)
    # task a: rows put ~0.3 s before it takes them (put -> delivery)
    await q.put({"x": torch.arange(8)}, partition="p")
    await asyncio.sleep(0.3)
    a = await q.get("a", ["x"], 4, partition="p", timeout=10)

    # task b: its take waits ~0.3 s for rows put then (the consumer's wait)
    async def late_put():
        await asyncio.sleep(0.3)
        await q.put({"x": torch.arange(4)}, partition="p2")

    producer = asyncio.ensure_future(late_put())
    b = await q.get("b", ["x"], 4, partition="p2", timeout=10)
    await producer

    # task c asks for a field that only a's four rows get: the others wait for it
    await a.write({"y": torch.ones(4, dtype=torch.float32)})
    c = await q.get("c", ["x", "y"], 2, partition="p", timeout=10)

    st = await q.stats()
    ta, tb, tc = st.tasks["a"], st.tasks["b"], st.tasks["c"]
    # quantiles are bucket upper bounds (power-of-two microseconds): 0.3 s reads as 0.52 s
    assert 0.25 < ta.delivery_p50 <= 0.6 and 0.25 < ta.delivery_p99 <= 0.6
    assert 0.25 < tb.wait_p50 <= 0.6 and 0.25 < tb.wait_p99 <= 0.6
    assert tb.delivery_p50 < 0.25 and ta.wait_p50 < 0.25  # neither waited for the other
    # rows per state, per task
    assert (ta.delivered, ta.leased, ta.ready, ta.waiting) == (4, 4, 4, 0)
    assert (tb.delivered, tb.leased, tb.ready, tb.waiting) == (4, 4, 0, 0)
    assert (tc.delivered, tc.leased, tc.ready, tc.waiting) == (2, 2, 2, 4)
    assert (ta.bytes, tb.bytes, tc.bytes) == (4 * 8, 4 * 8, 2 * (8 + 4))

    # bytes acked, and bytes handed out again
    await a.ack()
    await c.release()
    c = await q.get("c", ["x", "y"], 4, partition="p", timeout=10)  # 2 of them again
    st = await q.stats()
    assert (st.tasks["a"].acked, st.tasks["a"].bytes_acked) == (4, 4 * 8)
    tc = st.tasks["c"]
    assert (tc.delivered, tc.redelivered, tc.bytes_redelivered) == (6, 2, 2 * (8 + 4))
    assert st.partitions["p"]["put"] == 8 and st.partitions["p2"]["put"] == 4
    assert st.partitions["p"]["bytes"] == st.partitions["p"]["bytes_put"] == 8 * 8 + 4 * 4

    # summary(): the totals, then a line per task and per partition
    lines = st.summary().splitlines()
    assert lines[0].startswith("put=12 ")

    def row(name: str) -> list[str]:
        line = next(ln for ln in lines if ln.split()[0] == name)
        return line.split()

    for name, t in st.tasks.items():
        cells = row(name)
        assert [int(x) for x in cells[1:7]] == [t.delivered, t.acked, t.redelivered,
                                                t.leased, t.ready, t.waiting], cells
        assert float(cells[7]) == round(t.bytes / 1e6, 1)
    assert re.search(r"\b524ms / 524ms\b", " ".join(row("a")))  # a's put->deliv p50/p99
    assert re.search(r"\b524ms / 524ms$", " ".join(row("b")))  # b's wait p50/p99
    for name, p in st.partitions.items():
        cells = row(name)
        assert [int(x) for x in cells[1:7]] == [
            p["rows"], p["waiting"], p["ready"], p["leased"], p["consumed"], p["put"]], cells
        assert float(cells[7]) == round(p["bytes"] / 1e6, 1) and cells[8] == "no"
    await b.ack()
    await c.ack()


def test_partition_counters_follow_puts_writes_and_a_checkpoint():
    """Rows and bytes put per partition (new rows, then a write across partitions and an
    overwrite), held bytes per partition, kept by a saved state, gone once a sealed
    partition is empty."""
    c = Controller(64, num_shards=2)
    for part, n in (("p", 3), ("q", 2)):
        tok = c.allocate(part, n, ("x",), nbytes=8 * n)
        c.commit(tok, {"x": [8] * n})
    took = c.take(Request("t", ("x",), 5))  # a batch over both partitions
    assert took is not None
    tok = c.begin_write(took.rows, ("y",))
    c.commit(tok, {"y": [4] * 5})
    tok = c.begin_write(took.rows[:1], ("x",), overwrite=True)  # shrinks one row
    c.commit(tok, {"x": [2]})
    st = c.partition_states()
    assert {k: st["p"][k] for k in ("put", "bytes_put", "bytes")} == {
        "put": 3, "bytes_put": 3 * 8 + 3 * 4, "bytes": 3 * 8 + 3 * 4 - 6}
    assert {k: st["q"][k] for k in ("put", "bytes_put", "bytes")} == {
        "put": 2, "bytes_put": 2 * 8 + 2 * 4, "bytes": 2 * 8 + 2 * 4}
    again = Controller(64, num_shards=2)
    again.load_state_dict(c.state_dict())
    assert {p: {k: s[k] for k in ("put", "bytes_put", "bytes")}
            for p, s in again.partition_states().items()} == {
        p: {k: s[k] for k in ("put", "bytes_put", "bytes")} for p, s in st.items()}
    c.seal("q")
    c.clear("q")
    assert "q" not in c.partition_states()  # retired: nothing kept per finished step
