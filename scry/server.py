"""A connection from scry to PostgreSQL: login, relay back to a client, reset.

``ServerConnection`` is an ``asyncio.Protocol``. Its life:

    connecting -> login -> idle <-> active (linked to a client) -> closed
                             \\-> internal (reset / check query, no client)

While active, every chunk from PostgreSQL is scanned by a ``MessageScanner``
for the few messages the proxy acts on (ReadyForQuery, ParameterStatus,
ErrorResponse) and forwarded whole to the client. ``pending`` counts the
ReadyForQuery messages still owed to the client (one per Query, Sync or
FunctionCall sent); the link can end only when it is zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from time import monotonic, perf_counter_ns
from typing import TYPE_CHECKING

from scry.breaker import CLOSED as BREAKER_CLOSED
from scry.log import event
from scry.protocol import messages as m
from scry.protocol.auth import BackendAuthError, BackendAuthExchange
from scry.protocol.classify import quote_identifier, quote_literal
from scry.protocol.errors import CONNECTION_FAILURE, PROTOCOL_VIOLATION, ProtocolViolation
from scry.protocol.framing import MessageReader, MessageScanner
from scry.protocol.prepared import ServerStatements
from scry.protocol.startup import cancel_request, ssl_request, startup_message
from scry.relay_core import (
    COMPILED,
    S_ACTIVE,
    S_CLOSED,
    S_CONNECTING,
    S_IDLE,
    S_INTERNAL,
    S_LOGIN,
    ServerCore,
)
from scry.tcp_options import set_tcp_options

if TYPE_CHECKING:
    from scry.client import ClientConnection
    from scry.pool import Pool

_Z = m.READY_FOR_QUERY[0]
_S = m.PARAMETER_STATUS[0]
_E = m.ERROR_RESPONSE[0]
_R = m.AUTHENTICATION[0]
_K = m.BACKEND_KEY_DATA[0]
_N = m.NOTICE_RESPONSE[0]
_D = m.DATA_ROW[0]
_TX_IDLE = m.TX_IDLE

# What the relay must see in the server's stream; everything else is forwarded unread.
# What the client side queued in ``ClientConnection.inflight``: a Query or
# FunctionCall (complete at ReadyForQuery), an Execute (complete at its
# CommandComplete, EmptyQueryResponse, PortalSuspended or ErrorResponse), or
# the Sync that ends an extended-protocol batch (nothing to record).
REC_QUERY, REC_EXECUTE, REC_SYNC = 0, 1, 2

RELAY_WANT = (
    m.COMMAND_COMPLETE,  # row counts, for observability only: keep it first
    m.EMPTY_QUERY_RESPONSE,
    m.PORTAL_SUSPENDED,
    m.READY_FOR_QUERY,
    m.PARAMETER_STATUS,
    m.ERROR_RESPONSE,
    m.PARSE_COMPLETE,
    m.CLOSE_COMPLETE,
    m.COPY_IN_RESPONSE,
)
_PARSE_COMPLETE = m.PARSE_COMPLETE[0]
_C = m.COMMAND_COMPLETE[0]
_COPY_IN = m.COPY_IN_RESPONSE[0]
_EMPTY_QUERY = m.EMPTY_QUERY_RESPONSE[0]
_PORTAL_SUSPENDED = m.PORTAL_SUSPENDED[0]
_CLOSE_COMPLETE = m.CLOSE_COMPLETE[0]

# ``ServerConnection.copy`` bits: PostgreSQL ignores a Sync it reads while in
# COPY FROM STDIN, so the Syncs a client sends inside a COPY are settled only
# once the server shows how that COPY ended (see copy_window_closed).
COPY_LIVE = 1  # CopyInResponse seen; the COPY has not ended yet
COPY_WINDOW = 2  # the client ended its COPY data; copy_window Syncs came with it
COPY_FAILED = 4  # the COPY failed (on its data) before the client ended its data
COPY_BROKEN = 8  # ... failed on a message that was not COPY data (08P01)

_ids = itertools.count(1)
INTERNAL_QUERY_TIMEOUT = 2.0  # seconds for a reset or check query before the server is dropped
# A closed server of a pool under a connection limit counts against the limit
# until PostgreSQL closes the connection (its backend has exited), at most this long.
BACKEND_EXIT_WAIT = 5.0

CONNECTING, LOGIN, IDLE, ACTIVE, INTERNAL, CLOSED = (
    S_CONNECTING,
    S_LOGIN,
    S_IDLE,
    S_ACTIVE,
    S_INTERNAL,
    S_CLOSED,
)


class ServerLoginError(Exception):
    """PostgreSQL refused the login; ``fields`` are its ErrorResponse fields."""

    def __init__(self, fields: dict[str, str]) -> None:
        super().__init__(fields.get("M", "server login failed"))
        self.fields = fields

    @property
    def sqlstate(self) -> str:
        return self.fields.get("C", CONNECTION_FAILURE)


class ServerConnection(ServerCore, asyncio.Protocol):
    """One PostgreSQL backend connection owned by a pool."""

    # Slots: with more than 30 attributes CPython 3.11 gives up sharing instance
    # dict keys; the fields touched per message are ServerCore's (scry.relay_core).
    __slots__ = (
        "_auth", "_internal_answers", "_internal_done", "_internal_error", "_internal_timer",
        "_exit_timer", "_login_waiter", "_reader", "_tls_answer", "backend_pid", "backend_secret",
        "close_reason", "copy_early", "copy_window", "created_at", "evicted", "id",
        "internal_error_fields", "internal_rows", "local_addr", "address", "params", "proxy",
        "release_after_cancel", "retire_reason", "tls", "__weakref__"
    )  # fmt: skip

    def __init__(self, pool: Pool, address: tuple[str, int] | None = None) -> None:
        self.id = f"s{next(_ids)}"
        self.pool = pool
        self.state = CONNECTING
        self.transport: asyncio.Transport | None = None
        self.client: ClientConnection | None = None
        self.params: dict[str, str] = {}  # as reported by ParameterStatus
        self.applied: dict[str, str] = {}  # client settings SET on this backend
        self.backend_pid = 0
        self.backend_secret = 0
        self.pending = 0  # ReadyForQuery messages owed to the linked client
        self.tx_status = _TX_IDLE
        self.swallow = 0  # our own queries whose responses the client must not see
        self.created_at = time.monotonic()
        self.last_used = self.created_at
        self.close_reason = ""
        self.retire_reason = ""  # why retire was set, if not server_lifetime
        self.local_addr = ""
        # (host, port) to connect to: one of the target's (Pool._open_server).
        self.address = address or pool.target.hosts[0]
        # CommandComplete tags: row counts for observability, COMMIT/ROLLBACK for hybrid.
        need_tags = pool.proxy.observatory.enabled or pool.settings.mode == "hybrid"
        want = RELAY_WANT if need_tags else RELAY_WANT[3:]
        self._scanner = MessageScanner(want, pool.max_message_size)
        self._reader: MessageReader | None = None
        self._auth: BackendAuthExchange | None = None
        self._login_waiter: asyncio.Future[None] | None = None
        self._internal_done: Callable[[bool], None] | None = None
        self._internal_error = False
        self.internal_error_fields: dict[str, str] | None = None
        self.internal_rows: list[list[bytes | None]] | None = None
        self._tls_answer: asyncio.Future[bytes] | None = None
        self._internal_timer: asyncio.TimerHandle | None = None
        self._internal_answers = 0
        self.copy = 0  # COPY_* bits; 0 outside COPY FROM STDIN
        self.copy_window = 0  # Syncs sent inside the COPY being settled...
        self.copy_early = 0  # ... of which right after the statement that started it
        # Its ReadyForQuery count can no longer be trusted: never given to anyone else.
        self.desynced = False
        self.tls = False
        self.paused_by_client = False
        self.retire = False  # past server_lifetime: close instead of reusing
        # server_fast_close: the session holding it loses it between transactions.
        self.close_needed = False
        self.evicted = False  # retired for another pool (scry.connection_limits)
        self._exit_timer: asyncio.TimerHandle | None = None  # see BACKEND_EXIT_WAIT
        self.cancels_pending = 0  # CancelRequests sent and not yet processed by PostgreSQL
        self.release_after_cancel = False
        self.statements = ServerStatements(
            pool.settings.max_prepared_statements, pool.parsed_statements
        )
        self.breaker = pool.breaker
        self.proxy = pool.proxy
        self.busy_since = 0.0  # monotonic() when the oldest unanswered request was sent
        self.ready_at = 0.0  # monotonic() when it last answered everything
        # SHOW STATS: where the current transaction began (0.0: none open).
        self.stats = pool.stats
        self.xact_mark = 0.0
        observatory = pool.proxy.observatory
        self.observe = observatory.record
        # The queue behind observe, to wake the drain at its drain_at-th record.
        self.observed_queue = observatory.queue
        self.drain_at = observatory.drain_at
        self.wake_drain = observatory.wake_drain
        self.last_tag = b""  # CommandComplete tag of the statement running now
        self.sqlstate: str | None = None  # its ErrorResponse code, if any

    # --- connecting and login ------------------------------------------------

    async def connect(self, timeout: float) -> None:
        """Open the TCP/Unix connection to ``address``, negotiate TLS, log in;
        raises on failure (``transport`` is still None if the host was not reached)."""
        loop = asyncio.get_running_loop()
        host, port = self.address
        self._login_waiter = loop.create_future()
        tls = self.pool.proxy.server_tls
        unix = host.startswith("/")
        if tls.context is not None and not unix:
            self._tls_answer = loop.create_future()

        async def _open() -> None:
            if unix:
                await loop.create_unix_connection(lambda: self, f"{host}/.s.PGSQL.{port}")
            else:
                await self._connect_tcp(host, port)
            if self._tls_answer is not None:
                answer = await self._tls_answer
                if answer == b"S":
                    assert tls.context is not None and self.transport is not None
                    self.transport = await loop.start_tls(  # type: ignore[assignment]
                        self.transport, self, tls.context, server_hostname=host
                    )
                    self.tls = True
                elif tls.required:
                    raise ServerLoginError(
                        {
                            "C": "08004",
                            "M": f"the server refused TLS (server_tls_sslmode {tls.mode})",
                        }
                    )
                self._send_startup()
            assert self._login_waiter is not None
            await self._login_waiter

        try:
            await asyncio.wait_for(_open(), timeout or None)
        except BaseException:
            self.close("login failed")
            raise

    async def _connect_tcp(self, host: str, port: int) -> None:
        """The host's addresses (scry.dns: cached, the next in turn first)
        tried in order until one accepts the connection."""
        config = self.pool.proxy.config
        addresses = await self.pool.proxy.dns.addresses(
            host, port, config.dns_max_ttl, config.dns_nxdomain_ttl
        )
        loop = asyncio.get_running_loop()
        for address in addresses[:-1]:
            try:
                await loop.create_connection(lambda: self, address, port)
                return
            except OSError:
                continue
        await loop.create_connection(lambda: self, addresses[-1], port)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("sockname")
        self.local_addr = f"{sock[0]}:{sock[1]}" if isinstance(sock, tuple) else str(sock)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):  # TCP: the very address (a name may resolve to several)
            self.address = (peer[0], peer[1])  # (where its CancelRequests go too)
        if isinstance(sock, tuple):  # TCP: keepalive and friends (scry.tcp_options)
            set_tcp_options(transport.get_extra_info("socket"), self.pool.proxy.config, fresh=True)
        self.state = LOGIN
        if self._tls_answer is not None:
            transport.write(ssl_request())  # the answer decides what comes next
            return
        self._send_startup()

    def _send_startup(self) -> None:
        pool = self.pool
        self._reader = MessageReader(pool.max_message_size)
        user, password = pool.server_user, pool.server_password
        self._auth = BackendAuthExchange(user, password, pool.proxy.scram_key(user, password))
        params = {"user": pool.server_user, "database": pool.target.dbname}
        params.update(pool.startup_params)
        self.transport.write(startup_message(params))  # type: ignore[union-attr]

    def _login_data(self, data: bytes) -> None:
        answer = self._tls_answer
        if answer is not None and not answer.done():
            # The one-byte answer to our SSLRequest; nothing else may follow it.
            if data[:1] not in (b"S", b"N") or len(data) != 1:
                raise ValueError(f"unexpected answer to SSLRequest: {data[:1]!r}")
            if data == b"S":
                self.transport.pause_reading()  # type: ignore[union-attr]
            answer.set_result(data)
            return
        reader = self._reader
        assert reader is not None and self._auth is not None
        reader.feed(data)
        while (msg := reader.next_message()) is not None:
            kind, body = msg
            if kind == _R:
                code, rest = m.parse_auth_request(body)
                reply = self._auth.respond(code, rest)
                if reply:
                    self.transport.write(reply)  # type: ignore[union-attr]
            elif kind == _S:
                name, value = m.parse_parameter_status(body)
                self.params[name] = value
            elif kind == _K:
                self.backend_pid = int.from_bytes(body[:4], "big", signed=True)
                self.backend_secret = int.from_bytes(body[4:8], "big")
            elif kind == _E:
                self._login_failed(ServerLoginError(m.parse_fields(body)))
                return
            elif kind == _Z:
                self.state = IDLE
                self._reader = None
                self._auth = None
                if self._login_waiter and not self._login_waiter.done():
                    self._login_waiter.set_result(None)
                return
            # NoticeResponse and NegotiateProtocolVersion during login are ignored.

    def _login_failed(self, exc: Exception) -> None:
        if self._login_waiter and not self._login_waiter.done():
            self._login_waiter.set_exception(exc)
        self.close(f"login failed: {exc}")

    # --- relay -----------------------------------------------------------------

    def _data_received(self, data: bytes) -> None:
        """Every chunk from PostgreSQL; the compiled ServerCore serves the
        commonest ones itself and hands this the rest."""
        state = self.state
        if state is ACTIVE:
            if self.pending <= 0 and not self.swallow and self.client.parked:  # type: ignore[union-attr]
                self._parked_data(data)
            else:
                self._relay(data)
        elif state is LOGIN:
            try:
                self._login_data(data)
            except (ProtocolViolation, BackendAuthError, ValueError) as exc:
                self._login_failed(exc)
        elif state is INTERNAL:
            self._internal_data(data)
        elif state is IDLE:
            self._idle_data(data)

    if not COMPILED:
        data_received = _data_received

    def _relay(self, data: bytes) -> None:
        self.stats.sent += len(data)
        try:
            out, events = self._scanner.feed(data)
        except ProtocolViolation as exc:
            self._broken(f"protocol violation from server: {exc}")
            return
        client = self.client
        assert client is not None
        release = False
        cut = 0  # bytes already dropped from the front of ``out``
        drops: list[int] | None = None  # ends of ParseComplete/CloseComplete scry caused
        t_done = 0
        fatal = False  # PostgreSQL ends the session with this chunk
        for kind, end, body in events:
            if kind == _Z:
                status = self.tx_status = body[0]
                if self.swallow:
                    # The response to our own SET ends here: drop it from the chunk.
                    self.swallow -= 1
                    out = out[end - cut :]
                    cut = end
                    continue
                if self.copy:
                    self._copy_settled()
                pending = self.pending = self.pending - 1
                client.answered += 1
                now = monotonic()
                if pending <= 0:
                    # PgBouncer's counters: a query is a request up to the ReadyForQuery
                    # that answers all it sent (a pipeline counts once); a transaction
                    # ends at such a ReadyForQuery that says idle.
                    stats = self.stats
                    stats.query_count += 1
                    stats.query_time += now - self.busy_since
                    if status == _TX_IDLE:
                        stats.xact_count += 1
                        stats.xact_time += now - (self.xact_mark or self.busy_since)
                        self.xact_mark = 0.0
                        release = True
                    else:
                        release = False
                        if not self.xact_mark:
                            self.xact_mark = self.busy_since
                        if client.statement_pooling:
                            client.refuse_transaction_block()
                    self.ready_at = now
                    if pending < 0:
                        self.desync("a ReadyForQuery nobody asked for")
                tracker = client.tracker
                if tracker is not None and tracker.work:
                    tracker.settle(
                        client.answered, self.sqlstate, status, self, self.pool.proxy.clock
                    )
                    client.pins = tracker.reasons()
                statements = self.statements
                statements.segments_done += 1
                if statements.expect:
                    statements.on_ready()
                sqlstate = self.sqlstate
                if sqlstate is not None:
                    self.sqlstate = None
                else:
                    breaker = self.breaker
                    if breaker.state is not BREAKER_CLOSED or breaker.consecutive_failures:
                        breaker.record_success()  # only news when something was wrong
                inflight = client.inflight
                if inflight:
                    if inflight[0][0] == REC_SYNC:
                        inflight.popleft()  # the end of an extended-protocol batch
                    else:  # a simple Query (or FunctionCall) is complete
                        if not t_done:
                            t_done = perf_counter_ns()
                        self._record(client, self.last_tag, sqlstate, t_done)
                self.last_tag = b""
            elif kind == _COPY_IN:
                self.copy = (self.copy | COPY_LIVE) & ~(COPY_FAILED | COPY_BROKEN)
            elif kind == _C and not self.swallow:  # (else our settings query's: _apply_settings)
                self.last_tag = body
                inflight = client.inflight
                if inflight and inflight[0][0] == REC_EXECUTE:
                    if not t_done:
                        t_done = perf_counter_ns()
                    self._record(client, body, None, t_done)
            elif kind in (_EMPTY_QUERY, _PORTAL_SUSPENDED) and not self.swallow:
                inflight = client.inflight
                if inflight and inflight[0][0] == REC_EXECUTE:
                    if not t_done:
                        t_done = perf_counter_ns()
                    self._record(client, b"", None, t_done)
            elif kind in (_PARSE_COMPLETE, _CLOSE_COMPLETE):
                if self.statements.on_response(kind):
                    if drops is None:
                        drops = []
                    drops.append(end - cut)
            elif kind == _S:
                name, value = m.parse_parameter_status(body)
                self.params[name] = value
                client.on_parameter_status(self, name, value)
            elif kind == _E and not self.swallow:
                self.statements.on_error()
                fields = m.parse_fields(body)
                self.sqlstate = fields.get("C", "XX000")
                if fields.get("S") in ("FATAL", "PANIC"):
                    fatal = True
                if self.copy & COPY_LIVE:
                    self._copy_failed(self.sqlstate)
                self.breaker.record_server_error(self.sqlstate)
                inflight = client.inflight
                if inflight and inflight[0][0] == REC_EXECUTE:
                    if not t_done:
                        t_done = perf_counter_ns()
                    self._record(client, b"", self.sqlstate, t_done)
                    # PostgreSQL skips the rest of the batch up to its Sync.
                    while inflight and inflight[0][0] == REC_EXECUTE:
                        inflight.popleft()
            elif kind == _E and m.parse_fields(body).get("S") != "FATAL":
                event(
                    "could not apply a client setting on the server",
                    logging.WARNING,
                    server=self.id,
                    client=client.id,
                    error=m.parse_fields(body).get("M", ""),
                )
        if self.swallow or self.state is CLOSED:
            return  # inside our own query's response, or the client was just dropped
        if drops is not None:
            # Cut the 5-byte responses to statements scry prepared or closed itself.
            pieces, start = [], 0
            for end in drops:
                pieces.append(out[start : end - 5])
                start = end
            pieces.append(out[start:])
            out = b"".join(pieces)
        if out:
            client.unanswered = None
            client.transport.write(out)
        if fatal:
            # PostgreSQL closes the session after a FATAL error: the client
            # gets the close with it, as from PostgreSQL, not a moment later.
            self._broken("server ended the session with a FATAL error", told=True)
            return
        if release and self._scanner.at_boundary:
            client.on_server_ready(self)

    def _parked_data(self, data: bytes) -> None:
        # Nothing was asked: to the client this server is as good as idle in
        # the pool. An error here (the backend is being terminated) costs the
        # client nothing; it simply gets another server next time.
        client = self.client
        assert client is not None
        try:
            _, events = self._scanner.feed(data)
        except ProtocolViolation:
            events = [(_E, 0, b"")]
        for kind, _end, body in events:
            if kind in (_E, _Z):  # an error, or an answer nobody asked for
                client.drop_parked_server(self)
                self.close(
                    f"server error while idle: {m.parse_fields(body).get('M', '')}"
                    if kind == _E
                    else "unexpected ReadyForQuery while idle"
                )
                return
            if kind == _S:
                name, value = m.parse_parameter_status(body)
                self.params[name] = value

    # --- COPY FROM STDIN: Syncs PostgreSQL ignores -------------------------------

    def copy_window_closed(self, syncs: int, early: int) -> None:
        """The client sent CopyDone or CopyFail, after ``syncs`` Syncs since its
        last Query or Execute, ``early`` of them right after it (libpq sends
        Execute and Sync together, before any COPY data).

        PostgreSQL ignores the Syncs it reads while in COPY and answers the
        others. If the COPY ends well it read them all in COPY: all are settled
        at the next ReadyForQuery. If it failed on its data, it had read the
        early ones before any data: those are settled; which later ones it
        read before failing cannot be known, so they count as answered. The
        server may then wait for one answer too many, but is never released
        while it still owes one, and it is not reused.
        """
        copy = self.copy
        if copy & (COPY_FAILED | COPY_BROKEN):
            self.copy = copy & ~(COPY_FAILED | COPY_BROKEN)
            if copy & COPY_FAILED:
                self._copy_ignored(early)
                syncs -= early
            if syncs:
                self.desync("Syncs sent inside a COPY that failed")
        elif copy & COPY_WINDOW:
            if syncs or self.copy_window:
                self.desync("Syncs sent inside overlapping COPYs")
        else:
            self.copy = copy | COPY_WINDOW
            self.copy_window = syncs
            self.copy_early = early

    def _copy_failed(self, sqlstate: str) -> None:
        """ErrorResponse while in COPY: the COPY is over.

        08P01 means it ended on a message that was not COPY data (a Query or
        Parse sent into it): the Syncs after that message were answered."""
        copy = self.copy & ~COPY_LIVE
        broken = sqlstate == PROTOCOL_VIOLATION
        if copy & COPY_WINDOW:
            self.copy = copy & ~COPY_WINDOW
            late = self.copy_window
            if not broken:
                self._copy_ignored(self.copy_early)
                late -= self.copy_early
            if late:
                self.desync("Syncs sent inside a COPY that failed")
        else:  # settled when the client ends its data
            self.copy = copy | (COPY_BROKEN if broken else COPY_FAILED)

    def _copy_settled(self) -> None:
        """A ReadyForQuery: PostgreSQL is out of COPY. If the COPY ended well,
        the Syncs sent inside it earned no ReadyForQuery."""
        copy, self.copy = self.copy, 0
        if copy & COPY_LIVE and copy & COPY_WINDOW:
            self._copy_ignored(self.copy_window)
        # (Anything else left here was a CopyDone outside any COPY, or a COPY
        # that failed, whose Syncs were settled when it did.)

    def _copy_ignored(self, syncs: int) -> None:
        """``syncs`` Syncs PostgreSQL read while in COPY: count them answered."""
        client = self.client
        if not syncs or client is None:
            return
        self.pending -= syncs
        client.answered += syncs
        self.statements.segments_done += syncs
        inflight = client.inflight
        for _ in range(syncs):  # their end-of-batch markers, oldest first
            for i, item in enumerate(inflight):
                if item[0] == REC_SYNC:
                    del inflight[i]
                    break

    def desync(self, why: str) -> None:
        """This server's answers can no longer be counted: keep it from anyone else."""
        if not self.desynced:
            self.desynced = True
            event("server answers out of step; it will be closed, not reused",
                  logging.WARNING, server=self.id, why=why)  # fmt: skip

    def _record(
        self, client: ClientConnection, tag: bytes, sqlstate: str | None, t_done: int
    ) -> None:
        """One statement is complete: a single append, everything else is off-path."""
        _, text, t_received = client.inflight.popleft()
        t_acquired = client.t_acquired
        if t_acquired < t_received:
            t_acquired = t_received
        self.observe(
            (client.context, text, t_received, t_acquired, t_acquired, t_done, tag, sqlstate,
             client.pins)
        )  # fmt: skip
        if len(self.observed_queue) == self.drain_at:
            self.wake_drain()

    def _idle_data(self, data: bytes) -> None:
        # An idle backend may still send asynchronous messages (NOTICE on
        # shutdown, an ErrorResponse before it terminates): read, don't forward.
        try:
            _, events = self._scanner.feed(data)
        except ProtocolViolation:
            self.close("protocol violation while idle")
            return
        for kind, _end, body in events:
            if kind == _E:
                fields = m.parse_fields(body)
                self.close(f"server error while idle: {fields.get('M', '')}")
                return
            if kind == _Z:
                self.close("unexpected ReadyForQuery while idle")
                return
            if kind == _S:
                name, value = m.parse_parameter_status(body)
                self.params[name] = value

    def _broken(self, reason: str, told: bool = False) -> None:
        """The session is gone; ``told``: its client has PostgreSQL's own error."""
        client = self.client
        if client is not None and self.sqlstate is None:
            # Lost mid-request without an error saying why: the server is sick.
            self.breaker.record_failure("server connection lost", gone=True)
        self.close(reason)
        if client is not None:
            client.on_server_lost(self, reason, told)

    # --- internal queries (reset, health check) --------------------------------

    def run_internal(
        self,
        sql: str,
        done: Callable[[bool], None],
        resync: bool = True,
        timeout: float = INTERNAL_QUERY_TIMEOUT,
        params: list[str] | None = None,
    ) -> None:
        """Run ``sql`` with no client attached; ``done(ok)`` when it is ready again.

        ``resync`` sends a Sync first: if the last client left PostgreSQL
        skipping messages after an extended-protocol error, that ends it, and
        otherwise it only costs one extra ReadyForQuery. With ``params`` the
        query goes as Parse/Bind/Execute, and its rows are kept in
        ``internal_rows``.
        """
        self.state = INTERNAL
        self._internal_done = done
        self._internal_answers = 2 if resync else 1
        self._internal_error = False
        self.internal_error_fields: dict[str, str] | None = None
        self.internal_rows = None
        if params is not None:
            # Rows are whole messages, which the relay's scanner does not keep.
            self.internal_rows = []
            self._reader = MessageReader(self.pool.max_message_size)
            self.statements.unnamed_owner = None  # (its Parse replaces the unnamed statement)
        # A server that does not answer our own query in time is not trusted again.
        self._internal_timer = asyncio.get_running_loop().call_later(
            timeout, self._internal_timed_out
        )
        payload = m.query(sql) if params is None else m.parameterized_query(sql, params)
        self.transport.write(m.sync() + payload if resync else payload)  # type: ignore[union-attr]

    async def run_connect_query(self, sql: str) -> None:
        """PgBouncer's connect_query, before any client has this server. An
        error is logged and the server used anyway, as there; a server the
        query leaves unusable (closed, or inside a transaction) raises."""
        answered: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        timeout = self.pool.proxy.config.timeouts.server_connect_timeout
        self.run_internal(
            sql,
            lambda ok: answered.done() or answered.set_result(ok),
            resync=False,
            timeout=max(timeout, INTERNAL_QUERY_TIMEOUT),
        )
        await answered
        if self.state is CLOSED:
            raise ServerLoginError(
                {"C": CONNECTION_FAILURE, "M": "connect_query: the server closed or did not answer"}
            )
        if self.tx_status != _TX_IDLE:
            self.close("connect_query left a transaction open")
            raise ServerLoginError(
                {"C": CONNECTION_FAILURE, "M": "connect_query left a transaction open"}
            )
        fields = self.internal_error_fields
        if fields is not None:
            event("connect_query failed", logging.WARNING, server=self.id, pool=self.pool.name,
                  sqlstate=fields.get("C", ""), error=fields.get("M", ""))  # fmt: skip

    def _internal_timed_out(self) -> None:
        self._internal_timer = None
        done, self._internal_done = self._internal_done, None
        if self.state is INTERNAL:
            self.close("no answer to scry's own query (reset or check)")
            if done is not None:
                done(False)

    def _internal_data(self, data: bytes) -> None:
        rows = self.internal_rows
        try:
            if rows is None:
                _, events = self._scanner.feed(data)
            else:
                reader = self._reader
                assert reader is not None
                reader.feed(data)
                events = [(kind, 0, body) for kind, body in reader.messages()]
        except ProtocolViolation:
            self.close("protocol violation during internal query")
            return
        for kind, _end, body in events:
            if kind == _D and rows is not None:
                rows.append(m.parse_data_row(body))
            elif kind == _E:
                self._internal_error = True
                self.internal_error_fields = m.parse_fields(body)
            elif kind == _S:
                name, value = m.parse_parameter_status(body)
                self.params[name] = value
            elif kind == _Z:
                self._internal_answers -= 1
                if self._internal_answers > 0:
                    self._internal_error = False  # that answered the Sync: the old state
                    continue
                done = self._internal_done
                self._internal_done = None
                if self._internal_timer is not None:
                    self._internal_timer.cancel()
                    self._internal_timer = None
                self.tx_status = body[0]
                self.state = IDLE
                self._reader = None
                ok = not self._internal_error and body[0] == _TX_IDLE
                if done is not None:
                    done(ok)
                return

    # --- linking ------------------------------------------------------------------

    def link(self, client: ClientConnection) -> None:
        """Serve ``client``: bring the backend's settings in line with the client's."""
        self.state = ACTIVE
        self.client = client
        self.pending = 0
        self.copy = 0
        statements = self.statements
        if statements.expect:  # all answered while idle; nothing may linger
            statements.expect.clear()
        if not client.message_mode:
            # Its unnamed Parses are not followed: the unnamed statement is nobody's.
            statements.unnamed_owner = None
        wanted = client.params
        if self.applied is not wanted:
            self._apply_settings(wanted)

    def _apply_settings(self, wanted: dict[str, str]) -> None:
        """SET (and RESET) what the newly linked client's settings need; its
        answers are hidden from the client."""
        if self.applied != wanted:
            sql = settings_sql(self.applied, wanted)
            if sql:
                self.swallow += 1
                self.transport.write(m.query(sql))  # type: ignore[union-attr]
        self.applied = wanted

    def retire_because(self, reason: str) -> None:
        """Close this server instead of reusing it, once its client gives it back."""
        self.retire = True
        self.retire_reason = reason

    def unlink(self) -> None:
        self.client = None
        self.state = IDLE
        if self.paused_by_client:
            self.paused_by_client = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    @property
    def settled(self) -> bool:
        """Idle, nothing owed, at a message boundary, as far as scry counts.

        A server desynced by COPY may count an answer too many, never one too
        few, so this is still true of it; one desynced by a stray
        ReadyForQuery may count low, but is closed, never reused, either way."""
        return (
            self.state is not CLOSED
            and self.pending <= 0
            and self.swallow == 0
            and self.tx_status == _TX_IDLE
            and self._scanner.at_boundary
        )

    @property
    def clean(self) -> bool:
        """Safe to give to another client: settled, and its answers counted right."""
        return not self.desynced and self.settled

    # --- flow control: the client cannot take more, so stop reading the server --

    def pause_writing(self) -> None:
        if self.client is not None:
            self.client.pause_reading_for(self)

    def resume_writing(self) -> None:
        if self.client is not None:
            self.client.resume_reading_for(self)

    # --- closing -------------------------------------------------------------------

    def close(self, reason: str) -> None:
        if self.state is CLOSED:
            return
        was_up = self.state is not CONNECTING and self.state is not LOGIN
        self.state = CLOSED
        self.close_reason = reason
        if self.transport is not None:
            if was_up:
                try:
                    self.transport.write(m.terminate())
                except Exception:
                    pass
            if was_up and self.pool.shares_a_limit and not self.transport.is_closing():
                # Its backend still runs until it reads the Terminate: a server
                # opened in its place must not make PostgreSQL see one too many.
                self.pool.exiting += 1
                self._exit_timer = asyncio.get_running_loop().call_later(
                    BACKEND_EXIT_WAIT, self._backend_gone
                )
            else:
                self.transport.close()
        self.pool.on_server_closed(self, was_up)

    def _backend_gone(self) -> None:
        """PostgreSQL closed a server scry had closed (or BACKEND_EXIT_WAIT passed)."""
        timer, self._exit_timer = self._exit_timer, None
        if timer is None:
            return
        timer.cancel()
        if self.transport is not None:
            self.transport.close()
        self.pool.backend_exited()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is CLOSED:
            self._backend_gone()
            return
        state = self.state
        reason = f"server closed the connection{': ' + str(exc) if exc else ''}"
        if state is LOGIN:
            self._login_failed(ConnectionError(reason))
            return
        if state is INTERNAL and self._internal_done is not None:
            done, self._internal_done = self._internal_done, None
            self.close(reason)
            done(False)
            return
        client = self.client
        if client is not None and client.parked and self.pending <= 0:
            client.drop_parked_server(self)
            self.close(reason)
            return
        self._broken(reason)

    def send_cancel(self) -> asyncio.Task[None]:
        """Ask PostgreSQL to cancel whatever this backend is running; the task
        ends once PostgreSQL has acted on it (or cancel_wait_timeout passed).

        Until then, this server is not handed to another client: a late
        cancel must never hit someone else's query.
        """
        self.cancels_pending += 1
        return asyncio.get_running_loop().create_task(self._cancel())

    async def _cancel(self) -> None:
        try:
            await send_cancel_request(
                self.address,
                self.backend_pid,
                self.backend_secret,
                self.pool.proxy.config.timeouts.cancel_wait_timeout,
            )
        finally:
            self.cancels_pending -= 1
            if not self.cancels_pending and self.release_after_cancel:
                self.release_after_cancel = False
                self.pool.release(self)


