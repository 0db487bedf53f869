"""The files of a checkpoint, written and read without streamrl's own types.

Torch-free (storage-unit actors import it): tensors are ``(dtype name, itemsize, shape,
bytes)`` with the torch dtype's name (``"float32"``, ``"bfloat16"``) and the bytes as a
flat ``uint8`` numpy array or any buffer.

* **Checksums.** Every file is written through a :class:`FileWriter`, which keeps the
  CRC-32 (:func:`zlib.crc32`) of the bytes as they go out and ``fsync``\\ s the file
  before it is closed; what it returns (:class:`FileEntry` as a dict: ``name``,
  ``bytes``, ``crc32``) is recorded by whoever lists the file, and every reader compares
  it. CRC-32 catches torn and corrupted files (it runs at about 1.4 GB/s here, well
  above a disk's write speed); it is no defence against a file altered on purpose.
* **Tensors** go to `safetensors <https://huggingface.co/docs/safetensors>`_ files,
  written here directly (an 8-byte little-endian header length, a JSON header, then
  the tensors' bytes back to back) so that the bytes go from the stored tensors to the
  file with no copy in between but the aligned staging buffer of direct I/O (see
  :class:`FileWriter`), and checksummed on the way. Any safetensors reader
  opens them. Tensors whose dtype safetensors has no code for (complex128, sub-byte
  dtypes, ...) are written as ``U8`` bytes; the unit's index says what they are.
* **Metadata** is msgpack (:func:`write_msgpack`, :func:`read_msgpack`); a list of many
  items is packed item by item, so that a writer thread lets others run in between.
"""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Sized
from typing import Any

import msgpack
import numpy as np

from ..errors import CheckpointError

try:
    import fcntl
except ImportError:  # (not on Windows: no direct I/O there either)
    fcntl = None  # type: ignore[assignment]

__all__ = ["FileWriter", "write_msgpack", "read_msgpack", "read_file", "write_safetensors",
           "read_safetensors", "SAFETENSORS_DTYPES", "ITEMSIZE", "fsync_dir", "check_entry"]

#: torch dtype name -> safetensors dtype code (the others are written as U8 bytes)
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1,
                "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "C64": 8}
#: bytes per element of the torch dtypes safetensors has a code for
ITEMSIZE = {name: _ST_ITEMSIZE[code] for name, code in SAFETENSORS_DTYPES.items()}

#: bytes of the staging buffer of a direct writer (one write call each)
STAGE_BYTES = 8 << 20
#: what direct writes are aligned to (addresses, offsets and lengths)
DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0) if fcntl is not None else 0
#: set STREAMRL_CHECKPOINT_DIRECT=0 to write data files through the page cache
_NO_DIRECT = os.environ.get("STREAMRL_CHECKPOINT_DIRECT", "1") == "0"
_PACK_SLICE = 512  # items of a long list packed per call (a writer thread yields between)
_READ = 16 << 20  # bytes per read call


