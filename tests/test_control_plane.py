"""The control plane is one protocol (streamrl.control.ControlPlane) that every side
implements with the same signatures: the service itself, and on Ray the client proxy and
the controller actor, whose methods are generated from it. The check that says so can
fail, and the actor's one generic dispatch takes back what a cancelled call did."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence

import pytest
import torch

from streamrl.config import QueueConfig, Request
from streamrl.control import CANCELLABLE, CONTROL_METHODS, ControlPlane, check_implements
from streamrl.errors import FilterError, SchemaError
from streamrl.messages import CommitResult, FilterSpec, PutAnswer, PutStatus
from streamrl.service import ControllerService
from streamrl.storage import StorageUnit
from streamrl.transport.embedded import LocalDataPlane


def test_the_service_implements_the_control_plane():
    assert check_implements(ControllerService) == []


def _ray_side():
    pytest.importorskip("ray")
    from streamrl.transport import ray as ray_transport

    return ray_transport


def test_the_ray_proxy_implements_the_control_plane_by_generated_methods():
    rt = _ray_side()
    assert check_implements(rt.RayControl) == []
    for name, sig in CONTROL_METHODS.items():  # generated from the protocol, not written
        assert inspect.signature(getattr(rt.RayControl, name)) is sig
    assert not hasattr(rt.RayControl, "__getattr__")
    proxy = rt.RayControl(None)
    with pytest.raises(AttributeError):
        proxy.no_such_call  # noqa: B018 - no dynamic forwarding of unknown names


def test_the_controller_actor_serves_the_control_plane_by_generated_methods():
    rt = _ray_side()
    impl = rt.ControllerActorImpl
    assert check_implements(impl) == []
    for name, sig in CONTROL_METHODS.items():
        assert inspect.signature(getattr(impl, name)) is sig
    # the actor's own methods are not control calls (and do not shadow any)
    own = {n for n, v in vars(impl).items() if not n.startswith("_") and callable(v)}
    assert own - set(CONTROL_METHODS) == {"endpoints", "handles", "cancellable", "cancel",
                                          "ping", "event_loop", "serve_metrics", "path_bytes"}


class _Lacking:
    async def allocate(self, partition, n, fields, *, nbytes=0, version=None, timeout=None,
                       nowait=False, dtypes=None):
        ...


class _Changed(ControllerService):
    async def take(self, req: Request, timeout: float | None = 5.0):  # another default
        ...

    async def ack(self, leases: Sequence[int]) -> None:  # another parameter name
        ...

    async def seal(self, partition: str | None, *, force: bool = False) -> None:  # one more
        ...

    def drop(self, rows):  # not a coroutine function
        ...


def test_the_check_reports_what_is_missing_or_different():
    lacking = check_implements(_Lacking)
    assert len(lacking) == len(CONTROL_METHODS) - 1
    assert any("lacks take(" in p for p in lacking)
    changed = check_implements(_Changed)
    assert len(changed) == 4
    for name in ("take", "ack", "seal", "drop"):
        assert any(f"_Changed.{name}" in p for p in changed), (name, changed)
    assert check_implements(ControlPlane) == []


# -- the controller actor's dispatch and undo, in this process (no Ray actors)


class _LocalUnits(LocalDataPlane):
    """In-process storage units standing in for the actors' data plane."""

    def __init__(self, units, endpoints=None, on_lost=None):
        super().__init__([StorageUnit(i) for i in range(len(units))])
        self.on_lost = on_lost

    async def arena_stats(self):
        return [{"size": 7, "pinned": 1} for _ in self.units]


def _actor():
    rt = _ray_side()
    return rt.ControllerActorImpl(QueueConfig(capacity=8, num_shards=1), [None],
                                  data_plane=_LocalUnits)


async def test_the_actor_dispatches_every_call_to_its_service():
    actor = _actor()
    tok = await actor.allocate("p", 2, ["x"], nbytes=16)
    await actor._data.put([(0, tok.rows, {"x": torch.zeros(2)})], tok.id)
    await actor.commit(tok, {"x": [8, 8]})
    d = await actor.take(Request("t", ("x",), 2, partition="p"), 1.0)
    assert sorted(d.rows) == sorted(tok.rows)
    await actor.ack([d.lease])
    st = await actor.stats()
    assert st.tasks["t"].acked == 2
    assert st.unit_shared_bytes == [7] and st.unit_pinned_bytes == [1]  # the actor's extras


