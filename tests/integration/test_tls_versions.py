"""TLS versions and ciphers on both sides (``tls.*_tls_protocols``,
``tls.*_tls_ciphers``, ``tls.client_tls_ecdhcurve``), seen by real clients and
by PostgreSQL's pg_stat_ssl."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

PSQL = "/usr/bin/psql"
# The test cluster's certificates carry P-256 keys: ECDSA suites.
TLS12_CIPHER = "ECDHE-ECDSA-AES256-GCM-SHA384"


@pytest.fixture(scope="module")
def scry_cert(pg, tmp_path_factory) -> dict[str, str]:
    d: Path = tmp_path_factory.mktemp("tlsv")
    cert, key = d / "scry.crt", d / "scry.key"
    shutil.copyfile(pg.server_cert, cert)
    shutil.copyfile(pg.server_key, key)
    os.chmod(key, 0o600)
    return {"client_tls_cert_file": str(cert), "client_tls_key_file": str(key)}


def tls_client(proxy, pg, **kw: Any) -> psycopg.Connection:
    return psycopg.connect(
        host="localhost",
        hostaddr="127.0.0.1",
        port=proxy.port,
        user="app",
        password="app_pass",
        dbname="app",
        sslmode="verify-full",
        sslrootcert=str(pg.ca_cert),
        gssencmode="disable",
        connect_timeout=10,
        autocommit=True,
        **kw,
    )


def psql_tls(proxy, pg) -> tuple[str, str]:
    """(protocol, cipher) of a psql session through scry, from its \\conninfo."""
    dsn = (
        f"host=localhost hostaddr=127.0.0.1 port={proxy.port} user=app dbname=app "
        f"sslmode=verify-full sslrootcert={pg.ca_cert} gssencmode=disable connect_timeout=10"
    )
    done = subprocess.run(
        [PSQL, dsn, "-c", "\\conninfo"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PGPASSWORD": "app_pass"},
    )
    assert done.returncode == 0, done.stderr
    found = re.search(r"protocol: ([^,]+), cipher: ([^,]+),", done.stdout)
    assert found, done.stdout
    return found[1], found[2]


def test_client_side_tls13_only_refuses_a_tls12_client(scry_proxy, pg, scry_cert) -> None:
    proxy = scry_proxy(
        {"tls": {"client_tls_sslmode": "require", "client_tls_protocols": "tlsv1.3", **scry_cert}}
    )
    assert psql_tls(proxy, pg)[0] == "TLSv1.3"
    with tls_client(proxy, pg) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    with pytest.raises(psycopg.OperationalError, match="(?i)ssl|tls|protocol"):
        tls_client(proxy, pg, ssl_max_protocol_version="TLSv1.2")


def test_client_side_tls12_cipher_and_curve(scry_proxy, pg, scry_cert) -> None:
    proxy = scry_proxy(
        {
            "tls": {
                "client_tls_sslmode": "require",
                "client_tls_protocols": "tlsv1.2",
                "client_tls_ciphers": TLS12_CIPHER,
                "client_tls_ecdhcurve": "secp384r1",
                **scry_cert,
            }
        }
    )
    assert psql_tls(proxy, pg) == ("TLSv1.2", TLS12_CIPHER)
    with tls_client(proxy, pg) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_check_config_refuses_a_bad_curve_naming_the_key(scry_proxy, scry_cert) -> None:
    # check-config builds the TLS contexts as serve does.
    proxy = scry_proxy(
        {"tls": {"client_tls_sslmode": "require", "client_tls_ecdhcurve": "nocurve", **scry_cert}},
        start=False,
    )
    done = subprocess.run(
        [sys.executable, "-m", "scry.cli", "check-config", "-c", str(proxy.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "tls.client_tls_ecdhcurve: unknown curve 'nocurve'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_server_side_version_and_cipher_reach_postgresql(scry_proxy, pg) -> None:
    proxy = scry_proxy(
        {
            "tls": {
                "server_tls_sslmode": "require",
                "server_tls_protocols": "tlsv1.2",
                "server_tls_ciphers": TLS12_CIPHER,
            }
        }
    )
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        conn.execute("select 1")
    pids = [int(p) for p in re.findall(r"backend_pid=(\d+)", proxy.log_text())]
    assert pids
    with psycopg.connect(pg.dsn(user="postgres", sslmode="disable"), autocommit=True) as admin:
        rows = admin.execute(
            "select ssl, version, cipher from pg_stat_ssl where pid = any(%s)", (pids,)
        ).fetchall()
    assert rows and all(row == (True, "TLSv1.2", TLS12_CIPHER) for row in rows), rows
