"""What one round trip between two processes costs each side on this machine: the
library's socket channel (``streamrl.transport.rpc``, uvloop) against a bare blocking
TCP socket (issue 16: the Ray one-put-at-a-time case).

Run: python benchmarks/rpc_floor.py [--calls 20000] [--reps 3]

A server process answers a client process, one call in flight (as a producer that
awaits each put does):

* ``rpc``: ``RpcClient.call("ping", payload)`` to an ``RpcServer`` whose ``ping``
  returns its argument; the payload is what a one-row put carries (int64 tokens[256]
  and a float). Both processes are on one machine, so on Linux the call goes over the
  server's Unix socket, as the Ray transport's calls between the actors of a node do;
* ``rpc_put``: the call a producer makes to a storage unit for a one-row put
  (``put_rows`` with the producer's arguments: the row's two tensors in wire form, its
  sizes, dtypes and request id), answered with the tuple a unit answers it with. The
  ``rpc`` case's payload is numpy arrays, which this library's calls never pickle
  (tensors travel as :class:`~streamrl.wire.WireTensor`), and costs each side more;
* ``rpc_tcp``: the same by TCP (``streamrl.transport.rpc.LOCAL`` off in both
  processes), as between machines;
* ``raw``: 32 bytes sent and echoed over a blocking socket with ``TCP_NODELAY`` (no
  event loop, no pickling): what the kernel and the wake-ups alone cost;
* ``raw_unix`` (Linux): the same over a Unix socket of the abstract namespace;
* ``loop_unix`` (Linux): what an event loop adds to that: a bare ``asyncio.Protocol``
  echo on uvloop at both ends, over the same kind of socket, sending as many bytes as
  the ``rpc_put`` case's call frame (no pickling, no framing, no futures but the one the
  client awaits). The least a call between two event-loop processes (a producer and a
  storage unit, a unit and the controller) can cost each side here, whatever the
  library does;
* ``loop_inproc`` and ``rpc_put_inproc``: ``loop_unix`` and ``rpc_put`` with both ends
  in this one process, on one event loop: nothing sleeps and wakes, so the difference
  to the two-process cases is what waking processes costs (reported as the client's
  CPU: both ends; the server's is 0);
* ``call_paced`` and ``notify_paced``: a small report (``{"inline": 65664}``, as a
  process's report of bytes moved) every 1 ms, as a call awaited for its reply, and
  as a notification (``RpcClient.notify``: no reply). Each arrives alone, as such
  reports do; the difference in the server's CPU a message is what a reply costs it.

Reported per case: wall time a round trip, and CPU time a round trip of each side
(``time.process_time()`` of each process, every thread, over the timed calls). A
one-row put on Ray is two such round trips (producer <-> storage unit, unit <->
controller), so these bound what the whole path can cost per row from below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import numpy as np

try:
    import uvloop
except ImportError:  # (the library runs without it too)
    uvloop = None


class _Echo:
    def ping(self, x):
        return x

    def report(self, d):
        pass  # (the channel's cost is what is measured, not the work a report causes)

    def put_rows(self, *args):
        return _PUT_ANSWER


#: a storage unit's answer to a one-row put: admitted, its row id (PutAnswer.to_wire())
_PUT_ANSWER = ("ok", None, [12345], ({}, frozenset(), {}), False)


def _put_args() -> tuple:
    """What a producer's one-row put sends its storage unit (``put_rows``'s arguments):
    int64 tokens[256] and a float reward in wire form, their sizes and dtypes."""
    import torch

    from streamrl.transport.ray.wire import to_wire

    wire = to_wire({"tokens": torch.full((1, 256), 3, dtype=torch.int64),
                    "reward": torch.tensor([1.0])})
    return (1, wire, "p", ["tokens", "reward"], {"tokens": [2048], "reward": [4]}, {},
            None, "3f9c1a2b-17", {"tokens": "int64", "reward": "float32"}, False)


def _run(coro):
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


def _rpc_server(out: mp.Queue, ask: mp.Queue, local: bool = True) -> None:
    from streamrl.transport import rpc
    from streamrl.transport.rpc import RpcServer

    rpc.LOCAL = rpc.LOCAL and local

    async def main():
        server = RpcServer(_Echo(), "127.0.0.1")
        out.put(await server.start())
        loop = asyncio.get_running_loop()
        while True:  # answers "cpu" requests with its CPU time so far
            what = await loop.run_in_executor(None, ask.get)
            if what is None:
                return
            out.put(time.process_time())

    _run(main())


async def _paced_client(endpoint, calls: int, notify: bool) -> tuple[float, float]:
    from streamrl.transport.rpc import RpcClient

    c = RpcClient(endpoint)
    report = {"inline": 65664}
    for _ in range(200):  # (connected and warm)
        await c.call("report", report)
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        if notify:
            c.notify("report", report)
        else:
            await c.call("report", report)
        await asyncio.sleep(0.001)
    await c.call("report", report)  # (every notification was made before this returns)
    return time.process_time() - t0, time.perf_counter() - w0


async def _rpc_client(endpoint, calls: int, payload, method: str = "ping"
                      ) -> tuple[float, float]:
    from streamrl.transport.rpc import RpcClient

    c = RpcClient(endpoint)
    args = payload if method == "put_rows" else (payload,)
    for _ in range(500):  # (connected and warm)
        await c.call(method, *args)
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await c.call(method, *args)
    return time.process_time() - t0, time.perf_counter() - w0


def rpc_case(calls: int, local: bool = True, paced: str | None = None,
             put: bool = False) -> dict:
    """``paced``: ``"call"`` or ``"notify"`` (the paced report cases); ``put``: a
    producer's one-row ``put_rows``; else a ping."""
    from streamrl.transport import rpc

    payload = _put_args() if put else {"tokens": np.zeros(256, np.int64), "reward": 1.0}
    out, ask = mp.Queue(), mp.Queue()
    was, rpc.LOCAL = rpc.LOCAL, rpc.LOCAL and local
    p = mp.Process(target=_rpc_server, args=(out, ask, local), daemon=True)
    p.start()
    endpoint = out.get()
    ask.put("cpu")
    s0 = out.get()
    cpu, wall = _run(_paced_client(endpoint, calls, paced == "notify") if paced
                     else _rpc_client(endpoint, calls, payload, "put_rows" if put else "ping"))
    ask.put("cpu")
    s1 = out.get()
    ask.put(None)
    p.join(10)
    rpc.LOCAL = was
    return {"wall_us": wall / calls * 1e6, "client_cpu_us": cpu / calls * 1e6,
            "server_cpu_us": (s1 - s0) / calls * 1e6}


