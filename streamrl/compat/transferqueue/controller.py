"""The TransferQueue controller of the compatibility layer.

TransferQueue's users depend on metadata streamrl's own controller deliberately does not
keep: global indexes that name samples (reused after a clear), samples allocated before
any data (``get_meta(mode="insert")``), consumption marked when metadata is handed out
(and undone by ``reset_consumption``), reads that ignore consumption (``force_fetch``),
user keys and per-sample tags. :class:`TQController` keeps exactly that, as a pure state
machine over metadata; the samples' data lives in a :class:`streamrl.StreamQueue` (one
row per sample, one stored field per field and dtype, see :func:`.metadata.storage_name`),
which bounds it (capacity in rows and bytes, ``put`` waits for room) and moves it between
producers, storage units and readers without passing through this controller.

:class:`TQControllerService` is its async face (:class:`~.control.TQControlPlane`):
fetch-mode ``get_meta`` waits for samples event-driven (a waiting call holds nobody else
up), and clearing samples drops their rows from the queue. On the Ray transport the
service runs as the named actor ``TransferQueueController`` in namespace
``transfer_queue`` (``num_cpus=0``), where TransferQueue keeps its own, so code that
inspects it (``get_partition_snapshot``, ``list_partitions``, ``clear_partition``) keeps
working.

A sample is *bound* once its first fields are stored (it has a row); a field is
*produced* for a sample once a ``put`` of it committed. Fetch mode hands out bound samples
whose requested fields are all produced and that the task has not consumed.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from streamrl.errors import InvalidArgument, StreamTimeout


from .metadata import BatchMeta, storage_name
from .sampler import BaseSampler

__all__ = ["TQController", "TQControllerService", "PartitionSnapshot", "ACTOR_NAME",
           "ACTOR_NAMESPACE"]

#: where TransferQueue keeps its controller actor (and so where tools look for it)
ACTOR_NAME = "TransferQueueController"
ACTOR_NAMESPACE = "transfer_queue"

#: the version of :meth:`TQController.state`'s layout (checkpoints name it)
STATE_FORMAT = "streamrl.compat.transferqueue/controller-1"

_PLACEHOLDER = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False}


class _Field:
    """One field of a partition: its dtype, and the shape of each sample holding it."""

    __slots__ = ("dtype", "key", "non_tensor", "shapes", "counts")

    def __init__(self, dtype: Any, key: str, non_tensor: bool):
        self.dtype, self.key, self.non_tensor = dtype, key, non_tensor
        self.shapes: dict[int, tuple | None] = {}  # index -> shape of that sample
        self.counts: collections.Counter = collections.Counter()

    def set(self, index: int, shape: tuple | None) -> None:
        old = self.shapes.get(index, ())
        if old != () and old is not None:
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        self.shapes[index] = shape
        if shape is not None:
            self.counts[shape] += 1

    def set_many(self, indexes: Sequence[int], shapes: tuple | None | list) -> None:
        """:meth:`set` for many samples at once: ``shapes`` is one shape for all of them
        or a list with one per sample. A put of 256 samples x 32 fields made 8192
        :meth:`set` calls (about 45 ms of the controller's time per put here); this is a
        few dict and Counter updates per field."""
        if len(set(indexes)) != len(indexes):  # a sample twice: in order, one at a time
            for pos, i in enumerate(indexes):
                self.set(i, shapes[pos] if isinstance(shapes, list) else shapes)
            return
        known, counts = self.shapes, self.counts
        if known:
            olds = collections.Counter(
                o for o in (known.get(i) for i in indexes) if o is not None)
            if olds:
                counts.subtract(olds)
                for o in olds:
                    if counts[o] <= 0:
                        del counts[o]
        if isinstance(shapes, list):
            known.update(zip(indexes, shapes))
            counts.update(x for x in shapes if x is not None)
        else:
            known.update(dict.fromkeys(indexes, shapes))
            if shapes is not None:
                counts[shapes] += len(indexes)

    def remove(self, index: int) -> None:
        if index in self.shapes:
            self.set(index, None)
            del self.shapes[index]

    def schema(self, indexes: Sequence[int]) -> dict[str, Any]:
        nested = len(self.counts) > 1
        shape = next(iter(self.counts)) if len(self.counts) == 1 else None
        out = {"dtype": self.dtype, "shape": shape, "is_nested": nested,
               "is_non_tensor": self.non_tensor}
        if nested:
            out["per_sample_shapes"] = [self.shapes.get(i) for i in indexes]
        return out


class _Sample:
    __slots__ = ("row", "shard", "fields", "seq", "key")

    def __init__(self, seq: int):
        self.row: int | None = None
        self.shard: int | None = None
        self.fields: set[str] = set()
        self.seq = seq  # insertion order in the partition (groups of GRPOGroupNSampler)
        self.key: str | None = None


class _Partition:
    def __init__(self, name: str):
        self.name = name
        self.created = time.time()
        self.samples: dict[int, _Sample] = {}
        self.columns: dict[str, int] = {}  # every field ever written -> column number
        self.fields: dict[str, _Field] = {}  # fields some sample holds now
        self.consumed: dict[str, set[int]] = {}
        self.custom: dict[int, dict[str, Any]] = {}
        self.keys: dict[str, int] = {}
        self.next_seq = 0

    def new_sample(self, index: int) -> _Sample:
        s = self.samples[index] = _Sample(self.next_seq)
        self.next_seq += 1
        return s

    def remove(self, index: int) -> _Sample | None:
        s = self.samples.pop(index, None)
        if s is None:
            return None
        for f in s.fields:
            fld = self.fields.get(f)
            if fld is not None:
                fld.remove(index)
                if not fld.shapes:
                    del self.fields[f]
        for done in self.consumed.values():
            done.discard(index)
        self.custom.pop(index, None)
        if s.key is not None:
            self.keys.pop(s.key, None)
        return s


class _SamplerView:
    """What a sampler may ask about the partition it samples from."""

    def __init__(self, part: _Partition):
        self._p = part

    def get_custom_meta(self, global_indices: Sequence[int]) -> dict[int, dict[str, Any]]:
        return {i: self._p.custom[i] for i in global_indices if i in self._p.custom}

    def sequence(self, global_indices: Sequence[int]) -> list[int | None]:
        """Insertion order of each sample in the partition (``None``: not in it)."""
        s = self._p.samples
        return [s[i].seq if i in s else None for i in global_indices]


@dataclasses.dataclass
class PartitionSnapshot:
    """A copy of a partition's metadata, with the attribute names of TransferQueue's
    ``DataPartitionStatus``: ``production_status[global_index, field_name_mapping[f]]``
    and ``consumption_status[task][global_index]`` are 1 or 0."""

    partition_id: str
    created_at: float
    global_indexes: set[int]
    field_name_mapping: dict[str, int]
    production_status: torch.Tensor
    consumption_status: dict[str, torch.Tensor]
    custom_meta: dict[int, dict[str, Any]]
    keys_mapping: dict[str, int]
    revert_keys_mapping: dict[int, str]
    field_schema: dict[str, dict[str, Any]]

    @property
    def total_samples_num(self) -> int:
        return len(self.global_indexes)

    @property
    def total_fields_num(self) -> int:
        return len(self.field_name_mapping)

    def get_custom_meta(self, global_indices: Sequence[int]) -> dict[int, dict[str, Any]]:
        return {i: self.custom_meta[i] for i in global_indices if i in self.custom_meta}


class TQController:
    """TransferQueue's metadata as a state machine: no I/O, no waiting.

    Args:
        sampler: the policy of fetch-mode ``get_meta`` (a :class:`~.sampler.BaseSampler`).
        polling_mode: fetch mode gives an empty batch instead of waiting (the waiting is
            :class:`TQControllerService`'s).
    """

    def __init__(self, sampler: BaseSampler, polling_mode: bool = False):
        self.sampler = sampler
        self.polling_mode = polling_mode
        self.parts: dict[str, _Partition] = {}
        self._free: collections.deque[int] = collections.deque()  # reusable global indexes
        self._next = 0

    # ------------------------------------------------------------------ samples

    def _alloc(self, part: _Partition, n: int) -> list[int]:
        out: list[int] = []
        while self._free and len(out) < n:
            out.append(self._free.popleft())
        out.extend(range(self._next, self._next + n - len(out)))
        self._next = max(self._next, max(out, default=-1) + 1)
        for i in out:
            part.new_sample(i)
        return out

    def _part(self, partition_id: str, create: bool = False) -> _Partition | None:
        p = self.parts.get(partition_id)
        if p is None and create:
            p = self.parts[partition_id] = _Partition(partition_id)
        return p

    def _meta(self, p: _Partition, indexes: Sequence[int], fields: Sequence[str],
              status: Sequence[int], placeholders: bool = False) -> BatchMeta:
        schema, store = {}, {}
        for f in fields:
            fld = p.fields.get(f)
            if fld is not None:
                schema[f] = fld.schema(indexes)
                store[f] = storage_name(f, fld.key)
            elif placeholders:
                schema[f] = dict(_PLACEHOLDER)
        smp = [p.samples[i] for i in indexes]
        return BatchMeta(indexes, [p.name] * len(indexes), schema, status, None,
                         [p.custom.get(i, {}) for i in indexes], None,  # (copied there)
                         _rows=[s.row for s in smp], _shards=[s.shard for s in smp],
                         _store=store)

    def _produced(self, p: _Partition, indexes: Sequence[int], fields: Sequence[str]) -> list[int]:
        reg = set(f for f in fields if f in p.columns)
        return [int(bool(reg) and reg <= p.samples[i].fields) for i in indexes]

    # ------------------------------------------------------------------ get_meta modes

    def insert(self, partition_id: str, fields: Sequence[str], batch_size: int) -> BatchMeta:
        """``get_meta(mode="insert")``: ``batch_size`` new samples, no data yet."""
        p = self._part(partition_id, create=True)
        assert p is not None, "_part(create=True) always returns a partition"
        idx = self._alloc(p, batch_size)
        return self._meta(p, idx, fields, [0] * len(idx), placeholders=True)

    def ready(self, partition_id: str, fields: Sequence[str], task: str) -> list[int]:
        """Samples whose ``fields`` are all produced and that ``task`` did not consume."""
        p = self.parts.get(partition_id)
        if p is None or any(f not in p.columns for f in fields):
            return []
        want, done = set(fields), p.consumed.get(task, ())
        return sorted(i for i, s in p.samples.items() if i not in done and want <= s.fields)

    def fetch(self, fields: Sequence[str], batch_size: int, partition_id: str, task: str,
              sampling_config: Mapping[str, Any] | None = None) -> BatchMeta | None:
        """``get_meta(mode="fetch")``: a batch the sampler picks from the ready samples,
        marked consumed by ``task``; ``None`` when there is not enough now."""
        cfg = dict(sampling_config or {})
        ready = self.ready(partition_id, fields, task)
        p = self.parts.get(partition_id)
        if p is None or (len(ready) < batch_size
                         and not self.sampler.has_cached_result(partition_id, task, cfg)):
            return None
        cfg.setdefault("task_name", task)
        cfg.setdefault("partition_id", partition_id)
        cfg["partition"] = _SamplerView(p)
        sampled, consumed = self.sampler(ready, batch_size, **cfg)
        if not sampled:
            return None
        gone = [i for i in sampled if i not in p.samples]
        if gone:
            raise RuntimeError(f"the sampler returned global indexes {gone[:8]} that are not in "
                               f"partition {partition_id!r}")
        p.consumed.setdefault(task, set()).update(consumed)
        return self._meta(p, list(sampled), fields, [1] * len(sampled))

    def force_fetch(self, fields: Sequence[str], partition_id: str) -> BatchMeta:
        """``get_meta(mode="force_fetch")``: every sample of the partition, ready or not,
        consumed or not; consumption is left as it is."""
        p = self.parts.get(partition_id)
        if p is None:
            return BatchMeta.empty()
        idx = sorted(p.samples)
        return self._meta(p, idx, fields, self._produced(p, idx, fields))

    # ------------------------------------------------------------------ writes

    def commit(self, partition_id: str, indexes: Sequence[int] | None, rows: Sequence[int],
               shards: Sequence[int], schema: Mapping[str, Mapping[str, Any]],
               custom_meta: Sequence[Mapping[str, Any]] | None = None
               ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """A put stored ``schema``'s fields in ``rows``: mark them produced.

        ``indexes=None`` makes new samples for the rows (a put without metadata). A
        sample already bound to another row (a concurrent first write won) is left alone
        and reported as a conflict ``(position, its row, its shard)``: the writer rewrites
        those values into that row and commits again.

        Raises:
            ValueError: a field written with another dtype than the partition's samples
                hold, or samples that are not in the partition (cleared). Nothing changes.
        """
        p = self._part(partition_id, create=indexes is None)
        if p is None:
            raise InvalidArgument(f"partition {partition_id!r} does not exist (it was cleared); "
                             "put without metadata to create samples")
        for f, meta in schema.items():
            fld = p.fields.get(f)
            if fld is not None and fld.key != meta["_key"]:
                raise InvalidArgument(
                    f"field {f!r} of partition {partition_id!r} holds {fld.key} values and "
                    f"this put gives {meta['_key']}; a field keeps one dtype in a partition "
                    "(clear its samples first, or use another field name)")
        if indexes is None:
            indexes = self._alloc(p, len(rows))
        else:
            gone = [i for i in indexes if i not in p.samples]
            if gone:
                raise InvalidArgument(f"samples {gone[:8]} are not in partition {partition_id!r} "
                                 "(cleared); get fresh metadata")
        conflicts = []
        took: list[int] = []  # positions of the samples written here
        for pos, (i, row, shard) in enumerate(zip(indexes, rows, shards)):
            s = p.samples[i]
            if s.row is None:
                s.row, s.shard = row, shard
            elif s.row != row:
                assert s.shard is not None, "a sample's row and shard are set together"
                conflicts.append((pos, s.row, s.shard))
                continue
            took.append(pos)
        if not took:
            return list(indexes), conflicts
        every = len(took) == len(indexes)
        idx = list(indexes) if every else [indexes[pos] for pos in took]
        # field by field (one bulk update each), not sample by sample and field by field
        for f, meta in schema.items():
            p.columns.setdefault(f, len(p.columns))
            fld = p.fields.get(f)
            if fld is None:
                fld = p.fields[f] = _Field(meta["dtype"], meta["_key"], meta["is_non_tensor"])
            shapes = meta["_shapes"]
            if isinstance(shapes, list) and not every:
                shapes = [shapes[pos] for pos in took]
            fld.set_many(idx, shapes)
        names = schema.keys()
        samples = p.samples
        for i in idx:
            samples[i].fields.update(names)
        if custom_meta is not None:
            for pos, i in zip(took, idx):
                p.custom[i] = dict(custom_meta[pos])
        return list(indexes), conflicts

    def locate(self, wanted: Mapping[str, Sequence[int]], fields: Sequence[str]
               ) -> dict[str, tuple[list, list, dict[str, str]]]:
        """Per partition: the row and storage unit of each sample (``None``: no data
        yet, or not in the partition) and the stored name of each field."""
        out = {}
        for pid, idx in wanted.items():
            p = self.parts.get(pid)
            smp = [p.samples.get(i) if p else None for i in idx]
            store = {f: storage_name(f, p.fields[f].key) for f in fields
                     if p is not None and f in p.fields}
            out[pid] = ([s.row if s else None for s in smp], [s.shard if s else None for s in smp],
                        store)
        return out

    def set_custom_meta(self, partition_custom_meta: Mapping[str, Mapping[int, Mapping]]) -> None:
        """Replace the custom metadata of samples: ``{partition: {index: dict}}``."""
        for pid, per in partition_custom_meta.items():
            p = self.parts.get(pid)
            if p is None:
                continue
            for i, m in per.items():
                if i in p.samples:
                    p.custom[int(i)] = dict(m)

    # ------------------------------------------------------------------ clearing

    def _release(self, p: _Partition, indexes: Sequence[int]) -> list[tuple[int, int]]:
        rows = []
        for i in indexes:
            s = p.remove(i)
            if s is not None:
                self._free.append(i)
                if s.row is not None:
                    assert s.shard is not None, "a sample's row and shard are set together"
                    rows.append((s.row, s.shard))
        return rows

    def clear_partition(self, partition_id: str) -> list[tuple[int, int]]:
        """Forget a partition; returns the ``(row, shard)`` of its data."""
        p = self.parts.get(partition_id)
        if p is None:
            return []
        # the whole partition goes: no per-field bookkeeping to undo sample by sample
        rows = []
        for s in p.samples.values():
            if s.row is not None:
                assert s.shard is not None, "a sample's row and shard are set together"
                rows.append((s.row, s.shard))
        self._free.extend(p.samples)
        del self.parts[partition_id]
        self.sampler.clear_cache(partition_id)
        return rows

    def clear_samples(self, partition_id: str, indexes: Sequence[int]) -> list[tuple[int, int]]:
        """Forget samples (the partition stays); returns the ``(row, shard)`` of their data."""
        p = self.parts.get(partition_id)
        return self._release(p, list(dict.fromkeys(indexes))) if p is not None else []

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Make a partition's samples unconsumed again for ``task_name`` (every task when
        ``None``). False when there is no such partition."""
        p = self.parts.get(partition_id)
        if p is None:
            return False
        for task, done in p.consumed.items():
            if task_name is None or task == task_name:
                done.clear()
        self.sampler.clear_cache(partition_id)
        return True

    # ------------------------------------------------------------------ status

    def consumption_status(self, task_name: str, partition_id: str):
        """``(global indexes, consumed 1/0)`` of the partition's samples, by index."""
        p = self.parts.get(partition_id)
        if p is None:
            return None, None
        idx = sorted(p.samples)
        done = p.consumed.get(task_name, ())
        return (torch.tensor(idx, dtype=torch.long),
                torch.tensor([int(i in done) for i in idx], dtype=torch.int8))

    def production_status(self, data_fields: Sequence[str], partition_id: str):
        """``(global indexes, [samples, fields] produced 1/0)``; ``(None, None)`` when
        the partition or one of the fields is unknown."""
        p = self.parts.get(partition_id)
        if p is None or not data_fields or any(f not in p.columns for f in data_fields):
            return None, None
        idx = sorted(p.samples)
        st = [[int(f in p.samples[i].fields) for f in data_fields] for i in idx]
        return (torch.tensor(idx, dtype=torch.long),
                torch.tensor(st, dtype=torch.int8).reshape(len(idx), len(data_fields)))

    def list_partitions(self) -> list[str]:
        return list(self.parts)

    def snapshot(self, partition_id: str) -> PartitionSnapshot | None:
        """A copy of a partition's metadata (``None`` when there is none)."""
        p = self.parts.get(partition_id)
        if p is None:
            return None
        top = max(p.samples, default=-1) + 1
        prod = torch.zeros(top, len(p.columns), dtype=torch.int8)
        for i, s in p.samples.items():
            for f in s.fields:
                prod[i, p.columns[f]] = 1
        cons = {}
        for task, done in p.consumed.items():
            t = torch.zeros(top, dtype=torch.int8)
            t[[i for i in done if i < top]] = 1
            cons[task] = t
        idx = sorted(p.samples)
        return PartitionSnapshot(
            p.name, p.created, set(p.samples), dict(p.columns), prod, cons,
            {i: dict(m) for i, m in p.custom.items()}, dict(p.keys),
            {i: k for k, i in p.keys.items()},
            {f: fld.schema(idx) for f, fld in p.fields.items()})

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """Every sample's metadata as plain data (what a checkpoint saves): partitions
        with their samples (row, storage unit, fields, insertion order, key), fields
        (dtype, shapes), consumption, custom metadata, keys; the free global indexes;
        the sampler's state. Nothing of it is shared with the controller."""
        parts = []
        for p in self.parts.values():
            parts.append({
                "name": p.name, "created": p.created, "next_seq": p.next_seq,
                "columns": dict(p.columns),
                "samples": {i: (s.row, s.shard, sorted(s.fields), s.seq, s.key)
                            for i, s in p.samples.items()},
                "fields": {f: (fld.dtype, fld.key, fld.non_tensor, dict(fld.shapes))
                           for f, fld in p.fields.items()},
                "consumed": {t: sorted(done) for t, done in p.consumed.items()},
                "custom": copy.deepcopy(p.custom), "keys": dict(p.keys)})
        saver = getattr(self.sampler, "save_checkpoint", None)
        return {"format": STATE_FORMAT, "parts": parts, "free": list(self._free),
                "next": self._next,
                "sampler": copy.deepcopy(saver()) if callable(saver) else None}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace all metadata by ``state`` (from :meth:`state`); the sampler's state
        is loaded too when the sampler can.

        Raises:
            CheckpointError: ``state`` is not a controller state of a format this
                version reads. Nothing changes.
        """
        from streamrl.errors import CheckpointError

        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(
                f"not a TransferQueue controller state of streamrl.compat.transferqueue "
                f"(format {found!r}, this version reads {STATE_FORMAT!r}); load a checkpoint "
                "that transfer_queue.save_checkpoint wrote with streamrl")
        parts: dict[str, _Partition] = {}
        for d in state["parts"]:
            p = _Partition(d["name"])
            p.created, p.next_seq, p.columns = d["created"], d["next_seq"], dict(d["columns"])
            for i, (row, shard, fields, seq, key) in d["samples"].items():
                s = p.samples[i] = _Sample(seq)
                s.row, s.shard, s.fields, s.key = row, shard, set(fields), key
            for f, (dtype, key, non_tensor, shapes) in d["fields"].items():
                fld = p.fields[f] = _Field(dtype, key, non_tensor)
                for i, shape in shapes.items():
                    fld.set(i, shape)
            p.consumed = {t: set(done) for t, done in d["consumed"].items()}
            p.custom = copy.deepcopy(d["custom"])
            p.keys = dict(d["keys"])
            parts[p.name] = p
        self.parts = parts
        self._free = collections.deque(state["free"])
        self._next = state["next"]
        loader = getattr(self.sampler, "load_checkpoint", None)
        if state.get("sampler") is not None and callable(loader):
            loader(copy.deepcopy(state["sampler"]))

    def rebind(self, moved: Mapping[tuple[str, int], tuple[int, int]]) -> None:
        """Give samples new rows: ``{(partition, index): (row, storage unit)}`` (their
        data was written again elsewhere, as when a checkpoint is loaded)."""
        for (pid, i), (row, shard) in moved.items():
            s = self.parts[pid].samples[i]
            s.row, s.shard = row, shard

    # ------------------------------------------------------------------ keys

    def kv_retrieve_meta(self, keys: Sequence[str], partition_id: str, create: bool = False
                         ) -> BatchMeta:
        """The samples of ``keys`` (keys not found are left out unless ``create``, which
        makes samples for them), with the fields every one of them has."""
        p = self._part(partition_id, create=create)
        if p is None:
            return BatchMeta.empty()
        idx = [p.keys.get(k) for k in keys]
        missing = [pos for pos, i in enumerate(idx) if i is None]
        if missing and create:
            new = self._alloc(p, len(missing))
            for pos, i in zip(missing, new):
                idx[pos] = i
                p.keys[keys[pos]] = i
                p.samples[i].key = keys[pos]
        found = [i for i in idx if i is not None]
        common = [f for f in p.columns if f in p.fields
                  and found and all(f in p.samples[i].fields for i in found)]
        return self._meta(p, found, common, self._produced(p, found, common))

    def kv_retrieve_keys(self, global_indexes: Sequence[int], partition_id: str) -> list[str | None]:
        p = self.parts.get(partition_id)
        if p is None:
            return []
        return [p.samples[i].key if i in p.samples else None for i in global_indexes]

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        """``{partition: {key: tags}}`` for one partition or all (unknown ones are left out)."""
        pids = list(self.parts) if partition_id is None else [partition_id]
        return {pid: {k: dict(self.parts[pid].custom.get(i, {}))
                      for k, i in self.parts[pid].keys.items()}
                for pid in pids if pid in self.parts}


class TQControllerService:
    """The controller as clients call it (:class:`~.control.TQControlPlane`), on the
    embedded transport (in the client's event loop) or as the Ray actor:
    :class:`TQController` plus waiting and the deletion of cleared data from ``queue``.

    Args:
        config: the merged TransferQueue configuration (returned by :meth:`get_config`).
        queue: the :class:`streamrl.StreamQueue` that holds the samples' data.
        settings: the resolved compatibility settings (``sampler``, ``polling_mode``,
            ``get_meta_timeout``).
    """

    def __init__(self, config: Any, queue: Any, settings: Mapping[str, Any]):
        from .sampler import resolve_sampler

        self.ctl = TQController(resolve_sampler(settings["sampler"]), settings["polling_mode"])
        self.queue = queue
        self.config = config
        self.timeout = settings["get_meta_timeout"]
        # partition -> [event set on its next change, number of get_meta waiting on it]
        self._events: dict[str, list] = {}
        self._closed = False
        # rows whose drop waits for a checkpoint being written (None: no checkpoint)
        self._held: list[int] | None = None
        self._saving = asyncio.Lock()

    def _changed(self, partition_id: str) -> None:
        entry = self._events.pop(partition_id, None)
        if entry is not None:
            entry[0].set()

    async def _wait_change(self, partition_id: str, timeout: float | None) -> None:
        entry = self._events.setdefault(partition_id, [asyncio.Event(), 0])
        entry[1] += 1
        try:
            await asyncio.wait_for(entry[0].wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            entry[1] -= 1
            if not entry[1] and self._events.get(partition_id) is entry:
                del self._events[partition_id]

    async def _drop(self, rows: Sequence[tuple[int, int]]) -> None:
        if not rows:
            return
        if self._held is not None:  # a checkpoint is being cut: its rows must stay
            self._held.extend(r for r, _ in rows)
            return
        await self.queue.drop([r for r, _ in rows])

    # -- the calls clients make

    async def get_meta(self, data_fields: Sequence[str], batch_size: int, partition_id: str,
                       mode: str = "fetch", task_name: str | None = None,
                       sampling_config: Mapping[str, Any] | None = None) -> BatchMeta:
        """See :meth:`~.client.AsyncTransferQueueClient.async_get_meta`."""
        fields = _field_list(data_fields)
        if mode == "force_fetch":
            return self.ctl.force_fetch(fields, partition_id)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise InvalidArgument(f"batch_size must be a positive int, got {batch_size!r}")
        if mode == "insert":
            return self.ctl.insert(partition_id, fields, batch_size)
        if mode != "fetch":
            raise InvalidArgument(f"mode must be 'fetch', 'force_fetch' or 'insert', got {mode!r}")
        if not task_name:
            raise InvalidArgument("fetch mode needs a task_name (the consumer whose consumption "
                             "is marked)")
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        while True:
            if self._closed:
                raise RuntimeError("TransferQueue was closed while get_meta waited")
            meta = self.ctl.fetch(fields, batch_size, partition_id, task_name, sampling_config)
            if meta is not None:
                return meta
            if self.ctl.polling_mode:
                return BatchMeta.empty()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                n = len(self.ctl.ready(partition_id, fields, task_name))
                raise StreamTimeout(
                    f"get_meta waited {self.timeout} s for {batch_size} samples of "
                    f"partition {partition_id!r} with fields {fields} not consumed by task "
                    f"{task_name!r}; {n} are ready. Put more data, ask for fewer, or raise "
                    "controller.get_meta_timeout (null waits for ever); polling_mode=True "
                    "returns an empty BatchMeta instead")
            await self._wait_change(partition_id, left)

    async def commit(self, partition_id: str, indexes: Sequence[int] | None, rows: Sequence[int],
                     shards: Sequence[int], schema: Mapping[str, Mapping[str, Any]],
                     custom_meta: Sequence[Mapping[str, Any]] | None = None):
        out = self.ctl.commit(partition_id, indexes, rows, shards, schema, custom_meta)
        self._changed(partition_id)
        return out

    async def locate(self, wanted: Mapping[str, Sequence[int]], fields: Sequence[str]):
        return self.ctl.locate(wanted, fields)

    async def set_custom_meta(self, partition_custom_meta: Mapping[str, Mapping[int, Mapping]]) -> None:
        self.ctl.set_custom_meta(partition_custom_meta)

    async def clear_partition(self, partition_id: str) -> None:
        """Forget a partition and drop its data (TransferQueue's name, so cleanup code
        calling the actor directly works)."""
        await self._drop(self.ctl.clear_partition(partition_id))

    async def clear_samples(self, partition_id: str, indexes: Sequence[int]) -> None:
        await self._drop(self.ctl.clear_samples(partition_id, indexes))

    async def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        ok = self.ctl.reset_consumption(partition_id, task_name)
        self._changed(partition_id)
        return ok

    async def get_consumption_status(self, task_name: str, partition_id: str):
        return self.ctl.consumption_status(task_name, partition_id)

    async def get_production_status(self, data_fields: Sequence[str], partition_id: str):
        return self.ctl.production_status(_field_list(data_fields), partition_id)

    async def kv_retrieve_meta(self, keys: Sequence[str], partition_id: str, create: bool = False):
        return self.ctl.kv_retrieve_meta(keys, partition_id, create)

    async def kv_retrieve_keys(self, global_indexes: Sequence[int], partition_id: str):
        return self.ctl.kv_retrieve_keys(global_indexes, partition_id)

    async def kv_list(self, partition_id: str | None = None):
        return self.ctl.kv_list(partition_id)

    # -- checkpoints

    async def checkpoint(self, queue_dir: str, state_file: str) -> int:
        """Write the controller's metadata to ``state_file`` and the queue's checkpoint
        to ``queue_dir``; returns the number of storage units. Every sample of the saved
        metadata has its data in the queue's checkpoint: the metadata is taken first,
        and rows cleared meanwhile are dropped only once the queue's checkpoint is
        written (the queue's checkpoint may also hold rows the metadata does not name,
        of puts that ran meanwhile; loading leaves them out).

        Raises:
            CheckpointError: the queue's checkpoint could not be written.
        """
        import pickle

        async with self._saving:
            units = self.queue.num_shards
            self._held = []
            try:
                blob = pickle.dumps({"controller": self.ctl.state(), "storage_units": units},
                                    protocol=pickle.HIGHEST_PROTOCOL)
                with open(state_file, "wb") as f:
                    f.write(blob)
                await self.queue.checkpoint(queue_dir)
            finally:
                held, self._held = self._held, None
                if held:
                    await asyncio.shield(self.queue.drop(held))
            return units

    async def clear_all(self) -> None:
        """Forget every partition and drop their data (before a checkpoint is loaded)."""
        for pid in list(self.ctl.parts):
            await self.clear_partition(pid)

    async def install(self, state: Mapping[str, Any],
                      moved: Mapping[tuple[str, int], tuple[int, int]]) -> None:
        """Replace the metadata by a saved state whose samples' data was written again
        to the rows ``moved`` names; waiting ``get_meta`` calls look again."""
        rows = [r for pid in list(self.ctl.parts) for r in self.ctl.clear_partition(pid)]
        self.ctl.load_state(state)
        self.ctl.rebind(moved)
        await self._drop(rows)
        for pid in list(self._events):
            self._changed(pid)

    # -- introspection, with TransferQueue's names

    async def list_partitions(self) -> list[str]:
        return self.ctl.list_partitions()

    def get_partition_snapshot(self, partition_id: str) -> PartitionSnapshot | None:
        return self.ctl.snapshot(partition_id)

    def get_config(self) -> Any:
        return self.config

    def get_queue(self) -> Any:
        """The streamrl queue holding the data (on Ray: a handle that pickles)."""
        return self.queue

    def ping(self) -> bool:
        return True

    async def shutdown(self) -> None:
        """Wake waiting ``get_meta`` calls with an error."""
        self._closed = True
        for pid in list(self._events):
            self._changed(pid)


def _field_list(fields: Any) -> list[str]:
    if fields is None:
        return []
    if isinstance(fields, str):
        return [fields]
    return list(fields)
