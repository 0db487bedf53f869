"""The blocking twin cannot drift from the async API (issue 11, item 7).

The async and blocking public surfaces are compared name by name, kind by kind and
signature by signature, for the queue, the batch, the column view and the stream. The only
differences allowed are the ones each twin documents in its table (``_twin``: hidden,
renamed, written by hand, constructors, extra names). The comparison is written here, on
its own (from ``dir`` and ``inspect``), and is shown to fail when the async side grows a
method the twin does not have.
"""

from __future__ import annotations

import inspect
import pydoc
import re
import types

import pytest
import torch

import streamrl
from streamrl import sync
from streamrl.batch import ColumnRemoteBatch, RowRemoteBatch
from streamrl.queue import Stream

PAIRS = [
    (streamrl.StreamQueue, sync.StreamQueue),
    (RowRemoteBatch, sync.SyncBatch),
    (ColumnRemoteBatch, sync.SyncColumn),
    (Stream, sync.SyncStream),
]
IDS = [a.__name__ for a, _ in PAIRS]

# the blocking types that stand for async ones in return annotations
BLOCKING = {"RowRemoteBatch": "SyncBatch", "ColumnRemoteBatch": "SyncColumn",
            "RemoteBatch": "SyncBatch", "Stream": "SyncStream"}


def raw(cls: type, name: str):
    """The member as defined in the class body (property, classmethod... objects)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


def surface(cls: type, blocking: bool = False) -> set[str]:
    """Public names of a class, plus the protocol methods it defines itself (the async
    ones for an async class: ``__aiter__``..., the blocking ones for a twin: ``__iter__``...)."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    protocol = sync.PROTOCOL.values() if blocking else sync.PROTOCOL.keys()
    names |= {n for n in protocol if any(n in vars(k) for k in cls.__mro__[:-1])}
    return names


def kind(member) -> str:
    if isinstance(member, classmethod):
        return "classmethod"
    if isinstance(member, staticmethod):
        return "staticmethod"
    if isinstance(member, (property, types.MemberDescriptorType)):
        return "property"
    if inspect.isfunction(member):
        return "method"
    return "attribute"


def blocking_annotation(annotation):
    if isinstance(annotation, str):
        return re.sub(r"\b(RowRemoteBatch|ColumnRemoteBatch|RemoteBatch|Stream)\b",
                      lambda m: BLOCKING[m.group(1)], annotation)
    return annotation


def problems(async_cls: type, sync_cls: type, twin: sync.Twin | None = None) -> list[str]:
    """Every way ``sync_cls`` is not the blocking twin of ``async_cls`` that ``twin``
    (default: the twin's own table) does not document."""
    twin = twin or sync_cls._twin
    out: list[str] = []
    theirs = surface(sync_cls, blocking=True)
    expected: set[str] = set()
    for name in sorted(surface(async_cls)):
        if name in twin.hidden:
            if name in theirs:
                out.append(f"{name}: documented as not exposed, but the twin has it")
            continue
        twin_name = twin.renamed.get(name, sync.PROTOCOL.get(name, name))
        expected.add(twin_name)
        if twin_name not in theirs:
            out.append(f"{name}: the async class has it, the blocking twin has no {twin_name}")
            continue
        a, s = raw(async_cls, name), raw(sync_cls, twin_name)
        ka, ks = kind(a), kind(s)
        if ka == "classmethod" and name not in twin.constructors:
            out.append(f"{name}: a classmethod missing from the twin's constructors table")
        if ka != ks:
            out.append(f"{name}: {ka} on the async class, {ks} on the twin")
            continue
        if ka in ("method", "classmethod", "staticmethod"):
            fa = a.__func__ if ka != "method" else a
            fs = s.__func__ if ks != "method" else s
            if inspect.iscoroutinefunction(fs):
                out.append(f"{name}: the twin's {twin_name} is a coroutine function")
            sa, ss = inspect.signature(fa), inspect.signature(fs)
            if list(sa.parameters.values()) != list(ss.parameters.values()):
                out.append(f"{name}: parameters differ: async {sa}, blocking {ss}")
            elif (name not in twin.renamed and name not in twin.by_hand
                  and ss.return_annotation != blocking_annotation(sa.return_annotation)):
                out.append(f"{name}: returns {ss.return_annotation!r}, expected "
                           f"{blocking_annotation(sa.return_annotation)!r}")
    for name in twin.attributes:  # instance attributes of the async objects
        expected.add(name)
        if kind(getattr(sync_cls, name, None)) != "property":
            out.append(f"{name}: an instance attribute the twin does not forward")
    for name in sorted(theirs - expected):
        if name not in twin.extra:
            out.append(f"{name}: only on the blocking twin, and not documented as extra")
    return out


