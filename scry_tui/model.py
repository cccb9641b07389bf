"""What the console knows about each proxy, and the fleet-wide merges.

:class:`ProxyState` is written by one :class:`~scry_tui.poller.Poller` and
read by the views. Pure functions here (``merge_top``, ``TopTracker``) are
unit-tested without Textual.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from admin import (
    BreakerList,
    ClientList,
    HotData,
    PinList,
    PoolList,
    ServerList,
    Status,
    TopQueries,
    TopQuery,
)
from admin.histograms import add_histograms, percentiles

HISTORY = 60  # points kept for sparklines

#: Sort keys of the Top view, in the order `s` cycles through them.
SORTS: tuple[str, ...] = ("total_time", "mean", "calls", "errors", "p99")
SORT_LABELS = {"total_time": "total time", "mean": "mean", "calls": "calls", "errors": "errors", "p99": "p99"}  # fmt: skip


def sort_value(q: TopQuery, by: str) -> float:
    return {
        "total_time": q.total_ms,
        "mean": q.mean_ms,
        "calls": float(q.calls),
        "errors": float(q.errors),
        "p99": q.p99_ms,
    }[by]


@dataclass
class ProxyState:
    """The latest data of one proxy, and whether it answers."""

    name: str
    display: str  # the TARGET as typed (ssh://... or http://...)
    status: Status | None = None
    pools: PoolList | None = None
    clients: ClientList | None = None
    servers: ServerList | None = None
    pins: PinList | None = None
    breaker: BreakerList | None = None
    top: TopQueries | None = None
    hot: HotData | None = None
    topic_errors: dict[str, str] = field(default_factory=dict)
    last_ok: float | None = None  # wall clock of the last successful poll
    last_ok_mono: float | None = None
    unreachable_since: float | None = None  # wall clock of the first failure in a row
    last_error: str | None = None
    failures: int = 0
    retry_in: float | None = None
    polls: int = 0
    qps_history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    p99_history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    top_tracker: TopTracker = field(default_factory=lambda: TopTracker())

    @property
    def up(self) -> bool:
        return self.status is not None and self.unreachable_since is None

    def record_ok(self, data: dict[str, Any], wall: float, mono: float) -> None:
        for topic, value in data.items():
            setattr(self, topic, value)
        self.last_ok, self.last_ok_mono = wall, mono
        self.unreachable_since = None
        self.last_error = None
        self.failures = 0
        self.retry_in = None
        self.polls += 1
        if self.status is not None and "status" in data:
            self.qps_history.append(self.status.queries.qps)
            self.p99_history.append(self.status.queries.window_p99_ms)
        if "top" in data and self.top is not None:
            self.top_tracker.update(self.top.queries, mono)

    def record_failure(self, error: str, wall: float, retry_in: float) -> None:
        if self.unreachable_since is None:
            self.unreachable_since = wall
        self.last_error = error
        self.failures += 1
        self.retry_in = retry_in

    def saturation(self) -> float | None:
        """Servers busy over pool size, summed over the proxy's pools."""
        if self.pools is None or not self.pools.pools:
            return None
        size = sum(p.size for p in self.pools.pools)
        busy = sum(p.active + p.pinned for p in self.pools.pools)
        return busy / size if size else None

    def signals(self) -> list[tuple[str, str, str]]:
        """Active health signals: (database, name, severity)."""
        if self.breaker is None:
            return []
        return [
            (entry.database, s.name, s.severity)
            for entry in self.breaker.databases
            for s in entry.health.signals
        ]

    def breaker_state(self) -> str | None:
        """The worst breaker state over the proxy's databases."""
        if self.breaker is None or not self.breaker.databases:
            return None
        states = {e.breaker.state for e in self.breaker.databases}
        for worst in ("open", "half_open", "closed"):
            if worst in states:
                return worst
        return None


@dataclass
class TopRow:
    """One fingerprint in the Top view (one proxy's, or merged over the fleet)."""

    query: TopQuery
    proxies: tuple[str, ...]
    calls_per_s: float | None = None
    prev_mean: float | None = None
    prev_p99: float | None = None
    prev_rank: int | None = None


