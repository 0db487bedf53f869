"""A process's concurrent small puts combined into one call (streamrl.transport.ray.coalesce),
driven with a fake call so that every interleaving is chosen by the test: what goes at
once, what waits and is combined, what each put gets back, and what a cancellation at
each await leaves behind."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("ray")  # (the module is part of the Ray transport)

from streamrl.transport.ray.coalesce import ROOMS, SPLIT, PutCoalescer  # noqa: E402


class FakeUnit:
    """Stands for ``send`` and ``retract``: numbers rows in call order, keeps what each
    call carried, and holds a call until the test lets it go (``hold``)."""

    def __init__(self):
        self.sent: list[dict] = []
        self.retracted: list[tuple[str, list[int]]] = []
        self.held: dict[str, asyncio.Event] = {}
        self.hold = False
        self.answer = "ok"  # or "none", or an exception to raise
        self.next = 0
        self.rows: dict[str, list[int]] = {}  # rid -> rows of the call

    async def send(self, partition, cols, n, nbytes, tags, version, dtypes, rid, alone):
        self.sent.append(dict(partition=partition, cols=cols, n=n, nbytes=nbytes, tags=tags,
                              version=version, rid=rid, alone=alone))
        if self.hold:
            ev = self.held[rid] = asyncio.Event()
            await ev.wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer == "none":
            return None
        rows = list(range(self.next, self.next + n))
        self.next += n
        self.rows[rid] = rows
        return rows, [3] * n, {"call": rid}

    async def retract(self, shard, rid, rows):
        assert shard == 3 and set(rows) <= set(self.rows[rid])
        await asyncio.sleep(0)
        self.retracted.append((rid, list(rows)))

    def release(self, i: int) -> None:
        self.held[self.sent[i]["rid"]].set()


def _row(v: int, part: str = "p"):
    return (part, {"x": torch.tensor([[v, v]]), "chat": [f"c{v}"]}, 1,
            {"x": [16], "chat": [2]}, {}, None, None)


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def _busy(u: FakeUnit, c: PutCoalescer, k: int) -> list[asyncio.Task]:
    """``k`` lone puts, held in flight."""
    u.hold = True
    first = [asyncio.ensure_future(c.put(*_row(100 + i))) for i in range(k)]
    await _settle()
    assert c.in_flight == k and len(u.sent) == k
    return first


async def _behind(k: int, **kw) -> tuple[FakeUnit, PutCoalescer, list[asyncio.Task],
                                          list[asyncio.Task]]:
    """A coalescer (one call in flight) with one lone put held in flight and ``k``
    one-row puts waiting behind it."""
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1, **kw)
    first = await _busy(u, c, 1)
    waiting = [asyncio.ensure_future(c.put(*_row(i))) for i in range(k)]
    await _settle()
    return u, c, first, waiting


async def test_a_lone_put_goes_at_once_alone():
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract)
    rows, shards, res = await c.put(*_row(1))
    assert rows == [0] and shards == [3] and len(u.sent) == 1 and u.sent[0]["alone"]
    assert c.in_flight == 0 and (c.calls, c.rows) == (1, 1)


async def test_puts_made_while_calls_are_in_flight_go_as_one_call_per_kind():
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    first = await _busy(u, c, 1)
    waiting = [asyncio.ensure_future(c.put(*_row(i))) for i in range(3)]
    other = asyncio.ensure_future(c.put(*_row(9, part="q")))  # another partition
    await _settle()
    assert len(u.sent) == 1 and not any(t.done() for t in waiting)
    u.hold = False
    u.release(0)
    await asyncio.gather(*first, *waiting, other)
    assert len(u.sent) == 3  # the first, then one call per kind
    both = u.sent[1]
    assert both["n"] == 3 and not both["alone"] and both["partition"] == "p"
    assert both["cols"]["x"].tolist() == [[0, 0], [1, 1], [2, 2]]
    assert both["cols"]["chat"] == ["c0", "c1", "c2"]
    assert both["nbytes"] == {"x": [16, 16, 16], "chat": [2, 2, 2]}
    assert u.sent[2]["partition"] == "q" and u.sent[2]["n"] == 1
    # each put has its own rows of the combined call, in order
    assert [t.result()[0] for t in waiting] == [[1], [2], [3]]
    assert [t.result()[1] for t in waiting] == [[3]] * 3
    assert other.result()[0] == [4]
    assert (c.calls, c.rows, c.in_flight) == (3, 5, 0)


async def test_puts_of_other_kinds_are_not_combined():
    """Another version, another row shape or dtype, other tag fields: other calls."""
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    first = await _busy(u, c, 1)
    base = _row(0)
    variants = [
        base,
        base[:5] + (7,) + base[6:],  # version
        (base[0], {"x": torch.tensor([[1, 1, 1]]), "chat": ["a"]}) + base[2:],  # row shape
        (base[0], {"x": torch.tensor([[1.0, 1.0]]), "chat": ["a"]}) + base[2:],  # dtype
        base[:4] + ({"chat": ["u"]},) + base[5:],  # a tag field
    ]
    tasks = [asyncio.ensure_future(c.put(*v)) for v in variants]
    await _settle()
    u.hold = False
    u.release(0)
    await asyncio.gather(*first, *tasks)
    assert len(u.sent) == 1 + len(variants) and all(s["n"] == 1 for s in u.sent)


async def test_puts_that_bring_their_shapes_combine_with_those_that_do_not():
    """A one-row put of dense tensors comes with its columns' shapes already read
    (``one_row_dense``, the queue's quick path); it is of the same kind as a put of the
    same columns without them, and of another kind when a row shape differs."""
    from streamrl.columns import one_row_dense

    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    first = await _busy(u, c, 1)

    def put(v: int, width: int = 2, hint: bool = True):
        cols = {"x": torch.full((1, width), v), "r": torch.tensor([float(v)])}
        nbytes, dtypes, shapes = one_row_dense(cols)
        return asyncio.ensure_future(c.put("p", cols, 1, nbytes, {}, None, dtypes, None,
                                           shapes if hint else None))

    same = [put(0), put(1, hint=False), put(2), put(3, hint=False)]
    wider = put(4, width=3)
    await _settle()
    u.hold = False
    u.release(0)
    await asyncio.gather(*first, *same, wider)
    assert len(u.sent) == 3  # the first, the four alike as one call, the wider one
    assert u.sent[1]["n"] == 4 and u.sent[1]["cols"]["x"][:, 0].tolist() == [0, 1, 2, 3]
    assert u.sent[2]["n"] == 1 and u.sent[2]["cols"]["x"].shape == (1, 3)


async def test_tags_of_combined_puts_are_joined():
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    first = await _busy(u, c, 1)
    tasks = [asyncio.ensure_future(c.put(*(_row(i)[:4] + ({"chat": [f"u{i}"]},)
                                           + _row(i)[5:]))) for i in range(2)]
    await _settle()
    u.hold = False
    u.release(0)
    await asyncio.gather(*first, *tasks)
    assert u.sent[1]["tags"] == {"chat": ["u0", "u1"]}


async def test_a_combined_call_carries_at_most_max_bytes():
    """Puts that would take their group past max_bytes start another group (sent as
    another call when the call in flight returns)."""
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1, max_bytes=40)  # a put: 18 bytes
    first = await _busy(u, c, 1)
    waiting = [asyncio.ensure_future(c.put(*_row(i))) for i in range(5)]
    await _settle()
    u.hold = False
    u.release(0)
    await asyncio.gather(*first, *waiting)
    assert [s["n"] for s in u.sent[1:]] == [2, 2, 1]
    assert [s["cols"]["chat"] for s in u.sent[1:]] == [["c0", "c1"], ["c2", "c3"], ["c4"]]
    assert [t.result()[0] for t in waiting] == [[1], [2], [3], [4], [5]]


async def test_a_put_cancelled_while_it_waits_is_never_sent():
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    first = await _busy(u, c, 1)
    waiting = [asyncio.ensure_future(c.put(*_row(i))) for i in range(3)]
    await _settle()
    waiting[1].cancel()
    await _settle()
    assert waiting[1].cancelled()  # at once: nothing was sent for it
    u.hold = False
    u.release(0)
    await asyncio.gather(*first, waiting[0], waiting[2])
    assert u.sent[1]["cols"]["chat"] == ["c0", "c2"] and u.retracted == []


async def test_a_lone_waiting_put_cancelled_leaves_no_call_behind():
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    first = await _busy(u, c, 1)
    t = asyncio.ensure_future(c.put(*_row(5)))
    await _settle()
    t.cancel()
    await _settle()
    u.release(0)
    await asyncio.gather(*first)
    await _settle()
    assert t.cancelled() and len(u.sent) == 1 and c.in_flight == 0


async def test_a_put_cancelled_while_its_combined_call_is_in_flight_takes_back_its_rows_first():
    """The cancellation goes on only once the call is answered and this put's rows (and
    only they) are taken back; the other puts of the call keep theirs."""
    u = FakeUnit()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    first = await _busy(u, c, 1)
    waiting = [asyncio.ensure_future(c.put(*_row(i))) for i in range(3)]
    await _settle()
    u.release(0)  # the combined call goes, and is held in flight
    await _settle()
    assert len(u.sent) == 2 and u.sent[1]["n"] == 3
    waiting[1].cancel()
    await _settle()
    assert not waiting[1].done()  # waits for the answer and the undo
    u.release(1)
    await asyncio.gather(waiting[0], waiting[2])
    with pytest.raises(asyncio.CancelledError):
        await waiting[1]
    rid = u.sent[1]["rid"]
    assert u.retracted == [(rid, [2])]
    assert waiting[0].result()[0] == [1] and waiting[2].result()[0] == [3]
    await asyncio.gather(*first)


async def test_a_put_cancelled_just_after_its_answer_takes_its_rows_back_itself():
    """The call was answered and the put's result set, and it is cancelled before it
    resumes: it takes back its own rows before the cancellation goes on."""
    u, c, first, waiting = await _behind(2)
    u.hold = False
    send = u.send

    async def answered_then_cancel(*args):
        out = await send(*args)
        asyncio.get_running_loop().call_soon(waiting[0].cancel)  # after the answers
        return out

    u.send = answered_then_cancel
    c._send = answered_then_cancel
    u.release(0)
    await asyncio.gather(*first, waiting[1])
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    assert u.retracted == [(u.sent[1]["rid"], [1])]
    assert waiting[1].result()[0] == [2]


async def test_a_combined_call_that_does_not_apply_sends_each_put_the_usual_way():
    u, c, first, waiting = await _behind(2)
    u.hold = False
    u.answer = "none"
    u.release(0)
    assert await asyncio.gather(*waiting) == [None, None]
    assert first[0].result() is None


async def test_a_combined_call_that_fails_raises_in_each_put():
    u, c, first, waiting = await _behind(2)
    u.hold = False
    u.answer = RuntimeError("the controller is gone")
    u.release(0)
    res = await asyncio.gather(*first, *waiting, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in res)
    assert c.in_flight == 0 and not c._groups


def test_max_in_flight_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        PutCoalescer(lambda *a: None, lambda *a: None, max_in_flight=0)


# -- puts that may wait for room: the usual way, together, when the units have no room


class FakeNewRows:
    """Stands for the queue's usual way (``NewRows``): numbers rows from 1000 in the
    order room is given; holds a request for room, or a store, while ``hold_room`` /
    ``hold_store`` is set, until the test lets it go."""

    def __init__(self):
        self.rooms: list[dict] = []  # each request for room, in order
        self.stored: list[dict] = []
        self.retracted: list[list[int]] = []
        self.aborted: list[dict] = []
        self.hold_room = False
        self.hold_store = False
        self.refuse = False
        self.gates: list[asyncio.Event] = []
        self.next = 1000

    async def _gate(self) -> None:
        ev = asyncio.Event()
        self.gates.append(ev)
        await ev.wait()

    def go(self) -> None:
        """Let every held request go."""
        for ev in self.gates:
            ev.set()

    async def room(self, partition, cols, n, nbytes, version, dtypes):
        req = dict(partition=partition, chat=list(cols["chat"]), n=n, given=False)
        self.rooms.append(req)
        if self.hold_room:
            await self._gate()
        if self.refuse:
            return None
        req["given"] = True
        tok = {"rows": list(range(self.next, self.next + n))}
        self.next += n
        return tok

    async def store(self, tok, cols, nbytes, tags):
        self.stored.append(dict(rows=tok["rows"], chat=list(cols["chat"]),
                                x=cols["x"].tolist(), nbytes=nbytes))
        if self.hold_store:
            await self._gate()
        n = len(tok["rows"])
        return tok["rows"], [5] * n, {"usual": True}

    async def abort(self, tok):
        self.aborted.append(tok)

    async def retract(self, rows):
        await asyncio.sleep(0)
        self.retracted.append(list(rows))


_DTYPES = {"x": "int64", "chat": "list"}


def _urow(v: int, usual: FakeNewRows):
    """A one-row put that may wait for room (it comes with ``usual``)."""
    return _row(v)[:6] + (_DTYPES, usual)


async def _full(k: int) -> tuple[FakeUnit, FakeNewRows, PutCoalescer, list[asyncio.Task],
                                  list[asyncio.Task]]:
    """The units are full (``send`` answers ``None``): ROOMS lone puts waiting for room
    at the controller (held), and ``k`` puts of their kind that may wait for room made
    behind them."""
    u = FakeUnit()
    u.answer = "none"
    nr = FakeNewRows()
    nr.hold_room = True
    c = PutCoalescer(u.send, u.retract, max_in_flight=1)
    lone = []
    for i in range(ROOMS):
        lone.append(asyncio.ensure_future(c.put(*_urow(100 + i, nr))))
        await _settle()
    # waiting for room, they hold no slot in flight; their kind has ROOMS requests out
    assert len(nr.rooms) == ROOMS and c.in_flight == 0 and list(c._rooms.values()) == [ROOMS]
    waiting = [asyncio.ensure_future(c.put(*_urow(i, nr))) for i in range(k)]
    await _settle()
    assert len(u.sent) == ROOMS and len(nr.rooms) == ROOMS  # the others wait behind them
    return u, nr, c, lone, waiting


async def test_with_no_room_puts_that_may_wait_go_the_usual_way_together():
    """One request for room for all the puts made meanwhile, one store of their rows;
    each put gets its own rows, in order."""
    u, nr, c, lone, waiting = await _full(3)
    nr.hold_room = False
    nr.go()
    await asyncio.gather(*lone, *waiting)
    assert [t.result()[0] for t in lone] == [[1000 + i] for i in range(ROOMS)]
    # the combined call was tried first (the units may have room again), then the usual way
    assert [s["n"] for s in u.sent] == [1] * ROOMS + [3] and not u.sent[ROOMS]["alone"]
    assert [r["n"] for r in nr.rooms] == [1] * ROOMS + [3]
    assert [s["rows"] for s in nr.stored] == [[1000 + i] for i in range(ROOMS)] + [_ids(1000 + ROOMS, 3)]
    assert nr.stored[ROOMS]["chat"] == ["c0", "c1", "c2"]
    assert nr.stored[ROOMS]["x"] == [[0, 0], [1, 1], [2, 2]]
    assert nr.stored[ROOMS]["nbytes"] == {"x": [16, 16, 16], "chat": [2, 2, 2]}
    assert [t.result()[0] for t in waiting] == [[1000 + ROOMS + i] for i in range(3)]
    assert [t.result()[1] for t in waiting] == [[5]] * 3
    assert (c.usual_calls, c.usual_rows, c.in_flight, c._rooms) == (ROOMS + 1, ROOMS + 3, 0, {})


async def test_puts_of_other_kinds_go_on_while_a_kind_waits_for_room():
    """Requests for room hold no slot in flight: a put of another kind (another
    partition, another version: rows the controller may admit sooner) is sent at once,
    not held behind them."""
    u, nr, c, lone, waiting = await _full(1)
    other = asyncio.ensure_future(c.put(*_urow(7, nr)[:0], *(("q",) + _urow(7, nr)[1:])))
    await _settle()
    assert len(u.sent) == ROOMS + 1 and u.sent[-1]["partition"] == "q"
    assert nr.rooms[-1]["partition"] == "q"  # it waits for room at the controller too
    nr.hold_room = False
    nr.go()
    await asyncio.gather(*lone, *waiting, other)
    assert other.result()[0] and c.in_flight == 0 and c._rooms == {}


async def test_puts_that_may_not_wait_are_not_put_the_usual_way():
    """A put without ``usual`` (it has a timeout, or must not wait) is answered ``None``
    (the queue puts it alone, with its own timeout), and is not combined with puts that
    come with ``usual``."""
    u, nr, c, lone, waiting = await _full(1)
    plain = asyncio.ensure_future(c.put(*(_row(7)[:6] + (_DTYPES,))))
    await _settle()
    assert plain.done() and plain.result() is None  # (another kind: not held behind)
    nr.hold_room = False
    nr.go()
    await asyncio.gather(*lone, *waiting)
    assert sorted(s["n"] for s in u.sent) == [1] * (ROOMS + 2)  # none combined
    assert [r["n"] for r in nr.rooms] == [1] * (ROOMS + 1)


async def test_a_put_cancelled_while_its_group_waits_for_room_leaves_at_once():
    """Its group's request for room is taken back and made again without it; nothing
    is kept or taken back for it."""
    u, nr, c, lone, waiting = await _full(4)
    nr.go()  # the lone puts get room; then the others' combined call finds none: they wait
    await _settle()
    assert [r["n"] for r in nr.rooms] == [1] * ROOMS + [4] and not nr.rooms[ROOMS]["given"]
    waiting[1].cancel()
    await _settle()
    assert waiting[1].cancelled()  # at once, though room never came
    assert [r["n"] for r in nr.rooms] == [1] * ROOMS + [4, 3]
    assert nr.rooms[ROOMS + 1]["chat"] == ["c0", "c2", "c3"]
    nr.hold_room = False
    nr.go()
    rest = [waiting[0], waiting[2], waiting[3]]
    await asyncio.gather(*lone, *rest)
    assert [t.result()[0] for t in rest] == [[1000 + ROOMS + i] for i in range(3)]
    assert nr.stored[ROOMS]["chat"] == ["c0", "c2", "c3"]
    assert nr.retracted == [] and nr.aborted == [] and c.in_flight == 0 and c._rooms == {}


async def test_a_put_cancelled_while_its_group_is_stored_takes_back_its_rows_first():
    """Once room was given, the cancelled put waits for the store and the undo of its own
    rows (only they); the others keep theirs."""
    u, nr, c, lone, waiting = await _full(3)
    nr.hold_room = False
    nr.hold_store = True
    nr.go()
    for _ in range(10):  # (the lone puts' stores go; the group's is held)
        await _settle()
        if len(nr.stored) == ROOMS + 1:
            break
        nr.go()
    assert len(nr.stored) == ROOMS + 1 and nr.stored[ROOMS]["rows"] == _ids(1000 + ROOMS, 3)
    waiting[1].cancel()
    await _settle()
    assert not waiting[1].done()  # waits for the store and the undo
    nr.hold_store = False
    nr.go()
    await asyncio.gather(*lone, waiting[0], waiting[2])
    with pytest.raises(asyncio.CancelledError):
        await waiting[1]
    assert nr.retracted == [[1000 + ROOMS + 1]] and u.retracted == []
    assert [t.result()[0] for t in (waiting[0], waiting[2])] == [[1000 + ROOMS], [1000 + ROOMS + 2]]


async def test_a_group_refused_room_sends_each_put_alone():
    """Room refused and nothing kept (the queue closed, the group can never fit...):
    each put is answered ``None`` and the queue puts it alone, finding its own error."""
    u, nr, c, lone, waiting = await _full(2)
    nr.refuse = True
    nr.hold_room = False
    nr.go()
    assert await asyncio.gather(*lone, *waiting) == [None] * (ROOMS + 2)
    assert nr.stored == [] and c.in_flight == 0 and c._rooms == {}


async def test_a_combined_call_refused_sends_each_put_alone_even_if_it_may_wait():
    """SPLIT (the unit refused the combined put, nothing kept): each put alone, not the
    usual way together (one bad put must not fail the others)."""
    u, nr, c, lone, waiting = await _full(2)
    send = u.send

    async def split(*args):
        out = await send(*args)
        return SPLIT if not args[-1] else out

    c._send = split
    u.answer = "ok"
    nr.hold_room = False
    nr.go()
    assert await asyncio.gather(*waiting) == [None, None]
    assert [r["n"] for r in nr.rooms] == [1] * ROOMS
    assert [t.result()[0] for t in lone] == [[1000 + i] for i in range(ROOMS)]


# -- puts that may wait for room, sent to wait at the controller (send_waiting)


class FakeWaiting:
    """Stands for ``send_waiting``: a put that waits for room at the controller. Numbers
    rows from 2000 in answer order; holds call ``i`` until ``go(i)`` (or every call,
    made or to come, after ``go()``); cancelled, it takes its put back (the unit and
    the controller forget it) once ``undo`` is set, then re-raises; answers ``None``
    (it does not apply) while ``skip`` is set."""

    def __init__(self):
        self.sent: list[dict] = []
        self.withdrawn: list[str] = []
        self.gates: list[asyncio.Event] = []
        self.open = False
        self.undo = asyncio.Event()
        self.undo.set()
        self.skip = False
        self.next = 2000

    def go(self, i: int | None = None) -> None:
        if i is None:
            self.open = True
        for k, ev in enumerate(self.gates):
            if i is None or k == i:
                ev.set()

    async def send(self, partition, cols, n, nbytes, tags, version, dtypes, rid, alone):
        self.sent.append(dict(n=n, chat=list(cols["chat"]), rid=rid, alone=alone))
        if self.skip:
            return None
        gate = asyncio.Event()
        self.gates.append(gate)
        if self.open:
            gate.set()
        try:
            await gate.wait()
        except asyncio.CancelledError:
            await self.undo.wait()
            self.withdrawn.append(rid)
            raise
        rows = list(range(self.next, self.next + n))
        self.next += n
        return rows, [4] * n, {"waited": rid}


async def _full_waiting(k: int):
    """As :func:`_full`, with ``send_waiting``: ROOMS lone puts wait at the controller
    (held), and ``k`` puts of their kind wait behind them in the process."""
    u = FakeUnit()
    u.answer = "none"
    nr = FakeNewRows()
    w = FakeWaiting()
    c = PutCoalescer(u.send, u.retract, max_in_flight=1, send_waiting=w.send)
    lone = []
    for i in range(ROOMS):
        lone.append(asyncio.ensure_future(c.put(*_urow(100 + i, nr))))
        await _settle()
    assert len(w.sent) == ROOMS and c.in_flight == 0 and list(c._rooms.values()) == [ROOMS]
    waiting = [asyncio.ensure_future(c.put(*_urow(i, nr))) for i in range(k)]
    await _settle()
    assert len(w.sent) == ROOMS  # the others wait behind them
    return u, nr, w, c, lone, waiting


async def test_with_no_room_puts_that_may_wait_wait_at_the_controller_as_one_call():
    """The units have no room: each lone put, then the puts made meanwhile as one call,
    wait for room at the controller (no request for room, no store: one call each);
    each put gets its own rows, in order."""
    u, nr, w, c, lone, waiting = await _full_waiting(3)
    w.go()
    await asyncio.gather(*lone, *waiting)
    assert [s["n"] for s in w.sent] == [1] * ROOMS + [3]
    assert [s["alone"] for s in w.sent] == [True] * ROOMS + [False]
    assert w.sent[ROOMS]["chat"] == ["c0", "c1", "c2"]
    assert [t.result()[0] for t in lone] == [[2000 + i] for i in range(ROOMS)]
    assert [t.result()[0] for t in waiting] == [[2000 + ROOMS + i] for i in range(3)]
    assert [t.result()[1] for t in waiting] == [[4]] * 3
    assert nr.rooms == [] and nr.stored == []
    assert (c.wait_calls, c.wait_rows, c.usual_calls, c.in_flight, c._rooms) == (
        ROOMS + 1, ROOMS + 3, 0, 0, {})


async def test_a_put_cancelled_while_its_group_waits_at_the_controller_leaves_after_the_withdrawal():
    """The group's waiting put is withdrawn (the controller and the unit forget it)
    before the cancelled put leaves, so a retry never races it; the group then waits
    again without it."""
    u, nr, w, c, lone, waiting = await _full_waiting(3)
    first = w.sent[:]
    w.undo.clear()  # the withdrawal takes a while
    for i in range(ROOMS):  # the lone puts land; the group's call is sent and held
        w.go(i)
    await asyncio.gather(*lone)
    for _ in range(10):
        await _settle()
        if len(w.sent) == ROOMS + 1:
            break
    assert len(w.sent) == ROOMS + 1 and w.sent[-1]["n"] == 3 and w.sent[:ROOMS] == first
    waiting[1].cancel()
    await _settle()
    assert not waiting[1].done()  # it waits for the withdrawal
    w.undo.set()
    with pytest.raises(asyncio.CancelledError):
        await waiting[1]
    assert w.withdrawn == [w.sent[ROOMS]["rid"]]
    await _settle()
    assert w.sent[-1]["n"] == 2 and w.sent[-1]["chat"] == ["c0", "c2"]
    w.go()
    await asyncio.gather(waiting[0], waiting[2])
    assert [t.result()[0] for t in (waiting[0], waiting[2])] == [[2000 + ROOMS], [2000 + ROOMS + 1]]
    assert u.retracted == [] and nr.rooms == [] and c.in_flight == 0 and c._rooms == {}


async def test_a_waiting_put_that_does_not_apply_goes_the_usual_way():
    """``send_waiting`` answers ``None`` (nothing kept: the unit holds enough waiting
    puts, say): the puts ask for room and are stored the usual way, together."""
    u = FakeUnit()
    u.answer = "none"
    nr = FakeNewRows()
    w = FakeWaiting()
    w.skip = True
    c = PutCoalescer(u.send, u.retract, max_in_flight=1, send_waiting=w.send)
    puts = [asyncio.ensure_future(c.put(*_urow(i, nr))) for i in range(3)]
    await asyncio.gather(*puts)
    assert [t.result()[0] for t in puts] == [[1000], [1001], [1002]]
    # each call that waited would have asked for room the usual way instead
    assert [s["n"] for s in w.sent] == [r["n"] for r in nr.rooms]
    assert sum(r["n"] for r in nr.rooms) == 3 and len(nr.stored) == len(nr.rooms)
    assert (c.wait_calls, c.wait_rows, c.usual_rows) == (0, 0, 3)
