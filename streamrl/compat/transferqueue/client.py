"""TransferQueue's client classes over a :class:`streamrl.StreamQueue`.

:class:`AsyncTransferQueueClient` has TransferQueue 0.1.11's ``async_*`` methods and
:class:`TransferQueueClient` adds the blocking ones; ``transfer_queue.get_client()``
returns the latter. Every call runs on one event-loop thread per process (as
TransferQueue's blocking client does), so the async methods can be awaited from any event
loop, including a fresh ``asyncio.run`` per call.

What moves where:

* ``put`` stores the values directly in the queue's storage units (one row per sample),
  waiting for room when the queue is full, then tells the controller which fields are
  now produced; the controller never sees the bytes;
* ``get_meta`` asks the controller only;
* ``get_data`` reads the rows of the batch straight from the storage units and returns
  data the caller owns (TransferQueue's data is serialised over sockets, so writing into
  what ``get_data`` returned never changes the stored samples; streamrl's reads are views
  of shared memory). On Ray, on the storage unit's node, the unit's blocks are mapped
  copy-on-write (``materialize(copy=True)``): no byte is copied until the caller writes,
  and a write changes only the caller's pages; small tensors and reads from other nodes
  are copied, and so is everything on the embedded transport. ``streamrl.copy_on_get:
  false`` hands out plain views instead (treat them as read-only). Tensor fields of samples with at least one dimension come back
  as jagged nested tensors, as TransferQueue returns them (per-sample scalars as a dense
  tensor, Python objects as a ``NonTensorStack``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from streamrl.errors import (EventLoopError, InvalidArgument, NotSupported, RowsDropped,
                             StreamTimeout, UnknownField)

from .control import TQControlPlane
from .metadata import BatchMeta, public_schema, schema_of_columns, storage_name

__all__ = ["AsyncTransferQueueClient", "TransferQueueClient", "STORE_PARTITION"]

log = logging.getLogger("streamrl.compat.transferqueue")

#: the streamrl partition holding every sample's row (TransferQueue partitions are the
#: controller's: their rows are dropped by id, so the queue keeps no state per partition)
STORE_PARTITION = "transfer_queue"
#: seconds a put waits for room before it logs that the queue is full (it goes on waiting)
_FULL_NOTICE = 30.0

#: a checkpoint's layout (TransferQueue's file names, so tools that look for them find them)
CONTROLLER_FILE = "controller_state.pkl"
STORAGE_DIR = "simple_storage"
UNITS_FILE = "storage_unit_info.json"
QUEUE_DIR = "queue"  # in STORAGE_DIR: the streamrl queue checkpoint
#: samples written per put when a checkpoint is loaded
_LOAD_CHUNK = 1024
_CONTROLLER_ONLY = (
    "the controller's checkpoint alone is not supported: the samples' metadata and their "
    "data are one state here; use transfer_queue.save_checkpoint/load_checkpoint (or the "
    "client's save_storage_checkpoint/load_storage_checkpoint), which write and read both")


class _Loop:
    """The event-loop thread every call of this process runs on."""

    _lock = threading.Lock()
    _current: "_Loop | None" = None

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop
        try:
            import uvloop
            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(ready,), daemon=True,
                                       name="streamrl-transferqueue")
        self.thread.start()
        ready.wait()

    def _main(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> "_Loop":
        with cls._lock:
            if cls._current is None or not cls._current.thread.is_alive():
                cls._current = cls()
            return cls._current

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop and wait for it (blocking)."""
        if threading.get_ident() == self.thread.ident:
            coro.close()
            raise EventLoopError(
                "a blocking TransferQueue call was made on the compatibility layer's own "
                "event-loop thread (for example from a sampler); it would wait for itself. "
                "Use the async_* API there")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def hop(self, coro: Any) -> Any:
        """Await ``coro`` on the loop from any event loop."""
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))


