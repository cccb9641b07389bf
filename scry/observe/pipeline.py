"""The Observatory: everything the proxy's query records turn into.

The proxy calls exactly one thing per statement, ``observatory.record(rec)``
(a bounded deque append; see ``scry.observe.record`` for the tuple). A
background task drains the deque when ``drain_at`` records wait (the server
that appends the one that makes ``drain_at`` calls ``wake_drain``) or
``drain_max_wait`` seconds have passed since it last did, in chunks so one
drain never holds the event loop long. The drain shares the proxy's CPU, so
it works per *chunk*, not per record:

1. per chunk, in one compiled walk (``columns.chunk_variants``; no Python
   loop per record): each text's variant (``fingerprint.Fingerprinter``:
   digits zeroed, hashed, one dict hit, giving the shape and where its hot
   lookup values sit); Python touches only the texts that missed the cache
   or need a digit check; records are grouped by variant
   (``columns.group_records``), each group's texts kept with the spans of
   its hot lookup values;
2. per shape group: the timings, rows and errors summed with builtins over
   the group (``map``/``sum``/``min``/``max``), the latency histogram counted
   in one compiled pass (``histogram.add_ns``: nothing is sorted), and one
   ``stats.StatsTable.add_group``;
3. per database and per drain: the Prometheus histograms
   (``metrics.ObserveMetrics``), counted the same way;
4. per lookup value: its cells in the hot-value sketch, hashed where it
   sits in its text (``sketch.HotData.add_span_values``), and a keyed hash
   only for the few that may enter the top-k; the raw values die with the
   drain;
5. only when someone listens: the proxy's query listeners (per record), and
   the events, when a sink or a live-tail subscriber wants them: one
   ``events.EventBlock`` per chunk built column-wise, in record order, pushed
   to the ring buffer (shipped by ``sinks.EventShipper``) and, as dicts, to
   the subscribers.

Whole-column ``map``s rather than ``zip(*records)``: zip makes an iterator
per record, a thousand young objects per chunk, which set off the garbage
collector (measured live: 0.4 µs a record, most of it gone).

A record that cannot be processed (a bug) is counted in ``record_failures``;
the rest of its chunk is processed as usual.

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
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, islice, repeat
from operator import attrgetter, is_, itemgetter
from typing import Any

from scry.config import ObservabilityConfig
from scry.log import event as log_event
from scry.observe.anonymize import Anonymizer
from scry.observe.columns import chunk_variants, event_columns, group_columns, group_records
from scry.observe.events import EventBlock, EventRing, Subscription, event_dict, make_predicate
from scry.observe.fingerprint import Fingerprinter, Shape, Variant
from scry.observe.histogram import add_ns
from scry.observe.metrics import ObserveMetrics
from scry.observe.record import CONTEXT, SQLSTATE, T_DONE, TEXT, QueryRecord
from scry.observe.sinks import EventShipper, Sink, make_sink
from scry.observe.sketch import HotData
from scry.observe.stats import StatsTable
from scry.protocol.classify import classify_bytes
from scry.protocol.messages import parse_command_rows
from scry.protocol.string_escapes import standard_text


class Observatory:
    """Fingerprints, statistics, hot data, events and metrics for one worker."""

    def __init__(
        self,
        config: ObservabilityConfig | None = None,
        *,
        sink: Sink | None = None,
        max_records: int = 100_000,
        drain_at: int = 500,
        drain_max_wait: float = 0.1,
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
        # How the proxy's health monitors are fed without touching the query
        # path. Called during the drain, per record with (database, total_us,
        # sqlstate), or per group of records of one database with (database,
        # latencies in ns, sqlstates), the two lists aligned (much cheaper).
        self.query_listeners: list[Callable[[str, int, str | None], None]] = []
        self.query_batch_listeners: list[
            Callable[[str, Sequence[int], Sequence[str | None]], None]
        ] = []
        # Told, from the drain, which clients ran statements that leave session
        # state: called with (effects, contexts of the statements that succeeded)
        # per query shape whose statements have effects (scry.protocol.classify).
        self.session_state_listeners: list[Callable[[tuple[Any, ...], list[Any]], None]] = []
        self.metrics.set_pipeline_stats_provider(self._pipeline_counters)
        events = config.events
        self.ring = EventRing(events.buffer_capacity)
        self._ship_events = sink is not None or events.sink != "none"
        self.shipper = EventShipper(
            self.ring,
            sink if sink is not None else make_sink(events),
            batch_size=events.batch_size,
            flush_interval=events.flush_interval_ms / 1000,
            linger=events.linger_ms / 1000,
            compression=events.compression,
            on_flush=self._flushed,
        )
        self._subscribers: list[Subscription] = []
        # log.log_queries (set by the proxy): a log line per statement, from the drain.
        self.log_queries = False
        self._closed_tail_drops = 0
        # Bounded at max_records by the drain, which drops (and counts) the
        # oldest beyond it; the deque's own bound, ten chunks more (what
        # 100,000 statements a second bring between two drains), only holds
        # memory if the drain ever stopped (drops past it go uncounted).
        self.queue: deque[QueryRecord] = deque(maxlen=max_records + 10 * drain_chunk)
        self._max_records = max_records
        # The drain task drains when drain_at records wait (woken by the
        # server that queued the drain_at-th, see wake_drain) or drain_max_wait
        # has passed since its last drain.
        self.drain_at = drain_at
        self.drain_max_wait = drain_max_wait
        self.drain_chunk = drain_chunk
        self._clock = clock
        # Records carry perf_counter_ns readings; this turns them into wall time.
        self._wall_offset = clock() - perf_counter_ns() / 1e9
        self._task: asyncio.Task[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._tag_rows = _TagRows()
        self._dropped = 0
        #: Records that raised while being processed (a bug, but never fatal).
        self.record_failures = 0
        self.records_processed = 0
        #: A client here has had standard_conforming_strings off: the drain
        #: then looks for its records (ClientContext.nonstandard_strings).
        self.nonstandard_strings = False
        # The hot path's one call per statement, bound straight to the C
        # append (a Python method here cost the proxy 55 ns a statement more).
        self.record = self.queue.append if self.enabled else _discard  # type: ignore[method-assign]

    # ------------------------------------------------------------------ #
    # The hot path
    # ------------------------------------------------------------------ #

    def record(self, rec: QueryRecord) -> None:
        """Queue one completed statement (the only per-query call). Each
        instance replaces this with its deque's ``append``."""
        self.queue.append(rec)

    @property
    def records_dropped(self) -> int:
        """Records lost because the drain fell behind by ``max_records``
        (the oldest go; counted when they are dropped or would be)."""
        return self._dropped + max(0, len(self.queue) - self._max_records)

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

    def wake_drain(self) -> None:
        """``drain_at`` records wait: drain now, not at ``drain_max_wait``.
        Called by the server that queued the ``drain_at``-th record (one
        ``len`` of the deque a statement there; nothing here per statement)."""
        if self._drain_waiter is not None:
            _settle(self._drain_waiter)

    async def _drain_loop(self) -> None:
        # Woken, not polling. Under load wake_drain comes first (500 records
        # are ~40 ms at 12,000 statements a second) and the drain_max_wait
        # timer never fires; it only drains a low rate's few records. Polling
        # cost tps: a bare 30 ms sleep loop added to a proxy with
        # observability off ran pgbench -S -c 50 at 0.90x of it, a 1 s one at
        # 0.96x (docs/benchmarks.md, session 29). Waiting for drain_at records
        # spreads a drain's fixed cost (sessions 18-22 there).
        loop = asyncio.get_running_loop()
        while True:
            if len(self.queue) < self.drain_at:
                waiter = self._drain_waiter = loop.create_future()
                timer = loop.call_later(self.drain_max_wait, _settle, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
                    self._drain_waiter = None
            while self.drain(self.drain_chunk) == self.drain_chunk:  # noqa: ASYNC110
                await asyncio.sleep(0)  # let queries through between chunks

    def drain(self, limit: int | None = None) -> int:
        """Process up to ``limit`` queued records now; returns how many."""
        records = self.queue
        excess = len(records) - self._max_records
        if excess > 0:  # fell behind: the oldest go, as a bounded queue would
            self._dropped += excess
            popleft = records.popleft
            for _ in range(excess):
                popleft()
        n = len(records) if limit is None else min(limit, len(records))
        if n == 0:
            return 0
        if n == len(records):
            batch = list(records)
            records.clear()
        else:  # copied in C, then dropped (half what a popleft per record costs)
            batch = list(islice(records, n))
            popleft = records.popleft
            for _ in repeat(None, n):
                popleft()
        try:
            summary = self._summarize(batch)
        except Exception:
            summary = self._summarize_carefully(batch)
        try:
            self._apply(summary)
        except Exception:  # a bug; never fatal
            self.record_failures += n
        self.records_processed += n
        self.hot_data.maybe_decay()
        if self._ship_events:
            self.shipper.notify()
        return n

    def _summarize_carefully(self, batch: list[QueryRecord]) -> _Summary:
        """``_summarize`` after setting aside the records it fails on."""
        good = []
        for rec in batch:
            try:
                self._summarize([rec])
            except Exception:
                self.record_failures += 1
            else:
                good.append(rec)
        return self._summarize(good)

    def _summarize(self, batch: list[QueryRecord]) -> _Summary:
        """Everything one chunk of records adds up to. Changes nothing but
        caches, so a chunk that fails here can be summarized again."""
        if self.nonstandard_strings:
            batch = _standard_texts(batch)  # (a second time changes nothing)
        fingerprinter = self.fingerprinter
        variant_of = fingerprinter.variants.lookup
        values: dict[bytes, int] = {}
        # The variant of every text in one walk (fingerprint.variant_key);
        # then Python only for the texts that missed or need a digit check.
        texts, keys, variants = chunk_variants(batch, fingerprinter.variants)
        distinct = dict.fromkeys(variants)
        suspects = [v for v in distinct if v is None or v.checks is not None]
        if suspects:
            resolve = fingerprinter.resolve
            for suspect in suspects:
                for i in compress(range(len(batch)), map(is_, variants, repeat(suspect))):
                    text = texts[i]
                    variant = variants[i]
                    if variant is None or not variant.matches(text):
                        variant = variant_of(keys[i])  # an earlier text may have added it
                        if variant is None or not variant.matches(text):
                            variant, found = resolve(text)
                            for key in found:
                                values[key] = values.get(key, 0) + 1
                        variants[i] = variant
            distinct = dict.fromkeys(variants)
        groups: dict[Variant, list[QueryRecord]] = (
            {variants[0]: batch} if len(distinct) == 1 else group_records(variants, batch)
        )
        by_shape: dict[Shape, list[QueryRecord]] = {}
        spanned: list[tuple[list[bytes], tuple[tuple[bytes, int, int], ...]]] = []
        for variant, recs in groups.items():
            if variant.spans:
                spanned.append((list(map(_TEXT, recs)), variant.spans))
            same = by_shape.get(variant.shape)
            by_shape[variant.shape] = recs if same is None else same + recs
        summary = _Summary(
            values, spanned, bool(self.query_listeners or self.query_batch_listeners)
        )
        session_listened = bool(self.session_state_listeners)
        for shape, recs in by_shape.items():
            self._summarize_group(summary, shape, recs)
            if session_listened:
                self._note_session_effects(summary, shape, recs)
        if self._ship_events or self._subscribers or self.log_queries:
            summary.events = self._events(batch, variants)
        return summary

    def _note_session_effects(
        self, summary: _Summary, shape: Shape, recs: list[QueryRecord]
    ) -> None:
        effects = shape.session_effects
        if effects is None:  # once per shape: its literals do not change its effects
            effects = shape.session_effects = classify_bytes(recs[0][TEXT])
        if effects:
            ran = [r[CONTEXT] for r in recs if r[SQLSTATE] is None]
            if ran:
                summary.session.append((effects, ran))

    def _summarize_group(self, summary: _Summary, shape: Shape, recs: list[QueryRecord]) -> None:
        n = len(recs)
        (databases, totals, queues, backends, acquires, sqlstates, pins, errors, rows,
         first_done, min_done, max_done, total_sum, shortest, longest, queue_sum, backend_sum,
         one_database) = group_columns(recs, self._tag_rows)  # fmt: skip
        offset = self._wall_offset
        last = max_done / 1e9 + offset
        slot_seconds = self.stats.slot_seconds
        if n > 1 and int(min_done / 1e9 + offset) // slot_seconds != int(last) // slot_seconds:
            # Across a stats slot boundary (once per slot): one group per slot.
            by_slot: dict[int, list[QueryRecord]] = {}
            for rec in recs:
                by_slot.setdefault(int(rec[T_DONE] / 1e9 + offset) // slot_seconds, []).append(rec)
            for part in by_slot.values():
                self._summarize_group(summary, shape, part)
            return
        # Nothing is sorted: the histograms count a chunk's durations in
        # any order (histogram.count_positions), and sorting them was most
        # of what counting them cost.
        if shortest < 0 or longest > _MAX_NS:  # clamped, as StatsTable.add does
            clamped = [min(max(t // 1000, 0), _MAX_US) for t in totals]
            total_us, min_us, max_us = sum(clamped), min(clamped), max(clamped)
        else:
            total_us, min_us, max_us = total_sum // 1000, shortest // 1000, longest // 1000
        hist: dict[int, int] = {}
        add_ns(hist, totals)
        summary.groups.append(
            (shape, n, errors, rows, total_us, queue_sum // 1000, backend_sum // 1000,
             min_us, max_us, hist, first_done / 1e9 + offset, last)
        )  # fmt: skip
        summary.queues.extend(queues)
        summary.backends.extend(backends)
        if acquires is None:
            summary.acquire_zeros += n
        else:
            summary.acquires.extend(acquires)
        # (total = queue + acquire + backend, each sum of int64s exact here)
        summary.phase_sums[0] += queue_sum
        summary.phase_sums[1] += total_sum - queue_sum - backend_sum
        summary.phase_sums[2] += backend_sum
        if pins is not None:
            pinned = summary.pinned
            for reasons in pins:
                if reasons:
                    for reason in reasons:
                        pinned[reason] = pinned.get(reason, 0) + 1
        by_database = summary.by_database
        database = databases[0]
        if one_database:
            entry = by_database.get(database)
            if entry is None:  # a copy: later groups extend it
                by_database[database] = [errors, totals[:], total_sum]
            else:
                entry[0] += errors
                entry[1].extend(totals)
                entry[2] += total_sum
        else:
            for database, total, sqlstate in zip(databases, totals, sqlstates, strict=True):
                entry = by_database.get(database)
                if entry is None:
                    entry = by_database[database] = [0, totals[:0], 0]
                entry[0] += sqlstate is not None
                entry[1].append(total)
                entry[2] += total
        if summary.listened is not None:
            summary.listened.append((databases, totals, sqlstates))

    def _events(self, batch: list[QueryRecord], variants: list[Variant]) -> EventBlock:
        """The events of a chunk, in record order, built column by column
        (``zip``/``map`` over the chunk: no tuple per event)."""
        columns = event_columns(batch, self._tag_rows, self._wall_offset)
        shapes = list(map(_SHAPE, variants))
        if self.anonymize:
            queries: list[str] = list(map(_NORMALIZED, shapes))
        else:
            queries = [
                (t[:-1] if t[-1:] == b"\x00" else t).decode("utf-8", "replace")
                for t in map(_TEXT, batch)
            ]
        columns[6:6] = (list(map(_FINGERPRINT, shapes)), queries)
        return EventBlock(columns, len(batch))

    def _apply(self, summary: _Summary) -> None:
        """Fold a chunk's summary into statistics, sketches, metrics, events."""
        add_group = self.stats.add_group
        hot = self.hot_data
        for group in summary.groups:
            shape, n, errors, rows, total_us, queue_us, backend_us, min_us, max_us, hist, first, last = group  # fmt: skip
            add_group(shape.fingerprint, shape.normalized, first, last, n, errors, rows,
                      total_us, queue_us, backend_us, min_us, max_us, hist)  # fmt: skip
            for table in shape.tables:
                hot.add_table(table, n)
        if summary.spanned:
            hot.add_span_values(summary.spanned)
        if summary.values:
            hot.add_values(summary.values)
        metrics = self.metrics
        for database, (errors, totals, total_sum) in summary.by_database.items():
            metrics.observe_database(database, errors, totals, total_sum)
        metrics.observe_phases(
            summary.queues,
            summary.acquires,
            summary.backends,
            summary.acquire_zeros,
            summary.phase_sums,
        )
        for reason, count in summary.pinned.items():
            metrics.add_pinned(reason, count)
        if summary.listened:
            self._tell_listeners(summary.listened)
        events = summary.events
        if events is not None:
            if self._ship_events:
                self.ring.extend(events)
            if self._subscribers:
                for event in events.rows():
                    as_dict = event_dict(event)
                    for subscription in self._subscribers:
                        subscription.offer(as_dict)
            if self.log_queries:
                _log_queries(events)
        for effects, contexts in summary.session:
            for session_listener in self.session_state_listeners:
                try:
                    session_listener(effects, contexts)
                except Exception:  # a bug; never fatal
                    self.record_failures += len(contexts)

    def _tell_listeners(
        self, listened: list[tuple[list[str], list[int], Sequence[str | None]]]
    ) -> None:
        listeners = self.query_listeners
        batch_listeners = self.query_batch_listeners
        for databases, totals, sqlstates in listened:
            if batch_listeners:
                for database, part_totals, part_sqlstates in _by_database(
                    databases, totals, sqlstates
                ):
                    for batch_listener in batch_listeners:
                        try:
                            batch_listener(database, part_totals, part_sqlstates)
                        except Exception:
                            self.record_failures += len(part_totals)
            if not listeners:
                continue
            for database, total, sqlstate in zip(databases, totals, sqlstates, strict=True):
                for listener in listeners:
                    try:
                        listener(database, total // 1000, sqlstate)
                    except Exception:
                        self.record_failures += 1

    def _flushed(self, count: int, seconds: float, ok: bool) -> None:
        self.metrics.event_flush_seconds.observe(seconds)

    # ------------------------------------------------------------------ #
    # Reading (admin API)
    # ------------------------------------------------------------------ #

    def top(
        self,
        by: str = "total_time",
        limit: int = 20,
        window_seconds: float | None = None,
        histogram: bool = False,
    ) -> list[dict[str, Any]]:
        """Heaviest fingerprints by total_time, mean, calls, errors or p99,
        since start (``window_seconds=None``) or over the last window; with
        ``histogram``, each one's latency histogram too."""
        return self.stats.top(by, limit, window_seconds, histogram=histogram)

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
            records_pending=len(self.queue),
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


def _log_queries(events: EventBlock) -> None:
    """log.log_queries: one line per statement, with the query as events carry it
    (normalized, literals anonymized, unless observability.anonymize is off)."""
    for row in events.rows():
        e = event_dict(row)
        log_event("query", client=e["client_id"], db=e["database"], user=e["user"],
                  app=e["application_name"], fingerprint=e["fingerprint"],
                  total_ms=round(e["total_us"] / 1000, 3), rows=e["rows"],
                  sqlstate=e["sqlstate"] or "", query=e["query"])  # fmt: skip


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _standard_texts(batch: list[QueryRecord]) -> list[QueryRecord]:
    """The records, those of sessions that read plain literals with
    backslash escapes given texts that PostgreSQL's parser (pglast) and the
    lexer, which assume standard_conforming_strings = on, read the same way."""
    return [
        (rec[0], standard_text(rec[1]), *rec[2:]) if rec[0].nonstandard_strings else rec
        for rec in batch
    ]


def _discard(rec: QueryRecord) -> None:
    """``record`` when fingerprinting is off."""


def _by_database(
    databases: list[str], totals: list[int], sqlstates: Sequence[str | None]
) -> list[tuple[str, Sequence[int], Sequence[str | None]]]:
    """A group's latencies and sqlstates split by database (one part, as it
    comes, when the whole group is one database's)."""
    first = databases[0]
    if databases.count(first) == len(databases):
        return [(first, totals, sqlstates)]
    parts: dict[str, tuple[list[int], list[str | None]]] = {}
    for database, total, sqlstate in zip(databases, totals, sqlstates, strict=True):
        part = parts.get(database)
        if part is None:
            part = parts[database] = ([], [])
        part[0].append(total)
        part[1].append(sqlstate)
    return [(database, part[0], part[1]) for database, part in parts.items()]


_TEXT = itemgetter(1)
_SHAPE = attrgetter("shape")
_FINGERPRINT = attrgetter("fingerprint")
_NORMALIZED = attrgetter("normalized")
_MAX_US = (1 << 40) - 1
_MAX_NS = _MAX_US * 1000
_MAX_ROWS = (1 << 63) - 1


class _Summary:
    """What one chunk of records adds up to (see ``Observatory._summarize``)."""

    __slots__ = (
        "groups",
        "values",
        "spanned",
        "by_database",
        "queues",
        "acquires",
        "acquire_zeros",
        "backends",
        "phase_sums",
        "pinned",
        "listened",
        "session",
        "events",
    )

    def __init__(
        self,
        values: dict[bytes, int],
        spanned: list[tuple[list[bytes], tuple[tuple[bytes, int, int], ...]]],
        listened: bool,
    ) -> None:
        #: Per shape (and stats slot): the arguments of StatsTable.add_group.
        self.groups: list[tuple[Any, ...]] = []
        #: Hot lookup value key -> count, for texts whose values are not
        #: where their variant's spans say (found when the text was parsed).
        self.values: dict[bytes, int] = values
        #: (texts, the spans of their hot lookup values) per variant.
        self.spanned = spanned
        #: database -> [errors, latencies (ns), sum of latencies (ns)].
        self.by_database: dict[str, list[Any]] = {}
        #: The chunk's queue, acquire and backend times (ns), and their sums.
        self.queues: array[int] = array("q")
        self.acquires: array[int] = array("q")
        self.acquire_zeros = 0
        self.backends: array[int] = array("q")
        self.phase_sums = [0, 0, 0]
        #: Pin reason -> statements run while pinned.
        self.pinned: dict[str, int] = {}
        #: (databases, latencies in ns, sqlstates) per group, for the listeners.
        self.listened: list[tuple[list[str], list[int], tuple[str | None, ...]]] | None = (
            [] if listened else None
        )
        #: (session effects, contexts that ran them) per shape with effects.
        self.session: list[tuple[tuple[Any, ...], list[Any]]] = []
        #: The chunk's events, when a sink or the live tail wants them.
        self.events: EventBlock | None = None


class _TagRows(dict[Any, int]):
    """Row counts by CommandComplete tag (an int stands for itself), memoized:
    a workload has few distinct tags."""

    def __missing__(self, tag: Any) -> int:
        rows = parse_command_rows(tag) if tag.__class__ is bytes else int(tag)
        rows = min(max(rows, 0), _MAX_ROWS)  # events keep rows as int64
        if len(self) >= 4096:
            self.clear()
        self[tag] = rows
        return rows
