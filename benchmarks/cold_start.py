"""Cold start of the Ray transport: the first puts into a fresh queue against later ones.

Run: python benchmarks/cold_start.py [--mib 256] [--reps 3]

A page of shared memory written for the first time costs many times a page written
before (on a VM, much more). A fresh queue's storage units make their arena segments as
the first puts need them, so the first fill runs at first-touch speed. Side by side, per
rep, from the driver (GB/s of put + materialize of ``--mib`` MiB in 8 tensors):

* **cold**: a fresh queue, its first put;
* **warm**: the same queue after its rows were dropped (blocks reused);
* **reserved**: a fresh queue with ``arena_reserve=True`` (capacity_bytes / num_shards
  per unit made at start on a background thread), its first put once the reserve is made.
  The time to make the reserve is reported too: it moves the cost, it does not remove it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import ray
import torch
import tensordict  # noqa: F401  (streamrl imports it at a process's first materialize;
#                     imported here so that no timed part pays for it)

import streamrl

MiB = 1 << 20


async def one_put(q, x: torch.Tensor, part: str) -> float:
    t0 = time.perf_counter()
    rows = await q.put({"x": x}, partition=part)
    td = await rows.select("x").materialize()
    assert td["x"].shape == x.shape
    dt = time.perf_counter() - t0
    del td
    await rows.drop()
    return x.nbytes / dt / 1e9


async def reserved_size(q) -> int:
    st = await q.stats()
    return sum(st.unit_shared_bytes)


async def rep(mib: int) -> dict:
    x = torch.randn(8, mib * MiB // 8 // 4)
    cap = 2 * x.nbytes
    out = {}
    async with streamrl.StreamQueue(transport="ray", capacity=64, capacity_bytes=cap,
                                    num_shards=2) as q:
        out["cold_gbps"] = await one_put(q, x, "a")
        out["warm_gbps"] = await one_put(q, x, "b")
    t0 = time.perf_counter()
    async with streamrl.StreamQueue(transport="ray", capacity=64, capacity_bytes=cap,
                                    num_shards=2, arena_reserve=True) as q:
        want = cap - 2 * streamrl.arena.SEGMENT_BYTES  # whole segments within the limit
        while await reserved_size(q) < want:
            await asyncio.sleep(0.02)
        out["reserve_seconds"] = time.perf_counter() - t0
        out["reserved_gbps"] = await one_put(q, x, "a")
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    reps = [await rep(a.mib) for _ in range(a.reps)]
    res = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    res["reps"] = reps
    print(f"{a.mib} MiB put + materialize from the driver, median of {a.reps} fresh queues:")
    print(f"  cold (first put)        {res['cold_gbps']:.2f} GB/s")
    print(f"  warm (blocks reused)    {res['warm_gbps']:.2f} GB/s")
    print(f"  arena_reserve=True      {res['reserved_gbps']:.2f} GB/s "
          f"(reserve made in {res['reserve_seconds']:.2f} s after creation)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    import streamrl.arena  # noqa: F401 - SEGMENT_BYTES

    asyncio.run(main())
