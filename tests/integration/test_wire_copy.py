"""COPY through scry, in every pool mode.

COPY FROM STDIN and COPY TO STDOUT, text and binary, over the simple query
protocol (psycopg, asyncpg, psql's \\copy, raw Query) and the extended one
(pg8000, raw Parse/Bind/Execute/Sync); CopyFail; errors before and after
CopyDone; clients that vanish mid-COPY must leave no busy or dirty server
behind.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import asyncpg
import httpx
import pg8000.native
import psycopg
import psycopg.errors
import pytest
from rawpg import (
    COPY_DONE,
    SYNC,
    Raw,
    bind,
    copy_data,
    copy_fail,
    execute,
    fields,
    kinds,
    parse,
    q,
)

from scry.devcluster import free_port

MODES = ["session", "transaction", "hybrid"]
PSQL = "/usr/bin/psql"
TABLE = "wire_copy"
DEFERRED = "wire_copy_deferred"
POOL_SIZE = 2


def text_rows(start: int, n: int, tag: str) -> bytes:
    return b"".join(f"{i}\t{tag}\tnote {i}\n".encode() for i in range(start, start + n))


PGCOPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
PGCOPY_TRAILER = struct.pack("!h", -1)


def binary_row(i: int, tag: str, note: str | None) -> bytes:
    out = struct.pack("!hi", 3, 4) + struct.pack("!i", i)
    out += struct.pack("!i", len(tag.encode())) + tag.encode()
    if note is None:
        return out + struct.pack("!i", -1)
    return out + struct.pack("!i", len(note.encode())) + note.encode()


# --- fixtures and observation -------------------------------------------------------------


def direct(pg, user: str = "postgres") -> psycopg.Connection:
    return psycopg.connect(pg.dsn(user=user, dbname="app", sslmode="disable"), autocommit=True)


@pytest.fixture(scope="module")
def tables(pg) -> Iterator[None]:
    with direct(pg, "app") as conn:
        conn.execute(f"drop table if exists {TABLE}, {DEFERRED}")
        conn.execute(f"create table {TABLE} (id int, tag text, note text)")
        conn.execute(f"create table {DEFERRED} (id int unique deferrable initially deferred)")
    yield
    with direct(pg, "app") as conn:
        conn.execute(f"drop table if exists {TABLE}, {DEFERRED}")


@pytest.fixture(scope="module")
def proxies(scry_proxy_module, tables) -> Callable[[str], object]:
    cache: dict[str, object] = {}

    def get(mode: str):
        if mode not in cache:
            cache[mode] = scry_proxy_module(
                {"pool": {"mode": mode, "size": POOL_SIZE}, "auth": {"type": "trust"}}
            )
        return cache[mode]

    return get


def count(pg, tag: str) -> int:
    with direct(pg) as conn:
        row = conn.execute(f"select count(*) from {TABLE} where tag = %s", (tag,)).fetchone()
    assert row is not None
    return int(row[0])


def proxy_backend_pids(proxy) -> set[int]:
    """PIDs of every backend this proxy ever opened (from its "server connected" log lines)."""
    return {int(p) for p in re.findall(r"server connected .*?backend_pid=(\d+)", proxy.log_text())}


def server_states(pg, proxy) -> list[tuple[int, str, str]]:
    """(pid, state, query) of this proxy's live backends."""
    pids = sorted(proxy_backend_pids(proxy))
    with direct(pg) as conn:
        return [
            (int(r[0]), str(r[1]), str(r[2]))
            for r in conn.execute(
                "select pid, coalesce(state, ''), query from pg_stat_activity where pid = any(%s)",
                (pids,),
            ).fetchall()
        ]


def assert_servers_clean(pg, proxy, wait: float = 8.0) -> None:
    """Within ``wait`` s: at most POOL_SIZE backends of this proxy, all idle."""
    deadline = time.monotonic() + wait
    while True:
        states = server_states(pg, proxy)
        if len(states) <= POOL_SIZE and all(s == "idle" for _, s, _ in states):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"proxy backends not clean after {wait}s: {states}")
        time.sleep(0.05)


def works(proxy) -> None:
    raw = Raw(proxy.port)
    try:
        raw.send(q("select 'works'"))
        got = raw.until_ready()
        assert kinds(got) == "TDCZ", got
        assert got[-1] == ("Z", b"I")
    finally:
        raw.close()


