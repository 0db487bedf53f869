"""The controller service: the pure :class:`~streamrl.controller.Controller` plus waiting.

This is the control plane every transport exposes. It adds to the controller what needs
an event loop:

* **waiting** -- ``put`` waits (FIFO) for capacity and for version pacing; ``take`` waits
  for a batch. Waiting is event-driven: a write that makes rows deliverable sets the
  events of exactly the subscriptions that gained rows; a seal, drop, ack or close sets
  those of the partitions whose end-of-stream condition moved. A waiter's timer is the
  earlier of its own timeout and the next lease deadline, so expired leases are handed
  out again without any polling loop.
* **filters** -- filter jobs the controller queues are run right away by whoever caused
  them (usually the producer whose write completed a row or group), reading the needed
  fields from storage.
* **storage deletes** -- rows the controller drops are deleted from their units (while
  a checkpoint is written, those of rows of its cut are held until its units wrote them:
  see :mod:`streamrl.checkpoint.cut`).

Everything runs in one event loop (the caller's for the embedded transport, the
controller actor's on Ray); no locks are needed because controller calls never await.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import (Awaitable, Callable, Collection, Hashable, Iterable, Mapping,
                             Sequence)
from typing import Any, TypeVar

import anyio

from ._aio import shielded, to_thread_whole
from .controller import OPTIONS as CONTROLLER_OPTIONS, Controller
from .messages import (END, CommitResult, Delivery, DropReason, FilterJob, FilterSpec, PutAnswer,
                       PutStatus, Request, WriteToken)
from .checkpoint.cut import CheckpointCut, Hold
from .errors import (CheckpointError, FilterError, InvalidArgument, LeaseExpired, QueueClosed,
                     QueueFull, RowsDropped, RowsLost, SchemaError, StreamRLError, StreamTimeout)
from .stats import Histogram, Stats, TaskStats, partition_stats
from .transport.base import Column, DataPlane

log = logging.getLogger("streamrl")
T = TypeVar("T")

__all__ = ["ControllerService"]


class ControllerService:
    """Async control plane around a :class:`Controller` (see module docstring).

    Args:
        controller: the metadata state machine.
        data: the storage units, for deletes and for the fields filters read.
    """

    def __init__(self, controller: Controller, data: DataPlane):
        self.ctl = controller
        self.data = data
        # subscription -> its waiters and the batch size each waits for (see _waiting)
        self._sub_waiters: dict[tuple, dict[anyio.Event, int]] = {}
        self._part_waiters: dict[str | None, set[anyio.Event]] = {}
        # puts waiting for room, first come first served: their place in line (which
        # names the partition their new rows go to: a seal ends the wait) -> its event
        self._space_q: OrderedDict[_Turn, anyio.Event] = OrderedDict()
        # rows storage units hold for puts waiting for room (put_rows_wait): not strays
        self._waiting_rows: set[int] = set()
        # puts waiting for version pacing -> the partition of their new rows (None:
        # wait_version), whose seal ends the wait
        self._pace_waiters: dict[anyio.Event, str | None] = {}
        self._filters: dict[str, Callable] = {}
        self._filter_failures: deque[str] = deque(maxlen=16)
        #: filter jobs no writer waits for (those of one-row puts admitted together,
        #: whose puts have returned: see streamrl/combine.py): a failure is logged even by
        #: an :meth:`_after` that raises the failures of the writer it runs for
        self._quiet_jobs: set[int] = set()
        self._waits: deque[float] = deque(maxlen=10000)
        self._wait_hist: dict[str, Histogram] = {}  # task -> how long its takes waited
        # (tag field, partition or None) -> its backfill is done
        self._tags_ready: dict[tuple[str, str | None], anyio.Event] = {}
        self._deferred: deque[list[int]] = deque()  # releases queued by finalizers
        self._loop: asyncio.AbstractEventLoop | None = None  # see loop
        # a checkpoint being written: the storage deletes it holds back (one at a time)
        self._hold: Hold | None = None
        self._hold_ended: anyio.Event = anyio.Event()
        self._holds = 0
        # storage deletes running behind the call that caused them (see _delete_behind);
        # room they free is given to waiting producers once none is left
        self._behind: set[asyncio.Task] = set()
        self._freed_behind = False

    # ------------------------------------------------------------------ plumbing

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this service runs in (its waiters live there), once a call
        ran; ``None`` before."""
        return self._loop

    def defer_release(self, lease_ids: Sequence[int]) -> None:
        """Queue a release from any thread or finalizer; the loop applies it soon."""
        self._deferred.append(list(lease_ids))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._apply_deferred)
            except RuntimeError:  # the loop is shutting down
                pass

    def _apply_deferred(self) -> None:
        while self._deferred:
            self.ctl.release(self._deferred.popleft())
        self._settle()

    def _settle(self) -> None:
        """Wake whoever the controller's last changes help, without awaiting anything:
        storage deletes and filter jobs stay queued for the next queue call."""
        deletes, jobs, woken, changed, freed = self.ctl.drain()
        for shard, rows in deletes.items():
            self.ctl.deletes.setdefault(shard, []).extend(rows)
        self.ctl.filter_jobs.extend(jobs)
        self._wake(woken, changed, freed)

    def _done_now(self, jobs_ok: bool = False) -> bool:
        """Do at once what :meth:`_after` would, when that is only waking waiters (no
        storage I/O, filter jobs, deferred releases or checkpoint hold): ``True``; else
        ``False`` and nothing is done (await :meth:`_after`). Saves the hot paths a
        coroutine per call. Storage deletes count as nothing to await where
        :meth:`_delete_sync` does them at once (in-process storage units).
        ``jobs_ok``: filter jobs queued do not count (the caller knows a task that
        will run them: see ``CombiningService._open``)."""
        ctl = self.ctl
        if ((ctl.filter_jobs and not jobs_ok) or ctl.field_deletes or self._deferred
                or self._hold is not None or self._loop is None):
            return False
        if ctl.deletes:
            if not self._delete_sync(ctl.deletes):
                return False
            ctl.deletes = {}
        if ctl.woken or ctl.changed or ctl.space_freed:
            woken, changed, freed = ctl.woken, ctl.changed, ctl.space_freed
            ctl.woken, ctl.changed, ctl.space_freed = set(), set(), False
            self._wake(woken, changed, freed)
        return True

    def _delete_sync(self, deletes: dict[int, list[int]]) -> bool:
        """Delete rows from the storage units at once, where that needs no awaiting
        (units in this process): ``True`` once done. ``False`` (nothing done): they are
        deleted by awaiting :meth:`_after`. Here: always ``False``."""
        return False

    def ack_now(self, lease_ids: Sequence[int]) -> Awaitable[None] | None:
        """:meth:`ack` without a coroutine where nothing in it has to wait (in-process
        storage, no filter to run): ``None`` once done. Otherwise an awaitable that does
        what is left (all of it, or the storage deletes and filters that follow the
        acknowledgement); await it shielded, as :meth:`ack`. Raises what :meth:`ack`
        raises, once nothing is left to do."""
        if not self._sync_ok():
            return self.ack(lease_ids)
        try:
            self.ctl.ack(lease_ids)
        except BaseException as e:
            if self._done_now():
                raise
            return self._after_then(e)
        if self._done_now():
            return None
        self._delete_behind()  # (as ack: the answer does not wait for the deletes)
        return self._after()

    def _sync_ok(self) -> bool:
        """Whether a call may run without awaiting (see :meth:`_done_now`)."""
        return False

    async def _after_then(self, e: BaseException) -> None:
        await self._after()
        raise e

    async def _after(self, raise_filter_errors: bool = False) -> None:
        """Drain the controller's outboxes: wake waiters, delete from storage, run filters.
        Filter failures are raised (``raise_filter_errors``) or logged; either way the
        rows concerned are dropped and counted."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._deferred:
            self._apply_deferred()
        if self._hold is not None and self._hold.expired(self.ctl.clock()):
            await shielded(self._end_hold(self._hold))
        errors: list[FilterError] = []
        quiet: list[FilterError] = []  # (failures of jobs no writer waits for)
        # Storage I/O for state the controller already changed runs to the end even if
        # the caller is cancelled meanwhile (shielded): once taken out of the outbox, a
        # delete that was cut short would leave its rows in the units for ever.
        while self.ctl.field_deletes:  # fields stored by writes that expired
            await shielded(self._forget(self.ctl.field_deletes.pop()))
        while True:
            deletes, jobs, woken, changed, freed = self.ctl.drain()
            # producers waiting for room are let in once the storage units freed it, so
            # what the units hold stays within capacity (and arena blocks are reused)
            self._wake(woken, changed, freed and not deletes)
            if deletes:
                await shielded(self._delete(deletes))
                if freed:
                    self._wake((), (), True)
            if not jobs:
                break
            try:
                read = await self._read_for_filters(jobs)
            except BaseException:
                for j in jobs:
                    self.ctl.filter_retry(j.id)
                raise
            judged = self._judge_together(jobs, read) if read else None
            for i, job in enumerate(jobs):
                verdict = judged.get(job.id) if judged else None
                if verdict is not None:  # (judged with others: nothing to await)
                    if self.ctl.job_live(job.id):  # (not withdrawn meanwhile)
                        self.ctl.filter_done(job.id, [verdict.get(r, False) for r in job.rows])
                    if not self.ctl.job_live(job.id):
                        self._quiet_jobs.discard(job.id)
                    continue
                try:
                    err = await self._run_filter(job, read)
                except BaseException:
                    for j in jobs[i:]:
                        self.ctl.filter_retry(j.id)
                    raise
                if err is not None:
                    (quiet if job.id in self._quiet_jobs else errors).append(err)
                if not self.ctl.job_live(job.id):  # (done: a job queued again stays quiet)
                    self._quiet_jobs.discard(job.id)
        for e in quiet:
            log.error("streamrl: %s", e)
        if errors:
            if raise_filter_errors:
                raise errors[0]
            for e in errors:
                log.error("streamrl: %s", e)

    def _delete_behind(self) -> None:
        """Start the storage deletes in the controller's outbox without waiting for
        them: for a call whose answer does not depend on them (:meth:`ack` and
        :meth:`ack_take`: the consumer's acknowledgement, its next batch). Room they
        free goes to producers waiting for it once they are done, as when awaited
        (:meth:`_wake`); :meth:`stats`, :meth:`audit` and :meth:`close` wait for those
        running when they are called
        (:meth:`_deletes_done`). A checkpoint need not: the rows they delete had left
        the controller before its cut. They run to the end whatever happens to the
        call that started them."""
        ctl = self.ctl
        deletes = ctl.deletes
        if not deletes or self._hold is not None:
            return  # (a checkpoint's hold: _after splits them)
        ctl.deletes = {}
        if self._delete_sync(deletes):
            return
        task = asyncio.ensure_future(self._deleted_behind(deletes))
        self._behind.add(task)

    async def _deleted_behind(self, deletes: dict[int, list[int]]) -> None:
        try:
            await self._delete(deletes)
        finally:
            self._behind.discard(asyncio.current_task())
            if not self._behind and self._freed_behind:
                self._freed_behind = False
                self._wake((), (), True)

    async def _deletes_done(self) -> None:
        """Wait until the storage deletes running behind calls (:meth:`_delete_behind`)
        now are done (not those started meanwhile: a consumer that keeps acknowledging
        could otherwise hold the caller for ever)."""
        if self._behind:
            await shielded(asyncio.wait(set(self._behind)))

    async def _delete(self, deletes: dict[int, list[int]]) -> None:
        if self._hold is not None:  # rows of a checkpoint's cut: deleted once written
            deletes = self._hold.split(deletes)
            if not deletes:
                return
        try:
            await self.data.delete(deletes)
        except Exception:  # a dead unit: its rows are gone anyway
            log.exception("streamrl: deleting rows from storage failed")

    def _wake(self, woken: Iterable[tuple], changed: Collection[Any], freed: bool) -> None:
        if changed and (self._space_q or self._pace_waiters):
            # a put waiting in a partition sealed now never fits: it raises
            for me, ev in self._space_q.items():
                if not self.ctl.open_for_rows(me.partition):
                    ev.set()
            for ev, paced in self._pace_waiters.items():
                if paced is not None and not self.ctl.open_for_rows(paced):
                    ev.set()
        for key in woken:
            for ev in self._sub_waiters.get(key, ()):
                ev.set()
        if None in changed:
            changed = set(self._part_waiters)
        elif changed:
            changed = set(changed)
            changed.add(None)
        for name in changed:
            for ev in self._part_waiters.get(name, ()):
                ev.set()
        if freed and self._behind:  # (once the deletes running behind are done)
            self._freed_behind = True
        elif freed:
            if self._space_q:
                next(iter(self._space_q.values())).set()
            for ev in self._pace_waiters:
                ev.set()
        if self.ctl.closed:
            for ev in self._space_q.values():
                ev.set()
            for ev in self._pace_waiters:
                ev.set()

    async def _wait(self, ev: anyio.Event, deadline: float | None) -> bool:
        """Wait for ``ev`` until ``deadline`` or the next lease or write deadline; True if
        set. Leases and writes already past their deadline are expired first (so a waiter
        whose own checks do not expire them does not wake again at once, for ever)."""
        nxt = self.ctl.next_deadline()
        if nxt is not None and nxt <= self.ctl.clock():
            self.ctl.expire()
            self._settle()
            if ev.is_set():
                return True
            nxt = self.ctl.next_deadline()
        ends = [d for d in (deadline, nxt) if d is not None]
        if not ends:
            await ev.wait()
            return True
        delay = max(0.0, min(ends) - self.ctl.clock())
        with anyio.move_on_after(delay):
            await ev.wait()
        return ev.is_set()

    # ------------------------------------------------------------------ writes

    async def allocate(self, partition: str, n: int, fields: Sequence[str], *, nbytes: int = 0,
                       version: int | None = None, timeout: float | None = None,
                       nowait: bool = False, dtypes: dict[str, str] | None = None
                       ) -> WriteToken:
        """Admit ``n`` new rows, waiting (FIFO, up to ``timeout``) for capacity and for
        version pacing. ``nowait`` raises :class:`~streamrl.errors.QueueFull` instead."""
        ctl = self.ctl
        if nowait:
            if self._space_q:
                ctl.check_fits(n, nbytes)
                raise QueueFull(f"no room for {n} rows: other producers are waiting for space; "
                                "use put to wait your turn")
            tok = ctl.allocate(partition, n, fields, nbytes=nbytes, version=version,
                               dtypes=dtypes)
            return await self._admitted(tok)
        if not self._space_q and ctl.admission(n, nbytes, version) is None:
            # fast path: room now and nobody ahead of us
            tok = ctl.allocate(partition, n, fields, nbytes=nbytes, version=version,
                               dtypes=dtypes, admitted=True)
            if not self._done_now():
                await self._admitted(tok)
            return tok
        ctl.check_dtypes(dtypes)  # a put that can never be admitted does not wait
        ctl.check_open(partition)
        deadline = None if timeout is None else ctl.clock() + timeout
        if ctl.admission(n, nbytes, version) == "ahead":
            assert version is not None and ctl.max_lead is not None  # (what "ahead" means)
            # version pacing: wait until this producer is no longer too far ahead
            await self._until_version(
                version - ctl.max_lead, deadline, partition,
                f"put waited {timeout}s for the trainer to reach version "
                f"{version - ctl.max_lead}; call set_version as training advances, or raise "
                "max_lead")
        got = await self._in_turn(partition, n, nbytes, deadline, timeout, lambda me: (
            ctl.allocate(partition, n, fields, nbytes=nbytes, version=version, dtypes=dtypes)))
        return await self._admitted(got)

    async def _in_turn(self, partition: str, n: int, nbytes: int, deadline: float | None,
                       timeout: float | None, admit: Callable[[_Turn], T]) -> T:
        """Wait for room for ``n`` new rows of ``nbytes`` in ``partition``, first come,
        first served with every producer waiting (up to ``deadline``), then return
        ``admit(me)``, called at once while this caller is first in line (``me``: its
        place there). Raises :class:`~streamrl.errors.StreamTimeout`, and what
        :meth:`Controller.check_open` raises once the partition (or the queue) is sealed
        or closed meanwhile: such a put would never fit. Timed out, cancelled or failed before
        ``admit`` ran, the outboxes are drained, and the next in line is woken either
        way."""
        ctl = self.ctl
        me = _Turn(partition)
        self._space_q[me] = anyio.Event()
        done = False
        try:
            while True:
                ctl.check_open(partition)
                if next(iter(self._space_q)) is me and ctl.admission(n, nbytes, None) is None:
                    out = admit(me)
                    done = True
                    return out
                ev = self._space_q[me] = anyio.Event()
                if not await self._wait(ev, deadline) and _past(ctl, deadline):
                    raise StreamTimeout(
                        f"put of {n} row{'s' * (n != 1)} waited {timeout}s for room "
                        f"({len(ctl.rows)}/{ctl.capacity} rows held); consumers are not "
                        "keeping up: consume or drop rows, raise capacity, or pass a longer "
                        "timeout")
        finally:
            self._space_q.pop(me, None)
            if self._space_q:
                next(iter(self._space_q.values())).set()
            if not done:
                await self._after()

    async def _admitted(self, tok: WriteToken) -> WriteToken:
        """Drain the outboxes after admitting ``tok`` (storage deletes of rows it dropped
        as stale, wake-ups); if that is cancelled or fails, the admission is aborted
        before the error goes on: the caller never got the token, so nothing else would
        end the write, and its rows and reserved bytes would be held until
        ``lease_timeout``."""
        try:
            await self._after()
        except BaseException:
            await shielded(self.abort(tok))
            raise
        return tok

    async def wait_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until the current policy version is at least ``version``; returns it."""
        deadline = None if timeout is None else self.ctl.clock() + timeout
        await self._until_version(version, deadline, None,
                                  f"waited {timeout}s for policy version {version}; the trainer "
                                  "calls set_version as it advances")
        return self.ctl.version

    async def _until_version(self, version: int, deadline: float | None,
                             partition: str | None, timeout_msg: str) -> None:
        """Wait (woken by set_version and close) until the version reaches ``version``;
        a put's wait (its new rows go to ``partition``) also ends, raising what
        :meth:`Controller.check_open` raises, once that partition or the queue is sealed."""
        ctl = self.ctl
        while ctl.version < version:
            if ctl.closed:
                raise QueueClosed(f"the queue closed while waiting for version {version}")
            if partition is not None:
                ctl.check_open(partition)
            ev = anyio.Event()
            self._pace_waiters[ev] = partition
            try:
                if not await self._wait(ev, deadline) and _past(ctl, deadline):
                    raise StreamTimeout(f"{timeout_msg} (version now {ctl.version})")
            finally:
                self._pace_waiters.pop(ev, None)

    async def put_rows(self, partition: str, fields: Sequence[str], ids: Sequence[int],
                       shard: int, nbytes: Mapping[str, Sequence[int]],
                       tags: Mapping[str, Sequence[Hashable]] | None = None,
                       version: int | None = None, dtypes: dict[str, str] | None = None
                       ) -> PutAnswer:
        """Admit and commit, in one step, new rows that storage unit ``shard`` already
        stored under ``ids`` (leased by :meth:`unit_ids`): the unit's fast path for small
        puts, with no wait. Answers :attr:`~PutStatus.OK` with the commit result;
        :attr:`~PutStatus.BUSY` when the rows would have to wait for room or pacing (or
        other producers wait): the unit deletes them and the producer puts the usual
        way (or with :meth:`put_rows_wait`); :attr:`~PutStatus.REFUSED` with the error
        when they can never be admitted now (closed, sealed, another dtype): the unit
        deletes them and the producer raises it. A commit error (a filter failed) is
        raised as from :meth:`commit`."""
        ctl = self.ctl
        total = sum(sum(v) for v in nbytes.values())
        try:
            if self._space_q or ctl.admission(len(ids), total, version) is not None:
                return PutAnswer(PutStatus.BUSY)
            got = self._admit_rows(partition, fields, ids, shard, nbytes, tags, version,
                                   dtypes, total, True)
        except StreamRLError as e:
            return PutAnswer(PutStatus.REFUSED, error=e)
        return await self._land_rows(ids, got, nbytes, tags)

    async def put_rows_many(self, puts: Sequence[Sequence[Any]]) -> list[PutAnswer]:
        """:meth:`put_rows` of several puts, each ``puts[i]`` its positional arguments
        (or, for a small write, ``None`` then :meth:`write_rows`'s positional
        arguments), made one after the other as separate calls would be, in one message:
        a storage unit combines the small puts and writes that arrive while its last call
        to the controller is on its way (see
        :class:`streamrl.transport.ray.admit.UnitAdmission`). One answer each, in order;
        one whose commit raised (a filter failed) answers :attr:`~PutStatus.FAILED`
        with the error instead of raising, so the others' answers are not lost."""
        out = []
        for args in puts:
            try:
                out.append(await (self.write_rows(*args[1:]) if args[0] is None
                                  else self.put_rows(*args)))
            except Exception as e:  # noqa: BLE001 - its own answer (see the docstring)
                out.append(PutAnswer(PutStatus.FAILED, error=e))
        return out

    async def put_rows_wait(self, partition: str, fields: Sequence[str], ids: Sequence[int],
                            shard: int, nbytes: Mapping[str, Sequence[int]],
                            tags: Mapping[str, Sequence[Hashable]] | None = None,
                            version: int | None = None, dtypes: dict[str, str] | None = None
                            ) -> PutAnswer:
        """:meth:`put_rows` for a put that may wait for room as long as it takes: where
        :meth:`put_rows` answers ``BUSY``, this one waits its turn (first come, first
        served with every put waiting for room, and for version pacing, as
        :meth:`allocate` waits), then admits and commits the rows in one step. A full
        queue's small put then costs the controller one call instead of two (room, then
        the commit) and its producer one call instead of three. Meanwhile the storage
        unit holds the rows' bytes, outside the queue's capacity: at most what its
        producers have waiting (see :mod:`streamrl.transport.ray.coalesce`).

        Answers as :meth:`put_rows`, with :attr:`PutAnswer.waited` set when it waited;
        ``BUSY`` only when the ids are no longer the unit's to use (it leased two blocks
        more meanwhile): the unit deletes the rows and the producer puts the usual way.
        Cancelled while it waits, nothing is kept; cancelled once admitted, the rows are
        taken back (dropped as ``"cancelled"``) before the cancellation goes on."""
        ctl = self.ctl
        n = len(ids)
        total = sum(sum(v) for v in nbytes.values())
        try:
            why = ctl.admission(n, total, version)
            if not self._space_q and why is None:
                got = self._admit_rows(partition, fields, ids, shard, nbytes, tags, version,
                                       dtypes, total, True)
                return await self._land_rows(ids, got, nbytes, tags)
            ctl.check_dtypes(dtypes)  # (a put that can never be admitted does not wait)
            ctl.check_open(partition)
            self._waiting_rows.update(ids)
            try:
                if why == "ahead":
                    assert version is not None and ctl.max_lead is not None  # ("ahead")
                    await self._until_version(
                        version - ctl.max_lead, None, partition,
                        f"waited for the trainer to reach version {version - ctl.max_lead}")
                got = await self._in_turn(partition, n, total, None, None, lambda me: (
                    self._admit_rows(partition, fields, ids, shard, nbytes, tags, version,
                                     dtypes, total, False)))
            finally:
                self._waiting_rows.difference_update(ids)
        except StreamRLError as e:
            return PutAnswer(PutStatus.REFUSED, error=e)
        ans = await self._land_rows(ids, got, nbytes, tags)
        ans.waited = ans.status is PutStatus.OK
        return ans

    def _admit_rows(self, partition: str, fields: Sequence[str], ids: Sequence[int],
                    shard: int, nbytes: Mapping[str, Sequence[int]],
                    tags: Mapping[str, Sequence[Hashable]] | None, version: int | None,
                    dtypes: dict[str, str] | None, total: int, admitted: bool
                    ) -> PutAnswer | CommitResult | WriteToken:
        """Admit the rows of a unit-admitted put (``admitted``: :meth:`Controller.admission`
        just said they fit): rows of one shape, with no filter (whose errors the
        commit of a write token raises to the producer) and the values of their tag
        fields given, are committed at once (a :class:`CommitResult`), others get a
        write token to commit; ``BUSY`` when ``ids`` are not the unit's to use. Raises
        what admission raises."""
        ctl = self.ctl
        if not ctl.owns_ids(shard, ids):
            return PutAnswer(PutStatus.BUSY)
        # rows of one shape, no filter, their group keys given: admitted and committed
        # at once, without a write token (the common small put)
        res = None if ctl.filters or nbytes.keys() != set(fields) else ctl.admit_stored(
            partition, ids, shard, nbytes, version=version, dtypes=dtypes,
            admitted=admitted, at_once_only=True, tags=tags)
        if res is not None:
            return res
        return ctl.allocate(partition, len(ids), fields, nbytes=total, version=version,
                            ids=ids, shard=shard, dtypes=dtypes, admitted=admitted)

    async def _land_rows(self, ids: Sequence[int], got: PutAnswer | CommitResult | WriteToken,
                         nbytes: Mapping[str, Sequence[int]],
                         tags: Mapping[str, Sequence[Hashable]] | None) -> PutAnswer:
        """The answer to a unit-admitted put that :meth:`_admit_rows` answered ``got``:
        a token's write committed, waiters woken. Cancelled meanwhile, the rows are
        taken back before the cancellation goes on."""
        if isinstance(got, PutAnswer):
            return got
        if isinstance(got, WriteToken):  # (commit takes itself back if cancelled)
            return PutAnswer(PutStatus.OK, await self.commit(got, nbytes, tags),
                             rows=list(ids))
        try:  # (no filter: waking waiters and storage deletes of other calls are left)
            if not self._done_now():
                await self._after()
        except anyio.get_cancelled_exc_class():
            # as a commit cancelled after it landed: the rows are taken back
            await shielded(self.retract_rows(ids))
            raise
        return PutAnswer(PutStatus.OK, got, rows=list(ids))

    async def write_rows(self, rows: Sequence[int], fields: Sequence[str], shard: int,
                         write: int, nbytes: Mapping[str, Sequence[int]],
                         tags: Mapping[str, Sequence[Hashable]] | None = None,
                         dtypes: dict[str, str] | None = None) -> PutAnswer:
        """Admit and commit, in one step, a write of new ``fields`` (no overwrite) to
        existing ``rows``, all held by storage unit ``shard``, which already stored the
        data as write ``write`` (a negative id of its own, so the write's undo takes back
        only what it stored): a small write's one call from the unit, where the usual way
        makes two (:meth:`begin_write`, :meth:`commit`) besides the store. Answers
        :attr:`~PutStatus.OK` with the commit result; :attr:`~PutStatus.REFUSED` with
        the error :meth:`begin_write` raises (a row dropped, a field already written or
        being written, another dtype, the queue closed): the unit forgets the data and
        the writer raises it; :attr:`~PutStatus.BUSY` when a row is not the unit's (the
        writer writes the usual way). A commit error (a filter failed) is raised as from
        :meth:`commit`, which also takes the write back if cancelled."""
        ctl = self.ctl
        try:
            if ctl.closed:
                raise QueueClosed("the queue is closed; no fields can be written any more")
            rows_of = ctl.rows
            for r in rows:
                row = rows_of.get(r)
                if row is not None and row.shard != shard:
                    return PutAnswer(PutStatus.BUSY)
            tok = ctl.begin_write(rows, fields, dtypes=dtypes, write=write)
        except StreamRLError as e:
            return PutAnswer(PutStatus.REFUSED, error=e)
        return PutAnswer(PutStatus.OK, await self.commit(tok, nbytes, tags), rows=list(rows))

    async def unit_ids(self, shard: int, n: int) -> tuple[int, int]:
        """Lease ``n`` fresh row ids ``[start, end)`` to storage unit ``shard`` for the
        puts it admits itself (:meth:`put_rows`)."""
        return self.ctl.unit_ids(shard, n)

    async def report_lost(self, shard: int) -> None:
        """Storage unit ``shard`` is gone: its rows are dropped as ``"lost"``."""
        n = self.ctl.mark_lost(shard)
        if n:
            log.error("streamrl: storage unit %d died; %d rows lost", shard, n)
        await self._after()

    async def report_lost_rows(self, rows: Sequence[int], holder: str) -> int:
        """A reader found ``holder``, the process that held tensor fields of ``rows``
        (the RDT transport), gone: those rows are dropped as ``"lost"`` (an ack of a
        lease on them no longer counts them; idempotent). Returns the rows dropped now."""
        n = self.ctl.drop(rows, DropReason.LOST)
        if n:
            log.error("streamrl: the holder %s of tensor fields died; %d rows lost", holder, n)
        await self._after()
        return n

    async def begin_write(self, rows: Sequence[int], fields: Sequence[str], *,
                          overwrite: bool = False, dtypes: dict[str, str] | None = None
                          ) -> WriteToken:
        """Admit a write of new fields to existing rows (see :meth:`Controller.begin_write`)."""
        return self.begin_write_now(rows, fields, overwrite=overwrite, dtypes=dtypes)

    def begin_write_now(self, rows: Sequence[int], fields: Sequence[str], *,
                        overwrite: bool = False, dtypes: dict[str, str] | None = None
                        ) -> WriteToken:
        """:meth:`begin_write` without a coroutine (a caller in this process: the
        embedded transport's writes, which then store and :meth:`commit_now`)."""
        if self.ctl.closed:
            raise QueueClosed("the queue is closed; no fields can be written any more")
        return self.ctl.begin_write(rows, fields, overwrite=overwrite, dtypes=dtypes)

    async def commit(self, token: WriteToken, nbytes: Mapping[str, Sequence[int]],
                     tags: Mapping[str, Sequence[Hashable]] | None = None) -> CommitResult:
        """Mark a write's fields ready; run the filters it completes (a filter failure is
        raised here as :class:`~streamrl.errors.FilterError` after its rows were dropped).
        Rows dropped while the write was in flight are deleted from storage here.

        Cancelled after the commit (while filters run): the write is taken back
        (:meth:`retract`) before the cancellation goes on, so a writer that was cancelled
        finds nothing of its write and can retry. So is a write whose value of a tag
        field (a group key) is not one scalar a row, found when it is read back from
        storage (a writer that did not know the field is a tag sends no value): it
        raises :class:`~streamrl.errors.SchemaError` and leaves nothing."""
        res, more = self.commit_now(token, nbytes, tags)
        if more:
            await self.committed(token, res)
        return res

    def commit_now(self, token: WriteToken, nbytes: Mapping[str, Sequence[int]],
                   tags: Mapping[str, Sequence[Hashable]] | None = None
                   ) -> tuple[CommitResult, bool]:
        """The part of :meth:`commit` that needs no await (a caller in this process):
        the fields marked ready, and the waiters woken when that is all there is to do
        (see :meth:`_done_now`). Returns the result and whether more is to be done: then
        the caller awaits :meth:`committed`, which does the rest as :meth:`commit` does."""
        res = self.ctl.commit(token, nbytes, tags)
        return res, bool(res.dead or res.missing_tags or not self._done_now())

    async def committed(self, token: WriteToken, res: CommitResult) -> None:
        """What :meth:`commit` does once the controller committed ``token`` (``res``):
        storage deletes of rows dropped meanwhile, tag values read back, filters run (a
        filter's failure raised); cancelled meanwhile, or a tag value not one scalar, the
        write is taken back before the error goes on."""
        try:
            if res.dead:
                await shielded(self._delete(res.dead))
            for f, rows in res.missing_tags.items():
                await self._backfill_tags(f, _by_shard(self.ctl, rows))
            if not self._done_now():
                await self._after(raise_filter_errors=True)
        except (anyio.get_cancelled_exc_class(), SchemaError):
            await shielded(self.retract(token))
            raise

    async def abort(self, token: WriteToken | int) -> None:
        """Forget a failed write and delete whatever it stored (only what it stored: a
        retry's data is never touched, see :class:`~streamrl.controller.Undo`)."""
        await self._forget(self.ctl.abort(token))
        await self._after()

    async def retract(self, token: WriteToken) -> None:
        """Take back a committed write whose writer was cancelled before it heard of the
        commit (see :meth:`Controller.retract`)."""
        await self._forget(self.ctl.retract(token))
        await self._after()

    async def retract_rows(self, rows: Sequence[int]) -> int:
        """Drop new rows whose put was cancelled after it landed (``"cancelled"``)."""
        n = self.ctl.drop(rows, DropReason.CANCELLED)
        await self._after()
        return n

    async def _forget(self, undo) -> None:
        """Have the storage units forget what an aborted or retracted write stored (runs
        to the end even if the caller is cancelled meanwhile)."""
        if undo is not None:
            await shielded(self._forget_now(undo))

    async def _forget_now(self, undo) -> None:
        if self._hold is not None and self._hold.keeps(undo):
            return  # fields of rows of a checkpoint's cut: forgotten once written
        try:
            await self._forget_parts(undo)
        except Exception:  # a dead unit: gone anyway
            log.exception("streamrl: deleting fields from storage failed")

    async def _forget_parts(self, undo) -> None:
        told: set[int] = set()
        for fields, parts in undo.parts:
            await self.data.delete_fields(parts, fields, write=undo.write)
            told.update(parts)
        rest: dict[int, list[int]] = {s: [] for s in undo.shards if s not in told and s not in self.ctl.dead_shards}
        if rest:  # no entries to forget there, but late data of the write is dropped
            await self.data.delete_fields(rest, (), write=undo.write)

    # ------------------------------------------------------------------ tags

    async def _backfill_tags(self, field: str, parts: dict[int, list[int]]) -> None:
        """Read ``field`` of rows that were written before it became a tag. Rows dropped
        meanwhile are skipped (the rest is read again); on any failure, the rows still
        to read are reported unread (see :meth:`Controller.tags_unread`)."""
        from .columns import assemble, tag_values
        try:
            while parts:
                req = [(s, rows, [field]) for s, rows in parts.items()]
                try:
                    got = await self.data.get(req)
                except RowsDropped as e:  # rows left meanwhile: read the rest again
                    gone = set(e.rows or ())
                    left = {s: [r for r in rows if r not in gone] for s, rows in parts.items()}
                    left = {s: rows for s, rows in left.items() if rows}
                    if sum(map(len, left.values())) == sum(map(len, parts.values())):
                        raise  # (no row named: reading again would fail again)
                    self.ctl.tags_unread(field, [r for rows in parts.values() for r in rows
                                                 if r in gone])  # (they left)
                    parts = left
                    continue
                for (s, rows, _), cols in zip(req, got):
                    self.ctl.set_tags(field, rows, tag_values(field, assemble(cols[field])))
                return
        except BaseException:  # (cancelled, a unit died, a value that is no scalar)
            # their groups are not held back for values that will not come
            self.ctl.tags_unread(field, [r for rows in parts.values() for r in rows])
            raise

    def tags_pending(self, fields: Sequence[str | None], partition: str | None = None
                     ) -> list[str]:
        """Tag fields (group keys, balance keys, samplers' fields) of rows of
        ``partition`` (``None``: every partition) whose values are not all known yet."""
        out = []
        for f in fields:
            if not f:
                continue
            ev = self._tags_ready.get((f, partition)) or self._tags_ready.get((f, None))
            if ev is None or not ev.is_set():
                out.append(f)
        return out

    async def ensure_tags(self, fields: Sequence[str], partition: str | None = None) -> None:
        """Make sure the value of each tag field is known for every row of ``partition``
        (``None``: of every partition), reading the values of rows written before the
        field became a tag. A group key of one partition says nothing of a field of the
        same name in another: only rows in scope are read (a value that is no scalar
        raises :class:`~streamrl.errors.SchemaError` here, to the consumer that asked).
        Concurrent callers wait for the first one's backfill."""
        if partition is not None and partition in self.ctl.retired:
            return
        for key in [k for k in self._tags_ready if k[1] is not None and k[1] in self.ctl.retired]:
            del self._tags_ready[key]  # finished partitions keep no state
        for f in fields:
            while True:
                mine = self._tags_ready.get((f, partition))
                every = self._tags_ready.get((f, None)) if partition is not None else None
                if (mine is not None and mine.is_set()) or (every is not None and every.is_set()):
                    break
                other = mine if mine is not None else every
                if other is not None:  # another caller backfills
                    await other.wait()
                    continue  # (it may have failed: look again)
                ev = self._tags_ready[(f, partition)] = anyio.Event()
                try:
                    await self._backfill_tags(f, self.ctl.register_tag(f, partition))
                except BaseException:
                    del self._tags_ready[(f, partition)]
                    ev.set()
                    raise
                ev.set()
                break
        await self._after()

    # ------------------------------------------------------------------ reads

    async def take(self, req: Request, timeout: float | None = None) -> Delivery | None:
        """Lease the next batch for ``req``, waiting up to ``timeout`` seconds.

        Returns ``None`` at end of stream. Raises :class:`StreamTimeout` when the wait
        passes ``timeout``.
        """
        ctl = self.ctl
        ctl.validate_request(req)
        need = self.tags_pending(ctl.request_tags(req), req.partition)  # group, balance,
        if need:  # sampler fields
            await self.ensure_tags(need, req.partition)
        start = ctl.clock()
        deadline = None if timeout is None else start + timeout
        key = req.sub_key()
        while True:
            if self._deferred:
                self._apply_deferred()
            res = ctl.take(req)
            if res is END:
                await self._after()
                return None
            if res is not None:
                waited = ctl.clock() - start
                self._waits.append(waited)
                hist = self._wait_hist.get(req.task)
                if hist is None:
                    hist = self._wait_hist[req.task] = Histogram()
                hist.observe(waited)
                if req.partition is not None:  # (per partition: takes that name one)
                    part = ctl.parts.get(req.partition)
                    if part is not None:
                        part.counts.hist(part.counts.wait, req.task).observe(waited)
                try:
                    await self._after()  # (it may run filter jobs: a real wait)
                except BaseException:
                    # the caller never gets this batch: give its lease back now
                    ctl.release([res.lease])
                    self._settle()
                    raise
                return res
            ev = anyio.Event()
            # woken by new deliverable rows only once a batch of this size can be met
            # (grouped and DP requests: by every one; see Controller.wake_at)
            self._waiting(key, ev, req.batch_size if req.dp_size == 1 else 1)
            self._part_waiters.setdefault(req.partition, set()).add(ev)
            try:
                await self._after()
                if not ev.is_set():
                    got = await self._wait(ev, deadline)
                    if not got and _past(ctl, deadline):
                        raise StreamTimeout(self._timeout_message(req, timeout))
            finally:
                self._waiting(key, ev, None)
                _discard(self._part_waiters, req.partition, ev)

    def _waiting(self, key: tuple, ev: anyio.Event, size: int | None) -> None:
        """``ev`` waits for a batch of ``size`` rows of subscription ``key`` (``None``:
        it waits no more). The controller wakes the subscription when rows become
        deliverable only once the smallest batch any of its waiters wants can be met."""
        waiters = self._sub_waiters.get(key)
        if size is not None:
            if waiters is None:
                waiters = self._sub_waiters[key] = {}
            waiters[ev] = size
        elif waiters is not None:
            waiters.pop(ev, None)
            if not waiters:
                del self._sub_waiters[key]
                waiters = None
        self.ctl.wake_at(key, min(waiters.values()) if waiters else 1)

    def _timeout_message(self, req: Request, timeout: float | None) -> str:
        """Why a take found no batch: what the rows in its scope lack, and what to do."""
        ctl = self.ctl
        where = f"partition {req.partition!r}" if req.partition else "the queue"
        if req.partition is None:
            scope = list(ctl.rows.values())
            sealed = ctl.sealed_all
        else:
            p = ctl.parts.get(req.partition)
            scope = list(p.rows.values()) if p is not None else []
            sealed = p is not None and p.sealed
        tbit = ctl.task_bit(req.task)
        owed = [r for r in scope if not r.acked & tbit]
        leased = judging = ready = 0
        lacking: dict[str, int] = {}
        for r in owed:
            missing = [f for f in req.fields if f not in r.fields]
            for f in missing:
                lacking[f] = lacking.get(f, 0) + 1
            if req.task in r.leased:
                leased += 1
            elif missing:
                pass
            elif r.pending or r.judging:
                judging += 1
            else:
                ready += 1
        parts = [f"task {req.task!r} waited {timeout}s for {req.batch_size} rows of {where} "
                 f"ready in {list(req.fields)}: of {len(owed)} rows it has not consumed, "
                 f"{ready} are ready, {leased} are leased to it"]
        if lacking:
            parts.append("rows lacking " + ", ".join(f"{f!r}: {n}" for f, n in lacking.items()))
        if judging:
            parts.append(f"{judging} wait for a filter")
        if req.group_by:
            parts.append(f"grouped by {req.group_by!r}"
                         + (f" in groups of {req.group_size}" if req.group_size else ""))
        hint = ("the partition is sealed, so the rows that are missing fields wait for "
                "producers that are slow or never write them"
                if sealed else
                "the partition is not sealed: more rows may come; seal it so a short last "
                "batch can go out")
        if not owed:
            hint = ("no rows have been put there yet" if not sealed
                    else "every row was delivered")
        return "; ".join(parts) + f". {hint[0].upper()}{hint[1:]}. Pass a longer timeout."

    async def ack(self, lease_ids: Sequence[int]) -> None:
        """Acknowledge leases (see :meth:`Controller.ack`). Answers without waiting for
        the storage deletes of the rows it lets go (:meth:`_delete_behind`): room they
        free goes to producers waiting for it once they are done, and :meth:`stats`
        with the units, :meth:`audit` and :meth:`close` wait for them."""
        try:
            self.ctl.ack(lease_ids)
        finally:
            self._delete_behind()
            await self._after()

    async def ack_take(self, lease_ids: Sequence[int], req: Request,
                       timeout: float | None = None) -> tuple[Delivery | None, str | None]:
        """:meth:`ack` then :meth:`take`, as one call: a stream asking for its next
        batch acknowledges the one before with it (on a distributed transport, one
        message to the controller instead of two). The ack runs to the end first, even
        when this call is cancelled meanwhile, and stands whatever the take does; a
        :class:`~streamrl.errors.LeaseExpired` it raises comes back as its message
        (second of the pair) and the take goes on. Returns ``(delivery or None at end
        of stream, that message or None)``; raises what :meth:`take` raises. Cancelled
        while it waits for rows, it takes no lease (as :meth:`take`)."""
        expired = None
        try:
            self.ctl.ack(lease_ids)
        except LeaseExpired as e:
            expired = str(e)
        except BaseException:
            await shielded(self._after())
            raise
        # the next batch does not wait for the units to delete the rows acknowledged
        # (a consumer keeping up with a full queue waited a round trip to them a batch)
        self._delete_behind()
        await shielded(self._after())
        return await self.take(req, timeout), expired

    async def release(self, lease_ids: Sequence[int]) -> None:
        """Give leases back unacknowledged: their rows are delivered again."""
        self.ctl.release(lease_ids)
        await self._after()

    async def lease_rows(self, lease_ids: Sequence[int]) -> list[int]:
        """Rows still held under these leases."""
        out: list[int] = []
        for lid in lease_ids:
            out.extend(self.ctl.lease_rows(lid) or ())
        return out

    # ------------------------------------------------------------------ lifecycle

    async def drop(self, rows: Sequence[int]) -> int:
        """Drop rows for good; returns how many were held."""
        n = self.ctl.drop(rows)
        await self._after()
        return n

    async def clear(self, partition: str) -> int:
        """Drop every row of a partition; returns how many."""
        n = self.ctl.clear(partition)
        await self._after()
        return n

    async def seal(self, partition: str | None) -> None:
        """Seal a partition (or, with ``None``, the whole queue)."""
        if partition is None:
            self.ctl.seal_all()
        else:
            self.ctl.seal(partition)
        await self._after()

    async def declare(self, partition: str, consumers: Sequence[str] | None) -> None:
        """Set the consumers whose acknowledgement drops a row of the partition."""
        self.ctl.declare(partition, consumers)
        await self._after()

    async def set_version(self, version: int) -> int:
        """Advance the policy version; returns rows dropped as stale."""
        n = self.ctl.set_version(version)
        await self._after()
        return n

    async def close(self) -> dict[str, int]:
        """Close; returns rows still held per partition (logged when not empty)."""
        self.ctl.close()
        await self._after()
        await self._deletes_done()
        held = self.ctl.held_by_partition()
        if held:
            log.info("streamrl: queue closed with rows held: %s", held)
        return held

    # ------------------------------------------------------------------ filters

    async def add_filter(self, fn: Callable, spec: FilterSpec) -> None:
        """Register a filter function and judge the rows it applies to."""
        if not callable(fn):
            raise InvalidArgument(f"a filter must be callable, got {type(fn).__name__}")
        if spec.group_by:
            await self.ensure_tags([spec.group_by])
        self._filters[spec.name] = fn
        self.ctl.add_filter(spec)
        await self._after()

    async def _read_for_filters(self, jobs: list[FilterJob]) -> _FilterRead:
        """The fields of the rows of filter ``jobs``, read with one storage call per unit
        and set of fields (a call per job costs a Ray controller a round trip to a unit
        each: with groups of 8, most of what a filter costs it). Jobs whose rows are all
        gone, or a lone job, read nothing here (:meth:`_run_filter` reads for itself).
        Rows dropped from storage meanwhile, or lost with a unit: nothing is read here
        either (each job reads its own rows and judges the rest later, as alone; a put
        whose commit made the jobs is never failed by rows of others lost here)."""
        from .columns import assemble

        read: _FilterRead = {}
        if len(jobs) < 2:
            return read
        want: dict[tuple[int, tuple[str, ...]], dict[int, None]] = {}
        alone = 0  # the calls the jobs would make one by one
        rows_of = self.ctl.rows
        for job in jobs:
            if not self.ctl.job_live(job.id):
                continue
            units = set()
            for r in job.rows:
                row = rows_of.get(r)
                if row is not None:
                    want.setdefault((row.shard, job.fields), {})[r] = None
                    units.add(row.shard)
            alone += len(units)
        if len(want) >= alone:  # (no two jobs share a unit: nothing to save)
            return read
        keys = list(want)
        try:
            got = await self.data.get([(s, list(want[(s, fs)]), list(fs)) for s, fs in keys])
        except (RowsDropped, RowsLost):  # (each job reads alone, and sees what it lost)
            return {}
        for (s, fs), g in zip(keys, got):
            read[(s, fs)] = ({r: i for i, r in enumerate(want[(s, fs)])},
                             {f: assemble(g[f]) for f in fs})
        return read

    def _judge_together(self, jobs: list[FilterJob], read: _FilterRead
                        ) -> dict[int, dict[int, bool]]:
        """Verdicts (job id -> row -> keep) of those filter ``jobs`` whose filter judges
        many groups in one call (:meth:`streamrl.filters.Filter.judge_many`): the jobs
        of one filter whose rows one storage unit holds and ``read`` has (see
        :meth:`_read_for_filters`), at least two of them, are judged together, one
        column per field and one call for them all (a job alone costs a TensorDict, a
        call and the plumbing around them: most of what a GRPO group's zero-variance
        filter costs). The others, and jobs whose filter declines
        (``judge_many`` returns ``None``) or fails, are left to :meth:`_run_filter`,
        one by one, which reports a failure as its own. Never awaits."""
        from .columns import take_rows, to_tensordict
        from .filters import Filter

        ctl = self.ctl
        rows_of = ctl.rows
        together: dict[tuple[str, int], list[tuple[FilterJob, list[int]]]] = {}
        declines = Filter.judge_many  # (the base class's: judged one by one)
        for job in jobs:
            fn = self._filters.get(job.filter)
            if getattr(type(fn), "judge_many", declines) is declines or not ctl.job_live(job.id):
                continue
            live = [r for r in job.rows if r in rows_of]
            if not live:
                continue
            shard = rows_of[live[0]].shard
            if (shard, job.fields) not in read or any(rows_of[r].shard != shard for r in live):
                continue
            together.setdefault((job.filter, shard), []).append((job, live))
        out: dict[int, dict[int, bool]] = {}
        for (name, shard), group in together.items():
            if len(group) < 2:
                continue
            fields = group[0][0].fields  # (a filter's jobs read its fields)
            pos, cols = read[(shard, fields)]
            try:
                idx = [pos[r] for _, live in group for r in live]
                first = idx[0]
                at: slice | list[int] = (slice(first, first + len(idx)) if idx == list(
                    range(first, first + len(idx))) else idx)
                td = to_tensordict({f: take_rows(cols[f], at) for f in fields}, len(idx))
                judge: Any = self._filters[name]  # (its own judge_many: checked above)
                verdicts = judge.judge_many(td, [len(live) for _, live in group])
                if verdicts is None:
                    continue
                if len(verdicts) != len(group):
                    raise InvalidArgument(f"judge_many gave {len(verdicts)} verdicts for "
                                          f"{len(group)} groups")
                mine = {job.id: dict(zip(live, _verdict(v, len(live), name)))
                        for (job, live), v in zip(group, verdicts)}
            except Exception as e:  # noqa: BLE001 - each job then runs (and fails) alone
                log.debug("streamrl: filter %r could not judge %d groups together (%s); "
                          "judging them one by one", name, len(group), e)
                continue
            out.update(mine)
        return out

    def _filter_failed(self, job: FilterJob, live: list[int], e: Exception) -> FilterError:
        """Filter job ``job`` failed with ``e`` on its rows ``live``: they are dropped
        (counted in ``stats().filter_errors``); returns the error to raise or log."""
        self.ctl.filter_done(job.id, None, error=True)
        msg = (f"filter {job.filter!r} failed on {len(live)} rows ({type(e).__name__}: {e}); "
               "those rows were dropped and counted in stats().filter_errors. Fix the filter")
        self._filter_failures.append(msg)
        err = FilterError(msg)
        err.__cause__ = e
        return err

    async def _run_filter(self, job: FilterJob, read: _FilterRead | None = None
                          ) -> FilterError | None:
        """Read the job's fields (or take them from ``read``, see
        :meth:`_read_for_filters`), call the filter, record the verdict. Returns the
        error (rows already dropped) when the filter failed."""
        from .columns import assemble, to_tensordict

        if not self.ctl.job_live(job.id):  # withdrawn (its write was taken back)
            return None
        fn = self._filters[job.filter]
        live = [r for r in job.rows if r in self.ctl.rows]
        if not live:
            self.ctl.filter_done(job.id, [], error=False)
            return None
        parts = _by_shard(self.ctl, live)
        try:
            if read and all((s, job.fields) in read for s in parts):
                got = [_rows_of_read(read[(s, job.fields)], rows, job.fields)
                       for s, rows in parts.items()]
            else:
                got = await self.data.get([(s, rows, list(job.fields))
                                           for s, rows in parts.items()])
            order = [r for rows in parts.values() for r in rows]
            cols = {f: assemble([p for g in got for p in g[f]]) for f in job.fields}
            td = to_tensordict(cols, len(order))
            verdict = fn(td)
            if inspect.isawaitable(verdict):
                verdict = await verdict
            keep = _verdict(verdict, len(order), job.filter)
        except (RowsDropped, RowsLost) as e:
            if not self.ctl.job_live(job.id):
                # withdrawn meanwhile: the write of a field it reads was taken back (its
                # writer was cancelled), which is why storage had it no more. The rows
                # are alive: they are judged once the field is written again
                return None
            # rows dropped while they were read, or lost with their unit: the job runs
            # again on the others (they are judged all the same, never let through
            # unjudged, nor dropped as if the filter had failed). Rows lost with their
            # unit or holder leave the controller as "lost" (if the data plane has not
            # told it already); rows a RowsDropped names are only ever dropped by the
            # controller, which storage follows, never the other way round
            if isinstance(e, RowsLost):
                gone = [r for r in set(e.rows).intersection(live) if r in self.ctl.rows]
                if gone:
                    self.ctl.drop(gone, DropReason.LOST)
            if any(r not in self.ctl.rows for r in live):  # (fewer each time: it ends)
                self.ctl.filter_retry(job.id)
                return None
            return self._filter_failed(job, live, e)
        except Exception as e:  # noqa: BLE001 - any failure of user code
            return self._filter_failed(job, live, e)
        verdict_by_row = dict(zip(order, keep))
        self.ctl.filter_done(job.id, [verdict_by_row.get(r, False) for r in job.rows])
        return None

    # ------------------------------------------------------------------ checkpoints

    async def checkpoint_begin(self, directory: str, timeout: float | None = None
                               ) -> CheckpointCut:
        """Take a checkpoint's cut: the controller's state at this instant, written to
        ``directory`` (in a worker thread, while the queue goes on), and what each
        storage unit must write. From now until :meth:`checkpoint_end` (or ``timeout``
        seconds), storage deletes of rows of the cut are held back, so that the units
        can still read them. Waits while another checkpoint is being written.

        Cancelled (or failing) after the cut: the hold ends before this raises."""
        from .checkpoint.cut import write_state
        from .checkpoint.refs import filter_ref

        while self._hold is not None:
            await self._hold_ended.wait()
        if self._deferred:
            self._apply_deferred()
        ctl = self.ctl
        t0 = time.perf_counter()
        cut = ctl.state_cut()
        hold = Hold(self._holds + 1, set(ctl.rows),
                    None if timeout is None else ctl.clock() + timeout)
        pause = time.perf_counter() - t0
        self._holds += 1
        self._hold, self._hold_ended = hold, anyio.Event()
        filters = {n: filter_ref(fn) for n, fn in self._filters.items()}
        try:
            # (waited for even when cancelled: the caller removes the directory after)
            entry, plans, rows, summary = await to_thread_whole(
                write_state, directory, cut, ctl.num_shards)
        except BaseException:
            await shielded(self._end_hold(hold))
            raise
        summary["config"] = {k: v for k, v in ctl.config.to_dict().items()
                             if k in CONTROLLER_OPTIONS}
        return CheckpointCut(hold.token, plans, rows, entry, filters, summary, pause)

    async def checkpoint_end(self, token: int) -> None:
        """The units wrote checkpoint ``token``'s rows: the storage deletes held since
        its cut are done now (nothing when the hold already ended)."""
        if self._hold is not None and self._hold.token == token:
            await shielded(self._end_hold(self._hold))

    async def _end_hold(self, hold: Hold) -> None:
        if self._hold is not hold:
            return
        self._hold = None
        self._hold_ended.set()
        if hold.deletes:
            await self._delete(hold.deletes)
        for undo in hold.undos:
            await self._forget_now(undo)

    async def checkpoint_load(self, directory: str, state: dict[str, Any],
                              shards: dict[int, int] | None = None,
                              filters: dict[str, Callable] | None = None) -> dict[str, Any]:
        """Load the controller's state of the checkpoint in ``directory`` (its file
        checked against ``state``, its entry) into this new, empty queue, whose storage
        units hold the checkpoint's data already: rows of unit ``s`` are placed on unit
        ``shards[s]`` (``None``: the same), ``filters`` are the functions of its filters.
        Leases come back released, writes in flight aborted, filter jobs judged again
        (see :meth:`Controller.load_state_dict`). Returns ``rows`` (held now) and
        ``tag_fields``.

        Raises:
            CheckpointError: the queue is not new, the state file is missing, torn or
                corrupt, or a filter of the checkpoint is not in ``filters``.
        """
        from .checkpoint.cut import read_state, remap_shards

        ctl = self.ctl
        if ctl.rows or ctl.parts or ctl.c_put:
            raise CheckpointError("a checkpoint is loaded into a new queue only (this one "
                                  "has had rows); use StreamQueue.restore")
        st = await anyio.to_thread.run_sync(read_state, directory, state)
        remap_shards(st, shards)
        filters = dict(filters or {})
        lacking = sorted(f["name"] for f in st.get("filters", ()) if f["name"] not in filters)
        if lacking:
            raise CheckpointError(f"the checkpoint's filters {lacking} were not given; pass "
                                  "them to StreamQueue.restore(..., filters={name: fn})")
        self._filters.update(filters)
        ctl.load_state_dict(st)
        await self._after()
        return {"rows": len(ctl.rows), "tag_fields": sorted(ctl.tag_fields)}

    # ------------------------------------------------------------------ stats

    async def stats(self, with_units: bool = True) -> Stats:
        """A :class:`~streamrl.stats.Stats` snapshot (``with_units``: ask the storage units too)."""
        ctl = self.ctl
        ctl.expire()
        await self._after()
        if with_units:
            await self._deletes_done()
        tasks = {}
        states = ctl.task_states()
        for t in set(ctl.c_delivered) | set(ctl.c_acked) | {s.task for s in ctl.subs.values()}:
            hd, hw = ctl.delivery_histogram(t), self._wait_hist.get(t)
            st = states.get(t, {})
            tasks[t] = TaskStats(
                delivered=ctl.c_delivered.get(t, 0), acked=ctl.c_acked.get(t, 0),
                redelivered=ctl.c_redelivered.get(t, 0), expired=ctl.c_expired.get(t, 0),
                leased=sum(len(le.rows) for le in ctl.leases.values() if le.task == t),
                bytes=ctl.c_bytes_delivered.get(t, 0), bytes_acked=ctl.c_bytes_acked.get(t, 0),
                bytes_redelivered=ctl.c_bytes_redelivered.get(t, 0), ready=st.get("ready", 0),
                waiting=st.get("waiting", 0),
                delivery_p50=hd.quantile(0.5) if hd else None,
                delivery_p99=hd.quantile(0.99) if hd else None,
                wait_p50=hw.quantile(0.5) if hw else None,
                wait_p99=hw.quantile(0.99) if hw else None,
                delivery_latency=hd,
                wait=hw.merge(Histogram()) if hw else None)
        units = await self.data.unit_stats() if with_units else []
        usage = await self.data.unit_usage() if with_units else []
        waits = sorted(self._waits)
        return Stats(
            rows=len(ctl.rows), bytes=ctl.bytes_held + ctl.reserved_bytes,
            bytes_in_flight=ctl.reserved_bytes, capacity=ctl.capacity,
            capacity_bytes=ctl.capacity_bytes, version=ctl.version,
            put=ctl.c_put, bytes_put=ctl.c_bytes_put, bytes_freed=ctl.c_bytes_freed,
            dropped=sum(ctl.c_dropped.values()),
            dropped_by={str(k): v for k, v in ctl.c_dropped.items()},
            bytes_dropped_by={str(k): v for k, v in ctl.c_bytes_dropped.items()},
            filtered=sum(ctl.c_filtered_by.values()), filtered_by=dict(ctl.c_filtered_by),
            bytes_filtered_by=dict(ctl.c_bytes_filtered_by),
            filter_errors=sum(ctl.c_filter_errors.values()),
            filter_pending=ctl.pending_filter_rows(),
            stale=ctl.c_dropped.get("stale", 0), consumed=ctl.c_dropped.get("consumed", 0),
            delivered=sum(ctl.c_delivered.values()), tasks=tasks,
            partitions=ctl.partition_states(), leaked=sum(ctl.leaked().values()),
            leases=len(ctl.leases), waiting_puts=len(self._space_q) + len(self._pace_waiters),
            writes_expired=ctl.c_writes_expired,
            wait_p50=_pct(waits, 0.5), wait_p99=_pct(waits, 0.99),
            unit_rows=[u[0] for u in units], unit_bytes=[u[1] for u in units],
            unit_usage=list(usage),
            closed=ctl.closed, last_filter_errors=list(self._filter_failures),
            **partition_stats(ctl.parts.values()))

    async def leaked(self) -> dict[str, int]:
        """Leaked rows per sealed partition (see :meth:`Controller.leaked`)."""
        return self.ctl.leaked()

    async def audit(self) -> list[str]:
        """Where the controller and the storage units disagree (empty: they agree).

        Each committed field of each row must be held by the row's unit; a unit may hold
        more only for writes still in flight. Rows the units hold that the controller
        does not know are strays, unless they wait for room (:meth:`put_rows_wait`). Reads every
        unit's inventory: a check for tests and debugging, not for hot paths."""
        ctl = self.ctl
        await self._deletes_done()
        inv = await self.data.inventory()
        out: list[str] = []
        inflight, writing = ctl.rows_in_writes()
        for rid, row in ctl.rows.items():
            if row.shard in ctl.dead_shards:
                continue
            stored = inv[row.shard].get(rid)
            if stored is None:
                if rid not in inflight:
                    out.append(f"row {rid}: the controller holds it, unit {row.shard} does not")
                continue
            held = set(stored)
            lacking = sorted(set(row.fields) - held)
            if lacking:
                out.append(f"row {rid}: fields {lacking} are committed but unit {row.shard} "
                           "does not hold them")
            extra = sorted(held - set(row.fields))
            if extra and rid not in writing and rid not in inflight:
                out.append(f"row {rid}: unit {row.shard} holds fields {extra} that are not "
                           "committed")
        for shard, rows in enumerate(inv):
            if shard in ctl.dead_shards:
                continue
            stray = [r for r in rows if (r not in ctl.rows or ctl.rows[r].shard != shard)
                     and r not in self._waiting_rows]
            if stray:
                out.append(f"unit {shard} holds rows {stray[:8]} the controller does not know")
        return out


#: fields read for filter jobs (:meth:`ControllerService._read_for_filters`): per
#: (unit, fields), the position of each row read and the column of each field
_FilterRead = dict[tuple[int, tuple[str, ...]], tuple[dict[int, int], dict[str, Column]]]


def _rows_of_read(entry: tuple[dict[int, int], dict[str, Column]], rows: list[int],
                  fields: tuple[str, ...]) -> dict[str, list[Column]]:
    """``rows`` of one read of :meth:`ControllerService._read_for_filters`, as a storage
    read gives them (per field, a list of pieces): a view when they were read
    consecutively, else a copy."""
    from .columns import take_rows

    pos, cols = entry
    idx = [pos[r] for r in rows]
    first = idx[0]
    if idx[-1] - first == len(idx) - 1 and idx == list(range(first, first + len(idx))):
        at: slice | list[int] = slice(first, first + len(idx))
    else:
        at = idx
    return {f: [take_rows(cols[f], at)] for f in fields}


def _by_shard(ctl: Controller, rows: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in rows:
        row = ctl.rows.get(r)
        if row is not None:
            out.setdefault(row.shard, []).append(r)
    return out


def _verdict(v: Any, n: int, name: str) -> list[bool]:
    import torch

    if isinstance(v, (bool,)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
        return [bool(v)] * n
    if isinstance(v, torch.Tensor):
        v = v.reshape(-1).tolist()
    try:
        v = [bool(x) for x in v]
    except TypeError:
        raise InvalidArgument(
            f"filter {name!r} returned {type(v).__name__}; return a bool (keep or reject all "
            "rows) or a bool mask with one entry per row") from None
    if len(v) != n:
        raise InvalidArgument(
            f"filter {name!r} returned a mask of {len(v)} entries for {n} rows; return one "
            "bool per row (or a single bool)")
    return v


class _Turn:
    """A put's place in the line of puts waiting for room (compared by identity), and
    the partition its new rows go to."""

    __slots__ = ("partition",)

    def __init__(self, partition: str):
        self.partition = partition


def _past(ctl: Controller, deadline: float | None) -> bool:
    return deadline is not None and ctl.clock() >= deadline


def _discard(d: dict, key, ev) -> None:
    s = d.get(key)
    if s is not None:
        s.discard(ev)
        if not s:
            del d[key]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, math.floor(q * len(xs)))]
