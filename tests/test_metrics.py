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
    await q.get("train", ["x"], 3, partition="p", timeout=10)  # held
    st = await q.stats()
    m = await asyncio.to_thread(_scrape, q.metrics_url)
    assert m["streamrl_rows_put_total{}"] == st.put == 16
    assert m["streamrl_rows_filtered_total{filter=no4}"] == st.filtered_by["no4"] == 4
    assert m["streamrl_rows_dropped_total{reason=consumed}"] == st.dropped_by["consumed"]
    row_bytes = 8 + 8 * 4
    assert m["streamrl_bytes_dropped_total{reason=filtered}"] == 4 * row_bytes
    assert st.bytes_dropped_by == {"filtered": 4 * row_bytes, "consumed": 6 * row_bytes}
    assert m["streamrl_rows_delivered_total{task=train}"] == st.tasks["train"].delivered == 9
    assert m["streamrl_rows_acked_total{task=train}"] == 6
    assert m["streamrl_bytes_delivered_total{task=train}"] == st.tasks["train"].bytes > 0
    assert m["streamrl_rows_held{}"] == st.rows == 6
    assert m["streamrl_rows{partition=p,state=leased}"] == 3
    assert m["streamrl_capacity_rows{}"] == 64 and m["streamrl_leases{}"] == 1
    assert m["streamrl_delivery_latency_seconds_count{task=train}"] == 9
    assert m["streamrl_wait_seconds_count{task=train}"] == 2
    if q.transport == "embedded":  # this process's reads (on Ray: the Ray metrics)
        assert m["streamrl_materialize_seconds_count{task=train}"] == 1
        assert m["streamrl_materialize_bytes_total{task=train}"] == 6 * (8 + 8 * 4)
    else:  # the controller serves the queue; each client records its reads as Ray metrics
        import pickle

        assert q._session.on_read is not None and q._session.on_read._m is not None
        twin = pickle.loads(pickle.dumps(q))  # what a worker gets
        assert twin.metrics_url == q.metrics_url and twin._session.on_read is not None


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
