"""Smoke tests for the session PostgreSQL cluster (scry.devcluster)."""

from __future__ import annotations

import asyncpg
import psycopg
import pytest

from scry.devcluster import USERS, DevCluster


@pytest.mark.parametrize("user", sorted(USERS))
def test_password_users_connect(pg: DevCluster, user: str) -> None:
    with psycopg.connect(pg.dsn(user=user, sslmode="disable")) as conn:
        assert conn.execute("select current_user").fetchone() == (user,)


def test_dsn_and_url(pg: DevCluster) -> None:
    assert pg.dsn() == f"postgresql://app:app_pass@127.0.0.1:{pg.port}/app"
    assert pg.url(user="postgres", dbname="postgres", sslmode="require") == (
        f"postgres://postgres@127.0.0.1:{pg.port}/postgres?sslmode=require"
    )


def test_auth_methods_are_as_configured(pg: DevCluster) -> None:
    secrets = dict(
        line.split("|")
        for line in pg.psql(
            "select rolname, left(rolpassword, 5) from pg_authid "
            "where rolname in ('md5_user', 'scram_user', 'app', 'trust_user')"
        ).splitlines()
    )
    assert secrets["md5_user"].startswith("md5")
    assert secrets["scram_user"].startswith("SCRAM")
    assert secrets["app"].startswith("SCRAM")


@pytest.mark.parametrize("user", ["md5_user", "scram_user"])
async def test_wrong_password_is_28p01(pg: DevCluster, user: str) -> None:
    # libpq (psycopg) does not expose the SQLSTATE of connection-time errors;
    # asyncpg does.
    with pytest.raises(asyncpg.PostgresError) as excinfo:
        await asyncpg.connect(pg.dsn(user=user, password="wrong", sslmode="disable"))
    assert excinfo.value.sqlstate == "28P01"
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(pg.dsn(user=user, password="wrong", sslmode="disable"))


def test_tls_verify_full(pg: DevCluster) -> None:
    assert pg.ca_cert is not None
    with psycopg.connect(
        host="localhost",
        hostaddr="127.0.0.1",
        port=pg.port,
        user="app",
        password=USERS["app"],
        dbname="app",
        sslmode="verify-full",
        sslrootcert=str(pg.ca_cert),
    ) as conn:
        assert conn.pgconn.ssl_in_use
        row = conn.execute("select ssl from pg_stat_ssl where pid = pg_backend_pid()").fetchone()
        assert row == (True,)


def test_cert_user(pg: DevCluster) -> None:
    cert, key = pg.client_cert("cert_user")
    assert pg.client_cert("cert_user") == (cert, key)  # cached
    with psycopg.connect(
        pg.dsn(
            user="cert_user",
            sslmode="verify-full",
            host="localhost",
            hostaddr="127.0.0.1",
            sslrootcert=pg.ca_cert,
            sslcert=cert,
            sslkey=key,
        )
    ) as conn:
        assert conn.execute("select current_user").fetchone() == ("cert_user",)


def test_cert_user_without_tls_rejected(pg: DevCluster) -> None:
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(pg.dsn(user="cert_user", sslmode="disable"))


def test_app_privileges(pg: DevCluster) -> None:
    out = pg.psql(
        "select pg_has_role('app', 'pg_signal_backend', 'member'), "
        "pg_has_role('app', 'pg_read_all_stats', 'member')"
    )
    assert out == "t|t"
    with psycopg.connect(pg.dsn(user="scram_user")) as conn:
        conn.execute("create table if not exists scram_user_t (x int)")
        conn.execute("drop table scram_user_t")


def test_pg_stat_statements(pg: DevCluster) -> None:
    if not pg.pg_stat_statements:
        pytest.skip("pg_stat_statements not installed on this machine")
    with psycopg.connect(pg.dsn()) as conn:
        conn.execute("select 1")
        (n,) = conn.execute("select count(*) from pg_stat_statements").fetchone()  # type: ignore[misc]
        assert n >= 1


def test_psql_helper(pg: DevCluster) -> None:
    assert pg.psql("select 1; select 2") == "1\n2"
    assert pg.psql("select current_user", user="md5_user") == "md5_user"
    assert pg.is_running()
