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

import asyncio
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import queue as _aq
from .batch import RowRemoteBatch
from .errors import EventLoopError, InvalidArgument, QueueClosed

__all__ = ["StreamQueue", "SyncStream", "SyncBatch"]

#: how often (seconds) a caller waiting on a loop it does not own checks that it still runs
_POLL = 0.25
#: seconds ``shutdown`` lets calls that ``close`` woke finish before cancelling them
_GRACE = 5.0
#: seconds ``shutdown`` waits for its event-loop thread to end
_JOIN = 10.0

#: the loop that owns an in-process queue, keyed by its transport (filled by this module)
_owners: "weakref.WeakKeyDictionary[Any, asyncio.AbstractEventLoop]" = weakref.WeakKeyDictionary()


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Call:
    """One blocking call in flight: the hand-off between the loop, which finishes it, and
    the caller, which may give up on it (interrupted, or the blocking queue shut down).
    Whichever comes first wins, under ``lock``; a result nobody will receive is given back
    (a leased batch is released)."""

    __slots__ = ("lock", "state", "ready", "value", "error")

    def __init__(self):
        self.lock = threading.Lock()
        self.state = "pending"  # -> "done" | "abandoned"
        self.ready = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def settle(self, state: str) -> bool:
        with self.lock:
            if self.state != "pending":
                return False
            self.state = state
            return True


async def _serve(fn: Callable, args: tuple, kwargs: dict, call: _Call) -> None:
    """Run ``fn`` on the loop and hand its outcome to the blocking caller."""
    try:
        out = fn(*args, **kwargs)
        if inspect.isawaitable(out):
            out = await out
    except BaseException as e:
        if call.settle("done"):
            call.error = e
            call.ready.set()
        if not isinstance(e, Exception):
            raise
        return
    if call.settle("done"):
        call.value = out
        call.ready.set()
    else:  # the caller gave up: nobody will ack this batch, give it back now
        await _give_back(out)


async def _give_back(out: Any) -> None:
    if isinstance(out, RowRemoteBatch) and out.leased:
        try:
            await asyncio.shield(asyncio.ensure_future(out.release()))
        except BaseException:  # the loop is going away: the lease timeout applies
            pass


