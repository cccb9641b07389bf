"""pgbouncer.ini, read by PgBouncer's rules and turned into a scry Config.

Reading (:func:`parse_ini`), as PgBouncer does:

- a line whose first non-blank character is ``;`` or ``#`` is a comment (the
  characters are not special later in a line);
- ``[section]`` starts a section; a section may appear several times and a
  key set twice keeps its last value;
- ``%include FILE`` reads another file in place (a relative name is taken from
  the current directory, as PgBouncer does, then from the including file's
  directory); includes nest up to 10 deep;
- ``key = value``: the value is the rest of the line, stripped. Database and
  user names may be double-quoted (``"my db" = ...``, ``""`` for a quote).

Converting (:func:`convert`): every key of PgBouncer 1.25's documentation is
known. A key either maps to the scry setting with the same meaning, or is
reported once by name (``not supported: <key> (...)``) in the returned
warnings, unless its value is PgBouncer's default (then nothing changes). An
unknown key, a bad value or a setting scry cannot honour safely (``auth_type
= pam``) is an :class:`IniError`, as PgBouncer refuses to start on them.

A ``[scry]`` section (scry's own extension) sets scry-only settings by dotted
path: ``admin.listen_addr = 127.0.0.1:6481``, ``pool.mode = hybrid``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import yaml
from pydantic import ValidationError

from scry.config import (
    DEFAULT_AUTH_QUERY,
    USER_TIMEOUTS,
    Config,
    ConfigError,
    _env_overrides,
    _problems_from_validation,
    _set_path,
    join_host_port,
    redact_secrets,
)
from scry.protocol.auth import SCRAM_MIN_ITERATIONS

__all__ = [
    "IniError",
    "PGBOUNCER_KEYS",
    "PgbouncerIni",
    "convert",
    "load_pgbouncer_config",
    "parse_connstring",
    "parse_ini",
]

MAX_INCLUDE_DEPTH = 10
SECTIONS = ("databases", "pgbouncer", "users", "peers", "scry")


class IniError(ConfigError):
    """The pgbouncer.ini cannot be used; the message names the file and line."""


# --------------------------------------------------------------------------- #
# Reading
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Entry:
    """One ``key = value`` line: the value and where it was read (``file:line``)."""

    value: str
    where: str


@dataclass
class PgbouncerIni:
    """A parsed pgbouncer.ini: ``sections[name][key]`` (later lines win)."""

    path: str
    sections: dict[str, dict[str, Entry]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def section(self, name: str) -> dict[str, Entry]:
        return self.sections.get(name, {})

    def value(self, key: str) -> str | None:
        """A ``[pgbouncer]`` setting as written, or None when not set."""
        entry = self.section("pgbouncer").get(key)
        return entry.value if entry is not None else None


_SECTION = re.compile(r"\[\s*([^\]]*?)\s*\]\s*$")


def parse_ini(path: str | os.PathLike[str]) -> PgbouncerIni:
    """Read a pgbouncer.ini (and its ``%include`` files); raises :class:`IniError`."""
    ini = PgbouncerIni(os.fspath(path))
    _read_file(ini, os.fspath(path), None, 0, [None])
    return ini


def _read_file(
    ini: PgbouncerIni, path: str, including: str | None, depth: int, section: list[str | None]
) -> None:
    if depth > MAX_INCLUDE_DEPTH:
        raise IniError(f"{including}: %include nested more than {MAX_INCLUDE_DEPTH} deep")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        where = f"{including}: " if including else ""
        raise IniError(f"{where}cannot read {path}: {exc.strerror or exc}", source=path) from None
    ini.files.append(path)
    for lineno, raw in enumerate(text.splitlines(), start=1):
        where = f"{path}:{lineno}"
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("%include"):
            name = line[len("%include") :].strip()
            if not name:
                raise IniError(f"{where}: %include needs a file name")
            _read_file(ini, _include_path(name, path), where, depth + 1, section)
            continue
        if line.startswith("%"):
            raise IniError(f"{where}: unknown directive {line.split()[0]!r}")
        match = _SECTION.match(line)
        if match:
            name = match[1].lower()
            if name not in SECTIONS:
                raise IniError(f"{where}: unknown section [{match[1]}]")
            section[0] = name
            ini.sections.setdefault(name, {})
            continue
        if section[0] is None:
            raise IniError(f"{where}: a setting outside of any [section]")
        key, value = _split_key(line, where)
        if section[0] in ("pgbouncer", "scry"):
            key = key.lower()  # setting names are case-insensitive; database names are not
        ini.sections[section[0]][key] = Entry(value, where)


def _include_path(name: str, including_file: str) -> str:
    if os.path.isabs(name) or os.path.exists(name):
        return name
    beside = os.path.join(os.path.dirname(including_file), name)
    return beside if os.path.exists(beside) else name


def _split_key(line: str, where: str) -> tuple[str, str]:
    if line.startswith('"'):
        key, pos = _read_quoted(line, 0, '"', where)
        rest = line[pos:].lstrip()
        if not rest.startswith("="):
            raise IniError(f"{where}: expected '=' after {redact_secrets(line[:pos])}")
        return key, rest[1:].strip()
    key, sep, value = line.partition("=")
    if not sep or not key.strip() or len(key.split()) != 1:
        raise IniError(f"{where}: expected 'key = value', found {redact_secrets(line)!r}")
    return key.strip(), value.strip()


def _read_quoted(text: str, pos: int, quote_char: str, where: str) -> tuple[str, int]:
    """The quoted string starting at ``pos`` (doubled quote = one literal); (value, end)."""
    out = []
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\" and quote_char == "'" and i + 1 < len(text):
            out.append(text[i + 1])
            i += 2
            continue
        if ch == quote_char:
            if text[i + 1 : i + 2] == quote_char:
                out.append(ch)
                i += 2
                continue
            return "".join(out), i + 1
        out.append(ch)
        i += 1
    raise IniError(f"{where}: unterminated {quote_char}-quoted string")


_CONN_KEY = re.compile(r"\s*([A-Za-z0-9_]+)\s*=\s*")


def parse_connstring(text: str, where: str) -> dict[str, str]:
    """A ``[databases]``/``[users]``/``[peers]`` value: ``key=value`` pairs,
    values optionally single-quoted (``''`` or ``\\'`` for a quote)."""
    params: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _CONN_KEY.match(text, pos)
        if not match:
            raise IniError(f"{where}: expected 'key=value' at {redact_secrets(text[pos:])!r}")
        key = match[1].lower()
        pos = match.end()
        if text[pos : pos + 1] == "'":
            value, pos = _read_quoted(text, pos, "'", where)
        else:
            end = pos
            while end < len(text) and not text[end].isspace():
                end += 1
            value, pos = text[pos:end], end
        params[key] = value
    return params


# --------------------------------------------------------------------------- #
# Values
# --------------------------------------------------------------------------- #

_TRUE = {"1", "yes", "on", "true"}
_FALSE = {"0", "no", "off", "false"}
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_TIME = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*$")


def as_bool(entry: Entry) -> bool:
    value = entry.value.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise IniError(
        f"{entry.where}: expected a boolean (0/1, yes/no, on/off), found {entry.value!r}"
    )


def as_int(entry: Entry) -> int:
    try:
        return int(entry.value, 0) if entry.value.lower().startswith("0x") else int(entry.value)
    except ValueError:
        raise IniError(f"{entry.where}: expected an integer, found {entry.value!r}") from None


def as_seconds(entry: Entry) -> float:
    match = _TIME.match(entry.value.lower())
    if not match or match[2] not in ("", *_UNITS):
        raise IniError(f"{entry.where}: expected seconds (e.g. 30 or 1.5), found {entry.value!r}")
    seconds = float(match[1]) * _UNITS.get(match[2] or "s", 1.0)
    if seconds < 0:
        raise IniError(f"{entry.where}: expected a non-negative time, found {entry.value!r}")
    return seconds


def as_list(entry: Entry) -> list[str]:
    return [part.strip() for part in entry.value.split(",") if part.strip()]


def _normalized(value: str) -> str:
    """For comparing a value with PgBouncer's default (``0777`` = ``511``, ``1.0`` = ``1``)."""
    text = value.strip().lower()
    if text in _TRUE:
        return "1"
    if text in _FALSE:
        return "0"
    try:
        number = float(text)
    except ValueError:
        return text
    return f"{number:g}"


# --------------------------------------------------------------------------- #
# The [pgbouncer] keys of PgBouncer 1.25
# --------------------------------------------------------------------------- #

Handler = Callable[["_Builder", str, Entry], None]


@dataclass(frozen=True)
class Key:
    """One [pgbouncer] setting: PgBouncer's default (as SHOW CONFIG prints it),
    whether SET/RELOAD may change it, and how scry takes it (None = unsupported:
    warn unless the value is the default; ``why`` says what scry does instead)."""

    default: str | None
    changeable: bool = True
    handler: Handler | None = None
    why: str = ""


def _to(path: str, parse: Callable[[Entry], Any] = lambda e: e.value) -> Handler:
    def handler(builder: _Builder, key: str, entry: Entry) -> None:
        builder.set(path, parse(entry))

    return handler


def _compat(name: str, parse: Callable[[Entry], Any] = lambda e: e.value or None) -> Handler:
    return _to(f"pgbouncer.{name}", parse)


def _octal(entry: Entry) -> int:
    try:
        return int(entry.value, 8)
    except ValueError:
        raise IniError(f"{entry.where}: expected an octal mode like 0777") from None


def _auth_type(builder: _Builder, key: str, entry: Entry) -> None:
    value = entry.value.lower()
    if value in ("pam", "ldap"):
        raise IniError(
            f"{entry.where}: auth_type = {value} is not supported by scry; use md5, "
            "scram-sha-256, cert, hba, plain, trust or any"
        )
    builder.set("auth.type", value)


def _server_check_query(builder: _Builder, key: str, entry: Entry) -> None:
    if entry.value == "":
        builder.set("timeouts.server_check_delay", 0)  # PgBouncer: empty disables the check
        builder.check_disabled = True
    else:
        # "<empty>" asks for an empty query: scry sends ";", which is the same round trip.
        builder.set("timeouts.server_check_query", ";" if entry.value == "<empty>" else entry.value)


def _server_check_delay(builder: _Builder, key: str, entry: Entry) -> None:
    # PgBouncer: 0 = check every time; scry: 0 = never. A microsecond means "every time".
    builder.set("timeouts.server_check_delay", as_seconds(entry) or 1e-6)


def _verbose(builder: _Builder, key: str, entry: Entry) -> None:
    if as_int(entry) > 0:
        builder.set("log.level", "debug")


def _tracked(builder: _Builder, key: str, entry: Entry) -> None:
    scry_tracks = {
        "application_name", "client_encoding", "datestyle", "intervalstyle", "timezone",
        "standard_conforming_strings", "search_path",
    }  # fmt: skip
    extra = [p for p in as_list(entry) if p.lower() not in scry_tracks]
    if extra:
        builder.unsupported(key, f"scry tracks only {', '.join(sorted(scry_tracks))}")


def _ignored_listen(builder: _Builder, key: str, entry: Entry) -> None:
    """listen_addr and listen_port are combined in _Builder.finish."""


def _peer_id(builder: _Builder, key: str, entry: Entry) -> None:
    builder.set("peer_id", as_int(entry))
    builder.set("pgbouncer.peer_id", as_int(entry))


def _scram_iterations(builder: _Builder, key: str, entry: Entry) -> None:
    rounds = as_int(entry)
    if rounds < SCRAM_MIN_ITERATIONS:  # (PgBouncer allows fewer; scramp does not)
        builder.unsupported(key, f"below {SCRAM_MIN_ITERATIONS}, RFC 7677's floor")
    else:
        builder.set("auth.scram_iterations", rounds)


def _str_or_skip(path: str) -> Handler:
    def handler(builder: _Builder, key: str, entry: Entry) -> None:
        if entry.value:
            builder.set(path, entry.value)

    return handler


def _seconds(path: str) -> Handler:
    return _to(path, as_seconds)


_DNS = "scry looks host names up with the system resolver (getaddrinfo)"
_TLS = "Python's ssl module sets no TLS 1.3 cipher suites or DH parameters: OpenSSL's apply"

#: Every [pgbouncer] key of PgBouncer 1.25's documentation (plus 1.18's
#: ``suspend_timeout``), with its default as PgBouncer's SHOW CONFIG prints it.
PGBOUNCER_KEYS: dict[str, Key] = {
    # --- generic
    "logfile": Key("", handler=_compat("logfile")),
    "pidfile": Key("", changeable=False, handler=_compat("pidfile")),
    "listen_addr": Key("", changeable=False, handler=_ignored_listen),
    "listen_port": Key("6432", changeable=False, handler=_ignored_listen),
    "unix_socket_dir": Key("/tmp", changeable=False, handler=_compat("unix_socket_dir")),
    "unix_socket_mode": Key("0777", changeable=False, handler=_compat("unix_socket_mode", _octal)),
    "unix_socket_group": Key("", changeable=False, handler=_compat("unix_socket_group")),
    "user": Key(None, changeable=False, handler=_compat("user")),
    "pool_mode": Key("session", handler=_to("pool.mode", lambda e: e.value.lower())),
    "max_client_conn": Key("100", handler=_to("pool.max_client_conn", as_int)),
    "default_pool_size": Key("20", handler=_to("pool.size", as_int)),
    "min_pool_size": Key("0", handler=_to("pool.min_size", as_int)),
    "reserve_pool_size": Key("0", handler=_to("pool.reserve_size", as_int)),
    "reserve_pool_timeout": Key("5", handler=_seconds("timeouts.reserve_pool_timeout")),
    "max_db_connections": Key("0", handler=_to("pool.max_db_connections", as_int)),
    "max_db_client_connections": Key("0", handler=_to("pool.max_db_client_connections", as_int)),
    "max_user_connections": Key("0", handler=_to("pool.max_user_connections", as_int)),
    "max_user_client_connections": Key(
        "0", handler=_to("pool.max_user_client_connections", as_int)
    ),
    "server_round_robin": Key("0", handler=_to("pool.server_round_robin", as_bool)),
    "track_extra_parameters": Key("IntervalStyle", handler=_tracked),
    "ignore_startup_parameters": Key("", handler=_compat("ignore_startup_parameters", as_list)),
    "peer_id": Key("0", changeable=False, handler=_peer_id),
    "disable_pqexec": Key("0", changeable=False, handler=_to("disable_pqexec", as_bool)),
    "application_name_add_host": Key("0", handler=_to("application_name_add_host", as_bool)),
    "conffile": Key(None, handler=lambda b, k, e: None),
    "service_name": Key("pgbouncer", changeable=False, handler=lambda b, k, e: None),
    "job_name": Key("pgbouncer", changeable=False, handler=lambda b, k, e: None),
    "stats_period": Key("60", handler=_compat("stats_period", as_int)),
    "max_prepared_statements": Key("200", handler=_to("pool.max_prepared_statements", as_int)),
    "scram_iterations": Key("4096", handler=_scram_iterations),
    # --- authentication
    "auth_type": Key("md5", handler=_auth_type),
    "auth_hba_file": Key("", handler=_str_or_skip("auth.auth_hba_file")),
    "auth_ident_file": Key("", handler=_str_or_skip("auth.auth_ident_file")),
    "auth_file": Key(None, handler=_str_or_skip("auth.auth_file")),
    "auth_user": Key(None, handler=_str_or_skip("auth.auth_user")),
    "auth_query": Key(DEFAULT_AUTH_QUERY, handler=_str_or_skip("auth.auth_query")),
    "auth_dbname": Key("", handler=_str_or_skip("auth.auth_dbname")),
    "auth_ldap_options": Key("", why="no LDAP authentication"),
    # --- logging
    "syslog": Key("0", handler=_to("log.syslog", as_bool)),
    "syslog_ident": Key("pgbouncer", handler=_to("log.syslog_ident")),
    "syslog_facility": Key("daemon", handler=_to("log.syslog_facility")),
    "log_connections": Key("1", handler=_to("log.connections", as_bool)),
    "log_disconnections": Key("1", handler=_to("log.disconnections", as_bool)),
    "log_pooler_errors": Key("1", handler=_to("log.pooler_errors", as_bool)),
    "log_stats": Key("1", handler=lambda b, k, e: None),  # with stats_period: _log_stats
    "verbose": Key("0", handler=_verbose),
    # --- console access
    "admin_users": Key("", handler=_compat("admin_users", as_list)),
    "stats_users": Key("", handler=_compat("stats_users", as_list)),
    # --- connection sanity checks, timeouts
    "server_reset_query": Key("DISCARD ALL", handler=_to("pool.server_reset_query")),
    "server_reset_query_always": Key("0", handler=_to("pool.server_reset_query_always", as_bool)),
    "server_check_delay": Key("30", handler=_server_check_delay),
    "server_check_query": Key("<empty>", handler=_server_check_query),
    "server_fast_close": Key("0", handler=_to("pool.server_fast_close", as_bool)),
    "server_lifetime": Key("3600", handler=_seconds("timeouts.server_lifetime")),
    "server_idle_timeout": Key("600", handler=_seconds("timeouts.server_idle_timeout")),
    "server_connect_timeout": Key("15", handler=_seconds("timeouts.server_connect_timeout")),
    "server_login_retry": Key("15", handler=_seconds("timeouts.server_login_retry")),
    "client_login_timeout": Key("60", handler=_seconds("timeouts.client_login_timeout")),
    "autodb_idle_timeout": Key("3600", handler=_compat("autodb_idle_timeout", as_seconds)),
    "pool_idle_timeout": Key("0", handler=_seconds("timeouts.pool_idle_timeout")),
    "dns_max_ttl": Key("15", handler=_seconds("dns_max_ttl")),
    "dns_nxdomain_ttl": Key("15", handler=_seconds("dns_nxdomain_ttl")),
    "dns_zone_check_period": Key("0", why=f"{_DNS}, again after dns_max_ttl"),
    "resolv_conf": Key("", changeable=False, why=f"{_DNS}, configured by /etc/resolv.conf"),
    "query_wait_notify": Key("5", handler=_seconds("timeouts.query_wait_notify")),
    "login_notify_message": Key("", handler=_to("login_notify_message")),
    "suspend_timeout": Key("10", handler=_compat("suspend_timeout", as_seconds)),
    # --- TLS
    "client_tls_sslmode": Key("disable", handler=_to("tls.client_tls_sslmode")),
    "client_tls_key_file": Key("", handler=_str_or_skip("tls.client_tls_key_file")),
    "client_tls_cert_file": Key("", handler=_str_or_skip("tls.client_tls_cert_file")),
    "client_tls_ca_file": Key("", handler=_str_or_skip("tls.client_tls_ca_file")),
    "client_tls_protocols": Key("secure", handler=_to("tls.client_tls_protocols")),
    "client_tls_ciphers": Key("default", handler=_to("tls.client_tls_ciphers")),
    "client_tls13_ciphers": Key("", why=_TLS),
    "client_tls_ecdhcurve": Key("auto", handler=_to("tls.client_tls_ecdhcurve")),
    "client_tls_dheparams": Key("auto", why=_TLS),
    "server_tls_sslmode": Key("prefer", handler=_to("tls.server_tls_sslmode")),
    "server_tls_ca_file": Key("", handler=_str_or_skip("tls.server_tls_ca_file")),
    "server_tls_key_file": Key("", handler=_str_or_skip("tls.server_tls_key_file")),
    "server_tls_cert_file": Key("", handler=_str_or_skip("tls.server_tls_cert_file")),
    "server_tls_protocols": Key("secure", handler=_to("tls.server_tls_protocols")),
    "server_tls_ciphers": Key("default", handler=_to("tls.server_tls_ciphers")),
    "server_tls13_ciphers": Key("", why=_TLS),
    # --- dangerous timeouts
    "query_timeout": Key("0", handler=_seconds("timeouts.query_timeout")),
    "query_wait_timeout": Key("120", handler=_seconds("timeouts.query_wait_timeout")),
    "cancel_wait_timeout": Key("10", handler=_seconds("timeouts.cancel_wait_timeout")),
    "client_idle_timeout": Key("0", handler=_seconds("timeouts.client_idle_timeout")),
    "idle_transaction_timeout": Key("0", handler=_seconds("timeouts.idle_transaction_timeout")),
    "transaction_timeout": Key("0", handler=_seconds("timeouts.transaction_timeout")),
    # --- low-level network
    "pkt_buf": Key("4096", changeable=False, why="scry sizes its buffers itself"),
    "max_packet_size": Key("2147483647", handler=_to("max_packet_size", as_int)),
    "listen_backlog": Key("128", changeable=False, handler=_to("listen_backlog", as_int)),
    "sbuf_loopcnt": Key("5", why="asyncio flow control bounds each connection"),
    "so_reuseport": Key("0", changeable=False, handler=_to("so_reuseport", as_bool)),
    "tcp_defer_accept": Key("1", handler=_to("tcp_defer_accept", as_bool)),
    "tcp_socket_buffer": Key("0", handler=_to("tcp_socket_buffer", as_int)),
    "tcp_keepalive": Key("1", handler=_to("tcp_keepalive", as_bool)),
    "tcp_keepcnt": Key("0", handler=_to("tcp_keepcnt", as_int)),
    "tcp_keepidle": Key("0", handler=_to("tcp_keepidle", as_int)),
    "tcp_keepintvl": Key("0", handler=_to("tcp_keepintvl", as_int)),
    "tcp_user_timeout": Key("0", handler=_to("tcp_user_timeout", as_int)),
}

#: Old spellings PgBouncer still accepts.
_ALIASES = {"reserve_pool": "reserve_pool_size"}

# --------------------------------------------------------------------------- #
# Converting
# --------------------------------------------------------------------------- #

_DB_SETTINGS = {"client_encoding": "client_encoding", "datestyle": "DateStyle",
                "timezone": "TimeZone", "application_name": "application_name"}  # fmt: skip
_DB_KNOWN = {"dbname", "host", "port", "user", "password", "pool_size", "min_pool_size",
             "reserve_pool", "reserve_pool_size", "pool_mode", "max_db_connections",
             "max_db_client_connections", "connect_query", "auth_user", "auth_dbname",
             "auth_query", "server_lifetime", "query_wait_timeout",
             "load_balance_hosts", "target_session_attrs", *_DB_SETTINGS}  # fmt: skip


def _wait_timeout(value: str, where: str) -> float | None:
    """A [databases] or [users] query_wait_timeout: -1 is PgBouncer's "not
    set" (the user's, database's or global one applies), 0 disables."""
    return None if value.strip() == "-1" else as_seconds(Entry(value, where))


class _Builder:
    """Collects the scry config dict and the warnings while converting."""

    def __init__(self, ini: PgbouncerIni) -> None:
        self.ini = ini
        self.data: dict[str, Any] = {
            # PgBouncer's defaults where scry's differ.
            "pool": {"mode": "session", "max_client_conn": 100},
            "auth": {"type": "md5"},
            "max_packet_size": 2147483647,
            "pgbouncer": {"conffile": os.path.abspath(ini.path), "unix_socket_dir": "/tmp"},
        }
        self.warnings: list[str] = []
        self._reported: set[str] = set()
        self.check_disabled = False

    def set(self, dotted: str, value: Any) -> None:
        node = self.data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def unsupported(self, name: str, why: str) -> None:
        """Report a setting scry does not honour, once per name."""
        if name not in self._reported:
            self._reported.add(name)
            self.warnings.append(f"not supported: {name} ({why})")

    def differs(self, message: str) -> None:
        if message not in self._reported:
            self._reported.add(message)
            self.warnings.append(message)


def convert(ini: PgbouncerIni) -> tuple[dict[str, Any], list[str]]:
    """The scry config (as plain data for ``Config.model_validate``) and the warnings."""
    builder = _Builder(ini)
    for key, entry in ini.section("pgbouncer").items():
        key = _ALIASES.get(key, key)
        spec = PGBOUNCER_KEYS.get(key)
        if spec is None:
            raise IniError(f"{entry.where}: unknown parameter: pgbouncer/{key}")
        if spec.handler is not None:
            spec.handler(builder, key, entry)
        elif spec.default is None or _normalized(entry.value) != _normalized(spec.default):
            builder.unsupported(key, spec.why)
    if builder.check_disabled:
        builder.data["timeouts"]["server_check_delay"] = 0
    _listen(builder)
    _databases(builder)
    _users(builder)
    _peers(builder)
    _log_stats(builder)
    if "syslog_ident" not in builder.ini.section("pgbouncer"):
        builder.set("log.syslog_ident", "pgbouncer")  # (PgBouncer's default, not scry's)
    _scry_section(builder)
    return builder.data, builder.warnings


def _log_stats(builder: _Builder) -> None:
    """log_stats (on by default) logs every stats_period (60 s by default)."""
    section = builder.ini.section("pgbouncer")
    enabled = section.get("log_stats")
    if enabled is not None and not as_bool(enabled):
        return
    period = section.get("stats_period")
    builder.set("log.stats_period", as_int(period) if period is not None else 60)


def _listen(builder: _Builder) -> None:
    ini = builder.ini
    port_entry = ini.section("pgbouncer").get("listen_port")
    port = as_int(port_entry) if port_entry is not None else 6432
    addrs = [a for a in (ini.value("listen_addr") or "").split(",") if a.strip()]
    if not addrs:
        builder.differs(
            "differs: listen_addr is not set: PgBouncer would accept Unix-socket connections "
            "only; scry also listens on 127.0.0.1"
        )
        host = "127.0.0.1"
    else:
        host = addrs[0].strip()
        if len(addrs) > 1:
            builder.differs(
                f"differs: listen_addr: scry listens on the first address only ({host})"
            )
        if host == "*":
            host = "0.0.0.0"
            builder.differs("differs: listen_addr = * listens on all IPv4 addresses only")
    builder.set("listen_addr", join_host_port(host, port))


def _db_url(params: Mapping[str, str], name: str | None, socket_dir: str) -> str:
    """A postgresql:// URL for one [databases] entry (``name`` None: dbname left out)."""
    user, password = params.get("user"), params.get("password")
    netloc = ""
    if user:
        netloc = quote(user, safe="")
        if password is not None:
            netloc += ":" + quote(password, safe="")
        netloc += "@"
    dbname = params.get("dbname") or name or ""
    host = params.get("host") or socket_dir or "/tmp"
    query = {"host": host, "port": params.get("port") or "5432"}
    for key in ("load_balance_hosts", "target_session_attrs"):  # (scry.hosts)
        if params.get(key):
            query[key] = params[key]
    for key, setting in _DB_SETTINGS.items():
        if key in params:
            query[setting] = params[key]
    return f"postgresql://{netloc}/{quote(dbname, safe='')}?{urlencode(query)}"


def _db_pool(params: Mapping[str, str], where: str) -> dict[str, Any]:
    pool: dict[str, Any] = {}
    for key, target in (("pool_size", "size"), ("min_pool_size", "min_size"),
                        ("reserve_pool", "reserve_size"), ("reserve_pool_size", "reserve_size"),
                        ("max_db_connections", "max_db_connections"),
                        ("max_db_client_connections", "max_db_client_connections")):  # fmt: skip
        if key in params:
            pool[target] = as_int(Entry(params[key], where))
    if "pool_mode" in params:
        pool["mode"] = params["pool_mode"].lower()
    if params.get("connect_query"):
        pool["connect_query"] = params["connect_query"]
    if "server_lifetime" in params:
        pool["server_lifetime"] = as_seconds(Entry(params["server_lifetime"], where))
    if "query_wait_timeout" in params:
        pool["query_wait_timeout"] = _wait_timeout(params["query_wait_timeout"], where)
    return pool


def _databases(builder: _Builder) -> None:
    socket_dir = builder.data["pgbouncer"].get("unix_socket_dir") or "/tmp"
    databases: dict[str, Any] = {}
    for name, entry in builder.ini.section("databases").items():
        if name == "pgbouncer":
            raise IniError(f"{entry.where}: the database name 'pgbouncer' is reserved")
        params = parse_connstring(entry.value, entry.where)
        for key in params:
            if key not in _DB_KNOWN:
                raise IniError(f"{entry.where}: unrecognized connection parameter: {key}")
        balance = params.get("load_balance_hosts", "")
        if balance and balance not in ("round-robin", "disable"):
            raise IniError(
                f"{entry.where}: load_balance_hosts = {balance}: expected round-robin or disable"
            )
        if "password" in params and not params.get("user"):
            builder.differs(f"differs: [databases] {name}: password without user is ignored")
            params.pop("password")
        pool = _db_pool(params, entry.where)
        db: dict[str, Any] = {"database_url": _db_url(params, None if name == "*" else name,
                                                      socket_dir)}  # fmt: skip
        if pool:
            db["pool"] = pool
        for key in ("auth_user", "auth_dbname", "auth_query"):
            if params.get(key):
                db[key] = params[key]
        if name == "*":
            builder.set("pgbouncer.autodb", db)
        else:
            databases[name] = db
    builder.data["databases"] = databases


def _users(builder: _Builder) -> None:
    users: dict[str, Any] = {}
    for name, entry in builder.ini.section("users").items():
        params = parse_connstring(entry.value, entry.where)
        override: dict[str, Any] = {}
        for key, value in params.items():
            if key == "pool_mode":
                override["pool_mode"] = value.lower()
            elif key == "pool_size":
                override["pool_size"] = as_int(Entry(value, entry.where))
            elif key in ("reserve_pool_size", "reserve_pool"):
                override["reserve_pool_size"] = as_int(Entry(value, entry.where))
            elif key in ("max_user_connections", "max_user_client_connections"):
                override[key] = as_int(Entry(value, entry.where))
            elif key in USER_TIMEOUTS:
                override[key] = as_seconds(Entry(value, entry.where))
            elif key == "query_wait_timeout":
                override[key] = _wait_timeout(value, entry.where)
            else:
                raise IniError(f"{entry.where}: unrecognized user parameter: {key}")
        users[name] = override
    if users:
        builder.set("pgbouncer.users", users)


def _peers(builder: _Builder) -> None:
    own = builder.data.get("peer_id", 0)
    peers: dict[int, str] = {}
    for name, entry in builder.ini.section("peers").items():
        try:
            peer_id = int(name)
        except ValueError:
            raise IniError(f"{entry.where}: a peer id must be a number, found {name!r}") from None
        params = parse_connstring(entry.value, entry.where)
        if peer_id == own:
            continue  # PgBouncer allows (and skips) its own entry
        host = params.get("host", "")
        port = params.get("port", "6432")
        if not host or host.startswith("@"):
            builder.unsupported("[peers] host", "a peer is a host or a socket directory")
            continue
        if "pool_size" in params:
            builder.unsupported("[peers] pool_size", "cancel requests to peers are not pooled")
        # (A host that is a directory, as unix_socket_dir: the peer's socket in it.)
        peers[peer_id] = join_host_port(host, port)
    if peers:
        builder.data["peers"] = peers


def _scry_section(builder: _Builder) -> None:
    for key, entry in builder.ini.section("scry").items():
        try:
            value = yaml.safe_load(entry.value) if entry.value else None
        except yaml.YAMLError as exc:
            raise IniError(f"{entry.where}: not a valid value: {exc}") from None
        if isinstance(value, (int, float, bool)) or value is None:
            pass
        elif not isinstance(value, (list, dict)):
            value = entry.value  # keep strings (tokens, passwords) exactly as written
        builder.set(key, value)


def load_pgbouncer_config(
    path: str | os.PathLike[str],
    overrides: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[Config, list[str]]:
    """Read ``path`` and build the scry Config; raises :class:`IniError`.

    ``overrides`` are [pgbouncer] settings applied on top (the console's SET).
    ``SCRY_*`` environment variables (``env``, default ``os.environ``) win over
    the file, as they do over scry.yaml.
    """
    ini = parse_ini(path)
    if overrides:
        section = ini.sections.setdefault("pgbouncer", {})
        for key, value in overrides.items():
            section[key.lower()] = Entry(value, f"SET {key}")
    data, warnings = convert(ini)
    for var, key_path, value in _env_overrides(os.environ if env is None else env):
        _set_path(data, key_path, value, var)
    source = os.fspath(path)
    try:
        return Config.model_validate(data), warnings
    except ValidationError as exc:
        problems = _problems_from_validation(exc)
        text = problems[0] if len(problems) == 1 else "\n  ".join(["", *problems])
        raise IniError(f"{source}: {text}", problems=problems, source=source) from None
