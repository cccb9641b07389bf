"""Micro-benchmark of scry's per-transaction Python work, without sockets.

Drives one client and one server connection through N simple-query
transactions (the shape of pgbench -S: Query in; RowDescription, DataRow,
CommandComplete, ReadyForQuery out) with fake transports, and prints the
user-space microseconds per transaction. ``--contended`` runs 50 clients on
20 servers (pgbench -c 50 against pool 20): every transaction then queues
for a server and takes it over from the previous client. ``--cold`` evicts the
CPU caches before every callback (see steps.py); ``--floor`` runs the same
transactions through benchmarks/floor_pooler.py. Use it with a profiler:

    .venv/bin/python benchmarks/hotpath.py [--no-observe] [--contended] [--cold[=KIB]] [--floor]
    .venv/bin/python -m cProfile -s tottime benchmarks/hotpath.py | head -40
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque

from steps import Steps, cold_kib_from_argv  # type: ignore[import-not-found]

from scry.client import READY, ClientConnection
from scry.config import Config
from scry.hybrid import SessionTracker, TransactionTracker
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


def _setup(n_servers: int) -> tuple[Proxy, object, list[ServerConnection]]:
    config = Config.model_validate(
        {"database_url": "postgres://app:pw@127.0.0.1:5432/app", "pool": {"mode": "transaction"}}
    )
    proxy = Proxy(config)
    target = proxy.targets["app"]
    pool = proxy.pool_for(target, "app", "pw")
    pool.welcome = {}
    servers = []
    for _ in range(n_servers):
        server = ServerConnection(pool)
        server.transport = FakeTransport()
        server.state = IDLE
        pool.servers.add(server)
        pool.idle.append(server)
        servers.append(server)
    return proxy, pool, servers


def _client(proxy: Proxy, pool: object) -> ClientConnection:
    client = ClientConnection(proxy)
    client.transport = FakeTransport()
    client.state = READY
    client.pool = pool  # type: ignore[assignment]
    client.stats = pool.stats  # type: ignore[attr-defined]
    client.observed = "--no-observe" not in sys.argv
    # As in transaction mode: the drain warns about session state when it runs.
    client.tracker = (
        TransactionTracker(client.id)
        if client.observed
        else SessionTracker(client.id, pinning=False)
    )
    return client


QUERY = m.query("SELECT abalance FROM pgbench_accounts WHERE aid = 4242;")
RESPONSE = (
    m.row_description([("abalance", 23)])
    + m.data_row(["0"])
    + m.command_complete("SELECT 1")
    + m.ready_for_query()
)


async def main(n: int, cold_kib: int) -> None:
    proxy, pool, (server,) = _setup(1)
    client = _client(proxy, pool)
    steps = Steps(["query", "answer"], cold_kib)
    calls = [(client.data_received, (QUERY,)), (server.data_received, (RESPONSE,))]
    for _ in range(1000):
        steps.run(calls)
    steps.reset()
    for _ in range(n):
        steps.run(calls)
    assert server in pool.idle or client in pool.parked  # type: ignore[attr-defined]
    print(steps.report("transaction"))
    proxy.stop_now()


async def main_floor(n: int, cold_kib: int) -> None:
    """The same transactions through benchmarks/floor_pooler.py's protocol classes."""
    import argparse

    import floor_pooler as floor  # type: ignore[import-not-found]

    pool = floor.Pool(argparse.Namespace(user="app", password="pw", pool_size=20))
    server = floor.Server(pool)
    server.transport = FakeTransport()
    server.ready.set_result(None)
    pool.idle.append(server)
    pool.size = 1
    client = floor.Client(pool)
    client.transport = FakeTransport()
    client.authed = True
    steps = Steps(["query", "answer"], cold_kib)
    calls = [(client.data_received, (QUERY,)), (server.data_received, (RESPONSE,))]
    for _ in range(1000):
        steps.run(calls)
    steps.reset()
    for _ in range(n):
        steps.run(calls)
    assert server in pool.idle
    print("floor_pooler.py: " + steps.report("transaction"))


async def main_contended(n: int, n_clients: int = 50, n_servers: int = 20) -> None:
    proxy, pool, servers = _setup(n_servers)
    clients = [_client(proxy, pool) for _ in range(n_clients)]
    for client in clients:
        client.data_received(QUERY)  # 20 get a server, 30 queue

    def run(count: int) -> None:
        busy = deque(s for s in servers if s.client is not None)
        for _ in range(count):
            server = busy.popleft()
            client = server.client
            server.data_received(RESPONSE)  # answered; the server goes to the oldest waiter
            if server.client is not None:
                busy.append(server)
            client.data_received(QUERY)  # its next transaction queues (or gets a server)
            if client.server is not None and client.server not in busy:
                busy.append(client.server)

    run(2000)
    start = time.process_time()
    run(n)
    elapsed = time.process_time() - start
    assert len(pool.waiters) == n_clients - n_servers  # type: ignore[attr-defined]
    print(f"{elapsed / n * 1e6:.2f} us per transaction, contended "
          f"({n_clients} clients, {n_servers} servers, {n} transactions)")  # fmt: skip
    proxy.stop_now()


if __name__ == "__main__":
    counts = [a for a in sys.argv[1:] if a.isdigit()]
    cold = cold_kib_from_argv(sys.argv[1:])
    count = int(counts[0]) if counts else (5_000 if cold else 200_000)
    if "--contended" in sys.argv:
        asyncio.run(main_contended(count))
    else:
        asyncio.run((main_floor if "--floor" in sys.argv else main)(count, cold))
