"""The socket channel the Ray transport uses for its actors' calls (streamrl.transport.rpc),
tested in one process: no Ray needed."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamrl.errors import RowsDropped, TransportError
from streamrl.transport.rpc import DIRECT, RpcClient, RpcServer


class Target:
    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled: list = []
        self.marks: list = []  # (value, whether it ran in a task)

    def add(self, a, b=0):
        return a + b

    async def slow_add(self, a, b):
        await asyncio.sleep(0.05)
        return a + b

    def echo(self, *xs):
        return xs

    def echo_unloadable(self):
        return Unloadable()

    def fail(self, rows):
        raise RowsDropped("rows were dropped", rows)

    async def hang(self, rid=None):
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise

    def _private(self):
        return "secret"

    def mark(self, x):
        self.marks.append((x, asyncio.current_task() is not None))
        return x

    async def mark_async(self, x):
        self.marks.append((x, True))  # (before its first await)
        await asyncio.sleep(0)
        return x


@pytest.fixture(autouse=True, params=["local", "tcp"])
def path(request, monkeypatch):
    """Every test runs twice: with clients of the server's machine connecting by its Unix
    socket (on Linux), and with every connection by TCP (as from another machine)."""
    from streamrl.transport import rpc

    if request.param == "tcp":
        monkeypatch.setattr(rpc, "LOCAL", False)
    return request.param


def _family(client: RpcClient) -> int:
    """The address family of the connection of ``client`` on this event loop."""
    conn = rpc_ready(client)
    return conn.transport.get_extra_info("socket").family


def rpc_ready(client: RpcClient):
    from streamrl.transport.rpc import _ready

    conn = _ready(client._conns.get(asyncio.get_running_loop()))
    assert conn is not None
    return conn


async def _serve():
    """A server of a fresh Target on this test's event loop."""
    target = Target()
    server = RpcServer(target, "127.0.0.1")
    endpoint = await server.start()
    return target, server, endpoint


async def test_calls_return_results_and_raise_the_remote_error():
    _, _, ep = await _serve()
    c = RpcClient(ep)
    assert await c.call("add", 2, b=3) == 5
    # concurrent calls on one connection come back to the right caller, in any order
    res = await asyncio.gather(*[c.call("slow_add", i, 1) for i in range(20)],
                               *[c.call("add", i) for i in range(20)])
    assert res == [i + 1 for i in range(20)] + list(range(20))
    with pytest.raises(RowsDropped) as e:
        await c.call("fail", [3, 4])
    assert e.value.rows == [3, 4]
    with pytest.raises(AttributeError):
        await c.call("_private")
    c.close()


async def test_a_plain_method_is_answered_at_once_and_never_overtakes_an_earlier_call():
    """A call of a plain (not async) method is made as its frame arrives, no task, when
    its connection has no earlier call still to run; behind one that is, it runs after
    it, as a task: calls of a connection start in the order they were sent."""
    target, server, ep = await _serve()
    c = RpcClient(ep)
    assert await c.call("mark", 1) == 1
    assert target.marks == [(1, False)]  # at once, in no task
    target.marks.clear()
    assert c.notify("mark_async", 2) and c.notify("mark", 3) and c.notify("mark", 4)
    assert await c.call("mark_async", 5) == 5
    assert [x for x, _ in target.marks] == [2, 3, 4, 5]  # in the order sent
    assert target.marks[1][1]  # (3 came behind 2's task: a task of its own)
    c.close()
    server.close()


async def test_a_notification_gets_no_reply_and_runs_in_order_even_when_it_fails():
    """``notify`` is one way: the server makes the call (in its turn among the
    connection's calls) and sends nothing back, so neither side pays for a reply; a
    notification that raises is dropped at the server (logged), the connection and the
    calls after it unharmed. Several notifications queued behind a running call all
    run, in the order sent."""
    target, server, ep = await _serve()
    c = RpcClient(ep)
    assert await c.call("mark", 0) == 0
    conn = rpc_ready(c)
    got: list = []
    on_frame = conn._on_frame
    conn._on_frame = lambda req_id, load: (got.append(req_id), on_frame(req_id, load))
    target.marks.clear()
    task = asyncio.ensure_future(c.call("hang", "held"))
    await target.started.wait()  # a call still running: what follows queues behind it
    assert c.notify("mark", 1) and c.notify("fail", [9]) and c.notify("mark", 2)
    assert c.notify("mark_async", 3) and c.notify("mark", 4)
    assert len(conn.waiting) == 1  # (only the hang waits for a reply)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if len(target.marks) == 4:
            break
    assert [x for x, _ in target.marks] == [1, 2, 3, 4]
    served = next(iter(server._conns))
    assert set(served.running) == {next(iter(conn.waiting))}  # (the hang: nothing else left)
    assert await c.call("add", 5) == 5
    assert len(got) == 1  # the reply to add: none came for the notifications
    task.cancel()
    c.close()
    server.close()


