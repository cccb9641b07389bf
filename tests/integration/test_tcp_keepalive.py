"""TCP keepalive on a running scry's sockets, client side and server side.

The kernel lists every TCP socket in /proc/net/tcp with its pending timer:
an established socket with keepalive on has its keepalive timer armed
(``tr`` 2), due in at most ``tcp_keepidle`` seconds; with keepalive off
there is none (``tr`` 0). The sockets are scry's own, found by inode.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

ESTABLISHED = "01"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class TcpSocket:
    local_port: int
    remote_port: int
    timer: int  # 0 none, 1 retransmit, 2 keepalive, ...
    due_in: float  # seconds


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def sockets_of(pid: int) -> list[TcpSocket]:
    """The established TCP sockets process ``pid`` holds."""
    inodes = socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, timer, inode = (
                fields[1],
                fields[2],
                fields[3],
                fields[5],
                fields[9],
            )
            if inode not in inodes or state != ESTABLISHED:
                continue
            kind, _, when = timer.partition(":")
            found.append(
                TcpSocket(
                    local_port=int(local.rsplit(":", 1)[1], 16),
                    remote_port=int(remote.rsplit(":", 1)[1], 16),
                    timer=int(kind, 16),
                    due_in=int(when, 16) / CLOCK_TICKS,
                )
            )
    return found


def client_and_server_sockets(proxy, pg) -> tuple[list[TcpSocket], list[TcpSocket]]:
    # Right after an answer a socket may still show its retransmit timer (1)
    # until the peer's ACK: wait (bounded) for the connections to go quiet.
    deadline = time.monotonic() + 5
    held = sockets_of(proxy.pid)
    while any(s.timer == 1 for s in held) and time.monotonic() < deadline:
        time.sleep(0.05)
        held = sockets_of(proxy.pid)
    clients = [s for s in held if s.local_port == proxy.port]
    servers = [s for s in held if s.remote_port == pg.port]
    assert clients and servers, held
    return clients, servers


def test_keepalive_settings_reach_client_and_server_sockets(scry_proxy, pg, wait_until) -> None:
    proxy = scry_proxy({"tcp_keepidle": 77, "tcp_keepintvl": 11, "tcp_keepcnt": 4})
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        clients, servers = client_and_server_sockets(proxy, pg)
        for sock in clients + servers:
            assert sock.timer == 2 and 60 < sock.due_in <= 77, sock

        # A reload re-tunes the listener: the next connection gets the new idle time.
        proxy.update_config({"tcp_keepidle": 333})
        proxy.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
        with psycopg.connect(**proxy.conninfo(), autocommit=True) as second:
            second.execute("select 1")
            clients, _ = client_and_server_sockets(proxy, pg)
            due = sorted(s.due_in for s in clients)
            assert len(due) == 2 and due[0] <= 77 and 300 < due[1] <= 333, clients


def test_keepalive_off_leaves_no_keepalive_timer(scry_proxy, pg) -> None:
    proxy = scry_proxy({"tcp_keepalive": False})
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        clients, servers = client_and_server_sockets(proxy, pg)
        assert all(sock.timer == 0 for sock in clients + servers), clients + servers


def test_keepalive_is_on_by_default_with_the_systems_idle_time(scry_proxy, pg) -> None:
    system_idle = int(Path("/proc/sys/net/ipv4/tcp_keepalive_time").read_text())
    proxy = scry_proxy()
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        clients, servers = client_and_server_sockets(proxy, pg)
        for sock in clients + servers:
            assert sock.timer == 2 and system_idle - 60 < sock.due_in <= system_idle, sock
