"""A storage unit's checkpoint state when its rows are kept as runs.

Run: python benchmarks/unit_state.py [--runs 2000] [--reps 3] [--against OLD_TREE]
         (OLD_TREE: git archive <commit> streamrl | tar -x -C OLD_TREE; each tree runs in
         its own process, the trees alternating)

Case: a ``"memory"`` unit holding ``--runs`` runs of 64 rows (int64 tokens[256] and a
float reward: what the embedded queue's stage stores from 64 one-row puts), then
``state_dict()`` with every chunk read (what a checkpoint asks of the unit), then the
rows read back 64 at a time and deleted (what the queue does with them after the
checkpoint). CPU milliseconds of each step, the median of ``--reps``; the unit's
runs before and after the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = 64
TOKENS = 256


def one(runs: int) -> dict:
    import torch

    from streamrl.storage.memory import StorageUnit

    u = StorageUnit(0)
    n = 0
    for _ in range(runs):
        rows = list(range(n, n + ROWS))
        n += ROWS
        u.put(rows, {"tokens": torch.zeros(ROWS, TOKENS, dtype=torch.int64),
                     "reward": torch.zeros(ROWS)})
    before = len(getattr(u, "_by_first", ()))
    t0 = time.process_time()
    st = u.state_dict()
    chunks = sum(1 for _ in st["chunks"])
    t1 = time.process_time()
    after = len(getattr(u, "_by_first", ()))
    rows = list(range(n))
    for i in range(0, n, ROWS):
        u.get(rows[i:i + ROWS], ["tokens", "reward"])
    t2 = time.process_time()
    u.delete(rows)
    t3 = time.process_time()
    return {"state_ms": (t1 - t0) * 1e3, "reads_after_ms": (t2 - t1) * 1e3,
            "deletes_after_ms": (t3 - t2) * 1e3, "chunks": chunks,
            "runs_before": before, "runs_after": after}


def child(runs: int, reps: int) -> dict:
    res = [one(runs) for _ in range(reps)]
    out = {k: statistics.median(r[k] for r in res)
           for k in ("state_ms", "reads_after_ms", "deletes_after_ms")}
    for k in ("chunks", "runs_before", "runs_after"):
        out[k] = res[0][k]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--against", default=None, help="another tree's directory (A/B)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.runs, a.reps)))
        return
    trees = {"this": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    if a.against:
        trees["against"] = os.path.abspath(a.against)
    got: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(2 if a.against else 1):  # (the trees alternating)
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                  "--runs", str(a.runs), "--reps", str(a.reps)],
                                 env=env, cwd="/", capture_output=True, text=True, check=True)
            got[name].append(json.loads(out.stdout))
    for name, res in got.items():
        for r in res:
            print(f"{name:8s} {a.runs} runs of {ROWS} rows: state_dict + chunks "
                  f"{r['state_ms']:.0f} ms ({r['chunks']} chunks), reads after "
                  f"{r['reads_after_ms']:.0f} ms, deletes after {r['deletes_after_ms']:.0f} ms; "
                  f"runs {r['runs_before']} -> {r['runs_after']}")


if __name__ == "__main__":
    main()
