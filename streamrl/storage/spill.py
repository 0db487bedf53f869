"""The ``"spill"`` storage backend: rows in memory up to a byte budget, older tensor data
in a local file beyond it, read back when it is read.

``StreamQueue(storage={"backend": "spill", "memory_bytes": 2 << 30, "dir": "/nvme/tmp"})``

For long-lived, large rows (images, video frames, long trajectories) that should not all
sit in RAM while they wait for their consumers.

Policy:

* **What counts.** ``memory_bytes`` (per storage unit, default 1 GiB) bounds the tensor
  bytes a unit keeps in memory. Python objects (chat histories, strings) always stay in
  memory and do not count.
* **What spills, and when.** The unit of spilling is a *segment*: the tensor of one put
  for one field (the rows of that put on this unit), or one row of a ragged field. That
  is the unit in which memory is held (rows of one put share one buffer, which is freed
  only when none of them refers to it) and so the unit in which spilling frees it.
  When a ``put`` leaves more than ``memory_bytes`` of tensor data in memory, the unit
  writes the **least recently put** segments to the file, oldest first, until it is
  within budget again, before ``put`` returns (a segment bigger than the whole budget
  goes to disk at once). Only the rows still held are written. Spilled rows are never
  brought back into memory.
* **Reads.** A read of spilled rows reads them into a fresh buffer (one ``pread`` per run
  of rows of one segment) and returns tensors equal to what was put (``torch`` tensors
  on their original device; :class:`~streamrl.wire.WireTensor` with inline bytes in Ray
  storage-unit actors). Rows in memory are views as with ``"memory"``. So
  ``caps.zero_copy_reads`` is ``False``.
* **The file.** One file per unit, created in ``dir`` (default: the system temp dir,
  ``$TMPDIR``) and unlinked at once, so the kernel frees its space when the unit's
  process ends, however it ends (a killed Ray actor leaves nothing behind); ``ls`` does
  not show it (``/proc/<pid>/fd`` does, as ``(deleted)``). Space is allocated first-fit;
  deleting a row frees its bytes in the file at once, for reuse by later spills, and the
  file is truncated when its tail is free (an empty unit has an empty file). Put
  ``dir`` on a local SSD: a temp dir on ``tmpfs`` is memory again.
* **Accounting.** ``stats()`` reports the bytes of every row held, in memory or on disk
  (so it agrees with the controller and ``StreamQueue.stats().bytes``); :meth:`usage`
  says where they are (``memory``, ``disk``, ``file``, ``bytes_spilled``, ...).
* **Ray arenas.** A tensor that came with ``on_release`` semantics (a block of a Ray
  unit's shared-memory arena) is released when its segment is spilled, so the block is
  reused (once readers that still view it are done).
* **Failures.** A spill that fails (disk full) keeps the data in memory, logs a warning
  and is tried again at the next put. A tensor the backend cannot turn into bytes
  (sparse or quantized torch tensors, unknown tensor types) stays in memory.

Write ids, ``forgotten`` rows and writes, ``delete_fields(..., write=)`` and
``inventory()`` behave as with ``"memory"``, for spilled rows too.
"""

from __future__ import annotations

import bisect
import logging
import os
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgument, TransportError
from ..wire import WireTensor
from .base import StorageCaps
from .memory import _OFF_BITS, _OFF_MASK, StorageUnit, _Obj, _Segment

__all__ = ["SpillUnit", "create", "DEFAULT_MEMORY_BYTES"]

log = logging.getLogger("streamrl")

#: ``memory_bytes`` when none is given (per storage unit)
DEFAULT_MEMORY_BYTES = 1 << 30


class _FileSpace:
    """The spill file's space: ranges handed out first-fit from the freed ones, else at
    the end; freed ranges are merged, and a free tail is cut off (``end`` shrinks)."""

    __slots__ = ("end", "free")

    def __init__(self) -> None:
        self.end = 0
        self.free: list[list[int]] = []  # [offset, size], sorted by offset, merged

    def alloc(self, n: int) -> int:
        for j, (off, size) in enumerate(self.free):
            if size >= n:
                if size == n:
                    del self.free[j]
                else:
                    self.free[j] = [off + n, size - n]
                return off
        off = self.end
        self.end += n
        return off

    def release(self, off: int, n: int) -> bool:
        """Free ``[off, off + n)``; whether the end moved (the file can be truncated)."""
        free = self.free
        i = bisect.bisect_left(free, [off, 0])
        size = n
        if i < len(free) and free[i][0] == off + size:  # merge the next range
            size += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # merge the previous one
            free[i - 1][1] += size
        else:
            free.insert(i, [off, size])
        last = free[-1]
        if last[0] + last[1] == self.end:
            self.end = last[0]
            free.pop()
            return True
        return False

    @property
    def used(self) -> int:
        return self.end - sum(s for _, s in self.free)