@pytest.mark.parametrize("method", sorted(CANCELLABLE))
async def test_a_cancelled_call_is_taken_back_once_done(method, tmp_path):
    """cancel(rid) after the call returned: the lease goes back (an ack_take's ack
    stands), the admitted write is aborted, the commit retracted, a waiting small put's
    rows dropped, a checkpoint's hold on deletes ended (what ControllerActorImpl.cancel
    promises)."""
    actor = _actor()
    req = Request("t", ("x",), 2, partition="p")
    tok = await actor.allocate("p", 2, ["x"], nbytes=16)
    await actor._data.put([(0, tok.rows, {"x": torch.zeros(2)})], tok.id)
    if method == "allocate":
        await actor.abort(tok)
        res = await actor.cancellable("r1", "allocate", ("p", 2, ["x"]), {"nbytes": 16})
        assert (await actor.stats()).bytes_in_flight == 16
        await actor.cancel("r1")
        assert (await actor.stats()).bytes_in_flight == 0
        return
    if method == "begin_write":
        await actor.commit(tok, {"x": [8, 8]})
        await actor.cancellable("r1", "begin_write", (tok.rows, ["y"]), {})
        await actor.cancel("r1")
        tok2 = await actor.begin_write(tok.rows, ["y"])  # no write of y is pending
        assert tok2.rows == tok.rows
        return
    if method == "commit":
        res = await actor.cancellable("r1", "commit", (), {"token": tok, "nbytes": {"x": [8, 8]}})
        assert res.dead == {}
        await actor.cancel("r1")
        assert (await actor.stats()).rows == 0  # the new rows went with the write
        return
    if method == "checkpoint_begin":
        await actor.commit(tok, {"x": [8, 8]})
        cut = await actor.cancellable("r1", "checkpoint_begin", (str(tmp_path),), {})
        assert cut.rows == {0: sorted(tok.rows)}
        await actor.drop(tok.rows)  # the unit keeps them for the checkpoint's writers
        assert actor._data.units[0].stats()[0] == 2
        await actor.cancel("r1")
        assert actor._data.units[0].stats()[0] == 0  # the hold ended: deleted
        return
    if method == "put_rows_wait":
        await actor.abort(tok)
        start, _ = await actor.unit_ids(0, 4)
        actor._data.units[0].put([start], {"x": torch.zeros(1)})
        wire = await actor.cancellable("r1", "put_rows_wait",
                                       ("p", ["x"], [start], 0, {"x": [8]}), {})
        assert PutAnswer.from_wire(wire).status is PutStatus.OK
        assert (await actor.stats()).rows == 1
        await actor.cancel("r1")
        st = await actor.stats()
        assert st.rows == 0 and st.dropped_by.get("cancelled") == 1  # its rows went back
        assert actor._data.units[0].stats()[0] == 0  # and left the unit
        return
    if method == "ack_take":
        await actor.commit(tok, {"x": [8, 8]})
        one = Request("t", ("x",), 1, partition="p")
        first = await actor.take(one, 1.0)
        d, expired = await actor.cancellable("r1", "ack_take", ([first.lease], one, 1.0), {})
        assert expired is None and d.rows != first.rows
        await actor.cancel("r1")
        st = await actor.stats()
        assert st.tasks["t"].acked == 1 and st.leases == 0  # the ack stands, the lease went
        again = await actor.take(one, 1.0)
        assert again.rows == d.rows  # delivered again; the acked row never is
        return
    await actor.commit(tok, {"x": [8, 8]})
    d = await actor.cancellable("r1", "take", (req, 1.0), {})
    assert len(d.rows) == 2
    await actor.cancel("r1")
    again = await actor.take(req, 1.0)  # the lease went back: delivered again
    assert sorted(again.rows) == sorted(d.rows)


async def test_only_cancellable_calls_are_tracked():
    from streamrl.errors import InvalidArgument

    actor = _actor()
    with pytest.raises(InvalidArgument, match="not a cancellable"):
        await actor.cancellable("r1", "drop", ([0],), {})
    await actor.cancel("unknown")  # nothing to do


@pytest.mark.parametrize("answer", [
    PutAnswer(PutStatus.OK, CommitResult({2: [7, 9]}, frozenset({"uid"}), {"uid": [5]}),
              rows=[5, 6]),
    PutAnswer(PutStatus.BUSY),
    PutAnswer(PutStatus.REFUSED, error=SchemaError("field 'x' holds int64")),
    PutAnswer(PutStatus.FAILED, error=FilterError("the filter raised")),
], ids=["ok", "busy", "refused", "failed"])
def test_a_small_puts_answer_crosses_the_wire_as_itself(answer):
    """The answer to put_rows goes out as a tuple of builtins (cheaper to pickle than the
    dataclasses and the enum) and reads back as the same answer, through pickle."""
    import pickle

    wire = answer.to_wire()
    assert type(wire) is tuple
    back = PutAnswer.from_wire(pickle.loads(pickle.dumps(wire, protocol=5)))
    assert back.status is answer.status
    assert back.rows == answer.rows and back.result == answer.result
    assert type(back.error) is type(answer.error) and str(back.error) == str(answer.error)


async def test_the_actor_answers_put_rows_in_its_wire_form():
    """The controller actor sends put_rows' answer in its wire form; the Ray client reads
    it back (both ends name the same calls)."""
    from streamrl.transport.ray.control import FROM_WIRE
    from streamrl.transport.ray.controller import TO_WIRE

    assert TO_WIRE.keys() == FROM_WIRE.keys()
    actor = _actor()
    start, _ = await actor.unit_ids(0, 16)
    wire = await actor.put_rows("p", ["x"], [start], 0, {"x": [8]})
    assert type(wire) is tuple
    ans = FROM_WIRE["put_rows"](wire)
    assert ans.status is PutStatus.OK and ans.rows == [start]
    assert (await actor.stats()).rows == 1
    wire = await actor.put_rows_many([("p", ["x"], [start + 1], 0, {"x": [8]}),
                                      ("p", ["x"], list(range(start + 2, start + 10)), 0,
                                       {"x": [8] * 8})])
    assert type(wire) is list and all(type(w) is tuple for w in wire)
    ok, busy = FROM_WIRE["put_rows_many"](wire)
    assert ok.status is PutStatus.OK and ok.rows == [start + 1]
    assert busy.status is PutStatus.BUSY  # (too big for the room left: not admitted)
    assert (await actor.stats()).rows == 2


