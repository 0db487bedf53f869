"""The recipe of docs/sampling.md, done from outside the package: the page's own block
runs (a "longest first" sampler, registered by name, streamed with), then the stream is
checked again, with groups and beside a per-request sampler."""

from __future__ import annotations

import pytest
import torch

import streamrl
from streamrl.sampling import BalancedSampler

from ._docs import load_recipe


@pytest.fixture(scope="module")
def longest():
    """The page's sampler: its block runs as it is (registering "longest" and streaming
    with it)."""
    mod = load_recipe("sampling.md", "sampler")
    assert issubclass(mod.LongestFirst, BalancedSampler)
    assert "longest" in streamrl.sampling.available()
    yield "longest"
    streamrl.sampling.unregister("longest")


async def test_a_sampler_written_outside_streamrl_orders_the_stream(longest):
    lengths = torch.tensor([5, 90, 12, 40, 7, 64])
    async with streamrl.StreamQueue(capacity=64, num_shards=2, sampler=longest) as q:
        await q.put({"idx": torch.arange(6), "length": lengths}, partition="p")
        await q.seal("p")
        got = [(await mb.materialize())["idx"].tolist()
               async for mb in q.stream("train", ["idx"], 2, partition="p")]
    assert got == [[1, 5], [3, 2], [4, 0]]


async def test_it_keeps_groups_whole_and_yields_to_a_per_request_sampler(longest):
    async with streamrl.StreamQueue(capacity=64, num_shards=2) as q:  # queue default: fifo
        await q.put({"idx": torch.arange(6), "uid": torch.tensor([0, 0, 1, 1, 2, 2]),
                     "length": torch.tensor([3, 8, 50, 1, 9, 9])}, partition="p")
        await q.seal("p")
        got = [(await mb.materialize())["idx"].tolist()
               async for mb in q.stream("train", ["idx"], 2, partition="p", group_by="uid",
                                        group_size=2, sampler=longest)]
        fifo = [(await mb.materialize())["idx"].tolist()
                async for mb in q.stream("eval", ["idx"], 2, partition="p")]
    assert got == [[2, 3], [4, 5], [0, 1]]
    assert fifo == [[0, 1], [2, 3], [4, 5]]
