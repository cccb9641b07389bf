"""Per-fingerprint statistics, cumulative and over a sliding window, with bounded memory.

Each fingerprint keeps running totals (calls, errors, rows, time, min/max,
queue and backend time, a log-bucketed latency histogram) and a ring of
``slots`` buckets of ``slot_seconds`` each (by default 12 x 5 s = the last
minute), so ``top`` can rank by what hurts *now* as well as since start.
At most ``max_fingerprints`` are kept; the least recently seen is evicted
and counted, and its totals are folded into one "evicted" aggregate so the
overall totals stay exact.

Times are microseconds internally and milliseconds in the ranking output.
Timestamps are wall-clock seconds taken from the records, and ``now`` comes
from an injectable clock, so tests drive the window without sleeping.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from operator import itemgetter
from typing import Any

from scry.observe.histogram import _DIRECT, SUB_BITS, bucket_value, merge_into, percentiles

RANKINGS = ("total_time", "mean", "calls", "errors", "p99")

# Slot layout (a list, for speed): the epoch it covers, then the sums.
_EPOCH, _CALLS, _ERRORS, _ROWS, _TOTAL, _QUEUE, _BACKEND, _MIN, _MAX, _HIST = range(10)
_MAX_US = (1 << 40) - 1


def _new_slot(epoch: int) -> list[Any]:
    return [epoch, 0, 0, 0, 0, 0, 0, _MAX_US, 0, {}]


class QueryStats:
    """Totals for one fingerprint (``slots`` is the sliding-window ring)."""

    __slots__ = (
        "fingerprint",
        "query",
        "calls",
        "errors",
        "rows",
        "total_us",
        "queue_us",
        "backend_us",
        "min_us",
        "max_us",
        "hist",
        "first_seen",
        "last_seen",
        "slots",
    )

    def __init__(self, fingerprint: str, query: str, ts: float, nslots: int) -> None:
        self.fingerprint = fingerprint
        self.query = query
        self.calls = self.errors = self.rows = 0
        self.total_us = self.queue_us = self.backend_us = 0
        self.min_us = _MAX_US
        self.max_us = 0
        self.hist: dict[int, int] = {}
        self.first_seen = self.last_seen = ts
        self.slots: list[list[Any]] = [_new_slot(-1) for _ in range(nslots)]

    def as_slot(self) -> list[Any]:
        """The cumulative totals in slot layout."""
        return [
            0,
            self.calls,
            self.errors,
            self.rows,
            self.total_us,
            self.queue_us,
            self.backend_us,
            self.min_us,
            self.max_us,
            self.hist,
        ]


class StatsTable:
    """All fingerprints' statistics: ``add`` counts one statement,
    ``add_group`` many of one fingerprint (what the pipeline's drain uses)."""

    def __init__(
        self,
        max_fingerprints: int,
        *,
        slot_seconds: int = 5,
        slots: int = 12,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_fingerprints = max_fingerprints
        self.slot_seconds = slot_seconds
        self.nslots = slots
        self.clock = clock
        self._entries: OrderedDict[str, QueryStats] = OrderedDict()
        #: Fingerprints dropped to stay within max_fingerprints.
        self.evicted = 0
        self._evicted_totals = QueryStats("", "", 0.0, slots)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, fingerprint: str) -> QueryStats | None:
        """The statistics of one fingerprint, if kept."""
        return self._entries.get(fingerprint)

    def add(
        self,
        fingerprint: str,
        query: str,
        ts: float,
        total_us: int,
        queue_us: int,
        backend_us: int,
        rows: int,
        error: bool,
    ) -> None:
        """Count one completed statement."""
        entries = self._entries
        e = entries.get(fingerprint)
        if e is None:
            e = entries[fingerprint] = QueryStats(fingerprint, query, ts, self.nslots)
            if len(entries) > self.max_fingerprints:
                self._evict(entries.popitem(last=False)[1])
        else:
            entries.move_to_end(fingerprint)
        if total_us < 0:
            total_us = 0
        if total_us < _DIRECT:
            bucket = total_us
        else:
            if total_us > _MAX_US:
                total_us = _MAX_US
            shift = total_us.bit_length() - SUB_BITS - 1
            bucket = (shift << SUB_BITS) + (total_us >> shift)
        e.calls += 1
        e.rows += rows
        e.total_us += total_us
        e.queue_us += queue_us
        e.backend_us += backend_us
        if total_us < e.min_us:
            e.min_us = total_us
        if total_us > e.max_us:
            e.max_us = total_us
        hist = e.hist
        hist[bucket] = hist.get(bucket, 0) + 1
        if ts > e.last_seen:
            e.last_seen = ts
        if error:
            e.errors += 1
        epoch = int(ts) // self.slot_seconds
        slot = e.slots[epoch % self.nslots]
        if slot[0] != epoch:
            if epoch < slot[0]:
                return  # older than the window the ring still holds
            slot = e.slots[epoch % self.nslots] = _new_slot(epoch)
        slot[1] += 1
        slot[2] += error
        slot[3] += rows
        slot[4] += total_us
        slot[5] += queue_us
        slot[6] += backend_us
        if total_us < slot[7]:
            slot[7] = total_us
        if total_us > slot[8]:
            slot[8] = total_us
        shist = slot[9]
        shist[bucket] = shist.get(bucket, 0) + 1

    def add_group(
        self,
        fingerprint: str,
        query: str,
        first_ts: float,
        last_ts: float,
        calls: int,
        errors: int,
        rows: int,
        total_us: int,
        queue_us: int,
        backend_us: int,
        min_us: int,
        max_us: int,
        hist: dict[int, int],
    ) -> None:
        """Count ``calls`` statements of one fingerprint at once (the pipeline
        sums up a drain's worth). They must all fall in the slot of ``last_ts``;
        times are sums (µs), ``min_us``/``max_us``/``hist`` already clamped
        and bucketed like ``add`` does."""
        entries = self._entries
        e = entries.get(fingerprint)
        if e is None:
            e = entries[fingerprint] = QueryStats(fingerprint, query, first_ts, self.nslots)
            if len(entries) > self.max_fingerprints:
                self._evict(entries.popitem(last=False)[1])
        else:
            entries.move_to_end(fingerprint)
        e.calls += calls
        e.errors += errors
        e.rows += rows
        e.total_us += total_us
        e.queue_us += queue_us
        e.backend_us += backend_us
        if min_us < e.min_us:
            e.min_us = min_us
        if max_us > e.max_us:
            e.max_us = max_us
        merge_into(e.hist, hist)
        if last_ts > e.last_seen:
            e.last_seen = last_ts
        epoch = int(last_ts) // self.slot_seconds
        slot = e.slots[epoch % self.nslots]
        if slot[_EPOCH] != epoch:
            if epoch < slot[_EPOCH]:
                return  # older than the window the ring still holds
            slot = e.slots[epoch % self.nslots] = _new_slot(epoch)
        slot[_CALLS] += calls
        slot[_ERRORS] += errors
        slot[_ROWS] += rows
        slot[_TOTAL] += total_us
        slot[_QUEUE] += queue_us
        slot[_BACKEND] += backend_us
        if min_us < slot[_MIN]:
            slot[_MIN] = min_us
        if max_us > slot[_MAX]:
            slot[_MAX] = max_us
        merge_into(slot[_HIST], hist)

    def _evict(self, e: QueryStats) -> None:
        self.evicted += 1
        _fold(e, self._evicted_totals)

    # ------------------------------------------------------------------ #
    # Reading
    # ------------------------------------------------------------------ #

    def _window_view(self, e: QueryStats, first_epoch: int, last_epoch: int) -> list[Any] | None:
        view = _new_slot(0)
        for slot in e.slots:
            if first_epoch <= slot[_EPOCH] <= last_epoch and slot[_CALLS]:
                _add_slot(view, slot)
        return view if view[_CALLS] else None

    def _views(
        self, window_seconds: float | None, now: float | None
    ) -> list[tuple[QueryStats, list[Any]]]:
        if window_seconds is None:
            return [(e, e.as_slot()) for e in self._entries.values()]
        first, last = self._epochs(window_seconds, now)
        views = []
        for e in self._entries.values():
            view = self._window_view(e, first, last)
            if view is not None:
                views.append((e, view))
        return views

    def _epochs(self, window_seconds: float, now: float | None) -> tuple[int, int]:
        now = self.clock() if now is None else now
        last = int(now) // self.slot_seconds
        span = max(1, min(self.nslots, -(-int(window_seconds) // self.slot_seconds)))
        return last - span + 1, last

    def top(
        self,
        by: str = "total_time",
        limit: int = 20,
        window_seconds: float | None = None,
        now: float | None = None,
        histogram: bool = False,
    ) -> list[dict[str, Any]]:
        """The ``limit`` heaviest fingerprints, cumulative or over the last
        ``window_seconds`` (rounded up to whole slots, at most the ring);
        ``histogram`` adds each one's latency histogram (``_row``)."""
        if by not in RANKINGS:
            raise ValueError(f"top(by=...) must be one of {', '.join(RANKINGS)}, not {by!r}")
        views = self._views(window_seconds, now)
        grand_total = sum(v[_TOTAL] for _, v in views)
        if window_seconds is None:
            grand_total += self._evicted_totals.total_us
        slot_key = _slot_key(by)
        chosen = heapq.nlargest(limit, views, key=lambda ev: slot_key(ev[1]))
        return [_row(e, v, grand_total, histogram) for e, v in chosen]

    def summary(self, window_seconds: float = 60, now: float | None = None) -> dict[str, Any]:
        """Totals over everything and over the last window (qps, p99)."""
        total, window, seconds = self._summary_slots(window_seconds, now)
        return _summary_of(total, window, seconds, len(self._entries), self.evicted)

    def _summary_slots(
        self, window_seconds: float, now: float | None
    ) -> tuple[list[Any], list[Any], int]:
        total = _new_slot(0)
        for e in self._entries.values():
            _add_slot(total, e.as_slot())
        _add_slot(total, self._evicted_totals.as_slot())
        window = _new_slot(0)
        first, last = self._epochs(window_seconds, now)
        for e in (*self._entries.values(), self._evicted_totals):
            for slot in e.slots:
                if first <= slot[_EPOCH] <= last:
                    _add_slot(window, slot)
        return total, window, (last - first + 1) * self.slot_seconds

    # ------------------------------------------------------------------ #
    # Exports that merge across workers (scry.adminapi.fleet)
    # ------------------------------------------------------------------ #

    def export_summary(
        self, window_seconds: float = 60, now: float | None = None
    ) -> dict[str, Any]:
        """``summary`` in mergeable form (JSON-able): the summed slots with their
        histograms, and the fingerprint ids (so a merge counts distinct ones).
        ``merge_summaries`` of one export equals ``summary``."""
        total, window, seconds = self._summary_slots(window_seconds, now)
        return {
            "total": _export_slot(total),
            "window": _export_slot(window),
            "window_seconds": seconds,
            "fingerprints": ",".join(self._entries),
            "evicted_fingerprints": self.evicted,
        }

    def export_rows(
        self,
        window_seconds: float | None = None,
        now: float | None = None,
        *,
        fingerprints: Iterable[str] | None = None,
        details: bool = False,
        hist: bool = False,
    ) -> Iterator[list[Any]]:
        """Mergeable totals per fingerprint, cumulative or over a window, as
        ``EXPORT_ROW`` lists (JSON-able). ``details`` adds the normalized text,
        ``hist`` the histogram (both heavy; a merge asks for them only for the
        fingerprints it shows). Reads a snapshot of the table, so the caller may
        yield to the event loop between rows."""
        entries = self._entries
        if fingerprints is None:
            chosen = list(entries.values())
        else:
            chosen = [e for fp in fingerprints if (e := entries.get(fp)) is not None]
        first = last = 0
        if window_seconds is not None:
            first, last = self._epochs(window_seconds, now)
        for e in chosen:
            v = e.as_slot() if window_seconds is None else self._window_view(e, first, last)
            if v is None:
                continue
            yield [
                e.fingerprint, e.query if details else None, e.first_seen, e.last_seen,
                *v[_CALLS:_HIST], _flat(v[_HIST]) if hist or details else None,
            ]  # fmt: skip

    def evicted_total_us(self) -> int:
        """Time of the evicted fingerprints (part of the cumulative grand total)."""
        return self._evicted_totals.total_us


#: Fields of an exported row (``StatsTable.export_rows``).
EXPORT_ROW = (
    "fingerprint", "query", "first_seen", "last_seen", "calls", "errors", "rows",
    "total_us", "queue_us", "backend_us", "min_us", "max_us", "hist",
)  # fmt: skip


def merge_rows(parts: Iterable[Iterable[list[Any]]]) -> dict[str, list[Any]]:
    """Exported rows of several tables summed per fingerprint: fingerprint ->
    one row (``EXPORT_ROW`` layout, the histogram as a dict; a missing one
    counts as empty). Runs once per exported row, so it is written out."""
    merged: dict[str, list[Any]] = {}
    for rows in parts:
        for row in rows:
            m = merged.get(row[0])
            if m is None:
                m = merged[row[0]] = list(row)
                m[12] = _unflat(row[12])
                continue
            if row[1] and not m[1]:
                m[1] = row[1]
            if row[2] < m[2]:
                m[2] = row[2]
            if row[3] > m[3]:
                m[3] = row[3]
            m[4] += row[4]
            m[5] += row[5]
            m[6] += row[6]
            m[7] += row[7]
            m[8] += row[8]
            m[9] += row[9]
            if row[10] < m[10]:
                m[10] = row[10]
            if row[11] > m[11]:
                m[11] = row[11]
            flat = row[12]
            if flat:
                hist = m[12]
                for i in range(0, len(flat), 2):
                    hist[flat[i]] = hist.get(flat[i], 0) + flat[i + 1]
    return merged


#: Where a merged row keeps what a slot keeps: slot index + 3 (its epoch is last_seen).
_ROW_SLOT = 3


def rank_merged(
    merged: dict[str, list[Any]], by: str, limit: int, grand_total: int, histogram: bool = False
) -> list[dict[str, Any]]:
    """``top`` over merged rows (``grand_total``: µs, the denominator of ``share``)."""
    if by not in RANKINGS:
        raise ValueError(f"by must be one of {', '.join(RANKINGS)}, not {by!r}")
    chosen = heapq.nlargest(limit, merged.values(), key=_slot_key(by, _ROW_SLOT))
    out = []
    for m in chosen:
        e = QueryStats(m[0], m[1] or "", m[2], 0)
        e.last_seen = m[3]
        out.append(_row(e, m[_ROW_SLOT:], grand_total, histogram))
    return out


def merged_total_us(merged: dict[str, list[Any]]) -> int:
    """The time (µs) of every merged fingerprint: with the evicted fingerprints'
    time, the grand total behind ``share``."""
    return sum(m[_ROW_SLOT + _TOTAL] for m in merged.values())


def merge_summaries(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary`` of several tables from their ``export_summary``."""
    total, window = _new_slot(0), _new_slot(0)
    fingerprints: set[str] = set()
    for part in parts:
        _add_slot(total, _import_slot(part["total"]))
        _add_slot(window, _import_slot(part["window"]))
        fingerprints.update(filter(None, part["fingerprints"].split(",")))
    seconds = max((int(p["window_seconds"]) for p in parts), default=60)
    evicted = sum(int(p["evicted_fingerprints"]) for p in parts)
    return _summary_of(total, window, seconds, len(fingerprints), evicted)


def _slot_key(by: str, offset: int = 0) -> Callable[[list[Any]], float]:
    """The ranking key of a slot (or of a list holding one from ``offset`` on)."""
    total, calls, errors, hist = (i + offset for i in (_TOTAL, _CALLS, _ERRORS, _HIST))
    if by == "total_time":
        return itemgetter(total)
    if by == "mean":
        return lambda v: v[total] / v[calls]
    if by == "calls":
        return itemgetter(calls)
    if by == "errors":
        return itemgetter(errors)
    return lambda v: percentiles(v[hist], (0.99,))[0]


def _summary_of(
    total: list[Any], window: list[Any], seconds: int, fingerprints: int, evicted: int
) -> dict[str, Any]:
    p50, p99 = percentiles(total[_HIST], (0.5, 0.99))
    (wp99,) = percentiles(window[_HIST], (0.99,))
    return {
        "queries": total[_CALLS],
        "errors": total[_ERRORS],
        "rows": total[_ROWS],
        "total_ms": total[_TOTAL] / 1000,
        "p50_ms": p50 / 1000,
        "p99_ms": p99 / 1000,
        "window_seconds": seconds,
        "window_queries": window[_CALLS],
        "window_errors": window[_ERRORS],
        "qps": window[_CALLS] / seconds,
        "window_p99_ms": wp99 / 1000,
        "fingerprints": fingerprints,
        "evicted_fingerprints": evicted,
    }


def _flat(hist: dict[int, int]) -> list[int]:
    """A histogram as [bucket, count, bucket, count, ...] (JSON has no int keys)."""
    return [x for pair in hist.items() for x in pair]


def _unflat(flat: list[int] | None) -> dict[int, int]:
    return dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}


def _export_slot(slot: list[Any]) -> list[Any]:
    return [*slot[_CALLS:_HIST], _flat(slot[_HIST])]


def _import_slot(exported: list[Any]) -> list[Any]:
    return [0, *exported[:-1], _unflat(exported[-1])]


def _add_slot(target: list[Any], slot: list[Any]) -> None:
    for i in (_CALLS, _ERRORS, _ROWS, _TOTAL, _QUEUE, _BACKEND):
        target[i] += slot[i]
    target[_MIN] = min(target[_MIN], slot[_MIN])
    target[_MAX] = max(target[_MAX], slot[_MAX])
    merge_into(target[_HIST], slot[_HIST])


def _fold(source: QueryStats, target: QueryStats) -> None:
    target.calls += source.calls
    target.errors += source.errors
    target.rows += source.rows
    target.total_us += source.total_us
    target.queue_us += source.queue_us
    target.backend_us += source.backend_us
    target.min_us = min(target.min_us, source.min_us)
    target.max_us = max(target.max_us, source.max_us)
    merge_into(target.hist, source.hist)
    for i, slot in enumerate(source.slots):
        mine = target.slots[i]
        if slot[_EPOCH] > mine[_EPOCH]:
            mine = target.slots[i] = _new_slot(slot[_EPOCH])
        if slot[_EPOCH] == mine[_EPOCH]:
            _add_slot(mine, slot)


def _row(e: QueryStats, v: list[Any], grand_total: int, histogram: bool) -> dict[str, Any]:
    calls = v[_CALLS]
    p50, p95, p99 = percentiles(v[_HIST], (0.5, 0.95, 0.99))
    row = {
        "fingerprint": e.fingerprint,
        "query": e.query,
        "calls": calls,
        "errors": v[_ERRORS],
        "rows": v[_ROWS],
        "total_ms": v[_TOTAL] / 1000,
        "mean_ms": v[_TOTAL] / calls / 1000 if calls else 0.0,
        "min_ms": v[_MIN] / 1000 if calls else 0.0,
        "max_ms": v[_MAX] / 1000,
        "p50_ms": p50 / 1000,
        "p95_ms": p95 / 1000,
        "p99_ms": p99 / 1000,
        "share": v[_TOTAL] / grand_total if grand_total else 0.0,
        "queue_ms_mean": v[_QUEUE] / calls / 1000 if calls else 0.0,
        "backend_ms_mean": v[_BACKEND] / calls / 1000 if calls else 0.0,
        "total_ms_mean": v[_TOTAL] / calls / 1000 if calls else 0.0,
        "first_seen": e.first_seen,
        "last_seen": e.last_seen,
    }
    if histogram:
        # Each bucket as its value in ms (what percentiles() picks) and count:
        # proxies bucket alike, so a fleet's histograms add up pair by pair.
        row["histogram"] = [(bucket_value(b) / 1000, n) for b, n in sorted(v[_HIST].items())]
    return row
