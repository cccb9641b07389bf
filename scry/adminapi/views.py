"""Admin payloads built from the proxy's live objects.

Everything here reads; nothing changes the proxy. Polled endpoints (status,
pools, breaker) are built from counters and from the pools' own structures
(bounded by pool sizes); only the listings (clients, servers, pins) walk
every connection, and clients and servers are paginated.

Clocks: the proxy keeps monotonic readings (``time.monotonic``, the
janitor's coarse ``proxy.clock``) and ``perf_counter_ns`` stamps; the API
speaks Unix epoch seconds and durations, converted here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from admin import schemas as s
from scry import __version__
from scry.config import join_host_port
from scry.observe.fingerprint import DIGITS_TO_ZERO
from scry.protocol.string_escapes import standard_text

if TYPE_CHECKING:
    from scry.client import ClientConnection
    from scry.pool import Pool
    from scry.proxy import Proxy
    from scry.server import ServerConnection


class Clock:
    """One reading of every clock, so a payload's times agree with each other."""

    __slots__ = ("wall", "mono", "perf_ns")

    def __init__(self) -> None:
        self.wall = time.time()
        self.mono = time.monotonic()
        self.perf_ns = perf_counter_ns()

    def wall_of_mono(self, mono: float) -> float:
        return self.wall - (self.mono - mono)

    def ago_mono(self, mono: float) -> float:
        return max(0.0, self.mono - mono)


# --------------------------------------------------------------------------- #
# Status and pools
# --------------------------------------------------------------------------- #


def _pinned_servers(pool: Pool) -> int:
    pinned = 0
    for server in pool.servers:
        client = server.client
        if client is not None and client.tracker is not None and client.tracker.pinned:
            pinned += 1
    return pinned


def status(
    proxy: Proxy, admin_addr: str, summary: dict[str, Any], paused: bool = False
) -> s.Status:
    clock = Clock()
    pools = proxy.pools.values()
    identity = getattr(proxy, "identity", None)  # scry.workers.WorkerIdentity
    listen = [
        _sockname(sock.getsockname()) for server in proxy.listeners for sock in server.sockets
    ]
    return s.Status(
        version=__version__,
        pid=os.getpid(),
        started_at=proxy.started_at,
        uptime_s=round(clock.wall - proxy.started_at, 3),
        pool_mode=proxy.config.pool.mode,
        workers=getattr(identity, "workers", 1),
        worker=getattr(proxy, "worker_id", 0),
        listen_addr=proxy.config.listen_addr,
        listen_addresses=listen,
        admin_addr=admin_addr,
        databases=sorted(proxy.targets),
        draining=proxy.draining,
        paused=paused,
        read_only=proxy.config.admin.read_only,
        clients=len(proxy.clients),
        servers=sum(len(p.servers) for p in pools),
        pools=len(proxy.pools),
        waiting=sum(len(p.waiters) for p in pools),
        pinned=sum(_pinned_servers(p) for p in pools),
        queries=s.QueryTotals.model_validate(summary),
    )


def _sockname(name: Any) -> str:
    return join_host_port(name[0], name[1]) if isinstance(name, tuple) else str(name)


def pool_info(pool: Pool) -> s.PoolInfo:
    parked = len(pool.parked)
    waits = pool.waits
    wait_ms_total = pool.total_wait_us / 1000
    error = pool.last_error
    return s.PoolInfo(
        database=pool.target.name,
        user=pool.server_user,
        mode=pool.mode,
        size=pool.size,
        min_size=pool.settings.min_size,
        reserve_size=pool.settings.reserve_size,
        reserve_in_use=pool.reserve_in_use,
        servers=len(pool.servers),
        connecting=pool.connecting,
        active=max(0, pool.active_count),
        idle=len(pool.idle) + parked,
        parked=parked,
        waiting=len(pool.waiters),
        max_wait_ms=round(pool.oldest_wait() * 1000, 3),
        pinned=_pinned_servers(pool),
        stale=pool.stale,
        breaker=str(pool.breaker.state.value),
        last_error=(str(error) or type(error).__name__) if error is not None else None,
        totals=s.PoolTotals(
            waits=waits,
            wait_ms_total=wait_ms_total,
            wait_ms_mean=wait_ms_total / waits if waits else 0.0,
            servers_opened=pool.servers_opened,
            servers_closed=pool.servers_closed,
        ),
    )


