"""Per-database traffic totals, and PgBouncer's ``log_stats`` line.

The totals are the pools' PoolStats counters (bumped on the hot path)
summed per database, in PgBouncer's units; SHOW STATS reads them too
(scry.pgbouncer.stats). Every ``log.stats_period`` seconds the janitor
logs a ``stats`` line per database that saw traffic since the last one:
rates per second and average times in microseconds, as PgBouncer's log
line has them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from scry.log import event

if TYPE_CHECKING:
    from scry.pool import Pool

#: The counters, in SHOW STATS's order (times in microseconds).
TOTAL_FIELDS = (
    "server_assignment_count", "xact_count", "query_count", "received", "sent", "xact_time",
    "query_time", "wait_time", "client_parse_count", "server_parse_count", "bind_count",
)  # fmt: skip
_XACTS, _QUERIES, _RECEIVED, _SENT, _XACT_TIME, _QUERY_TIME, _WAIT_TIME = 1, 2, 3, 4, 5, 6, 7


def database_totals(pools: Iterable[Pool], databases: Iterable[str]) -> dict[str, list[int]]:
    """Per database (every name in ``databases``, and any with a pool), the
    counters of TOTAL_FIELDS summed over its pools."""
    by_db: dict[str, list[int]] = {name: [0] * len(TOTAL_FIELDS) for name in databases}
    for pool in list(pools):
        row = by_db.setdefault(pool.target.name, [0] * len(TOTAL_FIELDS))
        st = pool.stats
        for index, value in enumerate((
            st.server_assignment_count, st.xact_count, st.query_count, st.received,
            st.sent, int(st.xact_time * 1e6), int(st.query_time * 1e6),
            pool.total_wait_us, st.client_parse_count, st.server_parse_count,
            st.bind_count,
        )):  # fmt: skip
            row[index] += value
    return by_db


def average_times(delta: list[int]) -> tuple[int, int, int]:
    """From a period's change in the totals: the average transaction time, and
    query and wait times per query, in microseconds (PgBouncer's avg_*_time)."""
    xacts, queries = delta[_XACTS], delta[_QUERIES]
    return (
        delta[_XACT_TIME] // xacts if xacts else 0,
        delta[_QUERY_TIME] // queries if queries else 0,
        delta[_WAIT_TIME] // queries if queries else 0,
    )


class StatsLog:
    """The periodic ``stats`` lines (called by the janitor about once a second)."""

    def __init__(self, now: float) -> None:
        self._last_at = now
        self._last: dict[str, list[int]] = {}

    def tick(self, now: float, period: float, pools: Iterable[Pool]) -> None:
        if not period or now - self._last_at < period:
            return
        seconds, self._last_at = now - self._last_at, now
        totals = database_totals(pools, ())
        last, self._last = self._last, totals
        for name in sorted(totals):
            old = last.get(name, [0] * len(TOTAL_FIELDS))
            delta = [a - b for a, b in zip(totals[name], old, strict=True)]
            xacts, queries = delta[_XACTS], delta[_QUERIES]
            if not (xacts or queries or delta[_RECEIVED]):
                continue  # no traffic: no line
            xact_us, query_us, wait_us = average_times(delta)
            event(
                "stats",
                database=name,
                xacts_per_s=round(xacts / seconds, 1),
                queries_per_s=round(queries / seconds, 1),
                in_bytes_per_s=round(delta[_RECEIVED] / seconds),
                out_bytes_per_s=round(delta[_SENT] / seconds),
                xact_us=xact_us,
                query_us=query_us,
                wait_us=wait_us,
            )
