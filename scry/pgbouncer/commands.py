"""The console's commands: RELOAD, SET, PAUSE, RESUME, SUSPEND, DISABLE, ENABLE,
RECONNECT, KILL, KILL_CLIENT, WAIT_CLOSE and SHUTDOWN, with PgBouncer's errors.

Each ``cmd_*`` takes the console, the command's argument and the whole SQL
text (for PgBouncer's "invalid command" message), and returns the answer, or
an awaitable of it for the commands that wait (PAUSE, SUSPEND, WAIT_CLOSE, SHUTDOWN
WAIT_FOR_*). Only ``admin_users`` get here (the dispatcher checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from scry.config import ConfigError
from scry.log import event
from scry.pgbouncer.results import ADMIN_DB, READY, ConsoleError, error, num_id, ok
from scry.pgbouncer.state import autodb_target, state_for
from scry.protocol.errors import PROTOCOL_VIOLATION
from scry.server import ServerConnection

if TYPE_CHECKING:
    from scry.pgbouncer.dispatch import AdminConsole
    from scry.pool import Pool
    from scry.proxy import Proxy


def set_setting(console: AdminConsole, key: str, value: str) -> bytes:
    """SET key = value: change a ``changeable`` [pgbouncer] key and apply it as RELOAD."""
    if not console.admin:
        raise ConsoleError("admin access needed")
    from scry.pgbouncer.ini import PGBOUNCER_KEYS

    spec = PGBOUNCER_KEYS.get(key.lower())
    if spec is None or not spec.changeable:
        event("SET failed", logging.WARNING, key=key, reason="unknown or not changeable")
        raise ConsoleError("SET failed")
    previous = console.state.overrides.get(key.lower())
    console.state.overrides[key.lower()] = value
    try:
        reload_pgbouncer_config(console.proxy)
    except (ConfigError, RuntimeError) as exc:  # (IniError is a ConfigError)
        if previous is None:
            console.state.overrides.pop(key.lower(), None)
        else:
            console.state.overrides[key.lower()] = previous
        event("SET failed", logging.WARNING, key=key, error=str(exc))
        raise ConsoleError("SET failed") from None
    return ok(f"SET {key}={value}")


def cmd_reload(console: AdminConsole, arg: str, sql: str) -> bytes:
    if arg:
        raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
    event("RELOAD command issued")
    try:
        reload_pgbouncer_config(console.proxy)
    except Exception as exc:
        event("RELOAD failed", logging.ERROR, error=str(exc))
        return error("RELOAD failed, see logs for additional details", "F0000") + READY
    return ok("RELOAD")


def _known_db(console: AdminConsole, name: str) -> None:
    if name == ADMIN_DB:
        raise ConsoleError(f"cannot use admin db: {name}")
    if name not in console.proxy.targets:
        compat = console.proxy.config.pgbouncer
        if compat is None or compat.autodb is None or autodb_target(console.proxy, name) is None:
            raise ConsoleError(f"no such database: {name}")


def _mark_paused(console: AdminConsole, arg: str, verb: str) -> None:
    """PAUSE and KILL: flag ``arg`` (or everything) paused, with PgBouncer's errors."""
    st = console.state
    if st.paused_all or st.suspended:
        raise ConsoleError("already suspended/paused")
    if arg:
        if arg == ADMIN_DB:
            raise ConsoleError(f"cannot {verb} admin db: {arg}")
        _known_db(console, arg)
        st.paused.add(arg)
    else:
        st.paused_all = True


def cmd_pause(console: AdminConsole, arg: str, sql: str) -> Awaitable[bytes] | bytes:
    _mark_paused(console, arg, "pause")
    event("PAUSE command issued", database=arg or "*")
    return _finish_pause(console, arg or None)


async def _finish_pause(console: AdminConsole, database: str | None) -> bytes:
    await console.proxy.pause(database)
    return ok("PAUSE")


