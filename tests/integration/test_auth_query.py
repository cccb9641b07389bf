"""auth_query: users with no secret in scry's config are looked up in PostgreSQL.

``auth_user`` is the cluster's ``postgres`` (trust from loopback), as a
PgBouncer deployment reads ``pg_authid`` with a superuser or a SECURITY
DEFINER function. Roles made here have names of their own, so the tests do
not disturb the cluster's fixed roles.
"""

from __future__ import annotations

import uuid

import asyncpg
import psycopg
import pytest

from tests.integration.test_admin_api import get, start_admin_proxy
from tests.integration.test_core_auth import asyncpg_select, run_psql

LOOKUP = {"type": "scram-sha-256", "auth_user": "postgres"}


def new_role(pg, password: str, encryption: str = "scram-sha-256", login: bool = True) -> str:
    role = f"aq_{uuid.uuid4().hex[:8]}"
    pg.psql(
        f"SET password_encryption = '{encryption}';\n"
        f"CREATE ROLE {role} {'LOGIN' if login else 'NOLOGIN'} PASSWORD '{password}';\n"
        f"GRANT CONNECT ON DATABASE app TO {role};\n",
        dbname="postgres",
    )
    return role


def select_user(proxy, user: str, password: str) -> tuple[str, str]:
    """(the client's user as the proxy knows it, current_user on the server)."""
    with psycopg.connect(proxy.dsn(user=user, password=password)) as conn:
        row = conn.execute("select session_user, current_user").fetchone()
        assert row is not None
        return row


def refused(proxy, user: str, password: str) -> str:
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(proxy.dsn(user=user, password=password))
    return str(caught.value)


async def test_a_forced_user_pool_serves_roles_looked_up_at_each_login(pg, scry_proxy) -> None:
    # database_url names a user: the server logins are app's, and auth_query
    # only decides who may come in, with any kind of secret pg_authid holds.
    proxy = scry_proxy({"auth": {**LOOKUP, "users": [{"name": "app", "password": "app_pass"}]}})
    role = new_role(pg, "first")
    assert select_user(proxy, role, "first") == ("app", "app")
    assert tuple(await asyncpg_select(proxy, role, "first")) == ("app", 42)
    assert "password authentication failed" in refused(proxy, role, "wrong")
    with pytest.raises(asyncpg.exceptions.InvalidPasswordError):  # 28P01, as for a wrong one
        await asyncpg_select(proxy, f"{role}_nobody", "first")
    assert run_psql(proxy.port, role, "first", "select 1").stdout.strip() == "1"

    # Every login asks again: a new password works at once and the old one stops.
    pg.psql(f"ALTER ROLE {role} PASSWORD 'second'", dbname="postgres")
    assert "password authentication failed" in refused(proxy, role, "first")
    assert select_user(proxy, role, "second") == ("app", "app")
    # An expired or NOLOGIN role has no secret (PgBouncer's default auth_query).
    pg.psql(f"ALTER ROLE {role} VALID UNTIL '2000-01-01'", dbname="postgres")
    assert "password authentication failed" in refused(proxy, role, "second")
    md5_role = new_role(pg, "hashed", encryption="md5", login=False)
    assert "password authentication failed" in refused(proxy, md5_role, "hashed")
    pg.psql(f"ALTER ROLE {md5_role} LOGIN", dbname="postgres")
    assert select_user(proxy, md5_role, "hashed") == ("app", "app")  # an md5 secret, asked as SCRAM

    # A user scry knows is never looked up: its own secret decides.
    assert select_user(proxy, "app", "app_pass") == ("app", "app")
    log = proxy.log_text()
    assert "first" not in log and "second" not in log and "SCRAM-SHA-256$" not in log


