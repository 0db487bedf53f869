"""Taking batches: which ready rows a request gets (its sampler orders them, see
:mod:`streamrl.sampling`), when a short batch may go out and when a stream has ended,
and data-parallel (DP) dispatch over ranks."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, SupportsFloat, cast

from ..config import Request
from ..errors import DispatchError, InvalidArgument
from ..messages import END, Delivery, DropReason, _End
from ..sampling import FifoSampler, Ready, Sampler, Unit, resolve
from .base import ControllerBase

if TYPE_CHECKING:
    from .index import _Sub
    from .state import Partition, Row


class _Dispatcher:
    """DP dispatch state of one (subscription, dp_size): shares waiting for their rank."""

    __slots__ = ("next", "shares", "made")

    def __init__(self, dp_size: int):
        self.next = [0] * dp_size  # next dispatch index per rank
        self.made = 0  # dispatches made so far
        # (dispatch, rank) -> (lease id or 0, rows, padding rows)
        self.shares: dict[tuple[int, int], tuple[int, list[int], list[int]]] = {}


class Dispatch(ControllerBase):
    """Selection, tails and ends, DP dispatch (part of :class:`Controller`)."""

    def take(self, req: Request) -> Delivery | _End | None:
        """Lease the next micro-batch for ``req``.

        Returns a :class:`Delivery`, ``None`` when the caller must wait (nothing changes),
        or :data:`END` when nothing more will ever come (the partition is sealed and the
        task consumed all its rows, or the queue is closed and drained).
        """
        self.expire()
        sampler = self._sampler_of(req)
        for f in sampler.fields:
            if not self._tagged(f, req.partition):
                self._tag_scope(f, req.partition)
        sub = self._sub(req)
        if req.max_staleness is not None:
            self._drop_stale(sub, req.max_staleness)
        if req.dp_size > 1:
            return self._take_dp(sub, req, sampler)
        rows = self._select(sub, req, req.batch_size, sampler)
        if rows is None or rows is END:
            return rows
        return self._lease(sub, req, rows)

    def _sampler_of(self, req: Request) -> Sampler:
        """The request's sampler, or the queue's."""
        return self.sampler if req.sampler is None else resolve(req.sampler)

    def _owed(self, sub: _Sub) -> int | None:
        """Rows the task still owes in the subscription's scope once no new rows can come
        (its partition, or the whole queue, is sealed); ``None`` while more may come."""
        if sub.partition is None:
            return self._remaining_all(sub.task) if self.sealed_all else None
        if sub.partition in self.retired:
            return 0
        p = self.parts.get(sub.partition)
        if p is None:  # (no row yet: none will come once the whole queue is sealed)
            return 0 if self.sealed_all else None
        return p.remaining(sub.task) if p.sealed else None

    def _tail(self, sub: _Sub) -> bool:
        """True when every row the task still owes is deliverable now (nothing to wait
        for), so a short final batch may go out."""
        return self.closed or self._owed(sub) == len(sub.avail)

    def _ended(self, sub: _Sub) -> bool:
        return (self.closed and not sub.avail) or self._owed(sub) == 0

    def _select(self, sub: _Sub, req: Request, size: int, sampler: Sampler
                ) -> list[int] | _End | None:
        """Pick (without leasing) up to ``size`` rows, or None/END."""
        fifo = type(sampler) is FifoSampler  # the default, kept O(batch) with no overhead
        if sub.group_by is None:
            n = len(sub.avail)
            if n >= size:
                return list(itertools.islice(sub.avail, size)) if fifo else \
                    self._pack(sub, sampler, size)[0]
            tail = self._tail(sub)
            if n and tail and not req.drop_last:
                return list(sub.avail) if fifo else self._pack(sub, sampler, n)[0]
            if self._ended(sub) or (tail and req.drop_last):
                return END
            return None
        # grouped: whole groups only
        chosen, skipped = self._pack(sub, sampler, size, check=not fifo)
        if chosen and (len(chosen) >= size or skipped):
            return chosen  # a full batch, or the next whole group would not fit
        tail = self._tail(sub)
        if chosen and tail and not req.drop_last:
            return chosen
        if self._ended(sub) or (tail and req.drop_last):
            return END
        return None

    def _pack(self, sub: _Sub, sampler: Sampler, size: int, *, check: bool = True
              ) -> tuple[list[int], bool]:
        """Take the sampler's units, in its order, while they fit ``size`` rows (a first
        unit always: a group may be bigger than a batch). Returns the rows and whether a
        ready unit was left out for not fitting."""
        ready = Ready(lambda: self._ready_units(sub), self.rows, group_by=sub.group_by,
                      group_size=sub.group_size)
        chosen: list[int] = []
        seen: set[int] = set()
        offered = 0
        for unit in sampler.order(ready, size):
            if check:
                unit = self._check_unit(sub, sampler, unit, seen)
            n = len(unit)
            offered += n
            if len(chosen) + n <= size or not chosen:
                chosen.extend(unit)
                if check:
                    seen.update(unit)
            if len(chosen) >= size:
                break
        return chosen, offered > len(chosen)

    def _ready_units(self, sub: _Sub) -> Iterator[list[int]]:
        """What :meth:`Ready.units` yields."""
        if sub.group_by is None:
            for r in sub.avail:
                yield [r]
            return
        gs = sub.group_size
        for gk in sub.complete:
            b = sub.buckets[gk]
            yield list(itertools.islice(b, gs)) if gs and len(b) > gs else list(b)

    def _check_unit(self, sub: _Sub, sampler: Sampler, unit: Unit, seen: set[int]) -> list[int]:
        """``unit`` as a list, if it is a ready unit not taken yet; raise otherwise."""
        unit = list(unit)
        ok = bool(unit) and all(r in sub.avail and r not in seen for r in unit)
        if sub.group_by is None:
            ok = ok and len(unit) == 1
        elif ok:
            row = self.rows[unit[0]]
            gk = (row.part.name, row.tags[sub.group_by])
            b = sub.buckets.get(gk, {})
            need = min(len(b), sub.group_size) if sub.group_size else len(b)
            ok = (gk in sub.complete and len(unit) == need and len(set(unit)) == need
                  and all(r in b for r in unit))
        if not ok:
            what = "a whole complete group" if sub.group_by else "a single ready row"
            raise InvalidArgument(
                f"sampler {sampler!r} gave {unit!r}, which is not {what} of this request (or "
                "was given twice); a sampler must order the units of ready.units()")
        return unit

    def _delivery(self, lid: int, req: Request, sub: _Sub, rids: list[int], rank: int = 0,
                  dispatch: int | None = None, nbytes: int | None = None,
                  pads: Sequence[int] = (), objs: list[Row] | None = None) -> Delivery:
        """The delivery of ``rids`` under lease ``lid`` (``nbytes``: the bytes of the
        asked-for fields of those rows, if the caller counted them; ``pads``: those of
        them that are another DP share's rows, repeated as padding; ``objs``: the rows'
        records, if the caller has them)."""
        if objs is None:
            rows = self.rows
            objs = [rows[r] for r in rids]
        common: set[str] = set()
        fields = req.fields
        count = nbytes is None
        total = 0 if nbytes is None else nbytes
        if objs:
            keys = objs[0].fields.keys()
            common = set(keys)
            one_part: Partition | None = objs[0].part
            seen = objs[0].fields  # (rows of one shape share it: see Row.fields)
            for row in objs:  # (one pass: shared fields, bytes, partition)
                have = row.fields
                if have is not seen:
                    seen = have
                    if have.keys() != keys:
                        common.intersection_update(have)
                if count:
                    for f in fields:
                        total += have.get(f, 0)
                if row.part is not one_part:
                    one_part = None
        part = sub.partition
        if part is None and objs:
            part = one_part.name if one_part is not None else None
        return Delivery(lid, req.task, list(rids), [r.shard for r in objs],
                        [r.version for r in objs], req.fields, part, rank, dispatch,
                        tuple(sorted(common)), total, tuple(pads))

    # ------------------------------------------------------------------ DP dispatch

    def _take_dp(self, sub: _Sub, req: Request, sampler: Sampler) -> Delivery | _End | None:
        """Rank ``r`` takes share ``r`` of dispatch ``k`` (its k-th batch). The first rank
        to ask for dispatch ``k`` makes it: ``dp_size * batch_size`` rows (whole groups)
        split into equal-count, weight-balanced shares; the other shares are reserved
        (leased, unclaimed) until their rank asks. Rows of a reserved share dropped
        before its rank asks are left out of it (:class:`DispatchError` when none is
        left, as when the share expired)."""
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
            made = self._make_dispatch(sub, req, disp, k, sampler)
            if made is None or made is END:
                return made
        lid, rids, pads = disp.shares.pop((k, rank))
        disp.next[rank] = k + 1
        held = self.rows
        if any(r not in held for r in rids) or any(r not in held for r in pads):
            # rows of the share dropped meanwhile: the rank gets what is left of it
            rids = [r for r in rids if r in held]
            pads = [r for r in pads if r in held]
        # (a lease ends when its last row is dropped; one of padding only when given back)
        if (lid and lid not in self.leases) or not (rids or pads):
            if lid in self.leases:
                self.release([lid])  # (padding only: nothing of it is left to read)
            raise DispatchError(
                f"every row of the share of dp_rank={rank} in dispatch {k} of task "
                f"{req.task!r} was dropped (drop, clear or staleness) or taken back (a write "
                "it needed was undone) before this rank asked "
                "for it; ask again: the next batch comes from the next dispatch")
        if lid:
            lease = self.leases[lid]
            lease.deadline = self.clock() + lease.timeout
            heapq.heappush(self._lease_heap, (lease.deadline, lid))
            self._claim(lease)
        return self._delivery(lid, req, sub, list(rids) + list(pads), rank, k, pads=pads)

    def _make_dispatch(self, sub: _Sub, req: Request, disp: _Dispatcher, k: int,
                       sampler: Sampler) -> bool | _End | None:
        """Make dispatch ``k``: ``True``, or ``None``/:data:`END` as :meth:`_select`."""
        R = req.dp_size
        rows = self._select(sub, req, R * req.batch_size, sampler)
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
        if req.balance_by and not sampler.balances:
            self.validate_request(req)  # raises, saying what to do
        shares, pads = sampler.split(units, R, self._weights(units, req.balance_by))
        dealt = [r for s in shares for r in s]
        given = {r for u in units for r in u}
        if (len(shares) != R or len(pads) != R or len(dealt) != len(given)
                or set(dealt) != given or not {r for p in pads for r in p} <= given):
            raise InvalidArgument(
                f"sampler {sampler!r} split a dispatch into shares that are not {R} parts "
                "of its rows; split() must put every unit in exactly one share")
        pads = [list(p) for p in pads]  # (each share's own list: see Leases._pin)
        for r in range(R):
            # (a share of padding only gets a lease too: it keeps its rows readable)
            lid = self._lease(sub, req, shares[r], claimed=False, rank=r, dispatch=k).lease \
                if shares[r] or pads[r] else 0
            if lid:
                lease = self.leases[lid]
                lease.dispatch = (sub.key + (R,), k)
                if pads[r]:
                    self._pin(lease, pads[r])
            disp.shares[(k, r)] = (lid, shares[r], pads[r])
        disp.made = k + 1
        return True

    def _units(self, sub: _Sub, rows: list[int]) -> list[list[int]]:
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
                w += float(cast(SupportsFloat, v))  # a balance key is a number (a length)
            out.append(w)
        return out
