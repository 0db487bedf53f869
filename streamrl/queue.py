"""The async client: :class:`StreamQueue`."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
import numpy as np
import torch

from ._aio import shielded
from .batch import ColumnRemoteBatch, RemoteBatch, RowRemoteBatch
from .columns import (_PLAIN_DTYPES, _STRIDED, Column, column_dtype, dtype_name,
                      load_tensordict, one_row_dense, row_nbytes, tag_values, take_rows,
                      to_columns)
from .config import QueueConfig, check_timeout
from .control import ControlPlane
from .messages import Delivery, FilterSpec, Request
from .session import Session
from .transport import registry
from .timing import RoleTiming, Timer
from .timing import counted as _timed
from .timing import _current as _timing_now
from .timing import is_open as _timing_open
from .transport.base import DataPlane, Transport
from .errors import (EndOfStream, InvalidArgument, LeaseExpired, QueueClosed, SchemaError,
                     StreamRLError, StreamTimeout, TransportError)
from .stats import Stats

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from .checkpoint.client import CheckpointInfo, Periodic
    from .metrics import MetricsServer
    from .transport.embedded import LocalDataPlane

__all__ = ["StreamQueue", "Stream", "DEFAULT_PARTITION"]

#: Partition used by ``put`` when none is given.
DEFAULT_PARTITION = "default"

_registry: "weakref.WeakValueDictionary[int, StreamQueue]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)
#: this package's name (the modules StreamQueue looks up in sys.modules are named from it)
_PACKAGE = __name__.rpartition(".")[0]


class StreamQueue:
    """An async, sharded, bounded queue of partial samples.

    Producers ``put`` rows (or new fields of existing rows); consumers ``stream`` or
    ``get`` readiness-gated micro-batches as lazy :class:`~streamrl.RowRemoteBatch` views
    and ``materialize`` only the fields they need.

    Args:
        capacity: most rows held at once. ``put`` waits while the queue is full.
        num_shards: storage units the rows are spread over.

    Keyword Args:
        capacity_bytes: most bytes held at once (``None``: rows bound only). New rows are
            admitted only while their bytes fit; fields written to admitted rows always are.
            Rows that leave early (filtered, stale, dropped) free their room at once, so
            producers can run further ahead than the consumers' pace; pace them by version
            (``max_lead``, :meth:`wait_version`) when that matters.
        transport: ``"embedded"`` (default: everything in this process and event loop),
            ``"ray"`` (controller and storage units as Ray actors; see the deployment docs),
            or any transport registered with :func:`streamrl.transport.register`.
        lease_timeout: seconds a delivered batch stays leased without ``ack`` before its
            rows are delivered again (default 600; per stream/get too).
        max_staleness: drop rows whose version is older than ``version - max_staleness``
            (counted in ``stats().stale``); ``None`` keeps every version.
        max_lead: admission pacer: ``put`` of new rows with ``version=v`` waits while
            ``v > current version + max_lead``.
        consumers: tasks that must each acknowledge a row before it is dropped
            automatically (consumer-set cleanup); per partition with :meth:`declare`.
        name: name of the queue (Ray: actor names, :meth:`connect`).
        storage: the storage units' backend: ``"memory"`` (default), or a registered
            backend by name or as ``{"backend": name, **options}`` (docs/storage.md).
        sampler: how ready rows are picked for a request unless the request names its
            own: ``"fifo"`` (commit order, default) or a registered sampler by name or as
            ``{"sampler": name, **options}`` (docs/sampling.md).
        checkpoint_every: write a checkpoint (:meth:`checkpoint`) every this many
            seconds into ``checkpoint_dir``, from the queue's first call on, until
            :meth:`shutdown` (``None``: no periodic checkpoints). A failed one is logged.
        checkpoint_dir: where periodic checkpoints go, as ``ckpt-NNNNNNNN``
            directories; :meth:`restore` of this directory takes the newest.
        checkpoint_keep: how many periodic checkpoints to keep (the newest).
        **options: transport options (see :mod:`streamrl.transport`): for
            ``"embedded"`` ``combine_puts`` and ``put_linger`` (how one-row puts are
            combined: :func:`streamrl.transport.embedded.create`), for ``"ray"`` those
            of :data:`streamrl.transport.ray.RAY_OPTIONS`.

    Every option is a field of :class:`streamrl.config.QueueConfig`; build a queue from a
    dict or a YAML/OmegaConf config with :meth:`from_config`.

    Examples:
        >>> import asyncio, torch, streamrl
        >>> async def main():
        ...     async with streamrl.StreamQueue(capacity=64, num_shards=2) as q:
        ...         rows = await q.put({"prompt": torch.zeros(8, 4)}, partition="step-0")
        ...         await q.put({"reward": torch.ones(8)}, rows=rows)
        ...         await q.seal("step-0")
        ...         n = 0
        ...         async for mb in q.stream("train", ["prompt", "reward"], batch_size=4,
        ...                                  partition="step-0"):
        ...             td = await mb.materialize()
        ...             n += td.batch_size[0]
        ...         return n
        >>> asyncio.run(main())
        8
    """

    #: the ``/metrics`` endpoint this process serves for the queue (``metrics=``), if any
    _metrics: MetricsServer | None
    #: periodic checkpoints (``checkpoint_every``), if any
    _periodic: Periodic | None

    def __init__(self, capacity: int = 4096, num_shards: int = 4, *,
                 capacity_bytes: int | None = None, transport: "str | Transport" = "embedded",
                 lease_timeout: float = 600.0, max_staleness: int | None = None,
                 max_lead: int | None = None, consumers: Sequence[str] | None = None,
                 group_key: str | None = None,
                 name: str | None = None, storage: Any = "memory", sampler: Any = "fifo",
                 checkpoint_every: float | None = None, checkpoint_dir: str | None = None,
                 checkpoint_keep: int = 2, metrics: Any = None, **options: Any):
        if isinstance(transport, Transport):  # an already built deployment (connect, attach)
            self._config = None
            self._start(transport, name)
            return
        config = QueueConfig(
            capacity=capacity, num_shards=num_shards, capacity_bytes=capacity_bytes,
            transport=transport, lease_timeout=lease_timeout, max_staleness=max_staleness,
            max_lead=max_lead, consumers=consumers, group_key=group_key, name=name,
            storage=storage,
            sampler=sampler, checkpoint_every=checkpoint_every,
            checkpoint_dir=checkpoint_dir, checkpoint_keep=checkpoint_keep, metrics=metrics,
            options=options)
        self._config = config
        self._start(registry.resolve(config.transport)(config), name)
        if config.group_key is not None:  # (a tag of every partition: puts send its values)
            self._learn_tags(None, frozenset({config.group_key}))
        self._serve_metrics(config)
        if config.checkpoint_every is not None:
            from .checkpoint.client import Periodic  # noqa: F811 (at run time)

            assert config.checkpoint_dir is not None  # (QueueConfig checks it)
            self._periodic = Periodic(self, config.checkpoint_every, config.checkpoint_dir,
                                      config.checkpoint_keep)
            self._periodic.start()  # (or at the first call, once a loop runs)

    def _serve_metrics(self, config: QueueConfig) -> None:
        """Start the ``/metrics`` endpoint of ``metrics=`` (see :mod:`streamrl.metrics`):
        in this process for an in-process transport; transports whose controller lives
        elsewhere serve it there (``metrics_url``)."""
        from .metrics import MetricsServer, parse_spec

        addr = parse_spec(config.metrics)
        if addr is None or self._transport.metrics_url is not None:
            return
        try:
            first = asyncio.get_running_loop()
        except RuntimeError:
            first = None
        transport = self._transport

        def loop():
            return transport.owner_loop or first

        self._metrics = MetricsServer(self.stats, loop, self.name or self.queue_id[:8], addr,
                                      self._session.reads)

    @property
    def metrics_url(self) -> str | None:
        """Where the queue's Prometheus metrics are served (``metrics=``), or ``None``."""
        if self._metrics is not None:
            return self._metrics.url
        return self._transport.metrics_url

    def _start(self, transport: Transport, name: str | None) -> None:
        self._metrics = None
        self._timings: dict[str, RoleTiming] = {}
        self.name: str | None = name
        self._closed_locally = False
        # tag fields (group keys...) as the controller last said, per partition, and of
        # any partition: see _tags
        self._tags_by_part: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._tags_any: frozenset[str] = frozenset()
        self._transport: Transport = transport
        # the storage units, when they are in this process and stored to synchronously
        # (the embedded transport): a one-row put stores into its unit directly. (Its
        # modules are looked up, not imported: a transport made of them imported them,
        # and a queue of another transport, such as a Ray producer's, never loads them
        # nor the controller's state machine they import.)
        embedded = sys.modules.get(_PACKAGE + ".transport.embedded")
        combine = sys.modules.get(_PACKAGE + ".combine")
        data = transport.data
        self._units = (cast("LocalDataPlane", data).units if embedded is not None
                       and type(data) is embedded.LocalDataPlane else None)
        # the stage that combines one-row puts (the embedded transport): see combine.py
        control = transport.control
        self._stage = (control if combine is not None
                       and isinstance(control, combine.CombiningService) else None)
        # the controller service itself, when it is in this process beside the units
        # (embedded): a write to existing rows calls it without coroutines
        service = sys.modules.get(_PACKAGE + ".service")
        self._service = (control if self._units is not None and service is not None
                         and isinstance(control, service.ControllerService) else None)
        # a small put of new rows is one call to a unit, which has the controller admit
        # it (Ray; see DataPlane.put_rows)
        self._unit_puts = data.caps.unit_admitted_puts
        self._periodic = None
        self._new_rows = _NewRows(self)
        self._session: Session = Session(self, transport)
        if transport.metrics_url is not None and transport.handle is not None:
            # the controller serves the queue-wide series elsewhere: this process's reads
            # go to the cluster's metrics (the Ray dashboard) instead
            from .metrics import RayReads

            self._session.on_read = RayReads(name or transport.queue_id[:8])
        self._id = next(_ids)
        _registry[self._id] = self

    @classmethod
    def from_config(cls, config: "Mapping[str, Any] | QueueConfig | None" = None,
                    **overrides: Any) -> "StreamQueue":
        """A queue from a mapping of its options: a plain dict, or a YAML/OmegaConf-loaded
        config (the way verl and ROLL configure everything), with ``overrides`` on top.
        Transport options go under ``options:``.

        Raises:
            InvalidArgument: a key that is not an option (the message lists the valid
                ones), or a bad value.

        Examples:
            >>> import streamrl
            >>> q = streamrl.StreamQueue.from_config({"capacity": 64, "num_shards": 2})
            >>> q.num_shards
            2
        """
        if isinstance(config, QueueConfig):
            cfg = config.replace(**overrides) if overrides else config
        else:
            cfg = QueueConfig.from_mapping(config, **overrides)
        kw = cfg.to_dict()
        options = kw.pop("options")
        return cls(**kw, **options)

    @property
    def config(self) -> "QueueConfig | None":
        """The options this queue was created with (``None`` for a handle attached to a
        queue created elsewhere)."""
        return self._config

    @classmethod
    def connect(cls, name: str, *, namespace: str | None = None) -> "StreamQueue":
        """Attach to a named Ray queue (``StreamQueue(transport="ray", name=...)``) from
        another driver, task or actor. The returned queue does not own the actors:
        ``shutdown`` leaves them running.

        Raises:
            TransportError: no queue of that name in the cluster.
        """
        from .transport.ray import RayTransport

        return cls(transport=RayTransport.connect(name, namespace), name=name)

    # ------------------------------------------------------------------ plumbing

    @property
    def transport(self) -> str:
        """The transport's name (``"embedded"``, ``"ray"``, ...)."""
        return self._transport.name

    @property
    def session(self) -> Session:
        """What batch views of this queue talk to (see :mod:`streamrl.session`)."""
        return self._session

    @property
    def _control(self) -> ControlPlane:
        if self._periodic is not None and self._periodic.task is None:
            self._periodic.start()
        return self._transport.control

    @property
    def _data(self) -> DataPlane:
        return self._transport.data

    @property
    def queue_id(self) -> str:
        """An id of the queue itself, the same in every handle of it (Ray: in every
        process): batches carry their queue, and a queue refuses another queue's."""
        return self._transport.queue_id

    def _own(self, batch: RowRemoteBatch, what: str) -> None:
        """Refuse a batch of another queue: its row ids mean other rows here."""
        if batch.queue is not self and batch.queue.queue_id != self.queue_id:
            raise InvalidArgument(
                f"cannot {what} a batch of another queue ({batch.queue!r}) through {self!r}: "
                "row ids are per queue. Use the batch's own queue (batch.queue)")

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"<StreamQueue{name} transport={self.transport}>"

    @property
    def num_shards(self) -> int:
        """The number of storage units."""
        return self._data.num_shards

    def __reduce__(self):
        handle = self._transport.handle
        if handle is not None:
            return (_from_handle, (type(self._transport), handle, self.name))
        return (_attach_embedded, (self._id,))

    async def __aenter__(self) -> "StreamQueue":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
        await self.shutdown()

    # ------------------------------------------------------------------ put

    async def put(self, data: Mapping[str, Any] | TensorDictBase, partition: str | None = None,
                  rows: RemoteBatch | Sequence[int] | torch.Tensor | None = None, *,
                  version: int | None = None, overwrite: bool = False,
                  timeout: float | None = None) -> RowRemoteBatch:
        """Put new rows, or (with ``rows=``) new fields of existing rows.

        Args:
            data: a TensorDict (batch dim = rows) or a dict of field -> tensor / ndarray /
                list, every field with the same number of rows. Tensors are stored as given
                (no copy): do not modify them in place afterwards. (Embedded, a one-row
                put under 64 KiB is combined with the one-row puts that follow it into one
                admission, its tensors copied into one block per field; see
                :mod:`streamrl.combine`. It returns without waiting when there is room,
                and every later call of the queue sees its row; a filter that fails on
                such a row is logged, not raised: see :meth:`add_filter`. A one-row
                write of new fields to such a row before it is admitted is kept with
                it: the row is admitted with them.)
            partition: where new rows go (default ``"default"``); ignored with ``rows``.
            rows: existing rows to add fields to (a batch from ``put``/``get``/``stream``,
                or row ids); ``len(rows)`` must equal the rows in ``data``.

        Keyword Args:
            version: policy version stamped on new rows (default: the queue's current one).
            overwrite: allow replacing fields already written to ``rows``.
            timeout: seconds to wait for room (new rows only); ``None`` waits for ever.

        Returns:
            A :class:`RowRemoteBatch` of the rows written (not leased), whose cache holds
            ``data``.

        Waits while the queue is full (backpressure) or, with ``max_lead``, while
        ``version`` is too far ahead. Raises :class:`~streamrl.errors.QueueFull` at once for
        a put that can never fit, :class:`~streamrl.errors.InvalidArgument` at once for
        new rows into a sealed partition (or queue), full or not,
        :class:`~streamrl.errors.StreamTimeout` after
        ``timeout``, :class:`~streamrl.errors.QueueClosed` after close,
        :class:`~streamrl.errors.SchemaError` for mismatched lengths,
        :class:`~streamrl.errors.DuplicateField` and :class:`~streamrl.errors.RowsDropped`.

        A put that raises leaves nothing behind, cancelled ones included, wherever the
        cancellation lands: new rows it admitted are gone (rows that had already landed
        are dropped and counted as ``"cancelled"``), fields it was adding to existing rows
        are not written, and the cancellation goes on only once that is done, so a retry
        never races the undo. A write with ``overwrite=True`` is the exception: it is
        idempotent, and a cancelled one leaves each row with its old or its new value.
        """
        if rows is None and type(data) is dict and (self._stage is not None or self._unit_puts) \
                and not (overwrite is not False or (version is not None and (
                    type(version) is not int)) or (partition is not None and (
                        type(partition) is not str or not partition))
                    or (timeout is not None and (type(timeout) not in (int, float)
                                                 or not 0 <= timeout < math.inf))
                    or _timing_now.get() is not None):
            # new rows with plain arguments (all valid, of the usual types), no ``timed``
            # block open (it counts the queue's calls): a one-row put may skip the checks
            # and bookkeeping of the usual way (embedded: the stage checks group keys;
            # Ray: the tag values go with it, as the usual way sends them)
            if self._stage is not None:
                staged = self._put_staged(data, partition, version)
                if staged is not None:
                    return staged
            else:
                one = one_row_dense(data)
                if one is not None:  # (what to_columns and the sizes would make of it)
                    part = DEFAULT_PARTITION if partition is None else partition
                    cols = dict(data)
                    # (a group key's value that is not one scalar raises here, as the
                    # usual way raises it: before anything is stored)
                    return await self._put_rows(part, cols, 1, one[0],
                                                self._tags(part, cols), version, one[1],
                                                timeout, False, one[2])
        elif (type(rows) is RowRemoteBatch and type(data) is dict and self._service is not None
              and overwrite is False and version is None and _timing_now.get() is None):
            # new fields to a one-row batch, embedded, with plain arguments: no checks that
            # such a write cannot fail. Its row may be staged still (a sample put, then
            # written to): the write is kept with its put; else it is done in one go
            target = rows
            row = target.one_row
            if row is not None and target.queue is self:
                one = one_row_dense(data)
                if one is not None:
                    cols = dict(data)
                    stage = self._stage
                    if stage is not None and stage.staged and stage.stage_write(
                            row, cols, one[0], one[1]) is not None:
                        target._learn(cols)
                        return target
                    if not self._tags_any:  # (no group key known: no tag values to send)
                        res = (await self._write_here([row], tuple(cols), cols, one[0], {},
                                                      one[1], False))[1]
                        self._learn_tags(target.partition, res.tag_fields)
                        target._learn(cols)
                        return target
        return await _timed(self._put(data, partition, rows, version=version,
                                      overwrite=overwrite, timeout=timeout, nowait=False))

    async def put_nowait(self, data: Mapping[str, Any] | TensorDictBase,
                         partition: str | None = None, *, version: int | None = None
                         ) -> RowRemoteBatch:
        """Like :meth:`put` of new rows, but raises :class:`~streamrl.errors.QueueFull`
        instead of waiting for room. (It is a coroutine because storing may still need I/O
        on distributed transports.)"""
        return await _timed(self._put(data, partition, None, version=version,
                                      overwrite=False, timeout=None, nowait=True))

    def _tags(self, part: str | None, cols: Mapping[str, Column]) -> dict[str, list]:
        """The tag values (group keys...) to send with a write: those of fields that are
        tags of the rows' partition must be scalars per row (a SchemaError before
        anything is admitted); fields that are tags only elsewhere are sent when they can
        be (a group key of one partition says nothing of another's field)."""
        if not self._tags_any:  # (no tag anywhere; _tags_by_part holds subsets of it)
            return {}
        strict = self._tags_by_part.get(part, frozenset()) if part is not None else frozenset()
        tags = {}
        for f, col in cols.items():
            if f in strict:
                tags[f] = tag_values(f, col)
            elif f in self._tags_any:
                try:
                    tags[f] = tag_values(f, col)
                except SchemaError:
                    pass
        return tags

    def _learn_tags(self, part: str | None, fields: frozenset[str]) -> None:
        if not fields and part not in self._tags_by_part:
            return  # (nothing to learn, nothing to forget: the common case)
        self._tags_any = self._tags_any | fields
        if part is not None:
            self._tags_by_part[part] = fields
            self._tags_by_part.move_to_end(part)
            while len(self._tags_by_part) > 256:
                self._tags_by_part.popitem(last=False)

    def _put_staged(self, data: dict, partition: str | None, version: int | None
                    ) -> RowRemoteBatch | None:
        """The one-row put of new rows, embedded, at its cheapest: ``data`` is a dict of
        one-row dense tensors (with arguments :meth:`put` found plain), staged to be
        admitted with the one-row puts that follow it (see :mod:`streamrl.combine`).
        ``None``: not staged (anything else, or the stage cannot take it); :meth:`_put`
        then does it all, the checks and their errors included. Never awaits, raises
        nothing of its own."""
        stage = self._stage
        part = DEFAULT_PARTITION if partition is None else partition
        # a row like the stage's rows (same partition and version, fields of the same
        # dtypes and shapes: stage.like) is appended without sizing it again
        like = stage.like_now(part, version)  # type: ignore[union-attr]
        same = len(data) == len(like)
        for f, v in data.items():
            if (type(v) is not torch.Tensor or v.layout is not _STRIDED or v.is_meta
                    or v.requires_grad):
                return None
            try:
                shape = v.shape  # (cheaper than dim() and size(0))
            except RuntimeError:  # (a nested tensor of strided layout has no shape)
                return None
            if same:
                was = like.get(f)  # (its key and dtype were checked when it opened the stage)
                if was is not None and v.dtype is was[0] and shape == was[1]:
                    continue
                same = False
            if type(f) is not str or not f or not shape or shape[0] != 1:
                return None
        if not data:
            return None
        cols = dict(data)  # (the caller's dict may change once the put returned)
        staged = stage.stage_like(cols) if same else None  # type: ignore[union-attr]
        if staged is None:
            sizes = {}
            dtypes = {}
            names = _PLAIN_DTYPES  # (a quantized dtype is not one of them: the usual way)
            for f, v in data.items():
                name = names.get(v.dtype)
                if name is None:
                    return None
                sizes[f] = v.nbytes
                dtypes[f] = name
            staged = stage.stage_put(part, cols, sizes, dtypes, version,  # type: ignore[union-attr]
                                     like={f: (v.dtype, v.shape) for f, v in data.items()})
            if staged is None:
                return None
        return RowRemoteBatch._put(self, staged[0], staged[1], cols, part)

    async def _put(self, data, partition, rows, *, version, overwrite, timeout, nowait):
        timeout = check_timeout("timeout", timeout)
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise InvalidArgument(f"version must be an int (or None), got {version!r}")
        if not isinstance(overwrite, bool):
            raise InvalidArgument(f"overwrite must be True or False, got {overwrite!r}")
        if partition is not None and (not isinstance(partition, str) or not partition):
            raise InvalidArgument(f"partition must be a non-empty str (or None), got "
                                  f"{partition!r}")
        cols, n = to_columns(data)
        stage = self._stage
        if n == 1 and rows is None and stage is not None:
            # a one-row put of a new row, embedded: staged to be admitted with others
            # (see streamrl/combine.py; never awaits), unless it has to go the usual way
            one_part = DEFAULT_PARTITION if partition is None else partition
            sizes = {}
            dtypes = {}
            for f, c in cols.items():
                if type(c) is torch.Tensor:
                    sizes[f] = c.element_size() * c.numel()
                    dtypes[f] = dtype_name(c.dtype)
                else:
                    sizes[f] = row_nbytes(c, 1)[0]
                    dtypes[f] = column_dtype(f, c)
            if self._tags_any:  # (a group key's value that is not one scalar raises here)
                self._tags(one_part, cols)
            staged = stage.stage_put(one_part, cols, sizes, dtypes, version)
            if staged is None and not nowait:  # no room: wait for it, then stage
                staged = await stage.stage_when_room(one_part, cols, sizes, dtypes,
                                                     version, timeout)
            if staged is not None:
                return RowRemoteBatch._put(self, staged[0], staged[1], cols, one_part)
            nbytes = {f: [b] for f, b in sizes.items()}
        else:
            nbytes = {}
            dtypes = {}
            for f, c in cols.items():
                if type(c) is torch.Tensor:  # (row_nbytes and column_dtype of a tensor)
                    nbytes[f] = [c.element_size() * (c.numel() // n)] * n
                    dtypes[f] = dtype_name(c.dtype)
                else:
                    nbytes[f] = row_nbytes(c, n)
                    dtypes[f] = column_dtype(f, c)
        names = tuple(cols)
        ctl = self._control
        target: RowRemoteBatch | None = None
        part: str | None
        if rows is None:
            part = DEFAULT_PARTITION if partition is None else partition
            return await self._put_rows(part, cols, n, nbytes, self._tags(part, cols),
                                        version, dtypes, timeout, nowait)
        if version is not None:
            raise InvalidArgument(
                "version is stamped on new rows only (when they are put); writing fields "
                "to existing rows keeps their version. Put the rows with the version of "
                "the policy that produced them")
        if isinstance(rows, ColumnRemoteBatch):
            rows = rows.batch
        if isinstance(rows, RowRemoteBatch):
            self._own(rows, "write to")
            target = rows
            ids = rows.rows
            part = rows.partition
        else:
            ids = _row_ids(rows)
            part = None
        if len(ids) != n:
            raise SchemaError(
                f"writing {n} rows of {list(names)} to {len(ids)} rows; give one value per "
                "target row")
        if target is not None and target.padded:
            # a padded DP batch: its padding places hold rows of other ranks' shares,
            # which those ranks write; the values given for them are left out
            keep = (~target.padding.reshape(-1)).nonzero().flatten()
            at = keep.tolist()
            cols = {f: take_rows(c, at) for f, c in cols.items()}
            nbytes = {f: [b[i] for i in at] for f, b in nbytes.items()}
            own = target[keep]
            assert isinstance(own, RowRemoteBatch)  # (a tensor index gives rows)
            target = own
            ids = own.rows
            if not ids:
                return target
        if len(set(ids)) != len(ids):
            raise SchemaError("the target rows repeat; write each row once")
        tags = self._tags(part, cols)
        stage = self._stage
        if n == 1 and stage is not None and stage.staged and not overwrite and not tags:
            # a write to a row still staged (an env worker adding to the sample it just
            # put): kept with the put, admitted with it (see CombiningService.stage_write)
            shard = stage.stage_write(ids[0], cols, nbytes, dtypes)
            if shard is not None:
                if target is not None:
                    target._learn(cols)
                    return target
                return RowRemoteBatch._put(self, ids[0], shard, cols, part)
        tok = res = None
        if self._service is not None:  # embedded: in one go (see _write_here)
            tok, res = await self._write_here(ids, names, cols, nbytes, tags, dtypes, overwrite)
        elif self._unit_puts and not overwrite and target is not None:
            # Ray: a small write of new fields to rows of one unit is one call to it
            res = await self._data.write_rows(ids, target.shards, cols, nbytes, tags, dtypes)
        if res is None:  # (anything else: the usual way)
            tok = await ctl.begin_write(ids, names, overwrite=overwrite, dtypes=dtypes)
            res = await self._store_commit(tok, cols, names, nbytes, tags, new=False)
        self._learn_tags(part, res.tag_fields)
        if target is not None:
            target._learn(cols)
            return target
        assert tok is not None  # (only a batch's rows are written through a unit)
        return RowRemoteBatch._put(self, tok.rows, tok.shards, cols, part)

    async def _write_here(self, ids: list[int], names: tuple, cols: Mapping[str, Column],
                          nbytes: dict, tags: dict, dtypes: dict, overwrite: bool
                          ) -> tuple[Any, Any]:
        """A write to existing rows with the controller service and the storage units in
        this process (embedded): admitted, stored and committed without a coroutine,
        awaiting only what has to wait (filters, storage deletes, tag values read back),
        as the one-row put's stage does; a store that fails takes the write back.
        Returns ``(token, commit result)``."""
        svc, units = self._service, self._units
        assert svc is not None and units is not None  # (see _start)
        tok = svc.begin_write_now(ids, names, overwrite=overwrite, dtypes=dtypes)
        try:
            for s, rs, cs in _split_by_shard(tok.rows, tok.shards, cols):
                units[s].put(rs, cs, tok.id)
        except BaseException:  # (a unit that writes files failed) nothing of it stays
            await shielded(svc.abort(tok))
            raise
        res, more = svc.commit_now(tok, nbytes, tags)
        if more:
            await svc.committed(tok, res)
        return tok, res

    async def _put_rows(self, part: str, cols: Mapping[str, Column], n: int, nbytes: dict,
                        tags: dict, version: int | None, dtypes: dict, timeout: float | None,
                        nowait: bool, shapes: tuple | None = None) -> RowRemoteBatch:
        """Put ``n`` new rows whose arguments were checked: in one call to a unit where
        the data plane admits puts there (Ray), else (or when that does not apply now)
        the usual way. ``shapes``: see :meth:`DataPlane.put_rows`."""
        done = None
        if self._unit_puts:  # one call, no waiting (Ray)
            # a put that waits for room as long as it takes may be put the usual way
            # together with others (see NewRows)
            usual = self._new_rows if timeout is None and not nowait else None
            done = await self._data.put_rows(part, cols, n, nbytes, tags, version, dtypes,
                                             usual=usual, shapes=shapes)
        if done is None:
            done = await self._put_new(part, cols, n, nbytes, tags, version, dtypes,
                                       timeout, nowait)
        self._learn_tags(part, done[2].tag_fields)
        return RowRemoteBatch._put(self, done[0], done[1], cols, part)

    async def _put_new(self, part: str, cols: Mapping[str, Column], n: int, nbytes: dict,
                       tags: dict, version: int | None, dtypes: dict, timeout: float | None,
                       nowait: bool) -> tuple[list[int], list[int], Any]:
        """Put ``n`` new rows the usual way: room asked of the controller (waiting for
        it, see :meth:`put`), the columns stored, then committed. Returns ``(rows,
        shards, commit result)``."""
        tok = await self._allocate(part, cols, n, nbytes, version, dtypes, timeout, nowait)
        res = await self._store_commit(tok, cols, tuple(cols), nbytes, tags, new=True)
        return tok.rows, tok.shards, res

    def _allocate(self, part: str, cols: Mapping[str, Column], n: int, nbytes: dict,
                  version: int | None, dtypes: dict, timeout: float | None, nowait: bool):
        """Room for ``n`` new rows of ``cols`` (a write token), as :meth:`put` waits for it."""
        total = 0
        for v in nbytes.values():
            total += sum(v)
        return self._control.allocate(part, n, tuple(cols), nbytes=total, version=version,
                                      timeout=timeout, nowait=nowait, dtypes=dtypes)

    async def _store_commit(self, tok: Any, cols: Mapping[str, Column], names: tuple,
                            nbytes: dict, tags: dict, *, new: bool) -> Any:
        """Store the columns of write ``tok`` (new rows, or fields of existing ones) and
        commit it; on failure or cancellation nothing of it stays admitted."""
        ctl = self._control
        try:
            units = self._units
            if units is not None and len(tok.rows) == 1:
                # one row, in-process units (embedded): stored here and now, as
                # LocalDataPlane.put would, without the split and a coroutine
                units[tok.shards[0]].put(tok.rows, cols, tok.id)
            else:
                await self._data.put(_split_by_shard(tok.rows, tok.shards, cols), tok.id)
        except BaseException:  # nothing of it may stay admitted
            await shielded(ctl.abort(tok))
            raise
        try:
            res = await ctl.commit(tok, nbytes, tags)
        except anyio.get_cancelled_exc_class():
            # the commit may or may not have run: take the write back either way (an
            # abort if it did not; the controller makes a second retract a no-op)
            await shielded(ctl.retract(tok))
            raise
        except StreamTimeout:  # aborted for taking too long: forget what this write stored
            parts: dict[int, list[int]] = {}
            for r, s in zip(tok.rows, tok.shards):
                parts.setdefault(s, []).append(r)
            await shielded(self._data.delete(parts) if new
                           else self._data.delete_fields(parts, names, write=tok.id))
            raise
        return res

    # ------------------------------------------------------------------ get / stream

    @staticmethod
    def _request(args: dict[str, Any]) -> Request:
        """The request of a ``get``/``stream`` call, from its arguments (``locals()``):
        their options are exactly :class:`~streamrl.config.Request`'s fields."""
        return Request(args["task"], args["fields"], args["batch_size"],
                       **{k: args[k] for k in Request.options()})

    async def get(self, task: str, fields: Sequence[str], batch_size: int, *,
                  partition: str | None = None, timeout: float | None = None,
                  group_by: str | None = None, group_size: int | None = None,
                  drop_last: bool = False, max_staleness: int | None = None,
                  dp_rank: int = 0, dp_size: int = 1, balance_by: str | None = None,
                  dp_remainder: str = "error", lease_timeout: float | None = None,
                  sampler: Any = None) -> RowRemoteBatch:
        """One leased micro-batch for ``task`` (see :meth:`stream` for the arguments).

        The batch stays leased until ``ack()``, ``drop()``, ``release()`` or its lease
        timeout; a second ``get`` does not acknowledge the first.

        Raises:
            EndOfStream: nothing more will come (sealed and drained, or closed).
            StreamTimeout: no batch within ``timeout`` seconds.
        """
        req = self._request(locals())
        timeout = check_timeout("timeout", timeout)
        load_tensordict()  # (a consumer: before its first lease, not inside it)
        d = await _timed(self._control.take(req, timeout))
        if d is None:
            where = f"partition {partition!r} is sealed and" if partition else "the queue is closed and"
            raise EndOfStream(f"task {task!r}: {where} every row was delivered; nothing more to get")
        return self._delivered(d)

    def stream(self, task: str, fields: Sequence[str], batch_size: int, *,
               partition: str | None = None, timeout: float | None = None,
               group_by: str | None = None, group_size: int | None = None,
               drop_last: bool = False, max_staleness: int | None = None,
               dp_rank: int = 0, dp_size: int = 1, balance_by: str | None = None,
               dp_remainder: str = "error", lease_timeout: float | None = None,
               sampler: Any = None) -> "Stream":
        """Micro-batches of rows ready in every one of ``fields`` that ``task`` has not
        consumed, as an async iterator of leased :class:`RowRemoteBatch` views.

        Args:
            task: the consumer role (``"actor_update"``). Each task consumes each row once.
            fields: the fields a row must have to be delivered. A field nobody has written
                yet is fine: the stream waits for it.
            batch_size: rows per batch (per rank with ``dp_size``).

        Keyword Args:
            partition: only rows of this partition; the stream ends once the partition is
                sealed and every row was consumed by the task (or dropped). ``None``: rows
                of any partition, until the queue is closed.
            timeout: seconds to wait for each batch before raising
                :class:`~streamrl.errors.StreamTimeout` (``None``: wait for ever).
            group_by: deliver whole groups only (rows sharing the value of the field
                ``group_by``), never a group split across batches.
            group_size: rows per group: a group is complete when ``group_size`` of its
                rows are ready, or -- without ``group_size``, or for a short last group --
                when its partition is sealed and all its rows are ready. ``batch_size``
                must be a multiple of ``group_size``.
            drop_last: at the end of a sealed partition, do not deliver a short last batch
                (its rows stay unconsumed by this task).
            max_staleness: drop rows whose version is older than ``version - max_staleness``
                instead of delivering them.
            dp_rank: this consumer's data-parallel rank (``0 <= dp_rank < dp_size``);
                rank ``r`` gets share ``r`` of each dispatch.
            dp_size: data-parallel dispatch over ``dp_size`` ranks: each dispatch takes
                ``dp_size * batch_size`` rows and gives every rank an equal share (whole
                groups when grouped).
            balance_by: a per-row length field; shares are balanced on its totals.
            dp_remainder: what to do with a last dispatch that does not split evenly:
                ``"error"`` (raise :class:`~streamrl.errors.DispatchError`), ``"drop"``
                (drop the surplus rows, counted) or ``"pad"`` (repeat rows).
            lease_timeout: override the queue's lease timeout for these batches.
            sampler: which ready rows make each batch, overriding the queue's ``sampler``
                for this request: a registered name or ``{"sampler": name, **options}``
                (docs/sampling.md).

        Every option is a field of :class:`streamrl.config.Request`, validated when the
        call is made (a bad value raises :class:`~streamrl.errors.InvalidArgument` at once).

        Acknowledgement (leases): each batch is leased to ``task``. It is acknowledged when
        the consumer asks for the next batch, by ``await mb.ack()`` or ``await mb.drop()``,
        or -- when the stream is used as ``async with q.stream(...) as batches:`` -- when
        that block exits without an exception. Anything else releases the lease and the
        rows are delivered again to the next consumer of ``task`` (at-least-once): the
        block raising or being cancelled, leaving the loop with ``break`` before ``ack``,
        the iterator being garbage-collected, or the lease outliving ``lease_timeout``.
        (A bare ``async for`` cannot tell ``break`` from an exception; both release.)

        Ends and short batches: on a sealed partition, the last (short) batch goes out
        only once every other row of the partition is settled for this task (acknowledged
        or dropped), because a released lease would bring rows back. DP ranks
        (``dp_size > 1``) must iterate concurrently (one coroutine, thread or process per
        rank): a rank's next dispatch waits for rows that other ranks still hold.

        Rows can leave the queue while leased: a filter rejecting them, staleness
        (``set_version`` with ``max_staleness``), ``drop`` or ``clear`` by someone else. The
        lease then shrinks; materializing or writing those rows raises
        :class:`~streamrl.errors.RowsDropped` (its ``rows`` say which), so roles that
        write results back should catch it and skip those rows.

        Returns:
            A :class:`Stream` (async iterator and async context manager).
        """
        req = self._request(locals())
        timeout = check_timeout("timeout", timeout)
        load_tensordict()  # (a consumer: before its first lease, not inside it)
        return Stream(self, req, timeout)

    def _delivered(self, d: Delivery) -> RowRemoteBatch:
        pads: Iterable[int] = ()
        pad = None
        if d.pads:  # (a padded DP share: its own rows come first)
            n = len(d.rows) - len(d.pads)
            own = set(d.rows[:n])
            pads = [r for r in d.pads if r not in own]
            pad = np.arange(len(d.rows)) >= n
        mb = RowRemoteBatch(self, d.rows, d.shards, d.fields, versions=d.versions,
                            leases=(d.lease,), task=d.task, partition=d.partition,
                            known=d.known, pads=pads, pad=pad)
        mb.nbytes = d.nbytes
        return mb

    # ------------------------------------------------------------------ lifecycle

    async def drop(self, rows: RemoteBatch | Sequence[int] | torch.Tensor) -> int:
        """Delete rows for good and free their bytes (idempotent). Returns rows dropped."""
        if isinstance(rows, (RowRemoteBatch, ColumnRemoteBatch)):
            b = rows if isinstance(rows, RowRemoteBatch) else rows.batch
            self._own(b, "drop")
            await b.drop()
            return len(b)
        return await self._control.drop(_row_ids(rows))

    async def clear(self, partition: str) -> int:
        """Drop every row of ``partition``. Returns rows dropped."""
        _check_partition(partition)
        return await self._control.clear(partition)

    async def seal(self, partition: str | None = None) -> None:
        """Declare that no new rows will be added to ``partition``: streams over it end
        once every row is delivered to their task (or dropped), and a short last batch may
        go out. New fields of its existing rows are still accepted. A put of new rows
        into it raises :class:`~streamrl.errors.InvalidArgument`, at once, also one that
        was already waiting for room when the seal came (it could never fit).

        Without a partition, seal the whole queue: no new rows anywhere, and streams over
        all partitions (``partition=None``) end once drained, while later pipeline stages
        can still write their fields (unlike :meth:`close`)."""
        if partition is not None:
            _check_partition(partition)
        await self._control.seal(partition)

    async def declare(self, partition: str, consumers: Sequence[str] | None) -> None:
        """Set the tasks whose acknowledgement drops a row of ``partition`` automatically
        (overrides the queue's ``consumers``; ``None`` turns cleanup off). A finished
        partition (sealed and drained) has nothing to clean up: declaring it does
        nothing."""
        _check_partition(partition)
        await self._control.declare(partition, consumers)

    async def set_version(self, version: int) -> int:
        """Advance the current policy version (never backwards). With ``max_staleness``,
        rows now too old are dropped (whole groups together); returns how many. Producers
        paced by ``max_lead`` are released."""
        return await self._control.set_version(version)

    async def wait_version(self, version: int, *, timeout: float | None = None) -> int:
        """Wait until the trainer's policy version (:meth:`set_version`) reaches
        ``version``; returns the current version. Rollout workers use it to pace
        themselves on the weights they need (for example: play step ``k`` with weights of
        at least ``k - max_staleness``), so that no rollout is generated only to be dropped
        as stale.

        Raises:
            StreamTimeout: not reached within ``timeout`` seconds.
            QueueClosed: the queue closed meanwhile.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidArgument(f"version must be an int, got {version!r}")
        return await self._control.wait_version(version, check_timeout("timeout", timeout))

    async def add_filter(self, fn: Callable, *, fields: Sequence[str] | None = None,
                         group_by: str | None = None, group_size: int | None = None,
                         name: str | None = None) -> str:
        """Judge rows once they have every one of ``fields``; rejected rows are dropped.

        ``fn(td)`` gets a TensorDict of ``fields`` for a row set (the rows a write made
        ready, or one whole group with ``group_by``) and returns ``True``/``False`` (keep
        or reject them all) or a bool mask (per row); it may be ``async``. With
        ``group_by``, a group is judged when ``group_size`` of its rows are ready (without
        ``group_size``: when its partition is sealed and all its rows are ready).

        A row is never delivered to a task that asks for any of ``fields`` before the
        filter passed it; tasks that need none of them may take it earlier (if such a row
        is then rejected while leased, the lease shrinks and that task's ``ack`` covers
        the rest). A filter that raises or returns a bad mask drops the rows it was judging
        (counted in ``stats().filter_errors``) and the error is raised to the producer whose
        write triggered it as :class:`~streamrl.errors.FilterError`; it is logged instead
        when no writer waits for it: runs that ``seal`` or ``add_filter`` trigger, and
        rows of one-row puts that the embedded queue combined (those puts returned
        already; see :mod:`streamrl.combine`).

        Ready-made filters (:mod:`streamrl.filters`) carry their ``fields``, ``group_by``,
        ``group_size`` and ``name``; arguments given here override them.

        Returns:
            The filter's name (counted per name in ``stats().filtered_by``).
        """
        if not callable(fn):
            raise InvalidArgument(f"a filter must be callable (td -> bool or mask), got "
                                  f"{type(fn).__name__}")
        fields = fields if fields is not None else getattr(fn, "fields", None)
        group_by = group_by if group_by is not None else getattr(fn, "group_by", None)
        group_size = group_size if group_size is not None else getattr(fn, "group_size", None)
        name = name if name is not None else getattr(fn, "name", None)
        if isinstance(fields, str):
            fields = [fields]
        if not isinstance(fields, (list, tuple, set, frozenset)) or not fields or not all(
                isinstance(f, str) and f for f in fields):
            raise InvalidArgument(
                f"a filter needs the fields it reads: fields=[names], got {fields!r}")
        if group_by is not None and (not isinstance(group_by, str) or not group_by):
            raise InvalidArgument(f"group_by must be a field name (or None), got {group_by!r}")
        if group_size is not None and (group_by is None or not isinstance(group_size, int)
                                       or isinstance(group_size, bool) or group_size <= 0):
            raise InvalidArgument("group_size must be a positive int and needs group_by")
        if name is not None and (not isinstance(name, str) or not name):
            raise InvalidArgument(f"name must be a non-empty str (or None), got {name!r}")
        name = name or getattr(fn, "__name__", None) or "filter"
        spec = FilterSpec(name, frozenset(fields), group_by, group_size)
        await self._control.add_filter(fn, spec)
        if group_by:
            self._tags_any = self._tags_any | {group_by}
        return name

    def timed(self, role: str) -> Timer:
        """Record how long ``role`` waits on this queue against how long it computes:
        ``with q.timed("actor_update"): ...`` (or ``async with``) around the role's work;
        queue calls inside it (in this task and tasks it starts) count as queue time.
        For a consumer, open it around the ``async for`` over a stream, not inside it, so
        the wait for each next batch counts. Read the totals with :meth:`timings`. See
        :mod:`streamrl.timing`.

        Examples:
            >>> import asyncio, torch, streamrl
            >>> async def main():
            ...     async with streamrl.StreamQueue(capacity=8) as q:
            ...         with q.timed("producer"):
            ...             await q.put({"x": torch.zeros(4)})
            ...         return q.timings()["producer"].calls
            >>> asyncio.run(main())
            1
        """
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"role must be a non-empty str, got {role!r}")
        rec = self._timings.get(role)
        if rec is None:
            rec = self._timings[role] = RoleTiming()
        return Timer(rec)

    def timings(self) -> dict[str, RoleTiming]:
        """Per role timed with :meth:`timed` in this process: seconds in its blocks,
        the part in queue calls, and the rest (compute)."""
        return dict(self._timings)

    async def stats(self) -> Stats:
        """A snapshot of counters and holdings (see :class:`~streamrl.Stats`)."""
        return await self._control.stats()

    async def audit(self) -> list[str]:
        """Check that the controller and the storage units agree on every field of every
        row; returns the disagreements (empty when they agree). Writes in flight are
        allowed for; the undo of a cancelled call may still be on its way for a moment,
        so poll with a deadline right after cancellations. Reads every unit's inventory:
        a tool for tests and debugging, not for hot paths."""
        return await self._control.audit()

    async def leaked(self) -> int:
        """Rows held in sealed partitions that no task will take any more (0 when every
        row of every finished partition was consumed, filtered, dropped or cleared)."""
        return sum((await self._control.leaked()).values())

    # ------------------------------------------------------------------ checkpoints

    async def checkpoint(self, path: "str | os.PathLike", *,
                         timeout: float | None = None) -> "CheckpointInfo":
        """Write a snapshot of the whole queue to the directory ``path``, atomically,
        while producers and consumers go on; :meth:`restore` makes a running queue of it.

        What is saved: every row with its fields and data, per-field readiness and each
        task's consumption, partitions and their seals, consumers, the policy version,
        the row-id counters (no id is ever reused), the filters' registrations, and the
        queue's options. The snapshot is the queue at one instant during the call (the
        *cut*): every put, write and ``ack`` that returned before ``checkpoint`` was
        called is in it; those running meanwhile may or may not be (docs/checkpoint.md).
        Leases held at the cut come back released: their rows are delivered again
        (at-least-once) and counted as redelivered. Rows a task acknowledged before the
        cut are never delivered to it again.

        What waits: no queue call waits for the files; every call waits while the
        controller takes the cut (``CheckpointInfo.pause``, about a microsecond per row
        held). Rows dropped during the checkpoint keep their bytes until their storage
        unit has written them. A second checkpoint waits for the first. Copies: none
        in memory; every byte is written once, from where it is stored (each Ray
        storage unit writes its own files; nothing goes through this process).

        Args:
            path: the checkpoint directory. It is written as a temporary directory
                beside it and renamed at the end; a checkpoint already there is
                replaced. On a queue spread over several Ray nodes, ``path`` must be on
                a filesystem they all mount at the same place.

        Keyword Args:
            timeout: the longest the controller holds deletes back for this checkpoint
                (default: the larger of 600 s and ``lease_timeout``); a checkpoint that
                takes longer fails.

        Returns:
            A :class:`~streamrl.checkpoint.CheckpointInfo` (rows, bytes, seconds, pause).

        Raises:
            CheckpointError: the checkpoint could not be written (nothing is left at
                ``path`` but what was there before).
            EncodeError: a Python object field that cannot be encoded.
        """
        from .checkpoint.client import checkpoint

        return await checkpoint(self, path, timeout=check_timeout("timeout", timeout))

    @classmethod
    async def restore(cls, path: "str | os.PathLike", *,
                      filters: "Mapping[str, Callable] | None" = None,
                      **overrides: Any) -> "StreamQueue":
        """A running queue from the checkpoint at ``path`` (see :meth:`checkpoint`), or
        the newest one of a ``checkpoint_dir``.

        It is made with the saved options and ``overrides`` on top: any option of the
        constructor, for example another ``transport`` (restore an embedded checkpoint
        on Ray and the other way round), ``num_shards`` (rows of old unit ``s`` go to
        unit ``s % num_shards``; with more units than before, the new ones start empty
        and take new rows), ``capacity`` or ``name``, and transport options.

        Filters: one registered as an importable module-level function (or a
        ready-made filter of :mod:`streamrl.filters`) comes back by itself; pass the
        others as ``filters={name: fn}``.

        Every file is checked (sizes and CRC-32) as it is read; a torn or corrupt
        checkpoint raises and the new queue is shut down: never partial data. Restoring
        imports the modules its filters name, and decodes Python objects that were
        pickled: restore only checkpoints you trust.

        Raises:
            CheckpointError: no checkpoint at ``path``; a newer format version; a torn or
                corrupt file; filters that cannot be found (listed by name).
        """
        from .checkpoint.client import restore

        q, tags = await restore(cls, path, filters=filters, **overrides)
        q._learn_tags(None, tags)
        return q

    async def close(self) -> dict[str, int]:
        """Close the queue (idempotent): ``put`` raises :class:`~streamrl.errors.QueueClosed`,
        streams deliver what is ready and end, waiting ``put``/``get`` wake with an error.
        Data already in the queue stays readable until :meth:`shutdown`.

        Returns:
            Rows still held per partition (empty when nothing is left behind).
        """
        self._closed_locally = True
        return await self._control.close()

    async def shutdown(self) -> None:
        """Free the deployment (Ray: kill the actors this queue started), stop serving
        metrics and periodic checkpoints (one being written is abandoned: the previous
        ones stay)."""
        if self._periodic is not None:
            await self._periodic.stop()
            self._periodic = None
        if self._metrics is not None:
            self._metrics.close()
        await self._transport.shutdown()


class _NewRows:
    """A queue's usual way to put new rows, lent to its data plane with each put that
    waits for room as long as it takes (see :class:`streamrl.transport.base.NewRows`)."""

    __slots__ = ("_q",)

    def __init__(self, q: StreamQueue):
        self._q = weakref.ref(q)  # (the queue holds this: no cycle)

    async def room(self, partition: str, cols: Mapping[str, Column], n: int, nbytes: dict,
                   version: int | None, dtypes: dict) -> Any:
        q = self._q()
        if q is None:
            return None
        try:
            return await q._allocate(partition, cols, n, nbytes, version, dtypes, None, False)
        except StreamRLError:  # nothing kept (closed, can never fit...): each put alone
            # finds its own answer
            return None

    async def store(self, token: Any, cols: Mapping[str, Column], nbytes: dict, tags: dict
                    ) -> tuple[list[int], list[int], Any]:
        q = self._q()
        if q is None:
            raise QueueClosed("the queue was collected while a put was in progress")
        res = await q._store_commit(token, cols, tuple(cols), nbytes, tags, new=True)
        return token.rows, token.shards, res

    async def abort(self, token: Any) -> None:
        q = self._q()
        if q is not None:
            await shielded(q._control.abort(token))

    async def retract(self, rows: Sequence[int]) -> None:
        q = self._q()
        if q is not None:
            await q._control.retract_rows(rows)


class Stream:
    """The iterator returned by :meth:`StreamQueue.stream` (see its docstring for the
    acknowledgement rules).

    Examples:
        >>> import asyncio, torch, streamrl
        >>> async def main():
        ...     async with streamrl.StreamQueue(capacity=16) as q:
        ...         await q.put({"x": torch.arange(6)}, partition="p")
        ...         await q.seal("p")               # no more rows: the stream ends once drained
        ...         sizes = []
        ...         async with q.stream("t", ["x"], batch_size=4, partition="p") as batches:
        ...             async for mb in batches:    # acknowledged when the next is asked for
        ...                 sizes.append(len(mb))
        ...         return sizes
        >>> asyncio.run(main())
        [4, 2]
    """

    def __init__(self, queue: StreamQueue, req: Request, timeout: float | None):
        self._q = queue
        self._req = req
        self._timeout = timeout
        self._current: RowRemoteBatch | None = None
        self._done = False
        self._watched: asyncio.Task | None = None
        #: release an unacknowledged batch when the iterating task ends (see _watch);
        #: the blocking twin turns it off (each of its calls is a task of its own)
        self.watch_task = True

    @property
    def current(self) -> RowRemoteBatch | None:
        """The batch handed out last (until acknowledged)."""
        return self._current

    def __aiter__(self) -> "Stream":
        return self

    def __iter__(self):
        """Not iterable with a plain ``for``: raises a :class:`TypeError` that says what to
        use instead (``async for``, or the blocking twin :mod:`streamrl.sync`)."""
        raise TypeError(
            "a streamrl Stream is an async iterator: iterate it with `async for batch in "
            "q.stream(...)` inside a coroutine; in synchronous code (threads, plain Ray "
            "actors) use the blocking twin streamrl.sync.StreamQueue, whose stream() is a "
            "plain iterator (streamrl.sync.StreamQueue.wrap(q) makes one of this queue)")

    async def __anext__(self) -> RowRemoteBatch:
        cur, self._current = self._current, None
        d: Delivery | None
        session = self._q._session
        if (cur is not None and cur.leased and not self._done and not _timing_open()
                and not session.acks_in_place):
            # the ack goes with the request for the next batch: one message (it stands
            # whatever the take does, and is made again alone should the call fail)
            d, expired = await session.ack_take(cur.close_for_ack(), self._req,
                                                self._timeout)
            if expired is not None:
                warnings.warn(f"streamrl: {expired}", RuntimeWarning, stacklevel=2)
        else:
            if cur is not None and cur.leased:
                try:
                    await cur.ack()
                except LeaseExpired as e:
                    warnings.warn(f"streamrl: {e}", RuntimeWarning, stacklevel=2)
            if self._done:
                raise StopAsyncIteration
            d = await _timed(self._q._control.take(self._req, self._timeout))
        if d is None:
            self._done = True
            raise StopAsyncIteration
        self._current = self._q._delivered(d)
        self._watch()
        return self._current

    def _watch(self) -> None:
        """Give the current batch back when the task iterating this stream fails while it
        is unacknowledged (its body raised or it was cancelled). A stream kept in a
        variable (``s = q.stream(...)``; ``async for mb in s``) then releases its lease
        at once even when the exception, and with it the stream, is kept alive
        (``gather(..., return_exceptions=True)``), where no finalizer runs.

        A task that ends normally keeps nothing from being acknowledged: the batch may
        be held by another task (``asyncio.wait_for(anext(s), t)`` and a prefetching
        ``create_task(anext(s))`` fetch it in a short task of their own that ends at
        once, and the caller acks it), so only a failure gives it back."""
        if not self.watch_task:
            return
        task = asyncio.current_task()
        if task is None or task is self._watched:
            return
        self._watched = task
        ref = weakref.ref(self)

        def ended(_task: asyncio.Task, ref=ref) -> None:
            stream = ref()
            if stream is not None and stream._watched is _task:
                stream._watched = None
                if not _task.cancelled() and _failure(_task) is None:
                    return  # ended normally: the batch is someone's to ack
                cur, stream._current = stream._current, None
                if cur is not None and cur.leased:
                    cur.release_nowait()

        task.add_done_callback(ended)

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, et, e, tb) -> None:
        cur, self._current = self._current, None
        self._done = True
        if cur is None or not cur.leased:
            return
        if et is None:
            await cur.ack()  # (ack and release run to the end even if cancelled)
        else:
            await cur.release()

    async def aclose(self) -> None:
        """Stop: release the current batch (unacknowledged) and end the iteration."""
        cur, self._current = self._current, None
        self._done = True
        if cur is not None and cur.leased:
            await cur.release()

    def __del__(self) -> None:
        cur = self._current
        if cur is not None and cur.leased:
            cur.release_nowait()


def _failure(task: asyncio.Task) -> BaseException | None:
    """The exception a finished, not cancelled task raised, without marking it
    retrieved (``Task.exception()`` would: asyncio's "exception was never retrieved"
    report of a consumer task that failed must stay)."""
    try:
        return task._exception  # (CPython's Task and Future)
    except AttributeError:  # another loop's task class
        return task.exception()


def _check_partition(partition: Any) -> None:
    """A partition name given to seal/clear/declare: a non-empty str (an unhashable value
    would otherwise surface as a raw TypeError from deep inside the controller)."""
    if not isinstance(partition, str) or not partition:
        raise InvalidArgument(f"partition must be a non-empty str, got {partition!r}")


def _row_ids(rows: Any) -> list[int]:
    if isinstance(rows, RowRemoteBatch):
        return rows.rows
    if isinstance(rows, torch.Tensor):
        return rows.reshape(-1).tolist()
    if isinstance(rows, np.ndarray):
        return rows.reshape(-1).tolist()
    try:
        return [int(r) for r in rows]
    except (TypeError, ValueError):
        raise InvalidArgument(f"rows must be a batch or a list of row ids, got {type(rows).__name__}") from None


def _split_by_shard(rows: Sequence[int], shards: Sequence[int], cols: Mapping[str, Column]):
    """(shard, rows, columns) per storage unit: slices (views) for contiguous runs of one
    shard, gathered copies otherwise."""
    n = len(rows)
    if n and all(s == shards[0] for s in shards):  # one unit (every one-row put): as is
        return [(shards[0], list(rows), dict(cols))]
    runs: list[tuple[int, int, int]] = []  # (shard, start, stop)
    start = 0
    for i in range(1, n + 1):
        if i == n or shards[i] != shards[start]:
            runs.append((shards[start], start, i))
            start = i
    by_shard: dict[int, list[tuple[int, int]]] = {}
    for s, a, b in runs:
        by_shard.setdefault(s, []).append((a, b))
    parts = []
    for s, spans in by_shard.items():
        if len(spans) == 1:
            a, b = spans[0]
            parts.append((s, list(rows[a:b]), {f: c[a:b] for f, c in cols.items()}))
        else:
            idx = [i for a, b in spans for i in range(a, b)]
            parts.append((s, [rows[i] for i in idx], {f: take_rows(c, idx) for f, c in cols.items()}))
    return parts


def _attach_embedded(qid: int) -> StreamQueue:
    q = _registry.get(qid)
    if q is None:
        raise TransportError(
            "this batch or queue belongs to an embedded queue of another process (or one that "
            "is gone); embedded queues live in one process: use transport='ray' to share a "
            "queue between processes")
    return q


def _from_handle(kind: type[Transport], handle: Any, name: str | None) -> StreamQueue:
    q = StreamQueue.__new__(StreamQueue)
    q._config = None
    q._start(kind.attach(handle), name)
    return q