def test_without_a_forced_user_the_found_secret_logs_in_to_the_server(pg, scry_proxy) -> None:
    proxy, admin = start_admin_proxy(
        scry_proxy,
        database_url=f"postgres://127.0.0.1:{pg.port}/app",
        auth={**LOOKUP, "type": "md5"},
        pool={"mode": "transaction", "size": 3},
    )
    # md5_user's pg_authid secret is md5 and its pg_hba line md5: the md5
    # secret answers the server's challenge as PgBouncer's does.
    assert select_user(proxy, "md5_user", "md5_pass") == ("md5_user", "md5_user")
    assert "password authentication failed" in refused(proxy, "md5_user", "wrong")
    # scram_user's secret is SCRAM: the key the client proves logs the server
    # in (SCRAM pass-through; tests/integration/test_scram_pass_through.py).
    assert select_user(proxy, "scram_user", "scram_pass") == ("scram_user", "scram_user")
    assert select_user(proxy, "md5_user", "md5_pass") == ("md5_user", "md5_user")
    # Made-up names fail as wrong passwords do, and leave no pool behind.
    for n in range(3):
        assert "password authentication failed" in refused(proxy, f"made_up_{n}", "x")
    pools = {p["user"] for p in get(admin, "/api/v1/pools")["pools"]}
    assert pools == {"md5_user", "scram_user", "postgres"}, pools


async def test_a_failing_auth_query_refuses_that_client_and_logs_why(
    pg, scry_proxy, wait_until
) -> None:
    users = [{"name": "app", "password": "app_pass"}]
    broken = "SELECT usename, x FROM nowhere WHERE u=$1"
    proxy = scry_proxy({"auth": {**LOOKUP, "users": users, "auth_query": broken}})
    with pytest.raises(asyncpg.PostgresError) as caught:
        await asyncpg_select(proxy, "someone", "pw")
    assert caught.value.sqlstate == "08006"
    assert 'could not look up user "someone" (auth_query)' in str(caught.value)
    wait_until(lambda: "auth_query failed" in proxy.log_text(), 5, what="the log line")
    line = next(x for x in proxy.log_text().splitlines() if "auth_query failed" in x)
    assert "nowhere" in line and "does not exist" in line, line
    assert select_user(proxy, "app", "app_pass") == ("app", "app")  # others carry on

    # An auth_user that cannot log in is the same: refused, logged, the rest fine.
    proxy2 = scry_proxy(
        {"auth": {**LOOKUP, "users": users, "auth_user": "scram_user"}}  # no secret for it
    )
    assert "could not look up user" in refused(proxy2, "someone", "pw")
    wait_until(lambda: "auth_query failed" in proxy2.log_text(), 5, what="the log line")
    assert select_user(proxy2, "app", "app_pass") == ("app", "app")


def test_a_database_can_name_its_own_auth_user_and_query(pg, scry_proxy) -> None:
    # No global auth_user: only "looked" and "strict" look users up (PgBouncer's
    # per-database auth_user), in auth_dbname "app"; "strict" with its own
    # auth_query, which finds no aq_ role.
    url = pg.url()
    strict = "SELECT rolname, rolpassword FROM pg_authid WHERE rolname=$1 AND rolname !~ '^aq_'"
    proxy = scry_proxy(
        {
            "auth": {"type": "md5", "users": [{"name": "app", "password": "app_pass"}]},
            "databases": {
                "looked": {"database_url": url, "auth_user": "postgres", "auth_dbname": "app"},
                "strict": {"database_url": url, "auth_user": "postgres", "auth_query": strict},
            },
        }
    )  # fmt: skip
    role = new_role(pg, "mine")
    with psycopg.connect(proxy.dsn(user=role, password="mine", dbname="looked")) as conn:
        assert conn.execute("select current_user").fetchone() == ("app",)
    assert "password authentication failed" in refused(proxy, role, "mine")  # at "app"
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(proxy.dsn(user=role, password="mine", dbname="strict"))
    with psycopg.connect(proxy.dsn(user="md5_user", password="md5_pass", dbname="strict")) as conn:
        assert conn.execute("select current_user").fetchone() == ("app",)
