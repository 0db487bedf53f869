"""Prometheus metrics of a queue, served over HTTP (``StreamQueue(metrics=True | PORT)``).

Every series is named ``streamrl_*`` and labelled by ``queue`` (its name, or its id when
it has none) and, where they apply, ``partition``, ``task``, ``reason``, ``filter``,
``unit``. They are computed when scraped, from one :meth:`streamrl.StreamQueue.stats`
snapshot (nothing is counted twice on the hot paths, and nothing is computed when
nobody scrapes):

===========================================  ====================================================
series                                       what
===========================================  ====================================================
``streamrl_rows_put_total``                  rows admitted
``streamrl_bytes_put_total``                 bytes written
``streamrl_partition_rows_put_total``        rows admitted, per partition held now
``streamrl_partition_bytes_put_total``       bytes written, per partition held now
``streamrl_rows_delivered_total``            rows handed out, per task (redeliveries included)
``streamrl_bytes_delivered_total``           bytes of the asked-for fields handed out, per task
``streamrl_rows_acked_total``                rows acknowledged, per task
``streamrl_bytes_acked_total``               bytes of the asked-for fields acknowledged, per task
``streamrl_rows_redelivered_total``          rows handed out again, per task
``streamrl_bytes_redelivered_total``         bytes of the asked-for fields handed out again
``streamrl_rows_expired_total``              rows whose lease timed out, per task
``streamrl_partition_rows_delivered_total``  rows of a partition handed out, per partition and
                                             task (also ``_acked``, ``_redelivered``, and
                                             ``streamrl_partition_bytes_*`` of each)
``streamrl_partition_rows_dropped_total``    rows that left a partition, per partition and
                                             reason (and ``..._bytes_dropped_total``)
``streamrl_rows_dropped_total``              rows that left, per reason (consumed, filtered, ...)
``streamrl_bytes_dropped_total``             bytes of those rows, per reason
``streamrl_rows_filtered_total``             rows rejected, per filter
``streamrl_bytes_filtered_total``            bytes of those rows, per filter
``streamrl_bytes_moved_total``               bytes moved between processes, per path
``streamrl_rows``                            rows held now, per partition and state
``streamrl_partition_bytes_held``            bytes held now, per partition
``streamrl_rows_held`` / ``_bytes_held``     rows and bytes held now
``streamrl_capacity_rows`` / ``_bytes``      the bounds
``streamrl_producers_waiting``               producers waiting for room or pacing
``streamrl_leases``                          open leases
``streamrl_delivery_latency_seconds``        histogram: a row's put to its first delivery, per task
``streamrl_wait_seconds``                    histogram: how long takes waited, per task
``streamrl_partition_delivery_latency_...``  the same two histograms per partition and task
``streamrl_partition_wait_seconds``          (a take over every partition is only in
                                             ``streamrl_wait_seconds``)
``streamrl_unit_rows`` / ``_bytes``          what each storage unit holds
``streamrl_materialize_seconds``             histogram: this process's materialize calls, per
                                             task and path
``streamrl_materialize_bytes_total``         bytes this process read, per task and path
===========================================  ====================================================

Series labelled by ``partition`` name the partitions held now only (those of
:attr:`streamrl.Stats.partitions`): a sealed partition is forgotten once its last row
left, and its series end with it (Prometheus sees the series stop), so their number
stays that of the partitions alive at once, whatever the length of the run. A
``_total`` series per partition counts over the partition's lifetime (saved in a
checkpoint); the queue-wide series without ``partition`` count over the queue's.

On the Ray transport with ``metrics=`` the controller actor serves the queue-wide series
on its node, and also records them as Ray metrics (``ray.util.metrics``, see
:class:`RayMirror`), so the Ray dashboard and its Prometheus/Grafana show them; each
client process adds its own ``streamrl_materialize_*`` series to the Ray metrics
(:class:`RayReads`). Without ``metrics=`` nothing is recorded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .stats import Histogram, Stats

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

#: a process's reads (``Session.reads``): ``(task, path) -> [rows, bytes, Histogram]``
Reads = dict[tuple[str, str], list]

log = logging.getLogger("streamrl")

__all__ = ["MetricsServer", "RayMirror", "RayReads", "families", "parse_spec"]


def parse_spec(spec: Any) -> tuple[str, int] | None:
    """``metrics=`` as ``(host, port)``: ``True`` (a free port on 127.0.0.1), a port
    (on 127.0.0.1), ``"host:port"``, or ``None``/``False`` (off)."""
    from .errors import InvalidArgument

    if spec is None or spec is False:
        return None
    if spec is True:
        return ("127.0.0.1", 0)
    if isinstance(spec, int) and not isinstance(spec, bool) and 0 <= spec < 65536:
        return ("127.0.0.1", spec)
    if isinstance(spec, str) and ":" in spec:
        host, _, port = spec.rpartition(":")
        if port.isdigit() and int(port) < 65536:
            return (host or "127.0.0.1", int(port))
    raise InvalidArgument(
        f"metrics must be True (a free port on 127.0.0.1), a port number, 'host:port' or "
        f"None, got {spec!r}")


def families(st: Stats, queue: str, reads: Reads | None = None) -> Iterator[Any]:
    """The metric families of one stats snapshot (and of this process's reads)."""
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                        HistogramMetricFamily)

    def counter(name, doc, labels=()):
        return CounterMetricFamily(f"streamrl_{name}", doc, labels=["queue", *labels])

    def gauge(name, doc, labels=()):
        return GaugeMetricFamily(f"streamrl_{name}", doc, labels=["queue", *labels])

    c = counter("rows_put", "Rows admitted.")
    c.add_metric([queue], st.put)
    yield c
    c = counter("bytes_put", "Bytes written.")
    c.add_metric([queue], st.bytes_put)
    yield c
    per_part = [("partition_rows_put", "put", "Rows ever put into the partition."),
                ("partition_bytes_put", "bytes_put", "Bytes ever written into the partition.")]
    for name, key, doc in per_part:
        c = counter(name, doc, ["partition"])
        for part, states in sorted(st.partitions.items()):
            c.add_metric([queue, part], states.get(key, 0))
        yield c
    per_task = [("rows_delivered", "delivered", "Rows handed out (redeliveries included)."),
                ("bytes_delivered", "bytes", "Bytes of the asked-for fields handed out."),
                ("rows_acked", "acked", "Rows acknowledged."),
                ("bytes_acked", "bytes_acked", "Bytes of the asked-for fields of rows acked."),
                ("rows_redelivered", "redelivered", "Rows handed out again."),
                ("bytes_redelivered", "bytes_redelivered",
                 "Bytes of the asked-for fields of rows handed out again."),
                ("rows_expired", "expired", "Rows whose lease timed out.")]
    for name, attr, doc in per_task:
        c = counter(name, doc, ["task"])
        for task, t in sorted(st.tasks.items()):
            c.add_metric([queue, task], getattr(t, attr))
        yield c
    pt = st.partition_tasks
    for name, key, doc in [
            ("partition_rows_delivered", "delivered",
             "Rows of the partition handed out (redeliveries included), per task."),
            ("partition_bytes_delivered", "bytes",
             "Bytes of the asked-for fields of the partition's rows handed out, per task."),
            ("partition_rows_acked", "acked", "Rows of the partition acknowledged, per task."),
            ("partition_bytes_acked", "bytes_acked",
             "Bytes of the asked-for fields of the partition's rows acked, per task."),
            ("partition_rows_redelivered", "redelivered",
             "Rows of the partition handed out again, per task."),
            ("partition_bytes_redelivered", "bytes_redelivered",
             "Bytes of the asked-for fields of the partition's rows handed out again.")]:
        c = counter(name, doc, ["partition", "task"])
        for part, by_task in sorted(pt.items()):
            for task, counts in sorted(by_task.items()):
                c.add_metric([queue, part, task], counts.get(key, 0))
        yield c
    for name, table, doc in [
            ("partition_rows_dropped", st.partition_dropped_by,
             "Rows that left the partition, per reason."),
            ("partition_bytes_dropped", st.partition_bytes_dropped_by,
             "Bytes of the rows that left the partition, per reason.")]:
        c = counter(name, doc, ["partition", "reason"])
        for part, by_reason in sorted(table.items()):
            for reason, n in sorted(by_reason.items()):
                c.add_metric([queue, part, reason], n)
        yield c
    c = counter("rows_dropped", "Rows that left the queue, per reason.", ["reason"])
    for reason, n in sorted(st.dropped_by.items()):
        c.add_metric([queue, reason], n)
    yield c
    c = counter("bytes_dropped", "Bytes of rows that left the queue, per reason.", ["reason"])
    for reason, n in sorted(st.bytes_dropped_by.items()):
        c.add_metric([queue, reason], n)
    yield c
    c = counter("rows_filtered", "Rows rejected, per filter.", ["filter"])
    for name, n in sorted(st.filtered_by.items()):
        c.add_metric([queue, name], n)
    yield c
    c = counter("bytes_filtered", "Bytes of the rows rejected, per filter.", ["filter"])
    for name, n in sorted(st.bytes_filtered_by.items()):
        c.add_metric([queue, name], n)
    yield c
    c = counter("bytes_moved", "Bytes moved between processes, per path (rdt, shm, socket, "
                "inline, local; Ray transports).", ["path"])
    for path, n in sorted(st.bytes_by_path.items()):
        c.add_metric([queue, path], n)
    yield c
    g = gauge("rows", "Rows held now, per partition and state.", ["partition", "state"])
    for part, states in sorted(st.partitions.items()):
        for state in ("waiting", "ready", "leased", "consumed"):
            g.add_metric([queue, part, state], states.get(state, 0))
    yield g
    g = gauge("partition_bytes_held", "Bytes written and held now, per partition.",
              ["partition"])
    for part, states in sorted(st.partitions.items()):
        g.add_metric([queue, part], states.get("bytes", 0))
    yield g
    for name, value, doc in [
            ("rows_held", st.rows, "Rows held now."),
            ("bytes_held", st.bytes, "Bytes held now (and reserved by puts in flight)."),
            ("capacity_rows", st.capacity, "The bound on rows."),
            ("capacity_bytes", st.capacity_bytes or 0, "The bound on bytes (0: none)."),
            ("producers_waiting", st.waiting_puts, "Producers waiting for room or pacing."),
            ("leases", st.leases, "Open leases.")]:
        g = gauge(name, doc)
        g.add_metric([queue], value)
        yield g
    for name, attr, doc in [
            ("delivery_latency_seconds", "delivery_latency",
             "Seconds from a row's put to its first delivery to the task."),
            ("wait_seconds", "wait", "Seconds a take waited for a batch.")]:
        h = HistogramMetricFamily(f"streamrl_{name}", doc, labels=["queue", "task"])
        for task, t in sorted(st.tasks.items()):
            hist = getattr(t, attr)
            if hist is not None:
                h.add_metric([queue, task], _buckets(hist), hist.sum)
        yield h
    hists: list[tuple[str, dict[str, dict[str, Histogram]], str]] = [
            ("partition_delivery_latency_seconds", st.partition_delivery,
             "Seconds from the put of a row of the partition to its first delivery to the "
             "task."),
            ("partition_wait_seconds", st.partition_wait,
             "Seconds a take that named the partition waited for a batch.")]
    for name, by_part, doc in hists:
        h = HistogramMetricFamily(f"streamrl_{name}", doc, labels=["queue", "partition", "task"])
        for part, hists_of in sorted(by_part.items()):
            for task, ph in sorted(hists_of.items()):
                h.add_metric([queue, part, task], _buckets(ph), ph.sum)
        yield h
    for name, values, doc in [("unit_rows", st.unit_rows, "Rows a storage unit holds."),
                              ("unit_bytes", st.unit_bytes, "Bytes a storage unit holds.")]:
        g = gauge(name, doc, ["unit"])
        for i, v in enumerate(values):
            g.add_metric([queue, str(i)], v)
        yield g
    if reads:
        h = HistogramMetricFamily("streamrl_materialize_seconds",
                                  "Seconds a materialize call of this process took, per task "
                                  "and the path that carried most of its bytes.",
                                  labels=["queue", "task", "path"])
        c = counter("materialize_bytes", "Bytes this process's materialize calls read, per "
                    "task and path.", ["task", "path"])
        for (task, path), (_rows, nbytes, hist) in sorted(reads.items()):
            if hist.count:
                h.add_metric([queue, task, path], _buckets(hist), hist.sum)
            c.add_metric([queue, task, path], nbytes)
        yield h
        yield c


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    seen = 0
    last = max((i for i, c in enumerate(h.counts) if c), default=0)
    for i in range(min(last + 2, Histogram.NBUCKETS)):
        seen += h.counts[i]
        out.append((repr(Histogram.bound(i)), seen))
    out.append(("+Inf", h.count))
    return out


