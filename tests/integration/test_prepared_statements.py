"""Protocol-level prepared statements under transaction and hybrid pooling.

Real drivers that use named statements (asyncpg's statement cache, psycopg
with ``prepare_threshold=0``, libpq's PQprepare through pgbench and psycopg's
low-level ``pgconn``) against a pool much smaller than the number of clients,
so that statements prepared on one server are executed on others.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import threading

import asyncpg
import psycopg
import psycopg.errors
import pytest
from rawpg import SYNC, Raw, bind, data_row, execute, fields, kinds, parse, q

PGBENCH = "/usr/bin/pgbench"

MODES = ["transaction", "hybrid"]


def proxy_for(scry_proxy, mode: str, size: int, **extra):
    return scry_proxy({"pool": {"mode": mode, "size": size, **extra}})


def recreate_table(admin: psycopg.Connection, table: str, columns: str, rows: str) -> None:
    """A fresh table (``rows``: what INSERT takes after the name) that app may use."""
    admin.execute(f"drop table if exists {table}")
    admin.execute(f"create table {table} ({columns})")
    admin.execute(f"insert into {table} {rows}")
    admin.execute(f"grant all on {table} to app")


# --------------------------------------------------------------------------------------
# asyncpg: 50 connections, 5 servers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_asyncpg_pool_prepared_concurrency(scry_proxy, pg, mode: str) -> None:
    proxy = proxy_for(scry_proxy, mode, 5)
    table = f"prep_many_{mode}"
    admin = await asyncpg.connect(pg.dsn(user="postgres"))
    try:
        await admin.execute(f"drop table if exists {table}")
        await admin.execute(f"create table {table} (worker int, n int, label text)")
        await admin.execute(f"grant all on {table} to app")
    finally:
        await admin.close()

    pool = await asyncpg.create_pool(proxy.asyncpg_dsn(), min_size=50, max_size=50)
    try:

        async def worker(w: int) -> None:
            async with pool.acquire() as conn:
                for n in range(15):
                    assert await conn.fetchval("select $1::int * 3 + $2::int", w, n) == w * 3 + n
                    row = await conn.fetchrow(
                        "select $1::text || '-' || $2::int as label, $2::int + 1 as next",
                        f"w{w}",
                        n,
                    )
                    assert (row["label"], row["next"]) == (f"w{w}-{n}", n + 1)
                    # The same text from many clients: one server-side statement.
                    assert (
                        await conn.fetchval("select count(*) from generate_series(1, $1)", n) == n
                    )
                await conn.executemany(
                    f"insert into {table} (worker, n, label) values ($1, $2, $3)",
                    [(w, n, f"w{w}-{n}") for n in range(10)],
                )
                rows = await conn.fetch(
                    f"select n, label from {table} where worker = $1 order by n", w
                )
                assert [(r["n"], r["label"]) for r in rows] == [(n, f"w{w}-{n}") for n in range(10)]

        await asyncio.gather(*(worker(w) for w in range(50)))
        async with pool.acquire() as conn:
            assert await conn.fetchval(f"select count(*) from {table}") == 500
    finally:
        await pool.close()


# --------------------------------------------------------------------------------------
# psycopg prepare_threshold=0: 20 threads, 4 servers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_psycopg_threads_prepared(scry_proxy, mode: str) -> None:
    proxy = proxy_for(scry_proxy, mode, 4)
    errors: list[BaseException] = []
    barrier = threading.Barrier(20)

    def worker(t: int) -> None:
        try:
            with psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=0) as conn:
                barrier.wait(10)
                for n in range(40):
                    row = conn.execute(
                        "select %s::int * 7, %s::text || '!'", (t * 1000 + n, f"t{t}")
                    ).fetchone()
                    assert row == ((t * 1000 + n) * 7, f"t{t}!")
                    rows = conn.execute(
                        "select g from generate_series(%s::int, %s::int) g", (n, n + 2)
                    ).fetchall()
                    assert rows == [(n,), (n + 1,), (n + 2,)]
                    if n % 10 == 0:
                        with conn.transaction():
                            conn.execute("select %s::int", (n,))
                            (v,) = conn.execute("select %s::int + 1", (n,)).fetchone()
                            assert v == n + 1
                assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------------------
# pgbench -M prepared
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pgbench_tables(pg) -> None:
    env = {**os.environ, "PGPASSWORD": "app_pass"}
    subprocess.run(
        [PGBENCH, "-i", "-s", "1", "-q", "-h", pg.host, "-p", str(pg.port), "-U", "app", "app"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.mark.parametrize("threads", ["20", "1"])
@pytest.mark.parametrize("mode", MODES)
def test_pgbench_prepared(scry_proxy, pgbench_tables, mode: str, threads: str) -> None:
    # With -j 1 one pgbench thread drives all 20 connections, and its PQprepare
    # is synchronous: it blocks preparing BEGIN on a connection that has no
    # server while the 4 servers are held by connections whose transactions
    # that same thread must go on with. A pooler that waits for a server there
    # deadlocks (PgBouncer with max_prepared_statements does, until
    # query_wait_timeout); scry answers the prepare of a statement it knows.
    proxy = proxy_for(scry_proxy, mode, 4)
    env = {**os.environ, "PGPASSWORD": "app_pass"}
    cmd = [PGBENCH, "-M", "prepared", "-c", "20", "-j", threads, "-T", "3", "-n",
           "-h", "127.0.0.1", "-p", str(proxy.port), "-U", "app", "app"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    failed = re.search(r"number of failed transactions: (\d+)", out)
    assert failed is not None, out
    assert int(failed.group(1)) == 0, out
    processed = re.search(r"number of transactions actually processed: (\d+)", out)
    assert processed is not None and int(processed.group(1)) > 20, out
    assert "aborted" not in out, out


@pytest.mark.parametrize("mode", MODES)
def test_prepare_of_a_known_statement_needs_no_server(scry_proxy, pg, mode: str) -> None:
    """PQprepare while every server is taken: a statement the pool has parsed is
    answered at once and parsed on the server at its first use; any other waits."""
    proxy = scry_proxy({"pool": {"mode": mode, "size": 1}, "timeouts": {"query_wait_timeout": 1}})
    table = f"prep_known_{mode}"
    with psycopg.connect(pg.dsn(user="postgres"), autocommit=True) as admin:
        recreate_table(admin, table, "id int primary key, v text", "values (1, 'one')")
        ok = psycopg.pq.ExecStatus.COMMAND_OK
        lookup = f"select v from {table} where id = $1".encode()
        with (
            psycopg.connect(**proxy.conninfo(), autocommit=True) as first,
            psycopg.connect(**proxy.conninfo()) as holder,
            psycopg.connect(**proxy.conninfo(), autocommit=True) as second,
            psycopg.connect(**proxy.conninfo(), autocommit=True) as third,
        ):
            for name, sql in ((b"p1", b"select $1::int + 1"), (b"p2", lookup)):
                res = first.pgconn.prepare(name, sql)
                assert res.status == ok, res.error_message
            holder.execute("select 1")  # a transaction holds the only server

            for name, sql in ((b"add", b"select $1::int + 1"), (b"look", lookup)):
                res = second.pgconn.prepare(name, sql)
                assert res.status == ok, res.error_message
            # Never parsed in this pool: needs a server, and there is none.
            res = third.pgconn.prepare(b"mul", b"select $1::int * 2")
            assert res.status == psycopg.pq.ExecStatus.FATAL_ERROR
            assert "query_wait_timeout" in third.pgconn.error_message.decode()

            admin.execute(f"drop table {table}")
            holder.commit()
            res = second.pgconn.exec_prepared(b"add", [b"41"])
            assert res.status == psycopg.pq.ExecStatus.TUPLES_OK, res.error_message
            assert res.get_value(0, 0) == b"42"
            # Its Parse ran at its first use, after the table was dropped, and says so.
            res = second.pgconn.exec_prepared(b"look", [b"1"])
            assert res.status == psycopg.pq.ExecStatus.FATAL_ERROR
            assert res.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"42P01"
            assert second.execute("select 7").fetchone() == (7,)


# --------------------------------------------------------------------------------------
# Plan invalidation, re-Parse after Close, errors in a pipeline
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_prepared_survives_alter_table(scry_proxy, pg, mode: str) -> None:
    """A statement whose table changes is re-planned by PostgreSQL on every server."""
    proxy = proxy_for(scry_proxy, mode, 2)
    table = f"prep_alter_{mode}"
    with psycopg.connect(pg.dsn(user="postgres"), autocommit=True) as admin:
        recreate_table(admin, table, "id int primary key, v text, junk int",
                       "select g, 'v' || g, g from generate_series(1, 50) g")  # fmt: skip
        conns = [
            psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=0)
            for _ in range(4)
        ]
        try:
            query = f"select v from {table} where id = %s"

            def check_all(offset: int = 0) -> None:
                for k, conn in enumerate(conns):
                    for i in range(1, 4):
                        got = conn.execute(query, (k * 3 + i,)).fetchone()
                        assert got == (f"v{k * 3 + i}" if not offset else f"n{k * 3 + i}",)

            check_all()
            admin.execute(f"alter table {table} add column extra int default 7")
            check_all()
            admin.execute(f"create index on {table} (v)")
            admin.execute(f"alter table {table} drop column junk")
            check_all()
            admin.execute(f"update {table} set v = 'n' || id")
            admin.execute(f"alter table {table} alter column v type varchar(20)")
            # The result type changed (text -> varchar). PostgreSQL answers 0A000
            # "cached plan must not change result type" to a client that keeps
            # executing its old statement; a client that prepares the statement
            # anew must get the new plan, as it would on PostgreSQL directly.
            for conn in conns:
                conn.close()
            conns[:] = [
                psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=0)
                for _ in range(4)
            ]
            check_all(offset=1)
        finally:
            for conn in conns:
                conn.close()


@pytest.mark.parametrize("mode", MODES)
async def test_asyncpg_select_star_after_add_column(scry_proxy, pg, mode: str) -> None:
    """asyncpg recovers from InvalidCachedStatementError by re-preparing the
    statement (outside a transaction); that must work through the pool too."""
    proxy = proxy_for(scry_proxy, mode, 2)
    table = f"prep_star_{mode}"
    admin = await asyncpg.connect(pg.dsn(user="postgres"))
    conn = await asyncpg.connect(proxy.asyncpg_dsn())
    try:
        await admin.execute(f"drop table if exists {table}")
        await admin.execute(f"create table {table} (id int primary key, v text)")
        await admin.execute(f"insert into {table} values (1, 'one'), (2, 'two')")
        await admin.execute(f"grant all on {table} to app")
        row = await conn.fetchrow(f"select * from {table} where id = $1", 1)
        assert tuple(row) == (1, "one")
        await admin.execute(f"alter table {table} add column w int default 5")
        row = await conn.fetchrow(f"select * from {table} where id = $1", 2)
        assert tuple(row) == (2, "two", 5)
        row = await conn.fetchrow(f"select * from {table} where id = $1", 1)
        assert tuple(row) == (1, "one", 5)
    finally:
        await conn.close()
        await admin.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_deallocate_all_costs_the_server_not_anothers_statements(
    scry_proxy, mode: str
) -> None:
    """DEALLOCATE ALL, then an error, in one Query: PostgreSQL dropped the
    statements (DEALLOCATE is not transactional), and whether it ran before
    the error cannot be told. The server is closed when given back, so
    another client's statement is parsed again on the next one."""
    proxy = scry_proxy({"pool": {"mode": mode, "size": 1}, "auth": {"type": "trust"}})
    c, a = Raw(proxy.port), Raw(proxy.port)
    try:
        c.send(parse("select 7", name="mine"), bind(stmt="mine"), execute(), SYNC)
        assert kinds(c.until_ready()) == "12DCZ"
        a.send(q("deallocate all; select 1/0"))
        assert kinds(a.until_ready()) == "CEZ"
        a.send(q("select 1"))
        a.until_ready()
        c.send(bind(stmt="mine"), execute(), SYNC)
        answer = c.until_ready()
        assert kinds(answer) == "2DCZ", [fields(body) for kind, body in answer if kind == "E"]
    finally:
        a.close()
        c.close()
    assert "a failed query held DISCARD or DEALLOCATE" in proxy.log_text()


