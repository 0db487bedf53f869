"""A direct socket channel for calls to an actor.

A Ray actor call costs 1-1.5 ms on an idle 2-core machine and 2-4 ms while other actors
are busy; the same call over a plain TCP connection between the same two processes costs
0.04-0.07 ms (measured here: an async actor calling another, 64-int argument, uvloop on
both ends). The controller's calls carry only metadata, and a put or a read is several of
them, so the Ray transport sends them over this channel instead:

* the actor runs an :class:`RpcServer` in its event loop, bound to its node's IP address
  and (on Linux) to a Unix domain socket of the abstract namespace whose name comes from
  the endpoint; a client on the same machine connects to that, any other by TCP (a
  kernel's message costs a quarter less CPU: a round trip of a one-row put's call cost
  the client 38 µs and the server 44 against 44 and 48 by TCP loopback here,
  ``benchmarks/rpc_floor.py``);
* each client process keeps one connection per event loop (:class:`RpcClient`) and
  multiplexes its calls over it by request id; replies come back in any order;
* a notification (:meth:`RpcClient.notify`: reports of bytes moved, a read's views let
  go, RDT operations) is a call with no reply: the server makes it in its turn and
  sends nothing back (a reply nobody waited for cost the server a write and the client a
  wake-up to read it: 10-13 and ~35 µs of CPU a report on a 2-core VM,
  ``benchmarks/rpc_floor.py``);
* requests and replies are pickled (the same trust model as Ray, which pickles actor
  arguments); a connection is served only after it presents the random 32-byte token the
  actor handed out through Ray (which authenticates its own clients), and nothing is
  unpickled before that;
* when a client's connection closes (the client process died), the server cancels the
  calls that connection still waited for (a take waiting for rows gives up at once, so
  rows put later go to living consumers);
* a call whose connection breaks raises :class:`ConnectionError` at once (the actor died,
  or the network failed): callers turn it into their own error;
* a big out-of-band buffer (``DIRECT`` bytes or more) is received straight into memory of
  its own, which the unpickled arrays then view: the only copy on the receiving side is
  the kernel's. Everything else goes through a small staging buffer. The big buffers of
  one frame share one allocation once they add up to ``POOL`` bytes (huge pages where
  the kernel allows): an array received keeps that whole allocation alive.

Receiving a 64 MiB reply of 32 arrays (uvloop sender) took 50-62 ms through asyncio's
stream reader (which copies every byte twice into fresh memory) and takes 20-23 ms this
way, here.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import inspect
import itertools
import logging
import pickle
import secrets
import socket
import struct
import sys
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import numpy as np

__all__ = ["RpcServer", "RpcClient", "Endpoint", "ConnectFailed"]

log = logging.getLogger("streamrl")

_HDR = struct.Struct("<QQQ")  # frame header: request id, body length, number of buffers


class _FrameStart(int):
    """What the frame parser asks for at the start of a frame: a frame header's bytes
    (an ``int`` like any other size; its own object, so that the receiving end can tell
    it from a piece of that size inside a frame)."""


_FRAME_START = _FrameStart(_HDR.size)
_TOKEN_BYTES = 32
_CONNECT_TIMEOUT = 10.0
#: pieces of a frame this big or bigger are received into memory of their own
DIRECT = 64 * 1024
_STAGE = 4 * DIRECT  # the staging buffer for everything smaller
POOL = 4 << 20  # a frame's big buffers share one allocation from this many bytes on
#: a frame whose out-of-band buffers add up to less than this is sent as one piece (the
#: copy costs less than a write system call per buffer)
_JOIN = 16 * 1024

#: types of results that are never awaitable (a method's answer of one of them is sent
#: without asking ``inspect.isawaitable``, an ABC check)
_PLAIN = frozenset({tuple, list, dict, str, bytes, int, float, bool, type(None)})

#: ``(host, port, token)`` of a server
Endpoint = tuple[str, int, bytes]

#: whether servers also listen on a Unix domain socket of the abstract namespace (Linux's:
#: no file to make or clean up; reachable from processes of the same machine and network
#: namespace only), which clients on the same machine connect to instead of TCP
LOCAL = sys.platform.startswith("linux")


def local_name(token: bytes) -> str:
    """The abstract Unix socket name of the server whose token is ``token``: derived from
    the endpoint, so a client needs nothing more to find it, through a hash, so the name
    (which any process of the machine can list) does not give the token away."""
    digest = hashlib.sha256(b"streamrl rpc local name:" + token).hexdigest()
    return "\0streamrl-rpc-" + digest[:40]


class ConnectFailed(ConnectionError):
    """No connection could be opened (nothing was sent): the server is gone, or this
    process cannot reach its address."""


#: The request id of a call whose caller waits for no reply (:meth:`RpcClient.notify`):
#: the server makes it and sends nothing back (the largest id a header holds; the ids of
#: calls count up from 0 per connection).
ONE_WAY = (1 << 64) - 1


def _frame(req_id: int, obj: Any) -> list:
    """``obj`` as the pieces of one frame of call ``req_id``: a header (request id, body
    length, number and lengths of out-of-band buffers), the pickle body, then the raw
    buffers (numpy arrays and other protocol-5 buffers: written as they are, not copied
    into the pickle)."""
    buffers: list = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return [_HDR.pack(req_id, len(body), 0) + body]
    raws = [b.raw() for b in buffers]
    sizes = [r.nbytes for r in raws]
    head = struct.pack(f"<QQQ{len(raws)}Q", req_id, len(body), len(raws), *sizes)
    if sum(sizes) < _JOIN:  # small buffers (a one-row put's): one piece, one write
        return [b"".join((head, body, *raws))]
    return [head + body, *raws]


def _frames(on_frame: Callable[[int, Callable[[], Any]], None]) -> Generator[Any, Any, None]:
    """The frame parser: yields what it needs next, the number of bytes (and is sent
    them: ``bytes``, or a ``uint8`` array for big pieces) or an array to fill (and is
    sent it, filled); calls ``on_frame(request id, load)`` for each whole frame, where
    ``load()`` unpickles it (so a frame that cannot be unpickled fails only its own call).

    The big buffers of a frame that add up to ``POOL`` bytes or more are received into
    one allocation (which numpy backs with huge pages where the kernel allows: filling
    fresh memory costs a fifth as much here); the arrays unpickled from them view it."""
    while True:
        req_id, n, nbuf = _HDR.unpack((yield _FRAME_START))
        sizes = struct.unpack(f"<{nbuf}Q", (yield 8 * nbuf)) if nbuf else ()
        body = yield n
        offsets, end = [], 0
        for k in sizes:
            offsets.append(end)
            if k >= DIRECT:
                end += -(-k // 64) * 64  # each buffer 64-byte aligned
        pool = None
        if end >= POOL:
            pool = np.empty(end + 64, dtype=np.uint8)
            pool = pool[-pool.ctypes.data % 64:]
        buffers = []
        for k, off in zip(sizes, offsets):
            buffers.append((yield pool[off:off + k] if pool is not None and k >= DIRECT else k))
        on_frame(req_id, functools.partial(pickle.loads, body, buffers=buffers))


class _Protocol(asyncio.BufferedProtocol):
    """One end of a connection. Receiving: cuts the byte stream into the pieces a parser
    generator asks for (see :func:`_frames`); small pieces through a staging buffer, big
    ones received in place; a frame of small pieces that the stage holds whole is handed
    over in one step (see :meth:`_whole`). Sending: :meth:`send` writes a frame's pieces
    as they are."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser: Generator[Any, Any, None] | None = None
        #: the ``on_frame`` of the :func:`_frames` parser, once the stream is frames
        self._on_frame: Callable[[int, Callable[[], Any]], None] | None = None
        self._want: Any = 0  # what the parser needs next (see _frames)
        self._stage = bytearray(_STAGE)
        self._view = memoryview(self._stage)
        self._start = self._end = 0  # unparsed bytes of the stage
        self._big: np.ndarray | None = None  # a big piece being received in place
        self._got = 0

    def parse(self, parser: Generator[Any, Any, None]) -> None:
        """Feed the stream to ``parser`` from now on."""
        self._parser = parser
        self._want = next(parser)

    def parse_frames(self, on_frame: Callable[[int, Callable[[], Any]], None]) -> None:
        """The stream is frames from now on: ``on_frame`` is called for each (see
        :func:`_frames`)."""
        self._on_frame = on_frame
        self.parse(_frames(on_frame))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a stream connection's transport is an asyncio.Transport)
        self.transport = transport  # type: ignore[assignment]

    def send(self, pieces: list) -> None:
        """Write a frame's pieces. Raises :class:`ConnectionError` when the connection is
        closed or closing (its ``connection_lost`` may not have run yet)."""
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the connection is closed")
        try:
            for p in pieces:
                t.write(p)
        except RuntimeError as e:  # uvloop: the transport's handle closed under us
            raise ConnectionResetError(f"the connection is closed ({e})") from None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return self._big.data[self._got:]
        if self._end == len(self._stage):  # full: move what is left to the front
            n = self._end - self._start
            self._view[:n] = self._view[self._start:self._end]
            self._start, self._end = 0, n
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._got += nbytes
            if self._got == len(self._big):
                big, self._big = self._big, None
                self._feed(big)
        else:
            self._end += nbytes
        self._drain()

    def _feed(self, piece: Any) -> None:
        assert self._parser is not None  # (pieces are cut only while a parser wants them)
        try:
            self._want = self._parser.send(piece)
        except StopIteration:  # the parser is done with this connection
            self._parser = None
            if self.transport is not None:
                self.transport.abort()

    def _drain(self) -> None:
        """Hand the parser every piece the stage holds; start receiving a big one in place."""
        while self._parser is not None and self._big is None:
            want, have = self._want, self._end - self._start
            if want is _FRAME_START and have >= want and self._whole():
                continue
            if not isinstance(want, int) or want >= DIRECT:
                big = want if not isinstance(want, int) else np.empty(want, dtype=np.uint8)
                want = len(big)
                k = min(have, want)
                big[:k] = np.frombuffer(self._view[self._start:self._start + k], dtype=np.uint8)
                self._start += k
                if k < want:
                    self._big, self._got = big, k
                else:
                    self._feed(big)
            elif have >= want:
                piece = bytes(self._view[self._start:self._start + want])
                self._start += want
                self._feed(piece)
            else:
                break
        if self._start == self._end:
            self._start = self._end = 0

    def _whole(self) -> bool:
        """Hand over the frame at the start of the stage in one step, if the stage holds
        all of it and none of its pieces is big (a call's or a reply's usual frame): its
        pieces copied out as the parser would, without the parser's steps (it waits for
        the next frame's header, and stays where it is).
        ``False``: not so (the parser takes the frame piece by piece)."""
        on_frame = self._on_frame
        if on_frame is None:
            return False
        stage, end = self._stage, self._end
        req_id, n, nbuf = _HDR.unpack_from(stage, self._start)
        at = self._start + _HDR.size
        sizes: tuple[int, ...] = ()
        if nbuf:
            if at + 8 * nbuf > end:
                return False
            sizes = struct.unpack_from(f"<{nbuf}Q", stage, at)
            at += 8 * nbuf
        total = n + sum(sizes)
        if at + total > end or n >= DIRECT or (sizes and max(sizes) >= DIRECT):
            return False
        view = self._view
        body = bytes(view[at:at + n])
        buffers = []
        at += n
        for k in sizes:  # (each its own bytes, as the parser makes them: aligned for any
            # dtype, where a slice of one copy of the frame would not be)
            buffers.append(bytes(view[at:at + k]))
            at += k
        self._start = at
        on_frame(req_id, functools.partial(pickle.loads, body, buffers=buffers))
        return True


