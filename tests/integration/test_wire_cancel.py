"""Cancel requests through scry, in every pool mode.

The BackendKeyData a client receives is scry's own (never a backend's); a
CancelRequest on a new connection reaches the server currently running that
client's query and cancels exactly that query, never another client's; a
cancel for a client that is waiting for a server, or idle, does no harm.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from collections.abc import Callable

import asyncpg
import psycopg
import psycopg.errors
import pytest

MODES = ["session", "transaction", "hybrid"]
PROTOCOL_3 = 196608
CANCEL_CODE = 80877102


def cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def msg(kind: bytes, body: bytes = b"") -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


def login_key(port: int) -> tuple[socket.socket, tuple[int, int]]:
    """Log in (trust) on a raw socket; return it and the BackendKeyData it got."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = struct.pack("!i", PROTOCOL_3) + cstr("user") + cstr("app") + cstr("database")
    body += cstr("app") + b"\0"
    sock.sendall(struct.pack("!i", len(body) + 4) + body)
    buf = b""
    key = None
    while True:
        chunk = sock.recv(65536)
        assert chunk, buf
        buf += chunk
        pos = 0
        while pos + 5 <= len(buf):
            kind = buf[pos : pos + 1]
            (length,) = struct.unpack_from("!i", buf, pos + 1)
            if pos + 1 + length > len(buf):
                break
            body = buf[pos + 5 : pos + 1 + length]
            assert kind != b"E", body
            if kind == b"K":
                key = struct.unpack("!iI", body)
            if kind == b"Z":
                assert key is not None
                return sock, key
            pos += 1 + length


