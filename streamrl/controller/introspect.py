"""Outboxes and introspection: what the caller must do after a call (:meth:`drain`), and
the read-only views ``stats()`` is built from."""

from __future__ import annotations

from ..messages import FilterJob
from ..stats import Histogram
from .base import ControllerBase
from .state import Row


class Introspect(ControllerBase):
    """Outboxes and stats helpers (part of :class:`Controller`)."""

    def drain(self) -> tuple[dict[int, list[int]], list[FilterJob], set[tuple], set, bool]:
        """Take and reset the outboxes: (deletes, filter_jobs, woken, changed, space_freed)."""
        out = (self.deletes, self.filter_jobs, self.woken, self.changed, self.space_freed)
        self.deletes, self.filter_jobs, self.woken, self.changed = {}, [], set(), set()
        self.space_freed = False
        return out

    def delivery_histogram(self, task: str) -> Histogram | None:
        """Latency from a row's put to its first delivery to ``task``, over every row
        (a new histogram; ``None``: the task was handed no row). Recorded once per row,
        in the row's partition; a partition forgotten leaves its share in
        ``h_delivery``."""
        out = self.h_delivery.get(task)
        for p in self.parts.values():
            h = p.counts.delivery.get(task)
            if h is not None:
                out = h if out is None else out.merge(h)
        return None if out is None else out.merge(Histogram())

    def task_bit(self, task: str) -> int:
        """The bit of ``task`` in rows' ``acked`` masks (0: a task that never asked)."""
        return self._tbits.get(task, 0)

    def rows_in_writes(self) -> tuple[set[int], set[int]]:
        """Rows of writes admitted and not yet committed: ``(new rows being put, existing
        rows whose fields are being written)``."""
        new: set[int] = set()
        fields: set[int] = set()
        for tok in self._tokens.values():
            (new if tok.new_rows else fields).update(tok.rows)
        return new, fields

    def pending_filter_rows(self) -> dict[str, int]:
        """Per filter, live rows it has not judged yet."""
        out = {name: 0 for name in self.filters}
        for row in self.rows.values():
            for name in self._names(self._fbits, row.pending | row.judging):
                out[name] += 1
        return out

    def partition_states(self) -> dict[str, dict[str, int]]:
        """Rows held per partition and per state: ``waiting`` (no subscription can take
        them yet), ``ready`` (deliverable to some task), ``leased``, ``consumed``
        (acknowledged by some task, not leased, still held); ``bytes`` written and held;
        ``put`` and ``bytes_put``, rows and bytes ever put into it."""
        ready: set[int] = set()
        for sub in self.subs.values():
            ready.update(sub.avail)
        out: dict[str, dict[str, int]] = {}
        for p in self.parts.values():
            st = {"rows": len(p.rows), "waiting": 0, "ready": 0, "leased": 0, "consumed": 0,
                  "sealed": int(p.sealed), "put": p.put, "bytes_put": p.bytes_put}
            nbytes = 0
            for row in p.rows.values():
                nbytes += row.nbytes
                if row.leased:
                    st["leased"] += 1
                elif row.id in ready:
                    st["ready"] += 1
                elif row.acked:
                    st["consumed"] += 1
                else:
                    st["waiting"] += 1
            st["bytes"] = nbytes
            out[p.name] = st
        return out

    def task_states(self) -> dict[str, dict[str, int]]:
        """Per task (that asked for rows): rows held that it could take at once
        (``ready``) and rows it has neither consumed nor leased and cannot take yet
        (``waiting``: fields missing, a filter pending), within the partitions its
        requests name."""
        out: dict[str, dict[str, int]] = {}
        for task, subs in self._subs_by_task.items():
            if not subs:
                continue
            ready: set[int] = set()
            scope: dict[int, Row] = {}
            for sub in subs:
                ready.update(sub.avail)
                rows = (self.rows if sub.partition is None
                        else self.parts[sub.partition].rows if sub.partition in self.parts
                        else {})
                scope.update(rows)
            bit = self._tbits.get(task, 0)
            waiting = sum(1 for rid, row in scope.items()
                          if rid not in ready and not row.acked & bit and task not in row.leased)
            out[task] = {"ready": len(ready), "waiting": waiting}
        return out

    def leaked(self) -> dict[str, int]:
        """Rows still held in sealed partitions that no task will ever take: not leased,
        and acknowledged by every declared consumer (or, with none declared, by every
        task that has read from the partition)."""
        out: dict[str, int] = {}
        for p in self.parts.values():
            if not p.sealed or not p.rows:
                continue
            mask = p.cmask or self._mask(p.tasks)
            if not mask:
                continue
            n = sum(1 for r in p.rows.values() if not r.leased and r.acked & mask == mask)
            if n:
                out[p.name] = n
        return out

    def held_by_partition(self) -> dict[str, int]:
        """Rows held per partition (partitions holding none are left out)."""
        return {p.name: len(p.rows) for p in self.parts.values() if p.rows}
