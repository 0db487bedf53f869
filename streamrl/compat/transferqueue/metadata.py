"""``BatchMeta`` and ``KVBatchMeta``: the metadata TransferQueue 0.1.11 hands to its users.

A :class:`BatchMeta` names samples by ``(partition_id, global_index)`` and carries, per
field, a schema (dtype, per-sample shape, nested or not, tensor or not), per sample a
production status (1 = every field of the batch written) and a user dict
(``custom_meta``), plus batch-level ``extra_info``. The attributes and methods user code
reads have TransferQueue's names and meanings; this implementation also remembers where
each sample lives in the streamrl queue (row id and storage unit), so ``get_data`` of a
batch from ``get_meta`` goes straight to the storage units. That part is private
(``_rows``, ``_shards``, ``_store``) and travels with ``select_samples``, ``chunk``,
``concat`` and friends.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from streamrl.errors import InvalidArgument


__all__ = ["BatchMeta", "KVBatchMeta", "schema_of_columns", "storage_name"]

log = logging.getLogger("streamrl.compat.transferqueue")


def storage_name(field: str, dtype_key: str) -> str:
    """The streamrl field that holds TransferQueue field ``field`` when written with
    values of dtype ``dtype_key`` (``"torch.float32"``, ``"object"``).

    TransferQueue checks a field's dtype per partition (and forgets it when the field's
    last sample is cleared); streamrl gives a field one dtype per queue. Keeping the dtype
    in the stored name lets ``"score"`` be a float tensor in one partition and a list in
    another, as TransferQueue allows, with no state kept per name."""
    return f"{field}@{dtype_key}"


def schema_of_columns(cols: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The TransferQueue field schema of streamrl columns (see
    :func:`streamrl.columns.to_columns`): per field ``dtype`` (a ``torch.dtype``, ``None``
    for Python objects), ``shape`` (of one sample; a 1-d column's samples count as
    ``(1,)``, as TransferQueue records them), ``is_nested`` (samples of different shapes),
    ``is_non_tensor`` and, when nested, ``per_sample_shapes``. Private keys: ``_key``
    (the dtype part of the stored name) and ``_shapes`` (one shape or a list per sample)."""
    from streamrl.columns import column_dtype

    out: dict[str, dict[str, Any]] = {}
    for name, col in cols.items():
        key = column_dtype(name, col)
        if isinstance(col, torch.Tensor):
            shape = tuple(col.shape[1:]) if col.dim() > 1 else (1,)
            out[name] = {"dtype": col.dtype, "shape": shape, "is_nested": False,
                         "is_non_tensor": False, "_key": key, "_shapes": shape}
        elif key != "object":  # a list of per-sample tensors (a ragged put)
            shapes = [tuple(x.shape) for x in col]
            uniform = len(set(shapes)) == 1
            meta = {"dtype": col[0].dtype, "shape": shapes[0] if uniform else None,
                    "is_nested": not uniform, "is_non_tensor": False, "_key": key,
                    "_shapes": shapes[0] if uniform else shapes}
            if not uniform:
                meta["per_sample_shapes"] = shapes
            out[name] = meta
        else:
            out[name] = {"dtype": None, "shape": None, "is_nested": False,
                         "is_non_tensor": True, "_key": key, "_shapes": None}
    return out