async def test_big_arrays_travel_out_of_band_byte_for_byte():
    import numpy as np

    _, _, ep = await _serve()
    c = RpcClient(ep)
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, 8 << 20, dtype=np.uint8)  # 8 MiB
    small = rng.standard_normal(3)
    strided = rng.standard_normal((64, 64))[:, ::2]  # not contiguous: pickled in the body
    out = await c.call("echo", big, b"raw", small, strided, [big[:10]])
    assert np.array_equal(out[0], big) and out[1] == b"raw"
    assert np.array_equal(out[2], small) and np.array_equal(out[3], strided)
    assert np.array_equal(out[4][0], big[:10])
    c.close()


def _boom():
    raise ValueError("cannot be rebuilt here")


class Unloadable:
    """Pickles, but cannot be unpickled (like a class the other process cannot import)."""

    def __reduce__(self):
        return (_boom, ())


async def test_a_call_that_cannot_be_unpickled_fails_alone():
    _, _, ep = await _serve()
    c = RpcClient(ep)
    with pytest.raises(ValueError, match="rebuilt"):
        await c.call("echo", Unloadable())
    assert await c.call("add", 1, 2) == 3  # the connection lives on
    with pytest.raises(TransportError, match="unpickled"):
        await c.call("echo_unloadable")
    assert await c.call("add", 2, 2) == 4
    c.close()


async def test_a_wrong_token_gets_no_service():
    _, _, (host, port, token) = await _serve()
    bad = RpcClient((host, port, bytes(32)))
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(bad.call("add", 1), 5)
    good = RpcClient((host, port, token))
    assert await good.call("add", 1) == 1
    good.close()


async def test_a_client_on_the_servers_machine_connects_by_its_unix_socket(path):
    """On Linux a client of the server's machine connects by the Unix socket of the
    abstract namespace that the endpoint names (a lighter message for the kernel than
    TCP loopback); with none to connect to, by TCP, and the calls are the same."""
    import socket
    import sys

    from streamrl.transport import rpc

    _, server, ep = await _serve()
    c = RpcClient(ep)
    assert await c.call("add", 1, 2) == 3
    local = path == "local" and sys.platform.startswith("linux")
    assert _family(c) == (socket.AF_UNIX if local else socket.AF_INET)
    assert (server._local is not None) == local
    if not local:
        return
    # the name is the endpoint's, and does not show the token
    assert rpc.local_name(ep[2]).startswith("\0streamrl-rpc-")
    assert ep[2].hex() not in rpc.local_name(ep[2])
    assert rpc.local_name(ep[2]) != rpc.local_name(bytes(32))
    # the Unix listener gone (as on a machine where it could not be made): TCP
    server._local.close()
    await server._local.wait_closed()
    c2 = RpcClient(ep)
    assert await c2.call("add", 2, 2) == 4
    assert _family(c2) == socket.AF_INET
    assert await c.call("add", 3, 3) == 6  # (the open connection lives on)
    c.close()
    c2.close()
    server.close()


async def test_a_call_cancelled_while_its_connection_opens_leaves_one_connection(path):
    """A call cancelled at any step of opening its connection (the Unix socket's or
    TCP's) raises at once; the opening goes on, and the next call uses that connection:
    one connection a client, none left half open."""
    _, server, ep = await _serve()
    for steps in range(6):
        c = RpcClient(ep)
        call = asyncio.ensure_future(c.call("add", 1))
        for _ in range(steps):
            await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await asyncio.wait_for(c.call("add", 2), 5) == 2
        assert await asyncio.wait_for(c.call("add", 3), 5) == 3
        assert len(server._conns) == 1
        c.close()
        for _ in range(100):  # (a closed connection leaves the server's set)
            if not server._conns:
                break
            await asyncio.sleep(0.01)
        assert not server._conns
    server.close()


