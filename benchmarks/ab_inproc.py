"""This tree against another, in one process: the embedded one-row put case and the bare
controller of ``small_puts.py``, the two trees alternating run by run.

Why: on a shared VM the speed of the machine moves by 1.5-2x within the hour, and fresh
processes differ from each other as much as a change does (``small_puts.py --against``
runs each tree in its own processes). Here both trees run in the same process, one run
after the other, the order flipping every repetition, so that both see the same machine
and the same interpreter state; the medians are compared.

How: ``OLD_TREE/streamrl`` (e.g. ``git archive <commit> streamrl | tar -x -C OLD_TREE``)
is copied to a temporary directory as the package ``streamrl_old``, its imports of
itself renamed, and imported next to this tree's ``streamrl``. Only the embedded
transport and the bare controller are measured (nothing of Ray is loaded).

    python benchmarks/ab_inproc.py --against /tmp/sp-base --reps 10
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from small_puts import controller_batched, embedded_asyncio_queue, embedded_streamrl  # noqa: E402

OLD = "streamrl_old"


def load_old(tree: str) -> object:
    """``tree``'s ``streamrl`` package, imported as :data:`OLD`."""
    src = os.path.join(os.path.abspath(tree), "streamrl")
    if not os.path.isdir(src):
        raise SystemExit(f"{tree} has no streamrl/ (git archive <commit> streamrl | tar -x -C {tree})")
    root = tempfile.mkdtemp(prefix="streamrl-ab-")
    dst = os.path.join(root, OLD)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    # the package's imports of itself, the "module:attribute" names of its registries,
    # and (in trees before the package named them from __name__) its lookups of its own
    # modules in sys.modules: missed, the old tree's queue found no write-combining stage
    pat = re.compile(r"(\bfrom streamrl\.|\bimport streamrl\.|\"streamrl\.(?=[a-z_.]*:)"
                     r"|sys\.modules\.get\(\"streamrl\.)")
    for d, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                with open(p) as fh:
                    text = fh.read()
                new = pat.sub(lambda m: m.group(0).replace("streamrl.", OLD + "."), text)
                if new != text:
                    with open(p, "w") as fh:
                        fh.write(new)
    sys.path.insert(0, root)
    return importlib.import_module(OLD)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, metavar="OLD_TREE")
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-gc", action="store_true",
                    help="the cyclic GC off in the timed runs (less noise; no GC cost)")
    ap.add_argument("--group", type=int, default=0, metavar="N",
                    help="the embedded case with a group key (N samples a group) and a "
                    "grouped consumer, as a GRPO trainer reads")
    ap.add_argument("--filtered", action="store_true",
                    help="with --group: a zero-variance filter judges each group")
    ap.add_argument("--partial", action="store_true",
                    help="each sample put in parts: its tokens put, then the rest written "
                    "to the row (an env worker adding to an episode)")
    ap.add_argument("--paced", action="store_true",
                    help="the producer awaits between samples (an env step) and the "
                    "consumer after each batch (a train step), in both trees and in the "
                    "asyncio.Queue case")
    a = ap.parse_args()
    import streamrl as new

    old = load_old(a.against)
    for m in (old, new):  # warm
        await embedded_streamrl(500, mod=m)
    runs: dict[str, list[float]] = {k: [] for k in ("old", "new", "queue", "ctl_old", "ctl_new")}
    for i in range(a.reps):
        pair = [("old", old), ("new", new)]
        if i % 2:
            pair.reverse()
        for k, m in pair:
            runs[k].append(await embedded_streamrl(a.rows, mod=m, no_gc=a.no_gc,
                                                   group=a.group, filtered=a.filtered,
                                                   partial=a.partial, paced=a.paced) * 1e6)
            runs["queue"].append(await embedded_asyncio_queue(a.rows, no_gc=a.no_gc,
                                                              paced=a.paced) * 1e6)
        for k, m in pair:
            ctl = importlib.import_module(m.__name__ + ".controller")
            runs["ctl_" + k].append(controller_batched(64_000, controller=ctl.Controller,
                                                       request=ctl.Request,
                                                       clock=time.process_time))
    med = {k: statistics.median(v) for k, v in runs.items()}
    res = {"embedded_us_per_row": {"old": med["old"], "new": med["new"]},
           "asyncio_queue_us_per_row": med["queue"],
           "cost_ratio": {"old": med["old"] / med["queue"], "new": med["new"] / med["queue"]},
           "controller_rows_per_cpu_s": {"old": med["ctl_old"], "new": med["ctl_new"]},
           "reps": a.reps, "rows": a.rows, "group": a.group,
           "filtered": a.filtered, "partial": a.partial, "paced": a.paced}
    q = {k: statistics.quantiles(v, n=4) for k, v in runs.items() if len(v) > 1}
    res["quartiles"] = q
    for k in ("old", "new"):
        print(f"{k}: embedded quartiles {q[k][0]:.2f} .. {q[k][2]:.2f} us/row")
        print(f"{k}: embedded {med[k]:.2f} us/row = {med[k] / med['queue']:.2f}x asyncio.Queue "
              f"({med['queue']:.2f}) | bare controller {med['ctl_' + k]:,.0f} rows per CPU-s")
    print(f"new/old: embedded {med['new'] / med['old']:.2f}x the time, controller "
          f"{med['ctl_new'] / med['ctl_old']:.2f}x the rate (medians of {a.reps} alternating runs)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