class _OnDisk:
    """Where a spilled segment's rows are, and how to rebuild them: row ``off`` is at
    ``pos + off * row_bytes`` (``slot`` is ``None``: every row was written) or at
    ``slot[off]`` (only some rows were still held)."""

    __slots__ = ("wire", "dtype", "itemsize", "shape", "device", "pos", "slot")

    def __init__(self, wire: bool, dtype: str, itemsize: int, shape: tuple[int, ...],
                 device: str | None, pos: int, slot: dict[int, int] | None):
        self.wire = wire
        self.dtype = dtype
        self.itemsize = itemsize
        self.shape = shape  # of one row
        self.device = device  # torch: not None for a tensor that was not on the CPU
        self.pos = pos
        self.slot = slot

    def at(self, off: int, row_bytes: int) -> int:
        return self.pos + off * row_bytes if self.slot is None else self.slot[off]

    def build(self, buf: np.ndarray, k: int) -> Any:
        if self.wire:
            return WireTensor(self.dtype, self.itemsize, (k,) + self.shape, buf)
        from .. import codec  # torch: only units that were given torch tensors get here

        t = codec.tensor_from_raw(self.dtype, (k,) + self.shape, buf)
        return t if self.device is None else t.to(self.device)


def _raw(t: Any) -> tuple[tuple, np.ndarray] | None:
    """``(how to rebuild, flat uint8 bytes of every row)`` of a segment's tensor, or
    ``None`` when it cannot be spilled."""
    if isinstance(t, WireTensor):
        buf = t.inlined().buf if t.ref is None or t.buf is not None else None
        if buf is None:
            return None
        return (True, t.dtype, t.itemsize, t.shape[1:], None), np.asarray(buf).reshape(-1)
    if type(t).__module__.startswith("torch"):
        from .. import codec

        if not codec.is_raw_tensor(t) or t.device.type == "meta":
            return None
        dtype, shape, buf = codec.tensor_to_raw(t)
        device = None if t.device.type == "cpu" else str(t.device)
        return (False, dtype, t.element_size(), tuple(shape[1:]), device), buf
    return None


def _close_file(fd: int, path: str | None) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    if path is not None:  # (where a file cannot be unlinked while open)
        try:
            os.unlink(path)
        except OSError:
            pass


