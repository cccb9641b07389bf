"""listen_backlog and tcp_socket_buffer on a running scry's own sockets.

``ss`` reads them from the kernel: a listening socket's Send-Q is its
backlog, and ``skmem`` holds each socket's receive (``rb``) and send
(``tb``) buffer sizes, which the kernel sets to twice what was asked. The
sockets are scry's, found by the inodes in /proc/PID/fd.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import psycopg
from test_tcp_keepalive import socket_inodes


def ss(*args: str) -> list[str]:
    """One line per socket (``ss`` puts skmem on a continuation line)."""
    out = subprocess.run(["ss", "-neH", *args], capture_output=True, text=True, check=True)
    lines: list[str] = []
    for line in out.stdout.splitlines():
        if line[:1].isspace() and lines:
            lines[-1] += line
        else:
            lines.append(line)
    return lines


def listen_backlog(pid: int, port: int) -> int:
    """Send-Q of the TCP listener on ``port`` that process ``pid`` holds."""
    mine = socket_inodes(pid)
    for line in ss("-lt"):
        fields = line.split()
        inode = re.search(r"ino:(\d+)", line)
        if fields[3].endswith(f":{port}") and inode and inode.group(1) in mine:
            return int(fields[2])
    raise AssertionError(f"no listener on {port} in {ss('-lt')}")


def buffers(pid: int, port: int) -> list[tuple[int, int]]:
    """(rb, tb) of each established TCP socket of ``pid`` with ``port`` at either end."""
    mine = socket_inodes(pid)
    found = []
    for line in ss("-tm", "state", "established"):
        inode = re.search(r"ino:(\d+)", line)
        sizes = re.search(r"skmem:\(r\d+,rb(\d+),t\d+,tb(\d+)", line)
        if inode and sizes and inode.group(1) in mine and f":{port} " in line:
            found.append((int(sizes.group(1)), int(sizes.group(2))))
    return found


def test_listen_backlog_is_set_and_reloaded(scry_proxy, wait_until) -> None:
    proxy = scry_proxy({"listen_backlog": 77})
    assert listen_backlog(proxy.pid, proxy.port) == 77
    proxy.update_config({"listen_backlog": 99})
    proxy.send_signal(signal.SIGHUP)
    wait_until(lambda: "config reloaded" in proxy.log_text(), 5, what="config reloaded")
    assert listen_backlog(proxy.pid, proxy.port) == 99


def test_default_backlog_is_scrys(scry_proxy) -> None:
    proxy = scry_proxy()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert listen_backlog(proxy.pid, proxy.port) == min(4096, somaxconn)


def test_tcp_socket_buffer_sizes_client_and_server_sockets(scry_proxy, pg) -> None:
    proxy = scry_proxy({"tcp_socket_buffer": 50000})
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
        clients, servers = buffers(proxy.pid, proxy.port), buffers(proxy.pid, pg.port)
        assert clients and servers
        assert set(clients + servers) == {(100000, 100000)}, (clients, servers)


def test_without_tcp_socket_buffer_the_kernel_sizes_them(scry_proxy, pg) -> None:
    proxy = scry_proxy()
    with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
        conn.execute("select 1")
        sizes = buffers(proxy.pid, proxy.port) + buffers(proxy.pid, pg.port)
        assert sizes and (100000, 100000) not in sizes, sizes