def _raw_server(out: mp.Queue, calls: int, unix: str | None = None) -> None:
    ls = socket.socket(socket.AF_UNIX) if unix else socket.socket()
    ls.bind(unix or ("127.0.0.1", 0))
    ls.listen(1)
    out.put(ls.getsockname() if unix else ls.getsockname()[1])
    c, _ = ls.accept()
    if not unix:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(500):
        c.sendall(c.recv(64))
    t0 = time.process_time()
    for _ in range(calls):
        c.sendall(c.recv(64))
    out.put(time.process_time() - t0)


def raw_case(calls: int, unix: bool = False) -> dict:
    out = mp.Queue()
    name = f"\0streamrl-rpc-floor-{os.getpid()}-{time.monotonic_ns()}" if unix else None
    p = mp.Process(target=_raw_server, args=(out, calls, name), daemon=True)
    p.start()
    if unix:
        c = socket.socket(socket.AF_UNIX)
        c.connect(out.get())
    else:
        c = socket.create_connection(("127.0.0.1", out.get()))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * 32
    for _ in range(500):
        c.sendall(msg)
        c.recv(64)
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        c.sendall(msg)
        c.recv(64)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    server = out.get()
    p.join(10)
    return {"wall_us": wall / calls * 1e6, "client_cpu_us": cpu / calls * 1e6,
            "server_cpu_us": server / calls * 1e6}


