"""Merging workers' answers (scry.adminapi.fleet and the observe exports).

The property behind every merge: splitting one workload over several workers
and merging their exports gives what one worker fed the whole workload shows.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from admin import schemas as s
from admin.histograms import add_histograms
from admin.histograms import percentiles as histogram_percentiles
from scry.adminapi import fleet
from scry.adminapi.local import export_families
from scry.observe.anonymize import Anonymizer
from scry.observe.metrics import ObserveMetrics
from scry.observe.sketch import CountMinSketch, HotData, merge_hot
from scry.observe.stats import (
    RANKINGS,
    StatsTable,
    merge_rows,
    merge_summaries,
    merged_total_us,
    rank_merged,
)

NOW = 1_000_000.0


def _json(value: Any) -> Any:
    """What crossing a peering socket does to an export."""
    return json.loads(json.dumps(value))


# --- statistics ------------------------------------------------------------------------------


def _workload(seed: int, n: int = 3_000) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        fp = f"fp{min(int(rng.paretovariate(1.2)), 40):02d}"
        latency = int(rng.lognormvariate(7, 1.3))
        ts = NOW - rng.uniform(0, 120)  # half of it outside a 60 s window
        records.append((fp, f"select {fp}", ts, latency, rng.randint(0, 5), rng.random() < 0.05))
    return records


def _table(records: list[tuple[Any, ...]], max_fingerprints: int = 10_000) -> StatsTable:
    table = StatsTable(max_fingerprints, clock=lambda: NOW)
    for fp, query, ts, latency, rows, error in sorted(records, key=lambda r: r[2]):
        table.add(fp, query, ts, latency, latency // 3, latency // 2, rows, error)
    return table


def _split(records: list[Any], parts: int, seed: int) -> list[list[Any]]:
    rng = random.Random(seed)
    out: list[list[Any]] = [[] for _ in range(parts)]
    for record in records:
        out[rng.randrange(parts)].append(record)
    return out


def _fleet_top(
    tables: list[StatsTable], by: str, limit: int, window: float | None
) -> list[dict[str, Any]]:
    parts = [_json(list(t.export_rows(window, NOW, details=True, hist=True))) for t in tables]
    merged = merge_rows(parts)
    evicted = sum(t.evicted_total_us() for t in tables) if window is None else 0
    return rank_merged(merged, by, limit, merged_total_us(merged) + evicted)


_RANKED_BY = {"total_time": "total_ms", "mean": "mean_ms", "calls": "calls", "errors": "errors", "p99": "p99_ms"}  # fmt: skip


@pytest.mark.parametrize("by", RANKINGS)
@pytest.mark.parametrize("window", [None, 60.0])
def test_merged_ranking_equals_one_table_of_everything(by: str, window: float | None) -> None:
    records = _workload(seed=1)
    whole = _table(records)
    workers = [_table(part) for part in _split(records, 4, seed=2)]
    expected = {r["fingerprint"]: r for r in whole.top(by, 100, window, now=NOW)}
    got = {r["fingerprint"]: r for r in _fleet_top(workers, by, 100, window)}
    assert got.keys() == expected.keys()
    for fp, theirs in expected.items():
        for key, value in theirs.items():
            if key == "first_seen" and window is not None:
                # Only workers that ran it in the window say when they first saw it.
                assert got[fp][key] >= value
                continue
            assert got[fp][key] == pytest.approx(value, rel=1e-12, abs=1e-9), (fp, key)
    # A limited ranking is the same prefix (up to the order of ties).
    field = _RANKED_BY[by]
    limited = [r[field] for r in _fleet_top(workers, by, 15, window)]
    assert limited == [r[field] for r in whole.top(by, 15, window, now=NOW)]


def test_merge_of_one_export_is_the_tables_own_ranking() -> None:
    table = _table(_workload(seed=3))
    for by in RANKINGS:
        assert _fleet_top([table], by, 20, None) == table.top(by, 20, now=NOW)


@pytest.mark.parametrize("window", [None, 60.0])
def test_proxies_histograms_add_up_to_the_fleets_percentiles(window: float | None) -> None:
    """What the console does with several proxies' ``?histogram=true``
    rankings (admin.histograms): their percentiles are those of one proxy
    that served everything, where the worst proxy's would only bound them."""
    records = _workload(seed=11)
    whole = {r["fingerprint"]: r for r in _table(records).top("calls", 100, window, now=NOW)}
    proxies = [
        {r["fingerprint"]: r for r in _json(_table(part).top("calls", 100, window, NOW, True))}
        for part in _split(records, 3, seed=12)
    ]
    bounded = 0
    for fp, expected in whole.items():
        parts = [rows[fp] for rows in proxies if fp in rows]
        histogram = add_histograms(part["histogram"] for part in parts)
        assert sum(count for _, count in histogram) == expected["calls"]
        got = histogram_percentiles(histogram, (0.5, 0.95, 0.99))
        assert got == [expected["p50_ms"], expected["p95_ms"], expected["p99_ms"]], fp
        bounded += max(part["p99_ms"] for part in parts) > expected["p99_ms"]
    assert bounded  # (the worst proxy's p99 overstates some: this is not vacuous)


