"""streamrl.compat.transferqueue against TransferQueue itself, on benchmarks/transfer.py's cases.

Run:  python benchmarks/compat.py            (--reps N, --quick for 2 reps)

Three systems, each in its own subprocess with its own Ray (``num_cpus=2``, loopback),
one after the other (see benchmarks/transfer.py for the cases and how time is measured):

  streamrl       native: producer actor put, consumer actor get + materialize
  transferqueue  TransferQueue 0.1.11 (1 storage unit): the driver's put, get_meta,
                 get_data, clear_partition
  tq-compat      the same TransferQueue code with ``transfer_queue`` resolved to
                 streamrl.compat.transferqueue, same configuration (1 storage unit)
  nocopy         the same with ``streamrl.copy_on_get: false``

The target: the compatibility layer keeps native streamrl's advantage over TransferQueue,
less at most 20% (compat / transferqueue >= 0.8 x streamrl / transferqueue, per case).
By default its read includes a copy native streamrl does not make: get_data hands out
data the caller owns, as TransferQueue's does; ``nocopy`` hands out views, as native
``materialize`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import transfer  # noqa: E402  (benchmarks/transfer.py: its cases and workers)

# the workers (and the Ray workers they start) import streamrl from this checkout, not
# from wherever the installed package points: a worker runs benchmarks/transfer.py, whose
# directory is benchmarks/, while Ray's workers add the current directory to their path,
# so the two could otherwise run different copies of streamrl
_ROOT = os.path.dirname(HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

SYSTEMS = ["streamrl", "transferqueue", "tq-compat", "tq-compat-nocopy"]
LABELS = {"a:2": "(a) 1024 x 64KiB +int", "b:1": "(b) 256 x 1MiB", "c:32": "(c) 256 x 32 x 16KiB",
          "c:1": "(c) read 1 of 32", "c:2": "(c) read 2 of 32"}


def gbps(res: dict, key: str, read_only: bool) -> float:
    case = transfer.CASES[key[0]]
    read = next(r for r in case["reads"] if len(r) == int(key.split(":")[1]))
    c = res["cases"][key]
    return transfer.payload(case, read) / (c["read"] if read_only else c["put"] + c["read"]) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 reps")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    a = ap.parse_args()
    reps = 2 if a.quick else a.reps
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; reps={reps}")
    res = {}
    for s in SYSTEMS:
        print(f"  running {s} ...", flush=True)
        res[s] = transfer.run_worker(s, reps, [])
    missing = [s for s in SYSTEMS if "cases" not in res[s]]
    for s in missing:
        print(f"  {s}: {res[s].get('skipped') or 'failed: ' + res[s].get('error', '?')[-800:]}")
    if missing:
        return 1
    worst = {"tq-compat": float("inf"), "tq-compat-nocopy": float("inf")}
    for title, keys, read_only in (
            ("put -> data held: GB/s (payload / (put + read time))", ["a:2", "b:1", "c:32"], False),
            ("read side only: GB/s", ["a:2", "b:1", "c:1", "c:2", "c:32"], True)):
        print(f"\n{title}")
        print(f"{'case':<24}{'streamrl':>9}{'TQ':>7}{'compat':>8}{'nocopy':>8}"
              f"{'streamrl/TQ':>13}{'compat/TQ':>11}{'nocopy/TQ':>11}"
              f"{'compat/streamrl':>17}{'nocopy/streamrl':>17}")
        for k in keys:
            n, t, c, z = (gbps(res[s], k, read_only) for s in SYSTEMS)
            worst["tq-compat"] = min(worst["tq-compat"], c / n)
            worst["tq-compat-nocopy"] = min(worst["tq-compat-nocopy"], z / n)
            print(f"{LABELS[k]:<24}{n:>9.2f}{t:>7.2f}{c:>8.2f}{z:>8.2f}{n / t:>12.2f}x"
                  f"{c / t:>10.2f}x{z / t:>10.2f}x{c / n:>17.2f}{z / n:>17.2f}")
    print(f"\nworst ratio to native streamrl: compat {worst['tq-compat']:.2f}, nocopy "
          f"{worst['tq-compat-nocopy']:.2f} (target >= 0.80)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
