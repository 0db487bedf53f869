"""Leases: rows handed to a task and not yet acknowledged. Making, claiming (counting
deliveries and redeliveries), acknowledging, releasing and expiring them, and the
deadlines of leases and of admitted writes."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

from ..config import Request
from ..errors import LeaseExpired, rows_preview
from ..messages import Delivery, DropReason
from .base import ControllerBase
from .state import LEASE_MEMORY, Partition, Row

if TYPE_CHECKING:
    from .index import _Sub


class _Lease:
    __slots__ = ("id", "task", "rows", "deadline", "timeout", "claimed", "dispatch", "rank",
                 "fields", "withdrawn", "pads")

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
        # rows of other leases this DP share repeats as padding: kept from being dropped
        # as consumed until this lease ends (see Leases._unpin)
        self.pads: list[int] = []


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
        rows = self.rows
        last = None
        plain: list[dict[int, None]] = []  # the task's ungrouped subscriptions' rows
        grouped: list[list[Row]] = []  # per grouped subscription of the task, rows to remove
        taken: dict[_Sub, list[Row]] = {}
        objs = [rows[rid] for rid in rids]
        for row in objs:  # (_unindex of the task, inlined: the hot loop of a take)
            rid = row.id
            row.leased[task] = lid
            p = row.part
            if p is not last:  # (rows come in runs of one partition)
                last = p
                p.tasks.add(task)
                plain = []
                grouped = []
                for s in self._candidates(p.name):
                    if s.task == task:
                        if s.group_by is None:
                            plain.append(s.avail)
                        else:
                            grouped.append(taken.setdefault(s, []))
            for avail in plain:
                avail.pop(rid, None)
            for out in grouped:
                out.append(row)
        for s, out in taken.items():  # (whole groups, mostly: each group checked once)
            self._remove_many(s, out)
        lease.claimed = False
        nbytes = self._claim(lease, objs) if claimed else None
        return self._delivery(lid, req, sub, rids, rank, dispatch, nbytes, objs=objs)

    def _claim(self, lease: _Lease, objs: list[Row] | None = None) -> int:
        """The consumer has the batch now: count it (and redeliveries). Returns the bytes
        of the asked-for fields of its rows (``objs``: their records, if the caller has
        them)."""
        lease.claimed = True
        task = lease.task
        bit = self._bit(self._tbits, task)
        now = self.clock()
        fields = lease.fields
        rows = self.rows
        # totals: rows and bytes delivered, rows and bytes redelivered
        tot = [0, 0, 0, 0]
        # the run of rows of one partition: its counters and histogram of task, and the
        # rows and bytes delivered and redelivered in it (counted when the run ends)
        part = None
        pc: list[int] = []
        ph = None
        k = kb = rk = rb = 0
        # first deliveries not observed yet: ``seen`` rows born at ``born`` (the rows of
        # one put share it), observed at once
        born = 0.0
        seen = 0
        lhave: dict | None = None  # the last row's fields, and the bytes asked of them
        lb = 0
        for row in ([rows[rid] for rid in lease.rows] if objs is None else objs):
            if row.part is not part:
                if part is not None:
                    _count(pc, tot, k, kb, rk, rb)
                    if seen:
                        ph.observe_n(now - born, seen)  # type: ignore[union-attr]
                    k = kb = rk = rb = seen = 0
                part = row.part
                pc, ph = part.counts.task(task), part.counts.hist(part.counts.delivery, task)
            have = row.fields
            if have is not lhave:  # (rows of one shape share it: see Row.fields)
                lhave, lb = have, _asked(have, fields)
            b = lb
            k += 1
            kb += b
            if row.delivered & bit:
                rk += 1
                rb += b
            else:
                row.delivered |= bit
                if row.born != born or not seen:
                    if seen:  # (the task's histogram: the sum of its partitions')
                        ph.observe_n(now - born, seen)  # type: ignore[union-attr]
                    born = row.born
                    seen = 0
                seen += 1
        if part is not None:
            _count(pc, tot, k, kb, rk, rb)
            if seen:
                ph.observe_n(now - born, seen)  # type: ignore[union-attr]
        self.c_delivered[task] = self.c_delivered.get(task, 0) + tot[0]
        self.c_bytes_delivered[task] = self.c_bytes_delivered.get(task, 0) + tot[1]
        if tot[2]:
            self.c_redelivered[task] = self.c_redelivered.get(task, 0) + tot[2]
            self.c_bytes_redelivered[task] = self.c_bytes_redelivered.get(task, 0) + tot[3]
        return tot[1]

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
            rows = self.rows
            # the run of rows of one partition: rows and bytes acked in it
            last = None
            k = kb = cmask = 0
            pins = self._pins
            lhave: dict | None = None  # the last row's fields, and the bytes asked of them
            lb = 0
            sealed = False  # whether a row left is of a sealed partition (_lease_changed)
            for rid in lease.rows:
                row = rows.get(rid)
                if row is None:
                    continue
                held = row.leased.pop(task, None)  # (one dict call: it is lid but rarely)
                if held != lid:
                    if held is not None:  # (another lease's row: left as it was)
                        row.leased[task] = held
                    sealed = sealed or row.part.sealed
                    continue
                have = row.fields
                if have is not lhave:  # (rows of one shape share it: see Row.fields)
                    lhave, lb = have, _asked(have, fields)
                b = lb
                row.acked |= bit
                p = row.part
                if p is not last:  # (rows come in runs of one partition)
                    if last is not None:
                        _count_acks(last, task, k, kb)
                        nbytes += kb
                    last = p
                    k = kb = 0
                    cmask = p.cmask
                    sealed = sealed or p.sealed
                k += 1
                kb += b
                if cmask and row.acked & cmask == cmask and not row.leased and (
                        not pins or rid not in pins):
                    done.append(row)
            if last is not None:
                _count_acks(last, task, k, kb)
                nbytes += kb
            self.c_acked[task] = self.c_acked.get(task, 0) + len(lease.rows)
            self.c_bytes_acked[task] = self.c_bytes_acked.get(task, 0) + nbytes
            self._drop_rows(done, DropReason.CONSUMED)
            if lease.pads:
                self._unpin(lease)
            if sealed or self.closed or lease.dispatch is not None:
                self._lease_changed(lease)  # (nothing for it to do otherwise)
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
            back: list[Row] = []
            done: list[Row] = []  # rows every consumer acked that this lease alone kept
            for rid in lease.rows:
                row = self.rows.get(rid)
                if row is not None and row.leased.get(task) == lid:
                    del row.leased[task]
                    (done if self._consumed(row) else back).append(row)
            if expired:
                self.c_expired[task] = self.c_expired.get(task, 0) + len(back) + len(done)
            self._reindex(back, (task,))
            self._drop_rows(done, DropReason.CONSUMED)
            if lease.pads:
                self._unpin(lease)
            self._lease_changed(lease)

    def _consumed(self, row: Row) -> bool:
        """Every declared consumer of its partition acked ``row``, and no lease or DP
        share holds it: nothing needs it any more (it is dropped as consumed)."""
        cmask = row.part.cmask
        return bool(cmask) and row.acked & cmask == cmask and not row.leased and (
            row.id not in self._pins)

    def _pin(self, lease: _Lease, pads: list[int]) -> None:
        """``lease`` (a DP share) repeats ``pads``, rows of other shares, as padding: they
        are not dropped as consumed before it ends, so that its rank can still read them
        after the rank whose share holds them acked them."""
        lease.pads = pads  # (the reserved share's list: what is withdrawn is not delivered)
        pins = self._pins
        for rid in pads:
            pins[rid] = pins.get(rid, 0) + 1

    def _unpin(self, lease: _Lease) -> None:
        """``lease`` ended: the rows it repeated as padding may be dropped as consumed
        now, and those every consumer of their partition has acked are."""
        pins, rows = self._pins, self.rows
        done = []
        for rid in lease.pads:
            n = pins.get(rid, 0) - 1
            if n > 0:
                pins[rid] = n
                continue
            pins.pop(rid, None)
            row = rows.get(rid)
            if row is not None and self._consumed(row):
                done.append(row)
        lease.pads = []
        self._drop_rows(done, DropReason.CONSUMED)

    def _strip_pads(self, gone: set[int], fields: set[str] | None = None
                    ) -> list[tuple[int, _Lease, list[int]]]:
        """Take rows ``gone`` out of the padding of every live DP share (of those that
        asked for one of ``fields``, if given), in place: a reserved share's list, so that
        it does not deliver them. A share left with no rows and no padding ends (it leaves
        ``leases``; the caller remembers its outcome). Returns ``(lease id, lease, the
        rows it lost)`` for each share that lost some; pins are the caller's to count."""
        hit = []
        for lid, lease in list(self.leases.items()):
            pads = lease.pads
            if not pads or gone.isdisjoint(pads) or (
                    fields is not None and not lease.fields & fields):
                continue
            out = [r for r in pads if r in gone]
            pads[:] = [r for r in pads if r not in gone]
            if not lease.rows and not pads:
                del self.leases[lid]
            hit.append((lid, lease, out))
        return hit

    def _withdraw_pads(self, rids: Iterable[int], fields: set[str]) -> None:
        """Writes of ``fields`` to rows ``rids`` were taken back (see ``retract``): a DP
        share that repeats one of them as padding and asked for one of those fields loses
        it, as a batch holding it as its own row does (its ack names the row; a reserved
        share does not deliver it). The row is unpinned, and dropped if it is consumed."""
        pins = self._pins
        hit = [r for r in rids if r in pins]
        if not hit:
            return
        for lid, lease, out in self._strip_pads(set(hit), fields):
            for rid in out:
                n = pins[rid] - 1
                if n:
                    pins[rid] = n
                else:
                    del pins[rid]
            lease.withdrawn.extend(dict.fromkeys(out))  # its ack says so
            if lid not in self.leases:
                self._remember(lid, ["withdrawn", lease.withdrawn])
        done = []
        for rid in hit:
            row = self.rows.get(rid)
            if row is not None and self._consumed(row):
                done.append(row)
        self._drop_rows(done, DropReason.CONSUMED)

    def _unpad(self, gone: list[int]) -> None:
        """Rows ``gone`` were dropped: DP shares that repeat them as padding lose them
        (a reserved share does not deliver them), and a share of padding only left with
        nothing ends, as a lease whose last row is dropped does."""
        if not gone:
            return
        out = set(gone)
        pins = self._pins
        for rid in out:
            del pins[rid]
        for lid, lease, _ in self._strip_pads(out):
            if lid not in self.leases:
                self._remember(lid, _ended(lease))

    def _lease_changed(self, lease: _Lease) -> None:
        # per partition, the groups of the lease's rows: a sealed group's completeness
        # (every member the task owes is ready) moved for those alone (see _wake_groups)
        groups: dict[Partition, set[tuple[str, Hashable]]] = {}
        for r in lease.rows:
            row = self.rows.get(r)
            if row is not None:
                g = groups.get(row.part)
                if g is None:  # (not setdefault: a set made for every row)
                    g = groups[row.part] = set()
                if row.tags:
                    g.update(row.tags.items())
        for p, left in groups.items():
            if p.sealed or self.closed:  # remaining() moved: tails and ends may follow
                self.changed.add(p.name)
                self._wake_groups(p.name, left)
        if lease.dispatch is not None:
            disp = self._dispatchers.get(lease.dispatch[0])
            if disp is not None and not lease.claimed:
                disp.shares.pop((lease.dispatch[1], lease.rank), None)

    def lease_rows(self, lease_id: int) -> list[int] | None:
        """Rows still held under a lease (a DP share's padding rows included), or
        ``None`` once it ended."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return None
        return list(lease.rows) + [r for r in lease.pads if r in self.rows]

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


def _ended(lease: _Lease) -> str | list:
    """How ``lease`` ended when its last row left (dropped): as acknowledged, unless a
    retracted write took rows from it before (see ``retract``), which its ack names."""
    return ["withdrawn", lease.withdrawn] if lease.withdrawn else "acked"


def _count(pc: list[int], tot: list[int], k: int, kb: int, rk: int, rb: int) -> None:
    """Add a run's deliveries (``k`` rows, ``kb`` bytes; ``rk``, ``rb`` of them
    redelivered) to its partition's counters of the task and to the totals."""
    pc[0] += k
    pc[1] += kb
    pc[2] += rk
    pc[3] += rb
    tot[0] += k
    tot[1] += kb
    tot[2] += rk
    tot[3] += rb


def _count_acks(p: Partition, task: str, k: int, kb: int) -> None:
    """Count ``k`` rows (``kb`` bytes) of partition ``p`` acked by ``task``."""
    pc = p.counts.task(task)
    pc[4] += k
    pc[5] += kb
    p.acked[task] = p.acked.get(task, 0) + k


def _asked(have: dict[str, int], fields: Iterable[str]) -> int:
    """The bytes of ``fields`` in a row's record of field sizes ``have``."""
    b = 0
    for f in fields:
        b += have.get(f, 0)
    return b
