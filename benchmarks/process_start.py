"""What a fresh producer process pays to start: import streamrl and put its first rows.

Run: python benchmarks/process_start.py [--reps 5] [--against OLD_TREE]

Each repetition starts a new Python process that imports torch and streamrl, opens an
embedded queue and puts one-row samples (what an env worker does; it never reads a
TensorDict), and reports the process's wall time to that point, its CPU time and its
peak resident memory; ``torch`` alone (import torch, make a tensor) is the floor. With
``--against OLD_TREE`` (``git archive <commit> streamrl | tar -x -C OLD_TREE``) the same
process is run on that tree too, the trees alternating. Medians are printed, and the
difference to the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

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


def run(mode: str, tree: str | None) -> dict:
    env = dict(os.environ)
    root = tree if tree is not None else os.path.dirname(HERE)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    code = f"import json\nMODE = {mode!r}\n" + _CHILD
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=root, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--against", default=None, help="another tree holding streamrl/")
    a = ap.parse_args()
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