class System:
    """What a process holds once ``init`` ran: the queue, the controller, the settings."""

    def __init__(self, queue: Any, controller: TQControlPlane, config: Mapping[str, Any], *,
                 owner: bool, actor: Any = None, service: Any = None):
        self.queue = queue
        self.controller = controller
        self.config = config
        self.owner = owner
        self.actor = actor
        self.service = service
        self.loop = _Loop.get()
        self.put_timeout = config["streamrl"].get("put_timeout")
        self.copy = config["streamrl"].get("copy_on_get", True)
        self.embedded = queue.transport == "embedded"


def _on_loop(fn: Callable) -> Callable:
    """Run the coroutine method ``fn`` on the loop thread, so it can be awaited from any
    event loop (``fn`` itself stays at ``__wrapped__``, for the blocking twin)."""

    @functools.wraps(fn)
    async def method(self, *args, **kwargs):
        return await self._sys.loop.hop(fn(self, *args, **kwargs))

    return method


class AsyncTransferQueueClient:
    """TransferQueue's async client (see the module docstring).

    Args:
        client_id: a name for logs.
        controller_info: the system to talk to (``None``: the one ``init`` set up). The
            ZMQ address TransferQueue takes here has no meaning on streamrl.
    """

    def __init__(self, client_id: str = "", controller_info: Any = None,
                 zmq_io_threads: int | None = None, zmq_max_sockets: int | None = None):
        if controller_info is None:
            from . import interface

            controller_info = interface._system()
        if not isinstance(controller_info, System):
            raise InvalidArgument("controller_info must be the system transfer_queue.init() made "
                             "(pass None); TransferQueue's ZMQ addresses mean nothing here")
        self.client_id = client_id
        self._sys = controller_info

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.client_id!r} on {self._sys.queue!r}>"

    def initialize_storage_manager(self, manager_type: str = "SimpleStorage",
                                   config: Any = None) -> None:
        """Nothing to do: the data goes to streamrl's storage units."""

    @property
    def _ctl(self) -> TQControlPlane:
        """The controller (the service itself, or the actor's generated proxy)."""
        return self._sys.controller

    # ------------------------------------------------------------------ metadata

    @_on_loop
    async def async_get_meta(self, data_fields: Sequence[str], batch_size: int,
                              partition_id: str, mode: str = "fetch",
                              task_name: str | None = None,
                              sampling_config: dict[str, Any] | None = None) -> BatchMeta:
        """Metadata of a batch.

        Modes: ``"fetch"`` (samples whose ``data_fields`` are all written and that
        ``task_name`` has not consumed, picked by the sampler and marked consumed now);
        ``"force_fetch"`` (every sample of the partition, ready or not, consumed or not;
        ``batch_size`` is not used); ``"insert"`` (``batch_size`` new samples to ``put``
        into with ``metadata=``).

        When fewer than ``batch_size`` samples are ready, fetch mode returns an empty
        ``BatchMeta`` in polling mode, and otherwise waits -- event-driven, holding up no
        other client -- until they are, up to ``controller.get_meta_timeout`` seconds
        (then ``TimeoutError``).
        """
        return await self._ctl.get_meta(data_fields, batch_size, partition_id, mode,
                               task_name, sampling_config)

    @_on_loop
    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store the batch's ``custom_meta`` (one dict per sample) in the controller."""
        if metadata is None or metadata.size == 0:
            return
        per: dict[str, dict[int, dict]] = {}
        for pid, i, m in zip(metadata.partition_ids, metadata.global_indexes, metadata.custom_meta):
            per.setdefault(pid, {})[i] = m
        await self._ctl.set_custom_meta(per)

    # ------------------------------------------------------------------ put

    async def _store(self, cols: Mapping[str, Any], rows: Sequence[int] | None = None):
        """Write columns to existing rows, or as new rows (waiting for room)."""
        q = self._sys.queue
        if rows is not None:
            return await q.put(cols, rows=list(rows), overwrite=True)
        limit, waited = self._sys.put_timeout, 0.0
        while True:
            step = _FULL_NOTICE if limit is None else min(_FULL_NOTICE, limit - waited)
            try:
                return await q.put(cols, partition=STORE_PARTITION, timeout=step)
            except StreamTimeout:
                waited += step
                if limit is not None and waited >= limit:
                    raise
                log.warning("put of %d samples has waited %.0f s for room: the queue is full; "
                            "clear_partition/clear_samples what was consumed (or raise "
                            "backend.SimpleStorage.total_storage_size)", len(next(iter(cols.values()))),
                            waited)

    async def _drop_rows(self, rows: Sequence[int]) -> None:
        if rows:
            await asyncio.shield(self._sys.queue.drop(list(rows)))

    @_on_loop
    async def async_put(self, data: Any, metadata: BatchMeta | None = None,
                         partition_id: str | None = None,
                         data_parser: Callable[[Any], Any] | None = None) -> BatchMeta:
        """Write ``data`` (a TensorDict, one row per sample).

        Without ``metadata``, new samples are made in ``partition_id`` (the put waits
        while the queue is full). With ``metadata`` (from ``get_meta``, including insert
        mode), the fields are written to those samples, replacing values already there.
        The batch's ``custom_meta`` is stored too. Returns the batch with the new fields
        (``metadata`` itself, updated in place, when given).
        """
        from streamrl.columns import take_rows, to_columns

        if metadata is None and partition_id is None:
            raise InvalidArgument("put needs partition_id (new samples) or metadata (samples to "
                             "write to)")
        if metadata is not None and metadata.size == 0:
            raise InvalidArgument("metadata has no samples; get_meta found nothing to write to")
        cols, n = to_columns(_per_row(data))
        if data_parser is not None:
            cols = _parse(cols, data_parser, n)
        schema = schema_of_columns(cols)
        names = {f: storage_name(f, m["_key"]) for f, m in schema.items()}
        wire = {f: {k: m[k] for k in ("dtype", "_key", "is_non_tensor", "_shapes")}
                for f, m in schema.items()}
        stored = {names[f]: c for f, c in cols.items()}

        if metadata is None:
            assert partition_id is not None, "checked on entry: metadata or partition_id"
            rb = await self._store(stored)
            try:
                idx, _ = await self._ctl.commit(partition_id, None, rb.rows, rb.shards, wire,
                                         [{} for _ in range(n)])
            except BaseException:
                await self._drop_rows(rb.rows)
                raise
            return BatchMeta(idx, [partition_id] * n, {f: public_schema(m) for f, m in schema.items()},
                             [1] * n, None, None, _rows=rb.rows, _shards=rb.shards, _store=names)

        if n != metadata.size:
            raise InvalidArgument(f"put of {n} rows into a batch of {metadata.size} samples; give "
                             "one row per sample")
        rows, shards = list(metadata._rows), list(metadata._shards)
        old = [p for p in range(n) if rows[p] is not None]
        new = [p for p in range(n) if rows[p] is None]

        def part(pos: list[int]) -> dict[str, Any]:
            if len(pos) == n:
                return stored
            return {f: take_rows(c, pos) for f, c in stored.items()}

        made: list[int] = []
        try:
            if old:
                try:
                    await self._store(part(old), _set_ints([rows[p] for p in old], "rows"))
                except RowsDropped as e:
                    raise InvalidArgument(f"samples of this metadata were cleared (rows {e.rows[:8]}); "
                                     "get fresh metadata") from None
            if new:
                rb = await self._store(part(new))
                made = list(rb.rows)
                for p, r, s in zip(new, rb.rows, rb.shards):
                    rows[p], shards[p] = r, s
            by_pid: dict[str, list[int]] = {}
            for p, pid in enumerate(metadata.partition_ids):
                by_pid.setdefault(pid, []).append(p)
            for pid, pos in by_pid.items():
                await self._commit(pid, pos, metadata, rows, shards, wire, stored, made)
                bound = {rows[p] for p in pos}  # the controller holds these now
                made[:] = [r for r in made if r not in bound]
        except BaseException:
            await self._drop_rows(made)
            raise
        metadata._rows, metadata._shards = rows, shards
        for f, m in schema.items():
            metadata.field_schema[f] = public_schema(m)
        metadata._store.update(names)
        metadata.production_status[:] = 1
        return metadata

    async def _commit(self, pid: str, pos: list[int], meta: BatchMeta, rows: list, shards: list,
                      wire: dict, stored: dict, made: list[int]) -> None:
        """Commit a put's samples of one partition; a sample another writer bound first
        gets these values rewritten into its row, and the row made here is dropped."""
        from streamrl.columns import take_rows

        def sub(m: dict) -> dict:
            s = m["_shapes"]
            return {**m, "_shapes": [s[p] for p in pos] if isinstance(s, list) else s}

        custom = [meta.custom_meta[p] for p in pos]
        _, conflicts = await self._ctl.commit(pid, [meta.global_indexes[p] for p in pos],
                                       [rows[p] for p in pos], [shards[p] for p in pos],
                                       {f: sub(m) for f, m in wire.items()}, custom)
        if not conflicts:
            return
        lost = [pos[c] for c, _, _ in conflicts]
        await self._store({f: take_rows(c, lost) for f, c in stored.items()},
                          [r for _, r, _ in conflicts])
        extra = [rows[p] for p in lost if rows[p] in made]  # never drop a row not made here
        for (_, r, s), p in zip(conflicts, lost):
            rows[p], shards[p] = r, s
        await self._drop_rows(extra)
        made[:] = [r for r in made if r not in extra]
        await self._commit(pid, lost, meta, rows, shards, wire, stored, made)

    # ------------------------------------------------------------------ get_data

    @_on_loop
    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        """The batch's fields as a TensorDict the caller owns (see the module docstring
        for the layout); empty for an empty batch."""
        from streamrl.batch import RowRemoteBatch

        if metadata is None or metadata.size == 0 or not metadata.field_names:
            return TensorDict({}, batch_size=[0])
        fields = metadata.field_names
        rows, shards, store = list(metadata._rows), list(metadata._shards), dict(metadata._store)
        if any(r is None for r in rows) or any(f not in store for f in fields):
            wanted: dict[str, list[int]] = {}
            for pid, i in zip(metadata.partition_ids, metadata.global_indexes):
                wanted.setdefault(pid, []).append(i)
            found = await self._ctl.locate(wanted, fields)
            at = {pid: 0 for pid in found}
            for p, pid in enumerate(metadata.partition_ids):
                r, s, stored_as = found[pid]
                if rows[p] is None:
                    rows[p], shards[p] = r[at[pid]], s[at[pid]]
                at[pid] += 1
                for f, name in stored_as.items():
                    store.setdefault(f, name)
        empty = [i for i, r in zip(metadata.global_indexes, rows) if r is None]
        if empty:
            raise InvalidArgument(f"samples {empty[:8]} have no data (never put, or cleared)")
        lacking = [f for f in fields if f not in store]
        if lacking:
            raise InvalidArgument(f"fields {lacking} were never written to these samples")
        names = [store[f] for f in fields]
        rb = RowRemoteBatch(self._sys.queue, _set_ints(rows, "rows"), _set_ints(shards, "shards"),
                            names)
        try:
            td = await rb.materialize(names, copy=self._sys.copy)
        except UnknownField as e:
            raise InvalidArgument(f"some samples of this batch lack a field it names: {e}") from None
        except RowsDropped as e:
            raise InvalidArgument(f"samples of this batch were cleared (rows {e.rows[:8]}); get "
                             "fresh metadata") from None
        out = TensorDict({}, batch_size=[metadata.size])
        offsets: dict[tuple[int, int], torch.Tensor] = {}  # shared by fields of one length
        for f, name in zip(fields, names):
            out.set(f, _tq_column(td.get(name), self._sys.embedded and self._sys.copy, offsets))
        return out

    # ------------------------------------------------------------------ clearing

    @_on_loop
    async def async_clear_partition(self, partition_id: str) -> None:
        """Forget a partition and drop its samples' data (frees room at once)."""
        await self._ctl.clear_partition(partition_id)

    @_on_loop
    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        """Forget the batch's samples and drop their data."""
        if metadata is None or metadata.size == 0:
            return
        per: dict[str, list[int]] = {}
        for pid, i in zip(metadata.partition_ids, metadata.global_indexes):
            per.setdefault(pid, []).append(i)
        for pid, idx in per.items():
            await self._ctl.clear_samples(pid, idx)

    # ------------------------------------------------------------------ status

    @_on_loop
    async def async_get_consumption_status(self, task_name: str, partition_id: str):
        """``(global indexes, consumed)`` tensors of the partition (``(None, None)`` when
        there is no such partition)."""
        return await self._ctl.get_consumption_status(task_name, partition_id)

    @_on_loop
    async def async_get_production_status(self, data_fields: Sequence[str], partition_id: str):
        """``(global indexes, produced [samples, fields])`` tensors (``(None, None)`` when
        the partition or a field is unknown)."""
        return await self._ctl.get_production_status(data_fields, partition_id)

    @_on_loop
    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        """True when the partition has samples and ``task_name`` consumed every one."""
        _, st = await self.async_get_consumption_status(task_name, partition_id)
        return st is not None and st.numel() > 0 and bool(torch.all(st == 1))

    @_on_loop
    async def async_check_production_status(self, data_fields: Sequence[str],
                                             partition_id: str) -> bool:
        """True when every sample of the partition has all of ``data_fields``."""
        _, st = await self.async_get_production_status(data_fields, partition_id)
        return st is not None and bool(torch.all(st == 1))

    @_on_loop
    async def async_reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Make the partition's samples unconsumed again for ``task_name`` (all tasks when
        ``None``): fetch mode hands them out again. False when there is no such partition."""
        return await self._ctl.reset_consumption(partition_id, task_name)

    @_on_loop
    async def async_get_partition_list(self) -> list[str]:
        """The partitions the controller knows."""
        return await self._ctl.list_partitions()

    # ------------------------------------------------------------------ keys

    @_on_loop
    async def async_kv_retrieve_meta(self, keys: Sequence[str] | str, partition_id: str,
                                      create: bool = False) -> BatchMeta:
        """The samples of user keys (made when ``create``), with the fields all of them have."""
        keys = _key_list(keys)
        return await self._ctl.kv_retrieve_meta(keys, partition_id, create)

    @_on_loop
    async def async_kv_retrieve_keys(self, global_indexes: Sequence[int] | int,
                                      partition_id: str) -> list[str]:
        """The keys of samples.

        Raises:
            RuntimeError: a sample has no key.
        """
        idx = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
        if not idx or not all(isinstance(i, int) for i in idx):
            raise TypeError("global_indexes must be an int or a non-empty list of ints")
        found = await self._ctl.kv_retrieve_keys(idx, partition_id)
        keys = [k for k in found if k is not None]
        if len(keys) != len(idx):
            raise RuntimeError(f"some of global indexes {idx[:8]} have no key in partition "
                               f"{partition_id!r}")
        return keys

    @_on_loop
    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition: {key: tags}}`` of one partition (or all)."""
        return await self._ctl.kv_list(partition_id)

    # ------------------------------------------------------------------ checkpoints

    @_on_loop
    async def async_save_controller_checkpoint(self, path: str) -> None:
        """Not on its own: the samples' metadata and their data are one state here,
        written together by :meth:`async_save_storage_checkpoint` (``save_checkpoint``).

        Raises:
            NotSupported: always.
        """
        raise NotSupported(_CONTROLLER_ONLY)

    @_on_loop
    async def async_load_controller_checkpoint(self, path: str) -> None:
        """Not on its own: see :meth:`async_save_controller_checkpoint`.

        Raises:
            NotSupported: always.
        """
        raise NotSupported(_CONTROLLER_ONLY)

    @_on_loop
    async def async_save_storage_checkpoint(self, checkpoint_dir: str) -> None:
        """Write the whole system to the directory ``checkpoint_dir`` (made if missing):
        the controller's metadata (``controller_state.pkl``) and, at the same instant,
        the queue's checkpoint of the samples' data (``simple_storage/queue``, see
        :meth:`streamrl.StreamQueue.checkpoint`), with one entry per storage unit in
        ``simple_storage/storage_unit_info.json``. Producers and consumers go on
        meanwhile; a put running during the call may or may not be in it. Not atomic by
        itself: ``save_checkpoint`` writes it beside the target and renames.

        Raises:
            CheckpointError: the queue's checkpoint could not be written.
        """
        root = os.path.abspath(os.fspath(checkpoint_dir))
        store = os.path.join(root, STORAGE_DIR)
        os.makedirs(store, exist_ok=True)
        units = await self._ctl.checkpoint(os.path.join(store, QUEUE_DIR),
                                os.path.join(root, CONTROLLER_FILE))
        with open(os.path.join(store, UNITS_FILE), "w") as f:
            json.dump([{"position": i, "storage_unit": f"streamrl-unit-{i}"}
                       for i in range(units)], f, indent=1)

    @_on_loop
    async def async_load_storage_checkpoint(self, checkpoint_dir: str) -> None:
        """Replace the whole system's state by what :meth:`async_save_storage_checkpoint`
        wrote to ``checkpoint_dir``: every partition now held is cleared, the saved
        samples' data is written into this system's queue (whatever its number of
        storage units or transport; only samples the saved metadata names) and the
        saved metadata (partitions, keys, tags, consumption, the sampler's state) takes
        over. Other clients should not use the system meanwhile.

        Raises:
            FileNotFoundError: a file of the checkpoint is missing.
            CheckpointError: the checkpoint is not one of this layer, or is damaged (for
                example its storage-unit list does not match the data).
        """
        import pickle

        import streamrl
        from streamrl.batch import RowRemoteBatch
        from streamrl.errors import CheckpointError

        root = os.path.abspath(os.fspath(checkpoint_dir))
        store = os.path.join(root, STORAGE_DIR)
        for need in (os.path.join(root, CONTROLLER_FILE), os.path.join(store, UNITS_FILE),
                     os.path.join(store, QUEUE_DIR)):
            if not os.path.exists(need):
                raise FileNotFoundError(f"{os.path.relpath(need, root)} not found in {root}: "
                                        "not a checkpoint of transfer_queue.save_checkpoint")
        with open(os.path.join(root, CONTROLLER_FILE), "rb") as f:
            try:
                saved = pickle.load(f)
            except Exception as e:
                raise CheckpointError(f"{CONTROLLER_FILE} in {root} cannot be read ({e}); "
                                      "the checkpoint is damaged") from None
        if not isinstance(saved, dict) or "controller" not in saved:
            raise CheckpointError(f"{CONTROLLER_FILE} in {root} is not a controller state of "
                                  "streamrl.compat.transferqueue")
        with open(os.path.join(store, UNITS_FILE)) as units_file:
            listed = json.load(units_file)
        if not isinstance(listed, list) or len(listed) != saved["storage_units"]:
            raise CheckpointError(
                f"storage unit count mismatch in {root}: {STORAGE_DIR}/{UNITS_FILE} lists "
                f"{len(listed) if isinstance(listed, list) else listed!r} units and the data "
                f"was saved from {saved['storage_units']}; the checkpoint was altered or "
                "damaged")
        state = saved["controller"]
        # what to copy: each saved sample holding data, grouped by its stored fields
        groups: dict[tuple[str, ...], list[tuple[str, int, int, int]]] = {}
        for part in state["parts"]:
            keys = {f: k for f, (_, k, _, _) in part["fields"].items()}
            for i, (row, shard, fields, _, _) in part["samples"].items():
                if row is not None and fields:
                    names = tuple(sorted(storage_name(f, keys[f]) for f in fields))
                    groups.setdefault(names, []).append((part["name"], i, row, shard))
        await self._ctl.clear_all()
        old = await streamrl.StreamQueue.restore(os.path.join(store, QUEUE_DIR),
                                                 transport="embedded", metrics=False)
        moved: dict[tuple[str, int], tuple[int, int]] = {}
        made: list[int] = []
        try:
            for names, samples in groups.items():
                for at in range(0, len(samples), _LOAD_CHUNK):
                    chunk = samples[at:at + _LOAD_CHUNK]
                    rb = RowRemoteBatch(old, [r for _, _, r, _ in chunk],
                                        [s for _, _, _, s in chunk], list(names))
                    td = await rb.materialize(list(names), copy=True)
                    new = await self._store(td)
                    made.extend(new.rows)
                    for (pid, i, _, _), r, s in zip(chunk, new.rows, new.shards):
                        moved[(pid, i)] = (r, s)
            await self._ctl.install(state, moved)
        except BaseException:
            await self._drop_rows(made)
            raise
        finally:
            await old.shutdown()

    def close(self) -> None:
        """Nothing to release per client (``transfer_queue.close()`` ends the system)."""


