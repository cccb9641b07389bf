"""The extended query protocol through scry, in every pool mode.

Real drivers (psycopg pipeline mode, asyncpg executemany and prepared
statements, pg8000) and a raw protocol client for the parts drivers never
show: many Syncs pipelined before reading, errors in the middle of a
pipeline, Flush without Sync, portal suspension, Describe/Close of named
statements, FunctionCall.

Each pool mode gets one module-scoped proxy (``auth: trust`` so that the raw
client can log in with a bare StartupMessage).
"""

from __future__ import annotations

import asyncio
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator

import asyncpg
import pg8000.native
import psycopg
import psycopg.errors
import pytest
from rawpg import (
    FLUSH,
    SYNC,
    Raw,
    bind,
    close,
    data_row,
    describe,
    execute,
    fields,
    kinds,
    msg,
    parse,
    q,
)

MODES = ["session", "transaction", "hybrid"]


# --- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxies(scry_proxy_module) -> Callable[..., object]:
    """``proxies(mode, size=3)``: one proxy per (mode, size), shared by the module."""
    cache: dict[tuple[str, int], object] = {}

    def get(mode: str, size: int = 3):
        key = (mode, size)
        if key not in cache:
            cache[key] = scry_proxy_module(
                {
                    "pool": {"mode": mode, "size": size},
                    "auth": {"type": "trust"},
                    "timeouts": {"query_wait_timeout": 20},
                }
            )
        return cache[key]

    return get


@pytest.fixture(scope="module")
def table(pg) -> Iterator[str]:
    """A scratch table owned by app, emptied by each test that uses it."""
    name = "wire_ext"
    with psycopg.connect(pg.dsn(user="app", sslmode="disable"), autocommit=True) as conn:
        conn.execute(f"drop table if exists {name}")
        conn.execute(f"create table {name} (id int, mode text, note text)")
    yield name
    with psycopg.connect(pg.dsn(user="app", sslmode="disable"), autocommit=True) as conn:
        conn.execute(f"drop table if exists {name}")


def direct(pg) -> psycopg.Connection:
    return psycopg.connect(
        pg.dsn(user="postgres", dbname="app", sslmode="disable"), autocommit=True
    )


def assert_no_busy_backends(pg, proxy, wait: float = 5.0) -> None:
    """No backend of ``proxy`` (PIDs from its log) is running or idle in a transaction."""
    deadline = time.monotonic() + wait
    pids = [int(p) for p in re.findall(r"server connected .*?backend_pid=(\d+)", proxy.log_text())]
    with direct(pg) as conn:
        while True:
            rows = conn.execute(
                "select pid, state, query from pg_stat_activity where pid = any(%s)"
                " and state <> 'idle'",
                (pids,),
            ).fetchall()
            if not rows:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"backends left busy: {rows}")
            time.sleep(0.05)


# --- psycopg pipeline mode ----------------------------------------------------------------


@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("mode", MODES)
def test_psycopg_pipeline_many_syncs(proxies, pg, table, mode: str, prepared: bool) -> None:
    proxy = proxies(mode)
    with psycopg.connect(
        **proxy.conninfo(), autocommit=True, prepare_threshold=0 if prepared else None
    ) as conn:
        conn.execute(f"delete from {table} where mode = %s", (mode,))
        cursors = []
        with conn.pipeline() as p:
            for i in range(60):
                conn.execute(f"insert into {table} (id, mode) values (%s, %s)", (i, mode))
                cursors.append(conn.execute("select %s::int * 2", (i,)))
                if i % 6 == 5:
                    p.sync()  # many Syncs in flight before anything is read
            count = conn.execute(f"select count(*) from {table} where mode = %s", (mode,))
        assert [c.fetchone() for c in cursors] == [(i * 2,) for i in range(60)]
        assert count.fetchone() == (60,)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert_no_busy_backends(pg, proxy)


