"""TLS between applications and scry: ``tls.client_tls_*`` and ``auth.type: cert``.

scry presents the test cluster's server certificate (CN localhost, SAN
127.0.0.1, signed by ``pg.ca_cert``), so clients can use
``sslmode=verify-full`` with ``host=localhost``. Client certificates come
from ``pg.client_cert(user)``, signed by the same CA.

No silent downgrade: with ``require`` (and stricter) no plaintext login ever
gets as far as an authentication request.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

PSQL = "/usr/bin/psql"
PROTOCOL_3 = 196608
SSL_REQUEST = struct.pack("!ii", 8, 80877103)
GSSENC_REQUEST = struct.pack("!ii", 8, 80877104)


def startup(user: str = "app", database: str = "app") -> bytes:
    body = struct.pack("!i", PROTOCOL_3) + b"user\0" + user.encode() + b"\0database\0"
    body += database.encode() + b"\0\0"
    return struct.pack("!i", len(body) + 4) + body


def read_messages_until_close(sock: socket.socket | ssl.SSLSocket, limit: float = 5) -> bytes:
    sock.settimeout(limit)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ssl.SSLError, TimeoutError):
            return data
        if not chunk:
            return data
        data += chunk


def message_kinds(data: bytes) -> list[tuple[str, bytes]]:
    out, pos = [], 0
    while pos + 5 <= len(data):
        (length,) = struct.unpack_from("!i", data, pos + 1)
        out.append((chr(data[pos]), data[pos + 5 : pos + 1 + length]))
        pos += 1 + length
    return out


@pytest.fixture(scope="module")
def certs(pg, tmp_path_factory) -> dict[str, str]:
    """scry's certificate and key (a private copy, mode 0600) and the CA."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "scry.crt", d / "scry.key"
    shutil.copyfile(pg.server_cert, cert)
    shutil.copyfile(pg.server_key, key)
    os.chmod(key, 0o600)
    app_cert, app_key = pg.client_cert("app")
    other_cert, other_key = pg.client_cert("cert_user")
    return {
        "cert": str(cert),
        "key": str(key),
        "ca": str(pg.ca_cert),
        "app_cert": str(app_cert),
        "app_key": str(app_key),
        "other_cert": str(other_cert),
        "other_key": str(other_key),
    }


@pytest.fixture(scope="module")
def proxies(scry_proxy_module, certs) -> Callable[..., Any]:
    """``proxies(sslmode, auth=None, ca=True)``: one proxy per combination."""
    cache: dict[tuple[str, str | None, bool], Any] = {}

    def get(sslmode: str, auth: str | None = None, ca: bool = True):
        key = (sslmode, auth, ca)
        if key not in cache:
            tls: dict[str, Any] = {"client_tls_sslmode": sslmode}
            if sslmode != "disable":
                tls.update(client_tls_cert_file=certs["cert"], client_tls_key_file=certs["key"])
                if ca:
                    tls["client_tls_ca_file"] = certs["ca"]
            overrides: dict[str, Any] = {"tls": tls, "pool": {"size": 2}}
            if auth is not None:
                overrides["auth"] = {"type": auth}
            cache[key] = scry_proxy_module(overrides)
        return cache[key]

    return get


def conninfo(proxy, certs, sslmode: str, *, cert: str | None = None, **kw) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": "localhost",
        "hostaddr": "127.0.0.1",
        "port": proxy.port,
        "user": "app",
        "password": "app_pass",
        "dbname": "app",
        "sslmode": sslmode,
        "sslrootcert": certs["ca"],
        "connect_timeout": 10,
        "gssencmode": "disable",
    }
    if cert is not None:
        info["sslcert"] = certs[f"{cert}_cert"]
        info["sslkey"] = certs[f"{cert}_key"]
    info.update(kw)
    return {k: v for k, v in info.items() if v is not None}


def query_tls(info: dict[str, Any]) -> tuple[bool, str]:
    """Connect, run a query; return (TLS in use, current_user)."""
    with psycopg.connect(**info, autocommit=True) as conn:
        (user,) = conn.execute("select current_user").fetchone()  # type: ignore[misc]
        return bool(conn.pgconn.ssl_in_use), str(user)


# --- sslmode by sslmode --------------------------------------------------------------------


