"""Workers as a fleet: budgets divided across workers, and a worker killed under load.

The pure parts (shares, per-worker configs, the number of workers) need no
PostgreSQL; the rest runs ``scry serve`` with ``workers: 4``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from admin.schemas import API_PREFIX
from scry.config import load_config
from scry.devcluster import free_port
from scry.workers import resolve_workers, share, worker_config

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


# --- pure: shares and configs -------------------------------------------------------------


@pytest.mark.parametrize("total", [0, 1, 3, 4, 7, 8, 10, 20, 1000])
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 16])
def test_shares_add_up_to_the_total(total: int, workers: int) -> None:
    parts = [share(total, workers, i) for i in range(workers)]
    assert sum(parts) == total
    assert max(parts) - min(parts) <= 1
    assert parts == sorted(parts, reverse=True)  # the remainder goes to the lowest ids


def test_worker_config_divides_every_budget(tmp_path: Path) -> None:
    path = tmp_path / "scry.yaml"
    path.write_text(
        "database_url: postgresql://app@localhost/app\n"
        "pool: {size: 10, min_size: 3, reserve_size: 2, max_client_conn: 101,\n"
        "       max_user_connections: 6, max_db_client_connections: 9}\n"
        "databases:\n"
        "  big: {database_url: 'postgresql://app@localhost/big',\n"
        "        pool: {size: 9, max_db_connections: 5}}\n"
        "admin: {enabled: true}\n"
    )
    config = load_config(path, env={})
    shares = [worker_config(config, 4, i) for i in range(4)]
    assert [c.pool.size for c in shares] == [3, 3, 2, 2]
    assert [c.pool.min_size for c in shares] == [1, 1, 1, 0]
    assert [c.pool.reserve_size for c in shares] == [1, 1, 0, 0]
    assert sum(c.pool.max_client_conn for c in shares) == 101
    big = [c.targets()["big"].pool for c in shares]
    assert [p.size for p in big] == [3, 2, 2, 2]
    assert [p.max_db_connections for p in big] == [2, 1, 1, 1]
    assert [c.pool.max_user_connections for c in shares] == [2, 2, 1, 1]
    assert [c.pool.max_db_connections for c in shares] == [0, 0, 0, 0]  # no limit stays none
    assert [c.pool.max_db_client_connections for c in shares] == [3, 2, 2, 2]
    assert all(t.pool.min_size <= t.pool.size for c in shares for t in c.targets().values())
    assert [c.admin.enabled for c in shares] == [True, False, False, False]
    assert worker_config(config, 1, 0) is config


def test_resolve_workers(tmp_path: Path) -> None:
    path = tmp_path / "scry.yaml"
    path.write_text("database_url: postgresql://app@localhost/app\npool: {size: 3}\n")
    assert resolve_workers(load_config(path, env={}, overrides={"workers": 3})) == 3
    with pytest.raises(ValueError, match="pool.size 3"):
        resolve_workers(load_config(path, env={}, overrides={"workers": 4}))
    auto = resolve_workers(load_config(path, env={}, overrides={"workers": "auto"}))
    assert 1 <= auto <= min(3, os.cpu_count() or 1)
    limited = {"workers": 3, "pool": {"size": 3, "max_db_connections": 2}}
    with pytest.raises(ValueError, match="pool.max_db_connections 2"):
        resolve_workers(load_config(path, env={}, overrides=limited))


# --- helpers -------------------------------------------------------------------------------


def wait_workers(proxy, workers: int, wait_until) -> None:
    wait_until(
        lambda: len(set(re.findall(r"listening .*worker=(\d+)", proxy.log_text()))) >= workers,
        15,
        what=f"{workers} workers listening",
    )


def worker_pids(supervisor_pid: int) -> set[int]:
    path = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children")
    return {int(p) for p in path.read_text().split()}


@pytest.fixture
def with_admin_api(scry_proxy, wait_until):
    """``(workers) -> (proxy, client)``: that many workers listening, and a
    client of their admin API (worker 0's)."""
    clients: list[httpx.Client] = []

    def start(workers: int) -> tuple[Any, httpx.Client]:
        admin_port = free_port()
        admin = {"enabled": True, "listen_addr": f"127.0.0.1:{admin_port}", "token": "t0k"}
        proxy = scry_proxy({"workers": workers, "admin": admin})
        wait_workers(proxy, workers, wait_until)
        api = httpx.Client(
            base_url=f"http://127.0.0.1:{admin_port}{API_PREFIX}",
            headers={"Authorization": "Bearer t0k"},
            timeout=10,
        )
        clients.append(api)
        return proxy, api

    yield start
    for api in clients:
        api.close()


SERVERS_SQL = (
    "select count(*) from pg_stat_activity where usename = 'app'"
    " and backend_type = 'client backend' and backend_start >= to_timestamp(%s)"
)


class Sampler:
    """Polls pg_stat_activity for the proxy's server connections; keeps the peak.

    Only backends started after the proxy count: an earlier test's may still be ending.
    """

    def __init__(self, admin_dsn: str, since: float) -> None:
        self.admin_dsn = admin_dsn
        self.since = since
        self.peak = 0
        self.samples = 0

    async def run(self, stop: asyncio.Event) -> None:
        async with await psycopg.AsyncConnection.connect(self.admin_dsn, autocommit=True) as c:
            while not stop.is_set():
                row = await (await c.execute(SERVERS_SQL, (self.since,))).fetchone()
                assert row is not None
                self.peak = max(self.peak, int(row[0]))
                self.samples += 1
                await asyncio.sleep(0.01)


# --- budgets -------------------------------------------------------------------------------


def test_pool_size_is_a_fleet_budget(scry_proxy, admin_dsn, wait_until) -> None:
    """pool.size 8 over 4 workers with 200 clients: PostgreSQL never sees more than 8."""
    proxy = scry_proxy({"workers": 4, "pool": {"size": 8}, "timeouts": {"query_wait_timeout": 60}})
    wait_workers(proxy, 4, wait_until)

    async def run() -> Sampler:
        sampler = Sampler(admin_dsn, proxy.started_wall)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop))

        async def client() -> int:
            async with await psycopg.AsyncConnection.connect(
                **proxy.conninfo(), autocommit=True
            ) as conn:
                for _ in range(3):
                    await conn.execute("select pg_sleep(0.02)")
            return 3

        done = await asyncio.gather(*(client() for _ in range(200)))
        stop.set()
        await sampling
        assert sum(done) == 600
        return sampler

    sampler = asyncio.run(run())
    assert sampler.samples > 10
    assert 4 <= sampler.peak <= 8, sampler.peak