async def test_a_wrong_token_on_the_unix_socket_gets_no_service(path):
    """Whoever finds the Unix socket (any process of the machine can list the abstract
    namespace) must still present the token: a wrong one is cut off, unserved."""
    import socket
    import sys

    from streamrl.transport import rpc
    from streamrl.transport.rpc import _frame

    if path != "local" or not sys.platform.startswith("linux"):
        pytest.skip("the Unix socket is Linux's, and this run connects by TCP")
    target, server, ep = await _serve()
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.connect(rpc.local_name(ep[2]))
    await loop.sock_sendall(sock, bytes(32) + b"".join(
        bytes(p) for p in _frame(0, ("hang", (), {}))))
    assert await asyncio.wait_for(loop.sock_recv(sock, 64), 5) == b""  # closed, no reply
    assert not target.started.is_set()
    sock.close()
    server.close()


async def test_a_closed_connection_cancels_its_running_calls():
    target, _, ep = await _serve()
    c = RpcClient(ep)
    call = asyncio.ensure_future(c.call("hang", rid="r1"))
    await asyncio.wait_for(target.started.wait(), 5)
    c.close()  # the client goes away with the call still running
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(call, 5)
    for _ in range(100):
        if target.cancelled:
            break
        await asyncio.sleep(0.01)
    assert target.cancelled == ["r1"]


async def test_calls_fail_fast_once_the_server_is_gone():
    target = Target()
    server = RpcServer(target, "127.0.0.1")
    ep = await server.start()
    c = RpcClient(ep)
    assert await c.call("add", 1) == 1
    pending = asyncio.ensure_future(c.call("hang"))
    await asyncio.wait_for(target.started.wait(), 5)
    server.close()  # drops the connections, as the server's process dying would
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(pending, 5)
    with pytest.raises(ConnectionError):  # and no new connection either
        await asyncio.wait_for(c.call("add", 1), 5)


def _chunked_frames(sizes_per_frame, cuts, whole=False):
    """Frames of arrays of the given sizes, fed to a receiving end in chunks of the
    given sizes (as a socket might deliver them); what that end parsed. ``whole``: the
    end hands over frames it holds whole in one step, as the channel's ends do (see
    ``_Protocol._whole``); else every frame goes through the parser piece by piece."""
    import numpy as np

    from streamrl.transport.rpc import _frame, _frames, _Protocol

    rng = np.random.default_rng(len(cuts))
    sent = [[rng.integers(0, 255, k, dtype=np.uint8) for k in sizes]
            for sizes in sizes_per_frame]
    stream = b"".join(bytes(p) for i, arrs in enumerate(sent) for p in _frame(i, arrs))
    got: list = []
    end = _Protocol()
    on_frame = lambda req_id, load: got.append((req_id, load()))  # noqa: E731
    if whole:
        end.parse_frames(on_frame)
    else:
        end.parse(_frames(on_frame))
    pos, i = 0, 0
    while pos < len(stream):
        buf = end.get_buffer(-1)
        n = min(len(buf), cuts[i % len(cuts)], len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        end.buffer_updated(n)
        pos, i = pos + n, i + 1
    return sent, got


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 1, 100, DIRECT - 1, DIRECT, DIRECT + 3, 300_000]),
                         max_size=5), min_size=1, max_size=4),
       st.lists(st.integers(1, 400_000), min_size=1, max_size=8))
@example([[DIRECT - 1] * 5, [100] * 3], [400_000])  # a piece left at the stage's end
@example([[DIRECT - 1] * 5], [7, 1000, 200_000])
@example([[1, 100], [], [3]], [400_000])  # small frames, all in the stage at once
@example([[100] * 3, [1]], [24, 10, 3000])  # a frame's header, then the rest of it
@pytest.mark.parametrize("whole", [False, True])
def test_frames_arrive_whole_however_the_stream_is_cut(whole, sizes_per_frame, cuts):
    """The receiving end gets every frame byte for byte whatever chunks the bytes come in:
    small pieces through its staging buffer, big ones received in place; with frames
    held whole handed over in one step or not."""
    import numpy as np

    sent, got = _chunked_frames(sizes_per_frame, cuts, whole)
    assert [r for r, _ in got] == list(range(len(sent)))
    for arrs, (_, back) in zip(sent, got):
        assert len(back) == len(arrs)
        assert all(np.array_equal(a, b) for a, b in zip(arrs, back))