class FileWriter:
    """A new file, written sequentially, checksummed as it goes, ``fsync``\\ ed on close.

    Args:
        path: the file to create (it must not exist).
        direct: write around the page cache (``O_DIRECT``, where the OS and filesystem
            have it; else as usual): the bytes go through an aligned staging buffer of
            :data:`STAGE_BYTES` straight to the device. For big data files: a buffered
            write costs the kernel a copy into the page cache and its writeback threads
            CPU time at a high priority, which on a loaded machine starves every other
            thread (the queue's event loop included; see docs/checkpoint.md), and
            leaves gigabytes of dirty pages for ``fsync`` to push out at the end.
    """

    def __init__(self, path: str, direct: bool = False):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.crc = 0
        self.nbytes = 0
        self._stage: Any = None
        self._filled = 0
        if direct and _O_DIRECT and not _NO_DIRECT:
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETFL,
                            fcntl.fcntl(self.fd, fcntl.F_GETFL) | _O_DIRECT)
            except OSError:  # this filesystem has no direct I/O
                pass
            else:
                self._stage = np.frombuffer(mmap.mmap(-1, STAGE_BYTES), dtype=np.uint8)

    def write(self, data: Any) -> None:
        """Write ``data`` (any buffer: bytes, a numpy array, a memoryview), without
        copying it (but into the staging buffer, for a direct writer)."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        if not n:
            return
        self.crc = zlib.crc32(view, self.crc)  # (releases the GIL)
        self.nbytes += n
        if self._stage is None:
            self._write_all(view)
            return
        src = np.frombuffer(view, dtype=np.uint8)
        done = 0
        while done < n:  # (numpy copies release the GIL)
            k = min(n - done, STAGE_BYTES - self._filled)
            self._stage[self._filled:self._filled + k] = src[done:done + k]
            self._filled += k
            done += k
            if self._filled == STAGE_BYTES:
                self._flush_stage(STAGE_BYTES)

    def _write_all(self, view: memoryview) -> None:
        done, n = 0, view.nbytes
        while done < n:
            done += os.write(self.fd, view[done:done + (1 << 30)])

    def _flush_stage(self, nbytes: int) -> None:
        """Write the first ``nbytes`` (a multiple of DIRECT_ALIGN) of the stage."""
        view = memoryview(self._stage)[:nbytes]
        try:
            self._write_all(view)
        except OSError as e:
            if e.errno != errno.EINVAL or os.lseek(self.fd, 0, os.SEEK_CUR) != 0:
                raise
            # the filesystem took O_DIRECT but refuses its writes: go on buffered
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_O_DIRECT)
            self._write_all(view)
        self._filled = 0

    def close(self) -> dict[str, Any]:
        """Flush to the disk and close; the file's entry ``{name, bytes, crc32}``."""
        try:
            if self._stage is not None and self._filled:
                # the last block, padded to the alignment, then cut to the real size
                k = self._filled
                end = -(-k // DIRECT_ALIGN) * DIRECT_ALIGN
                self._stage[k:end] = 0
                self._flush_stage(end)
                os.ftruncate(self.fd, self.nbytes)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self._stage = None
        return {"name": os.path.basename(self.path), "bytes": self.nbytes, "crc32": self.crc}

    def abort(self) -> None:
        """Close without flushing (the file is left to be removed with its directory)."""
        self._stage = None
        try:
            os.close(self.fd)
        except OSError:
            pass


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (new files, renames)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse to fsync a directory
        pass
    finally:
        os.close(fd)


def _packed(obj: Any, packer: msgpack.Packer) -> Iterable[bytes]:
    """``obj`` as msgpack, in pieces: long lists item by item."""
    if isinstance(obj, dict):
        yield packer.pack_map_header(len(obj))
        for k, v in obj.items():
            yield packer.pack(k)
            yield from _packed(v, packer)
    elif isinstance(obj, list) and len(obj) > _PACK_SLICE:
        yield packer.pack_array_header(len(obj))
        for i in range(0, len(obj), _PACK_SLICE):
            yield b"".join(packer.pack(x) for x in obj[i:i + _PACK_SLICE])
    elif isinstance(obj, Sized) and isinstance(obj, Iterable) and not isinstance(
            obj, (list, tuple, str, bytes, bytearray, memoryview, dict)):
        # a sized stream of items made as they are read (the controller's rows): packed
        # as an array, a slice at a time, each item let go once packed
        n = len(obj)
        yield packer.pack_array_header(n)
        it, got = iter(obj), 0
        while items := list(itertools.islice(it, _PACK_SLICE)):
            got += len(items)
            yield b"".join([packer.pack(x) for x in items])
            del items
        if got != n:
            raise ValueError(f"a stream said it had {n} items and gave {got}")
    else:
        yield packer.pack(obj)


def write_msgpack(path: str, obj: Any) -> dict[str, Any]:
    """Write ``obj`` (plain data) as one msgpack object; its file entry."""
    w = FileWriter(path)
    try:
        packer = msgpack.Packer(use_bin_type=True)
        buf: list[bytes] = []
        size = 0
        for piece in _packed(obj, packer):
            buf.append(piece)
            size += len(piece)
            if size >= 1 << 20:
                w.write(b"".join(buf))
                buf, size = [], 0
        w.write(b"".join(buf))
    except BaseException:
        w.abort()
        raise
    return w.close()


def read_file(path: str, entry: dict[str, Any] | None, what: str) -> bytes:
    """The whole file, checked against its entry (``None``: not checked).

    Raises:
        CheckpointError: the file is missing, or its size or checksum is not the entry's.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"{what} is missing: {path} does not exist. The checkpoint is incomplete (or, "
            "on several nodes without a shared filesystem, not gathered: see "
            "docs/checkpoint.md)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} ({path}): {e}") from None
    if entry is not None:
        check_entry(path, entry, len(data), zlib.crc32(data), what)
    return data


def check_entry(path: str, entry: dict[str, Any], nbytes: int, crc: int, what: str) -> None:
    """Raise :class:`CheckpointError` unless ``nbytes`` and ``crc`` are the entry's."""
    if nbytes != entry["bytes"]:
        raise CheckpointError(
            f"{what} ({path}) is torn: {nbytes} bytes where the checkpoint wrote "
            f"{entry['bytes']}; the checkpoint is damaged, restore an earlier one")
    if crc != entry["crc32"]:
        raise CheckpointError(
            f"{what} ({path}) is corrupt: its CRC-32 is {crc:#010x}, the checkpoint "
            f"wrote {entry['crc32']:#010x}; restore an earlier checkpoint")


def read_msgpack(path: str, entry: dict[str, Any] | None, what: str) -> Any:
    """A file written by :func:`write_msgpack`, checked against its entry.

    Raises:
        CheckpointError: missing, torn, corrupt or not msgpack.
    """
    data = read_file(path, entry, what)
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise CheckpointError(f"{what} ({path}) is not readable msgpack ({e}); the "
                              "checkpoint is damaged") from None


# ------------------------------------------------------------------ safetensors


def write_safetensors(path: str, tensors: list[tuple[str, str, int, tuple, Any]],
                      metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Write a safetensors file of ``tensors``: ``(key, dtype name, itemsize, shape,
    bytes)`` each, in that order, straight from their buffers. Returns the file entry.

    A dtype without a safetensors code is written as ``U8`` of shape ``[nbytes]``."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    bufs = []
    for key, dtype, itemsize, shape, data in tensors:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        code = SAFETENSORS_DTYPES.get(dtype)
        st_shape = list(shape) if code is not None else [n]
        header[key] = {"dtype": code or "U8", "shape": st_shape, "data_offsets": [off, off + n]}
        off += n
        bufs.append(view)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the bytes start 8-aligned
    w = FileWriter(path, direct=True)
    try:
        w.write(struct.pack("<Q", len(head)) + head)
        for view in bufs:
            w.write(view)
    except BaseException:
        w.abort()
        raise
    return w.close()


def read_safetensors(path: str, entry: dict[str, Any], what: str,
                     alloc: Callable[[str, int], Any]) -> dict[str, Any]:
    """Read a safetensors file into buffers ``alloc(key, nbytes)`` gives (writable,
    ``nbytes`` long), checking its entry; the parsed header.

    Raises:
        CheckpointError: the file is missing, torn, corrupt or not safetensors.
    """
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointError(
            f"{what} is missing: {path} does not exist. The checkpoint is incomplete (or, "
            "on several nodes without a shared filesystem, not gathered: see "
            "docs/checkpoint.md)") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != entry["bytes"]:
            check_entry(path, entry, size, 0, what)
        first = f.read(8)
        crc = zlib.crc32(first)
        try:
            (n,) = struct.unpack("<Q", first)
            if n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            raw = f.read(n)
            crc = zlib.crc32(raw, crc)
            header = json.loads(raw)
            items = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                           key=lambda kv: kv[1]["data_offsets"][0])
            pos = 0
            for key, meta in items:
                b, e = meta["data_offsets"]
                if b != pos or e < b or 8 + n + e > size:
                    raise ValueError(f"tensor {key!r} at bytes {b}..{e}")
                pos = e
        except (ValueError, KeyError, TypeError, struct.error) as err:
            check_entry(path, entry, size, zlib.crc32(f.read(), crc), what)  # corrupt?
            raise CheckpointError(f"{what} ({path}) is not a safetensors file ({err})") from None
        for key, meta in items:
            b, e = meta["data_offsets"]
            dst = memoryview(alloc(key, e - b)).cast("B")[:e - b]
            got = 0
            while got < e - b:
                k = f.readinto(dst[got:got + _READ])
                if not k:
                    break
                got += k
            crc = zlib.crc32(dst[:got], crc)
        rest = f.read()
        crc = zlib.crc32(rest, crc)
    check_entry(path, entry, size, crc, what)
    return header
