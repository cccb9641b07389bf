"""PgBouncer's max_db_connections and max_user_connections: several pools, one bound.

A pool is a (database, server user) pair. Two users on one database make two
pools that ``pool.max_db_connections`` bounds together; two database names
served by one user make two pools that ``pool.max_user_connections`` bounds
together. pg_stat_activity is the judge of how many servers scry holds; the
last test runs one scenario against PgBouncer from one pgbouncer.ini.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import psycopg
import pytest
from conftest import admin_conninfo
from test_pgbouncer_compat import Bouncer, bouncer_dir, running

from scry.devcluster import DevCluster

USERS = [{"name": "app", "password": "app_pass"}, {"name": "md5_user", "password": "md5_pass"}]


def _proxy(scry_proxy: Callable[..., Any], pg: DevCluster, **pool: Any) -> Any:
    # No user in the URL: each client's pool logs in as the client's own user.
    url = f"postgres://{pg.host}:{pg.port}/app"
    return scry_proxy(
        {
            "database_url": url,
            "databases": {"app": {"database_url": url}, "app2": {"database_url": url}},
            "auth": {"type": "md5", "users": USERS},
            "pool": {"mode": "transaction", "size": 5, **pool},
        }
    )


async def _connect(proxy: Any, user: str = "app", dbname: str = "app") -> psycopg.AsyncConnection:
    password = next(u["password"] for u in USERS if u["name"] == user)
    return await psycopg.AsyncConnection.connect(
        **proxy.conninfo(user=user, password=password, dbname=dbname), autocommit=True
    )


async def _in_transaction(proxy: Any, count: int, **who: str) -> list[psycopg.AsyncConnection]:
    conns = []
    for _ in range(count):
        conn = await _connect(proxy, **who)
        await conn.execute("begin")
        await conn.execute("select 1")
        conns.append(conn)
    return conns


SERVERS_SQL = """
select count(*) from pg_stat_activity
where datname = 'app' and usename = any(%(users)s) and backend_type = 'client backend'
  and pid <> pg_backend_pid() and backend_start >= to_timestamp(%(since)s::float8)
