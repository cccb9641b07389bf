"""Pooling: pool size limits, isolation between clients, startup parameters, waiting.

A note on plain ``SET`` in transaction mode: as in PgBouncer, a session-level
``SET`` of an untracked setting done by one client stays on the backend and
may be seen by whichever client gets that backend next. That is documented
PgBouncer semantics, so nothing here asserts on it; transaction-local
settings (``SET LOCAL`` / ``set_config(..., true)``) must never leak.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import asyncpg
import psycopg
import psycopg.errors
import pytest
from rawpg import Raw, data_row, q
from test_admin_api import get, start_admin_proxy

# The proxy's backends: user app on database app (the tests' own direct
# connections are the postgres superuser). ``since`` filters out backends of
# proxies started by earlier tests that PostgreSQL has not reaped yet.
SAMPLE_SQL = """
select count(*) from pg_stat_activity
where datname = 'app' and usename = 'app' and backend_type = 'client backend'
  and backend_start >= to_timestamp(%s)
"""


class BackendSampler:
    """Polls pg_stat_activity every ~20 ms and remembers the maximum count."""

    def __init__(self, admin_dsn: str, since: float) -> None:
        self.admin_dsn = admin_dsn
        self.since = since
        self.samples: list[int] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> BackendSampler:
        self._conn = await psycopg.AsyncConnection.connect(self.admin_dsn, autocommit=True)
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while not self._stop.is_set():
            cur = await self._conn.execute(SAMPLE_SQL, (self.since,))
            row = await cur.fetchone()
            assert row is not None
            self.samples.append(int(row[0]))
            try:
                await asyncio.wait_for(self._stop.wait(), 0.02)
            except TimeoutError:
                pass

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task
        await self._conn.close()

    @property
    def max(self) -> int:
        return max(self.samples, default=0)


async def aconnect(proxy, **kwargs) -> psycopg.AsyncConnection:
    kwargs.setdefault("autocommit", True)
    kwargs.setdefault("prepare_threshold", None)  # no named statements in transaction mode
    return await psycopg.AsyncConnection.connect(**proxy.conninfo(), **kwargs)


async def fetch1(conn: psycopg.AsyncConnection, sql: str, params=None):
    cur = await conn.execute(sql, params)
    return await cur.fetchone()


# --- transaction mode: many clients, few servers ----------------------------------------


async def test_100_clients_pool_of_5(scry_proxy, admin_dsn) -> None:
    pool_size = 5
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": pool_size}})
    n_clients = 100
    leaks: list[tuple[int, object]] = []

    async def client(cid: int) -> int:
        # Half use autocommit statements, half explicit transactions.
        conn = await aconnect(proxy, autocommit=cid % 2 == 0)
        async with conn:
            for i in range(5):
                if cid % 2 == 0:
                    row = await fetch1(conn, "select %s::int, pg_sleep(0.002)::text", (cid,))
                    assert row is not None and row[0] == cid
                else:
                    # A transaction-local setting is visible inside its transaction only.
                    row = await fetch1(
                        conn, "select set_config('scry.owner', %s, true)", (f"c{cid}-{i}",)
                    )
                    assert row == (f"c{cid}-{i}",)
                    await asyncio.sleep(0)  # let other clients interleave
                    row = await fetch1(conn, "select current_setting('scry.owner', true)")
                    assert row == (f"c{cid}-{i}",)
                    await conn.commit()
                # Outside any transaction nobody's local setting may be visible.
                row = await fetch1(conn, "select current_setting('scry.owner', true)")
                assert row is not None
                seen = row[0]
                if seen not in (None, ""):
                    leaks.append((cid, seen))
                if cid % 2:
                    await conn.commit()
        return cid

    async with BackendSampler(admin_dsn, proxy.started_wall) as sampler:
        done = await asyncio.wait_for(
            asyncio.gather(*(client(c) for c in range(n_clients))), timeout=40
        )
    assert sorted(done) == list(range(n_clients))
    assert not leaks, f"transaction-local settings leaked between clients: {leaks[:5]}"
    assert len(sampler.samples) >= 3
    assert sampler.max <= pool_size, f"saw {sampler.max} proxy backends, pool size {pool_size}"
    assert sampler.max >= 1


async def test_set_local_not_visible_to_other_client(scry_proxy) -> None:
    # Pool size 1: both clients share one backend, strictly alternating.
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}})
    a = await aconnect(proxy, autocommit=False)
    b = await aconnect(proxy)
    try:
        await a.execute("set local scry.secret = 'from-a'")
        assert await fetch1(a, "select current_setting('scry.secret', true)") == ("from-a",)
        await a.commit()
        (seen,) = await fetch1(b, "select current_setting('scry.secret', true)")
        assert seen in (None, "")
        await fetch1(a, "select set_config('scry.secret', 'again-a', true)")
        await a.commit()
        (seen,) = await fetch1(b, "select current_setting('scry.secret', true)")
        assert seen in (None, "")
    finally:
        await a.close()
        await b.close()


# --- startup parameters follow the client across backends ---------------------------------

PROFILES = {
    "a": {
        "application_name": "client_a",
        "options": "-c search_path=myschema,public -c TimeZone=Asia/Tokyo -c DateStyle=SQL,DMY",
    },
    "b": {
        "application_name": "client_b",
        "options": "-c search_path=other,public -c TimeZone=America/New_York "
        "-c DateStyle=German,MDY",
    },
}
SETTINGS_SQL = (
    "select current_setting('application_name'), current_setting('TimeZone'),"
    " current_setting('DateStyle'), current_setting('search_path'),"
    " current_schemas(false)::text"
)


def expected_settings(admin_dsn: str, pg, profile: dict[str, str]) -> tuple:
    """What PostgreSQL itself reports for these startup parameters (direct connection)."""
    with psycopg.connect(pg.dsn(sslmode="disable"), **profile) as conn:
        row = conn.execute(SETTINGS_SQL).fetchone()
        (show,) = conn.execute("show search_path").fetchone()  # type: ignore[misc]
    assert row is not None
    return (*row, show)


def test_startup_parameters_follow_each_client(scry_proxy, pg, admin_dsn) -> None:
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}})
    want = {k: expected_settings(admin_dsn, pg, p) for k, p in PROFILES.items()}
    assert want["a"][:3] == ("client_a", "Asia/Tokyo", "SQL, DMY")
    conns = {
        k: psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=None, **p)
        for k, p in PROFILES.items()
    }
    try:
        pids = set()
        for _ in range(6):
            for name, conn in conns.items():
                row = conn.execute(SETTINGS_SQL).fetchone()
                (show,) = conn.execute("show search_path").fetchone()  # type: ignore[misc]
                assert (*row, show) == want[name], name  # type: ignore[misc]
                pids.add(conn.execute("select pg_backend_pid()").fetchone())
        assert len(pids) == 1  # one backend served both clients
    finally:
        for conn in conns.values():
            conn.close()


def test_settings_apply_after_a_client_without_standard_conforming_strings(scry_proxy) -> None:
    """A client logged in with standard_conforming_strings=off leaves its
    server so; the next client's settings (a backslash in application_name)
    must still apply, and standard_conforming_strings go back to on."""
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}, "auth": {"type": "trust"}})
    old = Raw(proxy.port, params={"standard_conforming_strings": "off"})
    old.send(q("select 1"))
    old.until_ready()
    old.close()
    new = Raw(proxy.port, params={"application_name": "tool\\"})
    try:
        new.send(q("select current_setting('standard_conforming_strings'), "
                   "current_setting('application_name'), 'a\\tb'"))  # fmt: skip
        rows = [data_row(body) for kind, body in new.until_ready() if kind == "D"]
    finally:
        new.close()
    assert rows == [["on", "tool\\", "a\\tb"]]
    assert "could not apply a client setting" not in proxy.log_tail(50)


async def test_a_startup_setting_named_on_its_own_wins_over_options(scry_proxy, pg) -> None:
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}})
    settings = {"options": "-c TimeZone=UTC -c statement_timeout=5s", "TimeZone": "Asia/Tokyo"}
    sql = "select current_setting('TimeZone'), current_setting('statement_timeout')"
    seen = []
    for dsn in (pg.dsn(sslmode="disable"), proxy.asyncpg_dsn()):
        conn = await asyncpg.connect(dsn, server_settings=settings, timeout=10)
        try:
            seen.append(tuple(await conn.fetchrow(sql)))
        finally:
            await conn.close()
    assert seen == [("Asia/Tokyo", "5s")] * 2


# Startup settings PostgreSQL refuses at login: a name it does not know (which
# asyncpg sends for a connect_timeout in its URL), and values it does not take,
# for a setting it reports back (TimeZone) and one it does not.
REFUSED = {
    "unknown-name": {"TimeZone": "Asia/Tokyo", "connect_timeout": "10"},
    "bad-value": {"statement_timeout": "soon"},
    "bad-reported-value": {"TimeZone": "Mars/Olympus_Mons"},
    "bad-value-with-detail": {"DateStyle": "ISO, Martian"},
    "bad-value-with-hint": {"lock_timeout": "5 fortnights"},
    "bad-option": {"options": "-c lock_timeout=never"},
}


@pytest.mark.parametrize("settings", REFUSED.values(), ids=REFUSED.keys())
async def test_a_startup_setting_postgres_refuses_fails_the_login_as_there(
    scry_proxy, pg, settings: dict[str, str]
) -> None:
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 2}})
    with pytest.raises(asyncpg.PostgresError) as direct:
        await asyncpg.connect(pg.dsn(sslmode="disable"), server_settings=settings, timeout=10)
    for _ in range(2):  # (the second time, scry remembers the answer)
        with pytest.raises(asyncpg.PostgresError) as through:
            await asyncpg.connect(proxy.asyncpg_dsn(), server_settings=settings, timeout=10)
        said = [(e.sqlstate, e.message, e.detail, e.hint) for e in (through.value, direct.value)]
        assert said[0] == said[1]
    assert "Traceback" not in proxy.log_text()


async def test_unreported_startup_settings_follow_each_client(scry_proxy) -> None:
    """Settings PostgreSQL does not report back (statement_timeout, a custom
    app.tenant) apply on whichever server serves the client, and a client
    refused for another setting leaves nothing behind on the servers."""
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 2}})
    wanted = {"statement_timeout": "1234", "TimeZone": "Asia/Tokyo", "app.tenant": "t1"}
    with pytest.raises(asyncpg.UndefinedObjectError):
        await asyncpg.connect(
            proxy.asyncpg_dsn(), server_settings={**wanted, "connect_timeout": "10"}, timeout=10
        )
    clients = [
        await asyncpg.connect(proxy.asyncpg_dsn(), server_settings=wanted, timeout=10)
        for _ in range(3)
    ]
    plain = [await asyncpg.connect(proxy.asyncpg_dsn(), timeout=10) for _ in range(2)]
    sql = (
        "select current_setting('statement_timeout'), current_setting('TimeZone'),"
        " current_setting('app.tenant', true)"
    )
    try:
        for _ in range(4):
            answers = await asyncio.gather(*(c.fetchrow(sql) for c in (*clients, *plain)))
            assert [tuple(a) for a in answers[:3]] == [("1234ms", "Asia/Tokyo", "t1")] * 3
            for row in answers[3:]:
                assert row[0] == "0" and row[1] != "Asia/Tokyo" and row[2] in (None, "")
    finally:
        for conn in (*clients, *plain):
            await conn.close()


async def test_a_settings_check_leaves_no_setting_behind(scry_proxy) -> None:
    """The server a login's settings are checked on keeps what its last client
    set, and scry must still know it: the next clients get the defaults.
    (The check once forgot it, and one client's statement_timeout reached the
    next ones.)"""
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}})
    sql = "select current_setting('statement_timeout')"
    first = await asyncpg.connect(
        proxy.asyncpg_dsn(), server_settings={"statement_timeout": "1234"}, timeout=10
    )
    try:
        assert await first.fetchval(sql) == "1234ms"
    finally:
        await first.close()
    seen = []
    for settings in ({"app.tenant": "t7"}, {}):  # (the first is checked on the one server)
        conn = await asyncpg.connect(proxy.asyncpg_dsn(), server_settings=settings, timeout=10)
        try:
            seen.append(await conn.fetchval(sql))
        finally:
            await conn.close()
    assert seen == ["0", "0"]


async def test_logins_opening_together_ask_postgres_about_a_setting_once(
    scry_proxy, admin_dsn
) -> None:
    """Ten connections opened at once with a setting the pool has not seen:
    one login asks PostgreSQL and the others wait for its answer, so the
    pool's one idle server is enough. (Each login asking for itself, queued
    for a server, made the pool open another.)"""
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 20}})
    first = await asyncpg.connect(proxy.asyncpg_dsn(), timeout=10)
    await first.fetchval("select 1")  # (the pool's first server, idle from now on)
    wanted = {"app.tenant": "t9", "statement_timeout": "2345"}
    clients = await asyncio.gather(
        *(
            asyncpg.connect(proxy.asyncpg_dsn(), server_settings=wanted, timeout=10)
            for _ in range(10)
        )
    )
    try:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            (servers,) = admin.execute(SAMPLE_SQL, (proxy.started_wall,)).fetchone()  # type: ignore[misc]
        assert servers == 1
        assert await clients[-1].fetchval("select current_setting('app.tenant')") == "t9"
    finally:
        for conn in (first, *clients):
            await conn.close()


async def test_a_refused_setting_is_asked_about_again_after_a_reload(
    scry_proxy, admin_dsn, wait_until
) -> None:
    """scry remembers that PostgreSQL refused a setting, until a reload: that
    is how a DBA who has fixed the cause (here, GRANT SET ON PARAMETER) has
    it asked again."""
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 2}})
    wanted = {"log_statement": "all"}  # (only superusers, or a GRANT, may set it)

    async def login() -> asyncpg.Connection:
        return await asyncpg.connect(proxy.asyncpg_dsn(), server_settings=wanted, timeout=10)

    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await login()
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("grant set on parameter log_statement to app")
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):  # (remembered)
                await login()
            proxy.send_signal(signal.SIGHUP)
            wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
            conn = await login()
            try:
                assert await conn.fetchval("select current_setting('log_statement')") == "all"
            finally:
                await conn.close()
        finally:
            admin.execute("revoke set on parameter log_statement from app")


async def test_a_login_waiting_to_check_its_settings_gets_query_wait_timeout(
    scry_proxy,
) -> None:
    """A new setting is checked on a pool server; with none free in time the
    login ends as a waiting client's query does, not as a connect failure."""
    proxy = scry_proxy(
        {"pool": {"mode": "session", "size": 1}, "timeouts": {"query_wait_timeout": 1}}
    )
    holder = await asyncpg.connect(proxy.asyncpg_dsn(), timeout=10)
    try:
        await holder.execute("select 1")  # (session mode: the only server is its own)
        with pytest.raises(asyncpg.ProtocolViolationError, match="query_wait_timeout"):
            await asyncpg.connect(
                proxy.asyncpg_dsn(), server_settings={"statement_timeout": "4321"}, timeout=10
            )
    finally:
        await holder.close()
    conn = await asyncpg.connect(
        proxy.asyncpg_dsn(), server_settings={"statement_timeout": "4321"}, timeout=10
    )
    try:
        assert await conn.fetchval("select current_setting('statement_timeout')") == "4321ms"
    finally:
        await conn.close()