class RpcServer:
    """Serve the public methods (sync or async) of ``target`` on ``host``. Calls run
    concurrently: a call is made as its frame arrives when no earlier call of its
    connection is still to run (a plain method's answer goes at once: no task, no turn
    of the event loop; 40-43 -> 34.5 µs of the server's CPU a round trip here), else as
    a task after them; what is left to await runs as a task. A call still running when
    its client's connection closes is cancelled."""

    def __init__(self, target: Any, host: str):
        self.target = target
        self.host = host
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self._server: asyncio.Server | None = None
        self._local: asyncio.AbstractServer | None = None  # the same-machine listener
        self._conns: set[_Served] = set()
        self._methods: dict[str, Callable] = {}  # name -> the bound method it calls

    def _method(self, name: str) -> Callable:
        """The target's public method ``name``. Ray wraps each method of an actor class
        for its tracing; the wrapper only adds a call layer unless the call carries a
        trace context, which a call over this channel never does, so the method
        underneath is called instead (a call costs a layer less)."""
        m = self._methods.get(name)
        if m is None:
            if name.startswith("_"):
                raise AttributeError(f"no public method {name!r}")
            m = getattr(self.target, name)
            fn = getattr(m, "__func__", None)
            if getattr(fn, "__ray_tracing_wrapped__", False):
                m = fn.__wrapped__.__get__(self.target)  # type: ignore[union-attr]
            self._methods[name] = m
        return m

    async def start(self) -> Endpoint:
        """Start listening (once); the endpoint clients connect to."""
        if self._server is None:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(lambda: _Served(self), self.host, 0)
            if LOCAL:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.bind(local_name(self.token))
                    sock.setblocking(False)
                    self._local = await loop.create_unix_server(lambda: _Served(self),
                                                                sock=sock)
                except OSError as e:  # (clients of this machine then connect by TCP)
                    sock.close()
                    log.debug("streamrl: no Unix socket for same-machine calls: %r", e)
        port = self._server.sockets[0].getsockname()[1]
        return (self.host, port, self.token)

    def close(self) -> None:
        """Stop listening and drop every connection (their clients' calls fail)."""
        if self._server is not None:
            self._server.close()
        if self._local is not None:
            self._local.close()
        for c in list(self._conns):
            if c.transport is not None:  # (set before the connection is listed)
                c.transport.abort()

    def _begin(self, conn: _Served, req_id: int, load: Callable) -> tuple[str, Any] | None:
        """Make call ``req_id`` (unpickled by ``load``): ``None`` once its answer is sent
        (a plain method's, or an error), else its method and what is left to await."""
        method = "?"
        try:
            method, args, kwargs = load()
            res = self._method(method)(*args, **kwargs)
        except Exception as e:  # the caller gets it (a call that cannot be unpickled too)
            self._reply(conn, req_id, method, (False, e))
            return None
        if type(res) not in _PLAIN and inspect.isawaitable(res):
            return method, res
        self._reply(conn, req_id, method, (True, res))
        return None

    async def _run(self, conn: _Served, req_id: int, load: Callable) -> None:
        left = self._begin(conn, req_id, load)
        if left is not None:
            await self._finish(conn, req_id, *left)

    async def _finish(self, conn: _Served, req_id: int, method: str, aw: Any) -> None:
        try:
            reply = (True, await aw)
        except Exception as e:  # noqa: BLE001 - the caller gets it
            reply = (False, e)
        self._reply(conn, req_id, method, reply)

    def _reply(self, conn: _Served, req_id: int, method: str, reply: tuple) -> None:
        if req_id == ONE_WAY:  # nobody waits for it: no reply (a failure is logged)
            if not reply[0]:
                log.debug("streamrl: notification %s failed: %r", method, reply[1])
            return
        try:
            data = _frame(req_id, reply)
        except Exception as e:  # an unpicklable result or error
            from ..errors import TransportError

            data = _frame(req_id, (False, TransportError(
                f"the reply to {method} could not be pickled ({e!r}): {reply[1]!r}")))
        try:
            conn.send(data)
        except ConnectionError:  # the client is gone: nobody waits for this reply
            pass


