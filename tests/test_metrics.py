"""Metrics: StreamQueue(metrics=...) serves Prometheus text at /metrics, with series
that agree with stats(), on every transport."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import torch

from streamrl.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "queue")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


async def test_metrics_agree_with_stats(make_queue):
    q = make_queue(capacity=64, consumers=["train"], metrics=True, name="mq")
    assert q.metrics_url.startswith("http://127.0.0.1:")
    await q.add_filter(lambda td: td["x"] % 4 != 0, fields=["x"], name="no4")
    await q.put({"x": torch.arange(16), "y": torch.zeros(16, 8)}, partition="p")
    mb = await q.get("train", ["x", "y"], 6, partition="p", timeout=10)
    await mb.materialize()
    await mb.ack()
    held = await q.get("train", ["x"], 3, partition="p", timeout=10)
    await held.release()
    await q.get("train", ["x"], 6, partition="p", timeout=10)  # held: 3 of them again
    await q.put({"x": torch.arange(1, 3), "y": torch.zeros(2, 8)}, partition="other")
    st = await q.stats()
    m = await asyncio.to_thread(_scrape, q.metrics_url)
    row_bytes = 8 + 8 * 4
    assert m["streamrl_rows_put_total{}"] == st.put == 18
    assert m["streamrl_bytes_put_total{}"] == st.bytes_put == 18 * row_bytes
    # per partition: put (ever) and held (now)
    assert m["streamrl_partition_rows_put_total{partition=p}"] == st.partitions["p"]["put"] == 16
    assert m["streamrl_partition_rows_put_total{partition=other}"] == 2
    assert m["streamrl_partition_bytes_put_total{partition=p}"] == 16 * row_bytes
    assert m["streamrl_partition_bytes_put_total{partition=other}"] == 2 * row_bytes
    assert m["streamrl_partition_bytes_held{partition=p}"] == st.partitions["p"]["bytes"] \
        == 6 * row_bytes
    assert m["streamrl_partition_bytes_held{partition=other}"] == 2 * row_bytes
    assert m["streamrl_rows_filtered_total{filter=no4}"] == st.filtered_by["no4"] == 4
    assert m["streamrl_bytes_filtered_total{filter=no4}"] == st.bytes_filtered_by["no4"] \
        == 4 * row_bytes
    assert m["streamrl_rows_dropped_total{reason=consumed}"] == st.dropped_by["consumed"]
    assert m["streamrl_bytes_dropped_total{reason=filtered}"] == 4 * row_bytes
    assert st.bytes_dropped_by == {"filtered": 4 * row_bytes, "consumed": 6 * row_bytes}
    t = st.tasks["train"]
    assert m["streamrl_rows_delivered_total{task=train}"] == t.delivered == 6 + 3 + 6
    assert m["streamrl_rows_acked_total{task=train}"] == 6
    assert m["streamrl_bytes_delivered_total{task=train}"] == t.bytes == 6 * row_bytes + 9 * 8
    assert m["streamrl_bytes_acked_total{task=train}"] == t.bytes_acked == 6 * row_bytes
    assert m["streamrl_rows_redelivered_total{task=train}"] == t.redelivered == 3
    assert m["streamrl_bytes_redelivered_total{task=train}"] == t.bytes_redelivered == 3 * 8
    assert m["streamrl_rows_held{}"] == st.rows == 8
    assert m["streamrl_rows{partition=p,state=leased}"] == 6
    assert m["streamrl_capacity_rows{}"] == 64 and m["streamrl_leases{}"] == 1
    assert m["streamrl_delivery_latency_seconds_count{task=train}"] == 12  # first deliveries
    assert m["streamrl_wait_seconds_count{task=train}"] == 3
    # labelled by partition too: what was delivered, acked, redelivered and dropped from
    # each partition, and the latency and wait histograms of each
    pt = st.partition_tasks["p"]["train"]
    assert pt == {"delivered": 15, "bytes": 6 * row_bytes + 9 * 8, "redelivered": 3,
                  "bytes_redelivered": 3 * 8, "acked": 6, "bytes_acked": 6 * row_bytes}
    assert "other" not in st.partition_tasks  # nothing taken from it
    series = {"delivered": "rows_delivered", "bytes": "bytes_delivered",
              "redelivered": "rows_redelivered", "bytes_redelivered": "bytes_redelivered",
              "acked": "rows_acked", "bytes_acked": "bytes_acked"}
    for key, value in pt.items():
        name = f"streamrl_partition_{series[key]}_total{{partition=p,task=train}}"
        assert m[name] == value, name
    assert st.partition_dropped_by == {"p": {"filtered": 4, "consumed": 6}}
    assert st.partition_bytes_dropped_by == {"p": {"filtered": 4 * row_bytes,
                                                   "consumed": 6 * row_bytes}}
    for reason in ("filtered", "consumed"):
        assert m[f"streamrl_partition_rows_dropped_total{{partition=p,reason={reason}}}"] \
            == st.partition_dropped_by["p"][reason]
        assert m[f"streamrl_partition_bytes_dropped_total{{partition=p,reason={reason}}}"] \
            == st.partition_bytes_dropped_by["p"][reason]
    h = st.partition_delivery["p"]["train"]
    assert m["streamrl_partition_delivery_latency_seconds_count{partition=p,task=train}"] \
        == h.count == 12
    assert m["streamrl_partition_delivery_latency_seconds_sum{partition=p,task=train}"] \
        == pytest.approx(h.sum)
    assert m["streamrl_partition_wait_seconds_count{partition=p,task=train}"] \
        == st.partition_wait["p"]["train"].count == 3
    if q.transport == "embedded":  # this process's reads (on Ray: the Ray metrics)
        assert m["streamrl_materialize_seconds_count{path=local,task=train}"] == 1
        assert m["streamrl_materialize_bytes_total{path=local,task=train}"] == 6 * row_bytes
    else:  # the controller serves the queue; each client records its reads as Ray metrics
        import pickle

        assert q._session.on_read is not None and q._session.on_read._m is not None
        twin = pickle.loads(pickle.dumps(q))  # what a worker gets
        assert twin.metrics_url == q.metrics_url and twin._session.on_read is not None
        # and the Ray node exports them, as the Ray dashboard's Prometheus reads them:
        # the controller's mirror (every 5 s), and this process's reads
        want = {"ray_streamrl_rows_put_total": 18,
                "ray_streamrl_partition_rows_put_total": 16,  # (partition p)
                "ray_streamrl_partition_rows_acked_total": 6,
                "ray_streamrl_delivery_latency_seconds_count": 12,
                "ray_streamrl_materialize_seconds_count": 1}
        got = await asyncio.to_thread(_ray_exported, want, {"queue": "mq"})
        assert got == want, got


async def test_partition_labels_of_every_drop_reason_and_of_forgotten_partitions():
    """Rows dropped as stale, cleared and lost are labelled by their partition, as
    stats() counts them; a sealed partition whose last row left is forgotten, and so
    are its series (the number of series stays that of the partitions held)."""
    import streamrl

    async with streamrl.StreamQueue(capacity=64, num_shards=2, max_staleness=1,
                                    consumers=["train"], metrics=True) as q:
        await q.put({"x": torch.arange(4)}, partition="old")  # version 0
        await q.put({"x": torch.arange(5)}, partition="gone", version=2)
        await q.put({"x": torch.arange(3)}, partition="keep", version=2)
        mb = await q.get("train", ["x"], 2, partition="keep", timeout=10)
        await mb.ack()
        assert await q.set_version(2) == 4  # "old" is stale now
        assert await q.clear("gone") == 5
        await q.put({"x": torch.arange(6)}, partition="lost", version=2)
        await q.session.control.report_lost(0)  # what a transport reports when a unit dies
        st = await q.stats()
        m = await asyncio.to_thread(_scrape, q.metrics_url)
        assert st.dropped_by["stale"] == 4 and st.dropped_by["cleared"] == 5
        lost = st.dropped_by["lost"]
        assert 0 < lost and lost == sum(d.get("lost", 0)
                                        for d in st.partition_dropped_by.values())
        assert st.partition_dropped_by["old"] == {"stale": 4}
        assert st.partition_dropped_by["gone"] == {"cleared": 5}
        assert st.partition_bytes_dropped_by["gone"] == {"cleared": 5 * 8}
        assert st.partition_dropped_by["keep"]["consumed"] == 2
        for part, by_reason in st.partition_dropped_by.items():
            for reason, n in by_reason.items():
                key = f"{{partition={part},reason={reason}}}"
                assert m[f"streamrl_partition_rows_dropped_total{key}"] == n, key
                assert m[f"streamrl_partition_bytes_dropped_total{key}"] \
                    == st.partition_bytes_dropped_by[part][reason], key
        # the queue-wide series are the sums of the partitions'
        for reason, n in st.dropped_by.items():
            assert m[f"streamrl_rows_dropped_total{{reason={reason}}}"] == n == sum(
                v for k, v in m.items()
                if k.startswith("streamrl_partition_rows_dropped_total{")
                and k.endswith(f",reason={reason}}}"))
        assert m["streamrl_partition_rows_acked_total{partition=keep,task=train}"] == 2
        assert any("partition=old" in k for k in m)
        await q.put({"x": torch.arange(3)}, partition="done", version=2)
        mb = await q.get("train", ["x"], 3, partition="done", timeout=10)
        await mb.ack()  # consumed: "done" is empty
        m = await asyncio.to_thread(_scrape, q.metrics_url)
        assert m["streamrl_partition_delivery_latency_seconds_count{partition=done,task=train}"] \
            == 3
        assert m["streamrl_delivery_latency_seconds_count{task=train}"] == 2 + 3
        for part in ("old", "gone", "done"):  # empty and sealed: forgotten, series end
            await q.seal(part)
        st = await q.stats()
        m = await asyncio.to_thread(_scrape, q.metrics_url)
        assert "old" not in st.partitions and "old" not in st.partition_dropped_by
        assert not any(f"partition={p}" in k for k in m for p in ("old", "gone", "done"))
        assert m["streamrl_partition_rows_acked_total{partition=keep,task=train}"] == 2
        # the task's histogram keeps the rows of forgotten partitions
        assert m["streamrl_delivery_latency_seconds_count{task=train}"] == 5 \
            == st.tasks["train"].delivery_latency.count


def test_the_ray_mirror_forgets_series_of_forgotten_partitions():
    """A partition's series that leave the snapshot: its gauges go to 0 in Ray once,
    and the mirror remembers nothing of it (a partition made again under the same name
    counts from 0)."""
    from streamrl.metrics import RayMirror

    rm = _fake_ray_metrics()
    mirror = RayMirror(rm)
    mirror.update(_stats(5, [0.01]), "q")
    held = rm.registry["streamrl_partition_bytes_held"]
    assert held.calls == [("set", 40, {"queue": "q", "partition": "p"})]
    assert any(k[0] == "streamrl_partition_rows_put" for k in mirror._last)
    empty = _stats(0, [0.01])
    empty.partitions = {}
    mirror.update(empty, "q")
    assert held.calls[1:] == [("set", 0, {"queue": "q", "partition": "p"})]
    assert not any(dict(k[1]).get("partition") for k in mirror._last)
    mirror.update(empty, "q")
    assert len(held.calls) == 2  # set to 0 once
    mirror.update(_stats(3, [0.01]), "q")  # "p" again, from 0
    assert rm.registry["streamrl_partition_rows_put"].calls[-1] == (
        "inc", 3, {"queue": "q", "partition": "p"})


def _ray_exported(want: dict[str, float], labels: dict[str, str],
                  deadline: float = 60.0) -> dict[str, float]:
    """The values of ``want``'s series (with ``labels``, and ``partition="p"`` and
    ``task="train"`` where they have those labels) that this Ray node exports, once they
    equal ``want`` or after ``deadline`` seconds (Ray exports every few seconds)."""
    import re
    import time

    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    line = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
    pair = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
    got: dict[str, float] = {}
    end = time.monotonic() + deadline
    while True:
        try:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError as e:
            pytest.skip(f"this Ray node exports no metrics ({url}: {e})")
        got = {}
        for raw in text.splitlines():
            m = line.match(raw)
            if m is None or m.group(1) not in want:
                continue
            lab = dict(pair.findall(m.group(2)))
            if any(lab.get(k) != v for k, v in labels.items()):
                continue
            if lab.get("partition", "p") != "p" or lab.get("task", "train") != "train":
                continue
            got[m.group(1)] = got.get(m.group(1), 0.0) + float(m.group(3))
        if got == want or time.monotonic() > end:
            return got
        time.sleep(1.0)


def test_a_bad_metrics_spec_is_refused():
    import streamrl

    for bad in ("x", -1, 70000, 1.5, "host:port"):
        with pytest.raises(InvalidArgument, match="metrics"):
            streamrl.StreamQueue(metrics=bad)


def test_bytes_by_path_is_a_counter_per_path():
    from streamrl.metrics import families
    from streamrl.stats import Stats

    st = Stats(bytes_by_path={"rdt": 5, "shm": 7})
    fam = next(f for f in families(st, "q") if f.name == "streamrl_bytes_moved")
    got = {s.labels["path"]: s.value for s in fam.samples if s.name.endswith("_total")}
    assert got == {"rdt": 5, "shm": 7}


class _FakeMetric:
    """A stand-in for a ``ray.util.metrics`` metric that remembers what it was given, and
    checks its tags as Ray does (every tag key given, nothing else)."""

    def __init__(self, registry, kind, name, description="", boundaries=None, tag_keys=()):
        assert isinstance(tag_keys, tuple) and name not in registry
        self.kind, self.name, self.tag_keys, self.boundaries = kind, name, tag_keys, boundaries
        self.calls: list[tuple[str, float, dict]] = []
        registry[name] = self

    def _record(self, op, value, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags, self.tag_keys)
        assert all(isinstance(v, str) for v in tags.values())
        self.calls.append((op, value, dict(tags)))

    def inc(self, value=1.0, tags=None):
        assert value > 0
        self._record("inc", value, tags)

    def set(self, value, tags=None):
        self._record("set", value, tags)

    def observe(self, value, tags=None):
        self._record("observe", value, tags)


def _fake_ray_metrics():
    import types

    registry: dict[str, _FakeMetric] = {}
    mod = types.SimpleNamespace(registry=registry)
    for kind in ("Counter", "Gauge", "Histogram"):
        setattr(mod, kind, lambda name, _k=kind, **kw: _FakeMetric(registry, _k, name, **kw))
    return mod


def _stats(put: int, latencies: list[float]):
    from streamrl.stats import Histogram, Stats, TaskStats

    h = Histogram()
    for s in latencies:
        h.observe(s)
    return Stats(put=put, rows=put, capacity=100,
                 partitions={"p": {"rows": put, "ready": put, "put": put, "bytes_put": 8 * put,
                                   "bytes": 8 * put, "sealed": 0}},
                 tasks={"train": TaskStats(delivered=len(latencies), delivery_latency=h)})


def test_the_ray_mirror_records_counters_gauges_and_histograms():
    import bisect

    from streamrl.metrics import RayMirror
    from streamrl.stats import Histogram

    rm = _fake_ray_metrics()
    mirror = RayMirror(rm)
    first = [0.3, 0.3, 1e-5]
    mirror.update(_stats(5, first), "q")
    reg = rm.registry
    # a counter is named as Prometheus names it without _total (Ray adds it)
    assert "streamrl_rows_put" in reg and not any(n.endswith("_total") for n in reg)
    assert reg["streamrl_rows_put"].kind == "Counter"
    assert reg["streamrl_rows_put"].calls == [("inc", 5, {"queue": "q"})]
    assert reg["streamrl_partition_rows_put"].calls == [("inc", 5, {"queue": "q",
                                                                     "partition": "p"})]
    assert reg["streamrl_rows_held"].kind == "Gauge"
    assert reg["streamrl_rows_held"].calls == [("set", 5, {"queue": "q"})]
    hist = reg["streamrl_delivery_latency_seconds"]
    assert hist.kind == "Histogram"
    tags = {"queue": "q", "task": "train"}
    assert [c[2] for c in hist.calls] == [tags] * 3

    def buckets(values):  # the Ray histogram's bucket of each value (upper bound inclusive)
        return sorted(bisect.bisect_left(hist.boundaries, v) for v in values)

    # each observation lands in the Ray bucket of the same bounds as the original's
    assert hist.boundaries == [Histogram.bound(i) for i in range(Histogram.NBUCKETS - 1)]
    assert buckets([c[1] for c in hist.calls]) == buckets(first)
    assert buckets([c[1] for c in hist.calls]) == [4, 19, 19]  # 8-16 us, 0.26-0.52 s
    # the next snapshot: counters grow by the difference, histograms get the new ones
    mirror.update(_stats(8, first + [2.0, 2.0]), "q")
    assert reg["streamrl_rows_put"].calls[1:] == [("inc", 3, {"queue": "q"})]
    assert reg["streamrl_rows_held"].calls[1:] == [("set", 8, {"queue": "q"})]
    assert buckets([c[1] for c in hist.calls[3:]]) == [21, 21]
    # nothing new: nothing recorded (gauges set again)
    mirror.update(_stats(8, first + [2.0, 2.0]), "q")
    assert len(hist.calls) == 5 and len(reg["streamrl_rows_put"].calls) == 2


def test_the_ray_mirror_spreads_a_burst_of_observations_over_updates():
    from streamrl.metrics import RayMirror

    rm = _fake_ray_metrics()
    mirror = RayMirror(rm)
    mirror.MAX_OBSERVATIONS = 4
    st = _stats(10, [0.01] * 10)
    counts = []
    for _ in range(4):
        mirror.update(st, "q")
        counts.append(len(rm.registry["streamrl_delivery_latency_seconds"].calls))
    assert counts == [4, 8, 10, 10]  # late, but every one, once


def test_ray_reads_record_time_and_bytes_per_path():
    from streamrl.metrics import RayReads

    rm = _fake_ray_metrics()
    reads = RayReads("q", rm)
    reads("train", "shm", 4, {"shm": 4096, "inline": 40}, 0.002)
    h, c = rm.registry["streamrl_materialize_seconds"], rm.registry["streamrl_materialize_bytes"]
    assert h.calls == [("observe", 0.002, {"queue": "q", "task": "train", "path": "shm"})]
    assert sorted((v, t["path"]) for _, v, t in c.calls) == [(40, "inline"), (4096, "shm")]