def public_schema(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A field schema without the private keys."""
    return {k: v for k, v in meta.items() if not k.startswith("_")}


class _SampleView:
    """One sample of a :class:`BatchMeta`, read-only."""

    __slots__ = ("_b", "_i")

    def __init__(self, batch: "BatchMeta", i: int):
        self._b, self._i = batch, i

    @property
    def global_index(self) -> int:
        return self._b.global_indexes[self._i]

    @property
    def partition_id(self) -> str:
        return self._b.partition_ids[self._i]

    @property
    def production_status(self) -> int:
        return int(self._b.production_status[self._i])

    @property
    def custom_meta(self) -> Mapping[str, Any]:
        return MappingProxyType(self._b.custom_meta[self._i])

    @property
    def fields(self) -> Mapping[str, Mapping[str, Any]]:
        """Per field: the schema of this sample (``shape`` is its own shape)."""
        out = {}
        for name, meta in self._b.field_schema.items():
            m = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                m["shape"] = shapes[self._i]
            out[name] = MappingProxyType(m)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (f"Sample(global_index={self.global_index}, partition_id={self.partition_id!r}, "
                f"production_status={self.production_status})")


class _Samples:
    __slots__ = ("_b",)

    def __init__(self, batch: "BatchMeta"):
        self._b = batch

    def __len__(self) -> int:
        return self._b.size

    def __getitem__(self, i: int) -> _SampleView:
        if not -self._b.size <= i < self._b.size:
            raise IndexError(f"sample {i} of a batch of {self._b.size}")
        return _SampleView(self._b, i % self._b.size)

    def __iter__(self):
        return (_SampleView(self._b, i) for i in range(self._b.size))


class BatchMeta:
    """Metadata of a batch of samples (TransferQueue's ``BatchMeta``).

    Args:
        global_indexes: the samples' global indexes.
        partition_ids: the partition of each sample.
        field_schema: ``{field: {"dtype", "shape", "is_nested", "is_non_tensor",
            "per_sample_shapes"?}}``.
        production_status: per sample, 1 when every field of the batch is written.
        extra_info: batch-level information of the user's.
        custom_meta: per sample, a dict of the user's (kept by the controller with
            ``set_custom_meta``/``put``).

    ``is_ready`` is true when the batch is not empty and every sample is produced.
    ``field_names`` are sorted. Views (``select_samples``, ``[i]``, ``chunk``...) copy.
    """

    __slots__ = ("global_indexes", "partition_ids", "field_schema", "production_status",
                 "extra_info", "custom_meta", "_custom_backend_meta", "_rows", "_shards",
                 "_store")

    def __init__(self, global_indexes: Sequence[int], partition_ids: Sequence[str],
                 field_schema: Mapping[str, Mapping[str, Any]] | None = None,
                 production_status: Any = None, extra_info: Mapping[str, Any] | None = None,
                 custom_meta: Sequence[Mapping[str, Any]] | None = None,
                 _custom_backend_meta: Sequence[Mapping[str, Any]] | None = None, *,
                 _rows: Sequence[int | None] | None = None,
                 _shards: Sequence[int | None] | None = None,
                 _store: Mapping[str, str] | None = None):
        self.global_indexes = [int(i) for i in global_indexes]
        self.partition_ids = list(partition_ids)
        n = len(self.global_indexes)
        if len(self.partition_ids) != n:
            raise InvalidArgument(f"{n} global_indexes but {len(self.partition_ids)} partition_ids; "
                             "give one partition id per sample")
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != n:
                raise InvalidArgument(f"field {name!r} has {len(shapes)} per_sample_shapes for "
                                 f"{n} samples")
        if production_status is None:
            self.production_status = np.zeros(n, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8).reshape(-1)
            if len(self.production_status) != n:
                raise InvalidArgument(f"production_status has {len(self.production_status)} "
                                 f"entries for {n} samples")
        self.extra_info = dict(extra_info or {})
        self.custom_meta = _per_sample("custom_meta", custom_meta, n)
        self._custom_backend_meta = _per_sample("_custom_backend_meta", _custom_backend_meta, n)
        self._rows = list(_rows) if _rows is not None else [None] * n
        self._shards = list(_shards) if _shards is not None else [None] * n
        if len(self._rows) != n or len(self._shards) != n:
            raise InvalidArgument("_rows and _shards need one entry per sample")
        self._store = dict(_store or {})

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        if not self.production_status.flags.writeable:  # Ray hands out read-only arrays
            self.production_status = self.production_status.copy()

    # ------------------------------------------------------------------ reading

    @property
    def size(self) -> int:
        """The number of samples."""
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        """The fields of the batch, sorted."""
        return sorted(self.field_schema)

    @property
    def samples(self) -> _Samples:
        """Per-sample read-only views: ``meta.samples[i].fields["x"]["shape"]``."""
        return _Samples(self)

    @property
    def is_ready(self) -> bool:
        """True when the batch has samples and each is produced."""
        return self.size > 0 and bool(np.all(self.production_status == 1))

    def _schema(self, field_name: str) -> dict[str, Any]:
        try:
            return self.field_schema[field_name]
        except KeyError:
            raise KeyError(f"field {field_name!r} is not in this batch; it has "
                           f"{self.field_names}") from None

    def get_dtypes(self, field_name: str) -> list:
        """The dtype of ``field_name``, once per sample."""
        return [self._schema(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list:
        """The shape of ``field_name`` of each sample."""
        meta = self._schema(field_name)
        shapes = meta.get("per_sample_shapes")
        return list(shapes) if shapes is not None else [meta.get("shape")] * self.size

    # ------------------------------------------------------------------ extra info

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        """A deep copy of ``extra_info``."""
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: Mapping[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    # ------------------------------------------------------------------ custom meta

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of the per-sample custom metadata, in sample order."""
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[Mapping[str, Any]] | None) -> None:
        """Merge one dict per sample into the samples' custom metadata (the controller
        keeps it once the batch goes through ``set_custom_meta`` or ``put``)."""
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise InvalidArgument(f"{len(custom_meta)} custom_meta dicts for {self.size} samples; "
                             "give one per sample")
        for mine, new in zip(self.custom_meta, custom_meta):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    # ------------------------------------------------------------------ changing

    def add_fields(self, tensor_dict: Any, set_all_ready: bool = True) -> "BatchMeta":
        """Record the fields of ``tensor_dict`` (one row per sample) in the schema, in
        place, and (by default) mark every sample produced. Returns ``self``."""
        from streamrl.columns import to_columns

        n = _rows_of(tensor_dict)
        if n == 0:
            return self
        if n != self.size:
            raise InvalidArgument(f"add_fields got {n} rows for a batch of {self.size} samples")
        cols, _ = to_columns(tensor_dict)
        for name, meta in schema_of_columns(cols).items():
            self.field_schema[name] = public_schema(meta)
            self._store[name] = storage_name(name, meta["_key"])
        if set_all_ready:
            self.production_status[:] = 1
        return self

    def _take(self, idx: Sequence[int]) -> "BatchMeta":
        schema = {}
        for name, meta in self.field_schema.items():
            m = copy.deepcopy(meta)
            if meta.get("per_sample_shapes") is not None:
                m["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in idx]
            schema[name] = m
        return BatchMeta(
            [self.global_indexes[i] for i in idx], [self.partition_ids[i] for i in idx],
            schema, self.production_status[list(idx)], self.extra_info,
            [copy.deepcopy(self.custom_meta[i]) for i in idx],
            [copy.deepcopy(self._custom_backend_meta[i]) for i in idx],
            _rows=[self._rows[i] for i in idx], _shards=[self._shards[i] for i in idx],
            _store=self._store)

    def select_samples(self, sample_indices: Sequence[int]) -> "BatchMeta":
        """A new batch of the samples at these positions."""
        bad = [i for i in sample_indices if not 0 <= i < self.size]
        if bad:
            raise InvalidArgument(f"sample positions {bad[:8]} are outside [0, {self.size})")
        return self._take(list(sample_indices))

    def select_fields(self, field_names: Sequence[str]) -> "BatchMeta":
        """A new batch with only these fields (names the batch lacks are skipped)."""
        keep = [f for f in field_names if f in self.field_schema]
        return BatchMeta(
            self.global_indexes, self.partition_ids,
            {f: copy.deepcopy(self.field_schema[f]) for f in keep},
            self.production_status.copy(), copy.deepcopy(self.extra_info),
            copy.deepcopy(self.custom_meta),
            [{k: v for k, v in m.items() if k.startswith("_") or k in field_names}
             for m in self._custom_backend_meta],
            _rows=self._rows, _shards=self._shards,
            _store={f: s for f, s in self._store.items() if f in keep})

    def copy(self) -> "BatchMeta":
        """A deep copy."""
        out = self._take(range(self.size))
        out.extra_info = copy.deepcopy(self.extra_info)
        return out

    def __getitem__(self, item: Any) -> "BatchMeta":
        if isinstance(item, (int, np.integer)):
            i = int(item) + (self.size if item < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"sample {item} of a batch of {self.size}")
            return self._take([i])
        if isinstance(item, slice):
            return self._take(range(*item.indices(self.size)))
        raise TypeError(f"index a BatchMeta with an int or a slice, not {type(item).__name__}")

    def chunk(self, chunks: int) -> list["BatchMeta"]:
        """Split into ``chunks`` parts, sizes differing by at most one (earlier parts
        larger); parts may be empty when there are fewer samples than chunks."""
        if chunks <= 0:
            raise InvalidArgument(f"chunks must be positive, got {chunks}")
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            stop = start + base + (1 if i < extra else 0)
            out.append(self._take(range(start, stop)))
            start = stop
        return out

    def chunk_by_partition(self) -> list["BatchMeta"]:
        """One batch per partition, in order of first appearance."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(self.partition_ids):
            groups[p].append(i)
        return [self._take(idx) for idx in groups.values()]

    def union(self, other: "BatchMeta") -> "BatchMeta":
        """The fields of both batches over the same samples (``other`` wins on a clash);
        a sample is produced only when it is on both sides."""
        if other is None or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes or self.partition_ids != other.partition_ids:
            raise InvalidArgument("union needs the same samples (global_indexes and partition_ids) "
                             "on both sides, in the same order")
        out = self.copy()
        for name, meta in other.field_schema.items():
            out.field_schema[name] = copy.deepcopy(meta)
        out._store.update(other._store)
        out.production_status = np.bitwise_and(self.production_status, other.production_status)
        out.extra_info.update(other.extra_info)
        for mine, theirs in zip(out.custom_meta, other.custom_meta):
            mine.update(copy.deepcopy(theirs))
        for mine, theirs in zip(out._custom_backend_meta, other._custom_backend_meta):
            mine.update(copy.deepcopy(theirs))
        out._rows = [a if a is not None else b for a, b in zip(self._rows, other._rows)]
        out._shards = [a if a is not None else b for a, b in zip(self._shards, other._shards)]
        return out

    @classmethod
    def concat(cls, data: Sequence["BatchMeta"], validate: bool = True) -> "BatchMeta":
        """One batch of the samples of ``data`` in order (empty batches are skipped).
        With ``validate``, every batch must have the same fields with the same dtypes."""
        parts = [b for b in data if b is not None and b.size > 0]
        if not parts:
            return cls.empty()
        first = parts[0]
        if validate:
            for i, b in enumerate(parts[1:], 1):
                if b.field_names != first.field_names:
                    raise InvalidArgument(f"concat: batch {i} has fields {b.field_names}, batch 0 "
                                     f"has {first.field_names}")
                for f in first.field_names:
                    if b.field_schema[f].get("dtype") != first.field_schema[f].get("dtype"):
                        raise InvalidArgument(f"concat: field {f!r} has dtype "
                                         f"{b.field_schema[f].get('dtype')} in batch {i} and "
                                         f"{first.field_schema[f].get('dtype')} in batch 0")
        schema: dict[str, dict[str, Any]] = {}
        for f, meta in first.field_schema.items():
            nested = any(b.field_schema.get(f, {}).get("is_nested", False) for b in parts)
            m = {"dtype": meta.get("dtype"), "shape": None if nested else meta.get("shape"),
                 "is_nested": nested, "is_non_tensor": meta.get("is_non_tensor", False)}
            if nested or any(b.field_schema.get(f, {}).get("per_sample_shapes") for b in parts):
                m["per_sample_shapes"] = [s for b in parts for s in b.get_shapes(f)] \
                    if all(f in b.field_schema for b in parts) else None
            schema[f] = m
        extra: dict[str, Any] = {}
        for b in parts:
            for k, v in b.extra_info.items():
                if k in extra and not _same(extra[k], v):
                    raise InvalidArgument(f"concat: extra_info {k!r} differs between batches "
                                     f"({extra[k]!r} and {v!r}) and cannot be merged")
                extra.setdefault(k, v)
        store: dict[str, str] = {}
        for b in parts:
            for f, s in b._store.items():
                if store.setdefault(f, s) != s:
                    raise InvalidArgument(f"concat: field {f!r} holds different dtypes in these "
                                     "batches; read them separately")
        chain = itertools.chain.from_iterable
        return cls(list(chain(b.global_indexes for b in parts)),
                   list(chain(b.partition_ids for b in parts)), schema,
                   np.concatenate([b.production_status for b in parts]), extra,
                   list(chain(b.custom_meta for b in parts)),
                   list(chain(b._custom_backend_meta for b in parts)),
                   _rows=list(chain(b._rows for b in parts)),
                   _shards=list(chain(b._shards for b in parts)), _store=store)

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the samples in the order of ``indices`` (a permutation), in place."""
        idx = list(indices)
        if sorted(idx) != list(range(self.size)):
            raise InvalidArgument(f"reorder needs a permutation of range({self.size}), got {idx[:8]}")
        other = self._take(idx)
        for slot in ("global_indexes", "partition_ids", "production_status", "custom_meta",
                     "_custom_backend_meta", "_rows", "_shards"):
            setattr(self, slot, getattr(other, slot))
        for name, meta in self.field_schema.items():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = other.field_schema[name]["per_sample_shapes"]

    @classmethod
    def empty(cls, extra_info: Mapping[str, Any] | None = None) -> "BatchMeta":
        """A batch of no samples."""
        return cls([], [], extra_info=extra_info)

    def __repr__(self) -> str:
        return (f"BatchMeta(size={self.size}, field_names={self.field_names}, "
                f"is_ready={self.is_ready}, global_indexes={self.global_indexes}, "
                f"extra_info={self.extra_info})")

    __str__ = __repr__


def _per_sample(name: str, values: Sequence[Mapping[str, Any]] | None, n: int) -> list[dict]:
    if not values:
        return [{} for _ in range(n)]
    if len(values) != n:
        raise InvalidArgument(f"{name} has {len(values)} entries for {n} samples")
    return [dict(v) for v in values]


def _rows_of(td: Any) -> int:
    bs = getattr(td, "batch_size", None)
    if bs is not None and len(bs):
        return int(bs[0])
    for v in td.values():
        return v.shape[0] if hasattr(v, "shape") else len(v)
    return 0


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False


@dataclasses.dataclass
class KVBatchMeta:
    """What the key-value calls return (TransferQueue's ``KVBatchMeta``): the keys, one
    tag dict per key, the partition, and every field written to those keys."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise InvalidArgument(f"{len(self.keys)} keys but {len(self.tags)} tags; give one tag "
                             "dict per key")
        if len(set(self.keys)) != len(self.keys):
            raise InvalidArgument("the keys repeat; give each key once")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise InvalidArgument("the fields repeat; give each field once")
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return f"KVBatchMeta(size={self.size}, field_names={self.fields}, extra_info={self.extra_info})"

    def select_keys(self, keys_to_select: Sequence[str]) -> "KVBatchMeta":
        """A new batch of these keys (each once, all of them in this batch)."""
        keys = list(keys_to_select)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys_to_select repeats a key")
        pos = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys if k not in pos]
        if missing:
            raise RuntimeError(f"keys {missing[:8]} are not in this batch")
        return KVBatchMeta(keys, [self.tags[pos[k]] for k in keys], self.partition_id,
                           self.fields, self.extra_info)

    def reorder(self, indexes: Sequence[int]) -> None:
        """Put the keys in the order of ``indexes``, in place."""
        idx = list(indexes)
        if len(idx) != self.size:
            raise InvalidArgument(f"reorder got {len(idx)} indexes for {self.size} keys")
        if len(set(idx)) != len(idx):
            raise InvalidArgument("reorder indexes repeat")
        self.keys = [self.keys[i] for i in idx]
        self.tags = [self.tags[i] for i in idx]

    def chunk(self, chunks: int) -> list["KVBatchMeta"]:
        """Split into ``chunks`` parts, sizes differing by at most one."""
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            stop = start + base + (1 if i < extra else 0)
            out.append(KVBatchMeta(self.keys[start:stop], self.tags[start:stop],
                                   self.partition_id, self.fields, self.extra_info))
            start = stop
        return out

    @classmethod
    def concat(cls, data: Sequence["KVBatchMeta"]) -> "KVBatchMeta":
        """One batch of the keys of ``data`` (same partition and fields)."""
        parts = [b for b in data if b is not None and b.size > 0]
        if not parts:
            return cls()
        first = parts[0]
        extra: dict[str, Any] = {}
        for b in parts:
            if b.fields is not None and first.fields is not None and set(b.fields) != set(first.fields):
                raise InvalidArgument("concat: the batches have different fields")
            if b.partition_id != first.partition_id:
                raise InvalidArgument("concat: the batches are of different partitions")
            for k, v in (b.extra_info or {}).items():
                if k in extra and not _same(extra[k], v):
                    raise InvalidArgument(f"concat: extra_info {k!r} differs between batches")
                extra.setdefault(k, v)
        return cls([k for b in parts for k in b.keys], [t for b in parts for t in b.tags],
                   first.partition_id, first.fields, extra or None)
