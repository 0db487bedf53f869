"""Checkpoint benchmark: checkpoint and restore of a full queue against ``torch.save`` /
``torch.load`` of the same tensors and against the disk's sequential write speed, all
measured in the same run, in the same directory; plus the pause producers see while a
checkpoint runs.

Run: python benchmarks/checkpoint.py [--size 2] [--dir DIR] [--transport embedded|ray]
     python benchmarks/checkpoint.py --size 0.25        # a quick run

* **disk**: ``--size`` GiB written sequentially in 16 MiB ``os.write`` calls from memory
  that was written before, then ``fsync``; twice each time: through the page cache
  (``buffered``, what ``dd conv=fsync`` does) and around it (``O_DIRECT``, what
  ``dd oflag=direct conv=fsync`` does). A disk shared with other jobs moves a lot, so it
  is measured four times, interleaved with the rest (before ``torch.save``, before the
  checkpoint, after it, after the restore); the reference is the median of the faster
  kind, and every run is printed.
* **torch.save**: the same tensors (one per put) in one ``torch.save`` file, then
  ``fsync``; ``torch.load`` of it for the restore side.
* **streamrl**: a queue holding ``--size`` GiB (rows of ``--row-kib`` KiB of float32 and
  an int field, over 4 storage units); ``checkpoint`` (durable: every file is
  ``fsync``\\ ed before it returns) and ``StreamQueue.restore`` (every file read and
  checked). While the checkpoint runs, a producer puts one small row at a time into
  another partition; its longest gap between two puts is the pause it saw. The same
  producer's longest gap without a checkpoint is measured just before it (1 s) and just
  after it (as long as the checkpoint took): what the machine's load alone does. On
  Linux, the share of the time the event loop's thread was runnable but not running
  (waiting for a CPU: ``/proc/self/task/<id>/schedstat``) is printed for both.

Targets (issue 13): checkpoint speed >= 50% of the disk's; producer pause < 100 ms.
Prints a table and a JSON line. Files go under ``--dir`` (default: a temporary
directory on the disk holding this file, not /tmp, which may be memory) and are
removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import statistics
import threading
import tempfile
import time

import numpy as np
import torch

import streamrl

MiB, GiB = 1 << 20, 1 << 30


def disk_write(path: str, nbytes: int, direct: bool = False) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them (``direct``: with
    ``O_DIRECT``, from a page-aligned buffer)."""
    buf = mmap.mmap(-1, 16 * MiB)
    chunk = np.frombuffer(buf, dtype=np.uint8)
    chunk[:] = np.random.default_rng(0).integers(0, 255, 16 * MiB, dtype=np.uint8)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        flags |= os.O_DIRECT
        nbytes -= nbytes % 4096
    fd = os.open(path, flags, 0o644)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(buf)[:min(left, len(buf))])
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        del chunk


def disk_both(work: str, nbytes: int, out: dict[str, list[float]]) -> None:
    """One measurement of each kind of sequential write (seconds, appended to ``out``)."""
    out["buffered"].append(disk_write(os.path.join(work, "disk.bin"), nbytes))
    if hasattr(os, "O_DIRECT"):
        try:
            out["direct"].append(disk_write(os.path.join(work, "disk.bin"), nbytes, True))
        except OSError:  # no direct I/O on this filesystem
            pass