@pytest.mark.parametrize("mode", MODES)
def test_psycopg_pipeline_error_in_the_middle(proxies, pg, mode: str) -> None:
    proxy = proxies(mode)
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        with conn.pipeline() as p:
            c1 = conn.execute("select 1")
            # psycopg raises the error at the first call that reads it: the
            # next execute or the sync, depending on timing.
            with pytest.raises(psycopg.errors.DivisionByZero):
                conn.execute("select 1 / %s::int", (0,))
                conn.execute("select 3")  # skipped by PostgreSQL (same Sync segment)
                p.sync()
            try:
                p.sync()  # an extra Sync is harmless
            except psycopg.errors.PipelineAborted:
                pass  # the skipped "select 3" reported now (the error came back early)
            assert c1.fetchone() == (1,)
            c4 = conn.execute("select 4")
            c5 = conn.execute("select %s::text", ("after",))
        assert c4.fetchone() == (4,)
        assert c5.fetchone() == ("after",)
        assert conn.execute("select 'still fine'").fetchone() == ("still fine",)

    # The same inside an explicit transaction: the error aborts it, ROLLBACK recovers.
    with psycopg.connect(**proxy.conninfo(), autocommit=False) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero), conn.pipeline():
            conn.execute("select 1")
            conn.execute("select 1 / 0")
            conn.execute("select 2")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.rollback()
        assert conn.execute("select 5").fetchone() == (5,)
        conn.rollback()
    assert_no_busy_backends(pg, proxy)


# --- raw pipelines -------------------------------------------------------------------------


def pipeline_segments(n: int, tag: int) -> tuple[bytes, list[int | None]]:
    """``n`` Sync-terminated segments; every 7th divides by zero. Returns (bytes, expected)."""
    out, expected = [], []
    for i in range(n):
        value = tag * 1000 + i
        if i % 7 == 3:
            out.append(parse("select 1 / $1::int") + bind(("0",)) + execute() + SYNC)
            expected.append(None)
        elif i % 5 == 4:
            out.append(q(f"select {value}"))  # a simple Query in the same stream
            expected.append(value)
        else:
            out.append(parse("select $1::int") + bind((str(value),)) + execute() + SYNC)
            expected.append(value)
    return b"".join(out), expected


def read_segments(raw: Raw, expected: list[int | None]) -> None:
    for i, want in enumerate(expected):
        got = raw.until_ready()
        errors = [fields(b) for k, b in got if k == "E"]
        rows = [data_row(b) for k, b in got if k == "D"]
        if want is None:
            assert errors and errors[0]["C"] == "22012", (i, got)
            assert not rows
        else:
            assert not errors, (i, errors)
            assert rows == [[str(want)]], (i, got)
        assert got[-1] == ("Z", b"I"), got


