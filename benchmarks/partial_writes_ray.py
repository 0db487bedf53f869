"""Partial samples on Ray: each sample put as its prompt, then written a field at a time.

Run: python benchmarks/partial_writes_ray.py [--samples 4000] [--producers 4]
[--shards 2] [--reps 3]

The pattern the mission names (rollout and env workers put the prompt first, then the
response, then the reward): P producer actors (async, ``num_cpus=0``) each, one sample
after another, ``put`` a one-row prompt (int64[64]), then ``write`` its response
(int64[192]) and its reward (one float) to the row the put returned; the driver streams
batches of 64 rows ready in all three fields and materializes each. Timed from the
moment every producer starts until the driver holds the last row; each producer puts and
writes one warm-up sample first.

Two cases, alternating in one run (``--reps`` pairs, the order flipping each pair, so a
slow minute of this shared machine does not land on one case only):

* ``unit``: the library as it is: a small write of new fields to rows of one storage
  unit is one call to that unit, which stores it and has the controller admit and
  commit it (``write_rows``);
* ``usual``: the same code with the producers' data plane declining those writes
  (its ``write_rows`` answers ``None``), so each write asks the controller for a write
  token, stores the fields in the unit and commits: three round trips, as before the
  unit admitted writes.

Reported per case (median run by rate): ``samples_per_s``, and the CPU each process kind
spent per sample (``controller``, ``units`` summed, ``producers`` summed, ``driver``),
read as ``small_puts_ray.py`` reads it (each actor's ``time.process_time()`` through
Ray's ``__ray_call__``; Ray's idle threads not taken off here); ``ratio``: ``unit`` over
``usual``, pair by pair, median.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = 64


def _prompt(i: int) -> dict:
    return {"prompt": torch.full((1, 64), i, dtype=torch.int64)}


class _Producer:
    """Puts a prompt, then writes the response and the reward, one sample at a time."""

    async def run(self, q, part: str, start: int, n: int, usual: bool) -> float:
        if usual:  # (the case "usual": every write the controller's way)
            async def decline(*args, **kwargs):
                return None

            q._transport.data.write_rows = decline
        for i in range(start, start + n):
            rows = await q.put(_prompt(i), partition=part)
            await rows.write({"response": torch.full((1, 192), i, dtype=torch.int64)})
            await rows.write({"reward": torch.tensor([float(i)])})
        return time.perf_counter()


async def _case(ray, usual: bool, samples: int, producers: int, shards: int) -> dict:
    import streamrl
    from small_puts_ray import _proc_cpu

    Producer = ray.remote(num_cpus=0)(_Producer)
    per = samples // producers
    n = per * producers
    q = streamrl.StreamQueue(transport="ray", capacity=4096, num_shards=shards,
                             consumers=["train"])
    try:
        ps = [Producer.remote() for _ in range(producers)]
        await asyncio.gather(*[p.run.remote(q, "warm", -1, 1, usual) for p in ps])
        await q.clear("warm")
        got = 0

        async def consume() -> float:
            nonlocal got
            async for mb in q.stream("train", ["prompt", "response", "reward"], BATCH,
                                     partition="p", timeout=600):
                td = await mb.materialize()
                got += td.batch_size[0]
            return time.perf_counter()

        units = list(q._transport._units)
        actors = [q._transport._controller, *units, *ps]
        reader = asyncio.ensure_future(consume())
        await asyncio.sleep(0.2)  # the consumer waits first
        cpu0 = await asyncio.gather(*[_proc_cpu(a) for a in actors])
        d0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*[p.run.remote(q, "p", i * per, per, usual)
                               for i, p in enumerate(ps)])
        await q.seal("p")
        t1 = await reader
        d1 = time.process_time()
        cpu1 = await asyncio.gather(*[_proc_cpu(a) for a in actors])
        assert got == n, (got, n)
        used = [b - a for a, b in zip(cpu0, cpu1)]
        k = 1 + len(units)
        for p in ps:
            ray.kill(p)
        return {"case": "usual" if usual else "unit", "samples": n, "seconds": t1 - t0,
                "samples_per_s": n / (t1 - t0),
                "cpu_us_per_sample": {"controller": used[0] / n * 1e6,
                                      "units": sum(used[1:k]) / n * 1e6,
                                      "producers": sum(used[k:]) / n * 1e6,
                                      "driver": (d1 - d0) / n * 1e6},
                "loadavg": os.getloadavg()[0]}
    finally:
        await q.shutdown()


async def run(samples: int, producers: int, shards: int, reps: int) -> dict:
    from small_puts_ray import _init_ray

    ray = _init_ray()
    runs: dict[str, list[dict]] = {"unit": [], "usual": []}
    ratios = []
    try:
        for r in range(reps):
            pair = {}
            for usual in ((False, True) if r % 2 == 0 else (True, False)):
                got = await _case(ray, usual, samples, producers, shards)
                print(f"  {got['case']} run {r + 1}: {got}", file=sys.stderr, flush=True)
                runs[got["case"]].append(got)
                pair[got["case"]] = got["samples_per_s"]
            ratios.append(pair["unit"] / pair["usual"])
    finally:
        ray.shutdown()
    out: dict = {"producers": producers, "shards": shards, "reps": reps}
    for name, rs in runs.items():
        out[name] = dict(sorted(rs, key=lambda d: d["samples_per_s"])[len(rs) // 2])
        out[name]["runs_samples_per_s"] = [d["samples_per_s"] for d in rs]
    out["ratio_unit_over_usual"] = statistics.median(ratios)
    out["ratios"] = ratios
    return out


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="pairs of runs (unit, usual)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = asyncio.run(run(a.samples, a.producers, a.shards, a.reps))
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