class TopTracker:
    """Remembers the previous refresh's ranking, for calls/s and ↑/↓ deltas."""

    def __init__(self) -> None:
        self.previous: dict[str, TopQuery] = {}
        self.current: dict[str, TopQuery] = {}
        self.previous_at: float | None = None
        self.current_at: float | None = None

    def update(self, queries: list[TopQuery], mono: float) -> None:
        self.previous, self.previous_at = self.current, self.current_at
        self.current = {q.fingerprint: q for q in queries}
        self.current_at = mono

    def calls_per_s(self, fingerprint: str) -> float | None:
        now = self.current.get(fingerprint)
        before = self.previous.get(fingerprint)
        if now is None or self.previous_at is None or self.current_at is None:
            return None
        elapsed = self.current_at - self.previous_at
        if elapsed <= 0:
            return None
        return max(0, now.calls - (before.calls if before else 0)) / elapsed


def merge_top(states: list[ProxyState], by: str) -> list[TopQuery]:
    """Merge the rankings of several proxies by fingerprint id, re-ranked by ``by``.

    Calls, errors, rows and total time add up; means are weighted by calls;
    percentiles come from the proxies' histograms added up, or are the worst
    proxy's (an upper bound) when a proxy sent none (one older than them).
    A share is of all the proxies' time, not only the listed rows'.
    """
    merged: dict[str, dict[str, Any]] = {}
    parts: dict[str, list[TopQuery]] = {}
    for state in states:
        if state.top is None or not state.up:
            continue
        for q in state.top.queries:
            m = merged.get(q.fingerprint)
            if m is None:
                merged[q.fingerprint] = q.model_dump()
                parts[q.fingerprint] = [q]
                continue
            parts[q.fingerprint].append(q)
            calls = m["calls"] + q.calls
            for mean in ("queue_ms_mean", "backend_ms_mean", "total_ms_mean"):
                m[mean] = (
                    (m[mean] * m["calls"] + getattr(q, mean) * q.calls) / calls if calls else 0.0
                )
            for key in ("calls", "errors", "rows", "total_ms"):
                m[key] += getattr(q, key)
            for key in ("p50_ms", "p95_ms", "p99_ms", "max_ms", "last_seen"):
                m[key] = max(m[key], getattr(q, key))
            for key in ("min_ms", "first_seen"):
                m[key] = min(m[key], getattr(q, key))
            m["mean_ms"] = m["total_ms"] / calls if calls else 0.0
    for fingerprint, same in parts.items():
        if len(same) < 2:
            continue
        m = merged[fingerprint]
        m["histogram"] = histogram = _added_histograms(same)
        if histogram is not None:
            m["p50_ms"], m["p95_ms"], m["p99_ms"] = percentiles(histogram, (0.5, 0.95, 0.99))
    total = _fleet_total_ms(states)
    if total is None:
        total = sum(m["total_ms"] for m in merged.values())
    for m in merged.values():
        m["share"] = m["total_ms"] / total if total else 0.0
    queries = [TopQuery.model_validate(m) for m in merged.values()]
    queries.sort(key=lambda q: (-sort_value(q, by), q.fingerprint))
    return queries


def _fleet_total_ms(states: list[ProxyState]) -> float | None:
    """The time of all the proxies' queries, those their lists left out too
    (a row's share is its time over its proxy's total, so any row with a
    share tells that total); None if a proxy's rows tell nothing."""
    total = 0.0
    for state in states:
        if state.top is None or not state.up or not state.top.queries:
            continue
        row = next((q for q in state.top.queries if q.share > 0), None)
        if row is None:
            return None
        total += row.total_ms / row.share
    return total


def _added_histograms(parts: list[TopQuery]) -> list[tuple[float, int]] | None:
    """Several proxies' histograms of one fingerprint, added; None if one is missing."""
    if len(parts) < 2 or any(q.histogram is None for q in parts):
        return None
    return add_histograms(q.histogram for q in parts if q.histogram is not None)


def merged_p99(parts: list[TopQuery]) -> float | None:
    """The p99 of one fingerprint over several proxies' rows (see merge_top)."""
    histogram = _added_histograms(parts)
    if histogram is not None:
        return percentiles(histogram, (0.99,))[0]
    return max((q.p99_ms for q in parts), default=None)


#: The most rows the console asks one proxy for (the admin API's page size).
MAX_TOP_LIMIT = 1000
# Rankings whose merged value is a sum; the others (mean, p99) are at most
# their largest part: a merged mean or p99 is never above every proxy's.
_ADDED_UP = frozenset({"total_time", "calls", "errors"})