REPORTED = ("application_name", "TimeZone", "DateStyle", "IntervalStyle", "client_encoding")


def test_login_parameter_status_matches_postgres(scry_proxy, pg) -> None:
    # The ParameterStatus a client gets at login must be what PostgreSQL itself
    # reports for the same startup parameters (drivers parse DateStyle & co).
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}})
    for name, profile in PROFILES.items():
        with psycopg.connect(pg.dsn(sslmode="disable"), **profile) as direct:
            want = {p: direct.info.parameter_status(p) for p in REPORTED}
        for _ in range(3):  # (then from what the pool learned, then planned)
            with psycopg.connect(**proxy.conninfo(), **profile) as conn:
                got = {p: conn.info.parameter_status(p) for p in REPORTED}
                row = conn.execute(
                    "select current_setting('DateStyle'), current_setting('TimeZone')"
                ).fetchone()
            assert got == want, name
            assert row == (want["DateStyle"], want["TimeZone"]), name


def test_client_set_of_tracked_parameter_follows_client(scry_proxy) -> None:
    # A plain SET of a reported setting (TimeZone, application_name) moves with the client.
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}})
    a = psycopg.connect(**proxy.conninfo(), autocommit=True, application_name="a0")
    b = psycopg.connect(**proxy.conninfo(), autocommit=True, application_name="b0")
    try:
        a.execute("set timezone = 'Europe/Paris'")
        a.execute("set application_name = 'a1'")
        b.execute("set timezone = 'Australia/Sydney'")
        for _ in range(3):
            assert a.execute("select current_setting('TimeZone')").fetchone() == ("Europe/Paris",)
            assert a.execute("select current_setting('application_name')").fetchone() == ("a1",)
            assert b.execute("select current_setting('TimeZone')").fetchone() == (
                "Australia/Sydney",
            )
            assert b.execute("select current_setting('application_name')").fetchone() == ("b0",)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("fingerprinting", [True, False], ids=["drain", "query-path"])
