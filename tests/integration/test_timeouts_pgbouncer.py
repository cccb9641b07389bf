"""PgBouncer's timeouts, one test each: it fires, and this is what the client sees.

The proxy's janitor checks timeouts about once a second, so a 1 s timeout
fires between 1 and about 2.5 s; every wait below polls with a bound.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
import pytest
from pgrelay import PgRelay

PROTOCOL_3 = 196608


def direct(pg, user: str = "postgres") -> psycopg.Connection:
    return psycopg.connect(pg.dsn(user=user, dbname="app", sslmode="disable"), autocommit=True)


def connect(proxy, **kw: Any) -> psycopg.Connection:
    kw.setdefault("autocommit", True)
    return psycopg.connect(**proxy.conninfo(), **kw)


def proxy_pids(proxy) -> set[int]:
    return {int(p) for p in re.findall(r"server connected .*?backend_pid=(\d+)", proxy.log_text())}


def live_backends(pg, proxy) -> list[tuple[int, str, str]]:
    with direct(pg) as conn:
        rows = conn.execute(
            "select pid, coalesce(state, ''), query from pg_stat_activity where pid = any(%s)",
            (sorted(proxy_pids(proxy)),),
        ).fetchall()
    return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]


def running(pg, marker: str) -> bool:
    with direct(pg) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity where state = 'active' and query like %s"
            " and pid <> pg_backend_pid()",
            (f"%{marker}%",),
        ).fetchone()
    return bool(row and row[0])


def startup(user: str = "app", database: str = "app") -> bytes:
    body = struct.pack("!i", PROTOCOL_3) + b"user\0" + user.encode() + b"\0database\0"
    body += database.encode() + b"\0\0"
    return struct.pack("!i", len(body) + 4) + body


def read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything until the peer closes; returns (data, seconds it took)."""
    started = time.monotonic()
    sock.settimeout(limit)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            pytest.fail(f"not closed within {limit}s; got {data!r}")
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - started


def error_fields(data: bytes) -> list[dict[str, str]]:
    out, pos = [], 0
    while pos + 5 <= len(data):
        (length,) = struct.unpack_from("!i", data, pos + 1)
        if data[pos : pos + 1] == b"E":
            body = data[pos + 5 : pos + 1 + length]
            out.append({chr(p[0]): p[1:].decode() for p in body.split(b"\0") if p})
        pos += 1 + length
    return out


def wait_for(predicate, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


# --- client-side timeouts -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "sqlstate"), [("query_timeout", "57014"), ("transaction_timeout", "25P04")]
)
def test_a_statement_past_the_limit_is_cancelled(scry_proxy, pg, setting, sqlstate) -> None:
    # Both end a long statement: the client is closed, the statement cancelled.
    marker = f"{setting}_marker"
    proxy = scry_proxy({"pool": {"mode": "transaction"}, "timeouts": {setting: 1}})
    with connect(proxy) as conn:
        started = time.monotonic()
        with pytest.raises(psycopg.Error) as exc_info:
            conn.execute(f"select pg_sleep(20) /* {marker} */")
        elapsed = time.monotonic() - started
        assert 0.95 < elapsed < 3.5, f"{setting}=1 fired after {elapsed:.2f}s"
        assert exc_info.value.sqlstate == sqlstate
        assert setting in str(exc_info.value)
        assert conn.closed or conn.broken
    # The query was cancelled on PostgreSQL, not left running.
    wait_for(lambda: not running(pg, marker), 3, "the timed-out query to stop")
    with connect(proxy) as conn:
        assert conn.execute("select 'next client fine'").fetchone() == ("next client fine",)


def test_query_timeout_spares_queries_under_the_limit(scry_proxy) -> None:
    # PgBouncer's query_timeout never fires before the limit: half-second
    # queries run back to back for three seconds under query_timeout=1.
    proxy = scry_proxy({"timeouts": {"query_timeout": 1}})
    with connect(proxy) as conn:
        for i in range(6):
            started = time.monotonic()
            try:
                conn.execute("select pg_sleep(0.5)")
            except psycopg.OperationalError as exc:
                pytest.fail(
                    f"query {i} killed by query_timeout=1 after "
                    f"{time.monotonic() - started:.2f}s: {exc}"
                )


