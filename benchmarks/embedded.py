"""Embedded transport benchmark: data path, metadata throughput, wake-up latency.

Run: python benchmarks/embedded.py [--reps 7]

Side by side in one run (ratios, since shared machines are noisy):
  * put + materialize of 1024 rows x 64 KiB and 256 rows x 1 MiB against a plain
    torch copy (clone) of the same bytes; also checks that no byte was copied;
  * metadata throughput: rows/s for put + stream + ack of 16-row batches (tiny rows),
    through the whole async queue and through the bare controller;
  * wake-up latency: a consumer waiting in get() resumes after a producer's put().
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch
import tensordict  # noqa: F401  (streamrl imports it at a process's first materialize;
#                     imported here so that no timed part pays for it)

import streamrl
from streamrl.controller import Controller, Request

KiB, MiB = 1 << 10, 1 << 20


def med(xs):
    return statistics.median(xs)


async def data_path(rows: int, row_bytes: int, reps: int) -> dict:
    n_el = row_bytes // 4
    src = torch.randn(rows, n_el)
    total = src.nbytes
    put_mat, clone = [], []
    zero_copy = True
    for _ in range(reps):
        async with streamrl.StreamQueue(capacity=rows, num_shards=4) as q:
            t0 = time.perf_counter()
            await q.put({"x": src, "k": torch.arange(rows)}, partition="p")
            mb = await q.get("t", ["x"], rows, partition="p")
            td = await mb.materialize()
            t1 = time.perf_counter()
            zero_copy &= td["x"].data_ptr() == src.data_ptr()
            put_mat.append(t1 - t0)
        t0 = time.perf_counter()
        c = src.clone()
        clone.append(time.perf_counter() - t0)
        del c
    return {"case": f"{rows} x {row_bytes // KiB} KiB", "bytes": total,
            "streamrl_s": med(put_mat), "torch_clone_s": med(clone),
            "streamrl_GBps": total / med(put_mat) / 1e9, "clone_GBps": total / med(clone) / 1e9,
            "speedup_vs_clone": med(clone) / med(put_mat), "zero_copy": zero_copy}


async def metadata_queue(total_rows: int, batch: int = 16) -> float:
    x = torch.zeros(batch, 1)
    async with streamrl.StreamQueue(capacity=4096, num_shards=4) as q:
        t0 = time.perf_counter()

        async def produce():
            for _ in range(total_rows // batch):
                await q.put({"x": x}, partition="p")
            await q.seal("p")

        async def consume():
            async for mb in q.stream("t", ["x"], batch, partition="p"):
                await mb.drop()

        await asyncio.gather(produce(), consume())
        return total_rows / (time.perf_counter() - t0)


def metadata_controller(total_rows: int, batch: int = 16) -> float:
    c = Controller(4096, num_shards=4, consumers=["t"])
    req = Request("t", ("x",), batch, partition="p")
    nb = {"x": [4] * batch}
    t0 = time.perf_counter()
    for _ in range(total_rows // batch):
        tok = c.allocate("p", batch, ("x",), nbytes=4 * batch)
        c.commit(tok, nb)
        d = c.take(req)
        c.ack([d.lease])
        c.drain()
    return total_rows / (time.perf_counter() - t0)


async def wakeup(reps: int) -> dict:
    """A consumer blocked in its stream resumes after a producer's put of one row: time
    from the put call to the consumer holding the batch (p50/p99), and the part of it
    after put returned (the wake-up proper)."""
    total, after = [], []
    async with streamrl.StreamQueue(capacity=1024, num_shards=1) as q:
        x = torch.zeros(1)
        resumed = asyncio.Event()
        stamp = {}

        async def consumer():
            async for mb in q.stream("t", ["x"], 1, partition="p"):
                stamp["resume"] = time.perf_counter()
                resumed.set()
                await mb.drop()

        task = asyncio.create_task(consumer())
        for _ in range(reps):
            await asyncio.sleep(0.0005)  # the consumer is waiting again
            resumed.clear()
            t0 = time.perf_counter()
            await q.put({"x": x}, partition="p")
            t1 = time.perf_counter()
            await resumed.wait()
            total.append(stamp["resume"] - t0)
            after.append(stamp["resume"] - t1)
        await q.seal("p")
        await task
    p99 = int(0.99 * reps)
    return {"wakeup_p50_us": med(total) * 1e6, "wakeup_p99_us": sorted(total)[p99] * 1e6,
            "wakeup_after_put_p50_us": med(after) * 1e6}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None, help="also write results here")
    a = ap.parse_args()
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    res = {"data": [await data_path(1024, 64 * KiB, a.reps), await data_path(256, MiB, a.reps)]}
    res["metadata_rows_per_s_queue"] = med([await metadata_queue(64_000) for _ in range(3)])
    res["metadata_rows_per_s_controller"] = med([metadata_controller(64_000) for _ in range(3)])
    res.update(await wakeup(300))
    print(f"embedded transport, event loop: {loop}")
    print(f"{'case':<18}{'streamrl GB/s':>15}{'clone GB/s':>12}{'ratio':>8}{'zero-copy':>11}")
    for d in res["data"]:
        print(f"{d['case']:<18}{d['streamrl_GBps']:>15.1f}{d['clone_GBps']:>12.2f}"
              f"{d['speedup_vs_clone']:>7.1f}x{str(d['zero_copy']):>11}")
    print(f"metadata: {res['metadata_rows_per_s_queue']:,.0f} rows/s through the queue "
          f"(put+stream+ack, 16-row batches); {res['metadata_rows_per_s_controller']:,.0f} rows/s "
          "bare controller")
    print(f"wake-up put call -> consumer holds the batch: p50 {res['wakeup_p50_us']:.0f} us, "
          f"p99 {res['wakeup_p99_us']:.0f} us (after put returned: p50 "
          f"{res['wakeup_after_put_p50_us']:.0f} us)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