def test_session_state_in_transaction_mode_is_logged_once(
    scry_proxy, wait_until, fingerprinting: bool
) -> None:
    # PgBouncer's behaviour (nothing pins) with a warning naming what may leak:
    # with observability on, the drain classifies each query shape once; without
    # it the relay classifies each statement. Either way: once per client, and
    # only for statements that succeeded.
    proxy = scry_proxy(
        {
            "pool": {"mode": "transaction", "size": 1},
            "observability": {"fingerprinting": fingerprinting},
        }
    )
    warning = "session state in transaction pooling"
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UndefinedObject):
            conn.execute("set no_such_setting = 1")  # failed: nothing to warn about
        conn.execute("select 1")
        conn.execute("set timezone = 'UTC'")  # followed by scry: not session state
        assert warning not in proxy.log_text()
        for value in ("a", "b", "c"):
            conn.execute(f"set search_path = {value}")
        wait_until(lambda: warning in proxy.log_text(), 10, what="the warning")
        conn.execute("set search_path = d")
        conn.execute("prepare p as select 1")
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as other:
        other.execute("select 2")
        other.execute("set work_mem = '8MB'")
        wait_until(lambda: proxy.log_text().count(warning) == 2, 10, what="the second client")
    lines = [line for line in proxy.log_text().splitlines() if warning in line]
    assert len(lines) == 2, lines
    assert "kinds=set" in lines[0] and "kinds=set" in lines[1]


