"""Storage backends (streamrl.storage): the interface on every built-in backend, the spill
backend's policy (budget, order, file space, arena blocks), state_dict round trips, and
the registry. A differential property test runs random operations on a memory unit and
on spilling units and asserts they hold the same data."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streamrl
from streamrl import storage
from streamrl.errors import InvalidArgument, RowsDropped, TransportError, UnknownField
from streamrl.storage import SpillUnit, StateChunk, StorageBackend, StorageUnit
from streamrl.wire import WireTensor

BACKENDS = {
    "memory": "memory",
    "spill-all": {"backend": "spill", "memory_bytes": 0},  # every tensor on disk
    "spill-tiny": {"backend": "spill", "memory_bytes": 100},  # some in memory, some not
}


@pytest.fixture(params=list(BACKENDS))
def make_unit(request, tmp_path):
    made: list[StorageBackend] = []

    def make(on_release=None):
        spec = BACKENDS[request.param]
        if isinstance(spec, dict):
            spec = {**spec, "dir": str(tmp_path)}
        u = storage.create_unit(spec, 0, on_release=on_release)
        made.append(u)
        return u

    yield make
    for u in made:
        u.close()
    assert os.listdir(tmp_path) == []  # the spill file was never visible


def rows_of(pieces: list) -> list:
    """Per-row values of the pieces of one field (ragged rows without their leading 1)."""
    out = []
    for p in pieces:
        if isinstance(p, list):
            out.extend(p)
        else:
            out.extend(p[i] for i in range(p.shape[0]))
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    return a == b


def check_get(u, rows, field, expected) -> None:
    got = rows_of(u.get(rows, [field])[field])
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, torch.Tensor) and isinstance(g, torch.Tensor) and g.dim() == e.dim() + 1:
            g = g[0]  # a ragged row keeps its leading 1
        assert same(g, e), (field, g, e)


# ---------------------------------------------------------------- the interface


def test_put_get_delete_on_every_backend(make_unit):
    u = make_unit()
    x = torch.arange(24, dtype=torch.float32).view(4, 6)
    ragged = [torch.arange(n, dtype=torch.int64) for n in (3, 1, 5, 2)]
    chat = [{"turns": ["hi"] * i} for i in range(4)]
    bf = torch.randn(4, 3).to(torch.bfloat16)
    u.put([10, 11, 12, 13], {"x": x, "resp": ragged, "chat": chat, "bf": bf[:, :2]})
    check_get(u, [10, 11, 12, 13], "x", list(x))
    check_get(u, [13, 11], "x", [x[3], x[1]])
    check_get(u, [12, 10], "resp", [ragged[2], ragged[0]])
    check_get(u, [11, 12], "chat", chat[1:3])
    check_get(u, [10, 13], "bf", [bf[0, :2], bf[3, :2]])  # a non-contiguous view was put
    assert u.fields_of([10, 12]) == ["bf", "chat", "resp", "x"]
    assert u.inventory() == {r: ["x", "resp", "chat", "bf"] for r in (10, 11, 12, 13)}
    held = u.stats()
    assert held[0] == 4 and held[1] == 4 * 24 + 8 * 11 + 4 * 2 * 2 + sum(
        storage.approx_size(c) for c in chat)
    assert sum(u.usage()[k] for k in ("memory", "disk")) == held[1]
    with pytest.raises(RowsDropped) as e:
        u.get([10, 99], ["x"])
    assert e.value.rows == [99]
    with pytest.raises(UnknownField, match="'nope'"):
        u.get([10], ["nope"])
    freed = 2 * 24 + 8 * (3 + 1) + 2 * 2 * 2 + sum(storage.approx_size(c) for c in chat[:2])
    assert u.delete([10, 11, 99]) == (2, freed) and u.stats() == (2, held[1] - freed)
    check_get(u, [12, 13], "resp", ragged[2:])
    assert u.delete([12, 13])[0] == 2 and u.stats() == (0, 0) and not u.segments
    assert u.usage()["memory"] == u.usage()["disk"] == 0


def test_deleting_runs_of_one_put_frees_each_tensor_once(make_unit):
    """Rows of one put deleted together, in parts, out of order, or with rows of other
    puts and fields that some rows lack: bytes and releases are counted exactly."""
    released = []
    u = make_unit(on_release=released.append)
    u.put([1, 2, 3, 4, 5, 6], {"x": torch.zeros(6, 4), "y": torch.zeros(6, 2, dtype=torch.int8)})
    u.put([7, 8], {"x": torch.ones(2, 4)})
    u.put([9], {"x": torch.ones(1, 4), "o": ["obj"]})
    mem = u.name == "memory"  # (a spilling backend hands tensors on when it spills them)
    assert u.delete([1, 2, 3]) == (3, 3 * (16 + 2)) and (released == [] or not mem)
    assert u.delete([5, 4, 7]) == (3, 2 * (16 + 2) + 16) and (released == [] or not mem)
    assert u.delete([6, 8, 9, 9, 42]) == (3, 16 + 2 + 16 + 16 + storage.approx_size("obj"))
    assert u.stats() == (0, 0) and not u.segments and (len(released) == 4 or not mem)
    u.put([10, 11], {"x": torch.zeros(2, 4)})
    assert u.delete([10, 11]) == (2, 32) and (len(released) == 5 or not mem)


def test_a_put_of_new_rows_and_a_put_that_repeats_a_row_are_both_counted_exactly(make_unit):
    u = make_unit()
    u.put([1, 2, 3], {"x": torch.arange(6).view(3, 2), "y": torch.zeros(3)})
    assert u.stats() == (3, 3 * 16 + 3 * 4)
    u.put([4, 4], {"x": torch.arange(4).view(2, 2)})  # the second value wins
    assert u.stats() == (4, 3 * 16 + 3 * 4 + 16)
    check_get(u, [4, 1], "x", [torch.tensor([2, 3]), torch.tensor([0, 1])])
    u.put([5, 6], {"x": torch.zeros(2, 2), "o": ["a", "b"]})  # not every field a tensor
    check_get(u, [6], "o", ["b"])
    assert u.delete([1, 2, 3, 4, 5, 6])[0] == 6 and u.stats() == (0, 0) and not u.segments


def test_replacing_a_field_frees_the_old_entry(make_unit):
    released = []
    u = make_unit(on_release=released.append)
    u.put([1, 2], {"x": torch.zeros(2, 8)})
    u.put([1], {"x": torch.ones(1, 8)})
    u.put([2], {"x": torch.full((1, 8), 2.0)})
    assert u.stats() == (2, 64) and len(released) >= 1
    check_get(u, [1, 2], "x", [torch.ones(8), torch.full((8,), 2.0)])
    u.delete([1, 2])
    assert u.stats() == (0, 0) and len(released) == 3  # every tensor put, once


def test_delete_fields_forgets_only_what_that_write_stored(make_unit):
    u = make_unit()
    u.put([1, 2], {"x": torch.zeros(2, 4)})
    u.put([1, 2], {"f": torch.full((2, 30), 2.0)}, write=2)  # the retry landed first
    u.delete_fields([1, 2], ["f"], write=1)  # then the undo of the cancelled write 1
    check_get(u, [1, 2], "f", [torch.full((30,), 2.0)] * 2)
    u.put([1, 2], {"f": torch.full((2, 30), 1.0)}, write=1)  # write 1's data, late
    check_get(u, [1, 2], "f", [torch.full((30,), 2.0)] * 2)
    assert u.forgotten([1, 2], 1) and not u.forgotten([1, 2], 2)
    assert u.delete_fields([1, 2], ["f"], write=2) == 2 * 30 * 4
    assert u.inventory() == {1: ["x"], 2: ["x"]} and u.stats() == (2, 32)
    u.put([1], {"g": ["a"]}, write=3)
    u.delete_fields([1], ["g"], write=3)
    assert u.inventory() == {1: ["x"], 2: ["x"]}
    assert u.delete_fields([1, 2], ["x"]) == 32 and u.inventory() == {1: [], 2: []}
    assert u.stats() == (2, 0) and u.usage()["disk"] == 0


def test_only_adds_says_whether_a_write_of_new_fields_replaces_nothing(make_unit):
    """only_adds(rows, fields): every row held, none holding any of the fields, for rows
    of a multi-row put (a run, where the backend keeps them so), of one-row puts, rows
    deleted since, and rows written since; a put it allowed is taken back whole by
    delete_fields with that put's write id."""
    u = make_unit()
    u.put([1, 2, 3], {"x": torch.zeros(3, 4)})
    u.put([10], {"x": torch.zeros(1, 4)})
    u.put([11], {"x": ["an object"]})
    assert u.only_adds([1, 2, 3, 10, 11], ["y", "z"])
    assert u.only_adds([], ["x"])
    assert not u.only_adds([1], ["x"]) and not u.only_adds([10], ["y", "x"])
    assert not u.only_adds([11], ["x"]) and not u.only_adds([3, 4], ["y"])  # (4: not held)
    before = u.inventory()
    u.put([1, 3, 10], {"y": torch.ones(3, 2)}, write=-5)
    assert not u.only_adds([3], ["y"]) and u.only_adds([2, 11], ["y"])
    u.delete_fields([1, 3, 10], ["y"], write=-5)
    assert u.inventory() == before and u.only_adds([1, 3, 10], ["y"])
    u.delete([2])
    assert not u.only_adds([2], ["y"]) and u.only_adds([1, 3], ["y"])


