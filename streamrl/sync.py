"""The blocking twin of :class:`streamrl.StreamQueue`, for threads and synchronous code.

:class:`StreamQueue` here has the same methods as the async queue, blocking. It runs the
async queue on one dedicated event-loop thread (an anyio blocking portal, on uvloop when
installed); every call is handed to that thread, so one queue is safe to use from many
threads at once. Batches it returns (:class:`SyncBatch`) have blocking ``materialize``,
``write``, ``ack``, ``release`` and ``drop``; ``stream`` returns a plain iterator that is
also a context manager, with the same acknowledgement rules as the async stream.

Examples:
    >>> import torch
    >>> from streamrl.sync import StreamQueue
    >>> with StreamQueue(capacity=16) as q:
    ...     rows = q.put({"x": torch.arange(4)}, partition="p")
    ...     q.seal("p")
    ...     [b.materialize()["x"].tolist() for b in q.stream("t", ["x"], batch_size=2, partition="p")]
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from . import queue as _aq
from .batch import RowRemoteBatch
from .errors import QueueClosed

__all__ = ["StreamQueue", "SyncStream", "SyncBatch"]


def _backend_options() -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


class _Portal:
    """A started blocking portal and the context manager that stops it."""

    def __init__(self):
        self._cm = start_blocking_portal("asyncio", _backend_options())
        self.portal: BlockingPortal = self._cm.__enter__()
        self.thread_ident: int | None = None
        self.portal.call(self._note_thread)
        self._lock = threading.Lock()
        self._stopped = False

    def _note_thread(self) -> None:
        self.thread_ident = threading.get_ident()

    def call(self, fn: Callable, *args, **kwargs):
        if self._stopped:
            raise QueueClosed("this blocking queue was shut down; create a new one")
        if threading.get_ident() == self.thread_ident:
            raise RuntimeError("a blocking streamrl call was made from the queue's own event "
                               "loop thread; use the async StreamQueue there")
        return self.portal.call(functools.partial(fn, *args, **kwargs))

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._cm.__exit__(None, None, None)


class SyncBatch:
    """Blocking wrapper of a :class:`~streamrl.RowRemoteBatch`. Views (indexing,
    ``select``, ``split``...) are wrapped too; ``.remote`` is the async batch."""

    __slots__ = ("remote", "_portal")

    def __init__(self, remote: RowRemoteBatch, portal: _Portal):
        self.remote = remote
        self._portal = portal

    def __len__(self) -> int:
        return len(self.remote)

    def __repr__(self) -> str:
        return f"Sync{self.remote!r}"

    def __getattr__(self, name: str):
        attr = getattr(self.remote, name)
        if callable(attr):
            @functools.wraps(attr)
            def wrapped(*args, **kwargs):
                out = attr(*args, **kwargs)
                return _wrap(out, self._portal)
            return wrapped
        return attr

    def __getitem__(self, idx):
        return _wrap(self.remote[idx], self._portal)

    def materialize(self, fields: Sequence[str] | str | None = None, *, copy: bool = False):
        """Blocking :meth:`RowRemoteBatch.materialize`."""
        return self._portal.call(self.remote.materialize, fields, copy=copy)

    def write(self, data, *, overwrite: bool = False) -> "SyncBatch":
        """Blocking :meth:`RowRemoteBatch.write`."""
        self._portal.call(self.remote.write, data, overwrite=overwrite)
        return self

    def ack(self) -> None:
        """Blocking :meth:`RowRemoteBatch.ack`."""
        self._portal.call(self.remote.ack)

    def release(self) -> None:
        """Blocking :meth:`RowRemoteBatch.release`."""
        self._portal.call(self.remote.release)

    def drop(self) -> None:
        """Blocking :meth:`RowRemoteBatch.drop`."""
        self._portal.call(self.remote.drop)

    @staticmethod
    def concat(batches: Sequence["SyncBatch"]) -> "SyncBatch":
        """:meth:`RowRemoteBatch.concat` of blocking batches."""
        return SyncBatch(RowRemoteBatch.concat([b.remote for b in batches]), batches[0]._portal)


class _SyncColumn:
    __slots__ = ("remote", "_portal")

    def __init__(self, remote, portal: _Portal):
        self.remote = remote
        self._portal = portal

    def __len__(self) -> int:
        return len(self.remote)

    def __getitem__(self, idx):
        return _SyncColumn(self.remote[idx], self._portal)

    def materialize(self, *, copy: bool = False):
        return self._portal.call(self.remote.materialize, copy=copy)


def _wrap(out, portal: _Portal):
    from .batch import ColumnRemoteBatch

    if isinstance(out, RowRemoteBatch):
        return SyncBatch(out, portal)
    if isinstance(out, ColumnRemoteBatch):
        return _SyncColumn(out, portal)
    if isinstance(out, list) and out and isinstance(out[0], RowRemoteBatch):
        return [SyncBatch(b, portal) for b in out]
    return out


class SyncStream:
    """Blocking iterator over a stream (and a context manager: leaving the ``with``
    block without an exception acknowledges the current batch, with one releases it)."""

    def __init__(self, stream: _aq.Stream, portal: _Portal):
        stream.watch_task = False  # each blocking call runs as a task of its own
        self._stream = stream
        self._portal = portal

    def __iter__(self) -> Iterator[SyncBatch]:
        return self

    def __next__(self) -> SyncBatch:
        try:
            return SyncBatch(self._portal.call(self._stream.__anext__), self._portal)
        except StopAsyncIteration:
            raise StopIteration from None

    def __enter__(self) -> "SyncStream":
        return self

    def __exit__(self, et, e, tb) -> None:
        self._portal.call(self._stream.__aexit__, et, e, tb)

    def close(self) -> None:
        """Release the current batch and stop."""
        self._portal.call(self._stream.aclose)

    def __del__(self) -> None:
        cur = getattr(self._stream, "_current", None)
        if cur is not None and cur.leased:
            try:
                self._portal.portal.start_task_soon(self._stream.aclose)
            except Exception:
                pass


class StreamQueue:
    """Blocking :class:`streamrl.StreamQueue` (same arguments, same method names).

    Wrap an existing async queue with :meth:`wrap` (for example a Ray queue handle received
    in a synchronous actor).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        self._portal = _Portal()
        try:
            self._q: _aq.StreamQueue = self._portal.call(_make_queue, args, kwargs)
        except BaseException:
            self._portal.stop()
            raise
        self._owner = True

    @classmethod
    def wrap(cls, queue: _aq.StreamQueue) -> "StreamQueue":
        """A blocking view of an existing (Ray-transport) async queue. Its calls run on a
        new event-loop thread; the queue itself is not owned (``shutdown`` does not kill
        it)."""
        self = cls.__new__(cls)
        self._portal = _Portal()
        self._q = queue
        self._owner = False
        return self

    @property
    def aqueue(self) -> _aq.StreamQueue:
        """The async queue behind this one."""
        return self._q

    def __reduce__(self):
        return (StreamQueue.wrap, (self._q,))

    def __enter__(self) -> "StreamQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.shutdown()

    def _call(self, name: str, *args, **kwargs):
        return self._portal.call(getattr(self._q, name), *args, **kwargs)

    def put(self, data, partition: str | None = None, rows=None, **kw) -> SyncBatch:
        """Blocking :meth:`streamrl.StreamQueue.put`."""
        if isinstance(rows, SyncBatch):
            rows = rows.remote
        return SyncBatch(self._call("put", data, partition, rows, **kw), self._portal)

    def put_nowait(self, data, partition: str | None = None, **kw) -> SyncBatch:
        """Blocking :meth:`streamrl.StreamQueue.put_nowait`."""
        return SyncBatch(self._call("put_nowait", data, partition, **kw), self._portal)

    def get(self, task: str, fields: Sequence[str], batch_size: int, **kw) -> SyncBatch:
        """Blocking :meth:`streamrl.StreamQueue.get`."""
        return SyncBatch(self._call("get", task, fields, batch_size, **kw), self._portal)

    def stream(self, task: str, fields: Sequence[str], batch_size: int, **kw) -> SyncStream:
        """:meth:`streamrl.StreamQueue.stream` as a plain iterator."""
        return SyncStream(self._q.stream(task, fields, batch_size, **kw), self._portal)

    def drop(self, rows) -> int:
        """Blocking :meth:`streamrl.StreamQueue.drop`."""
        if isinstance(rows, SyncBatch):
            rows = rows.remote
        return self._call("drop", rows)

    def clear(self, partition: str) -> int:
        """Blocking :meth:`streamrl.StreamQueue.clear`."""
        return self._call("clear", partition)

    def seal(self, partition: str | None = None) -> None:
        """Blocking :meth:`streamrl.StreamQueue.seal`."""
        self._call("seal", partition)

    def declare(self, partition: str, consumers) -> None:
        """Blocking :meth:`streamrl.StreamQueue.declare`."""
        self._call("declare", partition, consumers)

    def set_version(self, version: int) -> int:
        """Blocking :meth:`streamrl.StreamQueue.set_version`."""
        return self._call("set_version", version)

    def wait_version(self, version: int, *, timeout: float | None = None) -> int:
        """Blocking :meth:`streamrl.StreamQueue.wait_version`."""
        return self._call("wait_version", version, timeout=timeout)

    def add_filter(self, fn: Callable, **kw) -> str:
        """Blocking :meth:`streamrl.StreamQueue.add_filter`."""
        return self._call("add_filter", fn, **kw)

    def stats(self):
        """Blocking :meth:`streamrl.StreamQueue.stats`."""
        return self._call("stats")

    def leaked(self) -> int:
        """Blocking :meth:`streamrl.StreamQueue.leaked`."""
        return self._call("leaked")

    def close(self) -> dict[str, int]:
        """Close the queue (idempotent)."""
        if self._portal._stopped:
            return {}
        return self._call("close")

    def shutdown(self) -> None:
        """Free the queue's deployment (if this object created it) and stop the
        event-loop thread. Idempotent."""
        if self._portal._stopped:
            return
        try:
            if self._owner:
                self._call("shutdown")
        finally:
            self._portal.stop()

    def __del__(self) -> None:
        try:
            self._portal.stop()
        except Exception:
            pass


async def _make_queue(args, kwargs) -> _aq.StreamQueue:
    return _aq.StreamQueue(*args, **kwargs)
