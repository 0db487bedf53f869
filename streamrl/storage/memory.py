"""The ``"memory"`` storage backend (the default): column-oriented, in-memory holders
of row data.

A :class:`StorageUnit` holds, per field, one entry per row. A tensor entry is a reference
to the tensor given to ``put`` plus the row's offset in it: **nothing is copied on put**.
The ownership rule that follows (as with Ray Direct Transport): once a tensor is put, the
producer must not modify it in place; and data read back may be a view of what was put,
so consumers must not modify it in place either (use ``materialize(copy=True)`` when they
must). Python objects are stored by reference too.

A read of 2 fields out of 30 touches only those 2 fields' entries. Bytes are accounted
per row and field, and freed by ``delete``; the memory behind a tensor is released when
the last row that references it is deleted (and no reader holds a view).
"""

from __future__ import annotations

import bisect
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, final

from .._types import Column
from ..errors import RowsDropped, UnknownField, rows_preview
from .base import STATE_FORMAT, StateChunk, StorageBackend, StorageCaps, load_chunks

__all__ = ["StorageUnit", "approx_size", "create"]

# This module does not import torch: a unit stores anything with the tensor surface it
# uses (``shape``, ``element_size()``, ``numel()``, row slices, ``unsqueeze(0)``), that is
# torch tensors (embedded) and :class:`streamrl.wire.WireTensor` (storage-unit actors).


#: types seen to have the tensor surface (a put asks once per type, not per value)
_TENSOR_TYPES: set[type] = set()


def _is_tensor(x: Any) -> bool:
    t = type(x)
    if t in _TENSOR_TYPES:
        return True
    if hasattr(x, "element_size") and hasattr(x, "shape") and not isinstance(x, (list, tuple)):
        if hasattr(t, "element_size") and hasattr(t, "shape"):  # (of the class itself)
            _TENSOR_TYPES.add(t)
        return True
    return False


def approx_size(obj: Any) -> int:
    """The bytes an object holds, for capacity accounting.

    Exact for tensors, numpy arrays, ``bytes`` and ``str`` (their payload). Containers
    (lists, tuples, sets, dicts, and objects with a ``__dict__`` or ``__slots__``) are
    walked to any depth, each object counted once (shared and cyclic references too),
    adding 8 bytes per reference and ``sys.getsizeof`` for other scalars. So a 20 MiB
    string deep inside an agent trajectory counts 20 MiB. The walk visits every object
    once: a put of Python objects costs time in proportion to what they hold."""
    total = 0
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if _is_tensor(x):
            total += x.element_size() * x.numel()
            continue
        if isinstance(x, (bytes, bytearray, memoryview, str)):
            total += len(x)
            continue
        nbytes = getattr(x, "nbytes", None)  # numpy arrays
        if isinstance(nbytes, int) and not isinstance(x, type):
            total += nbytes
            continue
        if isinstance(x, (int, float, bool, complex)) or x is None:
            total += 8
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            total += 8 * len(x)
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            total += 8 * len(x)
            stack.extend(x)
        else:
            total += sys.getsizeof(x)
            d = getattr(x, "__dict__", None)
            if isinstance(d, dict):
                stack.append(d)
            for slot in getattr(type(x), "__slots__", ()) or ():
                if isinstance(slot, str) and hasattr(x, slot):
                    stack.append(getattr(x, slot))
    return total


@final  # (so that ``type(e) is _Obj`` tells a type checker an entry is not an int)
class _Obj:
    """A stored Python object (distinguishes it from a packed tensor entry)."""

    __slots__ = ("value", "nbytes", "write")

    def __init__(self, value, nbytes: int, write: int = 0):
        self.value = value
        self.nbytes = nbytes
        self.write = write  # the write that stored it (0: unknown)


_GONE_MAX = 1 << 16  # deleted-before-stored rows remembered (late data is seconds late at most)

#: a write of a field to some rows of a run splits it when each part is this many rows
#: or more (else the run becomes entries per row: a run a row would cost more)
_MIN_SPLIT = 8

_OFF_BITS = 32  # a tensor entry is the int (segment id << 32) | row offset in the segment
_OFF_MASK = (1 << _OFF_BITS) - 1


