"""Waking a waiting take only once its request can be met (issue 16): a row that becomes
deliverable wakes a subscription whose waiters want a batch of ``n`` only once it holds
``n`` rows, or once its partition (or the queue) is sealed or closed."""

from __future__ import annotations

import asyncio

import torch

import streamrl
from streamrl.controller import Controller, Request


def _put(c, n=1):
    tok = c.allocate("p", n, ("x",), nbytes=8 * n)
    c.commit(tok, {"x": [8] * n})


def test_a_subscription_wakes_once_a_batch_can_be_met():
    c = Controller(64, num_shards=2)
    req = Request("t", ("x",), 4, partition="p")
    assert c.take(req) is None
    key = req.sub_key()
    c.wake_at(key, 4)
    c.drain()
    for _ in range(3):
        _put(c)
        assert key not in c.drain()[2]  # 1, 2, 3 rows: no batch of 4 yet
    _put(c)
    assert key in c.drain()[2]  # 4 rows: a batch


def test_without_a_threshold_every_row_wakes():
    c = Controller(64, num_shards=2)
    req = Request("t", ("x",), 4, partition="p")
    assert c.take(req) is None
    c.drain()
    _put(c)
    assert req.sub_key() in c.drain()[2]


def test_a_sealed_partition_wakes_on_every_row():
    # a short last batch may go out once sealed: a field written to an existing row of a
    # sealed partition must wake the waiter even below its batch size
    c = Controller(64, num_shards=2)
    tok = c.allocate("p", 1, ("x",), nbytes=8)
    c.commit(tok, {"x": [8]})  # y not written yet: not deliverable for (x, y)
    c.seal("p")
    req = Request("t", ("x", "y"), 4, partition="p")
    assert c.take(req) is None
    key = req.sub_key()
    c.wake_at(key, 4)
    c.drain()
    w = c.begin_write([tok.rows[0]], ("y",))
    c.commit(w, {"y": [4]})
    assert key in c.drain()[2]
    d = c.take(req)
    assert d is not None and d is not streamrl.controller.END and d.rows == tok.rows


async def test_waiters_of_different_batch_sizes_on_one_subscription_are_served():
    async with streamrl.StreamQueue(capacity=64, num_shards=2) as q:
        big = asyncio.ensure_future(q.get("t", ["x"], 8, partition="p", timeout=30))
        small = asyncio.ensure_future(q.get("t", ["x"], 1, partition="p", timeout=30))
        await asyncio.sleep(0.05)
        await q.put({"x": torch.tensor([1])}, partition="p")
        got = await asyncio.wait_for(small, 10)  # woken at 1 row, not at 8
        assert len(got) == 1
        await got.ack()
        for i in range(8):
            await q.put({"x": torch.tensor([i])}, partition="p")
        got = await asyncio.wait_for(big, 10)
        assert len(got) == 8
        await got.ack()
