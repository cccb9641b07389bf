"""TCP options of scry's sockets: PgBouncer's ``tcp_keepalive`` family,
``tcp_user_timeout`` and ``tcp_socket_buffer``.

They are set on the client listeners, at start and again on reload. On
Linux an accepted connection inherits them from its listening socket, so a
login costs no system call for them. A server connection gets them when it
opens. (A buffer size, once set, turns the kernel's autotuning off for that
socket: set back to 0, it stays on the listener until a restart.)
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

# setsockopt refuses 0 for these, so "0 = the operating system's value" is
# applied by reading the system's value (a reload may have to undo a setting).
_KEEPALIVE_SYSCTLS = (
    ("TCP_KEEPIDLE", "tcp_keepidle", "tcp_keepalive_time"),
    ("TCP_KEEPINTVL", "tcp_keepintvl", "tcp_keepalive_intvl"),
    ("TCP_KEEPCNT", "tcp_keepcnt", "tcp_keepalive_probes"),
)


class TcpSettings(Protocol):
    """The part of scry.config.Config read here."""

    tcp_keepalive: bool
    tcp_keepidle: int
    tcp_keepintvl: int
    tcp_keepcnt: int
    tcp_user_timeout: int
    tcp_socket_buffer: int


def _system_value(sysctl: str) -> int | None:
    try:
        with open(f"/proc/sys/net/ipv4/{sysctl}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def set_tcp_options(sock: Any, settings: TcpSettings, *, fresh: bool) -> None:
    """Apply ``settings`` to a TCP socket (anything else is left alone).

    ``fresh``: the socket was just made, so options still at the system's
    value need no call; a listener being re-tuned on reload gets every one.
    """
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    if settings.tcp_keepalive or not fresh:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(settings.tcp_keepalive))
    for option_name, key, sysctl in _KEEPALIVE_SYSCTLS:
        option = getattr(socket, option_name, None)
        value = getattr(settings, key)
        if option is None or (fresh and not value):
            continue
        value = value or _system_value(sysctl)
        if value:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    if settings.tcp_socket_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.tcp_socket_buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, settings.tcp_socket_buffer)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None and (settings.tcp_user_timeout or not fresh):
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, settings.tcp_user_timeout)
