"""SHOW STATS, STATS_TOTALS, STATS_AVERAGES and TOTALS.

The totals are the pools' :class:`~scry.pool.PoolStats` counters, bumped on
the hot path, summed per database (times in microseconds, as PgBouncer).
The averages are over the last ``stats_period``: each SHOW keeps a snapshot
of the totals and compares with the newest one at least a period old (with
none yet, with the proxy's start). Counts are per second; times are per
transaction (``avg_xact_time``) or per query (``avg_query_time``,
``avg_wait_time``), as PgBouncer computes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from scry.pgbouncer.results import ADMIN_DB, NUMERIC, TEXT, result
from scry.stats_log import average_times, database_totals

if TYPE_CHECKING:
    from scry.pgbouncer.dispatch import AdminConsole

_T, _N = TEXT, NUMERIC

_TOTAL_NAMES = ("total_server_assignment_count", "total_xact_count", "total_query_count",
                "total_received", "total_sent", "total_xact_time", "total_query_time",
                "total_wait_time", "total_client_parse_count", "total_server_parse_count",
                "total_bind_count")  # fmt: skip
_AVG_NAMES = ("avg_server_assignment_count", "avg_xact_count", "avg_query_count", "avg_recv",
              "avg_sent", "avg_xact_time", "avg_query_time", "avg_wait_time",
              "avg_client_parse_count", "avg_server_parse_count", "avg_bind_count")  # fmt: skip
_TOTALS_SHORT = ("server_assignment_count", "xact_count", "query_count", "bytes_received",
                 "bytes_sent", "xact_time", "query_time", "wait_time", "client_parse_count",
                 "server_parse_count", "bind_count")  # fmt: skip
_AVERAGES_SHORT = ("server_assignment_count", "xact_count", "query_count", "bytes_received",
                   "bytes_sent", "xact_time", "query_time", "wait_time", "avg_client_parse_count",
                   "avg_server_parse_count", "avg_bind_count")  # fmt: skip
_XACT_COUNT, _QUERY_COUNT, _XACT_TIME, _QUERY_TIME, _WAIT_TIME = 1, 2, 5, 6, 7


def _database_totals(console: AdminConsole) -> dict[str, list[int]]:
    """Per database, the 11 counters of SHOW STATS, summed over its pools."""
    proxy = console.proxy
    return database_totals(proxy.pools.values(), (*proxy.targets, ADMIN_DB))


def _period_averages(console: AdminConsole, totals: dict[str, list[int]]) -> dict[str, list[int]]:
    """Per-second rates and per-query times over the last ``stats_period``."""
    compat = console.proxy.config.pgbouncer
    period = compat.stats_period if compat is not None else 60
    now = time.monotonic()
    snaps = console.state.snapshots
    if not snaps:
        snaps.append((now - (time.time() - console.proxy.started_at), {}))
    base_t, base = snaps[0]
    for t, snap in snaps:
        if t <= now - period:
            base_t, base = t, snap
    while len(snaps) > 1 and snaps[1][0] <= now - period:
        snaps.popleft()
    snaps.append((now, {k: list(v) for k, v in totals.items()}))
    seconds = max(now - base_t, 1e-6)
    out = {}
    for name, row in totals.items():
        old = base.get(name, [0] * 11)
        delta = [a - b for a, b in zip(row, old, strict=True)]
        avg = [int(d / seconds) for d in delta]
        avg[_XACT_TIME], avg[_QUERY_TIME], avg[_WAIT_TIME] = average_times(delta)
        out[name] = avg
    return out


def show_stats(console: AdminConsole) -> bytes:
    totals = _database_totals(console)
    averages = _period_averages(console, totals)
    columns = [("database", _T)] + [(n, _N) for n in (*_TOTAL_NAMES, *_AVG_NAMES)]
    rows = [[name, *totals[name], *averages[name]] for name in sorted(totals)]
    return result(columns, rows, "SHOW")


def show_stats_totals(console: AdminConsole) -> bytes:
    totals = _database_totals(console)
    columns = [("database", _T)] + [(n, _N) for n in _TOTALS_SHORT]
    return result(columns, [[n, *totals[n]] for n in sorted(totals)], "SHOW")


def show_stats_averages(console: AdminConsole) -> bytes:
    averages = _period_averages(console, _database_totals(console))
    columns = [("database", _T)] + [(n, _N) for n in _AVERAGES_SHORT]
    return result(columns, [[n, *averages[n]] for n in sorted(averages)], "SHOW")


def show_totals(console: AdminConsole) -> bytes:
    totals = _database_totals(console)
    averages = _period_averages(console, totals)
    total = [sum(col) for col in zip(*totals.values(), strict=True)]
    avg = [sum(col) for col in zip(*averages.values(), strict=True)]
    # Per-query and per-transaction times are weighted by their rates, not summed.
    for index, rate in ((_QUERY_TIME, _QUERY_COUNT), (_WAIT_TIME, _QUERY_COUNT),
                        (_XACT_TIME, _XACT_COUNT)):  # fmt: skip
        rates = [a[rate] for a in averages.values()]
        weighted = sum(a[index] * r for a, r in zip(averages.values(), rates, strict=True))
        avg[index] = weighted // sum(rates) if sum(rates) else 0
    rows = [[n, v] for n, v in zip(_TOTAL_NAMES, total, strict=True)]
    rows += [[n, v] for n, v in zip(_AVG_NAMES, avg, strict=True)]
    return result([("name", _T), ("value", _N)], rows, "SHOW")


STATS_VIEWS: dict[str, Callable[[AdminConsole], bytes]] = {
    "stats": show_stats, "stats_totals": show_stats_totals,
    "stats_averages": show_stats_averages, "totals": show_totals,
}  # fmt: skip
