"""The proxy: listeners, pools, clients, cancel keys, signals, reload, drain.

``Proxy`` owns everything for one event loop. ``run_proxy`` is what
``scry serve`` calls: it installs uvloop, starts the proxy, wires the signals
(SIGHUP reload; SIGINT/SIGTERM drain, a second one stops at once) and returns
an exit code.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from scry import __version__, systemd
from scry.accept import ClientListener, bind_client_listeners
from scry.auth import AuthPolicy
from scry.breaker import CLOSED, OPEN, CircuitBreaker, Transition, classify_sqlstate
from scry.config import Config, ConfigError, DatabaseTarget, load_config
from scry.dns import DnsCache
from scry.health import HealthMonitor, Signal
from scry.hosts import HostRotation
from scry.hybrid import TransactionTracker, unfollowed
from scry.log import event, log_connection_events, logger, setup_logging, use_syslog
from scry.observe.pipeline import Observatory
from scry.observe.record import ClientContext
from scry.peering import KEY_MASK, Peering, cancel_pid_base, new_cancel_key
from scry.pool import Pool
from scry.protocol.classify import Effect
from scry.relay_core import LoginPlan
from scry.stats_log import StatsLog
from scry.tcp_options import set_tcp_options
from scry.tls import client_tls, server_tls
from scry.workers import WorkerIdentity

if TYPE_CHECKING:
    from scry.adminapi import AdminServer
    from scry.client import ClientConnection

JANITOR_INTERVAL = 1.0
_TX_IDLE = ord("I")


class Proxy:
    """One scry instance on one event loop."""

    def __init__(
        self, config: Config, config_path: str | None = None, identity: WorkerIdentity | None = None
    ) -> None:
        # Workers (scry.workers): this process's share of the fleet budgets.
        self.identity = identity or WorkerIdentity(instance=os.getpid())
        self.worker_id = self.identity.worker_id
        config = self.identity.share_of(config)
        self.config = config
        self.config_path = config_path
        self.targets: dict[str, DatabaseTarget] = config.targets()
        self.auth = AuthPolicy.from_config(config)
        self.client_tls = client_tls(config.tls)
        self.server_tls = server_tls(config.tls)
        self.pools: dict[tuple[str, str], Pool] = {}
        # StartupMessage bytes -> what logging it in worked out (ClientLogin._plan_login);
        # a reload forgets them all.
        self.login_plans: dict[bytes, LoginPlan] = {}
        # user -> (SCRAM secret, the ClientKey a client proved against it): what
        # logs servers in as that user when only the secret is known (SCRAM
        # pass-through, scry.protocol.auth). One per user; never logged.
        self.scram_keys: dict[str, tuple[str, bytes]] = {}
        self.clients: set[ClientConnection] = set()
        self.cancel_keys: dict[tuple[int, int], ClientConnection] = {}
        self.listeners: list[ClientListener | asyncio.Server] = []
        # Set when a rolling restart took them (scry.peering): the new instance
        # owns the sockets, and the Unix socket's file, from then on.
        self.listeners_handed_over = False
        self.started_at = time.time()
        self.draining = False
        self.clock = time.monotonic()  # coarse clock, updated by the janitor
        self.observatory = Observatory(config.observability)
        self.user_timeouts = config.user_timeouts()  # ([users] lines that set timeouts)
        self.observatory.log_queries = config.log.log_queries
        self.breakers: dict[str, CircuitBreaker] = {}
        self.host_rotations: dict[str, HostRotation] = {}  # (scry.hosts: one per database)
        self.dns = DnsCache()  # server host names' addresses (dns_max_ttl)
        self.health: dict[str, HealthMonitor] = {}
        self.observatory.query_batch_listeners.append(self._feed_health)
        self.observatory.session_state_listeners.append(self._session_state_seen)
        self._stopped = asyncio.Event()
        self._janitor: asyncio.Task[None] | None = None
        self.admin: AdminServer | None = None  # the admin HTTP API (scry.adminapi)
        self.peering = Peering(self)  # cancel forwarding, shared breakers (scry.peering)
        # The owner bits of this worker's cancel keys (the compiled relay's
        # logins read them here; peer_id can change on reload).
        self.cancel_pid_base = cancel_pid_base(self.peering.peer_id, self.worker_id)
        self._wait_for_clients = False
        # PAUSE: the databases paused (None: all), so that a pool made
        # after the PAUSE (a database's first login) is held too.
        self._paused_databases: set[str | None] = set()
        self._stats_log = StatsLog(time.monotonic())  # log.stats_period's lines

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        from scry.client import ClientConnection

        host, port = self.config.listen_host_port
        loop = asyncio.get_running_loop()
        log_connection_events(self.config.log.connections, self.config.log.disconnections)
        # SO_REUSEPORT: workers share the port, and a rolling restart can bind it
        # while the old instance drains (scry.peering checks nobody else serves it).
        inherited = self.peering.take_over_listeners()
        if self.peering.replaced_state is not None:  # (before a handed-over socket is served)
            from scry.adminapi.rejoin import take_replaced_state

            await take_replaced_state(self)
        # (PgBouncer's Unix socket is handed over too: see start_unix_listener.)
        inherited_unix = [sock for sock in inherited if sock.family == socket.AF_UNIX]
        inherited = [sock for sock in inherited if sock.family != socket.AF_UNIX]
        # (A partial, not a lambda: no Python frame per accepted connection.)
        new_client = functools.partial(ClientConnection, self)
        # scry accepts its clients itself and answers a StartupMessage in the
        # accept callback, before uvloop has a transport for it (scry.accept).
        if inherited:
            server = ClientListener(inherited[:1], new_client)
            for sock in inherited[1:]:  # an old instance with several workers
                self.listeners.append(ClientListener([sock], new_client))
        else:
            socks = bind_client_listeners(
                host,
                port,
                backlog=self.config.listen_backlog,
                reuse_port=hasattr(socket, "SO_REUSEPORT"),
            )
            server = ClientListener(socks, new_client)
        self.listeners.insert(0, server)
        self._tune_listeners()
        for listener in self.listeners:
            await listener.start_serving()
        compat = self.config.pgbouncer
        # (A Unix socket has no SO_REUSEPORT sharing: worker 0 alone serves it.)
        if compat is not None and compat.unix_socket_dir and self.worker_id == 0:
            from scry.pgbouncer.console import start_unix_listener  # PgBouncer's .s.PGSQL.<port>

            self.listeners.append(await start_unix_listener(self, inherited_unix))
        elif inherited_unix:
            from scry.pgbouncer.console import drop_unix_sockets  # no longer configured

            drop_unix_sockets(inherited_unix)
        await self.peering.start()
        if self.config.admin.enabled:
            from scry.adminapi import AdminServer

            admin = AdminServer(self)
            try:
                await admin.start()
            except BaseException:
                server.close()  # nothing starts half-configured
                raise
            self.admin = admin
        self._janitor = loop.create_task(self._janitor_loop())
        await self.observatory.start()
        event("listening", addr=self.config.listen_addr, version=__version__,
              mode=self.config.pool.mode, pid=os.getpid())  # fmt: skip

    @property
    def listen_port(self) -> int:
        port: int = self.listeners[0].sockets[0].getsockname()[1]
        return port

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def begin_drain(self, wait_for_clients: bool = False) -> None:
        """Stop accepting; finish running transactions; then stop.

        ``wait_for_clients`` (a rolling restart; PgBouncer's SHUTDOWN
        WAIT_FOR_CLIENTS): keep serving connected clients until they leave.
        A later plain drain (SIGTERM) stops waiting for them.
        """
        if self.draining or (self._wait_for_clients and wait_for_clients):
            return
        if self._wait_for_clients:  # escalate; the _drain task is already running
            self._wait_for_clients = False
            self.draining = True
            return
        # While waiting for clients, clients still log in and start transactions.
        self.draining = not wait_for_clients
        self._wait_for_clients = wait_for_clients
        self.peering.mark_draining()
        event("shutting down: waiting for " + ("clients to leave" if wait_for_clients else
              "active transactions"), clients=len(self.clients))  # fmt: skip
        for listener in self.listeners:
            listener.close()
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = self.config.timeouts.shutdown_timeout
        started = time.monotonic()
        while True:
            # Clients without a server hold nothing: let them go now.
            if self._wait_for_clients:
                started = time.monotonic()  # shutdown_timeout counts from a plain drain
            for client in list(self.clients):
                if self._wait_for_clients:
                    break
                # Between transactions (no server, parked, or pinned but idle): go now.
                if client.between_transactions():
                    client.fatal("57P01", "scry is shutting down")
            if not self.clients:
                break
            if deadline and time.monotonic() - started > deadline:
                event("shutdown_timeout reached", logging.WARNING, clients=len(self.clients))
                break
            await asyncio.sleep(0.05)
        self.stop_now()

    def stop_now(self) -> None:
        """Close everything immediately."""
        self.draining = True
        for listener in self.listeners:
            listener.close()
        for client in list(self.clients):
            client.fatal("57P01", "terminating connection due to administrator command")
        for pool in self.pools.values():
            pool.close_all("shutdown")
        if self._janitor is not None:
            self._janitor.cancel()
        self.peering.close()
        self._stopped.set()

    def reload(self) -> None:
        """Re-read the config file; apply what can change without dropping connections."""
        if self.config_path is None:
            event("reload skipped: no config file", logging.WARNING)
            return
        try:
            self.apply_config(load_config(self.config_path))
        except ConfigError as exc:
            event("reload failed; keeping the running config", logging.ERROR, error=str(exc))

    def _tune_listeners(self) -> None:
        """The backlog and TCP options of every client listener (at start, and
        again on reload)."""
        for server in self.listeners:
            for sock in server.sockets:
                # listen() again sets the backlog of a listening socket (uvloop's
                # socket objects offer no listen(): on a duplicate of it).
                with socket.socket(fileno=os.dup(sock.fileno())) as same:
                    same.listen(self.config.listen_backlog)
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue  # PgBouncer's Unix socket
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                set_tcp_options(sock, self.config, fresh=False)  # accepted sockets inherit them
                if hasattr(socket, "TCP_DEFER_ACCEPT"):  # Linux
                    # Accepted with its StartupMessage already queued, or after 1 s
                    # without (PgBouncer's value): a silent client is still let in.
                    defer = int(self.config.tcp_defer_accept)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, defer)

    def apply_config(self, config: Config) -> None:
        """Apply a new configuration without dropping connections (the apply half of
        a reload; PgBouncer-ini reloads come here too). Raises ConfigError, having
        changed nothing, if it cannot be applied (an unreadable auth_file...)."""
        new = self.identity.share_of(config)
        auth = AuthPolicy.from_config(new)
        tls_in, tls_out = client_tls(new.tls), server_tls(new.tls)
        if new.listen_addr != self.config.listen_addr:
            event("listen_addr changed; takes effect on restart", logging.WARNING)
        if (new.admin.listen_addr, new.admin.enabled) != (
            self.config.admin.listen_addr,
            self.config.admin.enabled,
        ):
            # (The token and read_only apply at once: the API reads them per request.)
            event("admin.listen_addr or admin.enabled changed; takes effect on restart",
                  logging.WARNING)  # fmt: skip
        old_log, self.config = self.config.log, new
        if new.log.level != old_log.level:
            logger.setLevel(new.log.level.upper())
        if (syslog := new.log.syslog_target()) != old_log.syslog_target():
            use_syslog(syslog)
        self.cancel_pid_base = cancel_pid_base(self.peering.peer_id, self.worker_id)
        self._tune_listeners()
        self.auth = auth
        self.login_plans.clear()
        self.client_tls, self.server_tls = tls_in, tls_out
        self.targets = new.targets()
        self.user_timeouts = new.user_timeouts()
        self.observatory.log_queries = new.log.log_queries
        log_connection_events(new.log.connections, new.log.disconnections)
        for (name, _user), pool in self.pools.items():
            target = self.targets.get(name)
            if target is None or _connection_changed(pool.target, target):
                pool.stale = True
                for server in list(pool.idle):
                    server.close("config changed")
                if (target or pool.target).pool.server_fast_close:  # (the new config's say)
                    pool.close_sessions_fast()
            else:
                pool.target = target
                pool.use_settings(new.pool_settings(target, pool.server_user))
                pool.check_delay = new.timeouts.server_check_delay
        event("config reloaded", path=self.config_path or "", databases=len(self.targets))

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(JANITOR_INTERVAL)
            now = self.clock = time.monotonic()
            timeouts = self.config.timeouts
            for pool in list(self.pools.values()):
                pool.notify_waiters(timeouts.query_wait_notify)
                pool.expire_waiters(pool.query_wait_timeout)
                pool.maintain(now)
            self._check_health()
            self._enforce_timeouts(now)
            self._reclaim_idle_pins(now)
            self._stats_log.tick(now, self.config.log.stats_period, self.pools.values())
            if timeouts.pool_idle_timeout:
                self._free_idle_pools(now, timeouts.pool_idle_timeout)
            if self.config.pgbouncer is not None:
                from scry.pgbouncer.state import free_idle_autodbs

                free_idle_autodbs(self, now)

    def _free_idle_pools(self, now: float, timeout: float) -> None:
        """pool_idle_timeout: forget a pool that has had no client and no
        server (nor one logging in, nor a waiter) for that long, so that pools
        of users seen once (auth_query) do not pile up."""
        in_use = {client.pool for client in self.clients}
        for key, pool in list(self.pools.items()):
            if pool in in_use or pool.servers or pool.connecting or pool.waiters:
                pool.unused_since = None
            elif pool.unused_since is None:
                pool.unused_since = now
            elif now - pool.unused_since >= timeout:
                self.free_pool(key, "pool_idle_timeout")
                event("pool freed", pool=pool.name, idle=round(now - pool.unused_since))

    def free_pool(self, key: tuple[str, str], reason: str) -> None:
        """Forget the pool at ``key`` (pool_idle_timeout, autodb_idle_timeout):
        its servers close, and the next login makes a new one."""
        pool = self.pools.pop(key)
        pool.stale = True  # (a login plan that still names it goes the long way)
        pool.close_all(reason)

    # --- breakers and health ----------------------------------------------------------

    def breaker_for(self, database: str) -> CircuitBreaker:
        """The circuit breaker of a database (one per worker, created on first use)."""
        breaker = self.breakers.get(database)
        if breaker is None:
            breaker = CircuitBreaker(self.config.circuit_breaker, name=database)
            breaker.on_transition = self._on_breaker_transition
            self.breakers[database] = breaker
        return breaker

    def host_rotation(self, target: DatabaseTarget) -> HostRotation:
        """Where a database's next server connection starts (scry.hosts); made anew
        when a reload changed its host list or load_balance_hosts."""
        rotation = self.host_rotations.get(target.name)
        if (
            rotation is None
            or rotation.hosts != target.hosts
            or rotation.mode != target.load_balance_hosts
        ):
            rotation = HostRotation(target.hosts, target.load_balance_hosts)
            self.host_rotations[target.name] = rotation
        return rotation

    def health_for(self, database: str) -> HealthMonitor:
        monitor = self.health.get(database)
        if monitor is None:
            shared = self.identity.workers > 1  # (see _share_health)
            monitor = HealthMonitor(self.config.health, name=database, shared=shared)
            self.health[database] = monitor
        return monitor

    def _on_breaker_transition(self, breaker: CircuitBreaker, transition: Transition) -> None:
        level = logging.WARNING if transition.to_state != "closed" else logging.INFO
        event("circuit breaker " + str(transition.to_state), level, database=breaker.name,
              previous=str(transition.from_state), reason=transition.reason)  # fmt: skip
        metrics = self.observatory.metrics
        code = {"closed": 0, "half_open": 1, "open": 2}.get(str(transition.to_state), 2)
        metrics.breaker_state.labels(database=breaker.name).set(code)
        self.peering.breaker_changed(breaker, transition)  # one worker's view protects all
        metrics.breaker_transitions_total.labels(
            database=breaker.name,
            from_state=str(transition.from_state),
            to_state=str(transition.to_state),
        ).inc()

    def _session_state_seen(
        self, effects: tuple[Effect, ...], contexts: list[ClientContext]
    ) -> None:
        # From the drain: these clients ran statements with session effects. A
        # transaction-mode client is warned about once (TransactionTracker).
        reasons = sorted({e.reason for e in unfollowed(effects) if e.op == "pin"})
        if not reasons:
            return
        ids = {context.client_id for context in contexts}
        for client in self.clients:
            if client.id in ids and isinstance(client.tracker, TransactionTracker):
                client.tracker.warn(reasons)

    def _feed_health(
        self, database: str, latencies_ns: Sequence[int], sqlstates: Sequence[str | None]
    ) -> None:
        # Called from the observatory's drain, off the query path, with a
        # group of one database's statements.
        monitor = self.health.get(database)
        if monitor is None:
            return
        if sqlstates.count(None) != len(sqlstates):
            healthy = [
                latency
                for latency, sqlstate in zip(latencies_ns, sqlstates, strict=True)
                if sqlstate is None or not classify_sqlstate(sqlstate)
            ]
            errors, latencies_ns = len(latencies_ns) - len(healthy), healthy
        else:
            errors = 0
        # The janitor's clock is good to the second, which is all the monitor buckets by.
        monitor.observe_latencies(latencies_ns, errors, self.clock)

    def _reclaim_idle_pins(self, now: float) -> None:
        """Hybrid: pinned clients idle past ``pool.idle_unpin_seconds`` give their
        server back when their state can be replayed."""
        for client in list(self.clients):
            tracker = client.tracker
            if tracker is None or client.server is None or not tracker.pinned:
                continue
            pool = client.pool
            limit = pool.settings.idle_unpin_seconds if pool is not None else 0
            if limit and now - client.last_active >= limit:
                client.reclaim_pinned_server("idle_unpin_seconds")

    def _enforce_timeouts(self, now: float) -> None:
        """PgBouncer's client-side timeouts, checked once a janitor pass (about 1 s)."""
        timeouts = self.config.timeouts
        per_user = self.user_timeouts
        if not (
            timeouts.client_login_timeout
            or timeouts.query_timeout
            or timeouts.idle_transaction_timeout
            or timeouts.transaction_timeout
            or timeouts.client_idle_timeout
            or per_user
        ):
            return
        for client in list(self.clients):
            t = per_user.get(client.user, timeouts) if per_user else timeouts
            if client.state != "ready":
                if (
                    t.client_login_timeout
                    and now - client.connected_clock >= t.client_login_timeout
                ):
                    client.login_timed_out()
                continue
            server = client.server
            if per_user and server is not None:
                # As PgBouncer: what a server runs is timed by the [users]
                # line of its pool's user (a database's forced user, if it
                # has one); client_idle_timeout by the client's login user.
                t_login, t = t, per_user.get(server.pool.server_user, timeouts)
            else:
                t_login = t
            if (
                t.transaction_timeout
                and server is not None
                and (server.pending > 0 or server.tx_status != _TX_IDLE)
                # xact_mark: when its first statement was sent (the relay's
                # SHOW STATS bookkeeping), once that statement has answered.
                and now - (server.xact_mark or server.busy_since) >= t.transaction_timeout
            ):
                client.transaction_timed_out(t.transaction_timeout)
                continue
            if server is not None and server.pending > 0:
                if t.query_timeout and now - server.busy_since >= t.query_timeout:
                    client.query_timed_out(t.query_timeout)
                continue
            if server is not None and server.tx_status != _TX_IDLE:
                if (
                    t.idle_transaction_timeout
                    and now - server.ready_at >= t.idle_transaction_timeout
                ):
                    client.fatal(
                        "25P03",
                        "idle transaction timeout",
                        detail=f"idle in transaction for over {t.idle_transaction_timeout:g} s "
                        "(timeouts.idle_transaction_timeout)",
                    )
                continue
            idle_limit = t_login.client_idle_timeout
            if idle_limit and now - client.last_active >= idle_limit:
                client.fatal(
                    "57P05",
                    "client_idle_timeout",
                    detail=f"no activity for over {idle_limit:g} s",
                )

    # --- PAUSE / RESUME -----------------------------------------------------------------

    def hold(self, database: str | None = None) -> list[Pool]:
        """PAUSE's first step (and KILL's): no server for new transactions of
        ``database`` (None: every one), in its pools made later too; returns
        the pools held now."""
        self._paused_databases.add(database)
        pools = [p for p in self.pools.values() if database in (None, p.target.name)]
        for pool in pools:
            pool.pause()
        return pools

    async def pause(self, database: str | None = None, timeout: float | None = None) -> bool:
        """PgBouncer's PAUSE: hold new transactions, let running ones finish,
        then close the servers. Returns False if ``timeout`` passed first."""
        pools = self.hold(database)
        event("paused: waiting for servers to finish", database=database or "*")
        started = time.monotonic()
        while any(pool.busy for pool in pools):
            if timeout is not None and time.monotonic() - started > timeout:
                return False
            await asyncio.sleep(0.05)
        for pool in pools:
            for server in list(pool.idle):
                server.close("pause")
        event("paused", database=database or "*")
        return True

    def resume(self, database: str | None = None) -> None:
        """PgBouncer's RESUME: hand servers to the queued clients again."""
        if database is None:
            self._paused_databases.clear()
        else:
            self._paused_databases.discard(database)
        for pool in self.pools.values():
            if database in (None, pool.target.name):
                pool.resume()
        event("resumed", database=database or "*")

    @property
    def paused(self) -> bool:
        """A PAUSE holds some database (its pools are made paused when they come)."""
        return bool(self._paused_databases) or any(pool.paused for pool in self.pools.values())

    @property
    def paused_databases(self) -> set[str | None]:
        """What PAUSE (or KILL) holds until RESUME: database names, None for every one."""
        return set(self._paused_databases)

    def _check_health(self) -> None:
        if self.identity.workers > 1:
            self._share_health()
        for pool in self.pools.values():
            waiting = len(pool.waiters)
            saturation = pool.active_count / pool.size
            mean_wait = pool.mean_wait_since_last_call()
            if mean_wait is not None:
                pool.health.observe_pool(mean_wait, saturation, waiting)
            pool.health.observe_pool_state(saturation, waiting, pool.oldest_wait())
        for name, breaker in self.breakers.items():
            breaker.tick()
            if breaker.state is OPEN and breaker.opened_on_gone and not breaker.held:
                self._probe_login(name, self.clock)
            monitor = self.health.get(name)
            if monitor is None:
                continue
            before = monitor.signals
            signals = monitor.evaluate()
            if signals or before:
                self._report_anomalies(name, before, signals)
            if breaker.state is CLOSED and (reason := monitor.should_open()):
                breaker.trip(reason, hold=False)

    def _share_health(self) -> None:
        """Hand the other workers what this one's monitors saw in the seconds
        just completed: each then judges the instance's traffic."""
        before = int(self.clock)
        seen = {
            name: seconds
            for name, monitor in self.health.items()
            if (seconds := monitor.take_unshared(before))
        }
        if seen:
            self.peering.share_health(seen)

    def _probe_login(self, database: str, now: float) -> None:
        """A breaker opened because PostgreSQL was gone: try a login now and then
        (Pool.probe_login), so it goes half-open when the server is back, not
        after its timeout."""
        for pool in self.pools.values():
            if pool.target.name == database:
                pool.probe_login(now)
                return

    def _report_anomalies(self, database: str, before: list[Signal], now: list[Signal]) -> None:
        """A line when a health signal appears (counted for Prometheus), one when it clears."""
        had = {anomaly.name for anomaly in before}
        for anomaly in now:
            if anomaly.name not in had:
                event("health anomaly", logging.WARNING, database=database, kind=anomaly.name,
                      severity=anomaly.severity, message=anomaly.message)  # fmt: skip
                self.observatory.metrics.health_anomalies_total.labels(
                    database=database, kind=anomaly.name
                ).inc()
        for kind in had - {anomaly.name for anomaly in now}:
            event("health anomaly cleared", database=database, kind=kind)

    # --- pools and clients ----------------------------------------------------------

    def pool_for(self, target: DatabaseTarget, user: str, password: str | None) -> Pool:
        key = (target.name, user)
        pool = self.pools.get(key)
        if pool is None or pool.stale:
            pool = Pool(self, target, user, password)
            self.pools[key] = pool
            if self._paused_databases and (
                None in self._paused_databases or target.name in self._paused_databases
            ):
                pool.pause()  # (PAUSE came before this database's first login)
        return pool

    def pool_after_reload(self, stale: Pool, client_user: str) -> Pool | None:
        """Where a client of ``stale`` (a pool whose database a reload changed)
        gets its servers now; None if the database is gone, or if the client's
        own password would be needed and was never kept (it logged in to a
        forced user's pool)."""
        target = self.targets.get(stale.target.name)
        if target is None or (not target.user and stale.target.user):
            return None
        # (Not forced before: the pool's password is this client's own secret.)
        looked_up = None if stale.target.user else stale.server_password
        return self.pool_for(target, *self.auth.server_credentials(target, client_user, looked_up))

    def scram_key(self, user: str, secret: str | None) -> bytes | None:
        """The ClientKey a client proved for ``user``'s SCRAM ``secret``, if any."""
        known = self.scram_keys.get(user)
        return known[1] if known is not None and known[0] == secret else None

    @property
    def client_count(self) -> int:
        return len(self.clients)

    # The compiled ClientCore does these two and register_cancel_key inline
    # (connection_made, _leave_fast, _login_done): a change here goes there too.

    def on_client_connected(self, client: ClientConnection) -> None:
        self.clients.add(client)

    def on_client_closed(self, client: ClientConnection) -> None:
        self.clients.discard(client)
        if client.cancel_key is not None:
            self.cancel_keys.pop(client.cancel_key, None)

    def register_cancel_key(self, client: ClientConnection) -> tuple[int, int]:
        """A fresh BackendKeyData for ``client``: scry's own, never a backend's."""
        while True:
            # The pid names this peer and worker (scry.peering) so any worker can route it.
            key = new_cancel_key(self.peering.peer_id, self.worker_id)
            if key not in self.cancel_keys:
                break
        self.cancel_keys[key] = client
        client.cancel_key = key
        return key

    def handle_cancel(self, pid: int, secret: int) -> asyncio.Future[Any] | None:
        """A CancelRequest: to the server running that client's query, or to
        the worker or peer whose key it is. Returns what completes once
        PostgreSQL has acted on it (None: nothing was forwarded). The
        requester's connection stays open until then, as PostgreSQL keeps
        it: libpq waits for that close, so that a cancel still on its way
        cannot hit the client's next query instead."""
        client = self.cancel_keys.get((pid & KEY_MASK, secret))
        if client is not None:
            return client.cancel_current_query()
        # Another worker's or peer's key (forwarded at most one hop each).
        return self.peering.forward_cancel(pid, secret)