def test_a_client_keeps_its_server_from_its_second_transaction_on(scry_proxy) -> None:
    """A connect-per-query client (pgbench -C, a serverless handler) gives its server
    back at its first answer, so the next client runs on that warm backend and the pool
    opens no other; from its second transaction on, a client keeps (parks) its server
    while nobody waits."""
    proxy, base = start_admin_proxy(scry_proxy, pool={"mode": "transaction", "size": 5})

    def pool_state() -> tuple[int, int]:
        (pool,) = get(base, "/api/v1/pools")["pools"]
        return pool["parked"], pool["servers"]

    with (
        psycopg.connect(**proxy.conninfo(), autocommit=True) as a,
        psycopg.connect(**proxy.conninfo(), autocommit=True) as b,
    ):
        (a_backend,) = a.execute("select pg_backend_pid()").fetchone()
        assert pool_state() == (0, 1)  # back in the pool, though a is still connected
        (b_backend,) = b.execute("select pg_backend_pid()").fetchone()
        assert b_backend == a_backend and pool_state() == (0, 1)
        for _ in range(2):
            (again,) = a.execute("select pg_backend_pid()").fetchone()
            assert again == a_backend and pool_state() == (1, 1)


def test_a_client_does_not_park_the_last_free_server_of_a_full_pool(scry_proxy) -> None:
    """Parked, the pool's only free server would have to be taken back from its
    client by the next one; so at full size with nothing idle it goes back."""
    proxy, base = start_admin_proxy(scry_proxy, pool={"mode": "transaction", "size": 1})

    def pool_state() -> tuple[int, int, int]:
        (pool,) = get(base, "/api/v1/pools")["pools"]
        return pool["parked"], pool["idle"], pool["servers"]

    with (
        psycopg.connect(**proxy.conninfo(), autocommit=True) as a,
        psycopg.connect(**proxy.conninfo(), autocommit=True) as b,
    ):
        for _ in range(3):
            a.execute("select 1").fetchone()
            assert pool_state() == (0, 1, 1)
        (a_backend,) = a.execute("select pg_backend_pid()").fetchone()
        (b_backend,) = b.execute("select pg_backend_pid()").fetchone()
        assert b_backend == a_backend and pool_state() == (0, 1, 1)


