"""Small puts (and writes) admitted by a storage unit: both halves of the protocol.

A put of a few new rows with small data need not ask the controller for room first. The
producer's data plane (:class:`PlaneAdmission`, mixed into
:class:`~streamrl.transport.ray.data.RayDataPlane`) sends the rows inline to one storage
unit in one call; the unit (:class:`UnitAdmission`, mixed into
:class:`~streamrl.transport.ray.unit.StorageActorImpl`) stores them under row ids the
controller leased to it in blocks of :data:`ID_BLOCK`, then has the controller admit and
commit them in one step (:meth:`streamrl.control.ControlPlane.put_rows`). A waiting
consumer hears of the rows three hops after the producer's ``put`` began (producer ->
unit -> controller -> consumer) instead of five.

The answer is a :class:`~streamrl.messages.PutAnswer`. Where it does not apply (big
tensors, no socket channel, no room right now: ``BUSY``) nothing is kept and the
producer puts the usual way. A producer cancelled while it waits has the unit drop what
it committed (:meth:`UnitAdmission.cancel_put`), so a cancelled put leaves nothing behind.

A full queue: puts that may wait for room as long as it takes (``wait``) go the same
way, and the controller has them wait their turn
(:meth:`~streamrl.control.ControlPlane.put_rows_wait`, first come, first served with
every other waiting put) instead of answering ``BUSY``: one call from the producer and
one to the controller, where asking for room, storing and committing make three and
two. The unit holds their rows meanwhile, outside the queue's capacity, up to
:data:`WAIT_BYTES`; a producer that gives up withdraws the put (:meth:`cancel_put`: the
controller forgets it, or drops its rows had it just admitted them, and the unit
deletes them).

Small writes of new fields to rows a unit holds (the response, then the reward, added
to a sample's rows) go the same way (:meth:`PlaneAdmission.write_rows`,
:meth:`UnitAdmission.write_rows`): the unit stores the fields where that replaces nothing
(every row held there, none holding one of them), under a write id of its own, and has
the controller admit and commit the write in one step
(:meth:`~streamrl.control.ControlPlane.write_rows`); a refusal takes back exactly what
that id stored, and a writer that gives up has the write taken back once it landed
(:meth:`UnitAdmission.cancel_write`). Anything else (an overwrite, a field the rows hold,
rows of several units, big tensors) the writer writes the usual way: a write token from
the controller, the store, the commit.

Small puts and writes from many producers meet at a unit: while its call to the
controller is on its way, those that arrive wait, and go together in one call when it
returns (:meth:`~streamrl.control.ControlPlane.put_rows_many`), each answered as its own
call would be. Nothing waits longer than the call before it (no linger): a controller
that keeps up sees one call a put, a busy one fewer calls than puts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import TransportError
from ...messages import PutAnswer, PutStatus, WriteToken
from ..base import Column
from ..rpc import ConnectFailed
from .calls import request_id, spawn, undone
from .wire import SHM_MIN, bytes_by_path

if TYPE_CHECKING:
    from ..base import NewRows
    from ..rpc import RpcClient
    from .coalesce import PutCoalescer
    from .control import RayControl

__all__ = ["UnitAdmission", "PlaneAdmission", "ID_BLOCK", "FAST_MAX"]

ID_BLOCK = 4096  # row ids a unit leases at a time for the puts it admits
FAST_MAX = 1 << 20  # puts up to this many bytes may be admitted by a unit (put_rows)
_BUSY_PAUSE = 0.02  # seconds without put_rows after a unit found the queue full
#: bytes of small puts a unit holds while they wait for room (a full queue), outside the
#: queue's capacity; past it, a put that may wait is handed back (``BUSY``) and its
#: producer waits for room the usual way, holding its own rows
WAIT_BYTES = 16 << 20


class UnitAdmission:
    """The storage unit's half: admits small puts of new rows (socket channel only)."""

    if TYPE_CHECKING:  # (what the storage unit it is mixed into provides)
        index: int
        _controller: RayControl | None

        def put(self, parts: list, write: int = 0, only_adds: bool = False) -> bool: ...
        def delete_fields(self, rows: list[int], fields: list[str], write: int = 0) -> int: ...
        def delete(self, rows: list[int]) -> tuple[int, int]: ...

    def _init_admission(self) -> None:
        self._ids = [0, 0]  # [next, end) of the row ids leased for put_rows (socket thread)
        self._ids_lock: asyncio.Lock | None = None
        # put_rows by request id: the task, and whether it may wait for room
        self._puts: OrderedDict[str, tuple[asyncio.Task, bool]] = OrderedDict()
        self.wait_bytes = WAIT_BYTES  # (see WAIT_BYTES)
        self._held_waiting = 0  # bytes of puts waiting for room now
        # put_rows calls to the controller: whether one is on its way, and the puts that
        # wait for it to return (then sent together: see _put_rows_combined)
        self._put_rows_busy = False
        self._put_rows_next: list[tuple[tuple, asyncio.Future]] = []
        # write_rows by request id: the task, and the write (to take back: cancel_write)
        self._writes: OrderedDict[str, tuple[asyncio.Task, WriteToken]] = OrderedDict()
        self._write_ids = itertools.count(1)  # (see _write_id)

    def put_rows(self, n: int, cols: dict, partition: str, fields: list[str], nbytes: dict,
                 tags: dict, version: int | None, rid: str | None = None,
                 dtypes: dict | None = None, wait: bool = False):
        """A small put of ``n`` new rows (inline data), admitted by this unit: it stores
        them under row ids the controller leased to it, then asks the controller to
        admit and commit them in one step, without waiting for room. Consumers waiting
        for them hear of them two hops sooner than if the producer asked for room first.
        Socket channel only (it returns a coroutine). Answers a :class:`PutAnswer`, in
        its wire form (:meth:`PutAnswer.to_wire`):
        ``OK`` (with rows and commit result); ``BUSY`` (nothing kept: the producer puts
        the usual way); ``REFUSED`` (nothing kept) or ``FAILED`` (committed, then a
        filter failed, or the controller is gone), with the error.

        ``wait``: the put may wait for room as long as it takes: where the controller
        would answer ``BUSY`` it waits its turn instead
        (:meth:`~streamrl.control.ControlPlane.put_rows_wait`), and this unit holds the
        rows meanwhile, outside the queue's capacity, up to :data:`WAIT_BYTES` (past
        it, ``BUSY`` as without ``wait``); needs ``rid`` (the producer withdraws it with
        :meth:`cancel_put`)."""
        wait = wait and rid is not None
        fut = spawn(self._admit(n, cols, partition, fields, nbytes, tags, version, dtypes,
                                wait),
                    f"a small put admitted by storage unit {self.index}")
        if rid is not None:  # the producer may give up: see cancel_put
            self._puts[rid] = (fut, wait)
            while len(self._puts) > 4096:
                self._puts.popitem(last=False)
        return self._answer(fut)

    @staticmethod
    async def _answer(fut: asyncio.Future) -> tuple:
        """``fut``'s answer in its wire form (:meth:`PutAnswer.to_wire`); the put goes
        on if the producer's call is cancelled (see :meth:`cancel_put`). A put withdrawn
        while it waited for room answers ``BUSY`` (nothing kept)."""
        try:
            ans = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.cancelled():
                raise
            ans = PutAnswer(PutStatus.BUSY)
        return ans.to_wire()

    async def cancel_put(self, rid: str, rows: list[int] | None = None) -> None:
        """The producer of put ``rid`` was cancelled while it waited for the answer:
        once the put is done, rows it committed are dropped (``"cancelled"``), so a
        cancelled put leaves nothing behind. ``rows``: only those of its rows (one of
        the puts a producer combined into this one was cancelled; see
        :mod:`.coalesce`). A put that waits for room (``wait``) and is withdrawn whole
        stops waiting: the controller forgets it (or takes its rows back, had it just
        admitted them) and this unit deletes them. Socket channel only."""
        put = self._puts.pop(rid, None) if rows is None else self._puts.get(rid)
        if put is None:
            return
        fut, waits = put
        if rows is None and waits:
            fut.cancel()  # (see _admit: what it stored is deleted, nothing is admitted)
        await asyncio.wait([fut])
        if fut.cancelled() or fut.exception() is not None:  # nothing committed
            return
        ans = fut.result()
        if ans.status is PutStatus.OK and self._controller is not None:
            mine = set(ans.rows)
            back = ans.rows if rows is None else [r for r in rows if r in mine]
            if back:
                await self._controller.retract_rows(back)

    def write_rows(self, rows: list[int], cols: dict, fields: list[str], nbytes: dict,
                   tags: dict, dtypes: dict | None, rid: str):
        """A small write of new ``fields`` (no overwrite) to ``rows`` held here (inline
        data), admitted by this unit: it stores the data, then has the controller admit
        and commit the write in one step
        (:meth:`~streamrl.control.ControlPlane.write_rows`): one call from the writer
        and one to the controller, where the usual way makes three and two. The data is
        stored only if it replaces nothing (every row held here, none holding any of
        ``fields``: :meth:`StorageBackend.only_adds`), under a write id of this unit's,
        so that a refusal (a row dropped, a field being written by another writer...)
        takes back exactly what it stored. Socket channel only (it returns a
        coroutine). Answers a :class:`PutAnswer` in its wire form: ``OK`` (with the
        commit result), ``BUSY`` (nothing kept: the writer writes the usual way),
        ``REFUSED`` (nothing kept) or ``FAILED`` (committed, then a filter failed, or
        the controller is gone), with the error. A writer that gives up while it waits
        has the write taken back (:meth:`cancel_write`)."""
        wid = self._write_id()
        tok = WriteToken(wid, list(rows), [self.index] * len(rows), tuple(fields))
        fut = spawn(self._admit_write(tok, cols, nbytes, tags, dtypes),
                    f"a small write admitted by storage unit {self.index}")
        self._writes[rid] = (fut, tok)
        while len(self._writes) > 4096:
            self._writes.popitem(last=False)
        return self._answer(fut)

    def _write_id(self) -> int:
        """A write id of this unit's own: negative (the controller's count up from 1),
        and one of this unit's alone (its index in the low bits)."""
        return -((next(self._write_ids) << 20) | (self.index + 1))

    async def cancel_write(self, rid: str) -> None:
        """The writer of write ``rid`` was cancelled while it waited for the answer: once
        the write is done, what it committed is taken back (the fields un-written, as
        the controller's :meth:`~streamrl.control.ControlPlane.retract` does), so a
        cancelled write leaves nothing behind and may be written again. Socket channel
        only."""
        got = self._writes.pop(rid, None)
        if got is None:
            return
        fut, tok = got
        await asyncio.wait([fut])
        if fut.cancelled() or fut.exception() is not None:  # nothing committed
            return
        if fut.result().status is PutStatus.OK and self._controller is not None:
            await self._controller.retract(tok)

    async def _admit_write(self, tok: WriteToken, cols: dict, nbytes: dict, tags: dict,
                           dtypes: dict | None) -> PutAnswer:
        # shielded from the writer's cancellation (see write_rows): what it stores is
        # either committed or forgotten here, never left behind
        ctl = self._controller
        if ctl is None:
            return PutAnswer(PutStatus.BUSY)
        try:
            if not self.put([(tok.rows, cols)], tok.id, only_adds=True):
                return PutAnswer(PutStatus.BUSY)  # (it would replace: the usual way says why)
        except Exception as e:  # noqa: BLE001 - nothing stored
            return PutAnswer(PutStatus.REFUSED, error=e)
        try:
            ans = await self._put_rows_combined(ctl, (None, tok.rows, tok.fields, self.index,
                                                      tok.id, nbytes, tags, dtypes))
        except ConnectFailed:
            ans = PutAnswer(PutStatus.BUSY)  # nothing sent
        except asyncio.CancelledError:  # (never sent: see _put_rows_combined)
            self.delete_fields(tok.rows, list(tok.fields), tok.id)
            raise
        except Exception as e:  # noqa: BLE001 - committed (or the connection broke: it
            # may have been); the controller dropped what it had to
            return PutAnswer(PutStatus.FAILED, error=e)
        if ans.status is not PutStatus.OK:
            self.delete_fields(tok.rows, list(tok.fields), tok.id)
        return ans

    async def _admit(self, n: int, cols: dict, partition: str, fields: list[str],
                     nbytes: dict, tags: dict, version: int | None,
                     dtypes: dict | None = None, wait: bool = False) -> PutAnswer:
        # shielded from the producer's cancellation (see put_rows): what it stores is
        # either committed or deleted here, never left behind; a put that waits for room
        # is cancelled by cancel_put: the controller call takes its effect back, and what
        # was stored here is deleted
        ctl = self._controller
        if ctl is None:
            return PutAnswer(PutStatus.BUSY)
        if self._ids_lock is None:
            self._ids_lock = asyncio.Lock()
        try:
            async with self._ids_lock:  # blocks are leased one at a time, used in order
                if self._ids[1] - self._ids[0] < n:
                    self._ids = list(await ctl.unit_ids(self.index, max(n, ID_BLOCK)))
                start = self._ids[0]
                self._ids[0] += n
        except Exception:  # noqa: BLE001 - no ids (controller busy or gone): the usual
            # path says why
            return PutAnswer(PutStatus.BUSY)
        ids = list(range(start, start + n))
        size = 0
        if wait:
            for v in nbytes.values():
                size += sum(v)
            if self._held_waiting + size > self.wait_bytes:
                wait, size = False, 0  # (holds enough: no room now is BUSY)
        try:
            self.put([(ids, cols)])
        except Exception as e:  # noqa: BLE001 - nothing stored
            return PutAnswer(PutStatus.REFUSED, error=e)
        self._held_waiting += size
        args = (partition, fields, ids, self.index, nbytes, tags, version, dtypes)
        try:
            ans = await (ctl.put_rows_wait(*args) if wait
                         else self._put_rows_combined(ctl, args))
        except asyncio.CancelledError:  # (withdrawn: cancel_put) the controller stopped
            # the call or took its rows back before this is raised (see RayControl._call)
            self.delete(ids)
            raise
        except ConnectFailed:
            ans = PutAnswer(PutStatus.BUSY)  # nothing sent
        except Exception as e:  # noqa: BLE001 - committed (or the connection broke: it
            # may have been); the controller dropped what it had to
            return PutAnswer(PutStatus.FAILED, error=e)
        finally:
            self._held_waiting -= size
        if ans.status is not PutStatus.OK:
            self.delete(ids)
        return ans

    @staticmethod
    def _one(ctl: RayControl, args: tuple) -> Awaitable[PutAnswer]:
        """The controller call of one entry of ``put_rows_many``: ``put_rows(*args)``, or
        ``write_rows(*args[1:])`` for a write (``args[0]`` is ``None``)."""
        return ctl.write_rows(*args[1:]) if args[0] is None else ctl.put_rows(*args)

    async def _put_rows_combined(self, ctl: RayControl, args: tuple) -> PutAnswer:
        """``ctl.put_rows(*args)`` (``ctl.write_rows(*args[1:])`` for a small write, whose
        ``args[0]`` is ``None``), or, while such a call is on its way, wait for it to
        return and go with the other puts and writes that waited, in one
        ``put_rows_many`` call (answered, or raising, as its own call would). One whose
        wait is cancelled before its call goes is not sent; one cancelled after is taken
        back if it landed."""
        if self._put_rows_busy:
            fut = asyncio.get_running_loop().create_future()
            self._put_rows_next.append((args, fut))
            return await fut
        self._put_rows_busy = True
        try:
            return await self._one(ctl, args)
        finally:
            if self._put_rows_next:
                spawn(self._put_rows_waiting(ctl),
                      f"small puts combined by storage unit {self.index}")
            else:
                self._put_rows_busy = False

    async def _put_rows_waiting(self, ctl: RayControl) -> None:
        """Send the puts that waited (see :meth:`_put_rows_combined`), until none does."""
        try:
            while self._put_rows_next:
                batch = [(a, f) for a, f in self._put_rows_next if not f.done()]
                self._put_rows_next = []
                if not batch:
                    continue
                try:
                    if len(batch) == 1:
                        answers = [await self._one(ctl, batch[0][0])]
                    else:
                        answers = await ctl.put_rows_many([a for a, _ in batch])
                except asyncio.CancelledError:
                    for _, f in batch:
                        f.cancel()
                    raise
                except Exception as e:  # noqa: BLE001 - every put of the call gets it
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                for (a, f), ans in zip(batch, answers):
                    if f.done():  # it gave up (and deleted what it stored) meanwhile
                        if ans.status is PutStatus.OK:
                            spawn(ctl.retract(_write_token(a)) if a[0] is None
                                  else ctl.retract_rows(ans.rows),
                                  f"taking back a put or write storage unit {self.index} "
                                  "gave up")
                    elif ans.status is PutStatus.FAILED:  # (what put_rows raised)
                        f.set_exception(ans.error or TransportError("put_rows failed"))
                    else:
                        f.set_result(ans)
        finally:
            self._put_rows_busy = False