class _Collector:
    def __init__(self, snapshot: Callable[[], Iterator[Any]]):
        self._snapshot = snapshot

    def collect(self):
        yield from self._snapshot()


class MetricsServer:
    """An HTTP ``/metrics`` endpoint (a thread of its own) serving ``families`` of a
    snapshot taken on the queue's event loop at each scrape.

    Args:
        stats: a coroutine function returning the queue's :class:`Stats`.
        loop: the event loop that runs the queue (the scrape thread submits to it), or a
            function returning it (``None`` while not known).
        queue: the ``queue`` label.
        addr: ``(host, port)`` to listen on (port 0: a free one).
        reads: this process's reads (``Session.reads``), or ``None``.
    """

    def __init__(self, stats: Callable[[], Any],
                 loop: asyncio.AbstractEventLoop | Callable[[], asyncio.AbstractEventLoop | None],
                 queue: str,
                 addr: tuple[str, int], reads: Reads | None = None,
                 timeout: float = 10.0):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as e:  # pragma: no cover - the test extra installs it
            from .errors import InvalidArgument
            raise InvalidArgument(
                "metrics= needs prometheus_client: pip install 'streamrl[metrics]' "
                "(or pass metrics=None)") from e

        self._stats, self._loop, self._queue = stats, loop, queue
        self._reads, self._timeout = reads, timeout
        self._last: Stats | None = None
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self._families))
        server, self._thread = start_http_server(addr[1], addr=addr[0],
                                                 registry=self.registry)
        self._server: WSGIServer | None = server
        self.host, self.port = addr[0], server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def _families(self) -> Iterator[Any]:
        try:
            loop = self._loop() if callable(self._loop) else self._loop
            if loop is None or loop.is_closed():
                raise RuntimeError("the queue's event loop is not known yet, or closed")
            fut = asyncio.run_coroutine_threadsafe(self._stats(), loop)
            st = fut.result(self._timeout)
            with self._lock:
                self._last = st
        except Exception as e:  # noqa: BLE001 - the loop is busy or gone: the last snapshot
            log.debug("streamrl: metrics snapshot failed (%r); serving the last one", e)
            with self._lock:
                st = self._last
        if st is None:
            return iter(())
        return families(st, self._queue, self._reads)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class RayMirror:
    """Records the series of :func:`families` as Ray metrics (``ray.util.metrics``), so
    the Ray dashboard, and the Prometheus it feeds, show them: counters as
    ``Counter`` (named without ``_total``: Ray adds it), gauges as ``Gauge`` and
    histograms as ``Histogram`` with the same power-of-two bucket bounds. Call
    :meth:`update` with each snapshot: counters grow by what they grew since the last
    one, and each histogram gets one observation per new one of the snapshot's (at a
    value inside its bucket, 3/4 of the bucket's upper bound), at most
    :attr:`MAX_OBSERVATIONS` per update: beyond that the rest waits for the next update
    (Ray's histograms take one value per call, a few us each).

    A series that leaves the snapshot (those of a sealed partition once forgotten) is
    forgotten here too: a gauge of it is set to 0 once, a counter of it stays at its
    last value in Ray's export (Ray has no way to remove a series) until the process
    ends, so Ray's export holds one stopped series per partition ever made and
    labelled; a run that makes a partition per step can leave ``metrics=`` off on Ray,
    or scrape the controller's own endpoint, which names live partitions only.

    Args:
        metrics: the ``ray.util.metrics`` module (or a stand-in; ``None``: imported at the
            first update).
    """

    MAX_OBSERVATIONS = 20_000
    BOUNDARIES = [Histogram.bound(i) for i in range(Histogram.NBUCKETS - 1)]

    def __init__(self, metrics: Any = None) -> None:
        self._rm = metrics
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple, float] = {}
        self._seen: dict[tuple, dict[str, int]] = {}  # histogram series -> le -> observed
        self._gauges: dict[tuple, dict[str, str]] = {}  # gauge series set -> its tags

    def update(self, st: Stats, queue: str, reads: Reads | None = None) -> None:
        if self._rm is None:
            import importlib

            self._rm = importlib.import_module("ray.util.metrics")
        rm = self._rm
        budget = self.MAX_OBSERVATIONS
        counters: set[tuple] = set()
        gauges: dict[tuple, dict[str, str]] = {}
        hists: set[tuple] = set()
        for fam in families(st, queue, reads):
            if fam.type == "histogram":
                budget = self._histogram(rm, fam, budget, hists)
                continue
            if fam.type not in ("counter", "gauge"):
                continue
            for sample in fam.samples:
                if sample.name.endswith("_created"):
                    continue
                name = fam.name if fam.type == "counter" else sample.name
                m: Any = self._metrics.get(name)
                if m is None:
                    kind = rm.Counter if fam.type == "counter" else rm.Gauge
                    m = self._metrics[name] = kind(
                        name, description=fam.documentation, tag_keys=tuple(sorted(sample.labels)))
                tags = dict(sample.labels)
                key = (name, tuple(sorted(tags.items())))
                if fam.type == "counter":
                    counters.add(key)
                    delta = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if delta > 0:
                        m.inc(delta, tags=tags)
                else:
                    gauges[key] = tags
                    m.set(sample.value, tags=tags)
        # series gone since the last update (a forgotten partition): Ray keeps exporting
        # a gauge's last value, so it is set to 0 once; what is remembered of them goes,
        # so that this memory stays that of the series alive now, and a partition made
        # again under the same name counts from 0 again
        for key, tags in self._gauges.items():
            if key not in gauges:
                self._metrics[key[0]].set(0, tags=tags)
        self._gauges = gauges
        for key in [k for k in self._last if k not in counters]:
            del self._last[key]
        for key in [k for k in self._seen if k not in hists]:
            del self._seen[key]

    def _histogram(self, rm: Any, fam: Any, budget: int, alive: set[tuple]) -> int:
        """Observe what each series of histogram family ``fam`` gained (adding each
        series' key to ``alive``); the budget left."""
        series: dict[tuple, list[tuple[float, str, float]]] = {}
        for sample in fam.samples:
            if not sample.name.endswith("_bucket"):
                continue
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            le = sample.labels["le"]
            series.setdefault(labels, []).append((float(le), le, sample.value))
        for labels, buckets in sorted(series.items()):
            m: Any = self._metrics.get(fam.name)
            if m is None:
                m = self._metrics[fam.name] = rm.Histogram(
                    fam.name, description=fam.documentation, boundaries=self.BOUNDARIES,
                    tag_keys=tuple(k for k, _ in labels))
            alive.add((fam.name, labels))
            seen = self._seen.setdefault((fam.name, labels), {})
            tags = dict(labels)
            below, last_bound = 0.0, 0.0
            for bound, le, cumulative in sorted(buckets):
                count, below = cumulative - below, cumulative
                value = 0.75 * bound if bound != float("inf") else 2 * last_bound
                last_bound = bound if bound != float("inf") else last_bound
                todo = min(int(count) - seen.get(le, 0), budget)
                if todo <= 0:
                    continue
                for _ in range(todo):
                    m.observe(value, tags=tags)
                seen[le] = seen.get(le, 0) + todo
                budget -= todo
        return budget