# -- put_rows: a unit's small put, admitted and committed by the service


class _HeldDeletes(LocalDataPlane):
    """In-process units whose deletes wait until ``go`` is set."""

    def __init__(self, n: int):
        super().__init__([StorageUnit(i) for i in range(n)])
        import asyncio

        self.go = asyncio.Event()
        self.waiting = asyncio.Event()

    async def delete(self, parts):
        self.waiting.set()
        await self.go.wait()
        await super().delete(parts)


def _service(**kw):
    from streamrl.controller import Controller

    data = _HeldDeletes(1)
    return ControllerService(Controller(16, num_shards=1, **kw), data), data


async def _stored(svc, data, n=1):
    start, _ = await svc.unit_ids(0, n)
    ids = list(range(start, start + n))
    data.units[0].put(ids, {"x": torch.zeros(n)})
    return ids


async def test_put_rows_of_one_shape_are_committed_without_a_write_token():
    """Rows of one shape, with no tag and no filter, are admitted and committed in one
    step: no write token is made, and a consumer waiting for them gets them."""
    svc, data = _service()
    ids = await _stored(svc, data, 2)
    tokens = svc.ctl._next_token
    ans = await svc.put_rows("p", ["x"], ids, 0, {"x": [4, 4]})
    assert ans.status is PutStatus.OK and ans.rows == ids
    assert svc.ctl._next_token == tokens  # no write token was made
    assert svc.ctl.c_put == 2 and svc.ctl.bytes_held == 8
    d = await svc.take(Request("t", ("x",), 2, partition="p"), 1.0)
    assert sorted(d.rows) == ids


async def test_put_rows_with_a_filter_still_runs_it():
    """With a filter the rows go through a write token and the filter judges them (a
    row it rejects is dropped and never delivered)."""
    svc, data = _service()
    await svc.add_filter(lambda td: [False] * td.batch_size[0],
                         FilterSpec("none", frozenset({"x"})))
    data.go.set()
    ids = await _stored(svc, data)
    ans = await svc.put_rows("p", ["x"], ids, 0, {"x": [4]})
    assert ans.status is PutStatus.OK
    assert svc.ctl.c_filtered_by == {"none": 1} and not svc.ctl.rows


async def test_put_rows_cancelled_after_the_commit_takes_the_rows_back():
    """Cancelled while it waits for what it has to do after the commit (here: storage
    deletes of an earlier drop), the put takes its rows back before the cancellation
    goes on: dropped as "cancelled", gone from the unit, never delivered."""
    import asyncio

    svc, data = _service()
    old = await _stored(svc, data)
    assert (await svc.put_rows("p", ["x"], old, 0, {"x": [4]})).status is PutStatus.OK
    svc.ctl.drop(old, "dropped")  # its storage delete is left for the next call to do
    ids = await _stored(svc, data)
    put = asyncio.ensure_future(svc.put_rows("p", ["x"], ids, 0, {"x": [4]}))
    await asyncio.wait_for(data.waiting.wait(), 5)  # committed; deleting the old row
    assert ids[0] in svc.ctl.rows
    put.cancel()
    await asyncio.sleep(0.05)
    assert not put.done()  # the take-back waits for the deletes it needs
    data.go.set()
    with pytest.raises(asyncio.CancelledError):
        await put
    assert not svc.ctl.rows and svc.ctl.c_dropped.get("cancelled") == 1
    assert data.units[0].stats() == (0, 0)  # both rows deleted from the unit
    await svc.seal("p")
    assert await svc.take(Request("t", ("x",), 1, partition="p"), 1.0) is None


async def test_put_rows_naming_a_field_without_sizes_goes_through_a_write_token():
    """A field named without its bytes is written with 0 bytes, as a commit does: such
    a put is not admitted at once, and the field is ready all the same."""
    svc, data = _service()
    ids = await _stored(svc, data)
    tokens = svc.ctl._next_token
    ans = await svc.put_rows("p", ["x", "y"], ids, 0, {"x": [4]})
    assert ans.status is PutStatus.OK and svc.ctl._next_token == tokens + 1
    d = await svc.take(Request("t", ("x", "y"), 1, partition="p"), 1.0)
    assert d.rows == ids


async def test_put_rows_many_answers_each_put_as_its_own_call_would():
    """Several units' puts in one call: each is admitted (or not) as its own put_rows
    call would be, in order, and answered on its own: one that fits lands, one past the
    room left is BUSY, one of another dtype is REFUSED, one whose filter raises is
    FAILED (not raised: the others' answers stand), and the next lands."""
    svc, data = _service()
    data.go.set()
    await svc.add_filter(_raises, FilterSpec("bad", frozenset({"y"})))
    ids = await _stored(svc, data, 20)  # (one block: a unit's older blocks expire)
    a, b, c, d, e = ids[:2], ids[2:17], ids[17:18], ids[18:19], ids[19:]
    answers = await svc.put_rows_many([
        ("p", ["x"], a, 0, {"x": [4, 4]}, None, None, {"x": "torch.float32"}),
        ("p", ["x"], b, 0, {"x": [4] * 15}),  # (16 rows of room, 2 taken)
        ("p", ["x"], c, 0, {"x": [4]}, None, None, {"x": "torch.int64"}),
        ("p", ["y"], d, 0, {"y": [4]}),
        ("p", ["x"], e, 0, {"x": [4]}),
    ])
    assert [x.status for x in answers] == [PutStatus.OK, PutStatus.BUSY, PutStatus.REFUSED,
                                           PutStatus.FAILED, PutStatus.OK]
    assert answers[0].rows == a and answers[4].rows == e
    assert isinstance(answers[2].error, SchemaError)
    assert isinstance(answers[3].error, FilterError)
    assert sorted(svc.ctl.rows) == sorted(a + e)  # (the failed filter's row is dropped)


