"""Row data in wire form: torch columns <-> :class:`~streamrl.wire.WireTensor` and encoded
bytes.

The actors import neither torch nor tensordict (they start several times faster on a
loaded machine): storage units keep WireTensors and encoded bytes. Converting to and
from torch happens in the client, which has torch anyway (:func:`to_wire`,
:func:`from_wire`); the helpers that walk wire-form columns (:func:`tensors_in`,
:func:`refs_in`, :func:`map_col`, :func:`map_pieces`) are torch-free and used on both
sides. Any data path that stores rows in these storage units reuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ...arena import ShmRef
from ...wire import WireTensor
from ..base import Column

__all__ = ["SHM_MIN", "to_wire", "from_wire", "tensors_in", "refs_in", "map_col",
           "map_pieces", "bytes_by_path"]

#: Tensors of at least this many bytes go through the shared-memory arena when the
#: producer or reader is on the unit's node; smaller ones travel inline in the call.
SHM_MIN = 64 * 1024


def to_wire(cols: Mapping[str, Column]) -> dict[str, Any]:
    """Client side: tensors -> WireTensor (a view of their bytes, no copy when
    contiguous); per-row tensors of a list -> WireTensor each; other objects -> bytes."""
    import torch

    from ... import codec

    def wt(t):
        dtype, shape, buf = codec.tensor_to_raw(t)
        return WireTensor(dtype, t.element_size(), shape, buf)

    out: dict[str, Any] = {}
    for name, col in cols.items():
        if isinstance(col, torch.Tensor):
            out[name] = wt(col)
        else:
            out[name] = [wt(x) if isinstance(x, torch.Tensor)
                         else codec.pack(codec.encode(x, name=f"{name}[{i}]"))
                         for i, x in enumerate(col)]
    return out


def tensors_in(pieces: Mapping[str, Any]) -> list[WireTensor]:
    """The WireTensors of the columns of a put, or of the pieces of a read."""
    out = []
    for col in pieces.values():
        for p in (col if isinstance(col, list) else (col,)):
            for x in (p if isinstance(p, list) else (p,)):
                if isinstance(x, WireTensor):
                    out.append(x)
    return out


def refs_in(pieces: Mapping[str, Any]) -> list[ShmRef]:
    """The arena blocks the pieces of a read point at (each once, in a fixed order)."""
    return list({t.ref: None for t in tensors_in(pieces) if isinstance(t.ref, ShmRef)})


def bytes_by_path(pieces: Mapping[str, Any]) -> dict[str, int]:
    """Bytes of the columns of a put (or the pieces of a read) per path: ``"shm"`` for
    tensors in arena blocks, ``"inline"`` for tensors and encoded objects carried in the
    call. Entries of tensors held elsewhere (another reference) are not counted here: the
    data path that moves them counts them."""
    out = {"shm": 0, "inline": 0}
    for col in pieces.values():
        for p in (col if isinstance(col, list) else (col,)):
            for x in (p if isinstance(p, list) else (p,)):
                if isinstance(x, WireTensor):
                    if x.ref is None:
                        out["inline"] += x.nbytes
                    elif isinstance(x.ref, ShmRef):
                        out["shm"] += x.nbytes
                elif isinstance(x, (bytes, bytearray, memoryview)):
                    out["inline"] += len(x)
    return {k: v for k, v in out.items() if v}


def map_col(col: Any, fn: Callable) -> Any:
    """Apply ``fn`` to a column in wire form (a WireTensor, or a list of per-row
    WireTensors and encoded objects), or to one piece of a read."""
    if isinstance(col, WireTensor):
        return fn(col)
    return [fn(x) if isinstance(x, WireTensor) else x for x in col]


def map_pieces(pieces: dict[str, list], fn: Callable) -> dict[str, list]:
    """Apply ``fn`` to every WireTensor of read pieces."""
    return {f: [map_col(p, fn) for p in plist] for f, plist in pieces.items()}


def from_wire(pieces: Mapping[str, list], arrays: dict) -> dict[str, list[Column]]:
    """Client side: storage pieces -> tensors (views of the arena blocks or of the inline
    bytes, no copy) / objects. ``arrays`` maps the pieces' block references to views."""
    from ... import codec

    def obj(x):
        if isinstance(x, WireTensor):
            return codec.tensor_from_raw(x.dtype, x.shape[1:], x.resolve(arrays))
        return codec.decode(codec.unpack(x))

    out: dict[str, list[Column]] = {}
    for f, plist in pieces.items():
        out[f] = [codec.tensor_from_raw(p.dtype, p.shape, p.resolve(arrays))
                  if isinstance(p, WireTensor) else [obj(x) for x in p] for p in plist]
    return out
