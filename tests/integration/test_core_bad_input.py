"""Hostile or broken peers: garbage, absurd lengths, vanishing clients, killed backends.

The proxy of this file uses ``auth: {type: trust}`` so that a raw socket can
log in with a bare StartupMessage. None of these may leave a Python traceback
in the proxy's log (checked by the ``scry_proxy`` fixture at teardown).
"""

from __future__ import annotations

import socket
import struct
import time
import uuid

import psycopg
import pytest
from pgrelay import PgRelay

TRUST = {"auth": {"type": "trust"}, "pool": {"mode": "transaction", "size": 2}}
PROTOCOL_3 = 196608


# --- a tiny raw protocol client ------------------------------------------------------------


def startup_message(user: str = "app", database: str = "app") -> bytes:
    body = struct.pack("!i", PROTOCOL_3)
    body += b"user\0" + user.encode() + b"\0database\0" + database.encode() + b"\0\0"
    return struct.pack("!i", len(body) + 4) + body


def query_message(sql: str) -> bytes:
    body = sql.encode() + b"\0"
    return b"Q" + struct.pack("!i", len(body) + 4) + body


def parse_fields(body: bytes) -> dict[str, str]:
    fields = {}
    for part in body.split(b"\0"):
        if part:
            fields[chr(part[0])] = part[1:].decode(errors="replace")
    return fields


def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the peer closes (fails if it does not close in time)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            pytest.fail(f"scry did not close the connection within {timeout}s; got {data!r}")
        if not chunk:
            return data
        data += chunk
        if time.monotonic() > deadline:
            pytest.fail(f"scry kept the connection open for {timeout}s; got {data!r}")


def split_messages(data: bytes) -> list[tuple[str, bytes]]:
    out = []
    pos = 0
    while pos + 5 <= len(data):
        kind = chr(data[pos])
        (length,) = struct.unpack_from("!i", data, pos + 1)
        assert length >= 4, data
        out.append((kind, data[pos + 5 : pos + 1 + length]))
        pos += 1 + length
    assert pos == len(data), f"trailing partial message: {data[pos:]!r}"
    return out


def assert_fatal_or_closed(data: bytes, sqlstates: tuple[str, ...] = ("08P01",)) -> None:
    """A clean close, or a FATAL ErrorResponse with one of ``sqlstates`` (then close)."""
    if not data:
        return
    messages = split_messages(data)
    errors = [parse_fields(body) for kind, body in messages if kind == "E"]
    assert errors, f"expected an ErrorResponse, got {messages!r}"
    last = errors[-1]
    assert last.get("S") == "FATAL", last
    assert last.get("C") in sqlstates, last


def raw_login(port: int) -> socket.socket:
    """Log in with trust auth; return the socket positioned after ReadyForQuery."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(startup_message())
    buf = b""
    while True:
        chunk = sock.recv(65536)
        assert chunk, f"closed during login: {buf!r}"
        buf += chunk
        messages = []
        try:
            messages = split_messages(buf)
        except AssertionError:
            continue  # partial message: read more
        kinds = [k for k, _ in messages]
        assert "E" not in kinds, messages
        if kinds and kinds[-1] == "Z":
            return sock


def reset_close(sock: socket.socket) -> None:
    """Close abruptly (RST instead of FIN)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def psycopg_works(proxy, sql: str = "select 41 + 1") -> bool:
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        return conn.execute(sql).fetchone() == (42,)


# --- garbage before login ------------------------------------------------------------------


def raw_startup(body: bytes, protocol: int = PROTOCOL_3) -> bytes:
    return struct.pack("!ii", len(body) + 8, protocol) + body


GARBAGE = {
    "http": b"GET / HTTP/1.1\r\nHost: scry\r\n\r\n",
    "length_below_8": struct.pack("!ii", 4, PROTOCOL_3),
    "negative_length": struct.pack("!ii", -5, PROTOCOL_3),
    "no_user": raw_startup(b"\0"),
    "empty_user": raw_startup(b"user\0\0\0"),
    "not_nul_terminated": raw_startup(b"user"),
    "odd_params": raw_startup(b"user\0app\0database\0"),
    "bad_utf8": raw_startup(b"user\0\xff\xfe\xfd\0\0"),
    "bad_param_name": raw_startup(b"user\0app\0bad name;\0x\0\0"),
    "bad_options": raw_startup(b"user\0app\0options\0--\0\0"),
    "random_bytes": bytes(range(256)) * 4,
}


# Startup parameters scry cannot honour may also be refused as "not supported".
NOT_SUPPORTED_OK = {"bad_param_name", "bad_options"}


