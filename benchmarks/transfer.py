"""Transfer benchmark: streamrl on Ray against Ray's own paths, TransferQueue and shared memory.

Run:  python benchmarks/transfer.py            (add --quick for a short smoke run)
      python benchmarks/transfer.py --rdt      (streamrl transport="rdt" and "ray" vs raw Ray RDT)

Every system runs in its own subprocess (one Ray cluster per process, ``num_cpus=2``),
one after the other, in one invocation; the table prints medians and ratios. Cases:

  (a) 1024 rows x 64 KiB float32 + an int64 field      (read: both fields)
  (b) 256 rows x 1 MiB float32                         (read: the field)
  (c) 256 rows x 32 fields of 16 KiB                   (read: 1, 2 and 32 fields)

Systems:
  streamrl      producer actor ``put``s, consumer actor ``get``s + ``materialize``s
                (bytes through the storage units' shared-memory arenas)
  ray-torch     producer actor ``ray.put``s one tensor per field (Ray's default torch
                pickling); consumer actor ``ray.get``s the fields it reads
  ray-numpy     the same with ``tensor.numpy()`` (Ray's zero-copy numpy path)
  transferqueue TransferQueue 0.1.11, 1 storage unit, driver put + get_meta + get_data
                (``pip install -e .[bench]``; skipped with a note when missing)
  tq-compat     the same TransferQueue code on streamrl.compat.transferqueue (worker only:
                ``benchmarks/compat.py`` compares it; ``tq-compat-nocopy``: with
                ``streamrl.copy_on_get: false``)
  shm           the physical bound: process A writes the bytes into /dev/shm, process B
                copies them out (two processes, one copy each)

Time = from the producer starting its put to the consumer holding the data, measured by
the driver around both calls. GB/s = payload bytes / median time.

RDT (``--rdt``: these three only, on their own cases, in one process and Ray session,
repetitions alternating between them):

  streamrl-rdt  ``transport="rdt"``: an async producer actor puts (its tensors stay in
                its holder), an async consumer actor ``get``s + ``materialize``s (one
                transfer per holder per micro-batch, through each process's transfer
                thread); both in one gloo RDT group
  streamrl-ray  ``transport="ray"``, the same two actors and calls: the bytes go through
                the storage units' shared-memory arenas
  ray-rdt       raw Ray Direct Transport: a sync producer actor's
                ``@ray.method(tensor_transport="gloo")`` method returns each tensor, a sync
                consumer actor takes the refs as arguments (one transfer per tensor)

The raw time covers the producer's calls and the consumer holding the tensors, so it
compares with streamrl's put + read; streamrl's read alone is shown too.

  (L) 256 rows x 1 MiB float32, put as one tensor, read whole (256 MiB)
  (S) 1024 tensors of 64 KiB float32: 1024 one-row puts, read as one micro-batch

Also: case (c) read from a consumer on a second Ray node (``ray.cluster_utils``, loopback),
where reads move bytes; write-to-consumer wake-up latency on Ray (a consumer blocked in ``get`` resumes
after a producer's one-row put), and peak memory while 4 GiB stream through a queue
with ``capacity_bytes`` = 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CASES = {
    "a": {"rows": 1024, "fields": {"x": 64 * KiB // 4}, "int": True, "reads": [["x", "idx"]]},
    "b": {"rows": 256, "fields": {"x": MiB // 4}, "int": False, "reads": [["x"]]},
    "c": {"rows": 256, "fields": {f"f{i:02d}": 16 * KiB // 4 for i in range(32)}, "int": False,
          "reads": [["f00"], ["f00", "f01"], [f"f{i:02d}" for i in range(32)]]},
}


def payload(case: dict, read: list[str]) -> int:
    n = case["rows"]
    return sum(n * (8 if f == "idx" else case["fields"][f] * 4) for f in read)


def make_data(case: dict):
    import torch

    n = case["rows"]
    data = {f: torch.randn(n, w) for f, w in case["fields"].items()}
    if case["int"]:
        data["idx"] = torch.arange(n)
    return data


def med(xs):
    return statistics.median(xs)


# ------------------------------------------------------------------ workers (subprocesses)


class _CaseData:
    """A producer actor's state: one case's tensors, built once, one torch thread."""

    def __init__(self, case):
        import torch

        torch.set_num_threads(1)
        self.data = make_data(case)


class _QueueProducer(_CaseData):
    """The streamrl producer actor (made remote by the workers, with their options)."""

    async def put(self, q, part):
        await q.put(self.data, partition=part)

    async def put_one(self, q, part):  # for the wake-up measurement
        import torch

        t = time.time()
        await q.put({"x": torch.zeros(1)}, partition=part)
        return t


def _ray_init():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=2 * GiB, _node_ip_address="127.0.0.1")
    return ray


def worker_streamrl(reps: int) -> dict:
    import asyncio

    ray = _ray_init()
    import streamrl

    Producer = ray.remote(num_cpus=0)(_QueueProducer)

    @ray.remote(num_cpus=0)
    class Consumer:
        async def get(self, q, part, fields, n):
            mb = await q.get("bench", fields, n, partition=part, timeout=120)
            td = await mb.materialize(fields)
            self.last = mb
            return sum(td[f].nbytes for f in fields)

        async def drop(self):
            await self.last.drop()

        async def wait_one(self, q, part):
            mb = await q.get("wake", ["x"], 1, partition=part, timeout=60)
            t = time.time()
            await mb.drop()
            return t

    out: dict = {"cases": {}}
    q = streamrl.StreamQueue(transport="ray", capacity=8192, num_shards=2)
    cons = Consumer.remote()
    for name, case in CASES.items():
        prod = Producer.remote(case)
        for read in case["reads"]:
            puts, reads = [], []
            for r in range(reps + 1):
                part = f"{name}-{'-'.join(read[:2])}-{r}"
                t0 = time.perf_counter()
                ray.get(prod.put.remote(q, part))
                t1 = time.perf_counter()
                got = ray.get(cons.get.remote(q, part, read, case["rows"]))
                t2 = time.perf_counter()
                assert got == payload(case, read), (got, payload(case, read))
                ray.get(cons.drop.remote())
                if r:
                    puts.append(t1 - t0)
                    reads.append(t2 - t1)
            out["cases"][f"{name}:{len(read)}"] = {"put": med(puts), "read": med(reads)}
        ray.kill(prod)
    # wake-up: consumer already waiting; producer puts one row
    prod = Producer.remote(CASES["a"])
    lat = []
    for r in range(max(60, reps * 12)):  # enough samples for a steady median and p90
        part = f"wake-{r}"
        w = cons.wait_one.remote(q, part)
        time.sleep(0.05)  # it is waiting now
        t_put = ray.get(prod.put_one.remote(q, part))
        lat.append(ray.get(w) - t_put)
    out["wakeup_ms_p50"] = med(lat) * 1e3
    out["wakeup_ms_p90"] = sorted(lat)[int(0.9 * len(lat))] * 1e3
    asyncio.run(q.shutdown())
    ray.shutdown()
    return out


def worker_xnode(reps: int) -> dict:
    """Case (c) with the consumer on another Ray node (two nodes on this machine, joined
    over loopback by ``ray.cluster_utils``): reads move the bytes over the socket, so
    field selection shows in the read time."""
    import asyncio

    import ray
    from ray.cluster_utils import Cluster

    lo = "127.0.0.1"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"nodeA": 1}, "node_ip_address": lo,
        "include_dashboard": False, "object_store_memory": GiB})
    try:
        cluster.add_node(num_cpus=1, resources={"nodeB": 1}, node_ip_address=lo,
                         object_store_memory=GiB)
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=lo)
        cluster.wait_for_nodes()
        import streamrl

        Producer = ray.remote(num_cpus=0, resources={"nodeA": 0.01})(_QueueProducer)

        @ray.remote(num_cpus=0, resources={"nodeB": 0.01})
        class Consumer:
            async def get(self, q, part, fields, n):
                mb = await q.get("bench", fields, n, partition=part, timeout=120)
                td = await mb.materialize(fields)
                self.last = mb
                return sum(td[f].nbytes for f in fields)

            async def drop(self):  # not timed, as on one node
                await self.last.drop()

        case = CASES["c"]
        q = streamrl.StreamQueue(transport="ray", capacity=8192, num_shards=2,
                                 unit_options={"resources": {"nodeA": 0.01}})
        prod, cons = Producer.remote(case), Consumer.remote()
        out: dict = {"cases": {}}
        for read in case["reads"]:
            reads = []
            for r in range(reps + 1):
                part = f"x-{len(read)}-{r}"
                ray.get(prod.put.remote(q, part))
                t0 = time.perf_counter()
                got = ray.get(cons.get.remote(q, part, read, case["rows"]))
                if r:
                    reads.append(time.perf_counter() - t0)
                assert got == payload(case, read)
                ray.get(cons.drop.remote())
            out["cases"][f"c:{len(read)}"] = {"read": med(reads)}
        asyncio.run(q.shutdown())
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def worker_ray(reps: int, numpy: bool) -> dict:
    ray = _ray_init()
    import torch

    @ray.remote(num_cpus=0)
    class Producer(_CaseData):
        def put(self):
            # one object per field, so a consumer can fetch only what it reads
            return {f: [ray.put(t.numpy() if numpy else t)] for f, t in self.data.items()}

    @ray.remote(num_cpus=0)
    class Consumer:
        def get(self, refs, fields):
            vals = ray.get([refs[f][0] for f in fields])
            ts = [torch.from_numpy(v) if numpy else v for v in vals]
            return sum(t.nbytes for t in ts)

    @ray.remote(num_cpus=0)
    def hold(refs):  # the producer's put is done once its objects exist
        return len(ray.get([r[0] for r in refs.values()]))

    out: dict = {"cases": {}}
    cons = Consumer.remote()
    for name, case in CASES.items():
        prod = Producer.remote(case)
        for read in case["reads"]:
            puts, reads = [], []
            for r in range(reps + 1):
                t0 = time.perf_counter()
                refs = ray.get(prod.put.remote())
                t1 = time.perf_counter()
                got = ray.get(cons.get.remote(refs, read))
                t2 = time.perf_counter()
                assert got == payload(case, read)
                del refs
                if r:
                    puts.append(t1 - t0)
                    reads.append(t2 - t1)
            out["cases"][f"{name}:{len(read)}"] = {"put": med(puts), "read": med(reads)}
        ray.kill(prod)
    ray.shutdown()
    return out


def worker_tq(reps: int, compat: bool = False, copy: bool = True) -> dict:
    """TransferQueue's put + get_meta + get_data from the driver; with ``compat``, the
    same code on streamrl.compat.transferqueue (``import transfer_queue`` resolved to it;
    ``copy=False``: its ``streamrl.copy_on_get: false``)."""
    if compat:
        import streamrl.compat.transferqueue

        streamrl.compat.transferqueue.install()
    try:
        import transfer_queue as tq
    except ImportError:
        return {"skipped": "transferqueue is not installed (pip install -e '.[bench]')"}
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    from tensordict import TensorDict

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=2 * GiB, _node_ip_address="127.0.0.1")
    conf: dict = {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}
    if compat and not copy:
        conf["streamrl"] = {"copy_on_get": False}
    tq.init(conf)
    client = tq.get_client()
    out: dict = {"cases": {}, "version": tq.__version__}
    for name, case in CASES.items():
        data = make_data(case)
        n = case["rows"]
        td = TensorDict(data, batch_size=[n])
        for read in case["reads"]:
            puts, reads = [], []
            for r in range(reps + 1):
                part = f"{name}-{len(read)}-{r}"
                t0 = time.perf_counter()
                client.put(data=td, partition_id=part)
                t1 = time.perf_counter()
                meta = client.get_meta(data_fields=read, batch_size=n, partition_id=part,
                                       task_name="bench")
                got = client.get_data(meta)
                t2 = time.perf_counter()
                assert len(got) == n
                del got
                client.clear_partition(part)
                if r:
                    puts.append(t1 - t0)
                    reads.append(t2 - t1)
            out["cases"][f"{name}:{len(read)}"] = {"put": med(puts), "read": med(reads)}
    tq.close()
    ray.shutdown()
    return out


def _shm_reader(name, nbytes, reps, go, done):  # process B: copy out of shared memory
    from multiprocessing import shared_memory

    import numpy as np

    shm = shared_memory.SharedMemory(name=name)
    try:
        view = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
        for _ in range(reps):
            go.wait()
            go.clear()
            out = np.empty(nbytes, dtype=np.uint8)
            np.copyto(out, view)
            del out
            done.set()
        del view
    finally:
        shm.close()


def worker_shm(reps: int) -> dict:
    """A writes into shared memory, B copies out: one copy each, two processes."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    import numpy as np

    out: dict = {"cases": {}}
    for name, case in CASES.items():
        for read in case["reads"]:
            nbytes = payload(case, read)
            src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
            shm = shared_memory.SharedMemory(create=True, size=nbytes)
            ctx = mp.get_context("fork")
            go, done = ctx.Event(), ctx.Event()
            p = ctx.Process(target=_shm_reader, args=(shm.name, nbytes, reps + 1, go, done))
            p.start()
            dst = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
            puts, reads = [], []
            for r in range(reps + 1):
                t0 = time.perf_counter()
                np.copyto(dst, src)
                t1 = time.perf_counter()
                go.set()
                done.wait()
                done.clear()
                if r:
                    puts.append(t1 - t0)
                    reads.append(time.perf_counter() - t1)
            p.join()
            del dst
            shm.close()
            shm.unlink()
            out["cases"][f"{name}:{len(read)}"] = {"put": med(puts), "read": med(reads)}
    return out


