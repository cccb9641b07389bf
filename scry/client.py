"""A client connected to scry: startup, authentication, then the relay.

``ClientConnection`` is an ``asyncio.Protocol``:

    startup -> auth -> login (waiting for the pool's first server) -> ready -> closed

In ``ready`` every chunk from the client is scanned for the messages that
matter to pooling (Query, Sync and FunctionCall each owe one ReadyForQuery;
Terminate ends the client) and forwarded whole to its server. Without a server
the chunk is queued, reading pauses, and the pool is asked for one; in
transaction mode the server goes back as soon as it reports idle with nothing
owed, at a message boundary on both sides.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import itertools
import logging
import ssl
import time
from collections import deque
from time import monotonic, perf_counter_ns
from typing import TYPE_CHECKING

from scry.breaker import CLOSED as BREAKER_CLOSED
from scry.hybrid import SessionTracker
from scry.log import event, logging_info
from scry.observe.record import ClientContext
from scry.pool import Pool, PoolStats, connect_error
from scry.protocol import messages as m
from scry.protocol import startup as st
from scry.protocol.auth import AuthStep, ClientAuthExchange
from scry.protocol.errors import (
    ADMIN_SHUTDOWN,
    CONNECTION_FAILURE,
    FEATURE_NOT_SUPPORTED,
    INVALID_AUTHORIZATION,
    PROTOCOL_VIOLATION,
    TOO_MANY_CONNECTIONS,
    ProtocolViolation,
)
from scry.protocol.framing import MessageReader, MessageScanner
from scry.protocol.prepared import ClientStatements
from scry.protocol.prepared import rewrite as rewrite_statements
from scry.server import REC_EXECUTE, REC_QUERY, REC_SYNC, ServerConnection, ServerLoginError
from scry.tls import peer_common_name

if TYPE_CHECKING:
    from scry.proxy import Proxy

_Q = m.QUERY[0]
_SYNC = m.SYNC[0]
_F = m.FUNCTION_CALL[0]
_X = m.TERMINATE[0]
_EXECUTE = m.EXECUTE[0]
_MARKED = frozenset(x[0] for x in (m.BIND, m.DESCRIBE, m.CLOSE, m.FLUSH))
_PARSE = m.PARSE[0]
_BIND = m.BIND[0]
_COPY_DONE = m.COPY_DONE[0]
_COPY_FAIL = m.COPY_FAIL[0]

# Client messages the relay must see (every other one is forwarded unread).
CLIENT_WANT = (
    m.QUERY,
    m.SYNC,
    m.FUNCTION_CALL,
    m.TERMINATE,
    m.EXECUTE,
    m.COPY_DONE,
    m.COPY_FAIL,
    m.PARSE,
)
# Reported without their bodies: enough to know a batch is open until its Sync.
CLIENT_MARK = (m.BIND, m.DESCRIBE, m.CLOSE, m.FLUSH)
_EXTENDED = frozenset(x[0] for x in (m.PARSE, m.BIND, m.DESCRIBE, m.CLOSE, m.FLUSH, m.EXECUTE))

# Settings PostgreSQL reports with ParameterStatus that a client may change;
# scry re-applies them on whichever server serves the client.
TRACKED_PARAMETERS = frozenset(
    {
        "application_name",
        "client_encoding",
        "DateStyle",
        "IntervalStyle",
        "TimeZone",
        "standard_conforming_strings",
        "search_path",
    }
)
# GUC names are case-insensitive; ParameterStatus uses these spellings.
_CANONICAL = {"datestyle": "DateStyle", "intervalstyle": "IntervalStyle", "timezone": "TimeZone"}
# Startup keys that are not settings.
_NOT_SETTINGS = frozenset({"user", "database", "options", "replication"})

# Client bytes held while waiting for a server before reading pauses.
MAX_QUEUED_BYTES = 256 * 1024

_READY_IDLE = m.ready_for_query()
_SYNC_MARK = (REC_SYNC, b"")
_FUNCTION_CALL_MARK = (REC_QUERY, b"<function call>")

STARTUP, AUTH, LOGIN, READY, CLOSED = "startup", "auth", "login", "ready", "closed"

_ids = itertools.count(1)
_NO_STATS = PoolStats()  # counts nothing anyone reads: clients before they have a pool


def parse_text(body: bytes) -> bytes:
    """The query text of a Parse message body (statement name NUL query NUL ...)."""
    start = body.find(b"\x00") + 1
    return body[start : body.find(b"\x00", start)]


def canonical_name(name: str) -> str:
    lower = name.lower()
    return _CANONICAL.get(lower, lower)


def parse_options(options: str) -> dict[str, str]:
    """Settings from a startup ``options`` string (``-c name=value`` / ``--name=value``)."""
    tokens: list[str] = []
    current = []
    escaped = False
    for ch in options:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch.isspace():
            if current:
                tokens.append("".join(current))
                current = []
        else:
            current.append(ch)
    if current:
        tokens.append("".join(current))
    settings: dict[str, str] = {}
    it = iter(tokens)
    for token in it:
        if token == "-c":
            token = next(it, "")
        elif token.startswith("-c") or token.startswith("--"):
            token = token[2:]
        else:
            raise ProtocolViolation(f"unsupported startup option {token!r}", FEATURE_NOT_SUPPORTED)
        name, sep, value = token.partition("=")
        if not sep or not name:
            raise ProtocolViolation(f"invalid startup option {token!r}", FEATURE_NOT_SUPPORTED)
        settings[canonical_name(name.replace("-", "_"))] = value
    return settings


def _valid_setting_name(name: str) -> bool:
    return name.replace("_", "a").replace(".", "a").isalnum()


class ClientConnection(asyncio.Protocol):
    """One application connection to scry."""

    def __init__(self, proxy: Proxy) -> None:
        self.id = f"c{next(_ids)}"
        self.proxy = proxy
        self.state = STARTUP
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self._addr: str | None = None
        self.user = ""
        self.database = ""
        self.application_name = ""
        self.params: dict[str, str] = {}  # settings to apply on any server that serves us
        self.pool: Pool | None = None
        self.stats: PoolStats = _NO_STATS  # its pool's SHOW STATS counters
        self.tls = False
        self.server: ServerConnection | None = None
        self.connected_at = time.time()
        self.connected_clock = monotonic()  # for client_login_timeout
        self.cancel_key: tuple[int, int] | None = None
        self.transaction_pooling = True
        self.statement_pooling = False
        self.tracker: SessionTracker | None = None  # transaction and hybrid modes
        self.parked = False  # holding a server between transactions (see Pool.parked)
        self.ordinal = 0  # ReadyForQuery messages owed to this client, ever
        self.answered = 0  # ReadyForQuery messages it received, ever
        self.last_active = 0.0  # proxy.clock at its last message
        self._startup_buf = bytearray()
        self._reader: MessageReader | None = None
        self._auth: ClientAuthExchange | None = None
        self._scanner = MessageScanner(CLIENT_WANT, proxy.config.max_packet_size, mark=CLIENT_MARK)
        # Extended-protocol messages sent since the last Sync: the server owes
        # nothing yet but is mid-batch, so it must not change hands.
        self._unsynced = False
        # An unnamed statement was parsed and not yet executed (pg8000 parses,
        # syncs, then binds): the Bind may land on another server.
        self._unnamed_open = False
        self._unnamed_rest: bytes | None = None  # its last unnamed Parse, after the name
        # Client data waiting for a server: (bytes or whole messages, ReadyForQuery owed).
        self._queue: list[tuple[bytes | list[tuple[int, bytes]], int]] = []
        self._queued_owed = 0
        # Set once the client uses named prepared statements under transaction or
        # hybrid pooling: from then on its messages are read whole and rewritten.
        self._messages: MessageReader | None = None
        self.unanswered: list[tuple[bytes | list[tuple[int, bytes]], int]] | None = None
        # Observability: what is running and since when (see scry.observe.record).
        self.observed = proxy.observatory.enabled
        self.context: ClientContext | None = None
        # (REC_* kind, statement text, received ns): what the server side will complete.
        self.inflight: deque[tuple[int, bytes, int]] = deque()
        self.t_acquired = 0  # when the last waited-for server was linked
        self.pins: tuple[str, ...] | None = None
        self._last_text = b""  # the statement the next Execute runs
        self._unnamed_text = b""  # the unnamed prepared statement's text
        self._named_texts: dict[bytes, bytes] = {}  # named statement -> its text
        self._retried = False
        self.statements: ClientStatements | None = None
        self._queued_bytes = 0
        self._syncs_since_execute = 0
        self.waiting_since = 0  # perf_counter_ns() when it joined the pool's queue; 0 = not

        self._paused_waiting = False
        self._paused_by_server = False
        self._closing_after_release = False

    # --- asyncio callbacks -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # client_login_timeout is enforced by the proxy's janitor: no timer per connection.
        self.proxy.on_client_connected(self)

    @property
    def addr(self) -> str:
        """The client's address (looked up when first needed: one syscall saved per login)."""
        addr = self._addr
        if addr is None:
            peer = self.transport.get_extra_info("peername") if self.transport else None
            addr = self._addr = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unix"
        return addr

    def data_received(self, data: bytes) -> None:
        if self.state is READY:
            self._relay(data)
        elif self.state is STARTUP:
            self._startup_data(data)
        elif self.state is AUTH:
            self._auth_data(data)
        elif self.state is LOGIN:
            assert self._reader is not None
            self._reader.feed(data)  # pipelined before ReadyForQuery; relayed later

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is not CLOSED:
            self._cleanup(
                "client disconnected" if exc is None else f"client connection lost: {exc}"
            )

    # --- startup -----------------------------------------------------------------

    def _startup_data(self, data: bytes) -> None:
        buf = self._startup_buf
        if not buf and not self.tls and data[:1] == b"\x16":
            # A TLS ClientHello with no SSLRequest first: PostgreSQL 17's direct
            # TLS negotiation (sslnegotiation=direct, ALPN "postgresql").
            self._direct_tls(data)
            return
        buf += data
        while self.state is STARTUP:
            try:
                parsed = st.read_startup_packet(buf)
            except ProtocolViolation as exc:
                self.fatal(exc.sqlstate, str(exc))
                return
            if parsed is None:
                return
            packet, used = parsed
            del buf[:used]
            if isinstance(packet, st.SSLRequest):
                context = self.proxy.client_tls.context
                if context is None or self.tls:
                    self.transport.write(b"N")
                else:
                    self._upgrade_to_tls(context)
                    return
            elif isinstance(packet, st.GSSENCRequest):
                self.transport.write(b"N")  # no GSSAPI encryption; the client may go on
            elif isinstance(packet, st.CancelRequest):
                self.proxy.handle_cancel(packet.pid, packet.secret)
                self._cleanup("cancel request", quiet=True)
                return
            else:
                self._begin_login(packet)

    def _direct_tls(self, hello: bytes) -> None:
        context = self.proxy.client_tls.context
        if context is None:
            event("direct TLS from a client, but client TLS is disabled", logging.WARNING,
                  client=self.id, addr=self.addr)  # fmt: skip
            self._cleanup("direct TLS without client_tls", quiet=True)
            return
        # The ClientHello is already read, so asyncio's start_tls cannot be used:
        # put an SSL protocol between the transport and us by hand and hand it
        # the bytes we took (asyncio's SSLProtocol works on memory BIOs).
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        tls = asyncio.sslproto.SSLProtocol(
            loop, self, context, waiter, server_side=True, call_connection_made=False,
            ssl_handshake_timeout=30,
        )  # fmt: skip
        raw = self.transport
        raw.set_protocol(tls)
        tls.connection_made(raw)
        self.transport = tls._app_transport  # type: ignore[assignment]
        self.tls = True
        loop.create_task(self._direct_tls_done(waiter))
        view = memoryview(hello)
        while view:  # SSLProtocol is a BufferedProtocol: copy into its buffer
            buffer = tls.get_buffer(len(view))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            tls.buffer_updated(n)
            view = view[n:]

    async def _direct_tls_done(self, waiter: asyncio.Future[None]) -> None:
        try:
            await waiter
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            event("client TLS handshake failed", logging.WARNING, client=self.id,
                  error=str(exc) or type(exc).__name__)  # fmt: skip
            if self.state is not CLOSED:
                self._cleanup("TLS handshake failed", quiet=True)
            return
        selected = self.transport.get_extra_info("ssl_object")
        if selected is not None and selected.selected_alpn_protocol() != "postgresql":
            # PostgreSQL requires the ALPN for direct TLS; so do we.
            self.fatal(PROTOCOL_VIOLATION, "direct TLS requires ALPN protocol postgresql")

    def _upgrade_to_tls(self, context: ssl.SSLContext) -> None:
        # Nothing may be read between our 'S' and the handshake taking over.
        self.transport.pause_reading()
        self.transport.write(b"S")
        asyncio.get_running_loop().create_task(self._tls_handshake(context))

    async def _tls_handshake(self, context: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport = await loop.start_tls(
                self.transport, self, context, server_side=True, ssl_handshake_timeout=30
            )
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            event("client TLS handshake failed", logging.WARNING, client=self.id,
                  addr=self.addr, error=str(exc) or type(exc).__name__)  # fmt: skip
            self._cleanup("TLS handshake failed", quiet=True)
            self.transport.abort()
            return
        if transport is None or self.state is CLOSED:
            return
        self.transport = transport  # type: ignore[assignment]
        self.tls = True
        if self._startup_buf:
            self._startup_data(b"")

    def _begin_login(self, packet: st.StartupMessage) -> None:
        proxy = self.proxy
        params = packet.params
        self.user = packet.user
        self.database = packet.database
        if proxy.client_tls.required and not self.tls:
            self.fatal(INVALID_AUTHORIZATION, "SSL required",
                       detail=f"tls.client_tls_sslmode is {proxy.client_tls.mode}")  # fmt: skip
            return
        if proxy.auth.method == "cert" or proxy.client_tls.mode == "verify-full":
            common_name = peer_common_name(self.transport) if self.tls else None
            if common_name != self.user:
                event("client login failed", logging.WARNING, client=self.id, addr=self.addr,
                      user=self.user, reason="certificate CN does not match")  # fmt: skip
                self.fatal(
                    INVALID_AUTHORIZATION,
                    f'certificate authentication failed for user "{self.user}"',
                )
                return
        if "replication" in params and params["replication"] not in ("false", "off", "0"):
            self.fatal(FEATURE_NOT_SUPPORTED, "replication connections are not supported by scry")
            return
        if proxy.draining:
            self.fatal(ADMIN_SHUTDOWN, "scry is shutting down")
            return
        if proxy.client_count > proxy.config.pool.max_client_conn:
            self.fatal(TOO_MANY_CONNECTIONS, "no more connections allowed (max_client_conn)")
            return
        if proxy.config.pgbouncer is not None:  # PgBouncer mode: console, DISABLE, '*', [users]
            from scry.pgbouncer.console import route_login

            if route_login(self, packet):
                return
        target = proxy.targets.get(self.database)
        if target is None:
            self.fatal(PROTOCOL_VIOLATION, f"no such database: {self.database}")
            return
        try:
            settings = {}
            for key, value in params.items():
                if key in _NOT_SETTINGS:
                    continue
                name = canonical_name(key)
                if not _valid_setting_name(name):
                    raise ProtocolViolation(f"unsupported startup parameter: {key}")
                settings[name] = value
            if params.get("options"):
                settings.update(parse_options(params["options"]))
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))
            return
        self.params = settings
        self.application_name = settings.get("application_name", "")
        server_user, server_password = proxy.auth.server_credentials(target, self.user)
        self.pool = proxy.pool_for(target, server_user, server_password)
        self.stats = self.pool.stats
        mode = self.pool.mode
        self.transaction_pooling = mode != "session"
        self.statement_pooling = mode == "statement"
        if mode != "session":
            self.tracker = SessionTracker(self.id, pinning=mode == "hybrid")
        self._auth = ClientAuthExchange(
            proxy.auth.method, self.user, proxy.auth.secret_for(self.user)
        )
        self._reader = MessageReader(proxy.config.max_packet_size)
        self.state = AUTH
        rest = bytes(self._startup_buf)  # anything the client sent after its startup packet
        self._startup_buf.clear()
        self._auth_step(self._auth.start())
        if rest:
            self.data_received(rest)

    def _auth_data(self, data: bytes) -> None:
        reader = self._reader
        assert reader is not None and self._auth is not None
        reader.feed(data)
        try:
            while self.state is AUTH and (msg := reader.next_message()) is not None:
                self._auth_step(self._auth.handle(*msg))
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))

    def _auth_step(self, step: AuthStep) -> None:
        if step.error is not None:
            sqlstate, text = step.error
            event("client login failed", logging.WARNING, client=self.id, addr=self.addr,
                  user=self.user, db=self.database, reason=text)  # fmt: skip
            self.fatal(sqlstate, text)
            return
        if step.reply:
            self.transport.write(step.reply)
        if step.done:
            self.state = LOGIN
            self._auth = None
            pool = self.pool
            assert pool is not None
            if pool.welcome is not None and not self._settings_to_check(pool.welcome):
                self._complete_login(pool.welcome)  # the common case: no task, no await
            else:
                asyncio.get_running_loop().create_task(self._finish_login())

    def _settings_to_check(self, welcome: dict[str, str]) -> dict[str, str]:
        """Startup settings PostgreSQL reports back and may spell differently."""
        return {
            k: v
            for k, v in self.params.items()
            if k in welcome and k != "application_name" and v != welcome[k]
        }

    async def _finish_login(self) -> None:
        """Login that needs the pool first: its first server, or a settings check."""
        pool = self.pool
        assert pool is not None
        try:
            await pool.ensure_welcome()
            if self.state is not LOGIN:
                return
            assert pool.welcome is not None
            to_check = self._settings_to_check(pool.welcome)
            if to_check:
                spelled = await pool.check_settings(to_check)
                self.params = {**self.params, **spelled}
        except Exception as exc:
            if self.state is LOGIN:
                sqlstate, text = connect_error(exc)
                if isinstance(exc, ServerLoginError):
                    text = str(exc)
                self.fatal(sqlstate, text)
            return
        if self.state is LOGIN:
            self._complete_login(pool.welcome)

    def _complete_login(self, welcome: dict[str, str]) -> None:
        pool = self.pool
        assert pool is not None
        pid, secret = self.proxy.register_cancel_key(self)
        self.transport.write(
            pool.login_greeting(self.params) + m.backend_key_data(pid, secret) + _READY_IDLE
        )
        self.state = READY
        self.context = ClientContext(
            self.id, self.database, self.user, self.application_name, self.proxy.worker_id
        )
        if logging_info():  # (the address costs a getpeername syscall)
            event("client login", client=self.id, addr=self.addr, user=self.user,
                  db=self.database, app=self.application_name, pool=pool.name)  # fmt: skip
        assert self._reader is not None
        early = self._reader.take_remaining()
        self._reader = None
        if early:
            self._relay(early)

    def refuse_transaction_block(self) -> None:
        """Statement pooling: a transaction block was opened, which it cannot serve."""
        self.fatal(PROTOCOL_VIOLATION, "transaction blocks not allowed in statement pooling mode")

    def query_timed_out(self, limit: float) -> None:
        """query_timeout: cancel the query on PostgreSQL, close this client (PgBouncer's way)."""
        pool = self.pool
        if pool is not None:
            pool.breaker.record_failure("query_timeout")
        event("query_timeout", logging.WARNING, client=self.id, limit_s=limit)
        self.fatal("57014", "query_timeout", detail=f"the query ran longer than {limit:g} s")

    def login_timed_out(self) -> None:
        """client_login_timeout (checked by the janitor)."""
        if self.state in (STARTUP, AUTH, LOGIN):
            self.fatal(PROTOCOL_VIOLATION, "client_login_timeout")

    # --- relay -------------------------------------------------------------------

    def _relay(self, data: bytes) -> None:
        self.stats.received += len(data)
        if self._messages is not None:
            self._relay_messages(data)
            return
        try:
            out, events = self._scanner.feed(data)
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))
            return
        owed = 0
        terminate = False
        # What to time, in order (see REC_* in scry.server): a record per statement.
        texts: list[tuple[int, bytes]] | None = [] if self.observed else None
        tracker = self.tracker
        to_messages = False
        self.last_active = monotonic()
        for kind, end, body in events:
            # Query, Sync and FunctionCall are each answered by one ReadyForQuery.
            if kind == _SYNC:
                owed += 1
                self._syncs_since_execute += 1
                self._unsynced = False
                if self._unnamed_open and self.transaction_pooling:
                    # Parsed, synced, not executed: the Bind may come on another server.
                    to_messages = True
                if texts is not None:
                    texts.append(_SYNC_MARK)
                if tracker is not None:
                    tracker.on_sync(self.ordinal + owed)
            elif kind == _Q:
                owed += 1
                self._syncs_since_execute = 0
                self._unnamed_open = False  # a simple Query drops the unnamed statement
                if texts is not None:
                    texts.append((REC_QUERY, body))
                if tracker is not None:
                    tracker.on_query(body, self.ordinal + owed)
            elif kind == _EXECUTE:
                self._syncs_since_execute = 0
                self._unsynced = True
                self._unnamed_open = False
                if texts is not None:
                    texts.append((REC_EXECUTE, self._last_text))
            elif kind in _MARKED:
                self._unsynced = True
            elif kind == _PARSE:
                self._unsynced = True
                if body[:1] == b"\x00":
                    self._unnamed_open = True
                    self._unnamed_rest = body[1:]
                text = parse_text(body)
                self._last_text = text
                if tracker is not None:
                    tracker.on_parse(text)
                if (
                    body[:1] != b"\x00"
                    and self.transaction_pooling
                    and self._start_rewriting(out, end - 5 - len(body), owed, texts)
                ):
                    return  # (the rewriting path counted the ordinals)
            elif kind == _F:
                owed += 1
                self._syncs_since_execute = 0
                self._unsynced = False
                if texts is not None:
                    texts.append(_FUNCTION_CALL_MARK)
            elif kind == _X:
                out = out[: end - 5]
                terminate = True
                self.stats.received -= 5  # PgBouncer does not count the Terminate
                break
            else:  # CopyDone / CopyFail
                owed -= self._copy_ignored_syncs(texts)
        self.ordinal += owed
        if texts:
            if len(texts) == 1:
                code, text = texts[0]
                self.inflight.append((code, text, perf_counter_ns()))
            else:
                self._note_inflight(texts)
        if out:
            if self.parked:
                self._unpark()
            server = self.server
            if server is not None:  # the common case, inlined
                self.unanswered = None
                if not server.pending:
                    server.busy_since = monotonic()
                server.pending += owed
                server.statements.segments_sent += owed
                server.transport.write(out)  # type: ignore[union-attr]
            else:
                self._forward(out, owed, len(out))
        if to_messages and not terminate and self._scanner.at_boundary:
            self._enter_message_mode()
        if terminate:
            self._cleanup("client closed")

    def _enter_message_mode(self) -> None:
        """Read whole messages from now on, so statements can be rewritten."""
        self._messages = MessageReader(self.proxy.config.max_packet_size)
        statements = self.statements = ClientStatements()
        statements.unnamed = self._unnamed_rest
        self._unnamed_text = self._last_text
        if self.server is not None and self._unnamed_rest is not None:
            self.server.statements.unnamed_owner = statements

    @property
    def message_mode(self) -> bool:
        return self._messages is not None

    def _forward(self, payload: bytes | list[tuple[int, bytes]], owed: int, size: int) -> None:
        """Send to our server, or queue and ask the pool for one."""
        if self.parked:
            self._unpark()
        server = self.server
        if server is not None:
            self.unanswered = None  # more than the first batch: no longer retryable
            data = payload if isinstance(payload, bytes) else self._render(payload, server)
            if not server.pending:
                server.busy_since = monotonic()
            server.pending += owed
            server.statements.segments_sent += owed
            server.transport.write(data)  # type: ignore[union-attr]
            return
        self._queue.append((payload, owed))
        self._queued_owed += owed
        self._queued_bytes += size
        if self._queued_bytes > MAX_QUEUED_BYTES and not self._paused_waiting:
            # Bound what a client can make us hold while it waits for a server.
            self._paused_waiting = True
            self.transport.pause_reading()
        if self.state is READY:
            self._get_server()

    def _render(self, messages: list[tuple[int, bytes]], server: ServerConnection) -> bytes:
        assert self.statements is not None
        before = server.statements.parses_sent
        try:
            data = rewrite_statements(messages, self.statements, server.statements)
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))
            return b""
        self.stats.server_parse_count += server.statements.parses_sent - before
        return data

    def _copy_ignored_syncs(self, texts: list[tuple[int, bytes]] | None) -> int:
        """PostgreSQL ignores Sync during COPY FROM STDIN: a Sync sent after the
        Execute that started the copy earns no ReadyForQuery. Returns how many.

        Only while a COPY FROM STDIN is really running: outside one PostgreSQL
        ignores CopyDone/CopyFail and answers every Sync."""
        ignored = self._syncs_since_execute
        self._syncs_since_execute = 0
        if self.server is None or not self.server.copy_in:
            return 0
        for _ in range(ignored):
            # Forget the newest Sync marker still queued (here or already in flight).
            for queue in (texts, self.inflight):
                if queue:
                    for i in range(len(queue) - 1, -1, -1):
                        if queue[i][0] == REC_SYNC:
                            del queue[i]
                            break
                    else:
                        continue
                    break
        return ignored

    def _note_inflight(self, texts: list[tuple[int, bytes]]) -> None:
        now = perf_counter_ns()
        inflight = self.inflight
        for code, text in texts:
            inflight.append((code, text, now))

    def _start_rewriting(
        self, out: bytes, parse_start: int, owed: int, texts: list[tuple[int, bytes]] | None
    ) -> bool:
        """The client named a prepared statement: switch to whole-message rewriting.

        Everything before the Parse is forwarded as scanned; the Parse and what
        follows is re-read as whole messages. Returns False (keep scanning) in the
        rare case the Parse body was truncated by the scanner and cannot be located.
        """
        if parse_start < 0:
            return False
        head, tail = out[:parse_start], out[parse_start:] + self._scanner.detach()
        self._enter_message_mode()
        self.ordinal += owed
        if texts:
            self._note_inflight(texts)
        if head:
            self._forward(head, owed, len(head))
        self._relay_messages(tail)
        return True

    def _relay_messages(self, data: bytes) -> None:
        reader = self._messages
        assert reader is not None
        reader.feed(data)
        try:
            messages = reader.messages()
        except ProtocolViolation as exc:
            self.fatal(exc.sqlstate, str(exc))
            return
        if not messages:
            return
        owed = 0
        terminate = False
        size = 0
        texts: list[tuple[int, bytes]] | None = [] if self.observed else None
        tracker = self.tracker
        self.last_active = monotonic()
        try:
            for index, (kind, body) in enumerate(messages):
                if kind in _EXTENDED:
                    self._unsynced = True
                if kind == _SYNC:
                    owed += 1
                    self._syncs_since_execute += 1
                    self._unsynced = False
                    if texts is not None:
                        texts.append(_SYNC_MARK)
                    if tracker is not None:
                        tracker.on_sync(self.ordinal + owed)
                elif kind in (_Q, _F):
                    owed += 1
                    self._syncs_since_execute = 0
                    self._unnamed_open = False
                    if texts is not None:
                        texts.append((REC_QUERY, body) if kind == _Q else _FUNCTION_CALL_MARK)
                    if tracker is not None and kind == _Q:
                        tracker.on_query(body, self.ordinal + owed)
                elif kind == _EXECUTE:
                    self._syncs_since_execute = 0
                    self._unnamed_open = False
                    if texts is not None:
                        texts.append((REC_EXECUTE, self._last_text))
                elif kind == _PARSE:
                    text = parse_text(body)
                    if body[:1] == b"\x00":
                        self._unnamed_open = True
                        self._unnamed_text = text
                        if tracker is not None:
                            # Named statements run their text at each Execute; protocol-level
                            # prepares are tracked by scry itself and never pin.
                            tracker.on_parse(text)
                    else:  # SHOW STATS counts named statements only, as PgBouncer
                        self.stats.client_parse_count += 1
                        if texts is not None:
                            self._named_texts[body[: body.index(b"\x00")]] = text
                elif kind == _BIND:
                    if body[body.index(b"\x00") + 1] != 0:  # a named statement
                        self.stats.bind_count += 1
                    if texts is not None:
                        self._last_text = self._bound_text(body)
                elif kind == _X:
                    del messages[index:]
                    terminate = True
                    self.stats.received -= 5  # PgBouncer does not count the Terminate
                    break
                elif kind in (_COPY_DONE, _COPY_FAIL):
                    owed -= self._copy_ignored_syncs(texts)
                size += len(body) + 5
        except (ValueError, IndexError):  # a body cut short of its fields
            self.fatal(PROTOCOL_VIOLATION, "malformed extended-protocol message")
            return
        self.ordinal += owed
        if texts:
            self._note_inflight(texts)
        if messages:
            self._forward(messages, owed, size)
        if terminate:
            self._cleanup("client closed")

    def _bound_text(self, bind_body: bytes) -> bytes:
        """The statement text behind a Bind (the last Parse's, for the unnamed statement)."""
        portal_end = bind_body.index(b"\x00")
        name = bind_body[portal_end + 1 : bind_body.index(b"\x00", portal_end + 1)]
        if name:
            return self._named_texts.get(name, b"")
        return self._unnamed_text

    def _at_boundary(self) -> bool:
        """Between whole batches: no partial message and no extended batch left unsynced."""
        if self._unsynced:
            return False
        if self._messages is not None:
            return self._messages.buffered == 0
        return self._scanner.at_boundary

    def _get_server(self) -> None:
        pool = self.pool
        assert pool is not None
        if self.waiting_since:
            return  # already queued at the pool
        if self.proxy.draining:
            self.fatal(ADMIN_SHUTDOWN, "scry is shutting down")
            return
        if not pool.breaker.allow():
            self._reject_queued(*pool.breaker.rejection_message(pool.target.name))
            return
        server = pool.acquire_nowait()
        if server is not None:
            self._link(server)
            return
        # No timer per wait: the janitor enforces query_wait_timeout on the queue.
        self.waiting_since = perf_counter_ns()
        pool.wait(self)

    def _reject_queued(self, sqlstate: str, text: str) -> None:
        """Answer every queued request with an error instead of running it (breaker open)."""
        owed = self._queued_owed
        if owed <= 0:
            return  # nothing waits for an answer yet; decide when the Sync comes
        self._queue.clear()
        self._queued_owed = 0
        self._queued_bytes = 0
        self.inflight.clear()
        answer = m.error_response(sqlstate, text) + m.ready_for_query()
        self.transport.write(answer * owed)

    def attach(self, server: ServerConnection) -> bool:
        """Called by the pool when a server is free for this waiting client."""
        if self.state is not READY:
            return False
        pool = self.pool
        assert pool is not None
        now = perf_counter_ns()
        pool.total_wait_us += (now - self.waiting_since) // 1000
        pool.waits += 1
        self.waiting_since = 0
        self.t_acquired = now
        self._link(server)
        if self._paused_waiting:
            self._paused_waiting = False
            self._update_reading()
        return True

    def _link(self, server: ServerConnection) -> None:
        self.server = server
        self.stats.server_assignment_count += 1
        server.link(self)
        tracker = self.tracker
        if tracker is not None and tracker.needs_replay:
            # This client's SETs and PREPAREs were left on a reclaimed server:
            # re-create them here, before its query, and hide the answers.
            tracker.needs_replay = False
            server.swallow += 1
            server.transport.write(m.query(tracker.replay_sql()))  # type: ignore[union-attr]
        queue = self._queue
        if queue:
            statements = server.statements
            if len(queue) == 1 and queue[0][0].__class__ is bytes:
                data, owed = queue[0]  # type: ignore[assignment]
                statements.segments_sent += owed
            else:
                parts = []
                for payload, owed in queue:
                    parts.append(
                        payload if isinstance(payload, bytes) else self._render(payload, server)
                    )
                    statements.segments_sent += owed
                data = b"".join(parts)
            # Kept until the server answers: if it dies first, nothing ran and
            # the same messages can go to another server.
            self.unanswered = self._queue
            self._queue = []
            server.busy_since = monotonic()
            server.pending += self._queued_owed
            self._queued_owed = 0
            self._queued_bytes = 0
            server.transport.write(data)  # type: ignore[union-attr]

    def on_server_ready(self, server: ServerConnection) -> None:
        """The server answered everything and is idle: give it back if pooling allows."""
        if not self.transaction_pooling or not self._at_boundary():
            return
        tracker = self.tracker
        if tracker is not None and tracker.pinned:
            return  # session state lives on this server: keep it
        self._retried = False
        pool = self.pool
        assert pool is not None
        if not pool.waiters and not pool.paused:
            # Nobody needs it now: keep it (no release/acquire per transaction)
            # and hand it over as soon as another client asks for one.
            if not self.parked:
                self.parked = True
                pool.parked[self] = None
            return
        self.server = None
        server.unlink()
        pool.release(server)

    def detach_idle_server(self) -> ServerConnection | None:
        """Give up our server while between transactions (the pool wants it)."""
        server = self.server
        if (
            server is None
            or self.state is not READY
            or server.cancels_pending
            or not server.clean
            or not self._at_boundary()
            or (self.tracker is not None and self.tracker.pinned)
        ):
            return None
        self.server = None
        server.unlink()
        return server

    def between_transactions(self) -> bool:
        """Nothing running and no transaction open: closing loses no work in flight."""
        server = self.server
        if server is None:
            return not self._queue
        return server.clean and self._at_boundary() and not server.cancels_pending

    def drop_parked_server(self, server: ServerConnection) -> None:
        """Our parked server is going away while idle: forget it, quietly."""
        if self.server is server:
            self.server = None
            server.client = None
        if self.parked:
            self.parked = False
            if self.pool is not None:
                self.pool.parked.pop(self, None)

    def _unpark(self) -> None:
        """A parked client starts a new transaction on the server it kept."""
        self.parked = False
        pool = self.pool
        assert pool is not None
        pool.parked.pop(self, None)
        if pool.breaker.state is not BREAKER_CLOSED or pool.paused:
            # New transactions must pass the breaker: give the server back and
            # take the ordinary path, which asks it.
            server = self.detach_idle_server()
            if server is not None:
                pool.release(server)

    def on_parameter_status(self, server: ServerConnection, name: str, value: str) -> None:
        """The client (or our SET) changed a setting: remember it for the next server."""
        if name in TRACKED_PARAMETERS and self.params.get(name) != value:
            self.params = {**self.params, name: value}
            server.applied = self.params
            if name == "application_name":
                self.application_name = value
                self.context = ClientContext(
                    self.id, self.database, self.user, value, self.proxy.worker_id
                )

    def on_server_lost(self, server: ServerConnection, reason: str) -> None:
        """Our server died under us.

        If it died before answering anything since it was linked (an idle
        backend killed or restarted while in the pool), nothing ran: the
        messages go to another server, once. Otherwise the session is gone and
        so is the client.
        """
        if self.server is server:
            self.server = None
        if self.state is not READY:
            return
        unanswered = self.unanswered
        self.unanswered = None
        if unanswered is not None and not self._retried:
            self._retried = True
            event("server lost before answering; retrying on another server",
                  logging.WARNING, client=self.id, server=server.id, reason=reason)  # fmt: skip
            self._queue = unanswered + self._queue
            self._queued_owed = sum(owed for _, owed in self._queue)
            self._get_server()
            return
        self.fatal(CONNECTION_FAILURE, f"server connection lost ({reason})")

    def fail_waiting(self, sqlstate: str, text: str) -> None:
        """The pool cannot open a server for us: fail instead of hanging."""
        self.waiting_since = 0
        self.fatal(sqlstate, text)

    def wait_timed_out(self) -> None:
        """query_wait_timeout: the pool (already rid of us) could not serve us in time."""
        pool = self.pool
        assert pool is not None
        waited = (perf_counter_ns() - self.waiting_since) / 1e9
        self.waiting_since = 0
        event("query_wait_timeout", logging.WARNING, client=self.id, pool=pool.name,
              waited_s=round(waited, 3))  # fmt: skip
        self.fatal(
            PROTOCOL_VIOLATION,
            "query_wait_timeout",
            detail=f"no server connection of pool {pool.name} (size {pool.size}) "
            f"became free within {waited:.1f} s",
        )

    # --- flow control --------------------------------------------------------------

    def pause_writing(self) -> None:
        # The client reads slower than its server sends: stop reading the server.
        server = self.server
        if server is not None and not server.paused_by_client:
            server.paused_by_client = True
            server.transport.pause_reading()  # type: ignore[union-attr]

    def resume_writing(self) -> None:
        server = self.server
        if server is not None and server.paused_by_client:
            server.paused_by_client = False
            server.transport.resume_reading()  # type: ignore[union-attr]

    def pause_reading_for(self, server: ServerConnection) -> None:
        self._paused_by_server = True
        self._update_reading()

    def resume_reading_for(self, server: ServerConnection) -> None:
        self._paused_by_server = False
        self._update_reading()

    def _update_reading(self) -> None:
        if self.state is CLOSED:
            return
        if self._paused_waiting or self._paused_by_server:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    # --- closing -----------------------------------------------------------------------

    def fatal(self, sqlstate: str, text: str, detail: str | None = None) -> None:
        """Send a FATAL ErrorResponse and close."""
        if self.state is CLOSED:
            return
        try:
            self.transport.write(m.error_response(sqlstate, text, severity="FATAL", detail=detail))
        except Exception:
            pass
        self._cleanup(text)

    def _cleanup(self, reason: str, quiet: bool = False) -> None:
        # A connection that closes before saying anything (a port probe, a
        # load balancer's health check) is not worth a log line.
        quiet = quiet or (self.state is STARTUP and not self.user and not self._startup_buf)
        self.state = CLOSED
        pool = self.pool
        if pool is not None and self.waiting_since:
            pool.cancel_wait(self)
        if pool is not None and self.parked:
            self.parked = False
            pool.parked.pop(self, None)
        server = self.server
        self.server = None
        if server is not None and pool is not None:
            self._give_back(server, pool)
        self.transport.close()
        self.proxy.on_client_closed(self)
        if not quiet and logging_info():
            event("client closed", client=self.id, addr=self.addr, user=self.user,
                  db=self.database, reason=reason)  # fmt: skip

    def _give_back(self, server: ServerConnection, pool: Pool) -> None:
        server.unlink()
        if not server.clean or not self._at_boundary():
            if server.pending > 0:
                server.send_cancel()  # free the backend now, not when the query ends
            server.close("client left with a query or transaction in progress")
            return
        reset = pool.settings.server_reset_query
        pinned = self.tracker is not None and self.tracker.pinned
        if reset and (
            not self.transaction_pooling or pinned or pool.settings.server_reset_query_always
        ):
            pool.release_with_reset(server, reset)
        else:
            pool.release(server)

    def reclaim_pinned_server(self, why: str) -> bool:
        """Hybrid: give a replayable pinned client's idle server back to the pool.

        The server is reset (DISCARD ALL) before anyone else gets it; the
        client's SETs and PREPAREs are replayed on its next server. Returns
        False when the client is not in a state where that is safe.
        """
        tracker = self.tracker
        server = self.server
        pool = self.pool
        if (
            tracker is None
            or server is None
            or pool is None
            or not tracker.pinned
            or not tracker.state.replayable
            or tracker.work
            or not server.clean
            or not self._at_boundary()
            or self._queue
        ):
            return False
        self.server = None
        server.unlink()
        tracker.needs_replay = True
        event("pinned client released its server; its state will be replayed", client=self.id,
              server=server.id, why=why, reasons=",".join(tracker.state.reasons()))  # fmt: skip
        pool.release_with_reset(server, "DISCARD ALL")
        return True

    def force_unpin(self, disconnect: bool = False) -> dict[str, object]:
        """The admin's force-unpin: replay what can be replayed, say what could not.

        Replayable state (SET, PREPARE) moves with the client. Anything else
        (temp tables, cursors, advisory locks, LISTEN, LOAD) cannot: without
        ``disconnect`` the request is refused and nothing changes; with it the
        client is disconnected so its server can be reset and reused.
        """
        tracker = self.tracker
        if tracker is None or not tracker.pinned:
            return {"unpinned": False, "reason": "client is not pinned"}
        kept = [r for r in tracker.state.reasons() if r not in ("set", "prepare")]
        if not kept and self.reclaim_pinned_server("force-unpin"):
            return {"unpinned": True, "replayed": tracker.state.reasons(), "lost": []}
        if kept and disconnect:
            self.fatal(
                ADMIN_SHUTDOWN, "terminating connection: session force-unpinned by an administrator"
            )
            return {"unpinned": True, "replayed": [], "lost": kept, "disconnected": True}
        why = "not replayable: " + ", ".join(kept) if kept else "client is busy; try again"
        return {"unpinned": False, "reason": why, "lost": kept}

    def cancel_current_query(self) -> None:
        """A CancelRequest with our key: cancel what our server runs, if anything."""
        server = self.server
        if server is not None and server.pending > 0:
            server.send_cancel()