def _connection_changed(old: DatabaseTarget, new: DatabaseTarget) -> bool:
    """Whether a reload changed where or how a database's servers log in."""

    def login(t: DatabaseTarget) -> tuple[object, ...]:
        return (t.hosts, t.target_session_attrs, t.dbname, t.user, t.password, t.params)

    return login(old) != login(new)


def freeze_startup_heap() -> None:
    """Leave what a started proxy has made out of the cyclic GC from now on.

    Modules, config, pools: ~80,000 objects that live as long as the process.
    Unfrozen, the GC's full passes walked them all every few seconds under
    ``pgbench -C`` (30-45 ms of CPU each, every client stalled meanwhile).
    Frozen objects are still freed by reference counting; call this in a
    proxy process once it listens, not in a process that runs tests.
    """
    gc.collect()
    gc.freeze()


async def serve(
    config: Config, config_path: str | None = None, identity: WorkerIdentity | None = None
) -> int:
    """Run a proxy until it is stopped by a signal."""
    proxy = Proxy(config, config_path, identity)
    loop = asyncio.get_running_loop()
    pausing: set[asyncio.Task[bool]] = set()

    def pause() -> None:  # PgBouncer's SIGUSR1 (SIGUSR2 resumes)
        event("signal received: pausing", signal="SIGUSR1")
        task = loop.create_task(proxy.pause())
        pausing.add(task)
        task.add_done_callback(pausing.discard)

    # Before the listener opens: a SIGHUP (or SIGUSR1/2) sent as soon as the
    # port answers must be handled, not kill the process (the default action).
    loop.add_signal_handler(signal.SIGHUP, systemd.reload, proxy.reload)
    loop.add_signal_handler(signal.SIGUSR1, pause)
    loop.add_signal_handler(signal.SIGUSR2, proxy.resume)
    if proxy.identity.restarted:  # paused, breakers held as the other workers have them
        from scry.adminapi.rejoin import rejoin

        await rejoin(proxy)
    try:
        await proxy.start()
    except OSError as exc:
        event("cannot listen", logging.ERROR, addr=config.listen_addr, error=str(exc))
        return 1
    freeze_startup_heap()
    # (A worker's NOTIFY_SOCKET is its supervisor's, which speaks for all its workers.)
    systemd.notify("READY=1", f"STATUS=listening on {config.listen_addr}")
    signals = {"count": 0}

    def on_stop_signal(signame: str) -> None:
        signals["count"] += 1
        systemd.notify("STOPPING=1")
        if signals["count"] == 1:
            event("signal received: draining", signal=signame)
            proxy.begin_drain()
        else:
            event("signal received again: stopping now", signal=signame)
            proxy.stop_now()

    loop.add_signal_handler(signal.SIGINT, on_stop_signal, "SIGINT")
    loop.add_signal_handler(signal.SIGTERM, on_stop_signal, "SIGTERM")
    await proxy.wait_stopped()
    if proxy.admin is not None:
        await proxy.admin.stop()
    await proxy.observatory.stop()
    event("stopped")
    return 0


def run_proxy(
    config: Config,
    config_path: str | None,
    identity: WorkerIdentity | None = None,
    *,
    replace: bool = False,
) -> int:
    """Entry point for ``scry serve``: logging, uvloop, serve until stopped.

    Without an ``identity`` (not a worker of a supervisor) and with more than
    one worker configured, this runs the supervisor instead (scry.workers).
    """
    if identity is None:
        from scry.workers import resolve_workers, run_supervisor

        workers = resolve_workers(config)
        if workers > 1:
            return run_supervisor(config, config_path, workers, replace)
        identity = WorkerIdentity(instance=os.getpid(), replace=replace)
    setup_logging(config.log.level, config.log.format, syslog=config.log.syslog_target())
    from scry.event_loop import run

    return run(serve(config, config_path, identity))