async def test_write_rows_admits_and_commits_a_write_a_unit_stored_first():
    """A unit's small write of new fields: admitted and committed in one call under the
    unit's own write id, the fields ready at once; refused (nothing changed at the
    controller) for a row dropped, a field written or being written, another dtype, a
    closed queue; BUSY for a row another unit holds. One whose filter raises is FAILED
    in put_rows_many, beside a put, each answered as its own call would be."""
    from streamrl.errors import DuplicateField, QueueClosed, RowsDropped

    svc, data = _service()
    data.go.set()
    ids = await _stored(svc, data, 4)
    assert (await svc.put_rows("p", ["x"], ids, 0, {"x": [4] * 4})).status is PutStatus.OK
    tokens = svc.ctl._next_token
    ans = await svc.write_rows(ids[:2], ["y"], 0, -(1 << 20 | 1), {"y": [4, 4]},
                               None, {"y": "torch.float32"})
    assert ans.status is PutStatus.OK and ans.rows == ids[:2]
    assert svc.ctl._next_token == tokens  # (the unit's id, not the controller's)
    d = await svc.take(Request("t", ("x", "y"), 2, partition="p"), 1.0)
    assert sorted(d.rows) == ids[:2]
    # refused, each with begin_write's error, and nothing written
    held = await svc.begin_write([ids[2]], ["y"])  # (another writer's, in flight)
    for rows, dtypes, err in (([ids[0]], None, DuplicateField), ([ids[2]], None, DuplicateField),
                              ([ids[3]], {"y": "torch.int64"}, SchemaError)):
        ans = await svc.write_rows(rows, ["y"], 0, -(2 << 20 | 1), {"y": [8]}, None, dtypes)
        assert ans.status is PutStatus.REFUSED and isinstance(ans.error, err), (rows, ans)
    await svc.abort(held)
    assert "y" not in svc.ctl.rows[ids[3]].fields
    svc.ctl.rows[ids[3]].shard = 1  # (as if another unit held it)
    assert (await svc.write_rows([ids[3]], ["y"], 0, -(3 << 20 | 1), {"y": [4]})).status \
        is PutStatus.BUSY
    svc.ctl.rows[ids[3]].shard = 0
    svc.ctl.drop([ids[3]], "dropped")
    ans = await svc.write_rows([ids[3]], ["y"], 0, -(4 << 20 | 1), {"y": [4]})
    assert ans.status is PutStatus.REFUSED and isinstance(ans.error, RowsDropped)
    # beside a put in one message; a write whose filter raises is FAILED, not raised
    await svc.add_filter(_raises, FilterSpec("bad", frozenset({"z"})))
    new = await _stored(svc, data)
    answers = await svc.put_rows_many([
        (None, [ids[2]], ["z"], 0, -(5 << 20 | 1), {"z": [4]}),
        ("p", ["x"], new, 0, {"x": [4]}),
        (None, new, ["w"], 0, -(6 << 20 | 1), {"w": [4]})])
    assert [a.status for a in answers] == [PutStatus.FAILED, PutStatus.OK, PutStatus.OK]
    assert isinstance(answers[0].error, FilterError) and ids[2] not in svc.ctl.rows
    assert svc.ctl.rows[new[0]].fields.keys() >= {"x", "w"}
    await svc.close()
    ans = await svc.write_rows(new, ["v"], 0, -(7 << 20 | 1), {"v": [4]})
    assert ans.status is PutStatus.REFUSED and isinstance(ans.error, QueueClosed)


def _raises(td):
    raise ValueError("this filter fails")


class _ScriptedController:
    """The control calls a storage unit's small puts make, each answered when the test
    says so (``release``): OK for rows whose ``x`` is not negative, FAILED (as
    ``put_rows`` raising) otherwise."""

    def __init__(self):
        self.calls: list[tuple[str, list[list[int]]]] = []  # (method, each put's ids)
        self.gates: list[asyncio.Event] = []
        self.retracted: list[int] = []
        self._next = 0

    async def unit_ids(self, shard, n):
        self._next += n
        return self._next - n, self._next

    def _answer(self, args):
        ids, nbytes = args[2], args[4]
        if nbytes["x"][0] < 0:
            return PutAnswer(PutStatus.FAILED, error=FilterError("the filter raised"))
        return PutAnswer(PutStatus.OK, CommitResult([], [], []), rows=list(ids))

    async def _gate(self, method, puts):
        self.calls.append((method, [list(a[2]) for a in puts]))
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()

    async def put_rows(self, *args):
        await self._gate("put_rows", [args])
        ans = self._answer(args)
        if ans.status is PutStatus.FAILED:
            raise ans.error
        return ans

    async def put_rows_many(self, puts):
        await self._gate("put_rows_many", puts)
        return [self._answer(a) for a in puts]

    async def retract_rows(self, rows):
        self.retracted.extend(rows)
        return len(rows)

    async def release(self, k):
        """Let call ``k`` answer, once it was made."""
        while len(self.gates) <= k:
            await asyncio.sleep(0)
        self.gates[k].set()


