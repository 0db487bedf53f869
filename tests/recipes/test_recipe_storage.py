"""Recipe (docs/storage.md, "Write a storage backend"), from outside the package: the
page's own block runs (it defines a dict-of-rows backend, registers it and runs a queue on
it), then the backend goes through put / stream / materialize / write / drop with
nothing left behind, and is checked against the built-in one."""

from __future__ import annotations

import pytest
import torch

import streamrl
import streamrl.storage
from streamrl.storage import StorageUnit

from ._docs import load_recipe


@pytest.fixture(scope="module")
def DictStorage():
    """The page's DictStorage: its block runs as it is (registering "dict" and running a
    queue on it)."""
    mod = load_recipe("storage.md", "storage")
    assert "dict" in streamrl.storage.available()
    yield mod.DictStorage
    streamrl.storage.unregister("dict")


async def test_a_queue_runs_on_a_backend_registered_from_outside(DictStorage):
    released = []

    def make(index, *, on_release=None):
        return DictStorage(index, on_release=lambda t: (released.append(t), on_release
                                                        and on_release(t)))

    streamrl.storage.register("dict-counted", make, replace=True)
    try:
        async with streamrl.StreamQueue(capacity=64, num_shards=2, storage="dict-counted") as q:
            assert all(isinstance(u, DictStorage) for u in q.session.data.units)
            prompts = torch.arange(32).view(16, 2)
            await q.put({"prompt": prompts, "uid": [f"u{i // 4}" for i in range(16)]},
                        partition="s")
            await q.put({"prompt": prompts[:8] + 100, "uid": ["x"] * 8}, partition="s")
            await q.seal("s")
            seen = []
            async for mb in q.stream("gen", fields=["prompt", "uid"], batch_size=6,
                                     partition="s"):
                td = await mb.materialize()
                resp = [torch.arange(int(p[0]) % 5 + 1) for p in td["prompt"]]
                await mb.write({"resp": resp, "score": td["prompt"].sum(1).float()})
                seen += td["prompt"][:, 0].tolist()
            assert sorted(seen) == sorted(prompts[:, 0].tolist() + (prompts[:8, 0] + 100).tolist())
            assert await q.audit() == []  # the controller and the units agree
            async for mb in q.stream("train", fields=["resp", "score"], batch_size=8,
                                     partition="s"):
                td = await mb.materialize()
                assert td["score"].shape == (len(mb),)
                await mb.drop()
            st = await q.stats()
            assert (st.rows, st.bytes, sum(st.unit_rows), sum(st.unit_bytes)) == (0, 0, 0, 0)
            # every tensor put was released once no row referred to it: 2 prompt puts,
            # 24 ragged resp rows, and the score columns (one per batch and unit)
            assert all(not u.users and not u.cols.get("prompt") for u in q.session.data.units)
        assert len(released) >= 2 + 24 + 4
        assert len({id(t) for t in released}) == len(released)
    finally:
        streamrl.storage.unregister("dict-counted")


def test_the_recipe_backend_holds_what_the_memory_backend_holds(DictStorage):
    """Check a new backend against the built-in one, operation by operation."""
    units = [DictStorage(0), StorageUnit(0)]
    for u in units:
        u.put([1, 2, 3], {"x": torch.arange(6.0).view(3, 2), "o": ["a", {"b": 1}, None]},
              write=1)
        u.put([2, 3], {"r": [torch.ones(3), torch.ones(1)]}, write=2)
        u.delete_fields([2, 3], ["r"], write=9)  # another write's undo: keeps r
        u.put([2, 3], {"r": [torch.zeros(2), torch.zeros(2)]}, write=9)  # late: dropped
        u.delete([1, 7])
    a, b = units
    assert a.inventory() == b.inventory() and a.stats() == b.stats()
    assert a.fields_of([2, 3]) == b.fields_of([2, 3]) == ["o", "r", "x"]
    for f in ("x", "o", "r"):
        ga = [x for p in a.get([3, 2], [f])[f] for x in (p if isinstance(p, list) else p)]
        gb = [x for p in b.get([3, 2], [f])[f] for x in (p if isinstance(p, list) else p)]
        assert all((torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)
                   for x, y in zip(ga, gb))
    fresh = DictStorage(1)
    fresh.load_state_dict(b.state_dict())  # any backend's state loads into any other
    assert fresh.inventory() == b.inventory() and fresh.stats() == b.stats()
    assert a.delete([2, 3]) == b.delete([2, 3])
