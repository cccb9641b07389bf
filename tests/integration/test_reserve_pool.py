"""PgBouncer's reserve pool: ``pool.reserve_size`` extra servers for clients that
waited longer than ``timeouts.reserve_pool_timeout``, never more.

The clients hold their servers with open transactions; PostgreSQL's
pg_stat_activity is the judge of how many servers scry opened. The last test
runs the same scenario against PgBouncer from one pgbouncer.ini.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest
from test_admin_api import AUTH, get, start_admin_proxy
from test_pgbouncer_compat import Bouncer, bouncer_dir, running

from scry.devcluster import DevCluster

TIMEOUT = 0.5


async def _holders(proxy: Any, count: int) -> list[psycopg.AsyncConnection[Any]]:
    """``count`` clients, each inside a transaction (so each holds a server)."""
    conns = []
    for _ in range(count):
        conn = await psycopg.AsyncConnection.connect(**proxy.conninfo(), autocommit=True)
        await conn.execute("begin")
        await conn.execute("select 1")
        conns.append(conn)
    return conns


async def _timed_query(proxy: Any) -> float:
    """Seconds until a new client's first query is answered."""
    conn = await psycopg.AsyncConnection.connect(**proxy.conninfo(), autocommit=True)
    try:
        started = time.monotonic()
        await conn.execute("select 1")
        return time.monotonic() - started
    finally:
        await conn.close()


def _reserve_reported(base: str) -> tuple[int, int, float]:
    """(reserve_size, reserve_in_use) from the admin API, and the metrics gauge."""
    (pool,) = get(base, "/api/v1/pools")["pools"]
    metrics = httpx.get(f"{base}/metrics", headers=AUTH, timeout=5).text
    (line,) = [x for x in metrics.splitlines() if x.startswith("scry_pool_reserve_in_use{")]
    return pool["reserve_size"], pool["reserve_in_use"], float(line.rsplit(" ", 1)[1])


async def test_a_client_waiting_past_the_timeout_gets_a_reserve_server(
    pg: DevCluster, scry_proxy: Callable[..., Any], backend_count: Callable[..., int]
) -> None:
    proxy, base = start_admin_proxy(
        scry_proxy,
        pool={"mode": "transaction", "size": 2, "reserve_size": 1},
        timeouts={"reserve_pool_timeout": TIMEOUT},
    )
    holders = await _holders(proxy, 2)
    assert backend_count(pg, proxy=proxy) == 2
    assert _reserve_reported(base) == (1, 0, 0.0)
    waited = await _timed_query(proxy)  # the pool is full: the reserve serves it
    assert TIMEOUT <= waited < TIMEOUT + 3, waited
    assert backend_count(pg, proxy=proxy) == 3
    assert _reserve_reported(base) == (1, 1, 1.0)  # the admin API and /metrics say so

    # The reserve is spent: a fourth client waits past the timeout for a release.
    third = (await _holders(proxy, 1))[0]  # takes the reserve server, now idle
    fourth = asyncio.create_task(_timed_query(proxy))
    deadline = time.monotonic() + 3 * TIMEOUT
    while time.monotonic() < deadline:
        assert not fourth.done()
        assert backend_count(pg, proxy=proxy) == 3  # size + reserve, never more
        await asyncio.sleep(0.1)
    await holders[0].execute("commit")
    await asyncio.wait_for(fourth, 5)  # served by the released server
    assert backend_count(pg, proxy=proxy) == 3
    for conn in [*holders, third]:
        await conn.close()


@pytest.mark.parametrize(
    "settings",
    [{"reserve_size": 0, "timeout": TIMEOUT}, {"reserve_size": 1, "timeout": 0}],
    ids=["no-reserve", "timeout-0-disables"],
)
async def test_without_reserve_a_client_waits_for_a_release(
    pg: DevCluster,
    scry_proxy: Callable[..., Any],
    backend_count: Callable[..., int],
    settings: dict[str, Any],
) -> None:
    proxy = scry_proxy(
        {
            "pool": {"size": 2, "reserve_size": settings["reserve_size"]},
            "timeouts": {"reserve_pool_timeout": settings["timeout"]},
        }
    )
    holders = await _holders(proxy, 2)
    waiter = asyncio.create_task(_timed_query(proxy))
    await asyncio.sleep(3 * TIMEOUT)
    assert not waiter.done()
    assert backend_count(pg, proxy=proxy) == 2
    await holders[0].execute("commit")
    await asyncio.wait_for(waiter, 5)  # served by the released server
    assert backend_count(pg, proxy=proxy) == 2
    for conn in holders:
        await conn.close()


def test_reserve_matches_pgbouncer(pg: DevCluster) -> None:
    """The same ini to both: the third client is served after the timeout, from
    one reserve server that SHOW DATABASES counts."""
    seen = {}
    extra = f"default_pool_size = 2\nreserve_pool_size = 1\nreserve_pool_timeout = {TIMEOUT}\n"
    with bouncer_dir() as directory:
        for kind in ("pgbouncer", "scry"):
            with running(kind, pg, directory, extra=extra) as b:
                seen[kind] = _reserve_scenario(b)
    for kind, (waited, current) in seen.items():
        assert TIMEOUT <= waited < TIMEOUT + 3, (kind, waited)
        assert current == 3, kind
    reserve = {kind: b for kind, b in seen.items()}
    assert reserve["scry"][1] == reserve["pgbouncer"][1]


def _reserve_scenario(b: Bouncer) -> tuple[float, int]:
    """(how long the third client waited, SHOW DATABASES current_connections then)."""
    holders = [b.connect() for _ in range(2)]
    for conn in holders:
        conn.execute("begin")
        conn.execute("select 1")
    waited: list[float] = []

    def third() -> None:
        with b.connect() as conn:
            started = time.monotonic()
            conn.execute("select 1")
            waited.append(time.monotonic() - started)

    thread = threading.Thread(target=third)
    thread.start()
    thread.join(10)
    columns, rows, _ = b.admin("SHOW DATABASES")
    names = [c for c, _ in columns]
    app = next(r for r in rows if r[0] == "app")
    for conn in holders:
        conn.close()
    assert waited, f"{b.kind}: the third client was never served\n{b.output()[-3000:]}"
    return waited[0], app[names.index("current_connections")]
