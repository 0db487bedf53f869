"""Differential property tests: RemoteBatch views against the same ops on a TensorDict.

A random TensorDict of ``n`` rows is put into an embedded queue of ``k`` shards (in
several puts, so rows land on different storage units; a Python-object field may be
written later, as a partial sample; a jagged field -- a list of per-row tensors of
different lengths -- may come with it), taken back as one leased batch, and every view
operation -- indexing by int / slice / list / LongTensor / numpy array / bool mask,
``select``, ``exclude``, chains of them, ``split``, ``chunk``, ``repeat``,
``repeat_interleave``, ``concat`` and lazy columns -- must materialize to exactly what the
same operation gives on the TensorDict (values, dtypes, shapes, batch size).

A TensorDict cannot index a jagged nested tensor, so the expected TensorDict holds the
jagged field's rows as opaque objects (a non-tensor stack of :class:`Rag`), which it
indexes, splits, repeats and concatenates like any object field; the materialized
column is then compared row by row: a dense tensor when the picked rows share a shape
(``[0, ...]`` for none), a jagged nested tensor of exactly those rows otherwise.

The queue may hand rows out in another order than they were put, so the expected
TensorDict is the source reordered by the batch's own ``idx`` column, read through a
pickled copy of the batch (a fresh cache, so the batch under test starts cold).

The last tests check the shared cache (views never refetch what the batch or a sibling
view fetched; only missing fields are fetched) and that a batch pickles small.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

import streamrl
from streamrl import ColumnRemoteBatch, RowRemoteBatch

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# name -> (dtype, per-row shape)
FIELD_MENU: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "f32": (torch.float32, (3,)),
    "i32": (torch.int32, ()),
    "mask": (torch.bool, (2, 2)),
    "f64": (torch.float64, ()),
    "bf16": (torch.bfloat16, (4,)),
    "u8": (torch.uint8, (2, 3)),
    "i16": (torch.int16, (1,)),
}


# ---------------------------------------------------------------------------- helpers


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# kind of the jagged field -> (dtype, per-row trailing shape after the ragged length)
JAG_MENU: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "1d": (torch.int64, ()),
    "2d": (torch.float32, (3,)),
    "2d_bf16": (torch.bfloat16, (2,)),
}


class Rag:
    """One row of the jagged field in the expected TensorDict: an opaque object (equal
    only to itself), so TensorDict moves it around without looking inside."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __repr__(self) -> str:
        return f"Rag({tuple(self.t.shape)})"


def assert_jagged_equal(got, exp, what: str) -> None:
    """``got`` (a materialized jagged column, or one row of it for a 0-d view) holds the
    rows of ``exp`` (a list of :class:`Rag`, or one)."""
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    if isinstance(exp, Rag):  # 0-d view: the row itself
        assert not got.is_nested, f"{what}: one row should be a plain tensor"
        assert_values_equal(got, exp.t, what)
        return
    rows = [r.t for r in exp]
    assert got.shape[0] == len(rows), f"{what}: {got.shape[0]} rows, expected {len(rows)}"
    if not rows:
        assert not got.is_nested, f"{what}: zero rows should be a dense tensor"
        return
    assert got.dtype == rows[0].dtype, f"{what}: dtype {got.dtype} != {rows[0].dtype}"
    if len({r.shape for r in rows}) == 1:
        assert not got.is_nested, f"{what}: rows of one shape should be a dense tensor"
        assert_values_equal(got, torch.stack(rows), what)
        return
    assert got.is_nested and got.layout == torch.jagged, f"{what}: expected a jagged tensor"
    for j, (g, e) in enumerate(zip(got.unbind(), rows)):
        assert_values_equal(g, e, f"{what} row {j}")


def _value(td: TensorDictBase, key: str):
    """``td[key]`` normalised for comparison: a tensor, a list (non-tensor stack) or the
    object itself (0-d non-tensor)."""
    v = td.get(key)
    if is_non_tensor(v):
        return ("obj", v.tolist() if td.batch_size else v.data)
    return ("tensor", v)


