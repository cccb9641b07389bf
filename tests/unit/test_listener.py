"""The client listener's socket options, on a proxy started in-process (no
PostgreSQL is needed to listen)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from scry.config import Config
from scry.proxy import Proxy

needs_linux = pytest.mark.skipif(
    not hasattr(socket, "TCP_DEFER_ACCEPT"), reason="TCP_DEFER_ACCEPT is Linux's"
)


def config(**extra: Any) -> Config:
    return Config.model_validate(
        {
            "listen_addr": "127.0.0.1:0",  # any free port
            "database_url": "postgres://app:pw@127.0.0.1:1/app",
            "admin": {"enabled": False},
            **extra,
        }
    )


def deferred(proxy: Proxy) -> int:
    (sock,) = proxy.listeners[0].sockets
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT)


@needs_linux
async def test_the_listener_defers_accept_as_pgbouncer_does_and_a_reload_changes_it() -> None:
    proxy = Proxy(config())
    await proxy.start()
    try:
        assert deferred(proxy) > 0
        (sock,) = proxy.listeners[0].sockets
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        proxy.apply_config(config(tcp_defer_accept=False))
        assert deferred(proxy) == 0
        proxy.apply_config(config(tcp_defer_accept=True))
        assert deferred(proxy) > 0
    finally:
        proxy.stop_now()


@needs_linux
async def test_tcp_defer_accept_off_from_the_start() -> None:
    proxy = Proxy(config(tcp_defer_accept=False))
    await proxy.start()
    try:
        assert deferred(proxy) == 0
    finally:
        proxy.stop_now()
