"""What reading rows of one-row puts costs on Ray, against rows put several at a time.

Run: python benchmarks/small_reads_ray.py [--rows 2048] [--reps 4] [--shards 4]

The agentic pattern puts one row at a time, so each row is stored apart (a segment of
its own in its storage unit), and a consumer reads them back in batches of 64. The
driver puts ``--rows`` one-row samples (int64 tokens[256] and a float reward), one put
at a time, then streams them back in batches of 64 and materializes each; then the same
rows put 16 at a time. Reported per case: the driver's and the storage units' CPU per
row read (``time.process_time()`` of each process, every thread, over the reads alone)
and rows read per second; the first rep warms up and is left out of the medians.
``one_over_bulk``: the one-row case's CPU per row (driver + units) over the other's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

BATCH = 64
BULK = 16  # rows a put in the "bulk" case


def _cpu(actor):
    return actor.__ray_call__.remote(lambda self: time.process_time())


async def _case(q, units, part: str, rows: int, one: bool) -> dict:
    import torch

    if one:
        for i in range(rows):
            await q.put({"tokens": torch.full((1, 256), i), "reward": torch.ones(1)},
                        partition=part)
    else:
        for i in range(0, rows, BULK):
            await q.put({"tokens": torch.arange(i, i + BULK)[:, None].expand(BULK, 256)
                         .contiguous(), "reward": torch.ones(BULK)}, partition=part)
    await q.seal(part)
    u0 = await asyncio.gather(*[_cpu(u) for u in units])
    d0 = time.process_time()
    t0 = time.perf_counter()
    n = 0
    async for mb in q.stream("t", ["tokens", "reward"], BATCH, partition=part):
        td = await mb.materialize()
        n += td.batch_size[0]
        if not torch.equal(td["tokens"][:, 0], td["tokens"][:, -1]):
            raise AssertionError("a row came back with another row's bytes")
    t1 = time.perf_counter()
    d1 = time.process_time()
    u1 = await asyncio.gather(*[_cpu(u) for u in units])
    if n != rows:
        raise AssertionError(f"read {n} rows of {rows}")
    return {"driver_us_per_row": (d1 - d0) / n * 1e6,
            "units_us_per_row": sum(b - a for a, b in zip(u0, u1)) / n * 1e6,
            "rows_per_s": n / (t1 - t0)}


async def run(rows: int, reps: int, shards: int) -> dict:
    import streamrl

    q = streamrl.StreamQueue(transport="ray", capacity=max(2 * rows, 4096),
                             num_shards=shards, consumers=["t"])
    units = q._transport._units
    got: dict[str, list[dict]] = {"one_row_puts": [], "puts_of_16": []}
    try:
        for rep in range(reps):
            for name in got:  # (alternating, so that both see the same machine)
                r = await _case(q, units, f"{name}-{rep}", rows, name == "one_row_puts")
                got[name].append(r)
                line = ", ".join(f"{k} {v:.1f}" for k, v in r.items())
                print(f"  {name} rep {rep}: {line}", file=sys.stderr, flush=True)
    finally:
        await q.close()
    out: dict = {"rows": rows, "shards": shards, "batch": BATCH}
    for name, rs in got.items():
        rs = rs[1:] or rs  # (the first rep warms up)
        out[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    one, bulk = out["one_row_puts"], out["puts_of_16"]
    out["one_over_bulk"] = ((one["driver_us_per_row"] + one["units_us_per_row"])
                            / (bulk["driver_us_per_row"] + bulk["units_us_per_row"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        res = asyncio.run(run(a.rows, a.reps, a.shards))
    finally:
        ray.shutdown()
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