def assert_values_equal(got, exp, what: str) -> None:
    if isinstance(exp, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
        assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} != {exp.dtype}"
        assert got.shape == exp.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
        assert torch.equal(got, exp), f"{what}: values differ\n{got}\n!=\n{exp}"
    else:
        if isinstance(exp, list):  # LinkedList from td[key]
            assert isinstance(got, list), f"{what}: expected a list, got {type(got).__name__}"
            assert list(got) == list(exp), f"{what}: {list(got)} != {list(exp)}"
        else:
            assert got == exp, f"{what}: {got!r} != {exp!r}"


def assert_td_equal(got, exp: TensorDictBase, what: str = "view") -> None:
    assert isinstance(got, TensorDictBase), f"{what}: got a {type(got).__name__}"
    assert got.batch_size == exp.batch_size, f"{what}: batch_size {got.batch_size} != {exp.batch_size}"
    assert set(got.keys()) == set(exp.keys()), f"{what}: keys {sorted(got.keys())} != {sorted(exp.keys())}"
    for k in exp.keys():
        gk, gv = _value(got, k)
        ek, ev = _value(exp, k)
        if k == "jag":
            assert_jagged_equal(gv, ev, f"{what}[{k!r}]")
            continue
        assert gk == ek, f"{what}[{k!r}]: a {gk} field, expected a {ek} field"
        assert_values_equal(gv, ev, f"{what}[{k!r}]")


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], n: int, gen: torch.Generator):
    if dtype is torch.bool:
        return torch.rand((n, *shape), generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn((n, *shape), generator=gen).to(dtype)
    return torch.randint(0, 120, (n, *shape), generator=gen).to(dtype)


def make_obj(i: int):
    """Distinct per row (so a non-tensor stack never collapses), of mixed types."""
    return (("row", i), f"s{i}", {"i": i, "tag": "x" * (i % 3)})[i % 3]


def obj_stack(objs: list) -> NonTensorStack:
    return NonTensorStack(*[NonTensorData(o, batch_size=[]) for o in objs], stack_dim=0)


@dataclass
class Setup:
    n: int
    k: int
    cuts: list[int]
    tensor_fields: list[str]
    with_obj: bool
    obj_separately: bool
    seed: int
    fields: list[str] = field(default_factory=list)
    jag: str | None = None  # a key of JAG_MENU: the batch has a jagged field "jag"
    jag_lengths: list[int] = field(default_factory=list)

    def source(self) -> tuple[TensorDict, list | None]:
        gen = torch.Generator().manual_seed(self.seed)
        cols = {"idx": torch.arange(self.n)}
        for name in self.tensor_fields:
            dtype, shape = FIELD_MENU[name]
            cols[name] = make_tensor(dtype, shape, self.n, gen)
        td = TensorDict(cols, batch_size=[self.n])
        objs = [make_obj(i) for i in range(self.n)] if self.with_obj else None
        return td, objs

    def jag_rows(self) -> list[torch.Tensor] | None:
        """The jagged field's rows: ``[L_i, *rest]`` tensors, distinct per row."""
        if self.jag is None:
            return None
        dtype, rest = JAG_MENU[self.jag]
        gen = torch.Generator().manual_seed(self.seed + 1)
        return [make_tensor(dtype, rest, L, gen) + i for i, L in enumerate(self.jag_lengths)]


@st.composite
def setups(draw, max_n: int = 40) -> Setup:
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, 4))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    tensor_fields = draw(st.lists(st.sampled_from(sorted(FIELD_MENU)), min_size=1, max_size=3,
                                  unique=True))
    with_obj = draw(st.booleans())
    s = Setup(n, k, cuts, tensor_fields, with_obj, draw(st.booleans()), draw(st.integers(0, 2**31)))
    s.jag = draw(st.none() | st.sampled_from(sorted(JAG_MENU)))
    if s.jag is not None:  # few lengths, so views often pick rows of one length (dense)
        s.jag_lengths = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    s.fields = ["idx", *tensor_fields] + (["obj"] if with_obj else []) + (["jag"] if s.jag else [])
    return s


