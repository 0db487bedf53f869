"""Lazy views of rows held by a queue.

A :class:`RemoteBatch` is metadata only -- row ids, the storage unit of each row, the
fields known to be written, the lease it belongs to -- so it is cheap to create, index,
split and send to another process (it pickles to a few KiB whatever the data size; the
cache of fetched columns is not pickled). Data moves only when you ``await
materialize(fields)``, and only the fields not fetched before: views made by indexing,
``select``, ``split`` ... share one cache with the batch they came from.

Two flavours share the :class:`RemoteBatch` base:

* :class:`RowRemoteBatch` -- keyed by row ids: index it like a TensorDict's batch
  dimension (``int``, ``slice``, list, ``LongTensor``, bool mask) and materialize it to a
  ``TensorDict``;
* :class:`ColumnRemoteBatch` -- keyed by a column (field) id: ``mb["reward"]`` is the lazy
  column, whose ``materialize()`` returns the tensor (or list) itself, as ``td["reward"]``
  would.

:class:`BatchProxy` overlays a local TensorDict on a remote batch: reads look at the
local fields first, then fetch from the queue; ``commit`` writes local fields back.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._aio import shielded
from .timing import counted as _timed
from .timing import is_open as _timing_open
from .columns import Column, settle, take_rows, to_columns, to_tensordict
from .errors import InvalidArgument, LeaseExpired, RowsDropped, SchemaError, UnknownField, rows_preview

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase
    from typing_extensions import TypeIs  # (typing.TypeIs is Python >= 3.13)

    from .queue import StreamQueue
    from .session import Session

__all__ = ["RemoteBatch", "RowRemoteBatch", "ColumnRemoteBatch", "BatchProxy"]


class _Chunk:
    """Fetched (or written) values of one field for a list of rows."""

    __slots__ = ("rows", "_col", "_settled", "_pos")

    def __init__(self, rows: np.ndarray, col: Column):
        self.rows = rows
        self._col = col
        self._settled = False
        self._pos: dict[int, int] | None = None

    @property
    def col(self) -> Column:
        """The values as ``materialize`` gives them. Written values are kept as written
        (a ragged put is a list of per-row tensors) until first read, then settled once
        into the tensor or jagged nested tensor a fetch would give."""
        if not self._settled:
            self._col = settle(self._col)
            self._settled = True
        return self._col

    def pos(self) -> dict[int, int]:
        if self._pos is None:
            self._pos = {int(r): i for i, r in enumerate(self.rows.tolist())}
        return self._pos

    def lookup(self, rows: np.ndarray) -> Column | None:
        """The values of ``rows`` if this chunk holds them all (a view when possible)."""
        if len(rows) == len(self.rows) and np.array_equal(rows, self.rows):
            return self.col
        pos = self.pos()
        try:
            idx = [pos[r] for r in rows.tolist()]
        except KeyError:
            return None
        if idx and idx == list(range(idx[0], idx[0] + len(idx))):
            return take_rows(self.col, slice(idx[0], idx[0] + len(idx)))
        return take_rows(self.col, idx)


class _Cache:
    """Per-field chunks shared by the views of one batch."""

    __slots__ = ("fields", "probe")

    def __init__(self, fields: dict[str, list[_Chunk]] | None = None,
                 probe: tuple[np.ndarray, np.ndarray] | None = None):
        self.fields: dict[str, list[_Chunk]] = fields or {}
        # (rows, shards) of one row of the batch: read to learn dtype/shape of a field
        # when a view with no rows is materialized before anything was fetched
        self.probe = probe

    def lookup(self, field: str, rows: np.ndarray) -> Column | None:
        for chunk in self.fields.get(field, ()):
            col = chunk.lookup(rows)
            if col is not None:
                return col
        return None

    def add(self, field: str, rows: np.ndarray, col: Column) -> None:
        self.fields.setdefault(field, []).insert(0, _Chunk(rows, col))

    def forget(self, dropped: set[int]) -> None:
        """Let go of chunks whose rows were all dropped (their memory, and on the Ray
        transport the storage unit's blocks they view, can be freed)."""
        for f, chunks in list(self.fields.items()):
            keep = [c for c in chunks if not dropped.issuperset(c.rows.tolist())]
            if keep:
                self.fields[f] = keep
            else:
                del self.fields[f]

    def merged(self, other: "_Cache") -> "_Cache":
        out = {k: list(v) for k, v in self.fields.items()}
        for k, v in other.fields.items():
            out.setdefault(k, []).extend(v)
        return _Cache(out, self.probe if self.probe is not None else other.probe)


#: the shard array of a one-row batch on unit ``i`` (read-only, shared)
_ONE_SHARD: list[np.ndarray] = []
for _i in range(64):
    _ONE_SHARD.append(np.array((_i,), dtype=np.int32))
    _ONE_SHARD[-1].flags.writeable = False
del _i


class _BatchLease:
    """Acknowledgement state shared by the views of one delivered batch."""

    __slots__ = ("ids", "open", "released", "dropped", "parts", "pads")

    def __init__(self, ids: tuple[int, ...], parts: Sequence["_BatchLease"] = (),
                 pads: Iterable[int] = ()):
        self.ids = ids
        self.open = bool(ids)
        self.released = False  # given back unacknowledged: its rows go out again
        self.dropped: set[int] = set()
        self.parts = tuple(parts)  # the source leases of a concat (closed with it)
        # rows the batch repeats as DP padding, none of its own: ``drop`` leaves them
        self.pads: frozenset[int] = frozenset(pads).union(*(p.pads for p in self.parts))

    def close(self, released: bool = False) -> None:
        self.open = False
        self.released = released
        for p in self.parts:
            p.close(released)


class RemoteBatch(abc.ABC):
    """Common base of lazy batch views (see the module docstring)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def rows(self) -> list[int]:
        """Row ids, in batch order."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    async def materialize(self, *args, **kwargs) -> Any:
        """Fetch the data of this view."""

    def __bool__(self) -> bool:
        return True


class RowRemoteBatch(RemoteBatch):
    """A lazy view of rows of a queue, keyed by row ids.

    Returned by ``put`` (the rows it created or wrote), ``get`` and ``stream`` (leased
    batches). Indexing, ``select``, ``split`` and friends make views that share the cache
    and, for delivered batches, the lease: ``ack()`` on any view acknowledges the whole
    delivered batch.

    Examples:
        >>> import asyncio, torch, streamrl
        >>> async def main():
        ...     async with streamrl.StreamQueue(capacity=16) as q:
        ...         rows = await q.put({"x": torch.arange(4), "y": torch.ones(4, 2)})
        ...         mb = await q.get("t", fields=["x", "y"], batch_size=4)
        ...         td = await mb[1:3].materialize(["x"])
        ...         await mb.ack()
        ...         return td["x"].tolist()
        >>> asyncio.run(main())
        [1, 2]
    """

    __slots__ = ("_s", "_rows", "_shards", "_versions", "_fields", "_known", "_cache", "_lease",
                 "_task", "_partition", "_scalar", "nbytes", "_lazy", "_pad", "__weakref__")
    _lazy: tuple[Any, Any, Mapping[str, Column]] | None  # a put's, until first used

    def __init__(self, queue: "StreamQueue", rows: Sequence[int] | np.ndarray,
                 shards: Sequence[int] | np.ndarray, fields: Iterable[str], *,
                 versions: Sequence[int] | np.ndarray | None = None,
                 leases: tuple[int, ...] = (), task: str | None = None,
                 partition: str | None = None, cache: _Cache | None = None,
                 lease: _BatchLease | None = None, scalar: bool = False,
                 known: Iterable[str] = (), pads: Iterable[int] = (),
                 pad: Sequence[bool] | np.ndarray | None = None):
        self._s: Session = queue.session
        self._lazy = None
        self._rows = np.asarray(rows, dtype=np.int64)
        self._shards = np.asarray(shards, dtype=np.int32)
        self._versions = None if versions is None else np.asarray(versions, dtype=np.int64)
        # (which positions are padding, None when none is: see ``padding``)
        self._pad = None if pad is None else np.asarray(pad, dtype=np.bool_)
        self._fields = tuple(fields)
        self._known = frozenset(known) | frozenset(self._fields)
        self._cache = cache if cache is not None else _Cache(probe=_probe(self._rows, self._shards))
        # (``pads``: rows a DP share repeats as padding, none of its own; see ``drop``)
        self._lease = lease if lease is not None else _BatchLease(tuple(leases), pads=pads)
        self._task = task
        self._partition = partition
        self._scalar = scalar
        #: For a batch as delivered by ``get``/``stream``: bytes of its requested fields, as
        #: put (known without fetching anything). ``None`` for views and other batches.
        self.nbytes: int | None = None

    @classmethod
    def _put(cls, queue: "StreamQueue", rows: Sequence[int] | int, shards: Sequence[int] | int,
             cols: Mapping[str, Column], partition: str | None) -> "RowRemoteBatch":
        """What ``put`` returns: the rows it created, their cache holding ``cols`` (the
        same as ``RowRemoteBatch(queue, rows, shards, cols, partition=partition)``
        then ``_learn(cols)``). ``rows`` and ``shards`` may be one row id and its unit
        (a one-row put). Made for every put, and most are never looked at: its state is
        built when first used (:meth:`__getattr__`)."""
        self = cls.__new__(cls)
        self._s = queue.session
        self._partition = partition
        self._lazy = (rows, shards, cols)
        return self

    if not TYPE_CHECKING:  # (for the type checker, no attribute is made up)
        def __getattr__(self, name: str) -> Any:
            # reached only for an attribute not set: the state of a put's batch, built on
            # its first use (see _put); any other batch has no such attribute
            try:
                lazy = object.__getattribute__(self, "_lazy")
            except AttributeError:
                lazy = None
            if lazy is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            self._lazy = None
            rows, shards, cols = lazy
            if type(rows) is int:
                r = self._rows = np.array((rows,), dtype=np.int64)
                sh = self._shards = (_ONE_SHARD[shards] if shards < len(_ONE_SHARD)
                                     else np.array((shards,), dtype=np.int32))
            else:
                r = self._rows = np.array(rows, dtype=np.int64)
                sh = self._shards = np.array(shards, dtype=np.int32)
            self._versions = None
            self._pad = None
            names = self._fields = tuple(cols)
            self._known = frozenset(names)
            self._cache = _Cache({f: [_Chunk(r, c)] for f, c in cols.items()},
                                 (r, sh) if len(r) == 1 else _probe(r, sh))
            self._lease = _BatchLease(())
            self._task = None
            self._scalar = False
            self.nbytes = None
            return object.__getattribute__(self, name)

    # ------------------------------------------------------------------ metadata

    @property
    def rows(self) -> list[int]:
        """Row ids, in batch order."""
        return self._rows.tolist()

    @property
    def shards(self) -> list[int]:
        """The storage unit of each row."""
        return self._shards.tolist()

    @property
    def versions(self) -> list[int] | None:
        """The policy version each row was put with (delivered batches only)."""
        return None if self._versions is None else self._versions.tolist()

    @property
    def fields(self) -> tuple[str, ...]:
        """Fields this view materializes by default: those asked for (stream/get), put,
        written through it, or selected."""
        return self._fields

    @property
    def known_fields(self) -> frozenset[str]:
        """Every field known to be written on all these rows (a superset of
        :attr:`fields`); ``select`` accepts these."""
        return self._known

    @property
    def task(self) -> str | None:
        """The task the batch was delivered to (``None`` for batches from ``put``)."""
        return self._task

    @property
    def partition(self) -> str | None:
        """The partition of the rows, when they share one (``None`` otherwise)."""
        return self._partition

    @property
    def leased(self) -> bool:
        """True while the delivered batch is leased (not acked, dropped or released)."""
        return self._lease.open

    @property
    def lease_ids(self) -> tuple[int, ...]:
        """The leases this batch acknowledges (several after ``concat``)."""
        return self._lease.ids

    @property
    def padding(self) -> torch.Tensor:
        """A bool mask shaped like :attr:`batch_size`: ``True`` where this batch holds a
        row as padding. A DP batch of a dispatch that did not split evenly
        (``dp_remainder="pad"``) repeats rows of other ranks' shares after its own rows
        so that every rank gets as many; a loss that must count each sample once leaves
        them out (``loss[~mb.padding]``). The mask is by position: a row a custom
        sampler repeats from the rank's own share is ``False`` in its own place and
        ``True`` in the repeat. Views, concats and pickled copies keep the mask of the
        places they hold; it is all ``False`` for any other batch. Reads no data.

        Examples:
            >>> import asyncio, torch, streamrl
            >>> async def main():
            ...     async with streamrl.StreamQueue(consumers=["t"]) as q:
            ...         await q.put({"x": torch.arange(3)}, partition="p")
            ...         await q.seal("p")
            ...         kw = dict(partition="p", dp_size=2, dp_remainder="pad")
            ...         a = await q.get("t", ["x"], 2, dp_rank=0, **kw)
            ...         b = await q.get("t", ["x"], 2, dp_rank=1, **kw)
            ...         return a.padding.tolist(), b.padding.tolist()
            >>> asyncio.run(main())
            ([False, False], [False, True])
        """
        pad = self._pad
        mask = (torch.zeros(len(self._rows), dtype=torch.bool) if pad is None
                else torch.from_numpy(pad.copy()))
        return mask.reshape(self.batch_size)

    @property
    def padded(self) -> bool:
        """Whether any place of this batch holds a row as padding (see :attr:`padding`);
        cheaper than ``bool(padding.any())``, which makes a tensor. Reads no data."""
        pad = self._pad
        return pad is not None and bool(pad.any())

    @property
    def one_row(self) -> int | None:
        """The row id when this view is one row of its own (not a scalar view: see
        :meth:`write`; not padding, see :attr:`padding`), else ``None``. Reads nothing;
        the batch of a one-row put answers it without building its state."""
        lazy = self._lazy
        if lazy is not None:
            rows = lazy[0]
            if type(rows) is int:
                return rows
            return int(rows[0]) if len(rows) == 1 else None
        if len(self._rows) != 1 or self._scalar or (self._pad is not None and self._pad[0]):
            return None
        return int(self._rows[0])

    @property
    def queue(self) -> "StreamQueue":
        """The queue the rows belong to."""
        return self._s.queue

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def batch_size(self) -> torch.Size:
        """Like ``TensorDict.batch_size``: ``[len(self)]``, or ``[]`` for an int-index view."""
        return torch.Size([]) if self._scalar else torch.Size([len(self._rows)])

    def __repr__(self) -> str:
        lease = f", task={self._task!r}, leased={self.leased}" if self._task else ""
        return (f"{type(self).__name__}(rows={len(self._rows)}, fields={list(self._fields)}"
                f"{lease})")

    # ------------------------------------------------------------------ views

    def _view(self, idx: Any, *, fields: Iterable[str] | None = None, scalar: bool = False
              ) -> "RowRemoteBatch":
        return RowRemoteBatch(
            self._s.queue, self._rows[idx], self._shards[idx],
            self._fields if fields is None else fields,
            versions=None if self._versions is None else self._versions[idx], task=self._task,
            partition=self._partition, cache=self._cache, lease=self._lease, scalar=scalar,
            known=self._known, pad=None if self._pad is None else self._pad[idx])

    def __getitem__(self, idx: Any) -> "RemoteBatch":
        """Index rows like a TensorDict's batch dimension: ``int`` (a 1-row view whose
        ``materialize`` gives a 0-d TensorDict), ``slice``, list of ints, ``LongTensor``
        or bool mask. A ``str`` gives the lazy column (:class:`ColumnRemoteBatch`) and a
        list of ``str`` a :meth:`select`."""
        if isinstance(idx, str):
            return ColumnRemoteBatch(self.select(idx), idx)
        if isinstance(idx, (list, tuple)) and idx and all(isinstance(i, str) for i in idx):
            return self.select(*idx)
        return self._index(idx)

    def _index(self, idx: Any) -> "RowRemoteBatch":
        """The rows ``idx`` (not a field name) as :meth:`__getitem__` takes them."""
        if self._scalar:
            raise IndexError("cannot index a 0-d view (from an int index) further")
        n = len(self._rows)
        if isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
            i = int(idx)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of range for a batch of {n} rows")
            i %= n
            return self._view(slice(i, i + 1), scalar=True)
        if isinstance(idx, slice):
            return self._view(idx)
        arr = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
        if arr.dtype == bool:
            if arr.shape != (n,):
                raise IndexError(f"a bool mask must have {n} entries (one per row), got shape "
                                 f"{tuple(arr.shape)}")
            return self._view(arr)
        if arr.size == 0:
            return self._view(np.zeros(0, dtype=np.int64))
        if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 1:
            raise IndexError(f"cannot index a batch with {type(idx).__name__} of dtype "
                             f"{arr.dtype} and shape {arr.shape}; use ints, a slice or a bool mask")
        if arr.max() >= n or arr.min() < -n:
            raise IndexError(f"index out of range for a batch of {n} rows")
        return self._view(arr % n)

    def select(self, *fields: str) -> "RowRemoteBatch":
        """A view that materializes only ``fields``.

        Raises:
            UnknownField: a field is not among :attr:`fields`.
        """
        names = _flat_fields(fields)
        unknown = [f for f in names if f not in self._known]
        if unknown:
            raise UnknownField(
                f"this batch's rows are not known to have {unknown}; they have "
                f"{sorted(self._known)}. Fields written later by others can still be read with "
                "materialize([...])")
        return self._view(slice(None), fields=names, scalar=self._scalar)

    def exclude(self, *fields: str) -> "RowRemoteBatch":
        """A view without ``fields``."""
        names = set(_flat_fields(fields))
        return self._view(slice(None), fields=[f for f in self._fields if f not in names],
                          scalar=self._scalar)

    @staticmethod
    def concat(batches: Sequence["RowRemoteBatch"]) -> "RowRemoteBatch":
        """Rows of several batches of one queue, in order. Fields are those common to all;
        caches are shared; acknowledging the result acknowledges every source lease."""
        try:
            batches = list(batches)
        except TypeError:
            raise InvalidArgument(
                f"concat takes a list of RowRemoteBatch, got {type(batches).__name__}") from None
        if not batches:
            raise InvalidArgument("concat needs at least one batch")
        bad = [type(b).__name__ for b in batches if not isinstance(b, RowRemoteBatch)]
        if bad:
            raise InvalidArgument(f"concat takes RowRemoteBatch views only, got {bad}")
        q = batches[0].queue
        if any(b._s is not batches[0]._s and b._s.queue_id != batches[0]._s.queue_id
               for b in batches):
            raise InvalidArgument("concat needs batches of one queue")
        if any(b._scalar for b in batches):
            raise InvalidArgument("cannot concat 0-d views (from an int index); use slices")
        common = [f for f in batches[0]._fields if all(f in b._fields for b in batches[1:])]
        known = frozenset.intersection(*[b._known for b in batches])
        cache = batches[0]._cache
        for b in batches[1:]:
            if b._cache is not cache:
                cache = cache.merged(b._cache)
        leases = tuple(dict.fromkeys(i for b in batches for i in b._lease.ids))
        lease = batches[0]._lease if all(b._lease is batches[0]._lease for b in batches) else _BatchLease(
            leases, parts=list({id(b._lease): b._lease for b in batches}.values()))
        lease.open = any(b._lease.open for b in batches) if lease.ids else False
        versions = (None if any(b._versions is None for b in batches)
                    else np.concatenate([b._versions for b in batches]))
        pad = (None if all(b._pad is None for b in batches) else np.concatenate(
            [np.zeros(len(b._rows), np.bool_) if b._pad is None else b._pad for b in batches]))
        tasks = {b._task for b in batches}
        return RowRemoteBatch(
            q, np.concatenate([b._rows for b in batches]),
            np.concatenate([b._shards for b in batches]), common, versions=versions,
            task=tasks.pop() if len(tasks) == 1 else None,
            partition=batches[0]._partition, cache=cache, lease=lease, known=known, pad=pad)

    def repeat(self, repeats: int) -> "RowRemoteBatch":
        """The rows tiled ``repeats`` times (like ``TensorDict.repeat``)."""
        return self._view(np.tile(np.arange(len(self._rows)), _count(repeats)))

    def repeat_interleave(self, repeats: int) -> "RowRemoteBatch":
        """Each row repeated ``repeats`` times in place (GRPO's n samples per prompt)."""
        return self._view(np.repeat(np.arange(len(self._rows)), _count(repeats)))

    def split(self, split_size: int | Sequence[int]) -> list["RowRemoteBatch"]:
        """Views of ``split_size`` rows each (the last may be shorter), or of the given
        sizes, like ``TensorDict.split``."""
        n = len(self._rows)
        if _is_int(split_size):
            if split_size <= 0:
                raise InvalidArgument(f"split_size must be positive, got {split_size}")
            return [self._view(slice(i, i + split_size)) for i in range(0, n, split_size)] or [self]
        try:
            sizes = list(split_size)
        except TypeError:
            sizes = None
        if sizes is None or not all(_is_int(x) for x in sizes):
            raise InvalidArgument(
                f"split_size must be an int or a list of ints, got {split_size!r}")
        if sum(sizes) != n or any(s < 0 for s in sizes):
            raise InvalidArgument(f"split sizes {sizes} must be >= 0 and sum to {n} rows")
        out, i = [], 0
        for s in sizes:
            out.append(self._view(slice(i, i + s)))
            i += s
        return out

    def chunk(self, chunks: int) -> list["RowRemoteBatch"]:
        """``chunks`` views of near-equal size, like ``TensorDict.chunk``."""
        if not _is_int(chunks) or chunks <= 0:
            raise InvalidArgument(f"chunks must be a positive int, got {chunks!r}")
        n = len(self._rows)
        if not n:  # like torch/TensorDict: ``chunks`` empty views
            return [self._view(slice(0, 0)) for _ in range(chunks)]
        return self.split(-(-n // chunks))

    # ------------------------------------------------------------------ data

    def _check_alive(self, what: str) -> None:
        if self._lease.dropped:
            gone = [r for r in self._rows.tolist() if r in self._lease.dropped]
            if gone:
                raise RowsDropped(
                    f"cannot {what}: rows {rows_preview(gone)} were dropped through this batch "
                    "(drop()); take a new batch", gone)

    async def materialize(self, fields: Sequence[str] | str | None = None, *,
                          copy: bool = False) -> TensorDict:
        """Fetch ``fields`` (default: :attr:`fields`) of these rows as a TensorDict.

        Only fields not already cached by this batch or its views are fetched, one call
        per storage unit. Tensor fields whose rows were put together come back as views of
        the stored tensor (no copy on the embedded transport): treat them as read-only, or
        pass ``copy=True`` for tensors you own (a copy; where the data plane declares
        ``owned_reads``, as the Ray transport does on the storage unit's node, fields not
        cached are read as copy-on-write mappings instead, not cached, and copied only
        where written). Rows of different shapes in one field give a jagged nested
        tensor (layout ``torch.jagged``), and any view of it works: a view whose rows all
        have one shape gets a dense tensor instead (zero rows: ``[0, L, *rest]``, ``L``
        meaningless), whether read from the cache or fetched. Python-object fields give
        a non-tensor stack (``td[name]`` reads it as a list).

        ``import streamrl`` does not import ``tensordict`` (seconds, once a process), so
        that processes that only put stay light; a consumer's ``get`` or ``stream``
        imports it before its first lease. A batch materialized in a process that never
        asked for one (it was sent there) imports it here, once.

        Raises:
            UnknownField: a field is not written for these rows.
            RowsDropped: a row was dropped.
        """
        fields = list(self._fields) if fields is None else _flat_fields(
            [fields] if isinstance(fields, str) else fields)
        self._check_alive("materialize")
        owned: set[str] = set()  # fields read for this call alone, owned already
        cols = await _timed(self._columns(fields, owned if copy and self._s.owned_reads
                                          else None))
        if copy:
            cols = {f: c if f in owned else c.clone() if isinstance(c, torch.Tensor)
                    else list(c) for f, c in cols.items()}
        td = to_tensordict(cols, len(self._rows))
        return td[0] if self._scalar else td

    async def _columns(self, fields: Sequence[str], owned: set[str] | None = None
                       ) -> dict[str, Column]:
        """The columns of ``fields``: cached, or fetched (and cached). With ``owned`` (a
        set to fill), fields not cached are read as data the caller owns
        (``Session.fetch(owned=True)``, no copy where the data plane can), are not
        cached, and are added to ``owned``."""
        rows = self._rows
        out: dict[str, Column] = {}
        missing = []
        for f in fields:
            col = self._cache.lookup(f, rows)
            if col is None:
                missing.append(f)
            else:
                out[f] = col
        if missing and not len(rows):
            out.update(await self._empty_columns(missing))
            missing = []
        if missing:
            inverse: np.ndarray | None = None
            if len(rows) < 2 or bool((rows[1:] > rows[:-1]).all()):  # no row twice
                uniq = rows
            else:
                uniq, inverse = np.unique(rows, return_inverse=True)
            if len(uniq) == len(rows):
                fetch_rows, fetch_shards, inverse = rows, self._shards, None
            else:
                first = np.unique(rows, return_index=True)[1]
                fetch_rows, fetch_shards = uniq, self._shards[first]
            try:
                got = await self._s.fetch(fetch_rows, fetch_shards, missing, task=self._task,
                                          owned=owned is not None)
            except UnknownField:
                await self._check_withdrawn(fetch_rows)
                raise
            for f in missing:
                if owned is None:
                    self._cache.add(f, fetch_rows, got[f])
                else:  # (the caller may write into it: another view must not see that)
                    owned.add(f)
                out[f] = got[f] if inverse is None else take_rows(got[f], inverse.tolist())
        return {f: out[f] for f in fields}

    async def _check_withdrawn(self, rows: np.ndarray) -> None:
        """Raise :class:`RowsDropped` for rows that left this batch's lease: a write
        that made them ready was taken back (its writer was cancelled), so a field the
        batch asked for is not written any more. They are delivered again once it is."""
        if not self._lease.ids:
            return
        held = set(await self._s.lease_rows(self._lease.ids))
        gone = [r for r in rows.tolist() if r not in held]
        if gone:
            raise RowsDropped(
                f"rows {rows_preview(gone)} left this batch: a write of fields it asked for "
                "was taken back (its writer was cancelled) or they were dropped. Skip them; "
                "ack the batch for the rest (they are delivered again once written)", gone)

    async def _empty_columns(self, fields: Sequence[str]) -> dict[str, Column]:
        """Zero-row columns (a view with no rows), with the dtype and per-row shape the
        fields have: sliced from the cache, or from one fetched row of the batch."""
        out: dict[str, Column] = {}
        need = []
        for f in fields:
            chunks = self._cache.fields.get(f)
            if chunks:
                out[f] = take_rows(chunks[0].col, slice(0, 0))
            else:
                need.append(f)
        if need:
            if self._cache.probe is None:
                raise SchemaError(f"cannot tell the dtype and shape of {need} for a batch of "
                                  "0 rows that never had rows; materialize a non-empty batch")
            rows, shards = self._cache.probe
            got = await self._s.fetch(rows, shards, need)
            for f in need:
                self._cache.add(f, rows, got[f])
                out[f] = take_rows(got[f], slice(0, 0))
        return out

    async def write(self, data: Mapping[str, Any] | TensorDictBase, *,
                    overwrite: bool = False) -> "RowRemoteBatch":
        """Write new fields to these rows (``len(data) == len(self)``). The written values
        are cached, so materializing them from this batch costs nothing.

        A DP batch padded with rows of other ranks' shares (see :attr:`padding`) writes
        its own rows only: give a value for every place, as for any batch; those at
        padding places are left out (the rank whose share the row is writes it).

        Raises:
            SchemaError: wrong length, or the batch repeats rows.
            DuplicateField: a field is already written and ``overwrite`` is false.
            RowsDropped: a row was dropped.
        """
        if self._lazy is None:  # (a put's batch, unbuilt: its rows are its put's, once each)
            self._check_alive("write")
            if self._scalar:
                raise SchemaError("write through a batch of rows (use a slice, not an int index)")
            own = self._rows if self._pad is None else self._rows[~self._pad]
            if len(own) > 1 and len(set(own.tolist())) != len(own):  # (np.unique: 4-9x)
                raise SchemaError("this batch repeats rows (repeat/concat of overlapping "
                                  "views); write through a batch where each row appears once")
        await self._s.write(self, data, overwrite=overwrite)
        return self

    def _learn(self, cols: Mapping[str, Column]) -> None:
        """Remember fields just written through this batch (and cache their values)."""
        lazy = self._lazy
        if lazy is not None:  # (a put's batch, unbuilt: built with these too when used)
            self._lazy = (lazy[0], lazy[1], {**lazy[2], **cols})
            return
        for f, col in cols.items():
            self._cache.add(f, self._rows, col)
        self._fields = tuple(dict.fromkeys(self._fields + tuple(cols)))
        self._known = self._known | frozenset(cols)

    async def ack(self) -> None:
        """Acknowledge the delivered batch (all its rows, whichever view you call it on):
        the task is done with them. Idempotent; a no-op for batches that were not
        delivered (from ``put``).

        An ack runs to the end even when the awaiting task is cancelled meanwhile (the
        cancellation goes on after it), so a lease is never left half-acknowledged. It
        does not wait for the storage units to delete rows it lets go (every task done
        with them): producers waiting for the room they free get it once they are gone,
        and ``stats()`` waits for them.

        Raises:
            LeaseExpired: the lease had expired and the rows went to another consumer,
                or the batch was given back before (``release()``, or its stream let it
                go when the task iterating it failed): its rows are delivered again.
        """
        if not self._lease.open:
            if self._lease.released:
                raise LeaseExpired(
                    f"this batch ({len(self)} rows) was given back unacknowledged before "
                    "this ack (by release(), or by its stream when the task iterating it "
                    "raised or was cancelled): its rows are delivered again. Ack a batch "
                    "before giving it up")
            return
        self._lease.close()
        if _timing_open():  # (a timed block counts the call and its time)
            await _timed(shielded(self._s.ack(self._lease.ids)))
            return
        rest = self._s.ack_now(self._lease.ids)
        if rest is not None:
            await shielded(rest)

    def close_for_ack(self) -> tuple[int, ...]:
        """Close the delivered batch's lease here and return its lease ids, which the
        caller acknowledges with its next control call (a stream asking for its next
        batch: :meth:`streamrl.session.Session.ack_take`). Only for an open lease
        (:attr:`leased`); use :meth:`ack` otherwise."""
        if not self._lease.open:
            raise InvalidArgument("close_for_ack needs an open lease (this batch was "
                                  "acknowledged, dropped or given back); use ack()")
        self._lease.close()
        return self._lease.ids

    async def release(self) -> None:
        """Give the delivered batch back unacknowledged: its rows are delivered again to
        the task. Idempotent; runs to the end even if the awaiting task is cancelled."""
        if not self._lease.open:
            return
        self._lease.close(released=True)
        await _timed(shielded(self._s.release(self._lease.ids)))

    def release_nowait(self) -> None:
        """Give the delivered batch back without awaiting (from callbacks, finalizers or
        other threads): the release is queued and applied by the queue's event loop.
        Best effort: if the queue is gone, the lease timeout applies."""
        if not self._lease.open:
            return
        self._lease.close(released=True)
        try:
            self._s.release_nowait(self._lease.ids)
        except Exception:  # interpreter shutdown, loop gone: the lease timeout applies
            pass

    async def drop(self) -> None:
        """Delete these rows from the queue for good (idempotent) and free their bytes.
        Dropping a whole delivered batch also ends its lease. Any later ``materialize``
        or ``write`` through this batch raises :class:`~streamrl.errors.RowsDropped`.
        Runs to the end even if the awaiting task is cancelled meanwhile.

        A DP batch padded with rows of other ranks' shares (``dp_remainder="pad"``)
        deletes its own rows only: the padding rows are left to the shares they belong
        to, and this batch's lease ends once only padding is left (acknowledged)."""
        await _timed(shielded(self._drop()))

    async def _drop(self) -> None:
        lease = self._lease
        pads = lease.pads
        rows = [r for r in self._rows.tolist() if r not in lease.dropped and r not in pads]
        if rows:
            lease.dropped.update(rows)
            self._cache.forget(lease.dropped)  # their views may be reused
            await self._s.drop(rows)
        if lease.open and lease.ids:
            remaining = await self._s.lease_rows(lease.ids)
            if not remaining:
                lease.close()
            elif pads and pads.issuperset(remaining):
                # only padding is left: rows of other shares, which this batch is done
                # with (acknowledged: their own shares still read them)
                try:
                    await self._s.ack(list(lease.ids))
                except LeaseExpired:  # (it ended meanwhile: nothing of it is left here)
                    pass
                lease.close()

    # ------------------------------------------------------------------ pickling

    def __getstate__(self):
        lease = self._lease
        return {"q": self._s.queue, "rows": self._rows, "shards": self._shards,
                "versions": self._versions, "fields": self._fields, "known": self._known,
                "leases": lease.ids, "open": lease.open, "released": lease.released,
                "pads": tuple(lease.pads), "nbytes": self.nbytes, "task": self._task,
                "partition": self._partition, "scalar": self._scalar,
                "probe": self._cache.probe, "pad": self._pad}

    def __setstate__(self, st):
        self._s = st["q"].session
        self._lazy = None
        self._rows, self._shards, self._versions = st["rows"], st["shards"], st["versions"]
        self._pad = st.get("pad")
        self._fields = st["fields"]
        self._known = st["known"]
        self._cache = _Cache(probe=st.get("probe"))
        self._lease = _BatchLease(st["leases"], pads=st.get("pads", ()))
        self._lease.open = st["open"]
        self._lease.released = st.get("released", False)
        self._task, self._partition, self._scalar = st["task"], st["partition"], st["scalar"]
        self.nbytes = st.get("nbytes")


class ColumnRemoteBatch(RemoteBatch):
    """A lazy column: one field of some rows, keyed by the field (column) id.

    ``await col.materialize()`` returns the column itself: a tensor (or a jagged nested
    tensor when the rows differ in shape, or a list for Python objects), as ``td[field]``
    would. Index it by rows like the batch it came from; an int index gives the row.

    Examples:
        >>> import asyncio, torch, streamrl
        >>> async def main():
        ...     async with streamrl.StreamQueue(capacity=16) as q:
        ...         await q.put({"reward": torch.tensor([0.5, 1.0, 0.0])})
        ...         mb = await q.get("t", fields=["reward"], batch_size=3)
        ...         col = mb["reward"]                  # a ColumnRemoteBatch: nothing fetched
        ...         rewards = await col.materialize()   # the [3] tensor
        ...         first = await col[0].materialize()  # an int index gives the row
        ...         await mb.ack()
        ...         return rewards.tolist(), first.item()
        >>> asyncio.run(main())
        ([0.5, 1.0, 0.0], 0.5)
    """

    __slots__ = ("_batch", "_field")

    def __init__(self, batch: RowRemoteBatch, field: str):
        self._batch = batch
        self._field = field

    @property
    def field(self) -> str:
        """The field (column) this view reads."""
        return self._field

    @property
    def rows(self) -> list[int]:
        """Row ids, in batch order."""
        return self._batch.rows

    @property
    def batch(self) -> RowRemoteBatch:
        """The row view this column belongs to."""
        return self._batch

    def __len__(self) -> int:
        return len(self._batch)

    def __getitem__(self, idx: Any) -> "ColumnRemoteBatch":
        if isinstance(idx, str):
            raise IndexError("a column is already one field; index rows with ints/slices/masks")
        return ColumnRemoteBatch(self._batch._index(idx), self._field)

    def __repr__(self) -> str:
        return f"ColumnRemoteBatch(field={self._field!r}, rows={len(self)})"

    async def materialize(self, *, copy: bool = False) -> Column:
        """Fetch the column (cached like any view)."""
        self._batch._check_alive("materialize")
        col = (await _timed(self._batch._columns([self._field])))[self._field]
        if copy:
            col = col.clone() if isinstance(col, torch.Tensor) else list(col)
        return col[0] if self._batch._scalar else col


class BatchProxy:
    """A local TensorDict overlaid on a remote batch.

    Reads look at local fields first and fetch the rest (once) from the queue; ``set``
    only touches the local overlay until ``commit`` writes it back to the rows.

    Args:
        remote: the rows.
        local: initial local fields (same number of rows), optional.

    Examples:
        >>> import asyncio, torch, streamrl
        >>> async def main():
        ...     async with streamrl.StreamQueue(capacity=16) as q:
        ...         rows = await q.put({"reward": torch.tensor([1.0, 3.0])})
        ...         proxy = streamrl.BatchProxy(rows)
        ...         reward = await proxy.get("reward")            # fetched from the queue once
        ...         proxy["advantage"] = reward - reward.mean()   # local only
        ...         await proxy.commit()                          # writes "advantage" to the rows
        ...         td = await rows.materialize(["advantage"])
        ...         return td["advantage"].tolist()
        >>> asyncio.run(main())
        [-1.0, 1.0]
    """

    def __init__(self, remote: RowRemoteBatch, local: TensorDictBase | Mapping[str, Any] | None = None):
        from tensordict import TensorDict

        self.remote = remote
        self.local = TensorDict({}, batch_size=[len(remote)])
        self._dirty: set[str] = set()
        if local is not None:
            cols, n = to_columns(local)
            if n != len(remote):
                raise SchemaError(f"local data has {n} rows, the remote batch {len(remote)}")
            for k, v in to_tensordict(cols, n).items():
                self.local.set(k, v)
                self._dirty.add(k)

    def __len__(self) -> int:
        return len(self.remote)

    def keys(self) -> list[str]:
        """Local fields, then remote fields not shadowed."""
        local = [k for k in self.local.keys() if isinstance(k, str)]  # (no nested keys)
        return local + [f for f in self.remote.fields if f not in local]

    def __contains__(self, name: str) -> bool:
        return name in self.local.keys() or name in self.remote.fields

    def __setitem__(self, name: str, value: Any) -> None:
        self.set(name, value)

    def set(self, name: str, value: Any) -> None:
        """Set a local field (not written to the queue until :meth:`commit`)."""
        cols, n = to_columns({name: value})
        if n != len(self.remote):
            raise SchemaError(f"field {name!r} has {n} rows, the batch {len(self.remote)}")
        self.local.update(to_tensordict(cols, n))
        self._dirty.add(name)

    def __getitem__(self, name: str) -> Any:
        """A local field (synchronous). Remote fields need ``await proxy.get(name)``."""
        if name in self.local.keys():
            return self.local[name]
        raise KeyError(f"{name!r} is not local; use `await proxy.get({name!r})` to fetch it")

    async def get(self, name: str) -> Any:
        """A field: local if set, else fetched from the queue (and kept locally)."""
        if name not in self.local.keys():
            td = await self.remote.materialize([name])
            self.local.set(name, td.get(name))
        return self.local[name]

    async def materialize(self, fields: Sequence[str] | None = None) -> TensorDict:
        """Local and remote fields merged (local wins) as one TensorDict."""
        from tensordict import TensorDict

        fields = self.keys() if fields is None else list(fields)
        remote = [f for f in fields if f not in self.local.keys()]
        out = TensorDict({}, batch_size=[len(self.remote)])
        if remote:
            out.update(await self.remote.materialize(remote))
        for f in fields:
            if f in self.local.keys():
                out.set(f, self.local.get(f))
        return out

    async def commit(self, fields: Sequence[str] | None = None, *, overwrite: bool = False) -> None:
        """Write local fields set on this proxy (default: all of them) to the rows."""
        fields = sorted(self._dirty) if fields is None else list(fields)
        if fields:
            await self.remote.write({f: self.local.get(f) for f in fields}, overwrite=overwrite)
            self._dirty.difference_update(fields)


def _flat_fields(fields: Iterable[Any]) -> list[str]:
    out: list[str] = []
    for f in fields:
        if isinstance(f, str):
            out.append(f)
        elif isinstance(f, Iterable):
            out.extend(_flat_fields(f))
        else:
            raise InvalidArgument(f"field names must be str, got {f!r}")
    return out


def _probe(rows: np.ndarray, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    return (rows[:1].copy(), shards[:1].copy()) if len(rows) else None


def _is_int(x: Any) -> TypeIs[int | np.integer]:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _count(repeats: int) -> int:
    if not _is_int(repeats) or repeats < 0:
        raise InvalidArgument(f"repeats must be an int >= 0, got {repeats!r}")
    return repeats
