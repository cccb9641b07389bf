"""PgBouncer's admin console: the virtual database ``pgbouncer``.

A client that connects to database ``pgbouncer`` (when scry runs from a
pgbouncer.ini) is handed to a :class:`~scry.pgbouncer.session.ConsoleSession`
right after its StartupMessage (:func:`route_login`, called from
``ClientConnection._begin_login``). The console is made of:

- :mod:`~scry.pgbouncer.session`: the connection (login, simple queries);
- :mod:`~scry.pgbouncer.dispatch`: the grammar, one Query to one answer;
- :mod:`~scry.pgbouncer.views` and :mod:`~scry.pgbouncer.stats`: the SHOW views;
- :mod:`~scry.pgbouncer.commands`: RELOAD, SET, PAUSE, KILL ... and the reload;
- :mod:`~scry.pgbouncer.results`: result sets and errors on the wire;
- :mod:`~scry.pgbouncer.state`: the flags commands leave on the proxy.

This module is the way in: the login hook, the Unix socket listener, and the
names the rest of scry imports. Column names, order and types follow
PgBouncer 1.25; what scry does not count is listed in
docs/migrating-from-pgbouncer.md. Errors use PgBouncer's messages and its
SQLSTATE (08P01 for every console error, as PgBouncer sends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import stat
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scry.log import event
from scry.pgbouncer.commands import reload_pgbouncer_config
from scry.pgbouncer.dispatch import AdminConsole
from scry.pgbouncer.results import ADMIN_DB
from scry.pgbouncer.session import ConsoleSession
from scry.pgbouncer.state import ConsoleState, autodb_target, state_for
from scry.protocol.errors import PROTOCOL_VIOLATION
from scry.relay_core import AUTH

if TYPE_CHECKING:
    from scry.client import ClientConnection
    from scry.protocol.startup import StartupMessage
    from scry.proxy import Proxy

__all__ = [
    "AdminConsole", "ConsoleSession", "ConsoleState", "reload_pgbouncer_config",
    "drop_unix_sockets", "remove_unix_socket", "route_login", "start_unix_listener", "state_for",
]  # fmt: skip


def route_login(
    client: ClientConnection, packet: StartupMessage, params: dict[str, str], method: str
) -> bool:
    """Called by ``ClientConnection._begin_login`` when the config has a
    ``pgbouncer`` section, before the target lookup, with the auth method for
    this login. Returns True when it took the connection (the console, a
    refusal, or a login held by SUSPEND); False to go on as usual.

    Also applies DISABLE and makes databases from the ``*`` fallback entry.
    """
    proxy = client.proxy
    compat = proxy.config.pgbouncer
    if compat is None:
        return False
    state = state_for(proxy)
    database = packet.database
    if database == ADMIN_DB:
        _hand_to_console(client, packet, state, method)
        return True
    if state.shutting_down:
        client.fatal("57P01", "pooler is shutting down")
        return True
    if database in state.disabled:
        client.fatal(PROTOCOL_VIOLATION, f"database does not allow connections: {database}")
        return True
    if state.suspended:
        # PgBouncer leaves new connections in the listen backlog until RESUME;
        # scry reads their StartupMessage first, so the console stays reachable.
        client.state = AUTH  # (as while auth_query looks: what comes waits in _startup_buf)
        client.transport.pause_reading()
        # PgBouncer accepts such a client only at RESUME, so client_login_timeout
        # counts from then (the janitor's clock: connected_clock is only its).
        client.connected_clock = math.inf
        state.held_logins.append(lambda: _release_held_login(client, packet, params, method))
        return True
    if database not in proxy.targets and compat.autodb is not None:
        autodb_target(proxy, database)  # (registered in proxy.targets)
    # (A [users] line is applied by Pool, from Config.pool_settings; a PAUSE
    # or KILL that came before the pool existed, by Proxy.pool_for.)
    return False


def remove_unix_socket(proxy: Proxy) -> None:
    """At exit: remove the socket file this process made, unless a scry that
    replaced it (``--replace``) took the socket over or made its own at that
    path since."""
    state = state_for(proxy)
    if state.unix_path is None or proxy.listeners_handed_over:
        return
    with contextlib.suppress(OSError):
        if _file_identity(state.unix_path) == state.unix_file:
            os.unlink(state.unix_path)


def drop_unix_sockets(socks: Sequence[socket.socket]) -> None:
    """Close Unix listening sockets taken over that this process does not
    serve (its ini moved or dropped ``unix_socket_dir``), and remove their
    files: the process that made them handed them over and leaves them be."""
    for sock in socks:
        with contextlib.suppress(OSError):
            path = sock.getsockname()
            if isinstance(path, str) and path and stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        sock.close()


def _socket_at(path: str, socks: Sequence[socket.socket]) -> socket.socket | None:
    """The one of ``socks`` bound at ``path`` (the same file however written)."""
    here = os.path.abspath(path)
    return next((sock for sock in socks if os.path.abspath(sock.getsockname()) == here), None)


def _file_identity(path: str) -> tuple[int, int, int]:
    # (An inode number alone may be reused at once for the replacement's file.)
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_ctime_ns


def _release_held_login(
    client: ClientConnection, packet: StartupMessage, params: dict[str, str], method: str
) -> None:
    """RESUME: go on with a login that SUSPEND held (unless it left meanwhile)."""
    if client.state is not AUTH:
        return
    client.connected_clock = time.monotonic()
    client.transport.resume_reading()
    if not route_login(client, packet, params, method):
        client.login_to_database(params, method)


def _hand_to_console(
    client: ClientConnection, packet: StartupMessage, state: ConsoleState, method: str
) -> None:
    from scry.client import CLOSED

    proxy = client.proxy
    transport = client.transport
    rest = bytes(client._startup_buf)
    client._startup_buf.clear()
    client.state = CLOSED  # the ClientConnection is done; the session owns the transport
    proxy.on_client_closed(client)
    session = ConsoleSession(
        proxy, transport, packet.user, tls=client.tls, state=state, method=method
    )
    transport.set_protocol(session)
    session.start(client.connected_at)
    if rest:
        session.data_received(rest)


async def start_unix_listener(
    proxy: Proxy, inherited: Sequence[socket.socket] = ()
) -> asyncio.Server:
    """Listen on ``unix_socket_dir/.s.PGSQL.<port>`` as PgBouncer does (called
    from ``Proxy.start``); a stale socket file from a dead process is replaced.

    ``inherited``: Unix sockets a rolling restart took over (``--replace``).
    The one bound at this path is listened on as it is, so the connections in
    its accept queue are served here; any other is closed and its file removed.
    """
    from scry.client import ClientConnection

    compat = proxy.config.pgbouncer
    assert compat is not None and compat.unix_socket_dir
    path = os.path.join(compat.unix_socket_dir, f".s.PGSQL.{proxy.listen_port}")
    taken = _socket_at(path, inherited)
    drop_unix_sockets([sock for sock in inherited if sock is not taken])
    loop = asyncio.get_running_loop()
    if taken is not None:
        server = await loop.create_unix_server(
            lambda: ClientConnection(proxy), sock=taken, backlog=proxy.config.listen_backlog
        )
    else:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)
        server = await loop.create_unix_server(
            lambda: ClientConnection(proxy), path, backlog=proxy.config.listen_backlog
        )
    state = state_for(proxy)
    state.unix_path = path
    os.chmod(path, compat.unix_socket_mode)
    if compat.unix_socket_group:
        import grp

        os.chown(path, -1, grp.getgrnam(compat.unix_socket_group).gr_gid)
    state.unix_file = _file_identity(path)  # (after chmod and chown: they change its ctime)
    event("listening", addr=f"unix:{path}")
    return server