def _unit(ctl):
    pytest.importorskip("ray")
    from streamrl.transport.ray.admit import UnitAdmission

    class Unit(UnitAdmission):
        index = 0

        def __init__(self):
            self._controller = ctl
            self._init_admission()
            self.stored: dict[int, int] = {}

        def put(self, parts, write=0):
            for ids, cols in parts:
                self.stored.update(dict.fromkeys(ids, cols["x"]))

        def delete(self, rows):
            for r in rows:
                self.stored.pop(r, None)
            return len(rows), 0

    return Unit()


def _small_put(unit, x: int) -> asyncio.Task:
    return asyncio.ensure_future(unit._admit(1, {"x": x}, "p", ["x"], {"x": [x]}, {}, None))


async def test_a_unit_sends_the_small_puts_that_wait_for_its_last_call_in_one():
    """A unit's small puts that arrive while its call to the controller is on its way
    wait for it, then go in one put_rows_many call, each answered as its own call
    would: OK, or FAILED with the error put_rows would have raised (its rows left to
    the controller, which dropped them). A put cancelled while it waits is not sent and
    keeps nothing; one cancelled once its call went has its rows taken back when they
    land. Nothing of a failed or cancelled put stays stored."""
    ctl = _ScriptedController()
    unit = _unit(ctl)
    first = _small_put(unit, 1)
    while not ctl.calls:
        await asyncio.sleep(0)
    waiting = [_small_put(unit, x) for x in (2, -3, 4, 5)]
    for _ in range(5):
        await asyncio.sleep(0)
    waiting[2].cancel()  # (while it waits: never sent)
    await ctl.release(0)
    assert (await first).status is PutStatus.OK
    await ctl.release(1)
    ok, failed, ok2 = await asyncio.gather(waiting[0], waiting[1], waiting[3])
    with pytest.raises(asyncio.CancelledError):
        await waiting[2]
    assert ctl.calls == [("put_rows", [[0]]), ("put_rows_many", [[1], [2], [4]])]
    assert ok.status is PutStatus.OK and ok.rows == [1]
    assert failed.status is PutStatus.FAILED and isinstance(failed.error, FilterError)
    assert ok2.status is PutStatus.OK and ok2.rows == [4]
    assert sorted(unit.stored) == [0, 1, 2, 4]  # (2: the failed put's, dropped by the
    # controller, which deletes what it drops; 3: cancelled, deleted here)
    # cancelled once its call went: the rows are taken back
    first = _small_put(unit, 6)
    while len(ctl.calls) < 3:
        await asyncio.sleep(0)
    late = _small_put(unit, 7)
    await asyncio.sleep(0)
    await ctl.release(2)
    await first
    while len(ctl.calls) < 4:
        await asyncio.sleep(0)
    assert ctl.calls[3] == ("put_rows", [[6]])  # (one waited: sent on its own)
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert 6 not in unit.stored
    await ctl.release(3)
    while not ctl.retracted:
        await asyncio.sleep(0)
    assert ctl.retracted == [6]
    assert not unit._put_rows_busy and not unit._put_rows_next


class _ScriptedWrites(_ScriptedController):
    """:class:`_ScriptedController` that also answers small writes (``None`` entries of
    ``put_rows_many``, or ``write_rows``): OK, or REFUSED (a field being written
    elsewhere) for a write whose ``y`` bytes are negative."""

    def __init__(self):
        super().__init__()
        self.retracted_writes: list[int] = []

    def _answer(self, args):
        if args[0] is not None:
            return super()._answer(args)
        rows, nbytes = args[1], args[5]
        if nbytes["y"][0] < 0:
            return PutAnswer(PutStatus.REFUSED, error=SchemaError("being written"))
        return PutAnswer(PutStatus.OK, CommitResult([], [], []), rows=list(rows))

    async def _gate(self, method, puts):
        self.calls.append((method, [list(a[1] if a[0] is None else a[2]) for a in puts]))
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()

    async def write_rows(self, *args):
        await self._gate("write_rows", [(None, *args)])
        return self._answer((None, *args))

    async def retract(self, token):
        self.retracted_writes.append(token.id)


def _writing_unit(ctl):
    """:func:`_unit` that also stores fields ``y`` of rows it holds: ``fields`` maps
    (row, field) to (value, write id)."""
    unit = _unit(ctl)

    def put(parts, write=0, only_adds=False):
        if only_adds and any(r not in unit.stored or (r, f) in unit.fields
                             for ids, cols in parts for r in ids for f in cols):
            return False
        for ids, cols in parts:
            if "x" in cols:
                unit.stored.update(dict.fromkeys(ids, cols["x"]))
            for f, v in cols.items():
                if f != "x":
                    unit.fields.update({(r, f): (v, write) for r in ids})
        return True

    def delete_fields(rows, fields, write=0):
        for r in rows:
            for f in fields:
                if unit.fields.get((r, f), (None, write))[1] == write:
                    unit.fields.pop((r, f), None)
        return 0

    unit.fields = {}
    unit.put, unit.delete_fields = put, delete_fields
    return unit


def _small_write(unit, row: int, y: int) -> asyncio.Task:
    from streamrl.messages import WriteToken

    tok = WriteToken(unit._write_id(), [row], [0], ("y",))
    return asyncio.ensure_future(unit._admit_write(tok, {"y": y}, {"y": [y]}, {}, None))