class _EchoProtocol(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(data)


def _loop_server(out: mp.Queue, ask: mp.Queue, name: str) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(name)
        sock.setblocking(False)
        server = await loop.create_unix_server(_EchoProtocol, sock=sock)
        out.put("ready")
        while True:  # answers "cpu" requests with its CPU time so far
            what = await loop.run_in_executor(None, ask.get)
            if what is None:
                server.close()
                return
            out.put(time.process_time())

    _run(main())


class _WaitProtocol(asyncio.Protocol):
    """The client's end: resolves ``fut`` once ``want`` bytes came back."""

    fut: asyncio.Future | None = None
    want = got = 0

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.got += len(data)
        if self.got >= self.want and self.fut is not None:
            self.fut.set_result(None)


async def _echo_client(name: str, size: int):
    """A bare echo's client end, connected to the Unix socket ``name``: ``(one,
    close)``, where ``await one()`` sends ``size`` bytes and waits for them back."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(name)
    sock.setblocking(False)
    transport, proto = await loop.create_unix_connection(_WaitProtocol, sock=sock)
    msg = b"x" * size

    async def one():
        proto.fut, proto.want, proto.got = loop.create_future(), size, 0
        transport.write(msg)
        await proto.fut

    return one, transport.close


async def _timed(one, calls: int) -> tuple[float, float]:
    """(CPU, wall) seconds of ``calls`` awaits of ``one()``, after 500 to warm up."""
    for _ in range(500):
        await one()
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await one()
    return time.process_time() - t0, time.perf_counter() - w0


async def _loop_client(name: str, calls: int, size: int) -> tuple[float, float]:
    one, close = await _echo_client(name, size)
    try:
        return await _timed(one, calls)
    finally:
        close()


def loop_case(calls: int) -> dict:
    """The ``loop_unix`` case (see the module's docstring)."""
    from streamrl.transport.rpc import _frame

    size = sum(len(p) for p in _frame(0, ("put_rows", _put_args(), {})))
    name = f"\0streamrl-loop-floor-{os.getpid()}-{time.monotonic_ns()}"
    out, ask = mp.Queue(), mp.Queue()
    p = mp.Process(target=_loop_server, args=(out, ask, name), daemon=True)
    p.start()
    out.get()
    ask.put("cpu")
    s0 = out.get()
    cpu, wall = _run(_loop_client(name, calls, size))
    ask.put("cpu")
    s1 = out.get()
    ask.put(None)
    p.join(10)
    return {"wall_us": wall / calls * 1e6, "client_cpu_us": cpu / calls * 1e6,
            "server_cpu_us": (s1 - s0) / calls * 1e6}


async def _inproc(calls: int, rpc: bool) -> tuple[float, float]:
    """Both ends in this process on one loop: the channel's ``put_rows`` round trip
    (``rpc``) or the bare echo of as many bytes; (CPU, wall) seconds of ``calls``."""
    from streamrl.transport.rpc import RpcClient, RpcServer, _frame

    args = _put_args()
    if rpc:
        server = RpcServer(_Echo(), "127.0.0.1")
        client = RpcClient(await server.start())

        async def one():
            await client.call("put_rows", *args)

        close = server.close
    else:
        loop = asyncio.get_running_loop()
        name = f"\0streamrl-loop-inproc-{os.getpid()}-{time.monotonic_ns()}"
        lsock = socket.socket(socket.AF_UNIX)
        lsock.bind(name)
        lsock.setblocking(False)
        listener = await loop.create_unix_server(_EchoProtocol, sock=lsock)
        one, close_client = await _echo_client(
            name, sum(len(p) for p in _frame(0, ("put_rows", args, {}))))

        def close():
            close_client()
            listener.close()
    try:
        return await _timed(one, calls)
    finally:
        close()


def inproc_case(calls: int, rpc: bool) -> dict:
    """The ``loop_inproc`` / ``rpc_put_inproc`` cases (see the module's docstring)."""
    cpu, wall = _run(_inproc(calls, rpc))
    return {"wall_us": wall / calls * 1e6, "client_cpu_us": cpu / calls * 1e6,
            "server_cpu_us": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default=None,
                    help="comma-separated names of the cases to run (default: all)")
    args = ap.parse_args()
    unix = sys.platform.startswith("linux")
    cases = {"rpc": lambda: rpc_case(args.calls), "rpc_put": lambda: rpc_case(args.calls, put=True),
             "rpc_tcp": lambda: rpc_case(args.calls, False),
             "raw": lambda: raw_case(args.calls)}
    if unix:
        cases["raw_unix"] = lambda: raw_case(args.calls, True)
        cases["loop_unix"] = lambda: loop_case(args.calls)
        cases["loop_inproc"] = lambda: inproc_case(args.calls, False)
    cases["rpc_put_inproc"] = lambda: inproc_case(args.calls, True)
    paced = max(1000, args.calls // 4)
    cases["call_paced"] = lambda: rpc_case(paced, paced="call")
    cases["notify_paced"] = lambda: rpc_case(paced, paced="notify")
    if args.cases:
        keep = args.cases.split(",")
        unknown = [c for c in keep if c not in cases]
        if unknown:
            ap.error(f"unknown case(s) {unknown}; cases: {', '.join(cases)}")
        cases = {name: cases[name] for name in keep}
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(args.reps):  # (the cases alternate)
        for name, case in cases.items():
            runs[name].append(case())
    result: dict = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                    for name, rs in runs.items()}

    def cpu(name: str) -> float:
        return result[name]["client_cpu_us"] + result[name]["server_cpu_us"]

    for name in runs:
        r = result[name]
        print(f"{name}: {r['wall_us']:.1f} us wall a round trip; CPU client "
              f"{r['client_cpu_us']:.1f} us, server {r['server_cpu_us']:.1f} us "
              f"(medians of {args.reps})")
    def have(*names: str) -> bool:
        return all(n in result for n in names)

    if have("rpc_tcp", "raw", "rpc"):
        result["rpc_tcp_over_raw_cpu"] = cpu("rpc_tcp") / cpu("raw")
        result["rpc_over_rpc_tcp_cpu"] = cpu("rpc") / cpu("rpc_tcp")
        print(f"rpc_tcp / raw, CPU of both sides: {result['rpc_tcp_over_raw_cpu']:.2f}x; "
              f"rpc (same machine: {'Unix socket' if unix else 'TCP'}) / rpc_tcp: "
              f"{result['rpc_over_rpc_tcp_cpu']:.2f}x")
    if have("rpc", "raw_unix"):
        result["rpc_over_raw_unix_cpu"] = cpu("rpc") / cpu("raw_unix")
        print(f"rpc / raw_unix, CPU of both sides: {result['rpc_over_raw_unix_cpu']:.2f}x")
    if have("rpc_put", "loop_unix"):
        result["rpc_put_over_loop_unix_cpu"] = cpu("rpc_put") / cpu("loop_unix")
        print(f"rpc_put / loop_unix (the event loop's floor), CPU of both sides: "
              f"{result['rpc_put_over_loop_unix_cpu']:.2f}x")
        # issue 16: 10,000 one-row puts/s from producers that await each put, on this
        # machine's cores (2 here), is 200 us of CPU a row in all processes together. A
        # put makes two round trips (producer <-> storage unit, unit <-> controller; the
        # second may carry several puts that arrive together) before the consumer's
        # share; at the event loop's floor, with no library code at all, they cost:
        floor, chan = 2 * cpu("loop_unix"), 2 * cpu("rpc_put")
        result["one_row_put_floor_us"] = floor
        result["one_row_put_channel_us"] = chan
        cores = os.cpu_count() or 1
        print(f"a one-row put's two round trips, CPU of all sides: {floor:.0f} us at the "
              f"event loop's floor, {chan:.0f} us by this channel (issue 16's 10,000 "
              f"rows/s on {cores} cores: {cores / 1e4 * 1e6:.0f} us a row for everything)")
    if have("loop_unix", "loop_inproc", "rpc_put", "rpc_put_inproc"):
        result["wakeup_share_of_floor"] = 1 - cpu("loop_inproc") / cpu("loop_unix")
        print(f"in one process (nothing sleeps and wakes), both ends: the bare echo "
              f"{cpu('loop_inproc'):.1f} us, the channel's put {cpu('rpc_put_inproc'):.1f} "
              f"us a round trip; between two processes "
              f"{result['wakeup_share_of_floor']:.0%} of the floor is the waking")
    if have("notify_paced", "call_paced"):
        result["notify_over_call_server_cpu"] = (result["notify_paced"]["server_cpu_us"]
                                                 / result["call_paced"]["server_cpu_us"])
        print(f"a report as a notification / as a call, the server's CPU a message: "
              f"{result['notify_over_call_server_cpu']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median": result}, f, indent=2)


if __name__ == "__main__":
    main()
