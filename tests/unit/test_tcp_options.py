"""scry.tcp_options on real kernel sockets: what is set, what a reload undoes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from scry.config import ConfigError, load_config
from scry.tcp_options import set_tcp_options


@dataclass
class Settings:
    tcp_keepalive: bool = True
    tcp_keepidle: int = 0
    tcp_keepintvl: int = 0
    tcp_keepcnt: int = 0
    tcp_user_timeout: int = 0
    tcp_socket_buffer: int = 0


def system(name: str) -> int:
    return int(Path(f"/proc/sys/net/ipv4/{name}").read_text())


def options(sock: socket.socket) -> tuple[int, int, int, int, int]:
    tcp = socket.IPPROTO_TCP
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(tcp, socket.TCP_KEEPIDLE),
        sock.getsockopt(tcp, socket.TCP_KEEPINTVL),
        sock.getsockopt(tcp, socket.TCP_KEEPCNT),
        sock.getsockopt(tcp, socket.TCP_USER_TIMEOUT),
    )


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def test_accepted_connections_inherit_the_listeners_options(listener) -> None:
    set_tcp_options(
        listener,
        Settings(
            tcp_keepidle=77, tcp_keepintvl=11, tcp_keepcnt=4, tcp_user_timeout=12345,
            tcp_socket_buffer=50000,
        ),
        fresh=False,
    )  # fmt: skip
    with socket.create_connection(listener.getsockname()):
        accepted, _ = listener.accept()
        with accepted:
            assert options(accepted) == (1, 77, 11, 4, 12345)
            # (the kernel doubles a buffer size it is given)
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 100000
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 100000


def test_a_reload_back_to_zero_restores_the_systems_values(listener) -> None:
    set_tcp_options(
        listener, Settings(tcp_keepidle=77, tcp_keepintvl=11, tcp_keepcnt=4), fresh=False
    )
    set_tcp_options(listener, Settings(tcp_keepalive=False), fresh=False)
    system_values = (
        system("tcp_keepalive_time"),
        system("tcp_keepalive_intvl"),
        system("tcp_keepalive_probes"),
    )
    assert options(listener) == (0, *system_values, 0)


def test_a_fresh_socket_keeps_the_systems_values_unless_told(listener) -> None:
    with socket.create_connection(listener.getsockname()) as sock:
        before = options(sock)
        set_tcp_options(sock, Settings(), fresh=True)
        assert options(sock) == (1, *before[1:])
    with socket.create_connection(listener.getsockname()) as sock:
        set_tcp_options(sock, Settings(tcp_keepalive=False, tcp_keepcnt=3), fresh=True)
        assert options(sock) == (0, *before[1:3], 3, 0)


def test_unix_sockets_are_left_alone(tmp_path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        set_tcp_options(sock, Settings(tcp_keepidle=5), fresh=False)  # would raise if tried


def test_config_defaults_and_bounds_name_the_key(tmp_path) -> None:
    def load(extra: str):
        path = tmp_path / "scry.yaml"
        path.write_text("database_url: postgresql://u:p@localhost/db\n" + extra)
        return load_config(path, env={})

    config = load("")
    assert (config.tcp_keepalive, config.tcp_keepidle, config.tcp_user_timeout) == (True, 0, 0)
    with pytest.raises(ConfigError, match="tcp_keepcnt"):
        load("tcp_keepcnt: -1\n")
    with pytest.raises(ConfigError, match="tcp_keepidle"):
        load("tcp_keepidle: true\n")