class _Runner:
    """Runs a queue's coroutines on the event loop that owns the queue, for blocking
    callers in any thread.

    Either a loop of its own on a daemon thread (:meth:`start`), or the loop of an
    embedded queue that its user runs (:meth:`foreign`), known at once or found when first
    needed. Every call is checked first: from inside the loop it needs, or while that loop
    is not running, it raises :class:`~streamrl.errors.EventLoopError` instead of hanging.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None, thread: threading.Thread | None,
                 resolve: Callable[[], asyncio.AbstractEventLoop | None] | None, what: str):
        self._loop = loop
        self._thread = thread
        self._resolve = resolve
        self.what = what
        self.thread_ident: int | None = None
        self.accepting = True  # false once shutdown began: only its own calls go through
        self.stopped = False  # calls in flight were given up; nothing goes through
        self._lock = threading.Lock()
        self._inflight: dict[Any, tuple[_Call, Any]] = {}

    @classmethod
    def start(cls) -> "_Runner":
        """A new event loop (uvloop when installed) on a daemon thread of its own."""
        loop = _new_loop()
        self = cls(loop, None, None, "this blocking queue's own event loop thread")
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), daemon=True,
                                        name="streamrl-sync-loop")
        self._thread.start()
        ready.wait()
        return self

    @classmethod
    def foreign(cls, loop: asyncio.AbstractEventLoop | None,
                resolve: Callable[[], asyncio.AbstractEventLoop | None]) -> "_Runner":
        """The loop that runs an embedded queue (``None``: ask ``resolve`` when needed)."""
        return cls(loop, None, resolve, "the event loop that owns this embedded queue")

    @property
    def owns_loop(self) -> bool:
        return self._thread is not None

    def _main(self, ready: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        self.thread_ident = threading.get_ident()
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
            # what is still running is cancelled and may unwind (a cancelled put undoes)
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
            self.abandon_all()  # nothing is left to answer them

    # ------------------------------------------------------------------ calls

    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the calls go to."""
        loop = self._loop
        if loop is None:
            loop = self._resolve() if self._resolve is not None else None
            if loop is None:
                raise EventLoopError(
                    "this embedded queue has not run in any event loop yet, so the blocking "
                    "wrapper cannot tell which loop owns it (an embedded queue lives in one "
                    "loop). Call StreamQueue.wrap(q) from a coroutine running in that loop, "
                    "pass wrap(q, loop=...), or use the queue once there first; or create a "
                    "streamrl.sync.StreamQueue(...), which runs a loop of its own")
            self._loop = loop
        return loop

    def check(self, internal: bool = False) -> asyncio.AbstractEventLoop:
        """The loop, if a blocking call may wait for it from this thread now."""
        if self.stopped or not (self.accepting or internal):
            raise QueueClosed("this blocking queue was shut down; create a new one (or wrap "
                              "the async queue again)")
        loop = self.loop()
        if _running_loop() is loop or threading.get_ident() == self.thread_ident:
            raise EventLoopError(
                f"a blocking streamrl call was made from inside {self.what}, the loop that "
                "must run it: it would wait for that loop, which cannot run while the call "
                "blocks it (a deadlock). Use the async API there: await the async queue's "
                "method (blocking_queue.aqueue), or a batch's (blocking_batch.remote)")
        if not loop.is_running():
            state = "closed" if loop.is_closed() else "not running"
            raise EventLoopError(
                f"{self.what} is {state}, so nothing would answer this blocking call (it would "
                "hang). Make blocking calls while that loop runs (for example while "
                "asyncio.run(...) has not returned), or use a streamrl.sync.StreamQueue(...), "
                "which runs a loop of its own")
        return loop

    def call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a coroutine function, or a plain one) on the loop
        and block until it is done; its result is returned, its exception raised."""
        return self._call(self.check(), fn, args, kwargs, False)

    def call_internal(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` for shutdown's own calls, once it stopped taking others."""
        return self._call(self.check(True), fn, args, kwargs, True)

    def _call(self, loop: asyncio.AbstractEventLoop, fn: Callable, args: tuple,
              kwargs: dict, internal: bool) -> Any:
        call = _Call()
        coro = _serve(fn, args, kwargs, call)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed meanwhile
            coro.close()
            raise EventLoopError(f"{self.what} closed; nothing can answer this call") from None
        fut.add_done_callback(lambda _: call.ready.set())  # cancelled before it started
        key = object()
        with self._lock:
            self._inflight[key] = (call, fut)
            late = self.stopped or not (self.accepting or internal)
        try:
            if late and call.settle("abandoned"):  # shut down as we came in
                fut.cancel()
            poll = None if self.owns_loop else _POLL
            while not call.ready.wait(poll):
                if not loop.is_running() and call.settle("abandoned"):
                    fut.cancel()
                    raise EventLoopError(
                        f"{self.what} stopped while this blocking call waited for it; the "
                        "call was cancelled (keep the loop running while threads use the queue)")
        except BaseException:  # interrupted (KeyboardInterrupt...): give the call up
            if call.settle("abandoned"):
                fut.cancel()
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)
        if call.state == "abandoned":
            raise QueueClosed("this blocking queue was shut down while the call waited; "
                              "create a new one (or wrap the async queue again)")
        if isinstance(call.error, asyncio.CancelledError) or (
                call.state == "pending" and fut.cancelled()):
            raise EventLoopError(
                f"{self.what} cancelled this blocking call: it is shutting down (for example "
                "asyncio.run(...) returned); keep the loop running while threads use the queue")
        if call.error is not None:
            err, call.error = call.error, None
            raise err
        return call.value

    def submit(self, fn: Callable, *args: Any) -> None:
        """Start ``fn(*args)`` on the loop without waiting (from finalizers); best effort."""
        loop = self._loop
        if loop is None or self.stopped or loop.is_closed():
            return
        try:
            fut = asyncio.run_coroutine_threadsafe(_serve(fn, args, {}, _Call()), loop)
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        except RuntimeError:
            pass

    # ------------------------------------------------------------------ stopping

    def wait_idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the calls in flight to finish."""
        with self._lock:
            calls = [c for c, _ in self._inflight.values()]
        for c in calls:
            if not c.ready.wait(timeout):
                return

    def abandon_all(self) -> None:
        """Give up every call in flight: their callers raise QueueClosed at once, and the
        calls are cancelled on the loop (a put undoes itself, a batch is released)."""
        with self._lock:
            self.accepting = False
            self.stopped = True
            inflight = list(self._inflight.values())
        for call, fut in inflight:
            if call.settle("abandoned"):
                fut.cancel()

    def stop(self, *, wait: bool = True) -> None:
        """Stop taking calls, give up those in flight and, for a loop of our own, stop the
        loop (its leftover tasks are cancelled) and its thread. Idempotent."""
        self.abandon_all()
        thread = self._thread
        if thread is None:
            return
        loop = self._loop
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # already closed
            pass
        if wait and threading.current_thread() is not thread:
            thread.join(_JOIN)


def _bound_loop(queue: _aq.StreamQueue) -> asyncio.AbstractEventLoop | None:
    """The loop that owns an in-process queue, if known: recorded here, or by its control
    plane when first used (the embedded ControllerService keeps it as ``_loop``)."""
    transport = queue._transport
    loop = _owners.get(transport)
    if loop is None:
        loop = getattr(transport.control, "_loop", None)
    return loop


def _any_loop(queue: _aq.StreamQueue) -> bool:
    """Whether the queue may be used from any event loop: a transport that hands out a
    handle (Ray) keeps its connections per loop; an in-process one (embedded) has its
    waiters in the one loop that runs it."""
    return queue._transport.handle is not None


class SyncBatch:
    """Blocking wrapper of a :class:`~streamrl.RowRemoteBatch`. Views (indexing,
    ``select``, ``split``...) are wrapped too; ``.remote`` is the async batch."""

    __slots__ = ("remote", "_runner")

    def __init__(self, remote: RowRemoteBatch, runner: _Runner):
        self.remote = remote
        self._runner = runner

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
                return _wrap(out, self._runner)
            return wrapped
        return attr

    def __getitem__(self, idx):
        return _wrap(self.remote[idx], self._runner)

    def materialize(self, fields: Sequence[str] | str | None = None, *, copy: bool = False):
        """Blocking :meth:`RowRemoteBatch.materialize`."""
        return self._runner.call(self.remote.materialize, fields, copy=copy)

    def write(self, data, *, overwrite: bool = False) -> "SyncBatch":
        """Blocking :meth:`RowRemoteBatch.write`."""
        self._runner.call(self.remote.write, data, overwrite=overwrite)
        return self

    def ack(self) -> None:
        """Blocking :meth:`RowRemoteBatch.ack`."""
        self._runner.call(self.remote.ack)

    def release(self) -> None:
        """Blocking :meth:`RowRemoteBatch.release`."""
        self._runner.call(self.remote.release)

    def drop(self) -> None:
        """Blocking :meth:`RowRemoteBatch.drop`."""
        self._runner.call(self.remote.drop)

    @staticmethod
    def concat(batches: Sequence["SyncBatch"]) -> "SyncBatch":
        """:meth:`RowRemoteBatch.concat` of blocking batches."""
        return SyncBatch(RowRemoteBatch.concat([b.remote for b in batches]), batches[0]._runner)


class _SyncColumn:
    __slots__ = ("remote", "_runner")

    def __init__(self, remote, runner: _Runner):
        self.remote = remote
        self._runner = runner

    def __len__(self) -> int:
        return len(self.remote)

    def __getitem__(self, idx):
        return _SyncColumn(self.remote[idx], self._runner)

    def materialize(self, *, copy: bool = False):
        return self._runner.call(self.remote.materialize, copy=copy)


def _wrap(out, runner: _Runner):
    from .batch import ColumnRemoteBatch

    if isinstance(out, RowRemoteBatch):
        return SyncBatch(out, runner)
    if isinstance(out, ColumnRemoteBatch):
        return _SyncColumn(out, runner)
    if isinstance(out, list) and out and isinstance(out[0], RowRemoteBatch):
        return [SyncBatch(b, runner) for b in out]
    return out


class SyncStream:
    """Blocking iterator over a stream (and a context manager: leaving the ``with``
    block without an exception acknowledges the current batch, with one releases it)."""

    def __init__(self, stream: _aq.Stream, runner: _Runner):
        self._stream = stream
        self._runner = runner

    def __iter__(self) -> Iterator[SyncBatch]:
        return self

    def __next__(self) -> SyncBatch:
        try:
            return SyncBatch(self._runner.call(self._stream.__anext__), self._runner)
        except StopAsyncIteration:
            raise StopIteration from None

    def __enter__(self) -> "SyncStream":
        return self

    def __exit__(self, et, e, tb) -> None:
        self._runner.call(self._stream.__aexit__, et, e, tb)

    def close(self) -> None:
        """Release the current batch and stop."""
        self._runner.call(self._stream.aclose)

    def __del__(self) -> None:
        cur = getattr(self._stream, "_current", None)
        if cur is not None and cur.leased:
            try:
                self._runner.submit(self._stream.aclose)
            except Exception:
                pass


class StreamQueue:
    """Blocking :class:`streamrl.StreamQueue` (same arguments, same method names).

    Wrap an existing async queue with :meth:`wrap` (for example a Ray queue handle received
    in a synchronous actor, or an embedded queue whose loop runs producers while threads
    consume).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        runner = _Runner.start()
        try:
            queue = runner.call(_aq.StreamQueue, *args, **kwargs)
        except BaseException:
            runner.stop()
            raise
        self._adopt(queue, runner, owns=True)

    def _adopt(self, queue: _aq.StreamQueue, runner: _Runner, *, owns: bool) -> None:
        self._q = queue
        self._runner = runner
        #: close and shut down the queue at shutdown (this object created it)
        self._owner = owns
        if runner.owns_loop and not _any_loop(queue):
            _owners[queue._transport] = runner.loop()

    @classmethod
    def wrap(cls, queue: _aq.StreamQueue, *,
             loop: asyncio.AbstractEventLoop | None = None) -> "StreamQueue":
        """A blocking view of an existing async queue, usable from any thread. The queue
        is not owned: :meth:`shutdown` stops this view (and wakes its blocked callers with
        :class:`~streamrl.errors.QueueClosed`) but leaves the queue open and running.

        * A queue usable from any event loop (``transport="ray"``) gets an event-loop
          thread of its own for this view.
        * An embedded queue lives in one event loop (its waiters belong to it), so every
          call of the view is handed to that loop and waits for it there: a producer
          coroutine in that loop and consumer threads through the view wake each other as
          they should. The loop is the one given as ``loop``, else the one that already
          used the queue, else the one running where ``wrap`` is called (call it from a
          coroutine of that loop). That loop must keep running while the view is used: a
          blocking call while it is not running, or from inside it, raises
          :class:`~streamrl.errors.EventLoopError` instead of hanging.
        """
        if not isinstance(queue, _aq.StreamQueue):
            raise InvalidArgument(f"wrap takes an async streamrl.StreamQueue, got "
                                  f"{type(queue).__name__}")
        self = cls.__new__(cls)
        if _any_loop(queue):
            runner = _Runner.start()
        else:
            loop = loop or _bound_loop(queue) or _running_loop()
            if loop is not None:
                _owners.setdefault(queue._transport, loop)
            runner = _Runner.foreign(loop, lambda: _bound_loop(queue))
        self._adopt(queue, runner, owns=False)
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
        return self._runner.call(getattr(self._q, name), *args, **kwargs)

    def put(self, data, partition: str | None = None, rows=None, **kw) -> SyncBatch:
        """Blocking :meth:`streamrl.StreamQueue.put`."""
        if isinstance(rows, SyncBatch):
            rows = rows.remote
        return SyncBatch(self._call("put", data, partition, rows, **kw), self._runner)

    def put_nowait(self, data, partition: str | None = None, **kw) -> SyncBatch:
        """Blocking :meth:`streamrl.StreamQueue.put_nowait`."""
        return SyncBatch(self._call("put_nowait", data, partition, **kw), self._runner)

    def get(self, task: str, fields: Sequence[str], batch_size: int, **kw) -> SyncBatch:
        """Blocking :meth:`streamrl.StreamQueue.get`."""
        return SyncBatch(self._call("get", task, fields, batch_size, **kw), self._runner)

    def stream(self, task: str, fields: Sequence[str], batch_size: int, **kw) -> SyncStream:
        """:meth:`streamrl.StreamQueue.stream` as a plain iterator."""
        return SyncStream(self._q.stream(task, fields, batch_size, **kw), self._runner)

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
        """Close the queue (idempotent; a no-op after :meth:`shutdown`)."""
        if not self._runner.accepting:
            return {}
        return self._call("close")

    def shutdown(self) -> None:
        """Stop this blocking queue and wake every thread blocked in it; idempotent.

        For a queue this object created, the queue is closed first, so blocked callers
        wake as :meth:`close` wakes them (``get``: :class:`~streamrl.errors.EndOfStream`,
        ``put``/``wait_version``: :class:`~streamrl.errors.QueueClosed`, ``stream``
        iterators end), then its deployment is freed (Ray: its actors killed). A wrapped
        queue (:meth:`wrap`) is left open and running for its other users. Calls still
        blocked after that (all of them, for a wrapped queue) are cancelled and raise
        :class:`~streamrl.errors.QueueClosed`; later calls raise it too. The event-loop
        thread of this object, if it has one, ends.
        """
        runner = self._runner
        if not runner.accepting:
            return
        if self._owner:
            runner.check()  # not from inside the loop: it would wait for itself
        with runner._lock:
            if not runner.accepting:
                return
            runner.accepting = False
        try:
            if self._owner:
                try:
                    runner.call_internal(self._q.close)
                finally:
                    runner.wait_idle(_GRACE)
                    runner.call_internal(self._q.shutdown)
        finally:
            runner.stop()

    def __del__(self) -> None:
        try:
            runner = self._runner
        except AttributeError:  # __init__ failed
            return
        if runner.owns_loop:
            runner.stop(wait=False)