def test_a_single_histogram_gives_the_proxys_own_percentiles() -> None:
    for row in _table(_workload(seed=13)).top("total_time", 50, None, NOW, histogram=True):
        assert histogram_percentiles(row["histogram"], (0.5, 0.95, 0.99)) == [
            row["p50_ms"], row["p95_ms"], row["p99_ms"]
        ]  # fmt: skip
    assert histogram_percentiles([], (0.5, 0.99)) == [0.0, 0.0]
    assert "histogram" not in _table(_workload(seed=13)).top("calls", 5, None, NOW)[0]


def test_details_only_where_asked() -> None:
    table = _table(_workload(seed=4))
    rows = list(table.export_rows(None, NOW))
    assert all(row[1] is None and row[-1] is None for row in rows)
    assert len(rows) == len(table)
    picked = list(table.export_rows(None, NOW, fingerprints=["fp01", "nope"], details=True))
    assert [r[0] for r in picked] == ["fp01"] and picked[0][1] == "select fp01" and picked[0][-1]


def test_evicted_time_stays_in_the_share() -> None:
    records = _workload(seed=5)
    whole = _table(records, max_fingerprints=5)
    workers = [_table(part, max_fingerprints=5) for part in _split(records, 2, seed=6)]
    assert whole.evicted and all(w.evicted for w in workers)
    shares = [r["share"] for r in _fleet_top(workers, "total_time", 5, None)]
    assert 0 < sum(shares) < 1  # the evicted fingerprints' time is in the denominator


def test_merged_summary_equals_one_table_of_everything() -> None:
    records = _workload(seed=7)
    whole = _table(records)
    workers = [_table(part) for part in _split(records, 3, seed=8)]
    merged = merge_summaries([_json(w.export_summary(60, NOW)) for w in workers])
    assert merged == pytest.approx(whole.summary(60, NOW))
    assert merged["fingerprints"] == len(whole)  # distinct, not the sum of the workers'
    assert merge_summaries([_json(whole.export_summary(60, NOW))]) == whole.summary(60, NOW)


# --- hot data ---------------------------------------------------------------------------------


def _hot(anonymizer: Anonymizer, lookups: list[tuple[str, str]]) -> HotData:
    hot = HotData(anonymizer, top_k=10, width=256, depth=4)
    for table, value in lookups:
        hot.add_table(table)
        hot.add_value(f"{table}.id", value)
    return hot


def test_sketches_add_cell_wise_and_hot_keys_rerank() -> None:
    rng = random.Random(9)
    anonymizer = Anonymizer("one key for the instance")
    lookups = [
        (f"t{min(int(rng.paretovariate(1.1)), 30)}", str(min(int(rng.paretovariate(1.0)), 500)))
        for _ in range(5_000)
    ]
    whole = _hot(anonymizer, lookups)
    parts = [_hot(anonymizer, part) for part in _split(lookups, 3, seed=10)]
    exports = [_json(p.export()) for p in parts]

    merged = CountMinSketch.merged([e["values"] for e in exports])
    assert merged._counts == whole.values._counts and merged.total == whole.values.total
    got = merge_hot(exports, 10)
    truth = whole.hot(10)
    assert [t["table"] for t in got["tables"][:3]] == [t["table"] for t in truth["tables"][:3]]
    top_values = {(v["column"], v["value"]) for v in got["values"][:5]}
    assert top_values == {(v["column"], v["value"]) for v in truth["values"][:5]}
    for row in got["values"]:  # estimates come from the merged sketch: never below the truth
        exact = sum(1 for t, v in lookups if f"{t}.id" == row["column"] and _token(anonymizer, t, v) == row["value"])  # fmt: skip
        assert row["count"] >= exact


