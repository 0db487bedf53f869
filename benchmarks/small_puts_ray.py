"""The Ray cases of ``benchmarks/small_puts.py``: one-row puts from many producer actors.

Run: python benchmarks/small_puts.py --ray [--tq]   (or this file alone:
python benchmarks/small_puts_ray.py [--rows 20000] [--tq] [--producers 4,16]
[--episodes 1,16] [--reps 3] [--grpo none|grouped|filtered])

``--reps R`` runs each streamrl case R times, the producer counts alternating
(4, 16, 16, 4, ...) so that a slow minute of this shared machine does not land on one
count only; each case reports its median run, and ``scaling`` the rate of the most
producers over the fewest (the issue: it must not fall from 4 to 16).

Load: P producer actors (async, ``num_cpus=0``) each put ``rows / P`` one-row samples
(int64 tokens[256] + a float reward) one after another, while the driver streams batches
of 64 and materializes each (``--consumer get``: takes each batch with ``get`` and
acknowledges it with ``ack()``, as a consumer with its own loop or the TransferQueue
compat layer does). With ``--episodes E`` (E > 1) each producer runs E
episodes at once (asyncio tasks), each putting its share of the samples one after
another: an env worker stepping many environments, whose concurrent puts the Ray
transport combines into fewer calls (``streamrl.transport.ray.coalesce``); these cases
are reported as ``streamrl_PxE``. Timed from the moment every producer starts putting until
the driver holds the last row. Before that each producer puts one warm-up row, so
connections and actors are up.

Reported per case:

* ``rows_per_s``: aggregate rate (all producers together);
* ``cpu_us_per_row``: CPU time per row of each process kind over the timed window
  (``controller``, ``units`` summed, ``producers`` summed, ``driver``), less what each
  process burns while idle (Ray's own threads; measured for a second before); the
  controller's is the issue's target (at most 20 us). Read inside each actor with
  ``time.process_time()`` (the whole process, every thread) through Ray's
  ``__ray_call__``, so the library needs no extra method for it;
* ``controller_raw_us_per_row``: the controller's without taking its idle rate off;
* ``controller_us_at_issue_pace``: the controller's CPU per row scaled to the machine the
  issue's targets were set on (see ``pace`` below);
* ``unit_calls_per_row``: small-put calls the producers made per row (one per put, or
  one per group of puts combined); ``usual_share``: share of the rows that found the
  units full (a full queue), of which ``wait_share`` waited for room at the controller
  as one call a group through a unit, the rest put the usual way (room, store, commit).

``pace``: how fast this machine runs Python today, as the bare ``asyncio.Queue`` case of
``benchmarks/small_puts.py`` (one-row samples, a ``torch.cat`` per 64 rows) in the
driver before Ray starts: its cost per row, and ``scale_to_issue``, the issue's 1.8 us
for that case over it. The issue's absolute targets (a controller at most 20 us a row,
the bare controller 1M rows/s) were set on a machine that ran that case in 1.8 us; the
VMs these benchmarks run on differ by 2x from one session to the next (1.9 us on one,
3.8 us on another), so an absolute number is read with the pace it was measured at.

With ``tq``: TransferQueue 0.1.11 on the same load (polling mode: its blocking
``get_meta`` times out while rows trickle in), fewer rows since it is slow, producers
calling ``client.put`` of one-row TensorDicts (with ``--episodes E``: ``async_put`` from
E asyncio tasks a producer), the driver polling ``get_meta`` for 64 rows and calling
``get_data``. ``vs_tq``: each streamrl case's rate over TransferQueue's on the same
case.

``--bystanders K``: K more producer actors in every streamrl case, each connected (its
warm-up put) but putting nothing while the case is timed: ``--producers 4
--bystanders 12`` against ``--producers 4,16`` tells what sixteen producer processes
cost this machine apart from the puts they make. ``--bare-bystanders``: the
bystanders never touch the queue (plain idle Ray actors): what Ray's processes alone
cost.

``--grpo grouped``: each sample also carries its group key (``uid``, 8 consecutive
samples of a producer a group) and the driver takes whole groups (``group_by="uid"``);
``--grpo filtered``: a zero-variance filter judges each group first (the rewards all
differ, so every row still arrives). The GRPO pattern on Ray.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import torch
import tensordict  # noqa: F401  (streamrl imports it at a process's first materialize;
#                     imported here so that no timed part pays for it)

TOKENS = 256
BATCH = 64
TQ_STALL_S = 60.0  # TransferQueue case: give up after this long without a batch
IDLE_S = 1.0  # seconds of idle CPU measured per case, to take Ray's own threads off
HERE = os.path.dirname(os.path.abspath(__file__))


async def machine_pace(rows: int = 20_000, reps: int = 3) -> dict:
    """This machine's pace (``small_puts.pace``) from the median cost per row of
    ``small_puts``'s bare ``asyncio.Queue`` case."""
    import statistics

    import small_puts

    return small_puts.pace(statistics.median(
        [await small_puts.embedded_asyncio_queue(rows) * 1e6 for _ in range(reps)]))


