"""The agentic pattern: one-row puts from many producers, a consumer waiting for batches.

Run: python benchmarks/small_puts.py [--rows 20000] [--ray] [--tq] [--scrape-every 1]

Side by side in one run (ratios, since shared machines are noisy):

* **embedded**: one producer task puts one-row samples (int64 tokens[256] + a float
  reward) while a consumer ``async for``s batches of 64 and materializes them, against a
  bare ``asyncio.Queue`` carrying the same dicts with a ``torch.cat`` per 64 rows (the
  queue a user would otherwise write). Target: streamrl at most 5x its cost per row.
* **metrics**: the embedded case with ``metrics=True`` and a scraper thread reading
  ``/metrics`` every second, against metrics off, interleaved. Target: under 5% more.
* **controller, batched**: put + take + ack of 256-row batches through the bare
  controller (metadata only). Target: at least 1M rows/s.
* **ray** (``--ray``): 4 and 16 producer actors x one-row puts, the driver consuming
  batches of 64; and the controller actor's CPU time per committed row (target: at most
  20 us). ``--tq`` adds TransferQueue on the same load (polling mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import torch

import streamrl
from streamrl.controller import Controller, Request

TOKENS = 256
BATCH = 64


def sample(i: int) -> dict:
    return {"tokens": torch.full((1, TOKENS), i, dtype=torch.int64),
            "reward": torch.tensor([float(i)])}


def _scraper(url: str, stop: "threading.Event", every: float) -> int:
    """Scrape ``url`` every ``every`` seconds until ``stop``; returns the scrape count."""
    import urllib.request

    n = 0
    while not stop.wait(every):
        urllib.request.urlopen(url, timeout=30).read()
        n += 1
    return n


async def embedded_streamrl(n: int, metrics: bool = False, scrape_every: float = 1.0) -> float:
    """Seconds per row: one producer putting one-row samples, a consumer streaming
    batches of 64 and materializing them. With ``metrics``: the queue serves
    Prometheus metrics and a thread scrapes them every ``scrape_every`` seconds."""
    import threading

    samples = [sample(i) for i in range(n)]
    async with streamrl.StreamQueue(capacity=4096, num_shards=4, consumers=["train"],
                                    metrics=True if metrics else None) as q:
        got = 0
        stop = threading.Event()
        scraper = (asyncio.ensure_future(asyncio.to_thread(
            _scraper, q.metrics_url, stop, scrape_every)) if metrics else None)

        async def consume():
            nonlocal got
            async for mb in q.stream("train", ["tokens", "reward"], BATCH, partition="p"):
                td = await mb.materialize()
                got += td.batch_size[0]

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the consumer waits first
        t0 = time.perf_counter()
        for s in samples:
            await q.put(s, partition="p")
        await q.seal("p")
        await task
        dt = time.perf_counter() - t0
        assert got == n, (got, n)
        if scraper is not None:
            stop.set()
            await scraper
    return dt / n


async def embedded_asyncio_queue(n: int) -> float:
    """The same samples through a bare asyncio.Queue, a torch.cat per 64 rows."""
    samples = [sample(i) for i in range(n)]
    q: asyncio.Queue = asyncio.Queue(maxsize=4096)
    got = 0

    async def consume():
        nonlocal got
        buf = []
        while True:
            s = await q.get()
            if s is None:
                break
            buf.append(s)
            if len(buf) == BATCH:
                torch.cat([b["tokens"] for b in buf]), torch.cat([b["reward"] for b in buf])
                got += len(buf)
                buf = []
        if buf:
            got += len(buf)

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    for s in samples:
        await q.put(s)
    await q.put(None)
    await task
    dt = time.perf_counter() - t0
    assert got == n
    return dt / n


def controller_batched(total_rows: int, batch: int = 256) -> float:
    """Rows/s through the bare controller: put + take + ack of ``batch``-row batches."""
    c = Controller(1 << 16, num_shards=4, consumers=["t"])
    req = Request("t", ("x", "y"), batch, partition="p")
    nb = {"x": [8] * batch, "y": [4] * batch}
    t0 = time.perf_counter()
    for _ in range(total_rows // batch):
        tok = c.allocate("p", batch, ("x", "y"), nbytes=12 * batch)
        c.commit(tok, nb)
        d = c.take(req)
        c.ack([d.lease])
        c.drain()
    return total_rows / (time.perf_counter() - t0)


def controller_one_row(total_rows: int) -> float:
    """Seconds of controller work per one-row put (allocate + commit) with a waiting
    subscription taking 64-row batches: what one controller core carries."""
    c = Controller(1 << 16, num_shards=4, consumers=["t"])
    req = Request("t", ("tokens", "reward"), BATCH, partition="p")
    nb = {"tokens": [8 * TOKENS], "reward": [4]}
    c.take(req)  # the subscription exists (a consumer waits)
    t0 = time.perf_counter()
    for i in range(total_rows):
        tok = c.allocate("p", 1, ("tokens", "reward"), nbytes=8 * TOKENS + 4)
        c.commit(tok, nb)
        if (i + 1) % BATCH == 0:
            d = c.take(req)
            c.ack([d.lease])
        c.drain()
    return (time.perf_counter() - t0) / total_rows


def med(xs):
    return statistics.median(xs)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ray", action="store_true", help="also the Ray cases")
    ap.add_argument("--tq", action="store_true", help="also TransferQueue (with --ray)")
    ap.add_argument("--scrape-every", type=float, default=1.0,
                    help="seconds between scrapes in the metrics-on case")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="only profile the embedded one-row put path (cProfile, by own time)")
    a = ap.parse_args()
    if a.profile:
        import cProfile
        import pstats

        await embedded_streamrl(500)  # warm
        pr = cProfile.Profile()
        pr.enable()
        await embedded_streamrl(a.rows)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
        return
    res: dict = {}
    s = med([await embedded_streamrl(a.rows) for _ in range(a.reps)])
    b = med([await embedded_asyncio_queue(a.rows) for _ in range(a.reps)])
    res["embedded"] = {"streamrl_us_per_row": s * 1e6, "asyncio_queue_us_per_row": b * 1e6,
                       "cost_ratio": s / b, "target_ratio": 5.0}
    # metrics on (endpoint + a scrape a second) against off, interleaved, the order
    # alternating (a rep's first run pays for warming up)
    on, off = [], []
    for i in range(a.reps):
        for metrics in ((False, True) if i % 2 == 0 else (True, False)):
            (on if metrics else off).append(await embedded_streamrl(
                a.rows, metrics=metrics, scrape_every=a.scrape_every))
    res["metrics"] = {"off_us_per_row": med(off) * 1e6, "on_us_per_row": med(on) * 1e6,
                      "overhead": med(on) / med(off) - 1, "scrape_every_s": a.scrape_every,
                      "target_overhead": 0.05}
    res["controller_batched_rows_per_s"] = med([controller_batched(256_000) for _ in range(a.reps)])
    res["controller_one_row_us"] = med([controller_one_row(a.rows) for _ in range(a.reps)]) * 1e6
    if a.ray:
        from small_puts_ray import ray_cases  # noqa: E402 - optional, starts Ray

        res["ray"] = await ray_cases(a.rows, tq=a.tq)
    e = res["embedded"]
    print(f"embedded one-row puts, consumer waiting (batches of {BATCH}): "
          f"streamrl {e['streamrl_us_per_row']:.1f} us/row, asyncio.Queue "
          f"{e['asyncio_queue_us_per_row']:.1f} us/row: {e['cost_ratio']:.1f}x its cost "
          f"(target <= {e['target_ratio']:.0f}x)")
    m = res["metrics"]
    print(f"metrics on (scraped every {m['scrape_every_s']:g} s) vs off: "
          f"{m['on_us_per_row']:.1f} vs {m['off_us_per_row']:.1f} us/row: "
          f"{m['overhead']:+.1%} (target < +5%)")
    print(f"bare controller, 256-row put+take+ack: "
          f"{res['controller_batched_rows_per_s']:,.0f} rows/s (target >= 1,000,000)")
    print(f"bare controller, one-row put with a waiting subscription: "
          f"{res['controller_one_row_us']:.1f} us/row")
    if "ray" in res:
        for k, v in res["ray"].items():
            print(f"ray {k}: {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