def _token(anonymizer: Anonymizer, table: str, value: str) -> str:
    hot = HotData(anonymizer, top_k=1, width=8, depth=4)
    hot.add_value(f"{table}.id", value)
    return str(hot.hot(1)["values"][0]["value"])


def test_sketches_of_different_shapes_do_not_merge() -> None:
    a, b = CountMinSketch(8, 2), CountMinSketch(16, 2)
    with pytest.raises(ValueError, match="shapes"):
        CountMinSketch.merged([a.export(), b.export()])


# --- ids and pages ------------------------------------------------------------------------------


def test_ids_are_qualified_by_their_worker() -> None:
    assert fleet.qualify(3, "c12") == "w3.c12"
    assert fleet.qualify(3, None) is None
    assert fleet.parse_id("w3.c12") == (3, "c12")
    assert fleet.parse_id("c12") == (None, "c12")
    assert fleet.parse_id("w.c12") == (None, "w.c12")


@settings(max_examples=300, deadline=None)
@given(
    totals=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=6),
    limit=st.integers(min_value=1, max_value=40),
    offset=st.integers(min_value=0, max_value=120),
)
def test_page_plan_slices_the_instance_listing(totals: list[int], limit: int, offset: int) -> None:
    listings = {w: [(w, i) for i in range(n)] for w, n in enumerate(totals)}
    everything = [row for w in sorted(listings) for row in listings[w]]
    plan = fleet.page_plan(dict(enumerate(totals)), limit, offset)
    page = [row for w in sorted(plan) for row in listings[w][plan[w][1] : plan[w][1] + plan[w][0]]]
    assert page == everything[offset : offset + limit]


def test_listing_rows_carry_their_worker() -> None:
    pages = {
        0: {"clients": [{"id": "c1", "server_id": "s1", "user": "a"}]},
        2: {"clients": [{"id": "c1", "server_id": None, "user": "b"}]},
    }
    merged = fleet.merge_listing("clients", pages, total=7, limit=2, offset=0)
    assert merged["total"] == 7
    assert merged["clients"] == [
        {"id": "w0.c1", "server_id": "w0.s1", "user": "a", "worker": 0},
        {"id": "w2.c1", "server_id": None, "user": "b", "worker": 2},
    ]
    pins = fleet.merge_pins({1: {"pins": [{"client_id": "c4", "server_id": "s2"}]}})
    assert pins == {"pins": [{"client_id": "w1.c4", "server_id": "w1.s2", "worker": 1}]}


# --- pools, status, breakers ---------------------------------------------------------------------


def _pool(**over: Any) -> dict[str, Any]:
    pool = {
        "database": "app", "user": "app", "mode": "transaction", "size": 3, "min_size": 1,
        "reserve_size": 1, "reserve_in_use": 0, "servers": 2, "connecting": 0, "active": 1, "idle": 1, "parked": 0, "waiting": 0,
        "max_wait_ms": 0.0, "pinned": 0, "stale": False, "breaker": "closed", "last_error": None,
        "totals": {"waits": 2, "wait_ms_total": 10.0, "wait_ms_mean": 5.0,
                   "servers_opened": 2, "servers_closed": 0},
    }  # fmt: skip
    pool.update(over)
    return pool