async def fill(q: streamrl.StreamQueue, s: Setup, partition: str = "p") -> tuple[TensorDict, list | None]:
    """Put the source in several puts (one per span between cuts); the object field goes
    in the same put as a dict, or later as a partial-sample write to the same rows; the
    jagged field (a list of per-row tensors) goes in the same put as the tensors.

    Returns the source TensorDict, with the jagged field as a non-tensor stack of
    :class:`Rag` (the expected side), and the objects."""
    src, objs = s.source()
    jag = s.jag_rows()
    bounds = [0, *s.cuts, s.n]
    for a, b in zip(bounds, bounds[1:]):
        if (objs is not None and not s.obj_separately) or jag is not None:
            data = {key: src[a:b].get(key) for key in src.keys()}
            if objs is not None and not s.obj_separately:
                data["obj"] = objs[a:b]
            if jag is not None:
                data["jag"] = jag[a:b]
            rows = await q.put(data, partition=partition)
        else:
            rows = await q.put(src[a:b], partition=partition)
        if objs is not None and s.obj_separately:
            await q.put({"obj": objs[a:b]}, rows=rows)
    await q.seal(partition)
    if jag is not None:
        src = src.clone()
        src.set("jag", obj_stack([Rag(t) for t in jag]))
    return src, objs


async def expected_for(mb: RowRemoteBatch, src: TensorDict, objs: list | None, n_total: int
                       ) -> TensorDict:
    """The source reordered like ``mb``'s rows, read through a pickled copy of ``mb`` (a
    fresh, empty cache, so ``mb`` itself stays cold)."""
    twin = pickle.loads(pickle.dumps(mb))
    order = (await twin.materialize(["idx"]))["idx"]
    assert order.dtype == torch.int64 and order.shape == (len(mb),)
    assert len(set(order.tolist())) == len(mb) and all(0 <= i < n_total for i in order.tolist())
    full = src.clone()
    if objs is not None:
        full.set("obj", obj_stack(objs))
    return full[order]


async def leased_batch(s: Setup, q: streamrl.StreamQueue):
    src, objs = await fill(q, s)
    mb = await q.get("t", s.fields, batch_size=s.n, partition="p", timeout=5)
    assert len(mb) == s.n and sorted(mb.fields) == sorted(s.fields)
    exp = await expected_for(mb, src, objs, s.n)
    return mb, exp


async def warm(data, mb: RowRemoteBatch, fields: list[str]) -> None:
    """Maybe pre-fetch some fields through the parent, so views read the cache."""
    how = data.draw(st.sampled_from(["cold", "all", "some"]), label="warm")
    if how == "all":
        await mb.materialize()
    elif how == "some":
        await mb.materialize(data.draw(st.lists(st.sampled_from(fields), min_size=1, unique=True),
                                       label="warm fields"))


# ---------------------------------------------------------------------------- index strategies


def draw_row_index(data, m: int, *, allow_int: bool):
    """One batch-dimension index for a view of ``m`` rows: (index for the RemoteBatch,
    index for the TensorDict, label). TensorDict slices cannot step backwards, so a
    negative-step slice is given to it as the equivalent LongTensor."""
    kinds = ["slice", "list", "long", "numpy", "mask"]
    if allow_int and m > 0:
        kinds += ["int", "npint"]
    kind = data.draw(st.sampled_from(kinds), label="index kind")
    ints = st.integers(-m, m - 1) if m > 0 else st.nothing()
    if kind in ("int", "npint"):
        i = data.draw(ints, label="int")
        return (np.int64(i) if kind == "npint" else i), i, f"[{i}]"
    if kind == "slice":
        bound = st.none() | st.integers(-m - 3, m + 3)
        a, b = data.draw(bound, label="start"), data.draw(bound, label="stop")
        step = data.draw(st.none() | st.integers(-3, 3).filter(bool), label="step")
        s = slice(a, b, step)
        if step is not None and step < 0:
            return s, torch.tensor(list(range(m))[s], dtype=torch.long), f"[{a}:{b}:{step}]"
        return s, s, f"[{a}:{b}:{step}]"
    if kind in ("list", "long", "numpy"):
        lst = data.draw(st.lists(ints, max_size=8) if m > 0 else st.just([]), label="ints")
        t = torch.tensor(lst, dtype=torch.long)
        if kind == "list":
            return lst, (lst if lst else t), f"[{lst}]"
        if kind == "long":
            return t, t, f"[LongTensor {lst}]"
        return np.asarray(lst, dtype=np.int64), t, f"[ndarray {lst}]"
    bools = data.draw(st.lists(st.booleans(), min_size=m, max_size=m), label="mask")
    t = torch.tensor(bools, dtype=torch.bool)
    as_ = data.draw(st.sampled_from(["tensor", "list", "numpy"]), label="mask type")
    mbi = {"tensor": t, "list": bools, "numpy": np.asarray(bools, dtype=bool)}[as_]
    return mbi, t, f"[mask {as_} {bools}]"


