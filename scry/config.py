"""scry's configuration: a plain, validated object with no CLI dependency.

Layers, lowest priority first:

1. the defaults declared on the models below (PgBouncer's, where PgBouncer has
   the same setting);
2. the YAML file (``load_config(path)``);
3. environment variables ``SCRY_<PATH>``, where PATH is the dotted key path
   upper-cased with ``.`` replaced by ``__`` (``SCRY_POOL__SIZE=50``);
4. explicit overrides from the command line (``load_config(..., overrides=...)``).

Every model refuses unknown keys. Any problem, whether a YAML syntax error, a
wrong type, an unknown key or a bad URL, is raised as one :class:`ConfigError`
whose message names each offending key path, what was expected and what was
found, so that nothing starts half-configured.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from scry.log import SYSLOG_FACILITIES, Syslog
from scry.protocol.auth import SCRAM_MIN_ITERATIONS

__all__ = [
    "AdminConfig",
    "AuthConfig",
    "CircuitBreakerConfig",
    "Config",
    "ConfigError",
    "DatabaseConfig",
    "DatabaseTarget",
    "EventsConfig",
    "HealthConfig",
    "HotDataConfig",
    "LogConfig",
    "NON_CONFIG_ENV_VARS",
    "ObservabilityConfig",
    "PoolConfig",
    "PgbouncerCompatConfig",
    "PgbouncerUserOverride",
    "PoolOverride",
    "TimeoutsConfig",
    "TlsConfig",
    "UserEntry",
    "is_loopback_host",
    "load_config",
    "split_host_port",
]

ENV_PREFIX = "SCRY_"
#: ``SCRY_*`` variables that are not config paths (used by the CLI itself).
NON_CONFIG_ENV_VARS = frozenset({"SCRY_CONFIG", "SCRY_ADMIN_TOKEN"})
MASK = "***"


class ConfigError(Exception):
    """The configuration cannot be used; the message is meant for the operator.

    ``problems`` holds one line per offending key (``"pool.size: expected an
    integer, found 'abc'"``); ``source`` is the file name when there is one.
    """

    def __init__(
        self, message: str, *, problems: list[str] | None = None, source: str | None = None
    ):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]
        self.source = source


# --------------------------------------------------------------------------- #
# Small value types and helpers
# --------------------------------------------------------------------------- #


def _problem(path: str, message: str) -> PydanticCustomError:
    """An error raised from a validator that names a field below the current model.

    Pydantic locates model-level errors at the model itself; the ``field`` in
    the context lets :func:`_format_validation_error` point at the exact key.
    """
    return PydanticCustomError("scry_problem", "{detail}", {"field": path, "detail": message})


def _reject_bool(value: Any) -> Any:
    # Pydantic's lax mode turns true/false into 1/0; ``size: yes`` is a mistake.
    if isinstance(value, bool):
        raise PydanticCustomError("bool_not_number", "expected a number, found a boolean")
    return value


Int = Annotated[int, BeforeValidator(_reject_bool)]
Float = Annotated[float, BeforeValidator(_reject_bool)]
Seconds = Annotated[float, BeforeValidator(_reject_bool), Field(ge=0)]
SslMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
#: ``statement`` is PgBouncer's statement pooling (see scry.pgbouncer).
PoolMode = Literal["session", "transaction", "hybrid", "statement"]


def join_host_port(host: str, port: int | str) -> str:
    """``host:port``, with an IPv6 address in brackets (split_host_port's inverse)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(addr: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6addr]:port"`` into its parts.

    Raises ValueError with a readable message when the address is malformed.
    """
    addr = addr.strip()
    if addr.startswith("["):
        host, sep, rest = addr[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"expected '[ipv6]:port', found {addr!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = addr.rpartition(":")
        if not sep:
            raise ValueError(f"expected 'host:port', found {addr!r}")
        if ":" in host:
            raise ValueError(f"an IPv6 address needs brackets ('[::1]:6432'), found {addr!r}")
    if not host:
        raise ValueError(f"expected 'host:port' with a host, found {addr!r}")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected a port between 0 and 65535, found {port_text!r}")
    return host, int(port_text)


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 (other names count as non-loopback)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _validate_listen_addr(value: str) -> str:
    try:
        split_host_port(value)
    except ValueError as exc:
        raise PydanticCustomError("listen_addr", str(exc)) from None
    return value


class _Model(BaseModel):
    """Base for every config section: unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #


class PoolConfig(_Model):
    """Server-connection pool settings (per database and user)."""

    mode: PoolMode = "hybrid"
    size: Int = Field(20, ge=1)
    min_size: Int = Field(0, ge=0)
    reserve_size: Int = Field(0, ge=0)
    max_client_conn: Int = Field(1000, ge=1)
    idle_unpin_seconds: Seconds = 300
    max_prepared_statements: Int = Field(200, ge=0)
    server_reset_query: str = "DISCARD ALL"
    server_reset_query_always: bool = False
    #: PgBouncer's connect_query: run on each new server before any client gets
    #: it (errors are logged and ignored). Empty = none.
    connect_query: str = ""
    #: PgBouncer's: server connections to one database (all users' pools
    #: together) and of one server user (all databases); 0 = no limit.
    #: Room is made by closing an idle server of another pool (scry.connection_limits).
    max_db_connections: Int = Field(0, ge=0)
    max_user_connections: Int = Field(0, ge=0)
    #: PgBouncer's: clients of one database and of one (client) user; 0 = no
    #: limit. More get 53300, as past max_client_conn.
    max_db_client_connections: Int = Field(0, ge=0)
    max_user_client_connections: Int = Field(0, ge=0)
    #: PgBouncer's: hand out the idle server that has waited longest (FIFO)
    #: instead of the most recently used one (LIFO, warm caches), so that load
    #: spreads evenly over servers behind a host list or a load balancer.
    server_round_robin: bool = False
    #: PgBouncer's: a server that RECONNECT or a reload marks to close is taken
    #: from a session (session mode, a pinned hybrid client) once no transaction
    #: is open on it, instead of when the session ends (scry.client).
    server_fast_close: bool = False
    #: PgBouncer's per-database server_lifetime; None: ``timeouts.server_lifetime``.
    server_lifetime: Seconds | None = None
    #: PgBouncer's per-database (and per-user) query_wait_timeout; None:
    #: ``timeouts.query_wait_timeout``.
    query_wait_timeout: Seconds | None = None

    @model_validator(mode="after")
    def _min_not_above_size(self) -> PoolConfig:
        if self.min_size > self.size:
            raise _problem("min_size", f"must not exceed size ({self.size}), found {self.min_size}")
        return self


class PoolOverride(_Model):
    """Per-database pool settings; ``None`` inherits the top-level ``pool:`` value."""

    mode: PoolMode | None = None
    size: Int | None = Field(None, ge=1)
    min_size: Int | None = Field(None, ge=0)
    reserve_size: Int | None = Field(None, ge=0)
    max_client_conn: Int | None = Field(None, ge=1)
    idle_unpin_seconds: Seconds | None = None
    max_prepared_statements: Int | None = Field(None, ge=0)
    server_reset_query: str | None = None
    server_reset_query_always: bool | None = None
    connect_query: str | None = None
    max_db_connections: Int | None = Field(None, ge=0)
    max_user_connections: Int | None = Field(None, ge=0)
    max_db_client_connections: Int | None = Field(None, ge=0)
    max_user_client_connections: Int | None = Field(None, ge=0)
    server_round_robin: bool | None = None
    server_fast_close: bool | None = None
    server_lifetime: Seconds | None = None
    query_wait_timeout: Seconds | None = None

    def merged_with(self, base: PoolConfig) -> PoolConfig:
        """The effective pool settings: ``base`` with this override's set fields."""
        return PoolConfig.model_validate(
            {**base.model_dump(), **self.model_dump(exclude_none=True)}
        )


class DatabaseConfig(_Model):
    """One entry of ``databases:``: where a client-visible database really lives."""

    database_url: str
    pool: PoolOverride | None = None
    #: PgBouncer's per-database auth_user / auth_dbname / auth_query: override
    #: ``auth.*`` here.
    auth_user: str | None = None
    auth_dbname: str | None = None
    auth_query: str | None = None


class UserEntry(_Model):
    """An inline user; ``password`` is plaintext, ``md5<32 hex>`` or ``SCRAM-SHA-256$...``."""

    name: str = Field(min_length=1)
    password: str | None = None


#: PgBouncer's default auth_query: no secret for an expired or NOLOGIN role.
DEFAULT_AUTH_QUERY = (
    "SELECT rolname, CASE WHEN rolvaliduntil < now() THEN NULL ELSE rolpassword END "
    "FROM pg_authid WHERE rolname=$1 AND rolcanlogin"
)


class AuthConfig(_Model):
    """Client authentication, with PgBouncer's names."""

    type: Literal["trust", "md5", "scram-sha-256", "cert", "hba", "plain", "any"] = "scram-sha-256"
    auth_file: str | None = None
    #: type hba: the pg_hba.conf-format rules that choose the method (scry.hba).
    auth_hba_file: str | None = None
    #: type hba: user name maps (pg_ident.conf's format, scry.ident) that the
    #: HBA file's ``peer`` and ``cert`` rules name with ``map=``.
    auth_ident_file: str | None = None
    #: A user with no secret in ``users``/``auth_file`` is looked up at login by
    #: running ``auth_query`` ($1 = the user name) as ``auth_user``, in the
    #: client's database or in ``auth_dbname`` (scry.auth_query).
    auth_query: str = DEFAULT_AUTH_QUERY
    auth_user: str | None = None
    auth_dbname: str | None = None
    users: list[UserEntry] = Field(default_factory=list)
    #: PgBouncer's: PBKDF2 rounds of the SCRAM secrets scry makes from plaintext
    #: passwords (a client computes as many at each SCRAM login). Secrets stored
    #: as SCRAM keep their own. At least RFC 7677's 4096, which scramp enforces.
    scram_iterations: Int = Field(SCRAM_MIN_ITERATIONS, ge=SCRAM_MIN_ITERATIONS)

    @model_validator(mode="after")
    def _hba_needs_its_file(self) -> AuthConfig:
        if self.type == "hba" and not self.auth_hba_file:
            raise _problem("auth_hba_file", "is required when auth.type is hba")
        return self


class TimeoutsConfig(_Model):
    """Timeouts in seconds, 0 = disabled; PgBouncer's meanings and defaults."""

    query_wait_timeout: Seconds = 120
    #: A client queued this long is told so with a NOTICE, once per wait.
    query_wait_notify: Seconds = 5
    #: A client queued this long may get one of ``pool.reserve_size`` extra servers.
    reserve_pool_timeout: Seconds = 5
    query_timeout: Seconds = 0
    idle_transaction_timeout: Seconds = 0
    #: A transaction (idle or not) this old ends: the client is closed, as in PgBouncer 1.25.
    transaction_timeout: Seconds = 0
    client_idle_timeout: Seconds = 0
    server_lifetime: Seconds = 3600
    server_idle_timeout: Seconds = 600
    server_connect_timeout: Seconds = 15
    #: The longest a CancelRequest may take to reach PostgreSQL (or the peer
    #: that owns it) and be acted on; the backend stays out of the pool until
    #: then. PgBouncer's name and default.
    cancel_wait_timeout: Seconds = 10
    #: PgBouncer's: a pool (database and user) with no client and no server
    #: connection for this long is freed, its statistics with it; 0 keeps them.
    pool_idle_timeout: Seconds = 0
    #: The longest wait between retries of a failing server login: 0.2 s,
    #: doubling up to this (at least 0.1 s); and how often a login is tried
    #: after half a minute of failures while the breaker is open.
    #: PgBouncer's default is 15, which it always waits.
    server_login_retry: Seconds = 5
    client_login_timeout: Seconds = 60
    server_check_delay: Seconds = 30
    server_check_query: str = "select 1"
    #: 0 = a graceful shutdown waits for clients forever.
    shutdown_timeout: Seconds = 0


class CircuitBreakerConfig(_Model):
    """The per-database circuit breaker (docs/breaker.md)."""

    enabled: bool = True
    failure_threshold: Int = Field(5, ge=1)
    success_threshold: Int = Field(3, ge=1)
    timeout_seconds: Seconds = 30
    #: Transactions let through at once while half-open. One, as Hystrix does: a
    #: recovering server gets one probe at a time, and success_threshold of them in
    #: a row close the breaker.
    half_open_max_probes: Int = Field(1, ge=1)


class HealthConfig(_Model):
    """Health-monitor thresholds (the predictive breaker); reasoning in docs/breaker.md."""

    predictive: bool = False
    #: The rolling window the rules look at: long enough for a p99 at modest
    #: traffic, short next to the breaker's timeout.
    window_seconds: Int = Field(10, ge=2, le=300)
    #: "Normal" is an EWMA of the window with this half-life: slow enough that a
    #: spike stands out, fast enough that a permanent change stops alarming.
    baseline_half_life_seconds: Float = Field(300, gt=0)
    #: Latency spike: window p99 above this many times the baseline p99 ...
    latency_spike_factor: Float = Field(3.0, gt=1)
    #: ... and above this absolute floor (1 ms -> 4 ms is noise, not sickness).
    latency_floor_ms: Float = Field(50, ge=0)
    #: Error-rate anomaly: the share of server-sickness errors above
    #: max(error_rate_floor, error_rate_factor x baseline rate).
    error_rate_floor: Float = Field(0.1, ge=0, le=1)
    error_rate_factor: Float = Field(3.0, ge=1)
    #: Saturation: active/size at or above this, with clients waiting, sustained.
    saturation_threshold: Float = Field(0.9, gt=0, le=1)
    #: Starvation: a client waited this long for a server (well under
    #: timeouts.query_wait_timeout, so operators hear before clients get errors).
    starvation_seconds: Seconds = 5
    #: How long a rule must hold before its signal is critical (and, with
    #: predictive: true, opens the breaker); above window_seconds so that one bad
    #: second smeared across the window cannot do it alone.
    sustain_seconds: Seconds = 15
    #: Queries a window needs before latency and error-rate rules judge it.
    min_samples: Int = Field(50, ge=1)


class AdminConfig(_Model):
    """The admin HTTP endpoint."""

    listen_addr: str = "127.0.0.1:6480"
    token: str | None = None
    #: Read at load time into ``token`` (whitespace stripped) when ``token`` is unset.
    token_file: str | None = None
    read_only: bool = False
    enabled: bool = True
    #: Serve ``/metrics`` without the token (for Prometheus scrapers that send none).
    metrics_public: bool = False
    #: TLS for the admin listener: both files, or neither (plain HTTP).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    _check_addr = field_validator("listen_addr")(_validate_listen_addr)

    @model_validator(mode="after")
    def _resolve_token(self) -> AdminConfig:
        if self.token is None and self.token_file is not None:
            self.token = _read_secret_file(self.token_file, "token_file")
        elif self.token is not None and (
            not self.token.strip() or self.token != self.token.strip()
        ):
            # HTTP drops a header's outer whitespace: no client could send it.
            raise _problem("token", "must not be blank nor begin or end with whitespace")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise _problem(missing, "admin TLS needs both tls_cert_file and tls_key_file")
        host, _ = split_host_port(self.listen_addr)
        if self.enabled and not self.token and not is_loopback_host(host):
            # An unauthenticated admin API on the network could kill clients.
            raise _problem(
                "listen_addr",
                f"a non-loopback address ({self.listen_addr!r}) needs admin.token "
                "or admin.token_file",
            )
        return self


class HotDataConfig(_Model):
    """The hot-data sketch (count-min + top-k)."""

    top_k: Int = Field(50, ge=1)
    width: Int = Field(2048, ge=1)
    depth: Int = Field(4, ge=1)


class EventsConfig(_Model):
    """Where per-query events are shipped."""

    sink: Literal["none", "file", "http"] = "none"
    path: str | None = None
    url: str | None = None
    batch_size: Int = Field(100, ge=1)
    flush_interval_ms: Int = Field(1000, ge=1)
    #: After shipping, wait up to this long for more full batches (or until
    #: 16 batches, at most half the buffer, are waiting), so that a busy
    #: proxy ships in few large trips; 0 ships every full batch at once.
    linger_ms: Int = Field(100, ge=0)
    buffer_capacity: Int = Field(10000, ge=1)
    compression: Literal["gzip", "none"] = "gzip"

    @model_validator(mode="after")
    def _sink_has_destination(self) -> EventsConfig:
        if self.sink == "file" and not self.path:
            raise _problem("path", "sink 'file' needs a path")
        if self.sink == "http" and not self.url:
            raise _problem("url", "sink 'http' needs a url")
        return self


class ObservabilityConfig(_Model):
    """Fingerprinting, anonymization, hot data and the event pipeline."""

    fingerprinting: bool = True
    anonymize: bool = True
    anonymize_key: str | None = None
    #: Read at load time into ``anonymize_key`` when that is unset.
    anonymize_key_file: str | None = None
    max_fingerprints: Int = Field(5000, ge=1)
    hot_data: HotDataConfig = Field(default_factory=HotDataConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)

    @model_validator(mode="after")
    def _resolve_key(self) -> ObservabilityConfig:
        if self.anonymize_key is None and self.anonymize_key_file is not None:
            self.anonymize_key = _read_secret_file(self.anonymize_key_file, "anonymize_key_file")
        return self


class PgbouncerUserOverride(_Model):
    """One line of a pgbouncer.ini ``[users]`` section (what scry applies of it)."""

    pool_mode: PoolMode | None = None
    pool_size: Int | None = Field(None, ge=1)
    reserve_pool_size: Int | None = Field(None, ge=0)
    max_user_connections: Int | None = Field(None, ge=0)
    max_user_client_connections: Int | None = Field(None, ge=0)
    #: This user's clients' timeouts, over ``timeouts.*`` (PgBouncer's user-level ones).
    query_timeout: Seconds | None = None
    idle_transaction_timeout: Seconds | None = None
    transaction_timeout: Seconds | None = None
    client_idle_timeout: Seconds | None = None
    #: Of this user's pools, over the database's and ``timeouts.*``.
    query_wait_timeout: Seconds | None = None

    def pool_override(self) -> PoolOverride:
        """What this line changes in the pools of the user (over the database's)."""
        return PoolOverride(
            mode=self.pool_mode, size=self.pool_size, reserve_size=self.reserve_pool_size,
            max_user_connections=self.max_user_connections,
            max_user_client_connections=self.max_user_client_connections,
            query_wait_timeout=self.query_wait_timeout,
        )  # fmt: skip


#: The timeouts a ``[users]`` line may set for that user's clients.
USER_TIMEOUTS = (
    "query_timeout", "idle_transaction_timeout", "transaction_timeout", "client_idle_timeout",
)  # fmt: skip


class PgbouncerCompatConfig(_Model):
    """PgBouncer-only settings, filled from a pgbouncer.ini (``scry.pgbouncer.ini``).

    Present only when scry runs from a pgbouncer.ini; it enables the ``pgbouncer``
    admin console database and, with ``unix_socket_dir``, the Unix socket listener.
    """

    admin_users: list[str] = Field(default_factory=list)
    stats_users: list[str] = Field(default_factory=list)
    #: Where ``.s.PGSQL.<port>`` is created; None or "" = no Unix socket.
    unix_socket_dir: str | None = None
    unix_socket_mode: Int = Field(0o777, ge=0, le=0o7777)
    unix_socket_group: str | None = None
    logfile: str | None = None
    pidfile: str | None = None
    #: The operating-system user to switch to after startup (``user``; ``-u``
    #: wins), when started as root: scry.pgbouncer.account.
    user: str | None = None
    ignore_startup_parameters: list[str] = Field(default_factory=list)
    #: Seconds over which SHOW STATS averages are computed.
    stats_period: Int = Field(60, ge=1)
    #: PgBouncer's peer_id; the ini also sets the top-level ``peer_id`` (scry.peering).
    peer_id: Int = Field(0, ge=0, le=16383)
    #: The ``[users]`` section: per-user pool overrides.
    users: dict[str, PgbouncerUserOverride] = Field(default_factory=dict)
    #: The ``*`` fallback database: used for any database name not configured.
    autodb: DatabaseConfig | None = None
    #: A database made from ``*`` that nothing used for this long is forgotten
    #: (its pools and breaker too); 0 = never.
    autodb_idle_timeout: Seconds = 3600
    #: How long SUSPEND waits for a connection's unsent data to go out before
    #: it closes that connection; 0 = wait as long as it takes.
    suspend_timeout: Seconds = 10
    #: The pgbouncer.ini this came from (RELOAD / SIGHUP re-read it).
    conffile: str | None = None


class TlsConfig(_Model):
    """TLS on both sides, PgBouncer's names."""

    client_tls_sslmode: SslMode = "disable"
    client_tls_cert_file: str | None = None
    client_tls_key_file: str | None = None
    client_tls_ca_file: str | None = None
    #: TLS versions allowed (``tlsv1.2,tlsv1.3``; ``secure``, ``all``) and TLS
    #: 1.2 cipher list (OpenSSL syntax or PgBouncer's names), as in PgBouncer; see scry.tls.
    client_tls_protocols: str = "secure"
    client_tls_ciphers: str = "default"
    #: The ECDH curve of key exchanges (``auto``: OpenSSL's choice).
    client_tls_ecdhcurve: str = "auto"
    server_tls_sslmode: SslMode = "prefer"
    server_tls_ca_file: str | None = None
    server_tls_cert_file: str | None = None
    server_tls_key_file: str | None = None
    server_tls_protocols: str = "secure"
    server_tls_ciphers: str = "default"


class LogConfig(_Model):
    """Logging to stderr."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"
    log_queries: bool = False
    #: Log each login and each close (of clients and of servers), as
    #: PgBouncer's log_connections and log_disconnections; at level info.
    connections: bool = True
    disconnections: bool = True
    #: With ``disconnections`` off, still log each error that closes a client
    #: (PgBouncer's log_pooler_errors); with it on, the close line says it.
    pooler_errors: bool = True
    #: PgBouncer's log_stats: every this many seconds, a ``stats`` line per
    #: database with traffic (scry.stats_log); 0 = never.
    stats_period: Seconds = 0
    #: Also send every line to syslog (PgBouncer's syslog, syslog_ident,
    #: syslog_facility); ``syslog_address`` is a Unix datagram socket's path
    #: or ``host:port`` (UDP).
    syslog: bool = False
    syslog_ident: str = "scry"
    syslog_facility: str = "daemon"
    syslog_address: str = "/dev/log"

    @field_validator("syslog_facility")
    @classmethod
    def _known_facility(cls, value: str) -> str:
        if value not in SYSLOG_FACILITIES:
            raise ValueError(f"not a syslog facility: {value!r} (e.g. daemon, user, local0)")
        return value

    def syslog_target(self) -> Syslog | None:
        """Where syslog lines go, when ``syslog`` is on (for ``setup_logging``)."""
        if not self.syslog:
            return None
        return Syslog(self.syslog_ident, self.syslog_facility, self.syslog_address)


def _read_secret_file(path: str, key: str) -> str:
    try:
        value = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise _problem(key, f"cannot read {path!r}: {exc.strerror or exc}") from None
    if not value:
        raise _problem(key, f"{path!r} is empty")
    return value


# --------------------------------------------------------------------------- #
# Database URLs and targets
# --------------------------------------------------------------------------- #


#: How a database's hosts share its new server connections (PgBouncer's and
#: libpq's ``load_balance_hosts``; see scry.hosts).
LoadBalanceHosts = Literal["round-robin", "disable", "random"]
LOAD_BALANCE_HOSTS: tuple[str, ...] = typing.get_args(LoadBalanceHosts)
#: Which kind of session a server must have (libpq's ``target_session_attrs``).
TargetSessionAttrs = Literal[
    "any", "read-write", "read-only", "primary", "standby", "prefer-standby"
]
TARGET_SESSION_ATTRS: tuple[str, ...] = typing.get_args(TargetSessionAttrs)


@dataclass(frozen=True)
class DatabaseTarget:
    """A backend database as the pool sees it; ``name`` is what clients ask for.

    ``hosts`` holds one (host, port) or more: a list is tried in the order
    ``load_balance_hosts`` gives, past hosts whose session is not the kind
    ``target_session_attrs`` wants (scry.hosts).
    """

    name: str
    hosts: tuple[tuple[str, int], ...]
    dbname: str
    user: str | None
    password: str | None
    params: dict[str, str] = field(default_factory=dict)
    pool: PoolConfig = field(default_factory=PoolConfig)
    auth_user: str | None = None  # (this database's, over auth.auth_user)
    auth_dbname: str | None = None
    auth_query: str | None = None
    load_balance_hosts: LoadBalanceHosts = "round-robin"
    target_session_attrs: TargetSessionAttrs = "any"

    @property
    def host(self) -> str:
        """The host list as PgBouncer shows it (SHOW DATABASES): names joined by commas."""
        return ",".join(host for host, _ in self.hosts)

    @property
    def port(self) -> int:
        """The first host's port (the only one, unless ports differ per host)."""
        return self.hosts[0][1]

    def __repr__(self) -> str:
        # Never print the password, even by accident in a log line.
        password = MASK if self.password is not None else None
        return (
            f"DatabaseTarget(name={self.name!r}, hosts={self.hosts!r}, "
            f"dbname={self.dbname!r}, user={self.user!r}, password={password!r}, "
            f"params={self.params!r})"
        )


@dataclass(frozen=True)
class _ParsedUrl:
    hosts: tuple[tuple[str, int], ...]
    dbname: str | None
    user: str | None
    password: str | None
    params: dict[str, str]
    load_balance_hosts: LoadBalanceHosts
    target_session_attrs: TargetSessionAttrs


def _parse_database_url(url: str) -> _ParsedUrl:
    """Parse a libpq-style URL; raises ValueError with a readable message.

    As in libpq, several hosts are a comma-separated list, in the authority
    (``h1:5432,h2:5433``) or in ``host=`` with ``port=`` holding one port for
    all or one per host.
    """
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(
            f"expected a postgres:// or postgresql:// URL, found {redact_secrets(url)!r}"
        )
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    # libpq lets connection parameters live in the query string too.
    user = params.pop("user", None) or (unquote(parts.username) if parts.username else None)
    password = params.pop("password", None)
    if password is None and parts.password is not None:
        password = unquote(parts.password)
    listed = _authority_hosts(parts.netloc.rpartition("@")[2], url)
    hosts = [host for host, _ in listed]
    ports = [port for _, port in listed]
    host_param = params.pop("host", None)
    if host_param:
        hosts = [host.strip() for host in host_param.split(",")]
    port_param = params.pop("port", None)
    if port_param:
        ports = [_port(port.strip()) for port in port_param.split(",")]
    if len(ports) == 1:
        ports *= len(hosts)
    elif len(ports) != len(hosts):
        raise ValueError(
            f"{len(ports)} ports for {len(hosts)} hosts (give one for all, or one each)"
        )
    balance = _choice(params, "load_balance_hosts", LOAD_BALANCE_HOSTS)
    attrs = _choice(params, "target_session_attrs", TARGET_SESSION_ATTRS)
    dbname = params.pop("dbname", None) or unquote(parts.path.lstrip("/")) or user
    return _ParsedUrl(
        hosts=tuple(
            (host or "localhost", 5432 if port is None else port)
            for host, port in zip(hosts, ports, strict=True)
        ),
        dbname=dbname,
        user=user,
        password=password,
        params=params,
        load_balance_hosts=typing.cast(LoadBalanceHosts, balance),
        target_session_attrs=typing.cast(TargetSessionAttrs, attrs),
    )


def _choice(params: dict[str, str], name: str, allowed: tuple[str, ...]) -> str:
    """Pop a URL parameter scry reads itself (never sent to the server); the first
    allowed value is the default."""
    value = params.pop(name, allowed[0])
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def _authority_hosts(hostinfo: str, url: str) -> list[tuple[str, int | None]]:
    """``h1:5432,[::1]:5433,h3`` (percent-decoded; a missing port is None)."""
    hosts: list[tuple[str, int | None]] = []
    for item in hostinfo.split(","):
        host, port = item, ""
        if item.startswith("["):  # an IPv6 literal
            host, _, rest = item[1:].partition("]")
            if rest and not rest.startswith(":"):
                raise ValueError(f"bad host {item!r} in {redact_secrets(url)!r}")
            port = rest[1:]
        elif ":" in item:
            host, _, port = item.rpartition(":")
        try:
            hosts.append((unquote(host), _port(port) if port else None))
        except ValueError:
            raise ValueError(f"bad port in {redact_secrets(url)!r}") from None
    return hosts


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port {text!r}")
    return int(text)


# A URL's password (up to the authority's last "@", even one an unencoded "/"
# or "@" cut short for urlsplit) and a conninfo's or query's password= and
# sslpassword= (libpq's names), in text about to be shown.
_URL_PASSWORD = re.compile(r"(://[^\s/@:'\"]*:)[^\s'\"]*@")
_KEY_PASSWORD = re.compile(r"((?:ssl)?password\s*=\s*)('(?:[^']|'')*'|[^\s&;'\"]+)", re.IGNORECASE)


def redact_secrets(text: str) -> str:
    """``text`` (a config value or line quoted in an error) with what looks
    like a password replaced by ``***``."""
    return _KEY_PASSWORD.sub(rf"\1{MASK}", _URL_PASSWORD.sub(rf"\1{MASK}@", text))


# --------------------------------------------------------------------------- #
# The whole config
# --------------------------------------------------------------------------- #

# Sections that may be written as an empty YAML key (``pool:``) to mean "defaults".
_EMPTY_MEANS_DEFAULT = (
    "databases",
    "pool",
    "timeouts",
    "circuit_breaker",
    "admin",
    "observability",
    "health",
    "peers",
    "tls",
    "log",
)


class Config(_Model):
    """The complete, validated scry configuration."""

    listen_addr: str = "127.0.0.1:6432"
    database_url: str | None = None
    databases: dict[str, DatabaseConfig] = Field(default_factory=dict)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    auth: AuthConfig | None = None
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    workers: int | Literal["auto"] = 1
    #: peer id -> "host:port" of another scry instance, for cancel forwarding; a
    #: host that is a directory means the Unix socket in it (``[peers] host=/dir``).
    peers: dict[int, str] = Field(default_factory=dict)
    #: This instance's id among its peers (PgBouncer's peer_id); see scry.peering.
    peer_id: Int = Field(0, ge=0, le=16383)
    #: PgBouncer's disable_pqexec: a client that sends a simple Query (which may
    #: carry several statements, a help to SQL injection) is disconnected; only
    #: the extended protocol is served.
    disable_pqexec: bool = False
    #: PgBouncer's so_reuseport: other scry instances, each its own process and
    #: config, may serve listen_addr too, on purpose (the kernel spreads new
    #: connections over them). Without it a second instance is refused.
    so_reuseport: bool = False
    tls: TlsConfig = Field(default_factory=TlsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    max_packet_size: Int = Field(1073741823, ge=1024, le=2147483647)  # (PgBouncer's most)
    #: PgBouncer's listen_backlog: how many connections the kernel queues before
    #: they are accepted (capped by net.core.somaxconn). PgBouncer's default is
    #: 128; scry's rides out a burst of new connections. A reload applies it.
    listen_backlog: Int = Field(4096, ge=1, le=65535)
    #: PgBouncer's tcp_socket_buffer: SO_SNDBUF and SO_RCVBUF of client and server
    #: sockets, in bytes (the kernel doubles them); 0 = the kernel's autotuning.
    tcp_socket_buffer: Int = Field(0, ge=0, le=2147483647)
    #: PgBouncer's tcp_defer_accept (on by default on Linux, as there): the kernel
    #: hands over a new client connection with its first packet, one wakeup fewer.
    tcp_defer_accept: bool = True
    #: PgBouncer's dns_max_ttl and dns_nxdomain_ttl: a server host name's
    #: addresses are looked up once per dns_max_ttl seconds, a failed lookup
    #: kept as long as dns_nxdomain_ttl (scry.dns); 0 = at every connect.
    dns_max_ttl: Seconds = 15
    dns_nxdomain_ttl: Seconds = 15
    #: PgBouncer's login_notify_message: a NOTICE every client gets at login
    #: (e.g. that it reached a pooler, not PostgreSQL); empty = none.
    login_notify_message: str = ""
    #: PgBouncer's: the client's address joins its application_name on the
    #: server (``app - host:port``), so pg_stat_activity shows who sent what.
    application_name_add_host: bool = False
    #: PgBouncer's TCP keepalive settings, for client and server sockets alike
    #: (scry.tcp_options): on by default, as there; 0 = the operating system's value.
    tcp_keepalive: bool = True
    tcp_keepidle: Int = Field(0, ge=0, le=32767)
    tcp_keepintvl: Int = Field(0, ge=0, le=32767)
    tcp_keepcnt: Int = Field(0, ge=0, le=127)
    #: Milliseconds unacknowledged data may wait before the kernel drops the
    #: connection (Linux TCP_USER_TIMEOUT); 0 = the operating system's rule.
    tcp_user_timeout: Int = Field(0, ge=0, le=2147483647)
    #: Set when scry runs from a pgbouncer.ini (scry.pgbouncer); None otherwise.
    pgbouncer: PgbouncerCompatConfig | None = None

    _check_addr = field_validator("listen_addr")(_validate_listen_addr)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {
                k: ({} if v is None and k in _EMPTY_MEANS_DEFAULT else v) for k, v in data.items()
            }
        return data

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        # Validated by hand: pydantic's union errors would be reported twice.
        if value == "auto":
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
            return int(value)
        raise PydanticCustomError("workers", "expected a positive integer or 'auto'")

    @field_validator("peers")
    @classmethod
    def _peers(cls, value: dict[int, str]) -> dict[int, str]:
        for peer_id, addr in value.items():
            if not 0 <= peer_id <= 16383:
                raise _problem(str(peer_id), "a peer id is 0..16383")
            try:
                split_host_port(addr)
            except ValueError as exc:
                raise _problem(str(peer_id), str(exc)) from None
        return value

    @model_validator(mode="after")
    def _check_databases(self) -> Config:
        if not self.database_url and not self.databases:
            raise PydanticCustomError("no_database", "config needs database_url or databases")
        # Parse every URL and merge every pool now, so a bad one stops start-up.
        try:
            targets = self.targets()
        except ConfigError as exc:
            raise PydanticCustomError(
                "scry_problems", "{detail}", {"detail": str(exc), "problems": exc.problems}
            ) from None
        # (autodb may make more databases later; the lookups' must exist now)
        auth_dbnames = {f"databases.{name}": db.auth_dbname for name, db in self.databases.items()}
        if self.pgbouncer is not None and self.pgbouncer.autodb is not None:
            auth_dbnames["pgbouncer.autodb"] = self.pgbouncer.autodb.auth_dbname
        auth_dbnames["auth"] = self.auth.auth_dbname if self.auth is not None else None
        for where, auth_dbname in auth_dbnames.items():
            if auth_dbname and auth_dbname not in targets:
                raise _problem(f"{where}.auth_dbname", f"no database {auth_dbname!r} is configured")
        return self

    @property
    def listen_host_port(self) -> tuple[str, int]:
        """``listen_addr`` split into host and port."""
        return split_host_port(self.listen_addr)

    def user_timeouts(self) -> dict[str, TimeoutsConfig]:
        """The timeouts of users whose ``[users]`` line sets some (PgBouncer mode)."""
        users = self.pgbouncer.users if self.pgbouncer is not None else {}
        result = {}
        for name, override in users.items():
            own = {k: v for k in USER_TIMEOUTS if (v := getattr(override, k)) is not None}
            if own:
                result[name] = self.timeouts.model_copy(update=own)
        return result

    def pool_settings(self, target: DatabaseTarget, user: str | None) -> PoolConfig:
        """The settings of ``target``'s pool for ``user``: the database's, with
        the user's ``[users]`` line over them (PgBouncer mode), as PgBouncer
        has them at login and after every reload."""
        users = self.pgbouncer.users if self.pgbouncer is not None else {}
        override = users.get(user) if user is not None else None
        if override is None:
            return target.pool
        return override.pool_override().merged_with(target.pool)

    def targets(self) -> dict[str, DatabaseTarget]:
        """The backend databases by client-visible name.

        ``database_url`` alone is served under its own database name; entries of
        ``databases:`` win when both use the same name.
        """
        result: dict[str, DatabaseTarget] = {}
        problems: list[str] = []
        if self.database_url:
            try:
                parsed = _parse_database_url(self.database_url)
                if not parsed.dbname:
                    raise ValueError("the URL names no database (and no user to default to)")
                result[parsed.dbname] = _target(parsed.dbname, parsed, self.pool)
            except ValueError as exc:
                problems.append(f"database_url: {exc}")
        for name, db in self.databases.items():
            key = f"databases.{name}"
            try:
                parsed = _parse_database_url(db.database_url)
            except ValueError as exc:
                problems.append(f"{key}.database_url: {exc}")
                continue
            try:
                pool = db.pool.merged_with(self.pool) if db.pool else self.pool
            except ValidationError as exc:
                problems.extend(_problems_from_validation(exc, prefix=(*key.split("."), "pool")))
                continue
            result[name] = _target(name, parsed, pool, db)
        if problems:
            raise ConfigError("\n".join(problems), problems=problems)
        return result

    def masked_dict(self) -> dict[str, Any]:
        """The effective config as plain data, with every secret replaced by ``***``."""
        data = self.model_dump(mode="json")
        if data.get("database_url"):
            data["database_url"] = redact_secrets(data["database_url"])
        for db in data.get("databases", {}).values():
            db["database_url"] = redact_secrets(db["database_url"])
        if (data.get("pgbouncer") or {}).get("autodb"):
            autodb = data["pgbouncer"]["autodb"]
            autodb["database_url"] = redact_secrets(autodb["database_url"])
        if data["admin"].get("token") is not None:
            data["admin"]["token"] = MASK
        if data["observability"].get("anonymize_key") is not None:
            data["observability"]["anonymize_key"] = MASK
        if data.get("auth"):
            for user in data["auth"]["users"]:
                if user.get("password") is not None:
                    user["password"] = MASK
        return data


def _target(
    name: str, parsed: _ParsedUrl, pool: PoolConfig, db: DatabaseConfig | None = None
) -> DatabaseTarget:
    return DatabaseTarget(
        name=name,
        hosts=parsed.hosts,
        # PgBouncer's rule: an unnamed backend database is the client-visible one.
        dbname=parsed.dbname or name,
        user=parsed.user,
        password=parsed.password,
        params=dict(parsed.params),
        pool=pool,
        auth_user=db.auth_user if db else None,
        auth_dbname=db.auth_dbname if db else None,
        auth_query=db.auth_query if db else None,
        load_balance_hosts=parsed.load_balance_hosts,
        target_session_attrs=parsed.target_session_attrs,
    )


# --------------------------------------------------------------------------- #
# Error formatting
# --------------------------------------------------------------------------- #

_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "a boolean (true or false)",
    "bool_type": "a boolean (true or false)",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "bool_not_number": "a number",
}


def _join_loc(loc: Iterable[str | int]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int) and out:
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# Keys whose values (and anything under them) must not be echoed back in an
# error message: ``users`` holds passwords, whatever shape a mistake gave it.
_SECRET_KEYS = frozenset({"password", "token", "anonymize_key", "database_url", "users"})


def _describe(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if isinstance(value, (dict, list, tuple)) or _SECRET_KEYS.intersection(error["loc"]):
        # (A mapping or list may hold a secret under any key: only its type is said.)
        found = f", found a value of type {type(value).__name__}"
    else:
        shown = redact_secrets(value) if isinstance(value, str) else value
        found = f", found {_short_repr(shown)}"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected')}{found}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        sign = {
            "greater_than_equal": ">=",
            "greater_than": ">",
            "less_than_equal": "<=",
            "less_than": "<",
        }[kind]
        bound = next(iter(ctx.values()), "?")
        return f"expected a number {sign} {bound}{found}"
    if kind == "string_too_short":
        return f"expected a non-empty string{found}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}{found}"
    if kind in ("scry_problem", "scry_problems", "no_database"):
        return str(error["msg"])
    if kind in ("listen_addr",):
        return str(error["msg"])
    if kind == "workers":
        return f"{error['msg']}{found}"
    # Fall back to pydantic's own sentence, which is clear for the rest.
    msg = str(error["msg"]).removeprefix("Value error, ")
    return f"{msg}{found}"


def _problems_from_validation(exc: ValidationError, prefix: tuple[str, ...] = ()) -> list[str]:
    problems: list[str] = []
    for error in exc.errors(include_url=False):
        loc = (*prefix, *error["loc"])
        ctx = error.get("ctx") or {}
        if error["type"] == "scry_problems":
            problems.extend(f"{_join_loc(loc)}.{p}" if loc else p for p in ctx.get("problems", []))
            continue
        if error["type"] == "scry_problem":
            loc = (*loc, *str(ctx["field"]).split("."))
        message = _describe(error)
        if error["type"] == "extra_forbidden":
            message += _suggestion(loc)
        path = _join_loc(loc)
        problems.append(f"{path}: {message}" if path else message)
    return problems


def _suggestion(loc: tuple[str | int, ...]) -> str:
    """`` (did you mean 'size'?)`` for a misspelled key, or nothing."""
    parent = _model_at(tuple(str(p) for p in loc[:-1]))
    if parent is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------- #
# Walking the schema (for env vars and suggestions)
# --------------------------------------------------------------------------- #


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated[...] and ``X | None`` down to X."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _model_at(path: tuple[str, ...]) -> type[BaseModel] | None:
    annotation = _annotation_at(path)
    return annotation if _is_model(annotation) else None


def _annotation_at(path: tuple[str, ...]) -> Any:
    """The (unwrapped) type at a key path of Config, or None if no such path."""
    annotation: Any = Config
    for part in path:
        if _is_model(annotation):
            info = annotation.model_fields.get(part)
            if info is None:
                return None
            annotation = _unwrap(info.annotation)
        elif typing.get_origin(annotation) is dict:
            # Any key is fine inside a map (database names, peer ids).
            annotation = _unwrap(typing.get_args(annotation)[1])
        else:
            return None
    return annotation


def _is_string_leaf(annotation: Any) -> bool:
    return annotation is str


def _env_overrides(env: Mapping[str, str]) -> list[tuple[str, tuple[str, ...], Any]]:
    """``(var, key path, value)`` for each SCRY_ config variable, sorted for determinism.

    Unknown variables that look like config paths (contain ``__``, start with a
    top-level key, or are a near-miss of one) are an error: a typo must not be
    silently ignored. Other SCRY_ variables may belong to other tools.
    """
    overrides = []
    problems = []
    top_level = list(Config.model_fields)
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in NON_CONFIG_ENV_VARS:
            continue
        raw = env[var]
        path = tuple(p.lower() for p in var[len(ENV_PREFIX) :].split("__"))
        annotation = _annotation_at(path) if all(path) else None
        if annotation is None:
            looks_like_config = (
                "__" in var[len(ENV_PREFIX) :]
                or path[0] in top_level
                or difflib.get_close_matches(path[0], top_level, n=1, cutoff=0.8)
            )
            if looks_like_config:
                close = difflib.get_close_matches(var, _known_env_vars(), n=1, cutoff=0.8)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(f"{var}: no such config setting{hint}")
            continue
        if _is_string_leaf(annotation):
            value: Any = raw  # keep "12345" a string for tokens and passwords
        else:
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError as exc:
                problems.append(f"{var}: not a valid YAML value ({exc})")
                continue
        overrides.append((var, path, value))
    if problems:
        raise ConfigError(
            _summarize(problems, "environment"), problems=problems, source="environment"
        )
    return overrides


def _known_env_vars() -> list[str]:
    """Env var names for every fixed key path (maps like ``databases`` not expanded)."""
    names: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            var = f"{prefix}{name.upper()}"
            names.append(var)
            annotation = _unwrap(info.annotation)
            if _is_model(annotation):
                walk(annotation, var + "__")

    walk(Config, ENV_PREFIX)
    return names


def _set_path(data: dict[str, Any], path: tuple[str, ...], value: Any, origin: str) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(path[: i + 1])
            raise ConfigError(f"{origin}: {where} is not a mapping, cannot set {'.'.join(path)}")
        node = child
    # YAML map keys that are ints (peers) are matched by their text.
    key: Any = path[-1]
    if path[:-1] == ("peers",) and key.isdigit():
        key = int(key)
    node[key] = value


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", source=path) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}", source=path) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: YAML syntax error: {problem}", source=path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of settings at the top level, found {type(data).__name__}",
            source=path,
        )
    return data