# ---------------------------------------------------------------- the real surfaces


@pytest.mark.parametrize("async_cls, sync_cls", PAIRS, ids=IDS)
def test_async_and_blocking_surfaces_match_name_by_name(async_cls, sync_cls):
    assert sync_cls._twin.source is async_cls
    assert problems(async_cls, sync_cls) == []


@pytest.mark.parametrize("async_cls, sync_cls", PAIRS, ids=IDS)
def test_every_documented_exception_names_a_real_member_and_says_why(async_cls, sync_cls):
    twin = sync_cls._twin
    public = surface(async_cls)
    for table in (twin.hidden, twin.renamed, twin.by_hand, twin.constructors):
        for name in table:
            assert name in public, f"{name} is in the table but not on {async_cls.__name__}"
    for table in (twin.hidden, twin.by_hand, twin.extra):
        assert all(isinstance(why, str) and len(why) > 10 for why in table.values())
    for name in twin.extra:
        assert name in surface(sync_cls, blocking=True) and name not in public


def test_the_queue_instance_attributes_are_forwarded_too():
    q = streamrl.StreamQueue(capacity=8, num_shards=1, name="named")
    public = {n for n in vars(q) if not n.startswith("_")}
    assert public == {"name"}  # an attribute set in __init__, invisible on the class
    assert public <= surface(sync.StreamQueue, blocking=True)
    with sync.StreamQueue(capacity=8, num_shards=1, name="named") as sq:
        assert sq.name == "named"
        assert sq.num_shards == 1 and sq.transport == "embedded"
        assert sq.queue_id == sq.aqueue.queue_id
        assert sq.config.capacity == 8


def test_derived_methods_keep_the_async_signature_and_docstring():
    for async_cls, sync_cls in PAIRS:
        for name in surface(async_cls) - set(sync_cls._twin.hidden):
            a = raw(async_cls, name)
            if not (inspect.iscoroutinefunction(a) or inspect.isfunction(a)):
                continue
            s = getattr(sync_cls, sync_cls._twin.renamed.get(name, name))
            if name in sync_cls._twin.renamed or name in sync_cls._twin.by_hand:
                continue
            assert s.__name__ == name and s.__module__ == "streamrl.sync"
            assert inspect.getdoc(a) is None or inspect.getdoc(a) in inspect.getdoc(s), name
    # what help() and IDEs show
    text = pydoc.render_doc(sync.StreamQueue.put, renderer=pydoc.plaintext)
    assert "put(self, data" in text and "-> 'SyncBatch'" in text and "Put new rows" in text
    assert str(inspect.signature(sync.StreamQueue)) == str(inspect.signature(streamrl.StreamQueue))
    assert "Blocking :meth:`streamrl.StreamQueue.get`" in sync.StreamQueue.get.__doc__
    assert inspect.signature(sync.SyncBatch.split).return_annotation == "list['SyncBatch']"


def test_constructors_return_blocking_queues():
    q = sync.StreamQueue.from_config({"capacity": 16, "num_shards": 3})
    try:
        assert isinstance(q, sync.StreamQueue) and q.num_shards == 3
        rows = q.put({"x": torch.arange(4)}, partition="p")
        assert isinstance(rows, sync.SyncBatch) and rows.queue is q
        col = rows["x"]
        assert isinstance(col, sync.SyncColumn) and isinstance(col.batch, sync.SyncBatch)
        assert col.materialize().tolist() == [0, 1, 2, 3]
        both = sync.SyncBatch.concat([rows[:1], rows[2:]])  # a static method, unwrapped
        assert isinstance(both, sync.SyncBatch) and both.materialize()["x"].tolist() == [0, 2, 3]
        assert rows.write({"y": torch.ones(4)}) is rows  # the batch itself, not a new twin
        st = q.stream("t", ["x"], batch_size=4, partition="p", timeout=5)
        assert isinstance(st, sync.SyncStream) and st.current is None
        mb = next(st)
        assert st.current.rows == mb.rows and isinstance(st.current, sync.SyncBatch)
        st.close()
    finally:
        q.close()
        q.shutdown()
    assert inspect.signature(sync.StreamQueue.connect) == inspect.signature(
        streamrl.StreamQueue.connect)


