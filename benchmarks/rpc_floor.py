"""What one round trip between two processes costs each side on this machine: the
library's socket channel (``streamrl.transport.rpc``, uvloop) against a bare blocking
TCP socket (issue 16: the Ray one-put-at-a-time case).

Run: python benchmarks/rpc_floor.py [--calls 20000] [--reps 3]

A server process answers a client process, one call in flight (as a producer that
awaits each put does):

* ``rpc``: ``RpcClient.call("ping", payload)`` to an ``RpcServer`` whose ``ping``
  returns its argument; the payload is what a one-row put carries (int64 tokens[256]
  and a float);
* ``raw``: 32 bytes sent and echoed over a blocking socket with ``TCP_NODELAY`` (no
  event loop, no pickling): what the kernel and the wake-ups alone cost.

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
import socket
import statistics
import time

import numpy as np

try:
    import uvloop
except ImportError:  # (the library runs without it too)
    uvloop = None


class _Echo:
    def ping(self, x):
        return x


def _run(coro):
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)


def _rpc_server(out: mp.Queue, ask: mp.Queue) -> None:
    from streamrl.transport.rpc import RpcServer

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


async def _rpc_client(endpoint, calls: int, payload) -> tuple[float, float]:
    from streamrl.transport.rpc import RpcClient

    c = RpcClient(endpoint)
    for _ in range(500):  # (connected and warm)
        await c.call("ping", payload)
    t0, w0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await c.call("ping", payload)
    return time.process_time() - t0, time.perf_counter() - w0


def rpc_case(calls: int) -> dict:
    payload = {"tokens": np.zeros(256, np.int64), "reward": 1.0}
    out, ask = mp.Queue(), mp.Queue()
    p = mp.Process(target=_rpc_server, args=(out, ask), daemon=True)
    p.start()
    endpoint = out.get()
    ask.put("cpu")
    s0 = out.get()
    cpu, wall = _run(_rpc_client(endpoint, calls, payload))
    ask.put("cpu")
    s1 = out.get()
    ask.put(None)
    p.join(10)
    return {"wall_us": wall / calls * 1e6, "client_cpu_us": cpu / calls * 1e6,
            "server_cpu_us": (s1 - s0) / calls * 1e6}


def _raw_server(out: mp.Queue, calls: int) -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    out.put(ls.getsockname()[1])
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(500):
        c.sendall(c.recv(64))
    t0 = time.process_time()
    for _ in range(calls):
        c.sendall(c.recv(64))
    out.put(time.process_time() - t0)


def raw_case(calls: int) -> dict:
    out = mp.Queue()
    p = mp.Process(target=_raw_server, args=(out, calls), daemon=True)
    p.start()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"rpc": [], "raw": []}
    for _ in range(args.reps):  # (the two cases alternate)
        runs["rpc"].append(rpc_case(args.calls))
        runs["raw"].append(raw_case(args.calls))
    result = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
              for name, rs in runs.items()}
    result["rpc_over_raw_cpu"] = (
        (result["rpc"]["client_cpu_us"] + result["rpc"]["server_cpu_us"])
        / (result["raw"]["client_cpu_us"] + result["raw"]["server_cpu_us"]))
    for name in ("rpc", "raw"):
        r = result[name]
        print(f"{name}: {r['wall_us']:.1f} us wall a round trip; CPU client "
              f"{r['client_cpu_us']:.1f} us, server {r['server_cpu_us']:.1f} us "
              f"(medians of {args.reps})")
    print(f"rpc / raw, CPU of both sides: {result['rpc_over_raw_cpu']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median": result}, f, indent=2)


if __name__ == "__main__":
    main()
