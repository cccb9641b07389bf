"""TLS versions and ciphers (scry.tls), with PgBouncer's names: the contexts
they build and the errors that name the key."""

from __future__ import annotations

import ssl

import pytest

from scry.config import ConfigError, TlsConfig
from scry.tls import server_tls, version_range

V = ssl.TLSVersion


@pytest.mark.parametrize(
    ("value", "low", "high"),
    [
        ("secure", V.TLSv1_2, V.TLSv1_3),
        ("tlsv1.3", V.TLSv1_3, V.TLSv1_3),
        ("TLSv1.2", V.TLSv1_2, V.TLSv1_2),
        ("tlsv1.1, tlsv1.2", V.TLSv1_1, V.TLSv1_2),
        ("tlsv1.2:tlsv1.3", V.TLSv1_2, V.TLSv1_3),
        ("all", V.TLSv1, V.TLSv1_3),
        ("legacy", V.TLSv1, V.TLSv1_3),
    ],
)
def test_protocol_lists(value: str, low: ssl.TLSVersion, high: ssl.TLSVersion) -> None:
    assert version_range(value, "key") == (low, high)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("tlsv1.0,tlsv1.3", "consecutive"),
        ("sslv3", "unknown TLS version 'sslv3'"),
        ("", "names no TLS version"),
    ],
)
def test_bad_protocol_lists_name_the_key(value: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=f"tls.server_tls_protocols: .*{problem}"):
        server_tls(TlsConfig(server_tls_sslmode="require", server_tls_protocols=value))


def test_server_context_gets_versions_and_ciphers() -> None:
    tls = server_tls(
        TlsConfig(
            server_tls_sslmode="require",
            server_tls_protocols="tlsv1.2",
            server_tls_ciphers="ECDHE-RSA-AES128-GCM-SHA256",
        )
    )
    context = tls.context
    assert context is not None
    assert (context.minimum_version, context.maximum_version) == (V.TLSv1_2, V.TLSv1_2)
    tls12 = [c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12 == ["ECDHE-RSA-AES128-GCM-SHA256"]


def test_pgbouncer_cipher_shortcuts_are_accepted_and_default_keeps_the_ssl_modules() -> None:
    default = server_tls(TlsConfig(server_tls_sslmode="require")).context
    assert default is not None
    plain = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    assert [c["name"] for c in default.get_ciphers()] == [c["name"] for c in plain.get_ciphers()]
    for name in ("secure", "compat", "legacy", "normal", "fast", "all", "insecure"):
        assert server_tls(TlsConfig(server_tls_sslmode="require", server_tls_ciphers=name)).context


def test_unknown_ciphers_name_the_key() -> None:
    with pytest.raises(ConfigError, match="tls.server_tls_ciphers: OpenSSL accepts no cipher"):
        server_tls(TlsConfig(server_tls_sslmode="require", server_tls_ciphers="NO-SUCH-CIPHER"))
