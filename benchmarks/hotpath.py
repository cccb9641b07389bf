"""Micro-benchmark of scry's per-transaction Python work, without sockets.

Drives one client and one server connection through N simple-query
transactions (the shape of pgbench -S: Query in; RowDescription, DataRow,
CommandComplete, ReadyForQuery out) with fake transports, and prints the
user-space microseconds per transaction. Use it with a profiler:

    .venv/bin/python benchmarks/hotpath.py
    .venv/bin/python -m cProfile -s tottime benchmarks/hotpath.py | head -40
"""

from __future__ import annotations

import asyncio
import sys
import time

from scry.client import READY, ClientConnection
from scry.config import Config
from scry.protocol import messages as m
from scry.proxy import Proxy
from scry.server import IDLE, ServerConnection


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += len(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 5432)


async def main(n: int) -> None:
    config = Config.model_validate(
        {"database_url": "postgres://app:pw@127.0.0.1:5432/app", "pool": {"mode": "transaction"}}
    )
    proxy = Proxy(config)
    target = proxy.targets["app"]
    pool = proxy.pool_for(target, "app", "pw")
    pool.welcome = {}
    server = ServerConnection(pool)
    server.transport = FakeTransport()
    server.state = IDLE
    pool.servers.add(server)
    pool.idle.append(server)
    client = ClientConnection(proxy)
    client.transport = FakeTransport()
    client.state = READY
    client.pool = pool
    client.observed = "--no-observe" not in sys.argv
    query = m.query("SELECT abalance FROM pgbench_accounts WHERE aid = 4242;")
    response = (
        m.row_description([("abalance", 23)])
        + m.data_row(["0"])
        + m.command_complete("SELECT 1")
        + m.ready_for_query()
    )
    for _ in range(1000):
        client.data_received(query)
        server.data_received(response)
    start = time.process_time()  # CPU time: steady even on a busy machine
    for _ in range(n):
        client.data_received(query)
        server.data_received(response)
    elapsed = time.process_time() - start
    assert server in pool.idle or client in pool.parked
    print(f"{elapsed / n * 1e6:.2f} us per transaction ({n} transactions)")
    proxy.stop_now()


if __name__ == "__main__":
    counts = [a for a in sys.argv[1:] if a.isdigit()]
    asyncio.run(main(int(counts[0]) if counts else 200_000))