@pytest.mark.parametrize("pad", [100, 150_000, 600_000])
def test_a_named_parse_longer_than_a_read_is_rewritten(scry_proxy, pad: int) -> None:
    """A Parse arriving in several reads (a long statement) is rewritten like a
    short one: it runs on whichever server the client gets next, and its
    name is never left on a server for another client to collide with."""
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}, "auth": {"type": "trust"}})
    text = "select 42 /* " + "x" * pad + " */"
    a, c = Raw(proxy.port), Raw(proxy.port)
    try:
        a.send(parse(text, name="st"), SYNC)
        assert kinds(a.until_ready()) == "1Z"
        c.send(parse(text, name="st"), SYNC)  # the same name, on the same one server
        answer = c.until_ready()
        assert kinds(answer) == "1Z", [fields(body) for kind, body in answer if kind == "E"]
        a.send(bind(stmt="st"), execute(), SYNC)
        assert [data_row(body) for kind, body in a.until_ready() if kind == "D"] == [["42"]]
        # Read whole (rewriting), a message longer than a client may queue
        # while it has no server still gets one, and the client is read again.
        a.send(q(text))
        assert [data_row(body) for kind, body in a.until_ready() if kind == "D"] == [["42"]]
    finally:
        a.close()
        c.close()


@pytest.mark.parametrize("mode", MODES)
def test_reparse_same_name_after_close(scry_proxy, mode: str) -> None:
    proxy = proxy_for(scry_proxy, mode, 2)
    with (
        psycopg.connect(**proxy.conninfo(), autocommit=True) as conn,
        psycopg.connect(**proxy.conninfo(), autocommit=True) as other,
    ):
        pgconn = conn.pgconn
        ok = psycopg.pq.ExecStatus.COMMAND_OK
        tuples = psycopg.pq.ExecStatus.TUPLES_OK

        def prepare(sql: bytes) -> None:
            res = pgconn.prepare(b"st", sql)
            assert res.status == ok, res.error_message

        def run(param: bytes) -> bytes:
            res = pgconn.exec_prepared(b"st", [param])
            assert res.status == tuples, res.error_message
            return res.get_value(0, 0)

        def close() -> None:
            res = pgconn.close_prepared(b"st")
            assert res.status == ok, res.error_message

        prepare(b"select $1::int + 1")
        assert run(b"1") == b"2"
        # Another client's traffic moves this client between servers.
        assert other.execute("select 1").fetchone() == (1,)
        close()
        prepare(b"select $1::int + 100")  # same name, other text
        assert run(b"1") == b"101"
        other.execute("select 2")
        assert run(b"2") == b"102"
        close()
        prepare(b"select $1::int + 1")  # same name, the first text again
        assert run(b"5") == b"6"
        close()
        # Executing a closed statement fails as it would on PostgreSQL ...
        res = pgconn.exec_prepared(b"st", [b"1"])
        assert res.status == psycopg.pq.ExecStatus.FATAL_ERROR
        assert res.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"26000"
        # ... and leaves the connection usable.
        prepare(b"select $1::text || 'x'")
        assert run(b"a") == b"ax"
        assert conn.execute("select 'still fine'").fetchone() == ("still fine",)