def waiting() -> float:
    """Seconds this thread has spent runnable but not running (Linux; else 0)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


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


def gaps(stamps: list[float], t0: float, t1: float) -> list[float]:
    """The times in [t0, t1] with no put returning, longest first."""
    inside = [s for s in stamps if t0 <= s <= t1]
    before = [s for s in stamps if s < t0]
    points = ([before[-1]] if before else [t0]) + inside + [t1]
    return sorted((b - a for a, b in zip(points, points[1:])), reverse=True)


def longest_gap(stamps: list[float], t0: float, t1: float) -> float:
    """The longest time in [t0, t1] with no put returning."""
    return gaps(stamps, t0, t1)[0]


async def run(args) -> dict:
    row_bytes = args.row_kib * 1024
    rows = int(args.size * GiB) // row_bytes
    per_put = max(1, (64 * MiB) // row_bytes)
    base = args.dir or os.path.dirname(os.path.abspath(__file__))
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".ckpt-bench-", dir=base)
    disk: dict[str, list[float]] = {"buffered": [], "direct": []}
    try:
        tensors = {f"put{i}": torch.randn(min(per_put, rows - i), row_bytes // 4)
                   for i in range(0, rows, per_put)}
        nbytes = sum(t.nbytes for t in tensors.values())

        disk_both(work, nbytes, disk)  # 1: before torch.save
        save_s, load_s = torch_save(os.path.join(work, "torch.pt"), tensors)

        q = streamrl.StreamQueue(capacity=rows + 100_000, num_shards=4,
                                 transport=args.transport)
        try:
            for i, t in enumerate(tensors.values()):
                await q.put({"x": t, "k": torch.arange(len(t))}, partition="p")
            del tensors  # the queue holds the only copy now
            await asyncio.to_thread(disk_both, work, nbytes, disk)  # 2: before the checkpoint
            stop = asyncio.Event()
            stamps: list[float] = []
            task = asyncio.create_task(producer(q, stop, stamps))
            await asyncio.sleep(0.2)
            t_idle, w_idle = time.perf_counter(), waiting()
            await asyncio.sleep(1.0)  # the producer's gaps without a checkpoint
            t0, w0 = time.perf_counter(), waiting()
            info = await q.checkpoint(os.path.join(work, "ck"))
            t1, w1 = time.perf_counter(), waiting()
            ckpt_s = t1 - t0
            await asyncio.sleep(min(ckpt_s, 10.0))  # and after it, as long
            t2, w2 = time.perf_counter(), waiting()
            stop.set()
            await task
            during = gaps(stamps, t0, t1)
            idle = gaps(stamps, t_idle, t0) + gaps(stamps, t1, t2)[:-1]
            idle.sort(reverse=True)
        finally:
            await q.close()
            await q.shutdown()

        disk_both(work, nbytes, disk)  # 3: after the checkpoint
        t0 = time.perf_counter()
        r = await streamrl.StreamQueue.restore(os.path.join(work, "ck"))
        restore_s = time.perf_counter() - t0
        st = await r.stats()
        assert st.rows == info.rows, (st.rows, info.rows)
        await r.close()
        await r.shutdown()
        shutil.rmtree(os.path.join(work, "ck"), ignore_errors=True)
        disk_both(work, nbytes, disk)  # 4: after the restore
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = nbytes / 1e9
    speeds = {k: [gb / x for x in v] for k, v in disk.items() if v}
    medians = {k: statistics.median(v) for k, v in speeds.items()}
    ref_kind = max(medians, key=medians.__getitem__)
    disk_gbps = medians[ref_kind]

    def p99(g: list[float]) -> float:
        return g[len(g) // 100] if g else 0.0

    return {
        "transport": args.transport, "bytes": nbytes, "rows": rows,
        "row_kib": args.row_kib, "files_bytes": info.bytes,
        "disk_GBps": disk_gbps, "disk_reference": ref_kind,
        "disk_GBps_runs": speeds, "disk_GBps_median": medians,
        "torch_save_GBps": gb / save_s, "torch_load_GBps": gb / load_s,
        "checkpoint_GBps": gb / ckpt_s, "restore_GBps": gb / restore_s,
        "checkpoint_vs_disk": (gb / ckpt_s) / disk_gbps,
        "checkpoint_vs_disk_buffered": (gb / ckpt_s) / medians["buffered"],
        "checkpoint_vs_torch_save": save_s / ckpt_s,
        "checkpoint_s": ckpt_s, "restore_s": restore_s, "cut_pause_s": info.pause,
        "producer_pause_s": during[0], "producer_gap_p99_s": p99(during),
        "producer_gap_without_checkpoint_s": idle[0],
        "producer_gap_without_checkpoint_p99_s": p99(idle),
        "loop_cpu_wait_share": (w1 - w0) / ckpt_s,
        "loop_cpu_wait_share_without": ((w0 - w_idle) + (w2 - w1)) / ((t0 - t_idle) + (t2 - t1)),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
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
          f"transport {args.transport}, load average {res['load_average']}")
    print(f"{'':34} {'GB/s':>6}  {'vs disk':>7}")
    for kind, v in res["disk_GBps_median"].items():
        print(f"{'disk ' + kind + ' (median of ' + str(len(res['disk_GBps_runs'][kind])) + ')':34} "
              f"{v:6.3f}  {v / res['disk_GBps']:6.0%}")
    for name, key in (("torch.save + fsync", "torch_save_GBps"),
                      ("streamrl checkpoint", "checkpoint_GBps"),
                      ("torch.load", "torch_load_GBps"),
                      ("streamrl restore", "restore_GBps")):
        print(f"{name:34} {res[key]:6.3f}  {res[key] / res['disk_GBps']:6.0%}")
    for kind, v in res["disk_GBps_runs"].items():
        print(f"disk {kind} runs (GB/s, in order): " + ", ".join(f"{x:.3f}" for x in v))
    print(f"checkpoint vs torch.save: {res['checkpoint_vs_torch_save']:.2f}x; vs the disk "
          f"({res['disk_reference']}): {res['checkpoint_vs_disk']:.0%}; vs buffered: "
          f"{res['checkpoint_vs_disk_buffered']:.0%}")
    print(f"producer pause during checkpoint: {res['producer_pause_s'] * 1e3:.1f} ms, p99 gap "
          f"{res['producer_gap_p99_s'] * 1e3:.1f} ms (without one: longest "
          f"{res['producer_gap_without_checkpoint_s'] * 1e3:.1f} ms, p99 "
          f"{res['producer_gap_without_checkpoint_p99_s'] * 1e3:.1f} ms); the cut itself: "
          f"{res['cut_pause_s'] * 1e3:.2f} ms")
    print(f"event loop thread waiting for a CPU: {res['loop_cpu_wait_share']:.0%} of the "
          f"checkpoint, {res['loop_cpu_wait_share_without']:.0%} without one")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
