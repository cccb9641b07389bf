"""Workers and peering: cancel requests find their query whichever worker the kernel picks.

With ``workers: 4`` every CancelRequest lands on a random worker (SO_REUSEPORT
hashes the new connection's ports); about three in four need forwarding to
the worker that owns the key (scry.peering). A cancel must reach exactly its
own query and never another client's.
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import time

import asyncpg
import psycopg
import pytest
from psycopg import errors

from scry.peering import KEY_MASK, VIA_LOCAL, VIA_PEER, key_owner, new_cancel_key
from scry.protocol.startup import cancel_request

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

ROUNDS = 5
CLIENTS = 40  # per round; half are cancelled first, then the other half


def wait_workers(proxy, workers: int, wait_until) -> None:
    """Every worker listens (readiness of the fixture = the first one)."""
    wait_until(
        lambda: len(set(re.findall(r"listening .*worker=(\d+)", proxy.log_text()))) >= workers,
        15,
        what=f"{workers} workers listening",
    )


async def _active_markers(admin_dsn: str) -> set[str]:
    async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as conn:
        rows = await (
            await conn.execute(
                "select substring(query from 'mark_(\\d+)') from pg_stat_activity"
                " where state = 'active' and query like '%%pg_sleep(10)%%mark_%%'"
                " and pid <> pg_backend_pid()"
            )
        ).fetchall()
    return {r[0] for r in rows if r[0]}


async def _one_round(proxy, admin_dsn: str, round_no: int) -> list[float]:
    conns = [
        await psycopg.AsyncConnection.connect(**proxy.conninfo(), autocommit=True)
        for _ in range(CLIENTS)
    ]
    try:
        markers = [f"{round_no}{i:03d}" for i in range(CLIENTS)]
        outcomes: dict[str, str] = {}
        ended: dict[str, float] = {}

        async def sleeper(conn, marker: str) -> None:
            try:
                await conn.execute(f"select pg_sleep(10) /* mark_{marker} */")
                outcomes[marker] = "finished"
            except errors.QueryCanceled:
                outcomes[marker] = "cancelled"
            ended[marker] = time.monotonic()

        tasks = [asyncio.create_task(sleeper(c, m)) for c, m in zip(conns, markers, strict=True)]
        deadline = time.monotonic() + 15
        while await _active_markers(admin_dsn) != set(markers):
            assert time.monotonic() < deadline, "not every pg_sleep started"
            await asyncio.sleep(0.05)

        order = list(range(CLIENTS))
        random.shuffle(order)
        first, second = order[: CLIENTS // 2], order[CLIENTS // 2 :]
        latencies = []
        for half, others in ((first, second), (second, [])):
            sent = time.monotonic()
            # Each cancel is a new TCP connection: the kernel picks its worker.
            await asyncio.gather(*(conns[i].cancel_safe(timeout=5) for i in half))
            await asyncio.wait([tasks[i] for i in half], timeout=5)
            for i in half:
                marker = markers[i]
                assert outcomes.get(marker) == "cancelled", f"cancel of {marker} did not work"
                latencies.append(ended[marker] - sent)
            # None of them cancelled another client's query: those still run.
            assert not any(tasks[i].done() for i in others)
            assert {markers[i] for i in others} <= await _active_markers(admin_dsn)
        await asyncio.gather(*tasks)
        return latencies
    finally:
        for conn in conns:
            await conn.close()


def test_cancels_across_four_workers(scry_proxy, admin_dsn, wait_until) -> None:
    proxy = scry_proxy(
        {"workers": 4, "pool": {"size": 4 * CLIENTS}, "timeouts": {"query_wait_timeout": 30}}
    )
    wait_workers(proxy, 4, wait_until)

    async def run() -> list[float]:
        latencies: list[float] = []
        for round_no in range(1, ROUNDS + 1):
            latencies += await _one_round(proxy, admin_dsn, round_no)
        return latencies

    started = time.monotonic()
    latencies = asyncio.run(run())
    assert len(latencies) == ROUNDS * CLIENTS == 200
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    assert time.monotonic() - started < 30


def test_cancel_key_of_unknown_peer_is_dropped(scry_proxy, wait_until) -> None:
    """A key naming a peer nobody configured goes nowhere (and nothing breaks)."""
    proxy = scry_proxy({"workers": 2, "peer_id": 3})
    wait_workers(proxy, 2, wait_until)
    pid, secret = new_cancel_key(9, 0)
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", proxy.port)) as s:
            s.sendall(cancel_request(pid, secret))
    with psycopg.connect(**proxy.conninfo()) as conn:
        assert conn.execute("select 1").fetchone() == (1,)


def test_cancel_forwarded_to_tcp_peer(scry_proxy, wait_until) -> None:
    """Two instances behind one (simulated) load balancer: a cancel sent to the
    wrong one is forwarded to the owner over TCP (PgBouncer's [peers])."""
    a = scry_proxy({"workers": 2, "peer_id": 1}, start=False)
    b = scry_proxy({"workers": 2, "peer_id": 2}, start=False)
    peers = {1: f"127.0.0.1:{a.port}", 2: f"127.0.0.1:{b.port}"}
    a.update_config({"peers": peers})
    b.update_config({"peers": peers})
    a.start()
    b.start()
    wait_workers(a, 2, wait_until)
    wait_workers(b, 2, wait_until)

    async def run() -> float:
        conn = await asyncpg.connect(
            host="127.0.0.1", port=a.port, user="app", password="app_pass",
            database="app", ssl=False, statement_cache_size=0,
        )  # fmt: skip
        try:
            pid = conn._protocol.backend_pid
            secret = conn._protocol.backend_secret & 0xFFFFFFFF  # asyncpg keeps it signed
            query = asyncio.create_task(conn.execute("select pg_sleep(10)"))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            _, writer = await asyncio.open_connection("127.0.0.1", b.port)  # the wrong one
            writer.write(cancel_request(pid, secret))
            await writer.drain()
            writer.close()
            with pytest.raises(asyncpg.QueryCanceledError):
                await asyncio.wait_for(query, 5)
            return time.monotonic() - started
        finally:
            await conn.close()

    assert asyncio.run(run()) < 2


def test_cancel_key_layout() -> None:
    for peer, worker in ((0, 0), (1, 3), (16383, 63), (7, 0)):
        for _ in range(100):
            pid, secret = new_cancel_key(peer, worker)
            assert 0 < pid < 2**31 and 0 <= secret < 2**32
            assert key_owner(pid) == (peer, worker)
            assert pid & KEY_MASK == pid  # registered keys carry no hop flags
            assert key_owner(pid | VIA_PEER | VIA_LOCAL) == (peer, worker)
            assert (pid | VIA_PEER | VIA_LOCAL) & KEY_MASK == pid