class _Served(_Protocol):
    """A client's connection to an :class:`RpcServer`: served once it presents the token
    (nothing is unpickled before); its running calls are cancelled when it closes."""

    def __init__(self, server: RpcServer):
        super().__init__()
        self.server = server
        self.running: dict[int, asyncio.Task] = {}
        self._one_way = itertools.count(-1, -1)  # (keys in ``running`` of notifications)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server._conns.add(self)
        self._timer = asyncio.get_running_loop().call_later(_CONNECT_TIMEOUT, self._no_token)
        self.parse(self._serve())

    def _no_token(self) -> None:
        log.warning("streamrl: closed a connection that presented no token within %ss",
                    _CONNECT_TIMEOUT)
        if self.transport is not None:
            self.transport.abort()

    def _serve(self) -> Generator[Any, Any, None]:
        token = yield _TOKEN_BYTES
        if self._timer is not None:
            self._timer.cancel()
        if not hmac.compare_digest(token, self.server.token):
            log.warning("streamrl: refused a connection with a wrong token")
            return
        self._on_frame = self._call  # (frames from now on: see _whole)
        yield from _frames(self._call)

    def _call(self, req_id: int, load: Callable) -> None:
        server = self.server
        if self.running:  # an earlier call of this connection is still to run: as a
            # task, after it (a plain method called now would overtake it)
            self._track(req_id, server._run(self, req_id, load))
            return
        left = server._begin(self, req_id, load)  # (a plain method runs now)
        if left is not None:
            self._track(req_id, server._finish(self, req_id, *left))

    def _track(self, req_id: int, coro: Coroutine) -> None:
        """Run call ``req_id`` as ``coro``, a task this connection cancels if it closes."""
        task = asyncio.ensure_future(coro)
        key = req_id if req_id != ONE_WAY else next(self._one_way)  # (many may run)
        self.running[key] = task
        task.add_done_callback(lambda _t: self.running.pop(key, None))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.server._conns.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self.running.values()):
            task.cancel()