@pytest.mark.parametrize("mode", MODES)
def test_pipeline_error_leaves_client_and_pool_healthy(scry_proxy, mode: str) -> None:
    proxy = proxy_for(scry_proxy, mode, 2)
    conns = [
        psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=0) for _ in range(3)
    ]
    try:
        for round_ in range(12):
            conn = conns[round_ % 3]
            bad = round_ % 4  # where in the pipeline the failing statement sits
            cursors = []
            with pytest.raises(psycopg.errors.DivisionByZero), conn.pipeline() as p:
                for k in range(5):
                    if k == bad:
                        cursors.append(conn.execute("select 1 / %s::int", (0,)))
                    else:
                        cursors.append(conn.execute("select %s::int * 10", (round_ * 10 + k,)))
                p.sync()
            for k, cur in enumerate(cursors[:bad]):
                assert cur.fetchone() == ((round_ * 10 + k) * 10,)
            # Everything after the error in the same Sync was skipped by the server.
            # The connection works, with named statements, right away ...
            assert conn.execute("select %s::int * 10", (round_,)).fetchone() == (round_ * 10,)
            # ... in a pipeline with several Syncs, the failed one in the middle,
            with conn.pipeline() as p:
                first = conn.execute("select %s::text", (f"a{round_}",))
                p.sync()
                try:
                    conn.execute("select 1 / %s::int", (0,))
                    p.sync()
                except psycopg.errors.DivisionByZero:
                    pass
                last = conn.execute("select %s::text", (f"b{round_}",))
            assert first.fetchone() == (f"a{round_}",)
            assert last.fetchone() == (f"b{round_}",)
            # ... and inside a transaction block that the error aborted.
            with (
                pytest.raises(psycopg.errors.DivisionByZero),
                conn.transaction(),
                conn.pipeline(),
            ):
                conn.execute("select %s::int", (1,))
                conn.execute("select 1 / %s::int", (0,))
                conn.execute("select %s::int", (3,))
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            for other in conns:
                assert other.execute("select %s::int + 1", (round_,)).fetchone() == (round_ + 1,)
    finally:
        for conn in conns:
            conn.close()
    log = proxy.log_text()
    assert "server connection lost" not in log, proxy.log_tail()