class _Segment:
    """A tensor that was put, shared by the rows it holds."""

    __slots__ = ("tensor", "row_bytes", "live", "write")

    def __init__(self, tensor: Any, row_bytes: int, live: int, write: int = 0):
        self.tensor = tensor
        self.row_bytes = row_bytes
        self.live = live  # entries still referring to it
        self.write = write  # the write that stored it (0: unknown)


class _Run:
    """Rows ``first .. first + n - 1``, stored by one put of new rows whose fields are all
    tensors: field ``f`` of row ``first + i`` is the entry ``bases[f] + i``. The rows of
    a run have no other entry; ``dead``: the offsets of its rows deleted since."""

    __slots__ = ("first", "n", "bases", "live", "dead")

    def __init__(self, first: int, n: int, bases: dict[str, int]):
        self.first = first
        self.n = n
        self.bases = bases
        self.live = n
        self.dead: set[int] | None = None


class StorageUnit(StorageBackend):
    """One shard of row data, in memory (the ``"memory"`` backend).

    Tensor entries are packed ints ``(segment id << 32) | offset``: rows of one put sit at
    consecutive ints, so a run of rows is found by comparing integers, and the cyclic
    garbage collector has nothing per row to scan. A segment (the tensor that was put) is
    released when its last row is deleted.

    A put of new rows with consecutive ids whose fields are all tensors (what the
    embedded queue's combined one-row puts and most batched puts are) is kept as one
    record, a *run*, with no entry per row: a read or a delete of rows of runs (in
    increasing order) costs per run, not per row. A field written later to whole runs
    is kept in them, one written to a part of a run (``_MIN_SPLIT`` rows or more on each
    side) splits it. Anything else that touches a run's rows (a write to a few of them,
    rows out of order or twice, an undone write) first turns it into entries per row
    (:attr:`runs`); a checkpoint reads runs as they are.

    Args:
        index: the unit's number among the queue's shards (for messages).
        on_release: called with each tensor that was put, once no row refers to it any
            more (the Ray transport frees its shared-memory block then).

    Examples:
        >>> import torch
        >>> u = StorageUnit()
        >>> u.put([7, 8], {"x": torch.arange(6).view(2, 3)})
        >>> u.get([8], ["x"])["x"][0]
        tensor([[3, 4, 5]])
        >>> u.delete([7, 8])
        (2, 48)
    """

    name = "memory"
    caps = StorageCaps(zero_copy_reads=True)

    #: whether puts of new rows are kept as runs (see above); a subclass that needs an
    #: entry per row (the spill backend) turns it off
    runs = True

    def __init__(self, index: int = 0, on_release: Callable[[Any], None] | None = None):
        self.index = index
        self.on_release = on_release  # called with a tensor once no row refers to it
        # field -> row -> packed int (tensor rows) | _Obj (Python objects)
        self.columns: dict[str, dict[int, int | _Obj]] = {}
        self.segments: dict[int, _Segment] = {}
        self._next_seg = 1
        self.row_fields: dict[int, int] = {}  # row -> number of fields held (not in a run)
        self._by_first: dict[int, _Run] = {}  # first row -> run
        self._starts: list[int] = []  # the runs' first rows, sorted
        self._run_rows = 0  # rows held in runs
        self._run_fields: dict[str, int] = {}  # field -> runs that hold it
        self.nbytes = 0
        # rows deleted before any of their data arrived (a write aborted while its data
        # was on its way): their late data is dropped (row ids are never reused)
        self._gone: OrderedDict[int, None] = OrderedDict()
        # writes aborted (by id): their data, should it still arrive, is dropped
        self._aborted: OrderedDict[int, None] = OrderedDict()

    def _segment(self, t: Any, n: int, write: int, field: str, rows: Sequence[int]) -> int:
        """A new segment for tensor ``t`` of ``n`` rows (field ``field`` of ``rows``):
        the packed int of its first row."""
        sid = self._next_seg
        self._next_seg += 1
        per = t.element_size() * (t.numel() // n if n else 0)
        self.segments[sid] = _Segment(t, per, n, write)
        return sid << _OFF_BITS

    def _stored(self, t: Any, n: int, write: int, field: str, rows: Sequence[int]) -> int:
        """:meth:`_segment`, its bytes counted as held."""
        base = self._segment(t, n, write, field, rows)
        self.nbytes += self.segments[base >> _OFF_BITS].row_bytes * n
        return base

    def _rows(self, seg: _Segment, off: int, k: int) -> Any:
        """Rows ``off:off + k`` of a segment's tensor (subclasses keep them elsewhere)."""
        return seg.tensor[off:off + k]

    def _dead(self, sid: int, seg: _Segment) -> None:
        """Segment ``sid`` lost its last row (it is out of ``segments`` already)."""
        if self.on_release is not None:
            self.on_release(seg.tensor)

    def _write_of(self, e: int | _Obj) -> int:
        return e.write if isinstance(e, _Obj) else self.segments[e >> _OFF_BITS].write

    def _entry_bytes(self, e: int | _Obj) -> int:
        return e.nbytes if isinstance(e, _Obj) else self.segments[e >> _OFF_BITS].row_bytes

    def _release(self, e: int | _Obj) -> None:
        if not isinstance(e, _Obj):
            sid = e >> _OFF_BITS
            seg = self.segments[sid]
            seg.live -= 1
            if not seg.live:
                del self.segments[sid]
                self._dead(sid, seg)

    # ------------------------------------------------------------------ runs

    def _run_of(self, r: int) -> _Run | None:
        """The run whose ids cover row ``r`` (held or deleted), if any."""
        starts = self._starts
        i = bisect.bisect_right(starts, r) - 1
        if i < 0:
            return None
        run = self._by_first[starts[i]]
        return run if r < run.first + run.n else None

    def _span(self, rows: Sequence[int]) -> list[tuple[_Run, int, int]] | None:
        """``rows`` as pieces ``(run, offset, k)`` when they are ids in increasing order
        all held in runs (consecutive ids of one run make one piece), else ``None``."""
        if type(rows) is not list:
            rows = list(rows)
        out = []
        n = len(rows)
        i = 0
        prev = -1
        run_of = self._run_of
        while i < n:
            r = rows[i]
            if r <= prev:
                return None  # (out of order, or twice)
            run = run_of(r)
            if run is None:
                return None
            off = r - run.first
            k = min(run.n - off, n - i)  # (the most this piece can be)
            if k > 1 and (rows[i + k - 1] - r != k - 1 or (
                    k > 2 and rows[i:i + k] != list(range(r, r + k)))):
                j = 1  # (the piece ends before: where the ids stop following on)
                while rows[i + j] == r + j:
                    j += 1
                k = j
            if run.dead is not None and not run.dead.isdisjoint(range(off, off + k)):
                return None
            out.append((run, off, k))
            i += k
            prev = r + k - 1
        return out

    def _add_run(self, rows: Sequence[int], columns: Mapping[str, Column], write: int) -> bool:
        """Store a put of new rows as a run, if it is one (see :attr:`runs`)."""
        if not _consecutive(rows):
            return False
        n = len(rows)
        first = rows[0]
        starts = self._starts
        i = bisect.bisect_right(starts, first + n - 1)
        if i:
            last = self._by_first[starts[i - 1]]
            if last.first + last.n > first:
                return False  # (ids of a run: held, or deleted and not to be reused)
        bases = {}
        for name, col in columns.items():
            bases[name] = self._stored(col, n, write, name, rows)
            self._run_field(name)
        self._by_first[first] = _Run(first, n, bases)
        starts.insert(i, first)
        self._run_rows += n
        return True

    def _write_runs(self, rows: Sequence[int], columns: Mapping[str, Column],
                    write: int) -> bool:
        """Store fields of existing rows that are whole runs (a later stage's field of the
        rows of one put: a response, a reward), if they are: each run refers to the new
        tensor's rows as it does to those it was put with (a field a run holds already
        is replaced, as an entry per row would be). ``False``: not so (nothing done).
        ``columns``: tensors (at least one)."""
        span = self._span(rows)
        if span is None:
            return False
        for run, off, k in span:
            if (off or k != run.n) and (k < _MIN_SPLIT or (
                    off and off < _MIN_SPLIT) or (run.n - off - k and run.n - off - k < _MIN_SPLIT)):
                return False  # (a few rows of a run: entries per row)
        whole = []
        # (a part of a run is split off as a run of its own; the last piece first: rows
        # that skip a deleted row are two pieces of one run, and a split keeps the run's
        # first rows in the run, so the pieces before stay where the span says)
        for run, off, k in reversed(span):
            if off:
                run = self._split(run, off)
            if k != run.n:
                self._split(run, k)
            whole.append((run, 0, k))
        whole.reverse()
        span = whole
        n = len(rows)
        for name, col in columns.items():
            base = self._stored(col, n, write, name, rows)
            at = 0
            for run, _, k in span:
                old = run.bases.get(name)
                if old is None:
                    self._run_field(name)
                else:  # (replaced: the old tensor's rows are released)
                    self._release_rows(old, k)
                run.bases[name] = base + at
                at += k
        return True

    def _split(self, run: _Run, at: int) -> _Run:
        """Cut ``run`` before its offset ``at`` (0 < at < its length): it keeps its first
        ``at`` rows; returns the run of the others."""
        rest = _Run(run.first + at, run.n - at, {f: b + at for f, b in run.bases.items()})
        dead = run.dead
        if dead is not None:
            mine = {i for i in dead if i < at}
            theirs = {i - at for i in dead if i >= at}
            run.dead = mine or None
            rest.dead = theirs or None
            rest.live = rest.n - len(theirs)
            run.live = at - len(mine)
        else:
            run.live = at
        run.n = at
        for f in rest.bases:
            self._run_field(f)
        self._by_first[rest.first] = rest
        self._starts.insert(bisect.bisect_right(self._starts, run.first), rest.first)
        for part in (run, rest):  # (a part whose rows were all deleted: gone, as a run
            if not part.live:  # whose last row is deleted is; its rows were released)
                self._drop_run(part)
        return rest

    def _run_field(self, name: str) -> None:
        """One more run holds field ``name`` (listed among the columns, in the order
        entries per row would list it)."""
        if name not in self.columns:
            self.columns[name] = {}
        self._run_fields[name] = self._run_fields.get(name, 0) + 1

    def _drop_run(self, run: _Run) -> None:
        del self._by_first[run.first]
        del self._starts[bisect.bisect_left(self._starts, run.first)]
        for name in run.bases:
            left = self._run_fields[name] - 1
            if left:
                self._run_fields[name] = left
            else:
                del self._run_fields[name]
                if not self.columns.get(name, True):
                    del self.columns[name]

    def _explode(self, rows: Sequence[int] | None = None) -> None:
        """Turn the runs that cover any of ``rows`` (``None``: every run) into entries
        per row, for the operations that work on those."""
        if not self._starts:
            return
        if rows is None:
            hit = list(self._by_first.values())
        else:
            found: dict[int, _Run] = {}
            for r in rows:
                run = self._run_of(r)
                if run is not None:
                    found[run.first] = run
            hit = list(found.values())
        for run in hit:
            first, n, dead = run.first, run.n, run.dead
            if dead is None:
                ids: Sequence[int] = range(first, first + n)
                for name, base in run.bases.items():
                    self.columns.setdefault(name, {}).update(zip(ids, range(base, base + n)))
            else:
                offs = [i for i in range(n) if i not in dead]
                ids = [first + i for i in offs]
                for name, base in run.bases.items():
                    self.columns.setdefault(name, {}).update(zip(ids, [base + i for i in offs]))
            self.row_fields.update(dict.fromkeys(ids, len(run.bases)))
            self._run_rows -= run.live
            self._drop_run(run)

    def _release_rows(self, e: int, k: int) -> None:
        """``k`` rows of a segment from its entry ``e`` on are not referred to any more."""
        sid = e >> _OFF_BITS
        seg = self.segments[sid]
        self.nbytes -= seg.row_bytes * k
        seg.live -= k
        if not seg.live:
            del self.segments[sid]
            self._dead(sid, seg)

    def _delete_span(self, span: list[tuple[_Run, int, int]]) -> None:
        for run, off, k in span:
            for base in run.bases.values():
                self._release_rows(base + off, k)
            run.live -= k
            self._run_rows -= k
            if not run.live:
                self._drop_run(run)
            elif run.dead is None:
                run.dead = set(range(off, off + k))
            else:
                run.dead.update(range(off, off + k))

    def forgotten(self, rows: Sequence[int], write: int = 0) -> bool:
        """Whether the data of a write is to be dropped on arrival: ``rows`` (new rows)
        were deleted before it came, or the write (by id) was aborted."""
        return (bool(rows) and rows[0] in self._gone) or (bool(write) and write in self._aborted)

    def put(self, rows: Sequence[int], columns: Mapping[str, Column], write: int = 0) -> None:
        """Store ``columns`` (each with ``len(rows)`` rows) for ``rows``; an existing
        entry of the same field is replaced. ``write`` is the id of the write the data
        belongs to (the controller's write token), remembered with each entry so that an
        abort takes back only what that write stored. Data of a write that arrives after
        it was aborted, or of rows deleted before it came, is dropped (see
        :meth:`forgotten`)."""
        if self.forgotten(rows, write):
            return
        n = len(rows)
        row_fields = self.row_fields
        # every field a tensor (asked only where it matters: not of a one-row put alone)
        tensors = (n > 1 or bool(self._starts)) and all(
            _is_tensor(c) for c in columns.values())
        if n > 1 and columns and tensors and self.runs and (
                not row_fields or row_fields.keys().isdisjoint(rows)) and self._add_run(
                rows, columns, write):
            return
        if self._starts:
            if columns and tensors and self._write_runs(rows, columns, write):
                return
            self._explode(rows)
        if n > 1 and tensors and row_fields.keys().isdisjoint(rows):
            fresh = dict.fromkeys(rows, len(columns))
            if len(fresh) == n:
                # new rows (each once), every field a tensor (rows of one shape, the
                # common case): each field's rows are consecutive entries of one new
                # segment
                for name, col in columns.items():
                    base = self._stored(col, n, write, name, rows)
                    self.columns.setdefault(name, {}).update(zip(rows, range(base, base + n)))
                row_fields.update(fresh)
                return
        for name, col in columns.items():
            store = self.columns.setdefault(name, {})
            if _is_tensor(col):
                base = self._stored(col, n, write, name, rows)
                if n == 1:  # (every one-row put)
                    r = rows[0]
                    old = store.get(r)
                    if old is None:
                        row_fields[r] = row_fields.get(r, 0) + 1
                    else:
                        self.nbytes -= self._entry_bytes(old)
                        self._release(old)
                    store[r] = base
                    continue
                entries: list = list(range(base, base + n))
            else:
                entries = []
                for r, x in zip(rows, col):
                    if _is_tensor(x):
                        entries.append(self._segment(x.unsqueeze(0), 1, write, name, (r,)))
                    else:
                        entries.append(_Obj(x, approx_size(x), write))
                self.nbytes += sum(self._entry_bytes(e) for e in entries)
            for r, e in zip(rows, entries):
                old = store.get(r)
                if old is None:
                    row_fields[r] = row_fields.get(r, 0) + 1
                else:
                    self.nbytes -= self._entry_bytes(old)
                    self._release(old)
                store[r] = e

    def get(self, rows: Sequence[int], fields: Sequence[str]) -> dict[str, list[Column]]:
        """Read ``fields`` of ``rows`` (in that order) as pieces of consecutive rows:
        tensor pieces are views (slices) of what was put, never copies.

        Raises:
            RowsDropped: a row is not held here (dropped, or never written).
            UnknownField: a held row lacks one of ``fields``.
        """
        if self._starts and rows:
            span = self._span(rows)
            if span is not None:  # (consecutive rows of runs: a slice a run and field)
                out: dict[str, list[Column]] = {}
                segments = self.segments
                for f in fields:
                    pieces = []
                    for run, off, k in span:
                        base = run.bases.get(f)
                        if base is None:
                            break
                        e = base + off
                        pieces.append(self._rows(segments[e >> _OFF_BITS], e & _OFF_MASK, k))
                    else:
                        out[f] = pieces
                        continue
                    break  # (a field a run lacks: the usual way raises UnknownField)
                else:
                    return out
            self._explode(rows)
        missing = [r for r in rows if r not in self.row_fields]
        if missing:
            raise RowsDropped(
                f"rows {rows_preview(missing)} are not held by storage unit {self.index}: they "
                "were dropped (drop, clear, a filter, staleness or consumer-set cleanup)", missing)
        out = {}
        for f in fields:
            store = self.columns.get(f)
            if store is None:
                raise UnknownField(self._unknown(f, rows))
            try:
                entries = [store[r] for r in rows]
            except KeyError:
                raise UnknownField(self._unknown(f, rows)) from None
            out[f] = self._runs(entries)
        return out

    def _unknown(self, f: str, rows: Sequence[int]) -> str:
        store = self.columns.get(f, {})
        lacking = [r for r in rows if r not in store]
        have = sorted(k for k, v in self.columns.items() if all(r in v for r in rows))
        return (f"field {f!r} is not written for rows {rows_preview(lacking)}; these rows have "
                f"{have}. Wait for the field (stream/get with it in fields) or check the name")

    def _runs(self, entries: list) -> list[Column]:
        """Pieces: slices of one segment at consecutive offsets, and lists of objects."""
        n = len(entries)
        if n:  # (a run of one put, the common case: one slice)
            e = entries[0]
            if (type(e) is int and type(entries[-1]) is int and entries[-1] - e == n - 1
                    and entries[-1] >> _OFF_BITS == e >> _OFF_BITS
                    and entries == list(range(e, e + n))):
                return [self._rows(self.segments[e >> _OFF_BITS], e & _OFF_MASK, n)]
        pieces: list[Column] = []
        i = 0
        while i < n:
            e = entries[i]
            if isinstance(e, _Obj):
                objs = [e.value]
                i += 1
                while i < n and isinstance(entries[i], _Obj):
                    objs.append(entries[i].value)
                    i += 1
                pieces.append(objs)
                continue
            j = i + 1
            while j < n and entries[j] == e + (j - i) and not isinstance(entries[j], _Obj):
                j += 1
            pieces.append(self._rows(self.segments[e >> _OFF_BITS], e & _OFF_MASK, j - i))
            i = j
        return pieces

    def delete(self, rows: Sequence[int]) -> tuple[int, int]:
        """Forget ``rows`` (rows not held are skipped). Returns (rows, bytes) freed."""
        before = self.nbytes
        if self._starts and rows:
            span = self._span(rows)
            if span is not None:  # (consecutive rows of runs)
                self._delete_span(span)
                return len(rows), before - self.nbytes
            self._explode(rows)
        n = 0
        freed = 0
        stores = list(self.columns.values())
        segments = self.segments
        emptied: list[int] = []
        held = []
        pop = self.row_fields.pop
        for r in rows:
            if pop(r, None) is None:
                self._gone[r] = None  # its data may still be on its way
            else:
                held.append(r)
        n = len(held)
        if not n:
            stores = []
        for store in stores:  # (the hot loop of dropping: kept flat)
            sp = store.pop
            entries = [sp(r, None) for r in held]
            e = entries[0]
            if (type(e) is int and type(entries[-1]) is int and entries[-1] - e == n - 1
                    and entries[-1] >> _OFF_BITS == e >> _OFF_BITS
                    and entries == list(range(e, e + n))):
                # a run of one segment (rows of one put, dropped together: the common case)
                seg = segments[e >> _OFF_BITS]
                freed += seg.row_bytes * n
                seg.live -= n
                if not seg.live:
                    emptied.append(e >> _OFF_BITS)
                continue
            for e in entries:
                if e is None:
                    continue
                if isinstance(e, _Obj):
                    freed += e.nbytes
                    continue
                seg = segments[e >> _OFF_BITS]
                freed += seg.row_bytes
                seg.live -= 1
                if not seg.live:
                    emptied.append(e >> _OFF_BITS)
        self.nbytes -= freed
        for sid in emptied:
            self._dead(sid, segments.pop(sid))
        for f in [f for f, st in self.columns.items() if not st and f not in self._run_fields]:
            del self.columns[f]
        while len(self._gone) > _GONE_MAX:
            self._gone.popitem(last=False)
        return n, before - self.nbytes

    def delete_fields(self, rows: Sequence[int], fields: Sequence[str], write: int = 0) -> int:
        """Forget ``fields`` of ``rows`` (what a failed write stored); the rows and their
        other fields stay. Returns bytes freed.

        With ``write`` (the failed write's id), only entries that write stored are
        forgotten, and its data is dropped should it still arrive: the undo of a write
        never deletes what a later write (a retry) stored."""
        if write:
            self._aborted[write] = None
            while len(self._aborted) > _GONE_MAX:
                self._aborted.popitem(last=False)
        self._explode(rows)
        before = self.nbytes
        for f in fields:
            store = self.columns.get(f)
            if store is None:
                continue
            for r in rows:
                e = store.get(r)
                if e is None or (write and self._write_of(e) != write):
                    continue
                del store[r]
                self.nbytes -= self._entry_bytes(e)
                self._release(e)
                self.row_fields[r] -= 1
            if not store and f not in self._run_fields:
                del self.columns[f]
        return before - self.nbytes

    def inventory(self) -> dict[int, list[str]]:
        """Every row held, with the fields held for it (for consistency checks)."""
        out: dict[int, list[str]] = {r: [] for r in self.row_fields}
        for f, store in self.columns.items():
            for r in store:
                out[r].append(f)
        for first in self._starts:
            run = self._by_first[first]
            fields = [f for f in self.columns if f in run.bases]  # (in the columns' order)
            dead = run.dead or ()
            for i in range(run.n):
                if i not in dead:
                    out[first + i] = list(fields)
        return out

    def fields_of(self, rows: Sequence[int]) -> list[str]:
        """Fields held for every one of ``rows``."""
        if self._starts:
            have: set[str] | None = None
            for r in rows:
                run = self._run_of(r)
                if run is not None and (run.dead is None or r - run.first not in run.dead):
                    fs = set(run.bases)
                else:
                    fs = {f for f, st in self.columns.items() if r in st}
                have = fs if have is None else have & fs
            if have is not None:
                return sorted(have)
        return sorted(f for f, st in self.columns.items() if all(r in st for r in rows))

    def only_adds(self, rows: Sequence[int], fields: Sequence[str]) -> bool:
        held = self.row_fields
        columns = self.columns
        stores = [st for st in (columns.get(f) for f in fields) if st is not None]
        for r in rows:
            if r in held:
                for st in stores:
                    if r in st:
                        return False
                continue
            run = self._run_of(r) if self._starts else None  # (a run's rows: its fields)
            if (run is None or (run.dead is not None and r - run.first in run.dead)
                    or not run.bases.keys().isdisjoint(fields)):
                return False
        return True

    def stats(self) -> tuple[int, int]:
        """(rows, bytes) held now."""
        return len(self.row_fields) + self._run_rows, self.nbytes

    # ------------------------------------------------------------------ state

    #: most bytes (tensor runs) or objects in one chunk of :meth:`state_dict`
    STATE_CHUNK_BYTES = 64 << 20
    STATE_CHUNK_OBJECTS = 4096

    def state_dict(self) -> dict[str, Any]:
        """The unit's rows and data (see :meth:`StorageBackend.state_dict`). Chunks
        follow each field's rows kept one by one in the order they were first written,
        then its rows kept as runs, run by run: consecutive rows of one put (at most
        :attr:`STATE_CHUNK_BYTES`) are one chunk, a view of what was put; consecutive
        objects make chunks of up to :attr:`STATE_CHUNK_OBJECTS`. Runs stay runs (a
        checkpoint changes nothing of how the unit keeps its rows).

        Examples:
            >>> import torch
            >>> u = StorageUnit()
            >>> u.put([1, 2], {"x": torch.zeros(2, 3), "chat": ["hi", "yo"]})
            >>> st = u.state_dict()
            >>> st["rows"], st["fields"]
            ([1, 2], {'x': 2, 'chat': 2})
            >>> [(c.field, c.rows) for c in st["chunks"]]
            [('x', [1, 2]), ('chat', [1, 2])]
        """
        runs = [(run, _live_pieces(run)) for run in self._by_first.values()]
        rows = list(self.row_fields)
        fields = {f: len(st) for f, st in self.columns.items()}
        for run, pieces in runs:
            for at, k in pieces:
                rows.extend(range(run.first + at, run.first + at + k))
            for f in run.bases:
                fields[f] = fields.get(f, 0) + run.live
        rows.sort()
        return {"format": STATE_FORMAT, "backend": self.name, "index": self.index,
                "rows": rows, "fields": fields, "bytes": self.nbytes,
                "chunks": self._chunks(runs)}

    def _chunks(self, runs: Sequence[tuple[_Run, list[tuple[int, int]]]]
                ) -> Iterator[StateChunk]:
        """Field by field: the chunks of the rows kept one by one, then those of ``runs``
        (each with its live rows: :func:`_live_pieces`); the order in which turning the
        runs into entries per row would list them."""
        for f in list(self.columns):
            store = self.columns.get(f)
            if store is None:  # (the unit changed under the iterator)
                continue
            yield from self._entry_chunks(f, list(store.items()))
            for run, pieces in runs:
                base = run.bases.get(f)
                if base is None:
                    continue
                seg = self.segments[base >> _OFF_BITS]
                most = (max(1, self.STATE_CHUNK_BYTES // seg.row_bytes) if seg.row_bytes
                        else run.n)
                for at, k in pieces:
                    while k > 0:
                        m = min(k, most)
                        yield self._chunk(f, list(range(run.first + at, run.first + at + m)),
                                          seg, (base & _OFF_MASK) + at)
                        at += m
                        k -= m

    def _chunk(self, f: str, rows: list[int], seg: _Segment, off: int) -> StateChunk:
        """The chunk of ``rows`` (field ``f``), rows ``off..`` of segment ``seg``."""
        data = self._rows(seg, off, len(rows))
        inlined = getattr(data, "inlined", None)  # a WireTensor: bytes, not a block
        return StateChunk(f, rows, inlined() if inlined is not None else data, seg.write)

    def _entry_chunks(self, f: str, items: list[tuple[int, int | _Obj]]
                      ) -> Iterator[StateChunk]:
        """The chunks of field ``f`` of the rows kept one by one (``items``: row, entry)."""
        i, n = 0, len(items)
        while i < n:
            r, e = items[i]
            if isinstance(e, _Obj):
                objs = [e]
                j = i + 1
                while j < n and j - i < self.STATE_CHUNK_OBJECTS:
                    o = items[j][1]
                    if not isinstance(o, _Obj) or o.write != e.write:
                        break
                    objs.append(o)
                    j += 1
                yield StateChunk(f, [x[0] for x in items[i:j]], [o.value for o in objs],
                                 e.write)
                i = j
                continue
            seg = self.segments[e >> _OFF_BITS]
            most = max(1, self.STATE_CHUNK_BYTES // seg.row_bytes) if seg.row_bytes else n
            j = i + 1
            while (j < n and j - i < most and not isinstance(items[j][1], _Obj)
                   and items[j][1] == e + (j - i)):
                j += 1
            yield self._chunk(f, [x[0] for x in items[i:j]], seg, e & _OFF_MASK)
            i = j

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Fill this empty unit from a :meth:`state_dict` of any backend (see
        :meth:`StorageBackend.load_state_dict`). Tensors are stored as given (no copy)."""
        for c in load_chunks(self, state):
            self.put(c.rows, {c.field: c.data})
        for r in state.get("rows", ()):
            if self._run_of(r) is None:
                self.row_fields.setdefault(r, 0)  # rows held with no field


def _live_pieces(run: _Run) -> list[tuple[int, int]]:
    """``run``'s rows not deleted, as ``(offset, count)`` stretches of consecutive rows."""
    dead = run.dead
    if not dead:
        return [(0, run.n)]
    out: list[tuple[int, int]] = []
    at = None
    for i in range(run.n + 1):
        if i < run.n and i not in dead:
            if at is None:
                at = i
        elif at is not None:
            out.append((at, i - at))
            at = None
    return out


def _consecutive(rows: Sequence[int]) -> bool:
    """Whether ``rows`` (not empty) are consecutive ids in increasing order."""
    n = len(rows)
    first = rows[0]
    if rows[-1] - first != n - 1:
        return False
    if n > 2:
        seq = rows if type(rows) is list else list(rows)
        return seq == list(range(first, first + n))
    return True


def create(index: int = 0, *, on_release: Callable[[Any], None] | None = None) -> StorageUnit:
    """The registered factory of ``storage="memory"`` (it takes no options)."""
    return StorageUnit(index, on_release=on_release)