class SpillUnit(StorageUnit):
    """A storage unit that keeps at most ``memory_bytes`` of tensor data in memory and
    the rest in a local file (the ``"spill"`` backend; see the module docstring for the
    policy).

    Args:
        index: the unit's number among the queue's shards.
        on_release: called with each tensor that was put once the unit no longer refers
            to it in memory: when its last row is deleted, or when it is spilled.

    Keyword Args:
        memory_bytes: tensor bytes kept in memory (int >= 0; 0 spills every tensor).
        dir: the directory of the spill file (created if missing); default: the system
            temp dir.

    Raises:
        InvalidArgument: a bad ``memory_bytes``, or ``dir`` is not a writable directory.

    Examples:
        >>> import torch
        >>> u = SpillUnit(memory_bytes=64)
        >>> u.put([1, 2], {"x": torch.arange(16).view(2, 8)})  # 128 bytes: to disk
        >>> u.usage()["disk"], u.get([2], ["x"])["x"][0]
        (128, tensor([[ 8,  9, 10, 11, 12, 13, 14, 15]]))
        >>> u.delete([1, 2]), u.usage()["file"]
        ((2, 128), 0)
        >>> u.close()
    """

    name = "spill"
    caps = StorageCaps(zero_copy_reads=False, spills=True, persistent=False)
    runs = False  # (spilling works on entries per row)

    def __init__(self, index: int = 0, on_release: Callable[[Any], None] | None = None, *,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, dir: str | os.PathLike | None = None):
        _check_options(memory_bytes=memory_bytes, dir=dir)
        super().__init__(index, on_release)
        self.memory_bytes = memory_bytes
        self.dir = os.path.abspath(os.fspath(dir) if dir is not None else tempfile.gettempdir())
        try:
            os.makedirs(self.dir, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"streamrl-spill-unit{index}-", suffix=".bin",
                                        dir=self.dir)
        except OSError as e:
            raise InvalidArgument(
                f"spill storage: cannot create a file in dir={self.dir!r} ({e}); pass a "
                "writable directory on a local disk") from e
        try:
            os.unlink(path)
            unlinked = True
        except OSError:
            unlinked = False
        self.path = path  #: the spill file (unlinked: only this process sees it)
        self._fd = fd
        self._closer = weakref.finalize(self, _close_file, fd, None if unlinked else path)
        self._space = _FileSpace()
        self._mem = 0  # tensor bytes of the segments in memory
        # segments in memory: id -> (field, rows, bytes); spill candidates, oldest first
        self._origin: dict[int, tuple[str, tuple[int, ...], int]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._disk = 0  # bytes of the rows held on disk
        self._segs_on_disk = 0
        self.c_spilled = 0  # bytes written to the file, ever
        self.c_read = 0  # bytes read back from it, ever
        self._warned = False

    # -- hooks of StorageUnit

    def _segment(self, t: Any, n: int, write: int, field: str, rows: Sequence[int]) -> int:
        e = super()._segment(t, n, write, field, rows)
        sid = e >> _OFF_BITS
        nbytes = self.segments[sid].row_bytes * n
        self._mem += nbytes
        self._origin[sid] = (field, tuple(rows), nbytes)
        if nbytes:
            self._lru[sid] = None
        return e

    def _rows(self, seg: _Segment, off: int, k: int) -> Any:
        d = seg.tensor
        if d.__class__ is not _OnDisk:
            return d[off:off + k]
        n = k * seg.row_bytes
        buf = np.empty(n, dtype=np.uint8)
        self._pread(buf, d.at(off, seg.row_bytes))
        self.c_read += n
        return d.build(buf, k)

    def _dead(self, sid: int, seg: _Segment) -> None:
        if seg.tensor.__class__ is _OnDisk:
            self._segs_on_disk -= 1  # its rows' file space was freed row by row
            return
        self._mem -= self._origin.pop(sid)[2]
        self._lru.pop(sid, None)
        super()._dead(sid, seg)

    def _release(self, e: int | _Obj) -> None:
        if type(e) is not _Obj:
            seg = self.segments[e >> _OFF_BITS]
            if seg.tensor.__class__ is _OnDisk:
                self._free_row(seg, e & _OFF_MASK)
        super()._release(e)

    # -- the interface

    def put(self, rows: Sequence[int], columns: Mapping[str, Any], write: int = 0) -> None:
        """Store as :meth:`StorageUnit.put`, then spill the oldest segments while more
        than ``memory_bytes`` of tensor data is in memory (file writes, in this call)."""
        super().put(rows, columns, write)
        if self._mem > self.memory_bytes:
            self._spill()

    def delete(self, rows: Sequence[int]) -> tuple[int, int]:
        """Forget ``rows`` (see :meth:`StorageUnit.delete`); their bytes in the file are
        freed at once."""
        if self._segs_on_disk:
            segments = self.segments
            unique = list(dict.fromkeys(rows))
            for store in self.columns.values():
                for r in unique:
                    e = store.get(r)
                    if e is None or type(e) is _Obj:
                        continue
                    seg = segments[e >> _OFF_BITS]
                    if seg.tensor.__class__ is _OnDisk:
                        self._free_row(seg, e & _OFF_MASK)
        return super().delete(rows)

    def usage(self) -> dict[str, int]:
        """Where the bytes held are: ``memory`` (rows in memory, objects included) and
        ``disk`` (rows in the file), summing to ``stats()[1]``; ``memory_tensors``
        (tensor bytes in memory: what ``memory_bytes`` bounds, including rows deleted
        from a put whose other rows are held), ``file`` (the file's size now),
        ``bytes_spilled`` and ``bytes_read_back`` (ever)."""
        return {"memory": self.nbytes - self._disk, "disk": self._disk,
                "memory_tensors": self._mem, "file": self._space.end,
                "bytes_spilled": self.c_spilled, "bytes_read_back": self.c_read}

    def close(self) -> None:
        """Close (and so free) the spill file; reads of spilled rows fail afterwards."""
        self._closer()
        self._fd = -1

    # -- spilling

    def _spill(self) -> None:
        while self._mem > self.memory_bytes and self._lru:
            sid, _ = self._lru.popitem(last=False)
            try:
                self._spill_segment(sid)
            except OSError as e:
                self._lru[sid] = None
                self._lru.move_to_end(sid, last=False)
                if not self._warned:
                    self._warned = True
                    log.warning("streamrl: storage unit %d could not spill to %s (%s); its rows "
                                "stay in memory for now", self.index, self.dir, e)
                return

    def _spill_segment(self, sid: int) -> None:
        seg = self.segments[sid]
        raw = _raw(seg.tensor)
        if raw is None:  # stays in memory (and is no candidate any more)
            return
        (wire, dtype, itemsize, shape, device), flat = raw
        field, rows, nbytes = self._origin[sid]
        rb = seg.row_bytes
        base = sid << _OFF_BITS
        store = self.columns[field]
        live = [i for i, r in enumerate(rows) if store.get(r) == base + i]
        k = len(live)
        pos = self._space.alloc(k * rb)
        try:
            if k == len(rows):
                self._pwrite(flat[:k * rb], pos)
                slot = None
            else:
                slot = {}
                at = pos
                i = 0
                while i < k:  # runs of consecutive rows still held: one write each
                    j = i + 1
                    while j < k and live[j] == live[i] + (j - i):
                        j += 1
                    a, b = live[i], live[j - 1] + 1
                    self._pwrite(flat[a * rb:b * rb], at)
                    for off in range(a, b):
                        slot[off] = at
                        at += rb
                    i = j
        except BaseException:
            if self._space.release(pos, k * rb):
                self._truncate()
            raise
        t = seg.tensor
        seg.tensor = _OnDisk(wire, dtype, itemsize, tuple(shape), device, pos, slot)
        del self._origin[sid]
        self._mem -= nbytes
        self._disk += k * rb
        self._segs_on_disk += 1
        self.c_spilled += k * rb
        del flat, raw
        if self.on_release is not None:
            self.on_release(t)

    def _free_row(self, seg: _Segment, off: int) -> None:
        rb = seg.row_bytes
        if self._space.release(seg.tensor.at(off, rb), rb):
            self._truncate()
        self._disk -= rb

    # -- file I/O

    def _check_open(self) -> int:
        if self._fd < 0:
            raise TransportError(
                f"storage unit {self.index} is shut down: its spilled rows are gone "
                "(read data before the queue's shutdown)")
        return self._fd

    def _pwrite(self, data: np.ndarray, pos: int) -> None:
        fd = self._check_open()
        view = np.ascontiguousarray(data).data.cast("B")
        while view:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n

    def _pread(self, buf: np.ndarray, pos: int) -> None:
        fd = self._check_open()
        view = buf.data
        done, n = 0, len(view)
        while done < n:
            got = os.preadv(fd, [view[done:]], pos + done)
            if got <= 0:
                raise TransportError(
                    f"storage unit {self.index}: the spill file ended early at byte "
                    f"{pos + done} (wanted {n - done} more); the spilled rows are lost")
            done += got

    def _truncate(self) -> None:
        if self._fd >= 0:
            try:
                os.ftruncate(self._fd, self._space.end)
            except OSError:  # the space is reused anyway
                pass


def _check_options(memory_bytes: Any = DEFAULT_MEMORY_BYTES, dir: Any = None) -> None:
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise InvalidArgument(
            f"spill storage: memory_bytes must be an int >= 0 (tensor bytes kept in memory "
            f"per storage unit), got {memory_bytes!r}")
    if dir is not None and not isinstance(dir, (str, os.PathLike)):
        raise InvalidArgument(f"spill storage: dir must be a path or None, got {dir!r}")


def create(index: int = 0, *, on_release: Callable[[Any], None] | None = None,
           memory_bytes: int = DEFAULT_MEMORY_BYTES, dir: str | None = None) -> SpillUnit:
    """The registered factory of ``storage={"backend": "spill", ...}`` (see
    :class:`SpillUnit` for the options)."""
    return SpillUnit(index, on_release, memory_bytes=memory_bytes, dir=dir)


#: checked where the queue is made (the driver), before any unit is built (see
#: :func:`streamrl.storage.check_spec`); ``dir`` is checked by each unit, on its node
create.check_options = _check_options  # type: ignore[attr-defined]
