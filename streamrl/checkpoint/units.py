"""A storage unit's part of a checkpoint: its rows of the cut, written to files of its
own and read back.

Torch-free: the same code runs in the caller's process for the embedded transport and
inside each storage-unit actor on Ray (every unit writes its own files, in parallel;
nothing goes through the driver or the controller). How a unit's data is read and made
is given by the caller:

* writing, ``fetch(rows, field) -> (pieces, release)`` reads a field of some rows (the
  unit's :meth:`~streamrl.storage.StorageBackend.get`, under the unit's lock on Ray),
  and ``raw(piece)`` turns one piece into ``("t", dtype, itemsize, shape, bytes)`` or
  ``("o", [encoded objects])``; ``release`` is called once those pieces are written;
* reading, a :class:`Sink` says where the bytes of each tensor go and what a tensor or
  an object is made of them.

The directory of one unit::

    index.msgpack                 what is where (see write_unit)
    tensors-00000.safetensors     tensor pieces, up to FILE_BYTES each
    objects-00000.msgpack         a stream of [field, rows, [encoded objects]]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import msgpack

from ..errors import CheckpointError, StreamRLError
from ..storage.base import STATE_FORMAT, StateChunk
from .files import (FileWriter, fsync_dir, read_file, read_msgpack, read_safetensors,
                    write_msgpack, write_safetensors)

__all__ = ["UNIT_FORMAT", "UNIT_VERSION", "write_unit", "read_unit", "Sink", "FILE_BYTES",
           "FETCH_BYTES"]

#: the ``"format"`` and newest ``"version"`` of a unit's ``index.msgpack``
UNIT_FORMAT = "streamrl.checkpoint.unit"
UNIT_VERSION = 1
#: bytes of tensor data (or of encoded objects) per data file
FILE_BYTES = 64 << 20
#: most bytes (by the controller's sizes) of one read of the unit, and most rows
FETCH_BYTES = 8 << 20
FETCH_ROWS = 4096


class _Writer:
    """The files of one unit's part, written as pieces come."""

    def __init__(self, directory: str, file_bytes: int):
        self.dir = directory
        self.file_bytes = file_bytes
        self.files: list[dict] = []
        self.tensors: list[list] = []  # [field, file, key, dtype, itemsize, shape, rows]
        self.pending: list[tuple] = []  # (field, rows, dtype, itemsize, shape, bytes)
        self.pending_bytes = 0
        self.releases: list[Callable[[], None]] = []
        self.obj: FileWriter | None = None
        self.packer = msgpack.Packer(use_bin_type=True)
        self.nbytes = 0
        self.counts: dict[str, int] = {}

    def _name(self, kind: str, ext: str) -> str:
        n = self.counts[kind] = self.counts.get(kind, -1) + 1
        return f"{kind}-{n:05d}.{ext}"

    def tensor(self, field: str, rows: list[int], dtype: str, itemsize: int, shape: tuple,
               data: Any) -> None:
        self.pending.append((field, rows, dtype, itemsize, tuple(shape), data))
        self.pending_bytes += memoryview(data).nbytes

    def objects(self, field: str, rows: list[int], values: list) -> None:
        if self.obj is None:
            self.obj = FileWriter(os.path.join(self.dir, self._name("objects", "msgpack")))
        self.obj.write(self.packer.pack([field, rows, values]))
        if self.obj.nbytes >= self.file_bytes:
            self._close_objects()

    def _close_objects(self) -> None:
        if self.obj is not None:
            entry = self.obj.close()
            self.nbytes += entry["bytes"]
            self.obj = None
            self.files.append(entry)

    def released(self, release: Callable[[], None] | None) -> None:
        if release is not None:
            self.releases.append(release)

    def flush(self, final: bool = False) -> None:
        """Write the pending tensors to a file once there are enough (or at the end),
        then let the unit reuse what they viewed."""
        if self.pending and (final or self.pending_bytes >= self.file_bytes):
            # widest elements first: every tensor then starts at a multiple of its
            # element size, so a reader's views are aligned
            order = sorted(self.pending, key=lambda p: -p[3])
            idx = len(self.files)
            name = self._name("tensors", "safetensors")
            items = []
            for i, (field, rows, dtype, itemsize, shape, data) in enumerate(order):
                key = f"{field}/{i}"
                items.append((key, dtype, itemsize, shape, data))
                self.tensors.append([field, idx, key, dtype, itemsize, list(shape), rows])
            entry = write_safetensors(os.path.join(self.dir, name), items,
                                      {"format": "streamrl", "what": "rows of tensor fields; "
                                       "see index.msgpack for their rows"})
            self.nbytes += entry["bytes"]
            self.files.append(entry)
            self.pending, self.pending_bytes = [], 0
        if final or not self.pending:
            self._release()
        if final:
            self._close_objects()

    def _release(self) -> None:
        rel, self.releases = self.releases, []
        for r in rel:
            r()

    def abort(self) -> None:
        self.pending = []
        self._release()
        if self.obj is not None:
            self.obj.abort()
            self.obj = None