def test_disable_answers_n_and_serves_plaintext(proxies, certs) -> None:
    proxy = proxies("disable")
    assert query_tls(conninfo(proxy, certs, "prefer")) == (False, "app")
    with pytest.raises(psycopg.OperationalError, match="(?i)ssl"):
        query_tls(conninfo(proxy, certs, "require"))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(SSL_REQUEST)
        assert sock.recv(1) == b"N"


@pytest.mark.parametrize("sslmode", ["allow", "prefer"])
def test_allow_and_prefer_take_both(proxies, certs, sslmode: str) -> None:
    proxy = proxies(sslmode)
    assert query_tls(conninfo(proxy, certs, "disable")) == (False, "app")
    assert query_tls(conninfo(proxy, certs, "require")) == (True, "app")
    assert query_tls(conninfo(proxy, certs, "verify-full")) == (True, "app")


def test_require_refuses_plaintext_before_any_password(proxies, certs) -> None:
    proxy = proxies("require")
    assert query_tls(conninfo(proxy, certs, "verify-full")) == (True, "app")
    with pytest.raises(psycopg.OperationalError, match="SSL required"):
        query_tls(conninfo(proxy, certs, "disable"))
    # Raw: a plaintext StartupMessage gets a FATAL and nothing else: no
    # authentication request, no parameters, no key.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(startup())
        messages = message_kinds(read_messages_until_close(sock))
    assert [k for k, _ in messages] == ["E"], messages
    assert b"SFATAL" in messages[0][1]


def test_verify_full_hostname_checked_by_the_client(proxies, certs) -> None:
    # The certificate names localhost and 127.0.0.1; another name must fail
    # verification on the client side (proves scry presents the configured cert).
    proxy = proxies("require")
    info = conninfo(proxy, certs, "verify-full", host="scry.invalid")
    with pytest.raises(psycopg.OperationalError, match="(?i)certificate|host ?name|match"):
        query_tls(info)


def test_verify_ca_needs_a_client_certificate(proxies, certs) -> None:
    proxy = proxies("verify-ca")
    with pytest.raises(psycopg.OperationalError):
        query_tls(conninfo(proxy, certs, "verify-full"))
    assert query_tls(conninfo(proxy, certs, "verify-full", cert="app")) == (True, "app")
    # verify-ca checks the chain, not the name (PgBouncer's meaning).
    assert query_tls(conninfo(proxy, certs, "verify-full", cert="other")) == (True, "app")
    with pytest.raises(psycopg.OperationalError):
        query_tls(conninfo(proxy, certs, "disable"))


def test_verify_full_needs_the_users_certificate(proxies, certs) -> None:
    proxy = proxies("verify-full")
    assert query_tls(conninfo(proxy, certs, "verify-full", cert="app")) == (True, "app")
    with pytest.raises(psycopg.OperationalError, match="certificate authentication failed"):
        query_tls(conninfo(proxy, certs, "verify-full", cert="other"))
    with pytest.raises(psycopg.OperationalError):
        query_tls(conninfo(proxy, certs, "verify-full"))


# --- cert auth -----------------------------------------------------------------------------


def test_cert_auth_cn_is_the_user(proxies, certs) -> None:
    proxy = proxies("verify-ca", auth="cert")
    # No password at all: the certificate is the credential.
    info = conninfo(proxy, certs, "verify-full", cert="app", password=None)
    assert query_tls(info) == (True, "app")
    with pytest.raises(psycopg.OperationalError, match="certificate authentication failed"):
        query_tls(conninfo(proxy, certs, "verify-full", cert="other", password=None))
    with pytest.raises(psycopg.OperationalError):
        query_tls(conninfo(proxy, certs, "verify-full", password="app_pass"))


def test_cert_auth_with_require_and_optional_client_certificate(proxies, certs) -> None:
    proxy = proxies("require", auth="cert")
    assert query_tls(conninfo(proxy, certs, "require", cert="app", password=None)) == (True, "app")
    # TLS without a certificate is accepted by the handshake but not by cert auth.
    with pytest.raises(psycopg.OperationalError, match="certificate authentication failed"):
        query_tls(conninfo(proxy, certs, "require", password="app_pass"))


