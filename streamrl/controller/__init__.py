"""The controller: a pure state machine over row metadata.

It holds no data and does no I/O and no waiting. It knows, for every row: its partition,
its storage unit (shard), its policy version, which fields are written (and their sizes),
the scalar *tags* of registered fields (group keys, lengths), which tasks hold it leased or
have acknowledged it, and which filters still have to judge it. From that it answers the
two questions everything else is built on:

* can ``n`` more rows be admitted now (capacity in rows and bytes, version pacing)?
* which rows make the next micro-batch for a request (task, fields, partition, groups)?

Every method runs to completion synchronously. Side effects that need I/O or waking are
left in outboxes that the caller (:mod:`streamrl.service`) drains after each call:

* :attr:`Controller.deletes` -- rows to delete from each storage unit;
* :attr:`Controller.filter_jobs` -- row sets a filter function must judge;
* :attr:`Controller.woken` -- subscriptions that gained deliverable rows;
* :attr:`Controller.changed` -- partitions (``None``: all) whose end-of-stream condition
  may have changed, and :attr:`Controller.space_freed` -- capacity was released.

Readiness is indexed, not scanned: each distinct request shape (a *subscription*: task,
fields, partition, grouping) keeps an ordered set of its deliverable rows, updated when a
write, lease, ack, filter verdict or drop touches a row. Taking a batch is O(batch).

The controller is one object over one shared state, written in parts, one responsibility
each (every part is a mixin of :class:`Controller` and reads the same attributes):

* :mod:`.state` -- the source of truth: rows, partitions, counters, id counters;
* :mod:`.admission` -- capacity and pacing, row ids, placement, write tokens;
* :mod:`.lifecycle` -- consumer sets, seal and close, drop and clear, staleness, lost units;
* :mod:`.index` -- subscriptions and the readiness index (derived, rebuilt on load);
* :mod:`.leases` -- leases, acks, releases, deadlines and expiry;
* :mod:`.groups` -- tags, groups and filters;
* :mod:`.dispatch` -- selection, tails and ends, DP dispatch;
* :mod:`.introspect` -- outboxes and stats helpers;
* :mod:`.snapshot` -- ``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, final

from ..config import QueueConfig, Request, validate_request
from ..messages import (END, CommitResult, Delivery, DropReason, FilterJob, FilterSpec, Undo,
                        WriteToken)
from ..sampling import Sampler, imbalance, resolve
from ..sampling import balanced_split as _balanced_split  # noqa: F401 (its old name)
from .admission import Admission
from .dispatch import Dispatch
from .groups import Groups
from .index import Index
from .introspect import Introspect
from .leases import Leases
from .lifecycle import Lifecycle
from .snapshot import FORMAT_VERSION, Snapshot
from .state import _consumers

#: the queue options (:class:`~streamrl.config.QueueConfig` fields) the controller reads:
#: its keyword arguments
OPTIONS = ("capacity", "capacity_bytes", "num_shards", "lease_timeout", "max_staleness",
           "max_lead", "consumers", "group_key", "sampler")

__all__ = ["Controller", "OPTIONS", "validate_request", "Request", "Delivery", "END", "FilterSpec",
           "FilterJob", "DropReason", "Undo", "WriteToken", "CommitResult", "imbalance",
           "FORMAT_VERSION"]


@final  # (the composition of the parts: see .base)
class Controller(Admission, Dispatch, Leases, Groups, Lifecycle, Index, Introspect, Snapshot):
    """Metadata state machine of one queue.

    Args:
        capacity: most rows held at once (admitted and not yet dropped).

    Keyword Args:
        capacity_bytes: most bytes held at once, or ``None`` for no byte bound. Bytes are
            reserved when new rows are admitted; fields written later to admitted rows are
            always accepted (blocking them could deadlock a pipeline) and counted.
        num_shards: number of storage units rows are spread over.
        lease_timeout: seconds a delivered batch stays leased without ``ack``; also how
            long an admitted write may take to commit before it is aborted (its writer
            is presumed dead: new rows it admitted are dropped).
        max_staleness: rows whose version is older than ``version - max_staleness`` are
            dropped as stale (``None``: no bound).
        max_lead: admission pacer: new rows stamped with version ``v`` are admitted only
            while ``v <= version + max_lead`` (``None``: no pacing).
        consumers: tasks that must acknowledge a row before it is dropped automatically
            (default for partitions that do not declare their own).
        group_key: a field whose value groups rows, known from the start (a tag of
            every partition): rows dropped as stale take their group along, whether or
            not a grouped request or filter names it (``None``: group keys are those of
            grouped requests and filters).
        sampler: which ready rows a request gets unless it names its own sampler: a
            registered name, ``{"sampler": name, **options}`` or a
            :class:`~streamrl.sampling.Sampler` (see :mod:`streamrl.sampling`).
        clock: monotonic clock, injectable for tests.

    Attributes:
        sampler: the queue's :class:`~streamrl.sampling.Sampler`.

    Examples:
        >>> c = Controller(capacity=8)
        >>> tok = c.allocate("p", 4, ("x",), nbytes=64)
        >>> _ = c.commit(tok, {"x": [16] * 4})
        >>> d = c.take(Request("t", ("x",), batch_size=4, partition="p"))
        >>> d.rows
        [0, 1, 2, 3]
    """

    def __init__(
        self,
        capacity: int,
        *,
        capacity_bytes: int | None = None,
        num_shards: int = 4,
        lease_timeout: float = 600.0,
        max_staleness: int | None = None,
        max_lead: int | None = None,
        consumers: Sequence[str] | None = None,
        group_key: str | None = None,
        sampler: Any = "fifo",
        clock: Callable[[], float] = time.monotonic,
    ):
        # (the keyword form of from_config: these are QueueConfig's options, with its
        # defaults; tests/test_seams.py keeps the two equal)
        self._configure(QueueConfig(
            capacity=capacity, capacity_bytes=capacity_bytes, num_shards=num_shards,
            lease_timeout=lease_timeout, max_staleness=max_staleness, max_lead=max_lead,
            consumers=consumers, group_key=group_key, sampler=sampler), clock)

    @classmethod
    def from_config(cls, config: QueueConfig, *,
                    clock: Callable[[], float] = time.monotonic) -> "Controller":
        """The controller of a queue configured by ``config`` (it reads the options
        that concern metadata; :attr:`config` is ``config`` itself).

        Examples:
            >>> from streamrl.config import QueueConfig
            >>> Controller.from_config(QueueConfig(capacity=8, num_shards=2)).num_shards
            2
        """
        if not isinstance(config, QueueConfig):
            raise TypeError(f"Controller.from_config takes a QueueConfig, got "
                            f"{type(config).__name__}; for keywords use Controller(capacity, ...)")
        self = cls.__new__(cls)
        self._configure(config, clock)
        return self

    def _configure(self, config: QueueConfig, clock: Callable[[], float]) -> None:
        #: the options (validated by QueueConfig)
        self.config = config
        self.capacity = config.capacity
        self.capacity_bytes = config.capacity_bytes
        self.num_shards = config.num_shards
        self.lease_timeout = float(config.lease_timeout)
        self.max_staleness = config.max_staleness
        self.max_lead = config.max_lead
        self.default_consumers = _consumers(config.consumers)
        self.group_key = config.group_key
        self.sampler: Sampler = resolve(config.sampler)
        self.clock = clock
        self._init_state()
        if self.group_key is not None:
            self._tag_scope(self.group_key, None)
        self._init_index()
        self._init_outboxes()