def apply_chain(data, mb, exp, fields: list[str], *, max_ops: int = 3, allow_int: bool = True):
    """A random chain of row indexing and ``select``/``exclude``/``[list of str]`` applied
    to both sides; an int index (0-d result) can only come last."""
    path = "mb"
    cur_fields = list(fields)
    for _ in range(data.draw(st.integers(0, max_ops), label="chain length")):
        ops = ["index", "index", "select", "exclude", "strlist"] if cur_fields else ["index"]
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "index":
            i_mb, i_td, label = draw_row_index(data, len(mb), allow_int=allow_int)
            mb, exp = mb[i_mb], exp[i_td]
            path += label
            if exp.batch_size == torch.Size([]):
                break
        elif op in ("select", "strlist"):
            sub = data.draw(st.lists(st.sampled_from(cur_fields), min_size=1, unique=True), label="sel")
            mb = mb.select(*sub) if op == "select" else mb[sub]
            exp = exp.select(*sub)
            cur_fields = sub
            path += f".select{tuple(sub)}" if op == "select" else f"[{sub}]"
        else:
            sub = data.draw(st.lists(st.sampled_from(cur_fields), unique=True), label="excl")
            mb, exp = mb.exclude(*sub), exp.exclude(*sub)
            cur_fields = [f for f in cur_fields if f not in sub]
            path += f".exclude{tuple(sub)}"
    return mb, exp, cur_fields, path


async def check_view(view, exp: TensorDictBase, path: str) -> None:
    assert isinstance(view, RowRemoteBatch), path
    assert view.batch_size == exp.batch_size, f"{path}: batch_size {view.batch_size} != {exp.batch_size}"
    if exp.batch_size:
        assert len(view) == exp.batch_size[0], path
    assert_td_equal(await view.materialize(), exp, path)
    # a second read (from the cache now) gives the same
    assert_td_equal(await view.materialize(), exp, path + " (cached)")


def new_queue(s: Setup) -> streamrl.StreamQueue:
    return streamrl.StreamQueue(capacity=64, num_shards=s.k)


# ---------------------------------------------------------------------------- properties


@SETTINGS
@given(s=setups(), data=st.data())
def test_index_select_chains_match_tensordict(s: Setup, data):
    async def body():
        async with new_queue(s) as q:
            mb, exp = await leased_batch(s, q)
            await warm(data, mb, s.fields)
            for _ in range(data.draw(st.integers(1, 3), label="chains")):
                view, e, fields, path = apply_chain(data, mb, exp, s.fields)
                await check_view(view, e, path)
                if fields:  # materialize(fields=...) of a subset, in a random order
                    sub = data.draw(st.permutations(fields), label="fields")[: data.draw(
                        st.integers(1, len(fields)), label="nfields")]
                    assert_td_equal(await view.materialize(sub), e.select(*sub), f"{path}.materialize({sub})")
            assert mb.leased
            await mb.ack()

    run(body())


def pieces(e: TensorDictBase, parts) -> list[TensorDictBase]:
    """The pieces TensorDict.split/chunk make, as slices of ``e``: the sizes are
    TensorDict's, the contents slices (TensorDict's own empty pieces turn a non-tensor
    stack into an empty lazy stack, while an empty slice keeps it a non-tensor stack)."""
    out, a = [], 0
    for p in parts:
        b = a + p.batch_size[0]
        out.append(e[a:b])
        a = b
    assert a == e.batch_size[0]
    return out


