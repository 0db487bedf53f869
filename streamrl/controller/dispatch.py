"""Taking batches: which ready rows a request gets, when a short batch may go out and
when a stream has ended, and data-parallel (DP) dispatch over ranks."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Hashable, Sequence

from ..config import Request
from ..errors import DispatchError, InvalidArgument
from ..messages import END, Delivery, DropReason, _End


class _Dispatcher:
    """DP dispatch state of one (subscription, dp_size): shares waiting for their rank."""

    __slots__ = ("next", "shares", "made")

    def __init__(self, dp_size: int):
        self.next = [0] * dp_size  # next dispatch index per rank
        self.made = 0  # dispatches made so far
        # (dispatch, rank) -> (lease id or 0, rows, padding rows)
        self.shares: dict[tuple[int, int], tuple[int, list[int], list[int]]] = {}


class Dispatch:
    """Selection, tails and ends, DP dispatch (part of :class:`Controller`)."""

    def take(self, req: Request) -> Delivery | _End | None:
        """Lease the next micro-batch for ``req``.

        Returns a :class:`Delivery`, ``None`` when the caller must wait (nothing changes),
        or :data:`END` when nothing more will ever come (the partition is sealed and the
        task consumed all its rows, or the queue is closed and drained).
        """
        self.expire()
        sub = self._sub(req)
        if req.max_staleness is not None:
            self._drop_stale(sub, req.max_staleness)
        if req.dp_size > 1:
            return self._take_dp(sub, req)
        rows = self._select(sub, req, req.batch_size)
        if rows is None or rows is END:
            return rows
        return self._lease(sub, req, rows)

    def _owed(self, sub) -> int | None:
        """Rows the task still owes in the subscription's scope once no new rows can come
        (its partition, or the whole queue, is sealed); ``None`` while more may come."""
        if sub.partition is None:
            return self._remaining_all(sub.task) if self.sealed_all else None
        if sub.partition in self.retired:
            return 0
        p = self.parts.get(sub.partition)
        return p.remaining(sub.task) if p is not None and p.sealed else None

    def _tail(self, sub) -> bool:
        """True when every row the task still owes is deliverable now (nothing to wait
        for), so a short final batch may go out."""
        return self.closed or self._owed(sub) == len(sub.avail)

    def _ended(self, sub) -> bool:
        return (self.closed and not sub.avail) or self._owed(sub) == 0

    def _select(self, sub, req: Request, size: int) -> list[int] | _End | None:
        """Pick (without leasing) up to ``size`` rows, or None/END."""
        if sub.group_by is None:
            if len(sub.avail) >= size:
                return list(itertools.islice(sub.avail, size))
            tail = self._tail(sub)
            if sub.avail and tail and not req.drop_last:
                return list(sub.avail)
            if self._ended(sub) or (tail and req.drop_last):
                return END
            return None
        # grouped: whole groups only
        chosen: list[int] = []
        complete_rows = 0
        for gk in sub.complete:
            b = sub.buckets[gk]
            n = min(len(b), sub.group_size) if sub.group_size else len(b)
            complete_rows += n
            if len(chosen) + n <= size or not chosen:
                chosen.extend(itertools.islice(b, n))
            if len(chosen) >= size:
                break
        if chosen and (len(chosen) >= size or complete_rows > len(chosen)):
            return chosen  # a full batch, or the next whole group would not fit
        tail = self._tail(sub)
        if chosen and tail and not req.drop_last:
            return chosen
        if self._ended(sub) or (tail and req.drop_last):
            return END
        return None

    def _delivery(self, lid: int, req: Request, sub, rids: list[int], rank: int = 0,
                  dispatch: int | None = None) -> Delivery:
        objs = [self.rows[r] for r in rids]
        common = set(objs[0].fields) if objs else set()
        for row in objs[1:]:
            common.intersection_update(row.fields)
        part = sub.partition
        if part is None and objs:
            names = {r.part.name for r in objs}
            part = names.pop() if len(names) == 1 else None
        nbytes = sum(r.fields.get(f, 0) for r in objs for f in req.fields)
        return Delivery(lid, req.task, list(rids), [r.shard for r in objs],
                        [r.version for r in objs], req.fields, part, rank, dispatch,
                        tuple(sorted(common)), nbytes)

    # ------------------------------------------------------------------ DP dispatch

    def _take_dp(self, sub, req: Request) -> Delivery | _End | None:
        """Rank ``r`` takes share ``r`` of dispatch ``k`` (its k-th batch). The first rank
        to ask for dispatch ``k`` makes it: ``dp_size * batch_size`` rows (whole groups)
        split into equal-count, weight-balanced shares; the other shares are reserved
        (leased, unclaimed) until their rank asks."""
        R, rank = req.dp_size, req.dp_rank
        disp = self._dispatchers.setdefault(sub.key + (R,), _Dispatcher(R))
        k = disp.next[rank]
        if (k, rank) not in disp.shares:
            if k < disp.made:
                disp.next[rank] = k + 1
                raise DispatchError(
                    f"the share of dp_rank={rank} in dispatch {k} of task {req.task!r} expired "
                    "before this rank asked for it (its rows went back to the queue); raise "
                    "lease_timeout or keep the ranks in step")
            made = self._make_dispatch(sub, req, disp, k)
            if made is None or made is END:
                return made
        lid, rids, pads = disp.shares.pop((k, rank))
        disp.next[rank] = k + 1
        if lid:
            lease = self.leases[lid]
            lease.deadline = self.clock() + lease.timeout
            heapq.heappush(self._lease_heap, (lease.deadline, lid))
            self._claim(lease)
        return self._delivery(lid, req, sub, list(rids) + list(pads), rank, k)

    def _make_dispatch(self, sub, req: Request, disp: _Dispatcher, k: int):
        R = req.dp_size
        rows = self._select(sub, req, R * req.batch_size)
        if rows is None or rows is END:
            return rows
        units = self._units(sub, rows)  # whole groups (or single rows)
        extra = len(units) % R
        if extra:  # only a short last dispatch can be uneven
            kind = "groups" if sub.group_by else "rows"
            if req.dp_remainder == "error":
                raise DispatchError(
                    f"the last {len(rows)} rows ({len(units)} {kind}) of task {req.task!r} "
                    f"cannot be split evenly over dp_size={R} ranks; pass dp_remainder='drop' "
                    f"(drop the last {extra} {kind}, counted in stats) or 'pad' (repeat "
                    "rows), or put a multiple of dp_size")
            if req.dp_remainder == "drop":
                left = units[len(units) - extra:]
                units = units[:len(units) - extra]
                self._drop_rows([self.rows[r] for u in left for r in u], DropReason.DP_REMAINDER)
                if not units:
                    return None  # all dropped: the next take sees the end
        shares, pads = _balanced_split(units, R, self._weights(units, req.balance_by))
        for r in range(R):
            lid = self._lease(sub, req, shares[r], claimed=False, rank=r, dispatch=k).lease \
                if shares[r] else 0
            if lid:
                self.leases[lid].dispatch = (sub.key + (R,), k)
            disp.shares[(k, r)] = (lid, shares[r], pads[r])
        disp.made = k + 1
        return True

    def _units(self, sub, rows: list[int]) -> list[list[int]]:
        if sub.group_by is None:
            return [[r] for r in rows]
        by: dict[Hashable, list[int]] = {}
        for r in rows:
            by.setdefault(self.rows[r].tags[sub.group_by], []).append(r)
        return list(by.values())

    def _weights(self, units: list[list[int]], balance_by: str | None) -> list[float]:
        if balance_by is None:
            return [float(len(u)) for u in units]
        out = []
        for u in units:
            w = 0.0
            for r in u:
                v = self.rows[r].tags.get(balance_by)
                if v is None:
                    raise InvalidArgument(
                        f"balance_by={balance_by!r}: row {r} has no value for it yet; write the "
                        "length field before the row becomes ready, or list it in fields")
                w += float(v)
            out.append(w)
        return out


def _balanced_split(units: list[list[int]], R: int, weights: list[float]
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """Split ``units`` (groups of rows) over ``R`` ranks, every rank the same number of
    units, balancing the total weight.

    Greedy longest-processing-time first with a cardinality bound (each unit goes,
    heaviest first, to the lightest rank that still has room), then pairwise swaps between
    the heaviest and the lightest rank while a swap narrows their gap. When ``len(units)``
    is not a multiple of ``R``, short ranks are padded by repeating units of other ranks
    (returned separately, since those rows are leased by their own share).
    """
    per = math.ceil(len(units) / R) if units else 0
    order = sorted(range(len(units)), key=lambda i: -weights[i])
    load = [0.0] * R
    members: list[list[int]] = [[] for _ in range(R)]
    for i in order:
        r = min((r for r in range(R) if len(members[r]) < per), key=lambda r: (load[r], len(members[r])))
        members[r].append(i)
        load[r] += weights[i]
    for _ in range(4 * len(units)):
        h = max(range(R), key=load.__getitem__)
        lo = min(range(R), key=load.__getitem__)
        gap = load[h] - load[lo]
        best, pick = gap, None
        for a in members[h]:
            for b in members[lo]:
                d = weights[a] - weights[b]
                if 0 < d < gap and abs(gap - 2 * d) < best:
                    best, pick = abs(gap - 2 * d), (a, b)
        if pick is None:
            break
        a, b = pick
        members[h].remove(a)
        members[lo].remove(b)
        members[h].append(b)
        members[lo].append(a)
        d = weights[a] - weights[b]
        load[h] -= d
        load[lo] += d
    shares = [[r for i in m for r in units[i]] for m in members]
    pads: list[list[int]] = [[] for _ in range(R)]
    donors = deque(order)
    for r in range(R):
        need = per - len(members[r])
        while need > 0:
            i = donors.popleft()
            donors.append(i)
            pads[r].extend(units[i])
            need -= 1
    return shares, pads


def imbalance(loads: Sequence[float]) -> float:
    """(max - min) / mean of per-rank loads: 0 is perfect balance."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return (max(loads) - min(loads)) / mean if mean else 0.0