@pytest.mark.parametrize("fingerprinting", [True, False], ids=["observed", "unobserved"])
def test_discard_all_forgets_statements_in_transaction_mode(scry_proxy, fingerprinting) -> None:
    # DISCARD ALL drops every prepared statement on the backend, scry's own
    # included: scry must prepare again, whatever the letter case, and also
    # when the relay leaves classification to the observatory.
    proxy = scry_proxy(
        {
            "pool": {"mode": "transaction", "size": 1},
            "observability": {"fingerprinting": fingerprinting},
        }
    )
    with psycopg.connect(**proxy.conninfo(), autocommit=True, prepare_threshold=0) as conn:
        for statement in ("Discard All", "DeAllocate aLL"):
            for n in range(3):
                assert conn.execute("select %s::int + 1", (n,)).fetchone() == (n + 1,)
            conn.execute(statement, prepare=False)
            for n in range(3):
                assert conn.execute("select %s::int + 1", (n,)).fetchone() == (n + 1,)


@pytest.mark.parametrize("pad", [100, 1_500_000])
def test_an_unnamed_statement_bound_on_another_server_is_parsed_there_whole(
    scry_proxy, pad: int
) -> None:
    """Parse (unnamed), Sync, and the Bind later (pg8000 does this): meanwhile
    another client used the server, so scry parses the statement again
    first, all of it, however long (longer than the 1 MiB the relay copies
    from a message it only scans)."""
    proxy = scry_proxy({"pool": {"mode": "transaction", "size": 1}, "auth": {"type": "trust"}})
    text = "select 42 /* " + "x" * pad + " */"
    a, c = Raw(proxy.port), Raw(proxy.port)
    try:
        a.send(parse(text), SYNC)
        assert kinds(a.until_ready()) == "1Z"
        c.send(parse("select 7"), bind(), execute(), SYNC)
        assert [data_row(body) for kind, body in c.until_ready() if kind == "D"] == [["7"]]
        a.send(bind(), execute(), SYNC)
        answer = a.until_ready()
        assert kinds(answer) == "2DCZ", [fields(body) for kind, body in answer if kind == "E"]
        assert [data_row(body) for kind, body in answer if kind == "D"] == [["42"]]
    finally:
        a.close()
        c.close()
