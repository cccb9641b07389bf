"""The Observatory: everything the proxy's query records turn into.

The proxy calls exactly one thing per statement, ``observatory.record(rec)``
(a bounded deque append; see ``scry.observe.record`` for the tuple). A
background task drains the deque every ``drain_interval`` seconds, in chunks
so one drain never holds the event loop long, and for each record:

1. fingerprints the text (cached: ``fingerprint.Fingerprinter``);
2. updates per-fingerprint statistics (``stats.StatsTable``);
3. counts tables and lookup values in the hot-data sketches (``sketch``);
4. counts Prometheus timings (``metrics.ObserveMetrics``);
5. builds the event, when a sink or a live-tail subscriber wants events,
   and pushes it to the ring buffer (shipped by ``sinks.EventShipper``) and
   to the subscribers.

With ``anonymize`` on (the default), nothing that leaves the process carries
a value a client sent: events and ``top`` show the normalized text (literals
as ``$n``, literals the parser keeps in utility statements as keyed hashes),
hot values are keyed hashes. With it off, events carry the raw text.
With ``fingerprinting`` off, ``record`` discards its argument and nothing is
computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from scry.config import ObservabilityConfig
from scry.observe.anonymize import Anonymizer
from scry.observe.events import EventRing, Subscription, event_dict, make_predicate
from scry.observe.fingerprint import Fingerprinter, lookup_values
from scry.observe.metrics import ObserveMetrics
from scry.observe.record import QueryRecord
from scry.observe.sinks import EventShipper, Sink, make_sink
from scry.observe.sketch import HotData
from scry.observe.stats import StatsTable
from scry.protocol.messages import parse_command_rows


class Observatory:
    """Fingerprints, statistics, hot data, events and metrics for one worker."""

    def __init__(
        self,
        config: ObservabilityConfig | None = None,
        *,
        sink: Sink | None = None,
        max_records: int = 100_000,
        drain_interval: float = 0.1,
        drain_chunk: int = 1_000,
        hot_decay_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
        perf_counter_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        config = config or ObservabilityConfig()
        self.config = config
        self.enabled = config.fingerprinting
        self.anonymize = config.anonymize
        self.anonymizer = Anonymizer(config.anonymize_key)
        self.fingerprinter = Fingerprinter(
            self.anonymizer if config.anonymize else None,
            max_shapes=max(10_000, 4 * config.max_fingerprints),
        )
        self.stats = StatsTable(config.max_fingerprints, clock=clock)
        hot = config.hot_data
        self.hot_data = HotData(
            self.anonymizer,
            top_k=hot.top_k,
            width=hot.width,
            depth=hot.depth,
            decay_seconds=hot_decay_seconds,
            clock=clock,
        )
        self.metrics = ObserveMetrics()
        # Called per record during the drain with (database, total_us, sqlstate):
        # how the proxy's health monitors are fed without touching the query path.
        self.query_listeners: list[Callable[[str, int, str | None], None]] = []
        self.metrics.set_pipeline_stats_provider(self._pipeline_counters)
        events = config.events
        self.ring = EventRing(events.buffer_capacity)
        self._ship_events = sink is not None or events.sink != "none"
        self.shipper = EventShipper(
            self.ring,
            sink if sink is not None else make_sink(events),
            batch_size=events.batch_size,
            flush_interval=events.flush_interval_ms / 1000,
            compression=events.compression,
            on_flush=self._flushed,
        )
        self._subscribers: list[Subscription] = []
        self._closed_tail_drops = 0
        self._records: deque[QueryRecord] = deque(maxlen=max_records)
        self._max_records = max_records
        self.drain_interval = drain_interval
        self.drain_chunk = drain_chunk
        self._clock = clock
        # Records carry perf_counter_ns readings; this turns them into wall time.
        self._wall_offset = clock() - perf_counter_ns() / 1e9
        self._task: asyncio.Task[None] | None = None
        #: Records lost because the drain fell behind by max_records.
        self.records_dropped = 0
        #: Records that raised while being processed (a bug, but never fatal).
        self.record_failures = 0
        self.records_processed = 0
        if not self.enabled:
            self.record = _discard  # type: ignore[method-assign]

    # ------------------------------------------------------------------ #
    # The hot path
    # ------------------------------------------------------------------ #

    def record(self, rec: QueryRecord) -> None:
        """Queue one completed statement (the only per-query call)."""
        records = self._records
        if len(records) == self._max_records:
            self.records_dropped += 1
        records.append(rec)

    # ------------------------------------------------------------------ #
    # The background drain
    # ------------------------------------------------------------------ #

    async def start(self) -> None:
        """Start the drain task (and the event shipper when events go somewhere)."""
        if self._task is not None or not self.enabled:
            return
        if self._ship_events:
            self.shipper.start()
        self._task = asyncio.get_running_loop().create_task(self._drain_loop(), name="scry-observe")

    async def stop(self, timeout: float = 5.0) -> None:
        """Drain what is queued, flush events (within ``timeout``), stop."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self.drain()
        await self.shipper.stop(timeout)
        for subscription in list(self._subscribers):
            subscription.close()

    async def _drain_loop(self) -> None:
        # Polling on purpose: waking an Event from record() would cost the
        # hot path a call per statement.
        while True:
            await asyncio.sleep(self.drain_interval)
            while self.drain(self.drain_chunk) == self.drain_chunk:  # noqa: ASYNC110
                await asyncio.sleep(0)  # let queries through between chunks

    def drain(self, limit: int | None = None) -> int:
        """Process up to ``limit`` queued records now; returns how many."""
        records = self._records
        n = len(records) if limit is None else min(limit, len(records))
        if n == 0:
            return 0
        lookup = self.fingerprinter.lookup
        add_stats = self.stats.add
        hot = self.hot_data
        observe_query = self.metrics.observe_query
        offset = self._wall_offset
        want_events = self._ship_events or bool(self._subscribers)
        popleft = records.popleft
        listeners = self.query_listeners
        shapes_seen: dict[Any, int] = {}  # tables are counted once per shape per drain
        for _ in range(n):
            rec = popleft()
            try:
                ctx, text, t_received, t_acquired, t_sent, t_done, rows, sqlstate, pins = rec
                if text[-1:] == b"\x00":  # a Query body keeps its terminator
                    text = text[:-1]
                if rows.__class__ is bytes:  # the CommandComplete tag, parsed here
                    rows = parse_command_rows(rows)
                shape, literals, collapsed = lookup(text)
                total_us = (t_done - t_received) // 1000
                queue_us = (t_acquired - t_received) // 1000
                acquire_us = (t_sent - t_acquired) // 1000
                backend_us = (t_done - t_sent) // 1000
                ts = t_done / 1e9 + offset
                error = sqlstate is not None
                add_stats(
                    shape.fingerprint,
                    shape.normalized,
                    ts,
                    total_us,
                    queue_us,
                    backend_us,
                    rows,
                    error,
                )
                if shape.tables:
                    shapes_seen[shape] = shapes_seen.get(shape, 0) + 1
                if literals and shape.lookup_columns:
                    for column, literal in lookup_values(shape, text, literals, collapsed):
                        hot.add_value(column, literal)
                observe_query(ctx.database, total_us, queue_us, acquire_us, backend_us, error, pins)
                for listener in listeners:
                    listener(ctx.database, total_us, sqlstate)
                if want_events:
                    self._publish(
                        (
                            ts,
                            ctx.worker,
                            ctx.client_id,
                            ctx.database,
                            ctx.user,
                            ctx.application_name,
                            shape.fingerprint,
                            shape.normalized if self.anonymize else text.decode("utf-8", "replace"),
                            queue_us,
                            acquire_us,
                            backend_us,
                            total_us,
                            rows,
                            sqlstate,
                            pins is not None,
                            pins or (),
                        )
                    )
            except Exception:
                self.record_failures += 1
        self.records_processed += n
        for shape, count in shapes_seen.items():
            for table in shape.tables:
                hot.add_table(table, count)
        hot.maybe_decay()
        if self._ship_events:
            self.shipper.notify()
        return n

    def _publish(self, event: tuple[Any, ...]) -> None:
        if self._ship_events:
            self.ring.push(event)
        if self._subscribers:
            as_dict = event_dict(event)
            for subscription in self._subscribers:
                subscription.offer(as_dict)

    def _flushed(self, count: int, seconds: float, ok: bool) -> None:
        self.metrics.event_flush_seconds.observe(seconds)

    # ------------------------------------------------------------------ #
    # Reading (admin API)
    # ------------------------------------------------------------------ #

    def top(
        self, by: str = "total_time", limit: int = 20, window_seconds: float | None = None
    ) -> list[dict[str, Any]]:
        """Heaviest fingerprints by total_time, mean, calls, errors or p99,
        since start (``window_seconds=None``) or over the last window."""
        return self.stats.top(by, limit, window_seconds)

    def hot(self, limit: int = 20) -> dict[str, list[dict[str, Any]]]:
        """Hottest tables and lookup values (estimated, decaying counts)."""
        return self.hot_data.hot(limit)

    def subscribe(
        self,
        filter: Mapping[str, Any] | Callable[[dict[str, Any]], bool] | None = None,  # noqa: A002
        maxsize: int = 1_000,
    ) -> Subscription:
        """A live tail of events; a slow reader drops its oldest (counted)."""
        subscription = Subscription(make_predicate(filter), maxsize, self._unsubscribe)
        self._subscribers.append(subscription)
        return subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(subscription)
            self._closed_tail_drops += subscription.dropped

    def _tail_drops(self) -> int:
        return self._closed_tail_drops + sum(s.dropped for s in self._subscribers)

    def metrics_text(self) -> str:
        """Prometheus text exposition of scry's own registry."""
        return self.metrics.text().decode("utf-8")

    def stats_summary(self, window_seconds: float = 60) -> dict[str, Any]:
        """Totals: queries, errors, qps and p99 over the window, drops, evictions."""
        summary = self.stats.summary(window_seconds)
        summary.update(
            events_dropped=self.ring.dropped,
            events_lost=self.shipper.lost,
            tail_events_dropped=self._tail_drops(),
            records_dropped=self.records_dropped,
            records_pending=len(self._records),
            shapes_parsed=self.fingerprinter.parses,
            anonymize=self.anonymize,
            anonymize_key_random=self.anonymizer.key_is_random,
        )
        return summary

    def _pipeline_counters(self) -> dict[str, float]:
        return {
            "events": self.ring.pushed,
            "events_shipped": self.shipper.shipped,
            "events_dropped": self.ring.dropped,
            "events_lost": self.shipper.lost,
            "event_batches": self.shipper.batches,
            "tail_events_dropped": self._tail_drops(),
            "records_dropped": self.records_dropped,
            "fingerprints_evicted": self.stats.evicted,
            "fingerprints": len(self.stats),
            "ring": len(self.ring),
        }


def _discard(rec: QueryRecord) -> None:
    """``record`` when fingerprinting is off."""
