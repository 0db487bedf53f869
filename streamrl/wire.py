"""Torch-free row data, for the storage units of distributed transports.

A storage-unit actor never needs to understand tensors: it keeps bytes and hands slices
of them back. :class:`WireTensor` is a tensor seen that way: a dtype name, a shape and a
flat numpy ``uint8`` buffer (which Ray moves through its object store without pickling).
It has just the tensor surface a :class:`~streamrl.storage.StorageUnit` uses
(``shape``, ``element_size``, ``numel``, row slices, ``unsqueeze(0)``), so the same unit
code stores torch tensors (embedded) or wire tensors (Ray), and the unit's process never
imports torch. Python objects travel as ``bytes`` (encoded by :mod:`streamrl.codec`).
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np

__all__ = ["WireTensor", "joined", "JOIN_MAX"]

#: inline pieces of a read this small (bytes) are joined with their neighbours (see
#: :func:`joined`)
JOIN_MAX = 16 * 1024


class WireTensor:
    """Rows of one tensor as raw bytes: ``dtype`` name, ``shape`` (rows first),
    ``itemsize``, and the bytes: either inline, ``buf`` a flat C-contiguous ``uint8`` array
    of ``numel * itemsize`` bytes, or by reference, ``ref`` an opaque handle (a block of a
    storage unit's shared-memory arena, :class:`streamrl.arena.ShmRef`) of a flat
    ``uint8`` array with the rows starting ``offset`` bytes in. A storage unit keeps a
    reference with its local view of that whole array (``buf``, see :meth:`pinned`).
    Slicing rows never copies."""

    __slots__ = ("dtype", "itemsize", "shape", "buf", "ref", "offset")

    def __init__(self, dtype: str, itemsize: int, shape: tuple[int, ...],
                 buf: np.ndarray | None, ref: Any = None, offset: int = 0):
        self.dtype = dtype
        self.itemsize = itemsize
        self.shape = tuple(shape)
        self.buf = buf
        self.ref = ref
        self.offset = offset

    def __reduce__(self):
        # the bytes go as a pickle buffer (out of band where the pickler takes them so),
        # not as a numpy array: pickling the array's dtype and reconstructor cost 6 us a
        # tensor here, more than the rest of a small put's call
        buf: Any = self.buf
        if buf is not None:
            buf = pickle.PickleBuffer(
                (buf if buf.flags.c_contiguous else np.ascontiguousarray(buf)).data)
        return (_unpickle, (self.dtype, self.itemsize, self.shape, buf, self.ref, self.offset))

    def __repr__(self) -> str:
        where = "inline" if self.ref is None else "by reference"
        return f"WireTensor({self.dtype}, shape={self.shape}, {where})"

    def __len__(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        """Bytes per element, as ``torch.Tensor.element_size``."""
        return self.itemsize

    def numel(self) -> int:
        """Number of elements, as ``torch.Tensor.numel``."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of these rows."""
        return self.numel() * self.itemsize

    def by_reference(self, ref: Any) -> "WireTensor":
        """The same rows, with the bytes held as ``ref`` (whose array holds ``buf``)."""
        return WireTensor(self.dtype, self.itemsize, self.shape, None, ref, 0)

    def pinned(self, array: np.ndarray) -> "WireTensor":
        """The same reference, plus ``array``: a local view of the whole referenced array
        (what the storage unit that holds the block reads it through)."""
        return WireTensor(self.dtype, self.itemsize, self.shape, array, self.ref, self.offset)

    def stripped(self) -> "WireTensor":
        """The reference alone (what readers on the node are sent; they map the block
        themselves)."""
        if self.ref is None or self.buf is None:
            return self
        return WireTensor(self.dtype, self.itemsize, self.shape, None, self.ref, self.offset)

    def inlined(self) -> "WireTensor":
        """The rows' bytes inline (a view of the local array; the reference must come
        with one, see :meth:`pinned`). A reference without a local view (the entry of a
        tensor another process holds, see :mod:`streamrl.transport.rdt`) stays as it is."""
        if self.ref is None or self.buf is None:
            return self
        if self.buf is None:
            raise ValueError(
                "this WireTensor is a reference without the referenced array (stripped); "
                "inline it where the array is (see pinned)")
        return WireTensor(self.dtype, self.itemsize, self.shape,
                          self.buf[self.offset:self.offset + self.nbytes])

    def unsqueeze(self, dim: int) -> "WireTensor":
        """Add a leading row dimension (``dim`` must be 0)."""
        if dim != 0:
            raise ValueError("WireTensor only adds a leading row dimension")
        return WireTensor(self.dtype, self.itemsize, (1,) + self.shape, self.buf, self.ref,
                          self.offset)

    def __getitem__(self, idx: Any) -> "WireTensor":
        if (type(idx) is slice and not idx.start and idx.step is None
                and idx.stop == self.shape[0]):
            return self  # all of it (a one-row put's row, read): nothing to make
        if not isinstance(idx, slice):
            raise TypeError("WireTensor supports row slices only")
        start, stop, step = idx.indices(self.shape[0])
        if step != 1:
            raise ValueError("WireTensor supports contiguous row slices only")
        stop = max(start, stop)
        row = self.itemsize * math.prod(self.shape[1:])
        shape = (stop - start,) + self.shape[1:]
        if self.ref is not None:
            return WireTensor(self.dtype, self.itemsize, shape, self.buf, self.ref,
                              self.offset + start * row)
        assert self.buf is not None  # (inline: the bytes are here)
        return WireTensor(self.dtype, self.itemsize, shape, self.buf[start * row:stop * row])

    def resolve(self, arrays: dict) -> np.ndarray:
        """The bytes as a flat ``uint8`` array; ``arrays`` maps refs to their arrays."""
        if self.ref is None:
            assert self.buf is not None  # (inline: the bytes are here)
            return self.buf
        arr = arrays[self.ref] if self.buf is None else arrays.get(self.ref, self.buf)
        return arr[self.offset:self.offset + self.nbytes]


def joined(pieces: list) -> list:
    """The pieces of one field of a read, with each run of consecutive small inline
    tensor pieces of one dtype and row shape joined into one (one copy of their bytes).

    Rows of one-row puts are stored apart (a segment each), so a read of many of them is
    one piece a row, and each piece costs the reply and the reader far more than its
    bytes (its own buffer in the frame, its own tensor, its own slot in the final
    ``torch.cat``): a batch of 64 such rows cost its reader and units together 2.7-3x
    the CPU of rows put 16 at a time (see docs/benchmarks.md). Pieces of more than
    :data:`JOIN_MAX` bytes, pieces by reference and lists of objects stay as they
    are."""
    if len(pieces) < 2:
        return pieces
    out: list = []
    run: list[WireTensor] = []
    for p in pieces:
        if (type(p) is WireTensor and p.ref is None and p.buf is not None
                and p.nbytes <= JOIN_MAX):
            if run and (p.dtype != run[0].dtype or p.shape[1:] != run[0].shape[1:]):
                _flush(run, out)
            run.append(p)
        else:
            if run:
                _flush(run, out)
            out.append(p)
    if run:
        _flush(run, out)
    return out


def _flush(run: list[WireTensor], out: list) -> None:
    """Append ``run`` to ``out`` as one piece, and empty it."""
    first = run[0]
    if len(run) == 1:
        out.append(first)
    else:
        rows = 0
        for p in run:
            rows += p.shape[0]
        out.append(WireTensor(first.dtype, first.itemsize, (rows,) + first.shape[1:],
                              np.concatenate([p.buf for p in run])))
    run.clear()


def _unpickle(dtype: str, itemsize: int, shape: tuple[int, ...], buf: Any, ref: Any,
              offset: int) -> WireTensor:
    """A :class:`WireTensor` from its pickled fields (``buf``: any buffer of its bytes)."""
    return WireTensor(dtype, itemsize, shape,
                      None if buf is None else np.frombuffer(buf, dtype=np.uint8), ref, offset)
