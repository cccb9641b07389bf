"""PgBouncer's admin console: the virtual database ``pgbouncer``.

A client that connects to database ``pgbouncer`` (when scry runs from a
pgbouncer.ini) is handed to a :class:`ConsoleSession` right after its
StartupMessage (:func:`route_login`, called from ``ClientConnection._begin_login``).
The session authenticates with scry's normal auth (the auth_file users), admits
only ``admin_users`` and ``stats_users`` (and, over the Unix socket, the OS user
running scry as ``pgbouncer``, without a password, as PgBouncer does), then
answers the simple query protocol with :class:`AdminConsole`.

:meth:`AdminConsole.handle_query` returns the complete answer to one query:
RowDescription + DataRows + CommandComplete, or an ErrorResponse, then
ReadyForQuery. Commands that must wait (PAUSE, WAIT_CLOSE, SHUTDOWN
WAIT_FOR_*) return an awaitable instead of bytes.

Column names, order and types follow PgBouncer 1.25 (text 25, int4 23,
numeric 1700, as its console sends them); the figures come from scry's pools,
clients and servers. What scry does not count is listed in
docs/migrating-from-pgbouncer.md. Errors use PgBouncer's messages and its
SQLSTATE (08P01 for every console error, as PgBouncer sends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import socket
import stat
import struct
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from scry import __version__
from scry.log import event
from scry.protocol import messages as m
from scry.protocol.auth import ClientAuthExchange
from scry.protocol.errors import PROTOCOL_VIOLATION, ProtocolViolation
from scry.protocol.framing import MessageReader

if TYPE_CHECKING:
    from scry.client import ClientConnection
    from scry.config import Config
    from scry.pool import Pool
    from scry.protocol.startup import StartupMessage
    from scry.proxy import Proxy
    from scry.server import ServerConnection

__all__ = ["AdminConsole", "ConsoleSession", "ConsoleState", "route_login", "state_for"]

PGBOUNCER_VERSION = "1.25.0"
ADMIN_DB = "pgbouncer"

TEXT, INT4, INT8, NUMERIC = 25, 23, 20, 1700
_T, _I, _N = TEXT, INT4, NUMERIC

# PgBouncer's console grammar: ``CMD [arg] [;]`` and ``SET key = value``.
_WORD = r'("(?:[^"]|"")+"|[0-9a-z_]+)'
_CMD = re.compile(rf"^\s*{_WORD}(?:\s+{_WORD})?\s*(?:;\s*)?$", re.IGNORECASE)
_SET = re.compile(
    rf"^\s*set\s+{_WORD}\s*(?:=|to)\s*('(?:[^']|'')*'|{_WORD})\s*(?:;\s*)?$", re.IGNORECASE
)
# Settings clients like to SHOW/SET on connect; PgBouncer fakes them.
_FAKE_PARAMS = {
    "client_encoding": "UTF-8",
    "default_transaction_isolation": "read committed",
    "standard_conforming_strings": "on",
    "datestyle": "ISO",
    "timezone": "GMT",
    "extra_float_digits": "2",
}
_WELCOME = (
    ("server_version", f"{PGBOUNCER_VERSION}/bouncer"),
    ("client_encoding", "UTF8"),
    ("server_encoding", "UTF8"),
    ("DateStyle", "ISO"),
    ("TimeZone", "GMT"),
    ("standard_conforming_strings", "on"),
    ("is_superuser", "on"),
)
_READY = m.ready_for_query()

_HELP = (
    "\n\tSHOW HELP|CONFIG|DATABASES|POOLS|CLIENTS|SERVERS|USERS|VERSION\n"
    "\tSHOW PEERS|PEER_POOLS\n"
    "\tSHOW FDS|SOCKETS|ACTIVE_SOCKETS|LISTS|MEM|STATE\n"
    "\tSHOW DNS_HOSTS|DNS_ZONES\n"
    "\tSHOW STATS|STATS_TOTALS|STATS_AVERAGES|TOTALS\n"
    "\tSHOW PINS|BREAKER|FINGERPRINTS (scry)\n"
    "\tSET key = arg\n"
    "\tRELOAD\n"
    "\tPAUSE [<db>]\n"
    "\tRESUME [<db>]\n"
    "\tDISABLE <db>\n"
    "\tENABLE <db>\n"
    "\tRECONNECT [<db>]\n"
    "\tKILL [<db>]\n"
    "\tKILL_CLIENT <client_id>\n"
    "\tSUSPEND\n"
    "\tSHUTDOWN\n"
    "\tSHUTDOWN WAIT_FOR_SERVERS|WAIT_FOR_CLIENTS\n"
    "\tWAIT_CLOSE [<db>]"
)


class ConsoleError(Exception):
    """A console command failed; the message is PgBouncer's."""


# --------------------------------------------------------------------------- #
# Per-proxy console state
# --------------------------------------------------------------------------- #


@dataclass
class ConsoleState:
    """What the console keeps for one proxy: flags PgBouncer's commands set."""

    sessions: set[ConsoleSession] = field(default_factory=set)
    disabled: set[str] = field(default_factory=set)
    paused: set[str] = field(default_factory=set)  # PAUSE db / KILL db
    paused_all: bool = False
    suspended: bool = False
    shutting_down: bool = False
    #: [pgbouncer] settings changed with SET, applied on top of the file.
    overrides: dict[str, str] = field(default_factory=dict)
    #: Re-read the pgbouncer.ini and apply it (set by scry-pgbouncer / scry serve).
    reload: Callable[[], None] | None = None
    #: (time.monotonic(), {database: totals}) for SHOW STATS averages.
    snapshots: deque[tuple[float, dict[str, list[int]]]] = field(default_factory=deque)
    warned: set[str] = field(default_factory=set)
    #: The Unix socket file this process created (removed at exit).
    unix_path: str | None = None


_states: weakref.WeakKeyDictionary[Proxy, ConsoleState] = weakref.WeakKeyDictionary()
_session_ids = itertools.count(1_000_001)


def state_for(proxy: Proxy) -> ConsoleState:
    """The console state of ``proxy`` (created on first use)."""
    state = _states.get(proxy)
    if state is None:
        state = _states[proxy] = ConsoleState()
    return state


# --------------------------------------------------------------------------- #
# The login hook
# --------------------------------------------------------------------------- #


