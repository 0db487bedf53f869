"""Views over variable-length (jagged) fields.

A field put as a list of per-row tensors of different shapes (``[L_i]`` or ``[L_i, 3]``)
materializes to a jagged nested tensor. Every view of such a batch -- int / list / bool
mask / slice indexing, ``repeat``, ``repeat_interleave``, ``split``, ``chunk``,
``concat`` and lazy columns -- must materialize to the same rows, whether the field was
fetched before (the view reads the cache) or not (the view fetches, from one or several
storage units).

The reference for a view is the list of per-row tensors picked by the same positions,
compared row by row; the regular fields are compared against a plain TensorDict indexed
the same way. The rule checked for the jagged field: the column is a dense tensor when
the picked rows all have one shape (also for zero rows: a ``[0, 0, *rest]`` tensor) and a
jagged nested tensor otherwise -- the same whether read from the cache or fetched.

On the Ray transports the tests run with the 2-d field only (``on_ray``, see
tests/conftest.py): the 1-d one takes the same wire path, and each Ray test starts its
actor processes.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

import streamrl
from streamrl import BatchProxy, ColumnRemoteBatch, RowRemoteBatch

pytestmark = pytest.mark.timeout(60)

LENGTHS = [3, 5, 0, 4, 3, 3, 2, 5, 1, 3]  # rows 0, 4, 5, 9 share a length
PUTS = [(0, 4), (4, 7), (7, 10)]  # three puts: three storage units when num_shards=3
N = len(LENGTHS)


def jag_rows(kind: str) -> list[torch.Tensor]:
    """Row ``i`` of the jagged field: ``[L_i]`` int64 or ``[L_i, 3]`` float32."""
    if kind == "1d":
        return [torch.arange(L, dtype=torch.int64) + 100 * i for i, L in enumerate(LENGTHS)]
    return [torch.arange(3 * L, dtype=torch.float32).reshape(L, 3) + 100 * i
            for i, L in enumerate(LENGTHS)]


def source(kind: str) -> tuple[TensorDict, list[torch.Tensor], list[str]]:
    idx = torch.arange(N)
    td = TensorDict({"idx": idx, "x": idx.float().unsqueeze(1) * torch.tensor([1.0, -1.0])},
                    batch_size=[N])
    return td, jag_rows(kind), [f"t{i}" for i in range(N)]


async def fill(q: streamrl.StreamQueue, kind: str, partition: str = "p"):
    td, jag, txt = source(kind)
    for a, b in PUTS:
        await q.put({"idx": td["idx"][a:b], "x": td["x"][a:b], "resp": jag[a:b], "txt": txt[a:b]},
                    partition=partition)
    await q.seal(partition)
    return td, jag, txt


async def order_of(mb: RowRemoteBatch) -> list[int]:
    """The source row of each batch row, read through a pickled copy (a fresh cache, so
    ``mb`` stays cold)."""
    twin = pickle.loads(pickle.dumps(mb))
    return (await twin.materialize(["idx"]))["idx"].tolist()


def check_jagged(got, rows: list[torch.Tensor], what: str) -> None:
    """``got`` holds exactly ``rows``: dense when they share a shape, jagged otherwise."""
    assert isinstance(got, torch.Tensor), f"{what}: a {type(got).__name__}, not a tensor"
    dtype = rows[0].dtype if rows else None
    if not rows:
        assert not got.is_nested and got.shape[0] == 0, f"{what}: {got.shape} for zero rows"
        return
    assert got.dtype == dtype, f"{what}: dtype {got.dtype} != {dtype}"
    if len({r.shape for r in rows}) == 1:
        assert not got.is_nested, f"{what}: rows of one shape should be a dense tensor"
        assert torch.equal(got, torch.stack(rows)), f"{what}: {got} != {rows}"
        return
    assert got.is_nested and got.layout == torch.jagged, f"{what}: expected a jagged tensor"
    assert got.shape[0] == len(rows), f"{what}: {got.shape[0]} rows != {len(rows)}"
    got_rows = got.unbind()
    for j, (g, e) in enumerate(zip(got_rows, rows)):
        assert g.shape == e.shape and torch.equal(g, e), f"{what}: row {j}: {g} != {e}"


def check_td(td: TensorDictBase, src: TensorDict, jag: list, txt: list, pos: list[int],
             what: str, fields=("idx", "x", "resp", "txt")) -> None:
    """A materialized view of source rows ``pos`` (a list of rows)."""
    assert td.batch_size == torch.Size([len(pos)]), f"{what}: batch_size {td.batch_size}"
    exp = src[torch.tensor(pos, dtype=torch.long)]
    for f in ("idx", "x"):
        if f in fields:
            assert torch.equal(td[f], exp[f]), f"{what}[{f!r}]: {td[f]} != {exp[f]}"
    if "resp" in fields:
        check_jagged(td.get("resp"), [jag[p] for p in pos], f"{what}['resp']")
    if "txt" in fields:
        assert list(td["txt"]) == [txt[p] for p in pos], f"{what}['txt']"


def check_row(td: TensorDictBase, src, jag, txt, p: int, what: str) -> None:
    """A materialized int-index view (0-d): source row ``p``."""
    assert td.batch_size == torch.Size([]), f"{what}: batch_size {td.batch_size}"
    assert td["idx"].item() == p and torch.equal(td["x"], src["x"][p]), what
    r = td["resp"]
    assert not r.is_nested and r.dtype == jag[p].dtype and torch.equal(r, jag[p]), f"{what}: {r}"
    assert td["txt"] == txt[p], what


# Each view op: (make the view from a batch of m rows, the positions it picks).
def _mask(m):
    return [i % 3 != 1 for i in range(m)]


VIEWS = {
    "list": (lambda b: b[[7, 0, 0, 3, 9]], lambda m: [7, 0, 0, 3, 9]),
    "same_shape_list": (lambda b: b[[0, 4, 5, 9]], lambda m: [0, 4, 5, 9]),
    "long": (lambda b: b[torch.tensor([8, 1, 2])], lambda m: [8, 1, 2]),
    "mask": (lambda b: b[torch.tensor(_mask(len(b)))], lambda m: [i for i in range(m) if _mask(m)[i]]),
    "mask_list": (lambda b: b[_mask(len(b))], lambda m: [i for i in range(m) if _mask(m)[i]]),
    "slice": (lambda b: b[2:8], lambda m: list(range(m))[2:8]),
    "slice_step": (lambda b: b[1::3], lambda m: list(range(m))[1::3]),
    "slice_back": (lambda b: b[::-2], lambda m: list(range(m))[::-2]),
    "slice_one": (lambda b: b[3:4], lambda m: [3]),
    "same_shape_slice": (lambda b: b[4:6], lambda m: [4, 5]),
    "all": (lambda b: b[:], lambda m: list(range(m))),
    "repeat": (lambda b: b.repeat(2), lambda m: list(range(m)) * 2),
    "repeat_interleave": (lambda b: b.repeat_interleave(3), lambda m: [i for i in range(m) for _ in range(3)]),
    "split_0": (lambda b: b.split(4)[0], lambda m: list(range(4))),
    "split_1": (lambda b: b.split(4)[1], lambda m: list(range(4, 8))),
    "split_last": (lambda b: b.split(4)[-1], lambda m: list(range(8, m))),
    "split_sizes": (lambda b: b.split([2, 0, 5, 3])[2], lambda m: list(range(2, 7))),
    "chunk_1": (lambda b: b.chunk(3)[1], lambda m: list(range(4, 8))),
    "nested": (lambda b: b[1:9][[5, 0, 2]][::-1], lambda m: [3, 1, 6]),
    "mixed_chain": (lambda b: b.repeat(2)[7:14].split(3)[1], lambda m: (list(range(m)) * 2)[10:13]),
    "empty_slice": (lambda b: b[4:4], lambda m: []),
    "empty_list": (lambda b: b[[]], lambda m: []),
    "empty_mask": (lambda b: b[[False] * len(b)], lambda m: []),
    "empty_repeat": (lambda b: b.repeat(0), lambda m: []),
    "empty_split": (lambda b: b.split([0, len(b)])[0], lambda m: []),
}


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.on_ray(kind="2d")
@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("warm", ["cold", "warm"])
async def test_views_of_a_jagged_field(make_queue, kind, shards, warm):
    q = make_queue(num_shards=shards)
    src, jag, txt = await fill(q, kind)
    mb = await q.get("t", ["idx", "x", "resp", "txt"], batch_size=N, partition="p", timeout=5)
    order = await order_of(mb)
    if shards > 1:
        assert len(set(mb.shards)) > 1  # the batch spans storage units
    if warm == "warm":
        full = await mb.materialize()
        check_td(full, src, jag, txt, order, "mb")
    for name, (make, positions) in VIEWS.items():
        pos = [order[i] for i in positions(len(mb))]
        view = make(mb)
        # the first read may fetch (cold) or read the batch's cache (warm); the second
        # read is served by the cache in both cases
        check_td(await view.materialize(), src, jag, txt, pos, name)
        check_td(await view.materialize(), src, jag, txt, pos, name + " (again)")
        check_jagged(await view["resp"].materialize(), [jag[p] for p in pos], name + "['resp']")
    await mb.ack()


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.on_ray(kind="2d")
@pytest.mark.parametrize("warm", ["cold", "warm"])
async def test_int_index_gives_the_single_row(make_queue, kind, warm):
    q = make_queue(num_shards=3)
    src, jag, txt = await fill(q, kind)
    mb = await q.get("t", ["idx", "x", "resp", "txt"], batch_size=N, partition="p", timeout=5)
    order = await order_of(mb)
    if warm == "warm":
        await mb.materialize()
    for i in (0, 1, 2, 7, -1, -3):
        p = order[i]
        check_row(await mb[i].materialize(), src, jag, txt, p, f"mb[{i}]")
        row = await mb["resp"][i].materialize()
        assert not row.is_nested and torch.equal(row, jag[p]), f"mb['resp'][{i}]: {row}"
        row = await mb[1:9][i]["resp"].materialize()
        assert torch.equal(row, jag[order[1:9][i]]), f"mb[1:9][{i}]['resp']: {row}"
    # a 0-d view of a piece of a split (micro-batches, then one sample)
    for j, part in enumerate(mb.split(3)):
        check_row(await part[-1].materialize(), src, jag, txt, order[3 * j + len(part) - 1],
                  f"split(3)[{j}][-1]")
    await mb.ack()


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.on_ray(kind="2d")
async def test_column_views_of_a_jagged_field(make_queue, kind):
    q = make_queue(num_shards=2)
    src, jag, txt = await fill(q, kind)
    mb = await q.get("t", ["idx", "x", "resp", "txt"], batch_size=N, partition="p", timeout=5)
    order = await order_of(mb)
    col = mb["resp"]
    assert isinstance(col, ColumnRemoteBatch)
    # a column view before anything was fetched, then the whole column, then views of it
    check_jagged(await col[0:2].materialize(), [jag[p] for p in order[0:2]], "col[0:2] cold")
    check_jagged(await col.materialize(), [jag[p] for p in order], "col")
    for idx, pos in [(slice(0, 2), [0, 1]), (slice(3, None), list(range(3, N))),
                     ([9, 2, 2], [9, 2, 2]), (slice(None, None, -1), list(range(N))[::-1]),
                     ([0, 4], [0, 4]), (slice(5, 5), [])]:
        check_jagged(await col[idx].materialize(), [jag[order[i]] for i in pos], f"col[{idx}]")
    # copy=True gives the same rows, not sharing memory with the cache
    cp = await col[1:6].materialize(copy=True)
    check_jagged(cp, [jag[p] for p in order[1:6]], "col[1:6] copy")
    await mb.ack()


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.on_ray(kind="2d")
@pytest.mark.parametrize("warm", ["cold", "warm"])
async def test_concat_of_two_batches_with_a_jagged_field(make_queue, kind, warm):
    q = make_queue(num_shards=3)
    src, jag, txt = await fill(q, kind)
    b1 = await q.get("t", ["idx", "x", "resp", "txt"], batch_size=6, partition="p", timeout=5)
    b2 = await q.get("t", ["idx", "x", "resp", "txt"], batch_size=4, partition="p", timeout=5)
    o1, o2 = await order_of(b1), await order_of(b2)
    if warm == "warm":
        await b1.materialize()
        await b2.materialize()
    cases = [
        (RowRemoteBatch.concat([b1, b2]), o1 + o2),
        (RowRemoteBatch.concat([b1[4:], b2[[3, 0]], b1[[1, 1]]]), o1[4:] + [o2[3], o2[0], o1[1], o1[1]]),
        (RowRemoteBatch.concat([b2[:0], b1[2:2]]), []),
        (RowRemoteBatch.concat([b1[::2], b1[1::2]]), o1[::2] + o1[1::2]),  # one cache
    ]
    for j, (cat, pos) in enumerate(cases):
        check_td(await cat.materialize(), src, jag, txt, pos, f"concat {j}")
        check_td(await cat.materialize(), src, jag, txt, pos, f"concat {j} (again)")
        if len(cat):
            sub = [len(cat) - 1, 0]
            check_td(await cat[sub].materialize(), src, jag, txt, [pos[i] for i in sub],
                     f"concat {j}[{sub}]")
    await b1.ack()
    await b2.ack()


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.on_ray(kind="2d")
async def test_empty_views_of_a_jagged_field(make_queue, kind):
    q = make_queue(num_shards=2)
    src, jag, txt = await fill(q, kind)
    mb = await q.get("t", ["idx", "x", "resp", "txt"], batch_size=N, partition="p", timeout=5)
    # never fetched: the empty view reads one row to learn dtype and trailing dims
    td = await mb[3:3].materialize()
    check_td(td, src, jag, txt, [], "mb[3:3] cold")
    assert td["resp"].dtype == jag[0].dtype and td["resp"].shape[2:] == jag[0].shape[1:]
    await mb.materialize()
    for v in (mb[5:5], mb[[]], mb.repeat(0), mb.split([N, 0])[1], mb[2:6][[]]):
        td = await v.materialize()
        check_td(td, src, jag, txt, [], repr(v))
        r = td["resp"]
        assert r.dtype == jag[0].dtype and r.shape[2:] == jag[0].shape[1:], r.shape
        check_jagged(await v["resp"].materialize(), [], repr(v) + "['resp']")
    await mb.ack()


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.on_ray(kind="2d")
async def test_batch_from_put_materializes_a_jagged_field_like_a_fetched_one(make_queue, kind):
    """The batch returned by ``put`` caches what was put (a list of rows): reading it back
    gives the same column a fetch would, a jagged tensor, and views of it work."""
    q = make_queue(num_shards=2)
    src, jag, txt = source(kind)
    rows = await q.put({"idx": src["idx"], "x": src["x"], "resp": jag, "txt": txt})
    check_td(await rows.materialize(), src, jag, txt, list(range(N)), "put batch")
    for name, (make, positions) in VIEWS.items():
        pos = positions(N)
        check_td(await make(rows).materialize(), src, jag, txt, pos, "put batch " + name)
        check_jagged(await make(rows)["resp"].materialize(), [jag[p] for p in pos],
                     f"put batch {name}['resp']")
    check_row(await rows[2].materialize(), src, jag, txt, 2, "put batch[2]")


@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.on_ray(kind="2d")
async def test_a_materialized_jagged_field_can_be_written_back(make_queue, kind):
    """A jagged nested tensor given to put/write is taken as its rows (like a list of
    per-row tensors), also when the target rows are spread over storage units."""
    q = make_queue(num_shards=3)
    src, jag, txt = await fill(q, kind)
    mb = await q.get("t", ["idx", "resp"], batch_size=N, partition="p", timeout=5)
    order = await order_of(mb)
    td = await mb.materialize()
    assert td["resp"].is_nested
    # interleaved rows of three units: the write is split per unit
    view = mb[[9, 0, 5, 1, 8, 2]]
    part = await view.materialize()
    await view.write({"resp2": part["resp"]})
    for b in (view, pickle.loads(pickle.dumps(view))):  # cached, fetched
        got = await b.materialize(["resp2"])
        check_jagged(got["resp2"], [jag[order[i]] for i in (9, 0, 5, 1, 8, 2)], "resp2")
    # a nested tensor put as new rows
    nt = torch.nested.nested_tensor(jag[:3], layout=torch.jagged)
    new = await q.put({"resp": nt}, partition="n")
    check_jagged(await new["resp"].materialize(), jag[:3], "put nested")
    check_jagged(await pickle.loads(pickle.dumps(new))["resp"][1:].materialize(), jag[1:3],
                 "put nested, fetched")
    # the local overlay of a BatchProxy reads a jagged field like the queue does
    proxy = BatchProxy(mb[:3])
    proxy["resp3"] = [jag[order[i]] for i in range(3)]
    check_jagged(proxy["resp3"], [jag[order[i]] for i in range(3)], "proxy local")
    await proxy.commit()
    fetched = await pickle.loads(pickle.dumps(mb[:3])).materialize(["resp3"])
    check_jagged(fetched["resp3"], [jag[order[i]] for i in range(3)], "proxy committed")
    await mb.ack()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_take_rows_of_a_jagged_column():
    """The column helper on its own: slices of a jagged column share its values (only the
    offsets are new); gathers copy once; rows of one shape come back dense."""
    from streamrl.columns import assemble, take_rows

    for kind in ("1d", "2d"):
        rows = jag_rows(kind)
        col = assemble([rows])
        assert col.is_nested
        for idx in (slice(1, 4), slice(0, 0), slice(None, None, 2), slice(8, 2, -1),
                    [3, 3, 0], [], [0, 4, 5, 9], [2], [2, 2], list(range(N))):
            pos = list(range(N))[idx] if isinstance(idx, slice) else idx
            check_jagged(take_rows(col, idx), [rows[p] for p in pos], f"take_rows({idx})")
        view = take_rows(col, slice(1, 4))
        assert view.values().data_ptr() == col.values()[LENGTHS[0]:].data_ptr()
        dense = take_rows(col, slice(4, 6))  # rows 4 and 5 share a length: a dense view
        assert not dense.is_nested and dense.data_ptr() == col.values()[sum(LENGTHS[:4]):].data_ptr()
        empty = take_rows(col, [])
        assert empty.shape == (0, 0, *rows[0].shape[1:]) and empty.dtype == rows[0].dtype
    # other nested tensors (holes from narrow, strided layout) are read row by row
    dense = torch.arange(24).reshape(4, 6)
    holes = torch.nested.narrow(dense, 1, torch.tensor([0, 1, 2, 0]), torch.tensor([3, 2, 4, 1]),
                                layout=torch.jagged)
    rows = list(holes.unbind())
    strided = torch.nested.nested_tensor(rows)
    for col in (holes, strided):
        for idx in ([3, 1], slice(0, 2), [0, 0], [], slice(None, None, -1)):
            pos = list(range(4))[idx] if isinstance(idx, slice) else idx
            check_jagged(take_rows(col, idx), [rows[p] for p in pos], f"{col.layout} [{idx}]")
