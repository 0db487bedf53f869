"""Checkpoint benchmark: checkpoint and restore of a full queue against ``torch.save`` /
``torch.load`` of the same tensors and against the disk's sequential write speed, all
measured in the same run, in the same directory; plus the pause producers see while a
checkpoint runs.

Run: python benchmarks/checkpoint.py [--size 2] [--dir DIR] [--transport embedded|ray]
     python benchmarks/checkpoint.py --size 0.25        # a quick run

* **disk**: ``--size`` GiB written sequentially in 16 MiB ``os.write`` calls from memory
  that was written before, then ``fsync``: what the disk takes at best (once before and
  once after the rest; their mean is the reference, both are printed).
* **torch.save**: the same tensors (one per put) in one ``torch.save`` file, then
  ``fsync``; ``torch.load`` of it for the restore side.
* **streamrl**: a queue holding ``--size`` GiB (rows of ``--row-kib`` KiB of float32 and
  an int field, over 4 storage units); ``checkpoint`` (durable: every file is
  ``fsync``\\ ed before it returns) and ``StreamQueue.restore`` (every file read and
  checked). While the checkpoint runs, a producer puts one small row at a time into
  another partition; its longest gap between two puts is the pause it saw (the same
  producer's longest gap without a checkpoint is printed beside it).

Targets (issue 13): checkpoint speed >= 50% of the disk's; producer pause < 100 ms.
Prints a table and a JSON line. Files go under ``--dir`` (default: a temporary
directory on the disk holding this file, not /tmp, which may be memory) and are
removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch

import streamrl

MiB, GiB = 1 << 20, 1 << 30


def disk_write(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them."""
    chunk = np.random.default_rng(0).integers(0, 255, 16 * MiB, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(chunk)[:min(left, chunk.nbytes)])
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def torch_save(path: str, tensors: dict) -> tuple[float, float]:
    """Seconds to torch.save (and fsync) ``tensors``; seconds to torch.load them."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    save = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = torch.load(path)
    load = time.perf_counter() - t0
    assert sum(t.nbytes for t in back.values()) == sum(t.nbytes for t in tensors.values())
    del back
    os.unlink(path)
    return save, load


async def producer(q, stop: asyncio.Event, stamps: list[float]) -> None:
    """Put one small row at a time; record when each put returned."""
    x = torch.zeros(1, 16)
    while not stop.is_set():
        await q.put({"x": x}, partition="side")
        stamps.append(time.perf_counter())
        await asyncio.sleep(0.001)


def longest_gap(stamps: list[float], t0: float, t1: float) -> float:
    """The longest time in [t0, t1] with no put returning."""
    inside = [s for s in stamps if t0 <= s <= t1]
    before = [s for s in stamps if s < t0]
    points = ([before[-1]] if before else [t0]) + inside + [t1]
    return max(b - a for a, b in zip(points, points[1:]))


async def run(args) -> dict:
    row_bytes = args.row_kib * 1024
    rows = int(args.size * GiB) // row_bytes
    per_put = max(1, (64 * MiB) // row_bytes)
    base = args.dir or os.path.dirname(os.path.abspath(__file__))
    work = tempfile.mkdtemp(prefix=".ckpt-bench-", dir=base)
    try:
        tensors = {f"put{i}": torch.randn(min(per_put, rows - i), row_bytes // 4)
                   for i in range(0, rows, per_put)}
        nbytes = sum(t.nbytes for t in tensors.values())

        disk = [disk_write(os.path.join(work, "disk.bin"), nbytes)]
        save_s, load_s = torch_save(os.path.join(work, "torch.pt"), tensors)

        q = streamrl.StreamQueue(capacity=rows + 100_000, num_shards=4,
                                 transport=args.transport)
        try:
            for i, t in enumerate(tensors.values()):
                await q.put({"x": t, "k": torch.arange(len(t))}, partition="p")
            del tensors  # the queue holds the only copy now
            stop = asyncio.Event()
            stamps: list[float] = []
            task = asyncio.create_task(producer(q, stop, stamps))
            await asyncio.sleep(0.2)
            t_idle = time.perf_counter()
            await asyncio.sleep(1.0)  # the producer's gaps without a checkpoint
            t0 = time.perf_counter()
            idle_max = longest_gap(stamps, t_idle, t0)
            info = await q.checkpoint(os.path.join(work, "ck"))
            t1 = time.perf_counter()
            ckpt_s = t1 - t0
            stop.set()
            await task
            pause = longest_gap(stamps, t0, t1)
        finally:
            await q.close()
            await q.shutdown()

        t0 = time.perf_counter()
        r = await streamrl.StreamQueue.restore(os.path.join(work, "ck"))
        restore_s = time.perf_counter() - t0
        st = await r.stats()
        assert st.rows == info.rows, (st.rows, info.rows)
        await r.close()
        await r.shutdown()
        disk.append(disk_write(os.path.join(work, "disk.bin"), nbytes))  # before and after
        disk_s = sum(disk) / len(disk)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = nbytes / 1e9
    return {
        "transport": args.transport, "bytes": nbytes, "rows": rows,
        "row_kib": args.row_kib, "files_bytes": info.bytes,
        "disk_GBps": gb / disk_s, "disk_GBps_each": [gb / d for d in disk], "torch_save_GBps": gb / save_s,
        "torch_load_GBps": gb / load_s,
        "checkpoint_GBps": gb / ckpt_s, "restore_GBps": gb / restore_s,
        "checkpoint_vs_disk": disk_s / ckpt_s, "checkpoint_vs_torch_save": save_s / ckpt_s,
        "checkpoint_s": ckpt_s, "restore_s": restore_s, "cut_pause_s": info.pause,
        "producer_pause_s": pause, "producer_gap_without_checkpoint_s": idle_max,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=2.0, help="GiB held by the queue")
    ap.add_argument("--row-kib", type=int, default=256, help="KiB of tensor data per row")
    ap.add_argument("--dir", default=None, help="where files go (default: beside this script)")
    ap.add_argument("--transport", default="embedded", choices=["embedded", "ray"])
    args = ap.parse_args()
    if args.transport == "ray":
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=int(args.size * GiB) + GiB, _node_ip_address="127.0.0.1")
    res = asyncio.run(run(args))
    print(f"{res['bytes'] / GiB:.2f} GiB in {res['rows']} rows of {args.row_kib} KiB, "
          f"transport {args.transport}")
    print(f"{'':28} {'GB/s':>6}  {'vs disk':>7}")
    for name, key in (("disk sequential write", "disk_GBps"),
                      ("torch.save + fsync", "torch_save_GBps"),
                      ("streamrl checkpoint", "checkpoint_GBps"),
                      ("torch.load", "torch_load_GBps"),
                      ("streamrl restore", "restore_GBps")):
        print(f"{name:28} {res[key]:6.2f}  {res[key] / res['disk_GBps']:6.0%}")
    print("disk runs (GB/s): " + ", ".join(f"{x:.2f}" for x in res["disk_GBps_each"]))
    print(f"producer pause during checkpoint: {res['producer_pause_s'] * 1e3:.1f} ms "
          f"(its longest gap without one: {res['producer_gap_without_checkpoint_s'] * 1e3:.1f} "
          f"ms; the cut itself: {res['cut_pause_s'] * 1e3:.2f} ms)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
