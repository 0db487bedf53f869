"""Queue statistics, as returned by :meth:`streamrl.StreamQueue.stats`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Stats", "TaskStats", "Histogram", "PartitionCounters"]


class Histogram:
    """A latency histogram with power-of-two buckets: constant memory, O(1) to record,
    quantiles within a factor of 2 (the upper bound of their bucket). Bucket ``i`` counts
    values in ``[2**(i-1), 2**i)`` microseconds (bucket 0: under 1 us); the last of the
    37 buckets, from ``2**35`` us (about 9.5 hours) up, also takes every longer value, and
    its upper bound, ``2**36`` us, is about 19 hours."""

    __slots__ = ("counts", "count", "sum")

    NBUCKETS = 37

    def __init__(self) -> None:
        self.counts = [0] * self.NBUCKETS
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Record one value (seconds)."""
        # the bucket of us in [2**(i-1), 2**i) is i, the bit length of int(us)
        i = int(seconds * 1e6).bit_length() if seconds > 0 else 0
        self.counts[i if i < 37 else 36] += 1  # (37: NBUCKETS)
        self.count += 1
        self.sum += seconds

    def observe_n(self, seconds: float, n: int) -> None:
        """Record the same value ``n`` times (the rows of one put share their latency)."""
        i = int(seconds * 1e6).bit_length() if seconds > 0 else 0
        self.counts[i if i < 37 else 36] += n
        self.count += n
        self.sum += seconds * n

    @staticmethod
    def bound(i: int) -> float:
        """The upper bound of bucket ``i``, in seconds."""
        return (2.0 ** i) / 1e6

    def quantile(self, q: float) -> float | None:
        """The upper bound (seconds) of the bucket holding the ``q`` quantile, or
        ``None`` when empty."""
        if not self.count:
            return None
        rank = q * self.count
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.bound(i)
        return self.bound(self.NBUCKETS - 1)

    def merge(self, other: "Histogram") -> "Histogram":
        out = Histogram()
        out.counts = [a + b for a, b in zip(self.counts, other.counts)]
        out.count, out.sum = self.count + other.count, self.sum + other.sum
        return out

    def to_dict(self) -> dict:
        return {"counts": list(self.counts), "count": self.count, "sum": self.sum}

    def __reduce__(self):
        return (_histogram, (self.to_dict(),))


def _histogram(d: dict) -> Histogram:
    h = Histogram()
    h.counts, h.count, h.sum = list(d["counts"]), d["count"], d["sum"]
    return h


#: the per-task counters of a partition (:attr:`Stats.partition_tasks`), in the order
#: :class:`PartitionCounters` keeps them
PART_TASK_KEYS = ("delivered", "bytes", "redelivered", "bytes_redelivered", "acked",
                  "bytes_acked")


class PartitionCounters:
    """Counters of one partition over its lifetime, kept by the controller on the
    partition (and saved with it), so they go when a sealed partition is forgotten:
    the metrics labelled by partition only ever name partitions held now. Internal.

    Attributes:
        tasks: task -> ``[delivered, bytes, redelivered, bytes_redelivered, acked,
            bytes_acked]`` (see :data:`PART_TASK_KEYS`).
        dropped: reason -> ``[rows, bytes]`` of the rows that left the partition.
        delivery: task -> histogram of put -> first delivery of the partition's rows.
        wait: task -> histogram of how long takes naming the partition waited.
    """

    __slots__ = ("tasks", "dropped", "delivery", "wait")

    def __init__(self) -> None:
        self.tasks: dict[str, list[int]] = {}
        self.dropped: dict[str, list[int]] = {}
        self.delivery: dict[str, Histogram] = {}
        self.wait: dict[str, Histogram] = {}

    def task(self, task: str) -> list[int]:
        """The counters of ``task`` (made at first use)."""
        c = self.tasks.get(task)
        if c is None:
            c = self.tasks[task] = [0] * len(PART_TASK_KEYS)
        return c

    def hist(self, table: dict[str, Histogram], task: str) -> Histogram:
        """The histogram of ``task`` in ``table`` (:attr:`delivery` or :attr:`wait`)."""
        h = table.get(task)
        if h is None:
            h = table[task] = Histogram()
        return h

    def drop(self, reason: str, rows: int, nbytes: int) -> None:
        d = self.dropped.get(reason)
        if d is None:
            d = self.dropped[reason] = [0, 0]
        d[0] += rows
        d[1] += nbytes

    def state_dict(self) -> dict:
        """The counters, as plain data (histograms are not saved: they restart)."""
        return {"tasks": {t: list(c) for t, c in self.tasks.items()},
                "dropped": {r: list(d) for r, d in self.dropped.items()}}

    def load_state_dict(self, d: dict | None) -> None:
        for t, c in ((d or {}).get("tasks") or {}).items():
            self.tasks[str(t)] = [int(v) for v in c]
        for r, c in ((d or {}).get("dropped") or {}).items():
            self.dropped[str(r)] = [int(v) for v in c]


