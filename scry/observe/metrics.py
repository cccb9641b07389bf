"""Prometheus metrics in a registry of scry's own (never the global one).

Per-query timings are counted into plain integer arrays, a drain's worth at
a time (``observe_database`` and ``observe_phases`` take a drain's durations
in any order, counted into buckets in one pass: ``histogram.count_positions``;
``observe_query`` counts one statement),
and turned into histogram families only when Prometheus scrapes, so queries
cost no prometheus-client locking. Latency is labelled by database, never by
fingerprint (unbounded label sets would blow up the time-series database).

Objects for the proxy to update directly:

``breaker_state``               Gauge{database}: 0 closed, 1 half-open, 2 open.
``breaker_transitions_total``   Counter{database, from_state, to_state}.
``pins_total``                  Counter{reason}: sessions pinned (``count_pin``).
``health_anomalies_total``      Counter{database, kind}: health signals that appeared.

Pool gauges come from ``set_pool_stats_provider(callable)``; the callable
returns dicts ``{database, user, size, active, idle, waiting,
max_wait_seconds}`` and is called at scrape time only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from scry.observe.histogram import BucketBounds, count_positions

#: Histogram bucket upper bounds, µs (100 µs .. 10 s).
BOUNDS_US = (
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000,
    100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
)  # fmt: skip
_LE = [f"{b / 1e6:g}" for b in BOUNDS_US] + ["+Inf"]
# A duration of d ns counts as d // 1000 µs: it is above bound b µs (in a later
# bucket) exactly when d >= (b + 1) * 1000.
_EDGES_NS = tuple((b + 1) * 1000 for b in BOUNDS_US)
_EDGES = BucketBounds(_EDGES_NS)

PoolStatsProvider = Callable[[], Iterable[dict[str, Any]]]


class _Timing:
    """Bucket counts and sum for one histogram series."""

    __slots__ = ("counts", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS_US) + 1)
        self.sum_ns = 0

    def add(self, value_us: int) -> None:
        self.counts[bisect_left(BOUNDS_US, value_us)] += 1
        self.sum_ns += value_us * 1000

    def add_ns(self, values: Sequence[int], sum_ns: int) -> None:
        """Count durations in ns, in any order (``sum_ns`` is their sum)."""
        counts = self.counts
        # A duration's bucket is how many edges it reaches (bisect_right).
        for position, count in count_positions(values, _EDGES).items():
            counts[position] += count
        self.sum_ns += sum_ns

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for le, count in zip(_LE, self.counts, strict=True):
            running += count
            out.append((le, running))
        return out


class ObserveMetrics:
    """All of scry's Prometheus metrics; ``text()`` renders the exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._by_database: dict[str, tuple[_Timing, list[int]]] = {}  # timing, [queries, errors]
        self._queue = _Timing()
        self._acquire = _Timing()
        self._backend = _Timing()
        self._pinned_queries: dict[str, int] = {}
        self._pool_provider: PoolStatsProvider | None = None
        self._pipeline_provider: Callable[[], dict[str, float]] | None = None

        self.breaker_state = Gauge(
            "scry_breaker_state",
            "Circuit breaker state per database (0 closed, 1 half-open, 2 open).",
            ["database"],
            registry=self.registry,
        )
        self.breaker_transitions_total = Counter(
            "scry_breaker_transitions",
            "Circuit breaker state changes.",
            ["database", "from_state", "to_state"],
            registry=self.registry,
        )
        self.pins_total = Counter(
            "scry_pins",
            "Sessions pinned to a server, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.health_anomalies_total = Counter(
            "scry_health_anomalies",
            "Anomalies reported by the health monitor.",
            ["database", "kind"],
            registry=self.registry,
        )
        self.event_flush_seconds = Histogram(
            "scry_event_flush_seconds",
            "Time to encode and deliver one event batch.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=self.registry,
        )
        self.registry.register(_Collector(self))

    # ---------------------------------------------------------------- feed

    def observe_query(
        self,
        database: str,
        total_us: int,
        queue_us: int,
        acquire_us: int,
        backend_us: int,
        error: bool,
        pins: tuple[str, ...] | None,
    ) -> None:
        """Count one statement (called from the pipeline's drain)."""
        entry = self._by_database.get(database)
        if entry is None:
            entry = self._by_database[database] = (_Timing(), [0, 0])
        # _Timing.add, inlined: this runs once per statement.
        timing, tally = entry
        timing.add(total_us)
        tally[0] += 1
        if error:
            tally[1] += 1
        self._queue.add(queue_us)
        self._acquire.add(acquire_us)
        self._backend.add(backend_us)
        if pins:
            for reason in pins:
                self.add_pinned(reason, 1)

    def observe_database(
        self, database: str, errors: int, totals_ns: Sequence[int], sum_ns: int
    ) -> None:
        """Count many statements of one database at once: ``totals_ns`` are
        their latencies in ns (any order), ``sum_ns`` their sum."""
        entry = self._by_database.get(database)
        if entry is None:
            entry = self._by_database[database] = (_Timing(), [0, 0])
        timing, tally = entry
        timing.add_ns(totals_ns, sum_ns)
        tally[0] += len(totals_ns)
        tally[1] += errors

    def observe_phases(
        self,
        queue_ns: Sequence[int],
        acquire_ns: Sequence[int],
        backend_ns: Sequence[int],
        acquire_zeros: int,
        sums_ns: Sequence[int],
    ) -> None:
        """Count the queue, pool-acquire and backend times (ns, any order)
        of many statements at once, plus ``acquire_zeros`` acquire times of 0;
        ``sums_ns`` are the three times' sums (the column walk has them)."""
        self._queue.add_ns(queue_ns, sums_ns[0])
        self._acquire.add_ns(acquire_ns, sums_ns[1])
        self._acquire.counts[0] += acquire_zeros
        self._backend.add_ns(backend_ns, sums_ns[2])

    def count_pin(self, reasons: Iterable[str]) -> None:
        """A session was pinned to its server (committed), for these reasons."""
        for reason in reasons:
            self.pins_total.labels(reason=reason).inc()

    def add_pinned(self, reason: str, count: int) -> None:
        """Count statements run while pinned for ``reason``."""
        self._pinned_queries[reason] = self._pinned_queries.get(reason, 0) + count

    def set_pool_stats_provider(self, provider: PoolStatsProvider | None) -> None:
        """Install the callable that reports pool saturation at scrape time."""
        self._pool_provider = provider

    def set_pipeline_stats_provider(self, provider: Callable[[], dict[str, float]]) -> None:
        """Install the callable that reports the event pipeline's counters."""
        self._pipeline_provider = provider

    def text(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------- collect

    def _collect(self) -> Iterator[Metric]:
        overall = _Timing()
        per_db = HistogramMetricFamily(
            "scry_database_query_duration_seconds",
            "Statement latency (received to done) per database.",
            labels=["database"],
        )
        queries = CounterMetricFamily("scry_queries", "Statements completed.", labels=["database"])
        errors = CounterMetricFamily(
            "scry_query_errors", "Statements that ended in an error.", labels=["database"]
        )
        for database, (timing, (n, n_err)) in sorted(self._by_database.items()):
            per_db.add_metric([database], timing.buckets(), timing.sum_ns / 1e9)
            queries.add_metric([database], n)
            errors.add_metric([database], n_err)
            overall.counts = [a + b for a, b in zip(overall.counts, timing.counts, strict=True)]
            overall.sum_ns += timing.sum_ns
        yield from (per_db, queries, errors)
        for name, doc, timing in (
            ("scry_query_duration_seconds", "Statement latency, all databases.", overall),
            ("scry_query_queue_seconds", "Wait for a server connection.", self._queue),
            ("scry_query_pool_acquire_seconds", "Link setup after acquiring.", self._acquire),
            ("scry_query_backend_seconds", "Time spent in PostgreSQL.", self._backend),
        ):
            family = HistogramMetricFamily(name, doc)
            family.add_metric([], timing.buckets(), timing.sum_ns / 1e9)
            yield family
        pinned = CounterMetricFamily(
            "scry_pinned_queries", "Statements run while pinned, by reason.", labels=["reason"]
        )
        for reason, n in sorted(self._pinned_queries.items()):
            pinned.add_metric([reason], n)
        yield pinned
        yield from self._collect_pools()
        yield from self._collect_pipeline()

    def _collect_pools(self) -> Iterator[Metric]:
        if self._pool_provider is None:
            return
        try:
            pools = list(self._pool_provider())
        except Exception:  # a scrape must not fail because a provider did
            return
        gauges = {
            key: GaugeMetricFamily(f"scry_pool_{key}", doc, labels=["database", "user"])
            for key, doc in (
                ("size", "Server connections allowed in the pool."),
                ("reserve_in_use", "Server connections open beyond size (reserve_pool)."),
                ("active", "Server connections linked to a client."),
                ("idle", "Server connections idle in the pool."),
                ("waiting", "Clients waiting for a server connection."),
                ("max_wait_seconds", "Longest current wait for a server connection."),
                ("saturation", "active / size."),
            )
        }
        for pool in pools:
            labels = [str(pool.get("database", "")), str(pool.get("user", ""))]
            for key in ("size", "reserve_in_use", "active", "idle", "waiting", "max_wait_seconds"):
                gauges[key].add_metric(labels, float(pool.get(key, 0) or 0))
            size = float(pool.get("size", 0) or 0)
            gauges["saturation"].add_metric(
                labels, float(pool.get("active", 0) or 0) / size if size else 0.0
            )
        yield from gauges.values()

    def _collect_pipeline(self) -> Iterator[Metric]:
        if self._pipeline_provider is None:
            return
        stats = self._pipeline_provider()
        for key, doc in (
            ("events", "Events produced."),
            ("events_shipped", "Events delivered to the sink."),
            ("events_dropped", "Events dropped because the ring buffer was full."),
            ("events_lost", "Events in batches the sink gave up on."),
            ("event_batches", "Event batches flushed."),
            ("tail_events_dropped", "Events dropped by slow live-tail subscribers."),
            ("records_dropped", "Query records dropped before the drain saw them."),
            ("fingerprints_evicted", "Fingerprints evicted to bound memory."),
        ):
            yield CounterMetricFamily(f"scry_{key}", doc, value=stats.get(key, 0))
        yield GaugeMetricFamily(
            "scry_fingerprints", "Fingerprints tracked.", value=stats.get("fingerprints", 0)
        )
        yield GaugeMetricFamily(
            "scry_event_ring_events", "Events waiting in the ring.", value=stats.get("ring", 0)
        )


class _Collector:
    def __init__(self, metrics: ObserveMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics._collect()

    def describe(self) -> list[Metric]:
        return []  # families vary with what was seen; describe nothing up front