def test_a_backend_that_cannot_tell_says_a_write_may_replace():
    """StorageBackend.only_adds is False unless a backend says otherwise: a unit then
    has every small write go the usual way."""
    assert StorageBackend.only_adds(object(), [1], ["y"]) is False  # type: ignore[arg-type]


def test_rows_deleted_before_their_data_came_drop_it(make_unit):
    u = make_unit()
    u.delete([5, 6])  # not held: remembered as gone
    assert u.forgotten([5, 6])
    u.put([5, 6], {"x": torch.zeros(2, 64)})
    assert u.stats() == (0, 0) and u.inventory() == {}


# ---------------------------------------------------------------- spilling


def spill_unit(tmp_path, budget, **kw) -> SpillUnit:
    return SpillUnit(0, memory_bytes=budget, dir=str(tmp_path), **kw)


def on_disk(u: SpillUnit) -> set[int]:
    """Segment ids held on disk."""
    from streamrl.storage.spill import _OnDisk

    return {sid for sid, s in u.segments.items() if isinstance(s.tensor, _OnDisk)}


def test_spill_keeps_memory_within_budget_oldest_put_first(tmp_path):
    u = spill_unit(tmp_path, 1000)
    puts = [torch.full((2, 100), float(i)) for i in range(6)]  # 800 bytes each
    for i, t in enumerate(puts):
        u.put([2 * i, 2 * i + 1], {"x": t})
        assert u.usage()["memory_tensors"] <= 1000
    assert on_disk(u) == {1, 2, 3, 4, 5}  # all but the newest put
    assert u.usage() == {"memory": 800, "disk": 4000, "memory_tensors": 800, "file": 4000,
                         "bytes_spilled": 4000, "bytes_read_back": 0}
    for i, t in enumerate(puts):
        check_get(u, [2 * i + 1, 2 * i], "x", [t[1], t[0]])
    assert u.usage()["bytes_read_back"] == 4000
    got = u.get(list(range(12)), ["x"])["x"]
    assert len(got) == 6  # one read per put (a run of rows of one segment)
    u.put([100], {"x": torch.zeros(1, 2000)})  # bigger than the budget: to disk at once
    assert u.usage()["memory_tensors"] == 0 and u.usage()["disk"] == 4000 + 800 + 8000
    u.close()


def test_a_spill_writes_only_rows_still_held(tmp_path):
    u = spill_unit(tmp_path, 1 << 20)
    t = torch.arange(80, dtype=torch.float64).view(8, 10)
    u.put(list(range(8)), {"x": t, "y": torch.ones(8, 2)})
    u.delete([0, 3, 4, 7])
    u.delete_fields([5], ["x"])
    u.memory_bytes = 0
    u.put([50], {"z": torch.ones(1, 1)})  # over budget now: everything spills
    assert u.usage()["disk"] == u.usage()["file"] == 3 * 80 + 4 * 8 + 4  # x, y, z
    check_get(u, [1, 2, 6], "x", [t[1], t[2], t[6]])
    check_get(u, [6, 2], "x", [t[6], t[2]])
    assert len(u.get([1, 2, 6], ["x"])["x"]) == 2  # rows 1, 2 are a run; 6 another
    u.close()