def test_query_wait_notify_tells_a_queued_client_once(scry_proxy) -> None:
    # PgBouncer 1.25's query_wait_notify: a client queued longer gets a NOTICE
    # (once per wait), then its query runs as usual.
    proxy = scry_proxy(
        {"pool": {"size": 1}, "timeouts": {"query_wait_notify": 1, "query_wait_timeout": 30}}
    )
    with connect(proxy, autocommit=False) as holder, connect(proxy) as waiting:
        holder.execute("select 1")  # holds the only server in its transaction
        notices: list[tuple[str | None, str | None, str | None]] = []
        # (A Diagnostic is only readable inside the handler.)
        waiting.add_notice_handler(
            lambda d: notices.append((d.severity, d.message_primary, d.message_detail))
        )
        answers: list[Any] = []
        query = threading.Thread(
            target=lambda: answers.append(waiting.execute("select 42").fetchone())
        )
        started = time.monotonic()
        query.start()
        wait_for(lambda: notices, 5, "the NOTICE")
        noticed_after = time.monotonic() - started
        # Two more janitor passes while it still waits: no second notice.
        time.sleep(2.5)
        holder.commit()
        query.join(10)
        assert answers == [(42,)]
        assert 0.9 < noticed_after < 3.5, noticed_after
        assert len(notices) == 1, notices
        severity, primary, detail = notices[0]
        assert severity == "NOTICE"
        assert primary is not None and primary.startswith("waiting for a server connection")
        assert detail is not None and "pool app/app" in detail, detail


def test_query_wait_notify_zero_sends_nothing(scry_proxy) -> None:
    proxy = scry_proxy(
        {"pool": {"size": 1}, "timeouts": {"query_wait_notify": 0, "query_wait_timeout": 30}}
    )
    with connect(proxy, autocommit=False) as holder, connect(proxy) as waiting:
        holder.execute("select 1")
        notices: list[str | None] = []
        waiting.add_notice_handler(lambda d: notices.append(d.message_primary))
        query = threading.Thread(target=lambda: waiting.execute("select 1"))
        query.start()
        time.sleep(2.5)  # two janitor passes with the client queued
        holder.commit()
        query.join(10)
        assert not query.is_alive() and notices == []


def test_idle_transaction_timeout(scry_proxy, pg) -> None:
    with direct(pg, "app") as d:
        d.execute("create table if not exists wire_itt (v text)")
        d.execute("truncate wire_itt")
    proxy = scry_proxy(
        {"pool": {"mode": "transaction"}, "timeouts": {"idle_transaction_timeout": 1}}
    )
    with connect(proxy) as idle_ok:
        with connect(proxy, autocommit=False) as conn:
            conn.execute("insert into wire_itt values ('uncommitted')")
            started = time.monotonic()
            # The FATAL arrives while the client is idle; libpq notices on its next use.
            wait_for(lambda: _peer_closed(conn), 4, "the disconnect")
            elapsed = time.monotonic() - started
            assert elapsed > 0.95, f"idle_transaction_timeout=1 fired after {elapsed:.2f}s"
            with pytest.raises(psycopg.Error) as exc_info:
                conn.execute("select 1")
            assert exc_info.value.sqlstate == "25P03", exc_info.value
            assert "idle transaction timeout" in str(exc_info.value)
        # An idle client outside a transaction is not touched by this timeout.
        assert idle_ok.execute("select 'still here'").fetchone() == ("still here",)
    with direct(pg) as d:
        assert d.execute("select count(*) from wire_itt").fetchone() == (0,)
    wait_for(
        lambda: all(state == "idle" for _, state, _ in live_backends(pg, proxy)),
        3,
        "no backend idle in transaction",
    )