@pytest.mark.parametrize("mode", MODES)
def test_raw_many_syncs_pipelined_by_concurrent_clients(proxies, pg, mode: str) -> None:
    # Six clients over three servers (session mode: three clients), each
    # sending 80 segments in one write before reading any answer.
    proxy = proxies(mode)
    n_clients = 3 if mode == "session" else 6
    failures: list[BaseException] = []

    def client(tag: int) -> None:
        try:
            raw = Raw(proxy.port)
            for _round in range(3):
                data, expected = pipeline_segments(80, tag)
                raw.send(data)
                read_segments(raw, expected)
            raw.close()
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(1, n_clients + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert_no_busy_backends(pg, proxy)


@pytest.mark.parametrize("mode", MODES)
def test_raw_error_mid_pipeline_skips_to_sync(proxies, mode: str) -> None:
    # Within one Sync segment everything after the error is skipped; the next
    # segment runs normally, also when it was sent before the error came back.
    raw = Raw(proxies(mode).port)
    try:
        raw.send(
            parse("select 1"), bind(), execute(),
            parse("select 1 / 0"), bind(), execute(),
            parse("select 3"), bind(), execute(),  # skipped
            SYNC,
            parse("select 4"), bind(), execute(), SYNC,
        )  # fmt: skip
        first = raw.until_ready()
        # (the division may fail at Bind, when the constant is folded, or at Execute)
        assert kinds(first) in ("12DC12EZ", "12DC1EZ"), first
        assert data_row(first[2][1]) == ["1"]
        assert fields(first[-2][1])["C"] == "22012"
        second = raw.until_ready()
        assert kinds(second) == "12DCZ", second
        assert data_row(second[2][1]) == ["4"]
    finally:
        raw.close()


@pytest.mark.parametrize("mode", MODES)
def test_raw_flush_without_sync(proxies, mode: str) -> None:
    # Flush makes the server answer without ending the implicit transaction;
    # in transaction/hybrid mode the server must stay with this client until Sync.
    proxy = proxies(mode, size=1)
    a = Raw(proxy.port)
    other: list[object] = []
    thread = None
    try:
        a.send(parse("select pg_backend_pid()"), bind(), execute(), FLUSH)
        got = a.until("C")
        assert kinds(got) == "12DC", got
        pid = int(data_row(got[2][1])[0])
        if mode != "session":

            def b_query() -> None:
                b = Raw(proxy.port)
                b.send(q("select pg_backend_pid()"))
                other.append(b.until_ready())
                b.close()

            thread = threading.Thread(target=b_query)
            thread.start()
            time.sleep(0.5)
            assert not other, "another client got the server between Flush and Sync"
        a.send(parse("select txid_current_if_assigned() is null"), bind(), execute(), SYNC)
        rest = a.until_ready()
        assert kinds(rest) == "12DCZ", rest
        assert rest[-1] == ("Z", b"I")
        if thread is not None:
            thread.join(10)
            assert other and kinds(other[0]) == "TDCZ", other  # type: ignore[arg-type]
            assert int(data_row(other[0][1][1])[0]) == pid  # type: ignore[index]
    finally:
        a.close()


@pytest.mark.parametrize("mode", MODES)
def test_raw_portal_suspended_and_resumed(proxies, mode: str) -> None:
    raw = Raw(proxies(mode).port)
    try:
        # Within one Sync: Execute with a row limit, three times.
        raw.send(
            parse("select g from generate_series(1, 5) g"),
            bind(portal="p1"),
            execute("p1", 2),
            execute("p1", 2),
            execute("p1", 2),
            SYNC,
        )
        got = raw.until_ready()
        assert kinds(got) == "12DDsDDsDCZ", got
        assert [data_row(b)[0] for k, b in got if k == "D"] == ["1", "2", "3", "4", "5"]

        # Across Syncs, inside an explicit transaction (the portal lives until COMMIT).
        raw.send(q("begin"))
        assert raw.until_ready()[-1] == ("Z", b"T")
        raw.send(parse("select g from generate_series(1, 3) g"), bind(portal="p2"))
        raw.send(execute("p2", 2), SYNC)
        got = raw.until_ready()
        assert kinds(got) == "12DDsZ", got
        time.sleep(0.2)  # other clients may run meanwhile; the portal must survive
        raw.send(execute("p2", 2), SYNC)
        got = raw.until_ready()
        assert kinds(got) == "DCZ", got
        assert data_row(got[0][1]) == ["3"]
        raw.send(q("commit"))
        assert raw.until_ready()[-1] == ("Z", b"I")
    finally:
        raw.close()


@pytest.mark.parametrize("mode", MODES)
def test_raw_named_statement_describe_close(proxies, mode: str) -> None:
    raw = Raw(proxies(mode).port)
    try:
        raw.send(
            parse("select $1::int + $2::int as total", name="st_add", types=(23, 23)),
            describe(b"S", "st_add"),
            bind(("2", "3"), stmt="st_add"),
            describe(b"P"),
            execute(),
            SYNC,
        )
        got = raw.until_ready()
        assert kinds(got) == "1tT2TDCZ", got
        assert data_row(got[5][1]) == ["5"]
        # Used again in later Syncs (another server may serve them in transaction mode).
        for i in range(5):
            raw.send(bind((str(i), "10"), stmt="st_add"), execute(), SYNC)
            got = raw.until_ready()
            assert kinds(got) == "2DCZ", got
            assert data_row(got[1][1]) == [str(i + 10)]
        raw.send(close(b"S", "st_add"), SYNC)
        assert kinds(raw.until_ready()) == "3Z"
        raw.send(bind(("1", "1"), stmt="st_add"), execute(), SYNC)
        got = raw.until_ready()
        assert kinds(got) == "EZ", got
        assert fields(got[0][1])["C"] == "26000"  # prepared statement does not exist
        # The name can be reused for another statement.
        raw.send(parse("select 'again'", name="st_add"), bind(stmt="st_add"), execute(), SYNC)
        got = raw.until_ready()
        assert kinds(got) == "12DCZ", got
        assert data_row(got[2][1]) == ["again"]
        # Describe of an unknown statement is an error, not a hang.
        raw.send(describe(b"S", "nope"), SYNC)
        got = raw.until_ready()
        assert kinds(got) == "EZ", got
    finally:
        raw.close()


@pytest.mark.parametrize("mode", MODES)
def test_raw_function_call(proxies, mode: str) -> None:
    raw = Raw(proxies(mode).port)
    try:
        raw.send(q("select 'int4pl'::regproc::oid"))
        got = raw.until_ready()
        oid = int(data_row(got[1][1])[0])
        args = b"".join(struct.pack("!i", len(v)) + v for v in (b"2", b"40"))
        body = struct.pack("!ihhh", oid, 1, 0, 2) + args + struct.pack("!h", 0)
        raw.send(msg(b"F", body))
        got = raw.until_ready()
        assert kinds(got) == "VZ", got
        (length,) = struct.unpack_from("!i", got[0][1])
        assert got[0][1][4 : 4 + length] == b"42"
    finally:
        raw.close()


# --- drivers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_asyncpg_executemany_and_prepared_statements(proxies, table, mode: str) -> None:
    proxy = proxies(mode)
    conn = await asyncpg.connect(
        host="127.0.0.1",
        port=proxy.port,
        user="app",
        password="app_pass",
        database="app",
        ssl=False,
    )
    try:
        await conn.execute(f"delete from {table} where mode = $1", f"apg-{mode}")
        rows = [(i, f"apg-{mode}", f"note {i}") for i in range(300)]
        await conn.executemany(f"insert into {table} (id, mode, note) values ($1, $2, $3)", rows)
        total = await conn.fetchval(f"select sum(id) from {table} where mode = $1", f"apg-{mode}")
        assert total == sum(range(300))
        stmt = await conn.prepare("select $1::int * 3 as x, $2::text as t")
        for i in range(30):
            assert tuple(await stmt.fetchrow(i, str(i))) == (i * 3, str(i))
        async with conn.transaction():
            await conn.executemany(
                f"insert into {table} (id, mode) values ($1, $2)",
                [(i, f"apg-{mode}") for i in range(10)],
            )
            assert await stmt.fetchval(7, "x") == 21
        # An error in executemany rolls the whole batch back and leaves the connection usable.
        with pytest.raises(asyncpg.exceptions.DivisionByZeroError):
            await conn.executemany(
                f"insert into {table} (id, mode) values (10 / $1::int, $2)",
                [(1, f"apg-{mode}-bad"), (0, f"apg-{mode}-bad"), (2, f"apg-{mode}-bad")],
            )
        assert (
            await conn.fetchval(f"select count(*) from {table} where mode = $1", f"apg-{mode}-bad")
            == 0
        )
        assert await stmt.fetchval(1, "y") == 3
    finally:
        await asyncio.wait_for(conn.close(), 10)


@pytest.mark.parametrize("mode", MODES)
def test_pg8000_parameters(proxies, mode: str) -> None:
    proxy = proxies(mode)
    conn = pg8000.native.Connection(
        "app", host="127.0.0.1", port=proxy.port, database="app", password="app_pass", timeout=15
    )
    try:
        for i in range(20):
            assert conn.run("select :a::int + :b::int", a=i, b=1) == [[i + 1]]
        ps = conn.prepare("select :v::text || '!'")
        assert ps.run(v="hi") == [["hi!"]]
        assert ps.run(v="again") == [["again!"]]
        ps.close()
        with pytest.raises(pg8000.native.DatabaseError):
            conn.run("select 1 / :z::int", z=0)
        assert conn.run("select 'ok'") == [["ok"]]
    finally:
        conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_unnamed_statement_across_syncs_never_runs_another_clients(proxies, mode: str) -> None:
    # pg8000's pattern: Parse(unnamed) + Sync, later Bind + Execute + Sync.
    # Between those Syncs transaction pooling may move the server to another
    # client that replaces the unnamed statement. Client a may then get an
    # error (as behind PgBouncer), but never the result of b's statement.
    proxy = proxies(mode, size=1 if mode != "session" else 2)
    a, b = Raw(proxy.port), Raw(proxy.port)
    try:
        a.send(parse("select 'a:' || $1::text"), SYNC)
        assert kinds(a.until_ready()) == "1Z"
        b.send(parse("select 'b:' || $1::text"), SYNC)
        assert kinds(b.until_ready()) == "1Z"
        a.send(bind(("x",)), execute(), SYNC)
        got = a.until_ready()
        rows = [data_row(body) for k, body in got if k == "D"]
        assert rows in ([["a:x"]], []), f"client a ran client b's statement: {got}"
        b.send(bind(("y",)), execute(), SYNC)
        got = b.until_ready()
        rows = [data_row(body) for k, body in got if k == "D"]
        assert rows in ([["b:y"]], []), f"client b ran client a's statement: {got}"
    finally:
        a.close()
        b.close()


# --- a client that leaves in the middle of an extended-protocol batch ---------------------


UNSYNCED = {
    # Execute failed; PostgreSQL now ignores everything until a Sync.
    "error": parse("select 1 / (random() * 0)::int") + bind() + execute() + FLUSH,
    # Execute succeeded and was flushed; the implicit transaction is still open.
    "flushed": parse("select 'secret of the last client'") + bind() + execute() + FLUSH,
    # Execute succeeded; its answers still sit in the backend's output buffer.
    "buffered": parse("select 'secret of the last client'") + bind() + execute(),
}


@pytest.fixture(scope="module")
def leave_proxies(scry_proxy_module, pg) -> Callable[[str], object]:
    """One proxy per mode with a pool of one server per batch kind (database)."""
    cache: dict[str, object] = {}

    def get(mode: str):
        if mode not in cache:
            databases = {
                f"leave_{batch}": {"database_url": pg.url(), "pool": {"size": 1}}
                for batch in UNSYNCED
            }
            cache[mode] = scry_proxy_module(
                {"pool": {"mode": mode}, "auth": {"type": "trust"}, "databases": databases}
            )
        return cache[mode]

    return get


@pytest.mark.parametrize("batch", list(UNSYNCED))
@pytest.mark.parametrize("mode", MODES)
def test_client_leaves_without_sync(leave_proxies, pg, mode: str, batch: str) -> None:
    # The client sends Parse/Bind/Execute without a Sync and terminates. The
    # server it used must not reach the next client in that state: not one
    # that ignores every message until a Sync, not one that still holds (or
    # later flushes) the previous client's results.
    proxy = leave_proxies(mode)
    database = f"leave_{batch}"
    raw = Raw(proxy.port, database=database)
    raw.send(UNSYNCED[batch])
    if batch != "buffered":
        raw.until("E" if batch == "error" else "C")
    else:
        time.sleep(0.1)
    raw.close()
    nxt = Raw(proxy.port, database=database)
    try:
        nxt.sock.settimeout(2)
        nxt.send(q("select 'next client'"))
        try:
            got = nxt.until_ready()
        except TimeoutError:
            pytest.fail("the next client got a server that ignores its query (no answer in 2 s)")
        assert kinds(got) == "TDCZ", got
        assert data_row(got[1][1]) == ["next client"]
        assert got[-1] == ("Z", b"I")
    finally:
        nxt.close()


@pytest.mark.parametrize("mode", MODES)
def test_malformed_bind_after_named_statement(scry_proxy, mode: str) -> None:
    # After a named Parse, transaction/hybrid pooling reads every message whole
    # (to rewrite statement names). A Bind without its NUL terminators must be
    # refused like PostgreSQL does (08P01), never crash the relay.
    proxy = scry_proxy({"pool": {"mode": mode, "size": 1}, "auth": {"type": "trust"}})
    for body in (b"no-terminator", b"portal\0stmt-without-nul"):
        raw = Raw(proxy.port)
        try:
            raw.send(parse("select 1", name="mb_s1"), bind(stmt="mb_s1"), execute(), SYNC)
            assert kinds(raw.until_ready()) == "12DCZ"
            raw.send(msg(b"B", body), execute(), SYNC)
            raw.sock.settimeout(5)
            got: list[tuple[str, bytes]] = []
            try:
                got = raw.until_ready()
            except EOFError:
                pass  # closed after a FATAL: acceptable
            errors = [fields(b) for k, b in got if k == "E"]
            if got:
                assert errors and errors[0]["C"] == "08P01", got
        finally:
            raw.sock.close()
    log = proxy.log_text()
    assert "Traceback" not in log, proxy.log_tail(40)
