"""Prometheus metrics of a queue, served over HTTP (``StreamQueue(metrics=True | PORT)``).

Every series is named ``streamrl_*`` and labelled by ``queue`` (its name, or its id when
it has none) and, where they apply, ``partition``, ``task``, ``reason``, ``filter``,
``unit``. They are computed when scraped, from one :meth:`streamrl.StreamQueue.stats`
snapshot (nothing is counted twice on the hot paths, and nothing is computed when
nobody scrapes):

==========================================  =====================================================
series                                      what
==========================================  =====================================================
``streamrl_rows_put_total``                 rows admitted
``streamrl_bytes_put_total``                bytes written
``streamrl_rows_delivered_total``           rows handed out, per task (redeliveries included)
``streamrl_bytes_delivered_total``          bytes of the asked-for fields handed out, per task
``streamrl_rows_acked_total``               rows acknowledged, per task
``streamrl_rows_redelivered_total``         rows handed out again, per task
``streamrl_rows_expired_total``             rows whose lease timed out, per task
``streamrl_rows_dropped_total``             rows that left, per reason (consumed, filtered, ...)
``streamrl_rows_filtered_total``            rows rejected, per filter
``streamrl_rows``                           rows held now, per partition and state
``streamrl_rows_held`` / ``streamrl_bytes_held``  rows and bytes held now
``streamrl_capacity_rows`` / ``_bytes``     the bounds
``streamrl_producers_waiting``              producers waiting for room or pacing
``streamrl_leases``                         open leases
``streamrl_delivery_latency_seconds``       histogram: a row's put to its first delivery, per task
``streamrl_wait_seconds``                   histogram: how long takes waited, per task
``streamrl_unit_rows`` / ``_bytes``         what each storage unit holds
``streamrl_materialize_seconds``            histogram: this process's materialize calls, per task
``streamrl_materialize_bytes_total``        tensor bytes this process read, per task
==========================================  =====================================================

On the Ray transport the controller actor serves the queue-wide series on its node, and
also records them as Ray metrics (``ray.util.metrics``), so the Ray dashboard and its
Prometheus/Grafana show them with no extra setup; each client process adds its own
``streamrl_materialize_*`` series to the Ray metrics.
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


def families(st: Stats, queue: str, reads: dict[str, list] | None = None) -> Iterator[Any]:
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
    per_task = [("rows_delivered", "delivered", "Rows handed out (redeliveries included)."),
                ("bytes_delivered", "bytes", "Bytes of the asked-for fields handed out."),
                ("rows_acked", "acked", "Rows acknowledged."),
                ("rows_redelivered", "redelivered", "Rows handed out again."),
                ("rows_expired", "expired", "Rows whose lease timed out.")]
    for name, attr, doc in per_task:
        c = counter(name, doc, ["task"])
        for task, t in sorted(st.tasks.items()):
            c.add_metric([queue, task], getattr(t, attr))
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
    for name, values, doc in [("unit_rows", st.unit_rows, "Rows a storage unit holds."),
                              ("unit_bytes", st.unit_bytes, "Bytes a storage unit holds.")]:
        g = gauge(name, doc, ["unit"])
        for i, v in enumerate(values):
            g.add_metric([queue, str(i)], v)
        yield g
    if reads:
        h = HistogramMetricFamily("streamrl_materialize_seconds",
                                  "Seconds a materialize call of this process took.",
                                  labels=["queue", "task"])
        c = counter("materialize_bytes", "Tensor bytes this process read.", ["task"])
        for task, (_rows, nbytes, hist) in sorted(reads.items()):
            h.add_metric([queue, task], _buckets(hist), hist.sum)
            c.add_metric([queue, task], nbytes)
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
                 addr: tuple[str, int], reads: dict[str, list] | None = None,
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
    """Records the counters and gauges of :func:`families` as Ray metrics
    (``ray.util.metrics``), so the Ray dashboard, and the Prometheus it feeds, show them.
    Histograms are left to the HTTP endpoint. Call :meth:`update` with each snapshot."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple, float] = {}

    def update(self, st: Stats, queue: str, reads: dict[str, list] | None = None) -> None:
        from ray.util import metrics as rm

        for fam in families(st, queue, reads):
            if fam.type not in ("counter", "gauge"):
                continue
            for sample in fam.samples:
                if sample.name.endswith("_created"):
                    continue
                keys = tuple(sorted(sample.labels))
                # a Counter or a Gauge, as fam.type says
                m: Any = self._metrics.get(sample.name)
                if m is None:
                    kind = rm.Counter if fam.type == "counter" else rm.Gauge
                    m = self._metrics[sample.name] = kind(
                        sample.name, description=fam.documentation, tag_keys=keys)
                tags = dict(sample.labels)
                if fam.type == "counter":
                    key = (sample.name, tuple(sorted(tags.items())))
                    delta = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if delta > 0:
                        m.inc(delta, tags=tags)
                else:
                    m.set(sample.value, tags=tags)


class RayReads:
    """This process's ``materialize`` reads as Ray metrics (``ray.util.metrics``): the
    ``streamrl_materialize_seconds`` histogram and ``streamrl_materialize_bytes`` counter,
    labelled by queue and task, recorded where the reads happen (any Ray worker) so the
    Ray dashboard sums them over the cluster. Made lazily, on the first read."""

    BOUNDARIES = [Histogram.bound(i) for i in range(4, 36, 2)]  # 16 us .. ~2 min

    def __init__(self, queue: str) -> None:
        self._queue = queue
        self._m: tuple[Any, Any] | None = None

    def __call__(self, task: str, rows: int, nbytes: int, seconds: float) -> None:
        try:
            if self._m is None:
                from ray.util import metrics as rm

                self._m = (
                    rm.Histogram("streamrl_materialize_seconds",
                                 description="Seconds a materialize call took.",
                                 boundaries=self.BOUNDARIES, tag_keys=("queue", "task")),
                    rm.Counter("streamrl_materialize_bytes",
                               description="Tensor bytes read by materialize.",
                               tag_keys=("queue", "task")))
            tags = {"queue": self._queue, "task": task}
            self._m[0].observe(seconds, tags=tags)
            if nbytes:
                self._m[1].inc(nbytes, tags=tags)
        except Exception as e:  # noqa: BLE001 - metrics never break a read
            log.debug("streamrl: Ray read metrics failed: %r", e)
