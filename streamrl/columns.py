"""Column batches: turning user data into columns and stored pieces back into batches.

A *column* is the data of one field for ``n`` rows, either

* a ``torch.Tensor`` whose first dimension is ``n`` (rows of one shape), or
* a ``list`` of ``n`` values: Python objects (a chat history, a string), or tensors of
  different shapes per row (ragged responses), or
* a jagged nested tensor of ``n`` rows (``layout=torch.jagged``): how ragged rows come
  back from storage. :func:`take_rows` indexes it (torch cannot index dim 0 of a nested
  tensor); a nested tensor given to a put is taken as its list of rows.

Stored columns come back from storage units as *pieces* (tensors of consecutive rows, or
lists); :func:`assemble` joins them into one column without copying when the pieces are
adjacent slices of one original tensor (the common case: a micro-batch that is a
contiguous run of one put).
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._types import Column
from .errors import InvalidArgument, SchemaError
from .storage import approx_size

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase


__all__ = ["Column", "to_columns", "column_dtype", "row_nbytes", "tag_values", "assemble", "take_rows",
           "settle", "to_tensordict", "approx_size", "is_tensordict", "load_tensordict"]


# tensordict is imported where a TensorDict is made or read, not with this module: it
# pulls in torch._dynamo and sympy (2-3 s and ~90 MB a process here), which a producer
# that only puts plain tensors never needs. Nothing can be a TensorDict (or one of its
# non-tensor wrappers) before tensordict is imported, so the checks below look it up in
# sys.modules instead of importing it.

def is_tensordict(x: Any) -> bool:
    """Whether ``x`` is a TensorDict (any ``TensorDictBase``); never imports tensordict."""
    td = sys.modules.get("tensordict")
    base = getattr(td, "TensorDictBase", None)
    return base is not None and isinstance(x, base)


def load_tensordict() -> None:
    """Import tensordict now, once a process. A consumer calls this before its first
    batch is leased (``get``, ``stream``), so that the import (seconds, the first time)
    runs before a lease starts rather than inside its first ``materialize``, where a
    short ``lease_timeout`` could expire meanwhile."""
    if "tensordict" not in sys.modules:
        import tensordict  # noqa: F401


def _non_tensor(x: Any) -> bool:
    """Whether ``x`` is tensordict's ``NonTensorStack`` or ``NonTensorData``."""
    td = sys.modules.get("tensordict")
    stack = getattr(td, "NonTensorStack", None)
    data = getattr(td, "NonTensorData", None)
    return stack is not None and data is not None and isinstance(x, (stack, data))


def to_columns(data: Any) -> tuple[dict[str, Column], int]:
    """Normalise ``data`` (a TensorDict, or a mapping of field -> tensor / ndarray / list)
    into ``({field: column}, n_rows)``. Tensors are kept as given (no copy); numpy arrays
    become tensors sharing their memory; a nested tensor (a ragged field, e.g. one
    materialized before) becomes the list of its rows (``unbind``: views, no copy).

    Raises:
        SchemaError: fields of different lengths, a value that is not per-row.
        InvalidArgument: empty data or a bad field name.
    """
    if type(data) is dict:  # (the common case, before the slower ABC checks)
        items = list(data.items())
    elif is_tensordict(data):
        if not data.batch_size:
            raise SchemaError(
                "a TensorDict put needs a batch dimension (its first dim counts rows); got "
                "batch_size=[]: use td.unsqueeze(0) for a single row")
        items = _td_items(data)
    elif isinstance(data, Mapping):
        items = list(data.items())
    else:
        raise InvalidArgument(
            "put's data must be a TensorDict or a dict of field -> per-row values, got "
            f"{type(data).__name__}")
    if not items:
        raise InvalidArgument("put's data has no field: it needs at least one")
    cols: dict[str, Column] = {}
    n = -1
    same = True
    for name, v in items:
        if type(name) is not str and not isinstance(name, str) or not name:
            raise InvalidArgument(
                f"put's data: field names must be non-empty str, got {name!r}")
        if (type(v) is torch.Tensor and v.layout is _STRIDED and v.dim() and not (
                v.is_nested or v.is_meta or v.is_quantized or v.requires_grad)):
            col = v  # (a dense tensor, as _column would keep it: the common case)
            k = v.shape[0]
        else:
            col = _column(name, v)
            k = col.shape[0] if isinstance(col, torch.Tensor) else len(col)
        cols[name] = col
        if k != n:
            same = n == -1
            n = k
    if not same or n == -1:
        lens = {k: c.shape[0] if isinstance(c, torch.Tensor) else len(c)
                for k, c in cols.items()}
        desc = ", ".join(f"{k}: {v}" for k, v in lens.items())
        raise SchemaError(
            f"all fields of one put need the same number of rows (first dimension); got {desc}")
    if n == 0:
        raise InvalidArgument("put's data has no rows: its fields have 0 rows; put at least one")
    return cols, n