def cmd_resume(console: AdminConsole, arg: str, sql: str) -> bytes:
    st = console.state
    if st.shutting_down:
        raise ConsoleError("pooler is shutting down")
    if not arg:
        if not (st.paused_all or st.suspended or st.paused):
            raise ConsoleError("pooler is not paused/suspended")
        resume_all(console.proxy)
    else:
        if arg not in console.proxy.targets:
            raise ConsoleError(f"no such database: {arg}")
        if arg not in st.paused and not st.paused_all:
            raise ConsoleError(f"database {arg} is not paused")
        st.paused.discard(arg)
        console.proxy.resume(arg)
    event("RESUME command issued", database=arg or "*")
    return ok("RESUME")


def cmd_suspend(console: AdminConsole, arg: str, sql: str) -> Awaitable[bytes]:
    st = console.state
    if arg:
        raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
    if st.paused_all or st.suspended:
        raise ConsoleError("already suspended/paused")
    if st.paused:
        raise ConsoleError("cannot suspend with paused databases")
    st.suspended = True  # new logins wait for RESUME (scry.pgbouncer.console.route_login)
    event("SUSPEND command issued")
    return _finish_suspend(console.proxy)


async def _finish_suspend(proxy: Proxy) -> bytes:
    """Stop reading every connection, then answer once what scry still had to
    send has gone out. A connection whose data is not gone after
    ``suspend_timeout`` is closed, as in PgBouncer."""
    connections: list[Any] = [client for client in proxy.clients if client.transport is not None]
    connections += [s for pool in proxy.pools.values() for s in pool.servers if s.transport]
    for connection in connections:
        connection.transport.pause_reading()
    compat = proxy.config.pgbouncer
    timeout = compat.suspend_timeout if compat is not None else 0
    started = time.monotonic()
    while unsent := [c for c in connections if _has_unsent_data(c.transport)]:
        if timeout and time.monotonic() - started >= timeout:
            for connection in unsent:
                event("suspend_timeout: closing a connection with unsent data", logging.WARNING,
                      id=connection.id, unsent=connection.transport.get_write_buffer_size())  # fmt: skip
                if isinstance(connection, ServerConnection):
                    connection.close("suspend_timeout")
                else:
                    connection.fatal(PROTOCOL_VIOLATION, "suspend_timeout")
                connection.transport.abort()  # (close() would wait for the data)
            break
        await asyncio.sleep(0.05)  # polled, as Proxy.pause polls its pools
    return ok("SUSPEND")


def _has_unsent_data(transport: asyncio.WriteTransport) -> bool:
    return not transport.is_closing() and transport.get_write_buffer_size() > 0


def resume_all(proxy: Proxy) -> None:
    """RESUME with no database (and SIGUSR2): end PAUSE and SUSPEND alike."""
    st = state_for(proxy)
    st.paused_all = False
    st.paused.clear()
    if st.suspended:
        st.suspended = False
        for pool in list(proxy.pools.values()):
            for server in list(pool.servers):
                if server.transport is not None and not server.paused_by_client:
                    with contextlib.suppress(Exception):
                        server.transport.resume_reading()
        for client in list(proxy.clients):
            with contextlib.suppress(Exception):
                client._update_reading()
        held, st.held_logins = st.held_logins, []
        for go_on in held:
            go_on()
    proxy.resume()


def cmd_disable(console: AdminConsole, arg: str, sql: str) -> bytes:
    if not arg:
        raise ConsoleError("a database is required")
    if arg == ADMIN_DB:
        raise ConsoleError(f"cannot disable admin db: {arg}")
    _known_db(console, arg)
    console.state.disabled.add(arg)
    event("DISABLE command issued", database=arg)
    return ok("DISABLE")


def cmd_enable(console: AdminConsole, arg: str, sql: str) -> bytes:
    if not arg:
        raise ConsoleError("a database is required")
    if arg == ADMIN_DB:
        raise ConsoleError(f"cannot enable admin db: {arg}")
    if arg not in console.proxy.targets:
        raise ConsoleError(f"no such database: {arg}")
    console.state.disabled.discard(arg)
    event("ENABLE command issued", database=arg)
    return ok("ENABLE")


def _pools_of(console: AdminConsole, database: str | None) -> list[Pool]:
    return [p for p in list(console.proxy.pools.values()) if database in (None, p.target.name)]