# --- waiting for a server ------------------------------------------------------------------


async def test_waiting_clients_are_served_fifo(scry_proxy) -> None:
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}})
    holder = await aconnect(proxy, autocommit=False)
    waiters = [await aconnect(proxy) for _ in range(4)]
    try:
        await fetch1(holder, "select 1")  # holds the only server: transaction open
        tasks = []
        for conn in waiters:
            # pg_current_xact_id() grows in execution order: it records who ran first.
            tasks.append(asyncio.create_task(fetch1(conn, "select pg_current_xact_id()::text")))
            # Stagger the sends so that their arrival order at the proxy is defined.
            await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks), "a client ran while the pool was exhausted"
        await holder.commit()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        xids = [int(r[0]) for r in results]
        assert xids == sorted(xids), f"not served in arrival order: {xids}"
    finally:
        for conn in (holder, *waiters):
            await conn.close()


async def test_query_wait_timeout(scry_proxy) -> None:
    proxy = scry_proxy(
        {"pool": {"mode": "transaction", "size": 1}, "timeouts": {"query_wait_timeout": 1}}
    )
    holder = await aconnect(proxy, autocommit=False)
    waiter = await aconnect(proxy)
    try:
        await fetch1(holder, "select 1")  # transaction open: the pool is exhausted
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match="query_wait_timeout"):
            await asyncio.wait_for(fetch1(waiter, "select 1"), 10)
        elapsed = time.monotonic() - started
        assert 0.8 <= elapsed <= 3.0, elapsed
        # The holder is unaffected and the proxy keeps serving afterwards.
        assert await fetch1(holder, "select 2") == (2,)
        await holder.commit()
        async with await aconnect(proxy) as fresh:
            assert await fetch1(fresh, "select 3") == (3,)
    finally:
        await holder.close()
        await waiter.close()
    assert "query_wait_timeout" in proxy.log_text()


