"""Where a role's time goes: q.timed(role) splits it into queue time and compute."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from streamrl.errors import InvalidArgument


async def test_timed_splits_queue_wait_from_compute(make_queue):
    q = make_queue(capacity=64)

    async def producer():
        await asyncio.sleep(0.3)  # the consumer waits for this in its get
        await q.put({"x": torch.arange(8)}, partition="p")

    task = asyncio.ensure_future(producer())
    with q.timed("train"):
        mb = await q.get("train", ["x"], 8, partition="p", timeout=10)  # queue: ~0.3 s
        await mb.materialize()
        time.sleep(0.2)  # compute
        await mb.write({"y": torch.ones(8)})  # a put inside a write: counted once
        await mb.ack()
    await task
    t = q.timings()["train"]
    assert t.blocks == 1 and t.calls == 4  # get, materialize, write, ack
    assert 0.25 < t.queue_seconds < t.seconds
    assert 0.15 < t.compute_seconds < 0.5
    assert 0 < t.queue_share < 1
    assert "train" in q.timings() and set(t.to_dict()) >= {"queue_seconds", "compute_seconds"}


@pytest.mark.parametrize("transport", ["embedded"], indirect=True)
async def test_the_wait_for_a_streams_next_batch_is_queue_time(make_queue):
    """The documented pattern: the block around the ``async for``, whose statement waits
    for each next batch (here ~0.3 s for the first) before the body runs."""
    q = make_queue(capacity=64)

    async def producer():
        await asyncio.sleep(0.3)  # the consumer waits for this in the async for
        await q.put({"x": torch.arange(8)}, partition="p")
        await q.seal("p")

    task = asyncio.ensure_future(producer())
    with q.timed("train"):
        async for mb in q.stream("train", ["x"], 8, partition="p"):
            await mb.materialize()
    await task
    t = q.timings()["train"]
    assert t.blocks == 1
    assert t.calls >= 3  # the first batch, its materialize, the end of the stream
    assert 0.25 < t.queue_seconds <= t.seconds
    assert t.queue_share > 0.5  # nothing but the queue in this block


async def test_tasks_started_in_a_timed_block_count_for_its_role(make_queue):
    q = make_queue(capacity=64)
    async with q.timed("env"):
        await asyncio.gather(*[q.put({"x": torch.arange(2)}, partition="p") for _ in range(3)])
    assert q.timings()["env"].calls == 3
    await q.put({"x": torch.arange(2)}, partition="p")  # outside: not counted
    assert q.timings()["env"].calls == 3


def test_a_role_needs_a_name():
    import streamrl

    with pytest.raises(InvalidArgument):
        streamrl.StreamQueue().timed("")
