"""Micro-benchmark of scry's per-connection Python work (pgbench -C), without sockets.

Drives N whole client lifetimes through the proxy with fake transports, the
way ``pgbench -C -S`` uses it: StartupMessage, md5 password exchange, login
greeting, one ``SELECT`` answered by an idle pooled server, Terminate. Prints
the CPU microseconds per connection, per callback, and the observability
drain's share (run when the queue reaches ``drain_at``, as live;
``--no-observe`` turns observability off). ``--cold`` evicts the CPU
caches before every callback (see steps.py): the live cost. ``--floor`` runs the
same connections through benchmarks/floor_pooler.py, for comparison. Use it
with a profiler:

    .venv/bin/python benchmarks/connectpath.py [--cold[=KIB]] [--floor | --no-observe] [N]
    .venv/bin/python -m cProfile -s tottime benchmarks/connectpath.py 20000 | head -40
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import struct
import sys

from hotpath import FakeTransport  # type: ignore[import-not-found]
from steps import Steps, cold_kib_from_argv  # type: ignore[import-not-found]

from scry.client import CLOSED, ClientConnection
from scry.client_login import startup_settings
from scry.config import Config
from scry.protocol import messages as m
from scry.protocol.startup import read_startup_packet
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


def _exchange() -> tuple[bytes, bytes, bytes, bytes]:
    """startup packet, Query, the server's answer, Terminate."""
    query = m.query("SELECT abalance FROM pgbench_accounts WHERE aid = 4242;")
    response = (
        m.row_description([("abalance", 23)])
        + m.data_row(["0"])
        + m.command_complete("SELECT 1")
        + m.ready_for_query()
    )
    return startup_packet(), query, response, b"X\x00\x00\x00\x04"


def _password_message(salt: bytes) -> bytes:
    inner = hashlib.md5((PASSWORD + USER).encode()).hexdigest()
    digest = "md5" + hashlib.md5(inner.encode() + salt).hexdigest()
    return b"p" + struct.pack("!i", len(digest) + 5) + digest.encode() + b"\0"


def _run(steps: Steps, n: int, one) -> None:  # type: ignore[no-untyped-def]
    for _ in range(500):
        one()
    steps.reset()
    for _ in range(n):
        one()


async def main(n: int, cold_kib: int, observe: bool = True) -> None:
    config = Config.model_validate(
        {
            "observability": {"fingerprinting": observe},
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
    startup, query, response, terminate = _exchange()
    # The backend already has pgbench's settings (the first client's SET did
    # that live): no SET per connection, whose answer this script lacks.
    packet, _ = read_startup_packet(startup)  # type: ignore[misc]
    server.applied = startup_settings(packet.params)  # type: ignore[union-attr]
    steps = Steps([*STEP_NAMES, "drain"], cold_kib)
    observatory = proxy.observatory

    def drain_when_due() -> None:
        # What the live drain does when the server wakes it at drain_at
        # records; without it the queue only grows.
        if len(observatory.queue) >= observatory.drain_at:
            observatory.drain()

    def one() -> None:
        client = ClientConnection(proxy)
        transport = Capture()
        steps.run([(client.connection_made, (transport,)), (client.data_received, (startup,))])
        password = _password_message(transport.last[-4:])
        steps.run(
            [
                (client.data_received, (password,)),
                (client.data_received, (query,)),
                (server.data_received, (response,)),
                (client.data_received, (terminate,)),
                (client.connection_lost, (None,)),
                (drain_when_due, ()),
            ]
        )
        assert client.state is CLOSED and transport.last == response, transport.last[-20:]
        assert server in pool.idle, "the server was not given back clean"

    _run(steps, n, one)
    assert len(observatory.queue) < observatory.drain_at, "the drain fell behind"
    assert observatory.records_processed or not observe, "nothing was drained"
    print(steps.report("connection"))
    proxy.stop_now()


async def main_floor(n: int, cold_kib: int) -> None:
    """The same connections through benchmarks/floor_pooler.py's protocol classes."""
    import floor_pooler as floor  # type: ignore[import-not-found]

    pool = floor.Pool(argparse.Namespace(user=USER, password=PASSWORD, pool_size=20))
    server = floor.Server(pool)
    server.transport = FakeTransport()
    server.ready.set_result(None)
    pool.idle.append(server)
    pool.size = 1
    startup, query, response, terminate = _exchange()
    steps = Steps(STEP_NAMES, cold_kib)

    def one() -> None:
        client = floor.Client(pool)
        transport = Capture()
        steps.run([(client.connection_made, (transport,)), (client.data_received, (startup,))])
        password = _password_message(transport.last[-4:])
        steps.run(
            [
                (client.data_received, (password,)),
                (client.data_received, (query,)),
                (server.data_received, (response,)),
                (client.data_received, (terminate,)),
                (client.connection_lost, (None,)),
            ]
        )
        assert client.closed and transport.last == response, transport.last[-20:]

    _run(steps, n, one)
    print("floor_pooler.py: " + steps.report("connection"))


STEP_NAMES = ["made", "startup", "password", "query", "answer", "terminate", "lost"]

if __name__ == "__main__":
    counts = [a for a in sys.argv[1:] if a.isdigit()]
    cold = cold_kib_from_argv(sys.argv[1:])
    count = int(counts[0]) if counts else (3_000 if cold else 20_000)
    if "--floor" in sys.argv:
        asyncio.run(main_floor(count, cold))
    else:
        asyncio.run(main(count, cold, observe="--no-observe" not in sys.argv))
