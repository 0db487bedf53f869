"""Saving and loading the controller's state (:meth:`Controller.state_dict`,
:meth:`Controller.load_state_dict`): the source of truth of :mod:`.state` as plain data,
and the derived indexes rebuilt from it."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

from ..errors import CheckpointError
from ..messages import DropReason, FilterJob, FilterSpec, WriteToken
from .base import ControllerBase
from .leases import _Lease
from .state import Partition, Row, _consumers

#: The name under ``"format"`` of a saved controller state.
FORMAT = "streamrl.controller"
#: The format version written by :meth:`Snapshot.state_dict` (and the newest one read).
FORMAT_VERSION = 1


class Snapshot(ControllerBase):
    """``state_dict`` and ``load_state_dict`` (part of :class:`Controller`)."""

    def state_dict(self) -> dict[str, Any]:
        """The controller's state as plain data: dicts (with str keys), lists, str, int,
        float, bool and ``None`` only, so that it packs as msgpack or JSON as it is.

        What is saved is the source of truth: every row (partition, storage unit, policy
        version, committed fields and their sizes, tags, and the tasks that acknowledged
        it, were ever handed it, and the filters that still have to judge it), every
        partition (sealed, consumers, tasks that read it) and retired partition, the
        counters of ``stats()``, the id counters (no row, lease, write or job id is ever
        reused after a load), the policy version, ``closed`` and queue-wide seal, the
        registered filters and tag fields, field dtypes, the id blocks leased to storage
        units, dead units, and the leases, writes and filter jobs in flight (which
        :meth:`load_state_dict` settles, see there). Sets of tasks and filters are saved
        by name, never as bits. The readiness index is derived and not saved, except
        its order: for each request shape seen, the order in which its rows became
        ready, and of its groups (queue order: a FIFO stream continues where it was), and
        for each filter, the rows waiting for the rest of their group, in arrival order.

        Configuration (capacity, lease timeout, staleness bounds, ...) is not state: the
        controller a state is loaded into keeps its own. Outboxes (:meth:`drain`) are not
        state either: drain them before saving.

        Raises:
            CheckpointError: a tag value that is not a str, int, float, bool, ``None``,
                bytes or a tuple of those.
        """
        return self.state_cut().state_dict()

    def state_cut(self) -> "StateCut":
        """The state at this instant, taken cheaply: what :meth:`state_dict` returns,
        with the rows captured as they are (a tuple each, their sets of tasks and
        filters still as bits) and turned into plain data later, by
        :meth:`StateCut.state_dict`, in any thread. A checkpoint takes its cut this way
        while producers and consumers wait: the controller changes nothing the cut
        holds, so the slow part of ``state_dict`` runs beside them.

        Raises:
            CheckpointError: a group key of a subscription or a filter that cannot be
                saved (see :meth:`state_dict`).
        """
        subs = []
        for sub in self.subs.values():
            subs.append({
                "task": sub.task, "fields": sorted(sub.fields), "partition": sub.partition,
                "group_by": sub.group_by, "group_size": sub.group_size,
                "ready": list(sub.avail),
                "groups": [[p, _enc(k)] for p, k in sub.buckets],
                "complete": [[p, _enc(k)] for p, k in sub.complete]})
        head = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "policy_version": self.version,
            "closed": self.closed,
            "sealed_all": self.sealed_all,
            "next_ids": {"row": self._next_id, "lease": self._next_lease,
                         "write": self._next_token, "job": self._next_job},
            "next_shard": self._next_shard,
            "unit_ids": [[s, [list(b) for b in blocks]] for s, blocks in self._unit_ids.items()],
            "dead_shards": sorted(self.dead_shards),
            "dtypes": dict(self.dtypes),
            "tag_fields": sorted(self.tag_fields),
            "part_tags": {p: sorted(fs) for p, fs in self.part_tags.items()},
            "filters": [{"name": s.name, "fields": sorted(s.fields), "group_by": s.group_by,
                         "group_size": s.group_size} for s in self.filters.values()],
            "partitions": [{"name": p.name, "sealed": p.sealed,
                            "consumers": None if p.consumers is None else sorted(p.consumers),
                            "tasks": sorted(p.tasks), "put": p.put, "bytes_put": p.bytes_put,
                            "counts": p.counts.state_dict()}
                           for p in self.parts.values()],
            "retired": sorted(self.retired),
            "rows": None,  # (filled by StateCut.state_dict)
            "leases": [{"id": le.id, "task": le.task, "rows": list(le.rows),
                        "timeout": le.timeout, "claimed": le.claimed}
                       for le in self.leases.values()],
            "writes": [{"id": t.id, "rows": list(t.rows), "shards": list(t.shards),
                        "fields": list(t.fields), "reserved_bytes": t.reserved_bytes,
                        "new_rows": t.new_rows, "overwrite": t.overwrite}
                       for t in self._tokens.values()],
            "filter_jobs": [{"id": j.id, "filter": j.filter, "rows": list(j.rows),
                             "shards": list(j.shards)} for j in self._jobs.values()],
            "subscriptions": subs,
            "filter_waiting": {name: [[p, _enc(k), list(b)] for (p, k), b in buckets.items() if b]
                               for name, buckets in self._filter_ready.items()},
            "lease_outcomes": [[lid, o] for lid, o in self._lease_outcome.items()],
            "outcome_floor": self._outcome_floor,
            "expired_writes": list(self._expired_tokens),
            "counters": {
                "put": self.c_put, "bytes_put": self.c_bytes_put,
                "bytes_freed": self.c_bytes_freed, "writes_expired": self.c_writes_expired,
                "dropped": {str(k): v for k, v in self.c_dropped.items()},
                "bytes_dropped": {str(k): v for k, v in self.c_bytes_dropped.items()},
                "filtered_by": dict(self.c_filtered_by),
                "bytes_filtered_by": dict(self.c_bytes_filtered_by),
                "filter_errors": dict(self.c_filter_errors),
                "delivered": dict(self.c_delivered), "acked": dict(self.c_acked),
                "redelivered": dict(self.c_redelivered), "expired": dict(self.c_expired),
                "bytes_delivered": dict(self.c_bytes_delivered),
                "bytes_acked": dict(self.c_bytes_acked),
                "bytes_redelivered": dict(self.c_bytes_redelivered)},
        }
        # the one part that costs per row: a tuple of each row's fields, nothing converted
        rows = [(r.id, r.part.name, r.shard, r.version, dict(r.fields),
                 dict(r.tags) if r.tags else None, r.acked, r.delivered, r.pending)
                for r in self.rows.values()]
        return StateCut(head, rows, dict(self._tbits), dict(self._fbits))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this controller's state by ``state`` (from :meth:`state_dict`, also
        after a msgpack or JSON round trip) and rebuild the derived indexes. The
        controller keeps its own configuration.

        What was in flight at save time is settled as if its owner had gone away:

        * leases come back **released** (in lease id order): their rows are delivered
          again, and counted as redelivered to a task that had them before; ``ack`` of
          such a lease raises :class:`~streamrl.errors.LeaseExpired`. Acknowledged rows
          stay acknowledged and are never delivered again to that task;
        * writes (admitted, not committed) are **aborted** (in write id order, after the
          leases): new rows they admitted are dropped, as by :meth:`abort`, and are
          neither counted as put nor as dropped (their deletion from storage is queued in
          :attr:`deletes`); what a write to existing rows may have stored is queued in
          :attr:`field_deletes`;
        * filter jobs are **judged again**: each is queued anew in :attr:`filter_jobs`
          (same id, same rows) and its rows wait for the new verdict;
        * DP dispatch restarts: every rank's next dispatch is the first one; rows every
          consumer acked that a share kept as padding are dropped as consumed.

        Row, lease, write and job ids continue after the saved counters, so none is
        reused. Subscriptions come back with their saved ready order; the outboxes hold
        what the caller must do (deletes, filter jobs) and wake every waiter.

        Raises:
            CheckpointError: not a controller state, an unknown or newer format version,
                a malformed state, or rows on a storage unit this controller does not have.
        """
        _check_format(state)
        self._init_state()
        self._init_index()
        self._init_outboxes()
        try:
            self._load(state)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(
                f"the saved controller state is malformed ({type(e).__name__}: {e}); pass "
                "what Controller.state_dict() returned, unchanged") from e
        # settle what was in flight
        self.release(sorted(self.leases))
        for tid in sorted(self._tokens):
            undo = self.abort(tid)
            if undo is not None:
                self.field_deletes.append(undo)
        # rows every consumer acked that a live DP share kept as padding (pins are not
        # saved: the shares came back released): nothing keeps them now
        self._drop_rows([r for r in self.rows.values() if self._consumed(r)],
                        DropReason.CONSUMED)
        self.changed.add(None)
        self.woken.update(self.subs)
        self.space_freed = True

    def _load(self, st: Mapping[str, Any]) -> None:
        self.version = int(st["policy_version"])
        self.closed = bool(st["closed"])
        self.sealed_all = bool(st["sealed_all"])
        ids = st["next_ids"]
        self._next_id, self._next_lease = int(ids["row"]), int(ids["lease"])
        self._next_token, self._next_job = int(ids["write"]), int(ids["job"])
        self._next_shard = int(st["next_shard"])
        self._unit_ids = {int(s): [list(b) for b in blocks] for s, blocks in st["unit_ids"]}
        self.dead_shards = set(st["dead_shards"])
        self.dtypes = dict(st["dtypes"])
        self.tag_fields = set(st["tag_fields"])
        if self.group_key is not None:  # (this queue's own, saved or not)
            self.tag_fields.add(self.group_key)
        self.part_tags = {p: set(fs) for p, fs in st.get("part_tags", {}).items()}
        for f in st["filters"]:
            spec = FilterSpec(f["name"], frozenset(f["fields"]), f["group_by"], f["group_size"])
            self.filters[spec.name] = spec
            self._filter_ready[spec.name] = {}
            self._bit(self._fbits, spec.name)
        self.retired = set(st["retired"])
        for pd in st["partitions"]:
            consumers = _consumers(pd["consumers"])
            p = self.parts[pd["name"]] = Partition(pd["name"], consumers, self._mask(consumers))
            p.sealed = bool(pd["sealed"])
            p.tasks = set(pd["tasks"])
            p.put, p.bytes_put = int(pd.get("put", 0)), int(pd.get("bytes_put", 0))
            p.counts.load_state_dict(pd.get("counts"))
        self._load_rows(st["rows"])
        c = st["counters"]
        self.c_put, self.c_bytes_put = c["put"], c["bytes_put"]
        self.c_bytes_freed, self.c_writes_expired = c["bytes_freed"], c["writes_expired"]
        self.c_dropped = dict(c["dropped"])
        self.c_bytes_dropped = dict(c.get("bytes_dropped", {}))
        self.c_filtered_by = dict(c["filtered_by"])
        self.c_bytes_filtered_by = dict(c.get("bytes_filtered_by", {}))
        self.c_filter_errors = dict(c["filter_errors"])
        self.c_delivered, self.c_acked = dict(c["delivered"]), dict(c["acked"])
        self.c_redelivered, self.c_expired = dict(c["redelivered"]), dict(c["expired"])
        self.c_bytes_delivered = dict(c.get("bytes_delivered", {}))
        self.c_bytes_acked = dict(c.get("bytes_acked", {}))
        self.c_bytes_redelivered = dict(c.get("bytes_redelivered", {}))
        self._lease_outcome = OrderedDict((int(lid), o) for lid, o in st["lease_outcomes"]
                                          if o != "acked")
        self._outcome_floor = int(st.get("outcome_floor", 0))
        self._expired_tokens = OrderedDict((int(t), None) for t in st["expired_writes"])
        self._load_in_flight(st)
        # rows waiting for a filter's other group members, in arrival order
        for name, saved in st["filter_waiting"].items():
            fbit, buckets = self._fbits[name], self._filter_ready[name]
            for p, k, rids in saved:
                b = {r: None for r in rids if r in self.rows and self.rows[r].pending & fbit}
                if b:
                    buckets[(p, _dec(k))] = b
        self._filter_check(list(self.rows.values()))  # (rows not listed: not expected)
        for sd in st["subscriptions"]:
            self._load_sub(sd)

    def _load_rows(self, rows: list) -> None:
        fbits, rows_by_id = self._fbits, self.rows
        held = 0
        for rd in rows:
            p = self.parts.get(rd["partition"])
            if p is None:
                raise CheckpointError(
                    f"row {rd['id']} belongs to partition {rd['partition']!r}, which the saved "
                    "state does not list; pass what Controller.state_dict() returned, unchanged")
            shard = int(rd["shard"])
            if not 0 <= shard < self.num_shards:
                raise CheckpointError(
                    f"row {rd['id']} is held by storage unit {shard}, and this queue has "
                    f"{self.num_shards} units; load the state into a queue with at least "
                    f"{shard + 1} (num_shards=)")
            rid = int(rd["id"])
            row = Row(rid, p, shard, int(rd["version"]), self.clock())  # (latency from load)
            row.fields = {f: int(b) for f, b in rd["fields"].items()}
            row.nbytes = sum(row.fields.values())
            held += row.nbytes
            row.acked = self._mask(rd["acked"])
            row.delivered = self._mask(rd["delivered"])
            for name in rd["pending"]:
                row.pending |= fbits[name]
            for t in rd["acked"]:
                p.acked[t] = p.acked.get(t, 0) + 1
            rows_by_id[rid] = row
            p.rows[rid] = row
            for f, v in rd["tags"].items():
                self._set_tag(row, f, _dec(v))
        self.bytes_held = held

    def _load_in_flight(self, st: Mapping[str, Any]) -> None:
        """Writes, leases and filter jobs as they were (settled by the caller)."""
        rows = self.rows
        for w in st["writes"]:
            tok = WriteToken(int(w["id"]), list(w["rows"]), list(w["shards"]),
                             tuple(w["fields"]), int(w["reserved_bytes"]), bool(w["new_rows"]),
                             bool(w["overwrite"]))
            self._track(tok)
            self.reserved_bytes += tok.reserved_bytes
            wmask = self._wmask(tok.fields)
            for r in tok.rows:
                if r in rows:
                    rows[r].writing |= wmask
        now = self.clock()
        for ld in st["leases"]:
            lease = _Lease(int(ld["id"]), ld["task"], list(ld["rows"]),
                           now + ld["timeout"], float(ld["timeout"]))
            lease.claimed = bool(ld["claimed"])
            self.leases[lease.id] = lease
            heapq.heappush(self._lease_heap, (lease.deadline, lease.id))
            for r in lease.rows:
                rows[r].leased[lease.task] = lease.id
        for jd in st["filter_jobs"]:
            spec = self.filters[jd["filter"]]
            job = FilterJob(int(jd["id"]), spec.name, list(jd["rows"]), list(jd["shards"]),
                            tuple(sorted(spec.fields)))
            fbit = self._fbits[spec.name]
            for r in job.rows:
                if r in rows:
                    rows[r].judging |= fbit
            self._jobs[job.id] = job
            self.filter_jobs.append(job)  # judged again

    def _load_sub(self, sd: Mapping[str, Any]) -> None:
        """A subscription rebuilt from the rows, in its saved ready order."""
        key = (sd["task"], frozenset(sd["fields"]), sd["partition"], sd["group_by"],
               sd["group_size"])
        if key in self.subs or key[2] in self.retired:
            return
        sub = self._new_sub(key)
        if sub.partition is None:
            scope = self.rows
        else:
            p = self.parts.get(sub.partition)
            scope = p.rows if p is not None else {}
        if sub.group_by is not None:  # groups keep their place while they have rows
            for p, k in sd["groups"]:
                sub.buckets[(p, _dec(k))] = {}
        for rid in sd["ready"]:
            row = scope.get(rid)
            if row is not None and rid not in sub.avail and self._eligible(row, sub):
                self._add(sub, row)
        for row in scope.values():  # ready now but not then (not expected)
            if row.id not in sub.avail and self._eligible(row, sub):
                self._add(sub, row)
        if sub.group_by is not None:
            for gk in [gk for gk, b in sub.buckets.items() if not b]:
                del sub.buckets[gk]
            order = {(p, _dec(k)): i for i, (p, k) in enumerate(sd["complete"])}
            done = sorted(sub.complete, key=lambda gk: order.get(gk, len(order)))
            sub.complete = dict.fromkeys(done)


