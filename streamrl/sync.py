"""The blocking twin of :class:`streamrl.StreamQueue`, for threads and synchronous code.

:class:`StreamQueue` here has every method and property of the async queue, under the
same name with the same signature and docstring, blocking; so do its batches
(:class:`SyncBatch`, :class:`SyncColumn`) and streams (:class:`SyncStream`: a plain
iterator and context manager with the async stream's acknowledgement rules). One blocking
queue is safe to use from many threads at once.

Examples:
    >>> import torch
    >>> from streamrl.sync import StreamQueue
    >>> with StreamQueue(capacity=16) as q:
    ...     rows = q.put({"x": torch.arange(4)}, partition="p")
    ...     q.seal("p")
    ...     [b.materialize()["x"].tolist() for b in q.stream("t", ["x"], batch_size=2, partition="p")]
    [[0, 1], [2, 3]]

Where calls run:
    Each blocking call is handed to the event loop that owns the async queue and waits
    for it there:

    * ``StreamQueue(...)``, :meth:`StreamQueue.from_config` and
      :meth:`StreamQueue.connect` start an event-loop thread of their own (uvloop when
      installed) that owns the queue;
    * :meth:`StreamQueue.wrap` of a queue usable from any loop (``transport="ray"``, which
      pickles into a handle) starts one too;
    * :meth:`StreamQueue.wrap` of an embedded queue sends every call to the loop that owns
      it (the one that first used it, the one running where ``wrap`` was called, or
      ``loop=``): its waiters live in that loop, so a producer coroutine there and
      consumer threads through the wrapper wake each other at once. That loop must keep
      running while the wrapper is used.

    Plain (non-coroutine) methods and properties -- views, ``select``, ``split``,
    ``stream()`` itself, metadata -- run in the calling thread: they touch no loop state.

What raises instead of hanging:
    * :class:`~streamrl.errors.EventLoopError` (a ``RuntimeError``): a blocking call made
      from inside the loop that must serve it (from a coroutine or callback of an embedded
      queue's loop, or on a blocking queue's own loop thread, for example in a filter): it
      would wait for the loop it blocks. Use the async API there (``await`` the method of
      ``aqueue``, or of a batch's ``remote``). Also a call while that loop is not running
      or closed, a call still waiting when it stops (for example when ``asyncio.run``
      returns), and a wrapper of an embedded queue that no loop has used yet, made
      outside any loop (pass ``wrap(q, loop=...)``).
    * :class:`~streamrl.errors.QueueClosed`: every call after :meth:`StreamQueue.shutdown`,
      and the calls it gives up (below).

Shutdown:
    :meth:`StreamQueue.shutdown` returns promptly and wakes every thread blocked in the
    queue, ``close()`` or not. A queue the blocking object created is closed first, so
    waiters wake as ``close`` wakes them: ``get`` raises
    :class:`~streamrl.errors.EndOfStream`, ``put`` and ``wait_version``
    :class:`~streamrl.errors.QueueClosed`, ``stream`` iterators end; then its deployment
    is freed. A queue from ``wrap`` or ``connect`` stays open for its other users. Calls
    still blocked after that (all of them, for a wrapper) are given up: their callers
    raise :class:`~streamrl.errors.QueueClosed` at once and the calls are cancelled on the
    loop, with the async API's cancellation semantics (a cancelled put leaves nothing
    behind; a batch delivered as the caller gave up is released, so its rows go to
    another consumer). A caller interrupted while it waits (``KeyboardInterrupt``) gives
    its call up the same way.

The method table:
    The blocking classes are derived from the async ones when this module is imported
    (see :class:`Twin`): each public coroutine function becomes a blocking method, each
    plain method, static method, property and slot is forwarded, results that are async
    batches, columns, streams or the queue come back as their blocking twins, and blocking
    objects passed as arguments are unwrapped. Each twin's ``_twin`` lists the
    exceptions with their reasons: ``StreamQueue.session`` is not exposed (async
    plumbing); ``close``/``shutdown`` and the async protocol methods (``__aenter__`` ->
    ``__enter__``, ``__anext__`` -> ``__next__``, ``Stream.aclose`` -> ``close``) are
    written by hand; ``from_config`` and ``connect`` build a blocking queue on a loop
    thread of its own (only the first owns the queue); ``wrap`` and ``aqueue`` (queue) and
    ``remote`` (batch, column) exist only here. A subclass of an async class gets its twin
    with ``class SyncMine(streamrl.sync.StreamQueue, twin=Mine)``.
    ``tests/test_sync_surface.py`` compares the surfaces name by name.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from . import queue as _aq
from .batch import ColumnRemoteBatch, RowRemoteBatch
from .errors import EventLoopError, InvalidArgument, QueueClosed

__all__ = ["StreamQueue", "SyncStream", "SyncBatch", "SyncColumn", "Twin", "PROTOCOL"]

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
        self._thread = threading.Thread(target=self._main, args=(loop, ready), daemon=True,
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

    def _main(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
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
        deadline = time.monotonic() + timeout
        with self._lock:
            calls = [c for c, _ in self._inflight.values()]
        for c in calls:
            if not c.ready.wait(max(0.0, deadline - time.monotonic())):
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
        assert loop is not None  # (a runner with a thread of its own has its loop)
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # already closed
            pass
        if wait and threading.current_thread() is not thread:
            thread.join(_JOIN)


def _bound_loop(queue: _aq.StreamQueue) -> asyncio.AbstractEventLoop | None:
    """The loop that owns an in-process queue, if known: recorded here, or by its
    deployment when first used (:attr:`~streamrl.transport.Transport.owner_loop`)."""
    transport = queue.session.transport
    loop = _owners.get(transport)
    if loop is None:
        loop = transport.owner_loop
    return loop


def _remember(queue: _aq.StreamQueue, loop: asyncio.AbstractEventLoop) -> None:
    """Record the loop that owns an in-process queue (the first one recorded stays)."""
    try:
        _owners.setdefault(queue.session.transport, loop)
    except TypeError:  # a transport that cannot be weakly referenced: found again next time
        pass


def _any_loop(queue: _aq.StreamQueue) -> bool:
    """Whether the queue may be used from any event loop: a transport that hands out a
    handle (Ray) keeps its connections per loop; an in-process one (embedded) has its
    waiters in the one loop that runs it."""
    return queue.session.transport.handle is not None


# ============================================================================ the method table
#
# Every blocking class below is a *twin* of an async class: its public methods, properties
# and protocol methods are derived from the async class when this module is imported, so
# a method added to the async class shows up here with no code written. ``Twin`` lists
# the only differences, each with its reason; tests/test_sync_surface.py compares the two
# surfaces name by name (and signature by signature) against it.

#: protocol methods: async name -> blocking name. The first four are derived (forwarded
#: in the calling thread); the async ones differ in kind and are written by hand (each
#: twin lists them in ``renamed``).
PROTOCOL: dict[str, str] = {
    "__len__": "__len__", "__getitem__": "__getitem__", "__bool__": "__bool__",
    "__contains__": "__contains__",
    "__aiter__": "__iter__", "__anext__": "__next__",
    "__aenter__": "__enter__", "__aexit__": "__exit__",
}
_FORWARDED_PROTOCOL = ("__len__", "__getitem__", "__bool__", "__contains__")


@dataclass(frozen=True)
class Twin:
    """How a blocking class derives from an async class: everything public on ``source``
    (coroutine functions, plain methods, properties, slots, static methods) and its
    protocol methods, except what is listed here.

    Derived members keep the async member's name, signature and docstring (the return
    annotation names the blocking types). Coroutine functions become blocking methods that
    run on the queue's event loop; plain methods and properties run in the calling thread
    (they touch no loop state: views, the stream object, metadata). Arguments that are
    blocking objects are passed on as the async objects they wrap; results that are async
    batches, columns, streams or the queue come back as their blocking twins.

    Attributes:
        source: the async class.
        hidden: public async names the blocking class does not have -> why.
        renamed: async names whose blocking twin has another name -> that name (written by
            hand: ``aclose`` -> ``close``, ``__aenter__`` -> ``__enter__`` ...).
        by_hand: async names the blocking class writes itself (same name and signature,
            other behaviour) -> why.
        constructors: public classmethods that build a queue -> whether the blocking queue
            they return owns it (closes it and frees its deployment at ``shutdown``). A
            classmethod not listed is not derived (and the surface test says so).
        attributes: instance attributes of the async objects (set in ``__init__``, not on
            the class) forwarded as properties.
        extra: names only the blocking class has -> why.
    """

    source: type
    hidden: Mapping[str, str] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)
    by_hand: Mapping[str, str] = field(default_factory=dict)
    constructors: Mapping[str, bool] = field(default_factory=dict)
    attributes: tuple[str, ...] = ()
    extra: Mapping[str, str] = field(default_factory=dict)


def _members(source: type) -> dict[str, Any]:
    """Public members and protocol methods of ``source`` and its bases, raw (as found in
    the class ``__dict__``: functions, property/classmethod/staticmethod objects...)."""
    out: dict[str, Any] = {}
    for klass in reversed(source.__mro__[:-1]):  # the most derived wins; not object's
        for name, raw in vars(klass).items():
            if not name.startswith("_") or name in PROTOCOL:
                out[name] = raw
    return out


class _TwinBase:
    """Base of the blocking twins: ``_target`` is the async object, ``_home`` the blocking
    queue whose event loop runs its calls. A subclass made with ``twin=AsyncClass`` (a
    subclass of the async class the parent twins) derives that class's extra members."""

    __slots__ = ()
    _twin: ClassVar[Twin]

    if TYPE_CHECKING:  # slots of the twins, read-only properties of StreamQueue
        @property
        def _target(self) -> Any: ...
        @property
        def _home(self) -> StreamQueue: ...

    def __init_subclass__(cls, twin: type | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if twin is not None:
            parent = cls._twin
            if not issubclass(twin, parent.source):
                raise TypeError(f"{twin.__name__} is not a subclass of {parent.source.__name__}")
            cls._twin = replace(parent, source=twin)
            _derive(cls)


def _unwrap(x: Any) -> Any:
    """Blocking objects in arguments -> the async objects they wrap."""
    if isinstance(x, _TwinBase):
        return x._target
    if isinstance(x, (list, tuple)) and any(isinstance(i, _TwinBase) for i in x):
        return type(x)(_unwrap(i) for i in x)
    return x


def _unwrap_all(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tuple(_unwrap(a) for a in args), {k: _unwrap(v) for k, v in kwargs.items()}


def _home_of(args: Any) -> "StreamQueue | None":
    for a in args:
        if isinstance(a, _TwinBase):
            return a._home
        if isinstance(a, (list, tuple)):
            home = _home_of(a)
            if home is not None:
                return home
    return None


def _wrap(out: Any, home: "StreamQueue", me: _TwinBase | None = None) -> Any:
    """Async results -> their blocking twins (``me`` for the object itself)."""
    if me is not None and out is me._target:
        return me
    if out is home._q:
        return home
    if isinstance(out, RowRemoteBatch):
        return SyncBatch(out, home)
    if isinstance(out, ColumnRemoteBatch):
        return SyncColumn(out, home)
    if isinstance(out, _aq.Stream):
        return SyncStream(out, home)
    if isinstance(out, (list, tuple)) and any(
            isinstance(i, (RowRemoteBatch, ColumnRemoteBatch, _aq.Stream)) for i in out):
        return type(out)(_wrap(i, home) for i in out)
    return out


_BLOCKING_NAMES = [(re.compile(r"\bRowRemoteBatch\b"), "SyncBatch"),
                   (re.compile(r"\bColumnRemoteBatch\b"), "SyncColumn"),
                   (re.compile(r"\bRemoteBatch\b"), "SyncBatch"),
                   (re.compile(r"\bStream\b"), "SyncStream")]


def blocking_annotation(annotation: Any) -> Any:
    """The return annotation of a derived method: async batch, column and stream types
    replaced by their blocking twins (annotations are strings in streamrl's modules)."""
    if isinstance(annotation, str):
        for pattern, name in _BLOCKING_NAMES:
            annotation = pattern.sub(name, annotation)
        return annotation
    return {RowRemoteBatch: SyncBatch, ColumnRemoteBatch: SyncColumn,
            _aq.Stream: SyncStream}.get(annotation, annotation)


def _dress(fn: Callable, cls: type[_TwinBase], name: str, source_fn: Callable, note: str) -> Callable:
    """Give a derived method the name, docstring and signature of the async one."""
    functools.update_wrapper(fn, source_fn)
    fn.__module__ = cls.__module__
    fn.__qualname__ = f"{cls.__qualname__}.{name}"
    doc = inspect.getdoc(source_fn)
    fn.__doc__ = f"{note}\n\n{doc}" if doc else note
    sig = inspect.signature(source_fn)
    # (functions take any attribute; Callable declares neither of these)
    fn.__signature__ = sig.replace(  # type: ignore[attr-defined]  # read by inspect.signature
        return_annotation=blocking_annotation(sig.return_annotation))
    fn._derived = True  # type: ignore[attr-defined]  # what _derive may replace (see there)
    return fn


def _ref(cls: type, name: str) -> str:
    return f":meth:`{cls.__module__}.{cls.__qualname__}.{name}`".replace(
        "streamrl.queue.", "streamrl.")


def _blocking_method(cls: type[_TwinBase], name: str, func: Callable) -> Callable:
    def method(self, *args, **kwargs):
        home = self._home
        args, kwargs = _unwrap_all(args, kwargs)
        out = home._runner.call(getattr(self._target, name), *args, **kwargs)
        return _wrap(out, home, self)

    return _dress(method, cls, name, func,
                  f"Blocking {_ref(cls._twin.source, name)}: runs on the queue's event loop "
                  "and waits for it.")


def _plain_method(cls: type[_TwinBase], name: str, func: Callable) -> Callable:
    def method(self, *args, **kwargs):
        args, kwargs = _unwrap_all(args, kwargs)
        return _wrap(getattr(self._target, name)(*args, **kwargs), self._home, self)

    return _dress(method, cls, name, func,
                  f"{_ref(cls._twin.source, name)}, with blocking batches and streams.")


def _static_method(cls: type[_TwinBase], name: str, func: Callable) -> staticmethod:
    def method(*args, **kwargs):
        home = _home_of(list(args) + list(kwargs.values()))
        u_args, u_kwargs = _unwrap_all(args, kwargs)
        out = func(*u_args, **u_kwargs)
        return out if home is None else _wrap(out, home)

    return staticmethod(_dress(method, cls, name, func,
                               f"{_ref(cls._twin.source, name)} of blocking batches."))


def _constructor(cls: type[_TwinBase], name: str, func: Callable, owns: bool) -> classmethod:
    def method(klass, *args, **kwargs):
        runner = _Runner.start()
        try:
            queue = runner.call(getattr(klass._twin.source, name), *args, **kwargs)
        except BaseException:
            runner.stop()
            raise
        self = klass.__new__(klass)
        self._adopt(queue, runner, owns=owns)
        return self

    what = ("it owns the queue: shutdown closes it and frees its deployment" if owns else
            "shutdown stops this blocking queue and leaves the queue itself running")
    return classmethod(_dress(method, cls, name, func,
                              f"{_ref(cls._twin.source, name)}, as a blocking queue with an "
                              f"event-loop thread of its own ({what})."))


def _forward_property(name: str, raw: Any) -> property:
    def fget(self):
        return _wrap(getattr(self._target, name), self._home, self)

    def fset(self, value):
        setattr(self._target, name, _unwrap(value))

    settable = raw is None or isinstance(raw, types.MemberDescriptorType) or (
        isinstance(raw, property) and raw.fset is not None)
    doc = raw.__doc__ if isinstance(raw, property) else f"The async object's ``{name}``."
    return property(fget, fset if settable else None, doc=doc)


def _derive(cls: type[_TwinBase]) -> type[_TwinBase]:
    """Add to ``cls`` the members of ``cls._twin.source`` (see :class:`Twin`)."""
    twin: Twin = cls._twin
    member: object  # (derived members are marked _derived by _dress)
    skip = set(twin.hidden) | set(twin.renamed) | set(twin.by_hand)
    for name, raw in _members(twin.source).items():
        if name in skip or (name.startswith("__") and name not in _FORWARDED_PROTOCOL):
            continue
        if name in vars(cls) and not getattr(vars(cls)[name], "_derived", False):
            raise TypeError(f"{cls.__name__}.{name} is written by hand: list it in the "
                            "twin's by_hand (or renamed) with the reason")
        if isinstance(raw, classmethod):
            if name not in twin.constructors:
                continue  # not derived: the surface test names it
            member = _constructor(cls, name, raw.__func__, twin.constructors[name])
        elif isinstance(raw, staticmethod):
            member = _static_method(cls, name, raw.__func__)
        elif inspect.iscoroutinefunction(raw):
            member = _blocking_method(cls, name, raw)
        elif inspect.isfunction(raw):
            member = _plain_method(cls, name, raw)
        else:  # property, slot, or a plain class attribute
            member = _forward_property(name, raw)
        setattr(cls, name, member)
    for name in twin.attributes:
        setattr(cls, name, _forward_property(name, None))
    return cls


# ============================================================================ the twins


class SyncBatch(_TwinBase):
    """Blocking twin of :class:`~streamrl.RowRemoteBatch` (as returned by a blocking
    queue's ``put``, ``get`` and ``stream``): every method and property of the async batch,
    with ``materialize``, ``write``, ``ack``, ``release`` and ``drop`` blocking. Views
    (indexing, ``select``, ``split``...) are blocking batches too; ``mb["field"]`` is a
    :class:`SyncColumn`. ``.remote`` is the async batch."""

    __slots__ = ("_target", "_home")
    _twin = Twin(RowRemoteBatch, extra={"remote": "the async batch this one wraps"})
    _target: RowRemoteBatch
    _home: StreamQueue

    def __init__(self, remote: RowRemoteBatch, queue: "StreamQueue"):
        self._target = remote
        self._home = queue

    @property
    def remote(self) -> RowRemoteBatch:
        """The async batch."""
        return self._target

    def __repr__(self) -> str:
        return f"Sync{self._target!r}"

    def __reduce__(self):
        return (SyncBatch, (self._target, self._home))


class SyncColumn(_TwinBase):
    """Blocking twin of :class:`~streamrl.ColumnRemoteBatch` (``mb["field"]`` of a
    :class:`SyncBatch`): ``materialize()`` blocks and returns the column itself."""

    __slots__ = ("_target", "_home")
    _twin = Twin(ColumnRemoteBatch, extra={"remote": "the async column this one wraps"})
    _target: ColumnRemoteBatch
    _home: StreamQueue

    def __init__(self, remote: ColumnRemoteBatch, queue: "StreamQueue"):
        self._target = remote
        self._home = queue

    @property
    def remote(self) -> ColumnRemoteBatch:
        """The async column."""
        return self._target

    def __repr__(self) -> str:
        return f"Sync{self._target!r}"


class SyncStream(_TwinBase):
    """Blocking twin of :class:`~streamrl.Stream`: a plain iterator of :class:`SyncBatch`
    and a context manager, with the stream's acknowledgement rules (asking for the next
    batch acknowledges the current one; leaving the ``with`` block without an exception
    acknowledges it, with one releases it; :meth:`close` releases it)."""

    __slots__ = ("_target", "_home", "__weakref__")
    _twin = Twin(_aq.Stream, renamed={
        "__aiter__": "__iter__", "__anext__": "__next__",
        "__aenter__": "__enter__", "__aexit__": "__exit__", "aclose": "close"})
    _target: _aq.Stream
    _home: StreamQueue

    def __init__(self, stream: _aq.Stream, queue: "StreamQueue"):
        stream.watch_task = False  # each blocking call runs as a task of its own
        self._target = stream
        self._home = queue

    def __iter__(self) -> Iterator[SyncBatch]:
        return self

    def __next__(self) -> SyncBatch:
        """The next batch (blocking); acknowledges the one before."""
        try:
            out = self._home._runner.call(self._target.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None
        return SyncBatch(out, self._home)

    def __enter__(self) -> "SyncStream":
        return self

    def __exit__(self, et, e, tb) -> None:
        self._home._runner.call(self._target.__aexit__, et, e, tb)

    def close(self) -> None:
        """Release the current batch and stop (blocking :meth:`streamrl.Stream.aclose`)."""
        self._home._runner.call(self._target.aclose)

    def __repr__(self) -> str:
        return f"<SyncStream of {self._home!r}>"

    def __del__(self) -> None:
        try:  # (from __init__ on, _target is set)
            cur = self._target.current
            if cur is not None and cur.leased:
                self._home._runner.submit(self._target.aclose)
        except Exception:
            pass


class StreamQueue(_TwinBase):
    """Blocking twin of :class:`streamrl.StreamQueue`: the same arguments, and every method
    and property of the async queue under the same name with the same signature, blocking
    (``stream`` returns a plain iterator, :class:`SyncStream`; batches are
    :class:`SyncBatch`). See the module docstring for where calls run and what
    ``shutdown`` does.

    Wrap an existing async queue with :meth:`wrap` (for example a Ray queue handle received
    in a synchronous actor, or an embedded queue whose loop runs producers while threads
    consume).

    Examples:
        >>> import torch
        >>> from streamrl.sync import StreamQueue
        >>> with StreamQueue(capacity=16, num_shards=2) as q:
        ...     rows = q.put({"x": torch.arange(4)}, partition="p")
        ...     mb = q.get("t", ["x"], batch_size=4, partition="p")
        ...     mb[1:3].materialize()["x"].tolist()
        [1, 2]
    """

    _twin = Twin(
        _aq.StreamQueue,
        hidden={"session": "the async plumbing batch views await; blocking batches reach "
                           "it through their own calls (aqueue.session is there)"},
        renamed={"__aenter__": "__enter__", "__aexit__": "__exit__"},
        by_hand={"close": "a no-op once this blocking queue is shut down",
                 "shutdown": "closes a queue it owns first, wakes every blocked caller and "
                             "stops the event-loop thread"},
        constructors={"from_config": True, "connect": False, "restore": True},
        attributes=("name",),
        extra={"wrap": "a blocking view of an existing async queue",
               "aqueue": "the async queue behind this one"})

    def __init__(self, *args: Any, **kwargs: Any):
        runner = _Runner.start()
        try:
            queue = runner.call(self._twin.source, *args, **kwargs)
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
            _remember(queue, runner.loop())

    @property
    def _target(self) -> _aq.StreamQueue:
        return self._q

    @property
    def _home(self) -> "StreamQueue":
        return self

    @classmethod
    def wrap(cls, queue: _aq.StreamQueue, *,
             loop: asyncio.AbstractEventLoop | None = None) -> "StreamQueue":
        """A blocking view of an existing async queue, usable from any thread. The queue
        is not owned: :meth:`shutdown` stops this view (and wakes its blocked callers with
        :class:`~streamrl.errors.QueueClosed`) but leaves the queue open and running.

        * A queue usable from any event loop (``transport="ray"``: it pickles into a
          handle) gets an event-loop thread of its own for this view.
        * An embedded queue lives in one event loop (its waiters belong to it), so every
          call of the view is handed to that loop and waits for it there: a producer
          coroutine in that loop and consumer threads through the view wake each other as
          they should. The loop is the one given as ``loop``, else the one that already
          used the queue, else the one running where ``wrap`` is called (call it from a
          coroutine of that loop). That loop must keep running while the view is used: a
          blocking call while it is not running, or from inside it, raises
          :class:`~streamrl.errors.EventLoopError` instead of hanging.

        Raises:
            InvalidArgument: ``queue`` is not an async :class:`streamrl.StreamQueue`.
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
                _remember(queue, loop)
            runner = _Runner.foreign(loop, lambda: _bound_loop(queue))
        self._adopt(queue, runner, owns=False)
        return self

    @property
    def aqueue(self) -> _aq.StreamQueue:
        """The async queue behind this one."""
        return self._q

    def __reduce__(self):
        return (StreamQueue.wrap, (self._q,))

    def __repr__(self) -> str:
        return f"<blocking {repr(self._q)[1:]}"

    def __enter__(self) -> "StreamQueue":
        return self

    def __exit__(self, *exc) -> None:
        """Close and shut down (see :meth:`shutdown`)."""
        self.close()
        self.shutdown()

    def close(self) -> dict[str, int]:
        """Blocking :meth:`streamrl.StreamQueue.close` (idempotent; a no-op after
        :meth:`shutdown`).

        Returns:
            Rows still held per partition (empty when nothing is left behind).
        """
        if not self._runner.accepting:
            return {}
        return self._runner.call(self._q.close)

    def shutdown(self) -> None:
        """Stop this blocking queue and wake every thread blocked in it; idempotent.

        For a queue this object created, the queue is closed first, so blocked callers
        wake as :meth:`close` wakes them (``get``: :class:`~streamrl.errors.EndOfStream`,
        ``put``/``wait_version``: :class:`~streamrl.errors.QueueClosed`, ``stream``
        iterators end), then its deployment is freed (Ray: its actors killed). A queue
        from :meth:`wrap` or :meth:`connect` is left open and running for its other users.
        Calls still blocked after that (all of them, for those) are cancelled and raise
        :class:`~streamrl.errors.QueueClosed`; so do later calls. This object's event-loop
        thread, if it has one, ends.

        Raises:
            EventLoopError: called from inside the queue's event loop.
        """
        runner = self._runner
        if not runner.accepting:
            return
        if self._owner or runner.owns_loop:
            runner.check()  # not from inside the loop: it would wait for itself
        with runner._lock:
            if not runner.accepting:
                return
            runner.accepting = False
        try:
            if self._owner:
                try:
                    runner.call_internal(self._q.close)
                finally:  # the deployment is freed even if close failed (a dead actor)
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


StreamQueue.__init__.__signature__ = (  # type: ignore[attr-defined]  # read by inspect.signature
    inspect.signature(_aq.StreamQueue.__init__))
for _cls in (SyncBatch, SyncColumn, SyncStream, StreamQueue):
    _derive(_cls)
del _cls