async def test_a_unit_sends_small_writes_with_the_puts_that_wait_for_its_last_call():
    """A unit's small writes of new fields go with its small puts: while its call to the
    controller is on its way they wait, then go in the same put_rows_many call, each
    answered as its own call would be. A write is stored under a write id of the unit's
    own before it is sent; one the controller refuses has exactly that taken back (a
    value another write stored meanwhile stays); one that would replace a value held
    is not stored nor sent (BUSY: the writer writes the usual way, which says why); one
    cancelled while it waits is not sent and keeps nothing; one whose call went and
    landed after its writer gave up is taken back at the controller."""
    ctl = _ScriptedWrites()
    unit = _writing_unit(ctl)
    first = _small_put(unit, 1)
    while not ctl.calls:
        await asyncio.sleep(0)
    assert (await asyncio.wait_for(_small_write(unit, 99, 5), 5)).status is PutStatus.BUSY
    assert not unit.fields  # (row 99 is not held here: nothing stored, nothing sent)
    put2 = _small_put(unit, 2)
    w_ok = _small_write(unit, 0, 3)
    w_again = _small_write(unit, 0, -4)  # (y of row 0 again: w_ok stored it: BUSY)
    w_cancelled = _small_write(unit, 1, 6)
    for _ in range(5):
        await asyncio.sleep(0)
    assert (await w_again).status is PutStatus.BUSY
    assert unit.fields[(1, "y")][0] == 6
    w_cancelled.cancel()
    await ctl.release(0)
    assert (await first).status is PutStatus.OK
    while len(ctl.calls) < 2:
        await asyncio.sleep(0)
    assert ctl.calls[1] == ("put_rows_many", [[1], [0]])  # (the put and the write)
    await ctl.release(1)
    assert (await put2).status is PutStatus.OK
    ans = await w_ok
    assert ans.status is PutStatus.OK and ans.rows == [0]
    assert unit.fields[(0, "y")][0] == 3 and unit.fields[(0, "y")][1] < 0
    with pytest.raises(asyncio.CancelledError):
        await w_cancelled
    assert (1, "y") not in unit.fields
    # refused by the controller: its own value taken back, another write's kept
    refused = _small_write(unit, 1, -7)
    while len(ctl.calls) < 3:
        await asyncio.sleep(0)
    assert unit.fields[(1, "y")][0] == -7
    unit.fields[(1, "y")] = (8, 12)  # (the usual write of another writer landed)
    await ctl.release(2)
    assert (await refused).status is PutStatus.REFUSED
    assert unit.fields[(1, "y")] == (8, 12)
    unit.stored[2] = 0  # (as if a put of row 2 had landed)
    refused2 = _small_write(unit, 2, -9)
    while len(ctl.calls) < 4:
        await asyncio.sleep(0)
    await ctl.release(3)
    assert (await refused2).status is PutStatus.REFUSED and (2, "y") not in unit.fields
    # gave up once its call went (here: its task cancelled while the answer is on its
    # way, as at the unit's shutdown): taken back at the controller when it lands
    first = _small_put(unit, 3)
    while len(ctl.calls) < 5:
        await asyncio.sleep(0)
    late = _small_write(unit, 2, 11)
    await asyncio.sleep(0)
    await ctl.release(4)
    await first
    while len(ctl.calls) < 6:
        await asyncio.sleep(0)
    assert ctl.calls[5] == ("write_rows", [[2]])
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert (2, "y") not in unit.fields
    await ctl.release(5)
    while not ctl.retracted_writes:
        await asyncio.sleep(0)
    assert ctl.retracted_writes[0] < 0 and not unit._put_rows_next


# -- put_rows_wait: a unit's small put that waits its turn for room


async def _full_service(capacity=2, **kw):
    """A service whose queue holds ``capacity`` rows (full), their storage deletes free
    (``kw``: more options of the controller)."""
    from streamrl.controller import Controller

    data = _HeldDeletes(1)
    data.go.set()
    svc = ControllerService(Controller(capacity, num_shards=1, **kw), data)
    held = await _stored(svc, data, capacity)
    assert (await svc.put_rows("p", ["x"], held, 0, {"x": [4] * capacity})).status \
        is PutStatus.OK
    return svc, data, held


async def _waiting(svc, coro):
    task = asyncio.ensure_future(coro)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()
    return task


async def test_put_rows_wait_with_room_lands_at_once():
    svc, data = _service()
    ids = await _stored(svc, data)
    ans = await svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4]})
    assert ans.status is PutStatus.OK and ans.rows == ids and not ans.waited
    assert svc.ctl.c_put == 1


async def test_put_rows_wait_waits_its_turn_for_room_then_lands():
    """Where put_rows answers BUSY, put_rows_wait waits; it is first in line before a
    producer that asks for room after it, and lands (admitted and committed, ``waited``)
    once room frees; the later one goes on waiting."""
    svc, data, held = await _full_service()
    ids = await _stored(svc, data)
    assert (await svc.put_rows("p", ["x"], ids, 0, {"x": [4]})).status is PutStatus.BUSY
    put = await _waiting(svc, svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4]}))
    later = await _waiting(svc, svc.allocate("p", 1, ["x"], nbytes=4))
    await svc.drop(held[:1])
    ans = await asyncio.wait_for(put, 5)
    assert ans.status is PutStatus.OK and ans.rows == ids and ans.waited
    assert ids[0] in svc.ctl.rows and not later.done()  # FIFO: the later one still waits
    await svc.drop(held[1:])
    tok = await asyncio.wait_for(later, 5)
    await svc.abort(tok)
    d = await svc.take(Request("t", ("x",), 1, partition="p"), 1.0)
    assert d.rows == ids