def _small(nbytes: Mapping[str, Sequence[int]]) -> bool:
    """Whether a put or write of these bytes (per field, each row's) may go inline to a
    unit: no field of :data:`SHM_MIN` bytes or more (big tensors go through the arena),
    at most :data:`FAST_MAX` in all."""
    total = 0
    for v in nbytes.values():
        b = sum(v)
        if b >= SHM_MIN:
            return False
        total += b
    return total <= FAST_MAX


def _write_token(args: tuple) -> WriteToken:
    """The write of a small write's ``put_rows_many`` entry ``(None, rows, fields, shard,
    write, ...)`` (see :meth:`UnitAdmission._put_rows_combined`), to take it back."""
    _, rows, fields, shard, write = args[:5]
    return WriteToken(write, list(rows), [shard] * len(rows), tuple(fields))


class PlaneAdmission:
    """The producer's half: sends a small put to one unit (round robin, this node's
    units first) instead of asking the controller for room."""

    #: concurrent small puts of this process are combined into one call (see
    #: :mod:`.coalesce`); a data plane whose wire form of a put holds per-call state
    #: turns it off
    coalesce_puts = True

    if TYPE_CHECKING:  # (what the data plane it is mixed into provides)
        num_shards: int
        rpcs: list[RpcClient | None]

        def _wire(self, cols: Mapping[str, Column]) -> dict[str, Any]: ...
        async def _call(self, shard: int, method: str, *args: Any,
                        rows: Any = ()) -> Any: ...
        def count_moved(self, by_path: Mapping[str, int]) -> None: ...

    def _init_admission(self, first: int) -> None:
        # round robin of put_rows from unit ``first``: processes that put a few rows
        # each do not all start on unit 0
        self._next_unit = first
        self._busy_until = 0.0  # no put_rows before (the queue was full)
        self._unreachable: set[int] = set()  # units put_rows could not connect to
        self._unit_nodes: dict[int, str] = {}  # unit -> its Ray node id (asked once)
        self._node: str | None = None  # this process's Ray node id
        self._coalescer: PutCoalescer | None = None  # (made in the event loop's thread)
        # the units small puts may go to (_live) and those of them they go to (_pool),
        # as of the channels ``_live_of`` with ``_live_gone`` units unreachable
        self._live_of: object = None
        self._live_gone = -1
        self._live_units: list[int] = []
        self._pool_units: list[int] | None = None

    async def put_rows(self, partition: str, cols: Mapping[str, Column], n: int,
                       nbytes: dict, tags: dict, version: int | None,
                       dtypes: dict | None = None, *, usual: NewRows | None = None,
                       shapes: tuple | None = None
                       ) -> tuple[list[int], list[int], Any] | None:
        """A small put of ``n`` new rows, admitted and committed by one storage unit
        (see :meth:`UnitAdmission.put_rows`): one call instead of asking the
        controller for room first. The unit is one on this process's node when there is
        one (round robin over them), else any (round robin). Puts of this process made
        while others are in flight are combined into one call (:mod:`.coalesce`); when
        the units have no room, those that come with ``usual`` are put that way together.
        Returns ``(rows, shards, commit result)``, or ``None`` when it does not apply
        (big tensors, no socket channel, no room right now): the caller puts the usual
        way. Raises what the put would raise."""
        if (n < 1 or (usual is None or not self.coalesce_puts)
                and time.monotonic() < self._busy_until or not self._live()):
            return None
        if not _small(nbytes):
            return None
        if not self.coalesce_puts:
            ans = await self._put_rows_call(partition, cols, n, nbytes, tags, version,
                                            dtypes, request_id(), True)
            assert not isinstance(ans, str)  # (alone: a refusal raises)
            return ans
        if self._coalescer is None:
            from .coalesce import PutCoalescer  # (imports torch: producers only, not units)

            self._coalescer = PutCoalescer(self._put_rows_call, self._retract_rows,
                                           max_bytes=FAST_MAX,
                                           send_waiting=self._put_rows_waiting)
        return await self._coalescer.put(partition, cols, n, nbytes, tags, version, dtypes,
                                         usual, shapes)

    async def write_rows(self, rows: Sequence[int], shards: Sequence[int],
                         cols: Mapping[str, Column], nbytes: dict, tags: dict,
                         dtypes: dict | None) -> Any:
        """A small write of new fields (no overwrite) to ``rows``, admitted and committed
        by the storage unit that holds them all (see :meth:`UnitAdmission.write_rows`):
        one call instead of three (room at the controller, the store, the commit).
        Returns the commit result, or ``None`` when it does not apply (rows of several
        units, big tensors, no socket channel, a field the rows already hold): the
        caller writes the usual way. Raises what the write would raise."""
        shard = shards[0] if shards else -1
        if shard < 0 or any(s != shard for s in shards) or shard not in self._live():
            return None
        if not _small(nbytes):
            return None
        wire = self._wire(cols)
        rid = request_id()
        ans = await self._unit_call(shard, "write_rows", (list(rows), wire, list(cols), nbytes,
                                                          tags, dtypes, rid), rid, "write")
        if ans is None or ans.status is PutStatus.BUSY:
            return None
        if ans.status is not PutStatus.OK:
            assert ans.error is not None  # (REFUSED and FAILED carry their error)
            raise ans.error
        self.count_moved(bytes_by_path(wire))
        return ans.result

    async def _retract_rows(self, shard: int, rid: str, rows: list[int]) -> None:
        """Drop ``rows`` of the answered put ``rid`` to unit ``shard`` (``"cancelled"``)."""
        await self._call(shard, "cancel_put", rid, rows)

    def _put_rows_waiting(self, partition: str, cols: Mapping[str, Column], n: int,
                          nbytes: dict, tags: dict, version: int | None, dtypes: dict | None,
                          rid: str, alone: bool
                          ) -> Awaitable[tuple[list[int], list[int], Any] | str | None]:
        """:meth:`_put_rows_call` of a put that may wait for room as long as it takes
        (the unit has it wait at the controller: one call, where the usual way makes
        three)."""
        return self._put_rows_call(partition, cols, n, nbytes, tags, version, dtypes, rid,
                                   alone, True)

    async def _put_rows_call(self, partition: str, cols: Mapping[str, Column], n: int,
                             nbytes: dict, tags: dict, version: int | None,
                             dtypes: dict | None, rid: str, alone: bool, wait: bool = False
                             ) -> tuple[list[int], list[int], Any] | str | None:
        """:meth:`put_rows` as one call, request id ``rid`` (see
        :class:`~.coalesce.PutCoalescer` for ``alone``); no call while the units are
        full (``None``), unless the put may ``wait`` for room at the controller (then
        the units are taken to be full for a while more if it waited)."""
        if not wait and time.monotonic() < self._busy_until:
            return None
        live = self._live()
        if not live:
            return None
        wire = self._wire(cols)
        pool = self._pool_units
        if pool is None:
            pool = await self._on_this_node(live) or live
            if live is self._live_units and all(s in self._unit_nodes for s in live):
                self._pool_units = pool  # (every unit's node is known: kept)
        self._next_unit = (self._next_unit + 1) % len(pool)
        shard = pool[self._next_unit]
        ans = await self._unit_call(shard, "put_rows", (n, wire, partition, list(cols), nbytes,
                                                        tags, version, rid, dtypes, wait),
                                    rid, "put")
        if ans is None:
            return None
        if ans.status is PutStatus.BUSY:  # no room now: wait the usual way (and for a while)
            if not wait:  # (a waiting put's BUSY: its ids were no longer the unit's)
                self._busy_until = time.monotonic() + _BUSY_PAUSE
            return None
        if ans.waited:  # the queue is full: the next puts wait for room at once
            self._busy_until = time.monotonic() + _BUSY_PAUSE
        if ans.status is PutStatus.REFUSED and not alone:
            from .coalesce import SPLIT

            return SPLIT  # nothing kept: each of the puts combined finds its own error
        if ans.status is not PutStatus.OK:
            assert ans.error is not None  # (REFUSED and FAILED carry their error)
            raise ans.error
        rows, res = ans.rows, ans.result
        self.count_moved(bytes_by_path(wire))
        return rows, [shard] * n, res

    async def _unit_call(self, shard: int, method: str, args: tuple, rid: str, what: str
                         ) -> PutAnswer | None:
        """``method(*args)`` of storage unit ``shard`` (``put_rows`` or ``write_rows``,
        request id ``rid``) over its socket channel, its answer read back; ``None`` when
        it could not connect (nothing was sent: the usual way finds out why). Cancelled
        while it waits, the unit finishes the call (shielded) and then takes back what
        it committed (``cancel_put`` / ``cancel_write``); the cancellation goes on once
        that is done, so a retry cannot race it."""
        rpc = self.rpcs[shard]
        assert rpc is not None  # (live units have a socket channel)
        try:
            return PutAnswer.from_wire(await rpc.call(method, *args))
        except asyncio.CancelledError:
            rpc = self.rpcs[shard]  # (read again: the channel may have been replaced)
            assert rpc is not None
            await undone(rpc.call(f"cancel_{what}", rid), what)
            raise
        except ConnectFailed:
            self._unreachable.add(shard)
            return None
        except ConnectionError as e:
            raise TransportError(
                f"lost the connection to storage unit {shard} during a {what} ({e}); it "
                f"may or may not have landed") from None

    def _live(self) -> list[int]:
        """The units a small put may go to: those with a socket channel that could be
        reached (worked out again when the channels change or a unit turns out
        unreachable)."""
        if self._live_of is not self.rpcs or self._live_gone != len(self._unreachable):
            self._live_units = [s for s in range(self.num_shards)
                                if self.rpcs[s] is not None and s not in self._unreachable]
            self._live_of = self.rpcs
            self._live_gone = len(self._unreachable)
            self._pool_units = None
        return self._live_units

    async def _on_this_node(self, shards: list[int]) -> list[int]:
        """The units of ``shards`` on this process's Ray node: a small put goes to one of
        them when there is one, so a node's producers fill their own node's units and
        their bytes stay off the network. Each unit is asked for its node once."""
        import ray

        unknown = [s for s in shards if s not in self._unit_nodes]
        if unknown:
            res = await asyncio.gather(*[self._call(s, "shm_info") for s in unknown],
                                       return_exceptions=True)
            for s, r in zip(unknown, res):
                if not isinstance(r, BaseException):
                    self._unit_nodes[s] = r[0]
        if self._node is None:
            self._node = ray.get_runtime_context().get_node_id()
        return [s for s in shards if self._unit_nodes.get(s) == self._node]