# --- a worker killed under load ---------------------------------------------------------------


def test_killed_worker_is_replaced(scry_proxy, admin_dsn, wait_until) -> None:
    """SIGKILL one of 4 workers under load: its clients are cut, the others go on,
    the supervisor starts a replacement, and no server connection is left behind."""
    proxy = scry_proxy({"workers": 4, "pool": {"size": 8}, "timeouts": {"query_wait_timeout": 30}})
    wait_workers(proxy, 4, wait_until)
    before = worker_pids(proxy.pid)
    assert len(before) == 4

    async def run() -> tuple[int, int, list[int], Sampler]:
        sampler = Sampler(admin_dsn, proxy.started_wall)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop))
        killed = asyncio.Event()
        cut = 0  # clients whose connection died with the worker
        after_kill = [0] * 40  # successful queries after the kill, per client

        async def client(n: int) -> None:
            nonlocal cut
            while not stop.is_set():
                try:
                    async with await psycopg.AsyncConnection.connect(
                        **proxy.conninfo(), autocommit=True
                    ) as conn:
                        while not stop.is_set():
                            await conn.execute("select 1")
                            if killed.is_set():
                                after_kill[n] += 1
                            await asyncio.sleep(0.005)
                except psycopg.OperationalError:
                    cut += 1
                    await asyncio.sleep(0.05)  # reconnect, as an application would

        clients = [asyncio.create_task(client(n)) for n in range(40)]
        await asyncio.sleep(1.5)
        victim = sorted(before)[1]
        os.kill(victim, signal.SIGKILL)
        killed.set()
        await asyncio.sleep(3)
        stop.set()
        await asyncio.gather(*clients)
        await sampling
        return victim, cut, after_kill, sampler

    victim, cut, after_kill, sampler = asyncio.run(run())
    assert cut >= 1  # the victim's clients were disconnected
    assert all(n > 0 for n in after_kill)  # everyone works again (others never stopped)
    assert sampler.peak <= 8
    wait_until(
        lambda: len(worker_pids(proxy.pid)) == 4 and victim not in worker_pids(proxy.pid),
        10,
        what="a replacement worker",
    )
    assert "worker died; restarting" in proxy.log_text()
    # No leak: the dead worker's backends went away with its sockets.
    deadline = time.monotonic() + 10
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(SERVERS_SQL, (proxy.started_wall,)).fetchone()
            assert row is not None
            if int(row[0]) <= 8:
                break
            assert time.monotonic() < deadline, f"{row[0]} server connections linger"
            time.sleep(0.1)


