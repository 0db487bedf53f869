"""What one controller call costs the Ray controller, against what any message costs a
process on this machine (issue 16's controller target).

Run: python benchmarks/controller_calls.py [--rows 20000] [--per-call 1,4,16,64]

The controller actor alone, with nothing else busy: the driver plays four storage units
that send ``put_rows`` (the call a unit makes for each small put it admits) over the
controller's socket channel, four calls in flight at a time, each with ``k`` one-row
samples' metadata (``k`` = rows per call), while a consumer in the driver streams and
acknowledges batches of 64 (no bytes are stored or read: the rows are metadata only, so
only the controller's work is measured). Two floors are measured in the same run:

* ``ping``: the controller actor's own ``ping`` over the same channel (a call that does
  nothing): what the channel costs the controller per call;
* ``echo``: a bare uvloop echo server in another async Ray actor, driven the same way
  (four clients, one message in flight each): what receiving and answering one small
  message costs any process here (system calls, wake-ups, the event loop), with no
  streamrl code at all.

Reported: the controller's CPU time per row (``time.process_time()`` of the actor's
process, every thread, over the timed window), per call for the floors, and rows/s.
``bare_us_per_row``: the same calls on a bare controller in the driver (its state
machine alone: no actor, no messages), measured before Ray starts, and
``state_machine_share``, its share of the actor's CPU per row: what a faster state
machine (issue 16's bare-controller target) could take off the controller of a Ray
deployment at most.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from small_puts_ray import _init_ray, _proc_cpu  # noqa: E402 - (this folder, just added)

UNITS = 4  # calls in flight (one per simulated storage unit)
CAPACITY = 16384  # the queue's rows
BATCH = 64


class _Echo:
    """A bare uvloop echo server in an async actor."""

    async def start(self) -> int:
        loop = asyncio.get_running_loop()

        class Echo(asyncio.Protocol):
            def connection_made(self, t):
                self.t = t

            def data_received(self, d):
                self.t.write(d)

        self.server = await loop.create_server(Echo, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


async def _echo_case(ray, n: int) -> float:
    """CPU of the echo actor per message (us)."""
    actor = ray.remote(num_cpus=0)(_Echo).remote()
    port = await actor.start.remote()
    loop = asyncio.get_running_loop()

    class Client(asyncio.Protocol):
        fut: asyncio.Future | None = None

        def connection_made(self, t):
            self.t = t

        def data_received(self, d):
            if self.fut is not None and not self.fut.done():
                self.fut.set_result(d)

    conns = [await loop.create_connection(Client, "127.0.0.1", port) for _ in range(UNITS)]
    msg = b"x" * 128

    async def one(t, p, k):
        for _ in range(k):
            p.fut = loop.create_future()
            t.write(msg)
            await p.fut

    await asyncio.gather(*[one(t, p, 100) for t, p in conns])  # warm
    c0 = await _proc_cpu(actor)
    await asyncio.gather(*[one(t, p, n // UNITS) for t, p in conns])
    c1 = await _proc_cpu(actor)
    for t, _ in conns:
        t.close()
    ray.kill(actor)
    return (c1 - c0) / (n // UNITS * UNITS) * 1e6


async def _controller_cases(ray, rows: int, per_call: tuple[int, ...]) -> dict:
    import streamrl
    from streamrl.transport.ray.control import RayControl

    out: dict = {}
    # (room for every unit's call in flight and the consumer's lag at 256 rows a call:
    # a call answered BUSY, the queue full, is sent again and costs the controller a
    # call more; ``busy_calls`` counts them)
    q = streamrl.StreamQueue(transport="ray", capacity=CAPACITY, num_shards=UNITS,
                             consumers=["t"])
    try:
        await q.stats()
        ctl = q._transport._controller
        mine, _units = await ctl.endpoints.remote()
        rc = RayControl(None, mine)  # a storage unit's client: the socket channel only
        assert rc.rpc is not None

        async def pings(k):
            for _ in range(k):
                await rc.rpc.call("ping")

        await asyncio.gather(*[pings(100) for _ in range(UNITS)])  # warm
        c0 = await _proc_cpu(ctl)
        t0 = time.perf_counter()
        await asyncio.gather(*[pings(rows // UNITS) for _ in range(UNITS)])
        dt = time.perf_counter() - t0
        c1 = await _proc_cpu(ctl)
        n = rows // UNITS * UNITS
        out["ping"] = {"us_per_call": (c1 - c0) / n * 1e6, "calls_per_s": n / dt}

        fields = ("tokens", "reward")
        dtypes = {"tokens": "int64", "reward": "float32"}
        for k in per_call:
            part = f"k{k}"
            calls = rows // (UNITS * k)
            n = calls * UNITS * k
            got = 0
            busy = 0

            async def consume():
                nonlocal got
                async for mb in q.stream("t", list(fields), BATCH, partition=part,
                                         timeout=600):
                    got += len(mb)  # (acked when the next batch is asked for)

            async def unit(shard: int, start: int):
                nonlocal busy
                for c in range(calls):
                    ids = list(range(start + c * k, start + (c + 1) * k))
                    nbytes = {"tokens": [2048] * k, "reward": [4] * k}
                    while True:
                        ans = await rc.put_rows(part, fields, ids, shard, nbytes, None, None,
                                                dtypes)
                        if ans.status.name != "BUSY":  # BUSY: the queue is full, again
                            break
                        busy += 1
                        await asyncio.sleep(0.001)
                    assert ans.status.name == "OK", ans

            starts = [(await rc.unit_ids(s, calls * k))[0] for s in range(UNITS)]
            consumer = asyncio.ensure_future(consume())
            await asyncio.sleep(0.2)  # the consumer waits first
            c0 = await _proc_cpu(ctl)
            t0 = time.perf_counter()
            await asyncio.gather(*[unit(s, starts[s]) for s in range(UNITS)])
            await q.seal(part)
            await consumer
            dt = time.perf_counter() - t0
            c1 = await _proc_cpu(ctl)
            assert got == n, (got, n)
            out[f"put_rows_{k}"] = {"rows_per_call": k, "rows": n,
                                    "us_per_row": (c1 - c0) / n * 1e6,
                                    "us_per_call": (c1 - c0) / (n / k) * 1e6,
                                    "rows_per_s": n / dt, "busy_calls": busy}
        st = await q.stats()
        out["left_rows"] = st.rows
    finally:
        await q.shutdown()
    return out


def _bare(rows: int, k: int) -> float:
    """CPU per row (us) of the same controller calls on a bare :class:`Controller` in
    this process (no actor, no messages): four units' ``k``-row ``put_rows``
    (``admit_stored`` under ids leased up front), each followed by the takes of 64 rows
    it allows and their acks, as the actor case's consumer does."""
    from streamrl.controller import Controller
    from streamrl.messages import Request

    c = Controller(CAPACITY, num_shards=UNITS, consumers=["t"])
    req = Request("t", ("tokens", "reward"), BATCH, partition="p")
    calls = rows // (UNITS * k)
    starts = [c.unit_ids(s, calls * k)[0] for s in range(UNITS)]
    dtypes = {"tokens": "int64", "reward": "float32"}
    t0 = time.process_time()
    for i in range(calls):
        for s in range(UNITS):
            first = starts[s] + i * k
            c.admit_stored("p", list(range(first, first + k)), s,
                           {"tokens": [2048] * k, "reward": [4] * k}, dtypes=dtypes)
            while (d := c.take(req)) is not None:
                c.ack([d.lease])
                c.drain()
    return (time.process_time() - t0) / (calls * UNITS * k) * 1e6