"""


def _servers(pg: DevCluster, proxy: Any) -> int:
    """The backends of both users that this proxy opened, in one snapshot."""
    users = [u["name"] for u in USERS]
    with psycopg.connect(admin_conninfo(pg), autocommit=True) as conn:
        row = conn.execute(SERVERS_SQL, {"users": users, "since": proxy.started_wall}).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_pool_at_max_db_connections_gets_a_busy_server_of_a_larger_pool(
    pg: DevCluster, scry_proxy: Callable[..., Any], backend_count: Callable[..., int]
) -> None:
    proxy = _proxy(scry_proxy, pg, max_db_connections=3)
    # (A pool's first client waits for a server login, as in PgBouncer: log in first.)
    other = await _connect(proxy, user="md5_user")
    await other.execute("select 1")
    holders = await _in_transaction(proxy, 3)  # md5_user's server makes room for the third
    assert backend_count(pg, proxy=proxy, user="app") == 3
    assert _servers(pg, proxy) == 3
    query = asyncio.create_task(other.execute("select current_user"))
    done, _ = await asyncio.wait({query}, timeout=0.5)
    assert not done, "md5_user's pool opened a fourth server"
    assert _servers(pg, proxy) == 3

    # One of the three was claimed: it is closed when its transaction ends, and
    # md5_user's pool opens its server in its place.
    for conn in holders:
        await conn.execute("commit")
        done, _ = await asyncio.wait({query}, timeout=0.5)
        assert _servers(pg, proxy) <= 3
        if done:
            break
    cursor = await query
    assert await cursor.fetchone() == ("md5_user",)
    assert "server claimed" in proxy.log_text()
    assert "evicted (max_db_connections / max_user_connections)" in proxy.log_text()
    for conn in [*holders, other]:
        await conn.close()


async def test_an_idle_server_of_another_pool_is_closed_to_make_room(
    pg: DevCluster, scry_proxy: Callable[..., Any], backend_count: Callable[..., int]
) -> None:
    proxy = _proxy(scry_proxy, pg, max_db_connections=2)
    other = await _connect(proxy, user="md5_user")  # its pool's login server...
    holders = await _in_transaction(proxy, 2)  # ... is closed for app's second
    for conn in holders:
        await conn.execute("commit")  # between transactions: their servers are free
    assert backend_count(pg, proxy=proxy, user="app") == 2
    assert _servers(pg, proxy) == 2
    started = time.monotonic()
    cursor = await other.execute("select current_user")
    assert await cursor.fetchone() == ("md5_user",)
    assert time.monotonic() - started < 0.5  # no wait for a timeout or the janitor
    assert backend_count(pg, proxy=proxy, user="md5_user") == 1
    assert backend_count(pg, proxy=proxy, user="app") == 1
    # The holders still work: one of them gets the server left, one waits its turn.
    for conn in holders:
        assert await (await conn.execute("select 1")).fetchone() == (1,)
    assert _servers(pg, proxy) <= 2
    for conn in [*holders, other]:
        await conn.close()


@pytest.mark.parametrize("limit", ["max_user_connections", "max_db_connections"])
async def test_pools_sharing_a_limit_all_finish_under_load_and_never_exceed_it(
    pg: DevCluster, scry_proxy: Callable[..., Any], backend_count: Callable[..., int], limit: str
) -> None:
    proxy = _proxy(scry_proxy, pg, **{limit: 3})
    # max_user_connections: user app on two database names (two pools, one user);
    # max_db_connections: two users on database app (two pools, one database).
    if limit == "max_user_connections":
        who = [{"user": "app", "dbname": "app"}, {"user": "app", "dbname": "app2"}]
    else:
        who = [{"user": "app", "dbname": "app"}, {"user": "md5_user", "dbname": "app"}]
    conns = [await _connect(proxy, **who[i % 2]) for i in range(10)]
    peak = 0
    stop = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, await asyncio.to_thread(_servers, pg, proxy))
            await asyncio.sleep(0.02)

    async def client(conn: psycopg.AsyncConnection) -> int:
        for _ in range(15):
            async with conn.transaction():
                await conn.execute("select pg_sleep(0.005)")
        return 15

    sampler = asyncio.create_task(sample())
    try:
        finished = await asyncio.wait_for(asyncio.gather(*(client(c) for c in conns)), 60)
    finally:
        stop.set()
        await sampler
    assert sum(finished) == 150
    assert 1 <= peak <= 3, peak
    for conn in conns:
        await conn.close()


def test_max_db_connections_matches_pgbouncer(pg: DevCluster) -> None:
    """One pgbouncer.ini to both: database app may have 3 servers, over the pools
    of users app and md5_user. md5_user's client waits while app holds all 3 in
    transactions, and is served once one of them commits."""
    seen = {}
    with bouncer_dir() as directory:
        userlist = directory / "userlist.txt"
        userlist.write_text(userlist.read_text() + '"md5_user" "md5_pass"\n')
        for kind in ("pgbouncer", "scry"):
            with running(kind, pg, directory, extra="max_db_connections = 3\n") as b:
                seen[kind] = _limit_scenario(b)
    for kind, (early, waited, peak) in seen.items():
        assert not early, f"{kind} served the fourth transaction past the limit"
        assert waited is not None and waited < 1, (kind, waited)
        assert peak <= 3, (kind, peak)


def _limit_scenario(b: Bouncer) -> tuple[bool, float | None, int]:
    """(served before any commit, seconds from the commit to the answer, most
    servers of database app that SHOW DATABASES reported)."""

    def servers() -> int:
        columns, rows, _ = b.admin("SHOW DATABASES")
        names = [c for c, _ in columns]
        return int(next(r for r in rows if r[0] == "app")[names.index("current_connections")])

    other = b.connect(user="md5_user", password="md5_pass")
    other.execute("select 1")  # its pool's first server; app's third takes its place
    holders = [b.connect() for _ in range(3)]
    for conn in holders:
        conn.execute("begin")
        conn.execute("select 1")
    peak = servers()
    answered = threading.Event()
    thread = threading.Thread(target=lambda: (other.execute("select 2"), answered.set()))
    thread.start()
    early = answered.wait(0.5)
    peak = max(peak, servers())
    holders[0].execute("commit")
    committed = time.monotonic()
    waited = time.monotonic() - committed if answered.wait(5) else None
    peak = max(peak, servers())
    thread.join(5)
    for conn in [*holders, other]:
        conn.close()
    return early, waited, peak


async def test_a_server_postgresql_ends_frees_its_place_at_once(
    pg: DevCluster, scry_proxy: Callable[..., Any], admin_dsn: str
) -> None:
    # A server scry closes holds its place until PostgreSQL has closed the
    # connection too; here PostgreSQL ends it (FATAL 57P01, then the close), and
    # the place is free as soon as scry has seen both.
    proxy = _proxy(scry_proxy, pg, max_db_connections=1)
    holder = await _connect(proxy)
    (pid,) = await (await holder.execute("select pg_backend_pid()")).fetchone()
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("select pg_terminate_backend(%s)", (pid,))
    started = time.monotonic()
    other = await _connect(proxy, user="md5_user")  # its pool's first server
    assert await (await other.execute("select current_user")).fetchone() == ("md5_user",)
    assert time.monotonic() - started < 2
    for conn in (holder, other):
        await conn.close()


@pytest.mark.parametrize(
    ("setting", "same", "other"),
    [
        ("max_db_client_connections", {"dbname": "app"}, {"dbname": "app2"}),
        ("max_user_client_connections", {"user": "app"}, {"user": "md5_user"}),
    ],
)
async def test_client_limits_refuse_with_53300(
    pg: DevCluster, scry_proxy: Callable[..., Any], setting: str, same: dict, other: dict
) -> None:
    proxy = _proxy(scry_proxy, pg, **{setting: 2})
    for _ in range(3):  # logins that come and go (the same StartupMessage each time)
        conn = await _connect(proxy, **same)
        await conn.close()
    held = [await _connect(proxy, **same) for _ in range(2)]
    # The same StartupMessage as the logins before: no shortcut skips the count.
    with pytest.raises(psycopg.OperationalError, match=f"allowed \\({setting}\\)"):
        await _connect(proxy, **same)
    password = next(u["password"] for u in USERS if u["name"] == same.get("user", "app"))
    with pytest.raises(asyncpg.TooManyConnectionsError, match=f"allowed \\({setting}\\)"):
        await asyncpg.connect(  # (asyncpg gives the SQLSTATE of a failed login)
            host="127.0.0.1", port=proxy.port, user=same.get("user", "app"), password=password,
            database=same.get("dbname", "app"), ssl=False,
        )  # fmt: skip
    elsewhere = await _connect(proxy, **other)  # another database / user is not counted
    assert await (await elsewhere.execute("select 1")).fetchone() == (1,)
    await held.pop().close()
    again = await _connect(proxy, **same)  # a place was freed
    for conn in [*held, elsewhere, again]:
        assert await (await conn.execute("select 1")).fetchone() == (1,)
        await conn.close()
