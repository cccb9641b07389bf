"""systemd's service notifications (``sd_notify``), as PgBouncer sends them.

Debian's own ``pgbouncer.service`` is ``Type=notify``: systemd waits for
``READY=1`` before it counts the service as started, and kills it when that
never comes. So scry says ``READY=1`` once its listeners are up,
``RELOADING=1`` (with ``MONOTONIC_USEC``, for ``Type=notify-reload``) and
``READY=1`` again around a SIGHUP reload, and ``STOPPING=1`` when a signal
starts its shutdown. A notification is one datagram to the Unix socket named
by ``$NOTIFY_SOCKET``; without it (not run by systemd) nothing is sent.
"""

from __future__ import annotations

import os
import socket
import time


def notify(*fields: str) -> bool:
    """Send ``fields`` (``"READY=1"``...) to the service manager; False when
    there is none or it cannot be reached (never an error for the caller)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not address.startswith(("/", "@")):  # (vsock: is for VMs)
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError:
        return False
    return True


def reloading() -> bool:
    """A reload begins (``READY=1`` follows when it is done)."""
    now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={now_us}")