async def test_put_rows_wait_cancelled_while_it_waits_keeps_nothing():
    """Cancelled in line: nothing admitted, its place given up (the next in line gets
    the room that frees)."""
    svc, data, held = await _full_service()
    ids = await _stored(svc, data)
    put = await _waiting(svc, svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4]}))
    later = await _waiting(svc, svc.allocate("p", 1, ["x"], nbytes=4))
    put.cancel()
    with pytest.raises(asyncio.CancelledError):
        await put
    assert svc.ctl.c_put == 2 and ids[0] not in svc.ctl.rows
    await svc.drop(held[:1])
    tok = await asyncio.wait_for(later, 5)  # the room went to the next in line
    assert len(svc.ctl.rows) == 2 and not svc._space_q
    await svc.abort(tok)


async def test_put_rows_wait_waits_for_version_pacing_its_rows_no_strays():
    """Rows of a version too far ahead (max_lead) wait for the trainer's version; the
    unit's copy of them is not a stray meanwhile (audit), and they land once it moves."""
    from streamrl.controller import Controller

    data = _HeldDeletes(1)
    data.go.set()
    svc = ControllerService(Controller(16, num_shards=1, max_lead=1), data)
    ids = await _stored(svc, data)
    put = await _waiting(svc, svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4]}, version=2))
    assert await svc.audit() == []
    await svc.set_version(1)
    ans = await asyncio.wait_for(put, 5)
    assert ans.status is PutStatus.OK and ans.waited and ids[0] in svc.ctl.rows
    assert await svc.audit() == []


async def test_put_rows_wait_behind_others_still_waits_for_version_pacing():
    """Others wait for room already, and the put is of a version too far ahead: it
    waits for the version too (not refused once room comes)."""
    from streamrl.controller import Controller

    data = _HeldDeletes(1)
    data.go.set()
    svc = ControllerService(Controller(2, num_shards=1, max_lead=1), data)
    held = await _stored(svc, data, 2)
    await svc.put_rows("p", ["x"], held, 0, {"x": [4, 4]})
    first = await _waiting(svc, svc.allocate("p", 1, ["x"], nbytes=4))
    ids = await _stored(svc, data)
    put = await _waiting(svc, svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4]}, version=2))
    await svc.drop(held)
    await svc.abort(await asyncio.wait_for(first, 5))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not put.done()  # room, but not the version
    await svc.set_version(1)
    ans = await asyncio.wait_for(put, 5)
    assert ans.status is PutStatus.OK and ans.waited and ids[0] in svc.ctl.rows


async def test_put_rows_wait_is_refused_when_the_queue_closes_while_it_waits():
    svc, data, held = await _full_service()
    ids = await _stored(svc, data)
    put = await _waiting(svc, svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4]}))
    await svc.close()
    ans = await asyncio.wait_for(put, 5)
    assert ans.status is PutStatus.REFUSED and "closed" in str(ans.error)
    assert ids[0] not in svc.ctl.rows


async def test_put_rows_wait_that_can_never_fit_is_refused_at_once():
    svc, data, held = await _full_service()
    ids = await _stored(svc, data, 3)
    ans = await svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4] * 3})
    assert ans.status is PutStatus.REFUSED and not svc._space_q


async def test_put_rows_wait_whose_ids_are_no_longer_the_units_answers_busy():
    """While it waited, the unit leased two blocks of ids more (only its last two are
    its to use): admitted with them, the rows could not be told from others; it
    answers BUSY (the unit deletes them, the producer puts the usual way)."""
    svc, data, held = await _full_service()
    ids = await _stored(svc, data)
    put = await _waiting(svc, svc.put_rows_wait("p", ["x"], ids, 0, {"x": [4]}))
    await svc.unit_ids(0, 4)
    await svc.unit_ids(0, 4)
    await svc.drop(held[:1])
    ans = await asyncio.wait_for(put, 5)
    assert ans.status is PutStatus.BUSY and ids[0] not in svc.ctl.rows
    assert svc.ctl.c_put == 2 and not svc._space_q


# -- ack_take: the next batch does not wait for the storage deletes of the ack


async def _acked_full_queue():
    """A full queue (capacity 2) whose units' deletes wait for ``data.go``, a producer
    waiting for room, and a consumer's ``ack_take`` of both rows under way: returns
    ``(svc, data, producer task, ack_take task, ids of two more stored rows)``."""
    svc, data, held = await _full_service(consumers=["t"])
    data.go.clear()  # (deletes wait from now on)
    req = Request("t", ("x",), 2, partition="p")
    d = await svc.take(req, 1.0)
    assert sorted(d.rows) == sorted(held)
    more = await _stored(svc, data, 2)
    producer = await _waiting(svc, svc.put_rows_wait("p", ["x"], more, 0, {"x": [4, 4]}))
    nxt = asyncio.ensure_future(svc.ack_take([d.lease], req, 5.0))
    await asyncio.wait_for(data.waiting.wait(), 5)  # the ack's deletes are running
    return svc, data, producer, nxt, more