def pools(proxy: Proxy) -> s.PoolList:
    return s.PoolList(pools=[pool_info(p) for p in proxy.pools.values()])


def pool_gauges(proxy: Proxy) -> list[dict[str, Any]]:
    """For the Prometheus pool gauges (called at scrape time)."""
    return [
        {
            "database": p.target.name,
            "user": p.server_user,
            "size": p.size,
            "reserve_in_use": p.reserve_in_use,
            "active": max(0, p.active_count),
            "idle": len(p.idle) + len(p.parked),
            "waiting": len(p.waiters),
            "max_wait_seconds": p.oldest_wait(),
        }
        for p in list(proxy.pools.values())
    ]


# --------------------------------------------------------------------------- #
# Clients and servers
# --------------------------------------------------------------------------- #


def _id_order(item: Any) -> tuple[int, str]:
    ident: str = item.id
    digits = ident[1:]
    return (int(digits) if digits.isdigit() else 0, ident)


def _client_state(client: ClientConnection) -> str:
    if client.state != "ready":
        return str(client.state)
    if client.waiting_since:
        return "waiting"
    server = client.server
    if client.inflight or (server is not None and server.pending > 0):
        return "active"
    if server is not None and server.tx_status != ord("I") and not client.parked:
        return "idle_in_transaction"
    return "idle"


def _current_statement(proxy: Proxy, client: ClientConnection) -> tuple[str | None, str | None]:
    """Fingerprint and normalized text of what the client runs now, when the
    observatory already knows that text's variant (a dict lookup; never a parse)."""
    inflight = client.inflight
    if not inflight:
        return None, None
    try:
        text = inflight[0][-2]  # entries end with (..., text, t_received_ns)
    except IndexError:
        return None, None
    if not isinstance(text, bytes) or not text:
        return None, None
    if client.context is not None and client.context.nonstandard_strings:
        text = standard_text(text)  # as the drain wrote it
    observatory = proxy.observatory
    variant = observatory.fingerprinter.variants.get(text.translate(DIGITS_TO_ZERO))
    if variant is None or not variant.matches(text):
        return None, None
    shape = variant.shape
    return shape.fingerprint, shape.normalized


def client_info(proxy: Proxy, client: ClientConnection, clock: Clock) -> s.ClientInfo:
    server = client.server
    tracker = client.tracker
    pinned = tracker is not None and tracker.pinned
    fingerprint, query = _current_statement(proxy, client)
    inflight = client.inflight
    running_ms = None
    if inflight:
        try:
            running_ms = round((clock.perf_ns - inflight[0][-1]) / 1e6, 3)
        except (IndexError, TypeError):
            pass
    waiting = bool(client.waiting_since)
    return s.ClientInfo(
        id=client.id,
        addr=client.addr,
        user=client.user,
        database=client.database,
        application_name=client.application_name,
        state=_client_state(client),
        connected_at=client.connected_at,
        server_id=server.id if server is not None else None,
        backend_pid=server.backend_pid if server is not None else None,
        parked=client.parked,
        waiting=waiting,
        wait_ms=round((clock.perf_ns - client.waiting_since) / 1e6, 3) if waiting else None,
        idle_s=round(clock.ago_mono(client.last_active), 3) if client.last_active else None,
        pinned=pinned,
        pin_reasons=list(tracker.state.reasons()) if pinned and tracker is not None else [],
        fingerprint=fingerprint,
        query=query,
        running_ms=running_ms,
    )


def clients(proxy: Proxy, limit: int, offset: int) -> s.ClientList:
    clock = Clock()
    ordered = sorted(proxy.clients, key=_id_order)
    page = ordered[offset : offset + limit]
    return s.ClientList(
        total=len(ordered),
        offset=offset,
        limit=limit,
        clients=[client_info(proxy, c, clock) for c in page],
    )