_CALLS = ["get_meta", "set_custom_meta", "put", "get_data", "clear_partition", "clear_samples",
          "get_consumption_status", "get_production_status", "check_consumption_status",
          "check_production_status", "reset_consumption", "get_partition_list",
          "kv_retrieve_meta", "kv_retrieve_keys", "kv_list", "save_controller_checkpoint",
          "load_controller_checkpoint", "save_storage_checkpoint", "load_storage_checkpoint"]

class TransferQueueClient(AsyncTransferQueueClient):
    """TransferQueue's blocking client: the ``async_*`` methods, and each of them without
    the prefix, blocking, with the same arguments (``get_meta``, ``put``, ``get_data``,
    ``clear_partition``, ``clear_samples``, ``set_custom_meta``, ``get_consumption_status``,
    ``get_production_status``, ``check_consumption_status``, ``check_production_status``,
    ``reset_consumption``, ``get_partition_list``, ``kv_retrieve_meta``,
    ``kv_retrieve_keys``, ``kv_list`` and the checkpoint calls). They are usable from
    threads and synchronous Ray actors; not from the compatibility layer's own event loop
    (inside a sampler), where they raise :class:`~streamrl.errors.EventLoopError`."""

    def _run_coroutine(self, coro: Any) -> Any:
        return self._sys.loop.run(coro)

    if TYPE_CHECKING:
        # the blocking calls are attached below (setattr over _CALLS), where mypy cannot
        # see them; these declare the ones streamrl itself calls
        def save_storage_checkpoint(self, checkpoint_dir: str) -> None: ...
        def load_storage_checkpoint(self, checkpoint_dir: str) -> None: ...