def test_pools_add_up_per_database_and_user() -> None:
    merged = fleet.merge_pools(
        {
            0: {"pools": [_pool()]},
            1: {
                "pools": [
                    _pool(
                        size=2, waiting=3, max_wait_ms=40.0, breaker="half_open", reserve_in_use=1
                    )
                ]
            },
            2: {"pools": [_pool(user="other"), _pool(active=2, last_error="boom")]},
        }
    )
    app, other = merged["pools"]
    assert (app["user"], other["user"]) == ("app", "other")
    assert app["workers"] == [0, 1, 2] and other["workers"] == [2]
    assert app["size"] == 8 and app["active"] == 4 and app["waiting"] == 3
    assert app["reserve_size"] == 3 and app["reserve_in_use"] == 1
    assert app["max_wait_ms"] == 40.0 and app["breaker"] == "half_open"
    assert app["last_error"] == "boom"
    assert app["totals"]["waits"] == 6 and app["totals"]["wait_ms_mean"] == 5.0
    s.PoolList.model_validate(merged)


def _status(worker: int, pid: int, queries: int) -> dict[str, Any]:
    return {
        "version": "1", "pid": pid, "started_at": 100.0 + worker, "uptime_s": 10.0 - worker,
        "pool_mode": "transaction", "workers": 3, "worker": worker, "listen_addr": "x:1",
        "listen_addresses": ["x:1"], "admin_addr": "a:2" if worker == 0 else "",
        "databases": ["app"], "draining": False, "paused": worker == 2, "read_only": False,
        "clients": 4, "servers": 2, "pools": 1, "waiting": 1, "pinned": 0,
        "queries": {**s.QueryTotals().model_dump(), "queries": queries, "events_dropped": 1},
    }  # fmt: skip


def test_status_adds_up_and_keeps_each_workers_own() -> None:
    answers = {
        w: {"status": _status(w, 500 + w, 10 * (w + 1)), "pools": [["app", "app"]]}
        for w in range(3)
    }
    answers[1]["pools"].append(["app", "other"])
    queries = {"queries": 60, "p99_ms": 3.5}
    merged = fleet.merge_status(answers, queries, instance_pid=42)
    status = s.Status.model_validate(merged)
    assert status.pid == 42 and status.started_at == 100.0 and status.uptime_s == 10.0
    assert status.clients == 12 and status.servers == 6 and status.waiting == 3
    assert status.pools == 2 and status.paused and status.admin_addr == "a:2"
    assert status.queries.queries == 60 and status.queries.p99_ms == 3.5
    assert status.queries.events_dropped == 3
    assert status.per_worker is not None and [w.pid for w in status.per_worker] == [500, 501, 502]


def _breaker(state: str, reason: str | None, failures: int, at: float) -> dict[str, Any]:
    return {
        "name": "app", "state": state, "enabled": True, "held": False, "open_reason": reason,
        "retry_in_seconds": None, "last_failure_reason": None,
        "config": {"failure_threshold": 5, "success_threshold": 3, "timeout_seconds": 30.0,
                   "half_open_max_probes": 1},
        "counters": {"failures": failures, "successes": 1, "rejections": 0,
                     "consecutive_failures": failures, "opened": 1 if state == "open" else 0},
        "half_open": {"probes_in_flight": 0, "probe_successes": 0},
        "transitions": [] if state == "closed" else
        [{"at": at, "seconds_ago": 1.0, "from": "closed", "to": state, "reason": reason or ""}],
    }  # fmt: skip


def _health(queries: int, errors: int, p99: float, signals: list[str]) -> dict[str, Any]:
    return {
        "name": "app", "window_seconds": 10,
        "window": {"queries": queries, "errors": errors, "qps": queries / 10,
                   "error_rate": errors / queries, "p50": p99 / 2, "p99": p99,
                   "wait_mean": 0.0, "wait_max": 0.0},
        "pool": {"saturation": 0.5, "waiting": 1, "oldest_wait_seconds": 0.1},
        "baseline": {"p50": None, "p99": 0.01, "error_rate": 0.0, "ready": True},
        "signals": [{"name": n, "severity": "critical", "value": 1.0, "threshold": 0.1,
                     "for_seconds": 2.0, "message": n} for n in signals],
    }  # fmt: skip