@SETTINGS
@given(s=setups(), data=st.data())
def test_split_chunk_repeat_match_tensordict(s: Setup, data):
    async def body():
        async with new_queue(s) as q:
            mb, exp = await leased_batch(s, q)
            await warm(data, mb, s.fields)
            base, e, _, path = apply_chain(data, mb, exp, s.fields, max_ops=1, allow_int=False)
            m = len(base)
            op = data.draw(st.sampled_from(
                ["split", "split_sizes", "chunk", "repeat", "repeat_interleave"]), label="op")
            if op == "split":
                k = data.draw(st.integers(1, m + 2), label="split_size")
                got, want = base.split(k), pieces(e, e.split(k))
            elif op == "split_sizes":
                parts = data.draw(st.integers(1, 4), label="parts")
                cuts = sorted(data.draw(st.lists(st.integers(0, m), min_size=parts - 1,
                                                 max_size=parts - 1), label="cuts"))
                sizes = [b - a for a, b in zip([0, *cuts], [*cuts, m])]
                got, want = base.split(sizes), pieces(e, e.split(sizes))
            elif op == "chunk":
                k = data.draw(st.integers(1, 6), label="chunks")
                got, want = base.chunk(k), pieces(e, e.chunk(k))
            elif op == "repeat":
                k = data.draw(st.integers(0, 3), label="repeats")
                got, want = [base.repeat(k)], [e.repeat(k)]
            else:
                k = data.draw(st.integers(0, 3), label="repeats")
                got, want = [base.repeat_interleave(k)], [e.repeat_interleave(k, dim=0)]
            label = f"{path}.{op}({k if op != 'split_sizes' else sizes})"
            assert len(got) == len(want), f"{label}: {len(got)} views, TensorDict gives {len(want)}"
            for j, (g, w) in enumerate(zip(got, want)):
                await check_view(g, w, f"{label}[{j}]")
            # a view of a piece is still right (indexes compose through split/repeat)
            if got and len(got[-1]):
                await check_view(got[-1][-1:], want[-1][-1:], f"{label}[-1][-1:]")
            await mb.ack()

    run(body())


@SETTINGS
@given(s=setups(), data=st.data())
def test_concat_of_views_matches_torch_cat(s: Setup, data):
    async def body():
        async with new_queue(s) as q:
            src, objs = await fill(q, s)
            # one batch, or two batches (two leases, two caches) to concat across
            a = data.draw(st.integers(1, s.n), label="first batch size")
            batches = [await q.get("t", s.fields, batch_size=a, partition="p", timeout=5)]
            if a < s.n:
                batches.append(await q.get("t", s.fields, batch_size=s.n - a, partition="p", timeout=5))
            exps = [await expected_for(b, src, objs, s.n) for b in batches]
            assert sorted(r for b in batches for r in b.rows) == sorted(set(r for b in batches for r in b.rows))
            for b in batches:
                await warm(data, b, s.fields)
            views, want, used = [], [], set()
            for j in range(data.draw(st.integers(1, 3), label="parts")):
                which = data.draw(st.integers(0, len(batches) - 1), label="batch")
                used.add(which)
                v, e, _, path = apply_chain(data, batches[which], exps[which], s.fields,
                                            max_ops=2, allow_int=False)
                views.append(v)
                want.append(e)
            common = [f for f in views[0].fields if all(f in v.fields for v in views[1:])]
            cat = RowRemoteBatch.concat(views)
            assert sorted(cat.fields) == sorted(common)
            exp = torch.cat([w.select(*common) for w in want], 0)
            await check_view(cat, exp, f"concat of {len(views)}")
            # and a view of the concatenation
            v, e, _, path = apply_chain(data, cat, exp, common, max_ops=2)
            await check_view(v, e, "concat" + path[2:])
            # acknowledging the concatenation acknowledges every source lease (and only those)
            assert cat.leased
            await cat.ack()
            assert not any(batches[i].leased for i in used)
            acked = sum(len(batches[i]) for i in used)
            assert (await q.stats()).tasks["t"].acked == acked
            for b in batches:
                await b.ack()  # idempotent for the used ones; acks the others
            assert (await q.stats()).tasks["t"].acked == s.n

    run(body())