def _summarize(problems: list[str], source: str | None) -> str:
    if len(problems) == 1:
        return f"{source}: {problems[0]}" if source else problems[0]
    where = f" in {source}" if source else ""
    return f"{len(problems)} problems{where}:\n" + "\n".join(f"  {p}" for p in problems)


def load_config(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load and validate the config.

    ``path`` is a YAML file, or None for a config from the environment alone.
    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment.
    ``overrides`` maps dotted key paths to values (command-line flags) and wins
    over everything else. Raises :class:`ConfigError` on any problem.
    """
    source = os.fspath(path) if path is not None else None
    data = _read_yaml(source) if source is not None else {}
    env = os.environ if env is None else env

    origins: dict[str, str] = {}  # dotted key -> the env var / flag that set it
    for var, key_path, value in _env_overrides(env):
        _set_path(data, key_path, value, var)
        origins[".".join(key_path)] = var
    for dotted, value in (overrides or {}).items():
        _set_path(data, tuple(dotted.split(".")), value, dotted)
        origins[dotted] = "command line"

    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        problems = [_annotate_origin(p, origins) for p in _problems_from_validation(exc)]
        raise ConfigError(
            _summarize(problems, source or "environment"),
            problems=problems,
            source=source or "environment",
        ) from None


def _annotate_origin(problem: str, origins: Mapping[str, str]) -> str:
    key = problem.partition(": ")[0]
    for dotted, origin in origins.items():
        if key == dotted or key.startswith(dotted + ".") or key.startswith(dotted + "["):
            return f"{problem} (set by {origin})"
    return problem
