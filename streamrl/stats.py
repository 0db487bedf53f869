"""Queue statistics, as returned by :meth:`streamrl.StreamQueue.stats`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Stats", "TaskStats"]


@dataclass
class TaskStats:
    """Counters of one task (consumer role). ``delivered`` counts rows handed out
    (redeliveries included), ``acked`` rows acknowledged, ``redelivered`` rows handed out
    again after a release or lease expiry, ``expired`` rows whose lease timed out, and
    ``leased`` rows held right now."""

    delivered: int = 0
    acked: int = 0
    redelivered: int = 0
    expired: int = 0
    leased: int = 0


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
            ``filter_error``, ``stale``, ``consumed``, ``dp_remainder``, ``lost``.
        filtered: rows rejected by filters.
        filtered_by: rows rejected, per filter name.
        filter_errors: rows dropped because their filter raised.
        filter_pending: per filter, rows it has not judged yet (a filter over a field that
            is never written shows its rows here).
        stale: rows dropped for staleness.
        consumed: rows dropped because every declared consumer acknowledged them.
        delivered: rows handed out, over all tasks (redeliveries included).
        tasks: per-task :class:`TaskStats`.
        partitions: per partition, rows held by state (``waiting``, ``ready``, ``leased``,
            ``consumed``) and whether it is ``sealed``.
        leaked: rows held in sealed partitions that no task will take any more (should be
            0 at the end of a run).
        leases: open leases.
        waiting_puts: producers waiting for room or for version pacing.
        writes_expired: admitted writes aborted because they were not committed within
            ``lease_timeout`` (their writer presumed dead).
        wait_p50: median seconds consumers waited for a batch (recent 10k takes).
        wait_p99: 99th percentile of the same.
        unit_rows: rows each storage unit reports holding itself.
        unit_bytes: bytes each storage unit reports holding itself.
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
            by each client without waiting: eventually consistent. Empty for the
            embedded transport.
        closed: whether the queue is closed.
        last_filter_errors: messages of the last filter failures.
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
    filtered: int = 0
    filtered_by: dict[str, int] = field(default_factory=dict)
    filter_errors: int = 0
    filter_pending: dict[str, int] = field(default_factory=dict)
    stale: int = 0
    consumed: int = 0
    delivered: int = 0
    tasks: dict[str, TaskStats] = field(default_factory=dict)
    partitions: dict[str, dict[str, int]] = field(default_factory=dict)
    leaked: int = 0
    leases: int = 0
    waiting_puts: int = 0
    writes_expired: int = 0
    wait_p50: float | None = None
    wait_p99: float | None = None
    unit_rows: list[int] = field(default_factory=list)
    unit_bytes: list[int] = field(default_factory=list)
    unit_shared_bytes: list[int] = field(default_factory=list)
    unit_pinned_bytes: list[int] = field(default_factory=list)
    bytes_by_path: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    last_filter_errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """A plain dict (for logging or JSON)."""
        return asdict(self)

    def summary(self) -> str:
        """One line: rows put / filtered / stale / consumed / held / leaked."""
        return (f"put={self.put} filtered={self.filtered} stale={self.stale} "
                f"consumed={self.consumed} dropped={self.dropped} held={self.rows} "
                f"bytes={self.bytes} leaked={self.leaked}")
