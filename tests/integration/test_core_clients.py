"""Real client libraries through a real ``scry serve``: psql, psycopg, asyncpg, pg8000.

Transaction mode is the default of these proxies. Drivers that rely on
prepared statements across Syncs (asyncpg, pg8000 with parameters) run
against a session-mode proxy, as they would behind PgBouncer; psycopg runs
with ``prepare_threshold=None`` in transaction mode for the same reason.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import threading
import time

import asyncpg
import pg8000.native
import psycopg
import psycopg.errors
import pytest
from rawpg import Raw, data_row, q

PSQL = "/usr/bin/psql"
N_ROWS = 1_000_000
SUM_ROWS = N_ROWS * (N_ROWS + 1) // 2


def run_psql(proxy, sql: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGPASSWORD="app_pass", PGSSLMODE="disable", PGCONNECT_TIMEOUT="10")
    cmd = [
        PSQL,
        "-X",
        "-q",
        "-At",
        "-h",
        "127.0.0.1",
        "-p",
        str(proxy.port),
        "-U",
        "app",
        "-d",
        "app",
    ]
    return subprocess.run(
        [*cmd, *extra, "-f", "-"],
        input=sql,
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )


# --- psql -----------------------------------------------------------------------------


def test_psql_queries_and_error(scry_proxy) -> None:
    proxy = scry_proxy()
    sql = (
        "select 1;\n"
        "select 1/0;\n"
        "select 'after error', 40 + 2;\n"
        "begin;\nselect 1/0;\nselect 5;\nrollback;\n"
        "select current_user, current_database();\n"
    )
    proc = run_psql(proxy, sql, "-v", "VERBOSITY=verbose")
    assert proc.returncode in (0, 3), proc.stderr  # errors do not end the session
    assert proc.stdout.splitlines() == ["1", "after error|42", "app|app"], proc
    assert proc.stderr.count("22012") == 2, proc.stderr
    assert "25P02" in proc.stderr, proc.stderr  # the aborted transaction refused select 5


def test_psql_on_error_stop(scry_proxy) -> None:
    proxy = scry_proxy()
    proc = run_psql(proxy, "select 7;\nselect 1/0;\nselect 8;\n", "-v", "ON_ERROR_STOP=1")
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["7"]
    assert "division by zero" in proc.stderr


def test_login_notify_message_reaches_psql_and_follows_a_reload(scry_proxy, wait_until) -> None:
    """PgBouncer's login_notify_message: a NOTICE at every login (psql prints
    it), a repeated one included; a reload changes it."""
    proxy = scry_proxy(
        {
            "login_notify_message": "you reached scry, not PostgreSQL",
            # md5: a repeated login may take the compiled path (LoginPlan)
            "auth": {"type": "md5", "users": [{"name": "app", "password": "app_pass"}]},
        }
    )
    for _ in range(2):
        proc = run_psql(proxy, "select 1;\n")
        assert proc.stdout.splitlines() == ["1"], proc
        assert "NOTICE:  you reached scry, not PostgreSQL" in proc.stderr, proc.stderr
    proxy.update_config({"login_notify_message": ""})
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in proxy.log_text(), 10, what="the reload")
    proc = run_psql(proxy, "select 2;\n")
    assert proc.stdout.splitlines() == ["2"] and "NOTICE" not in proc.stderr, proc


# --- psycopg (sync) -------------------------------------------------------------------


def test_psycopg_sync_queries_and_errors(scry_proxy) -> None:
    proxy = scry_proxy()
    with psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=None) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        assert conn.execute("select %s::int + %s::int", (2, 3)).fetchone() == (5,)
        assert conn.execute("select current_user").fetchone() == ("app",)
        # An error outside a transaction: the session goes on.
        with pytest.raises(psycopg.errors.DivisionByZero) as exc:
            conn.execute("select 1/0")
        assert exc.value.sqlstate == "22012"
        assert conn.execute("select 2").fetchone() == (2,)
        # Several statements in one simple Query.
        cur = conn.execute("select 1; select 2; select 3")
        results = [cur.fetchone()]
        while cur.nextset():
            results.append(cur.fetchone())
        assert results == [(1,), (2,), (3,)]

    with psycopg.connect(**proxy.conninfo(), prepare_threshold=None) as conn:
        # An error inside a transaction: 25P02 until ROLLBACK, then fine again.
        assert conn.execute("select 10").fetchone() == (10,)
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("select 1/0")
        for _ in range(2):
            with pytest.raises(psycopg.errors.InFailedSqlTransaction) as exc:
                conn.execute("select 11")
            assert exc.value.sqlstate == "25P02"
        conn.rollback()
        assert conn.execute("select 12").fetchone() == (12,)
        conn.commit()


def test_psycopg_sync_large_result(scry_proxy) -> None:
    proxy = scry_proxy()
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        rows = conn.execute(f"select generate_series(1, {N_ROWS})").fetchall()
        assert len(rows) == N_ROWS
        assert sum(r[0] for r in rows) == SUM_ROWS
        assert rows[0] == (1,) and rows[-1] == (N_ROWS,)
        # The connection is still in step afterwards.
        assert conn.execute("select 'next'").fetchone() == ("next",)


# --- psycopg (async) ------------------------------------------------------------------


async def test_psycopg_async_queries_and_errors(scry_proxy) -> None:
    proxy = scry_proxy()
    aconn = await psycopg.AsyncConnection.connect(
        **proxy.conninfo(), autocommit=True, prepare_threshold=None
    )
    async with aconn as conn:
        cur = await conn.execute("select 1, 'two'")
        assert await cur.fetchone() == (1, "two")
        with pytest.raises(psycopg.errors.DivisionByZero):
            await conn.execute("select 1/0")
        cur = await conn.execute("select %s::text", ("ok",))
        assert await cur.fetchone() == ("ok",)

        # Explicit transaction with an error inside it.
        await conn.execute("begin")
        await conn.execute("select 1")
        with pytest.raises(psycopg.errors.DivisionByZero):
            await conn.execute("select 1/0")
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            await conn.execute("select 1")
        await conn.execute("rollback")
        cur = await conn.execute("select 3")
        assert await cur.fetchone() == (3,)

        # A transaction block that commits.
        async with conn.transaction():
            cur = await conn.execute("select txid_current_if_assigned() is null")
            assert await cur.fetchone() == (True,)


async def test_psycopg_async_large_result(scry_proxy) -> None:
    proxy = scry_proxy()
    async with await psycopg.AsyncConnection.connect(**proxy.conninfo(), autocommit=True) as conn:
        count = total = 0
        async with conn.cursor() as cur:
            await cur.execute(f"select generate_series(1, {N_ROWS})")
            while batch := await cur.fetchmany(50_000):
                count += len(batch)
                total += sum(r[0] for r in batch)
        assert (count, total) == (N_ROWS, SUM_ROWS)
        cur = await conn.execute("select 'still here'")
        assert await cur.fetchone() == ("still here",)


async def test_concurrent_clients_get_their_own_answers(scry_proxy) -> None:
    proxy = scry_proxy({"pool": {"size": 5}})
    n_clients, n_queries = 20, 50

    async def client(cid: int) -> int:
        async with await psycopg.AsyncConnection.connect(
            **proxy.conninfo(),
            autocommit=True,
            prepare_threshold=None,
            application_name=f"client-{cid}",
        ) as conn:
            for i in range(n_queries):
                cur = await conn.execute(
                    "select %s::int * 1000 + %s::int, %s::text || '-' || %s::text,"
                    " current_setting('application_name')",
                    (cid, i, f"c{cid}", i),
                )
                row = await cur.fetchone()
                assert row == (cid * 1000 + i, f"c{cid}-{i}", f"client-{cid}"), (cid, i, row)
            return cid

    done = await asyncio.wait_for(
        asyncio.gather(*(client(c) for c in range(n_clients))), timeout=30
    )
    assert sorted(done) == list(range(n_clients))


# --- asyncpg (session mode: it prepares statements) ----------------------------------------


async def test_asyncpg_session_mode(scry_proxy) -> None:
    proxy = scry_proxy({"pool": {"mode": "session", "size": 3}})
    conn = await asyncpg.connect(proxy.asyncpg_dsn(), timeout=10)
    try:
        assert await conn.fetchval("select 1") == 1
        assert await conn.fetchval("select $1::int * 2", 21) == 42
        rows = await conn.fetch("select g, g * g as sq from generate_series(1, 100) g")
        assert len(rows) == 100 and rows[9]["sq"] == 100
        with pytest.raises(asyncpg.exceptions.DivisionByZeroError) as exc:
            await conn.fetchval("select 1/0")
        assert exc.value.sqlstate == "22012"
        async with conn.transaction():
            assert await conn.fetchval("select $1::text", "in tx") == "in tx"
        assert await conn.fetchval("select current_user") == "app"
        # The same prepared statement, many times (named statement reuse).
        for i in range(20):
            assert await conn.fetchval("select $1::int + 1", i) == i + 1
    finally:
        await asyncio.wait_for(conn.close(), 10)


async def test_asyncpg_simple_query_in_transaction_mode(scry_proxy) -> None:
    # execute() without arguments is a simple Query: fine in transaction mode.
    proxy = scry_proxy()
    conn = await asyncpg.connect(proxy.asyncpg_dsn(), timeout=10, statement_cache_size=0)
    try:
        await conn.execute("select 1; select 2")
        with pytest.raises(asyncpg.exceptions.DivisionByZeroError):
            await conn.execute("select 1/0")
        await conn.execute("select 3")
    finally:
        await asyncio.wait_for(conn.close(), 10)


# --- pg8000 ---------------------------------------------------------------------------


def test_pg8000_native_simple_query(scry_proxy) -> None:
    proxy = scry_proxy()
    conn = pg8000.native.Connection(
        "app", host="127.0.0.1", port=proxy.port, database="app", password="app_pass", timeout=10
    )
    try:
        assert conn.run("select 1, 'x'") == [[1, "x"]]
        with pytest.raises(pg8000.native.DatabaseError) as exc:
            conn.run("select 1/0")
        assert exc.value.args[0]["C"] == "22012"
        assert conn.run("select current_user") == [["app"]]
    finally:
        conn.close()


def test_pg8000_native_parameters_session_mode(scry_proxy) -> None:
    proxy = scry_proxy({"pool": {"mode": "session", "size": 2}})
    conn = pg8000.native.Connection(
        "app", host="127.0.0.1", port=proxy.port, database="app", password="app_pass", timeout=10
    )
    try:
        assert conn.run("select :a::int + :b::int", a=40, b=2) == [[42]]
        assert conn.run("select :s::text", s="héllo") == [["héllo"]]
    finally:
        conn.close()


def test_psycopg_parses_dates_with_lowercase_datestyle_option(scry_proxy) -> None:
    # psycopg reads the DateStyle ParameterStatus to parse dates. PostgreSQL
    # reports it normalised ("ISO, MDY") whatever the case of the option.
    proxy = scry_proxy()
    with psycopg.connect(**proxy.conninfo(), options="-c DateStyle=iso,mdy") as conn:
        (day,) = conn.execute("select '2024-01-02'::date").fetchone()  # type: ignore[misc]
        assert day.isoformat() == "2024-01-02"
        assert conn.info.parameter_status("DateStyle") == "ISO, MDY"


def test_cancel_request_through_proxy(scry_proxy, pg, wait_until) -> None:
    proxy = scry_proxy()
    admin = psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True)
    conn = psycopg.connect(**proxy.conninfo(), autocommit=True)
    try:
        outcome: list[BaseException | None] = []

        def sleeper() -> None:
            try:
                conn.execute("select pg_sleep(20) /* cancel_me */")
                outcome.append(None)
            except BaseException as exc:  # recorded for the assertion
                outcome.append(exc)

        thread = threading.Thread(target=sleeper)
        thread.start()
        wait_until(
            lambda: (
                admin.execute(
                    "select count(*) from pg_stat_activity where state = 'active'"
                    " and query like '%cancel_me%' and pid <> pg_backend_pid()"
                ).fetchone()
                == (1,)
            ),
            5,
            what="the query to run",
        )
        started = time.monotonic()
        conn.cancel_safe(timeout=5)
        thread.join(10)
        assert not thread.is_alive()
        assert time.monotonic() - started < 5
        assert isinstance(outcome[0], psycopg.errors.QueryCanceled), outcome
        assert conn.execute("select 'alive'").fetchone() == ("alive",)
    finally:
        conn.close()
        admin.close()


def test_a_client_asking_for_protocol_3_2_is_told_3_0(scry_proxy) -> None:
    """As PostgreSQL does: NegotiateProtocolVersion (3.0, the _pq_ options it does
    not know) before authentication, then the login goes on in 3.0."""
    proxy = scry_proxy({"auth": {"type": "trust"}})
    raw = Raw(proxy.port, protocol=(3 << 16) | 2,
              params={"application_name": "pg18", "_pq_.future_option": "on"})  # fmt: skip
    kind, body = raw.login[0]
    assert kind == "v"
    minor, count = struct.unpack_from("!ii", body)
    assert (minor, count) == (0, 1) and body[8:] == b"_pq_.future_option\0"
    assert [k for k, _ in raw.login[1:]].count("v") == 0 and raw.login[1][0] == "R"
    # The option is not a setting; the rest of the startup parameters are.
    raw.send(
        q("select current_setting('application_name'), current_setting('_pq_.future_option', true)")
    )
    rows = [data_row(b) for k, b in raw.until_ready() if k == "D"]
    assert rows == [["pg18", None]]
    raw.close()
    # A plain 3.0 client gets no such message.
    plain = Raw(proxy.port)
    assert plain.login[0][0] == "R"
    plain.close()
