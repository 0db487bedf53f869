"""The messages of the control plane: what clients, storage units and the controller
send each other (see :mod:`streamrl.control`). Plain dataclasses and enums, pickled or
packed as they are; nothing here does work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

from .config import Request

__all__ = ["DropReason", "END", "Delivery", "FilterSpec", "FilterJob", "WriteToken", "Undo",
           "CommitResult", "PutStatus", "PutAnswer", "Request"]


class DropReason(str, enum.Enum):
    """Why rows left the queue (the keys of ``stats().dropped_by``; each is a ``str``)."""

    DROPPED = "dropped"  # drop() by a user
    CLEARED = "cleared"  # clear(partition)
    FILTERED = "filtered"  # rejected by a filter
    FILTER_ERROR = "filter_error"  # the filter raised or returned garbage
    STALE = "stale"  # older than the staleness bound
    CONSUMED = "consumed"  # every declared consumer acknowledged it
    DP_REMAINDER = "dp_remainder"  # left over by DP dispatch with dp_remainder="drop"
    LOST = "lost"  # its storage unit died
    CANCELLED = "cancelled"  # the put that created it was cancelled (or failed) after it landed

    def __str__(self) -> str:
        return self.value


class _End(enum.Enum):
    """The type of :data:`END`: an enum of one member, so that ``x is END`` narrows
    ``Delivery | _End | None`` for a type checker (pickles as the same object)."""

    END = "END"

    def __repr__(self) -> str:
        return "END"


#: Returned by :meth:`Controller.take` when the request can never be satisfied again.
END: Final = _End.END


@dataclass
class Delivery:
    """A leased batch handed to a consumer: metadata only."""

    lease: int
    task: str
    rows: list[int]
    shards: list[int]
    versions: list[int]
    fields: tuple[str, ...]  # the fields asked for
    partition: str | None
    dp_rank: int = 0
    dispatch: int | None = None
    known: tuple[str, ...] = ()  # every field written on all rows of the batch
    nbytes: int = 0  # bytes of the asked-for fields of these rows, as put
    #: rows of ``rows`` that repeat rows of other DP shares as padding (not the batch's
    #: own: its ``drop()`` leaves them to the share that holds them)
    pads: tuple[int, ...] = ()


@dataclass(frozen=True)
class FilterSpec:
    """A filter as the controller sees it (the function lives in the service)."""

    name: str
    fields: frozenset[str]
    group_by: str | None = None
    group_size: int | None = None


@dataclass
class FilterJob:
    """A set of rows a filter must judge now."""

    id: int
    filter: str
    rows: list[int]
    shards: list[int]
    fields: tuple[str, ...]


@dataclass
class WriteToken:
    """An admitted write: rows whose ``fields`` are being written to storage. Its
    ``id`` tags the data in storage (see :meth:`StorageUnit.put`)."""

    id: int
    rows: list[int]
    shards: list[int]
    fields: tuple[str, ...]
    reserved_bytes: int = 0
    new_rows: bool = False
    overwrite: bool = False


@dataclass
class Undo:
    """What storage must forget after a write failed (:meth:`Controller.abort`) or was
    taken back (:meth:`Controller.retract`).

    New rows are dropped through :attr:`Controller.deletes` as usual. For a write to
    existing rows, each ``(fields, {shard: rows})`` of :attr:`parts` names what the
    write may have stored and the rows do not hold committed: storage forgets those
    entries *only if this write stored them* (:meth:`StorageUnit.delete_fields` with
    ``write``), and drops the write's data should it still arrive. :attr:`shards` lists
    every unit the write went to: each is told, even with nothing to forget."""

    write: int
    shards: frozenset[int]
    parts: list[tuple[tuple[str, ...], dict[int, list[int]]]]


@dataclass
class CommitResult:
    """What :meth:`Controller.commit` tells the writer."""

    dead: dict[int, list[int]]  # shard -> rows dropped while the write was in flight
    tag_fields: frozenset[str]  # tags kept for the rows written (of their partition)
    missing_tags: dict[str, list[int]]  # tag field -> rows written without that tag


class PutStatus(enum.Enum):
    """The controller's answer to a storage unit that admits a small put itself
    (:meth:`streamrl.control.ControlPlane.put_rows`)."""

    OK = "ok"  #: admitted and committed
    BUSY = "busy"  #: no room now (or others wait): the unit forgets the rows, the
    #: producer puts the usual way
    REFUSED = "refused"  #: never admissible now (closed, sealed, bad dtype): the unit
    #: forgets the rows, the producer raises ``error``
    FAILED = "failed"  #: committed, then failed (a filter raised, the controller is gone)


@dataclass
class PutAnswer:
    """The answer to a unit-admitted small put (or write of new fields, whose ``rows``
    are the rows written): ``rows`` and ``result`` when
    :attr:`status` is ``OK``, ``error`` for ``REFUSED`` and ``FAILED``; ``waited``: the
    put waited for room (:meth:`streamrl.control.ControlPlane.put_rows_wait`)."""

    status: PutStatus
    result: "CommitResult | None" = None
    error: BaseException | None = None
    rows: list[int] = field(default_factory=list)
    waited: bool = False

    def to_wire(self) -> tuple:
        """This answer as a tuple of builtins, for the wire: a small put's answer crosses
        two process boundaries, and pickling the dataclasses and the enum as classes cost
        7 us a time here against under 1 us for the tuple (each class is looked up by
        name, when pickled and when unpickled). :meth:`from_wire` reads it back."""
        r = self.result
        return (self.status.value, self.error, self.rows,
                None if r is None else (r.dead, r.tag_fields, r.missing_tags), self.waited)

    @classmethod
    def from_wire(cls, t: tuple) -> "PutAnswer":
        """The answer :meth:`to_wire` made ``t`` from."""
        status, error, rows, r, waited = t
        return cls(PutStatus(status), None if r is None else CommitResult(*r), error, rows,
                   waited)
