"""Recipe (docs/storage.md, "Write a storage backend"), from outside the package: a
dict-of-rows backend defined here, registered, and a queue run on it through put /
stream / materialize / write / drop with nothing left behind."""

from __future__ import annotations

import torch

import streamrl
import streamrl.storage
from streamrl.errors import RowsDropped, UnknownField
from streamrl.storage import (STATE_FORMAT, StateChunk, StorageBackend, StorageCaps,
                              StorageUnit, approx_size)


class DictStorage(StorageBackend):
    """Every entry in a dict: field -> row -> (piece, bytes, write, tensor put). A read
    returns one piece per row (the queue joins them)."""

    name = "dict"
    caps = StorageCaps(zero_copy_reads=True)

    def __init__(self, index=0, *, on_release=None):
        self.index, self.on_release = index, on_release
        self.cols: dict[str, dict[int, tuple]] = {}
        self.held: set[int] = set()
        self.users: dict[int, list] = {}  # id(tensor put) -> [tensor, entries using it]
        self.gone: set[int] = set()  # (unbounded here; the built-ins keep the last 65536)
        self.aborted: set[int] = set()

    def forgotten(self, rows, write=0):
        return (bool(rows) and rows[0] in self.gone) or write in self.aborted

    def put(self, rows, columns, write=0):
        if self.forgotten(rows, write):
            return
        self.held.update(rows)
        for f, col in columns.items():
            store = self.cols.setdefault(f, {})
            for i, r in enumerate(rows):
                if not isinstance(col, list):  # a tensor: rows first
                    piece, src = col[i:i + 1], col
                elif hasattr(col[i], "shape"):  # a ragged row: one tensor
                    piece = src = col[i].unsqueeze(0)
                else:  # a Python object
                    piece, src = [col[i]], None
                size = approx_size(col[i]) if src is None else piece.element_size() * piece.numel()
                if src is not None:
                    self.users.setdefault(id(src), [src, 0])[1] += 1
                self._forget(store, r)
                store[r] = (piece, size, write, src)

    def _forget(self, store, r):
        old = store.pop(r, None)
        if old is None:
            return 0
        if old[3] is not None:  # the last entry of a tensor put: release it
            user = self.users[id(old[3])]
            user[1] -= 1
            if not user[1]:
                del self.users[id(old[3])]
                if self.on_release is not None:
                    self.on_release(old[3])
        return old[1]

    def get(self, rows, fields):
        missing = [r for r in rows if r not in self.held]
        if missing:
            raise RowsDropped(f"rows {missing} are not held by unit {self.index}", missing)
        out = {}
        for f in fields:
            store = self.cols.get(f, {})
            if any(r not in store for r in rows):
                raise UnknownField(f"field {f!r} is not written for all of rows {rows}")
            out[f] = [store[r][0] for r in rows]
        return out

    def delete(self, rows):
        n = nbytes = 0
        for r in rows:
            if r not in self.held:
                self.gone.add(r)
                continue
            self.held.discard(r)
            n += 1
            nbytes += sum(self._forget(store, r) for store in self.cols.values())
        return n, nbytes

    def delete_fields(self, rows, fields, write=0):
        if write:
            self.aborted.add(write)
        nbytes = 0
        for f in fields:
            store = self.cols.get(f, {})
            for r in rows:
                if r in store and (not write or store[r][2] == write):
                    nbytes += self._forget(store, r)
        return nbytes

    def inventory(self):
        return {r: [f for f, st in self.cols.items() if r in st] for r in self.held}

    def fields_of(self, rows):
        return sorted(f for f, st in self.cols.items() if all(r in st for r in rows))

    def stats(self):
        return len(self.held), sum(e[1] for st in self.cols.values() for e in st.values())

    def state_dict(self):
        return {"format": STATE_FORMAT, "backend": self.name, "index": self.index,
                "rows": sorted(self.held), "bytes": self.stats()[1],
                "fields": {f: len(st) for f, st in self.cols.items()},
                "chunks": (StateChunk(f, [r], e[0], e[2])
                           for f, st in self.cols.items() for r, e in st.items())}

    def load_state_dict(self, state):
        for c in state["chunks"]:
            self.put(c.rows, {c.field: c.data})
        self.held.update(state["rows"])


streamrl.storage.register("dict", DictStorage, replace=True)


async def test_a_queue_runs_on_a_backend_registered_from_outside():
    released = []

    def make(index, *, on_release=None):
        return DictStorage(index, on_release=lambda t: (released.append(t), on_release
                                                        and on_release(t)))

    streamrl.storage.register("dict-counted", make, replace=True)
    try:
        async with streamrl.StreamQueue(capacity=64, num_shards=2, storage="dict-counted") as q:
            assert all(isinstance(u, DictStorage) for u in q._data.units)
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
            assert all(not u.users and not u.cols.get("prompt") for u in q._data.units)
        assert len(released) >= 2 + 24 + 4
        assert len({id(t) for t in released}) == len(released)
    finally:
        streamrl.storage.unregister("dict-counted")


def test_the_recipe_backend_holds_what_the_memory_backend_holds():
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