@SETTINGS
@given(s=setups(), data=st.data())
def test_columns_match_td_getitem(s: Setup, data):
    async def body():
        async with new_queue(s) as q:
            mb, exp = await leased_batch(s, q)
            await warm(data, mb, s.fields)
            view, e, fields, path = apply_chain(data, mb, exp, s.fields, max_ops=2)
            if not fields:
                return
            f = data.draw(st.sampled_from(fields), label="column")
            col = view[f]
            assert isinstance(col, ColumnRemoteBatch) and col.field == f
            check = assert_jagged_equal if f == "jag" else assert_values_equal
            kind, want = _value(e, f)
            check(await col.materialize(), want, f"{path}[{f!r}]")
            if e.batch_size:
                # rows of the lazy column index like the TensorDict's
                i_mb, i_td, label = draw_row_index(data, len(col), allow_int=True)
                kind, want = _value(e[i_td], f)
                check(await col[i_mb].materialize(), want, f"{path}[{f!r}]{label}")
            await mb.ack()

    run(body())


# ---------------------------------------------------------------------------- the cache


def rows_data(n: int, start: int = 0) -> dict:
    ids = torch.arange(start, start + n)
    return {"idx": ids, "a": ids.float() * 2, "b": ids.view(-1, 1).repeat(1, 3).to(torch.int32),
            "c": [f"obj{i}" for i in ids.tolist()]}


def count_fetches(q: streamrl.StreamQueue, monkeypatch) -> list[tuple[list[int], list[str]]]:
    calls: list[tuple[list[int], list[str]]] = []
    orig = q.session.fetch

    async def counting(rows, shards, fields, **kw):
        calls.append((list(map(int, rows)), list(fields)))
        return await orig(rows, shards, fields, **kw)

    monkeypatch.setattr(q.session, "fetch", counting)
    return calls


async def _batch_of_12(q):
    for start in (0, 5, 9):  # three puts -> rows on different shards
        await q.put(rows_data({0: 5, 5: 4, 9: 3}[start], start), partition="p")
    await q.seal("p")
    return await q.get("t", ["idx", "a", "b", "c"], batch_size=12, partition="p", timeout=5)


async def test_parent_fetch_serves_every_view_and_only_missing_fields_are_fetched(monkeypatch):
    async with streamrl.StreamQueue(capacity=64, num_shards=3) as q:
        mb = await _batch_of_12(q)
        calls = count_fetches(q, monkeypatch)
        td_a = await mb.materialize(["a"])
        assert calls == [(mb.rows, ["a"])]
        order = (await mb.materialize(["idx"]))["idx"]
        assert calls[-1] == (mb.rows, ["idx"])
        assert torch.equal(td_a["a"], order.float() * 2)
        await mb.materialize(["a", "b"])
        assert calls[-1] == (mb.rows, ["b"])  # "a" was cached: only "b" is fetched
        full = await mb.materialize()
        assert calls[-1] == (mb.rows, ["c"])
        assert len(calls) == 4
        assert full["c"] == [f"obj{i}" for i in order.tolist()]

        # every view of the fetched batch reads the shared cache: no fetch at all
        mask = torch.arange(12) % 3 == 0
        views = [mb, mb[2:7], mb[::-2], mb[[3, 1, 1, 11]], mb[torch.tensor([0, 5])], mb[mask],
                 mb[4], mb[-1], mb.select("a", "c"), mb.exclude("b"), mb[["idx", "b"]],
                 mb[1:9][::2][[0, -1]], mb.repeat(2), mb.repeat_interleave(3),
                 *mb.split(5), *mb.chunk(3),
                 RowRemoteBatch.concat([mb[:3], mb[8:], mb[[4, 4]]])]
        for v in views:
            await v.materialize()
        for f in ("idx", "a", "b", "c"):
            await mb[f].materialize()
            await mb[3:6][f].materialize()
            await mb[2][f].materialize()
        assert len(calls) == 4, calls[4:]
        # and what the cache gives is right
        assert_td_equal(await mb[[3, 1, 1, 11]].materialize(), full[[3, 1, 1, 11]], "mb[[3,1,1,11]]")
        assert_td_equal(await mb[::-2].materialize(), full[torch.arange(11, -1, -2)], "mb[::-2]")


