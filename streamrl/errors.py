"""The exceptions streamrl raises.

Every exception is a :class:`StreamRLError`; most also subclass the builtin they refine
(``ValueError``, ``TimeoutError``, ...) so generic handlers keep working. Each message says
what was wrong and what to do about it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "StreamRLError",
    "QueueFull",
    "QueueClosed",
    "EndOfStream",
    "StreamTimeout",
    "RowsDropped",
    "RowsLost",
    "SchemaError",
    "UnknownField",
    "DuplicateField",
    "InvalidArgument",
    "EncodeError",
    "LeaseExpired",
    "FilterError",
    "DispatchError",
    "TransportError",
    "EventLoopError",
    "CheckpointError",
    "NotSupported",
]


def _preview(rows: Iterable[int], limit: int = 8) -> str:
    rows = list(rows)
    head = ", ".join(str(r) for r in rows[:limit])
    more = f", ... ({len(rows)} rows)" if len(rows) > limit else ""
    return f"[{head}{more}]"


class StreamRLError(Exception):
    """Base class of every streamrl error."""


class QueueFull(StreamRLError):
    """``put_nowait`` found no room; or a single put can never fit the capacity."""


class QueueClosed(StreamRLError):
    """The queue (or its controller) is closed; no further puts or waits are possible."""


class EndOfStream(StreamRLError):
    """``get`` found nothing more to deliver: the partition is sealed and drained, or the
    queue is closed. ``stream`` iterators end instead of raising this."""


class StreamTimeout(StreamRLError, TimeoutError):
    """A wait (``put`` on a full queue, ``get``, the next batch of ``stream``) passed its
    ``timeout``."""


class RowsDropped(StreamRLError):
    """The rows were dropped (by ``drop``, ``clear``, a filter, staleness or consumer-set
    cleanup) and can no longer be read or written."""

    def __init__(self, message: str, rows: Iterable[int] = ()):
        super().__init__(message)
        self.rows = list(rows)


class RowsLost(StreamRLError):
    """The storage unit that held the rows is gone (its process died), or (RDT) the
    process that held some of their tensor fields is; that data is lost. ``.rows`` names
    the rows, ``.unit`` the storage unit or ``.holder`` the holding process."""

    def __init__(self, message: str, rows: Iterable[int] = (), unit: int | None = None,
                 holder: str | None = None):
        super().__init__(message)
        self.rows = list(rows)
        self.unit = unit
        self.holder = holder


class SchemaError(StreamRLError, ValueError):
    """The data does not have the shape the operation needs (batch sizes, lengths, dtypes)."""


class UnknownField(SchemaError, KeyError):
    """``materialize``/``select`` asked for a field that the batch's rows do not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateField(SchemaError):
    """A field was written twice to the same rows without ``overwrite=True``."""


class InvalidArgument(StreamRLError, ValueError):
    """An argument has a value the operation cannot use (a non-positive batch size, ...)."""


class EncodeError(StreamRLError, TypeError):
    """The codec could not encode or decode a value."""


class LeaseExpired(StreamRLError):
    """``ack`` of a batch whose lease had already expired or been released; its rows were
    (or will be) delivered again to the task.

    Attributes:
        rows: the rows of the batch that were *not* acknowledged (they are delivered
            again), or ``None`` for all of them. A batch some of whose rows were taken
            back (a write it needed was undone) acknowledges the others and names these.
    """

    def __init__(self, message: str, rows: Iterable[int] | None = None):
        super().__init__(message)
        self.rows = None if rows is None else list(rows)


class FilterError(StreamRLError):
    """A filter function raised or returned something invalid. The rows it was judging
    were dropped (counted under ``stats().filter_errors``) so nothing is left in limbo."""


class DispatchError(StreamRLError):
    """Data-parallel dispatch could not give every rank an equal, non-empty share."""


class TransportError(StreamRLError):
    """The controller or a storage unit could not be reached (for example its actor died)."""


class EventLoopError(StreamRLError, RuntimeError):
    """A blocking call of :mod:`streamrl.sync` that the event loop it needs cannot serve:
    it was made from inside that loop (it would wait for the loop it blocks: a deadlock),
    or that loop is not running, or stopped while the call waited (nothing would ever
    answer it). Use the async API inside the loop; keep the loop running while threads
    use the queue through :meth:`streamrl.sync.StreamQueue.wrap`."""


class CheckpointError(StreamRLError, ValueError):
    """A saved state cannot be loaded: it is not a streamrl state, its format version is
    unknown or newer than this streamrl reads, or it does not fit the controller it is
    loaded into (for example rows on a storage unit the queue does not have)."""


class NotSupported(StreamRLError, NotImplementedError):
    """The call exists for compatibility (for example in :mod:`streamrl.compat`) but what
    it needs is not built yet; the message says when it arrives and what to do meanwhile."""


def rows_preview(rows: Iterable[int]) -> str:
    """Short text for a list of row ids, used in error messages."""
    return _preview(rows)