def _blocking(name: str) -> Callable:
    impl = getattr(AsyncTransferQueueClient, f"async_{name}").__wrapped__

    def method(self, *args, **kwargs):
        return self._run_coroutine(impl(self, *args, **kwargs))

    functools.update_wrapper(method, impl)  # its signature and docstring, for help()
    method.__name__, method.__qualname__ = name, f"TransferQueueClient.{name}"
    return method


for _name in _CALLS:
    setattr(TransferQueueClient, _name, _blocking(_name))


# ---------------------------------------------------------------------- helpers


def _set_ints(values: Sequence[int | None], what: str) -> list[int]:
    """``values`` (rows or shards known to be set at this point) as a list of ints."""
    out = [v for v in values if v is not None]
    if len(out) != len(values):
        raise AssertionError(f"{what} of samples holding data are unset")
    return out


def _key_list(keys: Any) -> list[str]:
    if isinstance(keys, str):
        return [keys]
    if isinstance(keys, (list, tuple)):
        if not keys:
            raise InvalidArgument("keys is an empty list; give at least one key")
        if not all(isinstance(k, str) for k in keys):
            raise TypeError("keys must be strings")
        return list(keys)
    raise TypeError(f"keys must be a str or a list of str, got {type(keys).__name__}")


def _per_row(data: Any) -> Any:
    """A put's data as TransferQueue reads it: a TensorDict's non-tensor entry holding a
    list or array with one item per row (how a TensorDict keeps a numpy array of strings
    or objects) is that many rows, not one value repeated on every row."""
    from tensordict import NonTensorData, TensorDictBase
    from tensordict.base import _is_leaf_nontensor

    if not isinstance(data, TensorDictBase) or not data.batch_size:
        return data
    n = data.batch_size[0]
    out: dict[str, Any] = {}
    for key in data.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        v = data.get(key)
        if isinstance(v, NonTensorData):
            d = v.data
            if isinstance(d, (list, tuple, np.ndarray)) and len(d) == n:
                v = d if isinstance(d, np.ndarray) else list(d)
        out[key if isinstance(key, str) else ".".join(key)] = v
    return out