async def run(rows: int = 20_000, per_call: tuple[int, ...] = (1, 4, 16, 64)) -> dict:
    """Every case (see the module docstring); a dict of results and ratios."""
    bare = {k: _bare(rows, k) for k in per_call}  # (before Ray starts: its processes take CPU)
    ray = _init_ray()
    try:
        out = await _controller_cases(ray, rows, per_call)
        out["echo"] = {"us_per_msg": await _echo_case(ray, rows)}
    finally:
        ray.shutdown()
    echo = out["echo"]["us_per_msg"]
    out["summary"] = {
        "echo_us_per_msg": echo,
        "ping_us_per_call": out["ping"]["us_per_call"],
        "controller_us_per_row": {k: out[f"put_rows_{k}"]["us_per_row"] for k in per_call},
        "controller_per_row_over_echo": {k: out[f"put_rows_{k}"]["us_per_row"] / echo
                                         for k in per_call},
        # the same calls' state-machine work alone, and its share of the actor's CPU
        "bare_us_per_row": bare,
        "state_machine_share": {k: bare[k] / out[f"put_rows_{k}"]["us_per_row"]
                                for k in per_call},
        "target_us_per_row": 20.0,
    }
    return out


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--per-call", default="1,4,16,64")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = asyncio.run(run(a.rows, tuple(int(x) for x in a.per_call.split(","))))
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