async def test_query_wait_timeout_of_one_database(scry_proxy, pg) -> None:
    """databases.*.pool.query_wait_timeout (PgBouncer's per-database one)
    holds that database's queue; another database keeps the global one."""
    proxy = scry_proxy(
        {
            "pool": {"mode": "transaction", "size": 1},
            "timeouts": {"query_wait_timeout": 60},
            "databases": {"quick": {"database_url": pg.url(), "pool": {"query_wait_timeout": 1}}},
        }
    )

    async def connect(dbname: str, **kwargs) -> psycopg.AsyncConnection:
        kwargs.setdefault("autocommit", True)
        return await psycopg.AsyncConnection.connect(
            **proxy.conninfo(dbname=dbname), prepare_threshold=None, **kwargs
        )

    holders = [await connect(db, autocommit=False) for db in ("app", "quick")]
    patient, quick = await connect("app"), await connect("quick")
    try:
        for holder in holders:
            await fetch1(holder, "select 1")  # a transaction open: each pool is exhausted
        waiting = asyncio.ensure_future(fetch1(patient, "select 'served'"))
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match="query_wait_timeout"):
            await asyncio.wait_for(fetch1(quick, "select 1"), 10)
        assert 0.8 <= time.monotonic() - started <= 3.0
        assert not waiting.done()  # app's client still waits: its limit is a minute
        await holders[0].commit()
        assert await asyncio.wait_for(waiting, 10) == ("served",)
    finally:
        for conn in (*holders, patient, quick):
            await conn.close()