# --- drivers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_psycopg_copy_text_and_binary(proxies, pg, mode: str) -> None:
    proxy = proxies(mode)
    tag_t, tag_b = f"pt-{mode}", f"pb-{mode}"
    n = 5000
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        conn.execute(f"delete from {TABLE} where tag in (%s, %s)", (tag_t, tag_b))
        cur = conn.cursor()
        with cur.copy(f"copy {TABLE} (id, tag, note) from stdin") as copy:
            for start in range(0, n, 1000):
                copy.write(text_rows(start, 1000, tag_t))
        assert cur.rowcount == n
        with cur.copy(f"copy {TABLE} (id, tag, note) from stdin (format binary)") as copy:
            copy.set_types(["int4", "text", "text"])
            for i in range(n):
                copy.write_row((i, tag_b, None if i % 10 == 0 else f"n{i}"))
        assert cur.rowcount == n

        # Text out, through COPY TO STDOUT.
        seen = 0
        total = 0
        with cur.copy(f"copy (select id from {TABLE} where tag = %s) to stdout", (tag_t,)) as copy:
            for row in copy.rows():
                seen += 1
                total += int(row[0])
        assert (seen, total) == (n, sum(range(n)))
        # Binary out, with types.
        with cur.copy(
            f"copy (select id, note from {TABLE} where tag = %s order by id) to stdout"
            " (format binary)",
            (tag_b,),
        ) as copy:
            copy.set_types(["int4", "text"])
            rows = list(copy.rows())
        assert len(rows) == n
        assert rows[0] == (0, None) and rows[7] == (7, "n7")
        # The connection is in a clean state afterwards.
        assert conn.execute("select 1").fetchone() == (1,)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert count(pg, tag_t) == n and count(pg, tag_b) == n
    assert_servers_clean(pg, proxy)


@pytest.mark.parametrize("mode", MODES)
def test_psycopg_copy_error_inside_block(proxies, pg, mode: str) -> None:
    # An exception in the with-block makes psycopg send CopyFail.
    proxy = proxies(mode)
    tag = f"pf-{mode}"
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        cur = conn.cursor()
        with (
            pytest.raises(RuntimeError, match="boom"),
            cur.copy(f"copy {TABLE} (id, tag, note) from stdin") as copy,
        ):
            copy.write(text_rows(0, 100, tag))
            raise RuntimeError("boom")
        # Bad data: the server reports the error (22P02), psycopg raises it.
        with (
            pytest.raises(psycopg.errors.InvalidTextRepresentation),
            cur.copy(f"copy {TABLE} (id, tag, note) from stdin") as copy,
        ):
            copy.write(text_rows(0, 10, tag) + b"oops\tx\ty\n" + text_rows(20, 10, tag))
        assert conn.execute("select 'after'").fetchone() == ("after",)
    assert count(pg, tag) == 0
    assert_servers_clean(pg, proxy)


@pytest.mark.parametrize("mode", MODES)
async def test_asyncpg_copy_records_and_copy_out(proxies, pg, mode: str) -> None:
    proxy = proxies(mode)
    tag = f"apg-{mode}"
    conn = await asyncpg.connect(
        host="127.0.0.1",
        port=proxy.port,
        user="app",
        password="app_pass",
        database="app",
        ssl=False,
    )
    try:
        await conn.execute(f"delete from {TABLE} where tag = $1", tag)
        records = [(i, tag, f"r{i}") for i in range(5000)]
        result = await conn.copy_records_to_table(
            TABLE, records=records, columns=["id", "tag", "note"]
        )
        assert result == "COPY 5000"
        out = io.BytesIO()
        await conn.copy_from_query(
            f"select id, note from {TABLE} where tag = $1 order by id", tag, output=out
        )
        lines = out.getvalue().splitlines()
        assert len(lines) == 5000 and lines[42] == b"42\tr42"
        assert await conn.fetchval("select count(*) from " + TABLE + " where tag = $1", tag) == 5000
    finally:
        await asyncio.wait_for(conn.close(), 10)
    assert_servers_clean(pg, proxy)


