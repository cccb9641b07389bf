"""TLS contexts for both sides, from PgBouncer-named settings (stdlib ``ssl``).

Client side (``tls.client_tls_*``): what scry presents to applications.
``disable`` answers every SSLRequest with 'N'; ``allow``/``prefer`` accept TLS
when the client asks; ``require`` refuses plaintext logins; ``verify-ca`` and
``verify-full`` also demand a client certificate signed by
``client_tls_ca_file`` (``verify-full`` additionally requires its CN to be the
user name). A CA file with the lower modes makes client certificates optional,
which ``auth.type: cert`` needs.

Server side (``tls.server_tls_*``): how scry reaches PostgreSQL.
``disable``/``allow`` connect in plaintext; ``prefer`` asks for TLS and
accepts a refusal; ``require`` insists (no silent downgrade, no certificate
check); ``verify-ca`` checks the chain against ``server_tls_ca_file``;
``verify-full`` also the host name.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from scry.config import ConfigError, TlsConfig

STRICT_MODES = ("require", "verify-ca", "verify-full")


@dataclass(frozen=True)
class ClientTls:
    mode: str
    context: ssl.SSLContext | None  # None: TLS is never offered

    @property
    def required(self) -> bool:
        return self.mode in STRICT_MODES


@dataclass(frozen=True)
class ServerTls:
    mode: str
    context: ssl.SSLContext | None  # None: plaintext only

    @property
    def required(self) -> bool:
        return self.mode in STRICT_MODES


def client_tls(config: TlsConfig) -> ClientTls:
    """The context scry uses as a TLS *server* towards applications."""
    mode = config.client_tls_sslmode
    if mode == "disable":
        return ClientTls(mode, None)
    if not config.client_tls_cert_file or not config.client_tls_key_file:
        raise ConfigError(
            f"tls.client_tls_sslmode: {mode!r} needs tls.client_tls_cert_file and "
            "tls.client_tls_key_file"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.client_tls_cert_file, config.client_tls_key_file)
        if config.client_tls_ca_file:
            context.load_verify_locations(config.client_tls_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls.client_tls_cert_file: cannot load the certificate: {exc}") from exc
    if mode in ("verify-ca", "verify-full"):
        if not config.client_tls_ca_file:
            raise ConfigError(f"tls.client_tls_sslmode: {mode!r} needs tls.client_tls_ca_file")
        context.verify_mode = ssl.CERT_REQUIRED
    elif config.client_tls_ca_file:
        context.verify_mode = ssl.CERT_OPTIONAL
    # PostgreSQL 17's direct TLS: the client starts TLS at once with ALPN "postgresql".
    context.set_alpn_protocols(["postgresql"])
    return ClientTls(mode, context)


def server_tls(config: TlsConfig) -> ServerTls:
    """The context scry uses as a TLS *client* towards PostgreSQL."""
    mode = config.server_tls_sslmode
    if mode in ("disable", "allow"):
        return ServerTls(mode, None)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if mode in ("verify-ca", "verify-full"):
            if not config.server_tls_ca_file:
                raise ConfigError(f"tls.server_tls_sslmode: {mode!r} needs tls.server_tls_ca_file")
            context.load_verify_locations(config.server_tls_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
            context.check_hostname = mode == "verify-full"
        else:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if config.server_tls_cert_file and config.server_tls_key_file:
            context.load_cert_chain(config.server_tls_cert_file, config.server_tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls.server_tls_ca_file: cannot load: {exc}") from exc
    return ServerTls(mode, context)


def peer_common_name(transport: object) -> str | None:
    """The CN of the client certificate on a TLS transport, if one was presented."""
    get = getattr(transport, "get_extra_info", None)
    cert = get("peercert") if get else None
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None