def test_garbage_startup_packets(scry_proxy) -> None:
    # One proxy for every case (each case is its own connection).
    proxy = scry_proxy(TRUST)
    failures = []
    for name, packet in sorted(GARBAGE.items()):
        allowed = ("08P01", "0A000") if name in NOT_SUPPORTED_OK else ("08P01",)
        try:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
                sock.sendall(packet)
                assert_fatal_or_closed(read_all(sock), allowed)
        except (AssertionError, pytest.fail.Exception) as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)
    assert psycopg_works(proxy)


def test_unsupported_protocol_version(scry_proxy) -> None:
    proxy = scry_proxy(TRUST)
    body = struct.pack("!i", 2 << 16) + b"user\0app\0\0"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(struct.pack("!i", len(body) + 4) + body)
        # PostgreSQL answers 0A000 here; a protocol violation (08P01) is fine too.
        assert_fatal_or_closed(read_all(sock), ("08P01", "0A000"))
    assert psycopg_works(proxy)


def test_two_gigabyte_startup_packet_refused_at_once(scry_proxy) -> None:
    proxy = scry_proxy(TRUST)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(struct.pack("!ii", 0x7FFFFFFF, PROTOCOL_3))
        data = read_all(sock, timeout=3)
        assert time.monotonic() - started < 2
        assert_fatal_or_closed(data)
    assert psycopg_works(proxy)


def test_silent_client_is_dropped_by_login_timeout(scry_proxy) -> None:
    proxy = scry_proxy({**TRUST, "timeouts": {"client_login_timeout": 1}})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"\x00\x00")  # half a length, then nothing
        assert_fatal_or_closed(read_all(sock, timeout=5))
    assert psycopg_works(proxy)


def test_a_client_that_never_speaks_is_let_in_and_dropped_by_login_timeout(scry_proxy) -> None:
    # tcp_defer_accept (on, as in PgBouncer) holds a silent connection in the
    # kernel for a second; then scry accepts it and its login timeout applies.
    proxy = scry_proxy({**TRUST, "timeouts": {"client_login_timeout": 1}})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=8) as sock:
        assert b"client_login_timeout" in read_all(sock, timeout=8)
    assert psycopg_works(proxy)


# --- garbage after login -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        pytest.param(b"Q" + struct.pack("!I", 0x7FFFFFFF), id="query_claims_2GB"),
        pytest.param(b"P" + struct.pack("!I", 0xFFFFFFFF), id="parse_claims_4GB"),
        pytest.param(b"Q" + struct.pack("!I", 2), id="length_below_4"),
    ],
)
def test_absurd_message_length_after_login(scry_proxy, message: bytes) -> None:
    proxy = scry_proxy(TRUST)
    sock = raw_login(proxy.port)
    with sock:
        # Prove the session works, then send the bad header.
        sock.sendall(query_message("select 1"))
        started = time.monotonic()
        sock.sendall(message)
        data = read_all(sock, timeout=5)
        assert time.monotonic() - started < 3
    messages = split_messages(data)
    errors = [parse_fields(b) for k, b in messages if k == "E"]
    assert errors and errors[-1]["C"] == "08P01", messages
    assert errors[-1]["S"] == "FATAL"
    assert psycopg_works(proxy)


