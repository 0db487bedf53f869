"""What the metrics cost on the small-put benchmark, measured against a build with no
metrics bookkeeping at all.

    python benchmarks/metrics_overhead.py [--rows 5000 --reps 20 --json out.json]

Three builds of the embedded one-row-put case of ``benchmarks/small_puts.py`` (one
producer putting one-row samples, a consumer streaming batches of 64 and materializing
them), run in interleaved triples (the order rotating each triple):

* **bare**: the always-on bookkeeping switched off in this process: the latency
  histograms (put -> delivery and wait, per task and per partition) record nothing
  (``Histogram.observe`` replaced by a function that returns at once) and the
  ``q.timed`` hooks around queue calls are the identity;
* **off**: the library as shipped with ``metrics=None`` (the histograms and hooks on);
* **on**: ``metrics=True`` and a thread scraping ``/metrics`` every second.

Per run: CPU time per row of the whole process (``time.process_time``: the event loop,
the endpoint's thread and the scraper's), less the CPU time of making the run's samples
(measured apart). Per triple: the ratios off/bare and on/bare and on/off; the medians
and quartiles of those ratios are reported. Wall time on this shared machine moves
by more than the effect, so it is printed but not used.

Directly, too: the cost of one histogram observation (``timeit`` of ``observe``, taken
between runs, median), times the observations a row makes (counted from the stats of an
"off" run), over the CPU per row of "off".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import timeit

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # small_puts, and this checkout's streamrl

import small_puts  # noqa: E402  (the benchmark case itself)

import streamrl  # noqa: E402
from streamrl import batch as _batch  # noqa: E402
from streamrl import queue as _queue  # noqa: E402
from streamrl.stats import Histogram  # noqa: E402

_OBSERVE = Histogram.observe
_TIMED = (_queue._timed, _batch._timed)


def _skip(self: Histogram, seconds: float) -> None:
    return None


def _identity(aw):
    return aw


def build(name: str) -> None:
    """Switch this process to build ``name`` (``bare``, ``off`` or ``on``)."""
    bare = name == "bare"
    Histogram.observe = _skip if bare else _OBSERVE  # type: ignore[method-assign]
    _queue._timed = _identity if bare else _TIMED[0]
    _batch._timed = _identity if bare else _TIMED[1]


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


async def observations_per_row(rows: int) -> float:
    """Histogram observations per row of the case (off build): ``observe`` calls
    counted over one run."""
    build("off")
    calls = [0]

    def counting(self: Histogram, seconds: float) -> None:
        calls[0] += 1
        _OBSERVE(self, seconds)

    Histogram.observe = counting  # type: ignore[method-assign]
    try:
        await small_puts.embedded_streamrl(rows)
    finally:
        build("off")
    return calls[0] / rows


async def chunked(rows: int, chunk: int) -> list[float]:
    """The bookkeeping's cost at a fine grain: one run of the case whose build flips
    between bare and off every ``chunk`` rows (the order alternating per pair), each
    chunk timed (CPU of the process) from its first put until the consumer has
    materialized its last row; returns, per pair, off/bare - 1. Adjacent chunks share
    the machine's load of that moment, which whole runs do not."""
    samples = [small_puts.sample(i) for i in range(rows)]
    ratios: list[float] = []
    async with streamrl.StreamQueue(capacity=4096, num_shards=4, consumers=["train"]) as q:
        got = 0
        target = 0
        caught_up = asyncio.Event()

        async def consume():
            nonlocal got
            async for mb in q.stream("train", ["tokens", "reward"], small_puts.BATCH,
                                     partition="p"):
                td = await mb.materialize()
                got += td.batch_size[0]
                if got >= target:
                    caught_up.set()

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        pair: dict[str, float] = {}
        for k in range(0, rows - chunk + 1, chunk):
            i = k // chunk
            name = ("bare", "off")[(i + i // 2) % 2]  # bare off, off bare, bare off...
            build(name)
            target = k + chunk
            caught_up.clear()
            c0 = time.process_time()
            for smp in samples[k:k + chunk]:
                await q.put(smp, partition="p")
            await caught_up.wait()
            pair[name] = time.process_time() - c0
            if len(pair) == 2:
                ratios.append(pair["off"] / pair["bare"] - 1)
                pair = {}
        build("off")
        await q.seal("p")
        await task
    return ratios


def observe_cost(n: int = 200_000) -> float:
    h = Histogram()
    return timeit.timeit(lambda: _OBSERVE(h, 0.00123), number=n) / n - timeit.timeit(
        lambda: None, number=n) / n


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--scrape-every", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=256,
                    help="rows per chunk of the fine-grained bare/off measure (0: skip)")
    ap.add_argument("--chunk-rows", type=int, default=20_000)
    ap.add_argument("--chunk-runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    base = []
    for _ in range(3):
        c0 = time.process_time()
        [small_puts.sample(i) for i in range(a.rows)]
        base.append((time.process_time() - c0) / a.rows)
    samples_cpu = statistics.median(base)
    obs_per_row = await observations_per_row(min(a.rows, 2000))
    fine: list[float] = []
    if a.chunk:
        for _ in range(a.chunk_runs):
            fine += await chunked(a.chunk_rows, a.chunk)
            q1, q3 = _quartiles(fine)
            print(f"chunks of {a.chunk} rows, {len(fine)} pairs so far: off/bare median "
                  f"{statistics.median(fine):+.1%} (quartiles {q1:+.1%} .. {q3:+.1%})",
                  flush=True)
    names = ["bare", "off", "on"]
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    obs_costs = []
    build("on")
    await small_puts.embedded_streamrl(min(a.rows, 2000), metrics=True)  # warm
    for i in range(a.reps):
        order = names[i % 3:] + names[:i % 3]
        for n in order:
            build(n)
            c0 = time.process_time()
            w = await small_puts.embedded_streamrl(a.rows, metrics=n == "on",
                                                   scrape_every=a.scrape_every)
            cpu[n].append((time.process_time() - c0) / a.rows - samples_cpu)
            wall[n].append(w)
        build("off")
        obs_costs.append(observe_cost(50_000))
        print(f"triple {i + 1}/{a.reps}: " + ", ".join(
            f"{n} {cpu[n][-1] * 1e6:.1f}" for n in names) + " us CPU/row", flush=True)
    build("off")

    def ratio(x: str, y: str) -> dict:
        r = [p / q - 1 for p, q in zip(cpu[x], cpu[y])]
        q1, q3 = _quartiles(r)
        return {"median": statistics.median(r), "q1": q1, "q3": q3, "min": min(r),
                "max": max(r)}

    obs = statistics.median(obs_costs)
    off = statistics.median(cpu["off"])
    res = {"rows_per_run": a.rows, "triples": a.reps, "scrape_every_s": a.scrape_every,
           "samples_cpu_us_per_row": samples_cpu * 1e6,
           "cpu_us_per_row": {n: statistics.median(cpu[n]) * 1e6 for n in names},
           "wall_us_per_row": {n: statistics.median(wall[n]) * 1e6 for n in names},
           "off_vs_bare": ratio("off", "bare"), "on_vs_bare": ratio("on", "bare"),
           "on_vs_off": ratio("on", "off"),
           "observations_per_row": obs_per_row, "observe_us": obs * 1e6,
           "histograms_direct": obs * obs_per_row / off, "target": 0.05,
           "chunk_rows": a.chunk, "chunk_pairs": len(fine),
           "chunked_off_vs_bare": ({"median": statistics.median(fine),
                                    "q1": _quartiles(fine)[0], "q3": _quartiles(fine)[1]}
                                   if len(fine) > 1 else None),
           "scrape_cpu_ms": (await small_puts.scrape_cost()) * 1e3,
           "load": os.getloadavg(), "streamrl": streamrl.__file__}
    print(f"CPU per row (median of {a.reps}): " + ", ".join(
        f"{n} {res['cpu_us_per_row'][n]:.1f} us" for n in names))
    for k in ("off_vs_bare", "on_vs_bare", "on_vs_off"):
        r = res[k]
        print(f"{k}: median {r['median']:+.1%}, quartiles {r['q1']:+.1%} .. {r['q3']:+.1%}, "
              f"range {r['min']:+.1%} .. {r['max']:+.1%}")
    if res["chunked_off_vs_bare"]:
        c = res["chunked_off_vs_bare"]
        print(f"chunked off/bare ({len(fine)} pairs of {a.chunk} rows): median "
              f"{c['median']:+.1%}, quartiles {c['q1']:+.1%} .. {c['q3']:+.1%}")
    print(f"one scrape: {res['scrape_cpu_ms']:.2f} ms CPU")
    print(f"histograms, directly: {obs_per_row:.3f} observations a row x "
          f"{obs * 1e6:.2f} us = {res['histograms_direct']:+.2%} of off's CPU per row")
    print(f"wall per row: " + ", ".join(f"{n} {res['wall_us_per_row'][n]:.1f} us"
                                        for n in names) + f"; load {res['load']}; "
          f"{streamrl.__file__}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
