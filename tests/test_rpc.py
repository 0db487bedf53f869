"""The socket channel the Ray transport uses for its actors' calls (streamrl.transport.rpc),
tested in one process: no Ray needed."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.errors import RowsDropped, TransportError
from streamrl.transport.rpc import RpcClient, RpcServer


class Target:
    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled: list = []

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
