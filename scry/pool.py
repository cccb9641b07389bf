"""Server pools: one per (database, server user), FIFO waiters, idle reuse.

A pool hands idle servers to clients synchronously (``acquire_nowait``) so the
hot path never awaits; only when none is idle does a client queue, and a
released server then goes straight to the oldest waiter. New connections are
opened only for waiting clients (or to keep ``min_size``) and never beyond
``size``. If PostgreSQL cannot be reached and the pool has no server left,
waiting clients are told at once instead of hanging until a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from time import perf_counter_ns
from typing import TYPE_CHECKING

from scry import connection_limits
from scry.config import DatabaseTarget, PoolConfig
from scry.hosts import session_matches, session_passes
from scry.log import connection_event, disconnection_event, event
from scry.protocol import messages as m
from scry.protocol.auth import secret_kind
from scry.protocol.errors import CONNECTION_FAILURE
from scry.protocol.prepared import ParsedStatements
from scry.relay_core import PoolCore, PoolStats
from scry.server import CLOSED, IDLE, ServerConnection, ServerLoginError, settings_sql

if TYPE_CHECKING:
    from collections.abc import Collection

    from scry.client import ClientConnection
    from scry.proxy import Proxy

# libpq connection options that are not server settings and must not be sent
# in a StartupMessage.
_LIBPQ_ONLY = frozenset(
    {
        "sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslpassword",
        "sslcompression", "sslsni", "requiressl", "ssl_min_protocol_version",
        "ssl_max_protocol_version", "gssencmode", "krbsrvname", "gsslib",
        "channel_binding", "connect_timeout", "host", "hostaddr", "port",
        "passfile", "target_session_attrs", "load_balance_hosts", "keepalives",
        "keepalives_idle", "keepalives_interval", "keepalives_count",
        "tcp_user_timeout", "service", "fallback_application_name", "require_auth",
        "user", "password", "dbname",
    }
)  # fmt: skip
# Startup (setting, value) pairs a pool remembers checking (then forgets all).
_MAX_KNOWN_SETTINGS = 4096


class Pool(PoolCore):
    """Server connections to one database as one user."""

    # Slots: more than 30 attributes (with more, CPython 3.11 gives up sharing
    # instance dict keys); the relay's per-transaction fields are PoolCore's.
    __slots__ = (
        "_asking", "_connect_failures", "_greetings", "_last_wait_noticed", "_limit_delay",
        "_limit_timer", "_next_probe_at", "_reserve_timer", "_retry_handle", "_wait_us_seen",
        "_waits_seen", "_welcome_future", "exiting", "health", "last_error", "limit_blocked",
        "limit_claim", "max_message_size", "max_wait_started", "name", "parsed_statements",
        "refused_settings", "server_password", "server_user", "servers_closed", "servers_opened",
        "setting_spellings", "startup_params", "stats", "target", "unused_since", "__weakref__"
    )  # fmt: skip

    def __init__(
        self,
        proxy: Proxy,
        target: DatabaseTarget,
        server_user: str,
        server_password: str | None,
    ) -> None:
        self.proxy = proxy
        self.target = target
        # The database's, with its user's [users] line over them (PgBouncer mode).
        self.settings: PoolConfig = proxy.config.pool_settings(target, server_user)
        self.unused_since: float | None = None  # (pool_idle_timeout: no client, no server)
        self.server_user = server_user
        self.server_password = server_password
        self.name = f"{target.name}/{server_user}"
        self.startup_params = {k: v for k, v in target.params.items() if k not in _LIBPQ_ONLY}
        self.max_message_size = proxy.config.max_packet_size
        # (Copied: the relay reads them per acquire; Proxy.apply_config renews them.)
        self.check_delay = proxy.config.timeouts.server_check_delay
        self.round_robin = self.settings.server_round_robin
        self.idle: deque[ServerConnection] = deque()
        self.servers: set[ServerConnection] = set()  # every logged-in server
        self.connecting = 0
        self.waiters: deque[ClientConnection] = deque()
        self._last_wait_noticed = 0  # waiting_since of the last wait query_wait_notify told of
        # Clients between transactions that still hold their server because
        # nobody else needed it; the server is taken from them on demand.
        self.parked: dict[ClientConnection, None] = {}
        self.welcome: dict[str, str] | None = None  # ParameterStatus set for new clients
        self._welcome_future: asyncio.Future[None] | None = None
        self.last_error: Exception | None = None
        self._retry_handle: asyncio.TimerHandle | None = None
        self._reserve_timer: asyncio.TimerHandle | None = None
        self._connect_failures = 0
        self._next_probe_at = 0.0  # probe_login's schedule
        # max_db_connections / max_user_connections (scry.connection_limits): this
        # pool was refused a server, and the busy server of a peer it claimed.
        self.limit_blocked = False
        self.limit_claim: ServerConnection | None = None
        self._limit_timer: asyncio.TimerHandle | None = None
        self._limit_delay = 0.0
        self.exiting = 0  # closed servers whose backends may still run (shares_a_limit)
        self.stale = False  # config changed: retire servers as they come back
        self.paused = False  # PAUSE: no server for new transactions until RESUME
        self.breaker = proxy.breaker_for(target.name)
        self.health = proxy.health_for(target.name)
        # (setting, value as a client wrote it) -> PostgreSQL's spelling of it,
        # or (refused_settings) its ErrorResponse fields: check_settings
        self.setting_spellings: dict[tuple[str, str], str] = {}
        self.refused_settings: dict[tuple[str, str], dict[str, str]] = {}
        self._asking: dict[tuple[str, str], asyncio.Future[None]] = {}  # (check_settings)
        # Statements its servers parsed, as many as they can hold together.
        self.parsed_statements = ParsedStatements(
            self.settings.max_prepared_statements * self.settings.size
        )
        # Counters for SHOW/admin views.
        self.stats = PoolStats()
        self.total_wait_us = 0
        self.waits = 0  # clients that had to queue for a server
        self._greetings: dict[tuple[str | tuple[str, str], ...], bytes] = {}
        self._waits_seen = 0
        self._wait_us_seen = 0
        self.max_wait_started: float | None = None
        self.servers_opened = 0
        self.servers_closed = 0

    @property
    def mode(self) -> str:
        return self.settings.mode

    @property
    def size(self) -> int:
        return self.settings.size

    @property
    def full(self) -> bool:
        """Every server ``size`` allows is open or opening (the reserve not counted)."""
        return len(self.servers) + self.connecting >= self.settings.size

    @property
    def reserve_in_use(self) -> int:
        """Servers open (or opening) beyond ``size``, taken from the reserve pool."""
        return max(0, len(self.servers) + self.connecting - self.settings.size)

    @property
    def active_count(self) -> int:
        """Servers running something (not idle, not held by a parked client)."""
        return len(self.servers) - len(self.idle) - len(self.parked)

    # --- handing out servers -------------------------------------------------

    def acquire_nowait(self) -> ServerConnection | None:
        """An idle server, already counted as active; None if the client must wait."""
        if self.paused:
            return None
        idle = self.idle
        check_delay = self.check_delay
        while idle:
            # Most recently used first, its caches warm; or (server_round_robin)
            # the one idle longest, to spread load over the servers.
            server = idle.popleft() if self.round_robin else idle.pop()
            if server.state is IDLE:
                if check_delay and self.proxy.clock - server.last_used > check_delay:
                    self._check(server)  # idle a long time: make sure it still works
                    continue
                return server
        if self.parked:
            server = self._take_parked()
            if server is not None:
                if not self.full:
                    self._spawn()  # room to grow: the parked client will want one back
                return server
        return None

    def _check(self, server: ServerConnection) -> None:
        """server_check_query on a long-idle server; it rejoins the pool if it answers."""

        def done(ok: bool) -> None:
            if not ok:
                server.close("server_check_query failed")
                self._open_for_waiters()
                return
            server.last_used = self.proxy.clock
            self.release(server)

        server.run_internal(self.proxy.config.timeouts.server_check_query, done)

    # --- PAUSE / RESUME ---------------------------------------------------------------

    def pause(self) -> None:
        self.paused = True
        for client in list(self.parked):  # held between transactions: take them back
            del self.parked[client]
            client.parked = False
            server = client.detach_idle_server()
            if server is not None:
                self.release(server)

    def resume(self) -> None:
        self.paused = False
        waiters, idle = self.waiters, self.idle
        while waiters and idle:
            server = idle.popleft() if self.round_robin else idle.pop()
            if server.state is IDLE and not waiters.popleft().attach(server):
                idle.append(server)
        self._open_for_waiters()

    @property
    def busy(self) -> bool:
        """Servers are running something (linked to a client or in an internal query)."""
        return len(self.servers) > len(self.idle)

    def _take_parked(self) -> ServerConnection | None:
        """Take the server of the longest-parked client, if it is still between transactions."""
        parked = self.parked
        while parked:
            client = next(iter(parked))
            del parked[client]
            client.parked = False
            server = client.detach_idle_server()
            if server is not None:
                return server
        return None

    def wait(self, client: ClientConnection) -> None:
        """Queue ``client`` (FIFO) until a server is released or opened for it."""
        self.waiters.append(client)
        self._open_for_waiters()

    def cancel_wait(self, client: ClientConnection) -> None:
        try:
            self.waiters.remove(client)
        except ValueError:
            pass

    def release(self, server: ServerConnection) -> None:
        """Take a server back from a client (or from login/reset)."""
        if server.state is CLOSED:
            return
        if server.cancels_pending:
            server.release_after_cancel = True  # back once PostgreSQL processed the cancel
            return
        if not server.clean:
            server.close("released while not idle")
            return
        if server.retire or self.stale:
            reason = "config changed" if self.stale else server.retire_reason or "server_lifetime"
            server.close(connection_limits.EVICTED if server.evicted else reason)
            self._open_for_waiters()
            return
        waiters = self.waiters
        while waiters and not self.paused:
            if waiters.popleft().attach(server):
                return
        server.last_used = self.proxy.clock
        self.idle.append(server)

    def release_with_reset(self, server: ServerConnection, query: str) -> None:
        """Run the reset query (session pooling), then release."""

        def done(ok: bool) -> None:
            if not ok:
                server.close("server_reset_query failed")
                return
            lowered = query.lower()
            if "discard all" in lowered or "reset all" in lowered:
                server.applied = {}
            if "discard all" in lowered or "deallocate all" in lowered:
                server.statements.forget_all()
            self.release(server)

        server.run_internal(query, done)

    def _expired(self, server: ServerConnection, now: float) -> bool:
        lifetime = self.settings.server_lifetime
        if lifetime is None:
            lifetime = self.proxy.config.timeouts.server_lifetime
        return bool(lifetime) and now - server.created_at > lifetime

    # --- opening servers -----------------------------------------------------------

    def _open_for_waiters(self) -> None:
        if self.stale:
            # Its servers close as they come back, so one opened for a waiter
            # would never serve it: the waiters go where the new config says.
            self._hand_over_waiters()
            return
        reserve = self.settings.reserve_size
        if self.paused or (not reserve and self.full):
            return  # (a full pool with no reserve has nothing to open)
        servers, waiters = len(self.servers), self.waiters
        want = min(len(waiters), self.size - servers)
        overdue = 0
        if reserve and want < len(waiters):
            # PgBouncer's reserve_pool: a client queued longer than reserve_pool_timeout
            # may have one of ``reserve`` servers beyond ``size``.
            overdue = self._overdue_waiters()
            if overdue > want:
                want = min(overdue, self.size + reserve - servers)
                if want - self.connecting > 0:
                    event("taking connection from reserve_pool", logging.WARNING,
                          pool=self.name, waiting=len(waiters), servers=servers)  # fmt: skip
        for _ in range(max(0, want - self.connecting)):
            self._spawn()
        if reserve and want < len(waiters) and self._reserve_timer is None:
            self._arm_reserve_timer(overdue)

    def _hand_over_waiters(self) -> None:
        """A reload changed this pool's database (or removed it): each queued
        client waits at the pool the new config gives it instead, or fails."""
        waiters, self.waiters = self.waiters, deque()
        for client in waiters:
            successor = self.proxy.pool_after_reload(self, client.user)
            if successor is None:
                client.fail_waiting(
                    CONNECTION_FAILURE,
                    f'database "{self.target.name}" changed on reload and this login '
                    "cannot be carried over: reconnect",
                )
            else:
                client.pool = successor
                client.stats = successor.stats
                successor.wait(client)

    def _overdue_waiters(self) -> int:
        """How many waiters (the queue is FIFO: the first ones) passed reserve_pool_timeout."""
        timeout = self.proxy.config.timeouts.reserve_pool_timeout
        if not timeout:
            return 0
        deadline = perf_counter_ns() - int(timeout * 1e9)
        overdue = 0
        for waiter in self.waiters:
            if waiter.waiting_since > deadline:
                break
            overdue += 1
        return overdue

    def _arm_reserve_timer(self, overdue: int) -> None:
        """One timer per pool, only while clients wait: wake up when the first waiter
        not counted ``overdue`` reaches reserve_pool_timeout, if the reserve has room."""
        timeout = self.proxy.config.timeouts.reserve_pool_timeout
        if not timeout or self.paused:
            return
        if len(self.servers) + self.connecting >= self.size + self.settings.reserve_size:
            return  # nothing left to open: a release will serve them
        if overdue >= len(self.waiters):
            return
        due_ns = self.waiters[overdue].waiting_since + int(timeout * 1e9)
        delay = max(0.0, (due_ns - perf_counter_ns()) / 1e9)
        self._reserve_timer = asyncio.get_running_loop().call_later(delay, self._reserve_due)

    def _reserve_due(self) -> None:
        self._reserve_timer = None
        self._open_for_waiters()  # (re-arms for the next waiter if need be)

    def _spawn(self) -> None:
        if self.shares_a_limit:
            if not connection_limits.room_for_one_more(self, self.proxy.pools.values()):
                return  # woken by connection_limits.server_closed or retry_when_room
            self._limit_delay = 0.0
        self.connecting += 1
        asyncio.get_running_loop().create_task(self._connect_one())

    async def _connect_one(self) -> None:
        try:
            server = await self._open_server()
            if self.settings.connect_query:
                await server.run_connect_query(self.settings.connect_query)
        except Exception as exc:  # any failure to reach or log in
            self.connecting -= 1
            self._on_connect_failed(exc)
            return
        self.connecting -= 1
        self._connect_failures = 0
        self.last_error = None
        self.servers.add(server)
        self.servers_opened += 1
        connection_event(
            "server connected",
            server=server.id,
            pool=self.name,
            local=server.local_addr,
            backend_pid=server.backend_pid,
        )
        if self.welcome is None:
            self.welcome = dict(server.params)
        self._resolve_welcome(None)
        self.breaker.login_succeeded()  # the server is back: half-open before release
        self.release(server)

    async def _open_server(self) -> ServerConnection:
        """A server logged in to the first of the database's hosts, in
        load_balance_hosts order, that can be reached and whose session is
        what target_session_attrs asks for (scry.hosts). A host that answers
        and then fails the login ends the attempt, as in libpq."""
        target = self.target
        rotation = self.proxy.host_rotation(target)
        order = rotation.order()
        timeout = self.proxy.config.timeouts.server_connect_timeout
        down: set[tuple[str, int]] = set()
        unreachable: Exception | None = None
        for wanted in session_passes(target.target_session_attrs):
            for address in order:
                if address in down:
                    continue
                server = ServerConnection(self, address)
                try:
                    await server.connect(timeout)
                except (OSError, TimeoutError) as exc:
                    if server.transport is not None or len(order) == 1:
                        raise
                    down.add(address)
                    unreachable = exc
                    event("server host unreachable", logging.WARNING,
                          pool=self.name, host=address[0], port=address[1],
                          error=str(exc) or type(exc).__name__)  # fmt: skip
                    continue
                if not session_matches(wanted, server.params):
                    server.close(f"target_session_attrs={target.target_session_attrs}")
                    continue
                rotation.connected(address)
                return server
        if len(down) == len(order) and unreachable is not None:
            raise unreachable
        raise ServerLoginError({
            "C": CONNECTION_FAILURE,
            "M": f"no server of {target.host} has a session that target_session_attrs="
            f"{target.target_session_attrs} accepts",
        })  # fmt: skip

    def _on_connect_failed(self, exc: Exception) -> None:
        self.last_error = exc
        self._connect_failures += 1
        if self.shares_a_limit:
            connection_limits.server_closed(self, None, self.proxy.pools.values())
        self.breaker.record_failure(connect_error(exc)[1], gone=True)
        event(
            "server connection failed",
            logging.WARNING,
            pool=self.name,
            host=self.target.host,  # (each host of a list is logged as it fails)
            port=self.target.port,
            error=str(exc) or type(exc).__name__,
        )
        self._resolve_welcome(exc)
        if not self.servers and not self.connecting:
            # Nothing will come back to serve the waiters: tell them now.
            sqlstate, text = connect_error(exc)
            while self.waiters:
                self.waiters.popleft().fail_waiting(sqlstate, text)
        elif self.waiters and self._retry_handle is None:
            cap = self.proxy.config.timeouts.server_login_retry
            delay = max(0.1, min(cap, 0.1 * 2 ** min(self._connect_failures, 12)))
            self._retry_handle = asyncio.get_running_loop().call_later(delay, self._retry)

    def probe_login(self, now: float) -> None:
        """One server login to see whether PostgreSQL is back (the breaker is open).

        Every second for the first half minute of failures (a restart is over
        by then), then every ``server_login_retry`` (5 s), so a long outage logs
        a line per 5 s, not per second.
        """
        if now < self._next_probe_at or self.paused or self.connecting or self.full:
            return
        retry = self.proxy.config.timeouts.server_login_retry
        self._next_probe_at = now + (1.0 if self._connect_failures < 30 else max(1.0, retry))
        self._spawn()

    def _retry(self) -> None:
        self._retry_handle = None
        self._open_for_waiters()

    async def ensure_welcome(self) -> None:
        """Make sure the pool knows the server's ParameterStatus set (one login)."""
        if self.welcome is not None:
            return
        if self._welcome_future is None:
            self._welcome_future = asyncio.get_running_loop().create_future()
            if not self.full:
                self._spawn()
        await asyncio.shield(self._welcome_future)

    def _resolve_welcome(self, exc: Exception | None) -> None:
        fut = self._welcome_future
        if fut is None or fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
            fut.exception()  # mark retrieved; each waiter re-raises its own copy
        self._welcome_future = None

    def login_greeting(self, settings: dict[str, str]) -> bytes:
        """AuthenticationOk, the ParameterStatus set for a client with
        ``settings`` and the login_notify_message NOTICE, if any.

        Built once per distinct set of settings (most clients of a pool share
        one): a login then costs a dict lookup, not a dozen message builds.
        """
        notice = self.proxy.config.login_notify_message
        key = (notice, *settings.items())
        greeting = self._greetings.get(key)
        if greeting is None:
            status = dict(self.welcome or {})
            for name, value in settings.items():
                if name in status:
                    status[name] = value
            greeting = m.auth_ok() + b"".join(m.parameter_status(k, v) for k, v in status.items())
            if notice:
                greeting += m.notice_response(notice)
            if len(self._greetings) >= 256:
                self._greetings.clear()
            self._greetings[key] = greeting
        return greeting

    def mean_wait_since_last_call(self) -> float | None:
        """Mean queueing time (s) of the clients served since the previous call."""
        waits = self.waits - self._waits_seen
        if not waits:
            return None
        mean = (self.total_wait_us - self._wait_us_seen) / waits / 1e6
        self._waits_seen, self._wait_us_seen = self.waits, self.total_wait_us
        return mean

    def oldest_wait(self) -> float:
        """Seconds the longest-waiting client has been queued (0 if none)."""
        return (perf_counter_ns() - self.waiters[0].waiting_since) / 1e9 if self.waiters else 0.0

    def notify_waiters(self, after: float) -> None:
        """query_wait_notify, checked by the janitor: a NOTICE to each client whose
        wait passed ``after`` seconds, once per wait."""
        if not after or not self.waiters:
            return
        now = perf_counter_ns()
        deadline = now - int(after * 1e9)
        # FIFO, so waits are queued in the order they began: every wait that
        # began after the last one noticed is new, and the first too-recent one
        # ends the walk.
        for waiter in self.waiters:
            since = waiter.waiting_since
            if since > deadline:
                break
            if since > self._last_wait_noticed:
                self._last_wait_noticed = since
                waiter.wait_noticed((now - since) / 1e9)

    def use_settings(self, settings: PoolConfig) -> None:
        """New settings (a reload): ``Config.pool_settings`` of this pool."""
        self.settings = settings
        self.round_robin = settings.server_round_robin
        self.refused_settings.clear()  # (a reload is how a DBA says "try again")

    @property
    def query_wait_timeout(self) -> float:
        """This pool's (its database's or user's, else the global one)."""
        own = self.settings.query_wait_timeout
        return self.proxy.config.timeouts.query_wait_timeout if own is None else own

    def expire_waiters(self, timeout: float) -> None:
        """query_wait_timeout, checked by the janitor: the queue is FIFO, oldest first."""
        if not timeout or not self.waiters:
            return
        deadline = perf_counter_ns() - int(timeout * 1e9)
        waiters = self.waiters
        while waiters and waiters[0].waiting_since <= deadline:
            waiters.popleft().wait_timed_out()

    async def check_settings(
        self, settings: dict[str, str], ignorable: Collection[str] = ()
    ) -> dict[str, str]:
        """PostgreSQL's spelling of startup settings, learned once per value.

        A client that starts with ``DateStyle=iso,mdy`` must be told
        ``ISO, MDY``, as PostgreSQL itself would, and a name or value PostgreSQL
        refuses must fail its login, as it would without scry: otherwise the
        statement that applies the client's settings fails on every server it
        is linked to, and takes its valid settings down with it. Each unknown
        (setting, value) pair is SET once on a pool server and the
        ParameterStatus it reports is remembered. Raises ``ServerLoginError``
        with PostgreSQL's error for a refused setting, unless its name is in
        ``ignorable`` (PgBouncer's ignore_startup_parameters): then it is left
        out of the answer, and the client must drop it.
        """
        spellings, refused, asking = self.setting_spellings, self.refused_settings, self._asking
        while todo := {
            k: v for k, v in settings.items() if (k, v) not in spellings and (k, v) not in refused
        }:
            # An application's connections open together and say the same
            # thing: one login asks PostgreSQL, the others wait for its answer
            # (and ask themselves if it got none).
            others = {asking[pair] for pair in todo.items() if pair in asking}
            if others:
                await asyncio.wait(others)
                continue
            if len(spellings) + len(refused) + len(todo) > _MAX_KNOWN_SETTINGS:
                spellings.clear()  # (distinct values are the clients' to make up)
                refused.clear()
            answered = asyncio.get_running_loop().create_future()
            asking.update(dict.fromkeys(todo.items(), answered))
            try:
                server = await self.borrow()
                try:
                    await _try_settings(server, todo, spellings, refused)
                finally:
                    self.release(server)
            finally:
                for pair in todo.items():
                    del asking[pair]
                answered.set_result(None)
            break
        answer = {}
        for name, value in settings.items():
            fields = refused.get((name, value))
            if fields is None:  # (.get: another login may have forgotten it since)
                answer[name] = spellings.get((name, value), value)
            elif name not in ignorable:
                raise ServerLoginError(fields)
        return answer

    async def borrow(self) -> ServerConnection:
        """A server for scry's own use, waiting in line like a client would."""
        server = self.acquire_nowait()
        if server is not None:
            return server
        waiter = _Borrower(asyncio.get_running_loop().create_future())
        self.wait(waiter)  # type: ignore[arg-type]
        try:
            return await asyncio.wait_for(waiter.future, self.query_wait_timeout or None)
        except TimeoutError:
            self.cancel_wait(waiter)  # type: ignore[arg-type]
            raise

    # --- bookkeeping ------------------------------------------------------------------

    def on_server_closed(self, server: ServerConnection, was_up: bool) -> None:
        if not was_up:
            return
        self.servers.discard(server)
        try:
            self.idle.remove(server)
        except ValueError:
            pass
        self.servers_closed += 1
        disconnection_event(
            "server closed", server=server.id, pool=self.name, reason=server.close_reason
        )
        if self.shares_a_limit:  # (first: a peer that claimed it gets the room)
            connection_limits.server_closed(self, server, self.proxy.pools.values())
        if self.waiters:
            self._open_for_waiters()

    @property
    def shares_a_limit(self) -> bool:
        """max_db_connections or max_user_connections applies (scry.connection_limits)."""
        return connection_limits.limited(self)

    def backend_exited(self) -> None:
        """The backend of a server this pool closed is gone: a limit has room."""
        self.exiting -= 1
        connection_limits.server_closed(self, None, self.proxy.pools.values())

    @property
    def starved(self) -> bool:
        """Clients wait for a server: queued, or logging in to a pool with none yet."""
        return bool(self.waiters) or self._welcome_future is not None

    def room_made(self) -> None:
        """A connection limit this pool shares has room again (scry.connection_limits)."""
        self.limit_blocked = False
        if self._welcome_future is not None and not self.connecting:
            self._spawn()  # a login waits for the pool's first server
        self._open_for_waiters()

    def retry_when_room(self) -> None:
        """Blocked by a connection limit: look again soon, as peer servers may go idle
        (10 ms, doubling to 100 ms while it stays blocked)."""
        if self._limit_timer is None:
            self._limit_delay = min(0.1, self._limit_delay * 2 or 0.01)
            self._limit_timer = asyncio.get_running_loop().call_later(
                self._limit_delay, self._limit_retry
            )

    def _limit_retry(self) -> None:
        self._limit_timer = None
        if self.limit_blocked:
            self.room_made()

    def close_parked_server(self, reason: str) -> bool:
        """Close the server of the longest-parked client; False if none is parked."""
        server = self._take_parked()
        if server is None:
            return False
        server.close(reason)
        return True

    def maintain(self, now: float) -> None:
        """Janitor pass: retire old or long-idle servers, keep ``min_size`` open."""
        timeouts = self.proxy.config.timeouts
        keep = self.settings.min_size
        for client in list(self.parked):
            server = client.server
            if server is not None and (server.retire or self._expired(server, now) or self.stale):
                del self.parked[client]
                client.parked = False
                if client.detach_idle_server() is server:
                    server.close("server_lifetime" if not self.stale else "config changed")
        for server in list(self.servers):
            if self._expired(server, now) and server not in self.idle:
                server.retire = True  # closed when its client gives it back
        for server in list(self.idle):
            if self._expired(server, now):
                server.close("server_lifetime")
            elif (
                timeouts.server_idle_timeout
                and now - server.last_used > timeouts.server_idle_timeout
                and len(self.servers) > keep
            ):
                server.close("server_idle_timeout")
        missing = keep - len(self.servers) - self.connecting
        if (
            missing > 0
            and not self.stale  # (they would close at once; the pool replacing it keeps it)
            and self._retry_handle is None
            and not self.proxy.draining
            and not self.paused
            and not self._awaiting_scram_key()
        ):
            for _ in range(missing):
                self._spawn()

    def _awaiting_scram_key(self) -> bool:
        """Only a SCRAM secret is known and no client has yet proved its key
        (SCRAM pass-through): a login now could only fail, so min_size waits."""
        password = self.server_password
        return (
            password is not None
            and secret_kind(password) == "scram"
            and self.proxy.scram_key(self.server_user, password) is None
        )

    def close_sessions_fast(self) -> None:
        """server_fast_close, after RECONNECT or a reload that changed the
        database: the servers sessions hold (session mode, pinned hybrid
        clients) leave them once no transaction is open: now if none is, else
        at the end of the current one (ClientConnection.server_must_go).
        Transaction-pooled clients give theirs back at that point anyway."""
        for server in list(self.servers):
            client = server.client
            if client is None or client.parked or not client.keeps_its_server:
                continue
            server.close_needed = True
            client.server_must_go(server)

    def close_all(self, reason: str) -> None:
        for server in list(self.servers):
            server.close(reason)
        for handle in (self._retry_handle, self._reserve_timer, self._limit_timer):
            if handle is not None:
                handle.cancel()
        self._retry_handle = self._reserve_timer = self._limit_timer = None