# --- shared breaker -----------------------------------------------------------------------


def test_breaker_open_on_one_worker_protects_all(with_admin_api, wait_until) -> None:
    """Worker 0 serves the admin API; a trip there opens every worker's breaker."""
    proxy, api = with_admin_api(4)

    def outcomes() -> list[str]:
        result = []
        for _ in range(20):  # fresh connections: the kernel spreads them over the workers
            try:
                with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
                    conn.execute("select 1")
                result.append("ok")
            except psycopg.Error as exc:
                result.append(getattr(exc, "sqlstate", None) or "error")
        return result

    assert set(outcomes()) == {"ok"}
    api.post("/breaker/trip", params={"database": "app"}).raise_for_status()
    wait_until(lambda: set(outcomes()) == {"57P03"}, 5, interval=0.1, what="every worker open")
    assert "worker 0: tripped via the admin API" in proxy.log_text()
    api.post("/breaker/reset", params={"database": "app"}).raise_for_status()
    wait_until(lambda: set(outcomes()) == {"ok"}, 5, interval=0.1, what="every worker closed")


def test_a_restarted_worker_is_paused_and_tripped_as_the_others(with_admin_api, wait_until) -> None:
    """A worker started again after a crash asks the others before it listens:
    paused, and with the breaker the operator holds open, not as the config says."""
    proxy, api = with_admin_api(2)
    api.post("/breaker/trip", params={"database": "app"}).raise_for_status()
    api.post("/pause", params={"wait": 2}).raise_for_status()
    victim = max(worker_pids(proxy.pid))  # (worker 0 serves the admin API: it stays)
    assert f"pid={victim} worker=1" in proxy.log_text()
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: len(re.findall(r"listening .*worker=1", proxy.log_text())) == 2,
        15,
        what="worker 1 started again",
    )
    lines = proxy.log_text().splitlines()
    took = [i for i, line in enumerate(lines) if "took the instance's state" in line]
    listening = [i for i, line in enumerate(lines) if re.search("listening .*worker=1", line)]
    assert len(took) == 1 and listening[0] < took[0] < listening[1]  # before it listened
    assert "paused=['*'] breakers_held=['app'] worker=1" in lines[took[0]]

    def worker_1(view: str) -> dict:
        answer = api.get(f"/{view}", params={"worker": 1})
        answer.raise_for_status()
        return answer.json()

    assert worker_1("status")["paused"] is True
    (app,) = [d for d in worker_1("breaker")["databases"] if d["database"] == "app"]
    assert (app["breaker"]["state"], app["breaker"]["held"]) == ("open", True)
    # Resumed and reset on every worker, the restarted one included.
    api.post("/resume").raise_for_status()
    api.post("/breaker/reset", params={"database": "app"}).raise_for_status()
    # (A status is reused for up to STATUS_TTL: poll until a fresh one says so.)
    wait_until(lambda: worker_1("status")["paused"] is False, 5, what="worker 1 resumed")
    for _ in range(10):  # fresh connections: the kernel spreads them over the workers
        with psycopg.connect(**proxy.conninfo(), autocommit=True) as conn:
            assert conn.execute("select 1").fetchone() == (1,)


def test_supervisor_forwards_sighup_and_sigterm(scry_proxy, wait_until) -> None:
    """SIGHUP reaches every worker (each reloads its share); SIGTERM drains them all."""
    proxy = scry_proxy({"workers": 2, "pool": {"size": 4}})
    wait_workers(proxy, 2, wait_until)
    workers = worker_pids(proxy.pid)
    proxy.update_config({"pool": {"size": 6}})
    proxy.send_signal(signal.SIGHUP)
    wait_until(
        lambda: len(re.findall(r"config reloaded .*worker=\d", proxy.log_text())) == 2,
        10,
        what="both workers reloaded",
    )
    with psycopg.connect(**proxy.conninfo()) as conn:
        assert conn.execute("select 1").fetchone() == (1,)
    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(15) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
    assert proxy.log_text().count("worker exited") == 2
