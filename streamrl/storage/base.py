"""The storage-backend interface: what a storage unit is to the transports.

A queue's rows are spread over ``num_shards`` storage units. Each unit is built by
:func:`streamrl.storage.create_unit` from the queue's ``storage=`` option, in the process
that hosts it (the caller's for the embedded transport, a storage-unit actor for Ray), and
is then called by that process only: one call at a time (the Ray actor holds a lock around
each call). Every method is **synchronous**: it waits for nothing but its own work (a
backend that spills to disk reads and writes files inside the call).

What a unit stores, per row and field, is an *entry*: either rows of a **tensor** or a
Python **object**. A column given to :meth:`StorageBackend.put` is

* a tensor whose first dimension counts the rows (stored as one piece shared by those
  rows), or
* a list with one value per row: a Python object, or a per-row tensor (a ragged field;
  stored with a leading dimension of 1 added, see below).

"Tensor" is duck-typed: anything with ``shape``, ``element_size()``, ``numel()``, row
slices ``t[a:b]`` and ``unsqueeze(0)``. That is a ``torch.Tensor`` on the embedded
transport and a :class:`streamrl.wire.WireTensor` in Ray storage-unit actors (which do not
import torch; there Python objects arrive already encoded, as ``bytes``). A backend must
accept both; it gets back what it was given (or equal data, see ``StorageCaps``).

Write ids: the controller tags each write with an id (its write token); ``put`` remembers
it with each entry so that the undo of a failed write (``delete_fields(..., write=id)``)
forgets only what that write stored, never what a retry stored, and data of an aborted
write that arrives late is dropped (``forgotten``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["StorageBackend", "StorageCaps", "StateChunk", "STATE_FORMAT", "Column"]

#: a column as given to ``put``: a tensor (rows first) or a list of per-row values
from .._types import Column

#: the ``"format"`` of :meth:`StorageBackend.state_dict` (bumped when its shape changes)
STATE_FORMAT = "streamrl.storage/1"


@dataclass(frozen=True)
class StorageCaps:
    """What a storage backend does beyond the required calls (declared, never probed).

    Attributes:
        zero_copy_reads: every read returns views of what was put (no copy). ``False``
            when some reads return copies (for example rows read back from disk).
        spills: some tensor data may be held outside memory (on local disk) and read
            back on ``get``.
        persistent: the data outlives the unit's process (none of the built-ins do).
    """

    zero_copy_reads: bool = False
    spills: bool = False
    persistent: bool = False


class StateChunk(NamedTuple):
    """One piece of a unit's data in :meth:`StorageBackend.state_dict`: ``field`` of
    ``rows``, as ``data``, stored by write ``write`` (0: unknown).

    ``data`` is what ``put(rows, {field: data})`` takes back: a tensor whose first
    dimension is ``len(rows)`` (a run of rows of one put; per-row tensors of a ragged
    field come one row per chunk, with their leading dimension of 1), or a list of
    ``len(rows)`` Python objects."""

    field: str
    rows: list[int]
    data: Any
    write: int = 0


class StorageBackend(abc.ABC):
    """One storage unit: holds, per row, the entries of the fields written to it.

    Subclass it (and register a factory with :func:`streamrl.storage.register`) to store
    rows elsewhere. The built-ins are :class:`~streamrl.storage.StorageUnit` (``"memory"``,
    the default) and :class:`~streamrl.storage.SpillUnit` (``"spill"``).

    Every method is synchronous and is called one at a time. ``rows`` are row ids (ints;
    the controller never reuses one); ``fields`` field names.
    """

    #: the registered name of the backend (what ``state_dict()["backend"]`` says)
    name: str = "?"
    #: what this backend does beyond the required calls
    caps: StorageCaps = StorageCaps()
    #: the unit's number among the queue's shards (for messages)
    index: int = 0
    #: called with each tensor that was put, once the unit no longer refers to it (the
    #: Ray transport frees the tensor's shared-memory block then); ``None``: nobody asks
    on_release: Callable[[Any], None] | None = None

    @abc.abstractmethod
    def put(self, rows: Sequence[int], columns: Mapping[str, Column], write: int = 0) -> None:
        """Store ``columns`` (each with ``len(rows)`` rows, see the module docstring) for
        ``rows``; an entry the rows already have for a field is replaced (and released).

        New rows become held by the first ``put`` naming them. ``write`` is the id of the
        write the data belongs to, kept with each entry. When :meth:`forgotten` says so
        the data is dropped instead (nothing is stored).

        Copies: none required; a backend may keep references to the tensors and objects
        it is given (producers must not modify them afterwards)."""

    @abc.abstractmethod
    def get(self, rows: Sequence[int], fields: Sequence[str]) -> dict[str, list[Column]]:
        """Read ``fields`` of ``rows`` (in that order): per field, a list of *pieces*
        that together hold the rows in order. A piece is a tensor of consecutive rows
        (first dimension: rows; rows of one ragged entry keep their leading 1) or a list
        of Python objects. How rows are cut into pieces is the backend's choice.

        Copies: whatever ``caps.zero_copy_reads`` declares; callers treat pieces as
        read-only either way.

        Raises:
            RowsDropped: a row is not held (dropped, or never written); ``.rows`` names
                those rows.
            UnknownField: a held row lacks one of ``fields``.
        """

    @abc.abstractmethod
    def delete(self, rows: Sequence[int]) -> tuple[int, int]:
        """Forget ``rows`` with all their fields; rows not held are skipped, but
        remembered (for a while) as gone, so that data of theirs still on its way is
        dropped (:meth:`forgotten`). Returns ``(rows, bytes)`` freed."""

    @abc.abstractmethod
    def delete_fields(self, rows: Sequence[int], fields: Sequence[str], write: int = 0) -> int:
        """Forget ``fields`` of ``rows`` (what a failed write stored); the rows and their
        other fields stay. With ``write``: only entries that write stored, and the write
        is remembered as aborted (its late data is dropped). Returns bytes freed."""

    @abc.abstractmethod
    def forgotten(self, rows: Sequence[int], write: int = 0) -> bool:
        """Whether data of write ``write`` for ``rows`` is to be dropped on arrival: the
        (new) rows were deleted before it came, or the write was aborted."""

    @abc.abstractmethod
    def inventory(self) -> dict[int, list[str]]:
        """Every row held, with the fields held for it (for consistency checks: not a
        hot path)."""

    @abc.abstractmethod
    def fields_of(self, rows: Sequence[int]) -> list[str]:
        """Fields held for every one of ``rows`` (sorted)."""

    def only_adds(self, rows: Sequence[int], fields: Sequence[str]) -> bool:
        """Whether every one of ``rows`` is held here and none of them holds any of
        ``fields``: a :meth:`put` of those fields to them then adds entries and replaces
        none, so :meth:`delete_fields` with the put's ``write`` takes all of it back.
        A storage unit asks this before it stores a small write of new fields that the
        controller admits only afterwards (see
        :class:`streamrl.transport.ray.admit.UnitAdmission`). ``False`` (the default)
        when the backend cannot tell: such writes then go the usual way."""
        return False

    @abc.abstractmethod
    def stats(self) -> tuple[int, int]:
        """``(rows, bytes)`` held now. Bytes are those of the entries held (tensor bytes,
        and an estimate for objects: :func:`~streamrl.storage.approx_size`), wherever
        they are kept, so they agree with the controller's accounting."""

    def usage(self) -> dict[str, int]:
        """Where the bytes of :meth:`stats` are: at least ``memory`` and ``disk``
        (summing to ``stats()[1]``); backends may add their own counters."""
        return {"memory": self.stats()[1], "disk": 0}

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the unit's data, for checkpoints: a dict of metadata and a lazy
        iterator of the data in chunks, so it can be written out piece by piece::

            {"format": STATE_FORMAT,          # "streamrl.storage/1"
             "backend": "memory",             # the backend that made it
             "index": 0,                      # the unit's shard number
             "rows": [3, 4, 9, ...],          # every row held (also rows with no field)
             "fields": {"x": 3, ...},         # rows held per field
             "bytes": 1234,                   # stats()[1]
             "chunks": <iterator of StateChunk(field, rows, data, write)>}

        Tensors come as the unit holds them (``torch.Tensor`` embedded,
        :class:`~streamrl.wire.WireTensor` with inline bytes in Ray actors), views where
        the backend can; objects as objects (encoded ``bytes`` in Ray actors). The
        iterator reads the unit as it goes: consume it before the unit changes. Any
        backend loads any backend's state (the format is the backend's data, not its
        layout)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Fill this (empty) unit from a :meth:`state_dict` (``chunks`` may be any
        iterable). Write ids are not restored (entries are stored as write 0): they
        belong to the controller that issued them.

        Raises:
            InvalidArgument: the unit holds rows already, or ``state`` is not a storage
                state of a known format.
        """

    def close(self) -> None:
        """Free what the unit holds outside Python objects (files, descriptors); the
        unit is not used afterwards. Idempotent. The default does nothing."""


def load_chunks(unit: StorageBackend, state: Mapping[str, Any]) -> Iterator[StateChunk]:
    """Check ``state`` for :meth:`StorageBackend.load_state_dict` (before the first
    chunk is asked for); its chunks, as :class:`StateChunk` (plain tuples are taken)."""
    from ..errors import InvalidArgument

    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        fmt = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise InvalidArgument(
            f"not a storage-unit state of format {STATE_FORMAT!r} (got {fmt!r}); pass what "
            "a storage unit's state_dict() returned")
    if unit.stats()[0]:
        raise InvalidArgument(
            f"storage unit {unit.index} holds {unit.stats()[0]} rows already; load a state "
            "into a new unit")
    return (c if isinstance(c, StateChunk) else StateChunk(*c)
            for c in state.get("chunks", ()))