@pytest.mark.parametrize("mode", ["transaction", "session"])
def test_bad_header_after_half_a_message_leaves_no_dirty_server(scry_proxy, mode: str) -> None:
    # The first half of a Query reaches PostgreSQL with a whole one before it;
    # the chunk with the rest also holds an absurd header, so scry refuses it.
    # PostgreSQL is then still waiting for the rest of that Query: the server
    # must be closed, not given to the next client, whose bytes would finish
    # the old message (a hang, or "invalid frontend message type").
    proxy = scry_proxy({**TRUST, "pool": {"mode": mode, "size": 1}})
    sock = raw_login(proxy.port)
    with sock:
        split = query_message("select 'split across chunks'")
        sock.sendall(query_message("select 1") + split[:12])
        sock.settimeout(5)
        answer = b""
        while not answer.endswith(b"Z\x00\x00\x00\x05I"):
            answer += sock.recv(65536)  # the whole Query was answered: both were forwarded
        sock.sendall(split[12:] + b"Q" + struct.pack("!I", 0x7FFFFFFF))
        assert_fatal_or_closed(read_all(sock, timeout=5))
    with raw_login(proxy.port) as sock:  # (raw, with a timeout: a misaligned backend is silent)
        sock.sendall(query_message("select 41 + 1"))
        sock.settimeout(5)
        answer = b""
        while not answer.endswith(b"Z\x00\x00\x00\x05I"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        assert [k for k, _ in split_messages(answer)] == ["T", "D", "C", "Z"], answer
        assert b"42" in answer


def test_unknown_message_type_after_login(scry_proxy) -> None:
    proxy = scry_proxy(TRUST)
    sock = raw_login(proxy.port)
    with sock:
        sock.sendall(b"y" + struct.pack("!i", 8) + b"abcd")
        data = read_all(sock, timeout=5)
    errors = [parse_fields(b) for k, b in split_messages(data) if k == "E"]
    assert errors and errors[0]["C"] == "08P01", errors
    assert psycopg_works(proxy)


# --- clients and servers that go away ------------------------------------------------------------


def test_client_disconnects_mid_query(scry_proxy, pg, backend_count, wait_until) -> None:
    pool_size = 1  # the abandoned backend plus a new one would exceed it
    proxy = scry_proxy({**TRUST, "pool": {"mode": "transaction", "size": pool_size}})
    marker = f"marker_{uuid.uuid4().hex[:8]}"
    sock = raw_login(proxy.port)
    sock.sendall(query_message(f"select pg_sleep(5) /* {marker} */"))

    def running() -> list[int]:
        with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as c:
            rows = c.execute(
                "select pid from pg_stat_activity where state = 'active' and query like %s"
                " and pid <> pg_backend_pid()",
                (f"%{marker}%",),
            ).fetchall()
        return [r[0] for r in rows]

    (sleeper,) = wait_until(running, 5, what="the sleeping query to start")
    reset_close(sock)

    # Other clients are served right away, and keep being served.
    started = time.monotonic()
    for _ in range(3):
        assert psycopg_works(proxy)
    assert time.monotonic() - started < 3
    # The pool heals: no more than pool.size backends once the abandoned one is gone.
    wait_until(
        lambda: backend_count(pg, proxy=proxy) <= pool_size,
        10,
        interval=0.1,
        what=f"at most {pool_size} proxy backends",
    )
    assert sleeper not in running()
    assert psycopg_works(proxy)
    assert backend_count(pg, proxy=proxy) <= pool_size


def test_backend_killed_mid_transaction(scry_proxy, pg, backend_count, wait_until) -> None:
    pool_size = 2
    proxy = scry_proxy({**TRUST, "pool": {"mode": "transaction", "size": pool_size}})
    marker = f"marker_{uuid.uuid4().hex[:8]}"
    victim = psycopg.connect(**proxy.conninfo())  # not autocommit: holds a transaction
    bystander = psycopg.connect(**proxy.conninfo(), autocommit=True)
    try:
        assert bystander.execute("select 1").fetchone() == (1,)
        assert victim.execute(f"select '{marker}'").fetchone() == (marker,)
        with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as adm:
            pids = [
                r[0]
                for r in adm.execute(
                    "select pid from pg_stat_activity where query like %s and usename = 'app'"
                    " and pid <> pg_backend_pid()",
                    (f"%{marker}%",),
                ).fetchall()
            ]
            assert len(pids) == 1, pids
            assert adm.execute("select pg_terminate_backend(%s)", (pids[0],)).fetchone() == (True,)
        with pytest.raises(psycopg.OperationalError) as exc:
            victim.execute("select 1")
            victim.execute("select 1")  # libpq may need a round trip to notice
        sqlstate = getattr(exc.value, "sqlstate", None)
        assert sqlstate in (None, "57P01", "08006", "08003", "08000"), sqlstate

        # Everyone else carries on; new clients are served.
        for i in range(5):
            assert bystander.execute("select %s::int", (i,)).fetchone() == (i,)
        assert psycopg_works(proxy)
        wait_until(
            lambda: backend_count(pg, proxy=proxy) <= pool_size,
            5,
            what=f"at most {pool_size} proxy backends",
        )
    finally:
        victim.close()
        bystander.close()


@pytest.mark.parametrize("mode", ["transaction", "session"])
def test_a_backend_killed_in_a_transaction_ends_its_client_with_one_error(
    scry_proxy, pg, mode: str
) -> None:
    """The client gets PostgreSQL's own FATAL (57P01), then the close: what it
    gets without scry. A second error of scry's own (as PgBouncer sends) is
    read by libpq as two results of the client's next query."""
    proxy = scry_proxy({**TRUST, "pool": {"mode": mode, "size": 2}})
    marker = f"marker_{uuid.uuid4().hex[:8]}"
    sock = raw_login(proxy.port)
    sock.sendall(query_message(f"begin; select '{marker}'"))
    answer = b""
    while not answer.endswith(b"Z\0\0\0\x05T"):  # idle in the transaction
        chunk = sock.recv(65536)
        assert chunk, answer
        answer += chunk
    with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as adm:
        (killed,) = adm.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity"
            " where query like %s and usename = 'app' and pid <> pg_backend_pid()",
            (f"%{marker}%",),
        ).fetchone()
        assert killed
    messages = split_messages(read_all(sock))
    assert [kind for kind, _ in messages] == ["E"], messages
    error = parse_fields(messages[0][1])
    assert (error["S"], error["C"]) == ("FATAL", "57P01"), error
    sock.close()
    assert psycopg_works(proxy)


