"""PgBouncer's multi-process layout: several scry-pgbouncer processes, each
with its own ini (``so_reuseport = 1``, its own ``peer_id`` and socket
directory), serve one TCP port; ``[peers]`` names each by its socket
directory so that a cancel reaching the wrong process finds its query.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import asyncpg
import psycopg
import pytest
from test_pgbouncer_compat import Bouncer, bouncer_dir

from scry.devcluster import DevCluster
from scry.protocol.startup import cancel_request


def console_clients(directory: Path, port: int) -> int:
    """Clients of database app, as the console on this process's own socket says."""
    with psycopg.connect(
        host=str(directory), port=port, user="admin", password="admin_pass", dbname="pgbouncer",
        autocommit=True,
    ) as conn:  # fmt: skip
        conn.prepare_threshold = None
        cur = conn.execute("SHOW CLIENTS", prepare=False)
        names = [c.name for c in cur.description or []]
        return sum(1 for row in cur.fetchall() if row[names.index("database")] == "app")


async def running_sleep(pg: DevCluster) -> bool:
    async with await psycopg.AsyncConnection.connect(
        pg.dsn(user="postgres", dbname="app", sslmode="disable"), autocommit=True
    ) as conn:
        cur = await conn.execute(
            "select 1 from pg_stat_activity where state = 'active' and query = %s",
            ("select pg_sleep(10)",),
        )
        return await cur.fetchone() is not None


async def cancelled_through(pg: DevCluster, owner: Path, other: Path, port: int) -> None:
    """A query of a client of ``owner``, cancelled through ``other``'s socket."""
    conn = await asyncpg.connect(
        host=str(owner), port=port, user="app", password="app_pass", database="app",
        ssl=False, statement_cache_size=0,
    )  # fmt: skip
    try:
        pid = conn._protocol.backend_pid
        secret = conn._protocol.backend_secret & 0xFFFFFFFF  # (asyncpg keeps it signed)
        query = asyncio.create_task(conn.execute("select pg_sleep(10)"))
        for _ in range(250):  # (a cancel before the query runs would cancel nothing)
            if await running_sleep(pg):
                break
            await asyncio.sleep(0.02)
        _, writer = await asyncio.open_unix_connection(str(other / f".s.PGSQL.{port}"))
        writer.write(cancel_request(pid, secret))
        await writer.drain()
        writer.close()
        with pytest.raises(asyncpg.QueryCanceledError):
            await asyncio.wait_for(query, 5)
    finally:
        await conn.close()


def test_processes_share_a_port_and_forward_cancels(pg: DevCluster, wait_until) -> None:
    with contextlib.ExitStack() as stack:
        dirs = [stack.enter_context(bouncer_dir()) for _ in range(2)]
        bouncers = [Bouncer("scry", pg, d) for d in dirs]
        port = bouncers[1].port = bouncers[0].port
        peers = "".join(f"{n} = host={d} port={port}\n" for n, d in enumerate(dirs, 1))
        for n, bouncer in enumerate(bouncers, 1):
            bouncer.write_ini(f"so_reuseport = 1\npeer_id = {n}\n")
            bouncer.ini.write_text(bouncer.ini.read_text() + f"\n[peers]\n{peers}")
            bouncer.start()
            stack.callback(bouncer.stop)
            socket_file = bouncer.dir / f".s.PGSQL.{port}"
            wait_until(socket_file.exists, 10, what=f"process {n} listening")
        assert all(b.proc is not None and b.proc.poll() is None for b in bouncers)

        # The kernel spreads TCP connections over both processes.
        conns = [
            psycopg.connect(
                host="127.0.0.1",
                port=port,
                user="app",
                password="app_pass",
                dbname="app",
                sslmode="disable",
                autocommit=True,
            )  # fmt: skip
            for _ in range(16)
        ]
        for conn in conns:
            assert conn.execute("select 1").fetchone() == (1,)
        counts = [console_clients(d, port) for d in dirs]
        assert min(counts) > 0 and sum(counts) == 16, counts
        for conn in conns:
            conn.close()

        # A cancel sent to the other process reaches the query, both ways.
        asyncio.run(cancelled_through(pg, dirs[0], dirs[1], port))
        asyncio.run(cancelled_through(pg, dirs[1], dirs[0], port))
        for bouncer in bouncers:
            bouncer.stop()
            assert "Traceback" not in bouncer.output(), bouncer.output()