def top_fetch_limit(states: list[ProxyState], by: str, shown: int, current: int) -> int:
    """How many rows to ask each proxy for, next time, so that their merged
    top ``shown`` holds every fingerprint that belongs there.

    A proxy's list leaves out fingerprints it ranks lower, and one that is
    51st on every proxy may be first in the fleet. What a proxy left out is
    at most its list's last value, so the lists settle the merged top when
    nothing outside it could reach the ``shown``-th value with those bounds
    added. Unsettled: twice as many rows (up to MAX_TOP_LIMIT); settled with
    half as many: half (not below ``shown``); else as many as now. Until two
    proxies have answered for this ranking: ``current``, unchanged. Ranked by
    mean or p99, a listed row's merged value is itself an estimate (a proxy
    that left the row out may have brought it down), so there the check is
    as good as those estimates.
    """
    live = [s for s in states if s.top is not None and s.up]
    if len(live) < 2 or any(s.top.by != by for s in live):  # type: ignore[union-attr]
        return current
    asked = min(s.top.limit for s in live)  # type: ignore[union-attr]
    if not _settled(live, by, shown, asked):
        return min(max(asked, shown) * 2, MAX_TOP_LIMIT)
    if asked // 2 >= shown and _settled(live, by, shown, asked // 2):
        return asked // 2
    return max(asked, shown)


def _settled(live: list[ProxyState], by: str, shown: int, depth: int) -> bool:
    """Whether each proxy's first ``depth`` rows settle the merged top ``shown``."""
    added_up = by in _ADDED_UP
    lists, bounds = [], []
    for state in live:
        queries = state.top.queries  # type: ignore[union-attr]
        head = {q.fingerprint: q for q in queries[:depth]}
        lists.append(head)
        left_out = len(queries) > depth or len(queries) >= state.top.limit  # type: ignore[union-attr]
        bounds.append(sort_value(queries[depth - 1], by) if left_out and head else 0.0)
    values: dict[str, float] = {}
    for fingerprint in {f for head in lists for f in head}:
        parts = [head[fingerprint] for head in lists if fingerprint in head]
        if added_up:
            values[fingerprint] = sum(sort_value(q, by) for q in parts)
        elif by == "mean":
            calls = sum(q.calls for q in parts)
            values[fingerprint] = sum(q.total_ms for q in parts) / calls if calls else 0.0
        else:
            values[fingerprint] = max(q.p99_ms for q in parts)
    ranked = sorted(values, key=lambda f: -values[f])
    threshold = values[ranked[shown - 1]] if len(ranked) >= shown else 0.0

    def most(fingerprint: str | None) -> float:
        """The largest merged value a fingerprint could have (None: one on no list)."""
        missing = [b for head, b in zip(lists, bounds, strict=True) if fingerprint not in head]
        if fingerprint is None:
            return sum(missing) if added_up else max(missing)
        if added_up:
            return values[fingerprint] + sum(missing)
        return max(values[fingerprint], *missing)

    return all(most(f) <= threshold for f in (None, *ranked[shown:]))


def top_rows(
    states: list[ProxyState], by: str, previous_ranks: dict[str, int], shown: int | None = None
) -> list[TopRow]:
    """The Top view's rows (the first ``shown``): merged when several proxies,
    with per-fingerprint deltas."""
    live = [s for s in states if s.top is not None and s.up]
    if len(live) == 1:
        queries = sorted(live[0].top.queries, key=lambda q: (-sort_value(q, by), q.fingerprint))  # type: ignore[union-attr]
    else:
        queries = merge_top(live, by)
    queries = queries[:shown]
    rows: list[TopRow] = []
    for q in queries:
        owners = tuple(s.name for s in live if q.fingerprint in s.top_tracker.current)
        rates = [s.top_tracker.calls_per_s(q.fingerprint) for s in live]
        known = [r for r in rates if r is not None]
        prev = [s.top_tracker.previous.get(q.fingerprint) for s in live]
        prev_q = [p for p in prev if p is not None]
        prev_calls = sum(p.calls for p in prev_q)
        rows.append(
            TopRow(
                query=q,
                proxies=owners,
                calls_per_s=sum(known) if known else None,
                prev_mean=(sum(p.total_ms for p in prev_q) / prev_calls) if prev_calls else None,
                prev_p99=merged_p99(prev_q),
                prev_rank=previous_ranks.get(q.fingerprint),
            )
        )
    return rows
