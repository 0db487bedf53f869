"""The "write a transport" recipe of docs/transports.md, done from outside the package:
its code runs as it is in the docs (registering the "hop" transport and using it), then
the transport goes through the checks every transport must pass."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

import streamrl
from streamrl.errors import EndOfStream

from ._docs import load_recipe


@pytest.fixture(scope="module")
def recipe():
    mod = load_recipe("transports.md", "transport")  # runs the page's own example too
    yield mod
    streamrl.transport.unregister("hop")


def test_the_recipe_registers_a_transport(recipe):
    assert "hop" in streamrl.transport.available()
    q = streamrl.StreamQueue(transport="hop", capacity=8)
    assert q.transport == "hop" and isinstance(q.session.transport, recipe.HopTransport)


async def test_cancelled_calls_on_the_recipe_transport_leave_nothing(recipe):
    """Cancel puts, writes and gets at random points of their hops, retry, and check that
    every row arrives once with its field, nothing leaks and the planes agree."""
    rng = random.Random(3)
    async with streamrl.StreamQueue(transport="hop", delay=0.0005, capacity=512,
                                    num_shards=3) as q:
        for i in range(40):
            data = {"idx": torch.tensor([i]), "x": torch.zeros(1, 4)}
            t = asyncio.ensure_future(q.put(data, partition="p"))
            await asyncio.sleep(rng.choice([0, 0.0003, 0.0008, 0.002]))
            t.cancel()
            try:
                rows = await t
            except asyncio.CancelledError:
                rows = await q.put(data, partition="p")
            t = asyncio.ensure_future(q.put({"f": torch.full((1,), float(i))}, rows=rows))
            await asyncio.sleep(rng.choice([0, 0.0003, 0.0008, 0.002]))
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                await q.put({"f": torch.full((1,), float(i))}, rows=rows)
        await q.seal("p")
        seen = []
        while True:
            t = asyncio.ensure_future(q.get("t", ["idx", "f"], 4, partition="p", timeout=10))
            await asyncio.sleep(rng.choice([0, 0.0003, 0.002, 0.01]))
            t.cancel()
            try:
                mb = await t
            except asyncio.CancelledError:
                continue  # a cancelled get leaves no lease behind: the rows come again
            except EndOfStream:
                break
            td = await mb.materialize()
            assert torch.equal(td["f"], td["idx"].float())
            seen += td["idx"].tolist()
            await mb.drop()
        assert sorted(seen) == list(range(40))
        st = await q.stats()
        assert st.rows == 0 and st.bytes == 0 and st.leases == 0
        assert await q.audit() == []


@pytest.mark.parametrize("op", ["ack", "release", "drop"])
async def test_a_cancelled_ack_release_or_drop_strands_no_lease(recipe, op):
    """ack/release/drop run to the end even when their task is cancelled mid-call (a
    cancelled ack that left the lease open would hold the rows until lease_timeout)."""
    async with streamrl.StreamQueue(transport="hop", delay=0.01, capacity=64) as q:
        await q.put({"x": torch.arange(4)}, partition="p")
        mb = await q.get("t", ["x"], 4, partition="p")
        t = asyncio.ensure_future(getattr(mb, op)())
        await asyncio.sleep(0.002)  # in the middle of its hop
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        st = await q.stats()
        assert st.leases == 0 and not mb.leased
        assert st.tasks["t"].acked == (4 if op == "ack" else 0)