async def test_ack_take_answers_before_the_units_delete_and_room_waits_for_them():
    """The consumer's next batch does not wait for the units to delete the rows it
    acknowledged; the room those deletes free goes to a producer waiting for it only
    once they are done (what the units hold stays within capacity). stats() with the
    units waits for them too."""
    svc, data, producer, nxt, more = await _acked_full_queue()
    stats = asyncio.ensure_future(svc.stats())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not producer.done() and not stats.done()  # room and unit counts: not yet
    assert svc.ctl.c_acked["t"] == 2 and not svc.ctl.rows  # the ack itself is done
    data.go.set()
    ans = await asyncio.wait_for(producer, 5)
    assert ans.status is PutStatus.OK and ans.waited
    d, expired = await asyncio.wait_for(nxt, 5)  # its rows: the producer's
    assert sorted(d.rows) == sorted(more) and expired is None
    st = await asyncio.wait_for(stats, 5)
    assert st.unit_rows == [2]  # the producer's: the stats call waited for the deletes
    await svc.ack([d.lease])
    assert (await svc.stats()).unit_rows == [0] and not svc._behind


async def test_ack_take_gets_its_next_batch_while_the_deletes_run():
    """With rows ready, ack_take answers while the deletes of its ack still run."""
    svc, data, held = await _full_service(capacity=4, consumers=["t"])
    data.go.clear()
    req = Request("t", ("x",), 2, partition="p")
    d = await svc.take(req, 1.0)
    d2, _ = await asyncio.wait_for(svc.ack_take([d.lease], req, 5.0), 5)
    assert sorted(d.rows + d2.rows) == sorted(held)
    assert data.waiting.is_set() and svc._behind  # (its deletes still wait)
    data.go.set()
    await svc.ack([d2.lease])
    assert await svc.audit() == [] and not svc._behind
    assert (await svc.stats()).unit_rows == [0]


async def test_ack_answers_before_the_units_delete_and_room_waits_for_them():
    """An explicit ack (get + ack) does not wait for the units to delete the rows it
    lets go either; a producer waiting for room gets it only once they are done, and
    stats() with the units waits for them."""
    svc, data, held = await _full_service(consumers=["t"])
    data.go.clear()  # (deletes wait from now on)
    d = await svc.take(Request("t", ("x",), 2, partition="p"), 1.0)
    more = await _stored(svc, data, 2)
    producer = await _waiting(svc, svc.put_rows_wait("p", ["x"], more, 0, {"x": [4, 4]}))
    await asyncio.wait_for(svc.ack([d.lease]), 5)  # answers while the deletes wait
    assert data.waiting.is_set() and svc._behind
    assert svc.ctl.c_acked["t"] == 2 and not svc.ctl.rows
    stats = asyncio.ensure_future(svc.stats())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not producer.done() and not stats.done()  # room and unit counts: not yet
    data.go.set()
    ans = await asyncio.wait_for(producer, 5)
    assert ans.status is PutStatus.OK and ans.waited
    assert (await asyncio.wait_for(stats, 5)).unit_rows == [2]
    assert await svc.audit() == [] and not svc._behind


async def test_deletes_behind_a_cancelled_ack_take_still_finish_and_close_waits():
    """Cancelling the ack_take (its take waiting for rows) cancels neither its ack nor
    the deletes running behind it; close() returns once they are done."""
    svc, data, held = await _full_service(consumers=["t"])
    data.go.clear()
    req = Request("t", ("x",), 2, partition="p")
    d = await svc.take(req, 1.0)
    call = asyncio.ensure_future(svc.ack_take([d.lease], req, 5.0))
    await asyncio.wait_for(data.waiting.wait(), 5)
    for _ in range(5):
        await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert svc._behind and svc.ctl.c_acked["t"] == 2
    closing = asyncio.ensure_future(svc.close())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not closing.done()
    data.go.set()
    assert await asyncio.wait_for(closing, 5) == {}
    assert data.units[0].stats() == (0, 0)  # deleted, not left behind


@pytest.mark.parametrize("failure", [ConnectionError, asyncio.CancelledError])
async def test_an_ack_take_that_fails_acks_alone_then_raises(failure):
    """A stream's ack_take that fails or is cancelled before the controller saw it (no
    connection yet, say): the session acks the batch alone (a second ack of a lease is
    a no-op), then the error goes on; no lease is left to its timeout."""
    from types import SimpleNamespace

    from streamrl.session import Session

    calls = []

    class Control:
        async def ack_take(self, ids, req, timeout):
            calls.append(("ack_take", ids))
            raise failure("nothing was sent")

        async def ack(self, ids):
            calls.append(("ack", ids))

    session = Session(None, SimpleNamespace(control=Control()))  # type: ignore[arg-type]
    assert not session.acks_in_place
    with pytest.raises(failure):
        await session.ack_take((7,), Request("t", ("x",), 1), None)
    assert calls == [("ack_take", [7]), ("ack", [7])]


def test_the_undo_of_a_commit_finds_its_token_by_position_or_by_name():
    _ray_side()
    from streamrl.transport.ray.controller import _UNDO

    tok = object()
    assert _UNDO["commit"]((tok, {"x": [8]}), {}, None) == ("retract", (tok,))
    assert _UNDO["commit"]((), {"token": tok, "nbytes": {"x": [8]}}, None) == ("retract", (tok,))
    assert _UNDO["commit"]((), {"nbytes": {"x": [8]}, "token": tok}, None) == ("retract", (tok,))