class RayReads:
    """This process's ``materialize`` reads as Ray metrics (``ray.util.metrics``): the
    ``streamrl_materialize_seconds`` histogram and ``streamrl_materialize_bytes`` counter,
    labelled by queue, task and path (see :class:`streamrl.session.Session`), recorded
    where the reads happen (any Ray worker) so the Ray dashboard sums them over the
    cluster. Made lazily, on the first read.

    Args:
        queue: the ``queue`` label.
        metrics: the ``ray.util.metrics`` module (or a stand-in; ``None``: imported at the
            first read).
    """

    BOUNDARIES = [Histogram.bound(i) for i in range(4, 36, 2)]  # 16 us .. ~2 min

    def __init__(self, queue: str, metrics: Any = None) -> None:
        self._queue = queue
        self._rm = metrics
        self._m: tuple[Any, Any] | None = None

    def __call__(self, task: str, path: str, rows: int, by_path: dict[str, int],
                 seconds: float) -> None:
        try:
            if self._m is None:
                if self._rm is None:
                    import importlib

                    self._rm = importlib.import_module("ray.util.metrics")
                rm = self._rm
                keys = ("queue", "task", "path")
                self._m = (
                    rm.Histogram("streamrl_materialize_seconds",
                                 description="Seconds a materialize call took.",
                                 boundaries=self.BOUNDARIES, tag_keys=keys),
                    rm.Counter("streamrl_materialize_bytes",
                               description="Bytes read by materialize.", tag_keys=keys))
            self._m[0].observe(seconds, tags={"queue": self._queue, "task": task, "path": path})
            for p, n in by_path.items():
                if n:
                    self._m[1].inc(n, tags={"queue": self._queue, "task": task, "path": p})
        except Exception as e:  # noqa: BLE001 - metrics never break a read
            log.debug("streamrl: Ray read metrics failed: %r", e)