def _parse(cols: dict[str, Any], parser: Callable[[Any], Any], n: int) -> dict[str, Any]:
    """Apply a user ``data_parser`` to a put's columns (a plain dict it edits in place)."""
    from streamrl.columns import to_columns

    plain = dict(cols)
    parser(plain)
    if set(plain) != set(cols):
        raise InvalidArgument("data_parser must not add or remove fields")
    out, m = to_columns(plain)
    if m != n:
        raise InvalidArgument(f"data_parser changed the number of rows from {n} to {m}")
    return out


_NestedTensor: Any
try:  # torch's own constructor of jagged tensors, without the public function's dispatch
    from torch.nested._internal.nested_tensor import NestedTensor

    _NestedTensor = NestedTensor
except ImportError:  # another torch: the public function
    _NestedTensor = None


def jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged(values, offsets)`` (a jagged nested tensor
    over ``values``, no copy), made by torch's ``NestedTensor`` class directly where this
    torch has it: the public function goes through torch's operator dispatch, about 10x
    the cost here (0.5-0.9 ms per field on this machine), and ``get_data`` makes one per
    tensor field. ``tests/compat`` checks that both give the same tensor."""
    if _NestedTensor is None or values.requires_grad:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return _NestedTensor(values, offsets)


def _tq_column(value: Any, embedded: bool,
               offsets: dict[tuple[int, int], torch.Tensor] | None = None) -> Any:
    """A column as TransferQueue's ``get_data`` gives it: a tensor of samples with one or
    more dimensions as a jagged nested tensor (a view, no copy), even when every sample
    has one shape, as TransferQueue returns it. ``offsets``: the offsets tensors made so
    far, by ``(samples, length)``, shared by the fields of one call (making one costs
    about as much as the view)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested or value.dim() < 2 or value.shape[0] == 0 or value.shape[1] == 0:
            return value
        n, length = value.shape[0], value.shape[1]
        values = value.reshape((n * length,) + tuple(value.shape[2:]))
        off = None if offsets is None else offsets.get((n, length))
        if off is None:
            off = torch.arange(0, n * length + 1, length, dtype=torch.int64)
            if offsets is not None:
                offsets[(n, length)] = off
        return jagged(values, off)
    if isinstance(value, NonTensorStack):
        items = value.tolist()
        if embedded:  # the stored objects themselves: hand out copies
            items = copy.deepcopy(items)
        return NonTensorStack(*items) if items else value
    return value