def test_deleting_rows_frees_their_space_in_the_file(tmp_path):
    u = spill_unit(tmp_path, 0)
    for i in range(4):
        u.put([10 * i + j for j in range(4)], {"x": torch.full((4, 256), float(i))})
    size = lambda: os.fstat(u._fd).st_size  # noqa: E731
    assert u.usage()["file"] == size() == 4 * 4 * 1024
    u.delete([0, 1, 2, 3, 11, 12])  # the whole first put, two rows of the second
    assert u.usage()["disk"] == 10 * 1024 and size() == 16 * 1024  # holes, reused later
    u.put([100, 101], {"x": torch.full((2, 256), 9.0)})
    assert size() == 16 * 1024  # fits a freed hole
    u.delete([30, 31, 32, 33])  # the tail: the file shrinks
    assert size() == u.usage()["file"] < 16 * 1024
    check_get(u, [10, 13, 100, 101], "x",
              [torch.full((256,), 1.0)] * 2 + [torch.full((256,), 9.0)] * 2)
    u.delete(list(u.row_fields))
    assert size() == 0 and u.usage() == {**u.usage(), "memory": 0, "disk": 0, "file": 0}
    assert u._space.free == [] and u._space.end == 0
    assert os.listdir(tmp_path) == []
    fd = u._fd
    u.close()
    with pytest.raises(OSError):  # closed: the kernel frees the (unlinked) file
        os.fstat(fd)


def test_delete_fields_and_replacement_of_spilled_rows_free_the_file(tmp_path):
    u = spill_unit(tmp_path, 0)
    u.put([1, 2], {"x": torch.zeros(2, 100)}, write=7)
    u.delete_fields([1], ["x"], write=7)
    assert u.usage()["disk"] == 400
    u.put([2], {"x": torch.ones(1, 100)})  # replaces row 2's spilled entry
    assert u.usage()["disk"] == 400 and u.inventory() == {1: [], 2: ["x"]}
    check_get(u, [2], "x", [torch.ones(100)])
    u.delete([1, 2])
    assert u.usage()["file"] == 0 and u.stats() == (0, 0)
    u.close()


def test_spilled_tensors_keep_dtype_shape_and_device(tmp_path):
    u = spill_unit(tmp_path, 0)
    vals = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "bool": torch.rand(3, 4) > 0.5,
        "i8": torch.randint(-100, 100, (3, 2, 2), dtype=torch.int8),
        "c64": torch.randn(3, 2, dtype=torch.complex64),
        "nc": torch.arange(30.0).view(5, 6).t()[:3],  # non-contiguous
        "empty": torch.zeros(3, 0),
    }
    u.put([1, 2, 3], vals)
    for f, t in vals.items():
        (got,) = u.get([1, 2, 3], [f])[f]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), f
    assert u.usage()["memory_tensors"] == 0
    u.close()


class _Duck:
    """A tensor type the spill backend does not know how to turn into bytes."""

    def __init__(self, t):
        self.t, self.shape = t, t.shape

    def element_size(self):
        return self.t.element_size()

    def numel(self):
        return self.t.numel()

    def __getitem__(self, i):
        return _Duck(self.t[i])

    def unsqueeze(self, d):
        return _Duck(self.t.unsqueeze(d))


def test_tensors_that_cannot_be_spilled_stay_in_memory(tmp_path):
    u = spill_unit(tmp_path, 0)
    u.put([1, 2, 3], {"q": _Duck(torch.eye(3)), "d": torch.ones(3, 3)})
    assert u.usage()["disk"] == 36 and u.usage()["memory_tensors"] == 36
    (got,) = u.get([1, 2, 3], ["q"])["q"]
    assert torch.equal(got.t, torch.eye(3))
    u.close()


def test_a_failed_spill_keeps_the_rows_in_memory_and_retries(tmp_path, monkeypatch, caplog):
    u = spill_unit(tmp_path, 0)

    def full(data, pos):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(u, "_pwrite", full)
    with caplog.at_level(logging.WARNING, "streamrl"):
        u.put([1, 2], {"x": torch.ones(2, 8)})
    assert "could not spill" in caplog.text
    assert u.usage()["disk"] == 0 and u.usage()["file"] == 0 and u.usage()["memory_tensors"] == 64
    check_get(u, [1, 2], "x", [torch.ones(8)] * 2)
    monkeypatch.undo()
    u.put([3], {"x": torch.zeros(1, 8)})  # the next put spills both, oldest first
    assert u.usage()["disk"] == 96 and u.usage()["memory_tensors"] == 0
    check_get(u, [1, 2, 3], "x", [torch.ones(8)] * 2 + [torch.zeros(8)])
    u.close()


def test_reads_after_close_raise_a_clear_error(tmp_path):
    u = spill_unit(tmp_path, 0)
    u.put([1], {"x": torch.ones(1, 4)})
    u.close()
    u.close()  # idempotent
    with pytest.raises(TransportError, match="shut down"):
        u.get([1], ["x"])


def test_bad_options_are_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for spec, msg in [({"backend": "spill", "memory_bytes": -1}, "memory_bytes"),
                      ({"backend": "spill", "memory_bytes": True}, "memory_bytes"),
                      ({"backend": "spill", "dir": str(blocker)}, "writable directory"),
                      ({"backend": "spill", "memory_byte": 1}, "did you mean 'memory_bytes'"),
                      ({"backend": "spill", "dir": 3}, "dir must be a path")]:
        with pytest.raises(InvalidArgument, match=msg):
            storage.create_unit(spec, 0)


# ------------------------------------------------ Ray storage units' values (WireTensor)


def _wire(t: torch.Tensor) -> WireTensor:
    from streamrl import codec

    dtype, shape, buf = codec.tensor_to_raw(t)
    return WireTensor(dtype, t.element_size(), shape, buf)


def _wire_bytes(w: WireTensor) -> bytes:
    return w.inlined().buf.tobytes()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the arena needs memfd (Linux)")