def test_a_frame_of_small_buffers_is_one_piece_and_big_buffers_are_not_copied():
    """A frame whose out-of-band buffers are small (a one-row put's tensors) goes out as
    one piece: one write, not one per buffer. Big buffers stay pieces of their own, the
    array's own memory (no copy into the frame)."""
    import numpy as np

    from streamrl.transport.rpc import _frame

    small = [np.arange(256, dtype=np.int64), np.ones(1, dtype=np.float32)]
    assert len(_frame(1, small)) == 1
    assert len(_frame(2, ("put", (1, 2), {}))) == 1
    big = np.arange(DIRECT, dtype=np.uint8)
    pieces = _frame(3, [big, small[1]])
    assert len(pieces) == 3
    assert np.shares_memory(np.frombuffer(pieces[1], dtype=np.uint8), big)
    _, got = _chunked_frames([[100, 3], [DIRECT + 3, 1]], [1 << 20])
    assert [len(a) for _, arrs in got for a in arrs] == [100, 3, DIRECT + 3, 1]


def test_a_frame_held_whole_is_handed_over_without_the_parser():
    """Frames of small pieces that arrive whole (a call's usual frame) are handed over
    in one step, the parser untouched; a frame cut after its header, or with a big
    piece, goes through the parser; and the two interleave in order."""
    import numpy as np

    from streamrl.transport.rpc import _frame, _Protocol

    got: list = []
    end = _Protocol()
    end.parse_frames(lambda req_id, load: got.append((req_id, load())))
    steps = 0
    inner, first = end._parser, end._want  # (the parser, started: it wants a header)

    def counted():
        nonlocal steps
        want = first
        while True:
            piece = yield want
            steps += 1
            want = inner.send(piece)

    end.parse(counted())
    arrs = [np.arange(256, dtype=np.int64), np.ones(1)]
    frames = [b"".join(bytes(p) for p in _frame(i, arrs)) for i in range(3)]
    big = b"".join(bytes(p) for p in _frame(3, [np.zeros(DIRECT, np.uint8)]))

    def feed(data):
        buf = end.get_buffer(-1)
        buf[:len(data)] = data
        end.buffer_updated(len(data))

    feed(frames[0] + frames[1])
    assert [r for r, _ in got] == [0, 1] and steps == 0
    # each array its own memory, aligned for its dtype (a tensor over it needs no copy)
    assert all(a.ctypes.data % 8 == 0 for _, arrs in got for a in arrs)
    feed(frames[2][:30])  # the header and a little: the parser takes it from here
    assert steps > 0 and len(got) == 2
    feed(frames[2][30:])
    assert [r for r, _ in got] == [0, 1, 2]
    before = steps
    feed(big)  # a big piece: the parser receives it in place
    assert steps > before and [r for r, _ in got] == [0, 1, 2, 3]
    feed(frames[0])
    assert [r for r, _ in got] == [0, 1, 2, 3, 0]
    assert all(np.array_equal(a, b) for a, b in zip(arrs, got[4][1]))
    assert len(got[3][1][0]) == DIRECT


def test_a_frames_big_buffers_share_one_aligned_allocation():
    """From POOL bytes on, a frame's big buffers are received into one allocation (huge
    pages where the kernel allows), each 64-byte aligned; small ones stay apart."""
    import numpy as np

    from streamrl.transport.rpc import POOL

    k = POOL // 2 + 5
    sent, got = _chunked_frames([[k, 10, k]], [1 << 20])
    a, small, b = got[0][1]
    assert np.array_equal(a, sent[0][0]) and np.array_equal(b, sent[0][2])
    assert a.base is not None and np.shares_memory(a.base, b)
    assert b.ctypes.data % 64 == 0 and not np.shares_memory(small, a.base)


async def test_a_big_pickle_body_is_received_whole():
    """Bytes and strings travel in the pickle body itself; a body of DIRECT bytes or more
    is received in place like a big buffer."""
    _, _, ep = await _serve()
    c = RpcClient(ep)
    big = b"x" * (5 * DIRECT) + bytes(range(256))
    out = await c.call("echo", big, "é" * DIRECT)
    assert out == (big, "é" * DIRECT)
    c.close()


def test_request_ids_are_unique_in_a_process_and_in_a_forked_child():
    """Request ids (a put's, for taking it back if its producer is cancelled) name one
    call across processes: a counter under a per-process prefix, drawn anew in a forked
    child (which would otherwise repeat its parent's ids)."""
    import os

    pytest.importorskip("ray")
    from streamrl.transport.ray.calls import request_id

    ids = [request_id() for _ in range(1000)]
    assert len(set(ids)) == len(ids)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(w, "\n".join(request_id() for _ in range(10)).encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 1 << 16).decode().split("\n")
    os.close(r)
    os.waitpid(pid, 0)
    theirs = [request_id() for _ in range(10)]
    assert len(child) == 10 and not set(child) & set(ids + theirs)