def test_cert_rule_with_a_user_name_map(scry_proxy_module, certs, tmp_path_factory) -> None:
    """An HBA cert rule with map=: the certificate's CN logs in as the users
    the map names for it, and only those (its own name no longer counts)."""
    d = tmp_path_factory.mktemp("maps")
    (d / "hba.conf").write_text("hostssl all all 127.0.0.1/32 cert map=certs\n")
    (d / "ident.conf").write_text("certs  /^cert_(user)$  app\n")
    proxy = scry_proxy_module(
        {
            "tls": {
                "client_tls_sslmode": "verify-ca",
                "client_tls_cert_file": certs["cert"],
                "client_tls_key_file": certs["key"],
                "client_tls_ca_file": certs["ca"],
            },
            "auth": {
                "type": "hba",
                "auth_hba_file": str(d / "hba.conf"),
                "auth_ident_file": str(d / "ident.conf"),
            },
        }
    )
    mapped = conninfo(proxy, certs, "verify-full", cert="other", password=None)  # CN cert_user
    assert query_tls(mapped) == (True, "app")
    with pytest.raises(psycopg.OperationalError, match="certificate authentication failed"):
        query_tls(conninfo(proxy, certs, "verify-full", cert="app", password=None))


def test_psql_verify_full_with_client_certificate(proxies, certs) -> None:
    proxy = proxies("verify-full", auth="cert")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(
        PGSSLMODE="verify-full",
        PGSSLROOTCERT=certs["ca"],
        PGSSLCERT=certs["app_cert"],
        PGSSLKEY=certs["app_key"],
        PGCONNECT_TIMEOUT="10",
        PGGSSENCMODE="disable",
    )
    proc = subprocess.run(
        [PSQL, "-X", "-At", "-h", "localhost", "-p", str(proxy.port), "-U", "app", "-d", "app",
         "-w", "-c", "select current_user, ssl from pg_stat_ssl where pid = pg_backend_pid()"],
        capture_output=True, text=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # current_user is app; the proxy's own link to PostgreSQL may or may not be TLS.
    assert proc.stdout.strip().split("|")[0] == "app", proc.stdout


# --- the startup dance, byte by byte ---------------------------------------------------------


def test_gssenc_request_answered_n_then_tls(proxies, certs) -> None:
    proxy = proxies("require")
    context = ssl.create_default_context(cafile=certs["ca"])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(GSSENC_REQUEST)
        assert sock.recv(1) == b"N"
        sock.sendall(SSL_REQUEST)
        assert sock.recv(1) == b"S"
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            tls.sendall(startup())
            tls.settimeout(5)
            first = tls.recv(65536)
            assert first[:1] == b"R", first  # the authentication request, over TLS


def test_gssenc_then_plaintext_startup_refused_under_require(proxies) -> None:
    proxy = proxies("require")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(GSSENC_REQUEST)
        assert sock.recv(1) == b"N"
        sock.sendall(startup())
        messages = message_kinds(read_messages_until_close(sock))
    assert [k for k, _ in messages] == ["E"], messages


def test_plaintext_after_s_is_not_a_downgrade(proxies) -> None:
    # The client asks for TLS, gets 'S', then speaks plaintext: the handshake
    # fails and the connection ends; no protocol message is ever answered.
    proxy = proxies("require")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(SSL_REQUEST)
        assert sock.recv(1) == b"S"
        sock.sendall(startup())
        data = read_messages_until_close(sock)
    assert b"SCRAM" not in data and not data.startswith(b"R"), data
    assert data[:1] in (b"", b"\x15"), data  # nothing, or a TLS alert record


def test_tls_handshake_garbage_does_not_hurt_the_proxy(proxies, certs) -> None:
    proxy = proxies("require")
    for junk in (b"\x16\x03\x01\x00\x05hello", os.urandom(300), b""):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(SSL_REQUEST)
            assert sock.recv(1) == b"S"
            if junk:
                sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            read_messages_until_close(sock)
    assert query_tls(conninfo(proxy, certs, "verify-full")) == (True, "app")


def test_direct_tls_negotiation(proxies, certs) -> None:
    # libpq 17+ can skip the SSLRequest and start TLS at once (ALPN "postgresql").
    if psycopg.pq.version() < 170000:
        pytest.skip("libpq older than 17: no sslnegotiation=direct")
    proxy = proxies("require")
    info = conninfo(proxy, certs, "verify-full", sslnegotiation="direct")
    assert query_tls(info) == (True, "app")


def test_no_key_file_left_readable(certs) -> None:
    # (guards the fixture: libpq refuses keys readable by others)
    for name in ("key", "app_key", "other_key"):
        assert Path(certs[name]).stat().st_mode & 0o077 == 0
