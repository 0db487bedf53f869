"""Concurrent small puts of one process, combined into one call.

An agentic env worker runs many episodes at once, and each of them puts its rows one at
a time. Sent one by one, every such put is a call to a storage unit and a call from the
unit to the controller: the cost of a small put is the number of messages, not the bytes
(see docs/benchmarks.md, "Small puts on Ray"). :class:`PutCoalescer` sends a put at
once while fewer than :attr:`~PutCoalescer.max_in_flight` small puts of this process are
in flight; a put that comes while they are joins the puts of the same kind waiting
behind them, and when a call returns, each kind's waiting puts go as one call (of at
most :attr:`~PutCoalescer.max_bytes`; more go as more calls). Nothing
waits for a timer (no linger): a process that puts one row at a time sends each at once,
and the busier it is, the more rows a call carries (a group commit).

Puts of one kind are new rows of the same partition and version, with the same fields
holding the same kinds of values (tensors of one dtype and row shape, or lists) and the
same dtypes and tag fields: their columns join into one put of all their rows.

What each ``put`` promises is unchanged: it returns once its rows are admitted and
committed (the combined call answered), with its own rows; it raises what the combined
call raised. A combined call that was refused before anything was kept (:data:`SPLIT`)
lets each put go the usual way, where each finds its own answer or error.

When the units have no room (a full queue), puts that may wait for room as long as it
takes (they come with the queue's :class:`~streamrl.transport.base.NewRows`) go
*together* as one put that waits for room at the controller (``send_waiting``: the unit
stores the rows and the controller admits and commits them when their turn comes; one
call, where the usual way makes three: room, store, commit), or, where that does not
apply, the usual way together: one request for room for all of them, then their columns
stored and committed as one write. A put alone (none in flight) goes that way alone. A
call waiting for room holds no slot in flight, so puts of other kinds (another partition or version, which the controller may admit sooner)
go on; puts of its kind go on until :data:`ROOMS` requests of the kind wait at the
controller, and then wait in the process behind them and combine. The controller
serves waiting puts first come, first served, so none overtakes an earlier one.

Cancellation: a put cancelled while it waits behind the calls in flight leaves at once
(nothing was sent for it); so does one cancelled while its group waits for room (the
request for room is withdrawn, and made again for the others), once the group's put
that waited for room is withdrawn (the controller forgets it, or takes its rows back
had it just admitted them, and the unit deletes them). One cancelled while its
combined call (or its group's store and commit) is in flight waits until that is
answered and its own rows are taken back (dropped as ``"cancelled"``), and only then is
the cancellation raised, so a retry never races the undo; the other puts of the call
keep their rows.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .calls import request_id, spawn, undone

if TYPE_CHECKING:
    from ..base import NewRows

__all__ = ["PutCoalescer", "SPLIT"]

#: what ``send`` answers when puts combined must each go alone (refused, nothing kept)
SPLIT = "split"

#: requests for room of one kind of puts a process has waiting at the controller at once;
#: more puts of that kind wait in the process, combined. One: a group that waits at the
#: controller (``send_waiting``) lands in the call that waited, so the next is sent at
#: once, and the fewer groups wait, the larger each one is (fewer calls; see
#: docs/benchmarks.md, stop 30). Two did better when a group that got room still had to
#: be stored and committed before the next went.
ROOMS = 1

_STRIDED = torch.strided


class _Put:
    __slots__ = ("cols", "n", "nbytes", "tags", "fut")

    def __init__(self, cols: Mapping[str, Any], n: int, nbytes: dict, tags: dict,
                 fut: asyncio.Future):
        self.cols = cols
        self.n = n
        self.nbytes = nbytes
        self.tags = tags
        self.fut = fut


class _Group:
    """Puts of one kind waiting to go as one call."""

    __slots__ = ("partition", "version", "dtypes", "usual", "kind", "puts", "nbytes", "sent",
                 "rid", "room", "waits", "settled")

    def __init__(self, partition: str, version: int | None, dtypes: dict | None,
                 usual: NewRows | None, kind: Hashable):
        self.kind = kind
        self.partition = partition
        self.version = version
        self.dtypes = dtypes
        self.usual = usual  # the usual way, when every put of the group may wait for room
        self.puts: list[_Put] = []
        self.nbytes = 0  # bytes of the puts
        self.sent = False
        # the combined call's request id (to take rows of it back); "" once the group
        # went the usual way (rows are taken back through ``usual``)
        self.rid = ""
        self.room: asyncio.Task | None = None  # the group's request for room, while it waits
        self.waits = False  # ``room`` is the group's put waiting for room (send_waiting)
        # set once the call is answered and cancelled puts' rows are taken back
        self.settled: asyncio.Future = asyncio.get_running_loop().create_future()


def _kind(partition: str, cols: Mapping[str, Any], tags: Mapping[str, Any],
          version: int | None, dtypes: Mapping[str, str] | None,
          usual: NewRows | None, shapes: tuple | None = None) -> Hashable | None:
    """What puts must share to be sent as one (``None``: this one goes alone).
    ``shapes``: ``((field, dtype, row shape), ...)`` of ``cols`` when the caller has
    them (every column a dense tensor, see :func:`streamrl.columns.one_row_dense`)."""
    if shapes is None:
        shape: list[tuple] = []
        for f, c in cols.items():
            if type(c) is torch.Tensor:
                if c.layout is not _STRIDED or c.is_nested:
                    return None
                shape.append((f, c.dtype, tuple(c.shape[1:])))
            elif type(c) is list:
                shape.append((f, list))
            else:
                return None
        shapes = tuple(shape)
    return (partition, version, shapes, tuple(tags),
            None if dtypes is None else tuple(dtypes.items()), usual)


def _join(pieces: list[Any]) -> Any:
    if type(pieces[0]) is torch.Tensor:
        return torch.cat(pieces)
    out: list = []
    for p in pieces:
        out.extend(p)
    return out


class PutCoalescer:
    """Combines a process's concurrent small puts of one kind into one call (see the
    module docstring).

    Args:
        send: ``send(partition, cols, n, nbytes, tags, version, dtypes, rid, alone)``
            puts rows in one call (request id ``rid``) and returns ``(rows, shards,
            result)``, or ``None`` when the put does not apply and nothing was kept (no
            room: the usual way); raises what the put raises, except that with ``alone``
            false (puts combined) a refusal that kept nothing answers :data:`SPLIT`, so
            that each put finds its own error the usual way. Cancelled, it takes back
            what it put before it re-raises.
        retract: ``retract(shard, rid, rows)`` drops ``rows`` of the answered call
            ``rid`` to unit ``shard`` as ``"cancelled"``.
        send_waiting: as ``send``, for puts that may wait for room as long as it takes:
            the call waits at the controller where ``send`` answers ``None`` (one call
            where ``usual`` makes three); ``None`` (it does not apply, nothing kept):
            the puts go the usual way. Cancelled, it takes back what it put (or its
            request for room) before it re-raises. Without it, puts go the usual way
            whenever the units have no room.

    Keyword Args:
        max_bytes: bytes a combined call carries at most (a put that would take its
            group past it starts a new one).
        max_in_flight: small puts of this process in flight before the next ones wait
            and are combined (a group commit: one call in flight, the puts made
            meanwhile go together when it returns).
    """

    def __init__(self, send: Callable[..., Awaitable[Any]],
                 retract: Callable[[int, str, list[int]], Coroutine[Any, Any, Any]], *,
                 max_bytes: int = 1 << 20, max_in_flight: int = 1,
                 send_waiting: Callable[..., Awaitable[Any]] | None = None):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._send = send
        self._send_waiting = send_waiting
        self._retract = retract
        self.max_in_flight = max_in_flight
        self.max_bytes = max_bytes
        self.in_flight = 0
        self._groups: OrderedDict[Hashable, _Group] = OrderedDict()  # taking puts
        self._full: list[_Group] = []  # groups that take no more puts, waiting to go
        # kind -> its calls waiting for room at the controller (they hold no slot in
        # flight: puts of other kinds go on; see ROOMS)
        self._rooms: dict[Hashable, int] = {}
        #: calls sent and rows they carried (for tests and benchmarks)
        self.calls = 0
        self.rows = 0
        #: puts sent the usual way (no room in the units), and rows they carried
        self.usual_calls = 0
        self.usual_rows = 0
        #: puts sent with ``send_waiting`` (no room in the units), and rows they carried
        self.wait_calls = 0
        self.wait_rows = 0

    async def put(self, partition: str, cols: Mapping[str, Any], n: int, nbytes: dict,
                  tags: dict, version: int | None, dtypes: dict | None = None,
                  usual: NewRows | None = None, shapes: tuple | None = None) -> Any:
        """Put ``n`` new rows: at once when fewer than :attr:`max_in_flight` puts are in
        flight, else combined with the puts of its kind waiting behind them. Returns
        what ``send`` (or, with no room, ``usual``) returns for these rows alone, or
        ``None``: the caller puts them the usual way. ``usual``: given when this put
        may wait for room as long as it takes (see the module docstring); ``shapes``:
        each column's ``(field, dtype, row shape)`` when the caller has them (see
        :func:`_kind`)."""
        kind = None
        now = self.in_flight < self.max_in_flight
        if not now or self._rooms:
            kind = _kind(partition, cols, tags, version, dtypes, usual, shapes)
            if kind is None:
                now = True
            elif now and self._rooms.get(kind, 0) >= ROOMS:
                now = False  # its kind waits for room: this put waits behind, combined
        if now:
            self.in_flight += 1
            self.calls += 1
            self.rows += n
            try:
                ans = await self._send(partition, cols, n, nbytes, tags, version, dtypes,
                                       request_id(), True)
                if ans is None and usual is not None and dtypes is not None:
                    # no room in the units: the usual way, with the puts of its kind
                    # made meanwhile waiting behind this one
                    if kind is None:
                        kind = _kind(partition, cols, tags, version, dtypes, usual, shapes)
                    self._park(kind)
                    tok = None
                    try:
                        if self._send_waiting is not None:  # (it waits at the controller)
                            ans = await self._send_waiting(partition, cols, n, nbytes, tags,
                                                           version, dtypes, request_id(), True)
                            if ans is not None:
                                self.wait_calls += 1
                                self.wait_rows += n
                        if ans is None:
                            tok = await usual.room(partition, cols, n, nbytes, version, dtypes)
                    finally:
                        self._unpark(kind)
                    if tok is not None:
                        self.usual_calls += 1
                        self.usual_rows += n
                        ans = await usual.store(tok, cols, nbytes, tags)
                return ans
            finally:
                self.in_flight -= 1
                self._kick()
        b = 0
        for v in nbytes.values():
            b += sum(v)
        g = self._groups.get(kind)
        if g is not None and g.puts and g.nbytes + b > self.max_bytes:
            self._full.append(self._groups.pop(kind))  # (it goes as it is)
            g = None
        if g is None:
            g = self._groups[kind] = _Group(partition, version, dtypes, usual, kind)
        me = _Put(cols, n, nbytes, tags, asyncio.get_running_loop().create_future())
        g.puts.append(me)
        g.nbytes += b
        try:
            return await me.fut
        except asyncio.CancelledError:
            await self._cancelled(kind, g, me)
            raise

    async def _cancelled(self, kind: Hashable, g: _Group, me: _Put) -> None:
        """``me`` was cancelled: nothing to do if its group was not sent (it leaves the
        group); else its rows are taken back before the cancellation goes on."""
        if not g.sent:
            g.puts.remove(me)
            g.nbytes -= sum(sum(v) for v in me.nbytes.values())
            if not g.puts and self._groups.get(kind) is g:
                del self._groups[kind]
            return
        fut = me.fut
        if fut.done() and not fut.cancelled():  # answered just before the cancellation
            if fut.exception() is None and fut.result() is not None:
                rows, shards, _ = fut.result()
                await undone(self._take_back(g, shards[0], rows), "put")
            return
        room = g.room
        if room is not None and room.cancel():
            # the group waits for room: it asks again without this put (nothing was kept
            # for it: a request for room taken back keeps nothing; a put waiting for room
            # takes back what it put before it ends, and this one leaves after that)
            if g.waits:
                await undone(asyncio.wait([room]), "put")
            return
        # the group's call takes this put's rows back once it is answered
        await undone(_wait(g.settled), "put")

    def _park(self, kind: Hashable) -> None:
        """A call of ``kind`` waits for room: it holds no slot in flight meanwhile."""
        self.in_flight -= 1
        if kind is not None:
            self._rooms[kind] = self._rooms.get(kind, 0) + 1
        self._kick()

    def _unpark(self, kind: Hashable) -> None:
        """The call of ``kind`` is done waiting for room: it holds its slot again."""
        if kind is not None:
            left = self._rooms[kind] - 1
            if left:
                self._rooms[kind] = left
            else:
                del self._rooms[kind]
        self.in_flight += 1

    def _kick(self) -> None:
        """A call returned (or waits for room): each kind's waiting puts go, as one call
        per kind, except kinds with :data:`ROOMS` calls waiting for room."""
        if self.in_flight >= self.max_in_flight:
            return
        full, self._full = self._full, []
        taking, self._groups = self._groups, OrderedDict()
        rooms = self._rooms
        for g in full:
            if rooms and rooms.get(g.kind, 0) >= ROOMS:
                self._full.append(g)  # (stays behind)
            else:
                self._go(g)
        for kind, g in taking.items():
            if rooms and rooms.get(kind, 0) >= ROOMS:
                self._groups[kind] = g  # (stays behind, and takes more puts)
            else:
                self._go(g)

    def _go(self, g: _Group) -> None:
        g.sent = True
        self.in_flight += 1
        spawn(self._run(g), "a combined small put")

    async def _run(self, g: _Group) -> None:
        try:
            await self._run_group(g)
        finally:
            self.in_flight -= 1
            if not g.settled.done():
                g.settled.set_result(None)
            self._kick()

    async def _run_group(self, g: _Group) -> None:
        puts = [p for p in g.puts if not p.fut.done()]
        if not puts:
            return
        cols, n, nbytes, tags = _combined(puts)
        g.rid = rid = request_id()
        self.calls += 1
        self.rows += n
        try:
            ans = await self._send(g.partition, cols, n, nbytes, tags, g.version, g.dtypes,
                                   rid, False)
            if ans is None and g.usual is not None and g.dtypes is not None:
                g.rid = ""
                puts, ans = await self._usual(g)
        except asyncio.CancelledError:  # (the loop is closing) what was put is taken back
            _answer(puts, None)
            raise
        except BaseException as e:
            for p in puts:
                if not p.fut.done():
                    p.fut.set_exception(e)
            return
        if ans is None or ans is SPLIT:
            _answer(puts, None)
            return
        rows, shards, res = ans
        back: list[int] = []
        at = 0
        for p in puts:
            mine = rows[at:at + p.n]
            if p.fut.cancelled():
                back.extend(mine)
            elif not p.fut.done():
                p.fut.set_result((mine, shards[at:at + p.n], res))
            at += p.n
        if back:
            await undone(self._take_back(g, shards[0], back), "put")

    async def _usual(self, g: _Group) -> tuple[list[_Put], Any]:
        """Put the group's puts the usual way (the units had no room): as one put that
        waits for room at the controller (``send_waiting``), else room for all of them
        (asked again without the puts cancelled while it waits), then one write.
        Returns the puts it put and the answer."""
        usual, dtypes = g.usual, g.dtypes
        assert usual is not None and dtypes is not None
        waits = self._send_waiting is not None
        rid = ""
        self._park(g.kind)  # (no slot held while it waits for room)
        try:
            while True:
                puts = [p for p in g.puts if not p.fut.done()]
                if not puts:
                    return puts, None
                cols, n, nbytes, tags = _combined(puts)
                if waits:
                    assert self._send_waiting is not None  # (waits)
                    rid = request_id()
                    aw = self._send_waiting(g.partition, cols, n, nbytes, tags, g.version,
                                            dtypes, rid, False)
                else:
                    aw = usual.room(g.partition, cols, n, nbytes, g.version, dtypes)
                g.room = room = asyncio.ensure_future(aw)
                g.waits = waits
                try:
                    await asyncio.wait([room])
                except asyncio.CancelledError:  # (the loop is closing)
                    if room.cancel() or room.cancelled() or room.exception() is not None \
                            or room.result() is None:
                        await asyncio.wait([room])
                    elif waits:  # its rows landed: taken back
                        if type(room.result()) is tuple:
                            rows, shards, _ = room.result()
                            await self._retract(shards[0], rid, rows)
                    else:  # room given: given back
                        await usual.abort(room.result())
                    raise
                finally:
                    g.room = None
                    g.waits = False
                if room.cancelled():  # a put of the group was cancelled: again without it
                    continue
                if not waits:
                    break
                ans = room.result()  # (raises what the put raised)
                if ans is None:  # (it does not apply, nothing kept): the usual way
                    waits = False
                    continue
                g.rid = rid  # (rows of cancelled puts are taken back through the unit)
                self.wait_calls += 1
                self.wait_rows += n
                return puts, ans
        finally:
            self._unpark(g.kind)
        tok = room.result()
        if tok is None:  # refused, nothing kept: each put goes alone
            return puts, None
        self.usual_calls += 1
        self.usual_rows += n
        # (a put cancelled from here on waits for the write and is taken back)
        return puts, await usual.store(tok, cols, nbytes, tags)

    def _take_back(self, g: _Group, shard: int, rows: list[int]) -> Coroutine[Any, Any, Any]:
        if g.rid:
            return self._retract(shard, g.rid, rows)
        assert g.usual is not None
        return g.usual.retract(rows)


def _combined(puts: Sequence[_Put]) -> tuple[Mapping[str, Any], int, dict, dict]:
    """The columns, rows, bytes and tags of ``puts`` as one put."""
    if len(puts) == 1:
        p = puts[0]
        return p.cols, p.n, p.nbytes, p.tags
    first = puts[0]
    cols = {f: _join([p.cols[f] for p in puts]) for f in first.cols}
    n = sum(p.n for p in puts)
    nbytes = {f: _join([p.nbytes[f] for p in puts]) for f in first.nbytes}
    tags = {f: _join([p.tags[f] for p in puts]) for f in first.tags}
    return cols, n, nbytes, tags


def _answer(puts: Sequence[_Put], value: Any) -> None:
    for p in puts:
        if not p.fut.done():
            p.fut.set_result(value)


async def _wait(fut: asyncio.Future) -> None:
    await fut