class _Borrower:
    """Stands in the waiters queue for scry itself (see ``Pool.borrow``)."""

    def __init__(self, future: asyncio.Future[ServerConnection]) -> None:
        self.future = future
        self.waiting_since = perf_counter_ns()

    def attach(self, server: ServerConnection) -> bool:
        if self.future.done():
            return False
        self.future.set_result(server)
        return True

    def wait_timed_out(self) -> None:
        if not self.future.done():
            self.future.set_exception(TimeoutError("query_wait_timeout"))

    def wait_noticed(self, waited: float) -> None:
        pass  # scry's own wait: nobody to tell

    def fail_waiting(self, sqlstate: str, text: str) -> None:
        if not self.future.done():
            self.future.set_exception(ServerLoginError({"C": sqlstate, "M": text}))


async def _try_settings(
    server: ServerConnection,
    todo: dict[str, str],
    spellings: dict[tuple[str, str], str],
    refused: dict[tuple[str, str], dict[str, str]],
) -> None:
    """SET each of ``todo`` on ``server`` by itself, so that one refused setting
    does not hide whether the others are accepted: PostgreSQL's spelling of
    each accepted one goes in ``spellings``, its error for each refused one in
    ``refused``. Raises ``ServerLoginError`` if the server fails to answer."""
    loop = asyncio.get_running_loop()
    applied = dict(server.applied)  # (what its last client left on it stays)
    try:
        for name, value in todo.items():
            done: asyncio.Future[bool] = loop.create_future()
            server.run_internal(settings_sql({}, {name: value}), done.set_result, resync=False)
            if await done:
                spelled = spellings[(name, value)] = server.params.get(name, value)
                spellings[(name, spelled)] = spelled  # (a respelled client's, next time)
                applied[name] = value
            elif server.internal_error_fields is not None:
                refused[(name, value)] = server.internal_error_fields
            else:
                raise ServerLoginError(
                    {"M": "could not check the startup settings: the server did not answer"}
                )
    finally:
        server.applied = applied


def connect_error(exc: Exception) -> tuple[str, str]:
    """The SQLSTATE and message a client gets when its server could not be opened."""
    if isinstance(exc, ServerLoginError):
        return exc.sqlstate, f"server login failed: {exc}"
    if isinstance(exc, asyncio.TimeoutError):
        return CONNECTION_FAILURE, "server_connect_timeout: could not connect to the server in time"
    return CONNECTION_FAILURE, f"could not connect to the server: {exc or type(exc).__name__}"
