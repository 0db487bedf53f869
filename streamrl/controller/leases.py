"""Leases: rows handed to a task and not yet acknowledged. Making, claiming (counting
deliveries and redeliveries), acknowledging, releasing and expiring them, and the
deadlines of leases and of admitted writes."""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..config import Request
from ..errors import LeaseExpired, rows_preview
from ..messages import Delivery, DropReason
from .base import ControllerBase
from .state import LEASE_MEMORY

if TYPE_CHECKING:
    from .index import _Sub


class _Lease:
    __slots__ = ("id", "task", "rows", "deadline", "timeout", "claimed", "dispatch", "rank",
                 "fields", "withdrawn")

    def __init__(self, lid: int, task: str, rows: list[int], deadline: float, timeout: float,
                 fields: frozenset[str] = frozenset()):
        self.id = lid
        self.task = task
        self.fields = fields  # the fields the batch was asked for
        self.withdrawn: list[int] = []  # rows taken back by a retracted write (see retract)
        self.rows = rows
        self.deadline = deadline
        self.timeout = timeout
        self.claimed = True
        self.dispatch: tuple | None = None
        self.rank = 0


class Leases(ControllerBase):
    """Leases and deadlines (part of :class:`Controller`)."""

    def _lease(self, sub: _Sub, req: Request, rids: list[int], *, claimed: bool = True,
               rank: int = 0, dispatch: int | None = None) -> Delivery:
        task = req.task
        timeout = req.lease_timeout or self.lease_timeout
        lid = self._next_lease
        self._next_lease = lid + 1
        lease = _Lease(lid, task, rids, self.clock() + timeout, timeout, frozenset(req.fields))
        lease.rank = rank
        self.leases[lid] = lease
        heapq.heappush(self._lease_heap, (lease.deadline, lid))
        for rid in rids:
            row = self.rows[rid]
            row.leased[task] = lid
            row.part.tasks.add(task)
            self._unindex(row, (task,))
        lease.claimed = False
        if claimed:
            self._claim(lease)
        return self._delivery(lid, req, sub, rids, rank, dispatch)

    def _claim(self, lease: _Lease) -> None:
        """The consumer has the batch now: count it (and redeliveries)."""
        lease.claimed = True
        task = lease.task
        bit = self._bit(self._tbits, task)
        redelivered = 0
        now = self.clock()
        nbytes = 0
        again = 0  # bytes of the rows redelivered
        fields = lease.fields
        part = None  # the partition of the last row, its counters and histogram of task
        for rid in lease.rows:
            row = self.rows[rid]
            if row.part is not part:
                part = row.part
                pc, ph = part.counts.task(task), part.counts.hist(part.counts.delivery, task)
            have = row.fields
            b = 0
            for f in fields:
                b += have.get(f, 0)
            nbytes += b
            pc[0] += 1
            pc[1] += b
            if row.delivered & bit:
                redelivered += 1
                again += b
                pc[2] += 1
                pc[3] += b
            else:
                ph.observe(now - row.born)  # (the task's: the sum of its partitions')
            row.delivered |= bit
        self.c_delivered[task] = self.c_delivered.get(task, 0) + len(lease.rows)
        self.c_bytes_delivered[task] = self.c_bytes_delivered.get(task, 0) + nbytes
        if redelivered:
            self.c_redelivered[task] = self.c_redelivered.get(task, 0) + redelivered
            self.c_bytes_redelivered[task] = self.c_bytes_redelivered.get(task, 0) + again

    def ack(self, lease_ids: Iterable[int]) -> None:
        """The consumer is done with these leases: their rows count as consumed by the
        task. Idempotent. Raises :class:`LeaseExpired` for a lease that expired or was
        released (its rows go, or went, to another consumer)."""
        self.expire()
        expired = []
        withdrawn: list[int] = []
        for lid in lease_ids:
            lease = self.leases.pop(lid, None)
            if lease is None:
                outcome = self._lease_outcome.get(lid)
                if outcome in ("expired", "released"):
                    expired.append(lid)
                elif isinstance(outcome, (list, tuple)):  # ["withdrawn", rows]: all of them
                    withdrawn.extend(outcome[1])
                elif outcome is None and lid <= self._outcome_floor:
                    expired.append(lid)  # too old to know: it may have been handed out again
                continue
            self._remember(lid, "acked")
            withdrawn.extend(lease.withdrawn)
            task = lease.task
            bit = self._bit(self._tbits, task)
            fields, nbytes = lease.fields, 0  # (bytes of the asked-for fields acked)
            done = []
            last = pc = None
            for rid in lease.rows:
                row = self.rows.get(rid)
                if row is None or row.leased.get(task) != lid:
                    continue
                del row.leased[task]
                b = 0
                for f in fields:
                    b += row.fields.get(f, 0)
                nbytes += b
                row.acked |= bit
                p = row.part
                if p is not last:  # (rows come in runs of one partition)
                    last, pc = p, p.counts.task(task)
                pc[4] += 1  # type: ignore[index]
                pc[5] += b  # type: ignore[index]
                p.acked[task] = p.acked.get(task, 0) + 1
                if p.cmask and row.acked & p.cmask == p.cmask and not row.leased:
                    done.append(row)
            self.c_acked[task] = self.c_acked.get(task, 0) + len(lease.rows)
            self.c_bytes_acked[task] = self.c_bytes_acked.get(task, 0) + nbytes
            self._drop_rows(done, DropReason.CONSUMED)
            self._lease_changed(lease)
        if expired:
            raise LeaseExpired(
                f"lease(s) {expired} expired or were released before ack; their rows were "
                "handed out again. Ack sooner, or raise lease_timeout on the queue or stream")
        if withdrawn:
            raise LeaseExpired(
                f"rows {rows_preview(withdrawn)} were taken back from this batch before its "
                "ack (a write of a field it asked for was undone: its writer was "
                "cancelled); the rest is acknowledged, and those rows are delivered again "
                "once the field is written again. Do not count work done on them",
                withdrawn)

    def release(self, lease_ids: Iterable[int], *, expired: bool = False) -> None:
        """Give the rows of these leases back: they are delivered again to the task."""
        for lid in lease_ids:
            lease = self.leases.pop(lid, None)
            if lease is None:
                continue
            self._remember(lid, "expired" if expired else "released")
            task = lease.task
            back = []
            for rid in lease.rows:
                row = self.rows.get(rid)
                if row is not None and row.leased.get(task) == lid:
                    del row.leased[task]
                    back.append(row)
            if expired:
                self.c_expired[task] = self.c_expired.get(task, 0) + len(back)
            self._reindex(back, (task,))
            self._lease_changed(lease)

    def _lease_changed(self, lease: _Lease) -> None:
        for p in {self.rows[r].part for r in lease.rows if r in self.rows}:
            if p.sealed or self.closed:  # remaining() moved: tails and ends may follow
                self.changed.add(p.name)
                self._wake_part(p.name)
        if lease.dispatch is not None:
            disp = self._dispatchers.get(lease.dispatch[0])
            if disp is not None and not lease.claimed:
                disp.shares.pop((lease.dispatch[1], lease.rank), None)

    def lease_rows(self, lease_id: int) -> list[int] | None:
        """Rows still held under a lease, or ``None`` once it ended."""
        lease = self.leases.get(lease_id)
        return None if lease is None else list(lease.rows)

    # ------------------------------------------------------------------ deadlines

    def next_deadline(self) -> float | None:
        """The earliest lease or write deadline (monotonic seconds), for the caller's timer."""
        while self._lease_heap:
            d, lid = self._lease_heap[0]
            lease = self.leases.get(lid)
            if lease is None or lease.deadline != d:
                heapq.heappop(self._lease_heap)
                continue
            break
        while self._token_heap and self._token_heap[0][1] not in self._tokens:
            heapq.heappop(self._token_heap)
        ends = [h[0][0] for h in (self._lease_heap, self._token_heap) if h]
        return min(ends) if ends else None

    def expire(self, now: float | None = None) -> int:
        """Release every lease past its deadline (returns how many), and abort every write
        admitted more than ``lease_timeout`` ago and not committed (its writer is
        presumed dead: new rows it admitted are dropped)."""
        now = self.clock() if now is None else now
        while self._token_heap and self._token_heap[0][0] <= now:
            _, tid = heapq.heappop(self._token_heap)
            if tid in self._tokens:
                undo = self.abort(tid)  # new rows: dropped (and deleted) here
                if undo is not None:
                    self.field_deletes.append(undo)
                self.c_writes_expired += 1
                self._expired_tokens[tid] = None
                if len(self._expired_tokens) > LEASE_MEMORY:
                    self._expired_tokens.popitem(last=False)
        n = 0
        while self._lease_heap and self._lease_heap[0][0] <= now:
            d, lid = heapq.heappop(self._lease_heap)
            lease = self.leases.get(lid)
            if lease is not None and lease.deadline == d:
                self.release([lid], expired=True)
                n += 1
        return n
