"""Authentication: clients to scry (front end) and scry to PostgreSQL (back end)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess

import asyncpg
import psycopg
import pytest

PSQL = "/usr/bin/psql"
AUTH_OK, AUTH_CLEARTEXT, AUTH_MD5, AUTH_SASL = 0, 3, 5, 10


def first_auth_request(port: int, user: str, database: str = "app") -> int:
    """The authentication code scry asks a fresh client for (raw protocol)."""
    body = struct.pack("!i", 196608)
    body += b"user\0" + user.encode() + b"\0database\0" + database.encode() + b"\0\0"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(struct.pack("!i", len(body) + 4) + body)
        head = b""
        while len(head) < 9:
            chunk = sock.recv(9 - len(head))
            assert chunk, "scry closed the connection before asking for authentication"
            head += chunk
    kind, _length, code = head[:1], *struct.unpack("!ii", head[1:9])
    assert kind == b"R", head
    return int(code)


def run_psql(port: int, user: str, password: str, sql: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGPASSWORD=password, PGSSLMODE="disable", PGCONNECT_TIMEOUT="10")
    cmd = [PSQL, "-X", "-q", "-At", "-w", "-h", "127.0.0.1", "-p", str(port), "-U", user]
    return subprocess.run(
        [*cmd, "-d", "app", "-c", sql],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )


async def asyncpg_select(proxy, user: str, password: str | None, dbname: str = "app"):
    conn = await asyncpg.connect(
        proxy.asyncpg_dsn(user=user, password=password, dbname=dbname), timeout=10
    )
    try:
        return await conn.fetchrow("select current_user, 42")
    finally:
        await asyncio.wait_for(conn.close(), 10)


def rolpassword(pg, role: str) -> str:
    return pg.psql(f"select rolpassword from pg_authid where rolname = '{role}'")


SESSION = {"pool": {"mode": "session", "size": 3}}  # asyncpg prepares statements


# --- no auth section: the database_url credentials --------------------------------------


async def test_database_url_credentials_without_auth_section(scry_proxy) -> None:
    proxy = scry_proxy(SESSION)
    assert first_auth_request(proxy.port, "app") == AUTH_SASL  # scram by default
    row = await asyncpg_select(proxy, "app", "app_pass")
    assert tuple(row) == ("app", 42)

    with pytest.raises(asyncpg.exceptions.InvalidPasswordError) as exc:
        await asyncpg_select(proxy, "app", "wrong")
    assert exc.value.sqlstate == "28P01"

    with pytest.raises(asyncpg.PostgresError) as exc:
        await asyncpg_select(proxy, "nobody", "app_pass")
    assert exc.value.sqlstate.startswith("28"), exc.value.sqlstate

    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(proxy.dsn(password="wrong"))

    # Still serving everyone else.
    row = await asyncpg_select(proxy, "app", "app_pass")
    assert tuple(row) == ("app", 42)
    with psycopg.connect(proxy.dsn()) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    assert "client login failed" in proxy.log_text()
    assert "app_pass" not in proxy.log_text()  # secrets never logged


# --- md5 ------------------------------------------------------------------------------


def test_md5_inline_users(scry_proxy) -> None:
    proxy = scry_proxy(
        {"auth": {"type": "md5", "users": [{"name": "app", "password": "app_pass"}]}}
    )
    assert first_auth_request(proxy.port, "app") == AUTH_MD5
    proc = run_psql(proxy.port, "app", "app_pass", "select current_user, 1 + 1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "app|2"
    proc = run_psql(proxy.port, "app", "nope", "select 1")
    assert proc.returncode != 0
    assert "password authentication failed" in proc.stderr
    with psycopg.connect(proxy.dsn()) as conn:
        assert conn.execute("select current_user").fetchone() == ("app",)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(proxy.dsn(password="nope"))


# --- scram with a PgBouncer auth_file ------------------------------------------------------


async def test_scram_auth_file_with_scram_and_md5_secrets(scry_proxy, pg, tmp_path) -> None:
    scram_secret = rolpassword(pg, "scram_user")
    md5_secret = rolpassword(pg, "md5_user")
    assert scram_secret.startswith("SCRAM-SHA-256$") and md5_secret.startswith("md5")
    userlist = tmp_path / "userlist.txt"
    userlist.write_text(
        f'; PgBouncer userlist\n"scram_user" "{scram_secret}"\n"md5_user" "{md5_secret}"\n'
    )
    proxy = scry_proxy({**SESSION, "auth": {"type": "scram-sha-256", "auth_file": str(userlist)}})
    assert first_auth_request(proxy.port, "scram_user") == AUTH_SASL
    # An md5 secret cannot answer SCRAM: that user is asked for md5 (as PostgreSQL does).
    assert first_auth_request(proxy.port, "md5_user") == AUTH_MD5

    # database_url forces the backend user (app) for everybody, as in PgBouncer.
    with psycopg.connect(proxy.dsn(user="scram_user", password="scram_pass")) as conn:
        assert conn.execute("select current_user").fetchone() == ("app",)
    with psycopg.connect(proxy.dsn(user="md5_user", password="md5_pass")) as conn:
        assert conn.execute("select current_user").fetchone() == ("app",)
    row = await asyncpg_select(proxy, "scram_user", "scram_pass")
    assert tuple(row) == ("app", 42)
    row = await asyncpg_select(proxy, "md5_user", "md5_pass")
    assert tuple(row) == ("app", 42)

    for user in ("scram_user", "md5_user"):
        with pytest.raises(asyncpg.exceptions.InvalidPasswordError):
            await asyncpg_select(proxy, user, "wrong")
    # app is not in the auth_file: its database_url password does not open the door.
    with pytest.raises(asyncpg.PostgresError):
        await asyncpg_select(proxy, "app", "app_pass")
    proc = run_psql(proxy.port, "scram_user", "scram_pass", "select 'psql ok'")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "psql ok"


# --- trust ----------------------------------------------------------------------------


async def test_trust_lets_any_password_in(scry_proxy) -> None:
    proxy = scry_proxy({**SESSION, "auth": {"type": "trust"}})
    assert first_auth_request(proxy.port, "whoever") == AUTH_OK
    for user, password in (("app", "anything"), ("someone", None), ("app", None)):
        row = await asyncpg_select(proxy, user, password)
        assert tuple(row) == ("app", 42)
    with psycopg.connect(proxy.dsn(user="x", password="y")) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


# --- scry to PostgreSQL ------------------------------------------------------------------

CLIENT_AUTH = {"auth": {"type": "md5", "users": [{"name": "app", "password": "app_pass"}]}}


@pytest.mark.parametrize("backend_user", ["md5_user", "scram_user", "trust_user"])
def test_backend_auth_methods(scry_proxy, pg, backend_user: str) -> None:
    if backend_user == "trust_user":
        url = f"postgres://trust_user@127.0.0.1:{pg.port}/app"  # no password at all
    else:
        url = pg.url(user=backend_user)
    proxy = scry_proxy({**CLIENT_AUTH, "database_url": url})
    for _ in range(2):  # the second login reuses the pooled server
        with psycopg.connect(proxy.dsn()) as conn:
            assert conn.execute("select current_user").fetchone() == (backend_user,)


def test_backend_wrong_password_reported_to_client(scry_proxy, pg) -> None:
    proxy = scry_proxy({**CLIENT_AUTH, "database_url": pg.url(user="scram_user", password="bad")})
    with (
        pytest.raises(psycopg.OperationalError, match="password authentication failed"),
        psycopg.connect(proxy.dsn()) as conn,
    ):
        conn.execute("select 1")
    # The proxy itself is fine: a client that fails auth at scry gets 28P01 too.
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(proxy.dsn(password="nope"))


# --- unknown database ----------------------------------------------------------------------


async def test_unknown_database(scry_proxy) -> None:
    proxy = scry_proxy(SESSION)
    with pytest.raises(psycopg.OperationalError, match="no such database"):
        psycopg.connect(proxy.dsn(dbname="nope"))
    with pytest.raises(asyncpg.PostgresError, match="no such database"):
        await asyncpg_select(proxy, "app", "app_pass", dbname="nope")
    with psycopg.connect(proxy.dsn()) as conn:
        assert conn.execute("select current_database()").fetchone() == ("app",)


# --- auth.type: hba ----------------------------------------------------------------------

HBA_RULES = """\
# TYPE    DATABASE  USER     ADDRESS       METHOD
host      all       blocked  127.0.0.1/32  reject
host      all       trusted  127.0.0.1/32  trust
host      all       app      127.0.0.1/32  md5
hostnossl all       tls_only all           reject
host      app       all      127.0.0.1/32  scram-sha-256
"""


async def test_hba_file_chooses_the_method_per_connection(scry_proxy, tmp_path, wait_until) -> None:
    hba = tmp_path / "hba.conf"
    hba.write_text(HBA_RULES)
    users = [{"name": n, "password": f"{n}_pass"} for n in ("app", "alice", "tls_only")]
    proxy = scry_proxy(
        {**SESSION, "auth": {"type": "hba", "auth_hba_file": str(hba), "users": users}}
    )
    assert first_auth_request(proxy.port, "app") == AUTH_MD5
    assert first_auth_request(proxy.port, "alice") == AUTH_SASL
    assert first_auth_request(proxy.port, "trusted") == AUTH_OK

    proc = run_psql(proxy.port, "app", "app_pass", "select current_user")
    assert proc.returncode == 0, proc.stderr
    assert tuple(await asyncpg_select(proxy, "alice", "alice_pass")) == ("app", 42)
    assert tuple(await asyncpg_select(proxy, "trusted", None)) == ("app", 42)
    with pytest.raises(asyncpg.exceptions.InvalidPasswordError):
        await asyncpg_select(proxy, "alice", "wrong")

    refusals = {
        ("blocked", "app"): 'pg_hba.conf rejects connection for host "127.0.0.1", user "blocked", '
        'database "app", no encryption',
        ("tls_only", "app"): 'pg_hba.conf rejects connection for host "127.0.0.1", '
        'user "tls_only", database "app", no encryption',
        ("alice", "elsewhere"): 'no pg_hba.conf entry for host "127.0.0.1", user "alice", '
        'database "elsewhere", no encryption',
    }
    for (user, dbname), message in refusals.items():
        with pytest.raises(psycopg.OperationalError) as caught:
            psycopg.connect(proxy.dsn(user=user, password=f"{user}_pass", dbname=dbname))
        assert message in str(caught.value)
        with pytest.raises(asyncpg.exceptions.InvalidAuthorizationSpecificationError):  # 28000
            await asyncpg_select(proxy, user, f"{user}_pass", dbname=dbname)
    assert 'reason="hba: line 2 rejects"' in proxy.log_text()

    # SIGHUP re-reads the file; a file with a line scry cannot honour is refused
    # and the rules in force stay.
    hba.write_text(HBA_RULES.replace("all       app      127.0.0.1/32  md5", "all app all reject"))
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
    with pytest.raises(psycopg.OperationalError, match="pg_hba.conf rejects connection"):
        psycopg.connect(proxy.dsn())
    hba.write_text("host all all example.com md5\n")
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "reload failed" in proxy.log_text(), 5, what="reload failed")
    assert "auth.auth_hba_file" in proxy.log_text() and "line 1" in proxy.log_text()
    assert tuple(await asyncpg_select(proxy, "alice", "alice_pass")) == ("app", 42)