def test_idle_transaction_timeout_spares_short_pauses(scry_proxy) -> None:
    proxy = scry_proxy({"timeouts": {"idle_transaction_timeout": 1}})
    with connect(proxy, autocommit=False) as conn:
        for i in range(6):
            time.sleep(0.5)  # idle in transaction, well under the limit
            try:
                conn.execute("select 1")
            except psycopg.Error as exc:
                pytest.fail(f"statement {i} after a 0.5 s pause: {exc}")
        conn.commit()


def test_transaction_timeout_ends_a_long_transaction_of_short_statements(scry_proxy, pg) -> None:
    # PgBouncer 1.25's transaction_timeout: the whole transaction is timed, so
    # statements 0.3 s apart (under any idle or query limit) still end at the limit.
    with direct(pg, "app") as d:
        d.execute("create table if not exists wire_tt (v text)")
        d.execute("truncate wire_tt")
    proxy = scry_proxy({"timeouts": {"transaction_timeout": 1.5}})
    with connect(proxy, autocommit=False) as conn:
        conn.execute("insert into wire_tt values ('uncommitted')")
        started = time.monotonic()
        with pytest.raises(psycopg.Error) as exc_info:
            while time.monotonic() - started < 10:
                time.sleep(0.3)
                conn.execute("select 1")
        elapsed = time.monotonic() - started
        assert 1.2 < elapsed < 4, f"transaction_timeout=1.5 fired after {elapsed:.2f}s"
        assert exc_info.value.sqlstate == "25P04", exc_info.value
        assert "transaction_timeout" in str(exc_info.value)
    with direct(pg) as d:
        assert d.execute("select count(*) from wire_tt").fetchone() == (0,)
    wait_for(
        lambda: all(state == "idle" for _, state, _ in live_backends(pg, proxy)),
        3,
        "no backend left in the transaction",
    )
    with connect(proxy) as conn:
        assert conn.execute("select 'next client fine'").fetchone() == ("next client fine",)


def test_transaction_timeout_spares_short_transactions(scry_proxy) -> None:
    # Transactions of 0.4 s each, back to back for 3 s, under transaction_timeout=1.
    proxy = scry_proxy({"timeouts": {"transaction_timeout": 1}})
    with connect(proxy, autocommit=False) as conn:
        started = time.monotonic()
        while time.monotonic() - started < 3:
            try:
                conn.execute("select pg_sleep(0.2)")
                conn.execute("select pg_sleep(0.2)")
                conn.commit()
            except psycopg.Error as exc:
                pytest.fail(f"a 0.4 s transaction ended by transaction_timeout=1: {exc}")