class StateCut:
    """A controller's state taken at one instant by :meth:`Snapshot.state_cut`: plain
    data except the rows, which :meth:`state_dict` converts (in any thread: nothing here
    is shared with the controller any more).

    Attributes:
        head: the state without its rows (plain data).
        rows: one tuple per row: ``(id, partition, shard, version, fields, tags, acked
            bits, delivered bits, pending filter bits)``.
    """

    __slots__ = ("head", "rows", "_tasks", "_filters")

    def __init__(self, head: dict[str, Any], rows: list[tuple], tasks: dict[str, int],
                 filters: dict[str, int]):
        self.head = head
        self.rows = rows
        self._tasks = tasks
        self._filters = filters

    def state_dict(self) -> dict[str, Any]:
        """What :meth:`Snapshot.state_dict` returned at the cut.

        Raises:
            CheckpointError: a tag value that cannot be saved.
        """
        return {**self.head, "rows": list(self.iter_rows())}

    def stream_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` with its rows as a :class:`RowStream`: each row's dict is
        made when it is read and can be let go at once. Writing a big cut this way keeps
        a few rows alive at a time instead of every row's dict, lists and strings at
        once: those many new long-lived objects made Python's cyclic garbage collector
        run a full collection (150-200 ms for a queue of 8,000 rows here, holding the
        GIL, so the event loop and every other thread stopped with it).

        Raises:
            CheckpointError: (while the rows are read) a tag value that cannot be saved.
        """
        return {**self.head, "rows": RowStream(self)}

    def iter_rows(self) -> Iterator[dict[str, Any]]:
        """The rows of :meth:`state_dict`, one dict at a time, in the cut's order."""
        tasks, filters = self._tasks, self._filters

        def names(table: dict[str, int], mask: int) -> list[str]:
            return sorted(n for n, b in table.items() if mask & b) if mask else []

        for rid, part, shard, version, fields, tags, acked, delivered, pending in self.rows:
            yield {"id": rid, "partition": part, "shard": shard, "version": version,
                   "fields": fields,
                   "tags": {f: _enc(v) for f, v in tags.items()} if tags else {},
                   "acked": names(tasks, acked), "delivered": names(tasks, delivered),
                   "pending": names(filters, pending)}


class RowStream:
    """The rows of a :class:`StateCut` as a sized iterable of plain dicts, made as they
    are read (see :meth:`StateCut.stream_dict`); msgpack writers pack it as an array."""

    __slots__ = ("_cut",)

    def __init__(self, cut: StateCut):
        self._cut = cut

    def __len__(self) -> int:
        return len(self._cut.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._cut.iter_rows()


def _check_format(state: Any) -> None:
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise CheckpointError(
            "not a saved controller state (no 'format': 'streamrl.controller'); pass what "
            "Controller.state_dict() returned")
    v = state.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise CheckpointError(f"the saved controller state has an unknown format version {v!r}")
    if v > FORMAT_VERSION:
        raise CheckpointError(
            f"the saved controller state has format version {v}, newer than this streamrl "
            f"reads (up to {FORMAT_VERSION}); load it with the streamrl that saved it, or a "
            "newer one")


def _enc(v: Hashable) -> Any:
    """A tag value as plain data (tuples and bytes tagged, since a tuple packs as a list
    and lists are not hashable)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"tuple": [_enc(x) for x in v]}
    if isinstance(v, bytes):
        return {"bytes": v.hex()}
    raise CheckpointError(
        f"a tag value {v!r} ({type(v).__name__}) cannot be saved; group and balance keys "
        "must be str, int, float, bool, None, bytes or tuples of those")


def _dec(v: Any) -> Hashable:
    if isinstance(v, dict):
        if "tuple" in v:
            return tuple(_dec(x) for x in v["tuple"])
        if "bytes" in v:
            return bytes.fromhex(v["bytes"])
        raise CheckpointError(f"a saved tag value {v!r} is not one state_dict() writes")
    if isinstance(v, list):  # a tuple packed by something else than state_dict()
        return tuple(_dec(x) for x in v)
    return v