class _Connection(_Protocol):
    """A client's connection: calls go out as frames, replies resolve their futures."""

    def __init__(self, on_broken: Callable[[], None] | None = None):
        super().__init__()
        self.on_broken = on_broken
        self.ids = itertools.count()
        self.waiting: dict[int, asyncio.Future] = {}
        self.broken: BaseException | None = None
        self.parse_frames(self._reply)

    def _reply(self, req_id: int, load: Callable) -> None:
        fut = self.waiting.pop(req_id, None)
        if fut is None or fut.done():
            return
        try:
            fut.set_result(load())
        except Exception as e:  # noqa: BLE001 - this call's reply cannot be read here
            from ..errors import TransportError

            fut.set_exception(TransportError(
                f"the reply could not be unpickled in this process ({e!r}); return "
                "values this process can import"))

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.broken is None:
            self.broken = exc or ConnectionResetError("closed by the server")
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"connection lost ({type(self.broken).__name__})"))
        self.waiting.clear()
        if self.on_broken is not None:
            self.on_broken()

    def _send_call(self, method: str, args: tuple, kwargs: dict) -> tuple[int, asyncio.Future]:
        """Send a call: its request id and the future its reply resolves (the caller
        pops the id from :attr:`waiting` once done with it; :meth:`RpcClient.call`)."""
        if self.broken is not None:
            raise ConnectionError(f"connection lost ({type(self.broken).__name__})")
        req_id = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[req_id] = fut
        try:
            self.send(_frame(req_id, (method, args, kwargs)))
        except ConnectionError as e:  # closing under us: nothing was sent
            self.waiting.pop(req_id, None)
            raise ConnectFailed(str(e)) from None
        return req_id, fut

    def notify(self, method: str, args: tuple, kwargs: dict) -> None:
        """Send a call that gets no reply (made after the calls sent before it; if it
        fails, only the server's log says so). Raises :class:`ConnectionError` if the
        connection is lost or closing (nothing was sent)."""
        if self.broken is not None:
            raise ConnectionError(f"connection lost ({type(self.broken).__name__})")
        self.send(_frame(ONE_WAY, (method, args, kwargs)))

    def close(self) -> None:
        if self.broken is None:
            self.broken = ConnectionAbortedError("closed by this client")
        if self.transport is not None:
            self.transport.close()


