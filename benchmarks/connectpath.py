"""Micro-benchmark of scry's per-connection Python work (pgbench -C), without sockets.

Drives N whole client lifetimes through the proxy with fake transports, the
way ``pgbench -C -S`` uses it: StartupMessage, md5 password exchange, login
greeting, one ``SELECT`` answered by an idle pooled server, Terminate. Prints
the user-space microseconds per connection. Use it with a profiler:

    .venv/bin/python benchmarks/connectpath.py
    .venv/bin/python -m cProfile -s tottime benchmarks/connectpath.py 20000 | head -40
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import sys
import time

from hotpath import FakeTransport  # type: ignore[import-not-found]

from scry.client import ClientConnection
from scry.config import Config
from scry.protocol import messages as m
from scry.proxy import Proxy
from scry.server import IDLE, ServerConnection

USER, PASSWORD = "app", "pw"


def startup_packet() -> bytes:
    body = struct.pack("!i", 196608)
    for key, value in (("user", USER), ("database", "app"), ("application_name", "pgbench"),
                       ("client_encoding", "UTF8")):  # fmt: skip
        body += key.encode() + b"\0" + value.encode() + b"\0"
    body += b"\0"
    return struct.pack("!i", len(body) + 4) + body


class Capture(FakeTransport):
    def __init__(self) -> None:
        super().__init__()
        self.last = b""

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.last = data


async def main(n: int) -> None:
    config = Config.model_validate(
        {
            "database_url": f"postgres://{USER}:{PASSWORD}@127.0.0.1:5432/app",
            "pool": {"mode": "transaction", "max_client_conn": 1000},
            "auth": {"type": "md5", "users": [{"name": USER, "password": PASSWORD}]},
            "log": {"level": "warning"},
        }
    )
    proxy = Proxy(config)
    target = proxy.targets["app"]
    pool = proxy.pool_for(target, USER, PASSWORD)
    pool.welcome = {"server_version": "15.0", "client_encoding": "UTF8", "DateStyle": "ISO, MDY"}
    server = ServerConnection(pool)
    server.transport = FakeTransport()
    server.state = IDLE
    pool.servers.add(server)
    pool.idle.append(server)
    inner = hashlib.md5((PASSWORD + USER).encode()).hexdigest()
    startup = startup_packet()
    query = m.query("SELECT abalance FROM pgbench_accounts WHERE aid = 4242;")
    response = (
        m.row_description([("abalance", 23)])
        + m.data_row(["0"])
        + m.command_complete("SELECT 1")
        + m.ready_for_query()
    )
    terminate = b"X\x00\x00\x00\x04"

    def one() -> None:
        client = ClientConnection(proxy)
        transport = Capture()
        client.connection_made(transport)
        client.data_received(startup)
        salt = transport.last[-4:]
        digest = "md5" + hashlib.md5(inner.encode() + salt).hexdigest()
        client.data_received(b"p" + struct.pack("!i", len(digest) + 5) + digest.encode() + b"\0")
        assert transport.last.endswith(b"Z\x00\x00\x00\x05I"), transport.last[-20:]
        client.data_received(query)
        server.data_received(response)
        client.data_received(terminate)
        client.connection_lost(None)

    for _ in range(500):
        one()
    start = time.process_time()  # CPU time: steady even on a busy machine
    for _ in range(n):
        one()
    elapsed = time.process_time() - start
    print(f"{elapsed / n * 1e6:.1f} us per connection ({n} connections)")
    proxy.stop_now()


if __name__ == "__main__":
    counts = [a for a in sys.argv[1:] if a.isdigit()]
    asyncio.run(main(int(counts[0]) if counts else 20_000))