def _peer_closed(conn: psycopg.Connection) -> bool:
    """The proxy closed this connection (readable with EOF or an error pending)."""
    sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    try:
        sock.setblocking(False)
        try:
            data = sock.recv(65536, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return data == b"" or data[:1] == b"E"
    finally:
        sock.close()


def test_client_idle_timeout(scry_proxy) -> None:
    proxy = scry_proxy({"timeouts": {"client_idle_timeout": 1}})
    busy = connect(proxy)
    idle = connect(proxy)
    try:
        idle.execute("select 1")
        started = time.monotonic()
        while time.monotonic() - started < 2.6:  # busy keeps working past the limit
            try:
                busy.execute("select 1")
            except psycopg.Error as exc:
                pytest.fail(
                    f"a client active every 0.2 s was closed by client_idle_timeout=1: {exc}"
                )
            time.sleep(0.2)
        wait_for(lambda: _peer_closed(idle), 3, "the idle client to be closed")
        with pytest.raises(psycopg.Error) as exc_info:
            idle.execute("select 1")
        assert "client_idle_timeout" in str(exc_info.value), exc_info.value
        assert busy.execute("select 'busy fine'").fetchone() == ("busy fine",)
    finally:
        busy.close()
        idle.close()


def test_client_login_timeout_mid_authentication(scry_proxy) -> None:
    # The client starts SCRAM and never answers.
    proxy = scry_proxy({"timeouts": {"client_login_timeout": 1}})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(startup())
        data, elapsed = read_until_closed(sock, 5)
    assert data[:1] == b"R"  # it got the authentication request, then nothing more happened
    errors = error_fields(data)
    assert errors and errors[-1]["C"] == "08P01" and "client_login_timeout" in errors[-1]["M"]
    assert elapsed < 3.5


@pytest.fixture
def tls_files(pg, tmp_path) -> dict[str, str]:
    cert, key = tmp_path / "scry.crt", tmp_path / "scry.key"
    shutil.copyfile(pg.server_cert, cert)
    shutil.copyfile(pg.server_key, key)
    os.chmod(key, 0o600)
    return {"client_tls_cert_file": str(cert), "client_tls_key_file": str(key)}


def test_client_login_timeout_mid_tls_handshake(scry_proxy, tls_files) -> None:
    # SSLRequest, 'S', then silence: the handshake must not hold the slot for long.
    proxy = scry_proxy(
        {
            "timeouts": {"client_login_timeout": 1},
            "tls": {"client_tls_sslmode": "require", **tls_files},
        }
    )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(struct.pack("!ii", 8, 80877103))
        assert sock.recv(1) == b"S"
        _, elapsed = read_until_closed(sock, 6)
    assert elapsed < 3.5, elapsed


# --- server-side timeouts -----------------------------------------------------------------


def backend_pid(conn: psycopg.Connection) -> int:
    row = conn.execute("select pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_server_lifetime(scry_proxy, pg) -> None:
    # Two databases, one per pool mode. Transaction mode: the expired server is
    # replaced between transactions. Session mode: a connected client keeps
    # its server; it is closed (not reused) once the client leaves.
    url = pg.url()
    proxy = scry_proxy(
        {
            "databases": {
                "lt_tx": {"database_url": url, "pool": {"mode": "transaction"}},
                "lt_session": {"database_url": url, "pool": {"mode": "session"}},
            },
            "timeouts": {"server_lifetime": 1},
        }
    )
    tx = psycopg.connect(**{**proxy.conninfo(), "dbname": "lt_tx"}, autocommit=True)
    session = psycopg.connect(**{**proxy.conninfo(), "dbname": "lt_session"}, autocommit=True)
    try:
        first_tx, first_session = backend_pid(tx), backend_pid(session)
        started = time.monotonic()
        time.sleep(1.2)
        wait_for(lambda: backend_pid(tx) != first_tx, 4, "a new server after the lifetime")
        time.sleep(max(0.0, 2.5 - (time.monotonic() - started)))
        assert backend_pid(session) == first_session  # never taken from a session client
    finally:
        tx.close()
        session.close()
    wait_for(
        lambda: not {first_tx, first_session} & {pid for pid, _, _ in live_backends(pg, proxy)},
        4,
        "the expired backends to be closed",
    )
    with psycopg.connect(**{**proxy.conninfo(), "dbname": "lt_session"}) as conn:
        assert backend_pid(conn) != first_session


def test_server_idle_timeout(scry_proxy, pg) -> None:
    proxy = scry_proxy({"timeouts": {"server_idle_timeout": 1}})
    with connect(proxy) as conn:
        conn.execute("select 1")
    assert live_backends(pg, proxy)
    wait_for(lambda: not live_backends(pg, proxy), 4, "idle servers to be closed")
    with connect(proxy) as conn:  # and new ones open on demand
        assert conn.execute("select 'reopened'").fetchone() == ("reopened",)


def test_pool_idle_timeout_frees_a_pool_nobody_uses(scry_proxy, pg) -> None:
    """A pool with no client and no server for pool_idle_timeout is freed
    (PgBouncer 1.25's); one whose client stays connected is kept."""
    proxy = scry_proxy({"timeouts": {"server_idle_timeout": 1, "pool_idle_timeout": 1}})
    with connect(proxy) as conn:
        conn.execute("select 1")
        wait_for(lambda: not live_backends(pg, proxy), 4, "idle servers to be closed")
        # Not a wait for an event: what is tested is that time passing does
        # not free a pool whose client is still connected.
        time.sleep(2.5)
        assert "pool freed" not in proxy.log_text()
        assert conn.execute("select 'still served'").fetchone() == ("still served",)
    wait_for(lambda: not live_backends(pg, proxy), 4, "idle servers to be closed")
    wait_for(lambda: "pool freed" in proxy.log_text(), 5, "the pool to be freed")
    (line,) = [x for x in proxy.log_text().splitlines() if "pool freed" in x]
    assert "app/app" in line, line
    with connect(proxy) as conn:  # a new pool, made on demand
        assert conn.execute("select 'again'").fetchone() == ("again",)


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(srv.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join(2)
    for s in accepted:
        s.close()
    srv.close()


def test_server_connect_timeout(scry_proxy, pg, blackhole: int) -> None:
    proxy = scry_proxy(
        {
            "database_url": pg.url(host="127.0.0.1", port=blackhole),
            "timeouts": {"server_connect_timeout": 1},
            "circuit_breaker": {"enabled": False},
        }
    )
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError, match="server_connect_timeout"):
        connect(proxy)
    assert time.monotonic() - started < 4


@pytest.fixture
def cancel_hole(pg) -> Iterator[PgRelay]:
    relay = PgRelay(pg.port, hold_cancels=True)
    yield relay
    relay.close()


def test_cancel_wait_timeout_bounds_a_cancel_nobody_answers(
    scry_proxy, pg, cancel_hole: PgRelay, wait_until
) -> None:
    proxy = scry_proxy(
        {
            "database_url": pg.url(host="127.0.0.1", port=cancel_hole.port),
            "pool": {"mode": "transaction", "size": 1},
            "timeouts": {"cancel_wait_timeout": 0.5},
        }
    )
    with connect(proxy) as conn, connect(proxy) as other:
        outcome: list[object] = []
        query = threading.Thread(
            target=lambda: outcome.append(conn.execute("select pg_sleep(2.5), 'slept'").fetchone())
        )
        query.start()
        wait_until(lambda: running(pg, "'slept'"), 5)
        # Through scry, which forwards it to the hole. (cancel_safe: libpq's
        # PQcancel keeps the GIL while it waits, and the hole is a thread.)
        conn.cancel_safe()
        assert cancel_hole.held.wait(5)
        assert cancel_hole.given_up.wait(5), "scry never gave up on the cancel"
        assert 0.4 < cancel_hole.held_for < 2.0, cancel_hole.held_for
        query.join(10)
        # The cancel never reached PostgreSQL: the query ran to its end, and
        # its server went back to the pool for the next client.
        assert outcome == [("", "slept")]
        assert other.execute("select 'next'").fetchone() == ("next",)
    assert "cancel request to the server timed out" in proxy.log_text()


def test_a_cancel_is_answered_once_postgresql_has_it(
    scry_proxy, pg, cancel_hole: PgRelay, wait_until
) -> None:
    """PostgreSQL closes a cancel connection once it has acted on the request,
    and libpq waits for that close so that a cancel still on its way cannot
    hit the next query. scry keeps the client's cancel connection open until
    its own, forwarded one is closed."""
    proxy = scry_proxy(
        {
            "database_url": pg.url(host="127.0.0.1", port=cancel_hole.port),
            "pool": {"mode": "transaction", "size": 1},
        }
    )
    with connect(proxy) as conn:
        outcome: list[object] = []

        def sleep() -> None:
            try:
                outcome.append(conn.execute("select pg_sleep(30), 'slept'").fetchone())
            except psycopg.Error as exc:
                outcome.append(exc)

        query = threading.Thread(target=sleep)
        query.start()
        wait_until(lambda: running(pg, "'slept'"), 5)
        cancelling = threading.Thread(target=conn.cancel_safe)
        cancelling.start()
        assert cancel_hole.held.wait(5)
        cancelling.join(0.5)  # (what must not happen has no event to await)
        assert cancelling.is_alive(), "the client's cancel was answered before PostgreSQL had it"
        cancel_hole.release.set()
        cancelling.join(5)
        assert not cancelling.is_alive()
        query.join(5)
        assert len(outcome) == 1 and isinstance(outcome[0], psycopg.errors.QueryCanceled), outcome


def test_server_check_query_after_delay(scry_proxy, pg) -> None:
    # The check query uses a sequence that exists in database app only: on
    # the "chk_fail" database (really postgres) the same check fails.
    with direct(pg, "app") as d:
        d.execute("drop sequence if exists wire_check_seq")
        d.execute("create sequence wire_check_seq")

    def checks() -> int:
        with direct(pg) as d:
            row = d.execute("select last_value, is_called from wire_check_seq").fetchone()
        assert row is not None
        return int(row[0]) if row[1] else 0

    proxy = scry_proxy(
        {
            "pool": {"mode": "transaction", "size": 1},
            "databases": {
                "chk_ok": {"database_url": pg.url(dbname="app")},
                "chk_fail": {"database_url": pg.url(dbname="postgres")},
            },
            "timeouts": {
                "server_check_delay": 1,
                "server_check_query": "select nextval('wire_check_seq')",
            },
        }
    )

    def pid_of(database: str) -> int:
        with psycopg.connect(**{**proxy.conninfo(), "dbname": database}) as conn:
            return backend_pid(conn)

    first_ok, first_fail = pid_of("chk_ok"), pid_of("chk_fail")
    assert checks() == 0  # a fresh server is not checked
    time.sleep(2.2)
    assert pid_of("chk_ok") == first_ok  # checked, passed, reused
    assert checks() == 1
    assert pid_of("chk_ok") == first_ok  # used a moment ago: not checked again
    assert checks() == 1
    # The failed check replaces the server; the client never sees the failure.
    assert pid_of("chk_fail") != first_fail
    assert "server_check_query failed" in proxy.log_text()


@pytest.mark.parametrize("retry", [None, 0.2], ids=["default", "server_login_retry=0.2"])
def test_server_login_retry_bounds_the_wait_between_failed_logins(scry_proxy, pg, retry) -> None:
    """A queued client's server cannot log in (the role's CONNECTION LIMIT is
    taken by the pool's other server): logins are retried 0.2 s, 0.4 s, ...
    apart, never more than server_login_retry."""
    from tests.integration.test_auth_query import new_role

    role = new_role(pg, "retry_pass")
    pg.psql(f"ALTER ROLE {role} CONNECTION LIMIT 1", dbname="postgres")
    timeouts = {"query_wait_timeout": 20, **({"server_login_retry": retry} if retry else {})}
    proxy = scry_proxy({
        "database_url": f"postgres://{role}:retry_pass@127.0.0.1:{pg.port}/app",
        "auth": {"type": "trust"},
        "pool": {"mode": "transaction", "size": 2},
        "circuit_breaker": {"enabled": False},  # (it would answer the client instead)
        "timeouts": timeouts,
    })  # fmt: skip
    holder = connect(proxy, autocommit=False)
    holder.execute("select 1")  # (the role's only server, held by an open transaction)
    answers: list[Any] = []

    def wait_for_a_server() -> None:
        with connect(proxy) as conn:
            answers.append(conn.execute("select 2").fetchone())

    waiter = threading.Thread(target=wait_for_a_server)
    waiter.start()
    wait_for(lambda: "server connection failed" in proxy.log_text(), 5, "a first failed login")
    time.sleep(2.5)  # (the window the retries are counted in)
    failed = proxy.log_text().count("server connection failed")
    if retry:
        assert failed >= 9, failed  # about every 0.2 s
    else:
        assert 3 <= failed <= 5, failed  # 0.2, 0.4, 0.8, 1.6 s apart
    holder.commit()  # its server goes to the waiting client
    waiter.join(10)
    assert answers == [(2,)]
    holder.close()