def worker_memory(total_gib: float) -> dict:
    """Stream ``total_gib`` through a queue bounded at 256 MiB; peak memory per process."""
    import asyncio

    ray = _ray_init()
    import torch

    import streamrl

    def mem() -> dict:
        import resource

        st = {}
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssShmem", "VmHWM"):
                    st[k] = int(v.split()[0]) * 1024
        st["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return st

    # the producer clones a fresh 16 MiB tensor per put; glibc would keep the freed ones
    # in its heap (see docs/troubleshooting.md), which is the producer's footprint, not
    # the queue's: run it with the setting the troubleshooting page recommends
    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"MALLOC_MMAP_THRESHOLD_": "1048576"}})
    class Producer:
        async def run(self, q, total):
            base = mem()
            x = torch.randn(16, MiB // 4)  # 16 MiB a put
            for i in range(total // x.nbytes):
                await q.put({"x": x.clone()}, partition="m")
            await q.seal("m")
            return base, mem()

    @ray.remote(num_cpus=0)
    class Consumer:
        async def run(self, q):
            base = mem()
            n = 0
            async for mb in q.stream("c", ["x"], 16, partition="m"):
                td = await mb.materialize()
                n += td["x"].nbytes
                del td
                await asyncio.sleep(0.05)  # a slow trainer: the queue fills to its bound
                await mb.drop()
            return base, mem(), n

    cap = 256 * MiB
    q = streamrl.StreamQueue(transport="ray", capacity=100_000, capacity_bytes=cap, num_shards=2)
    total = int(total_gib * GiB)
    units = q._transport._units
    p, c = Producer.remote(), Consumer.remote()
    import re

    from ray._private.internal_api import memory_summary

    def plasma_mib() -> int:  # live bytes in the object store (what the data occupies)
        m = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
        return int(m.group(1)) if m else 0

    peak_held = peak_plasma = peak_arena = 0
    cref = c.run.remote(q)
    pref = p.run.remote(q, total)
    while True:
        done, _ = ray.wait([cref], timeout=0.2)
        st = asyncio.run(q.stats())
        peak_held = max(peak_held, st.bytes, sum(st.unit_bytes))
        peak_plasma = max(peak_plasma, plasma_mib())
        peak_arena = max(peak_arena, sum(a["size"] for a in ray.get(
            [u.arena_stats.remote() for u in units])))
        if done:
            break
    (pb, pe), (cb, ce, n) = ray.get(pref), ray.get(cref)

    unit_mem = [ray.get(u.memory.remote()) for u in units]
    asyncio.run(q.shutdown())
    ray.shutdown()
    return {"streamed": n, "capacity_bytes": cap, "peak_bytes_held": peak_held,
            "peak_object_store_mib": peak_plasma, "peak_arena_bytes": peak_arena,
            "producer": {"base": pb, "end": pe}, "consumer": {"base": cb, "end": ce},
            "units": unit_mem}


RDT_CASES = {
    "L": {"tensors": 1, "rows": 256, "width": MiB // 4},
    "S": {"tensors": 1024, "rows": 1, "width": 64 * KiB // 4},
}


def _rdt_data(case: dict):
    import torch

    torch.set_num_threads(1)
    return [torch.randn(case["rows"], case["width"]) for _ in range(case["tensors"])]


def worker_rdt(reps: int) -> dict:
    """streamrl ``transport="rdt"`` between two async actors of one gloo RDT group,
    streamrl ``transport="ray"`` between the same two actors, and raw Ray Direct Transport
    between two sync actors (the only pairing that Ray 2.60 moves right under
    concurrency) of another gloo group, on the same tensors. Repetitions alternate
    between the three, so that all see the same machine (it is shared)."""
    import asyncio

    ray = _ray_init()
    from ray.experimental.collective import create_collective_group

    import streamrl
    from streamrl.transport.rdt import create_group

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class RawProducer:
        def __init__(self, case):
            self.data = _rdt_data(case)

        @ray.method(tensor_transport="gloo")
        def get(self, i):
            return self.data[i]

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class RawConsumer:
        def take(self, *ts):
            return sum(t.nbytes for t in ts)

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Producer:
        def __init__(self, case):
            self.data = _rdt_data(case)

        async def put(self, q, part):
            sem = asyncio.Semaphore(64)  # many puts in flight, as a rollout worker's

            async def one(t):
                async with sem:
                    await q.put({"x": t}, partition=part)

            await asyncio.gather(*[one(t) for t in self.data])

        def held(self):
            from streamrl.transport.rdt import holder_stats

            return holder_stats()

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Consumer:
        async def get(self, q, part, n):
            mb = await q.get("bench", ["x"], n, partition=part, timeout=120)
            td = await mb.materialize()
            self.last = mb
            # one storage means the rows read through both storage units were joined
            # without a copy
            return td["x"].nbytes, td["x"].untyped_storage().nbytes() == td["x"].nbytes

        async def drop(self):
            await self.last.drop()

    out: dict = {"cases": {}}
    for name, case in RDT_CASES.items():
        rp, rc = RawProducer.remote(case), RawConsumer.remote()
        create_collective_group([rp, rc], backend="torch_gloo")
        q = streamrl.StreamQueue(transport="rdt", capacity=8192, num_shards=2)
        qr = streamrl.StreamQueue(transport="ray", capacity=8192, num_shards=2)
        prod, cons = Producer.remote(case), Consumer.remote()
        g = create_group([prod, cons], "gloo")
        n = case["tensors"] * case["rows"]
        nbytes = n * case["width"] * 4
        raw, puts, reads, views, rputs, rreads = [], [], [], [], [], []

        def streamrl_run(queue, part):
            t0 = time.perf_counter()
            ray.get(prod.put.remote(queue, part))
            t1 = time.perf_counter()
            got, view = ray.get(cons.get.remote(queue, part, n))
            t2 = time.perf_counter()
            assert got == nbytes, (got, nbytes)
            ray.get(cons.drop.remote())
            return t1 - t0, t2 - t1, view

        for r in range(reps + 1):
            t0 = time.perf_counter()
            refs = [rp.get.remote(i) for i in range(case["tensors"])]
            got = ray.get(rc.take.remote(*refs))
            t1 = time.perf_counter()
            assert got == nbytes, (got, nbytes)
            del refs
            put, read, view = streamrl_run(q, f"{name}-{r}")
            rput, rread, _ = streamrl_run(qr, f"{name}-{r}")
            if r:
                raw.append(t1 - t0)
                puts.append(put)
                reads.append(read)
                views.append(view)
                rputs.append(rput)
                rreads.append(rread)
        st = asyncio.run(q.stats())
        t_end = time.time() + 10
        while ray.get(prod.held.remote())["bytes"] and time.time() < t_end:
            time.sleep(0.1)
        out["cases"][name] = {"raw": med(raw), "put": med(puts), "read": med(reads),
                              "put_read": med([a + b for a, b in zip(puts, reads)]),
                              "ray_put": med(rputs), "ray_read": med(rreads),
                              "ray_put_read": med([a + b for a, b in zip(rputs, rreads)]),
                              "bytes": nbytes, "one_buffer": all(views),
                              "bytes_by_path": st.bytes_by_path,
                              "ray_bytes_by_path": asyncio.run(qr.stats()).bytes_by_path,
                              "held_after": ray.get(prod.held.remote()),
                              "raw_all": raw, "read_all": reads, "put_all": puts,
                              "ray_read_all": rreads, "ray_put_all": rputs}
        asyncio.run(q.shutdown())
        asyncio.run(qr.shutdown())
        g.destroy()
        for a in (rp, rc, prod, cons):
            ray.kill(a)
    ray.shutdown()
    return out


def rdt_report(res: dict) -> None:
    """The RDT table: streamrl ``transport="rdt"`` and ``transport="ray"`` against raw Ray
    RDT, same tensors, same actors."""
    d = res.get("rdt", {})
    if "cases" not in d:
        print(f"  rdt: failed: {d.get('error', '?')[-800:]}")
        return
    labels = {"L": "(L) 256 x 1 MiB, 1 tensor", "S": "(S) 1024 x 64 KiB"}
    print("\nRDT, gloo, actor -> actor (GB/s of medians, ratio to raw RDT; repetitions "
          "alternate between the three)")
    print("  raw RDT: producer calls + consumer holds the tensors (compare with put+read); "
          "read: the consumer's get + materialize")
    print(f"{'case':<28}{'raw RDT':>9}{'rdt read':>16}{'rdt put+read':>16}"
          f"{'ray read':>16}{'ray put+read':>16}{'put ms rdt/ray':>16}")

    def col(c, key):
        gbs = c["bytes"] / c[key] / 1e9
        return f"{gbs:>9.2f} {gbs / (c['bytes'] / c['raw'] / 1e9):>5.2f}x"

    for k, label in labels.items():
        c = d["cases"][k]
        c.setdefault("put_read", c["put"] + c["read"])  # (results of older runs)
        raw = c["bytes"] / c["raw"] / 1e9
        ray_cols = (col(c, "ray_read") + col(c, "ray_put_read")
                    if "ray_read" in c else f"{'-':>16}{'-':>16}")
        ray_put = f"{c['ray_put'] * 1e3:.0f}" if "ray_put" in c else "-"
        print(f"{label:<28}{raw:>9.2f}{col(c, 'read'):>16}{col(c, 'put_read'):>16}"
              f"{ray_cols}{c['put'] * 1e3:>10.0f}/{ray_put:<5}")
    for k in labels:
        c = d["cases"][k]
        print(f"  ({k}) raw s {[round(x, 3) for x in c['raw_all']]}, rdt read s "
              f"{[round(x, 3) for x in c['read_all']]}, ray read s "
              f"{[round(x, 3) for x in c.get('ray_read_all', [])]}; one receive buffer: "
              f"{c['one_buffer']}; bytes_by_path rdt {c['bytes_by_path']}, ray "
              f"{c.get('ray_bytes_by_path')}; producer holds {c['held_after']} after")


# ------------------------------------------------------------------ driver


SYSTEMS = ["streamrl", "ray-torch", "ray-numpy", "transferqueue", "shm"]


def run_worker(system: str, reps: int, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", system, "--reps", str(reps), *extra]
    # loopback only; every Ray-based system gets a prefaulted object store (fresh pages
    # cost 0.2-0.5 GB/s on first touch in this VM, which would swamp every path alike)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": "",
           "RAY_preallocate_plasma_memory": "1"}
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    res = json.loads(lines[-1])
    res["wall_s"] = time.time() - t0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 reps, 1 GiB memory run")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--memory-gib", type=float, default=4.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rdt", action="store_true",
                    help="only the RDT comparison: streamrl transport='rdt' vs raw Ray RDT")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        fn = {"streamrl": lambda: worker_streamrl(a.reps),
              "ray-torch": lambda: worker_ray(a.reps, numpy=False),
              "ray-numpy": lambda: worker_ray(a.reps, numpy=True),
              "transferqueue": lambda: worker_tq(a.reps),
              "tq-compat": lambda: worker_tq(a.reps, compat=True),
              "tq-compat-nocopy": lambda: worker_tq(a.reps, compat=True, copy=False),
              "shm": lambda: worker_shm(a.reps),
              "xnode": lambda: worker_xnode(a.reps),
              "memory": lambda: worker_memory(a.memory_gib),
              "rdt": lambda: worker_rdt(a.reps)}[a.worker]
        print(json.dumps(fn()))
        return
    reps = 2 if a.quick else a.reps
    mem_gib = 1.0 if a.quick else a.memory_gib
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; reps={reps}")
    res = {}
    if a.rdt:
        print("  running rdt ...", flush=True)
        res["rdt"] = run_worker("rdt", reps, [])
        rdt_report(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    for s in a.systems.split(","):
        print(f"  running {s} ...", flush=True)
        res[s] = run_worker(s, reps, [])
    print("  running xnode (consumer on a second node) ...", flush=True)
    res["xnode"] = run_worker("xnode", reps, [])
    print("  running memory ...", flush=True)
    res["memory"] = run_worker("memory", reps, ["--memory-gib", str(mem_gib)])

    labels = {"a:2": "(a) 1024 x 64KiB +int", "b:1": "(b) 256 x 1MiB",
              "c:32": "(c) 256 x 32 x 16KiB", "c:1": "(c) read 1 of 32",
              "c:2": "(c) read 2 of 32"}
    systems = [s for s in a.systems.split(",") if "cases" in res.get(s, {})]
    others = [s for s in systems if not s.startswith("streamrl")]

    def e2e(s, k):  # put + read of the same bytes
        case = CASES[k[0]]
        read = next(r for r in case["reads"] if len(r) == int(k.split(":")[1]))
        c = res[s]["cases"][k]
        return payload(case, read) / (c["put"] + c["read"]) / 1e9

    def rd(s, k):  # read side only
        case = CASES[k[0]]
        read = next(r for r in case["reads"] if len(r) == int(k.split(":")[1]))
        return payload(case, read) / res[s]["cases"][k]["read"] / 1e9

    head = f"{'case':<24}" + "".join(f"{s:>14}" for s in systems) + (
        "".join(f"{'vs ' + s:>17}" for s in others) if "streamrl" in systems else "")
    for title, keys, fn in (
            ("producer put -> consumer holds the data: GB/s (payload / (put + read time))",
             ["a:2", "b:1", "c:32"], e2e),
            ("read side only: GB/s (bytes read / read time)", ["a:2", "b:1", "c:1", "c:2", "c:32"], rd)):
        print(f"\n{title}")
        print(head)
        for k in keys:
            row = {s: fn(s, k) for s in systems}
            line = f"{labels[k]:<24}" + "".join(f"{row[s]:>14.2f}" for s in systems)
            if "streamrl" in row:
                line += "".join(f"{row['streamrl'] / row[s]:>16.2f}x" for s in others)
            print(line)
    for s in a.systems.split(","):
        if s not in systems:
            print(f"  {s}: {res[s].get('skipped') or 'failed: ' + res[s].get('error', '?')[-400:]}")
    if "streamrl" in systems:
        sr = res["streamrl"]
        c = sr["cases"]
        print(f"\nstreamrl (c): read bandwidth 32 fields / 1 field = {rd('streamrl', 'c:32') / rd('streamrl', 'c:1'):.2f} "
              f"(target >= 0.8); read time 2 of 32 / 32 of 32 = {c['c:2']['read'] / c['c:32']['read']:.2f} "
              "(target <= 0.10)")
        print(f"wake-up (Ray, one-row put in one actor -> consumer resumes in another): "
              f"p50 {sr['wakeup_ms_p50']:.2f} ms, p90 {sr['wakeup_ms_p90']:.2f} ms")
    x = res["xnode"]
    if "cases" in x:
        c = x["cases"]
        print(f"\nstreamrl (c), consumer on another node (bytes come over the socket): "
              f"read 1 / 2 / 32 fields {c['c:1']['read'] * 1e3:.0f} / {c['c:2']['read'] * 1e3:.0f} / "
              f"{c['c:32']['read'] * 1e3:.0f} ms; 2 of 32 / 32 of 32 = "
              f"{c['c:2']['read'] / c['c:32']['read']:.2f} (target <= 0.10)")
    else:
        print("cross-node run failed:", x.get("error", "")[-800:])
    m = res["memory"]
    if "streamed" in m:
        def grow(d, k):
            return (d["end"][k] - d["base"][k]) / MiB

        print(f"\nmemory: streamed {m['streamed'] / GiB:.1f} GiB through capacity_bytes="
              f"{m['capacity_bytes'] / MiB:.0f} MiB; peak held {m['peak_bytes_held'] / MiB:.0f} MiB "
              f"({m['peak_bytes_held'] / m['capacity_bytes']:.0%} of capacity); storage units' "
              f"shared-memory arenas {m['peak_arena_bytes'] / MiB:.0f} MiB "
              f"({m['peak_arena_bytes'] / m['capacity_bytes']:.0%} of capacity); Ray object store "
              f"{m['peak_object_store_mib']} MiB")
        for who in ("producer", "consumer"):
            d = m[who]
            print(f"  {who}: peak RSS {d['end']['maxrss'] / MiB:.0f} MiB (baseline "
                  f"{d['base']['VmRSS'] / MiB:.0f} MiB, growth {(d['end']['maxrss'] - d['base']['VmRSS']) / MiB:.0f} MiB; "
                  f"private {d['end']['RssAnon'] / MiB:.0f} MiB, shared {d['end']['RssShmem'] / MiB:.0f} MiB at end)")
        for i, u in enumerate(m["units"]):
            print(f"  storage unit {i}: peak RSS {u['VmHWM'] / MiB:.0f} MiB (private "
                  f"{u['RssAnon'] / MiB:.0f} MiB, shared (arena) {u['RssShmem'] / MiB:.0f} MiB at end)")
    else:
        print("memory run failed:", m.get("error", "")[-800:])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