# --- session mode ------------------------------------------------------------------------


async def test_session_mode_resets_server_between_clients(scry_proxy) -> None:
    proxy = scry_proxy({"pool": {"mode": "session", "size": 1}})
    async with await aconnect(proxy) as first:
        (pid1,) = await fetch1(first, "select pg_backend_pid()")
        await first.execute("set work_mem = '7MB'")
        await first.execute("select set_config('scry.leak', 'yes', false)")
        await first.execute("prepare leaked_stmt as select 1")
        await first.execute("create temp table leaked_temp (x int)")
        assert await fetch1(first, "show work_mem") == ("7MB",)
    async with await aconnect(proxy) as second:
        (pid2,) = await fetch1(second, "select pg_backend_pid()")
        assert pid2 == pid1  # pool size 1: the same backend, reset
        assert await fetch1(second, "show work_mem") != ("7MB",)
        (leak,) = await fetch1(second, "select current_setting('scry.leak', true)")
        assert leak in (None, "")
        assert await fetch1(
            second, "select count(*) from pg_prepared_statements where name = 'leaked_stmt'"
        ) == (0,)
        assert await fetch1(second, "select to_regclass('pg_temp.leaked_temp') is null") == (True,)


async def test_session_mode_pool_size_is_respected(scry_proxy, admin_dsn) -> None:
    pool_size = 2
    proxy = scry_proxy(
        {"pool": {"mode": "session", "size": pool_size}, "timeouts": {"query_wait_timeout": 10}}
    )
    async with BackendSampler(admin_dsn, proxy.started_wall) as sampler:
        conns = [await aconnect(proxy) for _ in range(4)]
        try:
            for conn in conns[:pool_size]:
                assert await fetch1(conn, "select 1") == (1,)
            blocked = asyncio.create_task(fetch1(conns[2], "select 'third'"))
            done, _ = await asyncio.wait({blocked}, timeout=0.5)
            assert not done, "a third session got a server from a pool of two"
            await conns[0].close()  # its server is reset and handed to the waiter
            assert await asyncio.wait_for(blocked, 10) == ("third",)
            # Sessions keep their server: the same backend for every query.
            pids = {await fetch1(conns[1], "select pg_backend_pid()") for _ in range(5)}
            assert len(pids) == 1
        finally:
            for conn in conns:
                await conn.close()
    assert sampler.max <= pool_size, sampler.max


@pytest.mark.parametrize("round_robin", [False, True], ids=["lifo", "server_round_robin"])
def test_server_round_robin_hands_out_the_server_idle_longest(
    scry_proxy, wait_until, round_robin
) -> None:
    pool = {"mode": "session", "size": 3, "min_size": 3, "server_round_robin": round_robin}
    proxy, admin = start_admin_proxy(scry_proxy, pool=pool)

    def all_idle() -> bool:  # (a session's server is reset before it is idle again)
        (info,) = get(admin, "/api/v1/pools")["pools"]
        return info["servers"] == info["idle"] == 3

    psycopg.connect(proxy.dsn()).close()  # the pool is made at the first login
    pids = []
    for _ in range(6):
        wait_until(all_idle, 10, what="three idle servers")
        with psycopg.connect(proxy.dsn()) as conn:
            pids.append(conn.execute("select pg_backend_pid()").fetchone()[0])
    if round_robin:  # each in turn
        assert len(set(pids)) == 3 and pids[:3] == pids[3:], pids
    else:  # the one used last, its caches warm
        assert len(set(pids)) == 1, pids