@pytest.mark.parametrize("mode", MODES)
def test_pg8000_copy_extended_protocol(proxies, pg, mode: str) -> None:
    # pg8000 runs COPY through Parse/Bind/Execute/Sync.
    proxy = proxies(mode)
    tag = f"p8-{mode}"
    conn = pg8000.native.Connection(
        "app", host="127.0.0.1", port=proxy.port, database="app", password="app_pass", timeout=15
    )
    try:
        conn.run(f"delete from {TABLE} where tag = :t", t=tag)
        conn.run(
            f"copy {TABLE} (id, tag, note) from stdin", stream=io.BytesIO(text_rows(0, 3000, tag))
        )
        assert conn.row_count == 3000
        out = io.BytesIO()
        conn.run(
            f"copy (select id from {TABLE} where tag = '{tag}' order by id) to stdout", stream=out
        )
        assert out.getvalue().splitlines() == [str(i).encode() for i in range(3000)]
        with pytest.raises(pg8000.native.DatabaseError):
            conn.run(
                f"copy {TABLE} (id, tag, note) from stdin",
                stream=io.BytesIO(b"not-a-number\tx\ty\n"),
            )
        assert conn.run("select 'ok'") == [["ok"]]
    finally:
        conn.close()
    assert count(pg, tag) == 3000
    assert_servers_clean(pg, proxy)