def _ready(fut: asyncio.Future | None) -> _Connection | None:
    """The connection a connect future opened, if it did and the connection is whole."""
    if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
        return None
    conn = fut.result()
    ok = conn.broken is None and conn.transport is not None and not conn.transport.is_closing()
    return conn if ok else None


class RpcClient:
    """Calls to one :class:`RpcServer`: one connection per event loop of this process,
    opened on first use. ``on_broken()`` is called when a connection breaks (the server
    died, or the connection's event loop ended)."""

    def __init__(self, endpoint: Endpoint, on_broken: Callable[[], None] | None = None):
        self.host, self.port, self.token = endpoint
        self.on_broken = on_broken
        self._conns: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        local = await self._open_local(loop) if LOCAL else None
        if local is not None:
            conn = local
        else:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(self.on_broken), self.host, self.port), _CONNECT_TIMEOUT)
        try:
            conn.send([self.token])
        except ConnectionError as e:  # closed at once (the server is going away)
            raise ConnectFailed(f"{self.host}:{self.port} closed the connection: {e}") from None
        return conn

    async def _open_local(self, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        """A connection to the server's Unix socket, if it is on this machine (``None``:
        it is not, or does not listen on one, or its backlog is full: TCP then)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(local_name(self.token))  # (at once, or an error: never waits)
            _, conn = await loop.create_unix_connection(lambda: _Connection(self.on_broken),
                                                        sock=sock)
        except OSError:
            sock.close()
            return None
        return conn

    async def connection(self) -> _Connection:
        """This event loop's connection (opened, or opened again after it broke)."""
        loop = asyncio.get_running_loop()
        fut = self._conns.get(loop)
        if fut is not None and fut.done() and _ready(fut) is None:
            fut = None
        if fut is None:
            for other in [lp for lp in self._conns if lp.is_closed()]:
                del self._conns[other]
            fut = self._conns[loop] = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(fut)
        except OSError as e:
            if self._conns.get(loop) is fut:
                del self._conns[loop]
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e}") from None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method``; raises what it raised, :class:`ConnectFailed` (nothing was
        sent) or :class:`ConnectionError` (the connection broke: the call may have run)."""
        conn = _ready(self._conns.get(asyncio.get_running_loop()))
        if conn is None:  # (none yet, or it broke: opened, or opened again)
            conn = await self.connection()
        try:  # (_Connection.call, inlined: a coroutine frame less a call)
            req_id, fut = conn._send_call(method, args, kwargs)
            try:
                ok, value = await fut
            finally:
                conn.waiting.pop(req_id, None)
            if ok:
                return value
            raise value
        except RuntimeError as e:  # uvloop: an operation on a transport whose handle closed
            if "handler is closed" not in str(e):
                raise
            raise ConnectFailed(f"the connection to {self.host}:{self.port} closed: {e}") from None

    def close(self) -> None:
        """Close this event loop's connection, if it has one (reopened on the next call)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        conn = _ready(self._conns.pop(loop, None))
        if conn is not None:
            conn.close()

    def notify(self, method: str, *args: Any, **kwargs: Any) -> bool:
        """Send a call that gets no reply on this loop's open connection (made after the
        calls sent before it; a failure is only logged by the server); ``False`` if there
        is no such connection (nothing was sent)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        conn = _ready(self._conns.get(loop))
        if conn is None:
            return False
        try:
            conn.notify(method, args, kwargs)
        except ConnectionError:
            return False
        return True
