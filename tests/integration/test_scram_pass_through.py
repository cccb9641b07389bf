"""SCRAM pass-through: with only pg_authid's SCRAM secret (in an auth_file or
found by auth_query), scry logs servers in as the client's own user with the
ClientKey the client proved at its login, as PgBouncer does.

database_url names no user here, so every pool logs in as its client's user.
Roles are made per test (names of their own), with PostgreSQL's SCRAM secrets.
"""

from __future__ import annotations

import asyncio
import signal
import time

import asyncpg
import pytest

from tests.integration.test_admin_api import get, start_admin_proxy
from tests.integration.test_auth_query import LOOKUP, new_role, refused, select_user
from tests.integration.test_core_auth import asyncpg_select, rolpassword, run_psql


def userlist(tmp_path, secrets: dict[str, str]):
    path = tmp_path / "userlist.txt"
    path.write_text("".join(f'"{user}" "{secret}"\n' for user, secret in secrets.items()))
    return path


def unforced(pg) -> str:
    return f"postgres://127.0.0.1:{pg.port}/app"


async def test_a_scram_secret_logs_servers_in_with_the_clients_key(
    pg, scry_proxy, tmp_path, backend_count
) -> None:
    role = new_role(pg, "pt_pass")
    secret = rolpassword(pg, role)
    assert secret.startswith("SCRAM-SHA-256$")
    auth_file = userlist(tmp_path, {role: secret})
    proxy = scry_proxy({
        "database_url": unforced(pg),
        "auth": {"type": "scram-sha-256", "auth_file": str(auth_file)},
        "pool": {"mode": "transaction", "size": 3},
    })  # fmt: skip
    # A wrong password proves nothing: no key, and no server login is tried.
    with pytest.raises(asyncpg.exceptions.InvalidPasswordError):
        await asyncpg_select(proxy, role, "wrong")
    assert backend_count(pg, user=role, proxy=proxy) == 0

    assert select_user(proxy, role, "pt_pass") == (role, role)  # psycopg
    assert tuple(await asyncpg_select(proxy, role, "pt_pass")) == (role, 42)
    proc = run_psql(proxy.port, role, "pt_pass", "select current_user")
    assert (proc.returncode, proc.stdout.strip()) == (0, role), proc.stderr

    # Six clients at once need all three servers: each logs in with the key.
    async def busy() -> str:
        conn = await asyncpg.connect(proxy.asyncpg_dsn(user=role, password="pt_pass"), timeout=10)
        try:
            return await conn.fetchval("select current_user from pg_sleep(0.3)")
        finally:
            await conn.close()

    assert await asyncio.gather(*(busy() for _ in range(6))) == [role] * 6
    assert backend_count(pg, user=role, proxy=proxy) == 3
    log = proxy.log_text()
    assert "pt_pass" not in log and secret not in log and "SCRAM-SHA-256$" not in log


def test_a_secret_the_server_no_longer_holds_is_named(pg, scry_proxy, tmp_path, wait_until) -> None:
    role = new_role(pg, "same")
    old = rolpassword(pg, role)
    # The same password set again: PostgreSQL stores it with a new salt.
    pg.psql(f"ALTER ROLE {role} PASSWORD 'same'", dbname="postgres")
    assert rolpassword(pg, role) != old
    auth_file = userlist(tmp_path, {role: old})
    proxy = scry_proxy({
        "database_url": unforced(pg),
        "auth": {"type": "scram-sha-256", "auth_file": str(auth_file)},
    })  # fmt: skip
    # The client's proof holds against the old secret, and its key cannot
    # answer the server's salt: said, not sent to fail as a wrong password.
    message = refused(proxy, role, "same")
    assert f'the SCRAM secret known for user "{role}" is not the server\'s' in message
    # The auth_file brought up to date and reloaded: the same client gets in.
    userlist(tmp_path, {role: rolpassword(pg, role)})
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
    assert select_user(proxy, role, "same") == (role, role)


def test_auth_query_scram_secrets_log_in_to_the_server(pg, scry_proxy, wait_until) -> None:
    # PgBouncer's usual deployment: auth_query reads pg_authid, and no password
    # is written down in scry's config but auth_user's (trust, here).
    proxy, admin = start_admin_proxy(
        scry_proxy,
        database_url=unforced(pg),
        auth=LOOKUP,
        pool={"mode": "transaction", "size": 3, "min_size": 2},
    )
    role = new_role(pg, "looked_up")

    def pool(user: str) -> dict:
        return next(p for p in get(admin, "/api/v1/pools")["pools"] if p["user"] == user)

    assert "password authentication failed" in refused(proxy, role, "wrong")
    # The pool made for that login keeps min_size for postgres (auth_user)
    # but not for the role: with no key yet, a login could only fail. Past
    # the janitor's next pass (it runs each second), nothing was tried.
    wait_until(lambda: pool("postgres")["servers"] == 2, 5, what="auth_user's min_size")
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        waiting = pool(role)
        assert (waiting["servers"], waiting["connecting"], waiting["last_error"]) == (0, 0, None)
        time.sleep(0.1)

    assert select_user(proxy, role, "looked_up") == (role, role)
    wait_until(lambda: pool(role)["servers"] == 2, 5, what="the role's min_size, with the key")
    assert "server connection failed" not in proxy.log_text()


def test_secrets_of_fewer_than_4096_rounds_log_in(pg, scry_proxy, tmp_path) -> None:
    # PostgreSQL 16's scram_iterations may store fewer rounds than RFC 7677's
    # 4096 (the secret is written here directly). libpq takes them; so does
    # scry, with a password and through pass-through.
    from tests.unit.test_auth_exchange import hand_scram_secret

    role = new_role(pg, "unused")
    secret = hand_scram_secret("few_rounds", 1024)
    pg.psql(f"ALTER ROLE {role} PASSWORD '{secret}'", dbname="postgres")
    assert rolpassword(pg, role) == secret
    forced = scry_proxy({
        "database_url": f"postgres://{role}:few_rounds@127.0.0.1:{pg.port}/app",
        "auth": {"type": "trust"},
    })  # fmt: skip
    assert select_user(forced, "anyone", "x") == (role, role)
    passing = scry_proxy({
        "database_url": unforced(pg),
        "auth": {"type": "scram-sha-256", "auth_file": str(userlist(tmp_path, {role: secret}))},
    })  # fmt: skip
    assert select_user(passing, role, "few_rounds") == (role, role)