def route_login(client: ClientConnection, packet: StartupMessage) -> bool:
    """Called by ``ClientConnection._begin_login`` when the config has a
    ``pgbouncer`` section, before the target lookup. Returns True when it took
    the connection (the console, or a refusal); False to go on as usual.

    Also applies PgBouncer's per-database flags (DISABLE, PAUSE/KILL), the
    ``*`` fallback database and the ``[users]`` pool overrides.
    """
    proxy = client.proxy
    compat = proxy.config.pgbouncer
    if compat is None:
        return False
    state = state_for(proxy)
    database = packet.database
    if database == ADMIN_DB:
        _hand_to_console(client, packet, state)
        return True
    if state.shutting_down:
        client.fatal("57P01", "pooler is shutting down")
        return True
    if database in state.disabled:
        client.fatal(PROTOCOL_VIOLATION, f"database does not allow connections: {database}")
        return True
    target = proxy.targets.get(database)
    if target is None and compat.autodb is not None:
        target = _autodb_target(proxy, database)
    if target is None:
        return False
    override = compat.users.get(packet.user)
    paused = state.paused_all or database in state.paused
    if override is not None or paused:
        # Create the pool now (the normal path then finds it) to apply
        # [users] overrides and a PAUSE that came before the pool existed.
        from scry.config import PoolOverride

        user, password = proxy.auth.server_credentials(target, packet.user)
        pool = proxy.pool_for(target, user, password)
        if override is not None:
            changes = PoolOverride(
                mode=override.pool_mode, size=override.pool_size,
                reserve_size=override.reserve_pool_size,
            )  # fmt: skip
            pool.settings = changes.merged_with(target.pool)
        if paused and not pool.paused:
            pool.pause()
    return False


def _autodb_target(proxy: Proxy, database: str) -> Any:
    """A target for ``database`` made from the ``*`` entry (PgBouncer's autodb)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    compat = proxy.config.pgbouncer
    assert compat is not None and compat.autodb is not None
    url = compat.autodb.database_url
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        url = urlunsplit(parts._replace(path="/" + quote(database, safe="")))
    db = compat.autodb.model_copy(update={"database_url": url})
    try:
        target = proxy.config.model_copy(update={"databases": {database: db}}).targets()[database]
    except Exception as exc:  # a bad name cannot make a good URL
        event("autodb failed", logging.WARNING, database=database, error=str(exc))
        return None
    proxy.targets[database] = target
    return target


def _hand_to_console(client: ClientConnection, packet: StartupMessage, state: ConsoleState) -> None:
    from scry.client import CLOSED

    proxy = client.proxy
    transport = client.transport
    rest = bytes(client._startup_buf)
    client._startup_buf.clear()
    client.state = CLOSED  # the ClientConnection is done; the session owns the transport
    proxy.on_client_closed(client)
    session = ConsoleSession(proxy, transport, packet.user, tls=client.tls, state=state)
    transport.set_protocol(session)
    session.start(client.connected_at)
    if rest:
        session.data_received(rest)


# --------------------------------------------------------------------------- #
# The session (protocol side)
# --------------------------------------------------------------------------- #


def _peer_uid(transport: asyncio.BaseTransport) -> tuple[int, int] | None:
    """(pid, uid) of the peer of a Unix socket, or None."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid


class ConsoleSession(asyncio.Protocol):
    """One connection to the ``pgbouncer`` database."""

    def __init__(
        self, proxy: Proxy, transport: asyncio.BaseTransport, user: str, *, tls: bool,
        state: ConsoleState,
    ) -> None:  # fmt: skip
        self.proxy = proxy
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.user = user
        self.tls = tls
        self.state = state
        self.id = next(_session_ids)
        self.connected_at = time.time()
        self.request_at = self.connected_at
        self.console: AdminConsole | None = None
        self._auth: ClientAuthExchange | None = None
        self._reader = MessageReader(proxy.config.max_packet_size)
        self._busy: asyncio.Task[None] | None = None
        self._pending: deque[tuple[int, bytes]] = deque()
        self.closed = False

    # --- login ----------------------------------------------------------------

    def start(self, connected_at: float) -> None:
        self.connected_at = connected_at
        self.state.sessions.add(self)
        proxy = self.proxy
        compat = proxy.config.pgbouncer
        assert compat is not None
        peer = _peer_uid(self.transport)
        if peer is not None and peer[1] == os.getuid() and self.user == ADMIN_DB:
            self._login_ok(admin=True)  # PgBouncer: same OS user over the socket
            return
        method = proxy.auth.method
        if method == "any":
            admin = self.user in compat.admin_users
            self._login_ok(admin=admin)
            return
        self._auth = ClientAuthExchange(method, self.user, proxy.auth.secret_for(self.user))
        self._auth_step(self._auth.start())

    def _auth_step(self, step: Any) -> None:
        if step.error is not None:
            sqlstate, text = step.error
            event("console login failed", logging.WARNING, user=self.user, reason=text)
            self.fatal(sqlstate, text)
            return
        if step.reply:
            self.transport.write(step.reply)
        if step.done:
            self._auth = None
            compat = self.proxy.config.pgbouncer
            assert compat is not None
            if self.user in compat.admin_users:
                self._login_ok(admin=True)
            elif self.user in compat.stats_users:
                self._login_ok(admin=False)
            else:
                event("console login refused", logging.WARNING, user=self.user)
                self.fatal(PROTOCOL_VIOLATION, "not allowed")

    def _login_ok(self, admin: bool) -> None:
        self.console = AdminConsole(self.proxy, self.user, admin=admin, session=self)
        greeting = m.auth_ok() + b"".join(m.parameter_status(k, v) for k, v in _WELCOME)
        self.transport.write(greeting + m.backend_key_data(0, 0) + _READY)
        event("console login", user=self.user, admin=admin)

    # --- asyncio callbacks ---------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._reader.feed(data)
        try:
            while (msg := self._reader.next_message()) is not None:
                self._pending.append(msg)
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))
            return
        self._drain()

    def _drain(self) -> None:
        while self._pending and self._busy is None and not self.closed:
            kind, body = self._pending.popleft()
            if self._auth is not None:
                self._auth_step(self._auth.handle(kind, body))
            elif self.console is None:
                self.fatal(PROTOCOL_VIOLATION, "unexpected message during login")
            elif kind == m.QUERY[0]:
                self.request_at = time.time()
                answer = self.console.handle_query(m.parse_query_text(body))
                if isinstance(answer, bytes):
                    self.transport.write(answer)
                else:
                    self._busy = asyncio.ensure_future(self._wait(answer))
            elif kind == m.TERMINATE[0]:
                self.close()
            elif kind in (m.PARSE[0], m.BIND[0], m.EXECUTE[0]):
                self.fatal(
                    PROTOCOL_VIOLATION, "extended query protocol not supported by admin console"
                )
            else:
                self.fatal(
                    PROTOCOL_VIOLATION, f"unsupported packet type for admin console: {chr(kind)}"
                )

    async def _wait(self, answer: Awaitable[bytes]) -> None:
        try:
            data = await answer
        except asyncio.CancelledError:
            return
        except Exception as exc:  # a bug: answer, do not hang the operator
            event("console command failed", logging.ERROR, error=repr(exc))
            data = _error(f"internal error: {exc}") + _READY
        self._busy = None
        if not self.closed:
            self.transport.write(data)
            self._drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def fatal(self, sqlstate: str, text: str) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self.transport.write(m.error_response(sqlstate, text, severity="FATAL"))
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.state.sessions.discard(self)
        if self._busy is not None:
            self._busy.cancel()
        self.transport.close()