def test_connect_query_runs_on_every_new_server_before_its_first_client(scry_proxy) -> None:
    # PgBouncer's connect_query: each server is prepared before any client has it.
    query = "set lock_timeout = '1234ms'; set statement_timeout = '4321ms'"
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 2, "connect_query": query}})
    with (
        psycopg.connect(**proxy.conninfo(), autocommit=False) as a,
        psycopg.connect(**proxy.conninfo(), autocommit=False) as b,
    ):
        # Two transactions at once: two servers, both prepared.
        pids = set()
        for conn in (a, b):
            row = conn.execute(
                "select current_setting('lock_timeout'), current_setting('statement_timeout'),"
                " pg_backend_pid()"
            ).fetchone()
            assert row is not None and row[:2] == ("1234ms", "4321ms")
            pids.add(row[2])
        assert len(pids) == 2
        a.commit()
        b.commit()
    assert proxy.log_text().count("server connected") == 2


def test_a_failing_connect_query_is_logged_and_the_server_still_serves(scry_proxy) -> None:
    proxy = scry_proxy({"pool": {"size": 1, "connect_query": "select no_such_column"}})
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        assert conn.execute("select 'served'").fetchone() == ("served",)
    log = proxy.log_text()
    assert log.count("connect_query failed") == 1, proxy.log_tail()
    assert "sqlstate=42703" in log


def test_a_connect_query_that_leaves_a_transaction_open_fails_the_login(scry_proxy) -> None:
    # Such a server must never reach a client: the client is told why instead.
    proxy = scry_proxy({"pool": {"size": 1, "connect_query": "begin"}})
    with (
        pytest.raises(psycopg.OperationalError, match="connect_query left a transaction open"),
        psycopg.connect(**proxy.conninfo(), autocommit=True) as conn,
    ):
        conn.execute("select 1")


def test_application_name_add_host_shows_each_client_on_the_server(scry_proxy, admin_dsn) -> None:
    # PgBouncer's application_name_add_host: pg_stat_activity tells clients apart.
    proxy = scry_proxy(
        {"pool": {"mode": "transaction", "size": 1}, "application_name_add_host": True}
    )
    seen = {}
    for name in ("billing", "reports"):
        with psycopg.connect(**proxy.conninfo(), autocommit=True, application_name=name) as conn:
            with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
                client_port = sock.getsockname()[1]
            row = conn.execute(
                "select current_setting('application_name'), inet_client_port()"
            ).fetchone()
            assert row is not None
            assert row[0] == f"{name} - 127.0.0.1:{client_port}"
            seen[name] = row[1]  # the port of scry's server connection
    assert seen["billing"] == seen["reports"]  # one server, each client under its own name
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        names = [
            r[0]
            for r in admin.execute(
                "select application_name from pg_stat_activity where usename = 'app'"
            ).fetchall()
        ]
    assert any(n.startswith("reports - 127.0.0.1:") for n in names), names


def test_a_database_can_have_its_own_server_lifetime(pg, scry_proxy, wait_until) -> None:
    # (PgBouncer's per-database server_lifetime.)
    url = pg.url(password="app_pass")
    proxy = scry_proxy({
        "databases": {
            "short": {"database_url": url, "pool": {"server_lifetime": 1}},
            "long": {"database_url": url},  # timeouts.server_lifetime: an hour
        },
    })  # fmt: skip

    def backend_pid(dbname: str) -> int:
        with psycopg.connect(proxy.dsn(dbname=dbname)) as conn:
            return conn.execute("select pg_backend_pid()").fetchone()[0]

    first = {db: backend_pid(db) for db in ("short", "long")}
    wait_until(
        lambda: 'pool=short/app reason=server_lifetime' in proxy.log_text(), 5,
        what="the short-lived server closed",
    )  # fmt: skip
    assert backend_pid("long") == first["long"]
    assert backend_pid("short") != first["short"]
    assert "pool=long/app reason=server_lifetime" not in proxy.log_text()
