"""One connection to the ``pgbouncer`` database: login, then simple queries.

The session authenticates with scry's normal auth (the auth_file users) and
admits only ``admin_users`` and ``stats_users`` (and, over the Unix socket,
the OS user running scry as ``pgbouncer``, without a password, as PgBouncer
does). Each Query is answered by :class:`~scry.pgbouncer.dispatch.AdminConsole`;
an answer that must wait (PAUSE, WAIT_CLOSE ...) holds the following queries
back until it is sent. Only the simple query protocol is spoken, as in PgBouncer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from scry.log import connection_event, event
from scry.pgbouncer import PGBOUNCER_VERSION
from scry.pgbouncer.dispatch import AdminConsole
from scry.pgbouncer.results import ADMIN_DB, READY, error, peer_uid
from scry.protocol import messages as m
from scry.protocol.auth import ClientAuthExchange
from scry.protocol.errors import PROTOCOL_VIOLATION, ProtocolViolation
from scry.protocol.framing import MessageReader

if TYPE_CHECKING:
    from scry.pgbouncer.state import ConsoleState
    from scry.proxy import Proxy

#: The ParameterStatus set a console client gets (PgBouncer's).
WELCOME = (
    ("server_version", f"{PGBOUNCER_VERSION}/bouncer"),
    ("client_encoding", "UTF8"),
    ("server_encoding", "UTF8"),
    ("DateStyle", "ISO"),
    ("TimeZone", "GMT"),
    ("standard_conforming_strings", "on"),
    ("is_superuser", "on"),
)
_session_ids = itertools.count(1_000_001)


class ConsoleSession(asyncio.Protocol):
    """One connection to the ``pgbouncer`` database."""

    def __init__(
        self, proxy: Proxy, transport: asyncio.BaseTransport, user: str, *, tls: bool,
        state: ConsoleState, method: str,
    ) -> None:  # fmt: skip
        self.proxy = proxy
        self.method = method  # auth.type, or what the HBA file chose for this login
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
        peer = peer_uid(self.transport)
        if peer is not None and peer[1] == os.getuid() and self.user == ADMIN_DB:
            self._login_ok(admin=True)  # PgBouncer: same OS user over the socket
            return
        method = self.method
        if method == "any":
            admin = self.user in compat.admin_users
            self._login_ok(admin=admin)
            return
        self._auth = ClientAuthExchange(
            method,
            self.user,
            proxy.auth.secret_for(self.user),
            scram_iterations=proxy.auth.scram_iterations,
        )
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
        greeting = m.auth_ok() + b"".join(m.parameter_status(k, v) for k, v in WELCOME)
        self.transport.write(greeting + m.backend_key_data(0, 0) + READY)
        connection_event("console login", user=self.user, admin=admin)

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
            data = error(f"internal error: {exc}") + READY
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