def test_spill_of_arena_blocks_releases_them(tmp_path):
    """As the Ray storage-unit actor stores them: tensors written into blocks of its
    shared-memory arena (by reference), and inline ones; spilling releases the blocks."""
    from streamrl.arena import Arena

    arena = Arena(0, segment_bytes=1 << 20)
    released: list = []

    def on_release(t):
        released.append(t)
        if t.ref is not None:
            arena.free(t.ref)

    def by_ref(t: torch.Tensor) -> WireTensor:
        w = _wire(t)
        ref = arena.alloc(w.nbytes)
        arena.view(ref)[:w.nbytes] = w.buf
        return w.by_reference(ref).pinned(arena.view(ref))  # what the actor stores

    u = SpillUnit(0, on_release, memory_bytes=3000, dir=str(tmp_path))
    ts = [torch.randn(4, 250) for _ in range(3)]  # 4000 bytes each
    u.put([0, 1, 2, 3], {"x": by_ref(ts[0]), "o": [b"a", b"b", b"c", b"d"]})
    assert len(released) == 1 and arena.used == 0  # over budget: spilled, block freed
    u.put([4, 5, 6, 7], {"x": _wire(ts[1]), "r": [_wire(torch.ones(n)) for n in (1, 2, 3, 4)]})
    u.memory_bytes = 1 << 20
    u.put([8, 9, 10, 11], {"x": by_ref(ts[2])})
    assert arena.used >= 4000 and len(released) == 2
    pieces = u.get([1, 2, 5, 9], ["x"])["x"]
    got = b"".join(_wire_bytes(p) for p in pieces)
    want = b"".join(_wire_bytes(_wire(ts[i // 4][i % 4:i % 4 + 1])) for i in (1, 2, 5, 9))
    assert got == want
    assert all(isinstance(p, WireTensor) for p in pieces)
    spilled = pieces[0]
    assert spilled.ref is None and spilled.shape == (2, 250) and spilled.dtype == "float32"
    assert pieces[-1].ref is not None  # rows in memory: still a view of the block
    (r,) = u.get([6], ["r"])["r"]
    assert r.shape == (1, 3) and _wire_bytes(r) == _wire_bytes(_wire(torch.ones(1, 3)))
    st = u.state_dict()
    assert all(c.data.ref is None for c in st["chunks"] if isinstance(c.data, WireTensor))
    u.delete(list(range(12)))
    assert arena.used == 0 and u.stats() == (0, 0) and u.usage()["file"] == 0
    assert len(released) == 2 + 1 + 4  # each tensor put, once (the inline ones too)
    u.close()


def test_a_read_of_one_row_puts_comes_back_as_one_piece_a_field():
    """Each one-row put is a piece of its own in a read; the storage unit actor joins
    runs of small inline pieces of one dtype and row shape (one copy), keeping the rows,
    their order and their bytes; pieces of another kind end a run and stay as they are."""
    from streamrl.wire import JOIN_MAX, joined

    u = StorageUnit(0)
    rows = [torch.full((1, 4), i, dtype=torch.int64) for i in range(6)]
    wires = [_wire(r) for r in rows]
    for i, w in enumerate(wires):
        u.put([i], {"x": w, "o": [b"%d" % i]})
    pieces = u.get(list(range(6)), ["x", "o"])
    # a segment a put, each read as it was put (all of a tensor: no slice made)
    assert all(p is w for p, w in zip(pieces["x"], wires)) and len(pieces["x"]) == 6
    two = _wire(torch.arange(8).view(2, 4))
    assert two[0:2] is two and two[:2] is two and _wire_bytes(two[1:2]) == _wire_bytes(
        _wire(torch.arange(4, 8).view(1, 4)))
    (x,) = joined(pieces["x"])
    assert x.shape == (6, 4) and x.dtype == "int64" and x.ref is None
    assert _wire_bytes(x) == torch.cat(rows).numpy().tobytes()
    assert joined(pieces["o"]) == pieces["o"]  # (objects: one list already)
    # the order of a read is kept: rows 4, 1, 2 come back as one piece in that order
    (y,) = joined(u.get([4, 1, 2], ["x"])["x"])
    assert _wire_bytes(y) == torch.cat([rows[4], rows[1], rows[2]]).numpy().tobytes()

    f32 = _wire(torch.ones(1, 4))  # another dtype
    wide = _wire(torch.zeros(1, 5, dtype=torch.int64))  # another row shape
    big = _wire(torch.zeros(1, JOIN_MAX // 8 + 1, dtype=torch.int64))  # past JOIN_MAX
    # by reference (an arena block), with the unit's own view of it
    ref = _wire(rows[0]).by_reference(object()).pinned(_wire(rows[0]).buf)
    a, b = _wire(rows[0]), _wire(rows[1])
    got = joined([a, b, wide, f32, _wire(torch.ones(2, 4)), big, big, a, ref, b, [b"o"], a, b])
    assert [(p.shape, p.dtype) if isinstance(p, WireTensor) else p for p in got] == [
        ((2, 4), "int64"), ((1, 5), "int64"), ((3, 4), "float32"), ((1, 2049), "int64"),
        ((1, 2049), "int64"), ((1, 4), "int64"), ((1, 4), "int64"), ((1, 4), "int64"),
        [b"o"], ((2, 4), "int64")]
    assert got[1] is wide and got[3] is big and got[4] is big and got[5] is a
    assert got[6] is ref and got[7] is b
    assert got[2].buf.tobytes() == torch.ones(3, 4).numpy().tobytes()
    assert got[9].buf.tobytes() == torch.cat(rows[:2]).numpy().tobytes()
    assert joined([a]) == [a] and joined([]) == []


# ---------------------------------------------------------------- state_dict


def _fill(u):
    u.put([1, 2, 3, 4], {"x": torch.arange(12.0).view(4, 3),
                         "resp": [torch.arange(n) for n in (2, 0, 5, 1)],
                         "chat": [{"i": i} for i in range(4)]}, write=3)
    u.put([5, 6], {"x": torch.ones(2, 3), "chat": ["a", None]})
    u.put([2], {"x": torch.full((1, 3), 7.0)})  # replaces row 2's entry
    u.delete([3])
    u.delete_fields([6], ["x", "chat"])  # row 6 stays, with no field


@pytest.mark.parametrize("target", list(BACKENDS))
def test_state_dict_round_trips_to_any_backend(make_unit, target, tmp_path_factory):
    u = make_unit()
    _fill(u)
    st = u.state_dict()
    assert st["format"] == storage.STATE_FORMAT and st["backend"] in ("memory", "spill")
    assert st["rows"] == [1, 2, 4, 5, 6] and st["fields"] == {"x": 4, "resp": 3, "chat": 4}
    assert st["bytes"] == u.stats()[1]
    chunks = list(st["chunks"])
    assert all(isinstance(c, StateChunk) for c in chunks)
    assert sorted(r for c in chunks if c.field == "x" for r in c.rows) == [1, 2, 4, 5]
    assert {c.write for c in chunks if c.field == "resp"} == {3}
    spec = BACKENDS[target]
    v = storage.create_unit({**spec, "dir": str(tmp_path_factory.mktemp("b"))}
                            if isinstance(spec, dict)
                            else spec, 0)
    v.load_state_dict({**st, "chunks": iter(chunks)})
    assert v.inventory() == u.inventory() and v.stats() == u.stats()
    for f, rows in [("x", [1, 2, 4, 5]), ("resp", [1, 2, 4]), ("chat", [5, 1, 4, 2])]:
        assert all(same(a, b) for a, b in zip(rows_of(v.get(rows, [f])[f]),
                                              rows_of(u.get(rows, [f])[f])))
    with pytest.raises(InvalidArgument, match="holds 5 rows already"):
        v.load_state_dict(u.state_dict())
    v.delete([1, 2, 4, 5, 6])
    assert v.stats() == (0, 0)
    v.close()


def test_state_dict_chunks_are_bounded(tmp_path):
    u = spill_unit(tmp_path, 0)
    u.STATE_CHUNK_BYTES = 100
    u.STATE_CHUNK_OBJECTS = 3
    u.put(list(range(10)), {"x": torch.zeros(10, 10), "o": list(range(10))})  # 40 B a row
    chunks = list(u.state_dict()["chunks"])
    assert [len(c.rows) for c in chunks] == [2, 2, 2, 2, 2, 3, 3, 3, 1]
    assert all(c.data.shape == (len(c.rows), 10) for c in chunks if c.field == "x")
    u.close()


def test_load_state_dict_refuses_what_is_not_a_state():
    u = StorageUnit()
    with pytest.raises(InvalidArgument, match="format"):
        u.load_state_dict({"rows": []})
    with pytest.raises(InvalidArgument, match="format"):
        u.load_state_dict([])


# ---------------------------------------------------------------- the registry


def test_registry_names_backends_and_options():
    assert {"memory", "spill"} <= set(storage.available())
    with pytest.raises(InvalidArgument, match="registered backends: .*memory.*spill"):
        storage.create_unit("nope", 0)
    with pytest.raises(InvalidArgument, match="names no backend"):
        storage.create_unit({"memory_bytes": 3}, 0)
    with pytest.raises(InvalidArgument, match="'memory' has no option 'x'"):
        storage.create_unit({"backend": "memory", "x": 1}, 0)
    with pytest.raises(InvalidArgument, match="memory_bytes"):
        streamrl.StreamQueue(storage={"backend": "spill", "memory_bytes": 1.5, "dir": "/"})
    with pytest.raises(InvalidArgument, match="no option 'budget'"):
        streamrl.StreamQueue(storage={"backend": "spill", "budget": 1})
    with pytest.raises(InvalidArgument, match="did you mean 'memory_bytes'"):
        streamrl.StreamQueue.from_config({"storage": {"backend": "spill", "memory_byts": 1}})
    with pytest.raises(InvalidArgument, match="registered already"):
        storage.register("memory", lambda index, **kw: StorageUnit(index))
    with pytest.raises(InvalidArgument, match="not a streamrl.storage.StorageBackend"):
        storage.register("bad", lambda index, *, on_release=None: {})
        try:
            storage.create_unit("bad", 0)
        finally:
            storage.unregister("bad")
    u = storage.create_unit({"backend": "streamrl.storage.memory:create"}, 3)
    assert isinstance(u, StorageUnit) and u.index == 3


# ------------------------------------------- differential: spill == memory, whatever happens

_op = st.one_of(
    st.tuples(st.just("put"), st.integers(1, 4), st.integers(0, 40), st.sampled_from("abc")),
    st.tuples(st.just("ragged"), st.integers(1, 3), st.integers(0, 9), st.sampled_from("rs")),
    st.tuples(st.just("obj"), st.integers(1, 3), st.integers(0, 9), st.sampled_from("o")),
    st.tuples(st.just("delete"), st.integers(0, 30), st.integers(1, 4), st.just("")),
    st.tuples(st.just("undo"), st.integers(0, 30), st.integers(1, 20), st.sampled_from("abcro")),
    st.tuples(st.just("state"), st.just(0), st.just(0), st.just("")),
)


#: STREAMRL_STORAGE_EXAMPLES=N: N examples for each of this file's property tests (a
#: longer run). Run a long one with ``--timeout 0``: pytest-timeout's 120 s otherwise
#: interrupts whatever example is running, and hypothesis, which cannot make that example
#: fail again, reports it as a FlakyFailure ("failed on the first call but did not on a
#: subsequent one") of an example that is fine.
EXAMPLES = os.environ.get("STREAMRL_STORAGE_EXAMPLES")


@settings(max_examples=int(EXAMPLES or 60), deadline=None)
@given(st.lists(_op, min_size=1, max_size=40), st.sampled_from([0, 64, 300, 800, 2000]))
def test_spill_holds_what_memory_holds(tmp_path_factory, ops, budget):
    ref = StorageUnit(0)
    released = []
    u = SpillUnit(0, released.append, memory_bytes=budget,
                  dir=str(tmp_path_factory.mktemp("spill")))
    units = [ref, u]
    next_row, write = 0, 0
    for kind, n, size, field in ops:
        held = sorted(ref.inventory())
        write += 1
        if kind in ("put", "ragged", "obj"):
            # new rows, or (when there are some) a field of existing rows
            rows = (held[-n:] if held and size % 2 else list(range(next_row, next_row + n)))
            next_row = max(next_row, max(rows) + 1)
            if kind == "put":
                col = torch.randn(len(rows), size)
            elif kind == "ragged":
                col = [torch.randn(size + i) for i in range(len(rows))]
            else:
                col = [{"v": size + i} for i in range(len(rows))]
            for x in units:
                x.put(rows, {field: col}, write)
        elif kind == "delete":
            rows = [r for r in held if r % 5 == n % 5][:size + 1] + [10_000 + n]
            assert u.delete(rows) == ref.delete(rows)
        elif kind == "undo":
            rows = held[:n]
            w = write - size  # sometimes a write that stored some of these fields
            assert u.delete_fields(rows, [field], w) == ref.delete_fields(rows, [field], w)
        else:
            for x in units:
                st2 = x.state_dict()
                fresh = StorageUnit(0)
                fresh.load_state_dict(st2)
                assert fresh.inventory() == ref.inventory()
        assert u.inventory() == ref.inventory() and u.stats() == ref.stats()
        use = u.usage()
        assert use["memory"] + use["disk"] == u.stats()[1]
        assert use["memory_tensors"] <= budget and u._space.used == use["disk"]
        inv = ref.inventory()
        for f in list(ref.columns):
            rows = sorted(r for r, fs in inv.items() if f in fs)
            a = rows_of(ref.get(rows, [f])[f])
            b = rows_of(u.get(rows, [f])[f])
            assert all(same(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    rows = sorted(ref.inventory())
    assert u.delete(rows) == ref.delete(rows)
    assert u.stats() == (0, 0) and u.usage()["file"] == 0 and not u.segments
    assert u._mem == 0 and not u._lru and not u._origin
    u.close()


@pytest.mark.parametrize("where", ["embedded", pytest.param("ray", marks=pytest.mark.ray)])
async def test_stats_say_where_each_unit_keeps_its_bytes(where, tmp_path, request):
    """``stats().unit_usage`` is each unit's backend ``usage()``, from outside the package:
    with a spill budget of 256 bytes most rows go to disk, memory + disk add up to the
    unit's bytes, and a drained queue keeps nothing anywhere."""
    opts = {}
    if where == "ray":
        request.getfixturevalue("ray_session")
        opts = {"transport": "ray"}
    spec = {"backend": "spill", "memory_bytes": 256, "dir": str(tmp_path)}
    async with streamrl.StreamQueue(num_shards=2, storage=spec, **opts) as q:
        rows = await q.put({"x": torch.randn(64, 256)}, partition="p")
        st = await q.stats()
        assert len(st.unit_usage) == 2
        for use, held in zip(st.unit_usage, st.unit_bytes):
            assert use["memory"] + use["disk"] == held
            assert use["bytes_spilled"] >= use["disk"]
        assert sum(u["disk"] for u in st.unit_usage) > 64 * 256 * 4 - 2 * 256
        await q.drop(rows)
        st = await q.stats()
        assert [u["memory"] + u["disk"] for u in st.unit_usage] == [0, 0]


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12, dtype=torch.int64).reshape(3, 4)[1:],  # contiguous, offset
    lambda: torch.arange(12, dtype=torch.int32).reshape(3, 4)[:, 1:],  # strided: a copy
    lambda: torch.randn(3, dtype=torch.complex64).conj().imag,  # the negative bit
    lambda: torch.ones(2, 3, requires_grad=True),
    lambda: torch.zeros(0, 5),
    lambda: torch.tensor([[True, False]]),
    lambda: torch.randn(4, 2, dtype=torch.bfloat16),  # numpy has no bfloat16
    lambda: torch.randn(2, 2).half(),
], ids=["offset", "strided", "neg-bit", "grad", "empty", "bool", "bfloat16", "half"])
def test_wire_tensors_keep_their_bytes_through_pickle(make):
    """A tensor's raw bytes (numpy's view where it has one, else torch's) read back as the
    same tensor, and so does its WireTensor pickled with out-of-band buffers (the socket
    channel's way) and in band (a plain pickle), whose bytes are writable again."""
    import pickle

    from streamrl import codec

    t = make()
    want = t.detach().resolve_neg()
    w = _wire(t)
    assert w.buf is not None and w.buf.dtype == np.uint8 and w.buf.ndim == 1
    assert torch.equal(codec.tensor_from_raw(w.dtype, w.shape, w.buf), want)
    bufs: list = []
    body = pickle.dumps(w, protocol=5, buffer_callback=bufs.append)
    out_of_band = pickle.loads(body, buffers=[b.raw() for b in bufs])
    in_band = pickle.loads(pickle.dumps(w, protocol=5))
    for back in (out_of_band, in_band):
        assert (back.dtype, back.itemsize, back.shape, back.ref) == (w.dtype, w.itemsize,
                                                                      w.shape, None)
        assert torch.equal(codec.tensor_from_raw(back.dtype, back.shape, back.buf), want)
    assert in_band.buf.flags.writeable
    if t.numel():
        assert len(bufs) == 1  # the bytes went out of band, not into the pickle
    ref = pickle.loads(pickle.dumps(w.by_reference(("unit", 3))))
    assert ref.buf is None and ref.ref == ("unit", 3)


# ------------------------------ differential: runs == entries per row, whatever happens

class _PerRow(StorageUnit):
    runs = False  # (every put kept as entries per row: the reference)


#: (kind, a, b, flag): puts, reads and deletes of runs most often, and writes of a field
#: to the rows of one or two earlier puts (a later stage's field: new, or replacing one);
#: then rows put out of order or one at a time or as objects (never a run), writes of a
#: field to some rows, undone writes, checkpoints
_run_op = st.tuples(
    st.sampled_from(["put"] * 3 + ["read"] * 3 + ["delete"] * 3 + ["stage"] * 2
                    + ["odd", "write", "undo", "state"]),
    st.integers(0, 40), st.integers(1, 12), st.booleans())


def _outcome(fn):
    try:
        return "ok", fn()
    except (RowsDropped, UnknownField) as e:
        return type(e).__name__, getattr(e, "rows", None)


@settings(max_examples=int(EXAMPLES or 300), deadline=None)
@given(st.lists(_run_op, min_size=1, max_size=60), st.sampled_from([2, 8]))
def test_runs_hold_what_entries_per_row_hold(ops, min_split):
    """A unit that keeps puts of new rows as runs, against one that keeps an entry per
    row: random puts (runs and not), writes of fields to some rows, reads and deletes
    of consecutive ids (inside a run, across runs, over rows deleted or never put) and
    of ids out of order, undone writes and checkpoints; after every step both hold the
    same rows, fields, bytes and data, and read, delete and raise alike; the tensors
    they let go of are the same. ``min_split``: the fewest rows of a run a write splits
    off (2: runs split often)."""
    from streamrl.storage import memory

    was, memory._MIN_SPLIT = memory._MIN_SPLIT, min_split
    try:
        _runs_against_rows(ops)
    finally:
        memory._MIN_SPLIT = was


def _runs_against_rows(ops):
    rel_runs, rel_rows = [], []
    u, ref = StorageUnit(0, rel_runs.append), _PerRow(0, rel_rows.append)
    next_row, write = 0, 0
    puts: list[tuple[int, int]] = []  # (first row, rows) of each put of new rows
    for kind, a, b, flag in ops:
        write += 1
        held = sorted(ref.inventory())
        if kind == "stage":
            if not puts:
                continue
            i = a % len(puts)
            first, n = puts[i]
            if b % 4 == 1 and i + 1 < len(puts) and puts[i + 1][0] == first + n:
                n += puts[i + 1][1]  # (the rows of two puts, one after the other)
            elif b % 4 == 2 and n > 1:  # (its last rows)
                cut = 1 + a % (n - 1)
                first, n = first + cut, n - cut
            elif b % 4 == 3 and n > 1:  # (rows from inside it)
                cut = a % n
                first, n = first + cut, max(1, min(n - cut, 1 + b % 11))
            rows = list(range(first, first + n))
            col = torch.full((n, 3), float(write)) if flag else torch.arange(
                float(n)).view(n, 1) + write
            for x in (u, ref):
                x.put(rows, {"x" if flag else "w": col}, write)
        elif kind == "put":
            n = 1 + a % 9 if b < 9 else 8 + a % 24
            rows = list(range(next_row, next_row + n))
            puts.append((next_row, n))
            next_row += n + (b == 3)  # (an id no put used: deleted before its data came)
            cols = {"x": torch.randn(n, 3)}
            if flag:
                cols["y"] = torch.arange(n * 2, dtype=torch.int64).view(n, 2)
            for x in (u, ref):
                x.put(rows, dict(cols), write)
        elif kind == "odd":
            n = 1 + a % 4
            rows = list(range(next_row, next_row + n))[::-1]
            next_row += n
            col = [{"v": i} for i in rows] if flag else torch.randn(len(rows), 3)
            for x in (u, ref):
                x.put(rows, {"x": col}, write)
        elif kind == "write":
            rows = held[a % max(len(held), 1):][:b % 6 + 1]
            if not rows:
                continue
            col = torch.full((len(rows), 2), float(write), dtype=torch.float32)
            for x in (u, ref):
                x.put(rows, {"y" if flag else "z": col}, write)
        elif kind == "read":
            start = held[a % len(held)] - (a % 3 == 0) if held else a
            rows = list(range(start, start + (b if a % 2 else 1 + b % 3)))
            fields = ["x", "y"] if flag else ["x", "w"] if a % 3 == 0 else ["x"]
            got, want = _outcome(lambda: u.get(rows, fields)), _outcome(lambda: ref.get(rows, fields))
            assert got[0] == want[0] and (got[0] != "ok" or got[1].keys() == want[1].keys())
            if got[0] == "ok":
                for f in fields:
                    ga, wa = rows_of(got[1][f]), rows_of(want[1][f])
                    assert len(ga) == len(wa) and all(same(x, y) for x, y in zip(ga, wa))
            else:
                assert got[1] == want[1]
        elif kind == "delete":
            start = held[a % len(held)] - (a % 5 == 0) if held else a
            k = 1 if b % 2 else b if a % 4 == 1 else 1 + b % 3  # (mostly a part of a run)
            rows = list(range(start, start + k)) if flag else [
                r for r in held if r % 3 == a % 3][:b]
            assert u.delete(rows) == ref.delete(rows)
        elif kind == "undo":
            rows = held[a % max(len(held), 1):][:b % 6 + 1]
            w = write - b % 6
            assert u.delete_fields(rows, ["y"], w) == ref.delete_fields(rows, ["y"], w)
        else:
            fresh = StorageUnit(0)
            runs = sorted(u._by_first)
            fresh.load_state_dict(u.state_dict() if flag else ref.state_dict())
            assert sorted(u._by_first) == runs  # (a checkpoint leaves the runs as they were)
            inv = ref.inventory()
            assert fresh.inventory() == inv and fresh.stats() == ref.stats()
            for f in {f for fs in inv.values() for f in fs}:  # (and the same data)
                rows = [r for r, fs in sorted(inv.items()) if f in fs]
                got, want = rows_of(fresh.get(rows, [f])[f]), rows_of(ref.get(rows, [f])[f])
                assert len(got) == len(want) and all(same(x, y) for x, y in zip(got, want))
        assert u.inventory() == ref.inventory() and u.stats() == ref.stats()
        assert u.fields_of(held[:3]) == ref.fields_of(held[:3])
        assert sorted(map(id, rel_runs)) == sorted(map(id, rel_rows))
    rows = sorted(ref.inventory())
    assert u.delete(rows) == ref.delete(rows)
    assert u.stats() == (0, 0) and not u.segments and not u.columns and not u._starts
    assert sorted(map(id, rel_runs)) == sorted(map(id, rel_rows))


def test_a_write_to_rows_of_a_run_around_a_deleted_row_lands_on_those_rows():
    """A field written to rows of one run that skip a deleted row (two parts of the run,
    each long enough to be split off) lands on exactly those rows, and every row keeps
    its own data. (The second part was split from what the first split had left of the
    run: the run lost rows it held, and later reads and deletes saw the wrong ones.)"""
    from streamrl.storage import memory

    n = 5 * memory._MIN_SPLIT
    u = StorageUnit(0)
    x = torch.arange(float(n)).view(n, 1)
    u.put(list(range(n)), {"x": x})
    gap = 2 * memory._MIN_SPLIT
    u.delete([gap])
    rows = list(range(memory._MIN_SPLIT, gap)) + list(range(gap + 1, gap + 1 + memory._MIN_SPLIT))
    u.put(rows, {"z": torch.arange(float(len(rows))).view(-1, 1)})
    inv = u.inventory()
    assert sorted(inv) == [r for r in range(n) if r != gap]
    assert [r for r in sorted(inv) if "z" in inv[r]] == rows
    live = sorted(inv)
    assert torch.equal(torch.stack(rows_of(u.get(live, ["x"])["x"])), x[live])
    assert torch.equal(torch.stack(rows_of(u.get(rows, ["z"])["z"])),
                       torch.arange(float(len(rows))).view(-1, 1))
    held = u.stats()
    assert u.delete(live) == held and u.stats() == (0, 0)
    assert not u._starts and not u.segments


def test_a_checkpoint_of_runs_keeps_them_and_bounds_its_chunks():
    """A unit's state of rows kept as runs (one with rows deleted from its middle, one
    holding a field written to it whole later) names every live row and field, reads
    them in chunks of at most STATE_CHUNK_BYTES (views of what was put), loads into a
    unit of the other backend with the same data, and leaves the runs as runs."""
    u = StorageUnit(0)
    u.STATE_CHUNK_BYTES = 3 * 12  # (three rows of x a chunk)
    x = torch.arange(30.0).view(10, 3)
    u.put(list(range(10)), {"x": x}, write=1)
    u.put(list(range(10, 14)), {"x": torch.ones(4, 3)}, write=2)
    u.put(list(range(10, 14)), {"y": torch.arange(4)}, write=3)  # (the whole run)
    u.delete([3, 4, 8])
    runs = dict(u._by_first)
    assert sorted(runs) == [0, 10] and not u.row_fields
    st = u.state_dict()
    assert st["rows"] == [0, 1, 2, 5, 6, 7, 9, 10, 11, 12, 13]
    assert st["fields"] == {"x": 11, "y": 4} and st["bytes"] == u.stats()[1]
    chunks = list(st["chunks"])
    assert [(c.field, c.rows, c.write) for c in chunks] == [
        ("x", [0, 1, 2], 1), ("x", [5, 6, 7], 1), ("x", [9], 1),
        ("x", [10, 11, 12], 2), ("x", [13], 2), ("y", [10, 11, 12, 13], 3)]
    assert chunks[1].data.data_ptr() == x[5].data_ptr()  # (a view, no copy)
    assert u._by_first == runs and not u.row_fields  # (still runs)
    v = SpillUnit(0, memory_bytes=1 << 20)
    v.load_state_dict({**st, "chunks": iter(chunks)})
    assert v.inventory() == u.inventory() and v.stats() == u.stats()
    rows = st["rows"]
    want = torch.cat([x, torch.ones(4, 3)])[rows]
    assert torch.equal(torch.stack(rows_of(v.get(rows, ["x"])["x"])), want)
    assert torch.equal(torch.stack(rows_of(v.get(rows[-4:], ["y"])["y"])), torch.arange(4))
    v.close()


def test_a_run_is_read_and_deleted_without_entries_per_row():
    """A put of new rows with consecutive ids leaves no entry per row; reads and deletes
    of consecutive rows of it (a part, then the rest) keep it so, and free its tensor
    once; a write to one of its rows turns the run into entries per row."""
    released = []
    u = StorageUnit(0, released.append)
    x = torch.arange(12.0).view(4, 3)
    u.put([10, 11, 12, 13], {"x": x, "y": torch.arange(4)})
    assert not u.row_fields and not u.columns["x"] and u.stats() == (4, 4 * 12 + 4 * 8)
    (piece,) = u.get([11, 12], ["x"])["x"]
    assert piece.data_ptr() == x[1].data_ptr() and piece.shape == (2, 3)  # a view
    assert u.delete([11]) == (1, 20) and u.delete([10]) == (1, 20)  # (parts of it)
    assert not u.row_fields and released == [] and u.stats() == (2, 40)
    with pytest.raises(RowsDropped):
        u.get([11, 12], ["x"])
    assert u.delete([10, 11]) == (0, 0)  # (deleted already: nothing held)
    assert u.inventory() == {12: ["x", "y"], 13: ["x", "y"]}
    # rows of runs out of order, or twice: read and deleted as entries per row would be
    v = StorageUnit(0)
    v.put([0, 1, 2], {"x": torch.arange(3.0).view(3, 1)})
    v.put([5, 6], {"x": torch.arange(5.0, 7.0).view(2, 1)})
    assert [float(t) for p in v.get([6, 0, 0, 1], ["x"])["x"] for t in p] == [6, 0, 0, 1]
    assert [float(t) for p in v.get([1, 2, 5], ["x"])["x"] for t in p] == [1, 2, 5]
    assert v.delete([2, 2, 5]) == (2, 8) and v.stats() == (3, 12)
    assert v.inventory() == {0: ["x"], 1: ["x"], 6: ["x"]}
    # a later stage's field of the rows of two puts (whole runs): kept in the runs, one
    # tensor for both; written again, the first tensor is released
    w = StorageUnit(0, released.append)
    w.put([0, 1, 2], {"x": torch.zeros(3, 1)})
    w.put([3, 4], {"x": torch.zeros(2, 1)})
    r1 = torch.arange(5.0).view(5, 1)
    w.put([0, 1, 2, 3, 4], {"r": r1})
    assert not w.row_fields and w.stats() == (5, 5 * 8)
    assert [float(t) for p in w.get([2, 3, 4], ["r"])["r"] for t in p] == [2, 3, 4]
    w.put([0, 1, 2, 3, 4], {"r": r1 + 10})
    assert any(t is r1 for t in released) and w.stats() == (5, 5 * 8)
    assert [float(t) for p in w.get([1, 2, 3], ["r"])["r"] for t in p] == [11, 12, 13]
    del released[:]
    # a field written to a part of a run (8 rows or more) splits it, its deleted rows
    # staying deleted on either side
    v = StorageUnit(0)
    v.put(list(range(32)), {"x": torch.arange(32.0).view(32, 1)})
    assert v.delete([3]) == (1, 4) and v.delete([20]) == (1, 4)
    v.put(list(range(8, 16)), {"r": torch.ones(8, 1)})
    assert v._starts == [0, 8, 16] and not v.row_fields and v.stats() == (30, 30 * 4 + 8 * 4)
    assert sorted(v.inventory()) == [r for r in range(32) if r not in (3, 20)]
    assert [float(t) for p in v.get([16, 17, 18, 19], ["x"])["x"] for t in p] == [16, 17, 18, 19]
    assert v.delete(list(range(21, 32))) == (11, 44) and v._starts == [0, 8, 16]
    for gone in ([3], [20], [19, 20]):  # (a read that fails: entries per row from here)
        with pytest.raises(RowsDropped):
            v.get(gone, ["x"])
    assert v.delete(list(range(16, 21))) == (4, 16) and v._starts == [8]
    assert v.delete(list(range(8))) == (7, 28) and v.stats() == (8, 8 * 8)
    u.put([13], {"z": torch.ones(1, 2)})  # a field of one of its rows: entries per row
    assert u.row_fields == {12: 2, 13: 3} and not u._starts
    assert u.delete([12, 13]) == (2, 2 * 20 + 8) and len(released) == 3
    assert u.stats() == (0, 0) and not u.columns