def send_cancel(port: int, pid: int, secret: int) -> bytes:
    """A CancelRequest on a new connection; returns what came back (nothing, then close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(struct.pack("!iiiI", 16, CANCEL_CODE, pid, secret))
        data = b""
        while True:
            try:
                chunk = sock.recv(1024)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            data += chunk
        return data


@pytest.fixture(scope="module")
def proxies(scry_proxy_module) -> Callable[..., object]:
    cache: dict[tuple[str, int], object] = {}

    def get(mode: str, size: int = 3):
        if (mode, size) not in cache:
            cache[(mode, size)] = scry_proxy_module(
                {"pool": {"mode": mode, "size": size}, "auth": {"type": "trust"}}
            )
        return cache[(mode, size)]

    return get


def direct(pg) -> psycopg.Connection:
    return psycopg.connect(
        pg.dsn(user="postgres", dbname="app", sslmode="disable"), autocommit=True
    )


def running(pg, marker: str) -> int:
    with direct(pg) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity where state = 'active'"
            " and query like %s and pid <> pg_backend_pid()",
            (f"%{marker}%",),
        ).fetchone()
    return int(row[0]) if row else 0


class Sleeper:
    """A psycopg connection running one query in a thread; records the outcome."""

    def __init__(self, proxy, sql: str) -> None:
        self.conn = psycopg.connect(**proxy.conninfo(), autocommit=True)
        self.sql = sql
        self.outcome: list[object] = []
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            self.outcome.append(self.conn.execute(self.sql).fetchall())
        except BaseException as exc:  # recorded for the assertions
            self.outcome.append(exc)

    def start(self) -> Sleeper:
        self.thread.start()
        return self

    def join(self, timeout: float) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.sql!r} still running"
        return self.outcome[0]

    def close(self) -> None:
        self.conn.close()


@pytest.mark.parametrize("mode", MODES)
def test_backend_key_data_is_scrys_own(proxies, pg, mode: str) -> None:
    proxy = proxies(mode)
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        (real,) = conn.execute("select pg_backend_pid()").fetchone()  # type: ignore[misc]
        assert conn.info.backend_pid != real
        with direct(pg) as admin:
            pids = {r[0] for r in admin.execute("select pid from pg_stat_activity").fetchall()}
        assert conn.info.backend_pid not in pids
    sock, (pid, secret) = login_key(proxy.port)
    sock2, (pid2, secret2) = login_key(proxy.port)
    try:
        assert (pid, secret) != (pid2, secret2)
        assert pid > 0 and pid2 > 0
    finally:
        sock.close()
        sock2.close()


@pytest.mark.parametrize("mode", MODES)
def test_cancel_reaches_exactly_its_own_query(proxies, pg, wait_until, mode: str) -> None:
    proxy = proxies(mode)
    a = Sleeper(proxy, "select pg_sleep(30) /* cancel_a */").start()
    b = Sleeper(proxy, "select 'b', pg_sleep(1) /* cancel_b */").start()
    try:
        wait_until(lambda: running(pg, "cancel_a") == 1, 5, what="query a")
        wait_until(lambda: running(pg, "cancel_b") == 1, 5, what="query b")
        started = time.monotonic()
        a.conn.cancel_safe(timeout=5)
        assert isinstance(a.join(5), psycopg.errors.QueryCanceled), a.outcome
        assert time.monotonic() - started < 3
        assert running(pg, "cancel_b") == 1, "b's query was cancelled too"
        assert b.join(10) == [("b", "")]
        # Both connections keep working.
        assert a.conn.execute("select 'a again'").fetchone() == ("a again",)
        assert b.conn.execute("select 'b again'").fetchone() == ("b again",)
    finally:
        a.close()
        b.close()


def test_cancel_with_a_wrong_key_does_nothing(proxies, pg, wait_until) -> None:
    # (the key lookup does not depend on the pool mode)
    proxy = proxies("transaction")
    sock, (pid, secret) = login_key(proxy.port)
    try:
        sock.sendall(msg(b"Q", cstr("select pg_sleep(0.8) /* wrong_key */")))
        wait_until(lambda: running(pg, "wrong_key") == 1, 5, what="the query")
        for bad_pid, bad_secret in ((pid + 1, secret), (pid, secret ^ 1), (0, 0), (-1, 2**32 - 1)):
            assert send_cancel(proxy.port, bad_pid, bad_secret) == b""
        time.sleep(0.3)
        assert running(pg, "wrong_key") == 1
        sock.settimeout(5)
        data = b""
        while not data.endswith(b"Z\x00\x00\x00\x05I"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert b"57014" not in data  # not cancelled
    finally:
        sock.close()


@pytest.mark.parametrize("mode", MODES)
def test_cancel_of_a_waiting_client_harms_nobody(proxies, pg, wait_until, mode: str) -> None:
    # Pool of one: a holds the server, b waits for it. Cancelling b must not
    # cancel a's query (the only one running).
    proxy = proxies(mode, size=1)
    a = Sleeper(proxy, "select 'a', pg_sleep(0.8) /* waiting_a */").start()
    wait_until(lambda: running(pg, "waiting_a") == 1, 5, what="query a")
    b = Sleeper(proxy, "select 'b' /* waiting_b */").start()
    try:
        time.sleep(0.3)  # b is queued for the server now
        assert not b.outcome
        b.conn.cancel_safe(timeout=5)
        time.sleep(0.2)
        assert running(pg, "waiting_a") == 1, "a's query was cancelled by b's cancel"
        assert a.join(10) == [("a", "")]
        if mode == "session":
            a.close()  # session pooling: b gets the server when a leaves
        outcome = b.join(10)
        # Either b's query ran once a server was free, or it was cancelled; both are fine.
        assert outcome == [("b",)] or isinstance(outcome, psycopg.errors.QueryCanceled), outcome
        assert b.conn.execute("select 'b again'").fetchone() == ("b again",)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", MODES)
def test_cancel_of_an_idle_client_harms_nobody(proxies, pg, wait_until, mode: str) -> None:
    # Pool of one (transaction/hybrid): a ran a query and is idle; b now runs on
    # the server a used. A cancel with a's key must not touch b's query.
    proxy = proxies(mode, size=1 if mode != "session" else 2)
    a = psycopg.connect(**proxy.conninfo(), autocommit=True)
    try:
        (a_pid,) = a.execute("select pg_backend_pid()").fetchone()  # type: ignore[misc]
        b = Sleeper(proxy, "select pg_backend_pid(), pg_sleep(1) /* idle_b */").start()
        try:
            wait_until(lambda: running(pg, "idle_b") == 1, 5, what="query b")
            a.cancel_safe(timeout=5)
            time.sleep(0.2)
            outcome = b.join(10)
            assert isinstance(outcome, list), f"b's query failed: {outcome!r}"
            if mode != "session":
                assert outcome[0][0] == a_pid  # really the server a had used
        finally:
            b.close()
        assert a.execute("select 'a fine'").fetchone() == ("a fine",)
    finally:
        a.close()


@pytest.mark.parametrize("mode", MODES)
async def test_asyncpg_timeout_cancels_the_query(proxies, pg, mode: str) -> None:
    proxy = proxies(mode)
    conn = await asyncpg.connect(
        host="127.0.0.1", port=proxy.port, user="app", password="x", database="app", ssl=False
    )
    try:
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await conn.fetch("select pg_sleep(20) /* apg_timeout */", timeout=0.5)
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 5
        while running(pg, "apg_timeout"):
            assert time.monotonic() < deadline, "the timed-out query is still running"
            await asyncio.sleep(0.05)
        assert await conn.fetchval("select 'usable'") == "usable"
        stmt = await conn.prepare("select $1::int + 1")
        assert await stmt.fetchval(41) == 42
    finally:
        await asyncio.wait_for(conn.close(), 10)


@pytest.mark.parametrize("mode", ["transaction", "hybrid"])
def test_late_cancel_never_hits_the_next_client(proxies, mode: str) -> None:
    # Pool of one, two clients alternating on it. Client a runs short queries
    # and cancels itself at random moments; b's queries must never be the ones
    # cancelled, even when a's cancel races with a's query ending and the
    # server moving to b. (PgBouncer keeps a server out of the pool while a
    # cancel for it is in flight, for exactly this reason.)
    proxy = proxies(mode, size=1)
    stop = time.monotonic() + 2.5
    b_errors: list[BaseException] = []
    b_runs = [0]

    def run_b() -> None:
        with psycopg.connect(**proxy.conninfo(), autocommit=True) as b:
            while time.monotonic() < stop:
                try:
                    b.execute("select pg_sleep(0.005) /* b */")
                    b_runs[0] += 1
                except psycopg.errors.QueryCanceled as exc:
                    b_errors.append(exc)

    thread = threading.Thread(target=run_b)
    thread.start()
    rng = random.Random(7)
    a_cancelled = 0
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as a:
        while time.monotonic() < stop:
            canceller = threading.Timer(rng.uniform(0.0, 0.006), a.cancel_safe)
            canceller.start()
            try:
                a.execute("select pg_sleep(0.003) /* a */")
            except psycopg.errors.QueryCanceled:
                a_cancelled += 1
            canceller.join()
    thread.join(10)
    assert b_runs[0] > 10
    assert not b_errors, (
        f"{len(b_errors)} of b's queries were cancelled by a's cancel requests "
        f"(a was cancelled {a_cancelled} times, b ran {b_runs[0]} queries)"
    )
