"""What a fresh producer process pays to start: import streamrl and put its first rows.

Run: python benchmarks/process_start.py [--reps 5] [--against OLD_TREE] [--ray]

Each repetition starts a new Python process that imports torch and streamrl, opens an
embedded queue and puts one-row samples (what an env worker does; it never reads a
TensorDict), and reports the process's wall time to that point, its CPU time and its
peak resident memory; ``torch`` alone (import torch, make a tensor) is the floor. With
``--against OLD_TREE`` (``git archive <commit> streamrl | tar -x -C OLD_TREE``) the same
process is run on that tree too, the trees alternating. Medians are printed, and the
difference to the floor.

``--ray``: instead, what a Ray producer actor pays to take a queue: a driver (one per
repetition and tree, the trees alternating) starts a local Ray and a queue with one
storage unit, then ``--producers`` actors, each in a fresh worker process (a runtime_env
of its own), unpickle the queue's handle and put one row. Reported per actor: the CPU
time of unpickling the handle (Ray imports the module of each actor class whose handle
the queue carries; streamrl imports the clients), of the first put, how many of
streamrl's modules the process loaded, and the process's CPU time in all by the end of
that put (Ray's worker and ``import torch`` included). Medians over every actor of every repetition.
Where ``PYTHONDONTWRITEBYTECODE`` is set and streamrl is installed editable (no ``.pyc``
files), every process compiles the modules it imports: ``python -m compileall -q
streamrl`` first measures what an installed package costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import resource, sys, time
t0 = time.perf_counter()
import torch
x = torch.zeros(1, 256, dtype=torch.int64)
if MODE == "producer":
    import asyncio
    import streamrl

    async def main():
        async with streamrl.StreamQueue(capacity=1024) as q:
            for i in range(64):
                await q.put({"tokens": x + i, "reward": torch.tensor([float(i)])},
                            partition="p")
    asyncio.run(main())
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "rss_mb": ru.ru_maxrss / 1024, "tensordict": "tensordict" in sys.modules}))
"""


def _child(code: str, tree: str | None, timeout: float) -> Any:
    """Run ``code`` in a new Python process that imports streamrl from ``tree`` (this
    repository's by default); returns the JSON of its last line of output."""
    env = dict(os.environ)
    root = tree if tree is not None else os.path.dirname(HERE)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=root, timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(mode: str, tree: str | None) -> dict:
    return _child(f"import json\nMODE = {mode!r}\n" + _CHILD, tree, 600)


_RAY_CHILD = r"""
import asyncio, json, statistics, sys, time
import ray, ray.cloudpickle as cp, torch
import streamrl

ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self):
        import torch  # noqa: F401  (a producer has torch already)

    async def take(self, blob):
        t0 = time.process_time()
        q = cp.loads(blob)
        t1 = time.process_time()
        await q.put({"tokens": torch.zeros(1, 256, dtype=torch.int64)}, partition="p")
        t2 = time.process_time()
        return (t1 - t0, t2 - t1, len([m for m in sys.modules if m.startswith("streamrl")]),
                t2)


async def main():
    q = streamrl.StreamQueue(transport="ray", num_shards=1, capacity=1024)
    blob = cp.dumps(q)
    out = []
    for i in range(PRODUCERS):
        p = Producer.options(runtime_env={"env_vars": {"STREAMRL_BENCH_WORKER": str(i)}}).remote()
        out.append(await p.take.remote(blob))
        ray.kill(p)
    await q.close()
    await q.shutdown()
    print(json.dumps(out))


asyncio.run(main())
ray.shutdown()
"""


def run_ray(tree: str | None, producers: int) -> list:
    return _child(f"PRODUCERS = {producers}\n" + _RAY_CHILD, tree, 900)


def main_ray(reps: int, producers: int, against: str | None) -> None:
    trees = [("streamrl", None)] + ([("against", os.path.abspath(against))] if against else [])
    res: dict[str, list] = {name: [] for name, _ in trees}
    for i in range(reps):
        for name, tree in (trees if i % 2 == 0 else trees[::-1]):
            res[name] += run_ray(tree, producers)
    out = {name: {"handle_cpu_s": round(statistics.median(r[0] for r in rs), 3),
                  "first_put_cpu_s": round(statistics.median(r[1] for r in rs), 4),
                  "streamrl_modules": statistics.median(r[2] for r in rs),
                  "process_cpu_s": round(statistics.median(r[3] for r in rs), 3),
                  "producers": len(rs)}
           for name, rs in res.items()}
    print(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--against", default=None, help="another tree holding streamrl/")
    ap.add_argument("--ray", action="store_true",
                    help="what a Ray producer actor pays to take a queue (see above)")
    ap.add_argument("--producers", type=int, default=4, help="with --ray: actors a repetition")
    a = ap.parse_args()
    if a.ray:
        main_ray(a.reps, a.producers, a.against)
        return
    cases = [("torch", "torch", None), ("streamrl", "producer", None)]
    if a.against:
        cases.append(("against", "producer", os.path.abspath(a.against)))
    res: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
    for i in range(a.reps):
        for name, mode, tree in (cases if i % 2 == 0 else cases[::-1]):
            res[name].append(run(mode, tree))
    out = {}
    for name, runs in res.items():
        out[name] = {k: round(statistics.median(r[k] for r in runs), 3)
                     for k in ("wall_s", "cpu_s", "rss_mb")}
        out[name]["tensordict_imported"] = runs[0]["tensordict"]
    for name in out:
        if name != "torch":
            out[name]["over_torch"] = {k: round(out[name][k] - out["torch"][k], 3)
                                       for k in ("wall_s", "cpu_s", "rss_mb")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