def partition_stats(parts) -> dict:
    """The per-partition fields of :class:`Stats` from the controller's partitions
    (objects with ``name`` and ``counts``, a :class:`PartitionCounters`)."""
    tasks: dict[str, dict[str, dict[str, int]]] = {}
    dropped: dict[str, dict[str, int]] = {}
    bdropped: dict[str, dict[str, int]] = {}
    delivery: dict[str, dict[str, Histogram]] = {}
    wait: dict[str, dict[str, Histogram]] = {}
    for p in parts:
        c: PartitionCounters = p.counts
        if c.tasks:
            tasks[p.name] = {t: dict(zip(PART_TASK_KEYS, v)) for t, v in c.tasks.items()}
        if c.dropped:
            dropped[p.name] = {r: d[0] for r, d in c.dropped.items()}
            bdropped[p.name] = {r: d[1] for r, d in c.dropped.items()}
        if c.delivery:
            delivery[p.name] = {t: h.merge(Histogram()) for t, h in c.delivery.items()}
        if c.wait:
            wait[p.name] = {t: h.merge(Histogram()) for t, h in c.wait.items()}
    return {"partition_tasks": tasks, "partition_dropped_by": dropped,
            "partition_bytes_dropped_by": bdropped, "partition_delivery": delivery,
            "partition_wait": wait}


@dataclass
class TaskStats:
    """Counters of one task (consumer role).

    Attributes:
        delivered: rows handed out (redeliveries included).
        acked: rows acknowledged.
        redelivered: rows handed out again after a release or lease expiry.
        expired: rows whose lease timed out.
        leased: rows held right now.
        bytes: bytes of the asked-for fields of the rows handed out (as put).
        bytes_acked: the same bytes, of the rows acknowledged.
        bytes_redelivered: the same bytes, of the rows handed out again.
        ready: rows held now that the task could take at once.
        waiting: rows held now that the task has not consumed and cannot take yet
            (fields missing, a filter pending).
        delivery_p50, delivery_p99: seconds from a row's put to its first delivery to
            the task (upper bounds of power-of-two buckets).
        wait_p50, wait_p99: seconds the task's takes waited for a batch (same buckets).
        delivery_latency, wait: the histograms themselves (for exporters).
    """

    delivered: int = 0
    acked: int = 0
    redelivered: int = 0
    expired: int = 0
    leased: int = 0
    bytes: int = 0
    bytes_acked: int = 0
    bytes_redelivered: int = 0
    ready: int = 0
    waiting: int = 0
    delivery_p50: float | None = None
    delivery_p99: float | None = None
    wait_p50: float | None = None
    wait_p99: float | None = None
    delivery_latency: Histogram | None = field(default=None, repr=False, compare=False)
    wait: Histogram | None = field(default=None, repr=False, compare=False)