def test_a_fatal_error_and_the_close_reach_the_client_together(scry_proxy, pg) -> None:
    """PostgreSQL closes a session right after its FATAL error. When that
    close is slow to reach scry (staged here: 5 s late), the client still
    gets the error and the close at once, as from PostgreSQL."""
    relay = PgRelay(pg.port, close_delay=5)
    try:
        url = pg.url(host="127.0.0.1", port=relay.port)
        # (Plain TCP to the relay: over TLS, PostgreSQL's close_notify would
        # come with the error and close the session at once anyway.)
        proxy = scry_proxy({**TRUST, "database_url": url, "tls": {"server_tls_sslmode": "disable"}})
        marker = f"marker_{uuid.uuid4().hex[:8]}"
        sock = raw_login(proxy.port)
        sock.sendall(query_message(f"begin; select '{marker}'"))
        answer = b""
        while not answer.endswith(b"Z\0\0\0\x05T"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as adm:
            adm.execute(
                "select pg_terminate_backend(pid) from pg_stat_activity"
                " where query like %s and usename = 'app' and pid <> pg_backend_pid()",
                (f"%{marker}%",),
            )
        messages = split_messages(read_all(sock, timeout=2.5))  # (fails if not closed by then)
        assert [kind for kind, _ in messages] == ["E"], messages
        assert parse_fields(messages[0][1])["C"] == "57P01"
        sock.close()
    finally:
        relay.close()


def test_idle_backends_killed(scry_proxy, pg, backend_count, wait_until) -> None:
    pool_size = 3
    proxy = scry_proxy({**TRUST, "pool": {"mode": "transaction", "size": pool_size}})
    client = psycopg.connect(**proxy.conninfo(), autocommit=True)
    try:
        assert client.execute("select 1").fetchone() == (1,)
        assert backend_count(pg, proxy=proxy) >= 1
        with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as adm:
            adm.execute(
                "select pg_terminate_backend(pid) from pg_stat_activity"
                " where usename = 'app' and datname = 'app' and backend_start >= to_timestamp(%s)",
                (proxy.started_wall,),
            )
        wait_until(lambda: backend_count(pg, proxy=proxy) == 0, 5, what="the idle backends to exit")
        # The client never held a server between queries: it must not notice.
        for i in range(5):
            assert client.execute("select %s::int", (i,)).fetchone() == (i,)
        assert psycopg_works(proxy)
    finally:
        client.close()
    assert "server closed" in proxy.log_text() or "server error while idle" in proxy.log_text()


async def test_disable_pqexec_refuses_simple_queries_only(scry_proxy) -> None:
    """PgBouncer's disable_pqexec: the extended protocol is served; a client
    that sends a simple Query (psql does) is disconnected with 08P01."""
    import asyncpg

    from tests.integration.test_core_auth import run_psql

    proxy = scry_proxy({"disable_pqexec": True, "pool": {"mode": "session"}})
    dsn = proxy.asyncpg_dsn()
    extended, bystander = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        assert await extended.fetchval("select $1::int + 1", 41) == 42  # Parse/Bind/Execute
        with pytest.raises(asyncpg.PostgresError) as caught:
            await extended.execute("select 1")  # asyncpg sends this as a simple Query
        assert "PQexec disallowed" in str(caught.value), (caught.value.sqlstate, caught.value)
        assert extended.is_closed()
        assert await bystander.fetchval("select $1::text", "still here") == "still here"
    finally:
        await extended.close()
        await bystander.close()
    proc = run_psql(proxy.port, "app", "app_pass", "select 1")
    assert proc.returncode != 0 and "PQexec disallowed" in proc.stderr, proc.stderr
    # psycopg's ClientCursor binds on the client and sends simple Queries.
    with psycopg.connect(dsn, cursor_factory=psycopg.ClientCursor, autocommit=True) as conn:
        with pytest.raises(psycopg.OperationalError) as refused:
            conn.execute("select %s", (1,))
        assert refused.value.sqlstate == "08P01", refused.value
    assert proxy.log_text().count("simple query refused (disable_pqexec)") == 3
