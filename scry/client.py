"""A client connected to scry: the relay between it and its servers.

``ClientConnection`` is an ``asyncio.Protocol``:

    startup -> auth -> login (waiting for the pool's first server) -> ready -> closed

The way in (startup, TLS, auth, greeting) is :mod:`scry.client_login`; the
whole-message mode for named prepared statements is :mod:`scry.client_messages`;
both are mixins of this one class. In ``ready`` every chunk from the client is scanned for the messages that
matter to pooling (Query, Sync and FunctionCall each owe one ReadyForQuery;
Terminate ends the client) and forwarded whole to its server. Without a server
the chunk is queued, reading pauses, and the pool is asked for one; in
transaction mode the server goes back as soon as it reports idle with nothing
owed, at a message boundary on both sides.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import logging
import time
from time import monotonic, perf_counter_ns
from typing import TYPE_CHECKING

from scry.breaker import CLOSED as BREAKER_CLOSED
from scry.client_login import ClientLogin
from scry.client_messages import FUNCTION_CALL_MARK, SYNC_MARK, MessageModeRelay, parse_text
from scry.log import disconnection_event, event, logging_disconnections
from scry.pool import Pool, PoolStats
from scry.protocol import messages as m
from scry.protocol.errors import (
    ADMIN_SHUTDOWN,
    CONNECTION_FAILURE,
    PROTOCOL_VIOLATION,
    ProtocolViolation,
)
from scry.protocol.framing import DEFAULT_MAX_COLLECT, MessageScanner
from scry.relay_core import (
    AUTH,
    CLIENT_MARK,
    CLIENT_WANT,
    CLOSED,
    COMPILED,
    LOGIN,
    MAX_QUEUED_BYTES,
    READY,
    STARTUP,
    ClientCore,
    client_numbers,
)
from scry.server import REC_EXECUTE, REC_QUERY, ServerConnection

if TYPE_CHECKING:
    from scry.proxy import Proxy

_Q = m.QUERY[0]
_SYNC = m.SYNC[0]
_F = m.FUNCTION_CALL[0]
_X = m.TERMINATE[0]
_EXECUTE = m.EXECUTE[0]
_MARKED = frozenset(x[0] for x in (m.BIND, m.DESCRIBE, m.CLOSE, m.FLUSH))
_PARSE = m.PARSE[0]

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


# The settings a record's ClientContext carries (scry.observe.record).
_IN_CONTEXT = frozenset({"application_name", "standard_conforming_strings"})

_NO_STATS = PoolStats()  # counts nothing anyone reads: clients before they have a pool


class ClientConnection(ClientLogin, MessageModeRelay, ClientCore, asyncio.Protocol):
    """One application connection to scry."""

    # Its fields are ClientCore's (scry.relay_core): C struct members when compiled.
    # _droppable: the startup settings PgBouncer's ignore_startup_parameters lets
    # its login drop when PostgreSQL refuses them (set in PgBouncer mode only).
    __slots__ = ("__weakref__", "_droppable")

    if not COMPILED:  # else the compiled ClientCore.__init__, which does the same

        def __init__(self, proxy: Proxy) -> None:
            self.start_fields()  # the rest (see PyClientCore.start_fields)
            self.proxy = proxy
            self.stats: PoolStats = _NO_STATS  # its pool's SHOW STATS counters
            self._scanner = MessageScanner(
                CLIENT_WANT, proxy.config.max_packet_size, mark=CLIENT_MARK
            )
            self.observed = proxy.observatory.enabled  # records what runs (scry.observe.record)
            self.id = f"c{next(client_numbers)}"
            self.connected_at = time.time()
            self.connected_clock = monotonic()  # for client_login_timeout

    # --- asyncio callbacks -----------------------------------------------------

    def _connection_made(self, transport: asyncio.BaseTransport) -> None:
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

    def _data_received(self, data: bytes) -> None:
        """Every chunk from the client; the compiled ClientCore serves one whole
        Query itself and hands this the rest."""
        if self.state is READY:
            self._relay(data)
        elif self.state is STARTUP:
            self._startup_data(data)
        elif self.state is AUTH:
            self._auth_data(data)
        elif self.state is LOGIN:
            reader = self._reader
            assert reader is not None
            reader.feed(data)  # pipelined before ReadyForQuery; relayed later
            if reader.buffered > MAX_QUEUED_BYTES and not self._paused_waiting:
                self._paused_waiting = True  # (as a client waiting for a server)
                self.transport.pause_reading()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self.state is not CLOSED:
            self._cleanup(
                "client disconnected" if exc is None else f"client connection lost: {exc}"
            )

    if not COMPILED:  # else the compiled ClientCore's, which call these when they must
        data_received = _data_received
        connection_made = _connection_made
        connection_lost = _connection_lost

    def refuse_transaction_block(self) -> None:
        """Statement pooling: a transaction block was opened, which it cannot serve."""
        self.fatal(PROTOCOL_VIOLATION, "transaction blocks not allowed in statement pooling mode")

    def refuse_stream(self, exc: ProtocolViolation) -> None:
        """A malformed message: FATAL for this client. The chunk that held it is
        dropped whole, and may have held the end of a message whose start already
        reached PostgreSQL, so our server is closed, never reused."""
        server = self.server
        if server is not None:
            server.desynced = True
        self.fatal(exc.sqlstate, str(exc))

    def query_timed_out(self, limit: float) -> None:
        """query_timeout: cancel the query on PostgreSQL, close this client (PgBouncer's way)."""
        pool = self.pool
        if pool is not None:
            pool.breaker.record_failure("query_timeout")
        event("query_timeout", logging.WARNING, client=self.id, limit_s=limit)
        self.fatal("57014", "query_timeout", detail=f"the query ran longer than {limit:g} s")

    def transaction_timed_out(self, limit: float) -> None:
        """transaction_timeout: close this client (a running statement is
        cancelled on PostgreSQL, the transaction rolled back)."""
        event("transaction_timeout", logging.WARNING, client=self.id, limit_s=limit)
        self.fatal(
            "25P04",
            "transaction_timeout",
            detail=f"the transaction ran longer than {limit:g} s (timeouts.transaction_timeout)",
        )

    def login_timed_out(self) -> None:
        """client_login_timeout (checked by the janitor). Not for a client
        already greeted while PAUSE holds its settings check: its login
        has ended, as far as it knows, and it waits as a query would."""
        if self.state in (STARTUP, AUTH, LOGIN) and self.cancel_key is None:
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
            self.refuse_stream(exc)
            return
        if self.refuse_query and any(kind == _Q for kind, _, _ in events):
            self._refuse_simple_query()
            return
        if len(events) == 1:
            kind, end, body = events[0]
            if kind == _Q:
                self._relay_query(out, body)
                return
            if kind == _X and end == 5:  # a lone Terminate: how every client leaves
                self.stats.received -= 5  # PgBouncer does not count the Terminate
                self._cleanup("client closed")
                return
        owed = 0
        terminate = False
        # What to time, in order (see REC_* in scry.server): a record per statement.
        texts: list[tuple[int, bytes]] | None = [] if self.observed else None
        tracker = self.tracker
        to_messages = False
        chain = -1  # where a Sync right after the last Query/Execute (or such a Sync) starts
        self.last_active = monotonic()
        for kind, end, body in events:
            # Query, Sync and FunctionCall are each answered by one ReadyForQuery.
            if kind == _SYNC:
                owed += 1
                self._syncs_since_execute += 1
                if end - 5 == chain:  # (a COPY it starts ignores this Sync: see scry.server)
                    chain = end
                    self._early_syncs += 1
                self._unsynced = False
                if self._unnamed_open and self.transaction_pooling:
                    # Parsed, synced, not executed: the Bind may come on another server.
                    to_messages = True
                if texts is not None:
                    texts.append(SYNC_MARK)
                if tracker is not None:
                    tracker.on_sync(self.ordinal + owed)
            elif kind == _Q:
                owed += 1
                self._syncs_since_execute = self._early_syncs = 0
                chain = end
                self._unnamed_open = False  # a simple Query drops the unnamed statement
                if texts is not None:
                    texts.append((REC_QUERY, body))
                if tracker is not None:
                    tracker.on_query(body, self.ordinal + owed)
            elif kind == _EXECUTE:
                self._syncs_since_execute = self._early_syncs = 0
                chain = end
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
                self._syncs_since_execute = self._early_syncs = 0
                self._unsynced = False
                if texts is not None:
                    texts.append(FUNCTION_CALL_MARK)
            elif kind == _X:
                out = out[: end - 5]
                terminate = True
                self.stats.received -= 5  # PgBouncer does not count the Terminate
                break
            else:  # CopyDone / CopyFail
                self._close_copy_window()
        if self.transaction_pooling and not terminate:
            # A Parse longer than this chunk that must be read whole, before
            # any of it is forwarded: see _partial_parse_start.
            parse_start = self._partial_parse_start(out)
            if parse_start >= 0 and self._start_rewriting(out, parse_start, owed, texts):
                return
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

    def _partial_parse_start(self, out: bytes) -> int:
        """Where in ``out`` a Parse begins that ``out`` ends without completing
        and that must be read whole; -1 if none. A named one (or one whose name
        has not arrived yet) is rewritten. An unnamed one longer than the
        scanner copies out is kept whole, to be parsed again if the Bind comes
        on another server (ClientStatements.unnamed)."""
        partial = self._scanner.partial_message()
        if partial is None or partial[0] != _PARSE:
            return -1
        gathered = partial[1]
        start = len(out) - 5 - gathered
        if start < 0:  # (begun in an earlier chunk, forwarded then: too late here)
            return -1
        if gathered == 0 or out[start + 5] != 0:
            return start
        length = int.from_bytes(out[start + 1 : start + 5], "big") - 4
        return start if length > DEFAULT_MAX_COLLECT else -1

    def _relay_query(self, out: bytes, body: bytes) -> None:
        """:meth:`_relay` for the commonest chunk by far: one simple Query, whole
        (the general loop's steps for one Query, without its list of texts)."""
        self._syncs_since_execute = self._early_syncs = 0
        self._unnamed_open = False  # a simple Query drops the unnamed statement
        ordinal = self.ordinal = self.ordinal + 1
        tracker = self.tracker
        if tracker is not None:
            tracker.on_query(body, ordinal)
        if self.observed:
            self.inflight.append((REC_QUERY, body, perf_counter_ns()))
        self.last_active = monotonic()
        self._forward(out, 1, len(out))

    def _forward(self, payload: bytes | list[tuple[int, bytes]], owed: int, size: int) -> None:
        """Send to our server, or queue and ask the pool for one."""
        if self.parked:
            self._unpark()
        server = self.server
        if server is not None:
            self.unanswered = None  # more than the first batch: no longer retryable
            if isinstance(payload, bytes):
                data = payload
            else:
                data = self._render(payload, server)
                if self.state is CLOSED:
                    return  # refused while rewriting
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
            if self._paused_waiting and self.server is not None:
                # A server at once (no wait for attach() to end): read again.
                self._paused_waiting = False
                self._update_reading()

    def _close_copy_window(self) -> None:
        """CopyDone or CopyFail: PostgreSQL may have ignored the Syncs sent since
        the COPY began; our server settles that when it sees how the COPY ended."""
        syncs, early = self._syncs_since_execute, self._early_syncs
        self._syncs_since_execute = self._early_syncs = 0
        server = self.server
        if server is not None:
            server.copy_window_closed(syncs, early)
        # (With no server the data is queued and no COPY runs yet: every Sync counts
        # as answered, which at worst keeps the next server until this client leaves.)

    def _note_inflight(self, texts: list[tuple[int, bytes]]) -> None:
        now = perf_counter_ns()
        inflight = self.inflight
        for code, text in texts:
            inflight.append((code, text, now))

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
        if self.statements is not None and self._answer_prepare():
            return
        # No timer per wait: the janitor enforces query_wait_timeout on the queue.
        self.waiting_since = perf_counter_ns()
        pool.wait(self)

    def _reject_queued(self, sqlstate: str, text: str) -> None:
        """Answer every queued request with an error instead of running it (breaker open)."""
        owed = self._queued_owed
        if owed <= 0 or (self._messages is None and not self._scanner.at_boundary):
            # Nothing to answer yet, or the queue ends with the head of a message
            # whose tail is still to come: decide once it is whole (dropping the
            # head alone would send PostgreSQL a headless tail later). Read on
            # meanwhile: none of it will wait for a server.
            if self._paused_waiting:
                self._paused_waiting = False
                self._update_reading()
            return
        self._queue.clear()
        self._queued_owed = 0
        self._queued_bytes = 0
        self.inflight.clear()
        self.answered += owed  # (these ReadyForQuery are scry's; nothing ran)
        tracker = self.tracker
        if tracker is not None and tracker.work:
            tracker.never_ran(self.answered)
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
            self._replay_on(server)
        if self._queue:
            self._send_queue(server)

    def _replay_on(self, server: ServerConnection) -> None:
        """This client's SETs and PREPAREs were left on a reclaimed server:
        re-create them here, before its query, and hide the answers."""
        tracker = self.tracker
        assert tracker is not None
        tracker.needs_replay = False
        server.swallow += 1
        server.transport.write(m.query(tracker.replay_sql()))  # type: ignore[union-attr]

    def _send_queue(self, server: ServerConnection) -> None:
        """What the client sent while it waited, to the server it now has."""
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
                if self.state is CLOSED:
                    return  # refused while rewriting
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
        if server.close_needed:
            self.server_must_go(server)
            return
        if not self.transaction_pooling or not self._at_boundary():
            return
        tracker = self.tracker
        if tracker is not None and tracker.pinned:
            return  # session state lives on this server: keep it
        self._retried = False
        pool = self.pool
        assert pool is not None
        if (
            not pool.waiters
            and not pool.paused
            and self.answered > 1
            and (pool.idle or not pool.full)
        ):
            # Nobody needs it now: keep it (no release/acquire per transaction)
            # and hand it over as soon as another client asks for one. Not after
            # a client's first answer: connect-per-query clients leave next, and
            # servers parked with them would spread the load over more backends.
            # Not when it is the pool's last free server either: the next client
            # would take it back from us, and under contention parked servers
            # sit out of rotation while others queue.
            if not self.parked:
                self.parked = True
                pool.parked[self] = None
            return
        self.server = None
        server.unlink()
        pool.release(server)

    def _refuse_simple_query(self) -> None:
        """disable_pqexec: the client sent a simple Query; it is disconnected, as
        in PgBouncer, before anything of what it sent reaches a server."""
        event("simple query refused (disable_pqexec)", logging.WARNING, client=self.id,
              user=self.user, db=self.database)  # fmt: skip
        self.fatal(PROTOCOL_VIOLATION, "PQexec disallowed (disable_pqexec)")

    @property
    def keeps_its_server(self) -> bool:
        """Between transactions too: session mode, or a hybrid client pinned by
        session state."""
        tracker = self.tracker
        return not self.transaction_pooling or (tracker is not None and tracker.pinned)

    def server_must_go(self, server: ServerConnection) -> None:
        """server_fast_close: RECONNECT or a reload marked the server this
        session holds (Pool.close_sessions_fast). Once no transaction is open
        on it, it goes: a pinned hybrid client whose state can be replayed
        moves on to a new server; any other session ends with it, as in
        PgBouncer. A client that stopped pinning gives it back as usual."""
        if not self.between_transactions():
            return  # (at the end of this transaction)
        server.close_needed = False
        if not self.keeps_its_server:
            self.on_server_ready(server)  # (back to the pool, which closes it)
            return
        if self.reclaim_pinned_server("server_fast_close"):
            return
        pool = self.pool
        why = "database configuration changed" if pool is None or pool.stale else "RECONNECT"
        self.server = None
        server.unlink()
        server.close(f"{why} (server_fast_close)")
        self.fatal(ADMIN_SHUTDOWN, f"terminating the session: {why} (server_fast_close)")

    def detach_idle_server(self, *, starting: bool = False) -> ServerConnection | None:
        """Give up our server while between transactions (the pool wants it).
        ``starting``: the client began a new transaction in bytes not forwarded
        yet (unparking), so where its stream stands now does not matter."""
        server = self.server
        if (
            server is None
            or self.state is not READY
            or server.cancels_pending
            or not server.clean
            or not (starting or self._at_boundary())
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
        return server.settled and self._at_boundary() and not server.cancels_pending

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
            # take the ordinary path, which asks it (even when this chunk holds
            # only the head of the first message).
            server = self.detach_idle_server(starting=True)
            if server is not None:
                pool.release(server)

    def on_parameter_status(self, server: ServerConnection, name: str, value: str) -> None:
        """The client (or our SET) changed a setting: remember it for the next server."""
        if name in TRACKED_PARAMETERS and self.params.get(name) != value:
            self.params = {**self.params, name: value}
            server.applied = self.params
            if name == "application_name":
                self.application_name = value
            if name in _IN_CONTEXT:
                self.context = self.new_context()

    def on_server_lost(self, server: ServerConnection, reason: str, told: bool = False) -> None:
        """Our server died under us.

        If it died before answering anything since it was linked (an idle
        backend killed or restarted while in the pool), nothing ran: the
        messages go to another server, once. Otherwise the session is gone and
        so is the client. ``told``: the client already has PostgreSQL's FATAL
        error, as it would without scry, so only the close is left (a second
        error would read as two results of one query).
        """
        if self.server is server:
            self.server = None
        if self.state is not READY:
            return
        unanswered = self.unanswered
        self.unanswered = None
        if told:
            self._cleanup(reason)
            return
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

    def wait_noticed(self, waited: float) -> None:
        """query_wait_notify: tell the client why its query has not started yet."""
        pool = self.pool
        if pool is None or self.transport is None or self.transport.is_closing():
            return
        self.transport.write(
            m.notice_response(
                "waiting for a server connection: every server of the pool is in use",
                detail=f"pool {pool.name}: servers {len(pool.servers)}/{pool.size}, "
                f"clients queued {len(pool.waiters)}, this one for {waited:.0f} s",
            )
        )

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

    def fatal(
        self, sqlstate: str, text: str, detail: str | None = None, hint: str | None = None
    ) -> None:
        """Send a FATAL ErrorResponse and close."""
        if self.state is CLOSED:
            return
        try:
            self.transport.write(
                m.error_response(sqlstate, text, severity="FATAL", detail=detail, hint=hint)
            )
        except Exception:
            pass
        if self.proxy.config.log.pooler_errors and not logging_disconnections():
            # (else the close line carries the error as its reason)
            event("pooler error", logging.WARNING, client=self.id, addr=self.addr,
                  sqlstate=sqlstate, error=text)  # fmt: skip
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
        if not quiet and logging_disconnections():
            self._log_closed(reason)

    def _log_closed(self, reason: str) -> None:
        disconnection_event("client closed", client=self.id, addr=self.addr, user=self.user,
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

    def cancel_current_query(self) -> asyncio.Task[None] | None:
        """A CancelRequest with our key: cancel what our server runs, if
        anything; the forwarded cancel's task (None: nothing runs)."""
        server = self.server
        if server is not None and server.pending > 0:
            return server.send_cancel()
        return None