# --------------------------------------------------------------------------- #
# Result building
# --------------------------------------------------------------------------- #


def _error(text: str, sqlstate: str = PROTOCOL_VIOLATION) -> bytes:
    return m.error_response(sqlstate, text)


def _result(columns: Sequence[tuple[str, int]], rows: Iterable[Sequence[Any]], tag: str) -> bytes:
    out = [m.row_description(columns)]
    out.extend(m.data_row(_text(v) for v in row) for row in rows)
    out.append(m.command_complete(tag))
    out.append(_READY)
    return b"".join(out)


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return str(int(value))
    return str(value)


def _ok(tag: str) -> bytes:
    return m.command_complete(tag) + _READY


def _stamp(wall: float) -> str:
    """A timestamp as PgBouncer's console prints it."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(wall))


def _num_id(ident: str) -> int:
    digits = ident[1:]
    return int(digits) if digits.isdigit() else 0


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        return addr or "unix", 0
    return host.strip("[]"), int(port)


# --------------------------------------------------------------------------- #
# The console
# --------------------------------------------------------------------------- #

_SOCKET_COLUMNS: list[tuple[str, int]] = [
    ("type", _T), ("user", _T), ("database", _T), ("replication", _T), ("state", _T),
    ("addr", _T), ("port", _I), ("local_addr", _T), ("local_port", _I),
    ("connect_time", _T), ("request_time", _T), ("wait", _I), ("wait_us", _I),
    ("close_needed", _I), ("ptr", _T), ("link", _T), ("remote_pid", _I), ("tls", _T),
    ("application_name", _T), ("prepared_statements", _I), ("id", _I),
]  # fmt: skip
_SOCKET_DEBUG = [(name, _I) for name in (
    "recv_pos", "pkt_pos", "pkt_remain", "send_pos", "send_remain", "pkt_avail", "send_avail")]  # fmt: skip

_STAT_FIELDS = (
    "server_assignment_count", "xact_count", "query_count", "received", "sent", "xact_time",
    "query_time", "wait_time", "client_parse_count", "server_parse_count", "bind_count",
)  # fmt: skip
_TOTAL_NAMES = ("total_server_assignment_count", "total_xact_count", "total_query_count",
                "total_received", "total_sent", "total_xact_time", "total_query_time",
                "total_wait_time", "total_client_parse_count", "total_server_parse_count",
                "total_bind_count")  # fmt: skip
_AVG_NAMES = ("avg_server_assignment_count", "avg_xact_count", "avg_query_count", "avg_recv",
              "avg_sent", "avg_xact_time", "avg_query_time", "avg_wait_time",
              "avg_client_parse_count", "avg_server_parse_count", "avg_bind_count")  # fmt: skip
_TOTALS_SHORT = ("server_assignment_count", "xact_count", "query_count", "bytes_received",
                 "bytes_sent", "xact_time", "query_time", "wait_time", "client_parse_count",
                 "server_parse_count", "bind_count")  # fmt: skip
_AVERAGES_SHORT = ("server_assignment_count", "xact_count", "query_count", "bytes_received",
                   "bytes_sent", "xact_time", "query_time", "wait_time", "avg_client_parse_count",
                   "avg_server_parse_count", "avg_bind_count")  # fmt: skip
_XACT_COUNT, _QUERY_COUNT, _XACT_TIME, _QUERY_TIME, _WAIT_TIME = 1, 2, 5, 6, 7


class AdminConsole:
    """Answers the ``pgbouncer`` console's SQL for one user.

    ``admin`` users may run everything; others (stats_users) only SHOW.
    """

    def __init__(
        self, proxy: Proxy, user: str, *, admin: bool, session: ConsoleSession | None = None
    ) -> None:
        self.proxy = proxy
        self.user = user
        self.admin = admin
        self.session = session
        self.state = state_for(proxy)

    # --- dispatch ---------------------------------------------------------------

    def handle_query(self, sql: str) -> bytes | Awaitable[bytes]:
        """The full answer (ending in ReadyForQuery) to one simple Query."""
        try:
            return self._dispatch(sql)
        except ConsoleError as exc:
            event("console error", logging.WARNING, user=self.user, error=str(exc))
            return _error(str(exc)) + _READY

    def _dispatch(self, sql: str) -> bytes | Awaitable[bytes]:
        match = _CMD.match(sql)
        if match:
            command = _unquote(match[1], '"').lower()
            arg = _unquote(match[2], '"') if match[2] else ""
            if command in ("show", "select"):
                return self._show(arg, sql)
            handler = self._COMMANDS.get(command)
            if handler is None:
                raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
            if not self.admin:
                raise ConsoleError("admin access needed")
            return handler(self, arg, sql)
        match = _SET.match(sql)
        if match:
            key = _unquote(match[1], '"')
            raw = match[2]
            value = _unquote(raw, "'") if raw.startswith("'") else _unquote(raw, '"')
            return self._set(key, value)
        raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")

    def _show(self, what: str, sql: str) -> bytes:
        name = what.lower()
        if name in _FAKE_PARAMS:
            return _result([(name, _T)], [[_FAKE_PARAMS[name]]], "SHOW")
        show = self._SHOWS.get(name)
        if show is None:
            raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
        if name == "fds" and not self.admin:
            raise ConsoleError("admin access needed")
        return show(self)

    # --- SHOW -------------------------------------------------------------------

    def show_help(self) -> bytes:
        return m.notice_response("Console usage", detail=_HELP) + _ok("SHOW")

    def show_version(self) -> bytes:
        return _result([("version", _T)], [[f"PgBouncer {PGBOUNCER_VERSION} (scry {__version__})"]], "SHOW")  # fmt: skip

    def show_state(self) -> bytes:
        st = self.state
        paused = st.paused_all
        rows = [
            ["active", "no" if paused or st.suspended else "yes"],
            ["paused", "yes" if paused else "no"],
            ["suspended", "yes" if st.suspended else "no"],
        ]
        return _result([("key", _T), ("value", _T)], rows, "SHOW")

    def show_pools(self) -> bytes:
        columns = [("database", _T), ("user", _T)] + [(c, _I) for c in (
            "cl_active", "cl_waiting", "cl_active_cancel_req", "cl_waiting_cancel_req",
            "sv_active", "sv_active_cancel", "sv_being_canceled", "sv_idle", "sv_used",
            "sv_tested", "sv_login", "maxwait", "maxwait_us")] + [
            ("pool_mode", _T), ("load_balance_hosts", _T)]  # fmt: skip
        clients = self._clients_by_pool()
        rows = []
        for pool in list(self.proxy.pools.values()):
            mine = clients.get(id(pool), [])
            waiting = sum(1 for c in mine if c.waiting_since)
            counts = self._server_counts(pool)
            wait_us = int(pool.oldest_wait() * 1e6)
            rows.append([
                pool.target.name, pool.server_user, len(mine) - waiting, waiting, 0, 0,
                counts["active"], 0, 0, counts["idle"], counts["used"], counts["tested"],
                counts["new"], wait_us // 1_000_000, wait_us % 1_000_000, pool.mode, None,
            ])  # fmt: skip
        sessions = len(self.state.sessions)
        rows.append([ADMIN_DB, ADMIN_DB, sessions, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                     "statement", None])  # fmt: skip
        return _result(columns, rows, "SHOW")

    def show_clients(self) -> bytes:
        rows = [self._client_row(c, debug=False) for c in self._sorted_clients()]
        rows.extend(self._session_row(s, debug=False) for s in self._sorted_sessions())
        return _result(_SOCKET_COLUMNS, rows, "SHOW")

    def show_servers(self) -> bytes:
        rows = [self._server_row(s, debug=False) for s in self._sorted_servers()]
        return _result(_SOCKET_COLUMNS, rows, "SHOW")

    def show_sockets(self) -> bytes:
        rows = [self._client_row(c, debug=True) for c in self._sorted_clients()]
        rows.extend(self._server_row(s, debug=True) for s in self._sorted_servers())
        rows.extend(self._session_row(s, debug=True) for s in self._sorted_sessions())
        return _result(_SOCKET_COLUMNS + _SOCKET_DEBUG, rows, "SHOW")

    def show_active_sockets(self) -> bytes:
        # scry keeps no per-socket buffers: no socket has unsent or unparsed data.
        return _result(_SOCKET_COLUMNS + _SOCKET_DEBUG, [], "SHOW")

    def show_databases(self) -> bytes:
        columns = [("name", _T), ("host", _T), ("port", _I), ("database", _T),
                   ("force_user", _T), ("pool_size", _I), ("min_pool_size", _I),
                   ("reserve_pool_size", _I), ("server_lifetime", _I), ("pool_mode", _T),
                   ("load_balance_hosts", _T), ("max_connections", _I),
                   ("current_connections", _I), ("max_client_connections", _I),
                   ("current_client_connections", _I), ("paused", _I), ("disabled", _I)]  # fmt: skip
        proxy = self.proxy
        config = proxy.config
        servers: dict[str, int] = {}
        pools_paused: dict[str, bool] = {}
        for pool in list(proxy.pools.values()):
            name = pool.target.name
            servers[name] = servers.get(name, 0) + len(pool.servers) + pool.connecting
            pools_paused[name] = pools_paused.get(name, False) or pool.paused
        clients: dict[str, int] = {}
        for client in list(proxy.clients):
            clients[client.database] = clients.get(client.database, 0) + 1
        lifetime = int(config.timeouts.server_lifetime)
        overrides = {name: db.pool for name, db in config.databases.items()}
        rows = []
        for name in sorted(proxy.targets):
            target = proxy.targets[name]
            override = overrides.get(name)
            mode = override.mode if override is not None else None
            paused = self.state.paused_all or name in self.state.paused or pools_paused.get(name)
            rows.append([
                name, "unix" if target.host.startswith("/") else target.host, target.port,
                target.dbname, target.user, target.pool.size, target.pool.min_size,
                target.pool.reserve_size, lifetime, mode, None, 0, servers.get(name, 0), 0,
                clients.get(name, 0), paused, name in self.state.disabled,
            ])  # fmt: skip
        port = config.listen_host_port[1]
        rows.append([ADMIN_DB, None, port, ADMIN_DB, ADMIN_DB, 2, 0, 0, lifetime, "statement",
                     None, 0, 0, 0, len(self.state.sessions), 0, 0])  # fmt: skip
        rows.sort(key=lambda r: r[0])
        return _result(columns, rows, "SHOW")

    def show_users(self) -> bytes:
        columns = [("name", _T), ("pool_size", _T), ("reserve_pool_size", _T), ("pool_mode", _T),
                   ("max_user_connections", _I), ("current_connections", _I),
                   ("max_user_client_connections", _I), ("current_client_connections", _I)]  # fmt: skip
        compat = self.proxy.config.pgbouncer
        overrides = compat.users if compat is not None else {}
        servers: dict[str, int] = {}
        for pool in list(self.proxy.pools.values()):
            servers[pool.server_user] = servers.get(pool.server_user, 0) + len(pool.servers)
        clients: dict[str, int] = {}
        for client in list(self.proxy.clients):
            clients[client.user] = clients.get(client.user, 0) + 1
        names = set(self.proxy.auth.users) | set(overrides) | {ADMIN_DB}
        rows = []
        for name in sorted(names):
            o = overrides.get(name)
            rows.append([
                name,
                f"{o.pool_size:9d}" if o is not None and o.pool_size is not None else "",
                f"{o.reserve_pool_size:9d}" if o is not None and o.reserve_pool_size is not None else "",
                o.pool_mode if o is not None else None,
                0, servers.get(name, 0), 0, clients.get(name, 0),
            ])  # fmt: skip
        return _result(columns, rows, "SHOW")

    def show_lists(self) -> bytes:
        proxy = self.proxy
        servers = sum(len(p.servers) for p in proxy.pools.values())
        login = sum(1 for c in proxy.clients if c.state != "ready")
        users = set(proxy.auth.users)
        compat = proxy.config.pgbouncer
        if compat is not None:
            users |= set(compat.users)
        rows = [
            ["databases", len(proxy.targets) + 1],
            ["users", len(users | {ADMIN_DB})],
            ["peers", len(proxy.config.peers)],
            ["pools", len(proxy.pools) + 1],
            ["peer_pools", 0],
            ["free_clients", 0],
            ["used_clients", len(proxy.clients) + len(self.state.sessions)],
            ["login_clients", login],
            ["free_servers", 0],
            ["used_servers", servers],
            ["dns_names", 0],
            ["dns_zones", 0],
            ["dns_queries", 0],
            ["dns_pending", 0],
        ]
        return _result([("list", _T), ("items", _I)], rows, "SHOW")

    def show_peers(self) -> bytes:
        columns = [("peer_id", _I), ("host", _T), ("port", _I), ("pool_size", _I)]
        rows = []
        size = self.proxy.config.pool.size
        for peer_id, addr in sorted(self.proxy.config.peers.items()):
            host, port = _split_addr(addr)
            rows.append([peer_id, host, port, size])
        return _result(columns, rows, "SHOW")

    def show_peer_pools(self) -> bytes:
        columns = [("peer_id", _I), ("cl_active_cancel_req", _I), ("cl_waiting_cancel_req", _I),
                   ("sv_active_cancel", _I), ("sv_login", _I)]  # fmt: skip
        rows = [[peer_id, 0, 0, 0, 0] for peer_id in sorted(self.proxy.config.peers)]
        return _result(columns, rows, "SHOW")

    def show_config(self) -> bytes:
        from scry.pgbouncer.ini import PGBOUNCER_KEYS, parse_ini

        values: dict[str, str] = {}
        compat = self.proxy.config.pgbouncer
        if compat is not None and compat.conffile:
            with contextlib.suppress(Exception):
                ini = parse_ini(compat.conffile)
                values = {k: e.value for k, e in ini.section("pgbouncer").items()}
        values.update(self.state.overrides)
        if compat is not None and compat.conffile:
            values["conffile"] = compat.conffile
        rows = []
        for key in sorted(PGBOUNCER_KEYS):
            spec = PGBOUNCER_KEYS[key]
            value = values.get(key, spec.default)
            rows.append([key, value, spec.default, "yes" if spec.changeable else "no"])
        columns = [("key", _T), ("value", _T), ("default", _T), ("changeable", _T)]
        return _result(columns, rows, "SHOW")

    def show_mem(self) -> bytes:
        columns = [("name", _T), ("size", _I), ("used", _I), ("free", _I), ("memtotal", _I)]
        return _result(columns, [], "SHOW")  # scry has no slab allocator to report

    def show_dns_hosts(self) -> bytes:
        return _result([("hostname", _T), ("ttl", INT8), ("addrs", _T)], [], "SHOW")

    def show_dns_zones(self) -> bytes:
        return _result([("zonename", _T), ("serial", INT8), ("count", _I)], [], "SHOW")

    def show_fds(self) -> bytes:
        raise ConsoleError("SHOW FDS is not supported by scry (no online restart with -R)")

    # --- statistics ----------------------------------------------------------------

    def _totals(self) -> dict[str, list[int]]:
        """Per database, the 11 counters of SHOW STATS (see the module docstring)."""
        by_db: dict[str, list[int]] = {name: [0] * 11 for name in self.proxy.targets}
        for pool in list(self.proxy.pools.values()):
            row = by_db.setdefault(pool.target.name, [0] * 11)
            st = pool.stats
            for index, value in enumerate((
                st.server_assignment_count, st.xact_count, st.query_count, st.received,
                st.sent, int(st.xact_time * 1e6), int(st.query_time * 1e6),
                pool.total_wait_us, st.client_parse_count, st.server_parse_count,
                st.bind_count,
            )):  # fmt: skip
                row[index] += value
        by_db.setdefault(ADMIN_DB, [0] * 11)
        return by_db

    def _averages(self, totals: dict[str, list[int]]) -> dict[str, list[int]]:
        """Per-second rates and per-query times over the last ``stats_period``."""
        compat = self.proxy.config.pgbouncer
        period = compat.stats_period if compat is not None else 60
        now = time.monotonic()
        snaps = self.state.snapshots
        if not snaps:
            snaps.append((now - (time.time() - self.proxy.started_at), {}))
        base_t, base = snaps[0]
        for t, snap in snaps:
            if t <= now - period:
                base_t, base = t, snap
        while len(snaps) > 1 and snaps[1][0] <= now - period:
            snaps.popleft()
        snaps.append((now, {k: list(v) for k, v in totals.items()}))
        seconds = max(now - base_t, 1e-6)
        out = {}
        for name, row in totals.items():
            old = base.get(name, [0] * 11)
            delta = [a - b for a, b in zip(row, old, strict=True)]
            queries = delta[_QUERY_COUNT]
            avg = [int(d / seconds) for d in delta]
            xacts = delta[_XACT_COUNT]
            avg[_XACT_TIME] = delta[_XACT_TIME] // xacts if xacts else 0
            avg[_QUERY_TIME] = delta[_QUERY_TIME] // queries if queries else 0
            avg[_WAIT_TIME] = delta[_WAIT_TIME] // queries if queries else 0
            out[name] = avg
        return out

    def show_stats(self) -> bytes:
        totals = self._totals()
        averages = self._averages(totals)
        columns = [("database", _T)] + [(n, _N) for n in (*_TOTAL_NAMES, *_AVG_NAMES)]
        rows = [[name, *totals[name], *averages[name]] for name in sorted(totals)]
        return _result(columns, rows, "SHOW")

    def show_stats_totals(self) -> bytes:
        totals = self._totals()
        columns = [("database", _T)] + [(n, _N) for n in _TOTALS_SHORT]
        return _result(columns, [[n, *totals[n]] for n in sorted(totals)], "SHOW")

    def show_stats_averages(self) -> bytes:
        averages = self._averages(self._totals())
        columns = [("database", _T)] + [(n, _N) for n in _AVERAGES_SHORT]
        return _result(columns, [[n, *averages[n]] for n in sorted(averages)], "SHOW")

    def show_totals(self) -> bytes:
        totals = self._totals()
        averages = self._averages(totals)
        total = [sum(col) for col in zip(*totals.values(), strict=True)]
        avg = [sum(col) for col in zip(*averages.values(), strict=True)]
        # Per-query and per-transaction times are weighted by their rates, not summed.
        for index, rate in ((_QUERY_TIME, _QUERY_COUNT), (_WAIT_TIME, _QUERY_COUNT),
                            (_XACT_TIME, _XACT_COUNT)):  # fmt: skip
            rates = [a[rate] for a in averages.values()]
            weighted = sum(a[index] * r for a, r in zip(averages.values(), rates, strict=True))
            avg[index] = weighted // sum(rates) if sum(rates) else 0
        rows = [[n, v] for n, v in zip(_TOTAL_NAMES, total, strict=True)]
        rows += [[n, v] for n, v in zip(_AVG_NAMES, avg, strict=True)]
        return _result([("name", _T), ("value", _N)], rows, "SHOW")

    # --- scry's own views ------------------------------------------------------------

    def show_pins(self) -> bytes:
        columns = [("client_id", _I), ("database", _T), ("user", _T), ("server_id", _I),
                   ("reasons", _T), ("replayable", _I), ("pinned_s", _N)]  # fmt: skip
        now = self.proxy.clock
        rows = []
        for client in self._sorted_clients():
            tracker = client.tracker
            if tracker is None or not tracker.pinned:
                continue
            described = tracker.state.describe()
            since = tracker.pinned_since
            server = client.server
            rows.append([
                _num_id(client.id), client.database, client.user,
                _num_id(server.id) if server is not None else None,
                ",".join(described["reasons"]), bool(described["replayable"]),
                round(max(0.0, now - since), 3) if since else None,
            ])  # fmt: skip
        return _result(columns, rows, "SHOW")

    def show_breaker(self) -> bytes:
        columns = [("database", _T), ("state", _T), ("failures", _I), ("reason", _T)]
        rows = []
        for name in sorted(set(self.proxy.targets) | set(self.proxy.breakers)):
            snap = self.proxy.breaker_for(name).snapshot()
            counters = snap.get("counters") or {}
            reason = snap.get("open_reason") or snap.get("last_failure_reason")
            rows.append([name, str(snap.get("state")), counters.get("failures", 0), reason])
        return _result(columns, rows, "SHOW")

    def show_fingerprints(self) -> bytes:
        columns = [("fingerprint", _T), ("calls", INT8), ("errors", INT8), ("total_ms", _N),
                   ("mean_ms", _N), ("p99_ms", _N), ("query", _T)]  # fmt: skip
        rows = []
        for entry in self.proxy.observatory.top(limit=50):
            rows.append([
                entry.get("fingerprint"), entry.get("calls"), entry.get("errors"),
                _fmt(entry.get("total_ms")), _fmt(entry.get("mean_ms")),
                _fmt(entry.get("p99_ms")), entry.get("query") or entry.get("normalized"),
            ])  # fmt: skip
        return _result(columns, rows, "SHOW")

    _SHOWS: dict[str, Callable[[AdminConsole], bytes]] = {
        "help": show_help, "version": show_version, "state": show_state, "pools": show_pools,
        "clients": show_clients, "servers": show_servers, "sockets": show_sockets,
        "active_sockets": show_active_sockets, "databases": show_databases,
        "users": show_users, "lists": show_lists, "peers": show_peers,
        "peer_pools": show_peer_pools, "config": show_config, "mem": show_mem,
        "dns_hosts": show_dns_hosts, "dns_zones": show_dns_zones, "fds": show_fds,
        "stats": show_stats, "stats_totals": show_stats_totals,
        "stats_averages": show_stats_averages, "totals": show_totals, "pins": show_pins,
        "breaker": show_breaker, "fingerprints": show_fingerprints,
    }  # fmt: skip

    # --- rows ----------------------------------------------------------------------

    def _clients_by_pool(self) -> dict[int, list[ClientConnection]]:
        out: dict[int, list[ClientConnection]] = {}
        for client in list(self.proxy.clients):
            if client.pool is not None and client.state == "ready":
                out.setdefault(id(client.pool), []).append(client)
        return out

    def _server_counts(self, pool: Pool) -> dict[str, int]:
        counts = {"active": 0, "idle": 0, "used": 0, "tested": 0, "new": pool.connecting}
        for server in list(pool.servers):
            counts[self._server_state(server)] = counts.get(self._server_state(server), 0) + 1
        return counts

    def _server_state(self, server: ServerConnection) -> str:
        state = server.state
        if state == "internal":
            return "tested"
        if state in ("connecting", "login"):
            return "new"
        client = server.client
        if client is not None and not client.parked:
            return "active"
        delay = self.proxy.config.timeouts.server_check_delay
        if delay and self.proxy.clock - server.last_used > delay:
            return "used"
        return "idle"

    def _sorted_clients(self) -> list[ClientConnection]:
        return sorted(self.proxy.clients, key=lambda c: _num_id(c.id))

    def _sorted_servers(self) -> list[ServerConnection]:
        every = [s for pool in list(self.proxy.pools.values()) for s in pool.servers]
        return sorted(every, key=lambda s: _num_id(s.id))

    def _sorted_sessions(self) -> list[ConsoleSession]:
        return sorted(self.state.sessions, key=lambda s: s.id)

    def _client_row(self, client: ClientConnection, debug: bool) -> list[Any]:
        now_wall, now_mono = time.time(), time.monotonic()
        server = client.server
        if client.waiting_since:
            state = "waiting"
            waited = (perf_counter_ns() - client.waiting_since) // 1000
        else:
            state = "active" if server is not None and not client.parked else "idle"
            waited = 0
        if debug:
            state = "cl_login" if client.state != "ready" else f"cl_{state}".replace(
                "cl_idle", "cl_active")  # fmt: skip
        addr, port = _split_addr(client.addr)
        local = client.transport.get_extra_info("sockname") if client.transport else None
        local_addr, local_port = (local[0], local[1]) if isinstance(local, tuple) else ("unix", 0)
        peer = _peer_uid(client.transport) if client.transport and addr == "unix" else None
        request = client.last_active and now_wall - (now_mono - client.last_active)
        statements = client.statements
        row = [
            "C", client.user or "(nouser)", client.database or "(nodb)", "none", state,
            addr, port, local_addr, local_port, _stamp(client.connected_at),
            _stamp(request or client.connected_at), waited // 1_000_000, waited % 1_000_000, 0,
            client.id, server.id if server is not None else "", peer[0] if peer else 0,
            "TLS" if client.tls else "", client.application_name,
            len(statements.by_name) if statements is not None else 0, _num_id(client.id),
        ]  # fmt: skip
        return row + [0] * 7 if debug else row

    def _server_row(self, server: ServerConnection, debug: bool) -> list[Any]:
        now_wall, now_mono = time.time(), time.monotonic()
        pool = server.pool
        target = pool.target
        state = self._server_state(server)
        if debug:
            state = {"new": "sv_login"}.get(state, f"sv_{state}")
        local_addr, local_port = _split_addr(server.local_addr)
        client = server.client
        linked = client is not None and not client.parked
        row = [
            "S", pool.server_user, target.name, "none", state,
            "unix" if target.host.startswith("/") else target.host, target.port,
            local_addr, local_port, _stamp(now_wall - (now_mono - server.created_at)),
            _stamp(now_wall - (now_mono - server.last_used)), 0, 0,
            1 if (server.retire or pool.stale) else 0, server.id,
            client.id if linked and client is not None else "", server.backend_pid,
            "TLS" if server.tls else "",
            client.application_name if linked and client is not None else "",
            len(server.statements.names), _num_id(server.id),
        ]  # fmt: skip
        return row + [0] * 7 if debug else row

    def _session_row(self, session: ConsoleSession, debug: bool) -> list[Any]:
        peer = session.transport.get_extra_info("peername")
        addr, port = (peer[0], peer[1]) if isinstance(peer, tuple) else ("unix", 0)
        local = session.transport.get_extra_info("sockname")
        local_addr, local_port = (local[0], local[1]) if isinstance(local, tuple) else ("unix", 0)
        row = [
            "C", session.user, ADMIN_DB, "none", "cl_active" if debug else "active", addr, port,
            local_addr, local_port, _stamp(session.connected_at), _stamp(session.request_at),
            0, 0, 0, f"a{session.id}", "", 0, "TLS" if session.tls else "", "", 0, session.id,
        ]  # fmt: skip
        return row + [0] * 7 if debug else row

    # --- SET and process control ---------------------------------------------------

    def _set(self, key: str, value: str) -> bytes:
        if key.lower() in _FAKE_PARAMS:
            return m.notice_response("SET ignored") + _ok("SET")
        if not self.admin:
            raise ConsoleError("admin access needed")
        from scry.pgbouncer.ini import PGBOUNCER_KEYS, IniError

        spec = PGBOUNCER_KEYS.get(key.lower())
        if spec is None or not spec.changeable:
            event("SET failed", logging.WARNING, key=key, reason="unknown or not changeable")
            raise ConsoleError("SET failed")
        previous = self.state.overrides.get(key.lower())
        self.state.overrides[key.lower()] = value
        try:
            reload_pgbouncer_config(self.proxy)
        except (IniError, RuntimeError) as exc:
            if previous is None:
                self.state.overrides.pop(key.lower(), None)
            else:
                self.state.overrides[key.lower()] = previous
            event("SET failed", logging.WARNING, key=key, error=str(exc))
            raise ConsoleError("SET failed") from None
        return _ok(f"SET {key}={value}")

    def cmd_reload(self, arg: str, sql: str) -> bytes:
        if arg:
            raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
        event("RELOAD command issued")
        try:
            reload_pgbouncer_config(self.proxy)
        except Exception as exc:
            event("RELOAD failed", logging.ERROR, error=str(exc))
            return _error("RELOAD failed, see logs for additional details", "F0000") + _READY
        return _ok("RELOAD")

    def _known_db(self, name: str) -> None:
        if name == ADMIN_DB:
            raise ConsoleError(f"cannot use admin db: {name}")
        if name not in self.proxy.targets:
            compat = self.proxy.config.pgbouncer
            if compat is None or compat.autodb is None or _autodb_target(self.proxy, name) is None:
                raise ConsoleError(f"no such database: {name}")

    def cmd_pause(self, arg: str, sql: str) -> Awaitable[bytes] | bytes:
        st = self.state
        if st.paused_all or st.suspended:
            raise ConsoleError("already suspended/paused")
        if arg:
            if arg == ADMIN_DB:
                raise ConsoleError(f"cannot pause admin db: {arg}")
            self._known_db(arg)
            st.paused.add(arg)
        else:
            st.paused_all = True
        event("PAUSE command issued", database=arg or "*")
        return self._finish_pause(arg or None)

    async def _finish_pause(self, database: str | None) -> bytes:
        await self.proxy.pause(database)
        return _ok("PAUSE")

    def cmd_resume(self, arg: str, sql: str) -> bytes:
        st = self.state
        if st.shutting_down:
            raise ConsoleError("pooler is shutting down")
        if not arg:
            if not (st.paused_all or st.suspended or st.paused):
                raise ConsoleError("pooler is not paused/suspended")
            st.paused_all = False
            st.paused.clear()
            if st.suspended:
                st.suspended = False
                self._resume_reading()
            self.proxy.resume()
        else:
            if arg not in self.proxy.targets:
                raise ConsoleError(f"no such database: {arg}")
            if arg not in st.paused and not st.paused_all:
                raise ConsoleError(f"database {arg} is not paused")
            st.paused.discard(arg)
            self.proxy.resume(arg)
        event("RESUME command issued", database=arg or "*")
        return _ok("RESUME")

    def cmd_suspend(self, arg: str, sql: str) -> bytes:
        st = self.state
        if arg:
            raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
        if st.paused_all or st.suspended:
            raise ConsoleError("already suspended/paused")
        if st.paused:
            raise ConsoleError("cannot suspend with paused databases")
        st.suspended = True
        # scry has no socket buffers to flush: stop reading every connection.
        for client in list(self.proxy.clients):
            if client.transport is not None:
                client.transport.pause_reading()
        for pool in list(self.proxy.pools.values()):
            for server in list(pool.servers):
                if server.transport is not None:
                    server.transport.pause_reading()
        event("SUSPEND command issued")
        return _ok("SUSPEND")

    def _resume_reading(self) -> None:
        for pool in list(self.proxy.pools.values()):
            for server in list(pool.servers):
                if server.transport is not None and not server.paused_by_client:
                    with contextlib.suppress(Exception):
                        server.transport.resume_reading()
        for client in list(self.proxy.clients):
            with contextlib.suppress(Exception):
                client._update_reading()

    def cmd_disable(self, arg: str, sql: str) -> bytes:
        if not arg:
            raise ConsoleError("a database is required")
        if arg == ADMIN_DB:
            raise ConsoleError(f"cannot disable admin db: {arg}")
        self._known_db(arg)
        self.state.disabled.add(arg)
        event("DISABLE command issued", database=arg)
        return _ok("DISABLE")

    def cmd_enable(self, arg: str, sql: str) -> bytes:
        if not arg:
            raise ConsoleError("a database is required")
        if arg == ADMIN_DB:
            raise ConsoleError(f"cannot enable admin db: {arg}")
        if arg not in self.proxy.targets:
            raise ConsoleError(f"no such database: {arg}")
        self.state.disabled.discard(arg)
        event("ENABLE command issued", database=arg)
        return _ok("ENABLE")

    def _pools_of(self, database: str | None) -> list[Pool]:
        return [p for p in list(self.proxy.pools.values()) if database in (None, p.target.name)]

    def cmd_reconnect(self, arg: str, sql: str) -> bytes:
        if arg:
            if arg == ADMIN_DB:
                raise ConsoleError(f"cannot reconnect admin db: {arg}")
            self._known_db(arg)
        for pool in self._pools_of(arg or None):
            for client in list(pool.parked):  # held between transactions: take back
                server = client.server
                del pool.parked[client]
                client.parked = False
                if server is not None and client.detach_idle_server() is server:
                    server.close("RECONNECT")
            for server in list(pool.servers):
                server.retire = True  # closed when its client gives it back
            for server in list(pool.idle):
                server.close("RECONNECT")
        event("RECONNECT command issued", database=arg or "*")
        return _ok("RECONNECT")

    def cmd_kill(self, arg: str, sql: str) -> bytes:
        st = self.state
        if st.paused_all or st.suspended:
            raise ConsoleError("already suspended/paused")
        if arg:
            if arg == ADMIN_DB:
                raise ConsoleError(f"cannot kill admin db: {arg}")
            self._known_db(arg)
            st.paused.add(arg)
        else:
            st.paused_all = True
        database = arg or None
        for client in list(self.proxy.clients):
            if database in (None, client.database):
                client.fatal("08P01", "database removed")
        for pool in self._pools_of(database):
            pool.pause()
            pool.close_all("KILL")
        event("KILL command issued", database=arg or "*")
        return _ok("KILL")

    def cmd_kill_client(self, arg: str, sql: str) -> bytes:
        wanted = arg.lstrip("cC")
        if not wanted.isdigit():
            raise ConsoleError("invalid client pointer supplied")
        for client in list(self.proxy.clients):
            if _num_id(client.id) == int(wanted):
                client.fatal("08P01", "admin forced disconnect")
                return _ok("KILL_CLIENT")
        for session in list(self.state.sessions):
            if session.id == int(wanted):
                session.fatal("08P01", "admin forced disconnect")
                return _ok("KILL_CLIENT")
        raise ConsoleError("client not found")

    def cmd_wait_close(self, arg: str, sql: str) -> Awaitable[bytes] | bytes:
        if arg:
            if arg == ADMIN_DB:
                raise ConsoleError(f"cannot wait in admin db: {arg}")
            self._known_db(arg)
        pools = self._pools_of(arg or None)

        def pending() -> bool:
            return any(s.retire or p.stale for p in pools for s in list(p.servers))

        if not pending():
            return _ok("WAIT_CLOSE")

        async def wait() -> bytes:
            while pending():  # noqa: ASYNC110 - nothing signals a server close
                await asyncio.sleep(0.05)
            return _ok("WAIT_CLOSE")

        return wait()

    def cmd_shutdown(self, arg: str, sql: str) -> Awaitable[bytes] | bytes:
        mode = arg.upper()
        if mode not in ("", "WAIT_FOR_SERVERS", "WAIT_FOR_CLIENTS"):
            raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
        proxy = self.proxy
        event("SHUTDOWN command issued", mode=mode or "immediate")
        self.state.shutting_down = True
        if not mode:
            # PgBouncer exits without answering; the connection closes with the process.
            asyncio.get_running_loop().call_soon(proxy.stop_now)
            return asyncio.get_running_loop().create_future()  # never answered
        for listener in proxy.listeners:
            listener.close()
        if mode == "WAIT_FOR_SERVERS":
            proxy.begin_drain()
        else:

            async def wait_for_clients() -> None:
                while proxy.clients:  # noqa: ASYNC110 - polled, as Proxy._drain does
                    await asyncio.sleep(0.05)
                proxy.stop_now()

            asyncio.get_running_loop().create_task(wait_for_clients())
        return _ok("SHUTDOWN")

    _COMMANDS: dict[str, Callable[[AdminConsole, str, str], Any]] = {
        "disable": cmd_disable, "enable": cmd_enable, "kill": cmd_kill,
        "kill_client": cmd_kill_client, "pause": cmd_pause, "reconnect": cmd_reconnect,
        "reload": cmd_reload, "resume": cmd_resume, "shutdown": cmd_shutdown,
        "suspend": cmd_suspend, "wait_close": cmd_wait_close,
    }  # fmt: skip


def _fmt(value: Any) -> str | None:
    return None if value is None else f"{float(value):.3f}"


def _unquote(text: str, quote_char: str) -> str:
    if len(text) >= 2 and text[0] == quote_char and text[-1] == quote_char:
        return text[1:-1].replace(quote_char * 2, quote_char)
    return text


# --------------------------------------------------------------------------- #
# Reloading from the pgbouncer.ini
# --------------------------------------------------------------------------- #


def reload_pgbouncer_config(proxy: Proxy) -> list[str]:
    """Re-read the pgbouncer.ini (plus SET overrides) and apply it; returns the
    warnings not reported before. Raises IniError when the file is unusable."""
    from scry.pgbouncer.ini import IniError, load_pgbouncer_config

    state = state_for(proxy)
    compat = proxy.config.pgbouncer
    if compat is None or not compat.conffile:
        raise IniError("no pgbouncer.ini to reload")
    config, warnings = load_pgbouncer_config(compat.conffile, state.overrides)
    apply_config(proxy, config)
    fresh = [w for w in warnings if w not in state.warned]
    for warning in fresh:
        state.warned.add(warning)
        event(warning, logging.WARNING)
    return fresh


def apply_config(proxy: Proxy, config: Config) -> None:
    """Apply a new Config to a running proxy, as its own reload does.

    Uses ``Proxy.apply_config`` when the proxy has it. Otherwise the proxy's
    file reload is run with this Config in place of the file (Proxy.reload
    reads ``scry.proxy.load_config``): a stopgap until the proxy takes a loader.
    """
    apply = getattr(proxy, "apply_config", None)
    if callable(apply):
        apply(config)
        return
    import scry.proxy as proxy_module

    original = proxy_module.load_config
    saved_path = proxy.config_path
    proxy_module.load_config = lambda *_a, **_k: config  # type: ignore[assignment]
    proxy.config_path = proxy.config_path or "pgbouncer.ini"
    try:
        proxy.reload()
    finally:
        proxy_module.load_config = original
        proxy.config_path = saved_path


# --------------------------------------------------------------------------- #
# The Unix socket
# --------------------------------------------------------------------------- #


async def start_unix_listener(proxy: Proxy) -> asyncio.Server:
    """Listen on ``unix_socket_dir/.s.PGSQL.<port>`` as PgBouncer does (called
    from ``Proxy.start``); a stale socket file from a dead process is replaced."""
    from scry.client import ClientConnection

    compat = proxy.config.pgbouncer
    assert compat is not None and compat.unix_socket_dir
    path = os.path.join(compat.unix_socket_dir, f".s.PGSQL.{proxy.listen_port}")
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: ClientConnection(proxy), path, backlog=4096)
    state_for(proxy).unix_path = path
    os.chmod(path, compat.unix_socket_mode)
    if compat.unix_socket_group:
        import grp

        os.chown(path, -1, grp.getgrnam(compat.unix_socket_group).gr_gid)
    event("listening", addr=f"unix:{path}")
    return server
