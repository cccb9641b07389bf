"""TLS between scry and PostgreSQL: ``tls.server_tls_*``.

The session cluster has ``ssl = on`` with a certificate for localhost and
127.0.0.1 signed by ``pg.ca_cert``. A second, plaintext-only cluster (module
scope) proves that ``require`` and stricter never fall back to plaintext.
Which of the proxy's backends use TLS is read from ``pg_stat_ssl``; the
proxy's backend PIDs come from its "server connected" log lines.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from scry.devcluster import DevCluster


@pytest.fixture(scope="module")
def plain_pg() -> Iterator[DevCluster]:
    cluster = DevCluster(ssl=False, prefix="scry-pg-plain-")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def proxy_pids(proxy) -> list[int]:
    return [int(p) for p in re.findall(r"server connected .*?backend_pid=(\d+)", proxy.log_text())]


def ssl_of_backends(pg, pids: list[int]) -> list[tuple[bool, str | None]]:
    with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as conn:
        rows = conn.execute(
            "select ssl, client_dn from pg_stat_ssl where pid = any(%s)", (pids,)
        ).fetchall()
    return [(bool(r[0]), r[1]) for r in rows]


def client(proxy, user: str = "app") -> psycopg.Connection:
    return psycopg.connect(**proxy.conninfo(user=user), autocommit=True)


def run(proxy, sql: str = "select current_user") -> Any:
    with client(proxy) as conn:
        return conn.execute(sql).fetchone()


@pytest.mark.parametrize(
    ("sslmode", "host", "ssl"),
    [
        ("disable", "127.0.0.1", False),
        ("allow", "127.0.0.1", False),
        ("prefer", "127.0.0.1", True),
        ("require", "127.0.0.1", True),
        ("verify-ca", "127.0.0.1", True),
        ("verify-full", "localhost", True),
    ],
)
def test_server_tls_modes(scry_proxy, pg, sslmode: str, host: str, ssl: bool) -> None:
    tls: dict[str, Any] = {"server_tls_sslmode": sslmode}
    if sslmode.startswith("verify"):
        tls["server_tls_ca_file"] = str(pg.ca_cert)
    proxy = scry_proxy({"database_url": pg.url(host=host), "tls": tls})
    assert run(proxy) == ("app",)
    pids = proxy_pids(proxy)
    assert pids
    assert [s for s, _ in ssl_of_backends(pg, pids)] == [ssl] * len(pids)


def test_verify_ca_with_the_wrong_ca_fails_clearly(scry_proxy, pg) -> None:
    # The server certificate is not a CA: nothing verifies against it.
    proxy = scry_proxy(
        {
            "database_url": pg.url(host="localhost"),
            "tls": {"server_tls_sslmode": "verify-full", "server_tls_ca_file": str(pg.server_cert)},
        }
    )
    with pytest.raises(psycopg.OperationalError, match="(?i)certificate") as exc_info:
        run(proxy)
    assert "verify" in str(exc_info.value).lower()
    assert proxy_pids(proxy) == []


def test_client_certificate_towards_the_server(scry_proxy, pg) -> None:
    # cert_user may only log in with a certificate (hostssl ... cert).
    cert, key = pg.client_cert("cert_user")
    proxy = scry_proxy(
        {
            "database_url": pg.url(user="cert_user", host="localhost"),
            "auth": {"type": "trust"},
            "tls": {
                "server_tls_sslmode": "verify-full",
                "server_tls_ca_file": str(pg.ca_cert),
                "server_tls_cert_file": str(cert),
                "server_tls_key_file": str(key),
            },
        }
    )
    assert run(proxy) == ("cert_user",)
    assert ssl_of_backends(pg, proxy_pids(proxy)) == [(True, "/CN=cert_user")]


def test_server_without_client_certificate_refuses_cert_user(scry_proxy, pg) -> None:
    proxy = scry_proxy(
        {
            "database_url": pg.url(user="cert_user", host="localhost"),
            "auth": {"type": "trust"},
            "tls": {"server_tls_sslmode": "require"},
        }
    )
    with pytest.raises(psycopg.OperationalError, match="(?i)certificate|authentication"):
        run(proxy)


@pytest.mark.parametrize("sslmode", ["require", "verify-ca", "verify-full"])
def test_strict_modes_never_fall_back_to_plaintext(scry_proxy, pg, plain_pg, sslmode: str) -> None:
    tls: dict[str, Any] = {"server_tls_sslmode": sslmode}
    if sslmode.startswith("verify"):
        tls["server_tls_ca_file"] = str(pg.ca_cert)
    proxy = scry_proxy(
        {"database_url": plain_pg.url(host="localhost"), "tls": tls, "auth": {"type": "trust"}}
    )
    with pytest.raises(psycopg.OperationalError, match="refused TLS"):
        run(proxy)
    assert "refused TLS" in proxy.log_text()


def test_prefer_falls_back_to_plaintext(scry_proxy, plain_pg) -> None:
    proxy = scry_proxy(
        {
            "database_url": plain_pg.url(),
            "tls": {"server_tls_sslmode": "prefer"},
            "auth": {"type": "trust"},
        }
    )
    assert run(proxy, "select ssl from pg_stat_ssl where pid = pg_backend_pid()") == (False,)