def test_breakers_show_the_most_open_state_and_every_workers_signals() -> None:
    answers = {
        0: {"databases": [{"database": "app", "breaker": _breaker("closed", None, 1, 0),
                           "health": _health(100, 0, 0.01, [])}]},
        1: {"databases": [{"database": "app",
                           "breaker": _breaker("open", "predictive: error_rate", 40, 5.0),
                           "health": _health(50, 40, 0.2, ["error_rate"])}]},
        2: {"databases": [{"database": "app",
                           "breaker": _breaker("open", "worker 1: predictive: error_rate", 0, 6.0),
                           "health": _health(50, 0, 0.02, [])}]},
    }  # fmt: skip
    (entry,) = fleet.merge_breakers(answers)["databases"]
    breaker, health = entry["breaker"], entry["health"]
    assert breaker["state"] == "open"
    assert breaker["open_reason"] == "worker 1: predictive: error_rate"
    assert breaker["counters"]["failures"] == 41 and breaker["counters"]["consecutive_failures"] == 40  # fmt: skip
    assert [(t["worker"], t["at"]) for t in breaker["transitions"]] == [(2, 6.0), (1, 5.0)]
    assert health["window"]["queries"] == 200 and health["window"]["errors"] == 40
    assert health["window"]["error_rate"] == 0.2 and health["window"]["p99"] == 0.2
    assert health["pool"]["waiting"] == 3
    assert [(x["worker"], x["name"]) for x in health["signals"]] == [(1, "error_rate")]
    assert [w["worker"] for w in entry["workers"]] == [0, 1, 2]
    s.BreakerList.model_validate(fleet.merge_breakers(answers))


# --- Prometheus ---------------------------------------------------------------------------------


def _families(metrics: ObserveMetrics) -> list[dict[str, Any]]:
    return _json(export_families(metrics.registry))


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(text.decode())
        for x in family.samples
        if not x.name.endswith("_created")
    }


def _feed(metrics: ObserveMetrics, records: list[tuple[str, int, bool]]) -> None:
    for database, total_us, error in records:
        metrics.observe_query(database, total_us, 10, 5, total_us - 15, error, ("set",) if error else None)  # fmt: skip


def test_metrics_add_up_like_one_process() -> None:
    rng = random.Random(11)
    records = [(rng.choice(["a", "b"]), rng.randint(20, 3_000_000), rng.random() < 0.1) for _ in range(2_000)]  # fmt: skip
    whole = ObserveMetrics()
    _feed(whole, records)
    parts = [ObserveMetrics() for _ in range(3)]
    for part, chunk in zip(parts, _split(records, 3, seed=12), strict=True):
        _feed(part, chunk)
    parts[1].breaker_state.labels(database="a").set(2)
    parts[2].breaker_state.labels(database="a").set(1)
    pools = [
        [
            {
                "database": "a",
                "user": "u",
                "size": 3,
                "active": 3,
                "idle": 0,
                "waiting": 2,
                "max_wait_seconds": 0.5,
            }
        ],  # fmt: skip
        [
            {
                "database": "a",
                "user": "u",
                "size": 3,
                "active": 0,
                "idle": 3,
                "waiting": 0,
                "max_wait_seconds": 0.0,
            }
        ],  # fmt: skip
        [],
    ]
    for part, pool in zip(parts, pools, strict=True):
        part.set_pool_stats_provider(lambda pool=pool: pool)
    answers = {w: _families(p) for w, p in enumerate(parts)}
    merged = _samples(fleet.render_metrics(fleet.merge_metrics(answers, workers=4)))
    expected = _samples(whole.text())
    for key, value in expected.items():
        assert merged[key] == pytest.approx(value), key
    assert merged[("scry_breaker_state", (("database", "a"),))] == 2  # the most open
    pool = (("database", "a"), ("user", "u"))
    assert merged[("scry_pool_size", pool)] == 6 and merged[("scry_pool_waiting", pool)] == 2
    assert merged[("scry_pool_saturation", pool)] == 0.5  # 3 active of 6, not 1.0 + 0.0
    assert merged[("scry_pool_max_wait_seconds", pool)] == 0.5
    up = {labels[0][1]: v for (name, labels), v in merged.items() if name == "scry_worker_up"}
    assert up == {"0": 1, "1": 1, "2": 1, "3": 0}
