"""The console's SHOW views of pools, clients, servers, databases and settings.

Column names, order and types follow PgBouncer 1.25; the figures come from
scry's pools, clients and servers (docs/migrating-from-pgbouncer.md says what
scry has no equivalent for). SHOW STATS and its siblings are in
:mod:`scry.pgbouncer.stats`; scry's own views (PINS, BREAKER, FINGERPRINTS)
close this module.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from scry import __version__
from scry.pgbouncer import PGBOUNCER_VERSION
from scry.pgbouncer.results import (
    ADMIN_DB,
    INT4,
    INT8,
    NUMERIC,
    TEXT,
    ConsoleError,
    fmt3,
    num_id,
    peer_uid,
    result,
    split_addr,
    stamp,
)
from scry.pgbouncer.stats import STATS_VIEWS

if TYPE_CHECKING:
    from scry.client import ClientConnection
    from scry.pgbouncer.dispatch import AdminConsole
    from scry.pgbouncer.session import ConsoleSession
    from scry.pool import Pool
    from scry.server import ServerConnection

_T, _I, _N = TEXT, INT4, NUMERIC

_SOCKET_COLUMNS: list[tuple[str, int]] = [
    ("type", _T), ("user", _T), ("database", _T), ("replication", _T), ("state", _T),
    ("addr", _T), ("port", _I), ("local_addr", _T), ("local_port", _I),
    ("connect_time", _T), ("request_time", _T), ("wait", _I), ("wait_us", _I),
    ("close_needed", _I), ("ptr", _T), ("link", _T), ("remote_pid", _I), ("tls", _T),
    ("application_name", _T), ("prepared_statements", _I), ("id", _I),
]  # fmt: skip
_SOCKET_DEBUG = [(name, _I) for name in (
    "recv_pos", "pkt_pos", "pkt_remain", "send_pos", "send_remain", "pkt_avail", "send_avail")]  # fmt: skip


def show_version(console: AdminConsole) -> bytes:
    return result([("version", _T)], [[f"PgBouncer {PGBOUNCER_VERSION} (scry {__version__})"]], "SHOW")  # fmt: skip


def show_state(console: AdminConsole) -> bytes:
    st = console.state
    paused = st.paused_all
    rows = [
        ["active", "no" if paused or st.suspended else "yes"],
        ["paused", "yes" if paused else "no"],
        ["suspended", "yes" if st.suspended else "no"],
    ]
    return result([("key", _T), ("value", _T)], rows, "SHOW")


def show_pools(console: AdminConsole) -> bytes:
    columns = [("database", _T), ("user", _T)] + [(c, _I) for c in (
        "cl_active", "cl_waiting", "cl_active_cancel_req", "cl_waiting_cancel_req",
        "sv_active", "sv_active_cancel", "sv_being_canceled", "sv_idle", "sv_used",
        "sv_tested", "sv_login", "maxwait", "maxwait_us")] + [
        ("pool_mode", _T), ("load_balance_hosts", _T)]  # fmt: skip
    clients = _clients_by_pool(console)
    rows = []
    for pool in list(console.proxy.pools.values()):
        mine = clients.get(id(pool), [])
        waiting = sum(1 for c in mine if c.waiting_since)
        counts = _server_counts(console, pool)
        wait_us = int(pool.oldest_wait() * 1e6)
        # Cancels go to PostgreSQL at once (never queued) on their own connection.
        cancels = sum(s.cancels_pending for s in list(pool.servers))
        rows.append([
            pool.target.name, pool.server_user, len(mine) - waiting, waiting, cancels, 0,
            counts["active"], cancels, counts["being_canceled"], counts["idle"], counts["used"],
            counts["tested"], counts["new"], wait_us // 1_000_000, wait_us % 1_000_000,
            pool.mode, pool.target.load_balance_hosts,
        ])  # fmt: skip
    sessions = len(console.state.sessions)
    rows.append([ADMIN_DB, ADMIN_DB, sessions, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                 "statement", None])  # fmt: skip
    return result(columns, rows, "SHOW")


def show_clients(console: AdminConsole) -> bytes:
    rows = [_client_row(console, c, debug=False) for c in _sorted_clients(console)]
    rows.extend(_session_row(console, s, debug=False) for s in _sorted_sessions(console))
    return result(_SOCKET_COLUMNS, rows, "SHOW")


def show_servers(console: AdminConsole) -> bytes:
    rows = [_server_row(console, s, debug=False) for s in _sorted_servers(console)]
    return result(_SOCKET_COLUMNS, rows, "SHOW")


def show_sockets(console: AdminConsole) -> bytes:
    return result(_SOCKET_COLUMNS + _SOCKET_DEBUG, _socket_rows(console), "SHOW")


def _socket_rows(console: AdminConsole) -> list[list[Any]]:
    rows = [_client_row(console, c, debug=True) for c in _sorted_clients(console)]
    rows.extend(_server_row(console, s, debug=True) for s in _sorted_servers(console))
    rows.extend(_session_row(console, s, debug=True) for s in _sorted_sessions(console))
    return rows


def show_active_sockets(console: AdminConsole) -> bytes:
    """The sockets with data waiting to be sent (scry keeps no unparsed input)."""
    rows = [r for r in _socket_rows(console) if r[-1]]
    return result(_SOCKET_COLUMNS + _SOCKET_DEBUG, rows, "SHOW")


def show_databases(console: AdminConsole) -> bytes:
    columns = [("name", _T), ("host", _T), ("port", _I), ("database", _T),
               ("force_user", _T), ("pool_size", _I), ("min_pool_size", _I),
               ("reserve_pool_size", _I), ("server_lifetime", _I), ("pool_mode", _T),
               ("load_balance_hosts", _T), ("max_connections", _I),
               ("current_connections", _I), ("max_client_connections", _I),
               ("current_client_connections", _I), ("paused", _I), ("disabled", _I)]  # fmt: skip
    proxy = console.proxy
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
        paused = bool(
            console.state.paused_all or name in console.state.paused or pools_paused.get(name)
        )
        rows.append([
            name, "unix" if target.host.startswith("/") else target.host, target.port,
            target.dbname, target.user, target.pool.size, target.pool.min_size,
            target.pool.reserve_size,
            lifetime if target.pool.server_lifetime is None else int(target.pool.server_lifetime),
            mode, target.load_balance_hosts,
            target.pool.max_db_connections,
            servers.get(name, 0), target.pool.max_db_client_connections,
            clients.get(name, 0), paused, name in console.state.disabled,
        ])  # fmt: skip
    port = config.listen_host_port[1]
    rows.append([ADMIN_DB, None, port, ADMIN_DB, ADMIN_DB, 2, 0, 0, lifetime, "statement",
                 None, 0, 0, 0, len(console.state.sessions), 0, 0])  # fmt: skip
    rows.sort(key=lambda r: r[0])
    return result(columns, rows, "SHOW")


def show_users(console: AdminConsole) -> bytes:
    columns = [("name", _T), ("pool_size", _T), ("reserve_pool_size", _T), ("pool_mode", _T),
               ("max_user_connections", _I), ("current_connections", _I),
               ("max_user_client_connections", _I), ("current_client_connections", _I)]  # fmt: skip
    compat = console.proxy.config.pgbouncer
    overrides = compat.users if compat is not None else {}
    servers: dict[str, int] = {}
    for pool in list(console.proxy.pools.values()):
        servers[pool.server_user] = servers.get(pool.server_user, 0) + len(pool.servers)
    clients: dict[str, int] = {}
    for client in list(console.proxy.clients):
        clients[client.user] = clients.get(client.user, 0) + 1
    names = set(console.proxy.auth.users) | set(overrides) | {ADMIN_DB}
    defaults = console.proxy.config.pool
    rows = []
    for name in sorted(names):
        o = overrides.get(name)
        limit = o.max_user_connections if o is not None else None
        client_limit = o.max_user_client_connections if o is not None else None
        rows.append([
            name,
            f"{o.pool_size:9d}" if o is not None and o.pool_size is not None else "",
            f"{o.reserve_pool_size:9d}" if o is not None and o.reserve_pool_size is not None else "",
            o.pool_mode if o is not None else None,
            defaults.max_user_connections if limit is None else limit, servers.get(name, 0),
            defaults.max_user_client_connections if client_limit is None else client_limit,
            clients.get(name, 0),
        ])  # fmt: skip
    return result(columns, rows, "SHOW")


def show_lists(console: AdminConsole) -> bytes:
    proxy = console.proxy
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
        ["used_clients", len(proxy.clients) + len(console.state.sessions)],
        ["login_clients", login],
        ["free_servers", 0],
        ["used_servers", servers],
        ["dns_names", len(proxy.dns.entries)],
        ["dns_zones", 0],  # (no zone serial checks: dns_zone_check_period)
        ["dns_queries", proxy.dns.queries],
        ["dns_pending", proxy.dns.pending],
    ]
    return result([("list", _T), ("items", _I)], rows, "SHOW")


def show_peers(console: AdminConsole) -> bytes:
    columns = [("peer_id", _I), ("host", _T), ("port", _I), ("pool_size", _I)]
    rows = []
    size = console.proxy.config.pool.size
    for peer_id, addr in sorted(console.proxy.config.peers.items()):
        host, port = split_addr(addr)
        rows.append([peer_id, host, port, size])
    return result(columns, rows, "SHOW")


def show_peer_pools(console: AdminConsole) -> bytes:
    columns = [("peer_id", _I), ("cl_active_cancel_req", _I), ("cl_waiting_cancel_req", _I),
               ("sv_active_cancel", _I), ("sv_login", _I)]  # fmt: skip
    rows = [[peer_id, 0, 0, 0, 0] for peer_id in sorted(console.proxy.config.peers)]
    return result(columns, rows, "SHOW")


def show_config(console: AdminConsole) -> bytes:
    from scry.pgbouncer.ini import PGBOUNCER_KEYS, parse_ini

    values: dict[str, str] = {}
    compat = console.proxy.config.pgbouncer
    if compat is not None and compat.conffile:
        with contextlib.suppress(Exception):
            ini = parse_ini(compat.conffile)
            values = {k: e.value for k, e in ini.section("pgbouncer").items()}
    values.update(console.state.overrides)
    if compat is not None and compat.conffile:
        values["conffile"] = compat.conffile
    rows = []
    for key in sorted(PGBOUNCER_KEYS):
        spec = PGBOUNCER_KEYS[key]
        value = values.get(key, spec.default)
        rows.append([key, value, spec.default, "yes" if spec.changeable else "no"])
    columns = [("key", _T), ("value", _T), ("default", _T), ("changeable", _T)]
    return result(columns, rows, "SHOW")


def show_mem(console: AdminConsole) -> bytes:
    columns = [("name", _T), ("size", _I), ("used", _I), ("free", _I), ("memtotal", _I)]
    return result(columns, [], "SHOW")  # scry has no slab allocator to report


def show_dns_hosts(console: AdminConsole) -> bytes:
    rows = [list(row) for row in console.proxy.dns.rows()]
    return result([("hostname", _T), ("ttl", INT8), ("addrs", _T)], rows, "SHOW")


def show_dns_zones(console: AdminConsole) -> bytes:
    return result([("zonename", _T), ("serial", INT8), ("count", _I)], [], "SHOW")


def show_fds(console: AdminConsole) -> bytes:
    raise ConsoleError("SHOW FDS is not supported by scry (no online restart with -R)")


# --- rows ------------------------------------------------------------------------


def _clients_by_pool(console: AdminConsole) -> dict[int, list[ClientConnection]]:
    out: dict[int, list[ClientConnection]] = {}
    for client in list(console.proxy.clients):
        if client.pool is not None and client.state == "ready":
            out.setdefault(id(client.pool), []).append(client)
    return out


def _server_counts(console: AdminConsole, pool: Pool) -> dict[str, int]:
    counts = dict.fromkeys(("active", "idle", "used", "tested", "being_canceled"), 0)
    counts["new"] = pool.connecting
    for server in list(pool.servers):
        state = _server_state(console, server)
        counts[state] = counts.get(state, 0) + 1
    return counts


def _server_state(console: AdminConsole, server: ServerConnection) -> str:
    state = server.state
    if state == "internal":
        return "tested"
    if state in ("connecting", "login"):
        return "new"
    if server.release_after_cancel:
        return "being_canceled"  # released, held back until PostgreSQL did the cancel
    client = server.client
    if client is not None and not client.parked:
        return "active"
    delay = console.proxy.config.timeouts.server_check_delay
    if delay and console.proxy.clock - server.last_used > delay:
        return "used"
    return "idle"


def _sorted_clients(console: AdminConsole) -> list[ClientConnection]:
    return sorted(console.proxy.clients, key=lambda c: num_id(c.id))


def _sorted_servers(console: AdminConsole) -> list[ServerConnection]:
    every = [s for pool in list(console.proxy.pools.values()) for s in pool.servers]
    return sorted(every, key=lambda s: num_id(s.id))


def _sorted_sessions(console: AdminConsole) -> list[ConsoleSession]:
    return sorted(console.state.sessions, key=lambda s: s.id)


def _client_row(console: AdminConsole, client: ClientConnection, debug: bool) -> list[Any]:
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
    addr, port = split_addr(client.addr)
    local = client.transport.get_extra_info("sockname") if client.transport else None
    local_addr, local_port = (local[0], local[1]) if isinstance(local, tuple) else ("unix", 0)
    peer = peer_uid(client.transport) if client.transport and addr == "unix" else None
    request = client.last_active and now_wall - (now_mono - client.last_active)
    statements = client.statements
    row = [
        "C", client.user or "(nouser)", client.database or "(nodb)", "none", state,
        addr, port, local_addr, local_port, stamp(client.connected_at),
        stamp(request or client.connected_at), waited // 1_000_000, waited % 1_000_000, 0,
        client.id, server.id if server is not None else "", peer[0] if peer else 0,
        "TLS" if client.tls else "", client.application_name,
        len(statements.by_name) if statements is not None else 0, num_id(client.id),
    ]  # fmt: skip
    return row + _buffers(client.transport) if debug else row


def _server_row(console: AdminConsole, server: ServerConnection, debug: bool) -> list[Any]:
    now_wall, now_mono = time.time(), time.monotonic()
    pool = server.pool
    target = pool.target
    state = _server_state(console, server)
    if debug:
        state = {"new": "sv_login"}.get(state, f"sv_{state}")
    local_addr, local_port = split_addr(server.local_addr)
    host, port = server.address
    client = server.client
    linked = client is not None and not client.parked
    row = [
        "S", pool.server_user, target.name, "none", state,
        "unix" if host.startswith("/") else host, port,
        local_addr, local_port, stamp(now_wall - (now_mono - server.created_at)),
        stamp(now_wall - (now_mono - server.last_used)), 0, 0,
        1 if (server.retire or pool.stale) else 0, server.id,
        client.id if linked and client is not None else "", server.backend_pid,
        "TLS" if server.tls else "",
        client.application_name if linked and client is not None else "",
        len(server.statements.names), num_id(server.id),
    ]  # fmt: skip
    return row + _buffers(server.transport) if debug else row


def _session_row(console: AdminConsole, session: ConsoleSession, debug: bool) -> list[Any]:
    peer = session.transport.get_extra_info("peername")
    addr, port = (peer[0], peer[1]) if isinstance(peer, tuple) else ("unix", 0)
    local = session.transport.get_extra_info("sockname")
    local_addr, local_port = (local[0], local[1]) if isinstance(local, tuple) else ("unix", 0)
    pid_uid = peer_uid(session.transport) if addr == "unix" else None
    row = [
        "C", session.user, ADMIN_DB, "none", "cl_active" if debug else "active", addr, port,
        local_addr, local_port, stamp(session.connected_at), stamp(session.request_at),
        0, 0, 0, f"a{session.id}", "", pid_uid[0] if pid_uid else 0,
        "TLS" if session.tls else "", "", 0, session.id,
    ]  # fmt: skip
    return row + _buffers(session.transport) if debug else row


def _buffers(transport: Any) -> list[int]:
    """SHOW SOCKETS' buffer columns: only ``send_avail`` (bytes not yet written) is
    kept by scry (asyncio's write buffer); it reads whole messages as they come."""
    try:
        pending = transport.get_write_buffer_size() if transport is not None else 0
    except Exception:  # a transport being closed
        pending = 0
    return [0, 0, 0, 0, 0, 0, pending]


# --- scry's own views --------------------------------------------------------------


def show_pins(console: AdminConsole) -> bytes:
    columns = [("client_id", _I), ("database", _T), ("user", _T), ("server_id", _I),
               ("reasons", _T), ("replayable", _I), ("pinned_s", _N)]  # fmt: skip
    now = console.proxy.clock
    rows = []
    for client in _sorted_clients(console):
        tracker = client.tracker
        if tracker is None or not tracker.pinned:
            continue
        described = tracker.state.describe()
        since = tracker.pinned_since
        server = client.server
        rows.append([
            num_id(client.id), client.database, client.user,
            num_id(server.id) if server is not None else None,
            ",".join(described["reasons"]), bool(described["replayable"]),
            round(max(0.0, now - since), 3) if since else None,
        ])  # fmt: skip
    return result(columns, rows, "SHOW")


def show_breaker(console: AdminConsole) -> bytes:
    columns = [("database", _T), ("state", _T), ("failures", _I), ("reason", _T)]
    rows = []
    for name in sorted(set(console.proxy.targets) | set(console.proxy.breakers)):
        snap = console.proxy.breaker_for(name).snapshot()
        counters = snap.get("counters") or {}
        reason = snap.get("open_reason") or snap.get("last_failure_reason")
        rows.append([name, str(snap.get("state")), counters.get("failures", 0), reason])
    return result(columns, rows, "SHOW")


#: Rows of SHOW FINGERPRINTS: the heaviest fingerprints by total time.
FINGERPRINTS_SHOWN = 50


def show_fingerprints(console: AdminConsole) -> bytes:
    return fingerprints_result(console.proxy.observatory.top(limit=FINGERPRINTS_SHOWN))


def fingerprints_result(ranking: Iterable[Mapping[str, Any]]) -> bytes:
    """SHOW FINGERPRINTS of a ranking (Observatory.top's, or the instance's
    merged one: scry.pgbouncer.instance)."""
    columns = [("fingerprint", _T), ("calls", INT8), ("errors", INT8), ("total_ms", _N),
               ("mean_ms", _N), ("p99_ms", _N), ("query", _T)]  # fmt: skip
    rows = []
    for entry in ranking:
        rows.append([
            entry.get("fingerprint"), entry.get("calls"), entry.get("errors"),
            fmt3(entry.get("total_ms")), fmt3(entry.get("mean_ms")),
            fmt3(entry.get("p99_ms")), entry.get("query") or entry.get("normalized"),
        ])  # fmt: skip
    return result(columns, rows, "SHOW")


SHOWS: dict[str, Callable[[AdminConsole], bytes]] = {
    "version": show_version, "state": show_state, "pools": show_pools,
    "clients": show_clients, "servers": show_servers, "sockets": show_sockets,
    "active_sockets": show_active_sockets, "databases": show_databases,
    "users": show_users, "lists": show_lists, "peers": show_peers,
    "peer_pools": show_peer_pools, "config": show_config, "mem": show_mem,
    "dns_hosts": show_dns_hosts, "dns_zones": show_dns_zones, "fds": show_fds,
    **STATS_VIEWS, "pins": show_pins,
    "breaker": show_breaker, "fingerprints": show_fingerprints,
}  # fmt: skip
