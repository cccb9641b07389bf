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

import re
import ssl
from dataclasses import dataclass

from scry.config import ConfigError, TlsConfig

STRICT_MODES = ("require", "verify-ca", "verify-full")

# PgBouncer's ``*_tls_protocols`` names, oldest first, and its shortcuts.
_VERSIONS = {
    "tlsv1.0": ssl.TLSVersion.TLSv1,
    "tlsv1.1": ssl.TLSVersion.TLSv1_1,
    "tlsv1.2": ssl.TLSVersion.TLSv1_2,
    "tlsv1.3": ssl.TLSVersion.TLSv1_3,
}
_VERSION_SHORTCUTS = {
    "secure": ("tlsv1.2", "tlsv1.3"),
    "all": tuple(_VERSIONS),
    "legacy": tuple(_VERSIONS),
}
# PgBouncer's ``*_tls_ciphers`` shortcuts (its TLS library's cipher lists);
# ``default`` and ``secure`` keep the ssl module's own list, which is stricter.
_CIPHER_SHORTCUTS = {
    "compat": "HIGH:+3DES:!aNULL",
    "legacy": "HIGH:+3DES:!aNULL",
    "insecure": "ALL:!aNULL:!eNULL",
    "all": "ALL:!aNULL:!eNULL",
    "normal": "HIGH+EECDH:HIGH+EDH:HIGH+RSA:+SHA384:+SHA256:+SSLv3:+EDH:+RSA:-3DES:3DES+RSA"
    ":!CAMELLIA:!DSS:!aNULL",
    "fast": "HIGH+EECDH:HIGH+EDH:HIGH+RSA:+AES256:+SHA256:+SHA384:+SSLv3:+EDH:+RSA:-3DES"
    ":3DES+RSA:!CAMELLIA:!DSS:!aNULL",
}


def version_range(value: str, key: str) -> tuple[ssl.TLSVersion, ssl.TLSVersion]:
    """The lowest and highest TLS version of a PgBouncer ``*_tls_protocols`` value
    (``tlsv1.2,tlsv1.3``, ``secure``, ``all``); they must be consecutive."""
    names = set()
    for word in re.split(r"[\s,:]+", value.strip().lower()):
        if word in _VERSION_SHORTCUTS:
            names.update(_VERSION_SHORTCUTS[word])
        elif word in _VERSIONS:
            names.add(word)
        elif word:
            raise ConfigError(
                f"{key}: unknown TLS version {word!r} (tlsv1.0 to tlsv1.3, secure, all)"
            )
    order = [i for i, name in enumerate(_VERSIONS) if name in names]
    if not order:
        raise ConfigError(f"{key}: names no TLS version")
    if order != list(range(order[0], order[-1] + 1)):
        raise ConfigError(f"{key}: the versions must be consecutive, e.g. tlsv1.2,tlsv1.3")
    versions = list(_VERSIONS.values())
    return versions[order[0]], versions[order[-1]]


def _restrict(context: ssl.SSLContext, protocols: str, ciphers: str, side: str) -> None:
    """Apply ``tls.<side>_tls_protocols`` and ``tls.<side>_tls_ciphers``."""
    context.minimum_version, context.maximum_version = version_range(
        protocols, f"tls.{side}_tls_protocols"
    )
    if ciphers.strip().lower() in ("default", "secure"):
        return
    try:
        context.set_ciphers(_CIPHER_SHORTCUTS.get(ciphers.strip().lower(), ciphers))
    except ssl.SSLError:
        raise ConfigError(
            f"tls.{side}_tls_ciphers: OpenSSL accepts no cipher of {ciphers!r}"
        ) from None


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
    _restrict(context, config.client_tls_protocols, config.client_tls_ciphers, "client")
    curve = config.client_tls_ecdhcurve.strip()
    if curve.lower() not in ("auto", "secure"):
        try:
            context.set_ecdh_curve(curve)
        except (ValueError, ssl.SSLError):
            raise ConfigError(f"tls.client_tls_ecdhcurve: unknown curve {curve!r}") from None
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
    _restrict(context, config.server_tls_protocols, config.server_tls_ciphers, "server")
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