def write_unit(directory: str, shard: int, plan: Mapping[str, tuple[list[int], list[int]]],
               rows: Sequence[int], fetch: Callable[[list[int], str], tuple[list, Any]],
               raw: Callable[[Any], tuple], *, file_bytes: int = FILE_BYTES,
               node: str | None = None,
               stopped: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Write unit ``shard``'s part of a checkpoint under ``directory`` (created).

    Args:
        plan: per field, the rows of the cut that have it committed on this unit and the
            bytes of each (the controller's sizes), in row order.
        rows: every row of the cut held by this unit.
        fetch: reads a field of some rows: ``(pieces, release)`` (see the module).
        raw: one piece as ``("t", dtype, itemsize, shape, bytes)`` or ``("o", [bytes])``.
        node: where the files were written (recorded in the manifest, for messages).
        stopped: asked before each read of the unit; once true, the writing stops (the
            checkpoint was cancelled, or another unit failed).

    Returns:
        The unit's manifest entry: ``shard``, ``dir`` (the directory's name), ``index``
        (the index file's entry), ``rows``, ``bytes`` (data files), ``files``, ``node``.

    Raises:
        CheckpointError: a row of the cut is not held (the unit lost it), or
            ``stopped`` said so.
    """
    os.mkdir(directory)  # (not makedirs: a checkpoint given up has no parent any more)
    w = _Writer(directory, file_bytes)
    held: dict[str, int] = {}
    try:
        for field in sorted(plan):
            frows, sizes = plan[field]
            held[field] = len(frows)
            i, n = 0, len(frows)
            while i < n:  # a batch of rows of at most FETCH_BYTES (and FETCH_ROWS)
                j, size = i, 0
                while j < n and j - i < FETCH_ROWS and (j == i or size + sizes[j] <= FETCH_BYTES):
                    size += sizes[j]
                    j += 1
                batch = frows[i:j]
                if stopped is not None and stopped():
                    raise CheckpointError(
                        f"storage unit {shard} stopped writing: the checkpoint was "
                        "cancelled or another unit failed")
                try:
                    pieces, release = fetch(batch, field)
                    w.released(release)
                    pieces = [raw(p) for p in pieces]
                except CheckpointError:
                    raise
                except StreamRLError as e:
                    raise CheckpointError(
                        f"storage unit {shard} could not save field {field!r} of rows of the "
                        f"checkpoint ({type(e).__name__}: {e})") from e
                at = 0
                for kind, *rest in pieces:
                    if kind == "t":
                        dtype, itemsize, shape, data = rest
                        k = shape[0] if shape else 0
                        w.tensor(field, batch[at:at + k], dtype, itemsize, shape, data)
                    else:
                        (values,) = rest
                        k = len(values)
                        w.objects(field, batch[at:at + k], values)
                    at += k
                if at != len(batch):
                    raise CheckpointError(
                        f"storage unit {shard} returned {at} rows of field {field!r} for "
                        f"{len(batch)} asked; the checkpoint is not written")
                w.flush()
                i = j
        w.flush(final=True)
        index = {"format": UNIT_FORMAT, "version": UNIT_VERSION, "shard": shard,
                 "rows": list(rows), "fields": held, "bytes": w.nbytes, "files": w.files,
                 "tensors": w.tensors}
        entry = write_msgpack(os.path.join(directory, "index.msgpack"), index)
    except BaseException:
        w.abort()
        raise
    fsync_dir(directory)
    return {"shard": shard, "dir": os.path.basename(directory), "index": entry,
            "rows": len(rows), "bytes": w.nbytes, "files": len(w.files) + 1, "node": node}


class Sink:
    """Where a unit's checkpoint is read into (see :func:`read_unit`). The default
    keeps bytes in fresh numpy arrays and objects as their encoded bytes."""

    def alloc(self, nbytes: int) -> tuple[Any, Any]:
        """A writable buffer of ``nbytes`` bytes, and a handle of it for :meth:`tensor`."""
        import numpy as np

        buf = np.empty(nbytes, dtype=np.uint8)
        return buf, buf

    def tensor(self, dtype: str, itemsize: int, shape: tuple, handle: Any) -> Any:
        """The tensor of rows stored from buffer ``handle``."""
        raise NotImplementedError

    def objects(self, values: list) -> list:
        """The objects to store, from their encoded bytes."""
        return values

    def discard(self, handle: Any) -> None:
        """A buffer from :meth:`alloc` that will not be used (the read failed)."""


def read_unit(directory: str, entry: dict[str, Any], sink: Sink,
              what: str) -> tuple[list[int], list[StateChunk]]:
    """Read one unit's part of a checkpoint, checking every file: its rows and chunks.

    Raises:
        CheckpointError: a file is missing, torn or corrupt, or the index is of a newer
            format.
    """
    index = read_msgpack(os.path.join(directory, "index.msgpack"), entry["index"],
                         f"the index of {what}")
    if not isinstance(index, dict) or index.get("format") != UNIT_FORMAT:
        raise CheckpointError(f"{directory}/index.msgpack is not a unit index of a streamrl "
                              "checkpoint")
    v = index.get("version")
    if not isinstance(v, int) or v > UNIT_VERSION:
        raise CheckpointError(
            f"the index of {what} has format version {v!r}, newer than this streamrl reads "
            f"(up to {UNIT_VERSION}); restore it with the streamrl that wrote it, or a newer one")
    files = index["files"]
    chunks: list[StateChunk] = []
    by_file: dict[int, list] = {}
    for t in index["tensors"]:
        by_file.setdefault(t[1], []).append(t)
    handles: list = []
    try:
        for i, fe in enumerate(files):
            path = os.path.join(directory, fe["name"])
            if fe["name"].startswith("objects"):
                data = read_file(path, fe, f"{what}: {fe['name']}")
                unpacker = msgpack.Unpacker(raw=False, strict_map_key=False,
                                            max_buffer_size=max(len(data), 1))
                unpacker.feed(data)
                for field, rows, values in unpacker:
                    chunks.append(StateChunk(field, rows, sink.objects(values)))
                continue
            got: dict[str, Any] = {}

            def alloc(key: str, nbytes: int, got=got) -> Any:
                buf, handle = sink.alloc(nbytes)
                handles.append(handle)
                got[key] = handle
                return buf

            read_safetensors(path, fe, f"{what}: {fe['name']}", alloc)
            for field, _, key, dtype, itemsize, shape, rows in by_file.get(i, ()):
                if key not in got:
                    raise CheckpointError(f"{what}: {fe['name']} lacks tensor {key!r} that "
                                          "its index lists; the checkpoint is damaged")
                chunks.append(StateChunk(field, rows, sink.tensor(dtype, itemsize, tuple(shape),
                                                                  got[key])))
    except BaseException:
        for h in handles:
            sink.discard(h)
        raise
    return list(index["rows"]), chunks


def unit_state(shard: int, rows: list[int], chunks: Iterator[StateChunk] | list) -> dict:
    """A storage state (:meth:`~streamrl.storage.StorageBackend.load_state_dict`'s
    input) of these rows and chunks."""
    return {"format": STATE_FORMAT, "backend": "checkpoint", "index": shard, "rows": rows,
            "chunks": chunks}