def server_info(server: ServerConnection, clock: Clock) -> s.ServerInfo:
    client = server.client
    pool = server.pool
    idle = server.client is None and server.state == "idle"
    return s.ServerInfo(
        id=server.id,
        database=pool.target.name,
        user=pool.server_user,
        state=str(server.state),
        client_id=client.id if client is not None else None,
        backend_pid=server.backend_pid,
        local_addr=server.local_addr,
        addr=server.address[0] if server.address[0].startswith("/") else _sockname(server.address),
        created_at=round(clock.wall_of_mono(server.created_at), 3),
        age_s=round(clock.ago_mono(server.created_at), 3),
        idle_s=round(clock.ago_mono(server.last_used), 3) if idle else None,
        pending=server.pending,
        tx_status=chr(server.tx_status) if isinstance(server.tx_status, int) else "?",
        pinned=bool(client is not None and client.tracker is not None and client.tracker.pinned),
        retire=server.retire,
    )


def servers(proxy: Proxy, limit: int, offset: int) -> s.ServerList:
    clock = Clock()
    every = [server for pool in list(proxy.pools.values()) for server in pool.servers]
    every.sort(key=_id_order)
    return s.ServerList(
        total=len(every),
        offset=offset,
        limit=limit,
        servers=[server_info(x, clock) for x in every[offset : offset + limit]],
    )


# --------------------------------------------------------------------------- #
# Pins
# --------------------------------------------------------------------------- #


def pin_info(proxy: Proxy, client: ClientConnection, clock: Clock) -> s.PinInfo | None:
    tracker = client.tracker
    if tracker is None or not tracker.pinned:
        return None
    described = tracker.state.describe()
    anonymize = _anonymizer_of(proxy.observatory)
    server = client.server
    since = tracker.pinned_since or None
    return s.PinInfo(
        client_id=client.id,
        server_id=server.id if server is not None else None,
        backend_pid=server.backend_pid if server is not None else None,
        database=client.database,
        user=client.user,
        application_name=client.application_name,
        reasons=list(described["reasons"]),
        replayable=bool(described["replayable"]),
        # proxy.clock is coarse (one janitor tick): never before the client came.
        since=round(max(clock.wall_of_mono(since), client.connected_at), 3) if since else None,
        pinned_s=round(min(clock.ago_mono(since), clock.wall - client.connected_at), 3)
        if since
        else None,
        holding_server=server is not None,
        replay_pending=tracker.needs_replay,
        counts={k: int(v) for k, v in described["counts"].items()},
        settings=list(described["settings"]),
        # Never a raw literal: the statements are what the client sent.
        statements=[_anonymized(anonymize, text) for text in described["statements"]],
        pinned_by={r: _anonymized(anonymize, t) for r, t in described["pinned_by"].items()},
    )


def _anonymizer_of(observatory: Any) -> Callable[[str], str]:
    """Statements as the ranking shows them (PostgreSQL's parser makes a value
    written as a name, SET x = secret, a $n: the lexer cannot), with any
    literal left hashed, whatever observability.anonymize says."""
    normalized = observatory.fingerprinter.fingerprint
    hashed = observatory.anonymizer.anonymize_sql
    return lambda text: hashed(normalized(text).normalized)


def _anonymized(anonymize: Any, text: str) -> str:
    try:
        return str(anonymize(text))
    except Exception:  # the lexer should not fail; if it does, show nothing rather than raw text
        return "<unparsable statement>"


def pins(proxy: Proxy) -> s.PinList:
    clock = Clock()
    found = []
    for client in sorted(proxy.clients, key=_id_order):
        info = pin_info(proxy, client, clock)
        if info is not None:
            found.append(info)
    return s.PinList(pins=found)


# --------------------------------------------------------------------------- #
# Breakers
# --------------------------------------------------------------------------- #


def breaker_entry(proxy: Proxy, database: str) -> s.BreakerEntry:
    return s.BreakerEntry(
        database=database,
        breaker=s.BreakerSnapshot.model_validate(proxy.breaker_for(database).snapshot()),
        health=s.HealthSnapshot.model_validate(proxy.health_for(database).snapshot()),
    )


def breaker_databases(proxy: Proxy) -> list[str]:
    return sorted(set(proxy.targets) | set(proxy.breakers))


def breakers(proxy: Proxy) -> s.BreakerList:
    return s.BreakerList(databases=[breaker_entry(proxy, d) for d in breaker_databases(proxy)])