@pytest.mark.parametrize("mode", MODES)
def test_psql_backslash_copy(proxies, pg, mode: str, tmp_path) -> None:
    proxy = proxies(mode)
    tag = f"psql-{mode}"
    src = tmp_path / "in.tsv"
    src.write_bytes(text_rows(0, 2000, tag))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGPASSWORD="app_pass", PGSSLMODE="disable", PGCONNECT_TIMEOUT="10")
    script = (
        f"delete from {TABLE} where tag = '{tag}';\n"
        f"\\copy {TABLE} (id, tag, note) from '{src}'\n"
        f"\\copy (select count(*), sum(id) from {TABLE} where tag = '{tag}') to stdout\n"
    )
    proc = subprocess.run(
        [PSQL, "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
         "-p", str(proxy.port), "-U", "app", "-d", "app", "-f", "-"],
        input=script, capture_output=True, text=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"2000\t{sum(range(2000))}"
    assert_servers_clean(pg, proxy)


# --- raw protocol: simple and extended ---------------------------------------------------------


def copy_in_start(raw: Raw, extended: bool, sql: str) -> None:
    if extended:
        raw.send(parse(sql), bind(), execute(), SYNC)  # libpq's way: a Sync right after Execute
        got = raw.until("G")
        assert kinds(got) == "12G", got
    else:
        raw.send(q(sql))
        got = raw.until("G")
        assert kinds(got) == "G", got


def copy_in_end(raw: Raw, extended: bool) -> None:
    raw.send(COPY_DONE, SYNC if extended else b"")


EXT = pytest.mark.parametrize("extended", [False, True], ids=["simple", "extended"])


@EXT
@pytest.mark.parametrize("mode", MODES)
def test_raw_copy_in_and_out(proxies, pg, mode: str, extended: bool) -> None:
    proxy = proxies(mode)
    tag = f"raw-{mode}-{extended}"
    raw = Raw(proxy.port)
    try:
        raw.send(q(f"delete from {TABLE} where tag = '{tag}'"))
        raw.until_ready()
        copy_in_start(raw, extended, f"copy {TABLE} (id, tag, note) from stdin")
        for start in range(0, 5000, 500):
            raw.send(copy_data(text_rows(start, 500, tag)))
        copy_in_end(raw, extended)
        got = raw.until_ready()
        assert kinds(got) == "CZ", got
        assert got[0][1] == b"COPY 5000\0"
        raw.nothing_extra()  # the Sync ignored during COPY earns no ReadyForQuery

        out_sql = f"copy (select id from {TABLE} where tag = '{tag}' order by id) to stdout"
        if extended:
            raw.send(parse(out_sql), bind(), execute(), SYNC)
        else:
            raw.send(q(out_sql))
        got = raw.until_ready()
        head = "12H" if extended else "H"
        assert kinds(got) == head + "d" * 5000 + "cCZ", kinds(got)[:20]
        assert [b for k, b in got if k == "d"][-1] == b"4999\n"
        raw.send(q("select 1"))
        assert kinds(raw.until_ready()) == "TDCZ"
    finally:
        raw.close()
    assert count(pg, tag) == 5000
    assert_servers_clean(pg, proxy)


@EXT
@pytest.mark.parametrize("mode", MODES)
def test_raw_copy_fail(proxies, pg, mode: str, extended: bool) -> None:
    proxy = proxies(mode)
    tag = f"fail-{mode}-{extended}"
    raw = Raw(proxy.port)
    try:
        copy_in_start(raw, extended, f"copy {TABLE} (id, tag, note) from stdin")
        raw.send(copy_data(text_rows(0, 100, tag)))
        raw.send(copy_fail("client changed its mind"), SYNC if extended else b"")
        got = raw.until_ready()
        assert kinds(got) == "EZ", got
        err = fields(got[0][1])
        assert err["C"] == "57014" and "client changed its mind" in err["M"], err
        assert got[-1] == ("Z", b"I")
        raw.nothing_extra()
        raw.send(q("select 'after'"))
        assert kinds(raw.until_ready()) == "TDCZ"
    finally:
        raw.close()
    assert count(pg, tag) == 0
    assert_servers_clean(pg, proxy)


@EXT
@pytest.mark.parametrize("mode", MODES)
def test_raw_copy_error_before_copydone(proxies, pg, mode: str, extended: bool) -> None:
    # The server rejects a row while the client is still sending; the client
    # finishes its stream (more CopyData, CopyDone, Sync) before reading.
    proxy = proxies(mode)
    tag = f"bad-{mode}-{extended}"
    raw = Raw(proxy.port)
    try:
        copy_in_start(raw, extended, f"copy {TABLE} (id, tag, note) from stdin")
        raw.send(copy_data(text_rows(0, 50, tag) + b"zzz\tbad\trow\n"))
        time.sleep(0.1)  # let the error come back while more data is on its way
        for start in range(100, 1100, 100):
            raw.send(copy_data(text_rows(start, 100, tag)))
        copy_in_end(raw, extended)
        got = raw.until_ready()
        assert kinds(got) == "EZ", got
        assert fields(got[0][1])["C"] == "22P02"
        raw.nothing_extra()
        raw.send(q("select 'after'"))
        assert kinds(raw.until_ready()) == "TDCZ"
    finally:
        raw.close()
    assert count(pg, tag) == 0
    assert_servers_clean(pg, proxy)


@EXT
@pytest.mark.parametrize("mode", MODES)
def test_raw_copy_error_at_and_after_copydone(proxies, pg, mode: str, extended: bool) -> None:
    proxy = proxies(mode)
    tag = f"late-{mode}-{extended}"
    raw = Raw(proxy.port)
    try:
        # Binary COPY without its trailer: the error comes only with CopyDone.
        copy_in_start(raw, extended, f"copy {TABLE} (id, tag, note) from stdin (format binary)")
        raw.send(copy_data(PGCOPY_HEADER + binary_row(1, tag, "x") + binary_row(2, tag, None)))
        raw.send(copy_data(struct.pack("!h", 3)))  # a tuple cut short by the end of data
        copy_in_end(raw, extended)
        got = raw.until_ready()
        assert kinds(got) == "EZ", got
        assert fields(got[0][1])["C"] == "22P04", got  # bad COPY file format
        raw.nothing_extra()

        # Deferred unique constraint: COPY itself succeeds, the commit fails.
        copy_in_start(raw, extended, f"copy {DEFERRED} (id) from stdin")
        raw.send(copy_data(b"1\n2\n1\n"))
        copy_in_end(raw, extended)
        got = raw.until_ready()
        assert "E" in kinds(got) and got[-1] == ("Z", b"I"), got
        err = [fields(b) for k, b in got if k == "E"][0]
        assert err["C"] == "23505", err
        raw.nothing_extra()
        raw.send(q(f"select count(*) from {DEFERRED}"))
        got = raw.until_ready()
        assert got[1][1].endswith(b"0"), got
    finally:
        raw.close()
    assert count(pg, tag) == 0
    assert_servers_clean(pg, proxy)


@EXT
@pytest.mark.parametrize("mode", MODES)
def test_client_vanishes_mid_copy_in(proxies, pg, mode: str, extended: bool) -> None:
    proxy = proxies(mode)
    tag = f"gone-{mode}-{extended}"
    for _ in range(POOL_SIZE + 1):  # more times than there are servers: none may stay dirty
        raw = Raw(proxy.port)
        copy_in_start(raw, extended, f"copy {TABLE} (id, tag, note) from stdin")
        raw.send(copy_data(text_rows(0, 1000, tag)))
        time.sleep(0.1)
        raw.vanish()
    assert_servers_clean(pg, proxy)
    works(proxy)
    assert count(pg, tag) == 0


@pytest.mark.parametrize("mode", MODES)
def test_client_vanishes_mid_copy_out(proxies, pg, mode: str) -> None:
    # A COPY TO STDOUT far larger than any socket buffer; the client reads a
    # little and disappears. The backend must not stay busy sending.
    proxy = proxies(mode)
    raw = Raw(proxy.port)
    raw.send(q("copy (select g, repeat('x', 200) from generate_series(1, 3000000) g) to stdout"))
    got = raw.until("d")
    assert kinds(got) == "Hd", got
    for _ in range(100):
        raw.recv()
    raw.vanish()
    assert_servers_clean(pg, proxy, wait=10)
    works(proxy)


@pytest.mark.parametrize("mode", ["transaction", "hybrid"])
def test_server_stays_with_client_during_copy(proxies, pg, mode: str) -> None:
    # Transaction pooling must not hand the server to another client between
    # CopyData messages: the other client waits until the COPY is done.
    proxy = proxies(mode)
    tag = f"hold-{mode}"
    holders = [Raw(proxy.port) for _ in range(POOL_SIZE)]
    try:
        for raw in holders:
            copy_in_start(raw, False, f"copy {TABLE} (id, tag, note) from stdin")
        answers: list[str] = []

        def other() -> None:
            r = Raw(proxy.port)
            r.send(q("select 'other'"))
            answers.append(kinds(r.until_ready()))
            r.close()

        thread = threading.Thread(target=other)
        thread.start()
        for step in range(4):
            for raw in holders:
                raw.send(copy_data(text_rows(step * 10, 10, tag)))
            time.sleep(0.15)
        assert not answers, "a server in COPY was given to another client"
        for raw in holders:
            copy_in_end(raw, False)
            got = raw.until_ready()
            assert kinds(got) == "CZ", got
        thread.join(10)
        assert answers == ["TDCZ"]
    finally:
        for raw in holders:
            raw.close()
    assert count(pg, tag) == 40 * POOL_SIZE
    with direct(pg) as conn:
        conn.execute(f"delete from {TABLE} where tag = %s", (tag,))


def pools_waiting(admin_port: int) -> int:
    """Clients queued for a server, summed over the proxy's pools (-1: API not up)."""
    try:
        body = httpx.get(f"http://127.0.0.1:{admin_port}/api/v1/pools", timeout=2).json()
    except httpx.HTTPError:
        return -1
    return sum(p["waiting"] for p in body["pools"])


def test_sync_inside_failing_copy_never_frees_the_server_early(
    scry_proxy, pg, tables, wait_until
) -> None:
    # A client sends a bad row, a Sync and CopyDone in one go while PostgreSQL
    # is in COPY. PostgreSQL fails the COPY on the row, answers the Query and
    # then answers the Sync too (it is no longer in COPY when it reads it): two
    # ReadyForQuery. A proxy that assumed the Sync was ignored would hand the
    # server to the next client after the first one, and the second would
    # reach that client as a stray answer. Both servers are busy so that a
    # waiting client gets the server the moment it looks free.
    admin_port = free_port()
    proxy = scry_proxy(
        {
            "pool": {"mode": "transaction", "size": 2},
            "auth": {"type": "trust"},
            "admin": {"enabled": True, "listen_addr": f"127.0.0.1:{admin_port}"},
        }
    )
    wait_until(lambda: pools_waiting(admin_port) >= 0, 10, what="admin API")
    copier, holder, waiter = Raw(proxy.port), Raw(proxy.port), Raw(proxy.port)
    try:
        holder.send(q("begin"))
        holder.until_ready()
        copy_in_start(copier, False, f"copy {TABLE} (id, tag, note) from stdin")
        waiter.send(q("select 'waiter'"))
        wait_until(lambda: pools_waiting(admin_port) == 1, 10, what="the waiter queued")
        copier.send(copy_data(b"not-a-number\tx\ty\n"), SYNC, COPY_DONE)
        got = copier.until_ready()
        assert kinds(got) == "EZ", got
        assert fields(got[0][1])["C"] == "22P02"
        assert kinds(copier.until_ready()) == "Z"  # the Sync, read after the COPY failed
        holder.send(q("commit"))
        holder.until_ready()
        got = waiter.until_ready()
        assert kinds(got) == "TDCZ", f"the waiter got a stray message: {got}"
        assert got[1][1].endswith(b"waiter")
        waiter.nothing_extra()
        copier.nothing_extra()
    finally:
        for raw in (copier, holder, waiter):
            raw.close()