@dataclass
class Stats:
    """A snapshot of a queue.

    Attributes:
        rows: rows held now (admitted, not dropped).
        bytes: bytes held now, as accounted by the controller: written bytes plus the
            bytes reserved by puts in flight, so that ``rows`` and ``bytes`` describe the
            same rows.
        bytes_in_flight: bytes reserved by puts whose data is still on its way.
        capacity: the bound on rows.
        capacity_bytes: the bound on bytes (``None``: none).
        version: the current policy version.
        put: rows ever admitted.
        bytes_put: bytes ever written.
        bytes_freed: bytes of rows that left the queue.
        dropped: rows that left the queue.
        dropped_by: rows that left, per reason: ``dropped``, ``cleared``, ``filtered``,
            ``filter_error``, ``stale``, ``consumed``, ``dp_remainder``, ``lost``,
            ``cancelled`` (a put that was cancelled, or failed, after its rows landed).
        bytes_dropped_by: bytes of those rows, per the same reasons.
        filtered: rows rejected by filters.
        filtered_by: rows rejected, per filter name.
        bytes_filtered_by: bytes of those rows, per filter name.
        filter_errors: rows dropped because their filter raised.
        filter_pending: per filter, rows it has not judged yet (a filter over a field that
            is never written shows its rows here).
        stale: rows dropped for staleness.
        consumed: rows dropped because every declared consumer acknowledged them.
        delivered: rows handed out, over all tasks (redeliveries included).
        tasks: per-task :class:`TaskStats`.
        partitions: per partition held now (a sealed partition is forgotten once its
            last row left): ``rows`` held, and by state (``waiting``, ``ready``,
            ``leased``, ``consumed``); ``bytes`` written and held (without the bytes
            reserved by puts in flight); ``put`` and ``bytes_put``, rows and bytes ever
            put into it; whether it is ``sealed`` (0 or 1).
        partition_tasks: per partition held now, per task: rows and bytes (of the
            asked-for fields) ``delivered``, ``redelivered`` and ``acked`` from it
            (``bytes``, ``bytes_redelivered``, ``bytes_acked``), over the partition's
            lifetime. Like :attr:`partitions`, a sealed partition is forgotten once its
            last row left, and its counters with it.
        partition_dropped_by: per partition held now, rows that left it per reason
            (the reasons of :attr:`dropped_by`).
        partition_bytes_dropped_by: bytes of those rows.
        partition_delivery: per partition held now, per task: the histogram of put ->
            first delivery of the partition's rows.
        partition_wait: per partition held now, per task: the histogram of how long
            takes that named the partition waited (takes over every partition are in
            :attr:`TaskStats.wait` only).
        leaked: rows held in sealed partitions that no task will take any more (should be
            0 at the end of a run).
        leases: open leases.
        waiting_puts: put requests waiting for room or for version pacing (on Ray, small
            puts of one process that wait together are one request).
        writes_expired: admitted writes aborted because they were not committed within
            ``lease_timeout`` (their writer presumed dead).
        wait_p50: median seconds consumers waited for a batch (recent 10k takes).
        wait_p99: 99th percentile of the same.
        unit_rows: rows each storage unit reports holding itself.
        unit_bytes: bytes each storage unit reports holding itself.
        unit_usage: where each storage unit keeps those bytes, from its backend's
            ``usage()``: at least ``memory`` and ``disk`` (summing to its ``unit_bytes``);
            the spill backend adds ``memory_tensors``, ``file``, ``bytes_spilled`` and
            ``bytes_read_back``. ``{}`` for a unit that did not answer.
        unit_shared_bytes: Ray transport: shared memory each storage unit's arena holds
            (used or free; its high-water mark). Empty for the embedded transport.
        unit_pinned_bytes: Ray transport: bytes of each arena that readers still view
            (blocks not reused until those tensors are gone).
        bytes_by_path: Ray transports: bytes moved between processes so far, per path:
            ``"shm"`` (through a storage unit's shared-memory arena), ``"inline"``
            (inside calls to storage units), ``"rdt"`` (tensors moved from the process
            that holds them by Ray Direct Transport: gloo, nccl or nixl), ``"socket"``
            (held tensors served over the holder's socket when RDT cannot serve the
            read), ``"local"`` (held tensors read by the process holding them). Reported
            by each client without waiting, at most every 0.05 s a process
            (``streamrl.transport.ray.data.REPORT_EVERY``) and before each ``stats()``
            call of that process: eventually consistent across processes. Moves made
            less than 0.05 s before a process exits, or before the event loop that made
            them ends, are reported only with that process's next move or ``stats()``
            call, if any. Empty for the embedded transport.
        closed: whether the queue is closed.
        last_filter_errors: messages of the last filter failures.

    Examples:
        >>> import asyncio, torch, streamrl
        >>> async def main():
        ...     async with streamrl.StreamQueue(capacity=16) as q:
        ...         rows = await q.put({"x": torch.zeros(4, 2)})   # 4 rows of 8 bytes
        ...         st = await q.stats()
        ...         held = (st.rows, st.bytes)
        ...         await rows.drop()
        ...         st = await q.stats()
        ...         return held, (st.rows, st.bytes, st.dropped)
        >>> asyncio.run(main())
        ((4, 32), (0, 0, 4))
    """

    rows: int = 0
    bytes: int = 0
    bytes_in_flight: int = 0
    capacity: int = 0
    capacity_bytes: int | None = None
    version: int = 0
    put: int = 0
    bytes_put: int = 0
    bytes_freed: int = 0
    dropped: int = 0
    dropped_by: dict[str, int] = field(default_factory=dict)
    bytes_dropped_by: dict[str, int] = field(default_factory=dict)
    filtered: int = 0
    filtered_by: dict[str, int] = field(default_factory=dict)
    bytes_filtered_by: dict[str, int] = field(default_factory=dict)
    filter_errors: int = 0
    filter_pending: dict[str, int] = field(default_factory=dict)
    stale: int = 0
    consumed: int = 0
    delivered: int = 0
    tasks: dict[str, TaskStats] = field(default_factory=dict)
    partitions: dict[str, dict[str, int]] = field(default_factory=dict)
    partition_tasks: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    partition_dropped_by: dict[str, dict[str, int]] = field(default_factory=dict)
    partition_bytes_dropped_by: dict[str, dict[str, int]] = field(default_factory=dict)
    partition_delivery: dict[str, dict[str, Histogram]] = field(
        default_factory=dict, repr=False, compare=False)
    partition_wait: dict[str, dict[str, Histogram]] = field(
        default_factory=dict, repr=False, compare=False)
    leaked: int = 0
    leases: int = 0
    waiting_puts: int = 0
    writes_expired: int = 0
    wait_p50: float | None = None
    wait_p99: float | None = None
    unit_rows: list[int] = field(default_factory=list)
    unit_bytes: list[int] = field(default_factory=list)
    unit_usage: list[dict[str, int]] = field(default_factory=list)
    unit_shared_bytes: list[int] = field(default_factory=list)
    unit_pinned_bytes: list[int] = field(default_factory=list)
    bytes_by_path: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    last_filter_errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """A plain dict (for logging or JSON); histograms as ``{counts, count, sum}``."""
        out = asdict(self)
        for name, t in self.tasks.items():
            for k in ("delivery_latency", "wait"):
                h = getattr(t, k)
                out["tasks"][name][k] = None if h is None else h.to_dict()
        for k in ("partition_delivery", "partition_wait"):
            out[k] = {p: {t: h.to_dict() for t, h in by_task.items()}
                      for p, by_task in getattr(self, k).items()}
        return out

    def summary(self) -> str:
        """A readable summary: one line of totals (rows put / filtered / stale / consumed
        / held / leaked), then one line per task and per partition."""
        lines = [f"put={self.put} filtered={self.filtered} stale={self.stale} "
                 f"consumed={self.consumed} dropped={self.dropped} held={self.rows} "
                 f"bytes={self.bytes} leaked={self.leaked}"]
        if self.tasks:
            lines.append(f"{'task':<16}{'delivered':>10}{'acked':>8}{'again':>7}{'leased':>8}"
                         f"{'ready':>7}{'waiting':>8}{'MB':>9}{'put->deliv p50/p99':>21}"
                         f"{'wait p50/p99':>16}")
            for name in sorted(self.tasks):
                t = self.tasks[name]
                lines.append(
                    f"{name[:15]:<16}{t.delivered:>10}{t.acked:>8}{t.redelivered:>7}"
                    f"{t.leased:>8}{t.ready:>7}{t.waiting:>8}{t.bytes / 1e6:>9.1f}"
                    f"{_dur(t.delivery_p50) + ' / ' + _dur(t.delivery_p99):>21}"
                    f"{_dur(t.wait_p50) + ' / ' + _dur(t.wait_p99):>16}")
        if self.partitions:
            lines.append(f"{'partition':<16}{'rows':>8}{'waiting':>9}{'ready':>7}"
                         f"{'leased':>8}{'consumed':>10}{'put':>9}{'MB':>9}  sealed")
            for name in sorted(self.partitions):
                p = self.partitions[name]
                lines.append(f"{name[:15]:<16}{p.get('rows', 0):>8}{p.get('waiting', 0):>9}"
                             f"{p.get('ready', 0):>7}{p.get('leased', 0):>8}"
                             f"{p.get('consumed', 0):>10}{p.get('put', 0):>9}"
                             f"{p.get('bytes', 0) / 1e6:>9.1f}"
                             f"  {'yes' if p.get('sealed') else 'no'}")
        return "\n".join(lines)


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f}us"
    if s < 1.0:
        return f"{s * 1e3:.0f}ms"
    return f"{s:.1f}s"