# ---------------------------------------------------------------- the check can fail


class Extended(streamrl.StreamQueue):
    """An async queue that grew a method."""

    async def frobnicate(self, n: int, *, twice: bool = False) -> "RowRemoteBatch":
        """Put ``n`` rows (twice as many with ``twice``)."""
        return await self.put({"x": torch.arange(n * (2 if twice else 1))}, partition="f")

    @property
    def colour(self) -> str:
        """A new property."""
        return "blue"


def test_the_check_fails_when_the_async_class_grows_a_method():
    found = problems(Extended, sync.StreamQueue, sync.StreamQueue._twin)
    assert any(p.startswith("frobnicate:") for p in found), found
    assert any(p.startswith("colour:") for p in found), found


def test_the_check_fails_for_a_monkeypatched_extra_method(monkeypatch):
    async def rebalance(self, shards: int) -> None:
        """Move rows between shards."""

    monkeypatch.setattr(streamrl.StreamQueue, "rebalance", rebalance, raising=False)
    found = problems(streamrl.StreamQueue, sync.StreamQueue)
    assert found == ["rebalance: the async class has it, the blocking twin has no rebalance"]
    # a twin derived now gets it, with its signature
    class SyncNow(sync.StreamQueue, twin=streamrl.StreamQueue):
        pass

    assert problems(streamrl.StreamQueue, SyncNow) == []
    assert str(inspect.signature(SyncNow.rebalance)) == "(self, shards: 'int') -> 'None'"


def test_the_check_fails_on_a_changed_signature_or_an_undocumented_extra(monkeypatch):
    async def stats(self, detail: bool = False):
        """Stats, maybe detailed."""

    monkeypatch.setattr(streamrl.StreamQueue, "stats", stats)
    found = problems(streamrl.StreamQueue, sync.StreamQueue)
    assert len(found) == 1 and found[0].startswith("stats: parameters differ"), found
    monkeypatch.undo()

    monkeypatch.setattr(sync.StreamQueue, "frob", lambda self: None, raising=False)
    assert problems(streamrl.StreamQueue, sync.StreamQueue) == [
        "frob: only on the blocking twin, and not documented as extra"]


def test_a_new_classmethod_needs_a_decision_in_the_constructors_table():
    # (restore is in the table now; a classmethod nobody decided on yet must be flagged)
    class Migratable(streamrl.StreamQueue):
        @classmethod
        async def migrate(cls, path: str) -> "Migratable":
            """A queue moved from elsewhere."""
            return cls(capacity=8, num_shards=1)

    class SyncMigratable(sync.StreamQueue, twin=Migratable):
        pass

    assert problems(Migratable, SyncMigratable) == [
        "migrate: the async class has it, the blocking twin has no migrate"]


def test_a_twin_derived_for_an_extended_queue_has_and_runs_the_new_members():
    class SyncExtended(sync.StreamQueue, twin=Extended):
        pass

    assert problems(Extended, SyncExtended) == []
    with SyncExtended(capacity=16, num_shards=1) as q:
        assert isinstance(q.aqueue, Extended)
        rows = q.frobnicate(3, twice=True)  # blocking, and the result is a blocking batch
        assert isinstance(rows, sync.SyncBatch) and len(rows) == 6
        assert q.colour == "blue"
        assert q.stats().rows == 6
    assert inspect.getdoc(SyncExtended.frobnicate).endswith("Put ``n`` rows (twice as many "
                                                            "with ``twice``).")
    with pytest.raises(TypeError, match="not a subclass"):
        class Wrong(sync.SyncBatch, twin=Extended):
            pass
