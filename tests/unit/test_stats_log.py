"""The log_stats line (scry.stats_log): per database, per period, only with traffic."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from scry.relay_core import PoolStats
from scry.stats_log import StatsLog, database_totals


def pool(database: str) -> SimpleNamespace:
    return SimpleNamespace(
        target=SimpleNamespace(name=database), stats=PoolStats(), total_wait_us=0
    )


def stats_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    lines = [r.fields for r in caplog.records if r.getMessage() == "stats"]  # type: ignore[attr-defined]
    caplog.clear()
    return lines


def test_a_line_per_database_with_traffic_each_period(caplog) -> None:
    caplog.set_level(logging.INFO, logger="scry")
    app_a, app_b, idle = pool("app"), pool("app"), pool("idle")  # two users' pools of app
    log = StatsLog(now=100.0)
    for p, xacts in ((app_a, 30), (app_b, 10)):
        p.stats.xact_count += xacts
        p.stats.query_count += 2 * xacts
        p.stats.received += 1000
        p.stats.sent += 4000
        p.stats.xact_time += xacts * 0.002  # 2 ms each
        p.stats.query_time += xacts * 0.002
        p.total_wait_us += 800
    pools = [app_a, app_b, idle]

    log.tick(109.0, 10, pools)  # not a period yet
    assert stats_lines(caplog) == []
    log.tick(110.0, 10, pools)
    assert stats_lines(caplog) == [
        {
            "database": "app",
            "xacts_per_s": 4.0,
            "queries_per_s": 8.0,
            "in_bytes_per_s": 200,
            "out_bytes_per_s": 800,
            "xact_us": 2000,
            "query_us": 1000,
            "wait_us": 20,
        }
    ]
    # The next period counts only what happened in it: nothing.
    log.tick(120.0, 10, pools)
    assert stats_lines(caplog) == []
    app_a.stats.xact_count += 5
    app_a.stats.query_count += 5
    log.tick(125.0, 0, pools)  # 0 = off
    assert stats_lines(caplog) == []
    log.tick(130.0, 10, pools)
    (line,) = stats_lines(caplog)
    assert (line["database"], line["xacts_per_s"], line["xact_us"]) == ("app", 0.5, 0)


def test_database_totals_cover_named_databases_without_pools() -> None:
    p = pool("app")
    p.stats.xact_count = 7
    totals = database_totals([p], ["app", "reports"])
    assert totals["app"][1] == 7 and totals["reports"] == [0] * 11