def settings_sql(applied: dict[str, str], wanted: dict[str, str]) -> str:
    """SQL that turns a backend's ``applied`` settings into ``wanted``.

    ``set_config`` takes the value as PostgreSQL reads it from a startup packet
    or postgresql.conf (so ``search_path=a,b`` is two schemas, not one quoted name).
    """
    sets = [
        f"set_config({quote_literal(name)}, {quote_literal(value)}, false)"
        for name, value in wanted.items()
        if applied.get(name) != value
    ]
    parts = [f"SELECT {', '.join(sets)}"] if sets else []
    parts.extend(f"RESET {quote_identifier(name)}" for name in applied if name not in wanted)
    return ";".join(parts)


async def send_cancel_request(
    address: tuple[str, int], pid: int, secret: int, timeout: float, to: str = "the server"
) -> None:
    """Open a fresh connection to ``address`` (a backend's server, the host its
    connection went to; or a peer scry) and send a CancelRequest. A host that
    is a directory means the Unix socket in it, as in libpq. ``timeout``
    (cancel_wait_timeout; 0 = none) bounds the whole exchange."""
    host, port = address
    try:
        async with asyncio.timeout(timeout or None):
            if host.startswith("/"):
                reader, writer = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
            else:
                reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(cancel_request(pid, secret))
                await writer.drain()
                # PostgreSQL (and a peer) closes the connection once it has acted on it.
                await reader.read()
            finally:
                writer.close()
    except TimeoutError:
        event(f"cancel request to {to} timed out", logging.WARNING,
              addr=f"{host}:{port}", cancel_wait_timeout=timeout)  # fmt: skip
    except OSError as exc:
        event(f"cancel request could not reach {to}", logging.WARNING,
              addr=f"{host}:{port}", error=str(exc))  # fmt: skip


def random_secret() -> int:
    return secrets.randbits(32)