async def test_view_fetch_is_shared_with_parent_and_siblings(monkeypatch):
    async with streamrl.StreamQueue(capacity=64, num_shards=3) as q:
        mb = await _batch_of_12(q)
        calls = count_fetches(q, monkeypatch)
        # a select view (same rows) fetches; the parent then reads its cache
        sel = mb.select("a")
        a = (await sel.materialize())["a"]
        assert calls == [(mb.rows, ["a"])]
        assert torch.equal((await mb.materialize(["a"]))["a"], a)
        assert torch.equal(await mb["a"].materialize(), a)
        assert torch.equal((await mb[:].materialize(["a"]))["a"], a)
        assert len(calls) == 1
        # the parent then fetches only the fields the view did not
        await mb.materialize(["a", "b"])
        assert calls[1] == (mb.rows, ["b"]) and len(calls) == 2

        # a row view fetches its rows; views of those rows (its own or the parent's) do not
        v = mb[2:9]
        c = (await v.materialize(["c"]))["c"]
        assert calls[2] == (mb.rows[2:9], ["c"]) and len(calls) == 3
        assert (await v[1:4].materialize(["c"]))["c"] == c[1:4]
        assert (await v[[0, 0, 6]].materialize(["c"]))["c"] == [c[0], c[0], c[6]]
        assert (await mb[3:5].materialize(["c"]))["c"] == c[1:3]
        assert await mb[8]["c"].materialize() == c[6]
        assert len(calls) == 3, calls[3:]

        # repeated rows are fetched once each
        await mb[[10, 10, 11, 10]].materialize(["idx"])
        assert sorted(calls[3][0]) == sorted(mb.rows[10:12]) and calls[3][1] == ["idx"]


async def test_pickled_batch_is_small_and_has_no_cache(monkeypatch):
    n, width = 64, 16384  # 64 rows x 64 KiB = 4 MiB
    async with streamrl.StreamQueue(capacity=128, num_shards=4) as q:
        x = torch.randn(n, width)
        for a in range(0, n, 16):
            await q.put({"idx": torch.arange(a, a + 16), "x": x[a:a + 16]}, partition="p")
        await q.seal("p")
        mb = await q.get("t", ["idx", "x"], batch_size=n, partition="p", timeout=5)
        td = await mb.materialize()
        assert td["x"].numel() * td["x"].element_size() == 4 << 20
        assert torch.equal(td["x"], x[td["idx"]])
        for obj in (mb, mb[3:40], mb.select("x"), mb["x"], mb.split(16)):
            blob = pickle.dumps(obj)
            assert len(blob) < 4096, f"{obj!r} pickles to {len(blob)} bytes"
        # the copy is a working view of the same rows, with a fresh (empty) cache
        calls = count_fetches(q, monkeypatch)
        twin = pickle.loads(pickle.dumps(mb))
        assert isinstance(twin, RowRemoteBatch) and twin.rows == mb.rows and twin.leased
        assert_td_equal(await twin.materialize(), td, "unpickled batch")
        assert len(calls) == 1
        await mb.ack()
        assert not mb.leased


# ---------------------------------------------------------------------------- TensorDict puts


async def test_put_of_tensordict_keeps_non_tensor_field():
    async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
        td = TensorDict({"idx": torch.arange(3), "obj": obj_stack(["a", "b", "c"])}, batch_size=[3])
        rows = await q.put(td, partition="p")
        assert "obj" in rows.fields
        mb = await q.get("t", ["idx", "obj"], batch_size=3, partition="p", timeout=2)
        out = await mb.materialize()
        assert [td["obj"][i] for i in out["idx"].tolist()] == out["obj"]
