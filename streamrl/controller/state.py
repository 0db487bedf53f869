"""The controller's source of truth: row and partition records, counters, id counters.

Everything here is what :meth:`Controller.state_dict` saves. The indexes built over it
(subscriptions, filter buckets, deadline heaps; see :mod:`.index`, :mod:`.groups`,
:mod:`.leases`) are derived, and rebuilt by :meth:`Controller.load_state_dict`.

Sets of tasks, filters and fields are int bitmasks whose bits come from the registries
kept here (:meth:`State._bit`): ints and str->int dicts are not tracked by the cyclic GC,
which otherwise costs as much as the bookkeeping itself with many rows held. Bits depend
on the order names were first seen, so a saved state names them instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidArgument
from ..messages import FilterJob, FilterSpec, Undo, WriteToken
from ..stats import Histogram, PartitionCounters

if TYPE_CHECKING:
    from ..config import QueueConfig
    from ..sampling import Sampler
    from .leases import _Lease

_MISSING = object()
_NO_FIELDS: dict[str, int] = {}  # (shared by every row without a field: never changed)
_NO_TAGS_D: dict[str, Hashable] = {}  # (shared by every row without a tag: never changed)
_NO_TAGS: frozenset[str] = frozenset()

#: outcomes of finished leases (and ids of expired writes) kept for idempotent acks and
#: clear errors
LEASE_MEMORY = 65536
#: leases that ended without an ack (expired, released, emptied by a retract) whose
#: outcome is remembered, so that a late ack of one of them raises; acked leases need no
#: memory. Past this many, the oldest are forgotten and a late ack of a lease that old
#: raises too (its outcome is unknown: it may have been handed out again).
OUTCOME_MEMORY = 1 << 20


class Row:
    """Metadata of one row. Internal."""

    __slots__ = (
        "id", "part", "shard", "version", "fields", "nbytes", "tags", "leased", "acked",
        "pending", "judging", "writing", "delivered", "born",
    )

    def __init__(self, rid: int, part: "Partition", shard: int, version: int,
                 born: float = 0.0, fields: dict[str, int] | None = None, nbytes: int = 0,
                 pending: int = 0, writing: int = 0):
        self.id = rid
        self.born = born  # when it was admitted (the controller's clock)
        self.part = part
        self.shard = shard
        self.version = version
        # ready field -> bytes. Never changed in place: rows of one shape share one dict
        # (a put's rows, one per put), and a change gives the row a new one
        self.fields: dict[str, int] = _NO_FIELDS if fields is None else fields
        self.nbytes = nbytes  # committed bytes
        self.tags: dict[str, Hashable] = _NO_TAGS_D  # (shared until a tag is set: never changed)
        self.leased: dict[str, int] = {}  # task -> lease id
        self.acked = 0  # tasks that acknowledged it
        self.pending = pending  # filters that have not judged it yet
        self.judging = 0  # filters judging it right now
        self.writing = writing  # fields with a write in flight
        self.delivered = 0  # tasks it was ever handed to


class Partition:
    """A named set of rows with one lifetime. Internal."""

    __slots__ = ("name", "rows", "sealed", "consumers", "cmask", "acked", "groups", "tasks",
                 "put", "bytes_put", "counts")

    def __init__(self, name: str, consumers: frozenset[str] | None, cmask: int = 0):
        self.name = name
        self.rows: dict[int, Row] = {}
        self.sealed = False
        self.consumers = consumers
        self.cmask = cmask  # bitmask of the consumers
        self.acked: dict[str, int] = {}  # task -> live rows of this partition it acked
        self.groups: dict[str, dict[Hashable, dict[int, None]]] = {}  # tag -> key -> rows
        self.tasks: set[str] = set()  # tasks that took rows from here
        self.put = 0  # rows ever admitted here (counters of the partition's lifetime)
        self.bytes_put = 0  # bytes ever written here
        self.counts = PartitionCounters()  # delivered, acked, dropped... (metrics labels)

    def remaining(self, task: str) -> int:
        return len(self.rows) - self.acked.get(task, 0)


class State:
    """The records and counters every other part of the controller reads and writes.

    Attributes read by the service and the transports (keep them): ``rows``, ``parts``,
    ``leases``, ``subs``, ``closed``, ``version``, ``capacity``, ``capacity_bytes``,
    ``bytes_held``, ``reserved_bytes``, ``dead_shards``, ``deletes``, ``filter_jobs``,
    ``field_deletes``, ``clock``, ``max_lead``, ``num_shards``, ``_tokens`` and the
    ``c_*`` counters.
    """

    # configuration, set by Controller.__init__ (not state: a load keeps its own).
    # Declared for the type checker; class annotations create nothing at run time.
    config: QueueConfig
    capacity: int
    capacity_bytes: int | None
    num_shards: int
    lease_timeout: float
    max_staleness: int | None
    max_lead: int | None
    default_consumers: frozenset[str] | None
    group_key: str | None
    sampler: Sampler
    clock: Callable[[], float]

    def _init_state(self) -> None:
        self.version: int = 0
        self.closed: bool = False
        self.sealed_all: bool = False  # seal() of the whole queue: no new rows anywhere
        self.rows: dict[int, Row] = {}
        self.parts: dict[str, Partition] = {}
        # sealed partitions whose last row left: forgotten (streams over them end at once)
        self.retired: set[str] = set()
        self.bytes_held: int = 0
        self.reserved_bytes: int = 0
        # next ids: never reused, whether or not they are ever used
        self._next_id: int = 0
        self._next_lease: int = 1
        self._next_token: int = 1
        self._next_job: int = 1
        self._unit_ids: dict[int, list[list[int]]] = {}  # shard -> [next, end) id blocks
        self._next_shard: int = 0
        self.dead_shards: set[int] = set()  # storage units known to be gone

        self.leases: dict[int, _Lease] = {}  # lease id -> lease (see .leases)
        self._lease_outcome: OrderedDict[int, str | list] = OrderedDict()
        self._outcome_floor: int = 0  # leases up to this id may have a forgotten outcome
        self._tokens: dict[int, WriteToken] = {}  # writes admitted, not committed
        self._expired_tokens: OrderedDict[int, None] = OrderedDict()
        self._retracted: OrderedDict[int, None] = OrderedDict()  # write tokens taken back
        self._jobs: dict[int, FilterJob] = {}  # filter jobs waiting for their verdict

        self.dtypes: dict[str, str] = {}  # field -> its one dtype ("torch.int64", "object")
        # tags: fields whose scalar value per row is kept (group keys, balance keys,
        # samplers' fields), queue-wide (filters, requests over every partition) or for
        # one partition only (requests naming it): a group key of one partition says
        # nothing of another's field of the same name
        self.tag_fields: set[str] = set()
        self.part_tags: dict[str, set[str]] = {}
        self.filters: dict[str, FilterSpec] = {}
        self._tbits: dict[str, int] = {}  # task -> bit
        self._fbits: dict[str, int] = {}  # filter -> bit
        self._field_bits: dict[str, int] = {}  # field -> bit (writes in flight)

        # counters
        self.c_put: int = 0
        self.c_bytes_put: int = 0
        self.c_bytes_freed: int = 0
        self.c_writes_expired: int = 0
        self.c_dropped: dict[str, int] = {}
        self.c_bytes_dropped: dict[str, int] = {}  # per reason, like c_dropped
        self.c_filtered_by: dict[str, int] = {}
        self.c_bytes_filtered_by: dict[str, int] = {}  # filter -> bytes of rows it rejected
        self.c_filter_errors: dict[str, int] = {}
        self.c_delivered: dict[str, int] = {}
        self.c_acked: dict[str, int] = {}
        self.c_redelivered: dict[str, int] = {}
        self.c_bytes_delivered: dict[str, int] = {}  # task -> bytes of asked-for fields
        self.c_bytes_acked: dict[str, int] = {}  # (the same bytes, of rows acknowledged)
        self.c_bytes_redelivered: dict[str, int] = {}  # (of rows handed out again)
        # task -> latency from a row's admission to its first delivery to the task, of
        # the rows of partitions forgotten (each partition held keeps its own, in
        # Partition.counts.delivery: see Introspect.delivery_histogram)
        self.h_delivery: dict[str, Histogram] = {}
        self.c_expired: dict[str, int] = {}

    def _init_outboxes(self) -> None:
        """Side effects for the caller to carry out (see :meth:`drain`)."""
        self.deletes: dict[int, list[int]] = {}
        # ({shard: rows}, fields) a write to existing rows may have stored before it was
        # aborted for taking too long: the caller deletes those fields from storage
        self.field_deletes: list[Undo] = []
        self.filter_jobs: list[FilterJob] = []
        self.woken: set[tuple] = set()
        self.changed: set[str | None] = set()
        self.space_freed: bool = False

    # ------------------------------------------------------------------ registries

    def _bit(self, table: dict[str, int], name: str) -> int:
        b = table.get(name)
        if b is None:
            b = table[name] = 1 << len(table)
        return b

    def _mask(self, tasks: Iterable[str] | None) -> int:
        m = 0
        for t in tasks or ():
            m |= self._bit(self._tbits, t)
        return m

    @staticmethod
    def _names(table: dict[str, int], mask: int) -> list[str]:
        return [n for n, b in table.items() if mask & b] if mask else []

    # ------------------------------------------------------------------ partitions

    def _part(self, name: str) -> Partition:
        """Partition ``name``, created if it is new."""
        p = self.parts.get(name)
        if p is None:
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"partition must be a non-empty str, got {name!r}")
            p = self.parts[name] = Partition(name, self.default_consumers,
                                             self._mask(self.default_consumers))
            p.sealed = self.sealed_all  # (the whole queue sealed: so is every partition)
        return p

    def _remaining_all(self, task: str) -> int:
        return len(self.rows) - sum(p.acked.get(task, 0) for p in self.parts.values())

    def _tagged(self, field: str, partition: str | None) -> bool:
        """Whether rows of ``partition`` keep a tag of ``field``."""
        return field in self.tag_fields or (
            partition is not None and field in self.part_tags.get(partition, ()))

    def _tag_scope(self, field: str, partition: str | None) -> None:
        """Keep tags of ``field`` for rows of ``partition`` (``None``: every partition)."""
        if partition is None:
            self.tag_fields.add(field)
        else:
            self.part_tags.setdefault(partition, set()).add(field)

    def tags_of(self, partition: str | None) -> frozenset[str]:
        """The tag fields of rows of ``partition``."""
        if partition is None:
            return frozenset(self.tag_fields)
        mine = self.part_tags.get(partition)
        if not mine:
            return frozenset(self.tag_fields) if self.tag_fields else _NO_TAGS
        return frozenset(self.tag_fields | mine)

    def _remember(self, lid: int, outcome: str | list) -> None:
        """Remember how lease ``lid`` ended, unless it was acked (a lease that is not
        live and not remembered was acked, or is older than :attr:`_outcome_floor`)."""
        if outcome == "acked":
            return
        self._lease_outcome[lid] = outcome
        if len(self._lease_outcome) > OUTCOME_MEMORY:
            old, _ = self._lease_outcome.popitem(last=False)
            self._outcome_floor = max(self._outcome_floor, old)


def _dtype_name(d: str) -> str:
    return "Python objects" if d == "object" else d.replace("torch.", "")


def _by_shard_of(rows: Iterable[Row]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in rows:
        out.setdefault(r.shard, []).append(r.id)
    return out


def _consumers(consumers: Sequence[str] | None) -> frozenset[str] | None:
    if consumers is None:
        return None
    if isinstance(consumers, str):
        consumers = [consumers]
    out = frozenset(consumers)
    if not out or not all(isinstance(c, str) and c for c in out):
        raise InvalidArgument(
            f"consumers must be a non-empty list of task names (or None), got {consumers!r}")
    return out