#: rows of a group in the ``--grpo`` cases (the rollouts of one GRPO prompt)
GROUP = 8


def _sample(i: int, grouped: bool = False) -> dict:
    out = {"tokens": torch.full((1, TOKENS), i, dtype=torch.int64),
           "reward": torch.tensor([float(i)])}
    if grouped:  # (its group key: GROUP consecutive samples a group)
        out["uid"] = torch.tensor([i // GROUP])
    return out


class _Producer:
    """A producer actor: puts one-row samples one after another (the agentic env worker)."""

    def __init__(self):
        self.samples: list = []
        self.grouped = False

    def prepare(self, start: int, n: int, grouped: bool = False) -> int:
        self.samples = [_sample(start + i, grouped) for i in range(n)]
        self.grouped = grouped
        return os.getpid()

    async def warm(self, q, part: str) -> None:
        await q.put(_sample(-1 if not self.grouped else -GROUP, self.grouped), partition=part)

    async def run(self, q, part: str, episodes: int = 1) -> tuple[float, int, int]:
        async def episode(samples):
            for s in samples:
                await q.put(s, partition=part)

        await asyncio.gather(*[episode(self.samples[e::episodes]) for e in range(episodes)])
        co = getattr(q._transport.data, "_coalescer", None)  # calls sent for small puts
        # (and rows put the usual way, together, when the units had no room)
        return (time.perf_counter(), 0 if co is None else co.calls,
                0 if co is None else getattr(co, "usual_rows", 0),
                0 if co is None else getattr(co, "wait_rows", 0))

    def cpu(self) -> float:
        return time.process_time()


class _TQProducer:
    """The same producer on TransferQueue: ``client.put`` of one-row TensorDicts."""

    def __init__(self):
        import warnings

        warnings.filterwarnings("ignore")
        import transfer_queue as tq

        tq.init()  # attaches to the driver's TransferQueue
        self.client = tq.get_client()
        self.samples: list = []

    def prepare(self, start: int, n: int) -> int:
        from tensordict import TensorDict

        self.samples = [TensorDict(_sample(start + i), batch_size=[1]) for i in range(n)]
        return os.getpid()

    def run(self, part: str) -> float:
        for td in self.samples:
            self.client.put(data=td, partition_id=part)
        return time.perf_counter()

    def cpu(self) -> float:
        return time.process_time()


class _TQEpisodeProducer(_TQProducer):
    """The TransferQueue producer running E episodes at once (``client.async_put`` of
    one-row TensorDicts from E asyncio tasks): the ``--episodes`` load."""

    async def run_episodes(self, part: str, episodes: int) -> float:
        async def episode(samples):
            for td in samples:
                await self.client.async_put(data=td, partition_id=part)

        await asyncio.gather(*[episode(self.samples[e::episodes]) for e in range(episodes)])
        return time.perf_counter()


def _proc_cpu(actor) -> "ray.ObjectRef":  # noqa: F821
    """Process CPU seconds of any actor (all its threads), through Ray's ``__ray_call__``."""
    return actor.__ray_call__.remote(lambda self: time.process_time())


async def _streamrl_case(ray, producers: int, rows: int, shards: int,
                         episodes: int = 1, capacity: int = 4096,
                         consumer: str = "stream", grpo: str = "none",
                         bystanders: int = 0, bare: bool = False) -> dict:
    import streamrl

    Producer = ray.remote(num_cpus=0)(_Producer)
    per = rows // producers
    if grpo != "none":
        per = per // GROUP * GROUP  # (whole groups a producer)
    n = per * producers
    q = streamrl.StreamQueue(transport="ray", capacity=capacity, num_shards=shards,
                             consumers=["train"])
    try:
        ctl = q._transport._controller
        units = q._transport._units
        ps = [Producer.remote() for _ in range(producers)]
        idlers = [Producer.remote() for _ in range(bystanders)]
        await asyncio.gather(*[p.prepare.remote(i * per, per, grpo != "none")
                               for i, p in enumerate(ps)],
                             *[p.prepare.remote(0, 0, grpo != "none") for p in idlers])
        await asyncio.gather(*[p.warm.remote(q, "warm") for p in ps + ([] if bare else idlers)])
        await q.clear("warm")
        # --grpo: the consumer takes whole groups of 8 (uid), and with "filtered" a
        # zero-variance filter judges each group first (all rewards differ: none dropped)
        grouped = ({"group_by": "uid", "group_size": GROUP} if grpo != "none" else {})
        if grpo == "filtered":
            await q.add_filter(streamrl.filters.zero_variance(
                "reward", group_by="uid", group_size=GROUP))

        got = 0

        async def consume() -> float:
            nonlocal got
            if consumer == "get":  # each batch taken by get and acknowledged by ack()
                while True:
                    try:
                        mb = await q.get("train", ["tokens", "reward"], BATCH,
                                         partition="p", timeout=600, **grouped)
                    except streamrl.errors.EndOfStream:
                        break
                    td = await mb.materialize()
                    got += td.batch_size[0]
                    await mb.ack()
                return time.perf_counter()
            async for mb in q.stream("train", ["tokens", "reward"], BATCH, partition="p",
                                     timeout=600, **grouped):
                td = await mb.materialize()
                got += td.batch_size[0]
            return time.perf_counter()

        actors = [ctl, *units, *ps, *idlers]  # (bystanders count as producers)
        # each process's CPU rate while idle (Ray's own threads), taken off below
        idle0 = await asyncio.gather(*[_proc_cpu(a) for a in actors])
        ti = time.perf_counter()
        await asyncio.sleep(IDLE_S)
        idle1 = await asyncio.gather(*[_proc_cpu(a) for a in actors])
        idle = [(b - a) / (time.perf_counter() - ti) for a, b in zip(idle0, idle1)]
        reader = asyncio.ensure_future(consume())
        await asyncio.sleep(0.2)  # the consumer waits first
        cpu0 = await asyncio.gather(*[_proc_cpu(a) for a in actors])
        d0 = time.process_time()
        t0 = time.perf_counter()
        ran = await asyncio.gather(*[p.run.remote(q, "p", episodes) for p in ps])
        await q.seal("p")
        t1 = await reader
        d1 = time.process_time()
        cpu1 = await asyncio.gather(*[_proc_cpu(a) for a in actors])
        assert got == n, (got, n)
        dt = t1 - t0
        raw = [b - a for a, b in zip(cpu0, cpu1)]
        used = [max(u - r * dt, 0.0) for u, r in zip(raw, idle)]
        k = 1 + len(units)
        st = await q.stats()
        for p in ps + idlers:
            ray.kill(p)
        return {
            "producers": producers, "episodes": episodes, "rows": n, "shards": shards,
            "grpo": grpo, "bystanders": bystanders, "bare_bystanders": bare,
            "consumer": consumer, "seconds": dt,
            # put calls from the producers per row (warm-up puts included)
            "unit_calls_per_row": sum(r[1] for r in ran) / n,
            # share of the rows that found the units full (the queue was full): put
            # the usual way (room asked of the controller, stored, committed), as
            # groups, or (wait_share of all rows) as groups that waited for room at
            # the controller in one call through a unit
            "usual_share": sum(r[2] + r[3] for r in ran) / n,
            "wait_share": sum(r[3] for r in ran) / n,
            "rows_per_s": n / dt,
            "cpu_us_per_row": {
                "controller": used[0] / n * 1e6,
                "units": sum(used[1:k]) / n * 1e6,
                "producers": sum(used[k:]) / n * 1e6,
                "driver": (d1 - d0) / n * 1e6,
            },
            "controller_raw_us_per_row": raw[0] / n * 1e6,
            "idle_cpu_share": {"controller": idle[0], "units": sum(idle[1:k]),
                               "producers": sum(idle[k:])},
            "loadavg": os.getloadavg()[0],
            "left_rows": st.rows,
        }
    finally:
        await q.shutdown()


def _tq_case(ray, producers: int, rows: int, episodes: int = 1) -> dict:
    """TransferQueue on the same load (run in a thread: its sync client has its own loop)."""
    import transfer_queue as tq

    Producer = ray.remote(num_cpus=0)(_TQProducer if episodes == 1 else _TQEpisodeProducer)
    client = tq.get_client()
    per = rows // producers
    n = per * producers
    part = f"tq-{producers}x{episodes}"
    ps = [Producer.remote() for _ in range(producers)]
    ray.get([p.prepare.remote(i * per, per) for i, p in enumerate(ps)])
    t0 = time.perf_counter()
    runs = [p.run.remote(part) if episodes == 1 else p.run_episodes.remote(part, episodes)
            for p in ps]
    got = 0
    last = time.perf_counter()  # when a batch last arrived
    while got < n:
        if time.perf_counter() - last > TQ_STALL_S:
            for p in ps:
                ray.kill(p)
            return {"producers": producers, "rows": n, "received": got,
                    "error": f"no batch for {TQ_STALL_S:.0f} s: stopped"}
        meta = client.get_meta(data_fields=["tokens", "reward"], batch_size=min(BATCH, n - got),
                               partition_id=part, task_name="train")
        if len(meta) == 0:
            time.sleep(0.005)
            continue
        td = client.get_data(meta)
        got += len(td)
        last = time.perf_counter()
    dt = time.perf_counter() - t0
    ray.get(runs)
    client.clear_partition(part)
    for p in ps:
        ray.kill(p)
    return {"producers": producers, "rows": n, "seconds": dt, "rows_per_s": n / dt}


def _log(name: str, res: dict) -> None:
    print(f"  {name}: {res}", file=sys.stderr, flush=True)


def _init_ray():
    import ray

    if not ray.is_initialized():
        # (benchmarks/ on the workers' path through the environment the local Ray
        # inherits: a job-level runtime_env would double each actor's start)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")] if p)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=1 << 30, _node_ip_address="127.0.0.1")
    return ray


async def ray_cases(rows: int, tq: bool, producers: tuple[int, ...] = (4, 16),
                    shards: int = 4, tq_rows: int = 2000,
                    episodes: tuple[int, ...] = (1,), capacity: int = 4096,
                    consumer: str = "stream", reps: int = 1, grpo: str = "none",
                    bystanders: int = 0, bare: bool = False) -> dict:
    """The Ray small-put cases (see the module docstring): a dict of results per case,
    plus ratios against the issue's targets. With ``reps`` > 1 each case runs that many
    times, the producer counts alternating in order (4, 16, 16, 4, ...); a case's entry
    is its median run (by rows/s), with every run's rate in ``runs_rows_per_s``."""
    pace = await machine_pace()  # (before Ray starts: its processes take CPU)
    ray = _init_ray()
    out: dict = {"loadavg_before": os.getloadavg()[0], "pace": pace}
    try:
        for e in episodes:
            runs: dict[int, list[dict]] = {p: [] for p in producers}
            for r in range(reps):
                for p in (producers if r % 2 == 0 else producers[::-1]):
                    got = await _streamrl_case(ray, p, rows, shards, e, capacity, consumer,
                                               grpo, bystanders, bare)
                    got["controller_us_at_issue_pace"] = (
                        got["cpu_us_per_row"]["controller"] * pace["scale_to_issue"])
                    runs[p].append(got)
                    _log(f"streamrl_{p}x{e} run {r + 1}", got)
            for p in producers:
                key = f"streamrl_{p}" if e == 1 else f"streamrl_{p}x{e}"
                by_rate = sorted(runs[p], key=lambda d: d["rows_per_s"])
                out[key] = dict(by_rate[len(by_rate) // 2])
                if reps > 1:
                    out[key]["runs_rows_per_s"] = [d["rows_per_s"] for d in runs[p]]
            if len(producers) > 1:  # the "must not fall as producers go up"
                lo_p, hi_p = min(producers), max(producers)
                sfx = "" if e == 1 else f"x{e}"
                out.setdefault("scaling", {})[f"{hi_p}{sfx}_over_{lo_p}{sfx}"] = (
                    out[f"streamrl_{hi_p}{sfx}"]["rows_per_s"]
                    / out[f"streamrl_{lo_p}{sfx}"]["rows_per_s"])
        if tq:
            import warnings

            warnings.filterwarnings("ignore")
            try:
                import transfer_queue as tqm
            except ImportError:
                out["tq"] = {"skipped": "transferqueue is not installed (pip install -e '.[bench]')"}
            else:
                tqm.init({"controller": {"polling_mode": True},
                          "backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
                try:
                    for e in episodes:
                        for p in producers:
                            key = f"tq_{p}" if e == 1 else f"tq_{p}x{e}"
                            out[key] = await asyncio.to_thread(
                                _tq_case, ray, p, min(rows, tq_rows), e)
                            _log(key, out[key])
                finally:
                    tqm.close()
    finally:
        ray.shutdown()
    lo, hi = min(producers), max(producers)
    # streamrl over TransferQueue, case by case (the target: at least 20x)
    vs_tq = {k: out[k]["rows_per_s"] / out["tq" + k[8:]]["rows_per_s"]
             for k in out if k.startswith("streamrl_")
             and "rows_per_s" in out.get("tq" + k[8:], {})}
    if vs_tq:
        out["vs_tq"] = vs_tq
    if f"streamrl_{lo}" not in out:  # (only cases of several episodes a producer)
        return out
    s_lo = out[f"streamrl_{lo}"]["rows_per_s"]
    out["summary"] = {
        f"streamrl_{lo}_rows_per_s": s_lo,
        "vs_baseline_2000": s_lo / 2000, "target_vs_baseline": 5.0,
        f"scaling_{hi}_over_{lo}": out[f"streamrl_{hi}"]["rows_per_s"] / s_lo,
        "controller_cpu_us_per_row": {p: out[f"streamrl_{p}"]["cpu_us_per_row"]["controller"]
                                      for p in producers},
        "controller_cpu_us_per_row_at_issue_pace": {
            p: out[f"streamrl_{p}"]["controller_us_at_issue_pace"] for p in producers},
        "target_controller_us": 20.0,
    }
    if vs_tq:
        out["summary"]["vs_tq"] = vs_tq
        out["summary"]["target_vs_tq"] = 20.0
    return out


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--tq", action="store_true")
    ap.add_argument("--tq-rows", type=int, default=2000)
    ap.add_argument("--producers", default="4,16")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--episodes", default="1",
                    help="episodes each producer runs at once (comma-separated cases)")
    ap.add_argument("--capacity", type=int, default=4096, help="the queue's capacity (rows)")
    ap.add_argument("--consumer", choices=("stream", "get"), default="stream",
                    help="how the driver consumes: `async for` over stream() (each batch "
                    "acknowledged by asking for the next), or get() + ack() per batch")
    ap.add_argument("--reps", type=int, default=1,
                    help="runs of each streamrl case, producer counts alternating; each "
                    "case reports its median run")
    ap.add_argument("--grpo", choices=("none", "grouped", "filtered"), default="none",
                    help="each sample carries its group key (uid, 8 a group) and the "
                    "driver takes whole groups; 'filtered': a zero-variance filter "
                    "judges each group first")
    ap.add_argument("--bystanders", type=int, default=0,
                    help="this many more producer actors in every streamrl case, connected "
                    "(one warm-up put each) but putting nothing while it is timed: what "
                    "the processes alone cost the others (their CPU counts as producers')")
    ap.add_argument("--bare-bystanders", action="store_true",
                    help="the bystanders never touch the queue (plain idle Ray actors)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = asyncio.run(ray_cases(a.rows, a.tq, tuple(int(x) for x in a.producers.split(",")),
                                a.shards, a.tq_rows,
                                tuple(int(x) for x in a.episodes.split(",")), a.capacity,
                                a.consumer, a.reps, a.grpo, a.bystanders, a.bare_bystanders))
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    sys.path.insert(0, HERE)
    main()
