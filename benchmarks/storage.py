"""Storage backends: put and materialize of 64 MiB on "memory" against "spill".

Run: python benchmarks/storage.py [--reps 5] [--transport embedded|ray] [--dir PATH]

Case: 1024 rows x 64 KiB float32 (64 MiB) over 4 storage units, put in puts of 64 rows,
then streamed and materialized in batches of 64 rows. Backends:

  memory       the default: reads are views of what was put
  spill-warm   {"backend": "spill", "memory_bytes": 0}: every put goes to the spill file
               (the put time includes the writes); reads come from the page cache
  spill-cold   the same, with the file's pages dropped from the page cache before the
               reads (fsync + posix_fadvise DONTNEED on the unit's file: embedded only),
               so reads go to the disk

GB/s = payload bytes / median seconds. The spill file goes to --dir (default: $TMPDIR).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import torch
import tensordict  # noqa: F401  (streamrl imports it at a process's first materialize;
#                     imported here so that no timed part pays for it)

import streamrl

KiB, MiB = 1 << 10, 1 << 20
ROWS, ROW_BYTES, PUT, BATCH = 1024, 64 * KiB, 64, 64


def _drop_cache(q: streamrl.StreamQueue) -> None:
    for u in q._data.units:
        fd = getattr(u, "_fd", -1)
        if fd >= 0:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


async def one(transport: str, storage, cold: bool) -> tuple[float, float, dict]:
    src = torch.randn(ROWS, ROW_BYTES // 4)
    async with streamrl.StreamQueue(capacity=ROWS, num_shards=4, transport=transport,
                                    storage=storage) as q:
        t0 = time.perf_counter()
        for i in range(0, ROWS, PUT):
            await q.put({"x": src[i:i + PUT]}, partition="p")
        put_s = time.perf_counter() - t0
        await q.seal("p")
        if cold:
            _drop_cache(q)
        usage = {}
        if transport == "embedded":
            usage = {k: sum(u.usage()[k] for u in q._data.units) for k in ("memory", "disk")}
        got = 0
        t0 = time.perf_counter()
        async for mb in q.stream("t", fields=["x"], batch_size=BATCH, partition="p"):
            td = await mb.materialize()
            got += td["x"].shape[0]
            await mb.drop()
        mat_s = time.perf_counter() - t0
        assert got == ROWS
        st = await q.stats()
        assert st.rows == 0 and st.bytes == 0 and sum(st.unit_bytes) == 0
    return put_s, mat_s, usage


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", default="embedded")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    spill = {"backend": "spill", "memory_bytes": 0}
    if args.dir:
        spill["dir"] = args.dir
    cases = {"memory": ("memory", False), "spill-warm": (spill, False)}
    if args.transport == "embedded":
        cases["spill-cold"] = (spill, True)
    total = ROWS * ROW_BYTES
    out = {}
    for name, (storage, cold) in cases.items():
        puts, mats, usage = [], [], {}
        for _ in range(args.reps):
            p, m, usage = await one(args.transport, storage, cold)
            puts.append(p)
            mats.append(m)
        p, m = statistics.median(puts), statistics.median(mats)
        out[name] = {"put_ms": round(p * 1e3, 1), "put_GBps": round(total / p / 1e9, 2),
                     "materialize_ms": round(m * 1e3, 1),
                     "materialize_GBps": round(total / m / 1e9, 2), "held": usage}
        print(f"{name:11s} put {p * 1e3:7.1f} ms ({total / p / 1e9:5.2f} GB/s)   "
              f"materialize {m * 1e3:7.1f} ms ({total / m / 1e9:5.2f} GB/s)   {usage}",
              flush=True)
    print(json.dumps({"transport": args.transport, "reps": args.reps, **out}))


if __name__ == "__main__":
    asyncio.run(main())