def cmd_reconnect(console: AdminConsole, arg: str, sql: str) -> bytes:
    if arg:
        if arg == ADMIN_DB:
            raise ConsoleError(f"cannot reconnect admin db: {arg}")
        _known_db(console, arg)
    for pool in _pools_of(console, arg or None):
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
        if pool.settings.server_fast_close:
            pool.close_sessions_fast()
    event("RECONNECT command issued", database=arg or "*")
    return ok("RECONNECT")


def cmd_kill(console: AdminConsole, arg: str, sql: str) -> bytes:
    _mark_paused(console, arg, "kill")
    database = arg or None
    for client in list(console.proxy.clients):
        if database in (None, client.database):
            client.fatal("08P01", "database removed")
    for pool in console.proxy.hold(database):
        pool.close_all("KILL")
    event("KILL command issued", database=arg or "*")
    return ok("KILL")


def cmd_kill_client(console: AdminConsole, arg: str, sql: str) -> bytes:
    wanted = arg.lstrip("cC")
    if not (wanted.isascii() and wanted.isdigit()):  # (str.isdigit takes "²" too)
        raise ConsoleError("invalid client pointer supplied")
    for client in list(console.proxy.clients):
        if num_id(client.id) == int(wanted):
            client.fatal("08P01", "admin forced disconnect")
            return ok("KILL_CLIENT")
    for session in list(console.state.sessions):
        if session.id == int(wanted):
            session.fatal("08P01", "admin forced disconnect")
            return ok("KILL_CLIENT")
    raise ConsoleError("client not found")


def cmd_wait_close(console: AdminConsole, arg: str, sql: str) -> Awaitable[bytes] | bytes:
    if arg:
        if arg == ADMIN_DB:
            raise ConsoleError(f"cannot wait in admin db: {arg}")
        _known_db(console, arg)
    pools = _pools_of(console, arg or None)

    def pending() -> bool:
        return any(s.retire or p.stale for p in pools for s in list(p.servers))

    if not pending():
        return ok("WAIT_CLOSE")

    async def wait() -> bytes:
        while pending():  # noqa: ASYNC110 - nothing signals a server close
            await asyncio.sleep(0.05)
        return ok("WAIT_CLOSE")

    return wait()


def cmd_shutdown(console: AdminConsole, arg: str, sql: str) -> Awaitable[bytes] | bytes:
    mode = arg.upper()
    if mode not in ("", "WAIT_FOR_SERVERS", "WAIT_FOR_CLIENTS"):
        raise ConsoleError(f"invalid command '{sql}', use SHOW HELP;")
    proxy = console.proxy
    event("SHUTDOWN command issued", mode=mode or "immediate")
    console.state.shutting_down = True
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
    return ok("SHUTDOWN")


COMMANDS: dict[str, Callable[[AdminConsole, str, str], Any]] = {
    "disable": cmd_disable, "enable": cmd_enable, "kill": cmd_kill,
    "kill_client": cmd_kill_client, "pause": cmd_pause, "reconnect": cmd_reconnect,
    "reload": cmd_reload, "resume": cmd_resume, "shutdown": cmd_shutdown,
    "suspend": cmd_suspend, "wait_close": cmd_wait_close,
}  # fmt: skip


# --- reloading from the pgbouncer.ini ---------------------------------------------


def reload_pgbouncer_config(proxy: Proxy) -> list[str]:
    """Re-read the pgbouncer.ini (plus SET overrides) and apply it; returns the
    warnings not reported before. Raises IniError when the file is unusable,
    ConfigError when what it says cannot be applied (nothing changed then)."""
    from scry.pgbouncer.ini import IniError, load_pgbouncer_config

    state = state_for(proxy)
    compat = proxy.config.pgbouncer
    if compat is None or not compat.conffile:
        raise IniError("no pgbouncer.ini to reload")
    config, warnings = load_pgbouncer_config(compat.conffile, state.overrides)
    proxy.apply_config(config)
    fresh = [w for w in warnings if w not in state.warned]
    for warning in fresh:
        state.warned.add(warning)
        event(warning, logging.WARNING)
    return fresh
