"""Fuzz every public entry point with hypothesis: whatever the arguments (types, values,
shapes, dtypes, Python objects), only streamrl errors (or TypeError/ValueError naming the
argument) come out, and the queue stays consistent and usable afterwards.

Embedded transport: the checks are of argument handling, which every transport shares
(the client validates before anything is sent)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamrl
from streamrl.errors import EndOfStream, InvalidArgument, StreamRLError, StreamTimeout

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::UserWarning")]

import os  # noqa: E402

#: examples per test (STREAMRL_FUZZ_EXAMPLES=2000 for a longer run)
SETTINGS = settings(max_examples=int(os.environ.get("STREAMRL_FUZZ_EXAMPLES", "150")),
                    deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3), st.just(""), st.lists(st.integers(-2, 5), max_size=3),
    st.just(math.nan), st.just(-1), st.just(0), st.just(object()), st.just({"a": 1}),
    st.just(b"xy"), st.just(torch.zeros(2)), st.just(np.zeros(2)),
)

dtypes = st.sampled_from([torch.float32, torch.int64, torch.bool, torch.float16,
                          torch.bfloat16, torch.uint8, torch.complex64])


@st.composite
def columns(draw, n=None):
    """A column value: tensors of random dtypes/shapes, numpy arrays, lists of objects,
    ragged per-row tensors, or junk."""
    n = draw(st.integers(0, 4)) if n is None else n
    kind = draw(st.sampled_from(["tensor", "numpy", "objects", "ragged", "junk", "nested"]))
    if kind == "tensor":
        shape = (n,) + tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        return torch.zeros(shape, dtype=draw(dtypes))
    if kind == "numpy":
        dt = draw(st.sampled_from(["<f4", ">i8", "<U3", "bool", "O", "<c8"]))
        a = np.zeros((n, 2), dtype=dt)
        return a[::-1] if draw(st.booleans()) else a
    if kind == "objects":
        return draw(st.lists(st.one_of(st.none(), st.text(max_size=4), st.integers(),
                                       st.dictionaries(st.text(max_size=2), st.integers(),
                                                       max_size=2)),
                             min_size=n, max_size=n))
    if kind == "ragged":
        return [torch.zeros(draw(st.integers(0, 3)), dtype=draw(dtypes)) for _ in range(n)]
    if kind == "nested":
        return [[{"deep": [{"x": "y" * draw(st.integers(0, 8))}]}] for _ in range(n)]
    return draw(junk)


data_strategy = st.one_of(
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 2), st.just("")),
                    columns(), max_size=3),
    junk,
)


def _run(coro):
    return asyncio.run(coro)


async def _consistent(q: streamrl.StreamQueue) -> None:
    """The queue still works and its planes agree."""
    assert await q.audit() == []
    st = await q.stats()
    assert st.rows <= st.capacity and st.leases == 0
    if q._control.ctl.sealed_all:  # seal() of the whole queue: no new rows, as promised
        return
    # rows that fit any capacity (capacity=1 or capacity_bytes=1 are valid options)
    n = min(2, st.capacity, st.capacity_bytes or 2)
    rows = await q.put({"__ok": torch.arange(n, dtype=torch.uint8)}, partition="__check")
    mb = await q.get("__check", ["__ok"], n, partition="__check", timeout=5)
    assert (await mb.materialize())["__ok"].tolist() == list(range(n))
    await mb.drop()
    assert rows.rows == mb.rows


def _allowed(e: BaseException) -> bool:
    return isinstance(e, (StreamRLError, TypeError, ValueError))


@SETTINGS
@given(data=data_strategy, partition=st.one_of(st.none(), junk),
       version=st.one_of(st.none(), junk), timeout=st.one_of(st.none(), junk),
       overwrite=st.one_of(st.booleans(), junk))
def test_put_fuzz(data, partition, version, timeout, overwrite):
    async def main():
        async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
            base = await q.put({"idx": torch.arange(2)}, partition="p")
            for rows in (None, base):
                try:
                    await asyncio.wait_for(
                        q.put(data, partition=partition, rows=rows, version=version,
                              timeout=timeout, overwrite=overwrite), 5)
                except StreamRLError:  # (StreamTimeout is a TimeoutError too)
                    pass
                except asyncio.TimeoutError:
                    raise AssertionError("put hung")
                except BaseException as e:  # noqa: BLE001
                    assert _allowed(e), repr(e)
            await _consistent(q)

    _run(main())


@SETTINGS
@given(task=st.one_of(st.text(min_size=1, max_size=3), junk),
       fields=st.one_of(st.lists(st.sampled_from(["idx", "x", "nope", ""]), max_size=3), junk),
       batch_size=st.one_of(st.integers(-1, 5), junk),
       options=st.dictionaries(st.sampled_from(
           ["partition", "group_by", "group_size", "drop_last", "max_staleness", "dp_rank",
            "dp_size", "balance_by", "dp_remainder", "lease_timeout", "timeout", "sampler"]),
           junk, max_size=3))
def test_get_fuzz(task, fields, batch_size, options):
    async def main():
        async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
            await q.put({"idx": torch.arange(4), "x": torch.zeros(4, 2)}, partition="p")
            await q.seal("p")
            opts = dict(options)
            opts["timeout"] = 0.05 if opts.get("timeout") is None else opts["timeout"]
            try:
                mb = await asyncio.wait_for(q.get(task, fields, batch_size, **opts), 5)
            except StreamRLError:  # (StreamTimeout is a TimeoutError too)
                pass
            except asyncio.TimeoutError:
                raise AssertionError("get hung past its own timeout")
            except BaseException as e:  # noqa: BLE001
                assert _allowed(e), repr(e)
            else:
                await mb.release()
            await _consistent(q)

    _run(main())


@SETTINGS
@given(index=st.one_of(junk, st.slices(6), st.lists(st.integers(-7, 7), max_size=4),
                       st.lists(st.booleans(), min_size=6, max_size=6)),
       fields=st.one_of(st.lists(st.sampled_from(["idx", "x", "nope"]), max_size=2), junk),
       op=st.sampled_from(["index", "select", "split", "chunk", "repeat", "write", "concat"]))
def test_batch_view_fuzz(index, fields, op):
    async def main():
        async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
            mb = await q.put({"idx": torch.arange(6), "x": torch.zeros(6, 2)}, partition="p")
            try:
                if op == "index":
                    v = mb[index]
                    await v.materialize(fields if isinstance(fields, list) else None)
                elif op == "select":
                    await mb.select(*fields if isinstance(fields, list) else fields).materialize()
                elif op == "split":
                    mb.split(index)
                elif op == "chunk":
                    mb.chunk(index)
                elif op == "repeat":
                    mb.repeat(index)
                elif op == "write":
                    await mb[index].write({"w": torch.ones(len(mb[index]))})
                else:
                    streamrl.RowRemoteBatch.concat(index)
            except BaseException as e:  # noqa: BLE001
                assert _allowed(e) or isinstance(e, (IndexError, KeyError)), repr(e)
            await _consistent(q)

    _run(main())


@SETTINGS
@given(name=st.sampled_from(["seal", "clear", "declare", "set_version", "wait_version",
                             "drop", "add_filter", "from_config"]),
       args=st.lists(junk, max_size=2))
def test_lifecycle_fuzz(name, args):
    async def main():
        async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
            await q.put({"idx": torch.arange(2)}, partition="p")
            try:
                if name == "from_config":
                    streamrl.StreamQueue.from_config(*args[:1])
                elif name == "wait_version":
                    await asyncio.wait_for(q.wait_version(*args[:1], timeout=0.05), 5)
                elif name == "add_filter":
                    await q.add_filter(*args[:1], fields=args[1] if len(args) > 1 else None)
                else:
                    await asyncio.wait_for(getattr(q, name)(*args), 5)
            except StreamRLError:  # (StreamTimeout is a TimeoutError too)
                pass
            except asyncio.TimeoutError:
                raise AssertionError(f"{name} hung")
            except BaseException as e:  # noqa: BLE001
                assert _allowed(e), repr(e)
            await _consistent(q)

    _run(main())


# ------------------------------------------------------------------ names in the errors


def _check_names(e: BaseException, named: dict) -> None:
    """An error of bad arguments must say which: no raw ``TypeError``/``ValueError`` (from
    deep inside) comes out at all, and an :class:`~streamrl.errors.InvalidArgument` names
    one of the arguments given (``named``: name -> value). Schema and encoding errors are
    about the data (they name its fields)."""
    assert _allowed(e), repr(e)
    if isinstance(e, InvalidArgument) or (
            isinstance(e, (TypeError, ValueError)) and not isinstance(e, StreamRLError)):
        assert isinstance(e, StreamRLError), (
            f"a raw {type(e).__name__} came out: {e!r}; bad arguments raise streamrl errors")
        msg = str(e)
        assert any(name in msg for name in named), (
            f"the error names none of the arguments {sorted(named)}: {e!r}")


#: the constructor's options and values around their valid ones
_CTOR_OPTIONS = {
    "capacity": st.one_of(st.integers(-2, 64), junk),
    "num_shards": st.one_of(st.integers(-1, 5), junk),
    "capacity_bytes": st.one_of(st.none(), st.integers(-1, 1 << 20), junk),
    "lease_timeout": st.one_of(st.floats(-1, 100), junk),
    "max_staleness": st.one_of(st.none(), st.integers(-2, 3), junk),
    "max_lead": st.one_of(st.none(), st.integers(-2, 3), junk),
    "consumers": st.one_of(st.none(), st.lists(st.sampled_from(["a", "b", ""]), max_size=3),
                           junk),
    "name": st.one_of(st.none(), st.text(max_size=4), junk),
    "storage": st.one_of(st.sampled_from(["memory", "nope", {"backend": "memory"},
                                          {"backend": "memory", "junk": 1}]), junk),
    "sampler": st.one_of(st.sampled_from(["fifo", "nope", {"sampler": "fifo"}]), junk),
    "transport": st.one_of(st.sampled_from(["embedded", "nope", ""]), junk),
    "checkpoint_every": st.one_of(st.none(), junk),
    "checkpoint_keep": st.one_of(st.integers(-1, 3), junk),
    "no_such_option": junk,
}


@SETTINGS
@given(options=st.fixed_dictionaries({}, optional=_CTOR_OPTIONS))
def test_constructor_fuzz(options):
    """StreamQueue(...) with random options: a queue that works, or a clear error that
    names the option."""
    async def main():
        try:
            q = streamrl.StreamQueue(**options)
        except BaseException as e:  # noqa: BLE001
            _check_names(e, options)
            return
        try:
            await _consistent(q)
        finally:
            await q.close()
            await q.shutdown()

    _run(main())


_STREAM_OPTIONS = ["partition", "group_by", "group_size", "drop_last", "max_staleness",
                   "dp_rank", "dp_size", "balance_by", "dp_remainder", "lease_timeout",
                   "timeout", "sampler"]


@SETTINGS
@given(task=st.one_of(st.text(min_size=1, max_size=3), junk),
       fields=st.one_of(st.lists(st.sampled_from(["idx", "x", "nope", ""]), max_size=3), junk),
       batch_size=st.one_of(st.integers(-1, 5), junk),
       options=st.dictionaries(st.sampled_from(_STREAM_OPTIONS), junk, max_size=3),
       ctx=st.booleans())
def test_stream_fuzz(task, fields, batch_size, options, ctx):
    """stream(...) with random arguments: the errors come when the stream is made or on
    its first batch, name the argument, and leave nothing leased."""
    async def main():
        async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
            await q.put({"idx": torch.arange(4), "x": torch.zeros(4, 2)}, partition="p")
            await q.seal("p")
            opts = dict(options)
            opts["timeout"] = 0.05 if opts.get("timeout") is None else opts["timeout"]
            named = {"task": task, "fields": fields, "batch_size": batch_size, **opts}

            async def one():
                s = q.stream(task, fields, batch_size, **opts)
                if ctx:
                    async with s as batches:
                        async for mb in batches:
                            await mb.materialize()
                            break
                else:
                    async for mb in s:
                        await mb.ack()
                        break
            try:
                await asyncio.wait_for(one(), 5)
            except (StreamTimeout, EndOfStream):
                pass
            except asyncio.TimeoutError:
                raise AssertionError("stream hung past its own timeout")
            except BaseException as e:  # noqa: BLE001
                _check_names(e, named)
            await _consistent(q)

    _run(main())


@SETTINGS
@given(data=data_strategy, partition=st.one_of(st.none(), junk),
       version=st.one_of(st.none(), junk), fill=st.booleans())
def test_put_nowait_fuzz(data, partition, version, fill):
    """put_nowait: a full queue raises QueueFull; bad arguments a clear error."""
    async def main():
        async with streamrl.StreamQueue(capacity=4, num_shards=2) as q:
            if fill:
                await q.put({"idx": torch.arange(4)}, partition="p")
            try:
                await asyncio.wait_for(q.put_nowait(data, partition=partition,
                                                    version=version), 5)
            except asyncio.TimeoutError:
                raise AssertionError("put_nowait waited")
            except BaseException as e:  # noqa: BLE001
                _check_names(e, {"data": data, "partition": partition, "version": version})
            if fill:
                await q.clear("p")
            await _consistent(q)

    _run(main())


SYNC_SETTINGS = settings(SETTINGS, max_examples=max(20, SETTINGS.max_examples // 3))


@SYNC_SETTINGS
@given(op=st.sampled_from(["put", "put_nowait", "get", "stream", "seal", "wait_version",
                           "set_version", "drop", "clear"]),
       args=st.lists(junk, max_size=3))
def test_sync_twin_fuzz(op, args):
    """The blocking twin (streamrl.sync.StreamQueue, embedded): the same errors as the
    async queue, no hang, and the queue usable afterwards."""
    from streamrl.sync import StreamQueue as SyncQueue

    with SyncQueue(capacity=16, num_shards=2) as q:
        q.put({"idx": torch.arange(2)}, partition="p")
        try:
            if op in ("get", "stream"):
                task, fields, bs = (list(args) + ["t", ["idx"], 2])[:3]
                named = {"task": task, "fields": fields, "batch_size": bs}
                if op == "get":
                    q.get(task, fields, bs, partition="p", timeout=0.05).release()
                else:
                    for mb in q.stream(task, fields, bs, partition="p", timeout=0.05):
                        mb.ack()
                        break
            elif op in ("put", "put_nowait"):
                named = {"data": args[0] if args else None,
                         "partition": args[1] if len(args) > 1 else None}
                getattr(q, op)(*named.values())
            else:  # one argument each
                arg = {"seal": "partition", "clear": "partition", "drop": "rows",
                       "set_version": "version", "wait_version": "version"}[op]
                named = {arg: args[0] if args else None}
                kw = {"timeout": 0.05} if op == "wait_version" else {}
                getattr(q, op)(named[arg], **kw)
        except StreamTimeout:
            pass
        except BaseException as e:  # noqa: BLE001
            _check_names(e, named)
        # consistent and usable afterwards
        assert q.audit() == []
        if not q.aqueue._control.ctl.sealed_all:
            q.put({"__ok": torch.arange(2)}, partition="__check")
            mb = q.get("__check", ["__ok"], 2, partition="__check", timeout=5)
            assert mb.materialize()["__ok"].tolist() == [0, 1]
            mb.drop()


# ------------------------------------------------------------------ what the fuzz found


@pytest.mark.parametrize("value", [[1], {"a": 1}, np.zeros(2), 1, ""])
@pytest.mark.parametrize("op", ["seal", "clear", "declare"])
def test_a_bad_partition_is_refused_naming_it(op, value):
    """seal/clear/declare of a partition that is not a non-empty str raise InvalidArgument
    naming ``partition`` (an unhashable one raised a raw ``TypeError: unhashable type``)."""
    async def main():
        async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
            await q.put({"idx": torch.arange(2)}, partition="p")
            args = (value, None) if op == "declare" else (value,)
            with pytest.raises(InvalidArgument, match="partition"):
                await getattr(q, op)(*args)
            await _consistent(q)

    _run(main())


@pytest.mark.parametrize("data", [None, 3, [1, 2], torch.zeros(2), {}, {"x": torch.zeros(0)},
                                  {1: torch.zeros(2)}])
@pytest.mark.parametrize("op", ["put", "put_nowait"])
def test_bad_data_is_refused_naming_it(op, data):
    """A put's data that is not a non-empty mapping of fields -> rows: the error names
    ``data`` (it said "put takes a TensorDict ..." or "put needs at least one field")."""
    async def main():
        async with streamrl.StreamQueue(capacity=16, num_shards=2) as q:
            with pytest.raises(InvalidArgument, match="data"):
                await getattr(q, op)(data, partition="p")
            await _consistent(q)

    _run(main())