_STRIDED = torch.strided


def _td_items(td: TensorDictBase) -> list[tuple[str, Any]]:
    from tensordict.base import _is_leaf_nontensor

    out = []
    # non-tensor stacks are leaves too (tensordict would otherwise skip them)
    for key in td.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        name = key if isinstance(key, str) else ".".join(key)
        v = td.get(key)
        if _non_tensor(v):
            v = v.tolist()
            if not isinstance(v, list):
                v = [v] * td.batch_size[0]
        out.append((name, v))
    return out


def _check_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor streamrl can store, or a :class:`SchemaError` that says what to pass."""
    if t.is_nested:
        return t
    if t.layout != torch.strided:
        raise SchemaError(
            f"field {name!r} is a {t.layout} tensor; streamrl stores dense tensors: pass "
            "t.to_dense() (or put the indices and values as fields of their own)")
    if t.is_meta:
        raise SchemaError(
            f"field {name!r} is a meta tensor, which holds no data; put a tensor with values")
    if t.is_quantized:
        raise SchemaError(
            f"field {name!r} is a quantized tensor ({t.dtype}); put t.dequantize(), or its "
            "int_repr() and its scale/zero point as fields of their own")
    if t.requires_grad:
        t = t.detach()
    return t


def _column(name: str, v: Any) -> Column:
    if isinstance(v, torch.Tensor):
        if v.dim() == 0:
            raise SchemaError(
                f"field {name!r} is a 0-d tensor; a field needs one value per row: give a "
                "tensor whose first dimension counts rows")
        v = _check_tensor(name, v)
        if v.is_nested:  # a ragged field (e.g. one materialized before): stored per row
            return list(v.unbind(0))
        return v
    if isinstance(v, np.ndarray):
        if v.ndim == 0:
            raise SchemaError(f"field {name!r} is a 0-d array; give one value per row")
        if v.dtype == object:
            return list(v)
        if v.dtype.kind in "USV":  # numpy strings and raw bytes: Python objects per row
            return v.tolist()
        if not v.dtype.isnative:  # big-endian: torch takes native byte order (a copy)
            v = v.astype(v.dtype.newbyteorder("="))
        if any(s < 0 for s in v.strides) or not v.flags.writeable:
            v = np.ascontiguousarray(v)  # torch takes no negative strides (a copy)
            if not v.flags.writeable:
                v = v.copy()
        try:
            return torch.from_numpy(v)
        except TypeError as e:
            raise SchemaError(
                f"field {name!r}: a numpy array of dtype {v.dtype} has no torch dtype ({e}); "
                "convert it (e.g. astype(np.float32)) or put a list of Python objects") from None
    if _non_tensor(v):
        return list(v.tolist())
    if isinstance(v, (list, tuple)):
        return [_check_tensor(f"{name}[{i}]", x) if isinstance(x, torch.Tensor) else x
                for i, x in enumerate(v)]
    raise SchemaError(
        f"field {name!r} has a {type(v).__name__}, which is not per-row data; give a tensor "
        "(first dim = rows) or a list with one value per row")


def column_dtype(name: str, col: Column) -> str:
    """The dtype a column gives its field: the tensor dtype (``"torch.int64"``, also for
    a list of per-row tensors) or ``"object"`` (Python objects). A field holds one dtype
    in a queue (the controller checks it).

    Raises:
        SchemaError: a list of per-row tensors of different dtypes.
    """
    if isinstance(col, torch.Tensor):
        return dtype_name(col.dtype)
    dtypes = {x.dtype for x in col if isinstance(x, torch.Tensor)}
    if not dtypes:
        return "object"
    if len(dtypes) > 1 or len(col) and not all(isinstance(x, torch.Tensor) for x in col):
        kinds = sorted(str(d) for d in dtypes) + (
            ["Python objects"] if not all(isinstance(x, torch.Tensor) for x in col) else [])
        raise SchemaError(
            f"the rows of field {name!r} mix {', '.join(kinds)}; a field has one dtype: "
            "convert the per-row tensors to one dtype (t.to(dtype)) before the put")
    return str(dtypes.pop())


#: the dtypes of plain dense data (not quantized) -> their names
_PLAIN_DTYPES: dict[torch.dtype, str] = {
    d: str(d) for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool)}

#: dtype -> its name (``str(dtype)`` builds a new string per call)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def one_row_dense(data: dict) -> tuple[dict[str, list[int]], dict[str, str], tuple] | None:
    """What a put needs of ``data`` when it is one row of plain dense tensors (a dict of
    field name -> strided tensor of one row, not nested, meta or requiring grad, of a
    dtype in :data:`_PLAIN_DTYPES`): ``(nbytes, dtypes, shapes)``, where ``nbytes`` maps
    each field to ``[its bytes]``, ``dtypes`` to its dtype's name, and ``shapes`` is
    ``((field, dtype, row shape), ...)`` in the dict's order. One pass, as
    :func:`to_columns` and the sizes after it would make them. ``None`` for anything
    else (:func:`to_columns` then does it all, its errors included); never raises."""
    nbytes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    shapes = []
    names = _PLAIN_DTYPES
    for f, v in data.items():
        if (type(v) is not torch.Tensor or type(f) is not str or not f
                or v.layout is not _STRIDED or v.is_nested or v.is_meta or v.requires_grad):
            return None
        shape = v.shape  # (cheaper than dim() and size(0))
        if not shape or shape[0] != 1:
            return None
        dtype = v.dtype
        name = names.get(dtype)
        if name is None:
            return None
        nbytes[f] = [v.nbytes]
        dtypes[f] = name
        shapes.append((f, dtype, shape[1:]))
    if not nbytes:
        return None
    return nbytes, dtypes, tuple(shapes)


def dtype_name(dtype: torch.dtype) -> str:
    """``str(dtype)``, e.g. ``"torch.int64"``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def row_nbytes(col: Column, n: int) -> list[int]:
    """Bytes of each row of a column (exact for tensors, estimated for objects)."""
    if isinstance(col, torch.Tensor):
        return [col.element_size() * (col.numel() // n) if n else 0] * n
    return [approx_size(x) for x in col]


def tag_values(name: str, col: Column) -> list[Hashable]:
    """The scalar value per row of a column used as a tag (group key, length).

    Raises:
        SchemaError: the column does not hold one hashable scalar per row.
    """
    if isinstance(col, torch.Tensor):
        n = col.shape[0]
        if col.numel() != n:
            raise SchemaError(
                f"field {name!r} is used as a group/balance key, so it needs one scalar per "
                f"row; it has shape {tuple(col.shape)}. Put a [n] tensor or a list of str/int")
        return col.reshape(n).tolist()
    out = []
    for x in col:
        if isinstance(x, torch.Tensor):
            if x.numel() != 1:
                raise SchemaError(f"field {name!r}: a key needs one scalar per row, got a tensor "
                                  f"of shape {tuple(x.shape)}")
            x = x.item()
        elif isinstance(x, np.generic):
            x = x.item()
        try:
            hash(x)
        except TypeError:
            raise SchemaError(
                f"field {name!r} is used as a group key but holds an unhashable "
                f"{type(x).__name__}; use str, int or a tuple") from None
        out.append(x)
    return out


def take_rows(col: Column, index: Sequence[int] | slice) -> Column:
    """Rows ``index`` of a column.

    A regular tensor gives a view for a slice and one gather copy otherwise; a list gives
    a new list of the same objects. A jagged nested tensor (a field whose rows differ in
    shape) is handled by :func:`_take_jagged`: the picked rows come back as a jagged
    nested tensor when their shapes differ and as a dense tensor when they agree (also
    for zero rows), the rule :func:`assemble` follows for fetched rows.
    """
    if isinstance(col, torch.Tensor) and col.is_nested:
        return _take_jagged(col, index)
    if isinstance(index, slice):
        return col[index]
    if isinstance(col, torch.Tensor):
        return col[torch.as_tensor(index, dtype=torch.long)]
    return [col[i] for i in index]


def _take_jagged(nt: torch.Tensor, index: Sequence[int] | slice) -> torch.Tensor:
    """Rows ``index`` of a nested tensor (torch cannot index or slice dim 0 of one).

    Works on the packed values and offsets of a contiguous jagged tensor (the kind
    :func:`_ragged` builds): a slice with step 1 narrows the values (no copy of the data;
    only new offsets), any other index gathers the picked rows' values in one copy.
    The result is

    * a jagged nested tensor when the picked rows differ in shape;
    * a dense ``[k, L, *rest]`` tensor when they all have length ``L`` (a view of the
      values for a slice), so a view gives the same kind of column whether it is read
      from the cache or fetched (:func:`assemble` stacks rows of one shape);
    * a dense ``[0, 0, *rest]`` tensor of the field's dtype for zero rows (the size of
      the ragged dim means nothing there).

    Other nested tensors (strided layout, a ragged dim other than the first row dim, or
    holes from ``narrow``) go through ``unbind`` and are rebuilt the same way (a copy).
    """
    n = nt.size(0)
    if isinstance(index, slice):
        picked = range(n)[index]
        first = picked[0] if picked else 0
        span = (first, first + len(picked)) if picked.step == 1 or len(picked) < 2 else None
        positions: Sequence[int] = picked
    else:
        span, positions = None, [i + n if i < 0 else i for i in index]
    # (lengths() and offsets() are methods of torch's jagged NestedTensor subclass, which
    # torch.Tensor's annotations do not have)
    if not (nt.layout == torch.jagged and nt.lengths() is None  # type: ignore[attr-defined]
            and getattr(nt, "_ragged_idx", 1) == 1):
        rows = nt.unbind(0)
        return _stack_or_ragged([rows[i] for i in positions], nt.dtype, rows[0].shape[1:] if rows
                                else ())
    values, offsets = nt.values(), nt.offsets()  # type: ignore[attr-defined]
    rest = tuple(values.shape[1:])
    if span is not None:
        a, b = span
        lengths = offsets[a + 1:b + 1] - offsets[a:b]
        picked_values = values[int(offsets[a]):int(offsets[b])]  # a view
    else:
        idx = torch.as_tensor(list(positions), dtype=torch.long, device=offsets.device)
        starts = offsets[idx]
        lengths = offsets[idx + 1] - starts
        # the value rows of picked row j are starts[j] .. starts[j] + lengths[j]
        begin = torch.cumsum(lengths, 0) - lengths
        gather = torch.arange(int(lengths.sum()), device=offsets.device) + torch.repeat_interleave(
            starts - begin, lengths)
        picked_values = values[gather]
    k = lengths.numel()
    if k == 0:
        return values.new_empty((0, 0) + rest)
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo == hi:
        return picked_values.reshape((k, lo) + rest)
    new_offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    return torch.nested.nested_tensor_from_jagged(picked_values, new_offsets)


def _stack_or_ragged(rows: Sequence[torch.Tensor], dtype: torch.dtype, rest: tuple) -> torch.Tensor:
    """Per-row tensors as one column (a copy): stacked when their shapes agree, a jagged
    nested tensor otherwise, ``[0, 0, *rest]`` of ``dtype`` when there are none."""
    if not rows:
        return torch.empty((0, 0) + tuple(rest), dtype=dtype)
    if len({r.shape for r in rows}) == 1:
        return torch.stack(list(rows))
    return _ragged(list(rows))


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype
            and a.shape[1:] == b.shape[1:] and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.nbytes == b.data_ptr())


def _join_tensors(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate row pieces; a view (no copy) when they are adjacent in one storage."""
    if len(pieces) == 1:
        return pieces[0]
    if all(_adjacent(pieces[i], pieces[i + 1]) for i in range(len(pieces) - 1)):
        first = pieces[0]
        n = sum(p.shape[0] for p in pieces)
        out = first.new_empty(0)
        out.set_(first.untyped_storage(), first.storage_offset(), (n,) + tuple(first.shape[1:]),
                 first.stride())
        return out
    shapes = {p.shape[1:] for p in pieces}
    dtypes = {p.dtype for p in pieces}
    if len(dtypes) > 1:
        raise SchemaError(f"rows of one field have different dtypes {sorted(map(str, dtypes))}; "
                          "write the field with one dtype")
    if len(shapes) > 1:
        rows = [r for p in pieces for r in p.unbind(0)]
        return _ragged(rows)
    return torch.cat(pieces, 0)


def _ragged(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of different shapes: a jagged nested tensor (ragged first row dimension)."""
    try:
        return torch.nested.nested_tensor(rows, layout=torch.jagged)
    except (RuntimeError, ValueError) as e:
        shapes = sorted({tuple(r.shape) for r in rows})[:4]
        raise SchemaError(
            f"rows of one field have shapes {shapes} that cannot be stacked or made a jagged "
            f"nested tensor (only the first per-row dim may vary): {e}") from None


def assemble(pieces: list[Column]) -> Column:
    """Join pieces of consecutive rows into one column.

    Tensor pieces become one tensor: a zero-copy view when the pieces are adjacent slices
    of one storage, otherwise one ``torch.cat`` copy (or a jagged nested tensor when rows
    have different shapes). Lists are concatenated. Per-row tensors kept as a list (a ragged
    put) are stacked when their shapes agree.
    """
    if not pieces:
        return []
    if all(isinstance(p, torch.Tensor) for p in pieces):
        return _join_tensors(pieces)
    flat: list = []
    for p in pieces:
        flat.extend(p.unbind(0) if isinstance(p, torch.Tensor) else p)
    if flat and all(isinstance(x, torch.Tensor) for x in flat):
        shapes = {x.shape for x in flat}
        if len(shapes) == 1:
            return torch.stack(flat)
        return _ragged(flat)
    return flat


def settle(col: Column) -> Column:
    """A column as ``materialize`` gives it: a list whose values are all tensors (a
    ragged put, as given) becomes one tensor -- stacked when the rows agree in shape,
    else a jagged nested tensor, as :func:`assemble` makes of fetched rows (a copy).
    Other columns are returned as they are."""
    if isinstance(col, list) and col and all(isinstance(x, torch.Tensor) for x in col):
        return assemble([col])
    return col


def to_tensordict(columns: Mapping[str, Column], n: int) -> TensorDict:
    """A TensorDict of batch size ``[n]``; list columns become non-tensor stacks (read
    back as lists with ``td[name]``), except lists of per-row tensors, which become a
    tensor or a jagged nested tensor (see :func:`settle`)."""
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    td = TensorDict({}, batch_size=[n])
    for name, col in columns.items():
        col = settle(col)
        if isinstance(col, torch.Tensor):
            td.set(name, col)
        else:
            td.set(name, NonTensorStack(*[NonTensorData(x, batch_size=[]) for x in col],
                                        stack_dim=0) if col else NonTensorStack(batch_size=[0]))
    return td
