"""systemd's service notifications (``sd_notify``), as PgBouncer sends them.

Debian's own ``pgbouncer.service`` is ``Type=notify``: systemd waits for
``READY=1`` before it counts the service as started, and kills it when that
never comes. So scry says ``READY=1`` once its listeners are up,
``RELOADING=1`` (with ``MONOTONIC_USEC``, for ``Type=notify-reload``) and
``READY=1`` again around a SIGHUP reload, and ``STOPPING=1`` when a signal
starts its shutdown. A notification is one datagram to the Unix socket named
by ``$NOTIFY_SOCKET``; without it (not run by systemd) nothing is sent.
With ``workers``, the supervisor speaks for its workers
(:class:`WorkerNotifications`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable


def manager_present() -> bool:
    """Whether a service manager listens (``$NOTIFY_SOCKET`` names a socket)."""
    return os.environ.get("NOTIFY_SOCKET", "").startswith(("/", "@"))


def notify(*fields: str) -> bool:
    """Send ``fields`` (``"READY=1"``...) to the service manager; False when
    there is none or it cannot be reached (never an error for the caller)."""
    if not manager_present():  # (nor a vsock: address, which is for VMs)
        return False
    address = os.environ["NOTIFY_SOCKET"]
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


def reload(apply: Callable[[], object]) -> None:
    """Run ``apply`` (a reload) between ``RELOADING=1`` and ``READY=1``."""
    reloading()
    try:
        apply()
    finally:
        notify("READY=1")


class WorkerNotifications:
    """A supervisor's end of its workers' notifications.

    systemd hears from the supervisor only (it is the service's main
    process). The workers notify a socket of the supervisor's instead (their
    ``NOTIFY_SOCKET``), which tells systemd ``READY=1`` once each of the
    ``expected`` workers alive has said it, at start and again after a
    reload. The kernel names each sender's pid (``SO_PASSCRED``).
    """

    def __init__(self, live_pids: Callable[[], set[int]], expected: int, status: str) -> None:
        self._live_pids = live_pids
        self._expected = expected
        self._status = status
        self._dir = tempfile.mkdtemp(prefix="scry-notify-")  # (0700: only we send here)
        self.path = os.path.join(self._dir, "notify")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)
        self._sock.bind(self.path)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._ready: set[int] = set()
        self._owed = True  # READY=1, once every worker is ready

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self._sock.fileno(), self._receive)

    def reloading(self) -> None:
        """The workers are about to reload: READY=1 again when all have."""
        reloading()
        self._ready.clear()
        self._owed = True

    def _receive(self) -> None:
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except (BlockingIOError, InterruptedError):
                break
            for level, kind, cred in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("i", cred[:4])[0]
                    if b"READY=1" in data.split(b"\n"):
                        self._ready.add(pid)
        live = self._live_pids()
        if self._owed and len(live) == self._expected and live <= self._ready:
            self._owed = False
            notify("READY=1", f"STATUS={self._status}")

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._sock.fileno())
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
